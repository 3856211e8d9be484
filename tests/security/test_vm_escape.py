"""Escape and abuse attempts against the VM tiers (``microvm``, ``vm``): what a command does
must never kill or stall the guest agent (the sandbox is lost with it), and by default a
command gets the container tier's protections (``tests/security/test_container_escape.py``).
``full_guest=True`` sandboxes get the whole guest; their agent still survives ``kill -9 -1``.

A static C probe, compiled on the host and copied in with ``files.write`` (the busybox image
has no compiler), makes the raw syscalls; it refuses to run outside a dsec guest.
After every attack the sandbox must still answer an exec."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget, vm_boot_budgets
from tests.vm.conftest import VM_HOME, BusyboxImage, _build_image, new_spec

from dsec.config import Paths
from dsec.contract.runtime import Handle, capabilities_of
from dsec.errors import DsecError, InvalidRequest, QuotaExceeded
from dsec.models import ExecRequest, ExecResult
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime
from dsec.runtimes.microvm.qemu import pid_alive
from dsec.runtimes.vm import VMRuntime

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]

PROBE_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/ioctl.h>
#include <sys/klog.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void report(const char *name, long rc) { printf("%s=%d\n", name, rc < 0 ? errno : 0); }

/* PTRACE_ATTACH to every process this one can see; detach again at once. */
static int ptrace_all(void) {
    DIR *d = opendir("/proc");
    struct dirent *de;
    int attached = 0;
    while (d && (de = readdir(d)) != NULL) {
        int pid = atoi(de->d_name);
        if (pid <= 0 || pid == getpid()) continue;
        if (ptrace(PTRACE_ATTACH, pid, 0, 0) == 0) {
            waitpid(pid, NULL, __WALL);
            ptrace(PTRACE_DETACH, pid, 0, 0);
            printf("attached=%d\n", pid);
            attached++;
        } else {
            printf("refused=%d:%d\n", pid, errno);
        }
    }
    return attached;
}

int main(int argc, char **argv) {
    /* Refuse to run anywhere but inside a dsec guest: the probe makes privileged syscalls
     * that must fail there, but would succeed on a host as root. */
    char comm[32] = {0};
    int c = open("/proc/1/comm", O_RDONLY);
    if (c < 0 || read(c, comm, sizeof comm - 1) <= 0 || strncmp(comm, "dsec-nsinit", 11) != 0 ||
        getenv("DSEC_PROBE_IN_SANDBOX") == NULL) {
        fprintf(stderr, "probe: not inside a dsec guest, refusing to run\n");
        return 2;
    }
    if (argc > 1 && strcmp(argv[1], "ptrace-all") == 0) {
        ptrace_all();
        return 0;
    }
    int fd = open("/tmp/probe-target", O_RDWR | O_CREAT, 0600);
    int p[2];
    if (pipe(p) < 0) return 3;
    report("XFS_IOC_SWAPEXT", ioctl(fd, 0xC0C0586DUL, 0));
    report("FICLONE", ioctl(fd, 0x40049409UL, p[0]));
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    grantpt(m);
    unlockpt(m);
    int s = open(ptsname(m), O_RDWR | O_NOCTTY);
    report("TIOCSTI", ioctl(s, 0x5412UL, "x"));
    int avail = 0;
    report("FIONREAD_allowed", ioctl(p[0], FIONREAD, &avail));
    long rc = ptrace(PTRACE_ATTACH, 1, 0, 0);
    report("ptrace_attach_1", rc);
    if (rc == 0) {
        waitpid(1, NULL, __WALL);
        ptrace(PTRACE_DETACH, 1, 0, 0);
    }
    struct timeval tv;
    gettimeofday(&tv, NULL);
    report("settimeofday", settimeofday(&tv, NULL));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    report("clock_settime", clock_settime(CLOCK_REALTIME, &ts));
    report("syslog", klogctl(10, NULL, 0)); /* SYSLOG_ACTION_SIZE_BUFFER */
    report("iopl", iopl(3));
    report("init_module", syscall(SYS_init_module, 0, 0, ""));
    report("finit_module", syscall(SYS_finit_module, -1, "", 0));
    report("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0xffff0000UL)); /* invalid flags */
    report("reboot", syscall(SYS_reboot, 0, 0, 0, 0));                     /* bad magic */
    report("swapon", syscall(SYS_swapon, "/nonexistent-dsec-probe", 0));
    report("dev_mem", open("/dev/mem", O_RDONLY));
    unlink("/tmp/probe-mem");
    report("mknod_mem", mknod("/tmp/probe-mem", S_IFCHR | 0600, makedev(1, 1)));
    report("mount", mount("tmpfs", "/nonexistent-dsec-probe", "tmpfs", 0, 0));
    report("umount", umount2("/nonexistent-dsec-probe", 0));
    report("bpf", syscall(SYS_bpf, 0, 0, 0));
    report("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
    report("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
    report("userfaultfd", syscall(SYS_userfaultfd, 0));
    report("setns", setns(fd, 0));
    report("clone3", syscall(SYS_clone3, 0, 0));
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    report("sethostname", sethostname(host, strlen(host)));
    report("socket_vsock", syscall(SYS_socket, 40, SOCK_STREAM, 0));
    report("socket_inet_allowed", syscall(SYS_socket, AF_INET, SOCK_STREAM, 0));
    report("unshare_ns", unshare(CLONE_NEWNS)); /* last: a full guest's probe then lives there */
    return 0;
}
"""

# probe result -> errno under the guard (EPERM unless said otherwise). As the container tier,
# plus what only a VM guest offers (the clock, the kernel log, port I/O, /dev/mem).
GUARDED = {
    "XFS_IOC_SWAPEXT": 1, "FICLONE": 1, "TIOCSTI": 1, "FIONREAD_allowed": 0,
    "ptrace_attach_1": 1, "settimeofday": 1, "clock_settime": 1, "syslog": 1, "iopl": 1,
    "init_module": 1, "finit_module": 1, "kexec_load": 1, "reboot": 1, "swapon": 1,
    "dev_mem": 2, "mknod_mem": 1, "mount": 1, "umount": 1, "bpf": 1, "perf_event_open": 1,
    "io_uring_setup": 1, "userfaultfd": 1, "setns": 1, "clone3": 38, "sethostname": 1,
    "socket_vsock": 97, "socket_inet_allowed": 0, "unshare_ns": 1,
}  # fmt: skip
# what a full guest's probe gets past the guard: another result than GUARDED's (0, or the
# kernel's own complaint about the probe's bogus arguments)
FULL_ALLOWED = (
    "TIOCSTI", "ptrace_attach_1", "settimeofday", "clock_settime", "syslog", "iopl",
    "init_module", "finit_module", "kexec_load", "reboot", "swapon", "dev_mem", "mknod_mem",
    "mount", "umount", "setns", "sethostname", "unshare_ns",
)  # fmt: skip

TIERS = ("microvm", "vm")


@pytest.fixture(scope="module")
def image() -> Iterator[BusyboxImage]:
    VM_HOME.mkdir(parents=True, exist_ok=True)
    yield _build_image(VM_HOME)
    # the templates' RAM files live on /dev/shm (host memory); the tiers' cgroup parents
    for cls in (MicroVMRuntime, VMRuntime):
        rt = cls(Paths(VM_HOME))
        rt.remove_templates()
        for rel in (rt.cgroup_prefix, rt.cgroup_prefix.split("/")[0]):
            with contextlib.suppress(OSError):
                cgroup(rel).remove_if_empty()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("vm-probe")
    (d / "probe.c").write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-static", "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    return (d / "probe").read_bytes()


@pytest.fixture(params=TIERS)
async def runtime(request: pytest.FixtureRequest, image: BusyboxImage) -> AsyncIterator[Any]:
    cls = VMRuntime if request.param == "vm" else MicroVMRuntime
    rt = cls(
        Paths(VM_HOME),
        MicroVMConfig(
            pool_size=0, exec_grace_s=budget(3.0), keep_templates=True, **vm_boot_budgets()
        ),
    )
    await rt.start()
    if not capabilities_of(rt).available:
        pytest.fail(f"{request.param} tier unavailable: {capabilities_of(rt).reason}")
    yield rt
    await rt.close()


@pytest.fixture
async def make(
    runtime: MicroVMRuntime, image: BusyboxImage, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    made: list[Handle] = []

    async def create(**kw: Any) -> Handle:
        kw.setdefault("disk_mb", 64)
        h = await runtime.create(new_spec(image, tier=runtime.tier, **kw))
        made.append(h)
        return h

    yield create
    for h in made:
        rep = getattr(request.node, "rep_call", None)
        console = Path(h.state["dir"]) / "console.log"
        if rep is not None and rep.failed and console.exists():
            print(f"--- console of {h.id} ---\n{console.read_text(errors='replace')[-3000:]}")
        await asyncio.wait_for(runtime.destroy(h), 30)


async def run(rt: MicroVMRuntime, h: Handle, cmd: str | list[str], **kw: Any) -> ExecResult:
    kw.setdefault("timeout_s", 60)
    return await rt.exec(h, ExecRequest(cmd=cmd, **kw))


async def answers(rt: MicroVMRuntime, h: Handle) -> None:
    """The sandbox (its agent) still runs commands."""
    assert pid_alive(h.state["pid"]), "QEMU is gone"
    r = await run(rt, h, "echo still-here", timeout_s=30)
    assert r.stdout == "still-here\n", r


def _parse(stdout: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split("=") for line in stdout.splitlines())}


async def _probe(
    rt: MicroVMRuntime, h: Handle, probe: bytes, *args: str, user: str | None = None
) -> str:
    await rt.files(h).write("/tmp/probe", probe, mode=0o755)
    r = await run(rt, h, ["/tmp/probe", *args], user=user, env={"DSEC_PROBE_IN_SANDBOX": "1"})
    assert r.exit_code == 0, r
    return r.stdout


async def test_guard_probe_as_root_and_user(
    runtime: MicroVMRuntime, make: Any, probe: bytes
) -> None:
    """The container tier's seccomp filter, capabilities and no_new_privs, and the VM-only
    kernel interfaces (clock, kernel log, port I/O, modules, /dev/mem) are refused."""
    h = await make()
    for user in (None, "nobody"):
        assert _parse(await _probe(runtime, h, probe, user=user)) == GUARDED, user
    r = await run(runtime, h, "grep -E '^(Seccomp|NoNewPrivs|CapBnd|CapEff):' /proc/self/status")
    status = dict(line.split(":\t") for line in r.stdout.splitlines())
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1", status
    # the container tier's capability set: no SYS_ADMIN (21), SYS_RAWIO (17), SYS_TIME (25),
    # SYS_MODULE (16), SYS_BOOT (22), SYS_PTRACE (19), SYSLOG (34), MKNOD (27)
    bnd = int(status["CapBnd"], 16)
    for cap in (16, 17, 19, 21, 22, 25, 27, 34):
        assert not bnd & (1 << cap), (cap, status)
    assert int(status["CapEff"], 16) == bnd
    await answers(runtime, h)


async def test_kernel_interfaces_hidden(runtime: MicroVMRuntime, make: Any) -> None:
    """kcore, kpagecgroup & co read as empty, /dev has no memory or disk devices, sysrq does
    nothing, dmesg, date -s, mount, insmod, hostname fail: the guest keeps running."""
    h = await make()
    r = await run(
        runtime, h,
        "for f in /proc/kcore /proc/kpagecgroup /proc/kpageflags /proc/kpagecount /proc/kmsg "
        "/proc/timer_list /proc/keys /proc/sched_debug; do head -c 16 $f 2>/dev/null | wc -c; done",
    )  # fmt: skip
    assert set(r.stdout.split()) == {"0"}, r
    r = await run(
        runtime, h, "grep -r x /proc/kpagecgroup /sys/firmware 2>&1 | head -c 200; echo rc"
    )
    assert r.stdout.endswith("rc\n")
    r = await run(runtime, h, "ls /dev")
    assert set(r.stdout.split()) <= {
        "null", "zero", "full", "random", "urandom", "tty", "tty1", "pts", "shm", "ptmx", "fd",
        "stdin", "stdout", "stderr",
    }, r.stdout  # fmt: skip
    for dev in ("mem", "kmem", "port", "kmsg", "vda", "vdb", "console", "ttyS0"):
        assert dev not in r.stdout.split()
    # sysrq: masked (c would panic the guest), /proc/sys read-only
    r = await run(runtime, h, "echo c > /proc/sysrq-trigger; echo 1 > /proc/sys/kernel/sysrq")
    assert r.exit_code != 0 and "Read-only" in r.stderr, r
    r = await run(runtime, h, "touch /sys/x")
    assert r.exit_code != 0 and "Read-only" in r.stderr, r
    r = await run(runtime, h, "date -s 2001-01-01")  # busybox date says so, but exits 0
    assert "not permitted" in r.stderr, r
    for cmd in ("dmesg", "mount -t tmpfs none /tmp", "hostname pwned",
                "mount -o remount,rw /proc/sys", "umount /proc/kcore",
                "insmod /nonexistent.ko", "echo 1 > /sys/fs/cgroup/cmd/pids.max"):  # fmt: skip
        r = await run(runtime, h, cmd)
        assert r.exit_code != 0, (cmd, r)
    r = await run(runtime, h, "date +%Y; hostname")
    assert r.stdout.split() == [time.strftime("%Y"), "sandbox"], r
    # the commands' limits are readable (read-only cgroup2), as a container's are
    r = await run(runtime, h, "cat /sys/fs/cgroup/cmd/memory.max /sys/fs/cgroup/cmd/pids.max")
    assert r.stdout.split() == [str(256 << 20), "256"], r
    await answers(runtime, h)


async def test_kill_everything(runtime: MicroVMRuntime, make: Any) -> None:
    """kill -9 -1, kill of pid 1 and of every pid number, SIGSTOP to all: only the commands'
    own processes die; the agent has no pid in their namespace."""
    h = await make()
    await run(runtime, h, "sleep 300 >/dev/null 2>&1 & echo started")
    polls = int(budget(10) / 0.05)  # the background shell may not have exec'd sleep yet
    r = await run(
        runtime,
        h,
        f"n=0; until ps -o args | grep -q '^[s]leep 300' || [ $n -ge {polls} ]; "
        "do sleep 0.05; n=$((n+1)); done; ps -o pid,args",
    )
    assert "sleep 300" in r.stdout and "agent" not in r.stdout, r
    r = await run(runtime, h, "kill -9 -1 2>/dev/null; echo done")
    assert r.stdout == "done\n", r
    await answers(runtime, h)
    assert "sleep 300" not in (await run(runtime, h, "ps -o args")).stdout
    await run(runtime, h, "kill -9 1; kill -STOP 1; kill -STOP -1; kill -TERM -1; true")
    await answers(runtime, h)
    # every pid number the guest has: none is the agent
    r = await run(
        runtime, h, "i=1; while [ $i -le 400 ]; do [ $i = $$ ] || kill -9 $i 2>/dev/null; i=$((i+1)); done; echo swept",
        timeout_s=120,
    )  # fmt: skip
    assert r.stdout == "swept\n", r
    await answers(runtime, h)
    await run(runtime, h, "sleep 300 >/dev/null 2>&1 &")
    count = "ps -o args | grep -c '^[s]leep 300'"  # the killed one may still be exiting
    polls = int(budget(5) / 0.05)
    r = await run(
        runtime,
        h,
        f"cat /proc/1/comm; kill -9 -1; n=0; while [ $({count}) != 0 ] && [ $n -lt {polls} ];"
        f" do sleep 0.05; n=$((n+1)); done; {count}",
    )
    assert r.stdout.split() == ["dsec-nsinit", "0"], r


async def test_ptrace_of_everything(runtime: MicroVMRuntime, make: Any, probe: bytes) -> None:
    """A guarded command cannot ptrace anything it did not start; the agent is not there to
    be traced at all."""
    h = await make()
    await run(runtime, h, "sleep 300 >/dev/null 2>&1 &")
    out = await _probe(runtime, h, probe, "ptrace-all")
    assert "attached=" not in out and "refused=1:1" in out, out
    await answers(runtime, h)


async def test_no_memory_writes_into_other_commands(runtime: MicroVMRuntime, make: Any) -> None:
    """A process a command leaves behind cannot open ``/proc/<pid>/mem`` of a process another
    command started (each command is a Landlock domain of its own: docs/design/tenancy.md),
    so it cannot rewrite a grader started later; within one command it still can."""
    h = await make()
    r = await run(runtime, h, "sleep 300 >/dev/null 2>&1 & echo $!")
    pid = int(r.stdout)
    polls = int(budget(10) / 0.05)
    await run(
        runtime,
        h,
        f"n=0; until grep -q '^sleep' /proc/{pid}/cmdline || [ $n -ge {polls} ];"
        " do sleep 0.05; n=$((n+1)); done",
    )
    r = await run(runtime, h, f"if (: 3<>/proc/{pid}/mem); then echo opened; else echo refused; fi")
    assert r.stdout == "refused\n", r
    r = await run(
        runtime, h, "sleep 300 & p=$!; if (: 3<>/proc/$p/mem); then echo opened; fi; kill $p"
    )
    assert r.stdout == "opened\n", r
    await answers(runtime, h)


async def test_memory_hog_and_fork_bomb(runtime: MicroVMRuntime, make: Any) -> None:
    """The OOM killer takes the command, a fork bomb stays in the commands' pids limit and
    dies with its command, and one left running (daemonised: the command returned) leaves
    room for the next command (each command's leaf holds the limit less a reserve)."""
    h = await make(memory_mb=64, pids=64)
    r = await run(runtime, h, "awk 'BEGIN{s=\"x\"; while(1) s=s s}'")
    assert r.signal == 9 and r.oom_killed, r
    await answers(runtime, h)
    r = await run(runtime, h, "b() { b | b & }; b; sleep 60", timeout_s=5)
    assert r.timed_out, r  # the timeout kills its whole leaf, the bomb with it
    await answers(runtime, h)
    r = await run(runtime, h, "setsid sh -c 'b() { b | b & }; b' >/dev/null 2>&1 & echo left")
    assert r.stdout == "left\n", r
    await asyncio.sleep(3)  # let it fill its leaf
    t = time.monotonic()
    await answers(runtime, h)  # room for this command
    count = "ps -o args | grep -c '[b]() {'"  # the kill's victims may still be exiting
    polls = int(budget(5) / 0.05)
    r = await run(
        runtime,
        h,
        f"kill -9 -1 2>/dev/null; n=0; while [ $({count}) != 0 ] && [ $n -lt {polls} ];"
        f" do sleep 0.05; n=$((n+1)); done; {count} || true",
    )
    assert r.stdout.strip() == "0", r  # the bomb is gone
    assert time.monotonic() - t < budget(60)
    await answers(runtime, h)


async def test_disk_fill_does_not_stall(runtime: MicroVMRuntime, make: Any) -> None:
    """Filling the writable layer: commands get ENOSPC, the agent keeps answering, and the file
    API reports a full disk as QuotaExceeded (or writes into the root reserve), never hangs."""
    h = await make(disk_mb=24)
    t = time.monotonic()
    r = await run(
        runtime, h, "dd if=/dev/zero of=/fill bs=1M count=200 2>&1; sync; df -m /", timeout_s=120
    )
    assert "space" in r.stdout.lower(), r
    await answers(runtime, h)
    try:
        await asyncio.wait_for(runtime.files(h).write("/after-fill", b"x" * (2 << 20)), budget(30))
    except QuotaExceeded:
        pass
    await run(runtime, h, "rm -f /fill /after-fill")
    await runtime.files(h).write("/after-rm", b"ok")
    assert await runtime.files(h).read("/after-rm", 10) == b"ok"
    assert time.monotonic() - t < budget(150)
    await answers(runtime, h)


async def test_agent_channel_and_file_api_unreachable(runtime: MicroVMRuntime, make: Any) -> None:
    """No command can open the agent's port (no node, no mknod), see its fds, or stall its
    file API with a FIFO (or a device) where the host reads or writes."""
    h = await make()
    r = await run(
        runtime, h,
        "ls /dev | grep -c vport; for p in /sys/class/virtio-ports/*; do d=$(cat $p/dev); "
        "mknod /tmp/p c ${d%:*} ${d#*:}; done",
    )  # fmt: skip
    assert r.stdout.split()[0] == "0" and "not permitted" in r.stderr.lower(), r
    r = await run(runtime, h, "ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c vport || true")
    assert r.stdout.strip() == "0", r
    await run(runtime, h, "mkfifo /tmp/fifo; ln -s /dev/zero /tmp/zero")
    files = runtime.files(h)
    for path in ("/tmp/fifo", "/tmp/zero"):
        t = time.monotonic()
        with pytest.raises(InvalidRequest):
            await asyncio.wait_for(files.read(path, 1 << 20), budget(10))
        with pytest.raises(InvalidRequest):
            await asyncio.wait_for(files.write(path, b"x"), budget(10))
        assert time.monotonic() - t < budget(10)  # refused, not stalled on the FIFO
    await answers(runtime, h)


async def test_full_guest_opt_in(runtime: MicroVMRuntime, make: Any, probe: bytes) -> None:
    """full_guest=True: the kernel's interfaces are there (dmesg, /dev/mem, kcore, the clock,
    mount, ptrace, the agent's port is still exclusive), and the agent survives kill -9 -1,
    a ptrace of everything and a kill of its commands' namespace init (sysrq i)."""
    h = await make(full_guest=True)
    assert h.state["full_guest"] is True
    res = _parse(await _probe(runtime, h, probe))
    for name in FULL_ALLOWED:
        assert res[name] != GUARDED[name], (name, res)
    assert res["dev_mem"] == 0 and res["syslog"] == 0 and res["clock_settime"] == 0, res
    r = await run(runtime, h, "dmesg | grep -c Linux; head -c 16 /proc/kcore | wc -c; ls /dev/mem")
    assert int(r.stdout.split()[0]) >= 1 and r.stdout.split()[1] == "16", r
    r = await run(
        runtime, h, "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m && echo mounted && umount /tmp/m"
    )
    assert r.stdout == "mounted\n", r
    # the port is exclusive: even a full guest's mknod'ed node cannot open it
    r = await run(
        runtime, h,
        "for p in /sys/class/virtio-ports/*; do d=$(cat $p/dev); rm -f /tmp/p; "
        "mknod /tmp/p c ${d%:*} ${d#*:}; done; echo x > /tmp/p",
    )  # fmt: skip
    assert r.exit_code != 0 and "busy" in r.stderr.lower(), r
    await run(runtime, h, "kill -9 -1 2>/dev/null; true")
    await answers(runtime, h)
    out = await _probe(runtime, h, probe, "ptrace-all")
    assert "attached=1" in out, out  # it could trace its own namespace's init, nothing above
    await answers(runtime, h)
    # a full guest can kill the commands' namespace init: the agent builds it again
    await run(runtime, h, "echo i > /proc/sysrq-trigger; sleep 2")
    await answers(runtime, h)
    r = await run(runtime, h, "cat /proc/1/comm; dmesg >/dev/null && echo dmesg-ok")
    assert r.stdout.split() == ["dsec-nsinit", "dmesg-ok"], r
    # the mode cannot be taken back from a full guest
    vm = runtime._live[h.id]
    assert vm.agent is not None
    with pytest.raises(DsecError) as ei:
        await vm.agent.setup("sandbox", 0, full_guest=False)
    assert "full guest" in str(ei.value)


async def test_guard_holds_across_suspend_and_fork(
    runtime: MicroVMRuntime, make: Any, image: BusyboxImage
) -> None:
    """A suspended and restored sandbox and its memory forks keep their mode."""
    guarded = await make()
    full = await make(full_guest=True)
    await runtime.suspend(guarded)
    r = await run(runtime, guarded, "dmesg")  # restores it
    assert r.exit_code != 0, r
    snap = await runtime.memory_snapshot(full)
    try:
        child = await runtime.create_from_memory(
            snap, new_spec(image, tier=runtime.tier, full_guest=True, disk_mb=64)
        )
    finally:
        await runtime.drop_memory_snapshot(snap)
    try:
        r = await run(runtime, child, "dmesg | grep -c Linux")
        assert int(r.stdout) >= 1, r
    finally:
        await runtime.destroy(child)
