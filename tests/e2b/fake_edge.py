"""An in-memory ``EdgeAPI`` (+ ``InteractiveExec``) that really runs commands.

Each fake sandbox is a directory used as the root filesystem of ``bwrap``
(bubblewrap): the host's ``/usr`` is bound read-only, ``/bin``, ``/lib`` ...
are symlinks into it (Debian's merged-/usr layout), ``/etc/passwd`` knows
``root`` and ``user`` (uid 1000), and everything else (``/home``, ``/tmp``,
files written through the API) lives in the directory. So paths seen by
commands and by the file API agree, exit codes, stdin, signals and timeouts are
real, and nothing touches the host outside the directory. Requires ``bwrap``.

It is a test double, not an isolation boundary: no cgroups, no network
namespace, no quota. Ownership, states and error types follow ``EdgeAPI``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import os
import posixpath
import secrets
import shutil
import signal
import stat as stat_mod
import struct
import tarfile
import termios
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from dsec.e2b.interactive import OutputChunk, PtySize
from dsec.errors import (
    CapabilityNotSupported,
    FileExists_,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    PayloadTooLarge,
    SandboxNotFound,
    SandboxStopped,
)
from dsec.models import (
    BuildImageRequest,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ForkRequest,
    ForkResult,
    ImageInfo,
    JobAction,
    JobActionResult,
    LayerInfo,
    NodeInfo,
    SandboxInfo,
    SnapshotRequest,
)

MAX_READ_BYTES = 8 << 20
"""Largest file ``read_file`` returns, bytes (bigger: PayloadTooLarge)."""

PASSWD = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
GROUP = "root:x:0:\nuser:x:1000:\n"


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _Sandbox:
    info: SandboxInfo
    owner: str
    root: Path
    env: dict[str, str]
    procs: set[FakeProcess] = field(default_factory=set)


class FakeProcess:
    """An ``InteractiveProcess`` backed by a bwrap'ed subprocess."""

    def __init__(
        self, proc: asyncio.subprocess.Process, pty_master: int | None, timeout_s: float
    ) -> None:
        self._proc = proc
        self._master = pty_master
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
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    chunk = await loop.run_in_executor(None, os.read, fd, 65536)
                except OSError:  # EIO once the last slave fd closes
                    break
                if not chunk:
                    break
                await self._queue.put(("pty", chunk))
        finally:
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


class FakeEdge:
    """``EdgeAPI`` + ``InteractiveExec`` over bwrap'ed directories under ``base``."""

    images = ("debian", "busybox")

    def __init__(self, base: Path) -> None:
        self.base = base
        self.sandboxes: dict[str, _Sandbox] = {}
        self.snapshots: dict[str, Path] = {}
        """Image name -> copy of a sandbox's tree (what snapshot_sandbox made)."""
        self.calls: list[str] = []

    # --- helpers ------------------------------------------------------------
    def _get(self, sandbox_id: str, owner: str) -> _Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.owner != owner:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found")
        if sb.info.state == "running" and sb.info.expires_at and sb.info.expires_at <= _now():
            if sb.info.on_timeout == "pause":
                self._pause(sb)
            else:
                self._stop(sb, "ttl")
        return sb

    def _running(self, sandbox_id: str, owner: str) -> _Sandbox:
        """The sandbox, resumed if it was paused (any request resumes a paused sandbox)."""
        sb = self._get(sandbox_id, owner)
        if sb.info.state == "stopped":
            raise SandboxStopped(f"sandbox {sandbox_id} is stopped")
        if sb.info.state == "paused":
            self._resume(sb)
        return sb

    def _pause(self, sb: _Sandbox) -> None:
        for p in list(sb.procs):
            p.kill_tree(signal.SIGSTOP)
        sb.info.state = "paused"
        sb.info.paused_at = sb.info.updated_at = _now()

    def _resume(self, sb: _Sandbox) -> None:
        for p in list(sb.procs):
            p.kill_tree(signal.SIGCONT)
        sb.info.state = "running"
        sb.info.paused_at = None
        sb.info.updated_at = _now()
        if sb.info.ttl_s:
            sb.info.expires_at = _now() + timedelta(seconds=sb.info.ttl_s)

    def _stop(self, sb: _Sandbox, reason: str) -> None:
        for p in list(sb.procs):
            p.kill_tree()
        sb.info.state = "stopped"
        sb.info.stopped_reason = reason
        sb.info.updated_at = _now()
        shutil.rmtree(sb.root, ignore_errors=True)

    @staticmethod
    def _rel(path: str) -> str:
        if not path.startswith("/") or "\0" in path:
            raise InvalidRequest(f"path must be absolute: {path!r}")
        return posixpath.normpath(path).lstrip("/")

    def _host(self, sb: _Sandbox, path: str) -> Path:
        rel = self._rel(path)
        if rel.split("/", 1)[0] in ("usr", "proc", "dev"):
            raise InvalidRequest(f"{path} is outside the fake sandbox's writable tree")
        return sb.root / rel if rel not in ("", ".") else sb.root

    def _info(self, sb: _Sandbox, host: Path, sandbox_path: str) -> FileInfo:
        try:
            st = host.lstat()
        except FileNotFoundError:
            raise FileNotFound(f"{sandbox_path} does not exist") from None
        if stat_mod.S_ISLNK(st.st_mode):
            kind, target = "symlink", os.readlink(host)
        elif stat_mod.S_ISDIR(st.st_mode):
            kind, target = "dir", None
        elif stat_mod.S_ISREG(st.st_mode):
            kind, target = "file", None
        else:
            kind, target = "other", None
        name = posixpath.basename(sandbox_path.rstrip("/")) or "/"
        return FileInfo(
            path=sandbox_path,
            name=name,
            type=kind,
            size=st.st_size,
            mode=stat_mod.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            uid=st.st_uid,
            gid=st.st_gid,
            target=target,
        )

    # --- sandboxes ------------------------------------------------------------
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        self.calls.append("create_sandbox")
        snapshot = self.snapshots.get(req.image)
        if req.image not in self.images and snapshot is None:
            raise ImageNotFound(f"no image named {req.image!r}")
        sandbox_id = "sb-fake-" + secrets.token_hex(6)
        root = self.base / sandbox_id
        if snapshot is not None:
            shutil.copytree(snapshot, root, symlinks=True)
        for d in ("usr", "etc", "tmp", "home/user", "root", "proc", "dev"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if not (root / link).is_symlink():
                (root / link).symlink_to(f"usr/{link}")
        (root / "etc/passwd").write_text(PASSWD)
        (root / "etc/group").write_text(GROUP)
        os.chown(root / "home/user", 1000, 1000)
        now = _now()
        info = SandboxInfo(
            id=sandbox_id,
            tier=req.tier,
            image=req.image,
            state="running",
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            disk_mb=req.disk_mb,
            labels=dict(req.labels),
            user=req.user,
            workdir=req.workdir,
            node="fake",
            created_at=now,
            updated_at=now,
            expires_at=now + timedelta(seconds=req.ttl_s) if req.ttl_s else None,
            ttl_s=req.ttl_s,
            on_timeout=req.on_timeout,
        )
        self.sandboxes[sandbox_id] = _Sandbox(info=info, owner=owner, root=root, env=dict(req.env))
        return info.model_copy()

    async def get_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        return self._get(sandbox_id, owner).info.model_copy()

    async def list_sandboxes(
        self,
        owner: str,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> list[SandboxInfo]:
        out = []
        for sid, sb in self.sandboxes.items():
            if sb.owner != owner:
                continue
            info = self._get(sid, owner).info
            if info.state == "stopped" and not include_stopped:
                continue
            if state is not None and info.state != state:
                continue
            if labels and any(info.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(info.model_copy())
        return out

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self.calls.append("kill_sandbox")
        sb = self._get(sandbox_id, owner)
        if sb.info.state != "stopped":
            self._stop(sb, "killed")
        return sb.info.model_copy()

    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo:
        if not 0 < ttl_s <= 30 * 24 * 3600:  # as EdgeAgent.set_ttl
            raise InvalidRequest(f"ttl_s={ttl_s!r} must be > 0 and <= 30 days")
        sb = self._running(sandbox_id, owner)
        sb.info.ttl_s = ttl_s
        sb.info.expires_at = _now() + timedelta(seconds=ttl_s)
        return sb.info.model_copy()

    # --- exec -------------------------------------------------------------------
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
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: PtySize | None = None,
    ) -> FakeProcess:
        self.calls.append("start_process")
        sb = self._running(sandbox_id, owner)
        uid, gid, home = self._uid_gid(sb, req.user or sb.info.user)
        cwd = req.cwd or sb.info.workdir or "/"
        if not (sb.root / self._rel(cwd)).is_dir():
            raise InvalidRequest(f"cwd {cwd} is not a directory")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home}
        env.update(sb.env)
        env.update(req.env)
        if pty is not None:
            env.setdefault("TERM", "xterm")
        argv = ["bwrap", "--bind", str(sb.root), "/", "--ro-bind", "/usr", "/usr"]
        argv += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--chdir",
            cwd,
            "--unshare-pid",
            "--die-with-parent",
        ]
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
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
            )
            os.close(slave)
        else:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                process_group=0,
            )
        fp = FakeProcess(proc, master, req.timeout_s)
        sb.procs.add(fp)
        asyncio.get_running_loop().create_task(self._reap(sb, fp))
        return fp

    @staticmethod
    async def _reap(sb: _Sandbox, fp: FakeProcess) -> None:
        await fp._proc.wait()
        fp._watchdog.cancel()
        sb.procs.discard(fp)

    async def exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> ExecResult:
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        result = ExecResult()
        async for ev in self.exec_stream(sandbox_id, owner, req):
            if ev.type in out and ev.data:
                out[ev.type].append(ev.data)
            elif ev.type == "exit" and ev.result is not None:
                result = ev.result
        result.stdout = "".join(out["stdout"])
        result.stderr = "".join(out["stderr"])
        return result

    async def exec_stream(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> AsyncIterator[ExecEvent]:
        self.calls.append("exec_stream")
        stdin = (req.stdin or "").encode()
        proc = await self.start_process(sandbox_id, owner, req, stdin=bool(stdin))
        if stdin:
            await proc.write_stdin(stdin)
        await proc.close_stdin()
        try:
            while (chunk := await proc.read_output()) is not None:
                yield ExecEvent(type=chunk[0], data=chunk[1].decode("utf-8", "replace"))
            yield ExecEvent(type="exit", result=await proc.wait())
        finally:
            await proc.signal(signal.SIGKILL)

    # --- files ------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, owner: str, path: str) -> bytes:
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        info = self._info(sb, host, path)
        if info.type == "dir":
            raise InvalidRequest(f"{path} is a directory")
        if info.size > MAX_READ_BYTES:
            raise PayloadTooLarge(f"{path} is larger than {MAX_READ_BYTES} bytes")
        return host.read_bytes()

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
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        if host.is_dir():
            raise InvalidRequest(f"{path} is a directory")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
        host.chmod(mode)
        return self._info(sb, host, path)

    async def list_files(
        self, sandbox_id: str, owner: str, path: str, depth: int = 1
    ) -> list[FileInfo]:
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        if self._info(sb, host, path).type != "dir":
            raise InvalidRequest(f"{path} is not a directory")
        out: list[FileInfo] = []

        def walk(h: Path, p: str, level: int) -> None:
            for child in sorted(h.iterdir()):
                cp = posixpath.join(p, child.name)
                info = self._info(sb, child, cp)
                out.append(info)
                if info.type == "dir" and level < depth:
                    walk(child, cp, level + 1)

        walk(host, path.rstrip("/") or "/", 1)
        return out

    async def stat_file(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        sb = self._running(sandbox_id, owner)
        return self._info(sb, self._host(sb, path), path)

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
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        info = self._info(sb, host, path)
        if info.type == "dir":
            if not recursive and any(host.iterdir()):
                raise InvalidRequest(f"{path} is a non-empty directory")
            shutil.rmtree(host)
        else:
            host.unlink()

    async def make_dir(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        if host.exists() and not host.is_dir():
            raise FileExists_(f"{path} exists and is not a directory")
        host.mkdir(parents=True, exist_ok=True)
        return self._info(sb, host, path)

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
        sb = self._running(sandbox_id, owner)
        hsrc, hdst = self._host(sb, src), self._host(sb, dst)
        self._info(sb, hsrc, src)
        hdst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(hsrc, hdst)
        return self._info(sb, hdst, dst)

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
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        host.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = tf.getmembers()
            tf.extractall(host, filter="data")
        return len(members)

    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
        sb = self._running(sandbox_id, owner)
        host = self._host(sb, path)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(host, arcname=posixpath.basename(path.rstrip("/")) or ".")
        return buf.getvalue()

    # --- RL lifecycle -------------------------------------------------------------
    async def pause_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        sb = self._get(sandbox_id, owner)
        if sb.info.state == "stopped":
            raise SandboxStopped(f"sandbox {sandbox_id} is stopped")
        if sb.info.state == "running":
            self._pause(sb)
        return sb.info.model_copy()

    async def resume_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        return self._running(sandbox_id, owner).info.model_copy()

    def _copy_tree(self, sb: _Sandbox, name: str) -> Path:
        dest = self.base / "snapshots" / name
        if dest.exists() or name in self.images:
            raise FileExists_(f"an image named {name!r} exists")
        shutil.copytree(sb.root, dest, symlinks=True)
        self.snapshots[name] = dest
        return dest

    async def snapshot_sandbox(
        self,
        sandbox_id: str,
        owner: str,
        req: SnapshotRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> LayerInfo:
        sb = self._running(sandbox_id, owner)
        name = req.name or "snap-" + secrets.token_hex(6)
        self._copy_tree(sb, name)
        return LayerInfo(
            digest="sha256:" + secrets.token_hex(32),
            kind="workspace",
            name=name,
            size=0,
            created_at=_now(),
        )

    async def fork_sandbox(self, sandbox_id: str, owner: str, req: ForkRequest) -> ForkResult:
        sb = self._running(sandbox_id, owner)
        layer = await self.snapshot_sandbox(sandbox_id, owner, SnapshotRequest())
        children = []
        for _ in range(req.n):
            child = CreateSandboxRequest(
                tier=sb.info.tier,
                image=str(layer.name),
                env=sb.env,
                labels=req.labels or sb.info.labels,
                ttl_s=sb.info.ttl_s,
                user=sb.info.user,
                workdir=sb.info.workdir,
            )
            children.append(await self.create_sandbox(child, owner))
        return ForkResult(layer=layer, sandboxes=children)

    async def job_action(self, owner: str, job: str, action: JobAction) -> JobActionResult:
        raise CapabilityNotSupported("the fake edge has no jobs")

    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        raise CapabilityNotSupported("the fake edge keeps no trajectory")

    # --- images, node -------------------------------------------------------------
    async def list_images(self, owner: str) -> list[ImageInfo]:
        return [ImageInfo(name=n, layers=[], size=0, created_at=_now()) for n in self.images]

    async def get_image(self, name: str, owner: str) -> ImageInfo:
        if name not in self.images:
            raise ImageNotFound(name)
        return ImageInfo(name=name, layers=[], size=0, created_at=_now())

    async def delete_image(self, name: str, owner: str) -> None:
        raise CapabilityNotSupported("the fake edge cannot remove images")

    async def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        raise CapabilityNotSupported("the fake edge cannot share images")

    async def list_layers(self, owner: str) -> list[LayerInfo]:
        return []

    async def pull_image(self, ref: str, owner: str, name: str | None = None) -> ImageInfo:
        raise CapabilityNotSupported("the fake edge cannot pull images")

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        raise CapabilityNotSupported("the fake edge cannot build images")

    async def node_info(self) -> NodeInfo:
        return NodeInfo(
            node="fake",
            version="0",
            tiers=await self.capabilities(),
            sandboxes=len(self.sandboxes),
            cpus=1,
            memory_mb=1,
        )

    async def capabilities(self) -> list[Capabilities]:
        return [Capabilities(tier="container", available=True, tty=True)]

    def metrics_text(self) -> bytes:
        return b""

    async def stats(self) -> dict[str, Any]:
        return {"sandboxes": len(self.sandboxes)}

    async def close(self) -> None:
        """Kill everything (test teardown)."""
        for sb in self.sandboxes.values():
            if sb.info.state != "stopped":
                self._stop(sb, "closed")
