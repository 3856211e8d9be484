"""The container tier's warm pool on this node: a claimed container is a fresh sandbox
(its own id, limits, environment, user; nothing from the pool), the off switch, memory
pressure and close give everything back. Needs root (crun, cgroups, mounts)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.integration.test_container_runtime import (  # noqa: F401
    assert_gone,
    limits_applied,
    node,
)
from tests.timing import budget

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec, capabilities_of
from dsec.errors import SandboxError
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import upper_dir
from dsec.models import ExecRequest
from dsec.privileged.cgroups import cgroup
from dsec.privileged.mount import mount_points
from dsec.runtimes.container.pool import PoolConfig
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

Node = tuple[Paths, list[str], list[str]]


def spec(node: Node, **kw: object) -> SandboxSpec:  # noqa: F811
    _, layer_paths, digests = node
    args: dict = dict(
        id=f"sb-p-{uuid.uuid4().hex[:10]}",
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
    return SandboxSpec(**args)


@pytest.fixture
async def pooled(node: Node) -> AsyncIterator[ContainerRuntime]:  # noqa: F811
    paths, _, _ = node
    rt = ContainerRuntime(
        paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(min_ready=1, max_total=4)
    )
    await rt.start()
    cap = capabilities_of(rt)
    if not cap.available:  # a host of the matrix that dsec refuses: its reason, as a skip
        await rt.close()
        pytest.skip(f"the container tier is unavailable on this node: {cap.reason}")
    yield rt
    await rt.close()
    assert not list(paths.sandboxes.glob("wp-*")), "warm containers left after close"
    assert not [c for c in cgroup(rt.cgroup_parent).children() if c.startswith("wp-")]


async def warm(rt: ContainerRuntime, n: int = 1, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + budget(timeout_s)
    while asyncio.get_running_loop().time() < deadline:
        if rt.pool.ready_count() >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the pool did not fill: {rt.pool.stats}")


def gone_everywhere(rt: ContainerRuntime, h: Handle) -> None:
    assert_gone(rt, h.id)
    for rel in {h.state["cgroup"], f"{rt.cgroup_parent}/{h.id}"}:
        for d in cgroup(rel).every_dir():
            assert not d.exists(), f"cgroup {rel} left: {d}"
    assert not (rt.state_root / h.state.get("warm_id", h.id)).exists()


async def test_a_claimed_container_is_a_fresh_sandbox(pooled: ContainerRuntime, node: Node) -> None:  # noqa: F811
    first = await pooled.create(spec(node))  # a miss: made fresh, the key is now in demand
    assert "warm_id" not in first.state
    await warm(pooled)
    s = spec(
        node, env={"TASK": "t-1"}, user="nobody", workdir="/tmp", cpu=0.5, memory_mb=96, pids=77
    )
    h = await pooled.create(s)
    try:
        assert h.id == s.id and h.state["warm_id"].startswith("wp-") and pooled.pool.stats.hits == 1

        # nothing ran in it: its writable layer holds what a fresh one's does
        def upper(x: Handle) -> list[str]:
            top = upper_dir(pooled.paths.sandboxes / x.id)
            return sorted(str(p.relative_to(top)) for p in top.rglob("*"))

        assert upper(h) == upper(first)
        r = await pooled.exec(
            h, ExecRequest(cmd="echo $TASK; id -u; pwd; hostname; ps -o pid,comm | wc -l")
        )
        assert r.ok, r
        assert r.stdout.split("\n")[:4] == ["t-1", "65534", "/tmp", "sandbox"]
        # between commands: its init and exec server, as in a fresh one (nothing from the pool)
        procs = {x.id: cgroup(x.state["cgroup"]).procs() for x in (first, h)}
        assert len(procs[h.id]) == len(procs[first.id]) == 2
        # the sandbox's own limits, not the warm container's
        cg = cgroup(h.state["cgroup"])
        assert cg.memory_limit() == 96 << 20
        assert not limits_applied(cg, cpu=0.5, memory_bytes=96 << 20, pids=77)
        # its cgroups keep the warm name (no rename: it waited on the kernel's cgroup lock)
        # and are labelled with its id, in every hierarchy; its processes are in them
        init = h.state["init_pid"]
        assert h.state["cgroup"] == f"{pooled.cgroup_parent}/{h.state['warm_id']}"
        with open(f"/proc/{init}/cgroup") as f:
            assert h.state["warm_id"] in f.read()
        mine = [d for d in cg.every_dir() if d.is_dir()]
        # v1: memory, cpu, pids, freezer... (resolved: a stock v1 host co-mounts cpu and
        # cpuacct at cpu,cpuacct, and dirs() names them through their symbolic links)
        assert {d.resolve() for d in cg.dirs().values()} <= {d.resolve() for d in mine}
        for d in mine:
            assert os.getxattr(d, "trusted.dsec.sandbox") == h.id.encode(), d
        assert os.getpriority(os.PRIO_PROCESS, init) == 0  # made at nice 10, claimed at 0
        on_disk = json.loads(pooled._state_file(h.id).read_text())
        assert pooled._state_file(h.id).parent.parent == pooled.state_root.parent  # tmpfs
        assert not pooled._state_file(h.state["warm_id"]).exists()
        assert on_disk["env"] == {"TASK": "t-1"} and on_disk["cgroup"] == h.state["cgroup"]
        # what a restarted edge does: the claimed sandbox is known, not an orphan
        assert set(await pooled.list_orphans({first.id, h.id})) == set()
        # files and a second exec work under the new name
        await pooled.files(h).write("/tmp/x", b"mine", 0o644)
        assert (await pooled.exec(h, ExecRequest(cmd="cat /tmp/x"))).stdout == "mine"
    finally:
        await pooled.destroy(h)
        await pooled.destroy(first)
    gone_everywhere(pooled, h)
    gone_everywhere(pooled, first)


async def test_a_sandbox_with_a_hostname_of_its_own_makes_no_pool_key(
    pooled: ContainerRuntime,
    node: Node,  # noqa: F811
) -> None:
    """A packed fork's child is named by its id and stacked on a layer made for its group:
    the pool cannot serve it, and its creation must not have the pool make warm
    containers for a key nobody else has (16 children were 16 keys of 2 each, until the
    pool's limit kept every other key from refilling)."""
    h = await pooled.create(spec(node, hostname="sb-p-child-1"))
    try:
        assert "warm_id" not in h.state
        assert pooled.pool.stats.misses == 0 and pooled.pool.ready_count() == 0
        await asyncio.sleep(0.3)  # a refill would have started by now
        assert pooled.pool.ready_count() == 0 and pooled.pool.stats.made == 0
        r = await pooled.exec(h, ExecRequest(cmd="hostname"))
        assert r.stdout.strip() == "sb-p-child-1"
    finally:
        await pooled.destroy(h)


async def test_memory_pressure_and_the_off_switch(pooled: ContainerRuntime, node: Node) -> None:  # noqa: F811
    h = await pooled.create(spec(node))
    await pooled.destroy(h)
    await warm(pooled)
    pooled.pool._memory_fraction = lambda: 0.0  # the node is out of memory
    assert await pooled.pool.trim() >= 1
    assert pooled.pool.ready_count() == 0 and not list(pooled.paths.sandboxes.glob("wp-*"))
    paths, _, _ = node
    off = ContainerRuntime(paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False))
    await off.start()
    try:
        made = [await off.create(spec(node)) for _ in range(2)]
        await asyncio.sleep(0.2)
        assert all("warm_id" not in m.state for m in made) and off.pool.ready_count() == 0
        assert not list(paths.sandboxes.glob("wp-*"))
        for m in made:
            await off.destroy(m)
    finally:
        await off.close()


async def test_a_warm_container_the_pool_could_not_discard_is_gone_after_close(
    node: Node,  # noqa: F811
) -> None:
    """A discard that fails (a kill that timed out on a saturated node) leaves nothing once
    the runtime closes: no mount, directory, cgroup or process of the warm containers."""
    paths, _, _ = node
    rt = ContainerRuntime(
        paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(min_ready=2, max_total=4)
    )
    await rt.start()
    try:
        h = await rt.create(spec(node))  # a miss: the key is in demand, the pool fills
        await rt.destroy(h)
        await warm(rt, 2)
        warm_ids = sorted(p.name for p in paths.sandboxes.glob("wp-*"))
        real_destroy = rt.destroy

        async def failing(handle: Handle) -> None:
            if handle.id.startswith("wp-"):
                raise SandboxError(f"killing {handle.id} did not finish (simulated)")
            await real_destroy(handle)

        rt.destroy = failing  # type: ignore[method-assign]
    finally:
        await rt.close()
    assert len(warm_ids) == 2 and rt.pool.stats.discarded >= 2  # the pool tried, and failed
    assert not list(paths.sandboxes.glob("wp-*"))
    assert not [m for m in mount_points(paths.sandboxes) if "wp-" in str(m)]
    # a cgroup goes only once no process is left in it
    assert not [c for c in cgroup(rt.cgroup_parent).children() if c.startswith("wp-")]


def test_fixture_home_is_clean(node: Node) -> None:  # noqa: F811
    paths, _, _ = node
    assert not [m for m in mount_points(paths.sandboxes) if "wp-" in str(m)]
    assert isinstance(paths.home, Path)


@pytest.fixture(autouse=True)
def _no_leftover_warm(node: Node) -> Iterator[None]:  # noqa: F811
    yield
    paths, _, _ = node
    assert not list(paths.sandboxes.glob("wp-*"))


async def destroy_family(rt: ContainerRuntime, parent: Handle, kids: list[Handle]) -> None:
    """Destroy a fork's children and parent; nothing of them is left, nor a frozen layer."""
    for k in kids:
        await rt.destroy(k)
    await rt.destroy(parent)
    for h in [*kids, parent]:
        gone_everywhere(rt, h)
    assert rt.frozen_layers() == {} and not mount_points(rt._frozen_root())


async def test_a_fork_child_from_the_pool_is_a_child_like_a_fresh_one(
    pooled: ContainerRuntime,
    node: Node,  # noqa: F811
) -> None:
    """A shared fork's child made from a warm container (moved onto the fork's root) sees
    what a fresh child sees, is as isolated, keeps nothing of the warm root, and leaves
    nothing behind; the frozen layer goes with its last holder."""
    pooled.pool.config.idle_s = 3600.0  # a loaded node: its key stays in demand
    parent = await pooled.create(spec(node))
    kids: list[Handle] = []
    try:
        setup = (
            "mkdir -p /data && echo parent > /data/who && rm /bin/ls"
            " && echo 0123456789abcdef0123456789abcdef > /etc/machine-id"
            " && echo 'alice:x:1234:1234::/tmp:/bin/sh' >> /etc/passwd"
        )
        assert (await pooled.exec(parent, ExecRequest(cmd=setup))).ok
        await pooled.freeze_upper(parent)
        (fid,) = parent.state["frozen"]
        for _ in range(2):  # from the pool
            await warm(pooled)
            s = spec(node, user="alice")
            kids.append(await pooled.create_forked(parent, dataclasses.replace(s, hostname=s.id)))
        pooled.pool.config.enabled = False
        s = spec(node, user="alice")  # made fresh
        kids.append(await pooled.create_forked(parent, dataclasses.replace(s, hostname=s.id)))
        pooled.pool.config.enabled = True
        a, b, cold = kids
        assert "pivot" in a.state["create_ms"] and a.state["warm_id"].startswith("wp-")
        assert "pivot" in b.state["create_ms"] and "warm_id" not in cold.state
        assert pooled.frozen_layers() == {fid: 4}

        async def out(h: Handle, cmd: str, user: str | None = None) -> str:
            r = await pooled.exec(h, ExecRequest(cmd=cmd, user=user))
            assert r.ok, (cmd, r)
            return r.stdout.strip()

        probe = "cat /data/who; test -e /bin/ls || echo no-ls; hostname; id -u; pwd"
        for k in kids:  # the parent's files, its whiteouts and users; its own hostname
            assert (await out(k, probe)).split("\n") == ["parent", "no-ls", k.id, "1234", "/"]
            # renames across directories (Landlock's REFER grant names the new root)
            assert (
                await out(
                    k, "mkdir /tmp/d1 /tmp/d2; touch /tmp/d1/f; mv /tmp/d1/f /tmp/d2/f; ls /tmp/d2"
                )
                == "f"
            )
        ids = {await out(k, "cat /etc/machine-id") for k in kids}  # not the parent's
        boots = {await out(k, "cat /proc/sys/kernel/random/boot_id") for k in kids}
        assert len(ids - {"0123456789abcdef0123456789abcdef"}) == 3 and len(boots) == 3
        # a write in one child is seen by no sibling nor the parent (frozen: its layer)
        await out(a, "echo a > /data/who; touch /data/only-a", "root")
        parent_data = pooled.paths.sandboxes / parent.id / "upper" / "data" / "data"
        assert sorted(p.name for p in parent_data.iterdir()) == ["who"]
        for k in (b, cold):
            assert await out(k, "cat /data/who; ls /data") == "parent\nwho"

        # the same mounts as a fresh child, and nothing of the warm root: the container's
        # root, the init's and the exec server's are the new overlay the node mounted
        def mountpoints(h: Handle) -> list[str]:
            with open(f"/proc/{h.state['init_pid']}/mountinfo") as f:
                return sorted(line.split()[4] for line in f)

        assert mountpoints(a) == mountpoints(cold)
        assert await out(a, "test -e /.dsec-reroot || echo none") == "none"
        root_dev = os.stat(pooled.paths.sandboxes / a.id / "rootfs").st_dev
        assert os.stat(f"/proc/{a.state['init_pid']}/root").st_dev == root_dev
        server = pooled._live[a.id].server
        assert server is not None and os.stat(f"/proc/{server.pid}/root").st_dev == root_dev
        assert sum(1 for p in mount_points(pooled.paths.sandboxes / a.id)) == 2  # root, upper
    finally:
        await destroy_family(pooled, parent, kids)


async def test_a_fork_root_with_a_symlinked_mount_point_is_not_moved_onto(
    pooled: ContainerRuntime,
    node: Node,  # noqa: F811
) -> None:
    """A parent whose root has ``/proc`` as a symbolic link (out of its root): the move
    refuses it (nothing is mounted through a link of the tenant's), the warm container is
    destroyed and the child is made fresh (or fails as a fresh one would), leaving nothing."""
    pooled.pool.config.idle_s = 3600.0
    parent = await pooled.create(spec(node))
    kids: list[Handle] = []
    try:
        await pooled.freeze_upper(parent)
        os.symlink("/../../../../etc", upper_dir(pooled.paths.sandboxes / parent.id) / "proc")
        await warm(pooled)
        hits = pooled.pool.stats.hits
        s = spec(node)
        try:
            kids.append(await pooled.create_forked(parent, dataclasses.replace(s, hostname=s.id)))
        except Exception as e:  # what a fresh container does with it: the OCI runtime's call
            assert "warm" not in str(e), e
        assert pooled.pool.stats.hits == hits + 1  # a warm one was taken, and not kept
        assert all("warm_id" not in k.state for k in kids)
        # the claim made the pool refill: the containers it is making have directories too
        # until they are ready (not leftovers)
        fills = [k.task for k in pooled.pool._keys.values() if k.task is not None]
        await asyncio.gather(*fills, return_exceptions=True)
        assert not [
            p
            for p in pooled.paths.sandboxes.glob("wp-*")
            if p.name not in {w.id for q in pooled.pool._keys.values() for w in q.ready}
        ]
    finally:
        await destroy_family(pooled, parent, kids)
