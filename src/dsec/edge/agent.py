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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from dsec import __version__
from dsec.config import Paths
from dsec.edge.metrics import EdgeMetrics
from dsec.edge.registry import Registry, SandboxRow
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    TierUnavailable,
)
from dsec.models import (
    TIERS,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ImageInfo,
    LayerInfo,
    NodeInfo,
    SandboxInfo,
)
from dsec.runtimes.base import Handle, Runtime, SandboxFiles, SandboxSpec

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


@dataclass
class _Live:
    row: SandboxRow
    handle: Handle
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: int = 0


def node_name() -> str:
    """A short DNS-safe node name, used inside sandbox ids (``sb-<node>-<random>``)."""
    raw = os.environ.get("DSEC_NODE") or socket.gethostname()
    name = re.sub(r"[^a-z0-9]", "", raw.lower())[:12]
    return name or "node"


def _now_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class EdgeAgent:
    """Embedded edge. Construct, ``await start()``, use, ``await close()``.

    Args:
        paths: where this node keeps its state.
        runtimes: tier name -> runtime (only tiers present here can be created).
        layer_store: a :class:`dsec.layers.store.LayerStore` (images, layers).
        limits: admission limits.
    """

    def __init__(
        self,
        paths: Paths,
        runtimes: dict[str, Runtime],
        layer_store: Any,
        *,
        limits: EdgeLimits | None = None,
        node: str | None = None,
    ) -> None:
        self.paths = paths
        self.runtimes = runtimes
        self.layers = layer_store
        self.limits = limits or EdgeLimits()
        self.node = node or node_name()
        self.registry = Registry(paths.state_db)
        self.metrics = EdgeMetrics(self.node, self.registry.count_by)
        self._live: dict[str, _Live] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._cpus = os.cpu_count() or 1
        self._mem_mb = _total_memory_mb()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.paths.ensure()
        for rt in self.runtimes.values():
            await rt.start()
        await self.reconcile()
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
                *(self._destroy(lv, "edge shutdown") for lv in list(self._live.values())),
                return_exceptions=True,
            )
        for rt in self.runtimes.values():
            with contextlib.suppress(Exception):
                await rt.close()
        self.registry.close()
        self._closed = True

    async def reconcile(self) -> dict[str, int]:
        """Match the registry with reality after a (re)start. Returns counts for the log."""
        recovered = lost = orphans = 0
        for row in self.registry.list(states=("creating", "running", "paused")):
            rt = self.runtimes.get(row.tier)
            handle = Handle(row.id, row.handle)
            ok = False
            if rt is not None and row.state != "creating":
                try:
                    ok = await rt.recover(handle)
                except Exception as e:  # a broken sandbox must not stop the edge
                    log.warning("recover %s failed: %s", row.id, e)
            if ok:
                row.handle = handle.state
                self.registry.set_state(row.id, row.state, handle=handle.state)
                self._live[row.id] = _Live(row, handle)
                recovered += 1
            else:
                if rt is not None:
                    with contextlib.suppress(Exception):
                        await rt.destroy(handle)
                reason = "creation interrupted by edge restart" if row.state == "creating" else "lost while the edge was down"
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
            log.info("reconcile: %d recovered, %d lost, %d orphans removed", recovered, lost, orphans)
        return {"recovered": recovered, "lost": lost, "orphans": orphans}

    async def _reap_loop(self) -> None:
        last_purge = 0.0
        while not self._closing:
            await asyncio.sleep(self.limits.reap_interval_s)
            now = time.time()
            try:
                for lv in list(self._live.values()):
                    exp = lv.row.expires_at
                    if exp is not None and exp < now and lv.inflight == 0:
                        await self._destroy(lv, "ttl expired")
                if now - last_purge > 60:
                    self.registry.purge_stopped(now - self.limits.stopped_retention_s)
                    last_purge = now
            except Exception:
                log.exception("reaper iteration failed")

    # ------------------------------------------------------------------ helpers
    def _runtime(self, tier: str) -> Runtime:
        rt = self.runtimes.get(tier)
        if rt is None:
            if tier not in TIERS:
                raise InvalidRequest(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
            raise TierUnavailable(
                f"tier {tier!r} is not available on node {self.node}",
                tier=tier,
                available=sorted(self.runtimes),
            )
        caps = rt.capabilities()
        if not caps.available:
            raise TierUnavailable(f"tier {tier!r} is not available: {caps.reason}", tier=tier)
        return rt

    def _info(self, row: SandboxRow) -> SandboxInfo:
        req = row.request
        exp = row.expires_at if row.state in ("running", "paused", "creating") else None
        return SandboxInfo(
            id=row.id,
            tier=row.tier,  # type: ignore[arg-type]
            image=req.get("image", ""),
            layers=req.get("layers", []),
            state=row.state,  # type: ignore[arg-type]
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
        if lv.row.state != "running":
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
            return await fn(lv)
        except DsecError as e:
            self.metrics.errors.labels(e.code).inc()
            if not isinstance(e, SandboxStopped) and not await self._still_alive(lv):
                raise SandboxStopped(f"sandbox {sandbox_id} died", sandbox_id=sandbox_id) from e
            raise
        finally:
            lv.inflight -= 1
            self._touch(lv)

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

    def _files(self, lv: _Live) -> SandboxFiles:
        rt = self.runtimes[lv.row.tier]
        if not rt.capabilities().files:
            raise CapabilityNotSupported(f"tier {lv.row.tier} has no file access")
        return rt.files(lv.handle)

    def _check_admission(self, req: CreateSandboxRequest, caps: Capabilities) -> None:
        if caps.max_cpu is not None and req.cpu > caps.max_cpu:
            raise InvalidRequest(f"cpu={req.cpu} exceeds the {req.tier} tier maximum {caps.max_cpu}")
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
        live = [lv.row.request for lv in self._live.values()]
        if len(live) >= self.limits.max_sandboxes:
            raise QuotaExceeded(
                f"node {self.node} is at its limit of {self.limits.max_sandboxes} sandboxes"
            )
        cpu_sum = sum(r.get("cpu", 0) for r in live) + req.cpu
        if cpu_sum > self._cpus * self.limits.cpu_overcommit:
            raise QuotaExceeded(
                f"node {self.node} CPU overcommit cap reached ({cpu_sum:.1f} > {self._cpus * self.limits.cpu_overcommit:.1f} cores requested)"
            )
        mem_sum = sum(r.get("memory_mb", 0) for r in live) + req.memory_mb
        if mem_sum > self._mem_mb * self.limits.memory_overcommit:
            raise QuotaExceeded(
                f"node {self.node} memory overcommit cap reached ({mem_sum} MiB requested)"
            )

    async def _destroy(self, lv: _Live, reason: str) -> None:
        async with lv.lock:
            if lv.row.state == "stopped":
                return
            rt = self.runtimes.get(lv.row.tier)
            if rt is not None:
                try:
                    await rt.destroy(lv.handle)
                except Exception as e:
                    log.error("destroy of %s failed: %s", lv.row.id, e)
            lv.row.state = "stopped"
            lv.row.stopped_reason = reason
            self.registry.set_state(lv.row.id, "stopped", reason=reason)
            self._live.pop(lv.row.id, None)
            self.metrics.kills.labels(lv.row.tier, reason.split()[0]).inc()

    # ------------------------------------------------------------------ sandboxes
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        t0 = time.perf_counter()
        tier = req.tier
        try:
            rt = self._runtime(tier)
            caps = rt.capabilities()
            self._check_admission(req, caps)
            image = await self.layers.ensure_image(req.image)
            extra: list[LayerInfo] = self.layers.resolve_layers(req.layers) if req.layers else []
            digests = list(image.layers) + [x.digest for x in extra]
            layer_paths = [str(self.layers.layer_path(d)) for d in digests]
        except DsecError as e:
            self.metrics.creations.labels(tier, "rejected").inc()
            self.metrics.errors.labels(e.code).inc()
            raise
        sid = f"sb-{self.node}-{secrets.token_hex(6)}"
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
        )
        self.registry.insert(row)
        lv = _Live(row, Handle(sid))
        self._live[sid] = lv
        spec = SandboxSpec(
            id=sid,
            tier=tier,
            layer_paths=layer_paths,
            layer_digests=digests,
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            disk_mb=req.disk_mb,
            pids=req.pids,
            env=dict(req.env),
            user=req.user,
            workdir=req.workdir,
            labels=dict(req.labels),
        )
        try:
            async with lv.lock:
                handle = await rt.create(spec)
                lv.handle = handle
                row.state = "running"
                row.last_active = time.time()
                self.registry.set_state(sid, "running", handle=handle.state)
                self.registry.touch(sid, row.last_active)
        except BaseException as e:
            self._live.pop(sid, None)
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
        self.metrics.creations.labels(tier, "ok").inc()
        self.metrics.create_seconds.labels(tier).observe(time.perf_counter() - t0)
        return self._info(row)

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
        rows = self.registry.list(owner=owner, states=states, job=job)
        out = []
        for r in rows:
            lv = self._live.get(r.id)
            row = lv.row if lv is not None else r
            if labels and any(row.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(self._info(row))
        return out

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        row = self._lookup_row(sandbox_id, owner)
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self._destroy(lv, "killed by request")
            row = lv.row
        return self._info(self.registry.get(sandbox_id) or row)

    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo:
        lv = self._live_for(sandbox_id, owner)
        self.registry.set_ttl(sandbox_id, ttl_s)
        lv.row.ttl_s = ttl_s
        lv.row.last_active = time.time()
        return self._info(lv.row)

    # ------------------------------------------------------------------ exec
    async def exec(self, sandbox_id: str, owner: str, req: ExecRequest) -> ExecResult:
        return await self._exec(sandbox_id, owner, req, None)

    async def _exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        sink: Callable[[str, bytes], Awaitable[None]] | None,
    ) -> ExecResult:
        async def run(lv: _Live) -> ExecResult:
            rt = self.runtimes[lv.row.tier]
            if lv.row.request.get("workdir") and req.cwd is None:
                req.cwd = lv.row.request["workdir"]
            t0 = time.perf_counter()
            try:
                res = await rt.exec(lv.handle, req, sink)
            except DsecError:
                self.metrics.execs.labels(lv.row.tier, "error").inc()
                raise
            self.metrics.exec_seconds.labels(lv.row.tier).observe(time.perf_counter() - t0)
            outcome = "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
            self.metrics.execs.labels(lv.row.tier, outcome).inc()
            return res

        return await self._use(sandbox_id, owner, run)

    async def exec_stream(
        self, sandbox_id: str, owner: str, req: ExecRequest
    ) -> AsyncIterator[ExecEvent]:
        # validate before the first event so errors become proper HTTP errors
        self._live_for(sandbox_id, owner)
        queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue(maxsize=256)

        async def sink(stream: str, chunk: bytes) -> None:
            await queue.put(
                ExecEvent(type=stream, data=chunk.decode("utf-8", errors="replace"))  # type: ignore[arg-type]
            )

        async def runner() -> None:
            try:
                res = await self._exec(sandbox_id, owner, req, sink)
                await queue.put(ExecEvent(type="exit", result=res))
            except DsecError as e:
                await queue.put(ExecEvent(type="error", error=e.to_wire()["error"]))
            except Exception as e:  # pragma: no cover - reported to the client, logged here
                log.exception("exec stream failed")
                await queue.put(ExecEvent(type="error", error=InternalError(str(e)).to_wire()["error"]))
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
        self.metrics.file_ops.labels("read").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._files(lv).read(path, self.limits.max_read_bytes)
        )

    async def write_file(
        self, sandbox_id: str, owner: str, path: str, data: bytes, mode: int = 0o644
    ) -> FileInfo:
        self.metrics.file_ops.labels("write").inc()
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"mode {mode:o} is not a permission mode")
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).write(path, data, mode))

    async def list_files(
        self, sandbox_id: str, owner: str, path: str, depth: int = 1
    ) -> list[FileInfo]:
        self.metrics.file_ops.labels("list").inc()
        if not 1 <= depth <= 32:
            raise InvalidRequest("depth must be between 1 and 32")
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).list(path, depth))

    async def stat_file(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        self.metrics.file_ops.labels("stat").inc()
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).stat(path))

    async def remove_file(
        self, sandbox_id: str, owner: str, path: str, recursive: bool = False
    ) -> None:
        self.metrics.file_ops.labels("remove").inc()
        await self._use(sandbox_id, owner, lambda lv: self._files(lv).remove(path, recursive))

    async def make_dir(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        self.metrics.file_ops.labels("mkdir").inc()
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).mkdir(path))

    async def rename_file(self, sandbox_id: str, owner: str, src: str, dst: str) -> FileInfo:
        self.metrics.file_ops.labels("rename").inc()
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).rename(src, dst))

    async def upload_tar(self, sandbox_id: str, owner: str, path: str, data: bytes) -> int:
        self.metrics.file_ops.labels("upload_tar").inc()
        if len(data) > self.limits.max_tar_bytes:
            raise PayloadTooLarge(f"tar upload is larger than {self.limits.max_tar_bytes} bytes")
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).upload_tar(path, data))

    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self.metrics.file_ops.labels("download_tar").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._files(lv).download_tar(path, self.limits.max_tar_bytes)
        )

    # ------------------------------------------------------------------ images
    async def list_images(self) -> list[ImageInfo]:
        return list(self.layers.list_images())

    async def get_image(self, name: str) -> ImageInfo:
        return self.layers.get_image(name)  # type: ignore[no-any-return]

    async def list_layers(self) -> list[LayerInfo]:
        return list(self.layers.list_layers())

    async def build_image(
        self, path: str, name: str, kind: str = "workspace", base: str | None = None
    ) -> ImageInfo:
        from pathlib import Path

        p = Path(path)
        if not p.is_absolute() or not p.exists():
            raise InvalidRequest(f"build source {path!r} does not exist on the server")
        if base is not None:
            await self.layers.ensure_image(base)
        return await asyncio.to_thread(self.layers.build_image, p, name, kind, base)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ node
    async def capabilities(self) -> list[Capabilities]:
        out = []
        for tier in TIERS:
            rt = self.runtimes.get(tier)
            if rt is None:
                out.append(
                    Capabilities(
                        tier=tier,  # type: ignore[arg-type]
                        available=False,
                        reason="not enabled on this node",
                        exec=False,
                        files=False,
                        streaming=False,
                    )
                )
            else:
                out.append(rt.capabilities())
        return out

    async def node_info(self) -> NodeInfo:
        return NodeInfo(
            node=self.node,
            version=__version__,
            tiers=await self.capabilities(),
            sandboxes=len(self._live),
            cpus=self._cpus,
            memory_mb=self._mem_mb,
        )

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    async def stats(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "live": len(self._live),
            "by_tier_state": {f"{t}/{s}": n for (t, s), n in self.registry.count_by().items()},
        }


def _total_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 1024
