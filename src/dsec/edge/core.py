"""The edge's core (see :class:`EdgeCore`): what every ability of the edge stands on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dsec.builds.records import BuildRecords
from dsec.config import Paths, host_memory_mb
from dsec.contract.runtime import (
    Audited,
    ExitReporting,
    Handle,
    Reconciling,
    Runtime,
    SandboxFiles,
    SandboxSpec,
)
from dsec.contract.verbs import Envelope
from dsec.edge.admission import CreationGate
from dsec.edge.audit import EdgeAudit
from dsec.edge.createkeys import IdempotentCreates
from dsec.edge.desktop import DesktopSpec
from dsec.edge.limits import EdgeLimits
from dsec.edge.live import LiveTable
from dsec.edge.logs import SandboxLogs
from dsec.edge.metrics import EdgeMetrics
from dsec.edge.ports import PortGateway, TrackedStream
from dsec.edge.quotas import QuotaGuard
from dsec.edge.references import ImageReferences, short_name_registry_from_env
from dsec.edge.registry import Registry, ResolvedRequest, SandboxRow
from dsec.edge.start import StartProcess
from dsec.edge.trajectory import TrajectoryLog
from dsec.errors import (
    DsecError,
    InvalidRequest,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    SequenceGap,
    TierUnavailable,
)
from dsec.images.config import StartCommand
from dsec.layers.source import LayerSource, LazyLayers
from dsec.models import (
    Capabilities,
    CreateSandboxRequest,
    HostReport,
    KeyUsage,
    PauseReport,
    SandboxInfo,
)
from dsec.tiers import require_tier

if TYPE_CHECKING:
    from dsec.builds.engine import ImageBuilder
    from dsec.runtimes.fncall.service import RunCodeService

log = logging.getLogger("dsec.edge")

T = TypeVar("T")


@dataclass
class LiveSandbox:
    """A sandbox this edge holds: its registry row, the runtime's handle, and what the
    verbs keep beside it (its lock, logs, start command, desktop, proxied ports)."""

    row: SandboxRow
    handle: Handle
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: int = 0
    last_pause: PauseReport | None = None
    logs: SandboxLogs | None = None  # the start command's output, if the image has one
    start: StartProcess | None = None
    desktop: DesktopSpec | None = None  # the image's desktop (see _desktop_of)
    desktop_known: bool = False
    ports: set[TrackedStream] = field(default_factory=set)  # open proxied connections
    ports_opening: int = 0
    # the previous usage sample (monotonic seconds, cumulative CPU ns): rates between samples
    last_usage: tuple[float, int] | None = None


def node_name() -> str:
    """A short DNS-safe node name, used inside sandbox ids (``sb-<node>-<random>``)."""
    raw = os.environ.get("DSEC_NODE") or socket.gethostname()
    name = re.sub(r"[^a-z0-9]", "", raw.lower())[:12]
    return name or "node"


def utc_datetime(ts: float) -> datetime:
    """``ts`` (Unix seconds) as an aware UTC datetime; never raises: a timestamp past
    what ``datetime`` can hold (a row stored with a huge TTL) is clamped to
    ``datetime.max``/``datetime.min`` (UTC)."""
    try:
        return datetime.fromtimestamp(ts, UTC)
    except (OverflowError, ValueError, OSError):
        far = datetime.min if ts < 0 else datetime.max  # NaN compares False: max
        return far.replace(tzinfo=UTC)


class EdgeCore:
    """The edge's core: the live table, the registry, admission, use and destroy, the
    trajectory hook, start, close and reconcile. The verbs are its abilities
    (:mod:`dsec.edge.abilities`), composed into :class:`dsec.edge.agent.EdgeAgent`.


    Args:
        paths: where this node keeps its state.
        runtimes: tier name -> runtime (only tiers present here can be created).
        layer_store: the node's images and layers (a :class:`dsec.layers.store.LayerStore`;
            :class:`dsec.testing.MemoryLayers` for tests).
        limits: admission limits.
        node: the node's name in sandbox ids (default :func:`node_name`).
        network: the node's network manager (None: no networking).
        trajectory_path: SQLite file of the trajectory log (default under ``paths.home``).
        cpus, memory_mb: the node's size for admission (default: this machine's).
        unavailable: tiers the node's host rules out, each with why (no runtime is given
            for them; see :func:`dsec.node.prepare_host`).
        host_report: makes the node's host report (``GET /v1/node``'s ``host``; called in a
            thread, its tiers replaced by this edge's own): see :mod:`dsec.hostreport`.
    """

    def __init__(
        self,
        paths: Paths,
        runtimes: dict[str, Runtime],
        layer_store: LayerSource,
        *,
        limits: EdgeLimits | None = None,
        node: str | None = None,
        network: Any = None,
        trajectory_path: Path | None = None,
        cpus: int | None = None,
        memory_mb: int | None = None,
        unavailable: dict[str, str] | None = None,
        host_report: Callable[[], HostReport] | None = None,
    ) -> None:
        self.paths = paths
        self.runtimes = runtimes
        self.audited_tiers = frozenset(t for t, rt in runtimes.items() if isinstance(rt, Audited))
        """Tiers that count their sandboxes' limit hits themselves (``Audited``: asked once,
        not per command; a runtime-checkable protocol's check costs tens of microseconds)."""
        self.unavailable = {t: r for t, r in (unavailable or {}).items() if t not in runtimes}
        self._host_report = host_report
        self.layers = layer_store
        self.network = network  # dsec.network.NetworkManager (started by the edge) or None
        self.limits = limits or EdgeLimits.from_env()
        self.node = node or node_name()
        self.registry = Registry(paths.state_db)
        self.creates = IdempotentCreates(self.registry.create_keys())
        self.trajectory = TrajectoryLog(trajectory_path or paths.home / "trajectory.db")
        self._running_entries: dict[
            tuple[str, int], asyncio.Future[tuple[str, dict[str, Any]]]
        ] = {}
        self.metrics = EdgeMetrics(self.node, self.registry.count_by)
        if isinstance(layer_store, LazyLayers):  # on-demand layer loading counters
            self.metrics.add_lazy_layers(layer_store.lazy_stats)
        self._live: LiveTable[LiveSandbox] = LiveTable()  # with the running totals of requests
        self._builder: ImageBuilder | None = None
        self.code_runner: RunCodeService | None = None
        """The node's run_code service over its fncall tier (made on first use; a test edge
        may set its own, e.g. over a tier that is never started)."""
        self.build_records = BuildRecords()
        self.references = ImageReferences(layer_store, short_names=short_name_registry_from_env())
        self.port_gateway: PortGateway | None = None
        """Where :meth:`port_ticket` parks connections (cluster nodes; None: embedded)."""
        self._reaper: asyncio.Task[None] | None = None
        self._teardowns: set[asyncio.Task[None]] = set()  # kills' teardowns still running
        self._closing = False
        self._closed = False
        # the node's size for admission (default: this machine's; unknown: a small node's)
        self._cpus = cpus or os.cpu_count() or 1
        self._mem_mb = memory_mb or host_memory_mb() or 1024
        self.creations = CreationGate(
            self.limits.create_slots or max(4, 2 * self._cpus),
            max_waiting=self.limits.create_queue,
            max_wait_s=self.limits.create_wait_s,
        )
        """Admission of creations into the runtimes (:mod:`dsec.edge.admission`)."""
        self.key_quotas = QuotaGuard()
        """Each key's quota (:mod:`dsec.edge.quotas`; its ``source`` is set by the server)."""
        self.audit = EdgeAudit()
        """The refusals made on each sandbox's behalf (:mod:`dsec.edge.audit`)."""
        self.audit.calls = lambda sid: self.trajectory.starts(sid, last=3)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.paths.ensure()
        if self.network is not None:
            try:
                await self.network.start()
            except DsecError as e:  # the node still serves sandboxes without networking
                log.error("networking disabled on this node: %s", e.message)
        for rt in self.runtimes.values():
            if isinstance(rt, ExitReporting):
                rt.on_exit(self._sandbox_ended)
            await rt.start()
        self.audit.start(
            any(isinstance(rt, Audited) and rt.log_denials for rt in self.runtimes.values()),
            landlock=any(
                isinstance(rt, Audited) and rt.log_landlock for rt in self.runtimes.values()
            ),
        )
        await self.reconcile()
        for rt in self.runtimes.values():
            if isinstance(rt, Reconciling):
                try:
                    await rt.reconciled()
                except Exception as e:  # a leftover must not stop the edge
                    log.warning("%s: releasing what no sandbox uses failed: %s", rt.tier, e)
        if self.network is not None and self.network.started:
            await self.network.reconcile(set(self._live))
        self._reaper = asyncio.create_task(self._reap_loop(), name="dsec-edge-reaper")

    async def close(self, *, kill_sandboxes: bool = False) -> None:
        """Stop the edge. Sandboxes keep running (a restarted edge recovers them) unless
        ``kill_sandboxes``. Idempotent."""
        if self._closed:
            return
        self._closing = True
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if kill_sandboxes:
            await asyncio.gather(
                *(self._destroy(lv, "edge shutdown") for lv in self._live.values()),
                return_exceptions=True,
            )
        await self.settle()  # no runtime closes under a teardown still running
        for rt in self.runtimes.values():
            with contextlib.suppress(Exception):
                await rt.close()
        if self.network is not None:
            with contextlib.suppress(Exception):
                await self.network.close()
        if self._builder is not None:
            self._builder.close()
        self.audit.close()
        self.registry.close()
        self.trajectory.close()
        self._closed = True

    # ------------------------------------------------------------------ hooks
    # what the core calls and an ability fills in (an EdgeCore alone is never used)
    async def reconcile(self) -> dict[str, int]:
        """Match the registry with what runs (:mod:`dsec.edge.abilities.recovery`)."""
        raise NotImplementedError

    async def _reap_loop(self) -> None:
        """Expire idle sandboxes (:mod:`dsec.edge.abilities.recovery`)."""
        raise NotImplementedError

    async def _resume(self, lv: LiveSandbox) -> None:
        """Resume paused sandbox ``lv`` (:mod:`dsec.edge.abilities.pausing`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _runtime(self, tier: str) -> Runtime:
        rt = self.runtimes.get(tier)
        if rt is None:
            require_tier(tier)  # InvalidRequest: a tier no one registered
            if tier in self.unavailable:
                raise TierUnavailable(
                    f"tier {tier!r} is not available: {self.unavailable[tier]}", tier=tier
                )
            raise TierUnavailable(
                f"tier {tier!r} is not available on node {self.node}",
                tier=tier,
                available=sorted(self.runtimes),
            )
        facts = rt.facts()
        if not facts.available:
            raise TierUnavailable(f"tier {tier!r} is not available: {facts.reason}", tier=tier)
        return rt

    def _info(self, row: SandboxRow, next_seq: int | None = None) -> SandboxInfo:
        spec = row.request
        exp = row.expires_at if row.state in ("running", "creating") else None
        if row.state == "paused" and row.paused_at is not None and spec.paused_ttl_s:
            exp = row.paused_at + spec.paused_ttl_s
        lv = self._live.get(row.id)
        return SandboxInfo(
            id=row.id,
            tier=row.tier,
            image=spec.image,
            layers=spec.layers,
            state=row.state,
            cpu=spec.cpu,
            memory_mb=spec.memory_mb,
            disk_mb=spec.disk_mb,
            pids=spec.pids,
            labels=row.labels,
            job=row.job,
            user=spec.user,
            workdir=spec.workdir,
            node=self.node,
            created_at=utc_datetime(row.created_at),
            updated_at=utc_datetime(row.updated_at),
            expires_at=utc_datetime(exp) if exp is not None else None,
            ttl_s=row.ttl_s,
            stopped_reason=row.stopped_reason,
            on_timeout=spec.on_timeout,
            paused_ttl_s=spec.paused_ttl_s,
            paused_at=utc_datetime(row.paused_at) if row.paused_at else None,
            last_pause=lv.last_pause if lv is not None else None,
            next_seq=self.trajectory.next_seq(row.id) if next_seq is None else next_seq,
            network=spec.network,
            forked_from=row.forked_from,
            public_ports=spec.public_ports,
        )

    def _lookup_row(self, sandbox_id: str, owner: str) -> SandboxRow:
        lv = self._live.get(sandbox_id)
        row = lv.row if lv is not None else self.registry.get(sandbox_id)
        if row is None or row.owner != owner:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return row

    def _live_for(self, sandbox_id: str, owner: str) -> LiveSandbox:
        lv = self._live.get(sandbox_id)
        if lv is None or lv.row.owner != owner:
            row = self._lookup_row(sandbox_id, owner)
            if row.state == "stopped":
                raise SandboxStopped(
                    f"sandbox {sandbox_id} is stopped ({row.stopped_reason or 'killed'})",
                    sandbox_id=sandbox_id,
                    reason=row.stopped_reason,
                )
            raise SandboxStopped(f"sandbox {sandbox_id} is {row.state}", sandbox_id=sandbox_id)
        if lv.row.state not in ("running", "paused"):
            raise SandboxStopped(f"sandbox {sandbox_id} is {lv.row.state}", sandbox_id=sandbox_id)
        return lv

    def _touch(self, lv: LiveSandbox) -> None:
        now = time.time()
        # write through at most once a second per sandbox: activity extends the TTL
        if now - lv.row.last_active > 1.0:
            self.registry.touch(lv.row.id, now)
        lv.row.last_active = now

    async def _use(
        self, sandbox_id: str, owner: str, fn: Callable[[LiveSandbox], Awaitable[T]]
    ) -> T:
        lv = self._live_for(sandbox_id, owner)
        lv.inflight += 1
        self._touch(lv)
        try:
            if lv.row.state == "paused":
                await self._resume(lv)  # any request resumes a paused sandbox
            return await fn(lv)
        except DsecError as e:
            self.metrics.errors.labels(e.code).inc()
            self.audit.refusal(sandbox_id, owner, e)
            # a runtime's SandboxStopped too: the sandbox must not stay "running" after it
            if not await self._still_alive(lv) and not isinstance(e, SandboxStopped):
                raise SandboxStopped(f"sandbox {sandbox_id} died", sandbox_id=sandbox_id) from e
            raise
        finally:
            lv.inflight -= 1
            self._touch(lv)

    def _sandbox_ended(self, sandbox_id: str, why: str) -> None:
        """A runtime's report (:class:`ExitReporting`) that a sandbox ended by itself: it is
        stopped now, not at its next request."""
        if self._closing:
            return
        task = asyncio.create_task(self._died(sandbox_id, why), name=f"dsec-died-{sandbox_id}")
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    async def _died(self, sandbox_id: str, why: str) -> None:
        lv = self._live.get(sandbox_id)
        if lv is None or lv.row.state not in ("running", "paused"):
            return
        log.warning("sandbox %s died: %s", sandbox_id, why)
        await self._destroy(lv, f"sandbox died: {why}")

    async def _still_alive(self, lv: LiveSandbox) -> bool:
        rt = self.runtimes.get(lv.row.tier)
        if rt is None or lv.row.state != "running":
            return False
        try:
            alive = await rt.alive(lv.handle)
        except Exception:
            alive = False
        if not alive:
            await self._destroy(lv, "sandbox died")
        return alive

    def _add_live(self, lv: LiveSandbox) -> None:
        row = lv.row
        self.audit.sandbox_added(
            row.id, row.owner, row.tier, row.job, self.runtimes.get(row.tier), lv.handle
        )
        self._live.add(
            row.id, lv, cpu=row.request.cpu, memory_mb=row.request.memory_mb, owner=row.owner
        )

    def _files(self, lv: LiveSandbox) -> SandboxFiles:
        return self.runtimes[lv.row.tier].files(lv.handle)

    def _check_admission(
        self,
        req: CreateSandboxRequest,
        caps: Capabilities,
        owner: str,
        count: int = 1,
        *,
        rate: bool = False,
    ) -> None:
        """Raise if ``count`` sandboxes like ``req`` do not fit the tier, the node or
        ``owner``'s quota (:mod:`dsec.edge.quotas`); ``rate``: also spend ``count`` of the
        key's creation rate (once per creation: at its first check)."""
        if caps.max_cpu is not None and req.cpu > caps.max_cpu:
            raise InvalidRequest(
                f"cpu={req.cpu} exceeds the {req.tier} tier maximum {caps.max_cpu}"
            )
        if caps.max_memory_mb is not None and req.memory_mb > caps.max_memory_mb:
            raise InvalidRequest(
                f"memory_mb={req.memory_mb} exceeds the {req.tier} tier maximum {caps.max_memory_mb}"
            )
        if req.cpu > self._cpus:
            raise InvalidRequest(f"cpu={req.cpu} is more than this node has ({self._cpus} cores)")
        if req.memory_mb > self._mem_mb:
            raise InvalidRequest(
                f"memory_mb={req.memory_mb} is more than this node has ({self._mem_mb} MiB)"
            )
        self.key_quotas.check(
            owner, self.key_usage_now(owner), cpu=req.cpu, memory_mb=req.memory_mb, count=count
        )
        if len(self._live) + count > self.limits.max_sandboxes:
            raise QuotaExceeded(
                f"node {self.node} is at its limit of {self.limits.max_sandboxes} sandboxes",
                requested=count,
                limit=self.limits.max_sandboxes,
            )
        cpu_sum = self._live.requested_cpu + req.cpu * count
        if cpu_sum > self._cpus * self.limits.cpu_overcommit + 1e-6:
            raise QuotaExceeded(
                f"node {self.node} CPU overcommit cap reached ({cpu_sum:.1f} > {self._cpus * self.limits.cpu_overcommit:.1f} cores requested)",
                requested=count,
            )
        mem_sum = self._live.requested_memory_mb + req.memory_mb * count
        if mem_sum > self._mem_mb * self.limits.memory_overcommit + 1e-6:
            raise QuotaExceeded(
                f"node {self.node} memory overcommit cap reached ({mem_sum} MiB requested)",
                requested=count,
            )
        if rate:
            self.key_quotas.take(owner, count)

    def _spec(
        self,
        sid: str,
        req: ResolvedRequest,
        owner: str,
        digests: list[str],
        layer_paths: list[str],
        *,
        forked: bool = False,
    ) -> SandboxSpec:
        """What the runtime gets to make sandbox ``sid`` of ``req`` over ``digests``. A
        fork's child is named by its id (its siblings and parent are other machines; a
        sandbox created otherwise is ``sandbox``, as the warm pool makes them)."""
        return SandboxSpec.of_request(
            req,
            id=sid,
            hostname=sid[:63] if forked else "sandbox",
            layer_paths=layer_paths,
            layer_digests=digests,
            cpu_group=owner if self.limits.key_cpu_groups else "",
            cpu_group_weight=self.key_quotas.quota(owner).cpu_weight,
            owner=owner,
        )

    def key_usage_now(self, owner: str) -> KeyUsage:
        """What ``owner`` holds on this node (running totals: O(1))."""
        n, cpu, mem = self._live.owner_usage(owner)
        return KeyUsage(sandboxes=n, cpu=round(cpu, 6), memory_mb=mem)

    async def _destroy(self, lv: LiveSandbox, reason: str, *, wait: bool = True) -> None:
        """Stop sandbox ``lv`` for ``reason``. With ``wait=False`` and a runtime whose
        facts say ``teardown_in_background`` (the container tier), the sandbox is stopped
        (its id answers "stopped", its admission share is free) and its teardown started,
        and this returns without waiting for the teardown (``settle`` waits for it): a
        kill then costs ~1 ms instead of the init's reaping, cgroup removal and unmounts."""
        if lv.start is not None:
            await lv.start.stop()
        async with lv.lock:
            if lv.row.state == "stopped":
                return
            rt = self.runtimes.get(lv.row.tier)
            background = not wait and rt is not None and rt.facts().teardown_in_background
            await self.audit.sandbox_stopping(lv.row.id, rt, lv.handle)  # its last samples
            if rt is not None and not background:
                await self._teardown(rt, lv)
            lv.row.state = "stopped"
            lv.row.stopped_reason = reason
            for stream in list(lv.ports):  # the sandbox's proxied connections end with it
                with contextlib.suppress(Exception):
                    await stream.close()
            self.registry.set_state(lv.row.id, "stopped", reason=reason)
            self._live.pop(lv.row.id)
            self.metrics.kills.labels(lv.row.tier, reason.split()[0]).inc()
            if rt is not None and background:
                task = asyncio.create_task(
                    self._teardown(rt, lv), name=f"dsec-teardown-{lv.row.id}"
                )
                self._teardowns.add(task)
                task.add_done_callback(self._teardowns.discard)

    async def _teardown(self, rt: Runtime, lv: LiveSandbox) -> None:
        try:
            await rt.destroy(lv.handle)
        except Exception as e:
            log.error("destroy of %s failed: %s", lv.row.id, e)

    async def settle(self) -> None:
        """Wait until every teardown started by a kill has finished (see ``_destroy``)."""
        while self._teardowns:
            await asyncio.gather(*list(self._teardowns), return_exceptions=True)

    async def _start(
        self, lv: LiveSandbox, rt: Runtime, start: StartCommand, sink_sees_all: bool
    ) -> None:
        """Launch the image's start command in a sandbox (a new one, or again: its logs
        go on); wait for its readiness check."""
        if lv.logs is None:
            lv.logs = SandboxLogs(self.limits.log_bytes)
        else:
            lv.logs.reopen("start command started again")
        lv.start = StartProcess(
            rt,
            lv.handle,
            start,
            lv.row.request.workdir,
            lv.logs,
            sink_sees_all=sink_sees_all,
        )
        lv.start.launch()
        waited = await lv.start.wait_ready()
        if start.ready_cmd is not None:
            log.info("%s: start command ready after %.2f s", lv.row.id, waited)

    # ------------------------------------------------------------------ trajectory
    async def _begin(
        self,
        sandbox_id: str,
        seq: int | None,
        idem_key: str | None,
        op: str,
        request: dict[str, Any],
    ) -> Any:
        """``TrajectoryLog.begin`` that tolerates out-of-order arrival: a seq that skips ahead
        waits up to ``gap_wait_s`` for the missing ones before raising ``SequenceGap``."""
        deadline = time.monotonic() + self.limits.gap_wait_s
        delay = 0.002
        while True:
            try:
                return self.trajectory.begin(sandbox_id, seq, idem_key, op, request)
            except SequenceGap:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)

    async def _logged(
        self,
        lv: LiveSandbox,
        op: str,
        request: dict[str, Any],
        env: Envelope,
        run: Callable[[], Awaitable[T]],
        encode: Callable[[T], dict[str, Any]],
        decode: Callable[[dict[str, Any]], T],
    ) -> T:
        """Run a state-changing call under the trajectory log: a recorded repeat is answered
        from the log; a new one is recorded before its answer leaves the edge."""
        sid = lv.row.id
        b = await self._begin(sid, env.seq, env.idem_key, op, request)
        if b.kind == "replay":
            if b.error is not None:
                raise b.error
            return decode(b.result or {})
        if b.kind == "unknown":
            running = self._running_entries.get((sid, b.seq))
            if running is None:
                raise b.unknown_error()
            status, payload = await asyncio.shield(running)  # the same call, still running here
            if status == "error":
                from dsec.errors import error_from_wire

                raise error_from_wire(409, payload)
            return decode(payload)
        fut: asyncio.Future[tuple[str, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._running_entries[(sid, b.seq)] = fut
        t0 = time.time()
        try:
            result = await run()
        except DsecError as e:
            if isinstance(e, (SandboxStopped, QuotaExceeded, TierUnavailable)):
                self.trajectory.abort(sid, b.seq, e)  # it never ran: the client may retry
            else:
                self.trajectory.commit_error(sid, b.seq, e)
            fut.set_result(("error", e.to_wire()))
            raise
        except BaseException as e:
            err = (
                SandboxError(f"{op} failed: {e}")
                if not isinstance(e, asyncio.CancelledError)
                else SandboxError(f"{op} was cancelled")
            )
            with contextlib.suppress(Exception):
                self.trajectory.commit_error(sid, b.seq, err)
            fut.set_result(("error", err.to_wire()))
            raise
        finally:
            self._running_entries.pop((sid, b.seq), None)
        payload = encode(result)
        self.trajectory.commit(
            sid, b.seq, payload, {"started_at": t0, "run_ms": (time.time() - t0) * 1000}
        )
        fut.set_result(("ok", payload))
        return result


def json_dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")
