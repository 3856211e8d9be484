"""How a cluster's apiserver reaches its nodes and decides where sandboxes go.

* :class:`NodeRelay`: calls to each Ray node's edge actor (relayed ``EdgeAgent`` verbs, the
  actor's own steps, a result piped node to node through Ray's object store), each racing the
  node's *lost* signal and a timeout, every failure a typed error;
* :class:`ClusterPlacement`: the placer's view of the live nodes (rebuilt from their
  reports), the order in which nodes are tried, a reservation around each attempt;
* :class:`ClusterOptions`: the timings and placement settings both use.

:class:`~dsec.cluster.edge.ClusterEdge` composes them into the cluster's ``EdgeAPI``;
:mod:`dsec.cluster.migrate` takes them as arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dsec.errors import (
    DsecError,
    InvalidRequest,
    NodeLost,
    NotFound,
    QuotaExceeded,
    SandboxNotFound,
    SandboxTimeout,
    ServiceUnavailable,
    TierUnavailable,
    error_from_wire,
)
from dsec.models import (
    CreateSandboxRequest,
    SandboxInfo,
)
from dsec.placement import Node, NodeUsage, Overcommit, PlacementRequest, Placer

__all__ = [
    "BURSTABLE_LABEL",
    "STREAM_ITEM_TIMEOUT_S",
    "ClusterOptions",
    "ClusterPlacement",
    "NodeHandle",
    "NodeRelay",
    "node_of_sandbox",
]

log = logging.getLogger("dsec.cluster")

_T = TypeVar("_T")

STREAM_ITEM_TIMEOUT_S = 24 * 3600.0
"""Default wait for the next item of a relayed stream (a followed log may be quiet for
long); a lost node ends it at once, whatever this says."""

BURSTABLE_LABEL = "dsec.io/burstable"
"""Sandbox label ``"true"``: the sandbox may run on the burst pool (see docs/design/cluster.md)."""


def node_of_sandbox(sandbox_id: str) -> str:
    """The node part of ``sb-<node>-<random>`` (``SandboxNotFound`` if malformed)."""
    parts = sandbox_id.split("-")
    if len(parts) != 3 or parts[0] != "sb" or not parts[1]:
        raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
    return parts[1]


@dataclass
class ClusterOptions:
    """Timings and placement settings of :class:`ClusterEdge` (seconds unless noted).

    Attributes:
        report_interval_s: how often node reports are collected and the placer refreshed.
        probe_timeout_s: how long one report may take before it counts as a miss.
        lost_after_s: an edge whose reports have failed (not merely not answered yet) for
            this long is declared lost.
        hung_after_s: an edge on a node Ray has alive whose reports have gone unanswered
            for this long is declared lost (hung); before that it is busy: out of
            placement, its sandboxes untouched.
        start_grace_s: the same for a new edge that has not reported once yet (its first
            call starts the ``EdgeAgent``, which reconciles its node).
        call_timeout_s: default timeout of one call to an edge.
        create_timeout_s: timeout of a creation (first use of an image builds it).
        exec_margin_s: added to a call's own time budget (an exec's timeout: a row's
            ``Verb.timeout``) for the timeout of its relay.
        placement_k: candidates sampled per decision (power of k).
        overcommit: the placer's overcommit caps (each edge still applies its own).
        burst_threshold: regular-pool utilisation (0..1) from which burstable sandboxes may
            go to nodes labelled ``dsec.io/burst``.
        reconcile_every: every this many reports, a node's registry rows absent from its
            live ids are stopped (catches stops no replica recorded; between them only
            changes are synced).
        coalesce: single creations arriving while earlier ones are in flight go to the
            edges together, one call per node (:mod:`dsec.cluster.coalesce`).
    """

    report_interval_s: float = 2.0
    start_grace_s: float = 180.0
    probe_timeout_s: float = 5.0
    lost_after_s: float = 15.0
    hung_after_s: float = 300.0
    call_timeout_s: float = 120.0
    create_timeout_s: float = 600.0
    exec_margin_s: float = 30.0
    placement_k: int = 2
    overcommit: Overcommit = field(default_factory=Overcommit)
    burst_threshold: float = 0.8
    reconcile_every: int = 5
    coalesce: bool = True

    @classmethod
    def from_env(cls) -> ClusterOptions:
        """Defaults overridden by ``DSEC_CLUSTER_REPORT_INTERVAL_S``,
        ``DSEC_CLUSTER_LOST_AFTER_S``, ``DSEC_CLUSTER_HUNG_AFTER_S``,
        ``DSEC_CLUSTER_CALL_TIMEOUT_S``,
        ``DSEC_CLUSTER_PROBE_TIMEOUT_S``, ``DSEC_CLUSTER_K``, ``DSEC_CPU_OVERCOMMIT``,
        ``DSEC_MEMORY_OVERCOMMIT``, ``DSEC_BURST_THRESHOLD`` and ``DSEC_CLUSTER_COALESCE``
        (``off`` to send each single creation on its own)."""
        o = cls()
        env = os.environ
        try:
            if "DSEC_CLUSTER_REPORT_INTERVAL_S" in env:
                o.report_interval_s = float(env["DSEC_CLUSTER_REPORT_INTERVAL_S"])
            if "DSEC_CLUSTER_LOST_AFTER_S" in env:
                o.lost_after_s = float(env["DSEC_CLUSTER_LOST_AFTER_S"])
            if "DSEC_CLUSTER_HUNG_AFTER_S" in env:
                o.hung_after_s = float(env["DSEC_CLUSTER_HUNG_AFTER_S"])
            if "DSEC_CLUSTER_CALL_TIMEOUT_S" in env:
                o.call_timeout_s = float(env["DSEC_CLUSTER_CALL_TIMEOUT_S"])
            if "DSEC_CLUSTER_PROBE_TIMEOUT_S" in env:
                o.probe_timeout_s = float(env["DSEC_CLUSTER_PROBE_TIMEOUT_S"])
            if "DSEC_CLUSTER_K" in env:
                o.placement_k = int(env["DSEC_CLUSTER_K"])
            if "DSEC_CLUSTER_COALESCE" in env:
                o.coalesce = env["DSEC_CLUSTER_COALESCE"].strip().lower() not in ("0", "off", "no")
            if "DSEC_BURST_THRESHOLD" in env:
                o.burst_threshold = float(env["DSEC_BURST_THRESHOLD"])
            o.overcommit = Overcommit(
                cpu=float(env.get("DSEC_CPU_OVERCOMMIT", o.overcommit.cpu)),
                memory=float(env.get("DSEC_MEMORY_OVERCOMMIT", o.overcommit.memory)),
            )
        except ValueError as e:
            raise InvalidRequest(f"invalid cluster setting in the environment: {e}") from e
        return o


@dataclass
class NodeHandle:
    """One node's edge actor as this apiserver replica sees it."""

    name: str
    ray_node_id: str
    actor: Any
    burst: bool = False
    state: str = "alive"  # alive | lost
    last_ok: float = field(default_factory=time.monotonic)
    report: dict[str, Any] | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = ""
    answering: bool = True  # its last report came back (False: out of placement meanwhile)
    busy_logged: bool = False
    ray_dead: bool = False  # Ray reported the node dead (not merely silent): its processes are gone
    sync_cursor: Any = None  # the edge's sandbox_changes cursor the registry is synced to
    syncs: int = 0  # registry syncs asked of this edge (every reconcile_every-th reconciles)


class NodeRelay:
    """Calls to the edge actors of a cluster's nodes: the relayed ``EdgeAgent`` verbs
    (:meth:`call`, :meth:`on_sandbox`), the actors' own methods (:meth:`actor_call`) and a
    result handed from one node to another through the object store (:meth:`pipe`). Every
    wait races the node's *lost* signal and a timeout; every failure is a typed error.
    :class:`ClusterEdge` and :mod:`dsec.cluster.migrate` share it.

    Args:
        state: the PostgreSQL registry (None: none), to tell a lost node from an unknown one.
        options: the cluster's timings.
    """

    def __init__(self, state: Any, options: ClusterOptions) -> None:
        self.state = state
        self.options = options
        self.nodes: dict[str, NodeHandle] = {}

    def alive(self) -> list[NodeHandle]:
        return [h for h in self.nodes.values() if h.state == "alive"]

    def handle(self, node: str, sandbox_id: str | None = None) -> NodeHandle:
        """The live node ``node`` (``NodeLost`` for a lost one, ``SandboxNotFound`` /
        ``NotFound`` for an unknown one)."""
        h = self.nodes.get(node)
        if h is not None and h.state == "alive":
            return h
        if h is not None:
            raise NodeLost(
                f"sandbox {sandbox_id} was on node {node}, which was lost ({h.lost_reason})"
                if sandbox_id
                else f"node {node} was lost ({h.lost_reason})",
                sandbox_id=sandbox_id,
                node=node,
            )
        if self.state is not None:
            known = self.state.nodes().get(node)
            if known is not None and known["state"] == "lost":
                raise NodeLost(
                    f"sandbox {sandbox_id} was on node {node}, which was lost",
                    sandbox_id=sandbox_id,
                    node=node,
                )
        if sandbox_id:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        raise NotFound(f"unknown node {node!r}", node=node)

    async def await_ref(self, h: NodeHandle, ref: Any, timeout: float, what: str) -> Any:
        """Await an actor call, racing the node's lost signal; typed errors only. A call
        sent and never answered (the actor or its node died, the node was lost meanwhile)
        fails with ``NodeLost`` or ``ServiceUnavailable`` whose ``details["unreachable"]``
        is true: the node may or may not have acted on it (see :meth:`settle`)."""
        from ray.exceptions import RayActorError, RayError

        call = asyncio.ensure_future(_ray_await(ref))
        lost = asyncio.ensure_future(h.lost.wait())
        try:
            done, _ = await asyncio.wait(
                {call, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            lost.cancel()
        if call in done:
            try:
                return call.result()
            except RayActorError as e:
                if h.state == "lost":
                    raise NodeLost(
                        f"node {h.name} was lost during {what}", node=h.name, unreachable=True
                    ) from None
                raise ServiceUnavailable(
                    f"the edge of node {h.name} is unavailable (restarting?): {e}"[:500],
                    node=h.name,
                    unreachable=True,
                ) from None
            except RayError as e:
                raise ServiceUnavailable(
                    f"call to node {h.name} failed: {e}"[:500], node=h.name, unreachable=True
                ) from None
        call.cancel()
        with contextlib.suppress(Exception):
            import ray

            ray.cancel(ref)
        if lost in done:
            raise NodeLost(f"node {h.name} was lost during {what}", node=h.name, unreachable=True)
        raise SandboxTimeout(
            f"node {h.name} did not answer {what} within {timeout:.0f} s", node=h.name
        )

    async def settle(self, node: str, within_s: float) -> bool:
        """After a call to ``node`` went unanswered (an error with ``details["unreachable"]``),
        wait up to ``within_s`` seconds to learn what became of the node: True once Ray
        reports it dead (its processes died with it, so whatever the call made there is
        gone, and what it asked for may be made elsewhere without a duplicate); False when
        its edge answers again (a restarted edge may have acted on the call), when it was
        declared lost only by its silence (it may still run what it made), or when nothing
        is known within ``within_s``."""
        h = self.nodes.get(node)
        if h is None:
            return False
        deadline = time.monotonic() + within_s
        while not h.ray_dead:
            left = deadline - time.monotonic()
            if h.state == "lost" or left <= 0:
                return False
            try:
                await asyncio.wait_for(_ray_await(h.actor.ping.remote()), min(2.0, left))
                return False  # it answers: the same node, its edge restarted or still there
            except Exception:  # dead, dying or slow: look again shortly
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    h.lost.wait(), max(0.0, min(0.5, deadline - time.monotonic()))
                )
        return True

    async def call(
        self,
        node: str,
        method: str,
        *args: Any,
        timeout: float | None = None,
        sandbox_id: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Relay ``EdgeAgent.<method>(*args, **kwargs)`` to ``node``'s edge actor; its
        ``("error", ...)`` answer is raised as the typed error."""
        h = self.handle(node, sandbox_id)
        return await self.answer(h, h.actor.call.remote(method, args, kwargs), timeout, method)

    async def stream(
        self,
        node: str,
        method: str,
        *args: Any,
        item_timeout: float | None = None,
        sandbox_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """Relay the streaming verb ``EdgeAgent.<method>(*args, **kwargs)`` to ``node``:
        its items as they come (each within ``item_timeout`` seconds, default
        :data:`STREAM_ITEM_TIMEOUT_S`), an error raised as the typed error (the first item's
        refusals included), a lost node as ``NodeLost``. Closing this generator cancels
        the remote one."""
        h = self.handle(node, sandbox_id)
        gen = h.actor.stream.remote(method, args, kwargs)
        step = item_timeout or STREAM_ITEM_TIMEOUT_S
        finished = False
        try:
            while True:
                try:
                    ref = await self.await_ref(h, gen.__anext__(), step, method)
                except StopAsyncIteration:
                    finished = True
                    return
                status, value = await self.await_ref(h, ref, step, method)
                if status == "error":
                    finished = True
                    raise error_from_wire(0, value)
                yield value
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    import ray

                    ray.cancel(gen)

    async def answer(self, h: NodeHandle, ref: Any, timeout: float | None, what: str) -> Any:
        """Await ``ref`` (an actor method's ``("ok"|"error", value)``) as the value or the
        typed error."""
        status, value = await self.await_ref(h, ref, timeout or self.options.call_timeout_s, what)
        if status == "error":
            raise error_from_wire(0, value)
        return value

    async def actor_call(
        self,
        node: str,
        method: str,
        *args: Any,
        timeout: float | None = None,
        sandbox_id: str | None = None,
    ) -> Any:
        """Call the edge actor's own method ``method`` on ``node`` (not a relayed
        ``EdgeAgent`` call: e.g. the memory migration steps of :mod:`dsec.cluster.migrate`);
        its ``("error", ...)`` answer is raised as the typed error."""
        h = self.handle(node, sandbox_id)
        return await self.answer(h, getattr(h.actor, method).remote(*args), timeout, method)

    async def on_sandbox(
        self,
        sandbox_id: str,
        method: str,
        *args: Any,
        timeout: float | None = None,
        route_only: bool = False,
        **kw: Any,
    ) -> Any:
        """Relay ``method(sandbox_id, *args, **kw)`` to the node the id names
        (``route_only``: ``method(*args, **kw)``, the id only routes: a verb whose request
        model holds it)."""
        node = node_of_sandbox(sandbox_id)
        lead = () if route_only else (sandbox_id,)
        try:
            return await self.call(
                node, method, *lead, *args, timeout=timeout, sandbox_id=sandbox_id, **kw
            )
        except NodeLost as e:
            e.details.setdefault("sandbox_id", sandbox_id)
            raise

    async def pipe(
        self,
        source: str,
        target: str,
        read: tuple[str, tuple[Any, ...]],
        write: tuple[str, tuple[Any, ...]],
        timeout: float,
    ) -> Any:
        """``target``'s actor method ``write[0](*write[1], <answer of source's read>)``: the
        answer of ``read`` (an actor method of ``source``) goes node to node through Ray's
        object store, never through this process. Returns ``write``'s value."""
        src, dst = self.handle(source), self.handle(target)
        ref = getattr(src.actor, read[0]).remote(*read[1])
        return await self.answer(
            dst, getattr(dst.actor, write[0]).remote(*write[1], ref), timeout, write[0]
        )


class ClusterPlacement:
    """Where sandboxes go: the placer's view of the live nodes (rebuilt from their reports),
    the order in which nodes are tried, and a reservation around each attempt."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.placer = Placer([], k=options.placement_k, overcommit=options.overcommit)

    def rebuild(self, alive: list[NodeHandle]) -> None:
        """A fresh placer view from the latest reports: actual usage observed, and the
        requested totals each edge admits against committed as one reservation per node."""
        placer = Placer(
            [],
            k=self.options.placement_k,
            overcommit=self.options.overcommit,
            burst_threshold=self.options.burst_threshold,
        )
        answering = [h for h in alive if h.answering and h.report is not None]
        for h in alive:
            r = h.report
            if r is None or not r.get("tiers"):
                continue
            if not h.answering and answering:  # busy: new sandboxes go to the others
                continue
            live = int(r["sandboxes"])
            placer.add_node(
                Node(
                    node_id=h.name,
                    cpu_cores=float(r["cpus"]),
                    memory_bytes=int(r["memory_bytes"]),
                    tiers=frozenset(r["tiers"]),
                    disk_free_bytes=int(r["disk_free_bytes"]),
                    # the committed totals below count as one sandbox
                    max_sandboxes=max(1, int(r["max_sandboxes"]) - live + (1 if live else 0)),
                    burst=h.burst,
                    layers=frozenset(r.get("layers", ())),
                )
            )
            placer.observe(
                h.name,
                NodeUsage(
                    cpu_used=float(r["cpu_used"]),
                    memory_used=int(r["memory_used"]),
                    sandboxes=live,
                    disk_free_bytes=int(r["disk_free_bytes"]),
                ),
            )
            if live and r["requested_cpu"] > 0:
                committed = PlacementRequest(
                    tier=sorted(r["tiers"])[0],
                    cpu=float(r["requested_cpu"]),
                    memory_bytes=max(1, int(r["requested_memory"])),
                )
                with contextlib.suppress(QuotaExceeded):
                    placer.commit(placer.begin(h.name, committed))
        self.placer = placer

    def request(self, req: CreateSandboxRequest) -> PlacementRequest:
        """What the placer needs to know of ``req``."""
        return PlacementRequest(
            tier=req.tier,
            cpu=req.cpu,
            memory_bytes=req.memory_mb << 20,
            disk_bytes=req.disk_mb << 20,
            layers=tuple(x for x in req.layers if x.startswith("sha256:")),
            burstable=req.labels.get(BURSTABLE_LABEL, "").lower() == "true",
        )

    def candidates(
        self,
        preq: PlacementRequest,
        *,
        prefer: str | None = None,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> list[str]:
        """Nodes to try in order: a preferred node, the placer's choice and fallbacks, then
        every other live node serving the tier, least loaded first.

        Raises:
            TierUnavailable: no live node serves the tier.
            QuotaExceeded: the placer sees every such node at its caps.
        """
        placer = self.placer
        serving = [
            load
            for load in placer.nodes
            if not load.dead and preq.tier in load.tiers and load.node_id not in exclude
        ]
        if not serving:
            offered = sorted({t for load in placer.nodes if not load.dead for t in load.tiers})
            raise TierUnavailable(
                f"no node of this cluster offers the {preq.tier} tier"
                + (" (besides the excluded ones)" if exclude else ""),
                tier=preq.tier,
                available=offered,
            )
        order: list[str] = []
        if prefer and any(load.node_id == prefer for load in serving):
            order.append(prefer)
        try:
            decision = placer.place(preq)
            order += [decision.node_id, *decision.fallbacks]
        except QuotaExceeded:
            if not order:
                raise
        use_burst = preq.burstable and placer.regular_utilisation >= placer.burst_threshold
        rest = sorted(
            (x for x in serving if use_burst or not x.burst), key=lambda x: x.load_score()
        )
        order += [x.node_id for x in rest]
        out: list[str] = []
        for n in order:
            if n not in exclude and n not in out:
                out.append(n)
        return out

    async def first_admitting(
        self,
        candidates: list[str],
        preq: PlacementRequest,
        attempt: Callable[[str], Awaitable[tuple[SandboxInfo, _T]]],
        *,
        refusals: tuple[type[DsecError], ...] = (QuotaExceeded,),
        explicit: bool = False,
        none_admits: Callable[[DsecError | None], DsecError],
        admitted: Callable[[SandboxInfo], Awaitable[None]] | None = None,
    ) -> tuple[SandboxInfo, _T]:
        """Run ``attempt(node)`` on the candidates in order, each under a placement
        reservation for ``preq``, until one succeeds: the reservation is committed and
        ``admitted(new sandbox)`` awaited (the registry write). A refusal (``refusals`` from the node, or the placer's own)
        moves on to the next candidate, unless the target was ``explicit`` (then it is
        raised); when none admits, ``none_admits(last refusal)`` is raised. Used by creation
        and by both migration methods (:mod:`dsec.cluster.migrate`)."""
        last: DsecError | None = None
        for node in candidates:
            placer = self.placer
            try:
                reservation = placer.begin(node, preq)
            except (QuotaExceeded, NotFound) as e:
                if explicit:
                    raise
                last = e
                continue
            try:
                info, extra = await attempt(node)
            except refusals as e:
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
            if admitted is not None:
                await admitted(info)
            return info, extra
        raise none_admits(last)


async def _ray_await(ref: Any) -> Any:
    """Await a Ray ObjectRef (or a streaming generator step) from asyncio."""
    return await ref
