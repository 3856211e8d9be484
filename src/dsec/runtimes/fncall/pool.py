"""Server side of the fncall tier: zygotes, workers and warm pools.

Glossary:
    pool: the warm workers of one (layers, warm kind) key. ``warm kind`` is ``python`` (a
        Python interpreter with common modules imported, waiting), ``bash`` (a started
        bash, waiting) or ``none`` (only the locked-down agent; compilers run per call).
    zygote: one process per pool, the image's own Python running as root in a private
        mount namespace whose root is the pool's read-only overlay; it clones workers.
    worker: one disposable sandbox: own pid, mount, ipc, uts and net namespaces, own cgroup
        (CPU quota, memory and pids limits), rlimits, seccomp, Landlock, uid 1000. Serves one
        ``run`` (then it is killed) or, claimed as a sandbox, any number of ``exec``.

cgroups (both layouts, through :mod:`dsec.privileged.cgroups`): a pool's cgroup
``<prefix>/<pool>`` holds only its workers' leaves ``w<N>``; the zygote makes each one by
directory descriptor (:func:`worker_cgroup_plan`). The zygote itself stays in the server's
cgroup, outside the pool's: on v2 the pool hands its controllers to its workers and so may
hold no process, and the server's cgroup is a leaf (``dsec-supervisor`` once
:func:`~dsec.privileged.cgroups.prepare` ran, which the tier's start does).

Claiming takes a ready worker (creation = claim). The pool refills in the background and
sizes its ready set to demand: ``target = clamp(min_ready, max_ready, claims/s x refill
latency x 2 + waiting claims)``; surplus ready workers above the target are retired after
``idle_retire_s``. See ``docs/design/fncall.md`` for measurements.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import (
    InvalidRequest,
    QuotaExceeded,
    SandboxError,
    SandboxTimeout,
    ServiceUnavailable,
)
from dsec.layers.rootfs import mount_init_dir, release_init_dir
from dsec.privileged import landlock as landlock_module
from dsec.privileged.cgroups import Cgroup, cgroup
from dsec.privileged.mount import erofs_mount_sources, reconfigure
from dsec.runtimes.container.native import build_native
from dsec.runtimes.fncall import seccomp as seccomp_module
from dsec.runtimes.fncall import zygote as zygote_module

log = logging.getLogger("dsec.fncall")

__all__ = ["PoolConfig", "ScratchSize", "Worker", "WorkerPool", "build_launcher"]

ZYGOTE_PYTHON = "/usr/bin/python3"
"""The interpreter every pool's zygote runs, inside the pool's image."""
AGENT_CGROUP = "agent"
"""The child of a worker's cgroup (in the pids hierarchy) its agent lives in. Each command the
agent runs gets a child of its own, ``c<N>``, whose ``pids.max`` leaves the worker a reserve
(:func:`~dsec.runtimes.fncall.zygote.command_pids_max`): a fork bomb a command leaves behind
cannot take the processes the next command (a ``kill -9 -1``) needs."""
SPAWN_PATH = "/dev/.dsec-spawn"
"""Where ``fncall_launch`` binds the spawn helper (``native/fncall_spawn.c``) in a pool's root:
every command of a worker's agent execs through it."""
LAUNCH_NO_PROGRAM = 127
"""Exit status of ``fncall_launch`` when the image has no ``ZYGOTE_PYTHON``."""

FRAME = struct.Struct("<II")
MAX_FRAME = 512 << 20
NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"
_build_lock = threading.Lock()

ChunkSink = Callable[[str, bytes], Awaitable[None]]


def build_launcher(bin_dir: Path) -> Path:
    """Compile ``native/fncall_launch.c`` into ``bin_dir`` (cached by source hash)."""
    src = NATIVE_DIR / "fncall_launch.c"
    text = src.read_bytes()
    out = bin_dir / f"fncall_launch-{hashlib.sha256(text).hexdigest()[:16]}"
    if out.exists():
        return out
    with _build_lock:
        if out.exists():
            return out
        cc = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)
        if cc is None:
            raise SandboxError(
                "the fncall tier needs a C compiler to build its launcher (install 'gcc')",
                missing="gcc",
            )
        bin_dir.mkdir(parents=True, exist_ok=True)
        tmp = bin_dir / f".{out.name}.{os.getpid()}.tmp"
        proc = subprocess.run(
            [cc, "-O2", "-Wall", "-o", str(tmp), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SandboxError(f"building fncall_launch failed: {proc.stderr[-800:]}")
        os.replace(tmp, out)
    return out


@dataclass
class PoolConfig:
    """Limits and sizes of one pool. Units: MiB, cores, seconds.

    ``memory_mb``/``pids``/``cpu`` are each worker's cgroup limits (a call may lower the
    memory limit); ``work_mb`` is the most the worker's scratch tmpfs holds, the one
    filesystem ``/work``, ``/tmp``, ``/dev/shm`` and ``/mnt`` share, within what
    :func:`scratch_limits` leaves of ``memory_mb``.
    """

    min_ready: int = 2
    max_ready: int = 32
    max_workers: int = 256
    memory_mb: int = 1024
    pids: int = 256
    cpu: float = 1.0
    work_mb: int = 512
    nofile: int = 1024
    fsize_mb: int = 512
    uid: int = 1000
    gid: int = 1000
    hostname: str = "sandbox"
    claim_timeout_s: float = 30.0
    idle_retire_s: float = 10.0
    spawn_batch: int = 8
    preload: tuple[str, ...] = (
        "subprocess",
        "json",
        "re",
        "math",
        "collections",
        "itertools",
        "functools",
        "heapq",
        "bisect",
        "random",
        "string",
        "datetime",
        "typing",
        "decimal",
        "fractions",
        "statistics",
        "dataclasses",
        "copy",
        "io",
        "array",
        "enum",
        "operator",
        "textwrap",
        "unittest",
        "hashlib",
        "base64",
        "struct",
        "time",
        "threading",
        "traceback",
        "atexit",
        "numpy",
        "sympy",
    )
    env: dict[str, str] = field(
        default_factory=lambda: {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "USER": "sandbox",
            "TMPDIR": "/tmp",
        }
    )


@dataclass(frozen=True)
class ScratchSize:
    """A worker's scratch tmpfs (``/work``, ``/tmp``, ``/dev/shm`` and ``/mnt``: one
    filesystem): ``mb`` MiB of files and ``inodes`` files and directories.

    Both are charged to the worker's memory cgroup (a tmpfs page to the process that wrote
    it, an inode, ~1 KiB of kernel memory, 0.97 KiB measured on 6.18, to the one that made
    it), and neither can be reclaimed without swap: were they allowed past the memory limit,
    filling the disk would end in the OOM killer instead of ENOSPC. So :meth:`fit` keeps
    them together within the memory limit less a reserve for the agent and the kernel (an
    eighth, at least 16 MiB, at most half): seven eighths of that room for files (and at
    most ``disk_mb``), one eighth for inodes. And the commands run at ``oom_score_adj``
    1000 (the agent at 0, or -941 where root may), so a command that needs memory while
    the disk is full is what dies, not the agent.
    """

    mb: int
    inodes: int

    @classmethod
    def fit(cls, memory_mb: int, disk_mb: int) -> ScratchSize:
        """The scratch of a worker with ``memory_mb`` MiB of memory, at most ``disk_mb``."""
        reserve = max(16, memory_mb // 8)
        room = max(memory_mb // 2, memory_mb - reserve)
        return cls(mb=max(1, min(disk_mb, room - room // 8)), inodes=max(1024, room // 8 * 1024))

    def mount_options(self) -> dict[str, str]:
        """tmpfs options (``size``, ``nr_inodes``) that give this size."""
        return {"size": f"{self.mb}m", "nr_inodes": str(self.inodes)}


def worker_cgroup_plan(pool_cgroup: Cgroup, config: PoolConfig) -> dict[str, Any]:
    """How the zygote makes each worker's cgroup below ``pool_cgroup`` (it sees no cgroup file
    system, only descriptors of the pool's directories), computed once per pool:
    ``hierarchies`` to open, in the order of the descriptors the zygote gets (v1: those the
    limits are in, so no ``cpuacct``: a worker's CPU time comes from its processes; v2:
    ``""``), ``writes`` ``[hierarchy, file, value]`` in order into a fresh, unlimited cgroup,
    ``procs_file``, the file a process joins by, and the pids hierarchy (``pids_hierarchy``)
    with the ``nest_writes`` that let a worker's cgroup have children there: the agent
    lives in the child ``agent_cgroup`` of it and each command in a child of its own
    (:data:`AGENT_CGROUP`). The zygote's :func:`~dsec.runtimes.fncall.zygote.cgroup_steps`
    turns it into system calls."""
    writes = pool_cgroup.limit_writes(
        cpu=config.cpu,
        memory_bytes=config.memory_mb << 20,
        pids=config.pids,
        raising_memory=False,  # from the kernel's default, no limit
    )
    hierarchies: list[str] = []
    for w in writes:
        if w.hierarchy not in hierarchies:
            hierarchies.append(w.hierarchy)
    return {
        "hierarchies": hierarchies,
        "writes": [[w.hierarchy, w.file, w.value] for w in writes],
        "procs_file": pool_cgroup.PROCS_FILE,
        "pids_hierarchy": pool_cgroup.PIDS_HIERARCHY,
        "nest_writes": [[w.hierarchy, w.file, w.value] for w in pool_cgroup.nest_pids_writes()],
        "agent_cgroup": AGENT_CGROUP,
    }


class _FrameReader:
    """Incremental parser of ``<II`` json_len blob_len frames."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self.buf += data
        out: list[tuple[dict[str, Any], bytes]] = []
        while len(self.buf) >= FRAME.size:
            jlen, blen = FRAME.unpack_from(self.buf)
            if jlen > MAX_FRAME or blen > MAX_FRAME:
                raise SandboxError("worker sent an oversized frame")
            end = FRAME.size + jlen + blen
            if len(self.buf) < end:
                break
            header = json.loads(bytes(self.buf[FRAME.size : FRAME.size + jlen]))
            blob = bytes(self.buf[FRAME.size + jlen : end])
            del self.buf[:end]
            if not isinstance(header, dict):
                raise SandboxError("worker sent a malformed frame")
            out.append((header, blob))
        return out


def encode_frame(header: dict[str, Any], blob: bytes = b"") -> bytes:
    data = json.dumps(header, separators=(",", ":")).encode()
    return FRAME.pack(len(data), len(blob)) + data + blob


class Worker:
    """One worker as the server sees it: its agent socket, pidfd and cgroup.

    Frames from the agent go to ``inbox`` (a queue the current caller reads); ``chunk``
    frames go to ``sink`` when one is set. ``dead`` is set when the zygote reaps it.
    """

    def __init__(
        self, pool: WorkerPool, wid: int, pid: int, sock: socket.socket, pidfd: int
    ) -> None:
        self.pool = pool
        self.wid = wid
        self.pid = pid
        self.sock = sock
        self.pidfd = pidfd
        self.created = time.monotonic()
        self.ready_at: float | None = None
        self.cgroup = pool.cgroup.child(f"w{wid}")
        self.memory_limit_bytes = pool.config.memory_mb << 20
        self.scratch = ScratchSize.fit(pool.config.memory_mb, pool.config.work_mb)
        self.inbox: asyncio.Queue[tuple[dict[str, Any], bytes] | None] = asyncio.Queue()
        self.sink: ChunkSink | None = None
        self.exit_status: int | None = None
        self.dead = asyncio.Event()
        self.killed = False
        self.killed_alive = False  # dsec sent its SIGKILL before the worker was seen dead
        self.eof = False
        self._oom_seen = 0  # OOM kills counted while the cgroup was there to read
        self._limit_seen = 0  # memory limit hits, likewise
        self._reader = _FrameReader()
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def cgroup_rel(self) -> str:
        return self.cgroup.rel

    @property
    def audit_id(self) -> int | None:
        """The loginuid the worker's processes carry in the kernel's seccomp records (None:
        its pool does not log refusals)."""
        base = self.pool.audit_base
        return None if base is None else seccomp_module.worker_audit_id(base, self.wid)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(65536)  # below malloc's mmap threshold: no fresh pages per call
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_reader()
            self.oom_kills()  # read now: the pool may remove the dead worker's cgroup first
            self.inbox.put_nowait(None)
            return
        try:
            frames = self._reader.feed(data)
        except (SandboxError, ValueError):
            self._close_reader()
            self.inbox.put_nowait(({"op": "error", "message": "malformed frame from worker"}, b""))
            return
        for header, blob in frames:
            op = header.get("op")
            if op == "ready":
                self.marks = header.get("marks")
                self.setup_minflt = header.get("minflt")  # diagnostics: agent page faults
                self.pool._on_ready(self)
            elif op == "chunk" and self.sink is not None:
                sink = self.sink
                stream = str(header.get("stream"))
                asyncio.ensure_future(sink(stream, blob))
            elif op == "chunk":
                pass
            elif op == "error" and self.ready_at is None:
                log.warning("fncall worker %s failed to start: %s", self.wid, header.get("message"))
                self.pool._on_start_failed(
                    self, str(header.get("message")), str(header.get("trace", ""))
                )
            else:
                self.inbox.put_nowait((header, blob))

    def _close_reader(self) -> None:
        if not self.eof:
            self.eof = True
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())

    async def send(self, header: dict[str, Any], blob: bytes = b"") -> None:
        data = encode_frame(header, blob)
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            raise SandboxError(f"fncall worker {self.wid} is gone: {e}") from e
        if n < len(data):
            await self._loop.sock_sendall(self.sock, memoryview(data)[n:])

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        """The next frame; raises SandboxError if the agent closed its socket."""
        item = await self.inbox.get()
        if item is None:
            self.inbox.put_nowait(None)  # keep reporting EOF
            raise SandboxError(f"fncall worker {self.wid} exited unexpectedly")
        return item

    def oom_kills(self) -> int:
        """Processes of the worker the kernel's OOM killer killed: read from its cgroup, or
        what was read when its socket closed once the cgroup is gone (under load the pool
        may remove a dead worker's cgroup before the call asks why it died)."""
        try:
            self._oom_seen = max(self._oom_seen, self.cgroup.oom_kills())
            self._limit_seen = max(self._limit_seen, self.cgroup.memory_limit_hits())
        except (OSError, ValueError):
            pass
        return self._oom_seen

    def _hit_its_memory_limit(self) -> bool:
        """An OOM kill counted, or a charge refused at the limit (counted before the kill,
        which the kernel counts only after sending its SIGKILL)."""
        return self.oom_kills() > 0 or self._limit_seen > 0

    async def killed_by_memory_limit(self, wait_s: float = 2.0) -> bool:
        """After the worker went away during a call: whether its memory limit did it. The
        counters first; else, once the zygote reported the exit (waited for up to
        ``wait_s``), a SIGKILL dsec did not send: on a loaded node the kernel's count of its
        OOM kill can come after the worker's socket closed and its cgroup was removed, and
        nothing else sends a worker SIGKILL (its agent is the init of its pid namespace)."""
        if self._hit_its_memory_limit():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.dead.wait(), wait_s)
        if self._hit_its_memory_limit():
            return True
        status = self.exit_status
        return (
            status is not None
            and not self.killed_alive
            and os.WIFSIGNALED(status)
            and os.WTERMSIG(status) == signal.SIGKILL
        )

    def set_memory_limit(self, limit_bytes: int) -> None:
        try:  # the direction from what was set last: no read of the current limit per call
            self.cgroup.set_memory(limit_bytes, raising=limit_bytes >= self.memory_limit_bytes)
        except OSError as e:
            raise SandboxError(f"cannot set the memory limit of worker {self.wid}: {e}") from e
        self.memory_limit_bytes = limit_bytes

    def fit_scratch(self, memory_mb: int, disk_mb: int) -> None:
        """Size the worker's scratch for ``memory_mb`` of memory and at most ``disk_mb``
        (:meth:`ScratchSize.fit`): a fresh worker's is the pool's. Changed in place, from the
        host (:func:`~dsec.privileged.mount.reconfigure` through ``/proc/<pid>/root``: a few
        system calls), only when it differs; a tmpfs holding more than its new size refuses
        (raises :class:`SandboxError`)."""
        want = ScratchSize.fit(memory_mb, disk_mb)
        if want == self.scratch:
            return
        try:
            reconfigure(f"/proc/{self.pid}/root/work", want.mount_options())
        except OSError as e:
            raise SandboxError(
                f"cannot size worker {self.wid}'s scratch to {want.mb} MiB, {want.inodes}"
                f" inodes: {e}"
            ) from e
        self.scratch = want

    def kill(self) -> None:
        """SIGKILL the worker (its pid namespace dies with it). Idempotent, never raises."""
        if not self.killed:
            self.killed = True
            self.killed_alive = not self.dead.is_set()
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        self._close_reader()

    def release_fds(self) -> None:
        self.kill()
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1


class WorkerPool:
    """Warm workers of one (layers, warm kind) key, created by one zygote."""

    def __init__(
        self,
        name: str,
        layer_files: list[Path],
        warm: str,
        config: PoolConfig,
        *,
        scratch: Path,
        bin_dir: Path,
        cgroup_prefix: str,
        bash_script: str = "/work/main.sh",
        log_denials: bool = False,
    ) -> None:
        self.name = name
        self.layer_files = layer_files
        self.warm = warm
        self.config = config
        self.scratch = scratch
        self.bin_dir = bin_dir
        self.bash_script = bash_script
        self.cgroup = cgroup(f"{cgroup_prefix}/{name}")
        self.ready: collections.deque[Worker] = collections.deque()
        self.starting: dict[int, Worker | None] = {}
        self.busy: dict[int, Worker] = {}
        self.waiters: collections.deque[asyncio.Future[Worker]] = collections.deque()
        self._next_wid = 1
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        self._cg_fds: list[int] = []
        self._claims: collections.deque[float] = collections.deque()
        self._refill_latency_s = 0.02
        self._surplus_since: float | None = None
        self._closed = False
        self._start_failures = 0
        self.last_error: str | None = None
        self.landlock_abi = 0
        self.stats = {"spawned": 0, "claimed": 0, "waited": 0, "failed": 0, "exited": 0}
        self._spawn_dir = self.scratch.with_name(self.scratch.name + ".spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zygote_ready: asyncio.Future[dict[str, Any]] | None = None
        self._retire_task: asyncio.Task[None] | None = None
        self.audit_base: int | None = secrets.randbits(30) if log_denials else None
        """With ``log_denials``: where the workers' audit ids start (:attr:`Worker.audit_id`;
        their seccomp filters then report each refusal)."""

    @property
    def closed(self) -> bool:
        """True once the pool was closed or its zygote died (a new pool must be started)."""
        return self._closed

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Assemble the pool root, start the zygote and the first ``min_ready`` workers."""
        self._loop = asyncio.get_running_loop()
        launcher = await asyncio.to_thread(build_launcher, self.bin_dir)
        spawn = await asyncio.to_thread(build_native, self.bin_dir, "fncall_spawn")
        # bound into the pool's root from a tmpfs of its own: no node path in its mountinfo
        spawn = await asyncio.to_thread(mount_init_dir, self._spawn_dir, spawn)
        for f in self.layer_files:
            if not f.is_file():
                raise SandboxError(f"layer file {f} is missing")
        self.cgroup.create()
        self.cgroup.enable_child_controllers()  # the zygote makes the workers by mkdirat
        self.scratch.mkdir(parents=True, exist_ok=True)
        plan = worker_cgroup_plan(self.cgroup, self.config)
        dirs = self.cgroup.dirs()
        for h in plan["hierarchies"]:
            self._cg_fds.append(os.open(dirs[h], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        server_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = self._zygote_config(zygote_end.fileno(), plan)
        bundle = json.dumps(
            {
                "modules": [
                    ["dsec_landlock", inspect.getsource(landlock_module)],
                    ["dsec_seccomp", inspect.getsource(seccomp_module)],
                    ["dsec_zygote", inspect.getsource(zygote_module)],
                ],
                "config": cfg,
            }
        ).encode()
        log_path = self.scratch.parent / f"{self.name}.log"
        # each layer file, or a loop device bound to it where the kernel cannot mount EROFS
        # from the file (dsec.privileged.mount): held open until the zygote says hello, by
        # when the launcher has mounted them (AUTOCLEAR frees them with the pool's namespace)
        held = contextlib.ExitStack()
        layer_sources = await asyncio.to_thread(
            held.enter_context, erofs_mount_sources(self.layer_files)
        )
        try:
            with open(log_path, "ab") as logf:
                self._proc = subprocess.Popen(
                    [
                        str(launcher),
                        "--spawn",
                        str(spawn),
                        str(self.scratch),
                        "64",
                        *layer_sources,
                        "--",
                        ZYGOTE_PYTHON,
                        "-I",
                        "-B",
                        "-c",
                        zygote_module.BOOTSTRAP,
                    ],
                    stdin=subprocess.PIPE,
                    stdout=logf,
                    stderr=logf,
                    pass_fds=(zygote_end.fileno(), *self._cg_fds),
                    close_fds=True,
                    # its own process group: should it die before reaping its workers, they come
                    # back to the edge in a group no code here waits for, and its child reaper
                    # takes them (dsec.privileged.reaper); this Popen waits for the zygote
                    process_group=0,
                    env={
                        "PATH": "/usr/bin:/bin",
                        "LANG": "C.UTF-8",
                        **{k: v for k, v in self.config.env.items() if k != "PATH"},
                    },
                )
            zygote_end.close()
            for fd in self._cg_fds:
                os.close(fd)
            self._cg_fds = []
            assert self._proc.stdin is not None
            proc_stdin = self._proc.stdin

            def send_bundle() -> None:
                # the launcher exits early when the image cannot run a zygote (no python3): the
                # bundle (larger than a pipe's 64 KiB) then meets a closed pipe, and the exit
                # status below says why
                with contextlib.suppress(BrokenPipeError):
                    proc_stdin.write(bundle)
                with contextlib.suppress(BrokenPipeError):
                    proc_stdin.close()

            await asyncio.to_thread(send_bundle)
            self._ctl = server_end
            server_end.setblocking(False)
            self._zygote_ready = self._loop.create_future()
            self._loop.add_reader(server_end.fileno(), self._on_zygote_message)
            try:
                hello = await asyncio.wait_for(asyncio.shield(self._zygote_ready), 60)
            except (TimeoutError, SandboxError) as e:
                tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
                proc = self._proc
                await self.close()
                if proc is not None and proc.returncode == LAUNCH_NO_PROGRAM:
                    raise InvalidRequest(
                        f"the image has no {ZYGOTE_PYTHON}: fncall sandboxes run a Python 3"
                        " worker inside their image; use one that has it (e.g. 'debian')",
                        missing=ZYGOTE_PYTHON,
                    ) from None
                raise SandboxError(
                    f"fncall zygote for pool {self.name} did not start: {e}; log: {tail}"
                ) from e
        finally:
            held.close()
        self.landlock_abi = int(hello.get("landlock_abi", 0))
        self._retire_task = self._loop.create_task(self._retire_loop())
        self._refill()

    def _zygote_config(self, ctl_fd: int, cgroup_plan: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        return {
            "ctl_fd": ctl_fd,
            "cgroup": {**cgroup_plan, "fds": list(self._cg_fds)},
            "uid": c.uid,
            "gid": c.gid,
            "hostname": c.hostname,
            "warm": self.warm,
            "bash_script": self.bash_script,
            "preload": list(c.preload) if self.warm == "python" else ["subprocess"],
            "scratch": ScratchSize.fit(c.memory_mb, c.work_mb).mount_options(),
            "nofile": c.nofile,
            "fsize_bytes": c.fsize_mb << 20,
            "env": c.env,
            "spawn": SPAWN_PATH,
            "audit_base": self.audit_base,
        }

    async def close(self) -> None:
        """Kill every worker and the zygote, remove the pool's cgroups. Idempotent."""
        self._closed = True
        if self._retire_task is not None:
            self._retire_task.cancel()
        for fut in self.waiters:
            if not fut.done():
                fut.set_exception(ServiceUnavailable(f"fncall pool {self.name} is closing"))
        self.waiters.clear()
        workers = [
            *self.ready,
            *self.busy.values(),
            *(w for w in self.starting.values() if w is not None),
        ]
        for w in workers:
            w.release_fds()
        self.ready.clear()
        self.busy.clear()
        self.starting.clear()
        if self._ctl is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._ctl.fileno())
            with contextlib.suppress(OSError):
                self._ctl.send(b'{"op":"exit"}')
            self._ctl.close()
            self._ctl = None
        if self._proc is not None:
            proc = self._proc
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 5)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            self._proc = None
        await asyncio.to_thread(self._remove_cgroups)
        with contextlib.suppress(OSError):  # empty: its mounts lived in the zygote's namespace
            self.scratch.rmdir()
        await asyncio.to_thread(release_init_dir, self._spawn_dir)
        with contextlib.suppress(OSError):
            self._spawn_dir.rmdir()

    def _remove_cgroups(self) -> None:
        try:  # the workers' leaves first, killing what is left in them
            self.cgroup.remove(5)
        except (OSError, TimeoutError) as e:
            log.warning("cannot remove cgroup %s: %s", self.cgroup.rel, e)

    # --- zygote messages ---------------------------------------------------------------

    def _on_zygote_message(self, _arg: object = None) -> None:
        assert self._ctl is not None
        while True:
            try:
                raw, fds, _flags, _addr = socket.recv_fds(self._ctl, 1 << 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                raw, fds = b"", []
            if not raw:
                self._on_zygote_gone()
                return
            try:
                msg = json.loads(raw)
            except ValueError:
                for fd in fds:
                    os.close(fd)
                continue
            op = msg.get("op")
            if op == "worker" and len(fds) == 2:
                self._on_worker(int(msg["wid"]), int(msg["pid"]), fds[0], fds[1])
            elif op == "exited":
                self._on_exited(int(msg["wid"]), int(msg.get("status", -1)))
            elif op == "zygote_ready":
                if self._zygote_ready is not None and not self._zygote_ready.done():
                    self._zygote_ready.set_result(msg)
            elif op == "spawn_failed":
                self.starting.pop(int(msg["wid"]), None)
                self._note_failure(str(msg.get("message")))
            else:
                for fd in fds:
                    os.close(fd)

    def _on_zygote_gone(self) -> None:
        if self._ctl is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._ctl.fileno())
        err = SandboxError(f"fncall zygote of pool {self.name} exited")
        if self._zygote_ready is not None and not self._zygote_ready.done():
            self._zygote_ready.set_exception(err)
        if not self._closed:
            log.error("fncall zygote of pool %s exited", self.name)
            self.last_error = "zygote exited"
            self._closed = True
            for fut in self.waiters:
                if not fut.done():
                    fut.set_exception(err)
            self.waiters.clear()
            for w in [*self.ready, *self.busy.values()]:
                w.release_fds()
                w.dead.set()
            self.ready.clear()

    def _on_worker(self, wid: int, pid: int, sock_fd: int, pidfd: int) -> None:
        sock = socket.socket(fileno=sock_fd)
        if wid not in self.starting or self._closed:
            w = Worker(self, wid, pid, sock, pidfd)
            w.release_fds()
            return
        self.starting[wid] = Worker(self, wid, pid, sock, pidfd)
        self.stats["spawned"] += 1

    def _on_ready(self, w: Worker) -> None:
        if self.starting.pop(w.wid, None) is None:
            w.release_fds()
            return
        w.ready_at = time.monotonic()
        self._start_failures = 0
        self._refill_latency_s = 0.8 * self._refill_latency_s + 0.2 * (w.ready_at - w.created)
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                self.busy[w.wid] = w
                fut.set_result(w)
                return
        self.ready.append(w)

    def _on_start_failed(self, w: Worker, message: str, trace: str) -> None:
        self.starting.pop(w.wid, None)
        w.release_fds()
        self._note_failure(message + ("\n" + trace if trace else ""))

    def _note_failure(self, message: str) -> None:
        self.stats["failed"] += 1
        self._start_failures += 1
        self.last_error = message
        if self._start_failures >= 5:
            err = SandboxError(
                f"fncall workers of pool {self.name} fail to start: {message[:2000]}"
            )
            for fut in self.waiters:
                if not fut.done():
                    fut.set_exception(err)
            self.waiters.clear()
            return
        self._refill()

    def _on_exited(self, wid: int, status: int) -> None:
        self.stats["exited"] += 1
        w = self.busy.pop(wid, None)
        if w is None:
            for cand in self.ready:
                if cand.wid == wid:
                    w = cand
                    self.ready.remove(cand)
                    break
        if w is None:
            starting = self.starting.pop(wid, None)
            if starting is not None:
                starting.release_fds()
                self._note_failure(f"worker exited during setup (status {status})")
            return
        w.exit_status = status
        w.dead.set()
        w.release_fds()
        self._refill()

    # --- claiming ----------------------------------------------------------------------

    def _target_ready(self) -> int:
        now = time.monotonic()
        while self._claims and now - self._claims[0] > 1.0:
            self._claims.popleft()
        rate = len(self._claims)  # claims in the last second
        want = math.ceil(rate * self._refill_latency_s * 2) + len(self.waiters)
        return max(self.config.min_ready, min(self.config.max_ready, want))

    def _refill(self) -> None:
        if self._closed or self._ctl is None or self._start_failures >= 5:
            return
        total = len(self.ready) + len(self.starting) + len(self.busy)
        need = self._target_ready() - len(self.ready) - len(self.starting)
        need = min(need, self.config.max_workers - total, self.config.spawn_batch * 4)
        if need <= 0:
            return
        wids = list(range(self._next_wid, self._next_wid + need))
        self._next_wid += need
        for wid in wids:
            self.starting[wid] = None
        for i in range(0, len(wids), self.config.spawn_batch):
            batch = wids[i : i + self.config.spawn_batch]
            try:
                self._ctl.send(json.dumps({"op": "spawn", "wids": batch}).encode())
            except OSError as e:
                for wid in batch:
                    self.starting.pop(wid, None)
                self.last_error = f"cannot reach the zygote: {e}"
                return

    async def claim(self, timeout_s: float | None = None) -> Worker:
        """Take a ready worker (waiting for one if none is ready) and mark it busy."""
        if self._closed:
            raise ServiceUnavailable(
                f"fncall pool {self.name} is closed: {self.last_error or 'closing'}"
            )
        self.stats["claimed"] += 1
        self._claims.append(time.monotonic())
        while self.ready:
            w = self.ready.popleft()
            if w.eof or w.killed:
                w.release_fds()
                continue
            self.busy[w.wid] = w
            self._refill()
            return w
        if self._start_failures >= 5:
            raise SandboxError(
                f"fncall workers of pool {self.name} fail to start: {(self.last_error or '')[:2000]}"
            )
        if len(self.busy) >= self.config.max_workers:
            raise QuotaExceeded(
                f"fncall pool {self.name} has {len(self.busy)} busy workers (max_workers)"
            )
        assert self._loop is not None
        fut: asyncio.Future[Worker] = self._loop.create_future()
        self.waiters.append(fut)
        self.stats["waited"] += 1
        self._refill()
        try:
            return await asyncio.wait_for(fut, timeout_s or self.config.claim_timeout_s)
        except TimeoutError:
            raise SandboxTimeout(
                f"no fncall worker of pool {self.name} became ready in time: {self.last_error or ''}"
            ) from None
        finally:
            with contextlib.suppress(ValueError):
                self.waiters.remove(fut)

    def discard(self, w: Worker) -> None:
        """Kill a claimed worker (after its call). The zygote reaps it and removes its cgroup."""
        w.kill()
        self._refill()

    async def _retire_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(1.0)
            target = self._target_ready()
            if len(self.ready) > target:
                now = time.monotonic()
                if self._surplus_since is None:
                    self._surplus_since = now
                elif now - self._surplus_since >= self.config.idle_retire_s:
                    while len(self.ready) > target:
                        w = self.ready.pop()
                        w.kill()
                    self._surplus_since = None
            else:
                self._surplus_since = None
                self._refill()

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "warm": self.warm,
            "ready": len(self.ready),
            "starting": len(self.starting),
            "busy": len(self.busy),
            "target": self._target_ready(),
            "refill_latency_ms": round(self._refill_latency_s * 1000, 2),
            "landlock_abi": self.landlock_abi,
            "last_error": self.last_error,
            **self.stats,
        }
