"""Idle-aware CPU weights of the container tier: a sandbox with no command running has a
low ``cpu.shares``, its full weight (1024 x cpu) while a command runs. Needs root."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

import pytest
from tests.integration.test_container_runtime import node  # noqa: F401
from tests.timing import budget

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.layers.mounts import LayerMounts
from dsec.models import ExecRequest
from dsec.privileged.cgroups import cgroup, shares_to_weight, weight_to_shares
from dsec.runtimes.container import runtime as runtime_module
from dsec.runtimes.container.pool import PoolConfig
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

Node = tuple[Paths, list[str], list[str]]


async def runtime(node: Node, shares: int, boost: float = 1.0) -> ContainerRuntime:  # noqa: F811
    paths, _, _ = node
    rt = ContainerRuntime(
        paths,
        LayerMounts(paths.layer_mounts),
        pool=PoolConfig(min_ready=1, max_total=2),
        idle_cpu_shares=shares,
    )
    rt.exec_boost = boost
    await rt.start()
    return rt


def spec(node: Node, cpu: float) -> SandboxSpec:  # noqa: F811
    _, layer_paths, digests = node
    return SandboxSpec(
        id=f"sb-c-{uuid.uuid4().hex[:10]}",
        tier="container",
        layer_paths=layer_paths,
        layer_digests=digests,
        cpu=cpu,
        memory_mb=128,
        disk_mb=64,
        pids=128,
        env={},
        user=None,
        workdir="/",
    )


def shares(h: Handle) -> int:
    """``h``'s CPU weight in ``cpu.shares`` units (see :func:`as_set`)."""
    return cgroup(h.state["cgroup"]).cpu_shares()


def as_set(value: int) -> int:
    """What :func:`shares` reads after the runtime set ``value`` shares: v1 ``value``, v2
    the ``cpu.weight`` it maps to, in shares."""
    if cgroup("").version == 1:
        return value
    return weight_to_shares(shares_to_weight(value))


def waits_for(path: str) -> str:
    """A command that runs until ``path`` exists (exit 9 if it never comes)."""
    polls = int(budget(30) / 0.05)
    return (
        f"n=0; until [ -e {path} ]; do n=$((n+1)); [ $n -gt {polls} ] && exit 9; sleep 0.05; done"
    )


async def release(rt: ContainerRuntime, h: Handle, path: str) -> None:
    """End a :func:`waits_for` command (the file is written from the node: no exec)."""
    await rt.files(h).write(path, b"")


async def started(rt: ContainerRuntime, h: Handle, name: str) -> None:
    """Wait until the command that touches ``/tmp/<name>`` has (it runs)."""
    async with asyncio.timeout(budget(10)):
        while name not in {f.name for f in await rt.files(h).list("/tmp")}:
            await asyncio.sleep(0.02)


async def while_running(rt: ContainerRuntime, h: Handle) -> int:
    """``cpu.shares`` seen while a command runs in ``h``."""
    cmd = f"touch /tmp/running; {waits_for('/tmp/go')}; rm -f /tmp/running /tmp/go"
    task = asyncio.create_task(rt.exec(h, ExecRequest(cmd=cmd)))
    try:
        await started(rt, h, "running")
        seen = shares(h)
    finally:
        await release(rt, h, "/tmp/go")
    assert (await task).ok
    return seen


@pytest.fixture
async def weighted(node: Node) -> AsyncIterator[ContainerRuntime]:  # noqa: F811
    rt = await runtime(node, 2)
    yield rt
    await rt.close()


async def test_idle_sandboxes_get_a_low_weight(weighted: ContainerRuntime, node: Node) -> None:  # noqa: F811
    rt = weighted
    made = [await rt.create(spec(node, 0.5))]
    deadline = asyncio.get_running_loop().time() + budget(5)
    while not rt.pool.ready_count() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)  # a warm one, then a claimed sandbox: the same rule applies
    made.append(await rt.create(spec(node, 1.5)))
    assert "warm_id" in made[1].state
    try:
        # it starts at the highest weight (crun's set-up in the cgroup and the exec server's
        # attach are the platform's work and must get the CPU on a busy node), and is idle
        # once created
        paths, _, _ = node
        cfg = json.loads((paths.sandboxes / made[0].id / "config.json").read_text())
        assert cfg["linux"]["resources"]["cpu"]["shares"] == runtime_module.START_SHARES
        for h, full in zip(made, (512, 1536), strict=True):
            assert shares(h) == as_set(2)  # created idle
            assert await while_running(rt, h) == as_set(full)
            assert shares(h) == as_set(2)
        # an interactive process counts until it ends; two commands at once: until both end
        h = made[0]
        proc = await rt.start_process(
            h, ExecRequest(cmd=waits_for("/tmp/end-process")), stdin=False, pty=None
        )
        assert shares(h) == as_set(512)
        other = asyncio.create_task(
            rt.exec(h, ExecRequest(cmd=f"touch /tmp/exec-started; {waits_for('/tmp/end-exec')}"))
        )
        await started(rt, h, "exec-started")  # both run now
        await release(rt, h, "/tmp/end-process")
        while await proc.read_output() is not None:
            pass
        assert (await proc.wait()).ok
        assert shares(h) == as_set(512)  # the exec still runs
        await release(rt, h, "/tmp/end-exec")
        assert (await other).ok
        assert shares(h) == as_set(2)
        # a failing command ends as well
        assert not (await rt.exec(h, ExecRequest(cmd="exit 3"))).ok
        assert shares(h) == as_set(2)
        # frozen with its full weight (every task must run to reach the freezer), idle again
        # once resumed
        await rt.pause(h)
        assert shares(h) == as_set(512)
        await rt.resume(h)
        assert shares(h) == as_set(2)
    finally:
        for h in made:
            await rt.destroy(h)


async def test_weights_off(node: Node) -> None:  # noqa: F811
    rt = await runtime(node, 0)
    try:
        h = await rt.create(spec(node, 0.5))
        try:
            # the kernel's default weight (v1 1024 shares, v2 weight 100), as its parent's
            default = cgroup(rt.cgroup_parent).cpu_shares()
            assert shares(h) == default and await while_running(rt, h) == default
        finally:
            await rt.destroy(h)
    finally:
        await rt.close()


async def test_a_command_starts_with_a_boost_that_ends(node: Node) -> None:  # noqa: F811
    """A command starting in an idle sandbox runs at ``exec_boost`` times its weight for
    ``exec_boost_s``, then at its full weight; idle again when it ends (short commands are
    done within the boost: the node favours them over long ones)."""
    rt = await runtime(node, 2, boost=8)
    rt.exec_boost_s = budget(1.0)
    try:
        h = await rt.create(spec(node, 0.5))
        try:
            cmd = f"touch /tmp/running; {waits_for('/tmp/go')}"
            task = asyncio.create_task(rt.exec(h, ExecRequest(cmd=cmd)))
            await started(rt, h, "running")
            assert shares(h) == as_set(8 * 512)
            async with asyncio.timeout(budget(10)):
                while shares(h) != as_set(512):
                    await asyncio.sleep(0.05)
            await release(rt, h, "/tmp/go")
            assert (await task).ok
            assert shares(h) == as_set(2)
            # a command that ends within the boost leaves no timer behind to raise it again
            assert (await rt.exec(h, ExecRequest(cmd="true"))).ok
            await asyncio.sleep(rt.exec_boost_s + 0.2)
            assert shares(h) == as_set(2)
        finally:
            await rt.destroy(h)
    finally:
        await rt.close()


async def test_a_keys_sandboxes_share_one_weighted_cgroup(
    node: Node,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per-key CPU fairness (dsec.edge.quotas): the sandboxes of one CPU group (a key) sit
    under ``<parent>/key-<group>`` with the group's weight, so that a key's many busy
    sandboxes share what one key gets; warm containers are made in their group; the group's
    cgroup goes with its last sandbox, and a weight the operator changed applies at the
    group's next creation."""
    rt = await runtime(node, 2)
    a: list[Handle] = []
    b: Handle | None = None
    try:
        a += [
            await rt.create(
                dataclasses.replace(spec(node, 0.5), cpu_group="kaaaa", cpu_group_weight=300)
            )
            for _ in range(3)
        ]
        b = await rt.create(dataclasses.replace(spec(node, 0.5), cpu_group="kbbbb"))
        group_a = cgroup(f"{rt.cgroup_parent}/key-kaaaa")
        group_b = cgroup(f"{rt.cgroup_parent}/key-kbbbb")
        for h in a:
            # (a claimed warm container's cgroup keeps the warm id)
            assert h.state["cgroup"].rsplit("/", 1)[0] == f"{rt.cgroup_parent}/key-kaaaa"
            assert (await rt.exec(h, ExecRequest(cmd="true"))).ok
        assert b.state["cgroup"].startswith(f"{rt.cgroup_parent}/key-kbbbb/")
        assert group_a.cpu_shares() == as_set(3072) and group_b.cpu_shares() == as_set(1024)
        # a sandbox's own weight still follows its activity, inside its group
        assert shares(a[0]) == as_set(2)
        # the orphan scan looks inside the groups: a cgroup left there is found
        known = {h.id for h in [*a, b]}
        assert await rt.list_orphans(known) == []
        stray = group_a.child("sb-stray")
        stray.create()
        try:
            assert await rt.list_orphans(known) == ["sb-stray"]
        finally:
            stray.remove()
        # the operator changed the key's weight: its next sandbox sets it
        a.append(
            await rt.create(
                dataclasses.replace(spec(node, 0.5), cpu_group="kaaaa", cpu_group_weight=50)
            )
        )
        assert group_a.cpu_shares() == as_set(512)
        monkeypatch.setattr(runtime_module, "GROUP_LINGER_S", 0.5)
        await rt.destroy(b)
        b = None
        assert group_b.exists()  # its last sandbox is gone: the group waits for the next one
        b = await rt.create(dataclasses.replace(spec(node, 0.5), cpu_group="kbbbb"))
        await asyncio.sleep(1.0)
        assert group_b.exists()  # came back in time: the group stayed
        await rt.destroy(b)
        b = None
        for h in a[:-1]:
            await rt.destroy(h)
        assert group_a.exists()
        await rt.destroy(a[-1])
        a = []
        # the pool's warm containers of each group go, then the groups (after the linger)
        async with asyncio.timeout(budget(30)):
            await rt.pool.close()
            while group_a.exists() or group_b.exists():
                await asyncio.sleep(0.05)
    finally:
        for h in [*a, *([b] if b else [])]:
            await rt.destroy(h)
        await rt.close()
