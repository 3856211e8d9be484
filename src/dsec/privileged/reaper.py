"""The edge process's child reaper: every child is waited for, and by exactly one party.

The edge (``dsec serve``, a cluster node's edge actor, an in-process
:class:`~dsec.server.BackgroundServer`) is a child *subreaper*
(``PR_SET_CHILD_SUBREAPER``): a process below it that loses its parent is reparented to
the edge rather than to the machine's PID 1. Such orphans arrive all the time: ``crun
run --detach`` daemonizes (its monitor process exits right after it started the
container and comes back as a zombie, one per sandbox), the container's init outlives
``crun``, the commands of an exec server killed on its way out, the workers of an fncall
zygote that died, QEMU's helpers. Unreaped, each is a zombie that holds a pid until the
edge exits (``pid_max`` is 32768: a node would stop forking after ~32k sandboxes).

Reaping them with ``waitpid(-1)`` would be wrong: the same process runs code that waits
for its *own* children by pid -- ``subprocess`` (``waitpid(pid)``; a stolen child makes it
report exit status 0), asyncio's child watcher (reports 255), uvloop (libuv's
``waitpid(pid, WNOHANG)`` never sees the exit: the awaiting coroutine hangs), and the tiers
(QEMU's pid is waited for by the microVM runtime, which trusts the pid is not reused). So the reaper decides
per zombie, never blindly:

* it **peeks** with ``waitid(P_ALL, WEXITED | WNOWAIT)`` (the zombie stays a zombie) and,
  when that shows a zombie it must not reap (the first waitable child hides the others),
  lists the children (``/proc/self/task/*/children``) and peeks at each;
* it reaps a zombie child when the code that made it said it will be an orphan
  (:meth:`ChildReaper.expect`: a container's init, pinned by its start time), or when the
  zombie is in a process group that is neither the edge's own nor led by itself: only a
  descendant of a child can have put it there, so no code in this process waits for it.
  Left alone: children in the edge's process group (what ``subprocess`` and asyncio start
  by default) and group leaders (``start_new_session=True`` / ``process_group=0``: QEMU,
  the lazy layer server, the fncall zygote), which their starters wait for;
* it reaps through a **pidfd** (``waitid(P_PIDFD)``), opened before the decision and
  checked to still name an unreaped process after reading ``/proc/<pid>/stat``, so the
  decision and the reaping are about the same process even if another thread reaps the
  pid and the kernel reuses it in between.

The reaper thread sleeps in a blocking ``waitid(P_ALL, WEXITED | WNOWAIT)``: it wakes when
any child exits (no signal handler: uvloop and asyncio own ``SIGCHLD``), reaps what is
its to reap, and polls every ``interval_s`` seconds (50 ms) while a zombie it must not reap
is waiting for its owner or while there is no child at all. Cost: per exited child one peek
and one ``/proc/<pid>/stat`` read; otherwise a syscall per poll.

Rule for code in the edge process: a child started in its own process group must be
waited for by its starter (the default for ``Popen`` objects); a process that is handed
to the edge as an orphan but leads its own group (a container init) must be announced
with :meth:`ChildReaper.expect`. Design and measurements: ``docs/design/container.md``
("Reaping").
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import threading
import time
from dataclasses import dataclass

__all__ = [
    "REAPER",
    "ChildReaper",
    "ProcStat",
    "become_subreaper",
    "child_pids",
    "is_subreaper",
    "proc_stat",
    "reap_pid",
    "where_is",
]

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
_WALL = 0x40000000  # __WALL: also children whose exit signal is not SIGCHLD
_PEEK = os.WEXITED | os.WNOWAIT | _WALL


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the reaper decides on (pids in our namespace)."""

    state: str  # R, S, D, Z (zombie), X, ...
    ppid: int
    pgrp: int
    session: int
    start: int  # start time, clock ticks after boot (with the pid: the process's identity)


def proc_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` of ``pid`` (zombies included), or None if there is none."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    rest = data[data.rfind(b")") + 2 :].split()
    if len(rest) < 20:
        return None
    return ProcStat(
        state=rest[0].decode(),
        ppid=int(rest[1]),
        pgrp=int(rest[2]),
        session=int(rest[3]),
        start=int(rest[19]),
    )


def child_pids(pid: int | None = None) -> list[int]:
    """The children of process ``pid`` (default: this one), from every thread's list."""
    base = f"/proc/{pid if pid is not None else 'self'}/task"
    out: list[int] = []
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _peek(idtype: int, ident: int, *, block: bool = False) -> int | None:
    """The pid of a waitable (exited) child matching (idtype, ident), without reaping it;
    None if none is waitable now. Raises ChildProcessError if there is no such child."""
    res = os.waitid(idtype, ident, _PEEK | (0 if block else os.WNOHANG))
    return None if res is None or res.si_pid == 0 else int(res.si_pid)


class ChildReaper:
    """Reaps this process's orphaned zombie children (see the module docstring).

    One per process (:data:`REAPER`); :meth:`start` runs it in a daemon thread, and
    :meth:`sweep` does one pass synchronously.

    Args:
        interval_s: seconds between passes while a zombie that is not ours to reap waits
            for its owner, or while the process has no child at all (no wait can block
            then: a new child's orphans are seen within this delay); otherwise the thread
            sleeps in the kernel until a child exits. A pass costs ~10-50 us.
        full_scan_interval_s: minimum seconds between listings of all children (the
            fallback when the first waitable child is not ours to reap).
        crowd, crowd_gather_s: with more than ``crowd`` announced orphans alive (container
            inits), a pass waits ``crowd_gather_s`` after the exit that woke it, so that the
            exits of that moment are reaped in one pass: every wait visits every child (at
            5,000 live sandboxes the kernel's ``wait_consider_task`` was 4% of the node's
            CPU samples, a full visit per exit of any child).
    """

    def __init__(
        self,
        interval_s: float = 0.05,
        full_scan_interval_s: float = 1.0,
        crowd: int = 256,
        crowd_gather_s: float = 0.05,
    ) -> None:
        self.interval_s = interval_s
        self.full_scan_interval_s = full_scan_interval_s
        self.crowd = crowd
        self.crowd_gather_s = crowd_gather_s
        self._lock = threading.Lock()
        self._expected: dict[int, int] = {}  # pid -> start time of an announced orphan
        self._thread: threading.Thread | None = None
        self._thread_pid = 0  # the process the thread runs in (threads do not survive fork)
        self._last_full_scan = 0.0
        self.reaped = 0  # orphans reaped by this reaper since the process started

    # ------------------------------------------------------------------ registry
    def expect(self, pid: int, start_time: int) -> None:
        """``pid`` (with ``/proc/<pid>/stat`` start time ``start_time``, clock ticks) will
        become our child by reparenting and nobody else waits for it: reap it when it exits,
        even if it leads its own process group (e.g. a container's init)."""
        with self._lock:
            self._expected[pid] = start_time

    def forget(self, pid: int, start_time: int | None = None) -> None:
        """Drop the :meth:`expect` of ``pid`` (of that start time, if given): the caller
        reaped the process or handed it off."""
        with self._lock:
            if start_time is None or self._expected.get(pid) == start_time:
                self._expected.pop(pid, None)

    def expected_count(self) -> int:
        with self._lock:
            return len(self._expected)

    # ------------------------------------------------------------------ thread
    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and self._thread_pid == os.getpid()

    def start(self) -> None:
        """Run the reaper in a daemon thread of this process (idempotent)."""
        with self._lock:
            if self.running:
                return
            self._thread_pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="dsec-child-reaper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                blocked = self.sweep()
            except Exception:  # never let the reaper die of a surprise
                log.exception("child reaper pass failed")
                blocked = True
            if blocked:
                # a zombie waits for its owner: poll until it is gone
                time.sleep(self.interval_s)
                continue
            try:
                # sleep in the kernel until some child exits (any thread's, any kind)
                _peek(os.P_ALL, 0, block=True)
            except ChildProcessError:  # no children at all: wait for some to appear
                time.sleep(self.interval_s)
            except InterruptedError:
                continue
            else:
                # each wait and peek visits every child (the kernel's wait_consider_task): a
                # node with thousands of live sandboxes (an init each) gathers the exits of a
                # moment into one pass instead of a pass per exit
                if self.expected_count() > self.crowd:
                    time.sleep(self.crowd_gather_s)

    # ------------------------------------------------------------------ one pass
    def sweep(self) -> bool:
        """Reap every zombie child that is ours to reap. Returns True if a zombie that is
        not ours to reap (its owner has not waited yet) is left."""
        blocked = False
        for _ in range(100_000):  # bounded: each round reaps one
            try:
                pid = _peek(os.P_ALL, 0)
            except ChildProcessError:
                return False
            if pid is None:
                return False
            if not self._try_reap(pid):
                blocked = True
                break
        # the peek shows the first waitable child only: others may hide behind it
        now = time.monotonic()
        if blocked and now - self._last_full_scan >= self.full_scan_interval_s:
            self._last_full_scan = now
            for pid in child_pids():
                try:
                    if _peek(os.P_PID, pid) is not None:
                        self._try_reap(pid)
                except ChildProcessError:  # reaped by its owner meanwhile
                    continue
        return blocked

    def _try_reap(self, pid: int) -> bool:
        """Reap zombie child ``pid`` if it is ours to reap; True if it was reaped."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False  # reaped meanwhile
        try:
            st = proc_stat(pid)
            if st is None:
                return False
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError:
                return False  # reaped after the pidfd was opened: st may be a newer process
            except PermissionError:
                pass
            if st.state != "Z" or st.ppid != os.getpid() or not self._ours(pid, st):
                return False
            try:
                if os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | _WALL) is None:
                    return False
            except ChildProcessError:
                return False
        finally:
            os.close(pidfd)
        with self._lock:
            if self._expected.get(pid) == st.start:
                del self._expected[pid]
            self.reaped += 1
        return True

    def _ours(self, pid: int, st: ProcStat) -> bool:
        with self._lock:
            if self._expected.get(pid) == st.start:
                return True
        if st.pgrp == os.getpgrp():
            return False  # an ordinary child (subprocess, asyncio): its starter waits
        # a group leader was started in its own group by someone who waits for it; a
        # member of another group can only have been put there by a descendant
        return st.pgrp != pid

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._expected = {}
        self._thread = None
        self._thread_pid = 0
        self.reaped = 0


REAPER = ChildReaper()
"""This process's reaper (started by :func:`become_subreaper`)."""

os.register_at_fork(after_in_child=REAPER._after_fork_in_child)


def become_subreaper() -> ChildReaper:
    """Make this process a child subreaper (orphans below it come back to it, not to the
    machine's PID 1) and start its reaper thread. Idempotent; returns :data:`REAPER`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
    REAPER.start()
    return REAPER


def is_subreaper() -> bool:
    """Whether this process is a child subreaper."""
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return False
    return bool(flag.value)


def reap_pid(pid: int, start_time: int | None, timeout_s: float = 2.0) -> bool:
    """Wait up to ``timeout_s`` seconds for process ``pid`` to exit and reap it if it is
    our child; True once it is gone. ``start_time`` (``/proc/<pid>/stat`` clock ticks)
    pins the process: a recycled pid is neither waited for nor reaped."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return True  # gone (and reaped) already
    try:
        st = proc_stat(pid)
        if st is None or (start_time is not None and st.start != start_time):
            return True  # the pidfd names a newer process with this pid: ours is gone
        # poll, not select: a busy edge holds thousands of fds (select stops at 1024)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if not poller.poll(max(0, int(timeout_s * 1000))):
            return False
        with contextlib.suppress(ChildProcessError):  # not our child: its parent reaps it
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | _WALL)
        return True
    finally:
        os.close(pidfd)
        if start_time is not None:
            REAPER.forget(pid, start_time)


def where_is(pid: int) -> str:
    """Where process ``pid`` is, from /proc: its state, the kernel function it sleeps in and
    its syscall, and (as root) its kernel stack: for an exec server that does not answer,
    which kernel lock or wait holds it, e.g. ``pid 4242: D, in percpu_rwsem_wait, syscall 1,
    stack percpu_rwsem_wait < cgroup_attach_lock < ...``."""
    base = f"/proc/{pid}"
    st = proc_stat(pid)
    if st is None:
        return f"pid {pid}: gone"
    parts = [f"pid {pid}: {st.state}"]
    for name, label in (("wchan", "in"), ("syscall", "syscall")):
        try:
            with open(f"{base}/{name}") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text and text != "0":
            parts.append(f"{label} {text.split()[0]}")
    try:  # root: the kernel stack, innermost first
        with open(f"{base}/stack") as f:
            frames = [ln.split("] ", 1)[-1].split("+", 1)[0] for ln in f.read().splitlines()]
    except OSError:
        frames = []
    if frames:
        parts.append("stack " + " < ".join(frames[:5]))
    return ", ".join(parts)


def where_are(pid: int, limit: int = 8) -> str:
    """:func:`where_is` for ``pid`` and its descendants (breadth first, at most ``limit``):
    a runtime waiting on a pipe is waiting for a child, and the child says why."""
    found: list[int] = []
    queue = [pid]
    while queue and len(found) < limit:
        p = queue.pop(0)
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    queue.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return "; ".join(f"{'child ' if p != pid else ''}{where_is(p)}" for p in found)
