"""Fixtures for the VM tier tests: a busybox image from the layer store, a microvm runtime
on a private DSEC_HOME, and a factory that destroys what it made (keeping the console on
failure).

The guest kernel package is fetched once through apt (or ``$DSEC_VM_KERNEL_DEB``); the
first template boot takes a few seconds under TCG, later sandboxes restore in ~0.2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.isolation import WORKER
from tests.timing import budget, vm_boot_budgets

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec, capabilities_of
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime

VM_HOME = Path(os.environ.get("DSEC_VM_TEST_HOME", f"/tmp/dsec-vmtest-{WORKER}"))
"""Per xdist worker: two workers' VM tests never share templates or cgroups."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vm: boots QEMU guests (microvm / vm tiers)")


@dataclass
class BusyboxImage:
    layer_paths: list[str]
    layer_digests: list[str]


def _build_image(home: Path) -> BusyboxImage:
    """The busybox image through dsec.layers, or a local mkfs.erofs fixture if that fails."""
    paths = Paths(home)
    paths.ensure()
    try:
        from dsec.layers.store import LayerStore

        store = LayerStore(paths.layers, paths.scratch)
        try:
            info = store.ensure_image_sync("busybox")
            return BusyboxImage([str(store.layer_path(d)) for d in info.layers], list(info.layers))
        finally:
            store.close()
    except Exception:  # the layer store is another part's code: fall back to our own layer
        from dsec.layers.builtin import build_busybox_rootfs
        from dsec.layers.erofs import mkfs_erofs

        src = home / "fixture-rootfs"
        shutil.rmtree(src, ignore_errors=True)
        build_busybox_rootfs(src)
        out = home / "fixture-busybox.erofs"
        mkfs_erofs(src, out)
        digest = "sha256:" + hashlib.sha256(out.read_bytes()).hexdigest()
        return BusyboxImage([str(out)], [digest])


@pytest.fixture(scope="session")
def vm_home() -> Iterator[Path]:
    VM_HOME.mkdir(parents=True, exist_ok=True)
    yield VM_HOME
    # session teardown: templates of both tiers (RAM files on /dev/shm), cgroup parents
    from dsec.runtimes.vm import VMRuntime

    VMRuntime(Paths(VM_HOME)).remove_templates()
    rt = MicroVMRuntime(Paths(VM_HOME))
    rt.remove_templates()
    for rel in (rt.cgroup_prefix, f"dsec-{rt.tag}/vm", f"dsec-{rt.tag}"):
        with contextlib.suppress(OSError):
            cgroup(rel).remove_if_empty()


@pytest.fixture(scope="session")
def busybox_image(vm_home: Path) -> BusyboxImage:
    return _build_image(vm_home)


@pytest.fixture
async def microvm(vm_home: Path) -> AsyncIterator[MicroVMRuntime]:
    rt = MicroVMRuntime(
        Paths(vm_home),
        MicroVMConfig(
            pool_size=0, exec_grace_s=budget(3.0), keep_templates=True, **vm_boot_budgets()
        ),
    )
    await rt.start()
    if not capabilities_of(rt).available:
        pytest.fail(f"microvm tier unavailable: {capabilities_of(rt).reason}")
    yield rt
    await rt.close()


_counter = 0


def new_spec(image: BusyboxImage, **kw: Any) -> SandboxSpec:
    global _counter
    _counter += 1
    base: dict[str, Any] = dict(
        id=f"sb-vmt-{os.getpid()}-{_counter}", tier="microvm", layer_paths=image.layer_paths,
        layer_digests=image.layer_digests, cpu=1.0, memory_mb=256, disk_mb=64, pids=256,
        env={"GREETING": "hello"}, user=None, workdir="/",
    )  # fmt: skip
    base.update(kw)
    return SandboxSpec(**base)


@pytest.fixture
async def make_vm(
    microvm: MicroVMRuntime, busybox_image: BusyboxImage, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., Awaitable[Handle]]]:
    made: list[Handle] = []

    async def make(**kw: Any) -> Handle:
        h = await microvm.create(new_spec(busybox_image, **kw))
        made.append(h)
        return h

    yield make
    for h in made:
        console = Path(h.state["dir"]) / "console.log"
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed and console.exists():
            print(f"--- console of {h.id} ---\n{console.read_text(errors='replace')[-3000:]}")
        await asyncio.wait_for(microvm.destroy(h), 30)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome: Any = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
