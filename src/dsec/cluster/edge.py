"""``ClusterEdge``: the :class:`~dsec.contract.edge.EdgeAPI` of a Ray cluster.

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
node is *lost* when Ray reports it dead, its edge's reports have failed for
``lost_after_s``, or (on a node Ray has alive) gone unanswered for ``hung_after_s``; a
busy edge, whose reports are late, only leaves placement meanwhile. Calls to a lost node's
sandboxes raise :class:`NodeLost` at once (in-flight ones too), its registry rows are marked stopped, and its actor is released so a node
that comes back under the same name gets a new edge, which reconciles its data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from dsec.builds.records import MAX_BUILDS_PER_OWNER, BuildList, BuildRecord
from dsec.cluster.actor import BURST_LABEL, NodeConfig, edge_names_of, ensure_edge_actor
from dsec.cluster.coalesce import CreationCoalescer
from dsec.cluster.migrate import move_layers
from dsec.cluster.relay import (
    BURSTABLE_LABEL,
    ClusterOptions,
    ClusterPlacement,
    NodeHandle,
    NodeRelay,
    _ray_await,
    node_of_sandbox,
)
from dsec.cluster.state import ClusterState, PgCreateKeys
from dsec.contract.edge import (
    SANDBOX_VERBS,
    STREAM_VERBS,
    VERBS,
    EdgeAPI,
    PortStream,
    PortTicket,
)
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.edge.createkeys import IdempotentCreates, SqliteCreateKeys
from dsec.edge.ports import redeem_ticket
from dsec.edge.quotas import QuotaGuard, code_run_size
from dsec.errors import (
    DsecError,
    InvalidRequest,
    NodeLost,
    QuotaExceeded,
    ServiceUnavailable,
    error_from_wire,
)
from dsec.models import (
    NODE_QUERY,
    BatchCreateRequest,
    BatchCreateResult,
    BatchItemError,
    BuildImageRequest,
    BuildRef,
    Capabilities,
    CapabilityList,
    CodeRunRequest,
    CodeRunResult,
    CreateSandboxRequest,
    DeleteImageRequest,
    ExecEvent,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImageList,
    ImageRef,
    JobActionRequest,
    JobActionResult,
    JobAudit,
    JobOutcome,
    JobRef,
    KeyScope,
    KeyUsage,
    LayerList,
    ListSandboxesRequest,
    MigrateRequest,
    MigrateResult,
    NodeInfo,
    NodeQuery,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
    RunCodeRequest,
    RunCodeResponse,
    SandboxExecRequest,
    SandboxInfo,
    SandboxList,
    SandboxRef,
    ShareImageRequest,
)
from dsec.placement import PlacementRequest, Placer
from dsec.tiers import require_tier, tier_names
from dsec.version import __version__

if TYPE_CHECKING:
    from dsec.builds.wire import BuildRequest

__all__ = [
    "BURSTABLE_LABEL",
    "PREFER_NODE_LABEL",
    "ClusterEdge",
    "ClusterOptions",
    "NodeLost",
    "node_of_sandbox",
]

log = logging.getLogger("dsec.cluster")

PREFER_NODE_LABEL = "dsec.io/prefer-node"
"""Sandbox label naming a node to try first (soft: other nodes are tried if it rejects)."""


class _Unanswered(Exception):
    """A creation's call went unanswered by a node not known dead (not to be re-placed)."""


class ClusterEdge:
    """The cluster's :class:`~dsec.contract.edge.EdgeAPI`. ``ray.init`` must have been
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
        self.key_quotas = QuotaGuard()
        """Each key's quota (:mod:`dsec.edge.quotas`; its ``source`` is set by the server),
        checked here against the registry: the nodes' edges check only their own room."""
        self.creates = IdempotentCreates(
            PgCreateKeys(state)
            if isinstance(state, ClusterState)
            else SqliteCreateKeys(
                sqlite3.connect(":memory:", check_same_thread=False), threading.Lock()
            )
        )
        """Idempotent creations: keys shared by every replica through PostgreSQL."""
        self._monitor: asyncio.Task[None] | None = None
        self._closing = False
        self._pending_writes: list[tuple[str, SandboxInfo, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.coalescer = (
            CreationCoalescer(self, self._record, self._create_tried)
            if self.options.coalesce
            else None
        )

    @property
    def nodes(self) -> dict[str, NodeHandle]:
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

    def _alive(self) -> list[NodeHandle]:
        return self.relay.alive()

    # ------------------------------------------------------------------ membership and reports
    async def refresh(self) -> None:
        """One monitor step: follow Ray's node table, collect reports, rebuild the placer."""
        import ray

        ray_nodes = await asyncio.to_thread(ray.nodes)
        seen: set[str] = set()
        for rn in ray_nodes:
            for name in edge_names_of(rn, self.config):
                await self._follow(rn, name, seen)
        for h in self._alive():
            if h.name not in seen:  # gone from Ray's table altogether
                h.ray_dead = True
                await self._mark_lost(h, "node lost (left the Ray cluster)")
        await asyncio.gather(*(self._collect(h) for h in self._alive()))
        self.placement.rebuild(self._alive())

    async def _follow(self, rn: dict[str, Any], name: str, seen: set[str]) -> None:
        """Track the edge ``name`` of Ray node ``rn``: lost with its node, started on a
        new one."""
        h = self.nodes.get(name)
        if not rn.get("Alive"):
            if h is not None and h.ray_node_id == rn["NodeID"] and h.state == "alive":
                h.ray_dead = True
                await self._mark_lost(h, "node lost (Ray reported the node dead)")
            return
        seen.add(name)
        if h is None or h.state == "lost" or h.ray_node_id != rn["NodeID"]:
            if h is not None and h.state == "alive":
                await self._mark_lost(h, "node lost (replaced by a new Ray node)")
            labels = rn.get("Labels") or {}
            actor = await asyncio.to_thread(ensure_edge_actor, rn, self.config, name)
            self.nodes[name] = NodeHandle(
                name=name,
                ray_node_id=rn["NodeID"],
                actor=actor,
                burst=str(labels.get(BURST_LABEL, "")).lower() in ("1", "true", "yes"),
            )

    async def _collect(self, h: NodeHandle) -> None:
        try:
            report = await asyncio.wait_for(
                _ray_await(h.actor.report.remote()), self.options.probe_timeout_s
            )
        except Exception as e:
            h.answering = False  # out of placement until it answers again
            silent = time.monotonic() - h.last_ok
            # a new edge starts (and reconciles) on its first call: give it longer. A report
            # merely not answered yet, from a node Ray still has alive (a dead one was marked
            # lost by _follow), is a busy edge: losing it would kill its actor and every
            # sandbox there, so only a silence of hung_after_s counts (a hung edge)
            if h.report is None:
                limit = self.options.start_grace_s
            elif isinstance(e, TimeoutError):
                limit = self.options.hung_after_s
            else:
                limit = self.options.lost_after_s
            if silent > limit:
                await self._mark_lost(
                    h, f"node lost (its edge did not answer for {silent:.0f} s: {e!r})"[:300]
                )
            elif silent > self.options.lost_after_s and not h.busy_logged:
                h.busy_logged = True
                log.warning(
                    "node %s: its edge has not answered for %.0f s (busy?): no new sandboxes "
                    "go there until it does",
                    h.name,
                    silent,
                )
            return
        h.last_ok = time.monotonic()
        h.answering, h.busy_logged = True, False
        h.report = report
        if self.state is not None:
            try:
                h.syncs += 1
                reconcile = h.syncs % self.options.reconcile_every == 0
                asked_at = time.time()
                changes = await asyncio.wait_for(
                    _ray_await(h.actor.sandbox_changes.remote(h.sync_cursor, reconcile)),
                    self.options.probe_timeout_s,
                )
                if changes["full"]:
                    live = {info.id: (owner, info) for owner, info in changes["changed"]}
                    await asyncio.to_thread(self.state.sync_node, h.name, live, asked_at)
                elif changes["changed"] or changes["gone"]:
                    await asyncio.to_thread(
                        self.state.apply_changes, h.name, changes["changed"], changes["gone"]
                    )
                if "live" in changes:
                    await asyncio.to_thread(
                        self.state.stop_absent, h.name, changes["live"], asked_at
                    )
                h.sync_cursor = changes["cursor"]  # only once the registry has them
                await asyncio.to_thread(
                    self.state.upsert_node,
                    h.name,
                    h.ray_node_id,
                    "alive",
                    {k: v for k, v in report.items() if k != "layers"},
                )
            except Exception as e:
                log.warning("registry sync of node %s failed: %s", h.name, e)

    async def _mark_lost(self, h: NodeHandle, reason: str) -> None:
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
        # (never starting a Ray instance of its own to do it)
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ray.kill, h.actor, no_restart=True)

    # ------------------------------------------------------------------ calls
    def _relay_timeout(self, verb: str, req: Any) -> float | None:
        """How long a relayed call of ``verb`` may take: a creation's timeout for a verb
        that may take as long, the call's own budget plus ``exec_margin_s`` for a row that
        reads one from its request (:attr:`dsec.contract.verbs.Verb.timeout`: an exec's
        command timeout), else None (the default call timeout)."""
        if verb in _CREATE_TIMEOUT_VERBS:
            return self.options.create_timeout_s
        row = VERBS[verb] if verb in VERBS else None
        budget = row.timeout(req) if row is not None and row.timeout is not None else None
        return budget + self.options.exec_margin_s if budget else None

    # ------------------------------------------------------------------ placement
    # ------------------------------------------------------------------ sandboxes
    # ------------------------------------------------------------------ key quotas
    async def key_usage(self, owner: str) -> KeyUsage:
        """:class:`dsec.contract.edge.KeyAccounting`: ``owner``'s live sandboxes, from the
        registry (without one: from the live nodes)."""
        if self.state is not None:
            n, cpu, mem = await asyncio.to_thread(self.state.owner_usage, owner)
        else:
            listed = await self.list_sandboxes(ListSandboxesRequest(), owner)
            live = [i for i in listed.sandboxes if i.state != "stopped"]
            n, cpu, mem = len(live), sum(i.cpu for i in live), sum(i.memory_mb for i in live)
        return KeyUsage(sandboxes=n, cpu=round(cpu, 6), memory_mb=mem)

    async def _usage_for_quota(self, owner: str) -> KeyUsage:
        """``owner``'s usage as its quota checks need it: none counted when its quota sets
        no live limit (only its rate, or nothing), so those creations never query the
        registry (a scan of the key's live sandboxes)."""
        q = self.key_quotas.quota(owner)
        if q.max_sandboxes is None and q.max_cpu is None and q.max_memory_mb is None:
            return KeyUsage()
        return await self.key_usage(owner)

    async def _key_room(self, owner: str, cpu: float, memory_mb: int, want: int) -> int:
        """How many of ``want`` creations ``owner``'s quota admits now (their rate spent);
        none: the refusal is raised."""
        usage = await self._usage_for_quota(owner)
        fits, refusal = self.key_quotas.room(owner, usage, cpu=cpu, memory_mb=memory_mb, want=want)
        if fits == 0 and refusal is not None:
            raise refusal
        return fits

    async def create_sandbox(
        self, req: CreateSandboxRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> SandboxInfo:
        if env.idem_key is not None:
            return await self.creates.create_once(
                cast(EdgeAPI, self),
                req,
                owner,
                env.idem_key,
                lambda: self.create_sandbox(req, owner),
            )
        require_tier(req.tier)  # InvalidRequest: a tier no one registered
        await self._key_room(owner, req.cpu, req.memory_mb, 1)
        with self.key_quotas.admitted(owner, cpu=req.cpu, memory_mb=req.memory_mb):
            return await self._create_one(req, owner)

    async def _create_one(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        if self.coalescer is not None and not req.labels.get(PREFER_NODE_LABEL):
            return await self.coalescer.create(req, owner)
        return await self._create_tried(req, owner)

    @property
    def _settle_s(self) -> float:
        """How long an unanswered creation waits to learn whether its node died."""
        return self.options.lost_after_s + 2 * self.options.report_interval_s

    async def _create_tried(
        self, req: CreateSandboxRequest, owner: str, *, exclude: frozenset[str] = frozenset()
    ) -> SandboxInfo:
        """One creation tried on the candidates in turn (not ``exclude``): a node's refusal
        moves on to the next; so does a call left unanswered by a node Ray then reports
        dead (``NodeRelay.settle``). An unanswered call to a node not known dead is
        ``ServiceUnavailable`` (its edge may have made the sandbox)."""
        preq = self.placement.request(req)
        candidates = self.placement.candidates(
            preq, prefer=req.labels.get(PREFER_NODE_LABEL), exclude=exclude
        )
        unanswered: list[DsecError] = []

        async def attempt(node: str) -> tuple[SandboxInfo, None]:
            try:
                info: SandboxInfo = await self.relay.call(
                    node, "create_sandbox", req, owner, timeout=self.options.create_timeout_s
                )
            except (QuotaExceeded, NodeLost, ServiceUnavailable) as e:
                if e.details.get("unreachable") and not await self.relay.settle(
                    node, self._settle_s
                ):
                    unanswered.append(e)
                    raise _Unanswered from None
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

        try:
            info, _ = await self.placement.first_admitting(
                candidates,
                preq,
                attempt,
                refusals=(QuotaExceeded, NodeLost, ServiceUnavailable),
                none_admits=none_admits,
                admitted=lambda info: self._record(owner, info),
            )
        except _Unanswered:
            e = unanswered[0]
            raise ServiceUnavailable(
                f"{e.message} (the sandbox may have been made there: not tried elsewhere)",
                **e.details,
            ) from None
        return info

    async def create_sandboxes(self, batch: BatchCreateRequest, owner: str) -> BatchCreateResult:
        """Place ``n`` sandboxes with ``Placer.place_many`` and send one batch call per
        chosen node. Items an edge refuses with ``QuotaExceeded`` are retried one by one on
        other nodes; the rest are reported by index. ``all_or_nothing``: a batch the placer
        cannot fit is refused before anything is created, and any failure kills what was
        made and raises."""
        req, n, all_or_nothing = batch.sandbox, batch.n, batch.all_or_nothing
        if n < 1:
            raise InvalidRequest("a batch needs n >= 1", n=n)
        preq = self.placement.request(req)
        self.placement.candidates(preq)  # TierUnavailable before anything else
        if all_or_nothing:
            usage = await self._usage_for_quota(owner)
            self.key_quotas.check(owner, usage, cpu=req.cpu, memory_mb=req.memory_mb, count=n)
            self.key_quotas.take(owner, n)
            allowed, refusal = n, None
        else:
            allowed, refusal = self.key_quotas.room(
                owner,
                await self._usage_for_quota(owner),
                cpu=req.cpu,
                memory_mb=req.memory_mb,
                want=n,
            )
        with self.key_quotas.admitted(owner, cpu=req.cpu, memory_mb=req.memory_mb, count=allowed):
            res = await self._create_many(req, allowed, owner, all_or_nothing, preq)
        if refusal is None:
            return res
        errors = [
            *res.errors,
            *(
                BatchItemError(index=i, code=refusal.code, message=refusal.message)
                for i in range(allowed, n)
            ),
        ]
        return BatchCreateResult(requested=n, sandboxes=res.sandboxes, errors=errors)

    async def _create_many(
        self,
        req: CreateSandboxRequest,
        n: int,
        owner: str,
        all_or_nothing: bool,
        preq: Any,
    ) -> BatchCreateResult:
        if n == 0:
            return BatchCreateResult(requested=0, sandboxes=[], errors=[])
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
                    BatchCreateRequest(n=len(items), sandbox=req),
                    owner,
                    timeout=self.options.create_timeout_s,
                )
                infos, errs = list(res.sandboxes), list(res.errors)
            except DsecError as e:
                if e.details.get("unreachable") and await self.relay.settle(
                    node, self._settle_s
                ):  # the node died with the call: nothing it made lives; place them again
                    log.info("node %s died with %d creation(s) in flight", node, len(items))
                    for i, r in items:
                        placer.abort(r)
                        again.append(i)
                    return
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

        again: list[int] = []  # items of calls a dying node left unanswered
        await asyncio.gather(*(on_node(node, items) for node, items in by_node.items()))
        replaced: BatchCreateResult | None = None
        if again:  # recorded by the inner call
            self.rejections_retried += len(again)
            replaced = await self._create_many(req, len(again), owner, False, preq)
        retry = (
            [i for i, e in errors.items() if isinstance(e, QuotaExceeded)]
            if not all_or_nothing
            else []
        )
        for i in retry:  # the edge refused: the next candidate may admit
            try:
                made[i] = await self._create_tried(req, owner)
                self.rejections_retried += 1
                del errors[i]
            except DsecError as e:
                errors[i] = e
        await asyncio.gather(*(self._record(owner, info) for info in made.values()))
        if replaced is not None:  # identical items: any order will do
            made.update(zip(again, replaced.sandboxes, strict=False))
            for i, err in zip(again[len(replaced.sandboxes) :], replaced.errors, strict=False):
                errors[i] = error_from_wire(
                    0, {"error": {"code": err.code, "message": err.message}}
                )
        if all_or_nothing and errors:
            for info in made.values():
                with contextlib.suppress(DsecError):
                    await self.kill_sandbox(SandboxRef(sandbox_id=info.id), owner)
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
        """Write ``info`` to the registry before answering (group commit: the writes
        queued while one is in flight go together as the next statement). A sandbox of a
        node this replica has lost meanwhile (its creation answered, then the node died
        before the write) is written stopped as the node's loss stopped its other rows:
        written running, it would outlive the node in the registry."""
        if self.state is None:
            return
        h = self.nodes.get(info.node or "")
        if h is not None and h.state == "lost" and info.state != "stopped":
            info = info.model_copy(update={"state": "stopped", "stopped_reason": h.lost_reason})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending_writes.append((owner, info, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending(), name="dsec-registry-write")
        await asyncio.shield(done)

    async def _write_pending(self) -> None:
        while self._pending_writes:
            batch, self._pending_writes = self._pending_writes, []
            try:
                await asyncio.to_thread(
                    self.state.record_sandboxes, [(owner, info) for owner, info, _ in batch]
                )
            except Exception as e:  # the next report's sync writes them
                log.warning("registry write of %d sandbox(es) failed: %s", len(batch), e)
            for _, _, done in batch:
                if not done.done():
                    done.set_result(None)

    async def list_sandboxes(self, req: ListSandboxesRequest, owner: str) -> SandboxList:
        """Every live node's list; with stopped ones asked for, also the registry's rows of
        lost (or silent) nodes."""
        state, labels, job, include_stopped = req.state, req.labels, req.job, req.include_stopped

        async def one(h: NodeHandle) -> list[SandboxInfo] | None:
            try:
                res: SandboxList = await self.relay.call(
                    h.name,
                    "list_sandboxes",
                    req,
                    owner,
                    timeout=self.options.probe_timeout_s * 2,
                )
                return res.sandboxes
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
        return SandboxList(sandboxes=out)

    async def abandon_sandbox(
        self, sandbox_id: str, owner: str, env: Envelope = NO_ENVELOPE
    ) -> None:
        await self.creates.take_back(cast(EdgeAPI, self), sandbox_id, owner, env)

    async def kill_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo:
        info: SandboxInfo = await self.relay.on_sandbox(
            req.sandbox_id, "kill_sandbox", req, owner, route_only=True
        )
        await self._record(owner, info)
        return info

    # ------------------------------------------------------------------ exec
    async def exec_stream(
        self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> AsyncIterator[ExecEvent]:
        """Events relayed from the edge's Ray streaming generator as they are produced; a
        lost node ends the stream with an ``error`` event (``NodeLost``)."""
        sandbox_id = req.sandbox_id
        node = node_of_sandbox(sandbox_id)
        h = self.relay.handle(node, sandbox_id)
        gen = h.actor.exec_stream.remote(req, owner, env)
        step_timeout = self._relay_timeout("exec", req) or self.options.call_timeout_s
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

    # ------------------------------------------------------------------ ports
    async def open_port(self, sandbox_id: str, owner: str, port: int) -> PortStream:
        """:class:`~dsec.contract.edge.PortForwarding` across the cluster: the sandbox's
        node opens the connection (every check and error as on one node, typed through
        Ray) and parks it on its port gateway; this replica picks it up over the node
        network with the one-use ticket (docs/design/ports.md)."""
        ticket: PortTicket = await self.relay.on_sandbox(sandbox_id, "port_ticket", owner, port)
        return await redeem_ticket(ticket)

    # ------------------------------------------------------------------ files
    # ------------------------------------------------------------------ lifecycle verbs
    async def fork_sandbox(self, req: ForkRequest, owner: str) -> ForkResult:
        """Forks stay on the source's node (the snapshot layer is there)."""
        sandbox_id = req.sandbox_id
        found = await asyncio.to_thread(self.state.sandbox, sandbox_id) if self.state else None
        cpu, mem = (found[1].cpu, found[1].memory_mb) if found and found[0] == owner else (0, 0)
        usage = await self._usage_for_quota(owner)
        self.key_quotas.check(owner, usage, cpu=cpu, memory_mb=mem, count=req.n)
        self.key_quotas.take(owner, req.n)
        res: ForkResult = await self.relay.on_sandbox(
            sandbox_id,
            "fork_sandbox",
            req,
            owner,
            timeout=self.options.create_timeout_s,
            route_only=True,
        )
        for info in res.sandboxes:
            await self._record(owner, info)
        return res

    async def job_action(self, req: JobActionRequest, owner: str) -> JobActionResult:
        """Fan out to every live node; sandboxes of the job on lost nodes are reported with
        a ``NodeLost`` error outcome."""
        job, action = req.job, req.action
        alive = self._alive()

        async def one(h: NodeHandle) -> JobActionResult | DsecError:
            try:
                res: JobActionResult = await self.relay.call(h.name, "job_action", req, owner)
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
        killed = [sid for sid, o in outcomes.items() if o.ok and o.state == "stopped"]
        if self.state is not None and killed:  # the reports would learn it later
            try:
                await asyncio.to_thread(self.state.mark_stopped_many, killed, "killed")
            except Exception as e:
                log.warning("registry write of a job's %d kills failed: %s", len(killed), e)
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

    async def job_audit(self, req: JobRef, owner: str) -> JobAudit:
        """Fan out to every live node; a node that does not answer leaves its sandboxes out."""

        async def one(h: NodeHandle) -> JobAudit | None:
            try:
                res: JobAudit = await self.relay.call(h.name, "job_audit", req, owner)
                return res
            except DsecError:
                return None

        merged = JobAudit(job=req.job)
        for a in await asyncio.gather(*(one(h) for h in self._alive())):
            if a is not None:
                merged.sandboxes.update(a.sandboxes)
        return merged

    # ------------------------------------------------------------------ network
    # ------------------------------------------------------------------ display (vm tier)
    # ------------------------------------------------------------------ migration
    async def migrate_sandbox(self, req: MigrateRequest, owner: str) -> MigrateResult:
        """Move a sandbox to ``req.node`` (or a node the placer picks); see
        :func:`dsec.cluster.migrate.migrate_sandbox`."""
        from dsec.cluster.migrate import migrate_sandbox

        return await migrate_sandbox(
            self.relay, self.placement, req.sandbox_id, owner, req.node, record=self._record
        )

    # ------------------------------------------------------------------ images
    def _any_node(self) -> str:
        alive = [h.name for h in self._alive() if h.report is not None] or [
            h.name for h in self._alive()
        ]
        if not alive:
            raise ServiceUnavailable("no live node in the cluster")
        return alive[0]

    async def list_images(self, req: KeyScope, owner: str) -> ImageList:
        out: ImageList = await self.relay.call(self._any_node(), "list_images", req, owner)
        return out

    async def get_image(self, req: ImageRef, owner: str) -> ImageInfo:
        out: ImageInfo = await self.relay.call(self._any_node(), "get_image", req, owner)
        return out

    async def delete_image(self, req: DeleteImageRequest, owner: str) -> None:
        """Forgotten on every live node."""
        await self._on_every_node("delete_image", req, owner)

    async def share_image(self, req: ShareImageRequest, owner: str) -> ImageInfo:
        """Shared on every live node that has it."""
        out: ImageInfo = await self._on_every_node("share_image", req, owner)
        return out

    async def list_layers(self, req: KeyScope, owner: str) -> LayerList:
        out: LayerList = await self.relay.call(self._any_node(), "list_layers", req, owner)
        return out

    async def _on_every_node(self, method: str, *args: Any) -> Any:
        """``method`` done on every live node (a change each node keeps: an image pulled,
        built, removed); one node's answer."""
        answers = await self._from_every_node(method, *args, timeout=self.options.create_timeout_s)
        return answers[0]

    async def _from_every_node(
        self, method: str, *args: Any, timeout: float | None = None
    ) -> list[Any]:
        """``method``'s answer from each live node that gave one (none: the first error)."""
        names = [h.name for h in self._alive()]
        if not names:
            raise ServiceUnavailable("no live node in the cluster")
        results = await asyncio.gather(
            *(
                self.relay.call(n, method, *args, timeout=timeout or self.options.call_timeout_s)
                for n in names
            ),
            return_exceptions=True,
        )
        answers = [r for r in results if not isinstance(r, BaseException)]
        if not answers:
            raise results[0]
        return answers

    async def pull_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """Pulled (or, ``lazy``, attached) on every live node (each keeps its own layer
        store)."""
        out: ImageInfo = await self._on_every_node("pull_image", req, owner)
        return out

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """Built on every live node from the uploaded ``context``."""
        out: ImageInfo = await self._on_every_node("build_image", owner, req, context)
        return out

    async def build(
        self, owner: str, req: BuildRequest, context: bytes = b""
    ) -> AsyncGenerator[Any, None]:
        """Built on one node (the least busy that can), its layers then copied node to
        node to every other live node and the image registered there too, before the
        ``done`` event: a sandbox of the image may be placed anywhere."""

        node = self._build_node()
        async with contextlib.aclosing(
            self._replicated(node, owner, self.relay.stream(node, "build", owner, req, context))
        ) as events:
            async for event in events:
                yield event

    async def _replicated(
        self, node: str, owner: str, events: AsyncIterator[Any]
    ) -> AsyncGenerator[Any, None]:
        from dsec.builds.wire import BuildDone

        async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
            async for event in stream:
                if isinstance(event, BuildDone):
                    await self._replicate_image(node, owner, event.image)
                yield event

    async def list_builds(self, req: KeyScope, owner: str) -> BuildList:
        """The key's builds as every live node's edge recorded them (each records the
        builds it ran), newest first: every apiserver replica lists the same, whichever
        relayed a build. A node that does not answer leaves its builds out."""
        lists: list[BuildList] = await self._from_every_node("list_builds", req, owner)
        builds = sorted(
            (b for answer in lists for b in answer.builds),
            key=lambda b: b.started_at,
            reverse=True,
        )
        return BuildList(builds=builds[:MAX_BUILDS_PER_OWNER])

    async def get_build(self, req: BuildRef, owner: str) -> BuildRecord:
        """The build as the node that ran it recorded it (``NotFound`` from every node:
        the key has no such build, or its node restarted since)."""
        found: list[BuildRecord] = await self._from_every_node("get_build", req, owner)
        return found[0]

    def _build_node(self) -> str:
        """The live node with the most free sandbox slots that runs containers."""
        reports = [(h.name, h.report) for h in self._alive() if h.report is not None]
        able = [(n, r) for n, r in reports if "container" in r.get("tiers", ())] or reports
        if not able:
            return self._any_node()
        name, _ = max(able, key=lambda nr: int(nr[1]["max_sandboxes"]) - int(nr[1]["sandboxes"]))
        return name

    async def _replicate_image(self, source: str, owner: str, image: ImageInfo) -> None:
        """Copy ``image``'s layers from ``source`` to every other live node and register it
        there as ``owner``'s (a node that fails is logged and skipped: it builds the image
        itself if asked)."""

        async def one(target: str) -> None:
            await move_layers(self.relay, source, target, list(image.layers))
            await self.relay.actor_call(
                target, "put_image", owner, image, timeout=self.options.create_timeout_s
            )

        targets = [h.name for h in self._alive() if h.name != source]
        results = await asyncio.gather(*(one(t) for t in targets), return_exceptions=True)
        for target, r in zip(targets, results, strict=True):
            if isinstance(r, BaseException):
                log.warning("image %s not copied to node %s: %s", image.name, target, r)

    async def push_image(self, req: PushImageRequest, owner: str) -> PushImageResult:
        """Pushed from one node's layer store (any node holding the image)."""
        out: PushImageResult = await self.relay.call(
            self._any_node(), "push_image", req, owner, timeout=self.options.create_timeout_s
        )
        return out

    async def attach_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """Registered on every live node (each reads the layers from the registry)."""
        out: ImageInfo = await self._on_every_node("attach_image", req, owner)
        return out

    # ------------------------------------------------------------------ run_code
    async def run_code(self, req: CodeRunRequest, owner: str) -> CodeRunResult:
        """:class:`~dsec.contract.edge.CodeRuns` on a node with the fncall tier."""
        out: CodeRunResult = await self._run_code("run_code", req, owner)
        return out

    async def run_code_sandboxfusion(self, req: RunCodeRequest, owner: str) -> RunCodeResponse:
        """:class:`~dsec.contract.edge.CodeRuns` (SandboxFusion's shape) on a node with the
        fncall tier."""
        out: RunCodeResponse = await self._run_code("run_code_sandboxfusion", req, owner)
        return out

    async def _run_code(self, verb: str, req: CodeRunRequest | RunCodeRequest, owner: str) -> Any:
        """Check ``owner``'s quota here against the registry, as for a creation (the run
        counts as one live sandbox of :func:`code_run_size` until it returns), then run the
        call on the placer's fncall nodes in turn: a node that refuses it (its pool or its
        creation gate full, lost, restarting) passes it to the next. Nothing is reserved:
        the run is over when the call returns."""
        cpu, memory_mb = code_run_size(req)
        await self._key_room(owner, cpu, memory_mb, 1)
        preq = PlacementRequest(tier="fncall", cpu=cpu, memory_bytes=memory_mb << 20)
        last: DsecError | None = None
        with self.key_quotas.admitted(owner, cpu=cpu, memory_mb=memory_mb):
            for node in self.placement.candidates(preq):
                try:
                    return await self.relay.call(
                        node, verb, req, owner, timeout=self.options.create_timeout_s
                    )
                except (QuotaExceeded, NodeLost, ServiceUnavailable) as e:
                    log.info("node %s did not run a code call: %s", node, e.message)
                    last = e
        raise last if last is not None else QuotaExceeded("no node of the cluster runs code now")

    # ------------------------------------------------------------------ node
    async def capabilities(self, req: NodeQuery = NODE_QUERY) -> CapabilityList:
        """Per tier: the capabilities of a node offering it (unavailable if none does)."""
        answers = await asyncio.gather(
            *(self.relay.call(h.name, "capabilities") for h in self._alive()),
            return_exceptions=True,
        )
        best: dict[str, Capabilities] = {}
        for a in answers:
            if isinstance(a, BaseException):
                continue
            for c in a.tiers:
                if c.tier not in best or (c.available and not best[c.tier].available):
                    best[c.tier] = c
        return CapabilityList(
            tiers=[
                best.get(t)
                or Capabilities(
                    tier=t,
                    available=False,
                    reason="no live node",
                    exec=False,
                    files=False,
                    streaming=False,
                )
                for t in tier_names()
            ]
        )

    async def node_info(self, req: NodeQuery = NODE_QUERY) -> NodeInfo:
        """The cluster as one node: summed cores, memory and sandboxes of the live nodes."""
        reports = [h.report for h in self._alive() if h.report is not None]
        return NodeInfo(
            node="cluster",
            version=__version__,
            tiers=(await self.capabilities()).tiers,
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
        if self.coalescer is not None:
            lines += [
                "# HELP dsec_cluster_coalesced_calls_total Calls carrying coalesced single "
                "creations to the edges.",
                "# TYPE dsec_cluster_coalesced_calls_total counter",
                f"dsec_cluster_coalesced_calls_total {self.coalescer.calls}",
                "# HELP dsec_cluster_coalesced_creations_total Single creations those calls "
                "carried.",
                "# TYPE dsec_cluster_coalesced_creations_total counter",
                f"dsec_cluster_coalesced_creations_total {self.coalescer.items}",
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


_NODE_SIDE_VERBS = frozenset(
    {"export_sandbox", "export_memory", "start_process", "open_port", "watch_directory"}
)
"""Sandbox verbs a cluster does not relay: migrations call the edge actors' own steps; an
interactive process or a directory watcher is a live object of its node (E2B falls back to
exec streams and to polling); a port connection too (:meth:`ClusterEdge.open_port` relays
``port_ticket`` instead)."""
_CREATE_TIMEOUT_VERBS = frozenset({"snapshot_sandbox"})
"""Relayed verbs that may take as long as a creation (a snapshot packs a whole layer)."""


def _stream_forwarder(name: str) -> Callable[..., AsyncGenerator[Any, None]]:
    async def forward(
        self: ClusterEdge, sandbox_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        node = node_of_sandbox(sandbox_id)
        stream = self.relay.stream(node, name, sandbox_id, *args, sandbox_id=sandbox_id, **kwargs)
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield item

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` streamed from the node the sandbox id names (``EdgeAPI``)."
    return forward


def _forwarder(name: str) -> Callable[..., Awaitable[Any]]:
    """``name`` relayed to the node its first argument names: a sandbox id, or a request
    holding one (a :class:`SandboxRef`: a verb of the table), which is passed on whole;
    within ``ClusterEdge._relay_timeout``."""

    async def forward(self: ClusterEdge, first: Any, *args: Any, **kwargs: Any) -> Any:
        timeout = self._relay_timeout(name, first)
        if isinstance(first, SandboxRef):
            return await self.relay.on_sandbox(
                first.sandbox_id, name, first, *args, timeout=timeout, route_only=True, **kwargs
            )
        return await self.relay.on_sandbox(first, name, *args, timeout=timeout, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` on the node the sandbox id names (see ``EdgeAPI``)."
    return forward


# Every sandbox verb of the contract that ClusterEdge does not implement itself is relayed
# to the sandbox's node: adding a verb to dsec.contract.edge adds it here.
for _name in sorted(SANDBOX_VERBS - _NODE_SIDE_VERBS - set(vars(ClusterEdge))):
    if _name in STREAM_VERBS:
        setattr(ClusterEdge, _name, _stream_forwarder(_name))
    else:
        setattr(ClusterEdge, _name, _forwarder(_name))
