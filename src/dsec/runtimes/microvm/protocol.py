"""Host side of the guest agent protocol (virtio-serial, see ``dsec/guest/agent.c``).

Frames, both directions, little endian::

    magic u32 "DSA1" | payload_len u32 | request_id u32 | op u16 | nargs u16 | args
    arg = len u32 | bytes

One :class:`AgentClient` owns the host end of one VM's agent socket (QEMU's chardev, a unix
socket). Requests are multiplexed by request id; an exec gets any number of ``OUT`` frames
then one ``EXIT``. :class:`VMFiles` implements :class:`dsec.contract.runtime.SandboxFiles` on it.
:meth:`AgentClient.open_tcp` opens a TCP connection to the guest's loopback, multiplexed on
the same channel with a window each way (:class:`AgentStream`, a
:class:`~dsec.contract.edge.PortStream`; the frames are described in agent.c).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as errno_mod
import io
import os
import posixpath
import re
import struct
import tarfile
import time
from collections.abc import Callable
from typing import Any

from dsec.contract.runtime import OutputSink
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    FileExists_,
    FileNotFound,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
    PortNotListening,
    QuotaExceeded,
    SandboxError,
    SandboxTimeout,
)
from dsec.models import ExecResult, FileInfo
from dsec.privileged.seccomp_log import GuardLog, parse_guard_log

__all__ = ["AgentClient", "AgentOp", "AgentStream", "VMFiles"]

STREAM_WINDOW = 1 << 20
"""Bytes the guest may send on one TCP stream before the host acknowledges them."""
GUEST_WINDOW = 1 << 20
"""Bytes the host may have in flight to one TCP stream (agent.c's ``GUEST_WINDOW``)."""
_STREAM_CHUNK = 65536

MAGIC = 0x31415344
_HDR = struct.Struct("<IIIHH")
_ENTRY = struct.Struct("<BQIqII")
_TYPES = ("file", "dir", "symlink", "other")


class AgentOp:
    """Operation codes of the wire protocol (mirrors the enum in agent.c)."""

    PING = 1
    SETUP = 2
    EXEC = 3
    SIGNAL = 4
    READ = 10
    WRITE = 11
    LIST = 12
    STAT = 13
    REMOVE = 14
    MKDIR = 15
    RENAME = 16
    TCP_OPEN = 20
    TCP_DATA = 21
    TCP_SHUT = 22
    TCP_CLOSE = 23
    TCP_ACK = 24
    TCP_EOF = 25
    AUDIT = 30
    OK = 100
    ERR = 101
    OUT = 102
    EXIT = 103


def encode_frame(req_id: int, op: int, args: list[bytes]) -> bytes:
    body = b"".join(struct.pack("<I", len(a)) + a for a in args)
    return _HDR.pack(MAGIC, len(body), req_id, op, len(args)) + body


class _Pending:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[int, list[bytes]] | None] = asyncio.Queue()


class AgentStream:
    """One TCP connection to ``127.0.0.1:<port>`` in the guest, over the agent channel
    (:meth:`AgentClient.open_tcp`). A :class:`~dsec.contract.edge.PortStream`: reads
    return what the guest sent (``b""`` at its EOF or when the VM went away), writes wait
    while the guest's window is full."""

    def __init__(self, client: AgentClient, stream_id: int) -> None:
        self._client = client
        self.id = stream_id
        self._opened: asyncio.Future[list[bytes] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._chunks: collections.deque[bytes] = collections.deque()
        self._eof = False
        self._readable = asyncio.Event()
        self._credit = GUEST_WINDOW  # what we may still send before the guest acknowledges
        self._writable = asyncio.Event()
        self._writable.set()
        self._consumed = 0  # read by our caller, not yet acknowledged to the guest
        self._closed = False
        self._error: list[bytes] | None = None  # the guest's ERR answer to the open

    # called from the client's read loop (no await)
    def _frame(self, op: int, args: list[bytes]) -> None:
        if not self._opened.done():
            self._opened.set_result(args if op == AgentOp.OK else None)
            if op == AgentOp.ERR:
                self._error = args
            return
        if op == AgentOp.TCP_DATA and args:
            self._chunks.append(args[0])
            self._readable.set()
        elif op == AgentOp.TCP_ACK and args:
            with contextlib.suppress(ValueError):
                self._credit += int(args[0])
            self._writable.set()
        elif op in (AgentOp.TCP_EOF, AgentOp.ERR):
            self._eof = True
            self._readable.set()

    def _lost(self) -> None:
        if not self._opened.done():
            self._opened.set_result(None)
        self._eof = True
        self._closed = True
        self._readable.set()
        self._writable.set()

    async def read(self, max_bytes: int = 65536) -> bytes:
        while not self._chunks:
            if self._eof:
                return b""
            self._readable.clear()
            await self._readable.wait()
        data = self._chunks.popleft()
        if len(data) > max_bytes:
            self._chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        self._consumed += len(data)
        if self._consumed >= STREAM_WINDOW // 4 and not self._closed:
            n, self._consumed = self._consumed, 0
            with contextlib.suppress(DsecError):
                await self._client._post(self.id, AgentOp.TCP_ACK, [str(n).encode()])
        return data

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._closed:
                raise ConnectionResetError("the connection to the guest is closed")
            if self._credit <= 0:
                self._writable.clear()
                await self._writable.wait()
                continue
            n = min(len(view), self._credit, _STREAM_CHUNK)
            self._credit -= n
            await self._client._post(self.id, AgentOp.TCP_DATA, [bytes(view[:n])])
            view = view[n:]

    async def write_eof(self) -> None:
        if not self._closed:
            with contextlib.suppress(DsecError):
                await self._client._post(self.id, AgentOp.TCP_SHUT, [])

    async def close(self) -> None:
        if self._closed:
            return
        self._lost()
        self._client._streams.pop(self.id, None)
        with contextlib.suppress(DsecError, OSError):
            await self._client._post(self.id, AgentOp.TCP_CLOSE, [])


class AgentClient:
    """One connection to a guest agent. Create with :meth:`connect`; close with :meth:`close`.

    ``on_lost`` is called once when the connection drops (QEMU died or the guest stopped).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[int, AgentStream] = {}
        self._next_id = 1
        self._closed = False
        self._task = asyncio.create_task(self._read_loop())
        self._write_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: str, timeout_s: float = 10.0) -> AgentClient:
        """Connect to QEMU's agent socket, retrying until it exists (QEMU starting up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
                return cls(reader, writer)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > deadline:
                    raise SandboxTimeout(
                        f"agent socket {path} did not appear in {timeout_s} s"
                    ) from e
                await asyncio.sleep(0.002)

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._fail_all()

    def _fail_all(self) -> None:
        for p in self._pending.values():
            p.queue.put_nowait(None)
        for stream in list(self._streams.values()):
            stream._lost()
        self._streams.clear()

    async def _read_loop(self) -> None:
        try:
            while True:
                hdr = await self._reader.readexactly(_HDR.size)
                magic, length, req_id, op, nargs = _HDR.unpack(hdr)
                if magic != MAGIC:
                    raise SandboxError("agent stream corrupt (bad magic)")
                body = await self._reader.readexactly(length)
                args: list[bytes] = []
                off = 0
                for _ in range(nargs):
                    (n,) = struct.unpack_from("<I", body, off)
                    args.append(body[off + 4 : off + 4 + n])
                    off += 4 + n
                stream = self._streams.get(req_id)
                if stream is not None:
                    stream._frame(op, args)
                    continue
                pending = self._pending.get(req_id)
                if pending is not None:
                    pending.queue.put_nowait((op, args))
                # frames for unknown ids (a request the host gave up on) are dropped
        except (asyncio.IncompleteReadError, ConnectionError, SandboxError, OSError):
            pass
        finally:
            self._closed = True
            self._fail_all()

    async def _send(self, op: int, args: list[bytes]) -> tuple[int, _Pending]:
        if self._closed:
            raise SandboxError("the guest agent connection is closed")
        req_id = self._take_id()
        pending = _Pending()
        self._pending[req_id] = pending
        async with self._write_lock:
            self._writer.write(encode_frame(req_id, op, args))
            await self._writer.drain()
        return req_id, pending

    def _take_id(self) -> int:
        req_id = self._next_id
        self._next_id = (self._next_id % 0xFFFFFFF0) + 1
        return req_id

    async def _post(self, req_id: int, op: int, args: list[bytes]) -> None:
        """Send one frame that expects no reply of its own (TCP stream traffic)."""
        if self._closed:
            raise SandboxError("the guest agent connection is closed")
        async with self._write_lock:
            self._writer.write(encode_frame(req_id, op, args))
            await self._writer.drain()

    async def open_tcp(self, port: int, timeout_s: float = 10.0) -> AgentStream:
        """A TCP connection to ``127.0.0.1:port`` inside the guest. ``PortNotListening`` when
        refused (or when the agent predates TCP streams), ``SandboxTimeout`` when the
        guest does not answer within ``timeout_s`` seconds."""
        req_id = self._take_id()
        stream = AgentStream(self, req_id)
        self._streams[req_id] = stream
        try:
            await self._post(
                req_id, AgentOp.TCP_OPEN, [str(port).encode(), str(STREAM_WINDOW).encode()]
            )
            async with asyncio.timeout(timeout_s):
                ok = await asyncio.shield(stream._opened)
        except TimeoutError:
            await stream.close()
            raise SandboxTimeout(
                f"the guest did not connect to port {port} within {timeout_s:.0f} s", port=port
            ) from None
        except BaseException:
            await stream.close()
            raise
        if ok is None:
            err = stream._error
            self._streams.pop(req_id, None)
            stream._lost()
            if err is None:
                raise SandboxError("the guest agent connection was lost (the VM stopped?)")
            code = int(err[0]) if err and err[0].isdigit() else 0
            if code in (errno_mod.ECONNREFUSED, errno_mod.ECONNRESET):
                raise PortNotListening(
                    f"nothing in the sandbox accepts connections on port {port}", port=port
                )
            if code in (errno_mod.EINVAL, errno_mod.ENOSYS):
                raise CapabilityNotSupported(
                    "this sandbox's guest agent has no TCP streams (it was started by an "
                    "older dsec; a new sandbox has them)"
                )
            raise _map_error(err)
        return stream

    async def request(self, op: int, args: list[bytes], timeout_s: float = 30.0) -> list[bytes]:
        """Send one request and return the OK reply's args. Raises the mapped error on ERR."""
        req_id, pending = await self._send(op, args)
        try:
            async with asyncio.timeout(timeout_s):
                item = await pending.queue.get()
        except TimeoutError as e:
            raise SandboxTimeout(f"the guest agent did not answer in {timeout_s} s", op=op) from e
        finally:
            self._pending.pop(req_id, None)
        if item is None:
            raise SandboxError("the guest agent connection was lost (the VM stopped?)")
        rop, rargs = item
        if rop == AgentOp.ERR:
            raise _map_error(rargs)
        return rargs

    async def ping(self, timeout_s: float = 5.0) -> None:
        await self.request(AgentOp.PING, [], timeout_s)

    async def setup(
        self,
        hostname: str,
        disk_mb: int,
        seed: bytes | None = None,
        timeout_s: float = 10.0,
        pids: int = 0,
        memory_mb: int = 0,
        full_guest: bool | None = None,
        new_sandbox: bool = False,
    ) -> None:
        """Set the guest clock to now, reseed its RNG, set the hostname, resize the writable
        layer to ``disk_mb`` MiB, cap the commands (the guest cgroup every command runs in)
        at ``pids`` processes and ``memory_mb`` MiB. 0 keeps a value as it is.
        ``full_guest``: True runs the sandbox's commands without the guard (the whole guest;
        the agent refuses to go back), False with it, None keeps the mode. ``new_sandbox``:
        the guest now serves a new sandbox (a template's clone, a fork): the guard's
        refusals recorded so far (:meth:`guard_log`) are not its own and are forgotten."""
        mode = b"" if full_guest is None else b"1" if full_guest else b"0"
        await self.request(
            AgentOp.SETUP,
            [
                str(time.time_ns()).encode(),
                seed or os.urandom(64),
                hostname.encode(),
                str(disk_mb).encode(),
                str(pids).encode(),
                str(memory_mb).encode(),
                mode,
                b"1" if new_sandbox else b"",
            ],
            timeout_s,
        )

    async def guard_log(self, after: int = 0, timeout_s: float = 5.0) -> GuardLog:
        """The guard's seccomp refusals the guest kept (:class:`GuardLog`: exact counts per
        system call, the records numbered above ``after``). Raises :class:`DsecError` when
        the agent cannot answer (an agent older than the op answers ERR)."""
        args = await self.request(AgentOp.AUDIT, [str(after).encode()], timeout_s)
        try:
            return parse_guard_log(args)
        except ValueError as e:
            raise SandboxError(f"the guest agent's audit answer: {e}") from e

    async def exec_raw(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: str | None,
        stdin: bytes,
        timeout_s: float,
        max_output_bytes: int,
        tool: bool = False,
        sink: OutputSink | None = None,
        grace_s: float = 10.0,
    ) -> tuple[bytes, bytes, dict[str, Any]]:
        """Run a command in the guest; returns (stdout, stderr, status fields).

        The agent enforces ``timeout_s`` (SIGKILL to the process group) and the output cap;
        the host waits ``timeout_s + grace_s`` before declaring the agent unresponsive.
        ``tool`` runs ``argv[0]`` as an applet of the initramfs busybox (for tar).
        """
        head = f"{int(timeout_s * 1000)} {max_output_bytes} {1 if tool else 0} {len(env)}".encode()
        args = [head, cwd.encode(), (user or "").encode(), stdin]
        args += [f"{k}={v}".encode() for k, v in env.items()]
        args += [a.encode() for a in argv]
        req_id, pending = await self._send(AgentOp.EXEC, args)
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout_s + grace_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(remaining, 0.001)):
                        item = await pending.queue.get()
                except TimeoutError as e:
                    raise SandboxTimeout(
                        f"the guest agent did not finish the command {timeout_s + grace_s:.0f} s after it started"
                    ) from e
                if item is None:
                    raise SandboxError(
                        "the guest agent connection was lost during exec (the VM stopped?)"
                    )
                op, rargs = item
                if op == AgentOp.OUT:
                    stream = "stdout" if rargs[0] == b"1" else "stderr"
                    (out if stream == "stdout" else err).extend(rargs[1])
                    if sink is not None:
                        await sink(stream, rargs[1])
                elif op == AgentOp.EXIT:
                    fields = [int(x) for x in rargs[0].split()]
                    code, sig, timed_out, t_out, t_err, dur = fields[:6]
                    status = {
                        "exit_code": None if code < 0 else code,
                        "signal": sig or None,
                        "timed_out": bool(timed_out),
                        "stdout_truncated": bool(t_out),
                        "stderr_truncated": bool(t_err),
                        "duration_ms": float(dur),
                        "oom_killed": len(fields) > 6 and bool(fields[6]),
                    }
                    return bytes(out), bytes(err), status
                elif op == AgentOp.ERR:
                    raise _map_error(rargs)
        except asyncio.CancelledError:
            # the caller went away: kill the command in the guest, best effort
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self.request(AgentOp.SIGNAL, [str(req_id).encode(), b"9"], 2.0)
                )
            raise
        finally:
            self._pending.pop(req_id, None)

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        user: str | None,
        stdin: bytes,
        timeout_s: float,
        max_output_bytes: int,
        sink: OutputSink | None = None,
        grace_s: float = 10.0,
    ) -> ExecResult:
        out, err, status = await self.exec_raw(
            argv, env=env, cwd=cwd, user=user, stdin=stdin, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, sink=sink, grace_s=grace_s,
        )  # fmt: skip
        return ExecResult(
            stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"), **status
        )


def _map_error(args: list[bytes]) -> DsecError:
    code = int(args[0]) if args and args[0].isdigit() else 0
    msg = args[1].decode("utf-8", "replace") if len(args) > 1 else "guest agent error"
    return _errno_error(code, msg)


def _errno_error(code: int, msg: str) -> DsecError:
    """The typed error of a failed file operation in the guest (errno ``code``)."""
    if code == errno_mod.ENOENT:
        return FileNotFound(msg, errno=code)
    if code == errno_mod.EEXIST or code == errno_mod.ENOTEMPTY:
        return FileExists_(msg, errno=code)
    if code == errno_mod.EFBIG:
        return PayloadTooLarge(msg, errno=code)
    if code in (errno_mod.ENOSPC, errno_mod.EDQUOT):
        return QuotaExceeded(f"the sandbox's writable layer is full: {msg}", errno=code)
    if code in (
        errno_mod.EISDIR,
        errno_mod.ENOTDIR,
        errno_mod.EINVAL,
        errno_mod.ENAMETOOLONG,
        errno_mod.ESRCH,
        errno_mod.ELOOP,
        errno_mod.EACCES,
        errno_mod.EPERM,
        errno_mod.EROFS,
    ):
        return InvalidRequest(msg, errno=code)
    return SandboxError(msg, errno=code)


_STRERROR = {os.strerror(code): code for code in errno_mod.errorcode}
"""errno by its message (the guest's busybox is linked with glibc, as this host's Python)."""


def _tar_error(path: str, stderr: bytes) -> DsecError:
    """The typed error of a failed busybox ``tar -x``: from the errno its first message
    names (``tar: can't open 'x': Not a directory``), as the other file calls answer it. A
    leading directory it could not make for "File exists" is a name that is no directory
    (ENOTDIR, as the container tier says); a symlink or hard link it could not make is a
    name that exists (busybox says no errno)."""
    text = stderr.decode("utf-8", "replace")
    message = f"tar extract into {path} failed: {text[-500:]}"
    for line in text.splitlines():
        if not line.startswith("tar: "):
            continue
        code = _STRERROR.get(line.rsplit(": ", 1)[-1].strip())
        if code == errno_mod.EEXIST and line.startswith("tar: can't create directory "):
            code = errno_mod.ENOTDIR
        if code is not None:
            return _errno_error(code, message)
        if re.match(r"tar: can't create (sym|hard)link ", line):
            return _errno_error(errno_mod.EEXIST, message)
    return SandboxError(message)


def _entries(args: list[bytes]) -> list[FileInfo]:
    out: list[FileInfo] = []
    for i in range(0, len(args) - 2, 3):
        kind, size, mode, mtime_ns, uid, gid = _ENTRY.unpack(args[i])
        path = args[i + 1].decode("utf-8", "surrogateescape")
        target = args[i + 2].decode("utf-8", "surrogateescape")
        out.append(
            FileInfo(
                path=path,
                name=posixpath.basename(path) or "/",
                type=_TYPES[kind] if kind < 4 else "other",
                size=size,
                mode=mode,
                mtime=mtime_ns / 1e9,
                uid=uid,
                gid=gid,
                target=target if kind == 2 else None,
            )
        )
    return out


def _abs(path: str) -> str:
    """``path`` normalised (``.``, ``//`` and inner ``..`` collapsed). Refuses relative paths
    and a ``..`` that would climb above ``/`` (``PathOutsideSandbox``), as the container tier
    does, so the agent never receives a ``..`` component."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute: {path!r}", path=path)
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise PathOutsideSandbox(f"path {path!r} leaves the sandbox root", path=path)
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


def _member_parts(name: str) -> list[str]:
    """Relative components of a tar member name; refuses absolute names and ``..``."""
    if name.startswith("/") or "\0" in name:
        raise PathOutsideSandbox(f"tar member {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathOutsideSandbox(f"tar member {name!r} contains '..'")
    return parts


def sanitize_upload_tar(data: bytes) -> tuple[list[bytes], int]:
    """Check an uploaded archive and re-serialise it for the guest's busybox ``tar``.

    Returns (plain GNU-format tars to extract one after the other, number of members
    extracted). busybox makes an archive's links only after its other members (so that no
    member is written through a link of the same archive); the container tier follows them
    (resolved inside the sandbox, as every later access is), and so does this: a new tar
    starts at each member whose path goes through, or replaces, a link of the current one,
    which the tar before made. Refused with
    ``PathOutsideSandbox``: absolute member names, ``..`` components, hard links whose target
    is outside the archive's directory. Refused with ``InvalidRequest``: device nodes, FIFOs
    and anything else that is not a file, directory or link; input that is not a tar (gzip,
    bzip2 and xz are accepted). The guest sees only names checked here (no PAX or GNU header
    the host and busybox could read differently).
    """
    try:
        src = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise InvalidRequest(f"not a tar archive: {e}") from e
    batches: list[bytes] = []
    out = io.BytesIO()
    dst = tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT)
    links: set[str] = set()  # names of the links in the current tar
    count = 0
    try:
        with src:
            for member in src:
                parts = _member_parts(member.name)
                if not parts:
                    continue  # the archive's own root entry
                through = [parts]
                if member.islnk():
                    through.append(_member_parts(member.linkname))
                if any("/".join(p[:i]) in links for p in through for i in range(1, len(p) + 1)):
                    dst.close()
                    batches.append(out.getvalue())
                    out = io.BytesIO()
                    dst = tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT)
                    links.clear()
                if member.issym() or member.islnk():
                    links.add("/".join(parts))
                ti = tarfile.TarInfo("/".join(parts))
                ti.mode = member.mode & 0o7777
                ti.mtime = member.mtime
                ti.uid, ti.gid = member.uid, member.gid
                ti.uname, ti.gname = member.uname, member.gname
                fileobj = None
                if member.isdir():
                    ti.type = tarfile.DIRTYPE
                elif member.isfile():
                    ti.size = member.size
                    fileobj = src.extractfile(member)
                elif member.issym():
                    if "\0" in member.linkname or not member.linkname:
                        raise InvalidRequest(f"tar member {member.name!r}: bad link target")
                    ti.type, ti.linkname = tarfile.SYMTYPE, member.linkname
                elif member.islnk():
                    target = _member_parts(member.linkname)
                    if not target:
                        raise PathOutsideSandbox(
                            f"tar member {member.name!r} links outside the archive"
                        )
                    ti.type, ti.linkname = tarfile.LNKTYPE, "/".join(target)
                else:
                    raise InvalidRequest(
                        f"tar member {member.name!r}: devices and FIFOs are not allowed"
                    )
                dst.addfile(ti, fileobj)
                count += 1
        dst.close()
    except tarfile.TarError as e:
        raise InvalidRequest(f"corrupt tar archive: {e}") from e
    batches.append(out.getvalue())
    return batches, count


def relative_download_tar(raw: bytes, strip_root: bool, max_bytes: int) -> bytes:
    """Rewrite the guest's ``tar -c -C dir .`` output with member names relative to ``dir``
    (``./a`` -> ``a``, the ``.`` entry dropped) as the container tier produces them, so that
    ``upload_tar(dir, archive)`` puts everything back. Devices, FIFOs and sockets are left
    out. ``strip_root=False`` keeps names as they are (a single file archived under its
    own name). Raises ``PayloadTooLarge`` past ``max_bytes``."""
    out = io.BytesIO()
    try:
        with (
            tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as src,
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
        ):
            for member in src:
                name = member.name
                if strip_root:
                    parts = [p for p in name.split("/") if p not in ("", ".")]
                    if not parts:
                        continue
                    name = "/".join(parts)
                if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
                    continue
                if member.islnk() and strip_root:
                    member.linkname = "/".join(
                        p for p in member.linkname.split("/") if p not in ("", ".")
                    )
                member.name = name
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
                if out.tell() > max_bytes:
                    raise PayloadTooLarge(f"the archive exceeds {max_bytes} bytes", limit=max_bytes)
    except tarfile.TarError as e:
        raise SandboxError(f"the guest produced a corrupt tar archive: {e}") from e
    if out.tell() > max_bytes:
        raise PayloadTooLarge(f"the archive exceeds {max_bytes} bytes", limit=max_bytes)
    return out.getvalue()


# top-level directories of the guest that are other filesystems (kernel views, devices)
_GUEST_PSEUDO_DIRS = frozenset({"proc", "sys", "dev", "run"})


class VMFiles:
    """:class:`dsec.contract.runtime.SandboxFiles` over the guest agent.

    The whole guest is the sandbox, so every absolute guest path is inside it; paths are
    normalised (``..`` collapsed) before they cross the channel. ``get_client`` returns the
    live agent connection (resuming a paused sandbox first, if the runtime does that).
    """

    def __init__(self, get_client: Callable[[], Any], op_timeout_s: float = 60.0) -> None:
        self._get_client = get_client
        self._timeout = op_timeout_s

    async def _client(self) -> AgentClient:
        c = self._get_client()
        if asyncio.iscoroutine(c):
            c = await c
        assert isinstance(c, AgentClient)
        return c

    async def _req(self, op: int, args: list[bytes]) -> list[bytes]:
        return await (await self._client()).request(op, args, self._timeout)

    async def read(self, path: str, max_bytes: int) -> bytes:
        args = await self._req(AgentOp.READ, [_abs(path).encode(), str(max_bytes).encode()])
        return args[0] if args else b""

    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo:
        args = await self._req(
            AgentOp.WRITE,
            [_abs(path).encode(), data, str(mode).encode(), b"1" if make_parents else b"0"],
        )
        return _entries(args)[0]

    async def list(self, path: str, depth: int = 1) -> list[FileInfo]:
        args = await self._req(AgentOp.LIST, [_abs(path).encode(), str(max(1, depth)).encode()])
        return sorted(_entries(args), key=lambda f: f.path)

    async def stat(self, path: str) -> FileInfo:
        return _entries(await self._req(AgentOp.STAT, [_abs(path).encode()]))[0]

    async def remove(self, path: str, recursive: bool = False) -> None:
        p = _abs(path)
        if p == "/":
            raise InvalidRequest("refusing to remove /")
        await self._req(AgentOp.REMOVE, [p.encode(), b"1" if recursive else b"0"])

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        args = await self._req(AgentOp.MKDIR, [_abs(path).encode(), b"1" if parents else b"0"])
        return _entries(args)[0]

    async def rename(self, src: str, dst: str) -> FileInfo:
        args = await self._req(AgentOp.RENAME, [_abs(src).encode(), _abs(dst).encode()])
        return _entries(args)[0]

    async def upload_tar(self, path: str, data: bytes) -> int:
        """Extract a tar archive (optionally compressed) into directory ``path``; returns the
        number of members extracted. Members are checked on the host first
        (:func:`sanitize_upload_tar`); the guest's busybox ``tar`` extracts the checked copy."""
        p = _abs(path)
        batches, members = sanitize_upload_tar(data)
        await self.mkdir(p, parents=True)
        client = await self._client()
        for clean in batches:
            _, err, status = await client.exec_raw(
                ["tar", "-x", "-f", "-", "-C", p], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                user=None, stdin=clean, timeout_s=self._timeout, max_output_bytes=65536,
                tool=True,
            )  # fmt: skip
            if status["exit_code"] != 0:
                raise _tar_error(p, err)
        return members

    async def download_tar(self, path: str, max_bytes: int) -> bytes:
        """A tar archive of ``path``, at most ``max_bytes`` long. A directory's members are
        relative to it (``a.txt``, ``sub/b.txt``); a file is archived under its own name.
        Devices, FIFOs and sockets are left out; archiving ``/`` skips /proc, /sys, /dev, /run."""
        p = _abs(path)
        info = await self.stat(p)  # FileNotFound first
        if info.type == "dir":
            names = ["."]
            if p == "/":
                names = [
                    "./" + e.name for e in await self.list(p, 1) if e.name not in _GUEST_PSEUDO_DIRS
                ]
                if not names:
                    return relative_download_tar(_EMPTY_TAR, True, max_bytes)
            argv = ["tar", "-c", "-f", "-", "-C", p, *names]
        else:
            parent, name = posixpath.split(p)
            argv = ["tar", "-c", "-f", "-", "-C", parent or "/", name]
        client = await self._client()
        out, err, status = await client.exec_raw(
            argv, env={"PATH": "/usr/bin:/bin"}, cwd="/", user=None, stdin=b"",
            timeout_s=self._timeout, max_output_bytes=max_bytes + (1 << 20), tool=True,
        )  # fmt: skip
        if status["stdout_truncated"]:
            raise PayloadTooLarge(f"the tar of {p} exceeds {max_bytes} bytes", limit=max_bytes)
        if status["exit_code"] != 0:
            raise SandboxError(f"tar of {p} failed: {err.decode('utf-8', 'replace')[-500:]}")
        return relative_download_tar(out, info.type == "dir", max_bytes)


_EMPTY_TAR = b"\0" * 10240
