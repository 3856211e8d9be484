"""Sandbox migration between the nodes of a cluster.

Method ``pack_diff`` (every tier whose runtime can snapshot its writable layer; the
container tier here):

1. check everything that can be checked before touching anything: the sandbox is live,
   the target node exists, is alive, serves the tier and (in the placer's view) admits
   the sandbox; with no target given, the placer picks one (never the source);
2. the source edge packs the writable layer into a content-addressed layer
   (``EdgeAgent.export_sandbox``; the default snapshot scrub applies: ``/tmp``, shell
   histories and package caches are not carried); the sandbox keeps running;
3. layer files the target lacks move node to node through the Ray object store (the
   source's ``read_layer`` result is handed to the target's ``put_layer`` as an object
   reference: the bytes never pass through the apiserver); with a shared layer directory
   nothing moves;
4. the target edge creates the same spec on top of the moved layer
   (``EdgeAgent.import_sandbox``; its admission applies: a full target raises
   ``QuotaExceeded`` and, when no node was named, the next candidate is tried);
5. only once the new sandbox runs is the source killed. A failure before that leaves the
   source untouched and nothing half-created (moved layers stay in the target's store:
   they are content-addressed cache, not sandbox state).

Processes are not carried (``processes_carried=false``): CRIU cannot run on this kernel
(see MACHINE.md), so the new sandbox starts with the files but no running programs.
Writes made between step 2 and step 5 are not carried either. The new sandbox has a new
id (``sb-<target>-...``) and a fresh trajectory log; the migration is recorded in
PostgreSQL (``dsec_migrations``).

VM tiers (``microvm``, ``vm``): the same ``pack_diff`` path when their runtime supports
snapshots, else ``CapabilityNotSupported``; memory snapshots (``memory_snapshot``) are not
moved between nodes yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    SandboxStopped,
    TierUnavailable,
    error_from_wire,
)
from dsec.models import CreateSandboxRequest, LayerInfo, MigrateResult, SandboxInfo

if TYPE_CHECKING:
    from dsec.cluster.edge import ClusterEdge

__all__ = ["migrate_sandbox"]

log = logging.getLogger("dsec.cluster.migrate")


def _targets(
    edge: ClusterEdge, info: SandboxInfo, req: CreateSandboxRequest, target: str | None
) -> list[str]:
    """Target nodes to try, in order (checked before anything is created)."""
    source = info.node
    preq = edge._placement_request(req)
    if target is None:
        try:
            return edge.candidates(preq, exclude={source})
        except TierUnavailable as e:
            raise QuotaExceeded(
                f"no other node can take sandbox {info.id}: {e.message}", sandbox_id=info.id
            ) from None
    if target == source:
        raise InvalidRequest(f"sandbox {info.id} is already on node {target}", node=target)
    h = edge.nodes.get(target)
    if h is None:
        raise NotFound(f"unknown node {target!r}", node=target)
    if h.state != "alive":
        raise NotFound(f"node {target!r} was lost ({h.lost_reason})", node=target)
    try:
        load = edge.placer.node(target)
    except NotFound:
        raise TierUnavailable(
            f"node {target} has not reported yet or serves no tier", node=target
        ) from None
    if req.tier not in load.tiers:
        raise TierUnavailable(
            f"node {target} does not offer the {req.tier} tier", node=target, tier=req.tier
        )
    if not edge.placer.admits(target, preq):
        raise QuotaExceeded(f"node {target} is full for this sandbox", node=target)
    return [target]


async def migrate_sandbox(
    edge: ClusterEdge, sandbox_id: str, owner: str, target: str | None
) -> MigrateResult:
    """Move ``sandbox_id`` to ``target`` (or a placer-chosen node); see the module docstring.

    Raises:
        SandboxNotFound / NodeLost: no such sandbox for ``owner``, or its node was lost.
        SandboxStopped: the sandbox is not running or paused.
        NotFound: ``target`` is not a live node of the cluster.
        InvalidRequest: ``target`` is the sandbox's own node.
        TierUnavailable: ``target`` does not offer the sandbox's tier.
        QuotaExceeded: the target (or, with no target, every other node) is full.
        CapabilityNotSupported: the tier cannot pack its writable layer.
    """
    t0 = time.perf_counter()
    info = await edge.get_sandbox(sandbox_id, owner)
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
    candidates = _targets(edge, info, base, target)
    if info.tier in ("microvm", "vm"):
        caps = {c.tier: c for c in await edge._call(source, "capabilities")}
        if not caps[info.tier].snapshot:
            raise CapabilityNotSupported(
                f"the {info.tier} tier cannot pack its disk here, so it cannot migrate",
                tier=info.tier,
            )
    mig_id = None
    if edge.state is not None:
        mig_id = await asyncio.to_thread(
            edge.state.begin_migration, owner, sandbox_id, source, "pack_diff"
        )
    try:
        result = await _move(edge, info, owner, candidates, explicit=target is not None)
    except BaseException as e:
        if mig_id is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    edge.state.end_migration,
                    mig_id,
                    to_id=None,
                    to_node=None,
                    error=str(e)[:500] or type(e).__name__,
                )
        raise
    new, moved_bytes = result
    # the target is up: now the source goes
    try:
        await edge.kill_sandbox(sandbox_id, owner)
        if edge.state is not None:
            await asyncio.to_thread(
                edge.state.mark_stopped, sandbox_id, f"migrated to {new.id} on node {new.node}"
            )
    except DsecError as e:  # the copy runs; the old one is reported, not hidden
        log.error("migration of %s: source kill failed: %s", sandbox_id, e.message)
    if mig_id is not None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                edge.state.end_migration, mig_id, to_id=new.id, to_node=new.node
            )
    return MigrateResult(
        sandbox=new,
        from_id=sandbox_id,
        from_node=source,
        to_node=new.node,
        method="pack_diff",
        processes_carried=False,
        layer_bytes=moved_bytes,
        duration_ms=(time.perf_counter() - t0) * 1000,
    )


async def _move(
    edge: ClusterEdge, info: SandboxInfo, owner: str, candidates: list[str], *, explicit: bool
) -> tuple[SandboxInfo, int]:
    source = info.node
    export: dict[str, Any] = await edge._call(
        source,
        "export_sandbox",
        info.id,
        owner,
        timeout=edge.options.create_timeout_s,
        sandbox_id=info.id,
    )
    diff: LayerInfo = export["diff_layer"]
    digests = [*export["image_layers"], diff.digest]
    req = CreateSandboxRequest.model_validate(export["request"])
    preq = edge._placement_request(req)
    last: DsecError | None = None
    for node in candidates:
        placer = edge.placer
        try:
            reservation = placer.begin(node, preq)
        except (QuotaExceeded, NotFound) as e:
            if explicit:
                raise
            last = e
            continue
        try:
            moved = await _move_layers(edge, source, node, digests)
            new: SandboxInfo = await edge._call(
                node,
                "import_sandbox",
                export["request"],
                owner,
                export["image_layers"],
                diff.digest,
                timeout=edge.options.create_timeout_s,
            )
        except QuotaExceeded as e:
            placer.abort(reservation)
            if explicit:
                raise
            last = e
            continue
        except BaseException:
            placer.abort(reservation)
            raise
        with contextlib.suppress(DsecError):
            placer.commit(reservation)
        await edge._record(owner, new)
        return new, moved
    raise last or QuotaExceeded(f"no node admits sandbox {info.id}", sandbox_id=info.id)


async def _move_layers(edge: ClusterEdge, source: str, target: str, digests: list[str]) -> int:
    """Copy the layers ``target`` lacks from ``source``, node to node; returns bytes moved."""
    src, dst = edge._handle(source), edge._handle(target)
    timeout = edge.options.create_timeout_s
    status, missing = await edge._await(
        dst, dst.actor.missing_layers.remote(digests), timeout, "missing_layers"
    )
    if status == "error":
        raise error_from_wire(0, missing)
    moved = 0
    for digest in missing:
        blob_ref = src.actor.read_layer.remote(digest)  # stays in the object store
        status, layer = await edge._await(
            dst, dst.actor.put_layer.remote(blob_ref), timeout, "put_layer"
        )
        if status == "error":
            raise error_from_wire(0, layer)
        moved += int(layer.size or 0)
    return moved
