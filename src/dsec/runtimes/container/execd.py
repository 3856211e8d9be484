"""The edge's side of ``dsec_execd``, the per-sandbox exec server.

One :class:`ExecServer` per running container. The server joins the container's
cgroups once at start (so each command is born in them and counts against the
sandbox's memory and pids limits; a fork bomb at ``pids.max`` makes exec fail with
``SandboxError`` until the bomb is gone). It starts the server with one end
of a ``SOCK_SEQPACKET`` socketpair (the only way to talk to it: nothing inside
the sandbox can reach, signal or forge it) and multiplexes any number of
concurrent execs over that socket. For each exec the edge makes the
stdin/stdout/stderr pipes itself, passes the child's ends with ``SCM_RIGHTS``
and reads the output directly with the event loop: no byte of output passes
through the server. Wire format: see ``dsec/native/dsec_execd.c``.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import signal
import socket
import struct
import subprocess
import termios
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dsec.errors import (
    Conflict,
    DsecError,
    InvalidRequest,
    NodeBusy,
    PayloadTooLarge,
    SandboxError,
    SandboxStopped,
)
from dsec.privileged.reaper import REAPER, proc_stat, where_is

__all__ = [
    "ExecOutcome",
    "ExecServer",
    "InteractiveExecution",
    "SetupStage",
    "TerminalSize",
]

log = logging.getLogger(__name__)

T_EXEC, T_SIGNAL, T_RELEASE, T_ATTACH, T_REROOT = 1, 2, 3, 4, 5
_EXEC_F_CTTY = 1  # the child makes its stdin (a pty slave) its controlling terminal
R_READY, R_STARTED, R_EXIT, R_ERROR = 100, 101, 102, 103
_HDR = struct.Struct("<IIQ")
_EXEC_BODY = struct.Struct("<6I")
_SNDBUF_BYTES = 8 << 20  # requests carry argv (<= 1 MiB) and env (<= 256 KiB) inline
_PIPE_BYTES = 256 << 10  # kernel pipe buffer per output stream (root's pipe pages are capped)
_READ_CHUNK = 1 << 16
_F_SETPIPE_SZ = 1031


class SetupStage:
    """Steps of the exec'd child before its command runs (``dsec_execd.c``)."""

    (
        OK, CGROUP, SETSID, RLIMIT, BOUNDING, GROUPS, GID, UID, CAPSET, NNP, CHDIR, SECCOMP, EXEC,
        LANDLOCK,
    ) = range(14)  # fmt: skip
    NAMES = (
        "ok cgroup setsid rlimit bounding groups gid uid capset no_new_privs chdir seccomp exec"
        " landlock"
    ).split()


@dataclass
class ExecOutcome:
    """Raw result of one exec. Output is bytes, capped at ``max_output_bytes`` per stream."""

    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0


@dataclass
class _Pending:
    started: asyncio.Future[int]
    exited: asyncio.Future[tuple[int, int, int]]


@dataclass
class _Stream:
    kind: str
    fd: int
    cap: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


Sink = Callable[[str, bytes], Awaitable[None]]


async def _exited(pid: int) -> None:
    """Return once process ``pid`` (a child, not yet reaped) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


class ExecServer:
    """A ``dsec_execd`` for one container, and the client of its socket.

    Two steps, so that the server's start-up overlaps the OCI runtime's work:
    :meth:`spawn` starts the process (it loads its seccomp program and waits), and
    :meth:`attach` sends it the container's init pid and cgroups once they exist.
    :meth:`start` does both.
    """

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self._sock = sock
        self._proc = proc
        self.pid = proc.pid  # host pid of the server
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._attached = False
        self._closed = False
        self.closed_by_edge = False  # close() was called (e.g. the sandbox is being destroyed)
        self._loop = asyncio.get_running_loop()

    # -- lifecycle -----------------------------------------------------------

    @classmethod
    def spawn(
        cls,
        binary: Path,
        policy_file: Path,
        *,
        bpf_file: Path | None = None,
        allow_setuid: bool = False,
        audit_id: int | None = None,
    ) -> ExecServer:
        """Start the server process; it waits for :meth:`attach`. Takes ~0.5 ms.

        ``bpf_file``: the policy's seccomp program as ``dsec_execd --bpf`` wrote it; the
        server installs it instead of compiling the policy's rules (most of its start-up
        CPU). ``allow_setuid``: its commands run without no_new_privs (setuid programs such
        as sudo work; see ``dsec_execd.c``). ``audit_id``: the commands' seccomp refusals are
        logged by the kernel (``SECCOMP_FILTER_FLAG_LOG``) under this loginuid, which they
        inherit and cannot change (:mod:`dsec.privileged.seccomp_log` reads them); None:
        not logged. Its stderr is the edge's (it only writes there when it dies, and then
        also sends the reason over the socket)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                ours.setsockopt(socket.SOL_SOCKET, 32, _SNDBUF_BYTES)  # SO_SNDBUFFORCE
            except OSError:
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF_BYTES)
            proc = subprocess.Popen(
                [
                    str(binary),
                    str(theirs.fileno()),
                    str(policy_file),
                    *([f"bpf={bpf_file}"] if bpf_file is not None else []),
                    *(["setuid"] if allow_setuid else []),
                    *(["log", f"auid={audit_id}"] if audit_id is not None else []),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            raise SandboxError(f"cannot start the exec server: {e}") from e
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(ours, proc)

    async def attach(
        self, init_pid: int, cgroup_procs: list[Path], timeout_s: float = 30.0
    ) -> None:
        """Make the server join the container whose init has host pid ``init_pid``.

        A server that exits fails this at once (its socket ends); ``timeout_s`` bounds only
        a server that lives but does not answer. It is long because on a node whose CPU is
        oversubscribed by sandboxes' commands the server, once in the sandbox's cgroups, gets
        one fair share among them: at 5 s, creates failed under a 500-agent rollout load."""
        paths = [os.fsencode(p) for p in cgroup_procs]
        payload = _HDR.pack(T_ATTACH, 0, 0) + struct.pack("<iI", init_pid, len(paths))
        payload += b"".join(p + b"\0" for p in paths)
        ready: asyncio.Future[bytes] = self._loop.create_future()

        def on_ready() -> None:
            try:
                msg = self._sock.recv(4096)
            except BlockingIOError:
                return
            except OSError as e:
                msg = b""
                log.debug("exec server socket: %s", e)
            if not ready.done():
                ready.set_result(msg)

        self._loop.add_reader(self._sock.fileno(), on_ready)
        timed_out = False
        try:
            self._sock.send(payload)
            msg = await asyncio.wait_for(ready, timeout_s)
        except TimeoutError:
            msg, timed_out = b"", True
        except OSError:
            msg = b""
        finally:
            self._loop.remove_reader(self._sock.fileno())
        if len(msg) >= _HDR.size + 4 and _HDR.unpack_from(msg)[0] == R_READY:
            self._attached = True
            self._loop.add_reader(self._sock.fileno(), self._on_readable)
            return
        where = where_is(self.pid) if timed_out else ""
        await self.close()
        if msg:
            detail = _error_text(msg)
        elif timed_out:
            # where it waits (kernel functions) is the operator's business: the log, not
            # the tenant's error
            detail = f"no answer within {timeout_s:g} s (the node's log says where it waited)"
            log.warning("exec server %d did not answer its attach: %s", self.pid, where)
        else:
            detail = "it exited without an answer"
        if timed_out:  # a node too busy to attach in time: retryable, the create is undone
            raise NodeBusy(f"the exec server did not start: {detail}", retry_after_s=5)
        raise SandboxError(f"the exec server did not start: {detail}")

    @classmethod
    async def start(
        cls,
        binary: Path,
        init_pid: int,
        policy_file: Path,
        cgroup_procs: list[Path],
        *,
        bpf_file: Path | None = None,
        allow_setuid: bool = False,
        audit_id: int | None = None,
    ) -> ExecServer:
        """Spawn and attach in one go (e.g. for a recovered sandbox)."""
        server = cls.spawn(
            binary,
            policy_file,
            bpf_file=bpf_file,
            allow_setuid=allow_setuid,
            audit_id=audit_id,
        )
        await server.attach(init_pid, cgroup_procs)
        return server

    @property
    def alive(self) -> bool:
        return self._attached and not self._closed and self._proc.poll() is None

    async def close(self) -> None:
        """Close the socket (the server then kills in-flight execs, reaps them and exits)
        and reap it. Commands it could not reap in time (or all of them, if it has to be
        killed) come back to the edge as orphans: they are announced to its child reaper."""
        inflight = self._inflight_children() if not self._closed else []
        if not self._closed:
            self._closed = True
            self.closed_by_edge = True
            if self._attached:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._fail_all(SandboxStopped("the sandbox's exec server was closed"))
        if self._proc.poll() is None:
            # waited for on the event loop (a pidfd turns readable at exit), not in a thread:
            # a job's kill closed many servers at once and held every thread of asyncio's
            # default executor (6 here), which file transfers and creates also need
            try:
                await asyncio.wait_for(_exited(self._proc.pid), 2.0)
            except TimeoutError:
                self._proc.kill()
                await _exited(self._proc.pid)
            self._proc.wait()  # exited: reaps at once
        for pid, start in inflight:
            st = proc_stat(pid)
            if st is not None and st.start == start:  # not reaped by the server: ours now
                REAPER.expect(pid, start)

    def _announce_orphans(self) -> None:
        """The server died on its own: the commands it ran are (or, while it finishes
        exiting, are about to be) the edge's children, leading their own process groups.
        Announce them to the edge's child reaper, else their zombies would stay, and keep
        the container's init from ever finishing its exit."""
        for p in self._pending.values():
            fut = p.started
            if p.exited.done() or not fut.done() or fut.cancelled() or fut.exception():
                continue
            pid = fut.result()
            st = proc_stat(pid)
            if st is not None and st.pgrp == pid and st.ppid in (self.pid, os.getpid()):
                REAPER.expect(pid, st.start)

    def _inflight_children(self) -> list[tuple[int, int]]:
        """(host pid, start time) of the commands that run now (children of the server)."""
        out: list[tuple[int, int]] = []
        for p in self._pending.values():
            fut = p.started
            if p.exited.done() or not fut.done() or fut.cancelled() or fut.exception():
                continue
            pid = fut.result()
            st = proc_stat(pid)
            if st is not None and st.ppid == self.pid:
                out.append((pid, st.start))
        return out

    # -- socket --------------------------------------------------------------

    def _fail_all(self, exc: BaseException) -> None:
        for p in self._pending.values():
            for fut in (p.started, p.exited):
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # mark retrieved: the waiter may be gone already

    def _on_readable(self) -> None:
        while True:
            try:
                msg = self._sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                msg = b""
            if not msg:
                self._closed = True
                self._loop.remove_reader(self._sock.fileno())
                self._announce_orphans()
                self._fail_all(SandboxStopped("the sandbox's exec server went away"))
                return
            if len(msg) < _HDR.size:
                continue
            kind, _, req_id = _HDR.unpack_from(msg)
            body = msg[_HDR.size :]
            pending = self._pending.get(req_id)
            if kind == R_ERROR and req_id == 0:
                log.warning("exec server %d: %s", self.pid, _error_text(msg))
            if pending is None:
                continue
            if kind == R_STARTED and not pending.started.done():
                pending.started.set_result(struct.unpack_from("<i", body)[0])
            elif kind == R_EXIT and not pending.exited.done():
                pending.exited.set_result(struct.unpack_from("<3i", body))
            elif kind == R_ERROR:
                (err,) = struct.unpack_from("<i", body)
                exc: Exception = SandboxError(f"exec failed: {_error_text(msg)}", errno=err)
                if err == errno.EAGAIN:
                    # the sandbox's own processes fill its pids limit (a fork bomb, often in
                    # its own session): the sandbox's state, not a server failure
                    exc = Conflict(
                        "the command could not start: the sandbox is at its process limit "
                        f"(its own processes fill it; kill some, or the sandbox): {_error_text(msg)}",
                        errno=err,
                    )
                for fut in (pending.started, pending.exited):
                    if not fut.done():
                        fut.set_exception(exc)
                        fut.exception()

    async def _send(self, payload: bytes, fds: list[int] | None = None) -> None:
        if self._closed:
            raise SandboxStopped("the sandbox's exec server is gone")
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self._sock.sendmsg([payload], anc)
                return
            except BlockingIOError:
                writable = self._loop.create_future()
                self._loop.add_writer(self._sock.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    self._loop.remove_writer(self._sock.fileno())
            except OSError as e:
                if e.errno == errno.EMSGSIZE:
                    raise PayloadTooLarge("command and environment are too large") from e
                raise SandboxStopped(f"the sandbox's exec server is gone: {e}") from e

    def _send_nowait(self, payload: bytes) -> None:
        """Best-effort send of a small control message (never waits, never raises)."""
        if self._closed:
            return
        with contextlib.suppress(OSError):
            self._sock.send(payload)

    async def signal(self, req_id: int, signo: int) -> None:
        with contextlib.suppress(SandboxStopped):
            await self._send(_HDR.pack(T_SIGNAL, 0, req_id) + struct.pack("<i", signo))

    # -- exec ----------------------------------------------------------------

    async def run(
        self,
        argv: list[str],
        env: list[str],
        cwd: str,
        uid: int,
        gid: int,
        groups: list[int],
        stdin: bytes | None,
        timeout_s: float,
        max_output_bytes: int,
        sink: Sink | None = None,
    ) -> ExecOutcome:
        """Run one command; return when it has exited and its output is drained.

        The whole process group is SIGKILLed at ``timeout_s`` (then ``timed_out``).
        ``sink`` gets all of the output as it comes; the outcome keeps ``max_output_bytes``
        per stream (the rest is read and dropped there).
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        req_id = next(self._ids)
        payload = _exec_payload(req_id, argv, env, cwd, uid, gid, groups, 0)
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (out_r, err_r):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
            os.set_blocking(fd, False)
        pending = _Pending(self._loop.create_future(), self._loop.create_future())
        self._pending[req_id] = pending
        streams = [
            _Stream("stdout", out_r, max_output_bytes),
            _Stream("stderr", err_r, max_output_bytes),
        ]
        sink_queue: asyncio.Queue[tuple[str, bytes] | None] | None = None
        sink_task: asyncio.Task[None] | None = None
        stdin_task: asyncio.Task[None] | None = None
        try:
            try:
                await self._send(payload, [in_r, out_w, err_w])
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            if sink is not None:
                sink_queue = asyncio.Queue()
                sink_task = asyncio.create_task(_drain_sink(sink_queue, sink))
            for s in streams:
                self._loop.add_reader(s.fd, self._read_stream, s, sink_queue)
            stdin_task = asyncio.create_task(self._write_stdin(in_w, stdin))
            in_w = -1  # owned by the task now
            out = ExecOutcome()
            status: tuple[int, int, int] | None = None
            # shield: cancelling the gather must not cancel the exit future itself
            everything = asyncio.gather(
                asyncio.shield(pending.exited), *(s.done.wait() for s in streams)
            )
            try:
                await asyncio.wait_for(
                    asyncio.shield(everything), max(0.0, deadline - time.monotonic())
                )
                status = pending.exited.result()
            except TimeoutError:
                out.timed_out = True
                await self.signal(req_id, signal.SIGKILL)
                # the group is dead; the output ends once the last holder of the pipes exits
                try:
                    await asyncio.wait_for(asyncio.shield(everything), 5.0)
                    status = pending.exited.result()
                except TimeoutError:
                    log.warning("exec %d: output still open 5 s after SIGKILL; closing it", req_id)
                    if pending.exited.done() and not pending.exited.exception():
                        status = pending.exited.result()
            finally:
                if not everything.done():
                    everything.cancel()
                    with contextlib.suppress(BaseException):
                        await everything
            if status is None:
                raise SandboxError("the command's process could not be reaped")
            wait_status, stage, err = status
            if stage != SetupStage.OK:
                _raise_setup_failure(stage, err, argv, cwd, out)
            elif os.WIFEXITED(wait_status):
                out.exit_code = os.WEXITSTATUS(wait_status)
            elif os.WIFSIGNALED(wait_status):
                out.signal = os.WTERMSIG(wait_status)
            out.stdout, out.stderr = bytes(streams[0].data), bytes(streams[1].data) + out.stderr
            out.stdout_truncated, out.stderr_truncated = streams[0].truncated, streams[1].truncated
            out.duration_ms = (time.monotonic() - t0) * 1000.0
            return out
        finally:
            for s in streams:
                self._loop.remove_reader(s.fd)
                with contextlib.suppress(OSError):
                    os.close(s.fd)
            if in_w >= 0:
                os.close(in_w)
            if stdin_task is not None and not stdin_task.done():
                stdin_task.cancel()
            if sink_queue is not None and sink_task is not None:
                sink_queue.put_nowait(None)
                with contextlib.suppress(Exception):
                    await sink_task
            self._pending.pop(req_id, None)
            if not pending.exited.done():
                # cancelled (e.g. the client went away) or failed: the command must not
                # outlive its request
                self._send_nowait(
                    _HDR.pack(T_SIGNAL, 0, req_id) + struct.pack("<i", signal.SIGKILL)
                )
            self._send_nowait(_HDR.pack(T_RELEASE, 0, req_id))

    async def start_process(
        self,
        argv: list[str],
        env: list[str],
        cwd: str,
        uid: int,
        gid: int,
        groups: list[int],
        *,
        stdin: bool,
        pty: TerminalSize | None,
        timeout_s: float,
        max_output_bytes: int,
    ) -> InteractiveExecution:
        """Start one command and return at once; see :class:`InteractiveExecution`.

        ``stdin``: keep the command's stdin open for :meth:`InteractiveExecution.write_stdin`
        (otherwise it reads EOF). ``pty``: give it a new terminal of that size instead of
        pipes (a pty opened here, on the host; the child makes its slave its controlling
        terminal), so stdout and stderr arrive merged as ``pty`` output. The whole process
        group is SIGKILLed at ``timeout_s`` (seconds). Output beyond ``max_output_bytes``
        per stream is read and dropped.
        """
        req_id = next(self._ids)
        flags = _EXEC_F_CTTY if pty is not None else 0
        payload = _exec_payload(req_id, argv, env, cwd, uid, gid, groups, flags)
        ours: list[int] = []  # our ends: closed here only if the start fails
        theirs: list[int] = []  # the child's ends: closed here once sent
        streams: list[tuple[str, int]] = []
        stdin_fd = -1
        try:
            if pty is not None:
                master, slave = os.openpty()
                os.set_inheritable(master, False)
                os.set_inheritable(slave, False)
                ours.append(master)
                theirs.append(slave)
                _set_winsize(master, pty)
                os.set_blocking(master, False)
                streams.append(("pty", master))
                stdin_fd = master
                send_fds = [slave, slave, slave]
            else:
                in_r, in_w = os.pipe2(os.O_CLOEXEC)
                ours.append(in_w)
                theirs.append(in_r)
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                ours.append(out_r)
                theirs.append(out_w)
                err_r, err_w = os.pipe2(os.O_CLOEXEC)
                ours.append(err_r)
                theirs.append(err_w)
                for fd in (out_r, err_r):
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
                    os.set_blocking(fd, False)
                streams += [("stdout", out_r), ("stderr", err_r)]
                send_fds = [in_r, out_w, err_w]
                if stdin:
                    stdin_fd = in_w
                else:
                    os.close(in_w)  # the command reads EOF at once
                    ours.remove(in_w)
            pending = _Pending(self._loop.create_future(), self._loop.create_future())
            self._pending[req_id] = pending
            try:
                await self._send(payload, send_fds)
            except BaseException:
                self._pending.pop(req_id, None)
                raise
        except BaseException:
            for fd in ours:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        finally:
            for fd in theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return InteractiveExecution(
            self, req_id, pending, streams, stdin_fd, argv, cwd, timeout_s, max_output_bytes
        )

    async def reroot(
        self, root_fd: int, hostname: str, mounts: list[tuple[str, bool]], timeout_s: float = 30.0
    ) -> None:
        """Move the container onto another root filesystem: ``root_fd`` is a detached mount
        of it (``open_tree(OPEN_TREE_CLONE)``; the server takes its own copy of the fd);
        ``mounts``: (path, is a directory) of each mount right below the container's
        current root (``/proc``, ``/dev``, ``/sys`` ...), moved to the same path in the new
        one (made there if missing, never through a symbolic link: its files may be a
        sandbox's). Every process of the container moves with ``pivot_root``, the old root
        is detached, and the hostname becomes ``hostname``. Only for a container in which
        no command ran (a warm one). Raises :class:`SandboxError` on failure, after which
        the container must be destroyed. ~1 ms."""
        req_id = next(self._ids)
        body = hostname.encode() + b"\0" + struct.pack("<I", len(mounts))
        body += b"".join(
            (b"d" if is_dir else b"f") + os.fsencode(p) + b"\0" for p, is_dir in mounts
        )
        pending = _Pending(self._loop.create_future(), self._loop.create_future())
        self._pending[req_id] = pending
        try:
            await self._send(_HDR.pack(T_REROOT, 0, req_id) + body, [root_fd])
            await asyncio.wait_for(asyncio.shield(pending.exited), timeout_s)
        except DsecError as e:
            raise SandboxError(f"moving the container onto its root failed: {e.message}") from e
        except TimeoutError as e:
            raise SandboxError(
                f"moving the container onto its root took over {timeout_s:g} s"
            ) from e
        finally:
            self._pending.pop(req_id, None)

    def _forget(self, req_id: int) -> None:
        """The edge has an exec's result: let the server free it."""
        self._pending.pop(req_id, None)
        self._send_nowait(_HDR.pack(T_RELEASE, 0, req_id))

    def _read_stream(
        self, s: _Stream, sink_queue: asyncio.Queue[tuple[str, bytes] | None] | None
    ) -> None:
        for _ in range(16):  # bounded per wake-up, so one flood cannot starve the loop
            try:
                chunk = os.read(s.fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._loop.remove_reader(s.fd)
                s.done.set()
                return
            if sink_queue is not None:  # a sink sees everything; the result keeps the cap
                sink_queue.put_nowait((s.kind, chunk))
            room = s.cap - len(s.data)
            if room <= 0:
                s.truncated = True
                continue
            if len(chunk) > room:
                s.truncated = True
                chunk = chunk[:room]
            s.data += chunk

    async def _write_stdin(self, fd: int, data: bytes | None) -> None:
        try:
            if not data:
                return
            os.set_blocking(fd, False)
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                except BlockingIOError:
                    writable = self._loop.create_future()
                    self._loop.add_writer(fd, writable.set_result, None)
                    try:
                        await writable
                    finally:
                        self._loop.remove_writer(fd)
                except BrokenPipeError:
                    return  # the command stopped reading; like a shell pipe
        finally:
            os.close(fd)


def _exec_payload(
    req_id: int,
    argv: list[str],
    env: list[str],
    cwd: str,
    uid: int,
    gid: int,
    groups: list[int],
    flags: int,
) -> bytes:
    strings = [cwd, *argv, *env]
    return b"".join(
        [
            _HDR.pack(T_EXEC, 0, req_id),
            _EXEC_BODY.pack(uid, gid, len(groups), len(argv), len(env), flags),
            struct.pack(f"<{len(groups)}I", *groups),
            b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in strings),
        ]
    )


class TerminalSize(Protocol):
    """A terminal size in character cells (e.g. ``dsec.e2b.interactive.PtySize``)."""

    @property
    def cols(self) -> int: ...
    @property
    def rows(self) -> int: ...


def _set_winsize(fd: int, size: TerminalSize) -> None:
    if not (0 < size.cols <= 0xFFFF and 0 < size.rows <= 0xFFFF):
        raise InvalidRequest(f"bad terminal size {size.cols}x{size.rows}")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


class InteractiveExecution:
    """One command started by :meth:`ExecServer.start_process`, still running.

    Its output is read by the event loop into a queue that :meth:`read_output` empties;
    while more than ``_QUEUE_BYTES`` wait there, reading stops (the command then blocks
    on a full pipe, as it would under a slow reader). Once the command exited the rest
    is drained regardless. :meth:`wait` returns the exit status; stdout/stderr of the
    outcome are empty (they were streamed), only the ``*_truncated`` flags are set.
    """

    _QUEUE_BYTES = 1 << 20

    def __init__(
        self,
        server: ExecServer,
        req_id: int,
        pending: _Pending,
        streams: list[tuple[str, int]],
        stdin_fd: int,
        argv: list[str],
        cwd: str,
        timeout_s: float,
        max_output_bytes: int,
    ) -> None:
        self._server = server
        self._loop = server._loop
        self._req_id = req_id
        self._pending = pending
        self._open: dict[int, str] = dict((fd, kind) for kind, fd in streams)
        self._sizes: dict[str, int] = {kind: 0 for kind, _ in streams}
        self._truncated: set[str] = set()
        self._cap = max_output_bytes
        self._pty_fd = next((fd for kind, fd in streams if kind == "pty"), -1)
        self._stdin_fd = stdin_fd
        self._stdin_lock = asyncio.Lock()
        self._chunks: collections.deque[tuple[str, bytes]] = collections.deque()
        self._queued = 0
        self._reading = False
        self._wake = asyncio.Event()
        self._argv, self._cwd = argv, cwd
        self._t0 = time.monotonic()
        self._timed_out = False
        self._exited = False
        self._timer = self._loop.call_later(timeout_s, self._on_timeout)
        self._outcome: asyncio.Future[ExecOutcome] = self._loop.create_future()
        self._start_reading()
        pending.exited.add_done_callback(self._on_exit)

    # -- output ----------------------------------------------------------------

    def _start_reading(self) -> None:
        if not self._reading:
            self._reading = True
            for fd, kind in self._open.items():
                self._loop.add_reader(fd, self._on_readable, fd, kind)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            for fd in self._open:
                self._loop.remove_reader(fd)

    def _on_readable(self, fd: int, kind: str) -> None:
        for _ in range(16):  # bounded per wake-up, so one flood cannot starve the loop
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:  # EIO: every holder of a pty's slave closed it
                chunk = b""
            if not chunk:
                self._close_stream(fd)
                return
            room = self._cap - self._sizes[kind]
            if len(chunk) > room:
                self._truncated.add(kind)
                chunk = chunk[: max(0, room)]
            if not chunk:
                continue
            self._sizes[kind] += len(chunk)
            self._chunks.append((kind, chunk))
            self._queued += len(chunk)
            self._wake.set()
            if self._queued > self._QUEUE_BYTES and not self._exited:
                self._stop_reading()
                return

    def _close_stream(self, fd: int) -> None:
        if fd not in self._open:
            return
        if self._reading:
            self._loop.remove_reader(fd)
        del self._open[fd]
        if fd == self._pty_fd:
            self._pty_fd = -1
            if self._stdin_fd == fd:
                self._stdin_fd = -1
        with contextlib.suppress(OSError):
            os.close(fd)
        self._wake.set()

    async def read_output(self) -> tuple[str, bytes] | None:
        """The next ``(stream, bytes)`` (stream: stdout, stderr or pty); ``None`` once every
        stream is closed and the command exited."""
        while True:
            if self._chunks:
                kind, chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._queued <= self._QUEUE_BYTES // 2 and self._open:
                    self._start_reading()
                return kind, chunk
            if not self._open and self._outcome.done():
                return None  # after the exit, so a failed exec's message comes first
            self._wake.clear()
            await self._wake.wait()

    # -- input and control --------------------------------------------------------

    async def write_stdin(self, data: bytes) -> None:
        """Write all of ``data`` to the command's stdin (its terminal's input with a pty).

        Raises ``Conflict`` when stdin was not kept open, is closed, or the command exited.
        """
        async with self._stdin_lock:
            if self._stdin_fd < 0:
                raise Conflict("the process's stdin is closed")
            fd = self._stdin_fd
            os.set_blocking(fd, False)
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    writable: asyncio.Future[None] = self._loop.create_future()
                    self._loop.add_writer(fd, writable.set_result, None)
                    try:
                        await writable
                    finally:
                        self._loop.remove_writer(fd)
                    if self._stdin_fd != fd:
                        raise Conflict("the process's stdin was closed") from None
                except OSError as e:  # EPIPE / EIO: nobody reads it any more
                    raise Conflict(f"the process no longer reads its stdin: {e}") from None

    async def close_stdin(self) -> None:
        """Close stdin (with a pty: send end-of-file, ^D, to the terminal). Idempotent."""
        async with self._stdin_lock:
            if self._stdin_fd < 0:
                return
            if self._stdin_fd == self._pty_fd:
                with contextlib.suppress(OSError):
                    os.write(self._stdin_fd, b"\x04")
                return
            with contextlib.suppress(OSError):
                os.close(self._stdin_fd)
            self._stdin_fd = -1

    async def signal(self, signo: int) -> None:
        """Send ``signo`` to the command's process group; a no-op once it exited."""
        if not self._exited:
            await self._server.signal(self._req_id, signo)

    def resize(self, size: TerminalSize) -> None:
        """Resize the terminal (the kernel sends SIGWINCH); ``InvalidRequest`` without a pty."""
        if self._pty_fd < 0:
            if self._exited or "pty" in self._sizes:
                return
            raise InvalidRequest("the process has no terminal")
        _set_winsize(self._pty_fd, size)

    @property
    def server_closed_by_edge(self) -> bool:
        """The exec server was closed on purpose (its sandbox is being destroyed)."""
        return self._server.closed_by_edge

    @property
    def has_pty(self) -> bool:
        return "pty" in self._sizes

    # -- end ---------------------------------------------------------------------

    def _on_timeout(self) -> None:
        if not self._exited:
            self._timed_out = True
            self._server._send_nowait(
                _HDR.pack(T_SIGNAL, 0, self._req_id) + struct.pack("<i", signal.SIGKILL)
            )

    def _on_exit(self, fut: asyncio.Future[tuple[int, int, int]]) -> None:
        try:
            self._finish(fut)
        finally:
            self._wake.set()

    def _finish(self, fut: asyncio.Future[tuple[int, int, int]]) -> None:
        self._exited = True
        self._timer.cancel()
        self._server._forget(self._req_id)
        self._start_reading()  # drain what is left, whatever the queue holds
        if self._stdin_fd >= 0 and self._stdin_fd != self._pty_fd:
            with contextlib.suppress(OSError):
                os.close(self._stdin_fd)
        self._stdin_fd = -1
        if fut.cancelled():
            self._outcome.set_exception(SandboxStopped("the exec was cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._outcome.set_exception(exc)
            self._outcome.exception()  # the waiter may never come
            return
        wait_status, stage, err = fut.result()
        out = ExecOutcome(timed_out=self._timed_out)
        try:
            if stage != SetupStage.OK:
                _raise_setup_failure(stage, err, self._argv, self._cwd, out)
            elif os.WIFEXITED(wait_status):
                out.exit_code = os.WEXITSTATUS(wait_status)
            elif os.WIFSIGNALED(wait_status):
                out.signal = os.WTERMSIG(wait_status)
        except DsecError as e:
            self._outcome.set_exception(e)
            self._outcome.exception()
            return
        if out.stderr:  # exec failed: tell it like a shell on the error stream
            kind = "pty" if "pty" in self._sizes else "stderr"
            self._chunks.append((kind, out.stderr))
            self._wake.set()
            out.stderr = b""
        out.duration_ms = (time.monotonic() - self._t0) * 1000.0
        self._outcome.set_result(out)

    async def wait(self) -> ExecOutcome:
        """Wait for the command to exit; its status (output flags only, no output)."""
        out = await asyncio.shield(self._outcome)
        out.stdout_truncated = "stdout" in self._truncated
        out.stderr_truncated = bool(self._truncated & {"stderr", "pty"})
        return out

    def close(self) -> None:
        """Kill the command if it still runs and drop its output (the edge gave up on it)."""
        if not self._exited:
            self._on_timeout()
            self._timed_out = False
        self._stop_reading()
        for fd in list(self._open):
            self._close_stream(fd)
        self._chunks.clear()


async def _drain_sink(queue: asyncio.Queue[tuple[str, bytes] | None], sink: Sink) -> None:
    while True:
        item = await queue.get()
        if item is None:
            return
        await sink(*item)


def _raise_setup_failure(stage: int, err: int, argv: list[str], cwd: str, out: ExecOutcome) -> None:
    reason = os.strerror(err) if err else "unknown error"
    if stage == SetupStage.EXEC:
        # like a shell: 127 = not found, 126 = found but not executable
        out.exit_code = 127 if err in (errno.ENOENT, errno.ENOTDIR) else 126
        out.stderr = f"dsec: {argv[0]}: {reason}\n".encode()
        return
    if stage == SetupStage.CHDIR:
        raise InvalidRequest(f"cannot change to working directory {cwd!r}: {reason}", cwd=cwd)
    name = SetupStage.NAMES[stage] if 0 <= stage < len(SetupStage.NAMES) else str(stage)
    raise SandboxError(f"exec setup failed at step {name!r}: {reason}", stage=name, errno=err)


def _error_text(msg: bytes) -> str:
    if len(msg) < _HDR.size + 4:
        return "malformed reply"
    (err,) = struct.unpack_from("<i", msg, _HDR.size)
    text = msg[_HDR.size + 4 :].split(b"\0", 1)[0].decode(errors="replace")
    return text or os.strerror(err)
