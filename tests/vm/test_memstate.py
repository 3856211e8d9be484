"""Suspend to a file, transparent restore, memory forks and KSM on the microvm tier (TCG here).

Every test here restores from one template (one cold boot per session, shared with
test_microvm.py): suspends and forks are QEMU migrations to and from files."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from tests.timing import budget, vm_boot_budgets

from dsec.config import Paths
from dsec.contract.runtime import Handle, MemoryStateful, capabilities_of
from dsec.errors import Conflict, FileNotFound, SandboxError
from dsec.models import ExecRequest
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime
from dsec.runtimes.microvm.qemu import pid_alive, qemu_processes
from dsec.runtimes.microvm.runtime import SUSPEND_DIR

from .conftest import BusyboxImage, new_spec

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(240)]

MakeVM = Callable[..., Awaitable[Handle]]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# a background process that holds a value only in its memory: it prints it when asked
# (a signal) and otherwise sleeps. Survives only if the RAM does.
_HOLDER = (
    "secret=$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \\n'); echo $secret > /tmp/secret; "
    "(trap 'echo $secret > /tmp/said' USR1; while :; do sleep 1; done) </dev/null >/dev/null 2>&1 & "
    "echo $! > /tmp/holder.pid"
)


async def _sh(rt: MicroVMRuntime, h: Handle, cmd: str, timeout_s: float = 30) -> str:
    r = await rt.exec(h, ExecRequest(cmd=cmd, timeout_s=timeout_s))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout


async def _holder_answers(rt: MicroVMRuntime, h: Handle) -> str:
    """Signal the holder process started by _HOLDER; return what it wrote (its memory)."""
    out = await _sh(
        rt, h,
        "rm -f /tmp/said; kill -USR1 $(cat /tmp/holder.pid); "
        "for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.2; done; cat /tmp/said",
    )  # fmt: skip
    return out.strip()


def test_protocol(microvm: MicroVMRuntime) -> None:
    assert isinstance(microvm, MemoryStateful)
    caps = capabilities_of(microvm)
    assert caps.suspend and caps.memory_fork


async def test_suspend_frees_memory_and_survives_restart(
    vm_home: Path, microvm: MicroVMRuntime, make_vm: MakeVM
) -> None:
    h = await make_vm()
    await _sh(microvm, h, _HOLDER)
    secret = (await _sh(microvm, h, "cat /tmp/secret")).strip()
    pid = h.state["pid"]

    report = await microvm.suspend(h)
    assert report["method"] == "suspended-to-file"
    assert report["memory_before_bytes"] > 10 << 20 and report["memory_after_bytes"] == 0
    state = Path(h.state["dir"]) / SUSPEND_DIR / "state"
    # a template clone's file holds only the pages that differ from the template
    assert state.stat().st_size == report["state_bytes"] > 4096
    assert report["state_bytes"] < report["full_state_bytes"] // 4, report
    assert state.stat().st_mode & 0o077 == 0
    assert not pid_alive(pid) and h.id not in qemu_processes(microvm.qemu_tag)
    assert microvm.is_suspended(h) and await microvm.alive(h)
    assert (await microvm.pause(h))["mode"] == "suspended"  # a freeze leaves it suspended

    # an edge restart: a new runtime on the same node reattaches to the suspended sandbox
    rt2 = MicroVMRuntime(
        Paths(vm_home),
        MicroVMConfig(
            pool_size=0, exec_grace_s=budget(3.0), keep_templates=True, **vm_boot_budgets()
        ),
    )
    await rt2.start()
    try:
        h2 = Handle(h.id, json.loads(json.dumps(h.state)))
        assert await rt2.recover(h2)
        assert h2.id not in await rt2.list_orphans({h2.id})
        t = time.monotonic()
        # any call restores transparently: the background process and its memory are back
        assert await _holder_answers(rt2, h2) == secret
        restore_s = time.monotonic() - t
        assert not rt2.is_suspended(h2) and not state.exists()
        assert pid_alive(h2.state["pid"]) and h2.state["pid"] != pid
        saved = json.loads((Path(h.state["dir"]) / "handle.json").read_text())
        assert saved["pid"] == h2.state["pid"]
        # clock reset by the agent after the restore (the guest clock stood still)
        asked = time.time()
        guest_now = float(await _sh(rt2, h2, "date +%s"))
        assert asked - 5 < guest_now < time.time() + 5
        assert restore_s < budget(30)  # restored, not hung
        # suspend again and resume explicitly
        await rt2.suspend(h2)
        await rt2.resume(h2)
        assert (await _sh(rt2, h2, "cat /tmp/secret")).strip() == secret
    finally:
        await rt2.close()
    microvm._live.pop(h.id, None)  # rt2 owned it last; make_vm's destroy kills the QEMU
    h.state.update(h2.state)


async def test_memory_fork_carries_processes(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    parent = await make_vm()
    await _sh(microvm, parent, _HOLDER + "; echo parent-file > /tmp/f")
    secret = (await _sh(microvm, parent, "cat /tmp/secret")).strip()
    snap = await microvm.memory_snapshot(parent)
    children: list[Handle] = []
    try:
        for i in range(2):
            spec = new_spec(
                BusyboxImage(list(parent.state["layer_paths"]), []),
                hostname=f"child-{i}",
            )
            children.append(await microvm.create_from_memory(snap, spec))
    finally:
        await microvm.drop_memory_snapshot(snap)
    assert not snap.dir.exists()
    assert snap.ram_backing is not None  # a difference from the template RAM file
    try:
        # the parent runs on, undisturbed
        assert await _holder_answers(microvm, parent) == secret
        seeds = set()
        for i, c in enumerate(children):
            assert c.state["pid"] != parent.state["pid"] and pid_alive(c.state["pid"])
            # the process started in the parent runs in the child with the parent's memory
            assert await _holder_answers(microvm, c) == secret
            assert (await _sh(microvm, c, "cat /tmp/f")).strip() == "parent-file"
            assert (await _sh(microvm, c, "hostname")).strip() == f"child-{i}"
            assert abs(float(await _sh(microvm, c, "date +%s")) - time.time()) < 5
            seeds.add(await _sh(microvm, c, "head -c 16 /dev/urandom | od -An -tx1"))
            await _sh(microvm, c, f"echo child-{i} > /tmp/f")
        assert len(seeds) == 2  # reseeded: the children's RNG streams differ
        # copy-on-write: each has its own writable layer
        assert (await _sh(microvm, parent, "cat /tmp/f")).strip() == "parent-file"
        assert (await _sh(microvm, children[0], "cat /tmp/f")).strip() == "child-0"
    finally:
        for c in children:
            await microvm.destroy(c)
    for c in children:
        assert not pid_alive(c.state["pid"]) and not microvm._cgroup(c.id).exists()


async def test_suspend_refuses_while_a_command_runs(
    microvm: MicroVMRuntime, make_vm: MakeVM
) -> None:
    h = await make_vm()
    polls = int(budget(30) / 0.05)
    cmd = (
        f"touch /tmp/running; n=0; until [ -e /tmp/go ]; do n=$((n+1)); [ $n -gt {polls} ] &&"
        " break; sleep 0.05; done; echo done"
    )
    running = asyncio.create_task(microvm.exec(h, ExecRequest(cmd=cmd, timeout_s=budget(60))))
    files = microvm.files(h)
    async with asyncio.timeout(budget(30)):  # the command runs
        while True:
            try:
                await files.stat("/tmp/running")
                break
            except FileNotFound:
                await asyncio.sleep(0.05)
    with pytest.raises(Conflict):
        await microvm.suspend(h)
    await files.write("/tmp/go", b"")
    assert (await running).stdout == "done\n"  # untouched
    assert not microvm.is_suspended(h)


async def test_corrupt_suspend_file_is_a_typed_error(
    microvm: MicroVMRuntime, make_vm: MakeVM
) -> None:
    h = await make_vm()
    await microvm.suspend(h)
    state = Path(h.state["dir"]) / SUSPEND_DIR / "state"
    with open(state, "r+b") as f:  # keep the header, destroy what follows
        f.seek(64)
        f.write(os.urandom(1 << 20))
    before = set(qemu_processes(microvm.qemu_tag))
    t = time.monotonic()
    with pytest.raises(SandboxError):
        await microvm.exec(h, ExecRequest(cmd="true", timeout_s=5))
    assert time.monotonic() - t < budget(60)  # refused, not hung
    assert set(qemu_processes(microvm.qemu_tag)) <= before  # no QEMU left behind
    assert microvm.is_suspended(h)  # the file is kept: destroy (or a fixed file) decides


async def test_ksm_flag_marks_qemu_mergeable(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """MicroVMConfig.ksm (default on): the launcher's PR_SET_MEMORY_MERGE shows as
    ``ksm_merge_any: yes`` in /proc/PID/ksm_stat, the backend's ``merge=on`` on QEMU's
    command line."""
    h = await make_vm()
    pid = h.state["pid"]
    assert b"merge=on" in _read(f"/proc/{pid}/cmdline")
    lines = _read(f"/proc/{pid}/ksm_stat").decode().splitlines()
    ksm = dict(ln.replace(":", " ").split()[:2] for ln in lines if ln.strip())
    assert ksm.get("ksm_merge_any") == "yes", ksm


async def test_vm_tier_suspend_and_fork_keep_the_disk(
    vm_home: Path, busybox_image: BusyboxImage
) -> None:
    """The vm tier: the qcow2 disk stays in place across suspend (a display call restores the
    VM) and each memory fork gets its own copy of it."""
    from dsec.runtimes.vm import VMRuntime

    rt = VMRuntime(
        Paths(vm_home),
        MicroVMConfig(
            exec_grace_s=budget(3.0), pool_size=0, keep_templates=True, **vm_boot_budgets()
        ),
    )
    await rt.start()
    h = await rt.create(new_spec(busybox_image, tier="vm", disk_mb=96))
    child: Handle | None = None
    try:
        await _sh(rt, h, _HOLDER + "; echo on-disk > /persist.txt; sync")
        secret = (await _sh(rt, h, "cat /tmp/secret")).strip()
        report = await rt.suspend(h)
        assert report["memory_after_bytes"] == 0 and rt.disk_of(h).exists()
        png = await rt.screenshot(h)  # restores transparently
        assert png[:4] == b"\x89PNG" and not rt.is_suspended(h)
        assert await _holder_answers(rt, h) == secret
        assert (await _sh(rt, h, "cat /persist.txt")).strip() == "on-disk"

        snap = await rt.memory_snapshot(h)
        try:
            spec = new_spec(busybox_image, tier="vm", disk_mb=96, hostname="vm-child")
            child = await rt.create_from_memory(snap, spec)
        finally:
            await rt.drop_memory_snapshot(snap)
        assert rt.disk_of(child).exists() and rt.disk_of(child) != rt.disk_of(h)
        assert await _holder_answers(rt, child) == secret
        assert (await _sh(rt, child, "cat /persist.txt")).strip() == "on-disk"
        await _sh(rt, child, "echo child > /persist.txt; sync")
        assert (await _sh(rt, h, "cat /persist.txt")).strip() == "on-disk"
    finally:
        if child is not None:
            await rt.destroy(child)
            assert not rt.disk_of(child).exists() and not pid_alive(child.state["pid"])
        await rt.destroy(h)
        await rt.close()
