"""Template RAM (a file on /dev/shm, guest RAM in size) outlives no runtime (issue 32, item 7):
``close`` deletes the templates no sandbox needs, ``start`` those a crashed runtime left,
and neither touches what another live runtime of the same home uses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.timing import budget, vm_boot_budgets

from dsec.config import Paths
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime

from .conftest import VM_HOME, BusyboxImage, new_spec

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def home() -> Iterator[Path]:
    """A home of its own (short: unix socket paths live under it) sharing the guest build."""
    home = Path(tempfile.mkdtemp(prefix="dsec-tplram-", dir="/tmp")) / "home"
    home.mkdir()
    (VM_HOME / "bin").mkdir(parents=True, exist_ok=True)
    (home / "bin").symlink_to(VM_HOME / "bin", target_is_directory=True)
    yield home
    rt = MicroVMRuntime(Paths(home))
    rt.remove_templates()
    shutil.rmtree(rt.shm_dir, ignore_errors=True)
    for rel in (rt.cgroup_prefix, f"dsec-{rt.tag}"):
        with contextlib.suppress(OSError):
            cgroup(rel).remove_if_empty()
    shutil.rmtree(home.parent, ignore_errors=True)


def _config() -> MicroVMConfig:
    return MicroVMConfig(pool_size=0, exec_grace_s=budget(3.0), **vm_boot_budgets())


def _ram(rt: MicroVMRuntime) -> list[Path]:
    return sorted(rt.shm_dir.glob("microvm-*.ram"))


_CRASH = """
import asyncio, json, os, sys
from pathlib import Path
from dsec.config import Paths
from dsec.contract.runtime import SandboxSpec
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime

async def main():
    rt = MicroVMRuntime(Paths(Path(sys.argv[1])), MicroVMConfig(**json.loads(sys.argv[3])))
    await rt.start()
    h = await rt.create(SandboxSpec(**json.loads(sys.argv[2])))
    await rt.destroy(h)
    os._exit(0)  # a crash: no close()

asyncio.run(main())
"""


async def test_template_ram_is_released_at_close_and_reclaimed_after_a_crash(
    home: Path, busybox_image: BusyboxImage
) -> None:
    rt = MicroVMRuntime(Paths(home), _config())
    await rt.start()
    h = await rt.create(new_spec(busybox_image))
    ram = _ram(rt)
    assert len(ram) == 1 and rt.templates()
    # a second runtime of the same home while the first lives: it neither reclaims at start
    # nor releases at close what the first one uses
    other = MicroVMRuntime(Paths(home), _config())
    await other.start()
    await other.close()
    assert _ram(rt) == ram
    # a live sandbox keeps its template across a restart (its QEMU maps the file)
    await rt.close()
    assert _ram(rt) == ram
    rt = MicroVMRuntime(Paths(home), _config())
    await rt.start()
    assert _ram(rt) == ram and await rt.recover(h)
    await rt.destroy(h)
    # the last runtime to close, with no sandbox left: the template goes
    await rt.close()
    assert _ram(rt) == [] and rt.templates() == []

    # a crashed runtime (no close) leaves its template; the next start reclaims it
    spec = new_spec(busybox_image)
    cfg = {"pool_size": 0, **vm_boot_budgets()}
    crash = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASH, str(home), json.dumps(spec.__dict__), json.dumps(cfg),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(crash.communicate(), budget(240))
    assert crash.returncode == 0, out.decode(errors="replace")
    left = _ram(rt)
    assert len(left) == 1
    rt = MicroVMRuntime(Paths(home), _config())
    await rt.start()
    try:
        assert _ram(rt) == [] and rt.templates() == []
    finally:
        await rt.close()
