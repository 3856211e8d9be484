"""``FncallRuntime``: the fncall tier behind the :class:`~dsec.contract.runtime.Runtime` contract.

A sandbox of this tier is one warm worker claimed from the pool of its layers (creation is a
claim: no mount, no process start on the request path). ``exec`` runs commands in the
worker's namespaces through its agent; ``files`` works host-side on the worker's root; the
worker is killed by ``destroy``. ``run_code`` (one call, one worker) is served by
:class:`~dsec.runtimes.fncall.service.RunCodeService` on top of :meth:`FncallRuntime.pool`.

Capabilities: exec, files, streaming. No pause, snapshot, fork, network, TTY; not persistent
(workers die with the server: their zygote exits when the server's socket closes, and the
workers follow by ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.config import Paths
from dsec.contract.runtime import Handle, OutputSink, RuntimeFacts, SandboxFiles, SandboxSpec
from dsec.errors import (
    CapabilityNotSupported,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    TierUnavailable,
)
from dsec.models import ExecRequest, ExecResult
from dsec.privileged.cgroups import cgroup, host_layout, prepare
from dsec.privileged.seccomp_log import audit_on
from dsec.runtimes.fncall.files import WorkerFiles
from dsec.runtimes.fncall.languages import LanguageSpec
from dsec.runtimes.fncall.pool import PoolConfig, Worker, WorkerPool
from dsec.runtimes.fncall.state import FncallState
from dsec.runtimes.usage import SandboxUsage, disk_usage, processes_cpu_ns

log = logging.getLogger("dsec.fncall")

__all__ = ["FncallConfig", "FncallRuntime"]

_SANDBOX_USERS = {None, "sandbox", "1000", "1000:1000"}


@dataclass
class FncallConfig:
    """Settings of the tier. ``pool`` is the default of every pool; ``pools`` overrides
    ``min_ready``/``max_ready``/... per warm kind or language name (e.g. ``{"python":
    {"min_ready": 16}}``)."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_image: str = "debian"
    max_pools: int = 32


def _cgroup_prefix(home: Path) -> str:
    return f"dsec-{hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]}-fncall"


class FncallRuntime:
    """The fncall tier on this node. ``mounts`` is accepted for symmetry with the container
    tier and unused: each pool mounts its EROFS files itself, inside a private mount
    namespace, so no mount of this tier can outlive its processes."""

    tier = "fncall"

    def __init__(
        self,
        paths: Paths,
        mounts: Any = None,
        layer_store: Any = None,
        config: FncallConfig | None = None,
    ) -> None:
        self.paths = paths
        self.layer_store = layer_store
        self.config = config or FncallConfig()
        self.cgroup_prefix = _cgroup_prefix(paths.home)
        self._pools: dict[tuple[tuple[str, ...], str], WorkerPool] = {}
        self._pool_locks: dict[tuple[tuple[str, ...], str], asyncio.Lock] = {}
        self._toolkit_locks: dict[str, asyncio.Lock] = {}
        self._language_pools: dict[
            str, WorkerPool
        ] = {}  # resolved once: no layer-store query per call
        self._handles: dict[str, Worker] = {}
        self._exec_locks: dict[str, asyncio.Lock] = {}
        self._env: dict[str, dict[str, str]] = {}
        self._next_exec_id = 1
        self._unavailable: str | None = None
        self._started = False
        self.log_denials = audit_on()
        """The workers' seccomp filters report each refusal, under a loginuid per worker
        (:attr:`~dsec.runtimes.fncall.pool.Worker.audit_id`): ``DSEC_AUDIT``."""
        self.log_landlock = self.log_denials
        """The workers' Landlock domains report each refusal (kernel 6.15+, audit enabled:
        :mod:`dsec.privileged.seccomp_log`)."""

    # --- lifecycle -----------------------------------------------------------------------

    def _check_node(self) -> str | None:
        if os.geteuid() != 0:
            return "the fncall tier needs root (namespaces, mounts, cgroups)"
        layout = host_layout()
        if not layout.usable:
            return f"the fncall tier needs cgroups to confine its workers: {layout.reason}"
        return None

    def facts(self) -> RuntimeFacts:
        reason = self._unavailable or self._check_node()
        return RuntimeFacts(
            available=reason is None,
            reason=reason,
            max_cpu=float(os.cpu_count() or 1),
            max_memory_mb=self.config.pool.memory_mb * 4,
            persistent=False,
        )

    async def start(self) -> None:
        """Check the node, make dsec's cgroup base ready (v2: controllers enabled down to it,
        the server moved into a leaf of its own; idempotent) and remove cgroups a crashed
        predecessor left behind."""
        self._unavailable = self._check_node()
        if self._unavailable is None:
            try:
                for note in await asyncio.to_thread(prepare):
                    log.info("fncall: %s", note)
            except OSError as e:
                self._unavailable = f"the fncall tier cannot prepare its cgroups: {e}"
        if self._unavailable is None:
            await asyncio.to_thread(self._cleanup_stale_cgroups)
        self._started = True

    def _cleanup_stale_cgroups(self) -> None:
        """Remove the tier's cgroups (pools, then their workers' leaves first)."""
        try:
            cgroup(self.cgroup_prefix).remove(2)
        except (OSError, TimeoutError) as e:
            log.warning("fncall: cannot remove cgroup %s: %s", self.cgroup_prefix, e)

    async def close(self) -> None:
        """Kill every worker and zygote and remove this tier's cgroups."""
        pools = list(self._pools.values())
        self._pools.clear()
        self._language_pools.clear()
        self._handles.clear()
        await asyncio.gather(*(p.close() for p in pools), return_exceptions=True)
        if self._unavailable is None and self._started:
            await asyncio.to_thread(self._cleanup_stale_cgroups)

    # --- pools ----------------------------------------------------------------------------

    def _pool_config(self, warm: str, language: str | None) -> PoolConfig:
        base = self.config.pool
        over: dict[str, Any] = {
            **self.config.pools.get(warm, {}),
            **self.config.pools.get(language or "", {}),
        }
        return PoolConfig(**{**base.__dict__, **over}) if over else base

    async def pool(
        self,
        layer_files: list[Path],
        layer_digests: list[str],
        warm: str,
        language: str | None = None,
    ) -> WorkerPool:
        """The pool of these layers and warm kind, started on first use."""
        if self._unavailable:
            raise TierUnavailable(self._unavailable)
        key = (tuple(layer_digests), warm)
        pool = self._pools.get(key)
        if pool is not None and not pool.closed:
            return pool
        lock = self._pool_locks.setdefault(key, asyncio.Lock())
        async with lock:
            pool = self._pools.get(key)
            if pool is not None and not pool.closed:
                return pool
            if pool is not None:  # its zygote died: replace the pool
                del self._pools[key]
                await pool.close()
            if len(self._pools) >= self.config.max_pools:
                raise SandboxError(
                    f"the fncall tier already runs {len(self._pools)} pools (max_pools)"
                )
            digest = hashlib.sha256("\n".join([*layer_digests, warm]).encode()).hexdigest()[:12]
            name = f"{warm}-{digest}"
            pool = WorkerPool(
                name,
                list(layer_files),
                warm,
                self._pool_config(warm, language),
                scratch=self.paths.home / "fncall" / "pools" / name,
                bin_dir=self.paths.bin,
                cgroup_prefix=self.cgroup_prefix,
                log_denials=self.log_denials,
            )
            await pool.start()
            self._pools[key] = pool
            return pool

    async def image_layers(self, image: str) -> tuple[list[Path], list[str]]:
        """EROFS files and digests of an image from the layer store (built-in images built on first use)."""
        if self.layer_store is None:
            raise TierUnavailable("the fncall tier has no layer store")
        info = await self.layer_store.ensure_image(image)
        files = [Path(self.layer_store.layer_path(d)) for d in info.layers]
        return files, list(info.layers)

    async def pool_for_language(self, lang: LanguageSpec) -> WorkerPool:
        """The warm pool serving ``lang``: the base image with its toolkit layers stacked."""
        cached = self._language_pools.get(lang.name)
        if cached is not None and not cached.closed:
            return cached
        image = self.config.base_image
        if lang.toolkits:
            from dsec.runtimes.fncall.toolkits import build_toolkit_image

        for toolkit in lang.toolkits:  # each over the image of the ones before it
            lock = self._toolkit_locks.setdefault(f"{image}+{toolkit}", asyncio.Lock())
            async with lock:  # one build per toolkit at a time
                info = await asyncio.to_thread(
                    build_toolkit_image, self.layer_store, image, toolkit
                )
            image = info.name
        files, digests = await self.image_layers(image)
        pool = await self.pool(files, digests, lang.warm, lang.name)
        self._language_pools[lang.name] = pool
        return pool

    def pools(self) -> list[dict[str, Any]]:
        """A snapshot of every pool (ready/busy counts, refill latency, errors)."""
        return [p.snapshot() for p in self._pools.values()]

    # --- sandboxes ------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec) -> Handle:
        """Claim a warm worker of the spec's layers and apply its cpu/memory/pids limits."""
        if spec.user not in _SANDBOX_USERS:
            raise CapabilityNotSupported(
                f"fncall sandboxes run as the unprivileged user 'sandbox' only (got {spec.user!r})"
            )
        pool = await self.pool(
            [Path(p) for p in spec.layer_paths], list(spec.layer_digests), "none"
        )
        w = await pool.claim()
        try:
            await asyncio.to_thread(self._apply_limits, w, spec)
            # the agent starts the first command's helper now (no answer): it is in its
            # cgroup by the time the first exec comes
            await w.send({"op": "prepare"})
        except BaseException:
            pool.discard(w)
            raise
        self._handles[spec.id] = w
        self._exec_locks[spec.id] = asyncio.Lock()
        self._env[spec.id] = dict(spec.env)
        return Handle.of(
            spec.id, FncallState(pool=pool.name, wid=w.wid, pid=w.pid, auid=w.audit_id)
        )

    @staticmethod
    def _apply_limits(w: Worker, spec: SandboxSpec) -> None:
        w.set_memory_limit(spec.memory_mb << 20)
        cg = w.cgroup
        try:
            cg.set_pids(spec.pids)
            cg.set_cpu(spec.cpu)
        except OSError as e:
            raise SandboxError(f"cannot apply limits to worker {w.wid}: {e}") from e
        w.fit_scratch(spec.memory_mb, spec.disk_mb)

    def _worker(self, handle: Handle) -> Worker:
        w = self._handles.get(handle.id)
        if w is None:
            raise SandboxNotFound(f"no fncall sandbox {handle.id}")
        if w.dead.is_set() or w.killed or w.eof:
            raise SandboxStopped(f"fncall sandbox {handle.id} has stopped")
        return w

    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult:
        """Run one command in the worker (serialised per sandbox)."""
        if req.user not in _SANDBOX_USERS:
            raise CapabilityNotSupported(
                f"fncall sandboxes run commands as 'sandbox' only (got {req.user!r})"
            )
        w = self._worker(handle)
        if req.stdin is not None and req.stdin_b64 is not None:
            raise InvalidRequest("stdin and stdin_b64 are exclusive")
        try:
            stdin = (
                req.stdin.encode()
                if req.stdin is not None
                else base64.b64decode(req.stdin_b64 or "", validate=True)
            )
        except ValueError as e:
            raise InvalidRequest(f"stdin_b64 is not valid base64: {e}") from e
        async with self._exec_locks[handle.id]:
            rid = self._next_exec_id
            self._next_exec_id += 1
            header = {
                "op": "exec",
                "id": rid,
                "argv": req.argv(),
                "cwd": req.cwd,
                "env": {**self._env.get(handle.id, {}), **req.env},
                "timeout_s": req.timeout_s,
                "max_output": req.max_output_bytes,
                "stream": sink is not None,
            }
            w.sink = sink
            try:
                await w.send(header, stdin)
                try:
                    reply, blob = await asyncio.wait_for(w.receive(), req.timeout_s + 10.0)
                except TimeoutError:
                    w.kill()
                    raise SandboxError(f"fncall worker of {handle.id} stopped answering") from None
            finally:
                w.sink = None
        if reply.get("op") != "exit":
            raise SandboxError(f"fncall worker: {reply.get('message', reply)}")
        return result_from_agent(reply["result"], blob, oom=w.oom_kills() > 0)

    async def usage(self, handle: Handle) -> SandboxUsage:
        """:class:`dsec.contract.runtime.Measurable`: the worker's memory and pids cgroup, CPU
        time of its processes (workers are in no ``cpuacct`` hierarchy: attaching one costs
        every claim), and the fill of its private scratch tmpfs (no network on this tier)."""
        w = self._worker(handle)
        group, pid = w.cgroup, w.pid

        def read() -> SandboxUsage:
            try:
                cg = group.usage()
            except FileNotFoundError:
                raise SandboxStopped(f"fncall sandbox {handle.id} has stopped") from None
            cpu_ns = cg.cpu_usage_ns
            if cpu_ns is None:
                cpu_ns = processes_cpu_ns(group.procs_below() or [pid])
            try:  # the worker's scratch (/work, /tmp, ... share it), seen through its root
                used, total = disk_usage([f"/proc/{pid}/root/work"])
            except OSError:
                used, total = 0, 0
            return SandboxUsage(
                cpu_usage_ns=cpu_ns,
                memory_used_bytes=cg.memory_used_bytes,
                memory_cache_bytes=cg.memory_cache_bytes,
                memory_limit_bytes=cg.memory_limit_bytes,
                memory_peak_bytes=cg.memory_peak_bytes,
                disk_used_bytes=used,
                disk_total_bytes=total,
                pids=cg.pids,
                source=f"cgroup v{cg.version}"
                + (" + /proc/<pid>/stat" if cg.cpu_usage_ns is None else ""),
            )

        return await asyncio.to_thread(read)

    # --- audit ----------------------------------------------------------------------------

    def audit_id(self, handle: Handle) -> int | None:
        """:class:`dsec.contract.runtime.Audited`: the loginuid of the sandbox's worker (set
        when the worker was made, before any sandbox claimed it: one per worker)."""
        return handle.typed(FncallState).auid

    def limit_counters(self, handle: Handle) -> dict[str, int]:
        """:class:`dsec.contract.runtime.Audited`: OOM kills and refused forks of the worker's
        cgroup (zeros once the worker is gone)."""
        w = self._handles.get(handle.id)
        if w is None:
            return {}
        return {"oom_kill": w.oom_kills(), "pids_max": w.cgroup.pids_max_events()}

    def files(self, handle: Handle) -> SandboxFiles:
        w = self._worker(handle)
        return WorkerFiles(w.pid, w.pidfd, (self.config.pool.uid, self.config.pool.gid))

    async def destroy(self, handle: Handle) -> None:
        """Kill the worker (idempotent; its zygote reaps it and removes its cgroup)."""
        w = self._handles.pop(handle.id, None)
        self._exec_locks.pop(handle.id, None)
        self._env.pop(handle.id, None)
        if w is not None:
            w.pool.discard(w)

    async def recover(self, handle: Handle) -> bool:
        return handle.id in self._handles and not self._handles[handle.id].dead.is_set()

    async def alive(self, handle: Handle) -> bool:
        w = self._handles.get(handle.id)
        return w is not None and not (w.dead.is_set() or w.killed or w.eof)

    async def list_orphans(self, known: set[str]) -> list[str]:
        return [sid for sid in self._handles if sid not in known]

    async def destroy_orphan(self, sandbox_id: str) -> None:
        await self.destroy(Handle(id=sandbox_id))


def result_from_agent(
    res: dict[str, Any], blob: bytes, oom: bool = False, offset: int = 0
) -> ExecResult:
    """An :class:`ExecResult` from an agent's process report and the blob holding its output."""
    out_len, err_len = int(res.get("stdout_len", 0)), int(res.get("stderr_len", 0))
    stdout = blob[offset : offset + out_len]
    stderr = blob[offset + out_len : offset + out_len + err_len]
    if res.get("spawn_error"):
        stderr += (str(res["spawn_error"]) + "\n").encode()
    return ExecResult(
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        exit_code=res.get("exit_code"),
        signal=res.get("signal"),
        timed_out=bool(res.get("timed_out")),
        stdout_truncated=bool(res.get("stdout_truncated")),
        stderr_truncated=bool(res.get("stderr_truncated")),
        duration_ms=float(res.get("duration_s", 0.0)) * 1000.0,
        oom_killed=oom,
    )
