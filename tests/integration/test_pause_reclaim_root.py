"""A paused container gives its page cache back only once the pause has lasted
``pause_reclaim_after_s``: an agent's sandbox paused for the few seconds its model thinks keeps
what its next command reads (reclaimed at once, every command after a pause read its programs
from the layers again). Needs root."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import pytest
from tests.integration.test_container_runtime import node  # noqa: F401
from tests.timing import budget

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import rootfs_path
from dsec.models import ExecRequest
from dsec.runtimes.container.pause import memory_stat
from dsec.runtimes.container.pool import PoolConfig
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

Node = tuple[Paths, list[str], list[str]]
READ_LAYERS = "find / -xdev -type f -exec cat {} + > /dev/null 2>&1; true"


def _spec(node: Node) -> SandboxSpec:  # noqa: F811
    _, layer_paths, digests = node
    return SandboxSpec(
        id=f"sb-r-{uuid.uuid4().hex[:10]}",
        tier="container",
        layer_paths=layer_paths,
        layer_digests=digests,
        cpu=0.5,
        memory_mb=128,
        disk_mb=64,
        pids=64,
        env={},
        user=None,
        workdir="/",
    )


def _read_layers(rt: ContainerRuntime, h: Handle) -> str:
    """Drop the page cache of the sandbox's files (other sandboxes of the image read and were
    charged for them), then the command that reads them all again: charged to this one."""
    for path in rootfs_path(rt._sandbox_dir(h.id)).rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return READ_LAYERS


def _file_cache(rt: ContainerRuntime, h: Handle) -> int:
    """The sandbox's page cache of files (its layers' pages), not tmpfs."""
    stat = memory_stat(rt._cgroup(h))
    return stat.cache - stat.shmem


async def test_a_short_pause_keeps_the_page_cache_a_long_one_gives_it_back(node: Node) -> None:  # noqa: F811
    paths, _, _ = node
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False))
    rt.pause_reclaim_after_s = 0.5
    await rt.start()
    made: list[Handle] = []
    try:
        for _ in range(2):
            h = await rt.create(_spec(node))
            made.append(h)
            assert (await rt.exec(h, ExecRequest(cmd=_read_layers(rt, h)))).ok
        short, long = made
        cached = _file_cache(rt, long)
        assert cached > 256 << 10, cached  # the layers' files it read

        report = await rt.pause(short)
        assert report["method"] == "freeze", report
        await rt.resume(short)  # before the reclaim was due
        report = await rt.pause(long)
        assert report["method"] == "freeze" and "reclaimed once" in report["notes"][-1]
        assert _file_cache(rt, long) > cached // 2  # nothing given back yet

        deadline = asyncio.get_running_loop().time() + budget(10)
        while _file_cache(rt, long) > cached // 4:
            assert asyncio.get_running_loop().time() < deadline, _file_cache(rt, long)
            await asyncio.sleep(0.1)
        assert rt._cgroup(long).is_frozen()
        assert _file_cache(rt, short) > _file_cache(rt, long)  # resumed in time: kept
        await rt.resume(long)
        assert (await rt.exec(long, ExecRequest(cmd="echo back"))).stdout == "back\n"
    finally:
        for h in made:
            await rt.destroy(h)
        await rt.close()


async def test_reclaiming_at_once_when_asked(node: Node) -> None:  # noqa: F811
    """``DSEC_PAUSE_RECLAIM_AFTER_S=0``: the pause reclaims before it answers."""
    paths, _, _ = node
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts), pool=PoolConfig(enabled=False))
    rt.pause_reclaim_after_s = 0
    await rt.start()
    try:
        h = await rt.create(_spec(node))
        try:
            assert (await rt.exec(h, ExecRequest(cmd=_read_layers(rt, h)))).ok
            cached = _file_cache(rt, h)
            report = await rt.pause(h)
            assert report["method"].startswith("freeze+"), report
            assert _file_cache(rt, h) < cached // 4
            await rt.resume(h)
        finally:
            await rt.destroy(h)
    finally:
        await rt.close()
