"""The microvm tier on real QEMU guests (TCG here): template restore, exec, files, limits,
pause, teardown and bad input."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from tests.timing import budget, vm_boot_budgets

from dsec.config import Paths
from dsec.contract.runtime import Handle, Pausable, Runtime, capabilities_of
from dsec.errors import (
    FileNotFound,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxError,
    SandboxStopped,
)
from dsec.models import ExecRequest
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime
from dsec.runtimes.microvm.qemu import pid_alive, qemu_processes

from .conftest import BusyboxImage, new_spec

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(180)]

MakeVM = Callable[..., Awaitable[Handle]]


def _exists(path: str | Path) -> bool:
    return os.path.exists(path)


def _tar(*members: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            tf.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    return buf.getvalue()


def _member(
    name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 1
) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size = kind, link, size if kind == tarfile.REGTYPE else 0
    return ti


def _escaping_tars() -> list[bytes]:
    """Archives upload_tar must refuse: ``..``, absolute names, a hard link out of the
    archive, a device node, a PAX path that climbs out."""
    pax = _member("innocent.txt")
    pax.pax_headers = {"path": "../../pax-escape"}
    return [
        _tar(_member("../../escape.txt")),
        _tar(_member("ok/../../escape.txt")),
        _tar(_member("/etc/escape")),
        _tar(_member("link", tarfile.LNKTYPE, "../../etc/passwd")),
        _tar(_member("dev", tarfile.CHRTYPE)),
        _tar(pax),
    ]


def test_protocols(microvm: MicroVMRuntime) -> None:
    assert isinstance(microvm, Runtime)
    assert isinstance(microvm, Pausable)
    caps = capabilities_of(microvm)
    assert caps.available and caps.pause
    assert ("TCG" in (caps.reason or "")) or ("KVM" in (caps.reason or ""))


async def test_exec_from_template(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm(cpu=1.0, memory_mb=256)
    assert microvm.last_create["restored"] == 1.0
    r = await microvm.exec(
        h, ExecRequest(cmd="echo $GREETING $EXTRA; pwd; exit 3", env={"EXTRA": "x"}, cwd="/tmp")
    )
    assert r.stdout == "hello x\n/tmp\n" and r.exit_code == 3 and not r.timed_out
    r = await microvm.exec(h, ExecRequest(cmd=["cat"], stdin="from stdin"))
    assert r.stdout == "from stdin" and r.exit_code == 0
    r = await microvm.exec(h, ExecRequest(cmd="id -u", user="nobody"))
    assert r.stdout.strip() == "65534"
    r = await microvm.exec(h, ExecRequest(cmd=["/no/such/binary"]))
    assert r.exit_code == 127 and "no/such/binary" in r.stderr
    r = await microvm.exec(h, ExecRequest(cmd="kill -9 $$"))
    assert r.exit_code is None and r.signal == 9
    # its own kernel, not the host's
    r = await microvm.exec(h, ExecRequest(cmd="uname -r"))
    assert r.stdout.strip() != os.uname().release and "cloud" in r.stdout
    # the guest kernel runs with the arguments the runtime chose for the accelerator, and
    # under TCG sees a CPU without ERMS (no byte-wise `rep movsb/stosb`)
    r = await microvm.exec(h, ExecRequest(cmd="cat /proc/cmdline; grep -m1 ^flags /proc/cpuinfo"))
    cmdline, flags = r.stdout.split("\n")[:2]
    assert "lsm=landlock,yama,bpf" in cmdline.split()
    tcg_args = {"mitigations=off", "init_on_alloc=0", "clearcpuid=rep_good", "dsec.bpf_jit=0"}
    if microvm.accel == "tcg":
        assert tcg_args <= set(cmdline.split()), cmdline
        assert not {"erms", "rep_good"} & set(flags.split()), flags
        r = await microvm.exec(h, ExecRequest(cmd="cat /proc/sys/net/core/bpf_jit_enable"))
        assert r.stdout == "0\n", r  # the agent turned the JIT off (seccomp attach per command)
        assert "tsc=reliable" in cmdline.split(), cmdline  # no clocksource watchdog timer
        # QEMU runs without transparent huge pages (its memory charged by the 4 KiB page)
        status = await asyncio.to_thread(Path(f"/proc/{h.state['pid']}/status").read_text)
        assert "THP_enabled:\t0" in status, status
    else:
        assert not tcg_args & set(cmdline.split()), cmdline
    # nothing wakes an idle guest on a timer: no lockup watchdog, no proactive compaction
    assert "nowatchdog" in cmdline.split(), cmdline
    r = await microvm.exec(h, ExecRequest(cmd="cat /proc/sys/vm/compaction_proactiveness"))
    assert r.stdout == "0\n", r
    # limits: one vCPU; guest RAM = 256 MiB for the commands + the guest kernel's reserve;
    # every command in a guest cgroup holding it to memory_mb and pids; QEMU inside a host
    # cgroup with quota and memory limit
    r = await microvm.exec(
        h,
        ExecRequest(
            cmd="grep -c ^processor /proc/cpuinfo; grep MemTotal /proc/meminfo; cat /proc/self/cgroup"
        ),
    )
    lines = r.stdout.split("\n")
    assert lines[0] == "1"
    ram_kib = microvm.guest_ram_mb(256) * 1024
    assert ram_kib - 100_000 < int(lines[1].split()[1]) <= ram_kib
    assert lines[2].startswith("0::/cmd/c")
    # (the guest's cgroup2 is mounted read-only at /sys/fs/cgroup for guarded commands)
    r = await microvm.exec(
        h, ExecRequest(cmd="cat /sys/fs/cgroup/cmd/memory.max /sys/fs/cgroup/cmd/pids.max")
    )
    assert r.stdout.split() == [str(256 << 20), "256"], r.stderr
    cg = microvm._cgroup(h.id)
    assert h.state["pid"] in cg.procs()
    dirs = cg.dirs()  # the driver's files for one core and the QEMU pids limit, either layout
    for w in cg.limit_writes(cpu=1.0, pids=microvm.config.qemu_pids):
        assert (dirs[w.hierarchy] / w.file).read_text().strip() == w.value, w
    limit = cg.memory_limit()
    assert limit == (microvm.guest_ram_mb(256) + microvm.config.qemu_overhead_mb) << 20


async def test_home_is_the_users_own(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """HOME comes from the guest's /etc/passwd for the user a command runs as (as on the
    container tier); a HOME the sandbox or the request sets wins."""
    h = await make_vm()
    r = await microvm.exec(
        h, ExecRequest(cmd="echo 'ann:x:1234:1234:Ann:/home/ann:/bin/sh' >> /etc/passwd")
    )
    assert r.exit_code == 0, r.stderr
    r = await microvm.exec(h, ExecRequest(cmd='echo "$HOME $(id -u)"', user="ann"))
    assert r.stdout == "/home/ann 1234\n", r
    r = await microvm.exec(h, ExecRequest(cmd='echo "$HOME"', user="1234"))
    assert r.stdout == "/home/ann\n", r
    r = await microvm.exec(h, ExecRequest(cmd='echo "$HOME"'))
    assert r.stdout == "/root\n", r
    r = await microvm.exec(h, ExecRequest(cmd='echo "$HOME"', user="4321"))  # no passwd entry
    assert r.stdout == "/\n", r
    r = await microvm.exec(h, ExecRequest(cmd='echo "$HOME"', user="ann", env={"HOME": "/x"}))
    assert r.stdout == "/x\n", r
    h2 = await make_vm(env={"HOME": "/from/spec"})
    r = await microvm.exec(h2, ExecRequest(cmd='echo "$HOME"', user="nobody"))
    assert r.stdout == "/from/spec\n", r


async def test_files(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm()
    f = microvm.files(h)
    info = await f.write("/work/a/b.txt", b"data\x00\xff", mode=0o600)
    assert info.size == 6 and info.mode == 0o600 and info.type == "file"
    assert await f.read("/work/a/b.txt", 100) == b"data\x00\xff"
    with pytest.raises(PayloadTooLarge):
        await f.read("/work/a/b.txt", 3)
    with pytest.raises(FileNotFound):
        await f.read("/work/nope", 100)
    await f.mkdir("/work/d/e")
    names = [i.path for i in await f.list("/work", depth=2)]
    assert names == ["/work/a", "/work/a/b.txt", "/work/d", "/work/d/e"]
    moved = await f.rename("/work/a/b.txt", "/work/c.txt")
    assert moved.path == "/work/c.txt"
    assert (await f.stat("/bin/sh")).type == "symlink"
    r = await microvm.exec(h, ExecRequest(cmd="cat /work/c.txt | wc -c"))
    assert r.stdout.strip() == "6"
    # tar in and out
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"tarred\n"
        ti = tarfile.TarInfo("pkg/x.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    assert await f.upload_tar("/dst", buf.getvalue()) == 1
    assert await f.read("/dst/pkg/x.txt", 100) == b"tarred\n"
    # a directory's archive lists its entries relative to it (what upload_tar takes back)
    await f.write("/dst/pkg/sub/y.txt", b"y")
    out = await f.download_tar("/dst/pkg", 1 << 20)
    with tarfile.open(fileobj=io.BytesIO(out)) as tf:
        assert sorted(tf.getnames()) == ["sub", "sub/y.txt", "x.txt"]
    assert await f.upload_tar("/copy", out) == 3
    assert await f.read("/copy/sub/y.txt", 10) == b"y"
    # a file's archive holds it under its own name
    with tarfile.open(fileobj=io.BytesIO(await f.download_tar("/dst/pkg/x.txt", 1 << 20))) as tf:
        assert tf.getnames() == ["x.txt"]
    with pytest.raises(PayloadTooLarge):
        await f.download_tar("/bin", 100)
    # escaping members are refused before anything is extracted
    for bad in _escaping_tars():
        with pytest.raises(InvalidRequest) as ei:
            await f.upload_tar("/dst", bad)
        assert ei.value.code in ("path_outside_sandbox", "invalid_request")
    assert (await f.list("/dst", 1))[0].path == "/dst/pkg" and len(await f.list("/dst", 1)) == 1
    with pytest.raises(PathOutsideSandbox):
        await f.read("/../../etc/passwd", 100)
    await f.remove("/work", recursive=True)
    with pytest.raises(FileNotFound):
        await f.stat("/work")


async def test_timeout_and_output_cap(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm()
    t = time.monotonic()
    r = await microvm.exec(h, ExecRequest(cmd="sleep 30", timeout_s=1.0))
    assert r.timed_out and r.exit_code is None and time.monotonic() - t < budget(6)
    r = await microvm.exec(
        h, ExecRequest(cmd="yes | head -c 200000; echo err >&2", max_output_bytes=1000)
    )
    assert (
        len(r.stdout) == 1000
        and r.stdout_truncated
        and not r.stderr_truncated
        and r.stderr == "err\n"
    )
    chunks: list[tuple[str, bytes]] = []

    async def sink(stream: str, data: bytes) -> None:
        chunks.append((stream, data))

    r = await microvm.exec(h, ExecRequest(cmd="echo one; sleep 0.3; echo two >&2"), sink=sink)
    assert ("stdout", b"one\n") in chunks and ("stderr", b"two\n") in chunks
    assert r.stdout == "one\n" and r.stderr == "two\n"
    # a background child holding the pipe open does not hang the exec
    t = time.monotonic()
    r = await microvm.exec(h, ExecRequest(cmd="sleep 20 & echo started"))
    assert r.stdout == "started\n" and time.monotonic() - t < budget(5)  # not the 20 s


async def test_clones_are_isolated(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    a = await make_vm(hostname="alpha")
    b = await make_vm(hostname="beta")
    await microvm.files(a).write("/secret", b"only in a")
    with pytest.raises(FileNotFound):
        await microvm.files(b).read("/secret", 100)
    asked = time.time()
    ra = await microvm.exec(
        a, ExecRequest(cmd="hostname; head -c 16 /dev/urandom | od -An -x; date +%s")
    )
    rb = await microvm.exec(
        b, ExecRequest(cmd="hostname; head -c 16 /dev/urandom | od -An -x; date +%s")
    )
    answered = time.time()
    la, lb = ra.stdout.split("\n"), rb.stdout.split("\n")
    assert la[0] == "alpha" and lb[0] == "beta"
    assert la[1] != lb[1], "clones must not share RNG state"
    for lines in (la, lb):  # the host's time while the command ran
        assert asked - 5 < int(lines[2]) < answered + 5, "guest clock set after restore"
    # the agent channel cannot be opened from inside the guest
    r = await microvm.exec(
        a, ExecRequest(cmd="ls /dev | grep -c vport; cat /sys/class/virtio-ports/*/name")
    )
    assert r.stdout.split("\n")[0] == "0"
    # (guarded commands cannot mknod at all; a full guest's node is refused with EBUSY:
    # tests/security/test_vm_escape.py)
    r = await microvm.exec(
        a,
        ExecRequest(
            cmd="for p in /sys/class/virtio-ports/*; do d=$(cat $p/dev); mknod /tmp/p c ${d%:*} ${d#*:}; done; echo x > /tmp/p"
        ),
    )
    assert "mknod" in r.stderr and "not permitted" in r.stderr.lower(), r


async def test_pause_resume(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm()
    info = await microvm.pause(h)
    assert info["mode"] == "vcpus-stopped"
    vm = microvm._live[h.id]
    assert vm.qmp is not None
    assert (await vm.qmp.execute("query-status"))["status"] == "paused"
    paused_s = budget(2.0)  # a clock left standing would lag by this much
    await asyncio.sleep(paused_s)
    await microvm.resume(h)
    asked = time.time()
    r = await microvm.exec(h, ExecRequest(cmd="date +%s"))
    # the host's time while the command ran (whole seconds, so 1 s below it is fine)
    assert asked - 1.5 < int(r.stdout) < time.time() + 1, "clock reset after resume"
    # a request on a paused sandbox resumes it
    await microvm.pause(h)
    r = await microvm.exec(h, ExecRequest(cmd="echo back"))
    assert r.stdout == "back\n"
    assert (await vm.qmp.execute("query-status"))["status"] == "running"


async def test_destroy_leaves_nothing(microvm: MicroVMRuntime, busybox_image: BusyboxImage) -> None:
    h = await microvm.create(new_spec(busybox_image))
    pid, d = h.state["pid"], Path(h.state["dir"])
    assert pid_alive(pid) and _exists(d)
    assert h.id in qemu_processes(microvm.qemu_tag) or h.state["qemu_name"] in qemu_processes(
        microvm.tag
    )
    await microvm.destroy(h)
    assert not pid_alive(pid) and not _exists(f"/proc/{pid}")
    assert not _exists(d) and not microvm._cgroup(h.id).exists()
    await microvm.destroy(h)  # idempotent
    assert h.id not in await microvm.list_orphans(set())


async def test_recover_and_orphans(vm_home: Path, busybox_image: BusyboxImage) -> None:
    cfg = MicroVMConfig(pool_size=1, keep_templates=True, **vm_boot_budgets())
    rt = MicroVMRuntime(Paths(vm_home), cfg)
    await rt.start()
    h = await rt.create(new_spec(busybox_image))
    await rt.pool_settled()
    h2 = await rt.create(new_spec(busybox_image))  # comes from the pool (pre-started QEMU)
    try:
        assert rt.last_create["pooled"] == 1.0
        await rt.close()  # "edge restart": connections dropped, VMs keep running
        rt2 = MicroVMRuntime(Paths(vm_home), cfg)
        await rt2.start()
        assert await rt2.recover(h) and await rt2.recover(h2)
        r = await rt2.exec(h2, ExecRequest(cmd="echo recovered"))
        assert r.stdout == "recovered\n"
        assert await rt2.list_orphans({h.id}) == [h2.id]
        await rt2.destroy_orphan(h2.id)
        assert not pid_alive(h2.state["pid"])
        await rt2.destroy(h)
        await rt2.close()
    finally:
        for x in (h, h2):
            await rt.destroy(x)
    assert not pid_alive(h.state["pid"])


async def test_guest_panic_is_a_typed_error(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm(full_guest=True)  # the guard masks /proc/sysrq-trigger
    t = time.monotonic()
    with pytest.raises(SandboxStopped):
        await microvm.exec(
            h, ExecRequest(cmd="echo c > /proc/sysrq-trigger; sleep 5", timeout_s=10)
        )
    assert time.monotonic() - t < budget(20)
    assert not pid_alive(h.state["pid"])
    assert not await microvm.alive(h)
    # cleaned up: no QEMU of it left, its host cgroup gone
    assert h.id not in qemu_processes(microvm.qemu_tag)
    assert not microvm._cgroup(h.id).exists()


async def test_a_guest_that_ends_is_reported_when_it_happens(
    microvm: MicroVMRuntime, make_vm: MakeVM
) -> None:
    """No request needed: the runtime watches each QEMU and tells its listener when one
    ends by itself (issue 32, item 7: after a panic the API said "running" 15 s later);
    ends it makes itself are not reported."""
    ended: list[tuple[str, str]] = []
    got = asyncio.Event()

    def listener(sandbox_id: str, why: str) -> None:
        ended.append((sandbox_id, why))
        got.set()

    microvm.on_exit(listener)
    quiet = await make_vm()
    await microvm.destroy(quiet)
    h = await make_vm(full_guest=True)
    r = await microvm.exec(
        h, ExecRequest(cmd="(sleep 1; echo c > /proc/sysrq-trigger) </dev/null >/dev/null 2>&1 &")
    )
    assert r.exit_code == 0
    await asyncio.wait_for(got.wait(), budget(20))
    assert ended == [(h.id, "the guest kernel panicked")]
    assert not await microvm.alive(h) and not pid_alive(h.state["pid"])
    assert not microvm._cgroup(h.id).exists()
    with pytest.raises(SandboxStopped, match="panicked"):
        await microvm.exec(h, ExecRequest(cmd="true"))


async def test_console_log_stays_bounded(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """The guest's serial console goes to console.log on the host: a guest writing it
    without end must not fill the node's disk (issue 32, item 7). The newest part stays."""
    microvm.config.console_max_kb, microvm.config.watch_interval_s = 16, 0.2
    h = await make_vm(full_guest=True)
    console = Path(h.state["dir"]) / "console.log"
    r = await microvm.exec(
        h,
        ExecRequest(
            cmd="i=0; while [ $i -lt 2000 ]; do echo console-line-$i-padding-padding-padding; "
            "i=$((i+1)); done > /dev/console; echo console-last-line > /dev/console",
            timeout_s=120,
        ),
    )
    assert r.exit_code == 0, r.stderr
    # the guest's tty and serial port may still hold the last lines when the command ends
    # (under TCG they drain at the emulated port's pace): wait until the cut and the last
    # line are both there
    deadline = time.monotonic() + budget(10)
    text = console.read_text(errors="replace")
    while time.monotonic() < deadline and (
        len(text) > 16 << 10 or not text.rstrip().endswith("console-last-line")
    ):
        await asyncio.sleep(0.1)
        text = console.read_text(errors="replace")
    assert len(text) <= 16 << 10, len(text)
    assert "older bytes of this console were dropped" in text
    assert text.rstrip().endswith("console-last-line")
    # the sandbox and its console still work after the cut
    r = await microvm.exec(h, ExecRequest(cmd="echo after-the-cut > /dev/console"))
    assert r.exit_code == 0
    deadline = time.monotonic() + budget(5)
    while time.monotonic() < deadline and "after-the-cut" not in console.read_text(
        errors="replace"
    ):
        await asyncio.sleep(0.1)
    assert console.read_text(errors="replace").rstrip().endswith("after-the-cut")


async def test_unresponsive_agent_is_killed(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    h = await make_vm()
    vm = microvm._live[h.id]
    assert vm.qmp is not None
    await vm.qmp.execute("stop")  # freeze the guest behind the runtime's back
    t = time.monotonic()
    with pytest.raises(SandboxStopped):
        await microvm.exec(h, ExecRequest(cmd="true", timeout_s=1))
    assert time.monotonic() - t < budget(1 + microvm.config.exec_grace_s + 5)
    assert not pid_alive(h.state["pid"])
    assert h.id not in qemu_processes(microvm.qemu_tag)
    assert not microvm._cgroup(h.id).exists()


async def test_broken_layer_fails_cleanly(
    microvm: MicroVMRuntime, busybox_image: BusyboxImage, vm_home: Path
) -> None:
    bad = vm_home / "not-erofs.img"
    bad.write_bytes(os.urandom(1 << 20))
    spec = replace(
        new_spec(busybox_image), layer_paths=[str(bad)], layer_digests=["sha256:" + "0" * 64]
    )
    before = set(qemu_processes(microvm.qemu_tag))
    t = time.monotonic()
    with pytest.raises(SandboxError) as ei:
        await microvm.create(spec)
    assert time.monotonic() - t < budget(60)
    assert "mount layer0" in str(ei.value)
    assert set(qemu_processes(microvm.qemu_tag)) <= before
    assert not (microvm.sandbox_root / spec.id).exists()
    assert not microvm._cgroup(spec.id).exists()


async def test_bad_kernel_fails_cleanly(vm_home: Path, busybox_image: BusyboxImage) -> None:
    rt = MicroVMRuntime(
        Paths(vm_home),
        MicroVMConfig(pool_size=0, templates=False, cold_boot_timeout_s=20, keep_templates=True),
    )
    await rt.start()
    assert rt.artifacts is not None
    bogus = vm_home / "bogus-vmlinux"
    bogus.write_bytes(b"\x7fELF" + os.urandom(4096))
    rt.artifacts = replace(rt.artifacts, vmlinux=bogus)
    spec = new_spec(busybox_image)
    with pytest.raises(SandboxError):
        await rt.create(spec)
    assert spec.id not in qemu_processes(rt.qemu_tag)
    assert not (rt.sandbox_root / spec.id).exists()
    await rt.close()


async def test_full_writable_layer_is_a_typed_error(
    microvm: MicroVMRuntime, make_vm: MakeVM
) -> None:
    h = await make_vm(disk_mb=8)  # the template was booted with another size: resized at restore
    r = await microvm.exec(h, ExecRequest(cmd="df -m / | tail -1"))
    assert r.stdout.split()[1] == "8"
    with pytest.raises(QuotaExceeded):
        await microvm.files(h).write("/big", b"\0" * (10 << 20))
    r = await microvm.exec(h, ExecRequest(cmd="rm -f /big; echo still fine"))
    assert r.stdout == "still fine\n"


async def test_guest_limits_hold(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """memory_mb and pids hold inside the guest; what exceeds them dies visibly, the sandbox
    and its agent live on; a timeout kills the command's whole cgroup (setsid'ed children
    too)."""
    h = await make_vm(memory_mb=64, pids=32)
    r = await microvm.exec(h, ExecRequest(cmd="awk 'BEGIN{s=\"x\"; while(1) s=s s}'", timeout_s=60))
    assert r.signal == 9 and r.oom_killed and not r.timed_out, r
    r = await microvm.exec(
        h, ExecRequest(cmd="i=0; while [ $i -lt 100 ]; do sleep 5 & i=$((i+1)); done; wait")
    )
    assert r.exit_code != 0 and "fork" in r.stderr.lower(), r
    await microvm.exec(h, ExecRequest(cmd="kill -9 -1 2>/dev/null; true"))
    r = await microvm.exec(h, ExecRequest(cmd="setsid sleep 300 & sleep 300", timeout_s=1))
    assert r.timed_out
    count = "ps -o args | grep -c '^sleep 300'"  # the kill of its cgroup may still be under way
    polls = int(budget(5) / 0.05)
    r = await microvm.exec(
        h,
        ExecRequest(
            cmd=f"n=0; while [ $({count}) != 0 ] && [ $n -lt {polls} ]; do sleep 0.05;"
            f" n=$((n+1)); done; {count} || true"
        ),
    )
    assert r.stdout.strip() == "0", r.stdout
    r = await microvm.exec(h, ExecRequest(cmd="echo survived"))
    assert r.stdout == "survived\n" and not r.oom_killed


async def test_command_spawn_semantics(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """Commands start through clone3 (shared memory until execve, born in a reused leaf
    cgroup): PATH comes from the command's env, a script without ``#!`` runs with the shell,
    a leaf's earlier OOM kill is not reported again, and a leaf whose command left a
    background process is not handed to the next command."""
    h = await make_vm(memory_mb=64)
    script = "mkdir -p /opt/b && printf 'echo from-script \"$@\"\\n' > /opt/b/noshebang"
    await microvm.exec(h, ExecRequest(cmd=script + " && chmod 755 /opt/b/noshebang"))
    r = await microvm.exec(
        h, ExecRequest(cmd=["noshebang", "a1"], env={"PATH": "/opt/b:/bin:/usr/bin"})
    )
    assert r.exit_code == 0 and r.stdout == "from-script a1\n", r
    r = await microvm.exec(h, ExecRequest(cmd=["noshebang"], env={"PATH": "/bin"}))
    assert r.exit_code == 127 and "noshebang" in r.stderr, r
    # a file without the x bit earlier in PATH is passed over; alone it is "permission denied"
    await microvm.exec(
        h, ExecRequest(cmd="mkdir -p /opt/a && echo 'echo wrong' > /opt/a/noshebang")
    )
    r = await microvm.exec(
        h, ExecRequest(cmd=["noshebang", "a2"], env={"PATH": "/opt/a:/opt/b:/bin"})
    )
    assert r.exit_code == 0 and r.stdout == "from-script a2\n", r
    r = await microvm.exec(h, ExecRequest(cmd=["noshebang"], env={"PATH": "/opt/a"}))
    assert r.exit_code == 126 and "denied" in r.stderr.lower(), r
    r = await microvm.exec(h, ExecRequest(cmd=[""]))
    assert r.exit_code == 127, r
    r = await microvm.exec(h, ExecRequest(cmd="awk 'BEGIN{s=\"x\"; while(1) s=s s}'", timeout_s=60))
    assert r.oom_killed, r
    for _ in range(3):  # whichever leaf comes next, no stale OOM report
        r = await microvm.exec(h, ExecRequest(cmd=["true"]))
        assert r.exit_code == 0 and not r.oom_killed, r
    r = await microvm.exec(h, ExecRequest(cmd="setsid sleep 300 >/dev/null 2>&1 & echo started"))
    assert r.stdout == "started\n"
    bg_cgroup = (await microvm.exec(h, ExecRequest(cmd="cat /proc/$(pidof sleep)/cgroup"))).stdout
    seen = set()
    for _ in range(4):
        r = await microvm.exec(h, ExecRequest(cmd="cat /proc/self/cgroup", timeout_s=5))
        seen.add(r.stdout)
    assert bg_cgroup.strip() and bg_cgroup not in seen, (bg_cgroup, seen)
    r = await microvm.exec(h, ExecRequest(cmd="sleep 60", timeout_s=1))  # kills its own leaf only
    assert r.timed_out
    r = await microvm.exec(h, ExecRequest(cmd="pidof sleep"))
    assert r.stdout.strip(), "the background sleep of another command was killed"
