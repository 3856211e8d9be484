"""Test and benchmark wiring for the fncall tier: a real runtime on a private ``DSEC_HOME``.

The layer directory can be shared (a symlink to a store named by ``layer_cache`` or ``$DSEC_TEST_LAYER_CACHE``)
so the debian image and toolkit layers are built once per machine, not once per run::

    async with fncall_service(Path("/tmp/dsec-x"), layer_cache=Path("/var/cache/dsec-test-layers")) as svc:
        resp = await svc.run_code(RunCodeRequest(code="print(1+1)", language="python"))

On exit every worker, zygote and cgroup of the runtime is gone (``FncallRuntime.close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from dsec.config import Paths
from dsec.contract.runtime import SandboxSpec
from dsec.runtimes.fncall.pool import PoolConfig
from dsec.runtimes.fncall.runtime import FncallConfig, FncallRuntime
from dsec.runtimes.fncall.service import RunCodeLimits, RunCodeService

__all__ = ["default_layer_cache", "fncall_service"]


def default_layer_cache() -> Path | None:
    """``$DSEC_TEST_LAYER_CACHE`` when set, else None (the home keeps its own layer store;
    built-in images and toolkits come from ``DSEC_BUILTIN_CACHE`` when that is set). A
    machine-wide default store was shared by every test process at once and went stale."""
    shared = os.environ.get("DSEC_TEST_LAYER_CACHE")
    return Path(shared) if shared else None


@contextlib.asynccontextmanager
async def fncall_service(
    home: Path,
    *,
    layer_cache: Path | None = None,
    pool: PoolConfig | None = None,
    limits: RunCodeLimits | None = None,
) -> AsyncIterator[RunCodeService]:
    """A started :class:`FncallRuntime` + :class:`RunCodeService` on ``home``; closed on exit."""
    from dsec.layers import LayerStore

    def prepare() -> tuple[Paths, LayerStore]:
        home.mkdir(parents=True, exist_ok=True)
        cache = layer_cache or default_layer_cache()
        layers = home / "layers"
        if cache is not None and not layers.exists():
            cache.mkdir(parents=True, exist_ok=True)
            layers.symlink_to(cache, target_is_directory=True)
        paths = Paths(home)
        paths.ensure()
        return paths, LayerStore(paths.layers, paths.scratch)

    paths, store = await asyncio.to_thread(prepare)
    runtime = FncallRuntime(
        paths, None, store, FncallConfig(pool=pool or PoolConfig(min_ready=2, max_ready=16))
    )
    await runtime.start()
    try:
        yield RunCodeService(runtime, limits)
    finally:
        await runtime.close()
        store.close()


def worker_spec(files: list[Path], digests: list[str], sandbox_id: str) -> SandboxSpec:
    """A small fncall sandbox over the image layers ``files``/``digests`` (as
    ``FncallRuntime.image_layers`` answers them): 1 core, 256 MiB, 64 pids, /work."""
    return SandboxSpec(
        id=sandbox_id,
        tier="fncall",
        layer_paths=[str(f) for f in files],
        layer_digests=list(digests),
        cpu=1,
        memory_mb=256,
        disk_mb=64,
        pids=64,
        env={},
        user=None,
        workdir="/work",
    )
