"""The fncall tier's cgroups, without a kernel: the plan the server hands the zygote (file
names from the host's driver, nothing hard-coded in the zygote), the zygote's steps from it,
and the tier's availability from the host's layout. Drivers run on directories under
``tmp_path`` standing in for a cgroup file system."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.privileged.cgroups import CgroupLayout, CgroupV1, CgroupV2, reset_layout
from dsec.runtimes.fncall.pool import PoolConfig, worker_cgroup_plan
from dsec.runtimes.fncall.runtime import FncallRuntime
from dsec.runtimes.fncall.zygote import cgroup_steps, command_pids_max

CONFIG = PoolConfig(memory_mb=512, pids=64, cpu=1.5)


def test_plan_v1_names_the_limit_hierarchies_and_lowers_memory_first(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")
    plan = worker_cgroup_plan(CgroupV1("dsec-x-fncall/python-1", tmp_path), CONFIG)
    assert plan["hierarchies"] == ["cpu", "memory", "pids"]  # no cpuacct, no freezer
    assert plan["writes"] == [
        ["cpu", "cpu.cfs_period_us", "100000"],
        ["cpu", "cpu.cfs_quota_us", "150000"],
        # a fresh cgroup has no limit: memory first, then memory+swap down to it
        ["memory", "memory.limit_in_bytes", str(512 << 20)],
        ["memory", "memory.memsw.limit_in_bytes", str(512 << 20)],
        ["pids", "pids.max", "64"],
    ]
    assert plan["procs_file"] == "cgroup.procs"


def test_plan_v1_without_swap_accounting(tmp_path: Path) -> None:
    plan = worker_cgroup_plan(CgroupV1("p", tmp_path), CONFIG)
    assert [w[1] for w in plan["writes"] if w[0] == "memory"] == ["memory.limit_in_bytes"]


def test_plan_v2_is_one_directory(tmp_path: Path) -> None:
    pool = CgroupV2("dsec-x-fncall/python-1", tmp_path, "system.slice/dsec.service")
    pool.dir.mkdir(parents=True)
    (pool.dir / "memory.swap.max").write_text("max\n")  # the pool's parent has memory on
    plan = worker_cgroup_plan(pool, CONFIG)
    assert plan["hierarchies"] == [""]
    assert plan["writes"] == [
        ["", "cpu.max", "150000 100000"],
        ["", "memory.max", str(512 << 20)],
        ["", "memory.swap.max", "0"],
        ["", "pids.max", "64"],
    ]


def test_zygote_steps_make_limit_then_join_in_every_hierarchy(tmp_path: Path) -> None:
    """The agent joins the worker's cgroup in every hierarchy but the pids one, where it
    lives in a child (the commands get children of their own beside it)."""
    plan = worker_cgroup_plan(CgroupV1("p", tmp_path), CONFIG)
    plan = json.loads(json.dumps({**plan, "fds": [5, 6, 7]}))  # as the zygote receives it
    steps = cgroup_steps(plan, "w12")
    assert steps == [
        (5, "w12", None),
        (6, "w12", None),
        (7, "w12", None),
        (5, "w12/cpu.cfs_period_us", "100000"),
        (5, "w12/cpu.cfs_quota_us", "150000"),
        (6, "w12/memory.limit_in_bytes", str(512 << 20)),
        (7, "w12/pids.max", "64"),
        (7, "w12/agent", None),
        (5, "w12/cgroup.procs", "0"),
        (6, "w12/cgroup.procs", "0"),
        (7, "w12/agent/cgroup.procs", "0"),
    ]


def test_zygote_steps_v2_one_descriptor(tmp_path: Path) -> None:
    """v2: the worker's cgroup hands the pids controller to its children (and so holds no
    process itself: the agent is in one of them)."""
    pool = CgroupV2("p", tmp_path)
    pool.dir.mkdir()
    steps = cgroup_steps({**worker_cgroup_plan(pool, CONFIG), "fds": [9]}, "w1")
    assert {fd for fd, _, _ in steps} == {9}
    assert steps[0] == (9, "w1", None) and steps[-1] == (9, "w1/agent/cgroup.procs", "0")
    assert (9, "w1/memory.max", str(512 << 20)) in steps
    nest = steps.index((9, "w1/cgroup.subtree_control", "+pids"))
    assert nest > steps.index((9, "w1/pids.max", "64"))
    assert steps[nest + 1] == (9, "w1/agent", None)


def test_command_pids_max_keeps_a_reserve() -> None:
    assert [command_pids_max(n) for n in (1, 8, 64, 1024)] == [1, 6, 56, 1016]


def test_steps_carried_out_on_directories(tmp_path: Path) -> None:
    """The steps as the zygote carries them out (mkdirat, then writes by descriptor) give
    the worker's directory the pool's limits in each hierarchy."""
    for h in ("cpu", "memory", "pids"):
        (tmp_path / h / "pool").mkdir(parents=True)
    pool = CgroupV1("pool", tmp_path)
    plan = worker_cgroup_plan(pool, CONFIG)
    dirs = pool.dirs()
    fds = [os.open(dirs[h], os.O_RDONLY | os.O_DIRECTORY) for h in plan["hierarchies"]]
    try:
        for fd, path, value in cgroup_steps({**plan, "fds": fds}, "w3"):
            if value is None:
                os.mkdir(path, 0o755, dir_fd=fd)
            else:  # a cgroup file system has the files; plain directories need O_CREAT
                f = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(f, value.encode())
                os.close(f)
    finally:
        for fd in fds:
            os.close(fd)
    w = pool.child("w3")
    assert isinstance(w, CgroupV1)
    assert (w.path("memory") / "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert (w.path("pids") / "pids.max").read_text() == "64"
    assert (w.path("cpu") / "cpu.cfs_quota_us").read_text() == "150000"
    assert w.procs_files() == [w.path(c) / "cgroup.procs" for c in w.dirs()]


def test_set_memory_with_known_direction_reads_nothing(tmp_path: Path) -> None:
    """A worker knows the limit it set last: no read of the current one per call."""
    (tmp_path / "memory" / "w1").mkdir(parents=True)
    (tmp_path / "memory" / "memory.memsw.limit_in_bytes").write_text("0")
    cg = CgroupV1("w1", tmp_path)
    cg.set_memory(1 << 30, raising=True)  # memory.limit_in_bytes does not exist to be read
    d = cg.path("memory")
    assert (d / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (d / "memory.memsw.limit_in_bytes").read_text() == str(1 << 30)


def test_v2_pool_enables_controllers_for_workers_made_by_descriptor(tmp_path: Path) -> None:
    pool = CgroupV2("p", tmp_path)
    pool.dir.mkdir()
    (pool.dir / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (pool.dir / "cgroup.subtree_control").write_text("\n")
    pool.enable_child_controllers()
    assert (pool.dir / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    CgroupV1("p", tmp_path).enable_child_controllers()  # v1: nothing to do, nothing written


@pytest.fixture
def layout() -> Iterator[None]:
    yield
    reset_layout(None)


@pytest.mark.skipif(os.geteuid() != 0, reason="the root check comes first")
def test_tier_availability_follows_the_layout(tmp_path: Path, layout: None) -> None:
    rt = FncallRuntime(Paths(tmp_path))
    reason = "cgroup v1 (systemd's legacy layout) without a v1 memory controller"
    reset_layout(CgroupLayout("unsupported", reason=reason, missing=("memory",)))
    facts = rt.facts()
    assert not facts.available and facts.reason is not None and reason in facts.reason
    reset_layout(CgroupLayout("v2", controllers=("cpu", "memory", "pids")))
    assert rt.facts().available
    reset_layout(CgroupLayout("v1", controllers=("cpu", "cpuacct", "memory", "pids", "freezer")))
    assert rt.facts().available
