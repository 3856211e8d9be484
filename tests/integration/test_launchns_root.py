"""The launch mount namespace (dsec.privileged.launchns): crun makes containers from a
namespace that holds none of the live sandboxes' mounts, so a creation does not copy, read
and detach them all. Needs root."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path

import pytest
from tests.integration.test_container_runtime import node  # noqa: F401
from tests.ns_ids import from_each_cpu

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.layers.mounts import LayerMounts
from dsec.models import ExecRequest
from dsec.runtimes.container.pool import PoolConfig
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

Node = tuple[Paths, list[str], list[str]]


def _spec(node: Node) -> SandboxSpec:  # noqa: F811
    _, layer_paths, digests = node
    return SandboxSpec(
        id=f"sb-l-{uuid.uuid4().hex[:10]}",
        tier="container",
        layer_paths=layer_paths,
        layer_digests=digests,
        cpu=0.5,
        memory_mb=64,
        disk_mb=64,
        pids=64,
        env={},
        user=None,
        workdir="/",
    )


def _mounts_in(pin: Path) -> list[str]:
    out = subprocess.run(
        ["nsenter", f"--mount={pin}", "cat", "/proc/self/mountinfo"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split(" ")[4] for line in out.splitlines()]


async def test_containers_are_made_without_the_other_sandboxes_mounts(node: Node) -> None:  # noqa: F811
    paths, _, _ = node
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False))
    await rt.start()
    made: list[Handle] = []
    try:
        assert rt._launch is not None
        for _ in range(3):
            h = await rt.create(_spec(node))
            made.append(h)
            r = await rt.exec(h, ExecRequest(cmd="cat /etc/hostname; ls /bin/sh"))
            assert r.exit_code == 0, r
        # each container's own table: its root and what crun mounted, no other sandbox
        inits = [h.state["init_pid"] for h in made]
        for pid, h in zip(inits, made, strict=True):
            table = await asyncio.to_thread(Path(f"/proc/{pid}/mountinfo").read_text)
            for other in made:
                if other is not h:
                    assert other.id not in table
        # the launch namespace holds none of them (each root was attached while crun ran)
        under = str(paths.sandboxes) + "/"
        assert not [m for m in _mounts_in(rt._launch.pin) if m.startswith(under)]
        # a restarted runtime makes it again without the live sandboxes' mounts
        rt2 = ContainerRuntime(
            paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False)
        )
        await rt2.start()
        try:
            assert rt2._launch is not None
            assert not [m for m in _mounts_in(rt2._launch.pin) if m.startswith(under)]
            for h in made:
                assert await rt2.recover(h)
            h = await rt2.create(_spec(node))
            made.append(h)
            assert (await rt2.exec(h, ExecRequest(cmd="true"))).ok
        finally:
            for h in made:
                await rt2.destroy(h)
            made.clear()
            await rt2.close()
    finally:
        for h in made:
            await rt.destroy(h)
        await rt.close()
    assert not (paths.run / "launchns").exists()


async def test_off_makes_them_from_the_node_namespace(
    node: Node,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths, _, _ = node
    monkeypatch.setenv("DSEC_LAUNCH_NAMESPACE", "off")
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False))
    await rt.start()
    try:
        assert rt._launch is None
        h = await rt.create(_spec(node))
        try:
            assert (await rt.exec(h, ExecRequest(cmd="true"))).ok
        finally:
            await rt.destroy(h)
    finally:
        await rt.close()


PIN_REPEATEDLY = """
import sys
from pathlib import Path
from dsec.privileged.launchns import open_launch_namespace
from dsec.runtimes.container.native import build_native

base = Path(sys.argv[1])
launcher = build_native(base / "bin", "dsec_launch")
refused = 0
for _ in range(int(sys.argv[2])):
    ns = open_launch_namespace(base / "run", launcher, [])
    if ns is None:
        refused += 1
    else:
        ns.close()
print(refused)
"""


def test_the_pin_takes_however_the_kernel_numbers_namespaces(tmp_path: Path) -> None:
    """Linux 6.18 numbers mount namespaces out of per-CPU batches, and refuses (EINVAL) the
    pin of a namespace numbered below the binder's: a third of pins failed here before the
    namespace was made again on each CPU in turn. From a namespace of its own (as ``dsec
    serve``'s) made on each CPU in turn, every one of 8 pins must take."""
    for cpu, (out, err) in from_each_cpu(PIN_REPEATEDLY, tmp_path, "slave", "8").items():
        assert out == "0", f"refused from CPU {cpu}: {err}"
