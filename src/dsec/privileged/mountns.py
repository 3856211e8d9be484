"""The node's own mount namespace: every sandbox mount out of the host's table, and nothing
propagating back to the host.

Why. systemd makes ``/`` (and ``/dev``, ``/sys``, ``/run``) *shared* mounts; a bare container
host has them private. On a shared host, a bind mount made from a host mount joins the host
mount's peer group: crun binds ``/dev/null`` over a container's masked ``/proc`` files from a
file opened in the node's namespace, so each mask is a peer of the host's ``/dev``, and its
read-only rebind of ``/proc/sysrq-trigger`` (mounted on top of a mask) propagates to every
peer: the host's ``/dev/null`` and every other container's masks. The mount table doubled
with each container (measured on Debian 12 guests: 46 mounts before, 544 after five
containers, then ``mount(2)``: ENOSPC at ``fs.mount-max`` for every new container, and a
``/proc/self/mountinfo`` that took minutes to read). Besides, every sandbox's overlay and
upper in the host's table makes systemd (which rereads the table at each change) and every
new mount namespace pay for all of them.

What. ``dsec serve`` moves itself, before it starts a thread, into a new mount namespace
whose mounts are *slaves* of the host's (:func:`enter_node_namespace`): host mounts made later
still appear in it, but nothing mounted in it (or in a container made from it) reaches the
host. The namespace is pinned by a bind mount of its ``/proc/<pid>/ns/mnt`` at
``$DSEC_HOME/run/mntns/ns`` in the host's namespace (on a private bind mount of that
directory, as ``unshare --mount=FILE`` needs), so that a ``dsec serve`` restarted after a
crash joins it and finds its sandboxes' mounts (an edge restart recovers live sandboxes).
At a clean exit with no sandbox left, :meth:`NodeMountNamespace.release` unpins it, and it
disappears with the process: no mount of the node survives it.

Pinning a namespace (a bind mount of its nsfs file) is refused with EINVAL when the kernel
cannot rule out a loop: ``mnt_ns_loop`` requires the pinned namespace's id to be greater than
the id of the namespace the bind is made in. Linux 6.18 hands mount namespace ids out of
per-CPU batches, so a namespace made later on another CPU can have the smaller id (seen here
in about one pin of three). :func:`pin_attempts` gives the CPUs to make the namespace on, one
after another, until the pin takes: on the CPU that made the binder's namespace the ids only
grow, so one of them does.

``DSEC_MOUNT_NAMESPACE=host`` keeps the host's namespace (embedders, debugging with plain
``mount``); an in-process node (tests, Ray's edge actors) runs in its process's namespace, as
this cannot be changed once threads run. ``nsenter -t <pid of dsec serve> -m`` shows the
node's mounts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec.privileged.mount import (
    MNT_DETACH,
    MS_BIND,
    MS_PRIVATE,
    MS_REC,
    MS_SLAVE,
    _unescape,
    mount,
    umount,
)

__all__ = [
    "MOUNT_NAMESPACE_ENV",
    "NodeMountNamespace",
    "current",
    "enter_node_namespace",
    "pin_attempts",
    "root_propagation",
]

log = logging.getLogger(__name__)

MOUNT_NAMESPACE_ENV = "DSEC_MOUNT_NAMESPACE"
"""``own`` (default for ``dsec serve``) or ``host``."""

CLONE_NEWNS = 0x00020000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


@dataclass
class NodeMountNamespace:
    """Where this process's node mounts live. ``own``: in dsec's namespace (``joined``: one
    a crashed ``dsec serve`` left pinned); otherwise ``reason`` says why the host's."""

    own: bool
    reason: str
    pin: Path | None = None
    joined: bool = False
    host_fd: int = -1

    def describe(self) -> str:
        """One line for ``dsec doctor`` and the node's host report."""
        if not self.own:
            return f"the host's ({self.reason})"
        how = "rejoined after a restart" if self.joined else "new"
        if self.pin is None and self.reason:
            how += f", {self.reason}"
        return f"dsec's own ({how}; host mounts are seen as slaves, nothing propagates back)"

    def release(self) -> None:
        """Unpin the namespace (a clean exit with no sandbox left): it ends with this process,
        and every mount in it with it. Idempotent; never raises. The unmounts run in a child
        that joins the host's namespace (``nsenter``: this process has threads by now)."""
        import subprocess

        if not self.own or self.pin is None or self.host_fd < 0:
            return
        pin, self.pin = self.pin, None
        host = f"/proc/{os.getpid()}/fd/{self.host_fd}"
        try:
            proc = subprocess.run(
                ["nsenter", f"--mount={host}", "--", "umount", "--lazy", str(pin), str(pin.parent)],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if proc.returncode != 0:
                log.warning("cannot unpin the node's mount namespace at %s: %s", pin, proc.stderr)
            pin.unlink(missing_ok=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("cannot unpin the node's mount namespace at %s: %s", pin, e)
        finally:
            os.close(self.host_fd)
            self.host_fd = -1


_current = NodeMountNamespace(own=False, reason="not entered (an in-process node)")


def current() -> NodeMountNamespace:
    """What :func:`enter_node_namespace` did in this process (or that it was not called)."""
    return _current


def root_propagation(mountinfo: str = "/proc/self/mountinfo") -> str:
    """``shared``, ``slave`` or ``private``: the propagation of ``/`` in a mount namespace
    (systemd hosts: shared)."""
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split(" - ")[0].split()
                if len(fields) >= 5 and fields[4] == "/":
                    tags = fields[6:]
                    if any(t.startswith("shared:") for t in tags):
                        return "shared"
                    if any(t.startswith("master:") for t in tags):
                        return "slave"
                    return "private"
    except OSError:
        pass
    return "unknown"


def _is_mount_point(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(_unescape(line.split(" ", 5)[4]) == target for line in f)


def _pinned_namespace(pin: Path) -> int | None:
    """An fd of the mount namespace pinned at ``pin``, if one is (else None)."""
    try:
        fd = os.open(pin, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # a pinned namespace file is on nsfs; a leftover plain file (after a reboot) is not
        if os.fstat(fd).st_dev != os.stat("/proc/self/ns/mnt").st_dev or not _is_mount_point(pin):
            raise OSError(errno.EINVAL, f"{pin} is not a pinned namespace")
        return fd
    except OSError:
        os.close(fd)
        return None


def pin_attempts() -> list[int | None]:
    """The CPUs to make a namespace on, in turn, while its pin is refused with EINVAL (see
    the module's doc): first wherever the scheduler runs the process (None), then each CPU
    the process may use."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except OSError:
        cpus = []
    return [None, *cpus]


@contextlib.contextmanager
def _on_cpu(cpu: int | None) -> Iterator[None]:
    """Run this (single-threaded) process on ``cpu`` only, for the ``with`` block."""
    if cpu is None:
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _private_dir(path: Path) -> bool:
    """``path`` as a private bind mount of itself (in this namespace): a pin below it is
    neither propagated into the namespace it pins (the kernel refuses such a loop) nor into
    any other. True if it made the bind mount (it was not one)."""
    path.mkdir(parents=True, exist_ok=True)
    made = not _is_mount_point(path)
    if made:
        mount(path, path, None, MS_BIND)
    mount("none", path, None, MS_PRIVATE)
    return made


def _in_host(host_fd: int, fn: object) -> None:
    """Run ``fn`` in a child process that has joined the host's mount namespace (a process
    with threads cannot change its own). Raises OSError with the child's errno."""
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            _check(_libc.setns(host_fd, CLONE_NEWNS), "setns(host mount namespace)")
            fn()  # type: ignore[operator]
        except OSError as e:
            os.write(w, f"{e.errno or 0} {e}".encode()[:4000])
            code = 1
        except BaseException:
            os.write(w, f"0 {traceback.format_exc()[-2000:]}".encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        num, _, text = message.partition(" ")
        raise OSError(int(num) if num.isdigit() else 0, text or "the helper process failed")


def enter_node_namespace(run_dir: Path) -> NodeMountNamespace:
    """Move this process into the node's own mount namespace (see the module's doc): rejoin
    the one pinned under ``run_dir`` if a previous ``dsec serve`` left it, else make one and
    pin it. Call it before any thread starts; when it cannot (not root, threads running,
    ``DSEC_MOUNT_NAMESPACE=host``, a kernel refusal) the process stays in the host's
    namespace, and the returned value (also :func:`current`) says why. Never raises."""
    global _current
    mode = os.environ.get(MOUNT_NAMESPACE_ENV, "own").strip().lower() or "own"
    if mode not in ("own", "host"):
        log.warning("%s=%r: expected own or host; using own", MOUNT_NAMESPACE_ENV, mode)
        mode = "own"
    if mode == "host":
        _current = NodeMountNamespace(False, f"{MOUNT_NAMESPACE_ENV}=host")
        return _current
    if os.geteuid() != 0:
        _current = NodeMountNamespace(False, "not root")
        return _current
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        _current = NodeMountNamespace(False, f"{threads} threads were running")
        log.warning("the node stays in the host's mount namespace: %s", _current.reason)
        return _current
    pin = run_dir / "mntns" / "ns"
    host_fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    made_private = False
    try:
        pinned = _pinned_namespace(pin)
        if pinned is not None:
            cwd = os.getcwd()
            try:
                _check(_libc.setns(pinned, CLONE_NEWNS), "setns(pinned mount namespace)")
            finally:
                os.close(pinned)
            with contextlib.suppress(OSError):  # setns(CLONE_NEWNS) moved it to the root
                os.chdir(cwd)
            _current = NodeMountNamespace(True, "", pin, joined=True, host_fd=host_fd)
            log.info("joined the node's mount namespace pinned at %s", pin)
            return _current
        made_private = _private_dir(pin.parent)
        pin.touch()
        me = os.getpid()
        refused: OSError | None = None
        for cpu in pin_attempts():
            if refused is not None:  # back to the host's, to make another namespace
                _check(_libc.setns(host_fd, CLONE_NEWNS), "setns(host mount namespace)")
            with _on_cpu(cpu):  # the new namespace's id comes from this CPU's batch
                _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            mount("none", "/", None, MS_REC | MS_SLAVE)
            try:
                _in_host(host_fd, lambda: mount(f"/proc/{me}/ns/mnt", pin, None, MS_BIND))
                refused = None
                break
            except OSError as e:
                refused = e
                if e.errno != errno.EINVAL:
                    break
        if refused is not None:
            # refused on every CPU, or for another reason: the node keeps its own namespace,
            # unpinned (it ends with this process, a restarted server makes a new one)
            # rather than putting every sandbox mount in the host's table
            if made_private:
                with contextlib.suppress(OSError):
                    _in_host(host_fd, lambda: umount(pin.parent, MNT_DETACH))
            with contextlib.suppress(OSError):
                pin.unlink()
            _current = NodeMountNamespace(
                True,
                f"not pinned ({refused}): a restarted dsec serve cannot rejoin it",
                None,
                host_fd=host_fd,
            )
            log.warning("the node's own mount namespace is %s", _current.reason)
            return _current
    except OSError as e:
        _current = NodeMountNamespace(False, f"cannot make one: {e}")
        log.warning("the node stays in the host's mount namespace: %s", _current.reason)
        with_host = os.readlink("/proc/self/ns/mnt") == os.readlink(f"/proc/self/fd/{host_fd}")
        if not with_host:  # unshared but not pinned: go back, nothing is mounted here yet
            _libc.setns(host_fd, CLONE_NEWNS)
        if made_private:  # leave the host's table as it was
            with contextlib.suppress(OSError):
                umount(pin.parent, MNT_DETACH)
        os.close(host_fd)
        return _current
    _current = NodeMountNamespace(True, "", pin, host_fd=host_fd)
    return _current
