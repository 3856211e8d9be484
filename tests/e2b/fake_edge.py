"""A bubblewrap runtime under the real edge: E2B tests run real commands without root.

:class:`BwrapRuntime` is a :class:`~dsec.contract.runtime.Runtime` (with the ``Interactive``,
``Pausable`` and ``Snapshottable`` abilities) whose sandboxes are directories used as the
root filesystem of ``bwrap``: the host's ``/usr`` is bound read-only, ``/bin``, ``/lib`` ...
are symlinks into it (Debian's merged-/usr layout), ``/etc/passwd`` knows ``root`` and
``user`` (uid 1000), and everything else (``/home``, ``/tmp``, files written through the API)
lives in the directory. Paths seen by commands and by the file API agree; exit codes,
stdin, signals, terminals and timeouts are real. :func:`make_fake_edge` puts it under the
real :class:`~dsec.edge.agent.EdgeAgent` (``dsec.testing.FakeEdge``), so ownership, states,
TTLs, pause, snapshots, forks and the trajectory log follow the real edge's rules.
Requires ``bwrap``.

It is a test double, not an isolation boundary: no cgroups, no network namespace, no quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import os
import posixpath
import select
import shutil
import signal
import stat as stat_mod
import struct
import tarfile
import tempfile
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.contract.edge import OutputChunk, PtySize
from dsec.contract.runtime import Handle, OutputSink, RuntimeFacts, SandboxSpec
from dsec.errors import (
    CapabilityNotSupported,
    FileExists_,
    FileNotFound,
    InvalidRequest,
    PayloadTooLarge,
    SandboxStopped,
)
from dsec.models import ExecRequest, ExecResult, FileInfo, LayerInfo, SnapshotRequest
from dsec.runtimes.container.files import RootedFiles
from dsec.runtimes.container.watch import DirWatcher, WatchHub
from dsec.testing import FakeEdge, MemoryLayers

__all__ = ["BwrapRuntime", "make_fake_edge"]

PASSWD = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
GROUP = "root:x:0:\nuser:x:1000:\n"
MAX_READ_BYTES = 8 << 20
"""Largest file a read returns here, bytes (bigger: PayloadTooLarge): small, so tests of the
limit stay cheap."""
_HOST_DIRS = ("usr", "proc", "dev")
"""Top-level directories that are the host's, not the sandbox's (never snapshotted)."""


def make_fake_edge(base: Path) -> FakeEdge:
    """The real edge over :class:`BwrapRuntime` sandboxes under ``base`` (one ``container``
    tier; system images ``debian``, ``busybox`` and ``e2b-base`` are empty: everything comes
    from /usr; ``e2b-base`` has the real image's config: user ``user`` in ``/home/user``)."""
    layers = MemoryLayers(system_images=("busybox", "debian"))
    layers.put_image(
        "e2b-base",
        layers.get_image("debian").layers,
        meta={"builtin": "e2b-base", "config": {"User": "user", "WorkingDir": "/home/user"}},
    )
    edge = FakeEdge(
        available_tiers=("container",),
        layers=layers,
        runtime_factory=lambda tier: BwrapRuntime(tier, base, layers),
    )
    edge.limits.max_read_bytes = MAX_READ_BYTES
    return edge


class FakeProcess:
    """An ``InteractiveProcess`` backed by a bwrap'ed subprocess."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        pty_master: int | None,
        timeout_s: float,
        pty_slave: int | None = None,
    ) -> None:
        self._proc = proc
        self._master = pty_master
        self._slave = pty_slave
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue(64)
        self._open_streams = 0
        self._sent_signal: int | None = None
        self._timed_out = False
        self._readers: list[asyncio.Task[None]] = []
        self.started = time.monotonic()
        if pty_master is not None:
            self._open_streams = 1
            self._readers.append(asyncio.create_task(self._read_pty(pty_master)))
        else:
            for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                if stream is not None:
                    self._open_streams += 1
                    self._readers.append(asyncio.create_task(self._read_pipe(name, stream)))
        self._watchdog = asyncio.create_task(self._expire(timeout_s))

    async def _read_pipe(self, name: str, stream: asyncio.StreamReader) -> None:
        try:
            while chunk := await stream.read(65536):
                await self._queue.put((name, chunk))  # type: ignore[arg-type]
        finally:
            await self._queue.put(None)

    async def _read_pty(self, fd: int) -> None:
        """Read the master until the command has exited and its output is drained. The
        parent keeps a slave fd open (``self._slave``) until then: reading until EIO (every
        slave closed) lost the last output now and then on a busy machine, which the kernel
        had not yet moved to the master's side when the command's exit closed the slave."""
        loop = asyncio.get_running_loop()

        def read_some(timeout_s: float) -> bytes | None:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                return None  # nothing within timeout_s
            try:
                return os.read(fd, 65536)
            except OSError:
                return b""

        try:
            while True:
                exited = self._proc.returncode is not None
                chunk = await loop.run_in_executor(None, read_some, 0.05 if exited else 0.2)
                if chunk is None:
                    if exited:
                        break  # exited, and 50 ms without output since: drained
                    continue
                if not chunk:
                    break
                await self._queue.put(("pty", chunk))
        finally:
            if self._slave is not None:
                os.close(self._slave)
                self._slave = None
            await self._queue.put(None)

    async def _expire(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if self._proc.returncode is None:
            self._timed_out = True
            self.kill_tree()

    async def read_output(self) -> OutputChunk | None:
        while self._open_streams > 0:
            item = await self._queue.get()
            if item is None:
                self._open_streams -= 1
                continue
            return item
        return None

    async def write_stdin(self, data: bytes) -> None:
        if self._master is not None:
            os.write(self._master, data)
            return
        if self._proc.stdin is None or self._proc.stdin.is_closing():
            raise InvalidRequest("stdin is closed")
        self._proc.stdin.write(data)
        await self._proc.stdin.drain()

    async def close_stdin(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.is_closing():
            self._proc.stdin.close()

    def kill_tree(self, signum: int = signal.SIGKILL) -> None:
        """Signal bwrap's whole process group (bwrap does not forward signals)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signum)

    async def signal(self, signum: int) -> None:
        if self._proc.returncode is None:
            self._sent_signal = signum
            self.kill_tree(signum)

    async def resize(self, size: PtySize) -> None:
        if self._master is None:
            raise CapabilityNotSupported("process has no terminal")
        fcntl.ioctl(
            self._master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0)
        )

    async def wait(self) -> ExecResult:
        rc = await self._proc.wait()
        self._watchdog.cancel()
        if self._master is not None:
            with contextlib.suppress(OSError):
                os.close(self._master)
            self._master = None
        killed = self._sent_signal is not None or self._timed_out
        sig = self._sent_signal or (signal.SIGKILL if self._timed_out else None)
        return ExecResult(
            exit_code=None if killed else (rc if rc >= 0 else None),
            signal=sig if killed else (-rc if rc < 0 else None),
            timed_out=self._timed_out,
            duration_ms=(time.monotonic() - self.started) * 1000,
        )


@dataclass
class _Sandbox:
    root: Path
    env: dict[str, str]
    user: str | None
    workdir: str
    procs: set[FakeProcess] = field(default_factory=set)


class HostDirFiles:
    """:class:`~dsec.contract.runtime.SandboxFiles` over a sandbox's directory."""

    def __init__(self, root: Path, hub: WatchHub, owner: tuple[int, int] = (0, 0)) -> None:
        self.root = root
        self.hub = hub
        self.owner = owner
        """The sandbox's default user. Its commands run in a user namespace that maps it to
        the host user running the tests (bwrap ``--uid``), so files that user owns on the
        host are the default user's inside: they are reported as such, as the container
        tier reports the files it creates for the default user."""

    @staticmethod
    def _rel(path: str) -> str:
        return posixpath.normpath(path).lstrip("/")

    def _host(self, path: str) -> Path:
        rel = self._rel(path)
        if rel.split("/", 1)[0] in _HOST_DIRS:
            raise InvalidRequest(f"{path} is outside the fake sandbox's writable tree")
        return self.root / rel if rel not in ("", ".") else self.root

    def _info(self, host: Path, sandbox_path: str) -> FileInfo:
        try:
            st = host.lstat()
        except FileNotFoundError:
            raise FileNotFound(f"{sandbox_path} does not exist", path=sandbox_path) from None
        if stat_mod.S_ISLNK(st.st_mode):
            kind, target = "symlink", os.readlink(host)
        elif stat_mod.S_ISDIR(st.st_mode):
            kind, target = "dir", None
        elif stat_mod.S_ISREG(st.st_mode):
            kind, target = "file", None
        else:
            kind, target = "other", None
        return FileInfo(
            path=sandbox_path,
            name=posixpath.basename(sandbox_path.rstrip("/")) or "/",
            type=kind,
            size=st.st_size,
            mode=stat_mod.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            uid=self.owner[0] if st.st_uid == os.geteuid() else st.st_uid,
            gid=self.owner[1] if st.st_gid == os.getegid() else st.st_gid,
            target=target,
        )

    async def read(self, path: str, max_bytes: int) -> bytes:
        host = self._host(path)
        info = self._info(host, path)
        if info.type == "dir":
            raise InvalidRequest(f"{path} is a directory", path=path)
        if info.size > max_bytes:
            raise PayloadTooLarge(f"{path} is larger than {max_bytes} bytes", limit=max_bytes)
        return host.read_bytes()

    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo:
        host = self._host(path)
        if host.is_dir():
            raise InvalidRequest(f"{path} is a directory", path=path)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
        host.chmod(mode)
        return self._info(host, path)

    async def list(self, path: str, depth: int = 1) -> list[FileInfo]:
        host = self._host(path)
        if self._info(host, path).type != "dir":
            raise InvalidRequest(f"{path} is not a directory", path=path)
        out: list[FileInfo] = []

        def walk(h: Path, p: str, level: int) -> None:
            for child in sorted(h.iterdir()):
                cp = posixpath.join(p, child.name)
                info = self._info(child, cp)
                out.append(info)
                if info.type == "dir" and level < depth:
                    walk(child, cp, level + 1)

        walk(host, path.rstrip("/") or "/", 1)
        return out

    async def stat(self, path: str) -> FileInfo:
        return self._info(self._host(path), path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        host = self._host(path)
        if self._info(host, path).type == "dir":
            if not recursive and any(host.iterdir()):
                raise InvalidRequest(f"{path} is a non-empty directory", path=path)
            shutil.rmtree(host)
        else:
            host.unlink()

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        host = self._host(path)
        if host.exists() and not host.is_dir():
            raise FileExists_(f"{path} exists and is not a directory", path=path)
        host.mkdir(parents=True, exist_ok=True)
        return self._info(host, path)

    async def rename(self, src: str, dst: str) -> FileInfo:
        hsrc, hdst = self._host(src), self._host(dst)
        self._info(hsrc, src)
        hdst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(hsrc, hdst)
        return self._info(hdst, dst)

    async def upload_tar(self, path: str, data: bytes) -> int:
        host = self._host(path)
        host.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = tf.getmembers()
            tf.extractall(host, filter="data")
        return len(members)

    async def watch(self, path: str, recursive: bool) -> DirWatcher:
        """inotify, as the container tier (the sandbox's tree is a plain directory here)."""
        self._host(path)  # the host's own directories are not the sandbox's
        return await RootedFiles(self.root, watch_hub=self.hub).watch(path, recursive)

    async def get_xattrs(self, paths: list[str], prefix: str) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for path in paths:
            host = self._host(path)
            if not host.exists() or host.is_symlink():
                out.append({})
                continue
            out.append(
                {
                    n: os.getxattr(host, n).decode(errors="replace")
                    for n in os.listxattr(host)
                    if n.startswith(prefix)
                }
            )
        return out

    async def set_xattrs(self, path: str, values: dict[str, str], clear_prefix: str | None) -> None:
        host = self._host(path)
        self._info(host, path)
        if clear_prefix is not None:
            for n in os.listxattr(host):
                if n.startswith(clear_prefix) and n not in values:
                    os.removexattr(host, n)
        for n, v in values.items():
            os.setxattr(host, n, v.encode())

    async def download_tar(self, path: str, max_bytes: int) -> bytes:
        host = self._host(path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(host, arcname=posixpath.basename(path.rstrip("/")) or ".")
        if buf.tell() > max_bytes:
            raise PayloadTooLarge(f"{path} packs to more than {max_bytes} bytes")
        return buf.getvalue()


class BwrapRuntime:
    """Sandboxes as bwrap'ed directories under ``base`` (see the module docstring)."""

    def __init__(self, tier: str, base: Path, layers: MemoryLayers) -> None:
        self.tier = tier
        self.base = base
        self.layers = layers
        self.sandboxes: dict[str, _Sandbox] = {}
        self.hub = WatchHub()

    def facts(self) -> RuntimeFacts:
        return RuntimeFacts(available=shutil.which("bwrap") is not None, reason="bubblewrap")

    async def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        self.hub.close()
        for sid in list(self.sandboxes):
            await self.destroy(Handle(sid))

    def _get(self, handle: Handle) -> _Sandbox:
        sb = self.sandboxes.get(handle.id)
        if sb is None:
            raise SandboxStopped(f"sandbox {handle.id} is gone", sandbox_id=handle.id)
        return sb

    async def create(self, spec: SandboxSpec) -> Handle:
        root = self.base / spec.id
        root.mkdir(parents=True)
        for digest in spec.layer_digests:  # snapshots: tar archives of a sandbox's tree
            content = self.layers.content(digest)
            if content:
                with tarfile.open(fileobj=io.BytesIO(content)) as tf:
                    tf.extractall(root, filter="tar")
        for d in ("usr", "etc", "tmp", "home/user", "root", "proc", "dev"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if not (root / link).is_symlink():
                (root / link).symlink_to(f"usr/{link}")
        (root / "etc/passwd").write_text(PASSWD)
        (root / "etc/group").write_text(GROUP)
        os.chown(root / "home/user", 1000, 1000)
        self.sandboxes[spec.id] = _Sandbox(root, dict(spec.env), spec.user, spec.workdir)
        return Handle(spec.id, {"root": str(root)})

    async def destroy(self, handle: Handle) -> None:
        sb = self.sandboxes.pop(handle.id, None)
        if sb is not None:
            for p in list(sb.procs):
                p.kill_tree()
            shutil.rmtree(sb.root, ignore_errors=True)

    async def recover(self, handle: Handle) -> bool:
        return handle.id in self.sandboxes

    async def alive(self, handle: Handle) -> bool:
        return handle.id in self.sandboxes

    async def list_orphans(self, known: set[str]) -> list[str]:
        return [sid for sid in self.sandboxes if sid not in known]

    async def destroy_orphan(self, sandbox_id: str) -> None:
        await self.destroy(Handle(sandbox_id))

    def files(self, handle: Handle) -> HostDirFiles:
        sb = self._get(handle)
        uid, gid, _home = self._uid_gid(sb, sb.user)
        return HostDirFiles(sb.root, self.hub, (uid, gid))

    # --- commands
    def _uid_gid(self, sb: _Sandbox, user: str | None) -> tuple[int, int, str]:
        if user is None:
            return 0, 0, "/root"
        name, _, group = user.partition(":")
        for line in (sb.root / "etc/passwd").read_text().splitlines():
            parts = line.split(":")
            if len(parts) >= 6 and (parts[0] == name or parts[2] == name):
                return int(parts[2]), int(group or parts[3]), parts[5]
        if name.isdigit():
            return int(name), int(group or name), "/"
        raise InvalidRequest(f"unknown user {name!r}")

    async def start_process(
        self,
        handle: Handle,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: PtySize | None = None,
    ) -> FakeProcess:
        sb = self._get(handle)
        uid, gid, home = self._uid_gid(sb, req.user or sb.user)
        cwd = req.cwd or sb.workdir or "/"
        if not (sb.root / HostDirFiles._rel(cwd)).is_dir():
            raise InvalidRequest(f"cwd {cwd} is not a directory")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home}
        env.update(sb.env)
        env.update(req.env)
        if pty is not None:
            env.setdefault("TERM", "xterm")
        argv = ["bwrap", "--bind", str(sb.root), "/", "--ro-bind", "/usr", "/usr"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--chdir", cwd]
        argv += ["--unshare-pid", "--die-with-parent"]
        if uid != 0 or gid != 0:
            argv += ["--unshare-user", "--uid", str(uid), "--gid", str(gid)]
        argv += ["--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--", *req.argv()]
        master: int | None = None
        if pty is not None:
            master, slave = os.openpty()
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", pty.rows, pty.cols, 0, 0))
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
                )
            except BaseException:
                os.close(slave)
                raise
        else:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                process_group=0,
            )
        fp = FakeProcess(proc, master, req.timeout_s, pty_slave=slave if pty is not None else None)
        sb.procs.add(fp)
        asyncio.get_running_loop().create_task(self._reap(sb, fp))
        return fp

    @staticmethod
    async def _reap(sb: _Sandbox, fp: FakeProcess) -> None:
        await fp._proc.wait()
        fp._watchdog.cancel()
        sb.procs.discard(fp)

    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult:
        data = (req.stdin or "").encode()
        proc = await self.start_process(handle, req, stdin=bool(data))
        if data:
            await proc.write_stdin(data)
        await proc.close_stdin()
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        try:
            while (chunk := await proc.read_output()) is not None:
                name, body = chunk
                out[name].append(body)
                if sink is not None:
                    await sink(name, body)
            result = await proc.wait()
        finally:
            await proc.signal(signal.SIGKILL)
        # the sink saw it all; the result keeps max_output_bytes of each stream, flagged
        cap = req.max_output_bytes
        stdout, stderr = b"".join(out["stdout"]), b"".join(out["stderr"])
        result.stdout = stdout[:cap].decode("utf-8", "replace")
        result.stderr = stderr[:cap].decode("utf-8", "replace")
        result.stdout_truncated, result.stderr_truncated = len(stdout) > cap, len(stderr) > cap
        return result

    # --- pause: the processes stop, the tree stays
    async def pause(self, handle: Handle) -> dict[str, Any]:
        for p in list(self._get(handle).procs):
            p.kill_tree(signal.SIGSTOP)
        return {"method": "sigstop"}

    async def resume(self, handle: Handle) -> None:
        for p in list(self._get(handle).procs):
            p.kill_tree(signal.SIGCONT)

    # --- snapshots: a tar of the sandbox's own tree
    async def snapshot(
        self, handle: Handle, store: Any, req: SnapshotRequest, meta: dict[str, Any]
    ) -> LayerInfo:
        sb = self._get(handle)
        fd, tmp = tempfile.mkstemp(dir=self.layers.scratch, suffix=".tar")
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tf:
            for entry in sorted(sb.root.iterdir()):
                if entry.name not in _HOST_DIRS:
                    tf.add(entry, arcname=entry.name)
        return self.layers.import_layer_file(Path(tmp), "workspace", name=req.name, meta=meta)
