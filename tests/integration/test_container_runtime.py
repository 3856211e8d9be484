"""The container tier end to end on this node: crun (or runc) over EROFS layers, exec through
dsec_execd, host-side files, teardown. Needs root, the kernel features of a dsec node, crun
or runc, gcc, libseccomp-dev and busybox-static."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget

from dsec.config import Paths
from dsec.contract.isolation import MASKED_PATHS, RULES
from dsec.contract.runtime import Handle, Runtime, SandboxSpec, capabilities_of
from dsec.errors import Conflict, InvalidRequest, SandboxStopped
from dsec.layers.mounts import LayerMounts, mountinfo_entries
from dsec.layers.store import LayerStore
from dsec.models import ExecRequest, ExecResult
from dsec.privileged.cgroups import Cgroup, cgroup
from dsec.privileged.mount import mount_points
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

Factory = Callable[..., Awaitable[Handle]]


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Paths, list[str], list[str]]]:
    """A private DSEC_HOME with the busybox image built (once per module)."""
    home = Path(f"/tmp/dsec-ct-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    paths = Paths(home)
    paths.ensure()
    store = LayerStore(paths.layers, paths.scratch)
    image = store.ensure_image_sync("busybox")
    layer_paths = [str(store.layer_path(d)) for d in image.layers]
    yield paths, layer_paths, list(image.layers)
    store.close()
    mounts = LayerMounts(paths.layer_mounts)
    mounts.adopt_existing()  # layer mounts held by the runtimes of the tests
    mounts.unmount_unused()
    assert not mount_points(home), f"mounts left under {home}"
    shutil.rmtree(home)


@pytest.fixture
async def runtime(node: tuple[Paths, list[str], list[str]]) -> AsyncIterator[ContainerRuntime]:
    paths, _, _ = node
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    await rt.start()
    assert capabilities_of(rt).available, capabilities_of(rt).reason
    yield rt
    await rt.close()


@pytest.fixture
async def make(
    runtime: ContainerRuntime, node: tuple[Paths, list[str], list[str]]
) -> AsyncIterator[Factory]:
    """Factory of sandboxes; destroys what it made and checks nothing is left."""
    _, layer_paths, digests = node
    made: list[Handle] = []

    async def factory(**kw: object) -> Handle:
        args: dict = dict(
            id=f"sb-t-{uuid.uuid4().hex[:10]}",
            tier="container",
            layer_paths=layer_paths,
            layer_digests=digests,
            cpu=1.0,
            memory_mb=256,
            disk_mb=64,
            pids=256,
            env={},
            user=None,
            workdir="/",
        )
        args.update(kw)
        handle = await runtime.create(SandboxSpec(**args))
        made.append(handle)
        return handle

    yield factory
    for h in made:
        await runtime.destroy(h)
        assert_gone(runtime, h.id)


def assert_gone(runtime: ContainerRuntime, sandbox_id: str) -> None:
    sandbox_dir = runtime.paths.sandboxes / sandbox_id
    assert not mount_points(sandbox_dir), "mounts left"
    assert not sandbox_dir.exists(), "sandbox dir left"
    for d in cgroup(f"{runtime.cgroup_parent}/{sandbox_id}").every_dir():
        assert not d.exists(), f"cgroup left: {d}"
    assert not (runtime.state_root / sandbox_id).exists(), "OCI state left"


def limits_applied(cg: Cgroup, **limits: Any) -> list[str]:
    """The writes of :meth:`Cgroup.limit_writes` for ``limits`` (``cpu``, ``memory_bytes``,
    ``pids``) whose value ``cg`` does not have: empty when it has them, on either layout."""
    wrong = []
    for w in cg.limit_writes(**limits):
        have = (cg.dirs()[w.hierarchy] / w.file).read_text().split()
        if have != w.value.split():
            wrong.append(f"{w.file}: {' '.join(have)} (not {w.value})")
    return wrong


async def run(rt: ContainerRuntime, h: Handle, cmd: str | list[str], **kw: object) -> ExecResult:
    return await rt.exec(h, ExecRequest(cmd=cmd, **kw))


async def test_create_exec_files_destroy(runtime: ContainerRuntime, make: Factory) -> None:
    assert isinstance(runtime, Runtime)
    caps = capabilities_of(runtime)
    assert caps.tier == "container" and caps.pause and caps.snapshot and caps.tty
    h = await make(hostname="box1")
    assert await runtime.alive(h)
    # sandbox directories are on the runtime's own tmpfs (unmounted at close: see `node`)
    root = runtime.paths.sandboxes
    assert [m.fstype for m in mountinfo_entries(root) if m.mountpoint == root] == ["tmpfs"]
    r = await run(
        runtime, h, "echo hello; hostname; cat /proc/1/cmdline; echo; ip -o link | cut -d: -f2"
    )
    assert r.ok and r.stdout.replace("\0", "").split("\n")[:3] == [
        "hello",
        "box1",
        "/dev/.dsec-init",
    ]
    assert r.stdout.split()[-1] == "lo"  # a network namespace with only loopback
    files = runtime.files(h)
    await files.write("/work/a.txt", b"from host")
    r = await run(runtime, h, "cat /work/a.txt; echo -n inside > /work/b.txt")
    assert r.stdout == "from host"
    assert await files.read("/work/b.txt", 100) == b"inside"
    assert {i.name for i in await files.list("/work")} == {"a.txt", "b.txt"}
    assert (await files.stat("/bin/sh")).type == "symlink"
    await files.mkdir("/work/sub")
    await files.rename("/work/a.txt", "/work/sub/a.txt")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("t/x")
        ti.size = 3
        tar.addfile(ti, io.BytesIO(b"xyz"))
    assert await files.upload_tar("/work", buf.getvalue()) == 1
    r = await run(runtime, h, "cat /work/t/x /work/sub/a.txt")
    assert r.stdout == "xyzfrom host"
    with tarfile.open(fileobj=io.BytesIO(await files.download_tar("/work", 1 << 20))) as tar:
        assert "t/x" in tar.getnames() and "sub/a.txt" in tar.getnames()
    await files.remove("/work", recursive=True)
    assert (await run(runtime, h, "test -e /work")).exit_code == 1
    await runtime.destroy(h)
    assert_gone(runtime, h.id)
    assert not await runtime.alive(h)
    await runtime.destroy(h)  # idempotent
    with pytest.raises(SandboxStopped):
        await run(runtime, h, "true")


async def test_the_boot_id_cannot_be_written_from_inside(
    runtime: ContainerRuntime, make: Factory
) -> None:
    """The sandbox's boot id is a node file bound over ``/proc/sys/kernel/random/boot_id``:
    its root can neither overwrite nor grow it (the read-only /proc/sys rebind left a
    writable copy of the bind on top, and the file is on the node-wide sandbox tmpfs)."""
    h = await make()
    node_file = runtime.paths.sandboxes / h.id / "boot_id"
    before = node_file.read_text()
    r = await run(
        runtime,
        h,
        "f=/proc/sys/kernel/random/boot_id; echo PWNED > $f; echo rc=$?; "
        "dd if=/dev/zero of=$f bs=1M count=8 2>/dev/null; echo rc=$?; cat $f",
    )
    assert r.stdout.count("rc=0") == 0, r
    assert r.stdout.splitlines()[-1] == before.strip(), r
    assert node_file.read_text() == before
    await runtime.destroy(h)
    assert_gone(runtime, h.id)  # the immutable file did not keep the directory


def _proc_mask_dirs() -> list[str]:
    """The masked paths under /proc that are directories on this host."""
    return [p for p in MASKED_PATHS if p.startswith("/proc/") and os.path.isdir(p)]


async def test_few_superblocks_masks_still_hold(runtime: ContainerRuntime, make: Factory) -> None:
    """Every superblock on the host costs every memory cgroup the kernel makes
    (``bundle.SUPERBLOCKS_NOTE``): a container adds only its /proc, /sys, /dev, /dev/pts and
    mqueue (besides its root and writable layer) and a tmpfs per masked directory of /proc.
    The masked directories of /sys are read-only binds of one empty directory, and /dev/shm
    is a sticky, writable directory of /dev."""
    h = await make()
    r = await run(
        runtime,
        h,
        "cat /proc/self/mountinfo; echo ==; "
        "stat -c %a /dev/shm; echo x > /dev/shm/f && cat /dev/shm/f; "
        "for d in /proc/acpi /sys/firmware /sys/kernel/debug; do "
        "[ -d $d ] || continue; echo $d:$(ls -A $d | wc -l); touch $d/x 2>/dev/null && echo W; "
        "done",
    )
    mountinfo, _, checks = r.stdout.partition("==\n")

    # (fs type, mount point) of each mount of a filesystem's root (a bind of a directory
    # shows that directory as its root): one per superblock the container made
    roots = [
        (line.split(" - ")[1].split()[0], line.split()[4])
        for line in mountinfo.splitlines()
        if line.split()[3] == "/" and line.split()[4] != "/"
    ]
    # the OCI runtime's own masks of directories under /proc (a tmpfs each: runc refuses
    # binds on the container's procfs) are the only tmpfs besides /dev
    proc_masks = [("tmpfs", p) for p in _proc_mask_dirs()]
    assert sorted(roots) == sorted(
        [
            ("devpts", "/dev/pts"),
            ("mqueue", "/dev/mqueue"),
            ("proc", "/proc"),
            ("sysfs", "/sys"),
            ("tmpfs", "/dev"),
            *proc_masks,
        ]
    ), roots  # no tmpfs per /sys mask, none for /dev/shm
    lines = checks.split()
    assert lines[:2] == ["1777", "x"], r
    masked = [ln for ln in lines[2:] if ":" in ln]
    assert masked and all(ln.endswith(":0") for ln in masked), r  # empty
    assert "W" not in lines, r  # and read-only


async def test_env_cwd_user_stdin(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make(env={"FROM_SPEC": "spec", "OVERRIDE": "spec"}, workdir="/tmp", user="sandbox")
    r = await run(runtime, h, "id -u; id -g; pwd; echo $FROM_SPEC $OVERRIDE $HOME; echo $PATH")
    lines = r.stdout.splitlines()
    assert lines[:4] == ["1000", "1000", "/tmp", "spec spec /home/sandbox"]
    assert "/usr/bin" in lines[4]
    r = await run(
        runtime, h, "echo $OVERRIDE; pwd; id -un", env={"OVERRIDE": "req"}, cwd="/", user="root"
    )
    assert r.stdout.splitlines() == ["req", "/", "root"]
    r = await run(runtime, h, ["id", "-u"], user="4321:4321")
    assert r.stdout.strip() == "4321"
    r = await run(
        runtime, h, "wc -c; cat /proc/self/status | grep CapEff", stdin="x" * 100_000, user="0"
    )
    assert r.stdout.split()[0] == "100000"
    assert r.stdout.split()[-1] != "0000000000000000"  # root keeps the container's capabilities
    r = await run(runtime, h, "cat", stdin_b64="AAEC/w==", user="0")
    assert r.stdout.encode("utf-8", "surrogateescape")[:2] == b"\x00\x01"
    r = await run(runtime, h, "grep CapEff /proc/self/status")  # default user: non-root
    assert r.stdout.split()[-1] == "0000000000000000"
    with pytest.raises(InvalidRequest):
        await run(runtime, h, "true", user="nosuchuser")
    with pytest.raises(InvalidRequest):
        await run(runtime, h, "true", cwd="/does/not/exist")


async def test_exit_codes_and_signals(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make()
    assert (await run(runtime, h, "exit 7")).exit_code == 7
    r = await run(runtime, h, "kill -TERM $$")
    assert r.exit_code is None and r.signal == 15
    r = await run(runtime, h, ["/no/such/binary"])
    assert r.exit_code == 127 and "No such file" in r.stderr
    r = await run(runtime, h, ["/etc/passwd"])
    assert r.exit_code == 126
    r = await run(runtime, h, "echo out; echo err >&2; exit 1")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 1)


async def test_commands_start_with_default_signal_dispositions(
    runtime: ContainerRuntime, make: Factory
) -> None:
    """A server started with SIGINT and SIGQUIT ignored (a background job of a shell) hands
    that to its exec servers, but a command starts with every signal at its default (an
    ignored SIGINT survives exec: the command could not be interrupted)."""
    ignored = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)}
    try:
        h = await make()
    finally:
        for s, old in ignored.items():
            signal.signal(s, old)
    r = await run(runtime, h, ["grep", "SigIgn", "/proc/self/status"])
    assert int(r.stdout.split()[1], 16) == 0, r.stdout
    r = await run(runtime, h, "kill -INT $$; echo survived")
    assert (r.signal, r.stdout) == (signal.SIGINT, ""), r


async def test_crun_gets_the_policy_compiled_once(
    runtime: ContainerRuntime, make: Factory, node: tuple[Paths, list[str], list[str]]
) -> None:
    """With crun the seccomp rules go in as the program the exec server's compiler made
    from them (no per-container compile); the init runs under it."""
    if os.path.basename(runtime.oci_runtime or "") != "crun":
        pytest.skip("the compiled program is handed to crun only")
    h = await make()
    paths, _, _ = node
    cfg = json.loads((paths.sandboxes / h.id / "config.json").read_text())
    assert "seccomp" not in cfg["linux"]
    prog = base64.b64decode(cfg["annotations"]["run.oci.seccomp_bpf_data"])
    assert runtime._execd_bin is not None and runtime._policy_file is not None
    again = subprocess.run(
        [str(runtime._execd_bin), "--bpf", str(runtime._policy_file)],
        capture_output=True,
        check=True,
    ).stdout
    assert prog == again and len(prog) % 8 == 0 and len(prog) > 8 * len(RULES)
    r = await run(runtime, h, "grep Seccomp: /proc/1/status")
    assert r.stdout.split() == ["Seccomp:", "2"]


async def test_exec_servers_install_the_compiled_program(
    runtime: ContainerRuntime, make: Factory
) -> None:
    """Every exec server is handed the compiled program (no libseccomp compile at each
    sandbox's start); its commands run under it, denied calls fail as the policy says; a
    program file that is not whole instructions stops the server with a clear error."""
    h = await make()
    bpf = runtime._bpf_file
    assert bpf is not None and runtime._execd_bin is not None and runtime._policy_file is not None
    server = runtime._live[h.id].server
    assert server is not None
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    assert f"bpf={bpf}".encode() in args
    r = await run(runtime, h, "grep Seccomp: /proc/self/status; unshare -U true; echo rc=$?")
    assert r.stdout.split()[:2] == ["Seccomp:", "2"] and "rc=1" in r.stdout, r
    assert "not permitted" in r.stderr, r
    broken = bpf.with_name("broken.bpf")
    broken.write_bytes(bpf.read_bytes()[:-3])  # not a whole number of 8-byte instructions
    try:
        out = subprocess.run(
            [str(runtime._execd_bin), "0", str(runtime._policy_file), f"bpf={broken}"],
            capture_output=True,
            timeout=10,
        )
    finally:
        broken.unlink()
    assert out.returncode == 1 and b"bad bpf file" in out.stderr, out


async def test_command_search_follows_the_commands_path(
    runtime: ContainerRuntime, make: Factory
) -> None:
    """The exec server searches the PATH of the command's own environment (as execvp
    would with it), without touching its own memory (it runs commands from a vfork)."""
    h = await make()
    setup = "mkdir -p /t/a /t/b && printf 'echo from-script\\n' > /t/b/noshebang"
    setup += " && chmod +x /t/b/noshebang && echo x > /t/a/plain && cp /t/a/plain /t/b/plain"
    setup += " && chmod +x /t/b/plain"
    assert (await run(runtime, h, setup)).exit_code == 0
    # not executable in the first entry (EACCES), then found in the second
    r = await run(runtime, h, ["noshebang"], env={"PATH": "/t/a:/t/b"})
    assert (r.exit_code, r.stdout) == (0, "from-script\n")  # no shebang: run by /bin/sh
    r = await run(runtime, h, ["plain"], env={"PATH": "/t/a:/nonexistent"})
    assert r.exit_code == 126 and "Permission denied" in r.stderr  # EACCES seen, nothing else
    r = await run(runtime, h, ["ls"], env={"PATH": "/nonexistent:/t/a"})
    assert r.exit_code == 127 and "No such file" in r.stderr  # not on this PATH
    r = await run(runtime, h, ["ls", "/t"], env={"PATH": "/nonexistent::/bin"})
    assert (r.exit_code, r.stdout) == (0, "a\nb\n")
    assert (await run(runtime, h, ["/bin/echo", "by-path"])).stdout == "by-path\n"


async def test_timeout_kills_process_group(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make()
    t0 = time.monotonic()
    r = await run(runtime, h, "sleep 100 & sleep 100 & echo started; sleep 100", timeout_s=0.5)
    assert r.timed_out and r.signal == 9 and r.stdout == "started\n"
    assert time.monotonic() - t0 < budget(5)  # the 0.5 s time-out, not the 100 s sleeps

    async def sleeps() -> str:
        return (await run(runtime, h, "ps -o comm | grep -c sleep")).stdout.strip()

    # killed at once; gone as soon as the sandbox's init has reaped them (on a busy machine,
    # a moment later)
    async with asyncio.timeout(budget(5)):
        while await sleeps() != "0":
            await asyncio.sleep(0.05)

    # a cancelled request (the client went away) does not leave its command running
    task = asyncio.create_task(run(runtime, h, "sleep 100 & sleep 100"))
    async with asyncio.timeout(budget(10)):  # the command is running
        while await sleeps() != "2":
            await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(budget(5)):  # and is killed with its request
        while await sleeps() != "0":
            await asyncio.sleep(0.05)


async def test_output_flood_is_capped(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make()
    r = await run(runtime, h, "yes | head -c 50000000; echo done >&2", max_output_bytes=1 << 20)
    assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) == 1 << 20
    assert r.stderr == "done\n" and not r.stderr_truncated
    r = await run(runtime, h, "yes", timeout_s=1.0, max_output_bytes=1000)
    assert r.timed_out and r.stdout_truncated and len(r.stdout) == 1000
    assert (await run(runtime, h, "echo alive")).stdout == "alive\n"


async def test_streaming(runtime: ContainerRuntime, make: Factory) -> None:
    """'two' is printed only once the sink has seen 'one' (and said so with /tmp/ack, by a
    second exec): had the first chunk come at the end, the command would wait in vain."""
    h = await make()
    seen: list[tuple[str, bytes]] = []
    acks: list[asyncio.Task[ExecResult]] = []

    async def sink(kind: str, chunk: bytes) -> None:
        seen.append((kind, chunk))
        if chunk == b"one\n":
            acks.append(asyncio.create_task(run(runtime, h, "touch /tmp/ack")))

    polls = int(budget(10) / 0.05)
    cmd = (
        "echo one; n=0; until [ -e /tmp/ack ]; do n=$((n+1));"
        f" [ $n -gt {polls} ] && {{ echo no-ack; break; }}; sleep 0.05; done; echo two >&2"
    )
    r = await runtime.exec(h, ExecRequest(cmd=cmd), sink)
    assert r.stdout == "one\n" and r.stderr == "two\n"
    assert seen == [("stdout", b"one\n"), ("stderr", b"two\n")]
    assert [(await t).exit_code for t in acks] == [0]


async def test_memory_hog_is_oom_killed(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make(memory_mb=48)
    r = await run(runtime, h, "awk 'BEGIN { s = \"x\"; while (1) s = s s }'", timeout_s=30)
    assert r.oom_killed and r.signal == 9, r
    r = await run(runtime, h, "echo survived")
    assert r.stdout == "survived\n" and not r.oom_killed
    # a child killed while the command's shell goes on: reported through the shell's 137
    r = await run(runtime, h, "awk 'BEGIN { s = \"x\"; while (1) s = s s }'; exit $?")
    assert r.exit_code == 137 and r.oom_killed, r


async def test_background_oom_kills_do_not_mark_other_commands(
    runtime: ContainerRuntime, make: Factory
) -> None:
    h = await make(memory_mb=48)
    hog = "awk 'BEGIN { s = \"x\"; while (1) s = s s }'"
    await run(runtime, h, f"setsid sh -c 'while true; do {hog}; sleep 0.2; done' >/dev/null 2>&1 &")
    r = await run(runtime, h, "sleep 1.5; echo grader-ok", timeout_s=10)
    assert r.stdout == "grader-ok\n" and r.exit_code == 0 and not r.oom_killed, r


async def test_fork_bomb_is_capped_by_pids(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make(pids=40)
    r = await run(runtime, h, "bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=3)
    assert r.timed_out or r.exit_code is not None
    assert not limits_applied(cgroup(h.state["cgroup"]), pids=40)
    deadline = time.monotonic() + budget(10)
    out = ""
    while out != "alive\n" and time.monotonic() < deadline:
        try:  # while the bomb still holds every pid, even the exec server cannot fork
            out = (await run(runtime, h, ["echo", "alive"], timeout_s=5)).stdout
        except Conflict as e:  # the sandbox's state, not a server failure
            assert "process limit" in e.message and not isinstance(e, SandboxStopped)
            await asyncio.sleep(0.2)
    assert out == "alive\n"


async def test_concurrent_execs(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make()
    # in parallel, not one after the other: each waits until all ten have started (one run
    # alone would give up after its bounded wait and say so)
    polls = int(budget(10) / 0.05)

    def cmd(i: int) -> str:
        return (
            f"touch /tmp/conc{i}; n=0; until set -- /tmp/conc*; [ $# -eq 10 ]; do n=$((n+1));"
            f" [ $n -gt {polls} ] && {{ echo alone; exit 0; }}; sleep 0.05; done; echo {i}"
        )

    results = await asyncio.gather(*(run(runtime, h, cmd(i)) for i in range(10)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]


async def test_recover_after_restart_and_orphans(
    runtime: ContainerRuntime, node: tuple[Paths, list[str], list[str]], make: Factory
) -> None:
    paths, layer_paths, digests = node
    h = await make()
    await run(runtime, h, "echo -n kept > /tmp/state")
    await runtime.close()  # the edge goes away; the container keeps running
    fresh = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    await fresh.start()
    assert await fresh.recover(Handle(h.id, dict(h.state)))
    assert (await fresh.exec(h, ExecRequest(cmd="cat /tmp/state"))).stdout == "kept"
    # an unknown sandbox (e.g. the registry lost it) is an orphan
    other = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    await other.start()
    orphan = await other.create(
        SandboxSpec(
            id=f"sb-orphan-{uuid.uuid4().hex[:8]}",
            tier="container",
            layer_paths=layer_paths,
            layer_digests=digests,
            cpu=1,
            memory_mb=64,
            disk_mb=16,
            pids=64,
            env={},
            user=None,
            workdir="/",
        )
    )
    await other.close()
    assert orphan.id in await fresh.list_orphans({h.id})
    assert h.id not in await fresh.list_orphans({h.id})
    await fresh.destroy_orphan(orphan.id)
    assert_gone(fresh, orphan.id)
    # a sandbox whose container died is not recoverable
    await fresh.destroy(h)
    assert not await fresh.recover(Handle(h.id, dict(h.state)))
    await fresh.close()


async def test_create_failure_cleans_up(runtime: ContainerRuntime, make: Factory) -> None:
    with pytest.raises(InvalidRequest):
        await make(id="sb-t-baduser", user="nosuchuser")
    assert_gone(runtime, "sb-t-baduser")


async def test_a_runtime_only_asked_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """A runtime that is asked about its state (an orphan scan, a path) but never started
    makes no directory in /dev/shm: only start() makes it, and close() removes it."""
    paths = Paths(tmp_path / "home")
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    shm = Path("/dev/shm") / rt.cgroup_parent
    assert rt.state_root.parent in (shm, paths.run)
    assert await rt.list_orphans(set()) == []
    assert not shm.exists()
