"""Migration primitives: export and import of a sandbox's disk and memory."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from dsec.contract.runtime import Handle, MemoryStateful, SandboxSpec, capabilities_of
from dsec.edge.abilities.forks import ForkVerbs
from dsec.errors import CapabilityNotSupported, DsecError, InvalidRequest, SandboxError
from dsec.models import (
    CreateSandboxRequest,
    MigrateRequest,
    MigrateResult,
    SandboxInfo,
    SnapshotRequest,
)

log = logging.getLogger("dsec.edge")


class MigrationVerbs(ForkVerbs):
    """Migration primitives: export and import of a sandbox's disk and memory."""

    # --- migration primitives (cluster mode: dsec.cluster.migrate moves sandboxes) ---
    async def export_sandbox(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """Capture what a migration needs to recreate ``sandbox_id`` on another node: its
        create request, its image's layer digests and a ``pack_diff`` layer of its writable
        layer (the default snapshot scrub applies). The sandbox keeps running; processes are
        not captured. Raises ``CapabilityNotSupported`` for tiers that cannot snapshot."""
        lv = self._live_for(sandbox_id, owner)
        layer = await self._use(sandbox_id, owner, lambda lv: self._snapshot(lv, SnapshotRequest()))
        return {
            "request": lv.row.request.model_dump(mode="json"),
            "image_layers": list(lv.row.image_layers),
            "diff_layer": layer,
            "method": "pack_diff",
        }

    async def import_sandbox(
        self, request: dict[str, Any], owner: str, image_layers: list[str], diff_layer: str
    ) -> SandboxInfo:
        """Create a sandbox from an :meth:`export_sandbox` of another node (its layers must
        already be in this node's store): same request, the image's layers by digest, the
        exported diff on top. Admission applies as for any creation (``QuotaExceeded``)."""
        self.layers.grant_layers(owner, [*image_layers, diff_layer])  # moved here with it
        req = self._migrated_request(request, image_layers, [diff_layer], owner)
        return await self.create_sandbox(req, owner)

    # --- VM migration by memory state (cluster mode: dsec.cluster.migrate moves the files) ---
    def _memory_runtime(self, tier: str) -> MemoryStateful:
        """The runtime of ``tier`` if it can capture and load memory state, else
        ``CapabilityNotSupported``."""
        rt = self._runtime(tier)
        if not isinstance(rt, MemoryStateful):
            raise CapabilityNotSupported(
                f"the {tier} tier on node {self.node} has no memory snapshots", tier=tier
            )
        return rt

    async def export_memory(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """Capture what a migration needs to continue ``sandbox_id`` (a VM tier) on another
        node *with its processes*: its create request, its layers' digests and a portable
        memory snapshot (every RAM page + device state; the vm tier's disk without backing
        file) in a directory of this node. The sandbox keeps running (its vCPUs stop for
        the time of the write; a paused or suspended one is resumed first).

        Returns ``request``, ``image_layers``, ``tier``, ``sandbox_id``, ``source`` (the
        machine: vCPUs, memory, disk, accelerator, template key, layer paths here),
        ``guest_ram_mb``, ``files`` (file name -> bytes), ``state_bytes`` (their sum) and
        ``snapshot`` (this node's handle on the files: keep it here, delete it with
        :meth:`drop_memory_export`). Raises ``CapabilityNotSupported`` for other tiers."""
        lv = self._live_for(sandbox_id, owner)
        tier = lv.row.tier
        rt = self._memory_runtime(tier)
        snap = await self._use(
            sandbox_id, owner, lambda lv: rt.memory_snapshot(lv.handle, portable=True)
        )

        def sizes() -> dict[str, int]:
            return {p.name: p.stat().st_size for p in sorted(snap.dir.iterdir()) if p.is_file()}

        files = await asyncio.to_thread(sizes)
        source = dict(snap.source)
        return {
            "method": "memory_snapshot",
            "sandbox_id": sandbox_id,
            "tier": tier,
            "request": lv.row.request.model_dump(mode="json"),
            "image_layers": list(lv.row.image_layers),
            "source": source,
            "guest_ram_mb": int(rt.guest_ram_mb(int(source["memory_mb"]))),
            "files": files,
            "state_bytes": sum(files.values()),
            "snapshot": snap,
        }

    async def drop_memory_export(self, tier: str, snapshot: Any) -> None:
        """Delete the files of an :meth:`export_memory` capture (idempotent)."""
        await self._memory_runtime(tier).drop_memory_snapshot(snapshot)

    def _migrated_request(
        self, request: dict[str, Any], image_layers: list[str], extra: list[str], owner: str
    ) -> CreateSandboxRequest:
        """``request`` of another node's sandbox, its layers named so that this node
        resolves the same digests in the same order (the image name when it means the same
        layers here, else every layer by digest), plus ``extra`` layers on top."""
        base = CreateSandboxRequest.model_validate(request)
        if not image_layers:
            raise InvalidRequest("an exported sandbox needs its image layers")
        try:
            image = list(self.layers.get_image(base.image, owner).layers)
        except DsecError:
            image = []
        same_image = bool(image) and image_layers[: len(image)] == image
        head = base.image if same_image else image_layers[0]
        rest = image_layers[len(image) :] if same_image else image_layers[1:]
        return base.model_copy(update={"image": head, "layers": [*rest, *extra]})

    async def check_memory_import(self, export: dict[str, Any]) -> None:
        """Refuse, before any byte moves, an :meth:`export_memory` capture this node cannot
        load: tier without memory snapshots (``CapabilityNotSupported``), another
        accelerator or guest RAM size (``CapabilityNotSupported``), no room
        (``QuotaExceeded``)."""
        tier = str(export["tier"])
        rt = self._memory_runtime(tier)
        source = export["source"]
        accel = rt.accel
        if source.get("accel") != accel:
            raise CapabilityNotSupported(
                f"the sandbox runs under {source.get('accel')} and node {self.node} under "
                f"{accel}: a memory state does not load across accelerators",
                tier=tier,
            )
        ram_mb = int(rt.guest_ram_mb(int(source["memory_mb"])))
        if ram_mb != int(export["guest_ram_mb"]):
            raise CapabilityNotSupported(
                f"node {self.node} gives this sandbox {ram_mb} MiB of guest RAM, its source "
                f"{export['guest_ram_mb']} MiB: the memory state does not fit",
                tier=tier,
            )
        self._check_admission(  # the node's room only: a move adds nothing to its key
            CreateSandboxRequest.model_validate(export["request"]),
            capabilities_of(self._runtime(tier)),
            owner="",
        )

    async def import_memory(self, export: dict[str, Any], owner: str, staged: str) -> SandboxInfo:
        """Continue another node's :meth:`export_memory` capture here: its files are in the
        directory ``staged`` of this node, its layers in this node's store. A new sandbox
        (new id) with the same request resumes the guest where the capture left it: same
        processes and memory; its clock is set and RNG reseeded, its hostname is the new
        id's. Admission applies as for any creation. ``staged`` is left for the caller to
        delete; nothing else stays behind on failure."""
        from dsec.runtimes.microvm.runtime import MemorySnapshot

        tier = str(export["tier"])
        rt = self._memory_runtime(tier)
        source = dict(export["source"])
        self.layers.grant_layers(owner, list(export["image_layers"]))  # moved here with it
        req = self._migrated_request(export["request"], list(export["image_layers"]), [], owner)
        d = Path(staged)

        async def resume_here(spec: SandboxSpec) -> Handle:
            if len(spec.layer_paths) != len(source.get("layer_paths") or []):
                raise SandboxError(
                    f"the sandbox had {len(source.get('layer_paths') or [])} layer disks, its "
                    f"request resolves to {len(spec.layer_paths)} here",
                    sandbox_id=spec.id,
                )
            snap = MemorySnapshot(
                dir=d,
                state=d / "state",
                state_bytes=int(export["state_bytes"]),
                parent_id=str(export["sandbox_id"]),
                # the same devices in the same order, now this node's layer files
                source={**source, "layer_paths": list(spec.layer_paths)},
                ram_backing=None,  # a portable capture: every page is in the stream
            )
            handle: Handle = await rt.create_from_memory(snap, spec)
            return handle

        return await self.create_sandbox(req, owner, maker=resume_here)

    async def migrate_sandbox(self, req: MigrateRequest, owner: str) -> MigrateResult:
        """Migration moves a sandbox between nodes: only a cluster (``dsec serve
        --cluster``) has another node. Raises ``CapabilityNotSupported`` here."""
        self._lookup_row(req.sandbox_id, owner)
        raise CapabilityNotSupported(
            "migration needs cluster mode (dsec serve --cluster): this server has one node",
            node=self.node,
        )
