"""The fncall zygote and worker agent. Runs *inside* a pool's root, in the image's own Python.

Standard library only (plus the two sibling modules ``dsec_landlock`` and ``dsec_seccomp``,
which the server ships in the same bundle). The server starts it as::

    fncall_launch SCRATCH MB LAYERS... -- /usr/bin/python3 -I -B -c BOOTSTRAP   (stdin: bundle)

Process tree of one pool (host pid namespace on the left)::

    dsec server ──(SEQPACKET fd 3)── zygote (root, pool mount ns, modules imported, gc.freeze)
                                       └─ clone(NEWPID|NEWNS|NEWNET|NEWIPC|NEWUTS|PIDFD)
                                            worker agent "A" = pid 1 of its namespaces,
                                            uid 1000, seccomp + Landlock, own cgroup
                                              └─ warm interpreter "B" (pid 2): Python with the
                                                 modules imported, or a started bash, blocked
                                                 on a pipe until the call's code arrives

Zygote <-> server (SEQPACKET, JSON, fds by SCM_RIGHTS):
    server: {"op": "spawn", "wids": [..]}        zygote: {"op": "worker", "wid", "pid"} + [sock, pidfd]
    server: {"op": "exit"} (or EOF)              zygote: {"op": "exited", "wid", "status"}
Agent <-> server (stream socket, frames ``<II`` json_len blob_len, json, blob):
    agent: {"op": "ready"} | {"op": "error", "message"}
    server: {"op": "run", ...} -> agent: {"op": "result", ...}       (one per worker)
    server: {"op": "exec", "id", ...} -> agent: {"op": "chunk"}* {"op": "exit", ...}

The agent never runs user code in its own process: user code runs in B or in processes it
spawns, so the agent's reports (exit status, output, fetched files) cannot be forged by it
(ptrace and process_vm_* are denied, the agent is not dumpable).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import traceback
from typing import Any

try:  # inside the sandbox the server ships these as top-level modules
    import dsec_landlock as _landlock
    import dsec_seccomp as _seccomp
except ImportError:  # imported from the dsec package (tests, type checking)
    from dsec.privileged import landlock as _landlock
    from dsec.runtimes.fncall import seccomp as _seccomp

CLONE_NEWNS = 0x00020000
CLONE_PIDFD = 0x00001000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SYS_CLONE = 56
SYS_CLOSE_RANGE = 436
SYS_OPENAT2 = 437
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND = 0x2, 0x4, 0x8, 0x1000
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
_SINGLE_THREAD_ENV = (
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
"""Variables that keep numerical libraries from starting thread pools at import."""
FRAME = struct.Struct("<II")
MAX_FRAME = 512 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_pylibc = ctypes.PyDLL(None, use_errno=True)  # keeps the GIL across clone(), as os.fork() does
_pylibc.syscall.restype = ctypes.c_long


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


# --- framing -----------------------------------------------------------------------------


def send_frame(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    head = FRAME.pack(len(data), len(blob)) + data
    if len(blob) < 65536:
        sock.sendall(head + blob)
    else:
        sock.sendall(head)
        sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes] | None:
    head = _recv_exact(sock, FRAME.size)
    if head is None:
        return None
    jlen, blen = FRAME.unpack(head)
    if jlen > MAX_FRAME or blen > MAX_FRAME:
        raise ValueError("frame too large")
    data = _recv_exact(sock, jlen) if jlen else b""
    blob = _recv_exact(sock, blen) if blen else b""
    if data is None or blob is None:
        return None
    return json.loads(data), blob


# --- small syscalls --------------------------------------------------------------------


def _mount(src: str, target: str, fstype: str, flags: int, data: str | None) -> None:
    d = data.encode() if data else None
    if _libc.mount(src.encode(), target.encode(), fstype.encode(), flags, d) != 0:
        raise _oserror(f"mount {fstype} on {target}")


def _close_from(lowest: int) -> None:
    if _libc.syscall(SYS_CLOSE_RANGE, lowest, 0xFFFFFFFF, 0) != 0:
        os.closerange(lowest, 4096)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(
    dir_fd: int, path: str, flags: int, mode: int = 0, resolve: int = RESOLVE_BENEATH
) -> int:
    """openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS): ``..`` and symlinks cannot leave dir_fd.

    ``resolve=RESOLVE_IN_ROOT`` instead treats dir_fd as the root (absolute symlinks resolve
    inside it), which with ``/`` is the worker's own view of its file system."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve | RESOLVE_NO_MAGICLINKS)
    fd = int(
        _libc.syscall(SYS_OPENAT2, dir_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    )
    if fd < 0:
        raise _oserror(f"open {path}")
    return fd


MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


def collapse_heap() -> int:
    """Back the zygote's anonymous heap with 2 MiB transparent huge pages; returns bytes collapsed.

    Every worker is a fork of this heap and every fork copies, then unmaps, one page-table
    entry per 4 KiB page: on this kind of VM (PVM guest) that dominated the cost of a call
    (a 66 MB numpy+sympy heap: fork+exit 11 ms, 6 ms CPU). A PMD-mapped huge page is shared
    by fork with one entry per 2 MiB and zapped as one; a worker's first write into it splits
    only that PMD. Measured: fork+exit 3.2 ms, 3.1 ms CPU. ``MADV_COLLAPSE`` (Linux 6.1+)
    works whatever the sysfs THP mode except ``never``; failures (older kernel, no memory) are
    ignored: the heap just stays on 4 KiB pages.
    """
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        if len(fields) > 5 and fields[5] != "[heap]":
            continue  # file-backed or special ([stack], [vvar]): leave alone
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start = (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = hi & ~(HUGE_PAGE - 1)
        if end > start and _libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += end - start
    return done


# --- the zygote ------------------------------------------------------------------------


class Zygote:
    """Forks workers on request; reaps them and removes their cgroups."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.ctl = socket.socket(fileno=int(cfg["ctl_fd"]))
        self.cg_fds: list[int] = [int(fd) for fd in cfg["cgroup"]["fds"]]
        self.seccomp_prog = _seccomp.build_filter() if cfg.get("seccomp", True) else b""
        self.landlock_abi = _landlock.landlock_abi() if cfg.get("landlock", True) else 0
        self.collapsed_bytes = 0  # zygote heap backed by huge pages (collapse_heap)
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (wid, pid)

    def serve(self) -> None:
        # every worker is a clone() of this process, which must stay single-threaded: a
        # thread pool started by a preloaded module (OpenBLAS under numpy starts one per
        # core at import) would be missing in the child, holding locks it needs
        for var in _SINGLE_THREAD_ENV:
            os.environ[var] = "1"
        for name in self.cfg.get("preload", []):
            try:
                __import__(name)
            except Exception as e:
                print(f"zygote: preload {name}: {e}", file=sys.stderr)
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = 1  # no /proc mounted here
        if threads > 1:
            print(
                f"zygote: {threads} threads after the preloads; workers may hang", file=sys.stderr
            )
        gc.collect()
        gc.freeze()  # keep the imported heap shared copy-on-write in every worker
        if self.cfg.get("collapse_heap", True):
            self.collapsed_bytes = collapse_heap()
        self.sel.register(self.ctl, selectors.EVENT_READ)
        self.ctl.send(
            json.dumps(
                {
                    "op": "zygote_ready",
                    "landlock_abi": self.landlock_abi,
                    "pid": os.getpid(),
                    "huge_heap_bytes": self.collapsed_bytes,
                }
            ).encode()
        )
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.ctl:
                    raw = self.ctl.recv(1 << 16)
                    if not raw:
                        return
                    msg = json.loads(raw)
                    if msg["op"] == "exit":
                        return
                    if msg["op"] == "spawn":
                        for wid in msg["wids"]:
                            self.spawn(int(wid))
                else:
                    self.reap(int(key.fd))

    def spawn(self, wid: int) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        flags = int(
            self.cfg.get(
                "clone_flags",
                CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS,
            )
        )
        flags |= CLONE_PIDFD | signal.SIGCHLD
        pidfd = ctypes.c_int(-1)
        _MARKS[:] = [("clone", time.monotonic())]
        ctypes.pythonapi.PyOS_BeforeFork()
        pid = int(
            _pylibc.syscall(SYS_CLONE, ctypes.c_ulong(flags), None, ctypes.byref(pidfd), None, None)
        )
        if pid == 0:
            _mark("child")
            ctypes.pythonapi.PyOS_AfterFork_Child()
            _mark("afterfork")
            code = 70
            agent = None
            try:
                parent_end.close()
                agent = Agent(self, wid, child_end)
                agent.main()
                code = 0
            except BaseException as e:
                msg = f"worker setup failed: {type(e).__name__}: {e}"
                try:
                    send_frame(
                        agent.sock if agent is not None else child_end,
                        {"op": "error", "message": msg, "trace": traceback.format_exc()[-2000:]},
                    )
                except BaseException:
                    pass
            os._exit(code)
        err = ctypes.get_errno()
        ctypes.pythonapi.PyOS_AfterFork_Parent()
        child_end.close()
        if pid < 0:
            parent_end.close()
            self.ctl.send(
                json.dumps({"op": "spawn_failed", "wid": wid, "message": os.strerror(err)}).encode()
            )
            return
        self.children[pidfd.value] = (wid, pid)
        self.sel.register(pidfd.value, selectors.EVENT_READ)
        socket.send_fds(
            self.ctl,
            [json.dumps({"op": "worker", "wid": wid, "pid": pid}).encode()],
            [parent_end.fileno(), pidfd.value],
        )
        parent_end.close()

    def reap(self, pidfd: int) -> None:
        wid, pid = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            status = -1
        for fd in self.cg_fds:
            _rmdir_tree(fd, f"w{wid}")
        self.ctl.send(json.dumps({"op": "exited", "wid": wid, "status": status}).encode())

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Kill every worker and reap it before the zygote exits: orphaned, the workers
        would come back to the edge (a child subreaper) as zombies. Bounded by
        ``timeout_s`` seconds; a worker still dying after that is left to the edge."""
        for pidfd in self.children:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for pidfd, (_, pid) in list(self.children.items()):
            with contextlib.suppress(OSError):
                sel = selectors.DefaultSelector()
                try:
                    sel.register(pidfd, selectors.EVENT_READ)
                    sel.select(max(0.0, deadline - time.monotonic()))
                finally:
                    sel.close()
                os.waitpid(pid, os.WNOHANG)


# --- the worker agent (pid 1 of the worker's namespaces) -------------------------------


_MARKS: list[tuple[Any, ...]] = []  # (stage, CLOCK_MONOTONIC s, minor faults so far)


def _mark(name: str) -> None:
    _MARKS.append((name, time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt))


def cgroup_steps(plan: dict[str, Any], name: str) -> list[tuple[int, str, str | None]]:
    """The system calls that make worker ``name``'s cgroup and move the calling process into
    it, in order: ``(dir_fd, path, None)`` makes directory ``path`` below ``dir_fd``,
    ``(dir_fd, path, value)`` writes ``value`` to file ``path``. ``plan`` is the server's
    (:func:`dsec.runtimes.fncall.pool.worker_cgroup_plan` plus ``fds``, one per hierarchy):
    its file names and values come from the host's cgroup driver, none are known here."""
    fds = plan["fds"]
    fd_of = {h: int(fds[i]) for i, h in enumerate(plan["hierarchies"])}
    steps: list[tuple[int, str, str | None]] = [(fd, name, None) for fd in fd_of.values()]
    steps += [(fd_of[h], f"{name}/{file}", str(value)) for h, file, value in plan["writes"]]
    joined = dict.fromkeys(fd_of, name)
    pids = plan.get("pids_hierarchy")
    if pids in fd_of and plan.get("agent_cgroup"):
        # the agent in a child of the worker's cgroup in the pids hierarchy, its commands in
        # children of their own (Agent.command_cgroup)
        steps += [(fd_of[h], f"{name}/{file}", str(v)) for h, file, v in plan["nest_writes"]]
        joined[pids] = f"{name}/{plan['agent_cgroup']}"
        steps.append((fd_of[pids], joined[pids], None))
    steps += [(fd, f"{joined[h]}/{plan['procs_file']}", "0") for h, fd in fd_of.items()]
    return steps


def command_pids_max(worker_pids_max: int) -> int:
    """The ``pids.max`` of one command's cgroup in a worker whose limit is
    ``worker_pids_max``: that less a reserve (a quarter, at most 8, at least 1), so that a fork
    bomb a command left running (``setsid``, daemonised: it stays in its cgroup) still leaves
    the next command room to run, ``kill -9 -1`` and ``ps`` say (the VM tiers' guest agent
    keeps the same reserve)."""
    reserve = max(1, min(8, worker_pids_max // 4))
    return max(1, worker_pids_max - reserve)


def _rmdir_tree(dir_fd: int, name: str) -> None:
    """Remove cgroup ``name`` below ``dir_fd`` and its child cgroups, waiting out EBUSY (a
    task still leaving) for a moment. Missing is fine."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for child in os.listdir(fd):
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                    _rmdir_tree(fd, child)
    finally:
        os.close(fd)
    for _ in range(200):
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a task is still leaving
            time.sleep(0.001)


def _read_at(dir_fd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)


def _write_at(dir_fd: int, name: str, value: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mount_scratch(options: dict[str, str], uid: int, gid: int) -> None:
    """The worker's scratch: one tmpfs (``options``: its size and inodes,
    :class:`~dsec.runtimes.fncall.pool.ScratchSize`) shown at ``/work`` (the worker's user's),
    ``/tmp``, ``/dev/shm`` and ``/mnt`` (sticky, for all; ``/mnt`` where the image has one,
    SandboxFusion's programs write there). It is mounted on ``/proc`` first (nothing is
    mounted there yet, and nothing else runs), a directory of it is bound to each place, and
    it is detached from ``/proc`` again: its root is nowhere to be seen."""
    opts = ",".join(f"{k}={v}" for k, v in options.items())
    _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV, f"{opts},mode=0755")
    places = {"work": "/work", "tmp": "/tmp", "shm": "/dev/shm"}
    if os.path.isdir("/mnt"):
        places["mnt"] = "/mnt"
    for sub, target in places.items():
        d = f"/proc/{sub}"
        os.mkdir(d)
        if sub == "work":
            os.chown(d, uid, gid)
            os.chmod(d, 0o755)
        else:
            os.chmod(d, 0o1777)
        _mount(d, target, "", MS_BIND, None)  # a bind keeps the mount's nosuid, nodev
    if _libc.umount2(b"/proc", MNT_DETACH) != 0:
        raise _oserror("detach the scratch from /proc")


COMMAND_OOM_SCORE_ADJ = 1000
"""The ``oom_score_adj`` every process of a call or command starts with (``fncall_spawn``,
the warm interpreter's fork): the OOM killer takes any of them before the agent (0, or
-941: :func:`_protect_from_oom`), whose death would take the sandbox with it. Raising it
needs no privilege; a command may lower its own back to 0, not below."""

AGENT_OOM_ADJ = -16
"""The agent's legacy ``oom_adj`` (:func:`_protect_from_oom`): ``oom_score_adj`` -941, last
in the OOM killer's line but still in it. -17 (``oom_score_adj`` -1000) would make it
unkillable, and the agent shares its cgroup's memory limit with the call it reads: a call
larger than the limit (a 40 MiB file under ``memory_mb=16``) then left the kernel with
"no killable processes", retrying the agent's allocation for ever, and the call hung
until the pool gave up on the worker (a 500) instead of ending as the caller's 400. Seen
on stock Debian 12 and 13 kernels, where root keeps CAP_SYS_RESOURCE."""


def _protect_from_oom() -> None:
    """Put the agent last in the OOM killer's line where the node lets root do so
    (CAP_SYS_RESOURCE; this kind of VM withholds it): :data:`AGENT_OOM_ADJ`, written as the
    legacy ``oom_adj``, which unlike ``oom_score_adj`` leaves the floor an unprivileged
    process may lower itself to at 0 (the commands inherit the agent's score, raise theirs
    to :data:`COMMAND_OOM_SCORE_ADJ` and cannot go below 0 again). Without it the commands'
    1000 alone puts them first, and the scratch's sizing (ScratchSize) keeps the agent's
    room free. The kernel logs once per boot that ``oom_adj`` is deprecated."""
    with contextlib.suppress(OSError), open("/proc/self/oom_adj", "w") as f:
        f.write(str(AGENT_OOM_ADJ))


def _set_audit_id(auid: int) -> None:
    """Set this worker's loginuid (root's CAP_AUDIT_CONTROL, before the privileges go): the
    kernel's records of the seccomp refusals of every process of the worker carry it, and
    none of them can change it. Without it (an immutable loginuid on the node) the records
    are not attributed; the worker runs as before."""
    try:
        with open("/proc/self/loginuid", "w") as f:
            f.write(str(auid))
    except OSError as e:
        print(f"zygote: cannot set the worker's audit id: {e}", file=sys.stderr)


def _on_sigchld(_signo: int, _frame: object) -> None:
    """SIGCHLD handler: nothing to do; the signal's wake-up fd byte is what matters."""


def _status_channel() -> tuple[int, int]:
    """(agent's end, interpreter's end) of the warm interpreter's status channel.

    A ``SOCK_SEQPACKET`` pair whose receiving end has ``SO_PASSCRED``: the kernel stamps every
    report with the pid of the process that sent it. User code runs in the interpreter and can
    write to this channel too, and so can any process it forks (they inherit the descriptor),
    so the agent takes a report only from the interpreter itself and only once the kernel shows
    that process stopped (the runner stops itself right after reporting): see
    :meth:`Agent._drain`."""
    agent_end, interp_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    return agent_end.detach(), interp_end.detach()


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _read_reports(
    sock: socket.socket, pid: int, latest: dict[str, Any] | None
) -> tuple[bool, dict[str, Any] | None]:
    """Read the messages waiting on the status channel: (the channel is still open, the
    latest well-formed report sent by ``pid``, else ``latest``). At most 1024 per call, so a
    process of the call that floods the channel cannot hold the agent here (it can only make
    the interpreter's own report unseen: its call then ends at its deadline)."""
    for _ in range(1024):
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        except (BlockingIOError, InterruptedError):
            return True, latest
        if not data and not ancdata:
            return False, latest  # every writer closed it
        latest = _parse_report(data, ancdata, pid) or latest
    return True, latest


def _parse_report(
    data: bytes, ancdata: list[tuple[int, int, bytes]], pid: int
) -> dict[str, Any] | None:
    """The report in one status message if ``pid`` sent it and it is well formed."""
    sender = None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            sender = _UCRED.unpack_from(payload)[0]
    if sender != pid:
        return None  # a process the user's code forked: not the interpreter
    try:
        report = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if (
        not isinstance(report, dict)
        or not isinstance(report.get("rc"), int)
        or isinstance(report.get("rc"), bool)
        or not isinstance(report.get("cpu_s", 0.0), (int, float))
    ):
        return None
    return report


class _Proc:
    """A running user process: pid, pidfd and the parent's ends of its pipes."""

    def __init__(
        self, pid: int, stdin_w: int, stdout_r: int, stderr_r: int, status_r: int = -1
    ) -> None:
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.stdin_w = stdin_w
        self.stdout_r = stdout_r
        self.stderr_r = stderr_r
        # the warm interpreter's status channel (_status_channel): its exit code, then it stops
        self.status_r = status_r
        # (wait status, rusage) once reaped by Agent._reap_children
        self.reaped: tuple[int, Any] | None = None


class Agent:
    def __init__(self, zygote: Zygote, wid: int, sock: socket.socket) -> None:
        self.z = zygote
        self.cfg = zygote.cfg
        self.wid = wid
        self.sock = sock
        self.warm: _Proc | None = None
        self.warm_ctl = -1
        # each exec'd command enters a Landlock domain of its own (-1: no Landlock here)
        self.domain_fd = -1
        # the worker's cgroup in the pids hierarchy (delegated to the agent's user): each
        # exec'd command gets a child cgroup of its own there (-1: none)
        self.cg_fd = -1
        self.procs_file = "cgroup.procs"
        self.command_cgroups: list[str] = []  # made and not removed yet
        self.command_seq = 0
        # the next exec'd command's helper, waiting: (process, request pipe, cgroup)
        self.prepared: tuple[_Proc, int, str] | None = None

    # setup runs as root, before anything untrusted exists in these namespaces
    def setup(self) -> None:
        cfg = self.cfg
        uid, gid = int(cfg["uid"]), int(cfg["gid"])
        plan = cfg["cgroup"]
        name = f"w{self.wid}"
        for fd, path, value in cgroup_steps(plan, name):
            if value is not None:
                _write_at(fd, path, value)
                continue
            try:
                os.mkdir(path, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
        if plan.get("agent_cgroup") and plan.get("pids_hierarchy") in plan["hierarchies"]:
            # delegated to the agent's user, as a systemd unit's cgroup is to its user: the
            # directory (to make the commands' cgroups) and cgroup.procs (v2 moves a process
            # only where the mover may write the common parent's); pids.max stays root's
            pids_fd = int(plan["fds"][plan["hierarchies"].index(plan["pids_hierarchy"])])
            self.procs_file = plan["procs_file"]
            os.chown(name, uid, gid, dir_fd=pids_fd)
            os.chown(f"{name}/{self.procs_file}", uid, gid, dir_fd=pids_fd)
            self.cg_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pids_fd)
        for fd in self.z.cg_fds:
            os.close(fd)
        os.close(int(self.cfg["ctl_fd"])) if int(self.cfg["ctl_fd"]) != self.sock.fileno() else None
        _mark("cgroup")
        _mount_scratch(cfg["scratch"], uid, gid)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        if cfg.get("audit_base") is not None:
            _set_audit_id(_seccomp.worker_audit_id(int(cfg["audit_base"]), self.wid))
        if cfg.get("spawn"):  # every command raises its own (fncall_spawn)
            _protect_from_oom()
        _mark("mounts")
        host = cfg.get("hostname", "sandbox").encode()
        if _libc.sethostname(host, len(host)) != 0:
            raise _oserror("sethostname")
        _loopback_up()
        _mark("uts+lo")
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize_bytes"], cfg["fsize_bytes"]))
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 16, 1 << 16))
        if self.z.landlock_abi:
            # per worker: a rule on a mount point does not cover what is mounted on it later
            # (and the worker's delegated cgroup, by descriptor: the commands' cgroups)
            _landlock.confine(
                read_only=["/"],
                writable=["/work", "/tmp", "/dev/shm", "/proc"]
                + (["/mnt"] if os.path.isdir("/mnt") else [])
                + ([self.cg_fd] if self.cg_fd >= 0 else []),
                devices=["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"],
                abi=self.z.landlock_abi,
                log=cfg.get("audit_base") is not None,
            )
        # descriptors: only the server socket survives, as fd 3; 0-2 are /dev/null
        os.dup2(self.sock.fileno(), 3)
        self.sock.detach()
        self.sock = socket.socket(fileno=3)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        if self.cg_fd > 4:  # kept, as fd 4 (not inherited)
            os.dup2(self.cg_fd, 4, inheritable=False)
            self.cg_fd = 4
        _close_from(5 if self.cg_fd >= 0 else 4)
        if self.z.landlock_abi:
            self.domain_fd = _landlock.new_domain_ruleset(self.z.landlock_abi)
        _mark("rlimit+fds")
        os.chdir("/work")
        os.environ.clear()
        os.environ.update(cfg["env"])
        # drop privileges for good
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        _mark("drop+landlock")
        if self.z.seccomp_prog:
            _seccomp.install_filter(self.z.seccomp_prog, log=cfg.get("audit_base") is not None)
        _mark("seccomp")
        warm = cfg.get("warm", "none")
        if warm in ("python", "bash"):
            self.warm, self.warm_ctl = self._fork_warm(warm)
        _mark("warm")

    def _fork_warm(self, kind: str) -> tuple[_Proc, int]:
        ctl_r, ctl_w = os.pipe()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = _status_channel() if kind == "python" else (-1, -1)
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.dup2(ctl_r, 3)  # replaces the agent's socket: B never holds it
                if st_w >= 0:
                    os.dup2(st_w, 4)
                _close_from(5 if st_w >= 0 else 4)
                _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
                with open("/proc/self/oom_score_adj", "w") as f:  # above the agent's
                    f.write(str(COMMAND_OOM_SCORE_ADJ))
                if kind == "bash":
                    script = self.cfg["bash_script"]
                    os.execv(
                        "/bin/bash",
                        [
                            "bash",
                            "--noprofile",
                            "--norc",
                            "-c",
                            f"read -r -N 1 -u 3 _ || exit 111; exec 3<&-; unset _; . {script}",
                        ],
                    )
                _warm_python(3, 4)
            except BaseException:
                traceback.print_exc()
            os._exit(111)
        for fd in (ctl_r, in_r, out_w, err_w, st_w):
            if fd >= 0:
                os.close(fd)
        return _Proc(pid, in_w, out_r, err_r, st_r), ctl_w

    def _prewarm(self) -> None:
        """Touch the call path once while idle: after forking the warm interpreter every page
        is shared copy-on-write again, and each first write costs a fault (~5 us here)."""
        r, w = os.pipe()
        try:
            sel = selectors.DefaultSelector()
            os.set_blocking(r, False)
            sel.register(r, selectors.EVENT_READ)
            sel.select(0)
            sel.unregister(r)
            sel.close()
            try:
                os.read(r, 16)
            except BlockingIOError:
                pass
        finally:
            os.close(r)
            os.close(w)
        work = os.open("/work", os.O_PATH | os.O_DIRECTORY)
        try:
            os.close(open_beneath(work, ".", os.O_PATH))
        finally:
            os.close(work)
        sample = {
            "op": "result",
            "compile": None,
            "run": {
                "exit_code": 0,
                "signal": None,
                "timed_out": False,
                "duration_s": 0.0,
                "cpu_s": 0.0,
                "stdout_truncated": False,
            },
            "timing": [time.monotonic()],
        }
        json.loads(json.dumps(sample, separators=(",", ":")))
        FRAME.pack(1, 1)

    def main(self) -> None:
        t0 = time.monotonic()
        self.setup()
        self._prewarm()
        send_frame(
            self.sock,
            {
                "op": "ready",
                "wid": self.wid,
                "setup_ms": round((time.monotonic() - t0) * 1000, 3),
                "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                "marks": _MARKS,
            },
        )
        while True:
            got = recv_frame(self.sock)
            if got is None:
                os._exit(0)
            req, blob = got
            op = req.get("op")
            if op == "run":
                header, out = self.run(req, blob)
                send_frame(self.sock, header, out)
                # one call per worker: wait to be killed (the server may still read our cgroup)
                while recv_frame(self.sock) is not None:
                    pass
                os._exit(0)
            elif op == "exec":
                header, out = self.exec(req, blob)
                send_frame(self.sock, header, out)
                self.prepare_command()
            elif op == "prepare":  # the server claimed this worker for a sandbox: no answer
                self.prepare_command()
            else:
                send_frame(self.sock, {"op": "error", "message": f"unknown op {op!r}"})

    # --- running things --------------------------------------------------------------

    def _through_spawn(self, argv: list[str], procs_fd: int = -1) -> list[str]:
        """``argv`` run through the spawn helper (``native/fncall_spawn.c``, at
        ``cfg["spawn"]``), which, before it execs the command, makes it a Landlock domain of
        its own (no other command's processes can open its ``/proc/<pid>/mem``, nor it theirs:
        docs/design/tenancy.md), moves it into its cgroup by ``procs_fd`` (when >= 0) and
        raises its ``oom_score_adj`` to :data:`COMMAND_OOM_SCORE_ADJ`. The agent's own fork would
        copy its address space (~2-4 ms here); the helper is one small static exec after a
        vfork. As is without one."""
        spawn = self.cfg.get("spawn")
        if not spawn:
            return argv
        return [spawn, str(self.domain_fd), str(procs_fd), "--", *argv]

    def _spawn(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        new_session: bool,
        keep_fds: tuple[int, ...] = (),
    ) -> _Proc:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            p = subprocess.Popen(
                argv,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=env,
                close_fds=True,
                pass_fds=[fd for fd in (self.domain_fd, *keep_fds) if fd >= 0],
                start_new_session=new_session,
            )
        except OSError:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        p.returncode = 0  # we reap it ourselves with wait4; keep Popen from doing so
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        return _Proc(p.pid, in_w, out_r, err_r)

    def _drain(
        self,
        proc: _Proc,
        stdin: bytes,
        timeout: float,
        cap: int,
        kill_all: bool,
        stream_id: int | None = None,
        group: str = "",
    ) -> tuple[dict[str, Any], bytes, bytes]:
        """Feed stdin, collect capped output, enforce the wall timeout, reap. At the timeout
        every process of the call goes (``kill_all``), else the command's process group and
        everything in its cgroup ``group`` (:meth:`command_cgroup`), setsid'ed ones too."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        sel = selectors.DefaultSelector()
        bufs = {proc.stdout_r: bytearray(), proc.stderr_r: bytearray()}
        names = {proc.stdout_r: "stdout", proc.stderr_r: "stderr"}
        trunc = {proc.stdout_r: False, proc.stderr_r: False}
        for fd in (proc.stdout_r, proc.stderr_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(proc.pidfd, selectors.EVENT_READ)
        status_sock = socket.socket(fileno=proc.status_r) if proc.status_r >= 0 else None
        stop_wake: tuple[int, int] | None = None
        restore: tuple[Any, int] | None = None
        # an exec (its processes may outlive it): what earlier commands left comes back to the
        # agent, pid 1, and is reaped as it exits (_reap_children)
        reap_orphans = not kill_all
        if status_sock is not None:
            # The interpreter reports, then stops. The agent does not wait on the report (it
            # would wake twice); SIGCHLD, sent when a child stops too, wakes the loop through
            # this pipe, and once the kernel shows the interpreter stopped its reports are all
            # queued: the last well-formed one it sent counts (_read_reports).
            status_sock.setblocking(False)
        if status_sock is not None or reap_orphans:
            stop_wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            restore = (
                signal.signal(signal.SIGCHLD, _on_sigchld),
                signal.set_wakeup_fd(stop_wake[1], warn_on_full_buffer=False),
            )
            sel.register(stop_wake[0], selectors.EVENT_READ)
        reported: dict[str, Any] | None = None
        check_stop = status_sock is not None  # it may have stopped before the handler was set
        pending = memoryview(stdin)
        if pending.nbytes:
            os.set_blocking(proc.stdin_w, False)
            sel.register(proc.stdin_w, selectors.EVENT_WRITE)
        else:
            os.close(proc.stdin_w)
            proc.stdin_w = -1
        timed_out = False
        exited_at: float | None = None
        status = 0
        rusage: Any = None
        # after the interpreter's report, kill the call's other processes only if they keep
        # its output open: usually the pipes are at EOF at once, and the answer goes out
        # before anything is torn down (the server kills the worker right after it)
        kill_pending = False
        while True:
            now = time.monotonic()
            open_out = [fd for fd in bufs if fd in sel.get_map()]
            if exited_at is not None and (not open_out or now - exited_at > 0.02):
                break
            if kill_pending and now - exited_at > 0.001:  # type: ignore[operator]
                kill_pending = False
                self._kill(proc, True)
            if check_stop and exited_at is None:
                check_stop = False
                if self._stopped(proc.pid):
                    assert status_sock is not None
                    _, reported = _read_reports(status_sock, proc.pid, None)
                    if reported is not None:
                        # it flushed and closed its output, reported and stopped: done,
                        # without waiting for its exit (tearing Python down is slow)
                        exited_at = time.monotonic()
                        sel.unregister(proc.pidfd)
                        kill_pending = kill_all
                        continue
                    # stopped without a report (by its own code): not an end; the deadline holds
            if exited_at is None and now >= deadline:
                timed_out = True
                self._kill(proc, kill_all)
                if group and not kill_all:
                    self._kill_command_cgroup(group)
                deadline = now + 5.0
                continue
            wait = (deadline - now) if exited_at is None else max(0.0, exited_at + 0.02 - now)
            if kill_pending:
                wait = min(wait, max(0.0, exited_at + 0.001 - now))  # type: ignore[operator]
            for key, _ev in sel.select(wait):
                fd = int(key.fd)
                if fd not in sel.get_map():  # unregistered earlier in this batch
                    continue
                if fd == proc.pidfd:
                    sel.unregister(fd)
                    if reported is None or exited_at is None:
                        status, rusage = self._wait(proc)
                        reported = None
                        exited_at = time.monotonic()
                        if kill_all:  # a call ends when its main process ends
                            self._kill(proc, True)
                elif stop_wake is not None and fd == stop_wake[0]:
                    with contextlib.suppress(BlockingIOError):
                        os.read(fd, 512)
                    check_stop = status_sock is not None  # a child changed state: look again
                    if reap_orphans:
                        self._reap_children(proc)
                elif fd == proc.stdin_w:
                    try:
                        n = os.write(fd, pending[:65536])
                        pending = pending[n:]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BrokenPipeError):
                            pending = pending[:0]
                    if not pending.nbytes:
                        sel.unregister(fd)
                        os.close(fd)
                        proc.stdin_w = -1
                else:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = bufs[fd]
                    room = cap - len(buf)
                    if room < len(chunk):
                        trunc[fd] = True
                        chunk = chunk[: max(room, 0)]
                    if chunk:
                        buf += chunk
                        if stream_id is not None:
                            send_frame(
                                self.sock,
                                {"op": "chunk", "id": stream_id, "stream": names[fd]},
                                bytes(chunk),
                            )
        for registered in list(sel.get_map()):
            sel.unregister(registered)
        sel.close()
        if status_sock is not None:
            status_sock.close()
            proc.status_r = -1
        if restore is not None:
            signal.set_wakeup_fd(restore[1])
            signal.signal(signal.SIGCHLD, restore[0])
        if stop_wake is not None:
            os.close(stop_wake[0])
            os.close(stop_wake[1])
        for fd in (proc.stdout_r, proc.stderr_r, proc.pidfd, proc.stdin_w, proc.status_r):
            if fd >= 0:
                os.close(fd)
        if exited_at is None:  # killed after the grace period and still not reaped
            status, rusage = self._wait(proc)
            exited_at = time.monotonic()
        if reported is not None:
            status = (int(reported["rc"]) & 0xFF) << 8
        cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else None
        if reported is not None:
            cpu = float(reported.get("cpu_s", 0.0))
        res: dict[str, Any] = {
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out,
            "duration_s": exited_at - t0,
            "cpu_s": cpu,
            "stdout_truncated": trunc[proc.stdout_r],
            "stderr_truncated": trunc[proc.stderr_r],
        }
        if reported is not None:  # diagnostics (numbers only: the report comes after user code)
            res["interp"] = {
                k: v
                for k in ("minflt", "minflt_call", "woken", "ran", "reported")
                if isinstance(v := reported.get(k), (int, float))
            }
        return res, bytes(bufs[proc.stdout_r]), bytes(bufs[proc.stderr_r])

    @staticmethod
    def _reap_children(proc: _Proc | None = None) -> None:
        """Reap every child that has exited. A process a command left behind is the agent's
        child once that command has exited (the agent is pid 1 of the worker), and unreaped
        it would hold one of the worker's pids for good: a sandbox running background jobs
        would run out of processes. ``proc``'s own exit, if reaped here, is kept for
        :meth:`_wait`."""
        while True:
            try:
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if proc is not None and pid == proc.pid:
                proc.reaped = (status, rusage)

    @staticmethod
    def _wait(proc: _Proc) -> tuple[int, Any]:
        """(wait status, rusage) of ``proc``, waiting for it unless already reaped."""
        if proc.reaped is None:
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.reaped = (status, rusage)
        return proc.reaped

    @staticmethod
    def _stopped(pid: int) -> bool:
        """Whether the kernel reports ``pid`` (a child of this agent) stopped by a signal.
        ``WSTOPPED`` alone: an exited child is left for the pidfd path to reap."""
        try:
            info = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG)
        except ChildProcessError:
            return False
        return info is not None and info.si_code == os.CLD_STOPPED

    @staticmethod
    def _kill(proc: _Proc, kill_all: bool) -> None:
        try:
            if kill_all:
                os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of this worker
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _write_files(self, files: list[dict[str, Any]], blob: bytes, offset: int) -> int:
        work = os.open("/work", os.O_PATH | os.O_DIRECTORY)
        try:
            for f in files:
                path = f["path"]
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(os.path.join("/work", parent), exist_ok=True)
                fd = open_beneath(
                    work,
                    path,
                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                    f.get("mode", 0o644),
                )
                try:
                    data = memoryview(blob)[offset : offset + f["size"]]
                    while data.nbytes:
                        n = os.write(fd, data)
                        data = data[n:]
                finally:
                    os.close(fd)
                offset += f["size"]
        finally:
            os.close(work)
        return offset

    def _fetch(self, paths: list[str], max_bytes: int) -> tuple[list[dict[str, Any]], bytes]:
        """Read the files asked for: relative paths beneath ``/work``, absolute ones (as
        SandboxFusion allows) anywhere in the worker's own root, as the unprivileged user,
        except on ``/proc`` (there ``self`` would be this agent, not the program)."""
        work = os.open("/work", os.O_PATH | os.O_DIRECTORY)
        root = os.open("/", os.O_PATH | os.O_DIRECTORY)
        proc_dev = os.stat("/proc").st_dev
        out: list[dict[str, Any]] = []
        blob = bytearray()
        try:
            for path in paths:
                try:
                    if path.startswith("/"):
                        fd = open_beneath(
                            root,
                            path.lstrip("/"),
                            os.O_RDONLY | os.O_NONBLOCK,
                            resolve=RESOLVE_IN_ROOT,
                        )
                    else:
                        fd = open_beneath(work, path, os.O_RDONLY | os.O_NONBLOCK)
                except OSError as e:
                    out.append({"path": path, "error": e.strerror or str(e)})
                    continue
                try:
                    st = os.fstat(fd)
                    if st.st_dev == proc_dev:
                        out.append({"path": path, "error": "files of /proc are not fetched"})
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        out.append({"path": path, "error": "not a regular file"})
                        continue
                    if len(blob) + st.st_size > max_bytes:
                        out.append(
                            {"path": path, "error": f"fetched files exceed {max_bytes} bytes"}
                        )
                        continue
                    data = bytearray()
                    while len(data) <= max_bytes - len(blob):
                        chunk = os.read(fd, 1 << 20)
                        if not chunk:
                            break
                        data += chunk
                    if len(blob) + len(data) > max_bytes:
                        out.append(
                            {"path": path, "error": f"fetched files exceed {max_bytes} bytes"}
                        )
                        continue
                    out.append({"path": path, "size": len(data)})
                    blob += data
                finally:
                    os.close(fd)
        finally:
            os.close(work)
            os.close(root)
        return out, bytes(blob)

    def run(self, req: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        """One SandboxFusion-style call: write files, compile (maybe), run, fetch files."""
        t_recv = time.monotonic()
        off = self._write_files(req.get("files", []), blob, 0)
        stdin = blob[off : off + int(req.get("stdin_size", 0))]
        cap = int(req["max_output"])
        env = dict(self.cfg["env"])
        env.update(req.get("env", {}))
        header: dict[str, Any] = {"op": "result", "compile": None, "run": None}
        outs: list[bytes] = []
        comp = req.get("compile")
        if comp:
            proc = self._spawn(self._through_spawn(comp["argv"]), "/work", env, new_session=False)
            self._limit_cpu(proc.pid, comp["cpu_s"])
            res, o, e = self._drain(proc, b"", float(comp["timeout_s"]), cap, kill_all=True)
            res["stdout_len"], res["stderr_len"] = len(o), len(e)
            header["compile"] = res
            outs += [o, e]
            if res["timed_out"] or res["exit_code"] != 0:
                return header, b"".join(outs)
        run = req["run"]
        t_started = time.monotonic()
        if run.get("argv") is None and self.warm is not None:
            proc = self.warm
            self.warm = None
            if self.cfg.get("warm") == "bash":
                self._limit_cpu(proc.pid, run["cpu_s"])
                os.write(self.warm_ctl, b"g")
            else:
                msg = json.dumps(
                    {
                        "path": run["path"],
                        "argv": run.get("args") or [run["path"]],
                        "env": env,
                        "cpu_s": run["cpu_s"],
                        "cwd": "/work",
                    }
                ).encode()
                # length-prefixed: one write wakes the interpreter once (no wait for EOF)
                os.write(self.warm_ctl, struct.pack("<I", len(msg)) + msg)
            os.close(self.warm_ctl)
        else:
            proc = self._spawn(self._through_spawn(run["argv"]), "/work", env, new_session=False)
            self._limit_cpu(proc.pid, run["cpu_s"])
        res, o, e = self._drain(proc, stdin, float(run["timeout_s"]), cap, kill_all=True)
        res["stdout_len"], res["stderr_len"] = len(o), len(e)
        header["run"] = res
        # CLOCK_MONOTONIC instants (comparable with the server's time.monotonic()) for diagnostics
        header["timing"] = {
            "recv": t_recv,
            "started": t_started,
            "done": time.monotonic(),
            "agent_minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            "run_minflt": (res.get("interp") or {}).get("minflt"),
        }
        outs += [o, e]
        if req.get("fetch"):
            header["fetched"], fetched = self._fetch(
                req["fetch"], int(req.get("fetch_max", 64 << 20))
            )
            outs.append(fetched)
        return header, b"".join(outs)

    @staticmethod
    def _limit_cpu(pid: int, cpu_s: float) -> None:
        soft = max(1, int(cpu_s + 1.999))
        try:
            resource.prlimit(pid, resource.RLIMIT_CPU, (soft, soft + 1))
        except ProcessLookupError:
            pass

    def exec(self, req: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        """One command of a long-lived fncall sandbox (its processes may outlive the call).
        It starts in the helper prepared for it (:meth:`prepare_command`) if there is one
        still waiting, else in a new one."""
        env = dict(self.cfg["env"])
        env.update(req.get("env", {}))
        rid = int(req["id"])
        argv, cwd = [str(a) for a in req["argv"]], req.get("cwd") or "/work"
        self._reap_children()
        started = self._start_prepared(argv, cwd, env)
        if started is not None:
            proc, group = started
        else:
            group, procs_fd = self.command_cgroup()
            try:
                proc = self._spawn(
                    self._through_spawn(argv, procs_fd),
                    cwd,
                    env,
                    new_session=True,
                    keep_fds=(procs_fd,),
                )
            except OSError as e:
                self._remove_command_cgroups()
                res = {
                    "exit_code": 127 if e.errno == 2 else 126,
                    "signal": None,
                    "timed_out": False,
                    "duration_s": 0.0,
                    "cpu_s": 0.0,
                    "stdout_truncated": False,
                    "stderr_truncated": False,
                    "stdout_len": 0,
                    "stderr_len": 0,
                    "spawn_error": f"{argv[0]}: {e.strerror}",
                }
                return {"op": "exit", "id": rid, "result": res}, b""
            finally:
                if procs_fd >= 0:
                    os.close(procs_fd)
        res, out_b, err_b = self._drain(
            proc,
            blob,
            float(req["timeout_s"]),
            int(req["max_output"]),
            kill_all=False,
            stream_id=rid if req.get("stream") else None,
            group=group,
        )
        res["stdout_len"], res["stderr_len"] = len(out_b), len(err_b)
        self._reap_children()
        self._remove_command_cgroups()
        return {"op": "exit", "id": rid, "result": res}, out_b + err_b

    def prepare_command(self) -> None:
        """Start the next exec'd command's spawn helper now, between commands (after an
        answer, or when the server claims the worker): it enters its Landlock domain, moves
        into its own pids cgroup (up to ~14 ms on v1 when no cgroup move happened lately,
        an RCU grace period) and waits for the command on a pipe (:meth:`_start_prepared`).
        Nothing when one already waits or there is no helper."""
        spawn = self.cfg.get("spawn")
        if self.prepared is not None or not spawn:
            return
        group, procs_fd = self.command_cgroup()
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = self._spawn(
                [spawn, str(self.domain_fd), str(procs_fd), str(ctl_r)],
                "/",
                {},
                new_session=True,
                keep_fds=(procs_fd, ctl_r),
            )
        except OSError:
            os.close(ctl_w)
            self._remove_command_cgroups()
            return
        finally:
            os.close(ctl_r)
            if procs_fd >= 0:
                os.close(procs_fd)
        self.prepared = (proc, ctl_w, group)

    def _start_prepared(
        self, argv: list[str], cwd: str, env: dict[str, str]
    ) -> tuple[_Proc, str] | None:
        """Hand the command to the helper :meth:`prepare_command` started: ``(its process,
        its cgroup)``, or None when there is none or it is gone (killed by something a
        command left running)."""
        if self.prepared is None:
            return None
        proc, ctl_w, group = self.prepared
        self.prepared = None
        if group:  # the worker's limit may have changed since (a claim sets the sandbox's)
            with contextlib.suppress(OSError):
                limit = _read_at(self.cg_fd, "pids.max")
                if limit.isdigit():
                    _write_at(self.cg_fd, f"{group}/pids.max", str(command_pids_max(int(limit))))
        request = struct.pack("<II", len(argv), len(env)) + b"".join(
            x.encode("utf-8", "surrogateescape") + b"\0"
            for x in [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
        )
        try:
            if select.select([proc.pidfd], [], [], 0)[0]:
                raise BrokenPipeError  # it exited: it was killed while it waited
            view = memoryview(request)
            while view.nbytes:
                view = view[os.write(ctl_w, view) :]
        except OSError:
            self._discard(proc)
            return None
        finally:
            os.close(ctl_w)
        return proc, group

    def _discard(self, proc: _Proc) -> None:
        """Kill and forget a started helper that will not run a command."""
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            self._wait(proc)
        for fd in (proc.stdin_w, proc.stdout_r, proc.stderr_r, proc.pidfd):
            if fd >= 0:
                os.close(fd)
        self._remove_command_cgroups()

    def command_cgroup(self) -> tuple[str, int]:
        """A pids cgroup of its own for the next exec'd command, below the worker's, with
        :func:`command_pids_max` of the worker's limit: ``(name, descriptor of its
        cgroup.procs)`` for the spawn helper to join it, or ``("", -1)`` when the worker has
        no delegated cgroup. Commands that ended with nothing left running are removed first."""
        if self.cg_fd < 0:
            return "", -1
        self._remove_command_cgroups()
        self.command_seq += 1
        name = f"c{self.command_seq}"
        try:
            os.mkdir(name, 0o755, dir_fd=self.cg_fd)
        except OSError:
            return "", -1  # the command runs in the agent's (the worker's limit holds)
        self.command_cgroups.append(name)
        try:
            limit = _read_at(self.cg_fd, "pids.max")
            if limit.isdigit():
                _write_at(self.cg_fd, f"{name}/pids.max", str(command_pids_max(int(limit))))
            procs = os.open(
                f"{name}/{self.procs_file}", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.cg_fd
            )
        except OSError:
            self._remove_command_cgroups()
            return "", -1
        return name, procs

    def _remove_command_cgroups(self) -> None:
        """Remove the commands' cgroups with no process left (the others stay, EBUSY)."""
        for name in list(self.command_cgroups):
            try:
                os.rmdir(name, dir_fd=self.cg_fd)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self.command_cgroups.remove(name)

    def _kill_command_cgroup(self, name: str) -> None:
        """SIGKILL every process in command cgroup ``name``: at once where the kernel can
        (v2 ``cgroup.kill``), else by pid until it is empty (a fork bomb forks on while its
        processes are read; at most ~0.5 s)."""
        with contextlib.suppress(OSError):
            _write_at(self.cg_fd, f"{name}/cgroup.kill", "1")
            return
        for _ in range(500):
            try:
                fd = os.open(
                    f"{name}/{self.procs_file}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.cg_fd
                )
                try:
                    pids = [int(p) for p in os.read(fd, 1 << 20).split()]
                finally:
                    os.close(fd)
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)


# --- the warm Python interpreter (B) ---------------------------------------------------


def _warm_python(ctl_fd: int, status_fd: int) -> None:
    """Wait for the call, then run the user's file as ``__main__`` in this interpreter.

    Everything that does not depend on the call is done first (stdio objects, a throw-away
    compile and exec), so its copy-on-write page faults happen while the worker is idle.
    At the end the exit code goes to ``status_fd`` after stdout/stderr are flushed and
    closed, so the agent can answer before this process has finished exiting.
    """
    import builtins
    import io
    import types

    stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    for name in ("dsec_zygote", "dsec_landlock", "dsec_seccomp"):
        sys.modules.pop(name, None)
    main = types.ModuleType("__main__")
    # a dry run of the call's path (open + read a file, compile, exec, print, flush) on
    # /dev/null: its copy-on-write faults happen now, while the worker waits, not in the call
    with open("/dev/null", "rb") as f:
        f.read()
    sink = io.TextIOWrapper(io.BufferedWriter(io.FileIO("/dev/null", "w")), encoding="utf-8")
    warm_code = "import sys\n_ = [str(i) for i in range(3)]\nprint(1 + 1, _, file=sink)\n"
    exec(compile(warm_code, "<warm>", "exec"), {**main.__dict__, "sink": sink})
    sink.flush()
    sink.close()
    json.loads(json.dumps({"warm": [1, 2.0, "x"]}))
    # pre-fault the end-of-call path too (copy-on-write faults cost ~5 us each on this kind of VM)
    import atexit
    import threading

    resource.getrusage(resource.RUSAGE_SELF)
    resource.getrusage(resource.RUSAGE_CHILDREN)
    json.dumps({"rc": 0, "cpu_s": 0.0})
    resource.getrlimit(resource.RLIMIT_CPU)
    _ = (threading.main_thread(), atexit._ncallbacks(), dict(os.environ))
    # keep the runtime's two descriptors out of the user's way (top of the table, close-on-exec)
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 1022, inheritable=False)
    os.close(devnull)
    devnull = 1022
    os.dup2(status_fd, 1023, inheritable=False)
    os.close(status_fd)
    status_fd = 1023
    buf = b""
    need = 4
    while len(buf) < need:
        b = os.read(ctl_fd, 1 << 16)
        if not b:
            os._exit(111)  # the agent went away without a call
        buf += b
        if need == 4 and len(buf) >= 4:
            need = 4 + struct.unpack_from("<I", buf)[0]
    os.close(ctl_fd)
    monotonic = time.monotonic  # bound before user code runs (it may patch the modules)
    stop_self = signal.raise_signal  # a fork of this process made by user code stops itself
    t_woken = monotonic()
    faults_woken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    msg = json.loads(buf[4:need])
    soft = max(
        1, int(float(msg["cpu_s"]) + 1.999)
    )  # the wall clock fires first for one busy thread
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    if os.getcwd() != msg["cwd"]:
        os.chdir(msg["cwd"])
    if dict(os.environ) != msg["env"]:
        os.environ.clear()
        os.environ.update(msg["env"])
    path = msg["path"]
    for name, stream in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.argv = list(msg["argv"])
    sys.path[0:0] = [os.path.dirname(path) or "."]
    main.__dict__.update({"__file__": path, "__builtins__": builtins, "__cached__": None})
    sys.modules["__main__"] = main
    rc = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        code = compile(source, path, "exec")
        exec(code, main.__dict__)
    except SystemExit as e:
        rc = _exit_code(e.code)
    except BaseException:
        etype, value, tb = sys.exc_info()
        # drop this runner's frame so the traceback starts at the user's file, as in `python3 file`
        if tb is not None and tb.tb_frame.f_code.co_name == "_warm_python":
            tb = tb.tb_next
        try:
            if value is not None:
                value.__traceback__ = tb  # excepthook prints the exception's own traceback
            sys.excepthook(etype, value, tb)  # type: ignore[arg-type]
        except BaseException:
            pass
        rc = 1
    try:
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        rc = _exit_code(e.code)
    except BaseException:
        pass
    t_ran = monotonic()
    for out_stream in (sys.stdout, sys.stderr):
        try:
            out_stream.flush()
        except BaseException:
            rc = rc or 120
    reported = False
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime
        os.write(
            status_fd,
            json.dumps(
                {
                    "rc": rc,
                    "cpu_s": cpu,
                    "minflt": usage.ru_minflt,
                    "minflt_call": usage.ru_minflt - faults_woken,
                    "woken": t_woken,  # CLOCK_MONOTONIC: diagnostics of the call's timeline
                    "ran": t_ran,
                    "reported": monotonic(),
                }
            ).encode(),
        )
        reported = True
    except BaseException:
        pass
    if reported:
        # The agent answers from this report. Exiting now would tear this address space down
        # (~1-2 ms of CPU, often on the agent's CPU) while the agent is replying: stop until
        # the server kills the worker, right after the answer is out.
        try:
            stop_self(signal.SIGSTOP)
        except BaseException:
            pass
    os._exit(rc)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def main(cfg: dict[str, Any]) -> None:
    """Entry point of the zygote process."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    zygote = Zygote(cfg)
    try:
        zygote.serve()
    finally:
        # server gone or asked us to exit: kill and reap the workers (PDEATHSIG would kill
        # them too, but then nobody here reaps them)
        zygote.shutdown()
    os._exit(0)


BOOTSTRAP = r"""
import sys, json, types
_b = json.loads(sys.stdin.buffer.read())
sys.stdin.close()
import os
_n = os.open("/dev/null", os.O_RDONLY); os.dup2(_n, 0); os.close(_n)
for _name, _src in _b["modules"]:
    _m = types.ModuleType(_name); _m.__file__ = "<dsec:" + _name + ">"
    sys.modules[_name] = _m
    exec(compile(_src, "<dsec:" + _name + ">", "exec"), _m.__dict__)
sys.modules["dsec_zygote"].main(_b["config"])
"""
"""The ``-c`` program of the zygote: reads the bundle {"modules": [[name, src]...], "config"}
from stdin, installs the modules and calls ``dsec_zygote.main(config)``."""
