"""The edge agent: the one process per node that owns sandboxes.

It makes the final admission decision (limits, node capacity), resolves images into
layers, asks the tier's runtime to create the sandbox, keeps the durable registry,
expires idle sandboxes, and on start reconciles the registry with what actually runs
(live sandboxes stay usable, dead ones and orphans are cleaned up).

It implements :class:`dsec.edge.interface.EdgeAPI`; the apiserver calls it directly in
embedded mode (``dsec serve``) and through a remote transport in cluster mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dsec.builds.records import BuildList, BuildRecord, BuildRecords
from dsec.config import Paths, host_memory_mb
from dsec.display import DisplayAction, DisplayState, Screen, WindowInfo
from dsec.edge.admission import CreationGate
from dsec.edge.audit import EdgeAudit, interleave_audit, place_entries
from dsec.edge.desktop import (
    STOP_SCRIPT,
    ConsoleScreen,
    DesktopSpec,
    ExecDesktop,
    ScreenDriver,
    Windowed,
    desktop_spec,
)
from dsec.edge.interface import DirectoryWatcher, NodeUsage, PortStream, PortTicket
from dsec.edge.jobs import create_batch, for_each_sandbox
from dsec.edge.live import LiveTable
from dsec.edge.logs import SandboxLogs, log_bytes_from_env
from dsec.edge.metrics import EdgeMetrics
from dsec.edge.ports import PortGateway, TrackedStream, check_port
from dsec.edge.quotas import QuotaGuard, code_run_size
from dsec.edge.references import ImageReferences, short_name_registry_from_env
from dsec.edge.registry import Registry, SandboxRow
from dsec.edge.start import StartProcess, start_command_of, with_image_defaults
from dsec.edge.trajectory import TrajectoryLog
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    ImageNotFound,
    InternalError,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    SequenceGap,
    TierUnavailable,
    TooManyConnections,
)
from dsec.images.config import StartCommand
from dsec.layers.desktop import DISPLAY_LABEL
from dsec.layers.source import LayerSource, LazyLayers, RegistryLayers
from dsec.layers.workspace import check_stack
from dsec.models import (
    SYSTEM_OWNER,
    TIERS,
    AuditEntry,
    AuditReport,
    AuditSummary,
    BatchCreateResult,
    BuildImageRequest,
    Capabilities,
    CodeRunRequest,
    CodeRunResult,
    CpuMetrics,
    CreateSandboxRequest,
    DiskMetrics,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ForkRequest,
    ForkResult,
    HostReport,
    HostTier,
    ImageInfo,
    JobAction,
    JobActionResult,
    JobAudit,
    JobOutcome,
    KeyUsage,
    LayerInfo,
    LogLine,
    MemoryMetrics,
    MigrateResult,
    NetworkMetrics,
    NodeInfo,
    PauseReport,
    PushImageResult,
    RunCodeRequest,
    RunCodeResponse,
    SandboxInfo,
    SandboxMetrics,
    SnapshotRequest,
)
from dsec.runtimes.base import (
    Display,
    ExitReporting,
    FilesystemPause,
    Handle,
    Interactive,
    Measurable,
    MemoryStateful,
    Networked,
    Pausable,
    PortConnectable,
    Reconciling,
    Runtime,
    SandboxFiles,
    SandboxSpec,
    Snapshottable,
    UpperForkable,
    WatchableFiles,
    XattrFiles,
    capabilities_of,
)
from dsec.version import __version__

if TYPE_CHECKING:
    from dsec.builds.engine import ImageBuilder
    from dsec.builds.wire import BuildEvent, BuildRequest
    from dsec.runtimes.fncall.service import CodeRunAdmission, RunCodeService

log = logging.getLogger("dsec.edge")

T = TypeVar("T")


@dataclass
class EdgeLimits:
    """Node admission limits. Overcommit is expected: most sandboxes idle while the model thinks."""

    max_sandboxes: int = 4096
    cpu_overcommit: float = 10.0  # sum of requested cores <= this x physical cores
    memory_overcommit: float = 1.5  # sum of requested memory <= this x physical memory
    max_read_bytes: int = 256 << 20
    max_tar_bytes: int = 1 << 30
    stopped_retention_s: float = 3600.0
    reap_interval_s: float = 1.0
    gap_wait_s: float = 5.0  # how long a seq that skips ahead waits for the missing ones
    job_concurrency: int = 64
    create_concurrency: int = 8  # creations in flight per batch call
    image_wait_s: float = 20.0  # a create waits this long for a built-in image being built
    max_build_context_bytes: int = 256 << 20  # an uploaded build context, bytes
    max_build_bytes: int = 4 << 30  # what a build context may unpack to, bytes
    max_build_entries: int = 500_000  # files, directories and links in a build context
    log_bytes: int = 1 << 20  # start-command output kept per sandbox (its logs), bytes
    max_port_connections: int = 256  # open proxied connections per sandbox (429 beyond)
    create_slots: int = 0  # creations in the runtime at once (0: twice the cores, at least 4)
    create_queue: int = 10_000  # creations waiting for a slot (503 node_busy beyond)
    create_wait_s: float = 900.0  # longest wait for a slot (503 node_busy after it)
    key_cpu_groups: bool = False  # each key's sandboxes share one weighted cgroup (quotas.py)

    @classmethod
    def from_env(cls) -> EdgeLimits:
        """Defaults, overridden by ``DSEC_MAX_SANDBOXES``, ``DSEC_CPU_OVERCOMMIT``,
        ``DSEC_MEMORY_OVERCOMMIT``, ``DSEC_IMAGE_WAIT_S`` (seconds a create waits for a
        built-in image being built), ``DSEC_MAX_BUILD_CONTEXT_BYTES``,
        ``DSEC_MAX_BUILD_BYTES``, ``DSEC_CREATE_SLOTS``/``DSEC_CREATE_QUEUE``/
        ``DSEC_CREATE_WAIT_S`` (:mod:`dsec.edge.admission`), ``DSEC_KEY_CPU_GROUPS``
        (``on``: a key's sandboxes share one cgroup of its ``cpu_weight``,
        :mod:`dsec.edge.quotas`; off by default),
        ``DSEC_MAX_PORT_CONNECTIONS``
        (open proxied connections per sandbox) and ``DSEC_LOG_BYTES`` (start-command output
        kept per sandbox): the operator settings of ``dsec serve``."""
        lim = cls()
        env = os.environ
        try:
            if "DSEC_MAX_SANDBOXES" in env:
                lim.max_sandboxes = int(env["DSEC_MAX_SANDBOXES"])
            if "DSEC_CPU_OVERCOMMIT" in env:
                lim.cpu_overcommit = float(env["DSEC_CPU_OVERCOMMIT"])
            if "DSEC_MEMORY_OVERCOMMIT" in env:
                lim.memory_overcommit = float(env["DSEC_MEMORY_OVERCOMMIT"])
            if "DSEC_IMAGE_WAIT_S" in env:
                lim.image_wait_s = float(env["DSEC_IMAGE_WAIT_S"])
            if "DSEC_MAX_BUILD_CONTEXT_BYTES" in env:
                lim.max_build_context_bytes = int(env["DSEC_MAX_BUILD_CONTEXT_BYTES"])
            if "DSEC_MAX_BUILD_BYTES" in env:
                lim.max_build_bytes = int(env["DSEC_MAX_BUILD_BYTES"])
            lim.log_bytes = log_bytes_from_env()
            if "DSEC_MAX_PORT_CONNECTIONS" in env:
                lim.max_port_connections = int(env["DSEC_MAX_PORT_CONNECTIONS"])
            if "DSEC_CREATE_SLOTS" in env:
                lim.create_slots = int(env["DSEC_CREATE_SLOTS"])
            if "DSEC_CREATE_QUEUE" in env:
                lim.create_queue = int(env["DSEC_CREATE_QUEUE"])
            if "DSEC_CREATE_WAIT_S" in env:
                lim.create_wait_s = float(env["DSEC_CREATE_WAIT_S"])
            raw = env.get("DSEC_KEY_CPU_GROUPS", "off").strip().lower()
            if raw not in ("on", "off", "1", "0"):
                raise ValueError(f"DSEC_KEY_CPU_GROUPS must be on or off, not {raw!r}")
            lim.key_cpu_groups = raw in ("on", "1")
        except ValueError as e:
            raise SystemExit(f"invalid edge limit in the environment: {e}") from e
        return lim


@dataclass
class _Live:
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


def _now_dt(ts: float) -> datetime:
    """``ts`` (Unix seconds) as an aware UTC datetime; never raises: a timestamp past
    what ``datetime`` can hold (a row stored with a huge TTL) is clamped to
    ``datetime.max``/``datetime.min`` (UTC)."""
    try:
        return datetime.fromtimestamp(ts, UTC)
    except (OverflowError, ValueError, OSError):
        far = datetime.min if ts < 0 else datetime.max  # NaN compares False: max
        return far.replace(tzinfo=UTC)


MAX_XATTR_PATHS = 100_000
MAX_XATTRS = 64
MAX_XATTR_NAME_BYTES = 255
MAX_XATTR_VALUE_BYTES = 4096


def _check_xattrs(values: dict[str, str], clear_prefix: str | None) -> None:
    """Refuse anything but a few small ``user.*`` attributes (InvalidRequest)."""
    if len(values) > MAX_XATTRS:
        raise InvalidRequest(f"at most {MAX_XATTRS} extended attributes per file")
    if clear_prefix is not None and not clear_prefix.startswith("user."):
        raise InvalidRequest("only user.* extended attributes can be cleared")
    for name, value in values.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidRequest("extended attribute names and values are strings")
        if not name.startswith("user.") or len(name) <= 5 or "\0" in name:
            raise InvalidRequest(f"invalid extended attribute name {name!r} (user.<name>)")
        if len(name.encode()) > MAX_XATTR_NAME_BYTES:
            raise InvalidRequest(f"extended attribute name {name[:40]!r}... is too long")
        if len(value.encode()) > MAX_XATTR_VALUE_BYTES:
            raise InvalidRequest(
                f"extended attribute {name!r} is over {MAX_XATTR_VALUE_BYTES} bytes"
            )


class EdgeAgent:
    """Embedded edge. Construct, ``await start()``, use, ``await close()``.

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
        self.unavailable = {t: r for t, r in (unavailable or {}).items() if t not in runtimes}
        self._host_report = host_report
        self.layers = layer_store
        self.network = network  # dsec.network.NetworkManager (started by the edge) or None
        self.limits = limits or EdgeLimits.from_env()
        self.node = node or node_name()
        self.registry = Registry(paths.state_db)
        self.trajectory = TrajectoryLog(trajectory_path or paths.home / "trajectory.db")
        self._running_entries: dict[
            tuple[str, int], asyncio.Future[tuple[str, dict[str, Any]]]
        ] = {}
        self.metrics = EdgeMetrics(self.node, self.registry.count_by)
        if isinstance(layer_store, LazyLayers):  # on-demand layer loading counters
            self.metrics.add_lazy_layers(layer_store.lazy_stats)
        self._live: LiveTable[_Live] = LiveTable()  # with the running totals of requests
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
        self.audit.start(any(getattr(rt, "log_denials", False) for rt in self.runtimes.values()))
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

    async def reconcile(self) -> dict[str, int]:
        """Match the registry with reality after a (re)start. Returns counts for the log."""
        recovered = lost = orphans = 0
        for row in self.registry.select(states=("creating", "running", "paused")):
            rt = self.runtimes.get(row.tier)
            handle = Handle(row.id, row.handle)
            ok = False
            if rt is not None and row.state != "creating":
                try:
                    # a VM suspended to a file stays suspended: the next request restores it
                    suspended = isinstance(rt, MemoryStateful) and rt.is_suspended(handle)
                    if row.state == "paused" and isinstance(rt, Pausable) and not suspended:
                        # thaw before the exec path re-attaches (a frozen cgroup would freeze it);
                        # the TTL policy pauses it again if it stays idle
                        with contextlib.suppress(Exception):
                            await rt.resume(handle)
                        row.state = "running"
                        row.paused_at = None
                        self.registry.set_paused(row.id, None)
                    ok = await rt.recover(handle)
                except Exception as e:  # a broken sandbox must not stop the edge
                    log.warning("recover %s failed: %s", row.id, e)
            if ok:
                row.handle = handle.state
                self.registry.set_state(row.id, row.state, handle=handle.state)
                self._add_live(_Live(row, handle))
                # a store migrated from before owners grants loose layers to nobody: a live
                # sandbox's layers stay its owner's (for forks and snapshots of it)
                with contextlib.suppress(DsecError):
                    self.layers.grant_layers(row.owner, list(row.image_layers))
                recovered += 1
            else:
                if rt is not None:
                    with contextlib.suppress(Exception):
                        await rt.destroy(handle)
                reason = (
                    "creation interrupted by edge restart"
                    if row.state == "creating"
                    else "lost while the edge was down"
                )
                self.registry.set_state(row.id, "stopped", reason=reason)
                self.metrics.kills.labels(row.tier, "lost").inc()
                lost += 1
        known = set(self._live)
        for rt in self.runtimes.values():
            try:
                for sid in await rt.list_orphans(known):
                    with contextlib.suppress(Exception):
                        await rt.destroy_orphan(sid)
                        orphans += 1
            except Exception as e:
                log.warning("orphan scan of %s failed: %s", rt.tier, e)
        if recovered or lost or orphans:
            log.info(
                "reconcile: %d recovered, %d lost, %d orphans removed", recovered, lost, orphans
            )
        return {"recovered": recovered, "lost": lost, "orphans": orphans}

    async def _reap_loop(self) -> None:
        last_purge = 0.0
        while not self._closing:
            await asyncio.sleep(self.limits.reap_interval_s)
            now = time.time()
            try:
                for lv in self._live.values():
                    if lv.inflight or lv.lock.locked():
                        continue
                    row = lv.row
                    if row.state == "paused":
                        pttl = row.request.get("paused_ttl_s")
                        if (
                            pttl is not None
                            and row.paused_at is not None
                            and row.paused_at + pttl < now
                        ):
                            await self._destroy(lv, "paused ttl expired", wait=False)
                        continue
                    exp = row.expires_at
                    if exp is None or exp >= now or row.state != "running":
                        continue
                    rt = self.runtimes.get(row.tier)
                    if row.request.get("on_timeout") == "pause" and isinstance(rt, Pausable):
                        try:
                            # VM tiers: suspend to a file (host memory freed), others: freeze;
                            # timeout_pause=filesystem: only the files are kept
                            if row.request.get("timeout_pause") == "filesystem":
                                mode = "filesystem"
                            else:
                                mode = "suspend" if isinstance(rt, MemoryStateful) else "auto"
                            await self._pause(lv, mode)
                        except Exception as e:
                            log.warning("ttl pause of %s failed (%s); killing it", row.id, e)
                            await self._destroy(lv, "ttl expired", wait=False)
                    else:
                        await self._destroy(lv, "ttl expired", wait=False)
                if now - last_purge > 60:
                    for sid in self.registry.purge_stopped(now - self.limits.stopped_retention_s):
                        self.trajectory.purge(sid)
                        self.audit.recorder.forget((sid,))
                    last_purge = now
            except Exception:
                log.exception("reaper iteration failed")

    # ------------------------------------------------------------------ helpers
    def _runtime(self, tier: str) -> Runtime:
        rt = self.runtimes.get(tier)
        if rt is None:
            if tier not in TIERS:
                raise InvalidRequest(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
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
        req = row.request
        exp = row.expires_at if row.state in ("running", "creating") else None
        if row.state == "paused" and row.paused_at is not None and req.get("paused_ttl_s"):
            exp = row.paused_at + float(req["paused_ttl_s"])
        lv = self._live.get(row.id)
        return SandboxInfo(
            id=row.id,
            tier=row.tier,
            image=req.get("image", ""),
            layers=req.get("layers", []),
            state=row.state,
            cpu=req.get("cpu", 1.0),
            memory_mb=req.get("memory_mb", 0),
            disk_mb=req.get("disk_mb", 0),
            pids=req.get("pids", 1024),
            labels=row.labels,
            job=row.job,
            user=req.get("user"),
            workdir=req.get("workdir", "/"),
            node=self.node,
            created_at=_now_dt(row.created_at),
            updated_at=_now_dt(row.updated_at),
            expires_at=_now_dt(exp) if exp is not None else None,
            ttl_s=row.ttl_s,
            stopped_reason=row.stopped_reason,
            on_timeout=req.get("on_timeout", "kill"),
            paused_ttl_s=req.get("paused_ttl_s"),
            paused_at=_now_dt(row.paused_at) if row.paused_at else None,
            last_pause=lv.last_pause if lv is not None else None,
            next_seq=self.trajectory.next_seq(row.id) if next_seq is None else next_seq,
            network=req.get("network"),
            forked_from=row.forked_from,
            public_ports=bool(req.get("public_ports", False)),
        )

    def _lookup_row(self, sandbox_id: str, owner: str) -> SandboxRow:
        lv = self._live.get(sandbox_id)
        row = lv.row if lv is not None else self.registry.get(sandbox_id)
        if row is None or row.owner != owner:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return row

    def _live_for(self, sandbox_id: str, owner: str) -> _Live:
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

    def _touch(self, lv: _Live) -> None:
        now = time.time()
        # write through at most once a second per sandbox: activity extends the TTL
        if now - lv.row.last_active > 1.0:
            self.registry.touch(lv.row.id, now)
        lv.row.last_active = now

    async def _use(self, sandbox_id: str, owner: str, fn: Callable[[_Live], Awaitable[T]]) -> T:
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

    async def _still_alive(self, lv: _Live) -> bool:
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

    def _add_live(self, lv: _Live) -> None:
        req = lv.row.request
        row = lv.row
        self.audit.sandbox_added(
            row.id, row.owner, row.tier, row.job, self.runtimes.get(row.tier), lv.handle
        )
        self._live.add(
            lv.row.id,
            lv,
            cpu=float(req.get("cpu", 0) or 0),
            memory_mb=int(req.get("memory_mb", 0) or 0),
            owner=lv.row.owner,
        )

    def _files(self, lv: _Live) -> SandboxFiles:
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

    async def _destroy(self, lv: _Live, reason: str, *, wait: bool = True) -> None:
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

    async def _teardown(self, rt: Runtime, lv: _Live) -> None:
        try:
            await rt.destroy(lv.handle)
        except Exception as e:
            log.error("destroy of %s failed: %s", lv.row.id, e)

    async def settle(self) -> None:
        """Wait until every teardown started by a kill has finished (see ``_destroy``)."""
        while self._teardowns:
            await asyncio.gather(*list(self._teardowns), return_exceptions=True)

    # ------------------------------------------------------------------ sandboxes
    async def create_sandbox(
        self,
        req: CreateSandboxRequest,
        owner: str,
        *,
        maker: Callable[[SandboxSpec], Awaitable[Handle]] | None = None,
        forked_from: str | None = None,
    ) -> SandboxInfo:
        """Create a sandbox; ``maker`` (memory forks) replaces ``runtime.create``;
        ``forked_from``: the sandbox a fork comes from (shown in its info)."""
        t0 = time.perf_counter()
        tier = req.tier
        try:
            rt = self._runtime(tier)
            caps = capabilities_of(rt)
            if req.timeout_pause == "filesystem" and not caps.pause_filesystem:
                raise CapabilityNotSupported(
                    f"the {tier} tier on node {self.node} has no filesystem-only pause "
                    "(timeout_pause='filesystem')",
                    tier=tier,
                )
            if req.network is not None and not caps.network:
                raise CapabilityNotSupported(
                    f"the {tier} tier on node {self.node} cannot give sandboxes a network "
                    "(create with network=None, or use a tier whose capabilities say network)",
                    tier=tier,
                )
            self._check_admission(req, caps, owner, rate=True)
            image = await self._image(req.image, owner, self.limits.image_wait_s)
            req = with_image_defaults(req, image)
            extra: list[LayerInfo] = (
                self.layers.resolve_layers(req.layers, owner) if req.layers else []
            )
            digests = list(image.layers) + [x.digest for x in extra]
            check_stack([self.layers.get_layer(d) for d in digests])  # before any mount
            if all(self.layers.is_local(d) for d in digests):
                layer_paths = [str(self.layers.layer_path(d)) for d in digests]
            else:  # a lazy layer may start the node's FUSE server (~1 s): not on the loop
                layer_paths = await asyncio.to_thread(
                    lambda: [str(self.layers.layer_path(d)) for d in digests]
                )
        except DsecError as e:
            self.metrics.creations.labels(tier, "rejected").inc()
            self.metrics.errors.labels(e.code).inc()
            raise
        # a sandbox with public ports: its id is the secret of its URLs (96 random bits)
        sid = f"sb-{self.node}-{secrets.token_hex(12 if req.public_ports else 6)}"
        now = time.time()
        row = SandboxRow(
            id=sid,
            owner=owner,
            tier=tier,
            state="creating",
            request=req.model_dump(mode="json"),
            image_layers=digests,
            job=req.job,
            labels=dict(req.labels),
            created_at=now,
            updated_at=now,
            last_active=now,
            ttl_s=req.ttl_s,
            forked_from=forked_from,
        )
        try:  # re-checked now: other creations may have been admitted during the awaits above
            self._check_admission(req, caps, owner)
        except DsecError as e:
            self.metrics.creations.labels(tier, "rejected").inc()
            self.metrics.errors.labels(e.code).inc()
            raise
        self.registry.insert(row)
        lv = _Live(row, Handle(sid), desktop=desktop_spec(image), desktop_known=True)
        self._add_live(lv)
        spec = self._spec(sid, req, owner, digests, layer_paths, forked=forked_from is not None)
        t_admitted = time.perf_counter()
        try:
            async with lv.lock, self.creations.slot(owner):
                t_slot = time.perf_counter()
                handle = await (maker(spec) if maker is not None else rt.create(spec))
                lv.handle = handle
                self.audit.bind(sid, rt, handle)
                row.state = "running"
                row.last_active = time.time()
                # one commit: the state, the handle and the activity time
                self.registry.set_state(
                    sid, "running", handle=handle.state, last_active=row.last_active
                )
            t_made = time.perf_counter()
        except BaseException as e:
            self._live.pop(sid)
            self.audit.discard(sid)
            with contextlib.suppress(Exception):
                await rt.destroy(lv.handle)
            reason = f"creation failed: {e}"[:500]
            self.registry.set_state(sid, "stopped", reason=reason)
            self.metrics.creations.labels(tier, "failed").inc()
            if isinstance(e, DsecError):
                self.metrics.errors.labels(e.code).inc()
                raise
            if isinstance(e, asyncio.CancelledError):
                raise
            log.exception("create %s failed", sid)
            raise SandboxError(f"could not create sandbox: {e}", sandbox_id=sid) from e
        start = start_command_of(image) if maker is None and req.start else None
        if start is not None:
            try:
                await self._start(lv, rt, start, rt.facts().sink_sees_all_output)
            except BaseException as e:
                await self._destroy(lv, "start command failed")
                self.metrics.creations.labels(tier, "failed").inc()
                if isinstance(e, DsecError):
                    self.metrics.errors.labels(e.code).inc()
                raise
        self.metrics.creations.labels(tier, "ok").inc()
        t_end = time.perf_counter()
        self.metrics.create_seconds.labels(tier).observe(t_end - t0)
        phases = self.metrics.create_phase_seconds
        phases.labels(tier, "admit").observe(t_admitted - t0)
        phases.labels(tier, "queue").observe(t_slot - t_admitted)
        phases.labels(tier, "runtime").observe(t_made - t_slot)
        phases.labels(tier, "start").observe(t_end - t_made)
        return self._info(row)

    def _spec(
        self,
        sid: str,
        req: CreateSandboxRequest,
        owner: str,
        digests: list[str],
        layer_paths: list[str],
        *,
        forked: bool = False,
    ) -> SandboxSpec:
        """What the runtime gets to make sandbox ``sid`` of ``req`` over ``digests``. A
        fork's child is named by its id (its siblings and parent are other machines; a
        sandbox created otherwise is ``sandbox``, as the warm pool makes them)."""
        return SandboxSpec(
            id=sid,
            hostname=sid[:63] if forked else "sandbox",
            tier=req.tier,
            layer_paths=layer_paths,
            layer_digests=digests,
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            disk_mb=req.disk_mb,
            pids=req.pids,
            env=dict(req.env),
            user=req.user,
            workdir=req.workdir or "/",
            labels=dict(req.labels),
            network=req.network,
            full_guest=req.full_guest,
            allow_setuid=req.allow_setuid,
            cpu_group=owner if self.limits.key_cpu_groups else "",
            cpu_group_weight=self.key_quotas.quota(owner).cpu_weight,
            owner=owner,
        )

    async def _image(self, name: str, owner: str, wait_s: float | None) -> ImageInfo:
        """The image ``owner`` means by ``name``: its own, a system one (a built-in is built
        on first use), or a registry reference pulled on first use
        (:mod:`dsec.edge.references`)."""
        try:
            return await self.layers.ensure_image(name, owner, wait_s=wait_s)
        except ImageNotFound as missing:
            try:
                wanted = self.references.wanted(name)
            except DsecError:
                raise missing from None
            if wanted is None:
                raise
        return await self.references.resolve(name, owner, wait_s=wait_s)

    async def image_by_reference(self, owner: str, ref: str) -> ImageInfo:
        """``owner``'s image of the registry reference ``ref``, pulled if this node has no
        copy (for builds ``FROM`` a registry image: they wait for the pull)."""
        return await self.references.resolve(ref, owner, wait_s=None)

    async def _start(
        self, lv: _Live, rt: Runtime, start: StartCommand, sink_sees_all: bool
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
            lv.row.request.get("workdir") or "/",
            lv.logs,
            sink_sees_all=sink_sees_all,
        )
        lv.start.launch()
        waited = await lv.start.wait_ready()
        if start.ready_cmd is not None:
            log.info("%s: start command ready after %.2f s", lv.row.id, waited)

    async def create_sandboxes(
        self, req: CreateSandboxRequest, n: int, owner: str, *, all_or_nothing: bool = False
    ) -> BatchCreateResult:
        """Create ``n`` sandboxes like ``req`` (see :func:`dsec.edge.jobs.create_batch`).

        A batch that can never fit this node (``n`` above its sandbox limit), or with
        ``all_or_nothing`` one that does not fit now, is refused up front (QuotaExceeded)."""
        caps = capabilities_of(self._runtime(req.tier))
        if n > self.limits.max_sandboxes:
            raise QuotaExceeded(
                f"a batch of {n} is more than node {self.node} can ever hold "
                f"({self.limits.max_sandboxes} sandboxes)",
                batch_size=n,
            )
        if all_or_nothing:
            self._check_admission(req, caps, owner, count=n)
        return await create_batch(
            n,
            lambda _i: self.create_sandbox(req, owner),
            lambda sid: self.kill_sandbox(sid, owner),
            all_or_nothing=all_or_nothing,
            concurrency=self.limits.create_concurrency,
        )

    async def get_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        return self._info(self._lookup_row(sandbox_id, owner))

    async def list_sandboxes(
        self,
        owner: str,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> list[SandboxInfo]:
        if state is not None:
            states: tuple[str, ...] | None = (state,)
        elif include_stopped:
            states = None
        else:
            states = ("creating", "running", "paused")
        rows = []
        for r in self.registry.select(owner=owner, states=states, job=job):
            lv = self._live.get(r.id)
            row = lv.row if lv is not None else r
            if labels and any(row.labels.get(k) != v for k, v in labels.items()):
                continue
            rows.append(row)
        seqs = self.trajectory.next_seqs([r.id for r in rows])  # one query, not one per row
        return [self._info(row, seqs[row.id]) for row in rows]

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        row = self._lookup_row(sandbox_id, owner)
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self._destroy(lv, "killed by request", wait=False)
            row = lv.row
        info = self._info(self.registry.get(sandbox_id) or row)
        if self.audit.enabled:
            info.audit = self.audit.recorder.summary(sandbox_id, row.tier, row.job)
        return info

    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo:
        """Set the idle timeout to ``ttl_s`` seconds from now; ``InvalidRequest`` unless
        0 < ``ttl_s`` <= 30 days (the bound ``CreateSandboxRequest`` has)."""
        max_ttl_s = 30 * 24 * 3600
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, int | float)
            or not 0 < ttl_s <= max_ttl_s
        ):
            raise InvalidRequest(
                f"ttl_s={ttl_s!r} must be > 0 and <= {max_ttl_s} seconds (30 days)"
            )
        lv = self._live_for(sandbox_id, owner)
        self.registry.set_ttl(sandbox_id, ttl_s)
        lv.row.ttl_s = ttl_s
        lv.row.last_active = time.time()
        return self._info(lv.row)

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
        lv: _Live,
        op: str,
        request: dict[str, Any],
        seq: int | None,
        idem_key: str | None,
        run: Callable[[], Awaitable[T]],
        encode: Callable[[T], dict[str, Any]],
        decode: Callable[[dict[str, Any]], T],
    ) -> T:
        """Run a state-changing call under the trajectory log: a recorded repeat is answered
        from the log; a new one is recorded before its answer leaves the edge."""
        sid = lv.row.id
        b = await self._begin(sid, seq, idem_key, op, request)
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
        return await self._exec(sandbox_id, owner, req, None, seq, idem_key)

    async def _exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        sink: Callable[[str, bytes], Awaitable[None]] | None,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> ExecResult:
        request = req.model_dump(mode="json", exclude_defaults=True)

        async def run(lv: _Live) -> ExecResult:
            rt = self.runtimes[lv.row.tier]
            if lv.row.request.get("workdir") and req.cwd is None:
                req.cwd = lv.row.request["workdir"]

            async def go() -> ExecResult:
                t0 = time.perf_counter()
                try:
                    res = await rt.exec(lv.handle, req, sink)
                except DsecError:
                    self.metrics.execs.labels(lv.row.tier, "error").inc()
                    raise
                self.metrics.exec_seconds.labels(lv.row.tier).observe(time.perf_counter() - t0)
                self.audit.exec_result(lv.row.id, res, req.cmd)
                outcome = (
                    "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
                )
                self.metrics.execs.labels(lv.row.tier, outcome).inc()
                return res

            return await self._logged(
                lv,
                "exec",
                request,
                seq,
                idem_key,
                go,
                lambda r: r.model_dump(mode="json", exclude={"replayed"}),
                lambda d: ExecResult.model_validate({**d, "replayed": True}),
            )

        return await self._use(sandbox_id, owner, run)

    async def exec_stream(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> AsyncIterator[ExecEvent]:
        # validate before the first event so errors become proper HTTP errors
        self._live_for(sandbox_id, owner)
        queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue(maxsize=256)

        async def sink(stream: str, chunk: bytes) -> None:
            await queue.put(ExecEvent(type=stream, data=chunk.decode("utf-8", errors="replace")))

        async def runner() -> None:
            try:
                res = await self._exec(sandbox_id, owner, req, sink, seq, idem_key)
                if res.replayed:  # nothing ran: give the recorded output as one chunk each
                    if res.stdout:
                        await queue.put(ExecEvent(type="stdout", data=res.stdout))
                    if res.stderr:
                        await queue.put(ExecEvent(type="stderr", data=res.stderr))
                await queue.put(ExecEvent(type="exit", result=res))
            except DsecError as e:
                await queue.put(ExecEvent(type="error", error=e.to_wire()["error"]))
            except Exception as e:  # pragma: no cover - reported to the client, logged here
                log.exception("exec stream failed")
                await queue.put(
                    ExecEvent(
                        type="error",
                        error=InternalError(
                            f"exec failed on the node ({type(e).__name__}); the node logged it"
                        ).to_wire()["error"],
                    )
                )
            finally:
                await queue.put(None)

        task = asyncio.create_task(runner())
        try:
            while True:
                ev = await queue.get()
                if ev is None:
                    break
                yield ev
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ------------------------------------------------------------------ files
    async def read_file(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("read").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._files(lv).read(path, self.limits.max_read_bytes)
        )

    async def _logged_file_op(
        self,
        sandbox_id: str,
        owner: str,
        op: str,
        request: dict[str, Any],
        seq: int | None,
        idem_key: str | None,
        fn: Callable[[SandboxFiles], Awaitable[T]],
        encode: Callable[[T], dict[str, Any]],
        decode: Callable[[dict[str, Any]], T],
    ) -> T:
        self.metrics.file_ops.labels(op).inc()

        async def run(lv: _Live) -> T:
            files = self._files(lv)
            return await self._logged(
                lv, op, request, seq, idem_key, lambda: fn(files), encode, decode
            )

        return await self._use(sandbox_id, owner, run)

    async def write_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._check_path(sandbox_id, owner, path)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"mode {mode:o} is not a permission mode")
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "write_file",
            {"path": path, "mode": mode, "data": data},
            seq,
            idem_key,
            lambda f: f.write(path, data, mode),
            _dump,
            FileInfo.model_validate,
        )

    def _xattr_files(self, lv: _Live) -> XattrFiles:
        files = self._files(lv)
        if not isinstance(files, XattrFiles):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot keep extended attributes on files",
                tier=lv.row.tier,
            )
        return files

    async def get_xattrs(
        self, sandbox_id: str, owner: str, paths: list[str], prefix: str = "user."
    ) -> list[dict[str, str]]:
        """See :class:`dsec.edge.interface.FileXattrs`."""
        if not prefix.startswith("user."):
            raise InvalidRequest("only user.* extended attributes are readable")
        if len(paths) > MAX_XATTR_PATHS:
            raise InvalidRequest(f"at most {MAX_XATTR_PATHS} paths per call")
        for path in paths:
            self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("get_xattrs").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._xattr_files(lv).get_xattrs(paths, prefix)
        )

    async def set_xattrs(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        values: dict[str, str],
        *,
        clear_prefix: str | None = None,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> None:
        """See :class:`dsec.edge.interface.FileXattrs`."""
        self._check_path(sandbox_id, owner, path)
        _check_xattrs(values, clear_prefix)

        async def run(lv: _Live) -> None:
            files = self._xattr_files(lv)
            await self._logged(
                lv,
                "set_xattrs",
                {"path": path, "values": values, "clear_prefix": clear_prefix},
                seq,
                idem_key,
                lambda: files.set_xattrs(path, values, clear_prefix),
                lambda _r: {},
                lambda _d: None,
            )

        self.metrics.file_ops.labels("set_xattrs").inc()
        await self._use(sandbox_id, owner, run)

    async def watch_directory(
        self, sandbox_id: str, owner: str, path: str, *, recursive: bool = False
    ) -> DirectoryWatcher:
        """See :class:`dsec.edge.interface.DirectoryWatch`: the tier's kernel watch, opened
        without resuming the sandbox or counting as its activity."""
        self._check_path(sandbox_id, owner, path)
        lv = self._live_for(sandbox_id, owner)
        files = self._files(lv)
        if not isinstance(files, WatchableFiles):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot watch directories", tier=lv.row.tier
            )
        self.metrics.file_ops.labels("watch").inc()
        return await files.watch(path, recursive)

    async def list_files(
        self, sandbox_id: str, owner: str, path: str, depth: int = 1
    ) -> list[FileInfo]:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("list").inc()
        if not 1 <= depth <= 32:
            raise InvalidRequest("depth must be between 1 and 32")
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).list(path, depth))

    async def stat_file(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("stat").inc()
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).stat(path))

    async def remove_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        recursive: bool = False,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> None:
        self._check_path(sandbox_id, owner, path)
        await self._logged_file_op(
            sandbox_id,
            owner,
            "remove_file",
            {"path": path, "recursive": recursive},
            seq,
            idem_key,
            lambda f: f.remove(path, recursive),
            lambda _r: {},
            lambda _d: None,
        )

    async def make_dir(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._check_path(sandbox_id, owner, path)
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "make_dir",
            {"path": path},
            seq,
            idem_key,
            lambda f: f.mkdir(path),
            _dump,
            FileInfo.model_validate,
        )

    async def rename_file(
        self,
        sandbox_id: str,
        owner: str,
        src: str,
        dst: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._check_path(sandbox_id, owner, src)
        self._check_path(sandbox_id, owner, dst)
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "rename_file",
            {"src": src, "dst": dst},
            seq,
            idem_key,
            lambda f: f.rename(src, dst),
            _dump,
            FileInfo.model_validate,
        )

    async def upload_tar(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> int:
        if len(data) > self.limits.max_tar_bytes:
            raise PayloadTooLarge(f"tar upload is larger than {self.limits.max_tar_bytes} bytes")
        self._check_path(sandbox_id, owner, path)
        try:
            await asyncio.to_thread(check_tar, data)
        except DsecError as e:
            self.audit.refusal(sandbox_id, owner, e)
            raise
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "upload_tar",
            {"path": path, "data": data},
            seq,
            idem_key,
            lambda f: f.upload_tar(path, data),
            lambda n: {"files": n},
            lambda d: int(d.get("files", 0)),
        )

    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("download_tar").inc()
        return await self._use(
            sandbox_id,
            owner,
            lambda lv: self._files(lv).download_tar(path, self.limits.max_tar_bytes),
        )

    # ------------------------------------------------------------------ pause, snapshot, fork
    def _pausable(self, lv: _Live) -> Pausable:
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Pausable):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot pause sandboxes", tier=lv.row.tier
            )
        return rt

    async def _pause(self, lv: _Live, mode: str = "auto") -> None:
        """Pause ``lv``: ``auto``/``freeze`` the tier's pause, ``suspend`` memory to a file
        (VM tiers; a frozen sandbox can be suspended too), ``filesystem`` drop every process
        and keep the files (a paused sandbox can be paused so too: it then boots afresh)."""
        rt = self._pausable(lv)
        if mode == "suspend" and not isinstance(rt, MemoryStateful):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot suspend sandboxes to a file (use mode=freeze)",
                tier=lv.row.tier,
            )
        if mode == "filesystem" and not isinstance(rt, FilesystemPause):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} has no filesystem-only pause (use mode=freeze)",
                tier=lv.row.tier,
            )
        async with lv.lock:
            if mode == "filesystem" and isinstance(rt, FilesystemPause):
                if lv.row.state not in ("running", "paused"):
                    return
                report = _pause_report(await rt.pause_filesystem(lv.handle))
            elif mode == "suspend" and isinstance(rt, MemoryStateful):
                if lv.row.state not in ("running", "paused") or rt.is_suspended(lv.handle):
                    return
                report = _pause_report(await rt.suspend(lv.handle))
            else:
                if lv.row.state != "running":
                    return
                report = _pause_report(await rt.pause(lv.handle))
            now = time.time()
            lv.row.state = "paused"
            lv.row.paused_at = now
            lv.last_pause = report
            self.registry.set_paused(lv.row.id, now)
            self.metrics.pauses.labels(lv.row.tier).inc()

    async def _resume(self, lv: _Live) -> None:
        rt = self._pausable(lv)
        if isinstance(rt, UpperForkable) and rt.upper_frozen(lv.handle):
            await self._restart_frozen(lv, rt)  # its layer is its children's: never thawed
            return
        async with lv.lock:
            if lv.row.state != "paused":
                return
            await rt.resume(lv.handle)
            lv.row.state = "running"
            lv.row.paused_at = None
            lv.row.last_active = time.time()
            self.registry.set_paused(lv.row.id, None)
            self.metrics.resumes.labels(lv.row.tier).inc()

    async def pause_sandbox(self, sandbox_id: str, owner: str, mode: str = "auto") -> SandboxInfo:
        lv = self._live_for(sandbox_id, owner)
        await self._pause(lv, mode)
        return self._info(lv.row)

    async def pause_sandbox_mode(self, sandbox_id: str, owner: str, mode: str) -> SandboxInfo:
        """:class:`dsec.edge.interface.PauseModes`: pause with ``auto``/``freeze``/``suspend``/
        ``filesystem``."""
        return await self.pause_sandbox(sandbox_id, owner, mode)

    async def resume_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        lv = self._live_for(sandbox_id, owner)
        await self._resume(lv)
        return self._info(lv.row)

    async def _snapshot(self, lv: _Live, req: SnapshotRequest) -> LayerInfo:
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Snapshottable):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot snapshot sandboxes", tier=lv.row.tier
            )
        meta = {
            "parents": list(lv.row.image_layers),
            "sandbox_id": lv.row.id,
            "image": lv.row.request.get("image"),
        }
        async with lv.lock:
            layer = await rt.snapshot(lv.handle, self.layers, req, meta)
        self.layers.grant_layers(lv.row.owner, [layer.digest])
        if req.name:
            # a sandbox made from the snapshot starts as this one's user, in its directory
            config = {
                k: v
                for k, v in (
                    ("User", lv.row.request.get("user")),
                    ("WorkingDir", lv.row.request.get("workdir")),
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
        self,
        sandbox_id: str,
        owner: str,
        req: SnapshotRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> LayerInfo:
        async def run(lv: _Live) -> LayerInfo:
            return await self._logged(
                lv,
                "snapshot",
                req.model_dump(mode="json"),
                seq,
                idem_key,
                lambda: self._snapshot(lv, req),
                _dump,
                LayerInfo.model_validate,
            )

        return await self._use(sandbox_id, owner, run)

    async def fork_sandbox(self, sandbox_id: str, owner: str, req: ForkRequest) -> ForkResult:
        """``req.n`` new sandboxes from this one's files (see :class:`ForkRequest` for the
        methods), made concurrently; if any fails, none is left."""
        lv = self._live_for(sandbox_id, owner)
        base = CreateSandboxRequest.model_validate(lv.row.request)
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
                    await self.kill_sandbox(info.id, owner)
            raise failed[0]
        return created

    async def _fork_shared(
        self,
        lv: _Live,
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

    async def _restart_frozen(self, lv: _Live, rt: UpperForkable) -> None:
        """Start a sandbox whose writable layer a shared fork froze again, on a fresh one
        (:meth:`UpperForkable.restart_on_frozen`); it is stopped if that fails."""
        try:
            async with lv.lock:
                if lv.row.state != "paused" or not rt.upper_frozen(lv.handle):
                    return  # restarted by a request that came first, or gone
                row = lv.row
                req = CreateSandboxRequest.model_validate(row.request)
                paths = await asyncio.to_thread(
                    lambda: [str(self.layers.layer_path(d)) for d in row.image_layers]
                )
                spec = self._spec(
                    row.id,
                    req,
                    row.owner,
                    list(row.image_layers),
                    paths,
                    forked=row.forked_from is not None,
                )
                lv.handle = await rt.restart_on_frozen(lv.handle, spec)
                row.state = "running"
                row.paused_at = None
                row.last_active = time.time()
                self.registry.set_state(
                    row.id, "running", handle=lv.handle.state, last_active=row.last_active
                )
                self.registry.set_paused(row.id, None)
                self.metrics.resumes.labels(row.tier).inc()
        except DsecError as e:
            await self._destroy(lv, f"restart after a fork failed: {e}"[:500])
            raise

    # --- migration primitives (cluster mode: dsec.cluster.migrate moves sandboxes) ---
    async def export_sandbox(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """Capture what a migration needs to recreate ``sandbox_id`` on another node: its
        create request, its image's layer digests and a ``pack_diff`` layer of its writable
        layer (the default snapshot scrub applies). The sandbox keeps running; processes are
        not captured. Raises ``CapabilityNotSupported`` for tiers that cannot snapshot."""
        lv = self._live_for(sandbox_id, owner)
        layer = await self._use(sandbox_id, owner, lambda lv: self._snapshot(lv, SnapshotRequest()))
        return {
            "request": dict(lv.row.request),
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
            "request": dict(lv.row.request),
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

    async def migrate_sandbox(
        self, sandbox_id: str, owner: str, node: str | None = None
    ) -> MigrateResult:
        """Migration moves a sandbox between nodes: only a cluster (``dsec serve
        --cluster``) has another node. Raises ``CapabilityNotSupported`` here."""
        self._lookup_row(sandbox_id, owner)
        raise CapabilityNotSupported(
            "migration needs cluster mode (dsec serve --cluster): this server has one node",
            node=self.node,
        )

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

    async def job_action(self, owner: str, job: str, action: JobAction) -> JobActionResult:
        rows = self.registry.select(owner=owner, states=("creating", "running", "paused"), job=job)
        fns = {
            "pause": self.pause_sandbox,
            "resume": self.resume_sandbox,
            "kill": self.kill_sandbox,
        }
        if action not in fns:
            raise InvalidRequest(f"unknown job action {action!r}; use pause, resume or kill")
        fn = fns[action]
        outcomes = await for_each_sandbox(
            [r.id for r in rows],
            lambda sid: fn(sid, owner),
            concurrency=self.limits.job_concurrency,
        )
        return JobActionResult(
            job=job,
            action=action,
            outcomes={sid: JobOutcome.model_validate(o) for sid, o in outcomes.items()},
        )

    # ------------------------------------------------------------------ display
    def _desktop_of(self, lv: _Live) -> DesktopSpec | None:
        """The desktop the sandbox's image has (None: none). Known from creation; after an
        edge restart looked up again (the image as its owner sees it, if it still has the
        layers the sandbox was made from)."""
        if not lv.desktop_known:
            spec = None
            name = str(lv.row.request.get("image") or "")
            with contextlib.suppress(DsecError):
                image = self.layers.get_image(name, lv.row.owner)
                if list(image.layers) == lv.row.image_layers[: len(image.layers)]:
                    spec = desktop_spec(image)
            lv.desktop, lv.desktop_known = spec, True
        return lv.desktop

    def _desktop_not_running(self, lv: _Live) -> str:
        """Why a desktop may not answer, from its start command's fate (for the error)."""
        if lv.start is None or lv.logs is None:
            return "the sandbox's start command is not running (edge restarted?)"
        if lv.logs.end_note is None:
            return "its start command still runs"
        tail = lv.logs.tail(600).strip()
        return f"{lv.logs.end_note}" + (f"; its output ends with: {tail}" if tail else "")

    def _screen(self, lv: _Live, screen: Screen) -> ScreenDriver:
        """The screen ``screen`` names for this sandbox (see :mod:`dsec.display`)."""
        rt = self.runtimes[lv.row.tier]
        spec = self._desktop_of(lv) if screen != "console" else None
        image = str(lv.row.request.get("image") or "")
        if spec is not None:
            return ExecDesktop(
                rt, lv.handle, spec.display, spec.image, lambda: self._desktop_not_running(lv)
            )
        if screen == "desktop":
            raise CapabilityNotSupported(
                f"image {image!r} of sandbox {lv.row.id} has no desktop (its config has no "
                f"{DISPLAY_LABEL!r} label): create it with image='desktop'",
                image=image,
                tier=lv.row.tier,
            )
        if isinstance(rt, Display):
            return ConsoleScreen(rt, lv.handle)
        if screen == "console":
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier has no console screen (tier='vm' has one)",
                image=image,
                tier=lv.row.tier,
            )
        raise CapabilityNotSupported(
            f"sandbox {lv.row.id} has no display: its image {image!r} has no desktop "
            f"(create it with image='desktop') and the {lv.row.tier} tier has no console "
            "screen",
            image=image,
            tier=lv.row.tier,
        )

    async def display_screenshot(
        self, sandbox_id: str, owner: str, screen: Screen = "auto", pointer: bool = False
    ) -> bytes:
        """The sandbox's screen as PNG bytes."""

        async def run(lv: _Live) -> bytes:
            return await self._screen(lv, screen).screenshot(pointer=pointer)

        return await self._use(sandbox_id, owner, run)

    async def display_act(
        self, sandbox_id: str, owner: str, action: DisplayAction, screen: Screen = "auto"
    ) -> None:
        async def run(lv: _Live) -> None:
            await self._screen(lv, screen).act(action)

        await self._use(sandbox_id, owner, run)

    async def display_state(
        self, sandbox_id: str, owner: str, screen: Screen = "auto"
    ) -> DisplayState:
        async def run(lv: _Live) -> DisplayState:
            return await self._screen(lv, screen).state()

        return await self._use(sandbox_id, owner, run)

    async def display_windows(self, sandbox_id: str, owner: str) -> list[WindowInfo]:
        async def run(lv: _Live) -> list[WindowInfo]:
            s = self._screen(lv, "desktop")
            if not isinstance(s, Windowed):  # pragma: no cover - a desktop has windows
                raise CapabilityNotSupported("this screen has no windows")
            return await s.windows()

        return await self._use(sandbox_id, owner, run)

    async def display_restart(self, sandbox_id: str, owner: str) -> DisplayState:
        """Stop the sandbox's desktop (whatever is left of it) and run its image's start
        command again; returns once its readiness check passes."""

        async def run(lv: _Live) -> DisplayState:
            spec = self._desktop_of(lv)
            image = str(lv.row.request.get("image") or "")
            if spec is None:
                raise CapabilityNotSupported(
                    f"image {image!r} of sandbox {lv.row.id} has no desktop to restart",
                    image=image,
                )
            if spec.start is None:
                raise CapabilityNotSupported(
                    f"image {image!r} has a desktop but no start command that runs it",
                    image=image,
                )
            rt = self.runtimes[lv.row.tier]
            if lv.start is not None:
                await lv.start.stop()
            stop = ExecRequest(
                cmd=["/bin/sh", "-c", STOP_SCRIPT, "dsec-desktop-stop", spec.display],
                timeout_s=30,
            )
            await rt.exec(lv.handle, stop)
            await self._start(lv, rt, spec.start, rt.facts().sink_sees_all_output)
            return await self._screen(lv, "desktop").state()

        return await self._use(sandbox_id, owner, run)

    # ------------------------------------------------------------------ network
    async def update_network(self, sandbox_id: str, owner: str, policy: Any) -> SandboxInfo:
        """Replace a running sandbox's network policy; new connections see it at once."""

        async def run(lv: _Live) -> SandboxInfo:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, Networked):
                raise CapabilityNotSupported(f"tier {lv.row.tier} has no network policy")
            await rt.network_update(lv.handle, policy)
            lv.row.request["network"] = policy.model_dump(mode="json")
            return self._info(lv.row)

        return await self._use(sandbox_id, owner, run)

    async def network_stats(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """Allowed and blocked connection attempts of a sandbox, by destination."""

        async def run(lv: _Live) -> dict[str, Any]:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, Networked):
                return {"enabled": False}
            return await rt.network_stats(lv.handle)

        return await self._use(sandbox_id, owner, run)

    # ------------------------------------------------------------------ ports
    async def open_port(self, sandbox_id: str, owner: str, port: int) -> PortStream:
        """:class:`dsec.edge.interface.PortForwarding`: a TCP connection to ``port`` inside
        the sandbox, made from inside it (``PortConnectable`` runtimes). Counted against
        ``limits.max_port_connections`` until closed; traffic counts as TTL activity; the
        connection is closed when the sandbox is killed."""
        port = check_port(port)

        async def run(lv: _Live) -> PortStream:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, PortConnectable):
                raise CapabilityNotSupported(
                    f"tier {lv.row.tier} has no ports to connect to (use container, microvm or vm)",
                    tier=lv.row.tier,
                )
            limit = self.limits.max_port_connections
            if len(lv.ports) + lv.ports_opening >= limit:
                raise TooManyConnections(
                    f"sandbox {sandbox_id} already has {limit} open port connections (the "
                    "node's limit, DSEC_MAX_PORT_CONNECTIONS); close some and retry",
                    sandbox_id=sandbox_id,
                    limit=limit,
                    retry_after_s=1,
                )
            lv.ports_opening += 1
            try:
                inner = await rt.connect_port(lv.handle, port)
            finally:
                lv.ports_opening -= 1
            if lv.row.state == "stopped":  # killed while connecting
                await inner.close()
                raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
            stream = TrackedStream(
                inner, on_activity=lambda: self._touch(lv), on_close=lv.ports.discard
            )
            lv.ports.add(stream)
            self.metrics.port_connections.labels(lv.row.tier).inc()
            return stream

        return await self._use(sandbox_id, owner, run)

    async def port_ticket(self, sandbox_id: str, owner: str, port: int) -> PortTicket:
        """:class:`dsec.edge.interface.PortForwarding`: :meth:`open_port`, parked on this
        node's port gateway for a cluster apiserver to pick up."""
        if self.port_gateway is None:
            raise CapabilityNotSupported(
                "this edge has no port gateway (port tickets are for cluster nodes)"
            )
        return await self.port_gateway.park(self.open_port(sandbox_id, owner, port))

    async def public_port_owner(self, sandbox_id: str) -> str:
        """:class:`dsec.edge.interface.PortForwarding`: the owner of a live sandbox created
        with ``public_ports``; ``SandboxNotFound`` for any other."""
        lv = self._live.get(sandbox_id)
        if lv is None or not lv.row.request.get("public_ports"):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return lv.row.owner

    # ------------------------------------------------------------------ metrics
    async def sandbox_metrics(self, sandbox_id: str, owner: str) -> SandboxMetrics:
        """:class:`dsec.edge.interface.MetricsEdge`: one usage sample of a live sandbox, read
        without resuming it or touching its TTL (see :class:`dsec.runtimes.base.Measurable`)."""
        row = self._lookup_row(sandbox_id, owner)
        lv = self._live.get(sandbox_id)
        if lv is None or lv.row.state not in ("running", "paused"):
            state = lv.row.state if lv is not None else row.state
            raise SandboxStopped(
                f"sandbox {sandbox_id} is {state}"
                + (f" ({row.stopped_reason})" if state == "stopped" and row.stopped_reason else ""),
                sandbox_id=sandbox_id,
            )
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Measurable):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot measure its sandboxes", tier=lv.row.tier
            )
        try:
            u = await rt.usage(lv.handle)
        except DsecError as e:
            self.metrics.errors.labels(e.code).inc()
            raise
        now_mono, now = time.monotonic(), time.time()
        if (
            lv.last_usage is not None
            and now_mono > lv.last_usage[0]
            and u.cpu_usage_ns >= lv.last_usage[1]
        ):
            interval = now_mono - lv.last_usage[0]
            busy_ns = u.cpu_usage_ns - lv.last_usage[1]
        else:  # the first sample: the average since the sandbox was created
            interval = max(1e-3, now - lv.row.created_at)
            busy_ns = u.cpu_usage_ns
        lv.last_usage = (now_mono, u.cpu_usage_ns)
        # the CFS quota is at least 0.01 cores (1 ms per 100 ms), whatever was asked
        limit = max(0.01, float(lv.row.request.get("cpu", 1.0)))
        cores = busy_ns / 1e9 / interval
        net = u.net
        return SandboxMetrics(
            sandbox_id=sandbox_id,
            tier=lv.row.tier,
            state=lv.row.state,
            timestamp=_now_dt(now),
            interval_s=round(interval, 6),
            cpu=CpuMetrics(
                usage_s=u.cpu_usage_ns / 1e9,
                used_cores=round(cores, 4),
                used_pct=round(100.0 * cores / limit, 2),
                limit_cores=limit,
            ),
            memory=MemoryMetrics(
                used_bytes=u.memory_used_bytes,
                cache_bytes=u.memory_cache_bytes,
                limit_bytes=u.memory_limit_bytes,
                peak_bytes=u.memory_peak_bytes,
                host_bytes=u.host_memory_bytes,
            ),
            disk=DiskMetrics(used_bytes=u.disk_used_bytes, total_bytes=u.disk_total_bytes),
            network=(
                NetworkMetrics(
                    rx_bytes=net.rx_bytes,
                    tx_bytes=net.tx_bytes,
                    rx_packets=net.rx_packets,
                    tx_packets=net.tx_packets,
                )
                if net is not None
                else None
            ),
            pids=u.pids,
            source=u.source,
            # the cgroup's counters only: a dashboard polls metrics every second
            audit=await self._audit_summary(lv, network=False) if self.audit.enabled else None,
        )

    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        row = self._lookup_row(sandbox_id, owner)
        header = {"node": self.node, "create": row.request, "image_layers": row.image_layers}
        lines = self.trajectory.export_jsonl(sandbox_id, header=header)
        if not self.audit.enabled:
            return "".join(lines)
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self.audit.sample(sandbox_id, self.runtimes.get(row.tier), lv.handle)
        entries = self.audit.recorder.report(sandbox_id, row.tier, row.job).entries
        return "".join(interleave_audit(lines, entries))

    # ------------------------------------------------------------------ audit
    def _check_path(self, sandbox_id: str, owner: str, path: str) -> str:
        """:func:`check_path`, its refusals recorded as the sandbox's (:mod:`dsec.edge.audit`)."""
        try:
            return check_path(path)
        except DsecError as e:
            self.audit.refusal(sandbox_id, owner, e)
            raise

    async def _audit_summary(self, lv: _Live, *, network: bool = True) -> AuditSummary:
        rt = self.runtimes.get(lv.row.tier)
        await self.audit.sample(lv.row.id, rt, lv.handle, network=network)
        return self.audit.recorder.summary(lv.row.id, lv.row.tier, lv.row.job)

    async def sandbox_audit(self, sandbox_id: str, owner: str, after: int = 0) -> AuditReport:
        """:class:`dsec.edge.interface.SandboxAudits`: the sandbox's refusals (live or
        stopped while the node remembers it); never resumes it nor extends its TTL."""
        row = self._lookup_row(sandbox_id, owner)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise InvalidRequest(f"after={after!r} must be an entry number >= 0")
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self.audit.sample(sandbox_id, self.runtimes.get(row.tier), lv.handle)
        report = self.audit.recorder.report(sandbox_id, row.tier, row.job, after=after)
        report.sources = self.audit.sources(self.runtimes.get(row.tier))
        place_entries(report.entries, self.trajectory.starts(sandbox_id))
        return report

    async def follow_audit(
        self, sandbox_id: str, owner: str, after: int = 0
    ) -> AsyncGenerator[AuditEntry, None]:
        """:class:`dsec.edge.interface.SandboxAudits`: entries numbered above ``after`` as
        they are recorded, until the sandbox stops (sampled sources are read every 2 s)."""
        row = self._lookup_row(sandbox_id, owner)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise InvalidRequest(f"after={after!r} must be an entry number >= 0")
        rt = self.runtimes.get(row.tier)

        async def poll() -> None:
            while (lv := self._live.get(sandbox_id)) is not None:
                await self.audit.sample(sandbox_id, rt, lv.handle)
                await asyncio.sleep(2.0)

        poller = asyncio.create_task(poll())
        try:
            async for entry in self.audit.recorder.follow(sandbox_id, after):
                yield entry
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    async def job_audit(self, owner: str, job: str) -> JobAudit:
        """:class:`dsec.edge.interface.SandboxAudits`: the summary of every sandbox of
        ``owner``'s ``job`` this node has (live, and stopped ones it remembers)."""
        out: dict[str, AuditSummary] = {}
        for row in self.registry.select(owner=owner, job=job):
            lv = self._live.get(row.id)
            if lv is not None:
                out[row.id] = await self._audit_summary(lv)
            else:
                out[row.id] = self.audit.recorder.summary(row.id, row.tier, row.job)
        return JobAudit(job=job, sandboxes=out)

    async def sandbox_logs(
        self, sandbox_id: str, owner: str, *, follow: bool = False
    ) -> AsyncGenerator[LogLine, None]:
        """The output of the sandbox's start command (:mod:`dsec.edge.logs`): what is kept,
        then with ``follow`` what comes until the command ends. Empty for a sandbox whose
        image has none. The sandbox must be live (``SandboxStopped`` otherwise)."""
        lv = self._live_for(sandbox_id, owner)
        if lv.logs is None:
            return
        async for line in lv.logs.read(follow=follow):
            yield line

    # ------------------------------------------------------------------ run_code
    async def run_code(self, owner: str, req: CodeRunRequest) -> CodeRunResult:
        """:class:`~dsec.edge.interface.CodeRuns`: ``req`` in a fresh fncall worker, admitted
        as a creation of ``owner``'s (``POST /v1/run_code``)."""
        return await self._code_runs().run(req, self._code_run_admission(owner, req))

    async def run_code_sandboxfusion(self, owner: str, req: RunCodeRequest) -> RunCodeResponse:
        """:class:`~dsec.edge.interface.CodeRuns`: SandboxFusion's ``/run_code``, admitted as
        a creation of ``owner``'s."""
        return await self._code_runs().run_code(req, self._code_run_admission(owner, req))

    def _code_runs(self) -> RunCodeService:
        """The node's run_code service over its fncall tier, made on first use."""
        rt = self._runtime("fncall")
        if self.code_runner is None:
            from dsec.runtimes.fncall.runtime import FncallRuntime
            from dsec.runtimes.fncall.service import RunCodeService

            if not isinstance(rt, FncallRuntime):
                raise CapabilityNotSupported(
                    f"the fncall tier of node {self.node} does not run code", tier="fncall"
                )
            self.code_runner = RunCodeService(rt, pod_name=f"dsec-fncall@{self.node}")
        return self.code_runner

    def _code_run_admission(
        self, owner: str, req: CodeRunRequest | RunCodeRequest
    ) -> CodeRunAdmission:
        """What a creation of ``owner``'s passes, for one code run: the key's quota (the run
        counts as one live sandbox of :func:`code_run_size` while it runs, and spends one
        creation of the key's rate) and the node's creation gate around the worker's claim.
        The node's own caps are the fncall pool's (``max_workers``)."""
        from dsec.runtimes.fncall.service import CodeRunAdmission

        cpu, memory_mb = code_run_size(req)

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            try:
                usage = self.key_usage_now(owner)
                self.key_quotas.check(owner, usage, cpu=cpu, memory_mb=memory_mb)
                self.key_quotas.take(owner)
            except DsecError as e:
                self.metrics.errors.labels(e.code).inc()
                raise
            with self.key_quotas.admitted(owner, cpu=cpu, memory_mb=memory_mb):
                yield

        return CodeRunAdmission(hold=hold, claim_slot=lambda: self.creations.slot(owner))

    # ------------------------------------------------------------------ builds
    def image_builder(self) -> ImageBuilder:
        """The node's build engine, made on first use (its cache index opens then)."""
        if self._builder is None:
            from dsec.builds.engine import BuildLimits, ImageBuilder
            from dsec.layers.store import LayerStore

            if not isinstance(self.layers, LayerStore):
                raise CapabilityNotSupported(
                    "this node's layer store cannot build images (it makes no layer files)"
                )
            self._builder = ImageBuilder(
                self,
                self.layers,
                cache_db=self.paths.home / "build-cache.db",
                limits=BuildLimits.from_env(),
                resolve_registry=self.image_by_reference,
            )
        return self._builder

    async def build(
        self, owner: str, req: BuildRequest, context: bytes = b""
    ) -> AsyncGenerator[BuildEvent, None]:
        """Build ``req`` as ``owner``'s image (:class:`dsec.builds.engine.ImageBuilder`):
        refusals raise from the first ``__anext__``, then events until ``done`` or
        ``error``. ``context``: the build context, a tar archive (may be compressed)."""
        builder = self.image_builder()
        recorded = self.build_records.record(owner, builder.build(owner, req, context))
        async with contextlib.aclosing(recorded) as events:
            async for event in events:
                yield event

    def list_builds(self, owner: str) -> BuildList:
        return self.build_records.list(owner)

    def get_build(self, build_id: str, owner: str) -> BuildRecord:
        return self.build_records.get(build_id, owner)

    # ------------------------------------------------------------------ images
    def _layer_cache_info(self, layer: LayerInfo) -> LayerInfo:
        """``layer`` with ``remote`` and ``cached_fraction`` filled in (lazy layers)."""
        try:
            frac = self.layers.cached_fraction(layer.digest)
            remote = self.layers.remote_source(layer.digest)
        except DsecError:
            return layer
        return layer.model_copy(update={"remote": remote, "cached_fraction": frac})

    def _image_cache_info(self, image: ImageInfo) -> ImageInfo:
        """``image`` with ``cached_fraction``: the size-weighted share of its layers' bytes
        present on this node (1.0 when every layer is local)."""
        total = present = 0.0
        for digest in image.layers:
            try:
                layer = self._layer_cache_info(self.layers.get_layer(digest))
            except DsecError:
                continue
            total += layer.size
            present += layer.size * (
                layer.cached_fraction if layer.cached_fraction is not None else 1.0
            )
        frac = present / total if total else 1.0
        return image.model_copy(update={"cached_fraction": round(frac, 4)})

    def _pending_builtins(self, owner: str, known: set[str]) -> list[ImageInfo]:
        """Built-in images not stored yet, as ``image ls`` shows them (queued, building with
        the phase, or failed with the reason)."""
        from dsec.layers import builtin

        out = []
        for name in builtin.BUILTIN_IMAGES:
            status = self.layers.builtin_status(name)
            if name in known or status is None:
                continue
            state, phase, seconds = status
            progress = f"{phase} ({seconds:.0f} s)" if state == "building" else phase
            out.append(
                ImageInfo(
                    name=name,
                    layers=[],
                    size=0,
                    created_at=_now_dt(time.time()),
                    meta={"builtin": name},
                    status=state,
                    progress=progress,
                )
            )
        return out

    async def list_images(self, owner: str) -> list[ImageInfo]:
        """The images ``owner`` can use: its own and the system's (built-in images not built
        yet included, with their build status)."""
        images = [self._image_cache_info(im) for im in self.layers.list_images(owner)]
        known = {im.name for im in images}
        pending = self._pending_builtins(owner, known)
        pulling = [im for im in self.references.pending(owner) if im.name not in known]
        return sorted([*images, *pending, *pulling], key=lambda im: im.name)

    async def get_image(self, name: str, owner: str) -> ImageInfo:
        """``owner``'s (or the system's) image ``name``; a built-in image not built yet as
        ``image ls`` shows it (queued, building or failed, with no layers): it is usable,
        and is built on first use."""
        try:
            return self._image_cache_info(self.layers.get_image(name, owner))
        except ImageNotFound:
            pending = [im for im in self._pending_builtins(owner, set()) if im.name == name]
            if pending:
                return pending[0]
            raise

    async def delete_image(self, name: str, owner: str) -> None:
        """Forget ``owner``'s image ``name`` (its layers stay while anything uses them).
        ``ImageNotFound`` for a name it does not own; ``Conflict`` for a system image."""
        self.layers.remove_image(name, owner)

    async def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        """Let every key use ``owner``'s image ``name`` as ``<owner>/<name>`` (or stop)."""
        return self._image_cache_info(self.layers.share_image(name, owner, shared))

    async def pull_image(self, ref: str, owner: str, name: str | None = None) -> ImageInfo:
        """Pull ``ref`` (``oci://HOST/REPO:TAG`` or ``[registry/]repo[:tag]``) as ``owner``'s
        image: an image pushed with ``dsec image push`` gets its EROFS layers downloaded;
        any other image is converted from its tar layers. Credentials from
        ``DSEC_REGISTRY_AUTH`` (JSON ``{"host:port": ["user", "password"]}``). Without
        ``name`` the image is named by the reference (``127.0.0.1:5000/debian:12``) and the
        node's copy of that reference is shared with other keys that ask for it
        (:mod:`dsec.edge.references`); with ``name``, it is pulled as that image."""
        if name is None:
            return await self.references.resolve(ref, owner, wait_s=None)
        return await self.attach_image(ref, name, False, owner)

    async def attach_image(
        self, ref: str, name: str | None, lazy: bool, owner: str = SYSTEM_OWNER
    ) -> ImageInfo:
        """Register a pushed image as ``owner``'s (``lazy``: layers stay remote and are
        fetched on first read; other images fall back to a full pull):
        :func:`dsec.layers.publish.attach_image`."""
        layers = self.layers
        if not isinstance(layers, RegistryLayers):
            raise CapabilityNotSupported("this node's layer store cannot pull from registries")
        if name is not None and owner != SYSTEM_OWNER:
            layers.check_name_free(name, owner)  # before anything is downloaded
        return await asyncio.to_thread(layers.attach, ref, name, lazy, owner)

    async def push_image(
        self, name: str, target: str, owner: str = SYSTEM_OWNER
    ) -> PushImageResult:
        """Publish ``owner``'s image ``name`` to ``target`` (``oci://HOST[:PORT]/REPO[:TAG]``)
        as a dsec artifact (credentials from ``DSEC_REGISTRY_AUTH``)."""
        from dsec.layers.publish import push_image

        await self.layers.ensure_image(name, owner)
        digest = await asyncio.to_thread(push_image, self.layers, name, target, owner)
        return PushImageResult(image=name, target=target, manifest_digest=digest)

    async def list_layers(self, owner: str) -> list[LayerInfo]:
        """The layers ``owner`` may use by digest."""
        return [self._layer_cache_info(layer) for layer in self.layers.list_owned_layers(owner)]

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """Build ``owner``'s image ``req.name`` from an uploaded build ``context`` (a tar
        archive, optionally compressed): its files become one layer on top of ``req.base``.
        The archive is unpacked with the store's safe extraction (no member escapes, devices
        dropped) under the limits of :class:`EdgeLimits` (``PayloadTooLarge`` past them);
        nothing of a failed build is kept. The caller decides the owner (``SYSTEM_OWNER``
        for the operator's system images)."""
        import tempfile

        from dsec.layers.tarball import extract_tarball

        if len(context) > self.limits.max_build_context_bytes:
            raise PayloadTooLarge(
                f"the build context is larger than {self.limits.max_build_context_bytes} bytes",
                limit_bytes=self.limits.max_build_context_bytes,
            )
        self.layers.check_name_free(req.name, owner)  # before any byte is unpacked
        if req.base is not None:
            await self.layers.ensure_image(req.base, owner, wait_s=self.limits.image_wait_s)

        def build() -> ImageInfo:
            with tempfile.TemporaryDirectory(dir=self.paths.scratch, prefix="build-") as tmp:
                archive = Path(tmp) / "context.tar"
                archive.write_bytes(context)
                tree = Path(tmp) / "rootfs"
                extract_tarball(
                    archive,
                    tree,
                    max_bytes=self.limits.max_build_bytes,
                    max_members=self.limits.max_build_entries,
                )
                archive.unlink()
                return self.layers.build_image(
                    tree, req.name, req.kind, req.base, owner=owner, meta={"source": "upload"}
                )

        return await asyncio.to_thread(build)

    # ------------------------------------------------------------------ node
    async def capabilities(self) -> list[Capabilities]:
        out = []
        for tier in TIERS:
            rt = self.runtimes.get(tier)
            if rt is None:
                out.append(
                    Capabilities(
                        tier=tier,
                        available=False,
                        reason=self.unavailable.get(tier, "not enabled on this node"),
                        exec=False,
                        files=False,
                        streaming=False,
                    )
                )
            else:
                out.append(capabilities_of(rt))
        return out

    async def node_info(self) -> NodeInfo:
        tiers = await self.capabilities()
        host = None
        if self._host_report is not None:
            try:
                host = await asyncio.to_thread(self._host_report)
            except Exception:  # the node's answer must not fail for its report
                log.exception("host report failed")
        if host is not None:  # the tiers as this edge runs them, not as the host forecasts
            host = host.model_copy(
                update={
                    "tiers": [
                        HostTier(
                            tier=c.tier,
                            available=c.available,
                            reason=c.reason,
                            wanted=c.tier in self.runtimes or c.tier in self.unavailable,
                        )
                        for c in tiers
                    ]
                }
            )
        return NodeInfo(
            node=self.node,
            version=__version__,
            tiers=tiers,
            sandboxes=len(self._live),
            cpus=self._cpus,
            memory_mb=self._mem_mb,
            host=host,
        )

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def usage(self) -> NodeUsage:
        """:class:`dsec.edge.interface.NodeReports`: what this edge holds and admits against."""
        return NodeUsage(
            node=self.node,
            cpus=self._cpus,
            memory_mb=self._mem_mb,
            sandboxes=len(self._live),
            requested_cpu=self._live.requested_cpu,
            requested_memory_mb=self._live.requested_memory_mb,
            max_sandboxes=self.limits.max_sandboxes,
            cpu_overcommit=self.limits.cpu_overcommit,
            memory_overcommit=self.limits.memory_overcommit,
        )

    def key_usage_now(self, owner: str) -> KeyUsage:
        """What ``owner`` holds on this node (running totals: O(1))."""
        n, cpu, mem = self._live.owner_usage(owner)
        return KeyUsage(sandboxes=n, cpu=round(cpu, 6), memory_mb=mem)

    async def key_usage(self, owner: str) -> KeyUsage:
        """:class:`dsec.edge.interface.KeyAccounting`: what ``owner`` holds."""
        return self.key_usage_now(owner)

    def owned_sandboxes(self) -> list[tuple[str, SandboxInfo]]:
        """:class:`dsec.edge.interface.NodeReports`: ``(owner, info)`` of every live sandbox."""
        return [(lv.row.owner, self._info(lv.row)) for lv in self._live.values()]

    def live_states(self) -> dict[str, str]:
        """Sandbox id -> state of every live sandbox (cheap: no descriptions are built)."""
        return {lv.row.id: lv.row.state for lv in self._live.values()}

    def owned_sandbox(self, sandbox_id: str) -> tuple[str, SandboxInfo] | None:
        """``(owner, info)`` of the live sandbox ``sandbox_id``, or None."""
        lv = self._live.get(sandbox_id)
        return None if lv is None else (lv.row.owner, self._info(lv.row))

    async def stats(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "live": len(self._live),
            "by_tier_state": {f"{t}/{s}": n for (t, s), n in self.registry.count_by().items()},
        }

    # --- interactive processes (E2B)
    async def start_process(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: Any = None,
    ) -> Any:
        """Start ``req`` and return while it runs: ``dsec.e2b.interactive.InteractiveExec``.

        ``stdin``: keep the process's stdin open for writes (``req.stdin`` is ignored);
        ``pty``: a terminal size (``cols``, ``rows``) to run it on a new terminal. Returns the
        runtime's process object (``InteractiveProcess``). A tier without interactive
        processes raises ``CapabilityNotSupported`` (so does a runtime without terminals
        when ``pty`` is given). The call is logged in the trajectory
        as an ``exec`` entry (request plus ``interactive``/``stdin_open``/``pty``), committed
        with the exit result (no output) when the process ends. The sandbox's TTL keeps
        running meanwhile: a process does not keep its sandbox alive.
        """
        request = req.model_dump(mode="json", exclude_defaults=True)
        request["interactive"] = True
        request["stdin_open"] = stdin
        if pty is not None:
            request["pty"] = {"cols": int(pty.cols), "rows": int(pty.rows)}

        async def run(lv: _Live) -> Any:
            rt = self.runtimes[lv.row.tier]
            if not isinstance(rt, Interactive):
                raise CapabilityNotSupported(
                    f"tier {lv.row.tier} has no interactive processes (stdin after start, pty)"
                )
            start = rt.start_process
            if lv.row.request.get("workdir") and req.cwd is None:
                req.cwd = lv.row.request["workdir"]
            sid = lv.row.id
            entry = await self._begin(sid, None, None, "exec", request)
            t0 = time.time()
            try:
                proc = await start(lv.handle, req, stdin=stdin, pty=pty)
            except DsecError as e:
                self.metrics.execs.labels(lv.row.tier, "error").inc()
                if isinstance(e, SandboxStopped):
                    self.trajectory.abort(sid, entry.seq, e)
                else:
                    self.trajectory.commit_error(sid, entry.seq, e)
                raise
            except BaseException as e:
                with contextlib.suppress(Exception):
                    self.trajectory.commit_error(sid, entry.seq, SandboxError(f"exec failed: {e}"))
                raise
            task = asyncio.create_task(self._finish_process(lv, entry.seq, t0, proc))
            tasks: set[asyncio.Task[None]] = self.__dict__.setdefault("_process_finishers", set())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return proc

        return await self._use(sandbox_id, owner, run)

    async def _finish_process(self, lv: _Live, seq: int, t0: float, proc: Any) -> None:
        """Commit an interactive process's trajectory entry and metrics when it exits."""
        tier, sid = lv.row.tier, lv.row.id
        try:
            res: ExecResult = await proc.wait()
        except DsecError as e:
            self.metrics.execs.labels(tier, "error").inc()
            with contextlib.suppress(Exception):
                self.trajectory.commit_error(sid, seq, e)
            return
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.trajectory.commit_error(sid, seq, SandboxError(f"exec failed: {e}"))
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.metrics.exec_seconds.labels(tier).observe(time.time() - t0)
        outcome = "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
        self.metrics.execs.labels(tier, outcome).inc()
        with contextlib.suppress(Exception):  # the sandbox may be gone (and purged) by now
            self.trajectory.commit(
                sid,
                seq,
                res.model_dump(mode="json", exclude={"replayed"}),
                {"started_at": t0, "run_ms": (time.time() - t0) * 1000},
            )


def check_path(path: str) -> str:
    """Refuse sandbox paths that are not absolute or that climb with ``..`` (every tier gets
    the same answer, whatever its file backend would make of them)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidRequest(f"path {path!r} must be absolute", path=path)
    if "\0" in path or len(path) > 4096:
        raise InvalidRequest("path contains a NUL byte or is longer than 4096 bytes")
    if ".." in path.split("/"):
        raise PathOutsideSandbox(f"path {path!r} contains '..'", path=path)
    return path


def check_tar(data: bytes, max_members: int = 1_000_000) -> int:
    """Validate an uploaded tar before any tier sees it: no absolute names, no ``..``, no
    device nodes or FIFOs, no links that point outside the upload. Returns the member count."""
    import io
    import tarfile

    def bad(name: str) -> bool:
        return name.startswith("/") or ".." in name.split("/")

    n = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
            for m in tf:
                n += 1
                if n > max_members:
                    raise PayloadTooLarge(f"tar has more than {max_members} members")
                if bad(m.name):
                    raise PathOutsideSandbox(
                        f"tar member {m.name!r} escapes the target", member=m.name
                    )
                if m.ischr() or m.isblk() or m.isfifo():
                    raise PathOutsideSandbox(
                        f"tar member {m.name!r} is a device or FIFO", member=m.name
                    )
                if m.islnk() and bad(m.linkname):
                    raise PathOutsideSandbox(
                        f"tar hard link {m.name!r} points outside the upload", member=m.name
                    )
    except tarfile.TarError as e:
        raise InvalidRequest(f"not a valid tar archive: {e}") from e
    return n


def _pause_report(raw: dict[str, Any]) -> PauseReport:
    """A runtime's pause report as the API model: known fields kept, the rest as notes (each
    tier reports what it has: cgroup memory for containers, vCPU state for VMs)."""
    fields = PauseReport.model_fields
    known = {k: v for k, v in raw.items() if k in fields}
    extra = [f"{k}={v}" for k, v in raw.items() if k not in fields]
    if "method" not in known and "mode" in raw:
        known["method"] = str(raw["mode"])
    if extra:
        known["notes"] = [*known.get("notes", []), *extra]
    return PauseReport.model_validate(known)


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")
