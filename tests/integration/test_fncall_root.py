"""The fncall tier on the real kernel: isolation per call, each safety property, languages.

One runtime per module (pools stay warm between tests); the debian image and the gcc toolkit
come from the shared layer cache (built on first use: debootstrap, apt).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from tests.timing import budget

from dsec.models import ExecRequest
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.fncall.pool import PoolConfig, ScratchSize
from dsec.runtimes.fncall.service import (
    CodeRunRequest,
    RunCodeRequest,
    RunCodeResponse,
    RunCodeService,
)
from dsec.runtimes.fncall.testkit import fncall_service, worker_spec

pytestmark = [
    pytest.mark.root,
    pytest.mark.debian,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def svc(dsec_home_root: Path) -> AsyncIterator[RunCodeService]:
    home = dsec_home_root / f"fncall-{secrets.token_hex(3)}"
    async with fncall_service(
        home, pool=PoolConfig(min_ready=2, max_ready=8, memory_mb=512, pids=64)
    ) as s:
        yield s
    prefix = s.runtime.cgroup_prefix
    assert not cgroup(prefix).exists(), "fncall cgroups leaked"


async def run(
    svc: RunCodeService, code: str, language: str = "python", **kw: object
) -> RunCodeResponse:
    return await svc.run_code(RunCodeRequest(code=code, language=language, **kw))  # type: ignore[arg-type]


def out(resp: RunCodeResponse) -> str:
    assert resp.run_result is not None, resp
    return resp.run_result.stdout or ""


async def test_python_print(svc: RunCodeService) -> None:
    resp = await run(svc, "print(1+1)")
    assert resp.status.value == "Success", resp
    assert out(resp) == "2\n"
    assert resp.run_result is not None and resp.run_result.return_code == 0


async def test_stdin_files_and_fetch(svc: RunCodeService) -> None:
    code = "import sys\nd=open('in/data.txt').read()\nopen('result.txt','w').write(d+sys.stdin.read())\nprint('ok')"
    resp = await run(
        svc,
        code,
        stdin="-tail",
        files={"in/data.txt": base64.b64encode(b"head").decode()},
        fetch_files=["result.txt", "/work/in/data.txt"],
    )
    assert resp.status.value == "Success", resp
    assert base64.b64decode(resp.files["result.txt"]) == b"head-tail"
    assert base64.b64decode(resp.files["/work/in/data.txt"]) == b"head"


async def test_isolation_files_between_calls(svc: RunCodeService) -> None:
    await run(
        svc,
        "open('/work/left.txt','w').write('x'); open('/tmp/left.txt','w').write('x'); open('/dev/shm/left','w').write('x')",
    )
    resp = await run(
        svc,
        "import os; print([os.path.exists(p) for p in ('/work/left.txt','/tmp/left.txt','/dev/shm/left')])",
    )
    assert out(resp) == "[False, False, False]\n"


async def test_isolation_processes_between_calls(svc: RunCodeService) -> None:
    await run(
        svc,
        "import subprocess; subprocess.Popen(['sleep','60']); subprocess.Popen('sleep 61 &', shell=True)",
    )
    resp = await run(
        svc,
        "import os\nprint(sorted(open(f'/proc/{p}/cmdline').read().split(chr(0))[0] for p in os.listdir('/proc') if p.isdigit()))",
    )
    assert "sleep" not in out(resp), out(resp)


async def test_background_processes_do_not_hold_the_answer(svc: RunCodeService) -> None:
    """The interpreter reports and stops; the agent answers as soon as the output pipes are at
    EOF, killing the call's other processes only if they keep them open (a forked child, a
    `sleep` that inherited stdout). Output written before the report is kept."""
    code = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '30'])\n"
        "subprocess.Popen(['sleep', '31'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "if os.fork() == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "print('main done')\n"
    )
    t0 = time.monotonic()
    resp = await run(svc, code, run_timeout=20)
    assert out(resp) == "main done\n", resp
    assert resp.run_result is not None and resp.run_result.return_code == 0
    assert resp.run_result.status.value == "Finished"
    assert time.monotonic() - t0 < budget(5)  # not after the 30 s sleeps
    follow = await run(
        svc,
        "import os\nprint(sorted(open(f'/proc/{p}/cmdline').read().split(chr(0))[0] for p in os.listdir('/proc') if p.isdigit()))",
    )
    assert "sleep" not in out(follow), out(follow)


async def test_isolation_env_between_calls(svc: RunCodeService) -> None:
    os.environ["DSEC_FNCALL_SERVER_SECRET"] = "s3cret"
    try:
        await run(svc, "import os; os.environ['LEAKED']='1'; os.putenv('LEAKED2','1')")
        resp = await run(svc, "import os; print(sorted(os.environ))")
    finally:
        del os.environ["DSEC_FNCALL_SERVER_SECRET"]
    names = out(resp)
    assert "LEAKED" not in names and "DSEC" not in names and "s3cret" not in names, names


async def test_isolation_imported_modules_between_calls(svc: RunCodeService) -> None:
    await run(
        svc,
        "import json, sys, xml.dom.minidom\njson.dumps = None\nsys.modules['leak'] = 1\nimport builtins; builtins.LEAK = 1",
    )
    resp = await run(
        svc,
        "import json, sys, builtins\nprint(json.dumps([1]), 'xml.dom.minidom' in sys.modules, 'leak' in sys.modules, hasattr(builtins, 'LEAK'))",
    )
    assert out(resp) == "[1] False False False\n"


async def test_no_network(svc: RunCodeService) -> None:
    code = (
        "import socket\n"
        "print(socket.if_nameindex())\n"
        "for host in ('1.1.1.1', '10.0.2.2', '169.254.169.254'):\n"
        "    try:\n"
        "        socket.create_connection((host, 80), timeout=1); print('CONNECTED', host)\n"
        "    except OSError as e: print('blocked', host, e.errno)\n"
    )
    text = out(await run(svc, code))
    assert "[(1, 'lo')]" in text and "CONNECTED" not in text, text


async def test_no_ptrace(svc: RunCodeService) -> None:
    code = (
        "import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "p = subprocess.Popen(['sleep', '5'])\n"
        "print(libc.ptrace(16, p.pid, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
        "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"  # PTRACE_TRACEME
    )
    assert out(await run(svc, code)) == "-1 1\n-1 1\n"


async def test_no_mount_no_new_namespaces(svc: RunCodeService) -> None:
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
        "print(libc.unshare(0x20000), ctypes.get_errno())\n"  # CLONE_NEWNS
        "print(libc.chroot(b'/tmp'), ctypes.get_errno())\n"
    )
    assert out(await run(svc, code)) == "-1 1\n-1 1\n-1 1\n-1 1\n"


async def test_fork_bomb_capped_by_pids(svc: RunCodeService) -> None:
    code = (
        "import os, time\nn = 0\n"
        "try:\n"
        "    for _ in range(10000):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('capped', n, e.errno)\n"
    )
    t0 = time.monotonic()
    resp = await run(svc, code, run_timeout=20)
    assert out(resp).startswith("capped"), resp
    assert int(out(resp).split()[1]) < 64
    assert time.monotonic() - t0 < budget(15)  # capped, not timed out (20 s)
    assert out(await run(svc, "print('alive')")) == "alive\n"


async def test_fork_bomb_leaves_room_for_the_next_command(svc: RunCodeService) -> None:
    """A fork bomb stays in its command's own pids cgroup and dies with it at the timeout,
    and one left running (daemonised: the command returned at once) leaves the next command
    room to run and kill it (each command's cgroup holds the limit less a reserve)."""
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    h = await rt.create(worker_spec(files, digests, "sb-t-bomb"))  # pids=64
    # the bomb's shells, not this command's (whose own text holds "[b]()")
    count = "grep -l '[b]()' /proc/[0-9]*/cmdline 2>/dev/null | wc -l"
    polls = int(budget(5) / 0.05)
    wait_gone = (
        f"n=0; while [ $({count}) != 0 ] && [ $n -lt {polls} ]; do sleep 0.05; n=$((n+1)); done;"
        f" {count}"
    )
    try:
        # (exec: once the bomb fills its cgroup, a `sleep` would find no process to fork; the
        # bomb in a subshell: a shell whose fork fails exits, and this one must wait on)
        r = await rt.exec(h, ExecRequest(cmd="(b() { b | b & }; b); exec sleep 60", timeout_s=3))
        assert r.timed_out, r
        r = await rt.exec(h, ExecRequest(cmd=wait_gone))
        assert r.stdout.strip() == "0", r  # the timeout took its whole cgroup
        r = await rt.exec(
            h, ExecRequest(cmd="setsid sh -c 'b() { b | b & }; b' >/dev/null 2>&1 & echo left")
        )
        assert r.stdout == "left\n", r
        await asyncio.sleep(2)  # let it fill its cgroup
        r = await rt.exec(h, ExecRequest(cmd="kill -9 -1 2>/dev/null; " + wait_gone))
        assert (r.exit_code, r.stdout.strip()) == (0, "0"), r  # room for this one, bomb gone
        r = await rt.exec(h, ExecRequest(cmd="echo a | cat"))
        assert r.stdout == "a\n", r
    finally:
        await rt.destroy(h)


async def test_memory_hog_killed(svc: RunCodeService) -> None:
    resp = await run(
        svc,
        "x = bytearray(1 << 30)\nx[::4096] = b'1' * (len(x) // 4096)\nprint('survived')",
        memory_limit_MB=128,
    )
    assert resp.status.value == "Failed", resp
    assert resp.run_result is not None and resp.run_result.return_code == -9
    assert "memory limit exceeded" in resp.message
    assert "survived" not in out(resp)


async def test_workers_are_leaves_of_their_pools_cgroup(svc: RunCodeService) -> None:
    """Each worker has a cgroup of its own below its pool's, made by the zygote with the
    pool's limits whatever the host's layout; the pool's cgroup holds no process (v2: it
    hands its controllers to the workers) and the zygote is not in it."""
    await run(svc, "print(1)")
    prefix = svc.runtime.cgroup_prefix
    limits: set[int | None] = set()
    for pool in svc.runtime.pools():
        pool_cg = cgroup(f"{prefix}/{pool['name']}")
        assert pool_cg.procs() == [], pool
        workers = pool_cg.children()
        assert workers and all(w.startswith("w") for w in workers), workers
        for w in workers:
            with contextlib.suppress(FileNotFoundError):  # retired meanwhile
                limits.add(pool_cg.child(w).memory_limit())
    assert 512 << 20 in limits, limits


async def test_wall_time_limit(svc: RunCodeService) -> None:
    t0 = time.monotonic()
    resp = await run(svc, "import time; print('start', flush=True); time.sleep(100)", run_timeout=1)
    assert resp.run_result is not None and resp.run_result.status.value == "TimeLimitExceeded"
    assert out(resp) == "start\n"
    assert time.monotonic() - t0 < budget(4)  # the 1 s limit, not the 100 s sleep


async def test_cpu_time_limits(svc: RunCodeService) -> None:
    # RLIMIT_CPU is set per call, and the cgroup quota (1 core) caps the rate of a
    # multi-threaded burner: CPU time cannot exceed ~1 s per wall second.
    code = (
        "import resource, threading, time\nprint(resource.getrlimit(resource.RLIMIT_CPU))\n"
        "def burn():\n    t = time.time()\n    while time.time() - t < 1.5: pass\n"
        "ts = [threading.Thread(target=burn) for _ in range(2)]\n[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)\n"
    )
    resp = await run(svc, code, run_timeout=3)
    lines = out(resp).split("\n")
    soft, hard = eval(lines[0])
    assert 0 < soft <= 5 and hard <= 6
    assert float(lines[1]) < 1.5 * 1.3  # two threads for 1.5 s got about one core


async def test_output_capped(svc: RunCodeService) -> None:
    t0 = time.monotonic()
    resp = await run(
        svc,
        "import sys\nfor _ in range(200): sys.stdout.write('y' * 1_000_000)\nprint('done', file=sys.stderr)",
    )
    assert len(out(resp)) == svc.limits.max_output_bytes
    assert "truncated" in resp.message
    assert resp.run_result is not None and resp.run_result.stderr == "done\n"
    assert time.monotonic() - t0 < budget(10)  # the flood was cut, not read to its end


async def test_no_server_fd_inherited(svc: RunCodeService) -> None:
    leak = open("/etc/hostname", "rb")  # an fd of the server that must not reach a worker
    try:
        code = (
            "import os, subprocess\n"
            "print(subprocess.run(['ls', '/proc/self/fd'], capture_output=True, text=True).stdout.split())\n"
            "print({int(f): os.readlink(f'/proc/self/fd/{f}').split(':')[0] for f in os.listdir('/proc/self/fd') if int(f) > 3})\n"
            "print(os.access('/proc/1/fd', os.R_OK))"
        )
        text = out(await run(svc, code))
    finally:
        leak.close()
    child_fds, own_fds, agent_fds_readable = text.split("\n")[:3]
    assert child_fds == "['0', '1', '2', '3']", text  # 3 is ls's own directory descriptor
    # the interpreter itself holds only the runtime's status socket and /dev/null, close-on-exec
    assert own_fds == "{1022: '/dev/null', 1023: 'socket'}", text
    assert agent_fds_readable == "False"


async def test_no_view_of_other_workers(svc: RunCodeService) -> None:
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    specs = [worker_spec(files, digests, f"sb-t-{i}") for i in range(2)]
    h1, h2 = await rt.create(specs[0]), await rt.create(specs[1])
    try:
        await rt.files(h1).write("/work/secret.txt", b"one")
        r = await rt.exec(
            h1,
            ExecRequest(
                cmd="sleep 30 & python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.bind('\\0dsec-test'); print('bound')\""
            ),
        )
        assert r.stdout == "bound\n", r
        r2 = await rt.exec(
            h2,
            ExecRequest(
                cmd=[
                    "python3",
                    "-c",
                    "import os, socket\nprint(os.listdir('/work'))\n"
                    "print(sorted(open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit()))\n"
                    "s = socket.socket(socket.AF_UNIX)\n"
                    "try:\n    s.connect('\\0dsec-test'); print('connected')\nexcept OSError as e: print('refused', e.errno)\n",
                ]
            ),
        )
        lines = r2.stdout.split("\n")
        assert lines[0] == "[]", r2
        assert "sleep" not in lines[1], r2
        assert lines[2].startswith("refused"), r2
    finally:
        await rt.destroy(h1)
        await rt.destroy(h2)


async def test_sandbox_contract(svc: RunCodeService) -> None:
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    spec = dataclasses.replace(worker_spec(files, digests, "sb-t-contract"), env={"GREETING": "hi"})
    h = await rt.create(spec)
    try:
        u = await rt.usage(h)  # the spec's limits, in the worker's cgroup
        assert u.memory_limit_bytes == 256 << 20 and (u.pids or 0) >= 1, u
        f = rt.files(h)
        info = await f.write("/work/a/b.txt", b"content", mode=0o600)
        assert info.size == 7 and info.uid == 1000
        assert await f.read("/work/a/b.txt", 100) == b"content"
        assert [i.name for i in await f.list("/work/a")] == ["b.txt"]
        r = await rt.exec(
            h,
            ExecRequest(
                cmd="cat a/b.txt; echo; echo $GREETING $X; id -u; exit 3",
                cwd="/work",
                env={"X": "y"},
            ),
        )
        assert (r.stdout, r.exit_code) == ("content\nhi y\n1000\n", 3), r
        r = await rt.exec(h, ExecRequest(cmd="cat", stdin="piped"))
        assert r.stdout == "piped"
        chunks: list[tuple[str, bytes]] = []

        async def sink(stream: str, data: bytes) -> None:
            chunks.append((stream, data))

        r = await rt.exec(h, ExecRequest(cmd="echo one; echo two >&2"), sink=sink)
        async with asyncio.timeout(budget(5)):
            while not {("stdout", b"one\n"), ("stderr", b"two\n")} <= set(chunks):
                await asyncio.sleep(0.01)
        r = await rt.exec(h, ExecRequest(cmd="sleep 10", timeout_s=0.5))
        assert r.timed_out
        r = await rt.exec(h, ExecRequest(cmd="head -c 100000 /dev/zero", max_output_bytes=1000))
        assert len(r.stdout) == 1000 and r.stdout_truncated
        with pytest.raises(Exception, match=r"writable|Read-only|read-only"):
            await f.write("/etc/evil", b"x")
        tar = await f.download_tar("/work/a", 1 << 20)
        # a directory downloads as its entries (what upload_tar takes back)
        assert await f.upload_tar("/work/copy", tar) >= 1
        assert await f.read("/work/copy/b.txt", 100) == b"content"
        assert await rt.alive(h)
    finally:
        await rt.destroy(h)
    assert not await rt.alive(h)


async def test_disk_mb_bounds_each_writable_filesystem(svc: RunCodeService) -> None:
    """A sandbox's ``disk_mb`` bounds /work, /tmp and /dev/shm as it bounds a container's
    writable layer (the pool mounts them at 512 and 128 MiB)."""
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    spec = dataclasses.replace(worker_spec(files, digests, "sb-t-disk"), disk_mb=16)
    h = await rt.create(spec)
    try:
        for where in ("/work", "/tmp", "/dev/shm"):
            r = await rt.exec(
                h,
                ExecRequest(
                    cmd=f"dd if=/dev/zero of={where}/fill bs=1M count=40 2>&1; "
                    f"echo rc=$?; wc -c < {where}/fill; rm -f {where}/fill"
                ),
            )
            assert "rc=1" in r.stdout and "No space left" in r.stdout, (where, r)
            assert int(r.stdout.strip().splitlines()[-1]) <= 16 << 20, (where, r)
        u = await rt.usage(h)
        assert u.disk_total_bytes is not None and u.disk_total_bytes <= 16 << 20, u
    finally:
        await rt.destroy(h)
    # a large disk_mb: as much as the memory limit leaves (the next worker is a fresh one)
    h = await rt.create(
        dataclasses.replace(worker_spec(files, digests, "sb-t-disk2"), disk_mb=1024)
    )
    try:
        r = await rt.exec(h, ExecRequest(cmd="df -m /work /tmp /dev/shm | tail -3"))
        sizes = {int(line.split()[1]) for line in r.stdout.splitlines()}
        assert sizes == {ScratchSize.fit(256, 1024).mb}, r  # one filesystem
    finally:
        await rt.destroy(h)


def _capable(cap: int) -> bool:
    """Whether this process's bounding set holds capability ``cap``."""
    with open("/proc/self/status") as f:
        bnd = next(line for line in f if line.startswith("CapBnd:"))
    return bool(int(bnd.split()[1], 16) >> cap & 1)


async def test_full_disk_is_enospc_not_a_dead_sandbox(svc: RunCodeService) -> None:
    """Filling the scratch (files or inodes) is ENOSPC for the command: the scratch fits in
    the memory limit with room for the agent, which the OOM killer never takes; a command
    that needs memory on a full disk is what dies."""
    rt = svc.runtime
    files, digests = await rt.image_layers("debian")
    h = await rt.create(
        dataclasses.replace(worker_spec(files, digests, "sb-t-fill"), disk_mb=4096)
    )  # memory_mb=256
    try:
        r = await rt.exec(
            h,
            ExecRequest(cmd="dd if=/dev/zero of=/work/fill bs=1M count=1024 2>&1", timeout_s=120),
        )
        assert r.exit_code == 1 and "No space left" in r.stdout and not r.oom_killed, r
        r = await rt.exec(
            h,
            ExecRequest(
                cmd="i=0; while true 2>/dev/null > /tmp/f$i; do i=$((i+1)); done; echo made $i;"
                " : > /tmp/one-more",
                timeout_s=300,
            ),
        )
        assert r.stdout.startswith("made ") and "No space left" in r.stderr, r
        assert int(r.stdout.split()[1]) <= ScratchSize.fit(256, 4096).inodes, r
        r = await rt.exec(h, ExecRequest(cmd="cat /proc/1/oom_score_adj /proc/self/oom_score_adj"))
        # the agent at -1000 where root holds CAP_SYS_RESOURCE (this kind of VM withholds it)
        agent = "-1000" if _capable(24) else "0"
        assert r.stdout.split() == [agent, "1000"], r
        r = await rt.exec(h, ExecRequest(cmd="echo -1 > /proc/self/oom_score_adj"))
        assert r.exit_code != 0, r  # a command cannot go below the agent's 0
        r = await rt.exec(h, ExecRequest(cmd=["python3", "-c", "b = bytearray(200 << 20)"]))
        assert r.signal == 9 and r.oom_killed, r
        r = await rt.exec(
            h, ExecRequest(cmd="rm -rf /work/fill /tmp/f*; echo ok > /work/ok; cat /work/ok")
        )
        assert r.stdout == "ok\n", r
        assert await rt.alive(h)
    finally:
        await rt.destroy(h)


async def test_bash(svc: RunCodeService) -> None:
    resp = await run(svc, 'read x; echo "got $x"; echo err >&2; exit 4', "bash", stdin="val\n")
    assert out(resp) == "got val\n" and resp.run_result is not None
    assert resp.run_result.stderr == "err\n" and resp.run_result.return_code == 4


@pytest.mark.slow
async def test_c_and_cpp(svc: RunCodeService) -> None:
    c = '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);return 0;}'
    resp = await run(svc, c, "c", stdin="2 40")
    assert resp.status.value == "Success" and out(resp) == "42\n", resp
    cpp = "#include <iostream>\n#include <vector>\nint main(){std::vector<int> v{1,2,3};std::cout<<v.size()<<std::endl;}"
    resp = await run(svc, cpp, "cpp")
    assert resp.status.value == "Success" and out(resp) == "3\n", resp


@pytest.mark.slow
async def test_compile_error_vs_runtime_error(svc: RunCodeService) -> None:
    resp = await run(svc, "int main(){ return undeclared; }", "c")
    assert resp.status.value == "Failed" and resp.run_result is None
    assert resp.compile_result is not None and resp.compile_result.return_code != 0
    assert "undeclared" in (resp.compile_result.stderr or "")
    resp = await run(svc, "int main(){ int *p = 0; return *p; }", "c")
    assert resp.compile_result is not None and resp.compile_result.return_code == 0
    assert resp.run_result is not None and resp.run_result.return_code == -11
    native = await svc.run(CodeRunRequest(code="int main(){ return x; }", language="c"))
    assert native.outcome == "compile_error"
    native = await svc.run(CodeRunRequest(code="raise SystemExit(5)", language="python"))
    assert (
        native.outcome == "runtime_error" and native.run is not None and native.run.exit_code == 5
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"code": "x", "language": "cobol"}, "unsupported language"),
        ({"code": "print(1)", "language": "python", "files": {"a.txt": "not base64!"}}, "base64"),
        (
            {"code": "print(1)", "language": "python", "fetch_files": ["../../etc/passwd"]},
            "outside the work directory",
        ),
        (  # absolute paths are fetched, as SandboxFusion does, but never through '..'
            {"code": "print(1)", "language": "python", "fetch_files": ["/mnt/../etc/passwd"]},
            "may not use '..'",
        ),
        (
            {"code": "print(1)", "language": "python", "files": {"/tmp/../../x": "eA=="}},
            "outside the work directory",
        ),
        (
            {
                "code": "print(1)",
                "language": "python",
                "files": {"big": base64.b64encode(b"0" * (65 << 20)).decode()},
            },
            "at most",
        ),
        ({"code": "print(1)", "language": "python", "run_timeout": -1}, "timeout"),
    ],
)
async def test_bad_input_is_a_sandbox_error(
    svc: RunCodeService, kwargs: dict[str, object], needle: str
) -> None:
    resp = await svc.run_code(RunCodeRequest(**kwargs))  # type: ignore[arg-type]
    assert resp.status.value == "SandboxError" and needle in resp.message, resp


async def test_symlink_in_work_cannot_fetch_outside(svc: RunCodeService) -> None:
    resp = await run(
        svc,
        "import os; os.symlink('/etc/passwd', 'link'); os.symlink('../../etc', 'dir')",
        fetch_files=["link", "dir/passwd"],
    )
    assert resp.files == {}, resp
    assert "fetch link" in resp.message and "fetch dir/passwd" in resp.message


async def test_never_ending_code_leaves_no_stuck_worker(svc: RunCodeService) -> None:
    resps = await asyncio.gather(*(run(svc, "while True: pass", run_timeout=0.5) for _ in range(4)))
    assert all(
        r.run_result is not None and r.run_result.status.value == "TimeLimitExceeded" for r in resps
    )
    async with asyncio.timeout(budget(5)):  # the killed workers are given back
        while not all(p["busy"] == 0 for p in svc.runtime.pools()):
            await asyncio.sleep(0.05)


async def test_image_without_python_is_a_client_error(svc: RunCodeService) -> None:
    """An fncall sandbox of an image with no /usr/bin/python3 (busybox) cannot start its
    worker: that is the request's choice of image (400), not a server failure (500)."""
    from dsec.errors import InvalidRequest

    rt = svc.runtime
    files, digests = await rt.image_layers("busybox")
    spec = worker_spec(files, digests, "sb-t-nopython")
    with pytest.raises(InvalidRequest, match="no /usr/bin/python3") as got:
        await rt.create(spec)
    assert got.value.details == {"missing": "/usr/bin/python3"}
    # nothing half-made: the next try fails the same way (no stuck pool), debian still works
    with pytest.raises(InvalidRequest):
        await rt.create(spec)
    assert "hi" in out(await run(svc, "print('hi')"))
