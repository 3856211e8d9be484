"""Suspend, memory fork and the idle reaper end to end: SDK -> HTTP -> edge -> microvm runtime;
a suspended sandbox across an edge restart; typed refusals on a tier without them."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.timing import budget

from dsec import Sandbox
from dsec.config import Paths
from dsec.errors import CapabilityNotSupported, SandboxStopped
from dsec.models import CreateSandboxRequest, PauseRequest, SandboxExecRequest, SandboxRef
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.microvm import MicroVMRuntime
from dsec.runtimes.microvm.qemu import pid_alive
from dsec.server import BackgroundServer, embedded_edge

from .conftest import VM_HOME

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(300)]

_HOLDER = (
    "echo $$ > /dev/null; v=kept-$((6*7)); "
    "(trap 'echo $v > /tmp/said' USR1; while :; do sleep 1; done) </dev/null >/dev/null 2>&1 & "
    "echo $! > /tmp/holder.pid"
)
_ASK = (
    "rm -f /tmp/said; kill -USR1 $(cat /tmp/holder.pid); "
    "for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.2; done; cat /tmp/said"
)


@pytest.fixture(scope="module")
def home(shared_layers: Path) -> Iterator[Path]:
    # not pytest's tmp_path: concurrent pytest sessions rotate /tmp/pytest-of-root away
    h = Path(os.environ.get("DSEC_MEMSTATE_TEST_HOME", "/tmp/dsec-memstate-sdk"))
    shutil.rmtree(h, ignore_errors=True)
    h.mkdir(parents=True)
    (h / "layers").symlink_to(shared_layers, target_is_directory=True)
    # the guest kernel/initramfs build is per node: reuse the VM tests' one
    (VM_HOME / "bin").mkdir(parents=True, exist_ok=True)
    (h / "bin").symlink_to(VM_HOME / "bin", target_is_directory=True)
    yield h
    rt = MicroVMRuntime(Paths(h))
    rt.remove_templates()
    shutil.rmtree(h, ignore_errors=True)
    for rel in (rt.cgroup_prefix, f"dsec-{rt.tag}"):
        with contextlib.suppress(OSError):
            cgroup(rel).remove_if_empty()


def test_sdk_suspend_fork_reaper_and_refusals(home: Path) -> None:
    with BackgroundServer(home, tiers=["microvm", "container"]) as srv:
        kw = {"url": srv.url, "api_key": srv.api_key, "image": "busybox", "memory_mb": 256}
        caps = {c.tier: c for c in srv.call(srv.edge.capabilities()).tiers}  # type: ignore[union-attr]
        assert caps["microvm"].suspend and caps["microvm"].memory_fork
        assert not caps["container"].suspend and not caps["container"].memory_fork
        with Sandbox.create(tier="microvm", **kw) as sb:
            sb.commands.run(_HOLDER)
            info = sb.pause(mode="suspend")
            assert info.state == "paused" and info.last_pause is not None
            assert info.last_pause.method == "suspended-to-file"
            assert (
                info.last_pause.memory_before_bytes > 0 and info.last_pause.memory_after_bytes == 0
            )
            # transparent: the command restores the VM, the background process answers
            assert sb.commands.run(_ASK).stdout.strip() == "kept-42"
            assert sb.refresh().state == "running"
            # freeze is still there, and mode=auto keeps today's behaviour
            assert sb.pause(mode="freeze").last_pause.method == "vcpus-stopped"
            sb.resume()
            children = sb.fork(2, memory=True, labels={"kind": "child"})
            try:
                assert len(children) == 2
                for c in children:
                    assert c.info.forked_from == sb.id
                    assert c.commands.run(_ASK).stdout.strip() == "kept-42"
            finally:
                for c in children:
                    c.kill()
            assert sb.commands.run(_ASK).stdout.strip() == "kept-42"
        # the idle reaper suspends VM sandboxes whose on_timeout is pause
        with Sandbox.create(
            tier="microvm", ttl_s=1, on_timeout="pause", paused_ttl_s=600, **kw
        ) as sb:
            sb.commands.run("echo idle > /tmp/idle")
            deadline = time.monotonic() + budget(30)
            while time.monotonic() < deadline and sb.refresh().state != "paused":
                time.sleep(0.3)
            assert sb.info.state == "paused", sb.info
            assert sb.info.last_pause is not None
            assert sb.info.last_pause.method == "suspended-to-file"
            assert sb.commands.run("cat /tmp/idle").stdout == "idle\n"
        with Sandbox.create(tier="container", **kw) as sb:
            with pytest.raises(CapabilityNotSupported):
                sb.pause(mode="suspend")
            with pytest.raises(CapabilityNotSupported):
                sb.fork(1, memory=True)
            assert sb.refresh().state == "running"  # the refusals changed nothing


def test_a_guest_that_dies_is_stopped_at_once(home: Path) -> None:
    """A full guest's kernel panic ends its QEMU: the sandbox reads "stopped" with the
    reason right after, with a request in flight or without (issue 32, item 7)."""
    with BackgroundServer(home, tiers=["microvm"]) as srv:
        kw = {"url": srv.url, "api_key": srv.api_key, "image": "busybox", "memory_mb": 256}
        panic_later = "(sleep 1; echo c > /proc/sysrq-trigger) </dev/null >/dev/null 2>&1 &"
        with Sandbox.create(tier="microvm", full_guest=True, **kw) as sb:
            sb.commands.run(panic_later)
            deadline = time.monotonic() + budget(20)
            while time.monotonic() < deadline and sb.refresh().state != "stopped":
                time.sleep(0.2)
            assert sb.info.state == "stopped", sb.info
            assert sb.info.stopped_reason == "sandbox died: the guest kernel panicked"
        with Sandbox.create(tier="microvm", full_guest=True, **kw) as sb:
            with pytest.raises(SandboxStopped):
                sb.commands.run("echo c > /proc/sysrq-trigger; sleep 5", timeout=30)
            assert sb.refresh().state == "stopped", sb.info
            assert "sandbox died" in (sb.info.stopped_reason or "")


async def test_suspended_sandbox_survives_edge_restart(home: Path) -> None:
    owner = "memstate-test"
    async with embedded_edge(home, tiers=["microvm"]) as edge:
        info = await edge.create_sandbox(
            CreateSandboxRequest(tier="microvm", image="busybox", memory_mb=256, ttl_s=600), owner
        )
        sid = info.id
        await edge.exec(SandboxExecRequest(sandbox_id=sid, cmd=_HOLDER), owner)
        info = await edge.pause_sandbox(PauseRequest(sandbox_id=sid, mode="suspend"), owner)
        assert info.state == "paused"
        pid = edge._live[sid].handle.state["pid"]
        assert pid == 0
    async with embedded_edge(home, tiers=["microvm"]) as edge:
        try:
            info = await edge.get_sandbox(SandboxRef(sandbox_id=sid), owner)
            assert info.state == "paused"  # still suspended: not restored by the restart
            rt = edge.runtimes["microvm"]
            assert isinstance(rt, MicroVMRuntime) and rt.is_suspended(edge._live[sid].handle)
            r = await edge.exec(SandboxExecRequest(sandbox_id=sid, cmd=_ASK), owner)
            assert r.stdout.strip() == "kept-42"
            assert (await edge.get_sandbox(SandboxRef(sandbox_id=sid), owner)).state == "running"
            assert pid_alive(edge._live[sid].handle.state["pid"])
        finally:
            await edge.kill_sandbox(SandboxRef(sandbox_id=sid), owner)
