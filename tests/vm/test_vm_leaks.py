"""The VM tiers leave nothing behind either: a few microvm and vm lifecycles (plain, suspend
to a file and restore, memory fork, freeze) through the SDK against a ``dsec serve`` child
process, then no zombie child, the same QEMU processes (the warm pool's), threads and fds
as after the warm-up, and no mount, cgroup or sandbox directory left.

QEMU is started in its own session (a group leader): the edge's child reaper leaves it to
the microVM runtime, which waits for it by pid (``docs/design/container.md``, "Reaping").
Under TCG here: ~30-60 s.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget

from dsec import Client, Sandbox
from dsec.footprint import ServerFootprint, server_footprint
from dsec.server import ServeProcess

from .conftest import VM_HOME

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(600)]


_STEADY = ("descendants", "mounts", "cgroups", "netns", "sandbox_dirs", "oci_state")
"""What a server's warm pools change while they fill (threads, fds and the machine's tasks
move for reasons of their own)."""


def steady_footprint(srv: ServeProcess, quiet_s: float = 2.0, timeout_s: float = 60.0) -> Any:
    """The server's footprint once :data:`_STEADY` has not changed for ``quiet_s`` (its
    warm pools refilled), waiting at most ``budget(timeout_s)``."""
    deadline = time.monotonic() + budget(timeout_s)
    last = server_footprint(srv.proc.pid, srv.home)
    still_since = time.monotonic()
    while time.monotonic() - still_since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.25)
        now = server_footprint(srv.proc.pid, srv.home)
        if {k: now.counts()[k] for k in _STEADY} != {k: last.counts()[k] for k in _STEADY}:
            still_since = time.monotonic()
        last = now
    return last


def _settle(srv: ServeProcess, baseline: ServerFootprint, timeout_s: float = 60.0) -> dict:  # type: ignore[type-arg]
    assert not baseline.zombies, f"the served baseline has zombies: {baseline.zombies}"
    deadline = time.monotonic() + budget(timeout_s)
    while True:
        grew = server_footprint(srv.proc.pid, srv.home).growth(baseline, threads=8, fds=16)
        if not grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.5)


def test_vm_tier_cycles_leave_nothing_behind(shared_layers: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="dsec-vmleaks-", dir="/tmp")) / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    (VM_HOME / "bin").mkdir(parents=True, exist_ok=True)  # the guest build, once per node
    (home / "bin").symlink_to(VM_HOME / "bin", target_is_directory=True)
    try:
        with ServeProcess(home, env={"DSEC_TIERS": "microvm,vm"}, start_timeout_s=900) as srv:
            client = Client(srv.url, srv.api_key, timeout=600)

            def cycle(tier: str, kind: str) -> None:
                sb = Sandbox.create(tier=tier, image="busybox", client=client, timeout=600)
                made = [sb]
                try:
                    assert sb.commands.run("echo hi").stdout == "hi\n"
                    if kind == "suspend":
                        sb.pause(mode="suspend")
                        sb.resume()
                    elif kind == "freeze":
                        sb.pause()
                        sb.resume()
                    elif kind == "fork":
                        made += sb.fork(1, memory=True)
                    for s in made:
                        assert s.commands.run("echo again").stdout == "again\n"
                finally:
                    for s in made:
                        s.kill()

            try:
                cycle("microvm", "plain")
                cycle("vm", "plain")
                baseline = steady_footprint(srv)  # warm pools refilled
                for kind in ("plain", "suspend", "fork", "freeze"):
                    cycle("microvm", kind)
                for kind in ("plain", "suspend"):
                    cycle("vm", kind)
                grew = _settle(srv, baseline)
                assert not grew, f"leaked: {grew}"
            finally:
                client.close()
        # the stopped server kept no template RAM on /dev/shm (no sandbox of it needs any)
        tag = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]
        assert not list(Path(f"/dev/shm/dsec-tpl-{tag}").glob("*.ram"))
    finally:
        from dsec.config import Paths
        from dsec.runtimes.microvm import MicroVMRuntime
        from dsec.runtimes.vm import VMRuntime

        for rt in (MicroVMRuntime(Paths(home)), VMRuntime(Paths(home))):
            rt.remove_templates()
        shutil.rmtree(home.parent, ignore_errors=True)
