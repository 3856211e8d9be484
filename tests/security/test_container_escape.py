"""Escape and abuse attempts against the container tier, each one something DSec saw agents
do (or the obvious next step). A static C probe, compiled on the host and copied in with
``files.write`` (the busybox image has no compiler or Python), makes the raw syscalls."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.errors import DsecError, FileNotFound, PathOutsideSandbox
from dsec.layers.mounts import LayerMounts
from dsec.layers.store import LayerStore
from dsec.models import ExecRequest, ExecResult
from dsec.privileged.mount import mount_points
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

PROBE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/sched.h>

static void report(const char *name, long rc) { printf("%s=%d\n", name, rc < 0 ? errno : 0); }

int main(void) {
    /* Refuse to run anywhere but inside a dsec container: the probe makes privileged
     * syscalls that must fail there, but would succeed on a host as root. */
    if (access("/dev/.dsec-init", X_OK) != 0 || getenv("DSEC_PROBE_IN_SANDBOX") == NULL) {
        fprintf(stderr, "probe: not inside a dsec sandbox, refusing to run\n");
        return 2;
    }
    int fd = open("/tmp/probe-target", O_RDWR | O_CREAT, 0600);
    int p[2];
    pipe(p);
    report("XFS_IOC_SWAPEXT", ioctl(fd, 0xC0C0586DUL, 0));
    report("XFS_IOC_SWAPEXT_sext", syscall(SYS_ioctl, fd, 0xFFFFFFFFC0C0586DUL, 0));
    report("FICLONE", ioctl(fd, 0x40049409UL, p[0]));
    report("FICLONERANGE", ioctl(fd, 0x4020940DUL, 0));
    report("FIDEDUPERANGE", ioctl(fd, 0xC0189436UL, 0));
    report("TIOCSTI", ioctl(0, 0x5412UL, "x"));
    report("TIOCLINUX", ioctl(0, 0x541CUL, 0));
    int avail = 0;
    report("FIONREAD_allowed", ioctl(p[0], FIONREAD, &avail));
    report("ptrace_attach", ptrace(PTRACE_ATTACH, 1, 0, 0));
    report("ptrace_traceme", ptrace(PTRACE_TRACEME, 0, 0, 0));
    /* targets that do not exist: EPERM proves the filter, never a mount change */
    report("mount", mount("tmpfs", "/nonexistent-dsec-probe", "tmpfs", 0, 0));
    report("umount", umount2("/nonexistent-dsec-probe", 0));
    report("unshare_user", unshare(CLONE_NEWUSER));
    report("unshare_ns", unshare(CLONE_NEWNS));
    report("clone_newuser", syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0));
    report("clone3", syscall(SYS_clone3, 0, 0));
    report("bpf", syscall(SYS_bpf, 0, 0, 0));
    report("userfaultfd", syscall(SYS_userfaultfd, 0));
    report("keyctl", syscall(SYS_keyctl, 0, 0, 0, 0, 0));
    report("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
    report("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
    report("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0xffff0000UL)); /* invalid flags */
    report("init_module", syscall(SYS_init_module, 0, 0, ""));
    report("open_by_handle_at", syscall(SYS_open_by_handle_at, fd, 0, 0));
    report("setns", setns(fd, 0));
    report("reboot", syscall(SYS_reboot, 0, 0, 0, 0)); /* bad magic: EINVAL if allowed */
    report("swapon", syscall(SYS_swapon, "/nonexistent-dsec-probe", 0));
    /* vsock is not per network namespace: it would reach the VM host's services */
    report("socket_vsock", syscall(SYS_socket, 40, SOCK_STREAM, 0));
    report("socket_vsock_sext", syscall(SYS_socket, 0xFFFFFFFF00000028UL, SOCK_STREAM, 0));
    int sv[2];
    report("socketpair_vsock", syscall(SYS_socketpair, 40, SOCK_STREAM, 0, sv));
    long inet = syscall(SYS_socket, AF_INET, SOCK_STREAM, 0);
    report("socket_inet_allowed", inet);
    return 0;
}
"""

# probe result name -> the errno the filter must produce (EPERM unless said otherwise)
EXPECTED = {
    "XFS_IOC_SWAPEXT": 1, "XFS_IOC_SWAPEXT_sext": 1, "FICLONE": 1, "FICLONERANGE": 1,
    "FIDEDUPERANGE": 1, "TIOCSTI": 1, "TIOCLINUX": 1, "FIONREAD_allowed": 0, "ptrace_attach": 1,
    "ptrace_traceme": 1, "mount": 1, "umount": 1, "unshare_user": 1, "unshare_ns": 1,
    "clone_newuser": 1, "clone3": 38, "bpf": 1, "userfaultfd": 1, "keyctl": 1, "perf_event_open": 1,
    "io_uring_setup": 1, "kexec_load": 1, "init_module": 1, "open_by_handle_at": 1, "setns": 1,
    "reboot": 1, "swapon": 1, "socket_vsock": 97, "socket_vsock_sext": 97, "socketpair_vsock": 97,
    "socket_inet_allowed": 0,
}  # fmt: skip


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Paths, list[str], list[str], bytes]]:
    home = Path(f"/tmp/dsec-cs-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    paths = Paths(home)
    paths.ensure()
    store = LayerStore(paths.layers, paths.scratch)
    image = store.ensure_image_sync("busybox")
    src, exe = home / "probe.c", home / "probe"
    src.write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-static", "-o", str(exe), str(src)], check=True)
    yield (
        paths,
        [str(store.layer_path(d)) for d in image.layers],
        list(image.layers),
        exe.read_bytes(),
    )
    store.close()
    mounts = LayerMounts(paths.layer_mounts)
    mounts.adopt_existing()
    mounts.unmount_unused()
    assert not mount_points(home)
    shutil.rmtree(home)


@pytest.fixture
async def box(
    node: tuple[Paths, list[str], list[str], bytes],
) -> AsyncIterator[tuple[ContainerRuntime, Handle]]:
    paths, layer_paths, digests, _ = node
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    await rt.start()
    spec = SandboxSpec(
        id=f"sb-sec-{uuid.uuid4().hex[:10]}", tier="container", layer_paths=layer_paths,
        layer_digests=digests, cpu=1, memory_mb=128, disk_mb=32, pids=128, env={}, user=None, workdir="/",
    )  # fmt: skip
    h = await rt.create(spec)
    yield rt, h
    await rt.destroy(h)
    await rt.close()


async def run(rt: ContainerRuntime, h: Handle, cmd: str | list[str], **kw: object) -> ExecResult:
    return await rt.exec(h, ExecRequest(cmd=cmd, **kw))


def _sha256_of(path: str) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _parse(stdout: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split("=") for line in stdout.splitlines())}


async def test_seccomp_probe_as_root_and_user(
    box: tuple[ContainerRuntime, Handle], node: tuple[Paths, list[str], list[str], bytes]
) -> None:
    rt, h = box
    await rt.files(h).write("/tmp/probe", node[3], mode=0o755)
    for user in ("root", "sandbox"):
        r = await run(rt, h, ["/tmp/probe"], user=user, env={"DSEC_PROBE_IN_SANDBOX": "1"})
        assert r.exit_code == 0, r
        assert _parse(r.stdout) == EXPECTED, user
    # the container's own PID 1 runs under the OCI runtime's rendering of the same policy
    r = await run(rt, h, "grep -E '^(Seccomp|NoNewPrivs|CapBnd)' /proc/1/status /proc/self/status")
    lines = r.stdout.splitlines()
    assert "/proc/1/status:Seccomp:\t2" in lines and "/proc/self/status:Seccomp:\t2" in lines
    assert "/proc/1/status:NoNewPrivs:\t1" in lines
    bnd = {line.split(":")[0]: line.split("\t")[-1] for line in lines if "CapBnd" in line}
    assert bnd["/proc/1/status"] == bnd["/proc/self/status"]  # same capability set


async def test_kernel_pages_and_core_unreadable(box: tuple[ContainerRuntime, Handle]) -> None:
    rt, h = box
    r = await run(
        rt,
        h,
        "for f in /proc/kpagecgroup /proc/kpageflags /proc/kpagecount /proc/kcore /proc/keys /proc/timer_list /proc/sched_debug; do head -c 16 $f 2>/dev/null | wc -c; done",
    )
    assert set(r.stdout.split()) == {"0"}, r
    r = await run(rt, h, "grep -r x /proc/kpagecgroup /sys/firmware 2>&1 | head -c 200; echo rc=$?")
    assert "rc=" in r.stdout  # the DSec crash: nothing to read, no crash
    r = await run(
        rt, h, "echo 1 > /proc/sys/kernel/sysrq; echo c > /proc/sysrq-trigger; touch /sys/x"
    )
    assert r.exit_code != 0 and "Read-only" in r.stderr
    assert (await run(rt, h, "echo alive")).stdout == "alive\n"


async def test_mount_and_ptrace_fail_from_the_shell(box: tuple[ContainerRuntime, Handle]) -> None:
    rt, h = box
    r = await run(rt, h, "mount -t tmpfs none /mnt")
    assert r.exit_code != 0
    r = await run(rt, h, "mount -o remount,rw /proc/sys")
    assert r.exit_code != 0
    assert (await run(rt, h, "kill -9 1; sleep 0.2; echo still")).stdout == "still\n"
    assert await rt.alive(h)  # PID 1 ignores signals from inside


async def test_no_memory_writes_into_other_commands(box: tuple[ContainerRuntime, Handle]) -> None:
    """A process one command leaves behind cannot open ``/proc/<pid>/mem`` of a process another
    command started, nor of PID 1 (each command is a Landlock domain of its own:
    docs/design/tenancy.md), as root or as the same user; within one command it still can."""
    rt, h = box
    opens = "if (: 3<>/proc/{pid}/mem) 2>/dev/null; then echo opened; else echo refused; fi"
    for user in ("root", "sandbox"):
        r = await run(rt, h, "sleep 300 >/dev/null 2>&1 & echo $!", user=user)
        pid = int(r.stdout)
        r = await run(rt, h, f"until grep -q '^sleep' /proc/{pid}/cmdline; do sleep 0.01; done")
        for target in (pid, 1):
            r = await run(rt, h, opens.format(pid=target), user=user)
            assert r.stdout == "refused\n", (user, target, r)
        r = await run(rt, h, "sleep 300 & p=$!; " + opens.format(pid="$p") + "; kill $p", user=user)
        assert r.stdout == "opened\n", (user, r)
        await run(rt, h, f"kill {pid}")


async def test_exec_server_is_invisible(box: tuple[ContainerRuntime, Handle]) -> None:
    rt, h = box
    server = rt._live[h.id].server
    assert server is not None and server.alive
    r = await run(rt, h, "cat /proc/[0-9]*/comm; echo; ls /proc/self/fd")
    assert "dsec-execd" not in r.stdout and "dsec_execd" not in r.stdout
    fds = set(r.stdout.split("\n\n")[-1].split())
    assert fds <= {"0", "1", "2", "3"}, fds  # no socket or other edge fd leaks in
    r = await run(
        rt,
        h,
        f"kill -0 {server.pid} 2>&1; ls /proc/{server.pid}/comm 2>&1 && cat /proc/{server.pid}/comm",
    )
    assert "dsec-execd" not in r.stdout
    r = await run(rt, h, "ls -l /proc/1/fd 2>&1 | grep -c socket")
    assert r.stdout.strip() == "0"


async def test_layers_stay_read_only(
    box: tuple[ContainerRuntime, Handle], node: tuple[Paths, list[str], list[str], bytes]
) -> None:
    rt, h = box
    _, layer_paths, digests, _ = node
    r = await run(
        rt,
        h,
        "echo evil > /bin/evil; echo 'x:x:0:0::/:/bin/sh' >> /etc/passwd; rm /bin/ls; echo ok",
    )
    assert r.stdout == "ok\n"
    lower = rt.layer_mounts.mounted()[digests[0]]
    assert not (lower / "bin/evil").exists() and (lower / "bin/ls").is_symlink()
    assert "x:x:0:0" not in (lower / "etc/passwd").read_text()
    assert _sha256_of(layer_paths[0]) == digests[0]  # the EROFS file itself is unchanged
    # a non-root user cannot even write to the sandbox's own /bin
    r = await run(rt, h, "echo x > /bin/busybox; touch /bin/new", user="sandbox")
    assert r.exit_code != 0 and "Permission denied" in r.stderr


async def test_file_api_confined_to_rootfs(
    box: tuple[ContainerRuntime, Handle], tmp_path: Path
) -> None:
    rt, h = box
    files = rt.files(h)
    marker = tmp_path / "host-secret"
    marker.write_text("HOST")
    for bad in ("/../../../../etc/passwd", "/tmp/../../" + str(marker).lstrip("/")):
        with pytest.raises(PathOutsideSandbox):
            await files.read(bad, 1 << 20)
    # links planted from inside, absolute and relative, towards the host file and /proc magic
    await run(
        rt,
        h,
        f"ln -s {marker} /tmp/abs; ln -s ../../../../../../..{marker} /tmp/rel; ln -s /proc/self/root/etc/hostname /tmp/magic; ln -s {marker.parent} /tmp/dir",
    )
    for link in ("/tmp/abs", "/tmp/rel", "/tmp/magic", "/tmp/dir/host-secret"):
        with pytest.raises(DsecError) as exc:
            data = await files.read(link, 1 << 20)
            assert data != b"HOST"
            raise AssertionError("read through a planted link succeeded")
        assert "HOST" not in str(exc.value)
    with pytest.raises(FileNotFound):
        await files.write("/tmp/dir/host-secret", b"pwned")
    assert marker.read_text() == "HOST"
