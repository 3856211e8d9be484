"""``ClusterEdge``: the :class:`~dsec.edge.interface.EdgeAPI` of a Ray cluster.

The apiserver calls it exactly as it calls the embedded edge. It holds no sandbox state
of its own (any number of apiserver replicas can run):

* a per-sandbox call goes to the edge actor of the node named in the sandbox id
  (``sb-<node>-<random>``), with a per-call timeout, racing the node's *lost* signal, so
  no request hangs on a dead node;
* ``create`` asks the placer (:mod:`dsec.placement`) for a node and fallbacks; the chosen
  edge admits or rejects (``QuotaExceeded``) and on rejection the next candidate is
  tried; ``create_sandboxes`` places the whole batch with ``Placer.place_many`` and sends
  one batch call per node;
* lists and job actions fan out to the live edges; sandboxes of lost nodes come from the
  PostgreSQL registry (:class:`~dsec.cluster.state.ClusterState`).

A monitor task (every ``report_interval_s``) follows Ray's node table, starts an edge
actor on every new node, collects each edge's usage report (actual CPU and memory used,
sandboxes, layers present, tiers) into a fresh placer view, and syncs the registry. A
node is *lost* when Ray reports it dead or its edge has not answered for
``lost_after_s``: calls to its sandboxes then raise :class:`NodeLost` at once (in-flight
ones too), its registry rows are marked stopped, and its actor is released so a node
that comes back under the same name gets a new edge, which reconciles its data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dsec import __version__
from dsec.cluster.actor import BURST_LABEL, NodeConfig, ensure_edge_actor, node_name_of
from dsec.edge.interface import SANDBOX_VERBS
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
    TIERS,
    BatchCreateResult,
    BatchItemError,
    BuildImageRequest,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ForkRequest,
    ForkResult,
    ImageInfo,
    JobAction,
    JobActionResult,
    JobOutcome,
    LayerInfo,
    MigrateResult,
    NodeInfo,
    SandboxInfo,
)
from dsec.placement import Node, NodeUsage, Overcommit, PlacementRequest, Placer

__all__ = [
    "BURSTABLE_LABEL",
    "PREFER_NODE_LABEL",
    "ClusterEdge",
    "ClusterOptions",
    "NodeLost",
    "node_of_sandbox",
]

log = logging.getLogger("dsec.cluster")

_T = TypeVar("_T")

PREFER_NODE_LABEL = "dsec.io/prefer-node"
"""Sandbox label naming a node to try first (soft: other nodes are tried if it rejects)."""

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
        lost_after_s: an edge that has not answered for this long is declared lost.
        start_grace_s: the same for a new edge that has not reported once yet (its first
            call starts the ``EdgeAgent``, which reconciles its node).
        call_timeout_s: default timeout of one call to an edge.
        create_timeout_s: timeout of a creation (first use of an image builds it).
        exec_margin_s: added to an exec's own timeout for the call's timeout.
        placement_k: candidates sampled per decision (power of k).
        overcommit: the placer's overcommit caps (each edge still applies its own).
        burst_threshold: regular-pool utilisation (0..1) from which burstable sandboxes may
            go to nodes labelled ``dsec.io/burst``.
    """

    report_interval_s: float = 2.0
    start_grace_s: float = 180.0
    probe_timeout_s: float = 5.0
    lost_after_s: float = 15.0
    call_timeout_s: float = 120.0
    create_timeout_s: float = 600.0
    exec_margin_s: float = 30.0
    placement_k: int = 2
    overcommit: Overcommit = field(default_factory=Overcommit)
    burst_threshold: float = 0.8

    @classmethod
    def from_env(cls) -> ClusterOptions:
        """Defaults overridden by ``DSEC_CLUSTER_REPORT_INTERVAL_S``,
        ``DSEC_CLUSTER_LOST_AFTER_S``, ``DSEC_CLUSTER_CALL_TIMEOUT_S``,
        ``DSEC_CLUSTER_PROBE_TIMEOUT_S``, ``DSEC_CLUSTER_K``, ``DSEC_CPU_OVERCOMMIT``,
        ``DSEC_MEMORY_OVERCOMMIT`` and ``DSEC_BURST_THRESHOLD``."""
        o = cls()
        env = os.environ
        try:
            if "DSEC_CLUSTER_REPORT_INTERVAL_S" in env:
                o.report_interval_s = float(env["DSEC_CLUSTER_REPORT_INTERVAL_S"])
            if "DSEC_CLUSTER_LOST_AFTER_S" in env:
                o.lost_after_s = float(env["DSEC_CLUSTER_LOST_AFTER_S"])
            if "DSEC_CLUSTER_CALL_TIMEOUT_S" in env:
                o.call_timeout_s = float(env["DSEC_CLUSTER_CALL_TIMEOUT_S"])
            if "DSEC_CLUSTER_PROBE_TIMEOUT_S" in env:
                o.probe_timeout_s = float(env["DSEC_CLUSTER_PROBE_TIMEOUT_S"])
            if "DSEC_CLUSTER_K" in env:
                o.placement_k = int(env["DSEC_CLUSTER_K"])
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
class _NodeHandle:
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
        self.nodes: dict[str, _NodeHandle] = {}

    def alive(self) -> list[_NodeHandle]:
        return [h for h in self.nodes.values() if h.state == "alive"]

    def handle(self, node: str, sandbox_id: str | None = None) -> _NodeHandle:
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

    async def await_ref(self, h: _NodeHandle, ref: Any, timeout: float, what: str) -> Any:
        """Await an actor call, racing the node's lost signal; typed errors only."""
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
                    raise NodeLost(f"node {h.name} was lost during {what}", node=h.name) from None
                raise ServiceUnavailable(
                    f"the edge of node {h.name} is unavailable (restarting?): {e}"[:500],
                    node=h.name,
                ) from None
            except RayError as e:
                raise ServiceUnavailable(
                    f"call to node {h.name} failed: {e}"[:500], node=h.name
                ) from None
        call.cancel()
        with contextlib.suppress(Exception):
            import ray

            ray.cancel(ref)
        if lost in done:
            raise NodeLost(f"node {h.name} was lost during {what}", node=h.name)
        raise SandboxTimeout(
            f"node {h.name} did not answer {what} within {timeout:.0f} s", node=h.name
        )

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

    async def answer(self, h: _NodeHandle, ref: Any, timeout: float | None, what: str) -> Any:
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
        self, sandbox_id: str, method: str, *args: Any, timeout: float | None = None, **kw: Any
    ) -> Any:
        """Relay ``method(sandbox_id, *args, **kw)`` to the node the id names."""
        node = node_of_sandbox(sandbox_id)
        try:
            return await self.call(
                node, method, sandbox_id, *args, timeout=timeout, sandbox_id=sandbox_id, **kw
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

    def rebuild(self, alive: list[_NodeHandle]) -> None:
        """A fresh placer view from the latest reports: actual usage observed, and the
        requested totals each edge admits against committed as one reservation per node."""
        placer = Placer(
            [],
            k=self.options.placement_k,
            overcommit=self.options.overcommit,
            burst_threshold=self.options.burst_threshold,
        )
        for h in alive:
            r = h.report
            if r is None or not r.get("tiers"):
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


class ClusterEdge:
    """The cluster's :class:`~dsec.edge.interface.EdgeAPI`. ``ray.init`` must have been
    called; construct, ``await start()``, use, ``await close()``.

    Args:
        state: the PostgreSQL registry (``None``: no shared registry; lists then only show
            sandboxes of live nodes and lost ones are reported from memory).
        config: how edge actors are set up on each node.
        options: timings and placement settings.
    """

    def __init__(
        self,
        state: Any,
        config: NodeConfig,
        options: ClusterOptions | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self.options = options or ClusterOptions.from_env()
        self.relay = NodeRelay(state, self.options)
        self.placement = ClusterPlacement(self.options)
        self.rejections_retried = 0
        self._monitor: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def nodes(self) -> dict[str, _NodeHandle]:
        """The nodes this replica knows, by name (live and lost)."""
        return self.relay.nodes

    @property
    def placer(self) -> Placer:
        """The placer's current view of the live nodes."""
        return self.placement.placer

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, wait_s: float = 120.0) -> None:
        """Start (or find) an edge per alive Ray node and wait up to ``wait_s`` seconds
        for every one of them to report once."""
        await self.refresh()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pending = [h.name for h in self._alive() if h.report is None]
            if not pending:
                break
            await asyncio.sleep(0.2)
            await self.refresh()
        pending = [h.name for h in self._alive() if h.report is None]
        if pending:
            log.warning("edges not reporting yet: %s", ", ".join(pending))
        self._monitor = asyncio.create_task(self._monitor_loop(), name="dsec-cluster-monitor")

    async def close(self) -> None:
        """Stop monitoring. Edge actors keep running (they are detached)."""
        self._closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor

    async def shutdown_edges(self, *, kill_sandboxes: bool = False) -> None:
        """Close every edge actor (and their sandboxes if ``kill_sandboxes``) and release
        them: what an operator does to take the cluster's dsec down."""
        import ray

        for h in self._alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(h.actor.shutdown.remote(kill_sandboxes), 120)
            with contextlib.suppress(Exception):
                ray.kill(h.actor, no_restart=True)

    async def _monitor_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.options.report_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("cluster refresh failed")

    def _alive(self) -> list[_NodeHandle]:
        return self.relay.alive()

    # ------------------------------------------------------------------ membership and reports
    async def refresh(self) -> None:
        """One monitor step: follow Ray's node table, collect reports, rebuild the placer."""
        import ray

        ray_nodes = await asyncio.to_thread(ray.nodes)
        seen: set[str] = set()
        for rn in ray_nodes:
            name = node_name_of(rn)
            h = self.nodes.get(name)
            if not rn.get("Alive"):
                if h is not None and h.ray_node_id == rn["NodeID"] and h.state == "alive":
                    await self._mark_lost(h, "node lost (Ray reported the node dead)")
                continue
            seen.add(name)
            if h is None or h.state == "lost" or h.ray_node_id != rn["NodeID"]:
                if h is not None and h.state == "alive":
                    await self._mark_lost(h, "node lost (replaced by a new Ray node)")
                labels = rn.get("Labels") or {}
                actor = await asyncio.to_thread(ensure_edge_actor, rn, self.config)
                self.nodes[name] = _NodeHandle(
                    name=name,
                    ray_node_id=rn["NodeID"],
                    actor=actor,
                    burst=str(labels.get(BURST_LABEL, "")).lower() in ("1", "true", "yes"),
                )
        for h in self._alive():
            if h.name not in seen:  # gone from Ray's table altogether
                await self._mark_lost(h, "node lost (left the Ray cluster)")
        await asyncio.gather(*(self._collect(h) for h in self._alive()))
        self.placement.rebuild(self._alive())

    async def _collect(self, h: _NodeHandle) -> None:
        try:
            report = await asyncio.wait_for(
                _ray_await(h.actor.report.remote()), self.options.probe_timeout_s
            )
        except Exception as e:
            silent = time.monotonic() - h.last_ok
            # a new edge starts (and reconciles) on its first call: give it longer
            limit = (
                self.options.lost_after_s if h.report is not None else self.options.start_grace_s
            )
            if silent > limit:
                await self._mark_lost(
                    h, f"node lost (its edge did not answer for {silent:.0f} s: {e!r})"[:300]
                )
            return
        h.last_ok = time.monotonic()
        h.report = report
        if self.state is not None:
            try:
                owned = await asyncio.wait_for(
                    _ray_await(h.actor.owned_sandboxes.remote()), self.options.probe_timeout_s
                )
                live = {info.id: (owner, info) for owner, info in owned}
                await asyncio.to_thread(self.state.sync_node, h.name, live)
                await asyncio.to_thread(
                    self.state.upsert_node,
                    h.name,
                    h.ray_node_id,
                    "alive",
                    {k: v for k, v in report.items() if k != "layers"},
                )
            except Exception as e:
                log.warning("registry sync of node %s failed: %s", h.name, e)

    async def _mark_lost(self, h: _NodeHandle, reason: str) -> None:
        import ray

        if h.state == "lost":
            return
        log.warning("node %s: %s", h.name, reason)
        h.state = "lost"
        h.lost_reason = reason
        h.lost.set()
        with contextlib.suppress(Exception):
            self.placer.remove_node(h.name)
        if self.state is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.state.mark_node_lost, h.name, reason)
        # release the pinned actor: a node coming back under this name gets a new edge
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, h.actor, no_restart=True)

    # ------------------------------------------------------------------ calls
    # ------------------------------------------------------------------ placement
    # ------------------------------------------------------------------ sandboxes
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        if req.tier not in TIERS:
            raise InvalidRequest(f"unknown tier {req.tier!r}")
        preq = self.placement.request(req)
        candidates = self.placement.candidates(preq, prefer=req.labels.get(PREFER_NODE_LABEL))

        async def attempt(node: str) -> tuple[SandboxInfo, None]:
            try:
                info: SandboxInfo = await self.relay.call(
                    node, "create_sandbox", req, owner, timeout=self.options.create_timeout_s
                )
            except (QuotaExceeded, NodeLost, ServiceUnavailable) as e:
                self.rejections_retried += 1
                log.info("node %s did not admit a %s sandbox: %s", node, req.tier, e.message)
                raise
            return info, None

        def none_admits(last: DsecError | None) -> DsecError:
            if isinstance(last, QuotaExceeded) or last is None:
                return QuotaExceeded(
                    "no node of the cluster admits this sandbox"
                    + (f" (last refusal: {last.message})" if last else ""),
                    tier=req.tier,
                )
            return last

        info, _ = await self.placement.first_admitting(
            candidates,
            preq,
            attempt,
            refusals=(QuotaExceeded, NodeLost, ServiceUnavailable),
            none_admits=none_admits,
            admitted=lambda info: self._record(owner, info),
        )
        return info

    async def create_sandboxes(
        self, req: CreateSandboxRequest, n: int, owner: str, *, all_or_nothing: bool = False
    ) -> BatchCreateResult:
        """Place ``n`` sandboxes with ``Placer.place_many`` and send one batch call per
        chosen node. Items an edge refuses with ``QuotaExceeded`` are retried one by one on
        other nodes; the rest are reported by index. ``all_or_nothing``: a batch the placer
        cannot fit is refused before anything is created, and any failure kills what was
        made and raises."""
        if n < 1:
            raise InvalidRequest("a batch needs n >= 1", n=n)
        preq = self.placement.request(req)
        self.placement.candidates(preq)  # TierUnavailable before anything else
        placer = self.placer
        batch = placer.place_many(n, preq)
        if all_or_nothing and batch.failed:
            for r in batch.placed:
                placer.abort(r)
            raise QuotaExceeded(
                f"the cluster cannot fit a batch of {n} (room for {len(batch.placed)})",
                batch_size=n,
                room=len(batch.placed),
            )
        by_node: dict[str, list[tuple[int, Any]]] = {}
        for i, r in enumerate(batch.placed):
            by_node.setdefault(r.node_id, []).append((i, r))
        made: dict[int, SandboxInfo] = {}
        errors: dict[int, DsecError] = {}
        for j, e in enumerate(batch.failed):
            errors[len(batch.placed) + j] = e

        async def on_node(node: str, items: list[tuple[int, Any]]) -> None:
            try:
                res: BatchCreateResult = await self.relay.call(
                    node,
                    "create_sandboxes",
                    req,
                    len(items),
                    owner,
                    timeout=self.options.create_timeout_s,
                )
                infos, errs = list(res.sandboxes), list(res.errors)
            except DsecError as e:
                infos, errs = (
                    [],
                    [
                        BatchItemError(index=k, code=e.code, message=e.message)
                        for k in range(len(items))
                    ],
                )
            for (i, r), info in zip(items, infos, strict=False):
                with contextlib.suppress(DsecError):
                    placer.commit(r)
                made[i] = info
            for (i, r), err in zip(items[len(infos) :], errs, strict=False):
                placer.abort(r)
                errors[i] = error_from_wire(
                    0, {"error": {"code": err.code, "message": err.message}}
                )

        await asyncio.gather(*(on_node(node, items) for node, items in by_node.items()))
        retry = (
            [i for i, e in errors.items() if isinstance(e, QuotaExceeded)]
            if not all_or_nothing
            else []
        )
        for i in retry:  # the edge refused: the next candidate may admit
            try:
                made[i] = await self.create_sandbox(req, owner)
                self.rejections_retried += 1
                del errors[i]
            except DsecError as e:
                errors[i] = e
        await asyncio.gather(*(self._record(owner, info) for info in made.values()))
        if all_or_nothing and errors:
            for info in made.values():
                with contextlib.suppress(DsecError):
                    await self.kill_sandbox(info.id, owner)
            first = errors[min(errors)]
            raise type(first)(
                f"batch of {n} failed (all_or_nothing): {first.message}; "
                f"{len(made)} sandbox(es) already created were killed",
                **{**first.details, "batch_size": n, "created_then_killed": len(made)},
            )
        return BatchCreateResult(
            requested=n,
            sandboxes=[made[i] for i in sorted(made)],
            errors=[
                BatchItemError(index=i, code=errors[i].code, message=errors[i].message)
                for i in sorted(errors)
            ],
        )

    async def _record(self, owner: str, info: SandboxInfo) -> None:
        if self.state is not None:
            try:
                await asyncio.to_thread(self.state.record_sandbox, owner, info)
            except Exception as e:
                log.warning("registry write of %s failed: %s", info.id, e)

    async def list_sandboxes(
        self,
        owner: str,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> list[SandboxInfo]:
        async def one(h: _NodeHandle) -> list[SandboxInfo] | None:
            try:
                out: list[SandboxInfo] = await self.relay.call(
                    h.name,
                    "list_sandboxes",
                    owner,
                    state=state,
                    labels=labels,
                    job=job,
                    include_stopped=include_stopped,
                    timeout=self.options.probe_timeout_s * 2,
                )
                return out
            except DsecError as e:
                log.warning("list on node %s failed: %s", h.name, e.message)
                return None

        alive = self._alive()
        answers = await asyncio.gather(*(one(h) for h in alive))
        out: list[SandboxInfo] = [info for a in answers if a for info in a]
        if self.state is not None and (include_stopped or state == "stopped"):
            # sandboxes of lost (or silent) nodes, as the registry last saw them
            silent = [h.name for h, a in zip(alive, answers, strict=True) if a is None]
            lost = [h.name for h in self.nodes.values() if h.state == "lost"]
            rows = await asyncio.to_thread(
                self.state.sandboxes,
                owner,
                nodes=lost + silent,
                job=job,
                states=("stopped",) if state == "stopped" else None,
            )
            seen = {i.id for i in out}
            for info in rows:
                if info.id in seen:
                    continue
                if labels and any(info.labels.get(k) != v for k, v in labels.items()):
                    continue
                out.append(info)
        out.sort(key=lambda i: i.created_at)
        return out

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        info: SandboxInfo = await self.relay.on_sandbox(sandbox_id, "kill_sandbox", owner)
        await self._record(owner, info)
        return info

    # ------------------------------------------------------------------ exec
    async def exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> ExecResult:
        res: ExecResult = await self.relay.on_sandbox(
            sandbox_id,
            "exec",
            owner,
            req,
            seq=seq,
            idem_key=idem_key,
            timeout=self._exec_timeout(req),
        )
        return res

    def _exec_timeout(self, req: ExecRequest) -> float:
        t = getattr(req, "timeout", None) or getattr(req, "timeout_s", None)
        return float(t) + self.options.exec_margin_s if t else self.options.call_timeout_s

    async def exec_stream(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Events relayed from the edge's Ray streaming generator as they are produced; a
        lost node ends the stream with an ``error`` event (``NodeLost``)."""
        node = node_of_sandbox(sandbox_id)
        h = self.relay.handle(node, sandbox_id)
        gen = h.actor.exec_stream.remote(sandbox_id, owner, req, seq, idem_key)
        step_timeout = self._exec_timeout(req)
        while True:
            try:
                ref = await self.relay.await_ref(h, gen.__anext__(), step_timeout, "exec stream")
            except StopAsyncIteration:
                return
            except DsecError as e:
                e.details.setdefault("sandbox_id", sandbox_id)
                yield ExecEvent(type="error", error=e.to_wire()["error"])
                return
            ev: ExecEvent = await self.relay.await_ref(h, ref, step_timeout, "exec stream")
            yield ev
            if ev.type in ("exit", "error"):
                return

    # ------------------------------------------------------------------ files
    # ------------------------------------------------------------------ lifecycle verbs
    async def fork_sandbox(self, sandbox_id: str, owner: str, req: ForkRequest) -> ForkResult:
        """Forks stay on the source's node (the snapshot layer is there)."""
        res: ForkResult = await self.relay.on_sandbox(
            sandbox_id, "fork_sandbox", owner, req, timeout=self.options.create_timeout_s
        )
        for info in res.sandboxes:
            await self._record(owner, info)
        return res

    async def job_action(self, owner: str, job: str, action: JobAction) -> JobActionResult:
        """Fan out to every live node; sandboxes of the job on lost nodes are reported with
        a ``NodeLost`` error outcome."""
        alive = self._alive()

        async def one(h: _NodeHandle) -> JobActionResult | DsecError:
            try:
                res: JobActionResult = await self.relay.call(
                    h.name, "job_action", owner, job, action
                )
                return res
            except DsecError as e:
                return e

        answers = await asyncio.gather(*(one(h) for h in alive))
        outcomes: dict[str, JobOutcome] = {}
        for a in answers:
            if isinstance(a, JobActionResult):
                outcomes.update(a.outcomes)
            elif isinstance(a, InvalidRequest):
                raise a
        if self.state is not None:
            lost = [h.name for h in self.nodes.values() if h.state == "lost"]
            failed = [
                h.name for h, a in zip(alive, answers, strict=True) if isinstance(a, DsecError)
            ]
            rows = await asyncio.to_thread(
                self.state.sandboxes, owner, nodes=lost + failed, job=job
            )
            for info in rows:
                if info.id in outcomes:
                    continue
                if info.node in lost and (info.stopped_reason or "").startswith("node lost"):
                    err = NodeLost(
                        f"sandbox {info.id} was on lost node {info.node}",
                        sandbox_id=info.id,
                        node=info.node,
                    )
                    outcomes[info.id] = JobOutcome(
                        ok=False, state="stopped", error=err.to_wire()["error"]
                    )
                elif info.node in failed and info.state != "stopped":
                    err2 = ServiceUnavailable(f"node {info.node} did not answer", node=info.node)
                    outcomes[info.id] = JobOutcome(
                        ok=False, state=info.state, error=err2.to_wire()["error"]
                    )
        return JobActionResult(job=job, action=action, outcomes=outcomes)

    # ------------------------------------------------------------------ network
    # ------------------------------------------------------------------ display (vm tier)
    # ------------------------------------------------------------------ migration
    async def migrate_sandbox(
        self, sandbox_id: str, owner: str, node: str | None = None
    ) -> MigrateResult:
        """Move a sandbox to ``node`` (or a node the placer picks); see
        :func:`dsec.cluster.migrate.migrate_sandbox`."""
        from dsec.cluster.migrate import migrate_sandbox

        return await migrate_sandbox(
            self.relay, self.placement, sandbox_id, owner, node, record=self._record
        )

    # ------------------------------------------------------------------ images
    def _any_node(self) -> str:
        alive = [h.name for h in self._alive() if h.report is not None] or [
            h.name for h in self._alive()
        ]
        if not alive:
            raise ServiceUnavailable("no live node in the cluster")
        return alive[0]

    async def list_images(self, owner: str) -> list[ImageInfo]:
        out: list[ImageInfo] = await self.relay.call(self._any_node(), "list_images", owner)
        return out

    async def get_image(self, name: str, owner: str) -> ImageInfo:
        out: ImageInfo = await self.relay.call(self._any_node(), "get_image", name, owner)
        return out

    async def delete_image(self, name: str, owner: str) -> None:
        """Forgotten on every live node."""
        await self._on_every_node("delete_image", name, owner)

    async def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        """Shared on every live node that has it."""
        out: ImageInfo = await self._on_every_node("share_image", name, owner, shared)
        return out

    async def list_layers(self, owner: str) -> list[LayerInfo]:
        out: list[LayerInfo] = await self.relay.call(self._any_node(), "list_layers", owner)
        return out

    async def _on_every_node(self, method: str, *args: Any) -> Any:
        names = [h.name for h in self._alive()]
        if not names:
            raise ServiceUnavailable("no live node in the cluster")
        results = await asyncio.gather(
            *(
                self.relay.call(n, method, *args, timeout=self.options.create_timeout_s)
                for n in names
            ),
            return_exceptions=True,
        )
        for r in results:
            if not isinstance(r, BaseException):
                return r
        raise results[0]

    async def pull_image(self, ref: str, owner: str, name: str | None = None) -> ImageInfo:
        """Pulled on every live node (each keeps its own layer store)."""
        out: ImageInfo = await self._on_every_node("pull_image", ref, owner, name)
        return out

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """Built on every live node from the uploaded ``context``."""
        out: ImageInfo = await self._on_every_node("build_image", owner, req, context)
        return out

    async def push_image(self, name: str, target: str, owner: str) -> Any:
        """Pushed from one node's layer store (any node holding the image)."""
        return await self.relay.call(
            self._any_node(),
            "push_image",
            name,
            target,
            owner,
            timeout=self.options.create_timeout_s,
        )

    async def attach_image(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Registered on every live node (each reads the layers from the registry)."""
        out: ImageInfo = await self._on_every_node("attach_image", ref, name, lazy, owner)
        return out

    # ------------------------------------------------------------------ node
    async def capabilities(self) -> list[Capabilities]:
        """Per tier: the capabilities of a node offering it (unavailable if none does)."""
        answers = await asyncio.gather(
            *(self.relay.call(h.name, "capabilities") for h in self._alive()),
            return_exceptions=True,
        )
        best: dict[str, Capabilities] = {}
        for a in answers:
            if isinstance(a, BaseException):
                continue
            for c in a:
                if c.tier not in best or (c.available and not best[c.tier].available):
                    best[c.tier] = c
        return [
            best.get(t)
            or Capabilities(
                tier=t,
                available=False,
                reason="no live node",
                exec=False,
                files=False,
                streaming=False,
            )
            for t in TIERS
        ]

    async def node_info(self) -> NodeInfo:
        """The cluster as one node: summed cores, memory and sandboxes of the live nodes."""
        reports = [h.report for h in self._alive() if h.report is not None]
        return NodeInfo(
            node="cluster",
            version=__version__,
            tiers=await self.capabilities(),
            sandboxes=sum(int(r["sandboxes"]) for r in reports),
            cpus=sum(int(r["cpus"]) for r in reports),
            memory_mb=sum(int(r["memory_bytes"]) >> 20 for r in reports),
        )

    def metrics_text(self) -> bytes:
        lines = [
            "# HELP dsec_cluster_nodes Nodes of the cluster by state.",
            "# TYPE dsec_cluster_nodes gauge",
        ]
        for st in ("alive", "lost"):
            count = sum(1 for h in self.nodes.values() if h.state == st)
            lines.append(f'dsec_cluster_nodes{{state="{st}"}} {count}')
        lines += [
            "# HELP dsec_cluster_create_retries_total Creations retried on another node.",
            "# TYPE dsec_cluster_create_retries_total counter",
            f"dsec_cluster_create_retries_total {self.rejections_retried}",
        ]
        return ("\n".join(lines) + "\n").encode()

    async def stats(self) -> dict[str, Any]:
        return {
            "node": "cluster",
            "nodes": {
                h.name: {
                    "state": h.state,
                    "ray_node_id": h.ray_node_id,
                    "burst": h.burst,
                    "sandboxes": (h.report or {}).get("sandboxes"),
                    "lost_reason": h.lost_reason or None,
                }
                for h in self.nodes.values()
            },
            "live": sum(int((h.report or {}).get("sandboxes", 0)) for h in self._alive()),
            "create_retries": self.rejections_retried,
            "regular_utilisation": self.placer.regular_utilisation,
        }


async def _ray_await(ref: Any) -> Any:
    """Await a Ray ObjectRef (or a streaming generator step) from asyncio."""
    return await ref


_NODE_SIDE_VERBS = frozenset({"export_sandbox", "export_memory", "start_process"})
"""Sandbox verbs a cluster does not relay: migrations call the edge actors' own steps, and an
interactive process is a live object of its node (E2B falls back to exec streams)."""
_CREATE_TIMEOUT_VERBS = frozenset({"snapshot_sandbox"})
"""Relayed verbs that may take as long as a creation (a snapshot packs a whole layer)."""


def _forwarder(name: str) -> Callable[..., Awaitable[Any]]:
    async def forward(self: ClusterEdge, sandbox_id: str, *args: Any, **kwargs: Any) -> Any:
        timeout = self.options.create_timeout_s if name in _CREATE_TIMEOUT_VERBS else None
        return await self.relay.on_sandbox(sandbox_id, name, *args, timeout=timeout, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` on the node the sandbox id names (see ``EdgeAPI``)."
    return forward


# Every sandbox verb of the contract that ClusterEdge does not implement itself is relayed
# to the sandbox's node: adding a verb to dsec.edge.interface adds it here.
for _name in sorted(SANDBOX_VERBS - _NODE_SIDE_VERBS - set(vars(ClusterEdge))):
    setattr(ClusterEdge, _name, _forwarder(_name))
