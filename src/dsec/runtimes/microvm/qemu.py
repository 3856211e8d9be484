"""QEMU mechanics shared by the ``microvm`` and ``vm`` tiers: command lines, launch, QMP.

A QEMU process is started through the guest agent binary in host mode
(``agent --launch <cgroup.procs>... -- qemu ...``) so it runs in its sandbox's cgroup and has
KSM merging enabled (``prctl(PR_SET_MEMORY_MERGE)``) from its first instruction. It runs in
its own session and outlives the edge (``recover()`` reattaches through the QMP and agent
sockets on disk). Every QEMU dsec starts carries ``-name dsec:<node tag>:<sandbox id>`` so
orphans can be found in /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import SandboxError, SandboxTimeout, TierUnavailable

__all__ = [
    "QMPClient",
    "QemuProcess",
    "find_qemu",
    "kill_and_wait",
    "pid_alive",
    "pidfd_readable",
    "qemu_processes",
    "wait_exit",
]


def find_qemu() -> str:
    """Path of qemu-system-x86_64, or :class:`TierUnavailable` naming the Debian package."""
    for d in [*os.environ.get("PATH", "/usr/bin:/bin").split(":"), "/usr/bin"]:
        p = Path(d) / "qemu-system-x86_64"
        if p.exists():
            return str(p)
    raise TierUnavailable("qemu-system-x86_64 is not installed (Debian: qemu-system-x86)")


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _reap(pid: int) -> bool | None:
    """waitpid(WNOHANG): True if reaped now, False if not yet, None if not our child."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return None


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def pidfd_readable(fd: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the process of pidfd ``fd`` to exit. True if it did."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _set_done, fut)
    try:
        await asyncio.wait_for(fut, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


async def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited (reaping it if it is our child). True if it did."""
    deadline = time.monotonic() + timeout_s
    fd = -1
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
    try:
        while True:
            reaped = _reap(pid)
            if reaped or (reaped is None and not pid_alive(pid)):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if fd >= 0:
                if await pidfd_readable(fd, min(remaining, 0.5)):
                    await asyncio.sleep(0.001)  # exited: let its threads finish before waitpid
            else:
                await asyncio.sleep(0.01)
    finally:
        if fd >= 0:
            os.close(fd)


async def kill_and_wait(pid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL ``pid`` and wait for it to be gone (reaped if ours)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    await wait_exit(pid, timeout_s)


def qemu_processes(tag: str) -> dict[str, int]:
    """{sandbox id: pid} of running QEMUs started with ``-name dsec:<tag>:<id>``."""
    out: dict[str, int] = {}
    prefix = f"dsec:{tag}:"
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"qemu-system-x86_64"):
            continue
        for i, a in enumerate(argv[:-1]):
            if a == b"-name" and argv[i + 1].decode(errors="replace").startswith(prefix):
                if pid_alive(int(d)):
                    out[argv[i + 1].decode(errors="replace")[len(prefix) :]] = int(d)
    return out


@dataclass
class QemuProcess:
    """One QEMU started by :meth:`launch` (pid, its directory, log files)."""

    pid: int
    dir: Path
    log: Path
    console: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @classmethod
    def launch(
        cls,
        launcher: Path,
        cgroup_procs: list[Path],
        argv: list[str],
        dir: Path,
        ksm: bool = True,
        thp: bool = True,
    ) -> QemuProcess:
        """Start ``argv`` (QEMU) through the launcher in a new session; stdout/stderr to qemu.log.

        ``ksm``: the launcher marks the process mergeable (``PR_SET_MEMORY_MERGE``) before exec;
        False sets ``DSEC_KSM=0`` so it does not. ``thp``: False sets ``DSEC_THP=0``, and the
        launcher turns transparent huge pages off for the process (``PR_SET_THP_DISABLE``)."""
        log = dir / "qemu.log"
        env = dict(os.environ)
        env["DSEC_KSM"] = "1" if ksm else "0"
        env["DSEC_THP"] = "1" if thp else "0"
        with open(log, "ab") as logf:
            popen = subprocess.Popen(
                [str(launcher), "--launch", *map(str, cgroup_procs), "--", *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        return cls(pid=popen.pid, dir=dir, log=log, console=dir / "console.log", popen=popen)

    def evidence(self, max_bytes: int = 3000) -> str:
        """The tail of QEMU's log and the guest console, for error messages."""
        parts = []
        for p in (self.log, self.console):
            with contextlib.suppress(OSError):
                data = p.read_bytes()[-max_bytes:].decode("utf-8", "replace").strip()
                if data:
                    parts.append(f"--- {p.name} ---\n{data}")
        return "\n".join(parts)


class QMPClient:
    """A minimal QMP client (one command at a time) over QEMU's unix socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: str, timeout_s: float = 10.0, pid: int | None = None) -> QMPClient:
        """Connect (retrying while QEMU starts), read the greeting, negotiate capabilities."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=16 << 20)
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if pid is not None and not pid_alive(pid):
                    raise SandboxError("QEMU exited during startup") from e
                if time.monotonic() > deadline:
                    raise SandboxTimeout(
                        f"QMP socket {path} did not appear in {timeout_s} s"
                    ) from e
                await asyncio.sleep(0.002)
        client = cls(reader, writer)
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                await client._read_message()  # greeting
                await client.execute("qmp_capabilities")
        except TimeoutError as e:
            await client.close()
            raise SandboxTimeout(f"QMP on {path} did not greet in {timeout_s} s") from e
        except (ConnectionError, OSError, ValueError) as e:
            await client.close()
            raise SandboxError(f"QEMU closed its QMP socket during startup ({e})") from e
        return client

    async def _read_message(self) -> dict[str, Any]:
        line = await self._reader.readline()
        if not line:
            raise SandboxError("QMP connection closed (QEMU exited)")
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def execute(self, command: str, timeout_s: float = 30.0, **arguments: Any) -> Any:
        """Run one QMP command and return its ``return`` value; errors raise SandboxError."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        async with self._lock:
            try:
                async with asyncio.timeout(timeout_s):
                    self._writer.write(json.dumps(msg).encode() + b"\n")
                    await self._writer.drain()
                    while True:
                        reply = await self._read_message()
                        if "event" in reply:
                            self.events.append(reply)
                            del self.events[:-100]
                            continue
                        if "error" in reply:
                            raise SandboxError(
                                f"QMP {command}: {reply['error'].get('desc')}", qmp=command
                            )
                        return reply.get("return")
            except TimeoutError as e:
                raise SandboxTimeout(f"QMP {command} did not answer in {timeout_s} s") from e
            except (ConnectionError, OSError) as e:
                raise SandboxError(f"QMP {command}: connection lost ({e})") from e

    async def send_fd(self, name: str, fd: int, timeout_s: float = 10.0) -> None:
        """Hand ``fd`` to QEMU as ``name`` (QMP ``getfd`` with the fd in SCM_RIGHTS), for a
        ``fd:<name>`` migration URI."""
        msg = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
        transport_sock = self._writer.get_extra_info("socket")
        if transport_sock is None:
            raise SandboxError("QMP connection has no socket to pass a file descriptor")
        async with self._lock:
            # a dup of the transport's socket: sendmsg with ancillary data is not exposed by
            # asyncio streams; the message is small, so one non-blocking send takes it all
            raw = socket.socket(fileno=os.dup(transport_sock.fileno()))
            try:
                deadline = time.monotonic() + timeout_s
                while True:
                    try:
                        sent = socket.send_fds(raw, [msg], [fd])
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise SandboxTimeout("QMP getfd: socket not writable") from None
                        await asyncio.sleep(0.001)
                if sent != len(msg):
                    raise SandboxError("QMP getfd: short write")
            except OSError as e:
                raise SandboxError(f"QMP getfd: {e}") from e
            finally:
                raw.close()
            try:
                async with asyncio.timeout(timeout_s):
                    while True:
                        reply = await self._read_message()
                        if "event" in reply:
                            self.events.append(reply)
                            del self.events[:-100]
                            continue
                        if "error" in reply:
                            raise SandboxError(f"QMP getfd: {reply['error'].get('desc')}")
                        return
            except TimeoutError as e:
                raise SandboxTimeout(f"QMP getfd did not answer in {timeout_s} s") from e

    async def wait_migration(self, timeout_s: float) -> dict[str, Any]:
        """Poll ``query-migrate`` until completed; raises on failure or timeout."""
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            info: dict[str, Any] = await self.execute("query-migrate") or {}
            status = info.get("status")
            if status == "completed":
                return info
            if status in ("failed", "cancelled"):
                raise SandboxError(f"migration {status}: {info.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise SandboxTimeout(f"migration not completed in {timeout_s} s (status {status})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
