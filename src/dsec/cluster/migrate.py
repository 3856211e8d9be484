"""Sandbox migration between the nodes of a cluster.

The method follows the tier: ``memory_snapshot`` for the VM tiers (``microvm``, ``vm``)
whose runtime captures memory state, ``pack_diff`` for the others (containers).

Both start by checking everything that can be checked before touching anything: the
sandbox is live, the target node exists, is alive, serves the tier and (in the placer's
view) admits the sandbox; with no target given, the placer picks one (never the source).
Both end the same way: only once the new sandbox runs is the source killed. A failure
before that leaves the source running and nothing half-created on the target (moved
layers stay in the target's store: they are content-addressed cache, not sandbox state).
The new sandbox has a new id (``sb-<target>-...``) and a fresh trajectory log; the move
is recorded in PostgreSQL (``dsec_migrations``).

Method ``memory_snapshot`` (``processes_carried=true``):

1. the source edge captures the running VM (``EdgeAgent.export_memory``): QMP ``stop``,
   every RAM page + device state to a file (a *portable* capture: not a difference from
   the node's template RAM file, which is another file on every node), on the vm tier a
   copy of the writable disk with its backing chain folded in; then ``cont``. The source
   keeps running (its vCPUs stop only for the write: ~0.3-1 s under TCG);
2. the target edge checks that it can load it (``prepare_import``: tier with memory
   snapshots, same accelerator, same guest RAM size, room by its own admission) before
   any byte moves;
3. layer files the target lacks move as in ``pack_diff`` (below), then the capture's files
   in chunks of :data:`CHUNK_BYTES`: each chunk is the object of one source call
   (``read_export_chunk``) whose reference is handed to the target (``write_import_chunk``),
   :data:`WINDOW` chunks in flight: the bytes go node to node through the Ray object store,
   never through the apiserver, and no node holds more than a few chunks in memory;
4. the target starts a QEMU with the same devices in the same order (its own paths for
   the same layer digests), private RAM, ``-incoming defer``, loads the state and
   continues the guest (``finish_import`` -> ``EdgeAgent.import_memory``): the same
   processes (same pids in the guest), memory, tmpfs files and, on the vm tier, disk. The
   guest clock is set and the RNG reseeded as after any restore; the hostname becomes the
   new id's;
5. the source is killed; the capture is deleted on the source whatever the outcome, the
   staging files on the target too.

What the source does between step 1 and its kill (writes, output, network traffic) is
not carried, and for the time between the target's start and the source's kill both
copies run. Nodes must run the same QEMU (a state from another QEMU version fails to load:
``SandboxError``, the source keeps running). Measured on this host (TCG, 3 Ray nodes on one
machine): see docs/design/cluster.md.

Method ``pack_diff`` (``processes_carried=false``; containers):

1. the source edge packs the writable layer into a content-addressed layer
   (``EdgeAgent.export_sandbox``; the default snapshot scrub applies: ``/tmp``, shell
   histories and package caches are not carried); the sandbox keeps running;
2. layer files the target lacks move node to node through the Ray object store (the
   source's ``read_layer`` result is handed to the target's ``put_layer`` as an object
   reference: the bytes never pass through the apiserver); with a shared layer directory
   nothing moves;
3. the target edge creates the same spec on top of the moved layer
   (``EdgeAgent.import_sandbox``; its admission applies: a full target raises
   ``QuotaExceeded`` and, when no node was named, the next candidate is tried);
4. the source is killed.

Processes are not carried by ``pack_diff``: CRIU cannot run on this kernel (see
MACHINE.md), so the new sandbox starts with the files but no running programs. Writes
made between step 1 and step 4 are not carried either. A VM tier whose runtime has
neither memory snapshots nor disk snapshots raises ``CapabilityNotSupported``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InternalError,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    SandboxStopped,
    TierUnavailable,
)
from dsec.models import (
    CapabilityList,
    CreateSandboxRequest,
    LayerInfo,
    MigrateResult,
    SandboxInfo,
    SandboxRef,
)
from dsec.tiers import tier_has

if TYPE_CHECKING:
    from dsec.cluster.relay import ClusterPlacement, NodeRelay

Record = Callable[[str, SandboxInfo], Awaitable[None]]
"""Writes an (owner, sandbox) to the cluster's registry."""

__all__ = ["CHUNK_BYTES", "WINDOW", "migrate_sandbox"]

log = logging.getLogger("dsec.cluster.migrate")

CHUNK_BYTES = 8 << 20
"""Bytes per object of a memory capture's transfer (Ray's test nodes have 150 MiB stores)."""
WINDOW = 4
"""Chunks in flight at once during a memory capture's transfer."""


def _targets(
    relay: NodeRelay,
    placement: ClusterPlacement,
    info: SandboxInfo,
    req: CreateSandboxRequest,
    target: str | None,
) -> list[str]:
    """Target nodes to try, in order (checked before anything is created)."""
    source = info.node
    preq = placement.request(req)
    if target is None:
        try:
            return placement.candidates(preq, exclude={source})
        except TierUnavailable as e:
            raise QuotaExceeded(
                f"no other node can take sandbox {info.id}: {e.message}", sandbox_id=info.id
            ) from None
    if target == source:
        raise InvalidRequest(f"sandbox {info.id} is already on node {target}", node=target)
    h = relay.nodes.get(target)
    if h is None:
        raise NotFound(f"unknown node {target!r}", node=target)
    if h.state != "alive":
        raise NotFound(f"node {target!r} was lost ({h.lost_reason})", node=target)
    try:
        load = placement.placer.node(target)
    except NotFound:
        raise TierUnavailable(
            f"node {target} has not reported yet or serves no tier", node=target
        ) from None
    if req.tier not in load.tiers:
        raise TierUnavailable(
            f"node {target} does not offer the {req.tier} tier", node=target, tier=req.tier
        )
    if not placement.placer.admits(target, preq):
        raise QuotaExceeded(f"node {target} is full for this sandbox", node=target)
    return [target]


async def migrate_sandbox(
    relay: NodeRelay,
    placement: ClusterPlacement,
    sandbox_id: str,
    owner: str,
    target: str | None,
    *,
    record: Record,
) -> MigrateResult:
    """Move ``sandbox_id`` to ``target`` (or a placer-chosen node); see the module docstring.
    ``relay`` reaches the nodes, ``placement`` picks and reserves the target, ``record``
    writes the new and the killed sandbox to the registry.

    Raises:
        SandboxNotFound / NodeLost: no such sandbox for ``owner``, or its node was lost.
        SandboxStopped: the sandbox is not running or paused.
        NotFound: ``target`` is not a live node of the cluster.
        InvalidRequest: ``target`` is the sandbox's own node.
        TierUnavailable: ``target`` does not offer the sandbox's tier.
        QuotaExceeded: the target (or, with no target, every other node) is full.
        CapabilityNotSupported: the tier can neither capture its memory nor pack its
            writable layer, or (memory_snapshot) the target cannot load the capture
            (another accelerator or guest RAM size).
        SandboxError: (memory_snapshot) the target failed to load the capture.
    """
    t0 = time.perf_counter()
    ref = SandboxRef(sandbox_id=sandbox_id)
    info: SandboxInfo = await relay.on_sandbox(
        sandbox_id, "get_sandbox", ref, owner, route_only=True
    )
    if info.state not in ("running", "paused"):
        raise SandboxStopped(f"sandbox {sandbox_id} is {info.state}", sandbox_id=sandbox_id)
    source = info.node
    base = CreateSandboxRequest(
        tier=info.tier,
        image=info.image,
        cpu=info.cpu,
        memory_mb=info.memory_mb or 512,
        disk_mb=info.disk_mb or 1024,
    )
    candidates = _targets(relay, placement, info, base, target)
    method: Literal["pack_diff", "memory_snapshot"] = "pack_diff"
    if tier_has(info.tier, lambda t: t.guest_kernel):
        listed: CapabilityList = await relay.call(source, "capabilities")
        caps = {c.tier: c for c in listed.tiers}
        tier_caps = caps.get(info.tier)
        if tier_caps is not None and tier_caps.memory_fork:
            method = "memory_snapshot"
        elif tier_caps is None or not tier_caps.snapshot:
            raise CapabilityNotSupported(
                f"the {info.tier} tier here can neither capture its memory nor pack its "
                "disk, so it cannot migrate",
                tier=info.tier,
            )
    mig_id = None
    if relay.state is not None:
        mig_id = await asyncio.to_thread(
            relay.state.begin_migration, owner, sandbox_id, source, method
        )
    explicit = target is not None
    state_bytes = 0
    try:
        if method == "memory_snapshot":
            new, moved_bytes, state_bytes = await _move_memory(
                relay, placement, record, info, owner, candidates, explicit=explicit
            )
        else:
            new, moved_bytes = await _move(
                relay, placement, record, info, owner, candidates, explicit=explicit
            )
    except BaseException as e:
        if mig_id is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    relay.state.end_migration,
                    mig_id,
                    to_id=None,
                    to_node=None,
                    error=str(e)[:500] or type(e).__name__,
                )
        raise
    # the target is up: now the source goes
    try:
        killed: SandboxInfo = await relay.on_sandbox(
            sandbox_id, "kill_sandbox", ref, owner, route_only=True
        )
        await record(owner, killed)
        if relay.state is not None:
            await asyncio.to_thread(
                relay.state.mark_stopped, sandbox_id, f"migrated to {new.id} on node {new.node}"
            )
    except DsecError as e:  # the copy runs; the old one is reported, not hidden
        log.error("migration of %s: source kill failed: %s", sandbox_id, e.message)
    if mig_id is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                relay.state.end_migration, mig_id, to_id=new.id, to_node=new.node
            )
    return MigrateResult(
        sandbox=new,
        from_id=sandbox_id,
        from_node=source,
        to_node=new.node,
        method=method,
        processes_carried=method == "memory_snapshot",
        layer_bytes=moved_bytes,
        state_bytes=state_bytes,
        duration_ms=(time.perf_counter() - t0) * 1000,
    )


def _none_admits(info: SandboxInfo) -> Callable[[DsecError | None], DsecError]:
    """The error of a migration that no candidate admitted: the last refusal, if any."""

    def error(last: DsecError | None) -> DsecError:
        return last or QuotaExceeded(f"no node admits sandbox {info.id}", sandbox_id=info.id)

    return error


async def _move(
    relay: NodeRelay,
    placement: ClusterPlacement,
    record: Record,
    info: SandboxInfo,
    owner: str,
    candidates: list[str],
    *,
    explicit: bool,
) -> tuple[SandboxInfo, int]:
    source = info.node
    export: dict[str, Any] = await relay.call(
        source,
        "export_sandbox",
        info.id,
        owner,
        timeout=relay.options.create_timeout_s,
        sandbox_id=info.id,
    )
    diff: LayerInfo = export["diff_layer"]
    digests = [*export["image_layers"], diff.digest]

    async def attempt(node: str) -> tuple[SandboxInfo, int]:
        moved = await move_layers(relay, source, node, digests)
        new: SandboxInfo = await relay.call(
            node,
            "import_sandbox",
            export["request"],
            owner,
            export["image_layers"],
            diff.digest,
            timeout=relay.options.create_timeout_s,
        )
        return new, moved

    req = CreateSandboxRequest.model_validate(export["request"])
    return await placement.first_admitting(
        candidates,
        placement.request(req),
        attempt,
        explicit=explicit,
        none_admits=_none_admits(info),
        admitted=lambda new: record(owner, new),
    )


async def move_layers(relay: NodeRelay, source: str, target: str, digests: list[str]) -> int:
    """Copy the layers ``target`` lacks from ``source``, node to node; returns bytes moved."""
    timeout = relay.options.create_timeout_s
    missing: list[str] = await relay.actor_call(target, "missing_layers", digests, timeout=timeout)
    moved = 0
    for digest in missing:  # the blob stays in the object store on its way
        layer: LayerInfo = await relay.pipe(
            source, target, ("read_layer", (digest,)), ("put_layer", ()), timeout
        )
        moved += int(layer.size or 0)
    return moved


async def _move_memory(
    relay: NodeRelay,
    placement: ClusterPlacement,
    record: Record,
    info: SandboxInfo,
    owner: str,
    candidates: list[str],
    *,
    explicit: bool,
) -> tuple[SandboxInfo, int, int]:
    """The ``memory_snapshot`` move (module docstring, steps 1-4). Returns (the new
    sandbox, layer bytes moved, capture bytes moved)."""
    source = info.node
    timeout = relay.options.create_timeout_s
    t0 = time.perf_counter()
    export: dict[str, Any] = await relay.actor_call(
        source, "export_memory", info.id, owner, timeout=timeout, sandbox_id=info.id
    )
    t_export = time.perf_counter()

    async def attempt(node: str) -> tuple[SandboxInfo, tuple[int, int]]:
        import_id: str = await relay.actor_call(node, "prepare_import", export)
        try:
            layer_bytes = await move_layers(relay, source, node, list(export["image_layers"]))
            t_moved = time.perf_counter()
            state_bytes = await _move_files(
                relay, source, node, export["export_id"], import_id, export["files"]
            )
            t_state = time.perf_counter()
            new: SandboxInfo = await relay.actor_call(
                node, "finish_import", import_id, owner, timeout=timeout
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await relay.actor_call(node, "abort_import", import_id)
            raise
        log.info(
            "memory migration %s -> %s (%s -> %s): capture %.2f s, %d state bytes in "
            "%.2f s, resume %.2f s",
            info.id,
            new.id,
            source,
            node,
            t_export - t0,
            state_bytes,
            t_state - t_moved,
            time.perf_counter() - t_state,
        )
        return new, (layer_bytes, state_bytes)

    try:
        req = CreateSandboxRequest.model_validate(export["request"])
        new, (layer_bytes, state_bytes) = await placement.first_admitting(
            candidates,
            placement.request(req),
            attempt,
            explicit=explicit,
            refusals=(QuotaExceeded, CapabilityNotSupported),
            none_admits=_none_admits(info),
            admitted=lambda new: record(owner, new),
        )
        return new, layer_bytes, state_bytes
    finally:
        with contextlib.suppress(Exception):
            await relay.actor_call(source, "drop_export", export["export_id"])


async def _move_files(
    relay: NodeRelay,
    source: str,
    target: str,
    export_id: str,
    import_id: str,
    files: dict[str, int],
) -> int:
    """Copy a capture's files from ``source`` to ``target`` in :data:`CHUNK_BYTES` objects,
    :data:`WINDOW` at a time, node to node; returns the bytes moved."""
    timeout = relay.options.call_timeout_s
    chunks = [
        (name, offset, min(CHUNK_BYTES, size - offset))
        for name, size in sorted(files.items())
        for offset in range(0, int(size), CHUNK_BYTES)
    ]

    async def one(name: str, offset: int, length: int) -> int:
        written = await relay.pipe(
            source,
            target,
            ("read_export_chunk", (export_id, name, offset, length)),
            ("write_import_chunk", (import_id, name, offset)),
            timeout,
        )
        if int(written) != length:
            raise InternalError(f"{name}: {written} of {length} bytes written at {offset}")
        return length

    moved = 0
    in_flight: set[asyncio.Task[int]] = set()
    try:
        for chunk in chunks:
            if len(in_flight) >= WINDOW:
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                moved += sum(t.result() for t in done)
            in_flight.add(asyncio.create_task(one(*chunk)))
        if in_flight:
            done, in_flight = await asyncio.wait(in_flight)
            moved += sum(t.result() for t in done)
    finally:
        for t in in_flight:
            t.cancel()
        for t in in_flight:
            with contextlib.suppress(BaseException):
                await t
    return moved
