"""Pause and resume, snapshots and forks (shared, packed and memory forks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from dsec.contract.runtime import (
    Handle,
    MemoryStateful,
    Snapshottable,
    UpperForkable,
    capabilities_of,
)
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.edge.abilities.sandboxes import SandboxVerbs
from dsec.edge.core import LiveSandbox, json_dump
from dsec.errors import CapabilityNotSupported, InvalidRequest, SandboxStopped
from dsec.models import (
    CreateSandboxRequest,
    ForkRequest,
    ForkResult,
    LayerInfo,
    SandboxInfo,
    SandboxRef,
    SandboxSnapshotRequest,
    SnapshotRequest,
)

log = logging.getLogger("dsec.edge")


class ForkVerbs(SandboxVerbs):
    """Pause and resume, snapshots and forks (shared, packed and memory forks)."""

    # ------------------------------------------------------------------ pause, snapshot, fork

    async def _snapshot(self, lv: LiveSandbox, req: SnapshotRequest) -> LayerInfo:
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Snapshottable):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot snapshot sandboxes", tier=lv.row.tier
            )
        meta = {
            "parents": list(lv.row.image_layers),
            "sandbox_id": lv.row.id,
            "image": lv.row.request.image,
        }
        async with lv.lock:
            layer = await rt.snapshot(lv.handle, self.layers, req, meta)
        self.layers.grant_layers(lv.row.owner, [layer.digest])
        if req.name:
            # a sandbox made from the snapshot starts as this one's user, in its directory
            config = {
                k: v
                for k, v in (
                    ("User", lv.row.request.user),
                    ("WorkingDir", lv.row.request.workdir),
                )
                if v and v != "/"
            }
            await asyncio.to_thread(
                self.layers.put_image,
                req.name,
                [*lv.row.image_layers, layer.digest],
                meta={"snapshot_of": lv.row.id, **({"config": config} if config else {})},
                owner=lv.row.owner,
            )
        return layer

    async def snapshot_sandbox(
        self, req: SandboxSnapshotRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> LayerInfo:
        # the trajectory records what was asked of the sandbox, not its id (a replay into
        # another sandbox asks the same)
        asked = req.model_dump(mode="json", exclude={"sandbox_id"})

        async def run(lv: LiveSandbox) -> LayerInfo:
            return await self._logged(
                lv,
                "snapshot",
                asked,
                env,
                lambda: self._snapshot(lv, req),
                json_dump,
                LayerInfo.model_validate,
            )

        return await self._use(req.sandbox_id, owner, run)

    async def fork_sandbox(self, req: ForkRequest, owner: str) -> ForkResult:
        """``req.n`` new sandboxes from this one's files (see :class:`ForkRequest` for the
        methods), made concurrently; if any fails, none is left."""
        sandbox_id = req.sandbox_id
        lv = self._live_for(sandbox_id, owner)
        base = lv.row.request
        rt = self._runtime(base.tier)
        shared = req.method == "shared" or (
            req.method == "auto" and not req.scrub and req.parent != "keep"
        )
        if req.method == "shared" and req.scrub:
            raise InvalidRequest("a shared fork keeps every file: scrub needs method=pack")
        if req.method == "shared" and req.parent == "keep":
            raise InvalidRequest(
                "a shared fork gives the parent's writable layer to the children: "
                "parent=pause or parent=continue (parent=keep needs method=pack)"
            )
        if shared and not req.memory and not isinstance(rt, UpperForkable):
            if req.method == "shared":
                raise CapabilityNotSupported(
                    f"tier {base.tier} cannot share a frozen writable layer (use method=pack)",
                    tier=base.tier,
                )
            shared = False
        # admission for all n first, so a fork that cannot fit creates nothing
        self._check_admission(base, capabilities_of(rt), owner, count=req.n)
        if req.memory:
            return await self._fork_memory(sandbox_id, owner, base, req)
        if shared and isinstance(rt, UpperForkable):
            return await self._fork_shared(lv, owner, base, req, rt)
        layer = await self._use(
            sandbox_id, owner, lambda lv: self._snapshot(lv, SnapshotRequest(scrub=req.scrub))
        )
        child_req = base.model_copy(
            update={
                "layers": [*base.layers, layer.digest],
                "labels": {**base.labels, **req.labels},
            }
        )
        created = await self._create_all(
            req.n, owner, lambda: self.create_sandbox(child_req, owner, forked_from=sandbox_id)
        )
        return ForkResult(layer=layer, sandboxes=created, method="pack")

    async def _create_all(
        self, n: int, owner: str, make: Callable[[], Awaitable[SandboxInfo]]
    ) -> list[SandboxInfo]:
        """``n`` creations at once; if any fails, the others are killed and its error raised."""
        results = await asyncio.gather(*(make() for _ in range(n)), return_exceptions=True)
        created = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for info in created:  # nothing half-done: undo the ones made
                with contextlib.suppress(Exception):
                    await self.kill_sandbox(SandboxRef(sandbox_id=info.id), owner)
            raise failed[0]
        return created

    async def _fork_shared(
        self,
        lv: LiveSandbox,
        owner: str,
        base: CreateSandboxRequest,
        req: ForkRequest,
        rt: UpperForkable,
    ) -> ForkResult:
        """Children stacked on the parent's frozen writable layer (O(1) in its size)."""
        async with lv.lock:
            if lv.row.state not in ("running", "paused"):
                raise SandboxStopped(f"sandbox {lv.row.id} is {lv.row.state}", sandbox_id=lv.row.id)
            await rt.freeze_upper(lv.handle)
            now = time.time()
            if lv.row.state == "running":
                lv.row.state = "paused"
                lv.row.paused_at = now
                self.metrics.pauses.labels(lv.row.tier).inc()
            self.registry.set_state(lv.row.id, "paused", handle=lv.handle.state)
            self.registry.set_paused(lv.row.id, lv.row.paused_at or now)
            # the children read the frozen layers from this copy: the parent may restart
            # (and its handle change) while they are made
            parent = Handle(lv.handle.id, dict(lv.handle.state))
        child_req = base.model_copy(update={"labels": {**base.labels, **req.labels}})

        def make() -> Awaitable[SandboxInfo]:
            return self.create_sandbox(
                child_req,
                owner,
                maker=lambda spec: rt.create_forked(parent, spec),
                forked_from=lv.row.id,
            )

        children = self._create_all(req.n, owner, make)
        if req.parent == "continue":
            restarted, created = await asyncio.gather(
                self._restart_frozen(lv, rt), children, return_exceptions=True
            )
            if isinstance(created, BaseException):
                raise created
            if isinstance(restarted, BaseException):  # the children stand on their own
                log.warning("fork of %s: the parent did not restart: %s", lv.row.id, restarted)
        else:
            created = await children
        return ForkResult(layer=None, sandboxes=created, method="shared")

    async def _fork_memory(
        self, sandbox_id: str, owner: str, base: CreateSandboxRequest, req: ForkRequest
    ) -> ForkResult:
        """n sandboxes resuming one capture of this sandbox's memory (VM tiers)."""
        rt = self._runtime(base.tier)
        if not isinstance(rt, MemoryStateful):
            raise CapabilityNotSupported(
                f"tier {base.tier} cannot fork from memory (use memory=false)", tier=base.tier
            )
        snap = await self._use(sandbox_id, owner, lambda lv: rt.memory_snapshot(lv.handle))
        child_req = base.model_copy(update={"labels": {**base.labels, **req.labels}})
        try:
            # all at once: each child's restore waits mostly on its QEMU (its incoming
            # migration, the guest agent's answer), not on the edge; one after another,
            # fork(n) took n restores end to end
            created = await self._create_all(
                req.n,
                owner,
                lambda: self.create_sandbox(
                    child_req,
                    owner,
                    maker=lambda spec: rt.create_from_memory(snap, spec),
                    forked_from=sandbox_id,
                ),
            )
        finally:
            await rt.drop_memory_snapshot(snap)
        return ForkResult(layer=None, sandboxes=created, method="memory")
