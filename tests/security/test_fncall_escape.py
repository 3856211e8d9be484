"""Escape attempts from fncall workers: each must fail with the errno of the layer that stops it.

EPERM (1) from seccomp or missing capabilities, EACCES (13) from permissions or Landlock
(``mknod`` in the writable ``/work``: Landlock never grants MAKE_CHAR), EROFS (30) from the read-only
root, EAFNOSUPPORT (97) for socket families outside the allowlist, ENOSYS (38) for clone3.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.contract.runtime import SandboxSpec
from dsec.errors import DsecError, PathOutsideSandbox
from dsec.models import ExecRequest
from dsec.privileged import landlock
from dsec.runtimes.fncall import seccomp
from dsec.runtimes.fncall.pool import PoolConfig
from dsec.runtimes.fncall.service import RunCodeRequest, RunCodeService
from dsec.runtimes.fncall.testkit import fncall_service, worker_spec

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def svc(dsec_home_root: Path) -> AsyncIterator[RunCodeService]:
    async with fncall_service(
        dsec_home_root / f"fncall-sec-{secrets.token_hex(3)}",
        pool=PoolConfig(min_ready=2, max_ready=4, memory_mb=256, pids=64),
    ) as s:
        yield s


async def probe(svc: RunCodeService, body: str) -> str:
    code = "import ctypes, errno, os, socket, fcntl\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
    code += "def e(rc):\n    return 0 if rc >= 0 else ctypes.get_errno()\n" + body
    resp = await svc.run_code(RunCodeRequest(code=code, language="python"))
    assert resp.run_result is not None, resp
    assert resp.run_result.return_code == 0, resp.run_result.stderr
    return resp.run_result.stdout or ""


pytestmark_async = pytest.mark.asyncio(loop_scope="module")


@pytestmark_async
@pytest.mark.debian
@pytest.mark.parametrize(
    ("name", "body", "expected"),
    [
        ("bpf", "print(e(libc.syscall(321, 0, 0, 0)))", "1"),
        ("keyctl", "print(e(libc.syscall(250, 0, 0, 0, 0, 0)))", "1"),
        (
            "setns",
            "fd = os.open('/proc/self/ns/net', os.O_RDONLY)\nprint(e(libc.setns(fd, 0)))",
            "1",
        ),
        ("clone_newuser", "print(e(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)))", "1"),
        ("clone3", "print(e(libc.syscall(435, 0, 0)))", "38"),
        ("kexec", "print(e(libc.syscall(246, 0, 0, 0, 0)))", "1"),
        ("init_module", "print(e(libc.syscall(175, 0, 0, 0)))", "1"),
        ("io_uring", "print(e(libc.syscall(425, 1, 0)))", "1"),
        ("perf_event_open", "print(e(libc.syscall(298, 0, 0, -1, -1, 0)))", "1"),
        ("tiocsti", "print(e(libc.ioctl(0, 0x5412, b'x')))", "1"),
        (
            "ficlone",
            "a = os.open('/work/a', os.O_CREAT|os.O_RDWR); b = os.open('/work/b', os.O_CREAT|os.O_RDWR)\nprint(e(libc.ioctl(b, 0x40049409, a)))",
            "1",
        ),
        (
            "xfs_swapext",
            "a = os.open('/work/a', os.O_CREAT|os.O_RDWR)\nprint(e(libc.ioctl(a, 0xC0C0586D, 0)))",
            "1",
        ),
        (
            "af_packet",
            "try:\n    socket.socket(17, socket.SOCK_RAW)\n    print('opened')\nexcept OSError as x: print(x.errno)",
            "97",
        ),
        (
            "af_vsock",
            "try:\n    socket.socket(40, socket.SOCK_STREAM)\n    print('opened')\nexcept OSError as x: print(x.errno)",
            "97",
        ),
        (
            "overwrite_bash",
            "try:\n    open('/bin/bash', 'wb')\nexcept OSError as x: print(x.errno)",
            "30",
        ),
        (
            "write_etc",
            "try:\n    open('/etc/evil', 'w')\nexcept OSError as x: print(x.errno)",
            "30",
        ),
        (
            "kpagecgroup",
            "try:\n    open('/proc/kpagecgroup', 'rb').read(8)\nexcept OSError as x: print(x.errno)",
            "13",
        ),
        (
            "sysrq",
            "try:\n    open('/proc/sysrq-trigger', 'w').write('c')\nexcept OSError as x: print(x.errno)",
            "13|2",
        ),
        (
            "agent_mem",
            "try:\n    open('/proc/1/mem', 'rb')\nexcept OSError as x: print(x.errno)",
            "13",
        ),
        (
            "mknod",
            "try:\n    os.mknod('/work/dev', 0o20666, os.makedev(1, 3))\nexcept OSError as x: print(x.errno)",
            "13",
        ),
        ("setuid_root", "print(e(libc.setuid(0)))", "1"),
        ("sethostname", "print(e(libc.sethostname(b'x', 1)))", "1"),
    ],
)
async def test_escape_attempt_fails(
    svc: RunCodeService, name: str, body: str, expected: str
) -> None:
    assert (await probe(svc, body)).strip() in expected.split("|"), name


@pytestmark_async
@pytest.mark.debian
async def test_killing_the_agent_does_not_break_the_call(svc: RunCodeService) -> None:
    out = await probe(
        svc, "import signal\nprint(e(os.kill(1, signal.SIGKILL) or 0))\nprint(os.getpid())"
    )
    assert out.split() == ["0", "2"]  # pid 1 ignores signals from inside its namespace


@pytestmark_async
@pytest.mark.debian
async def test_host_side_files_stay_in_the_worker_root(svc: RunCodeService) -> None:
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    spec = SandboxSpec(
        id="sb-sec-files",
        tier="fncall",
        layer_paths=[str(f) for f in files],
        layer_digests=digests,
        cpu=1,
        memory_mb=128,
        disk_mb=16,
        pids=32,
        env={},
        user=None,
        workdir="/work",
    )
    h = await rt.create(spec)
    try:
        r = await rt.exec(
            h,
            ExecRequest(
                cmd="ln -s /../../../../etc/hostname /work/abs; ln -s /proc/1/root/etc /work/magic; echo done"
            ),
        )
        assert r.stdout == "done\n", r
        f = rt.files(h)
        # resolves inside the worker: the image's /etc/hostname, never the host's
        host = await asyncio.to_thread(Path("/etc/hostname").read_bytes)
        try:
            got = await f.read("/work/abs", 4096)
            assert got != host or host == b""
        except Exception:
            pass
        with pytest.raises(DsecError):  # a /proc magic link is refused
            await f.read("/work/magic/hostname", 4096)
        with pytest.raises(PathOutsideSandbox):
            await f.read("/../../etc/shadow", 4096)
    finally:
        await rt.destroy(h)


@pytestmark_async
@pytest.mark.debian
async def test_no_memory_writes_into_other_commands(svc: RunCodeService) -> None:
    """A process one command leaves behind cannot open ``/proc/<pid>/mem`` of a process a
    later command started (each command is a Landlock domain of its own:
    docs/design/tenancy.md), though both run as the same user; within one command it can."""
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    h = await rt.create(worker_spec(files, digests, "sb-sec-mem"))
    opens = "if (: 3<>/proc/{pid}/mem) 2>/dev/null; then echo opened; else echo refused; fi"
    try:
        r = await rt.exec(h, ExecRequest(cmd="sleep 300 >/dev/null 2>&1 & echo $!"))
        pid = int(r.stdout)
        await rt.exec(
            h, ExecRequest(cmd=f"until grep -q '^sleep' /proc/{pid}/cmdline; do sleep 0.01; done")
        )
        r = await rt.exec(h, ExecRequest(cmd=opens.format(pid=pid)))
        assert r.stdout == "refused\n", r
        r = await rt.exec(
            h, ExecRequest(cmd="sleep 300 & p=$!; " + opens.format(pid="$p") + "; kill $p")
        )
        assert r.stdout == "opened\n", r
    finally:
        await rt.destroy(h)


def _in_child(fn: object) -> int:
    """Run ``fn()`` in a forked child; its return value is the child's exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = fn()  # type: ignore[operator]
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status)


def test_landlock_denies_writes_outside_writable_dirs() -> None:
    if landlock.landlock_abi() < 1:
        pytest.skip("no Landlock")
    with tempfile.TemporaryDirectory() as allowed, tempfile.TemporaryDirectory() as denied:

        def child() -> int:
            landlock.confine(read_only=["/"], writable=[allowed])
            Path(allowed, "ok").write_text("ok")
            try:
                Path(denied, "no").write_text("no")
            except PermissionError:
                return 0
            return 1

        assert _in_child(child) == 0
        assert Path(allowed, "ok").exists() and not Path(denied, "no").exists()


def test_seccomp_filter_denies_namespaces_even_for_root() -> None:
    prog = seccomp.build_filter()

    def child() -> int:
        import ctypes

        seccomp.install_filter(prog)
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.unshare(0x04000000)  # CLONE_NEWUTS: allowed for root without the filter
        return 0 if rc == -1 and ctypes.get_errno() == 1 else 1

    assert _in_child(child) == 0


async def _run(
    svc: RunCodeService, code: str, timeout: float = 10.0
) -> tuple[str, int | None, str]:
    resp = await svc.run_code(RunCodeRequest(code=code, language="python", run_timeout=timeout))
    assert resp.run_result is not None, resp
    r = resp.run_result
    return r.status.value, r.return_code, r.stdout or ""


# The runner reports the exit code on descriptor 1023, which user code can also write to.
_FORGE = 'import os\nos.write(1023, b\'{"rc": 0, "cpu_s": 0.0}\')\n'


@pytestmark_async
@pytest.mark.debian
@pytest.mark.parametrize(
    ("name", "code", "status", "rc", "stdout"),
    [
        # a forged report, then the test fails: the failure counts
        ("forge_then_fail", _FORGE + "assert 1 + 1 == 3\n", "Finished", 1, ""),
        # a forged report, then the program runs on: the call ends only when it does
        ("forge_then_loop", _FORGE + "while True:\n    pass\n", "TimeLimitExceeded", None, ""),
        # malformed reports are ignored, not a server error
        ("garbage_report", "import os\nos.write(1023, b'[1]')\nos.write(1023, b'{\"rc\": \"x\"}')\n"
         "print('done')\nraise SystemExit(4)\n", "Finished", 4, "done\n"),
        # a child forked by the code ends first: the call's result is the main process's
        ("fork_child_first", "import os, sys, time\nif os.fork() == 0:\n    print('child', flush=True)\n"
         "else:\n    time.sleep(0.5)\n    print('parent')\n    sys.exit(3)\n", "Finished", 3,
         "child\nparent\n"),
    ],
)  # fmt: skip
async def test_status_report_cannot_be_forged(
    svc: RunCodeService, name: str, code: str, status: str, rc: int | None, stdout: str
) -> None:
    got = await _run(svc, code, timeout=3.0)
    assert got[0] == status and (rc is None or got[1] == rc) and got[2] == stdout, (name, got)
    # and the next call is served normally
    assert await _run(svc, "print(1 + 1)") == ("Finished", 0, "2\n")
