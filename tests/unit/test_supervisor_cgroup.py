"""The node agent's cgroup (dsec.privileged.cgroups.supervisor) on a v2 and a v1 tree made of
plain files: where dsec moves itself, the weight it sets, where it goes back at exit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.privileged.cgroups import supervisor
from dsec.privileged.cgroups.layout import CgroupLayout


def _v2_tree(root: Path, own: str) -> None:
    parts = own.split("/")
    for d in [root, *(root.joinpath(*parts[: i + 1]) for i in range(len(parts)))]:
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text("cpu memory pids\n")
        (d / "cgroup.subtree_control").write_text("")
        (d / "cgroup.procs").write_text("")


def test_v2_from_a_shell_dsec_moves_beside_its_sandboxes_and_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _v2_tree(tmp_path, "user.slice/session-1.scope")
    monkeypatch.setattr(supervisor, "_own_cgroups", lambda: {"": "/user.slice/session-1.scope"})
    layout = CgroupLayout("v2", tmp_path, "", controllers=("cpu", "memory", "pids"))
    sup = supervisor.reserve(layout)
    assert sup is not None
    leaf = tmp_path / "dsec-supervisor"
    assert (leaf / "cgroup.procs").read_text() == str(os.getpid())
    assert (leaf / "cpu.weight").read_text() == "1000"
    assert "+cpu" in (tmp_path / "cgroup.subtree_control").read_text()  # prepare() ran
    (leaf / "cgroup.procs").unlink()
    (leaf / "cpu.weight").unlink()
    sup.release()
    assert (tmp_path / "user.slice/session-1.scope/cgroup.procs").read_text() == str(os.getpid())
    assert not leaf.exists()


def test_v2_delegated_base_keeps_dsec_in_the_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _v2_tree(tmp_path, "system.slice/dsec.service")
    base = tmp_path / "system.slice/dsec.service"
    monkeypatch.setattr(supervisor, "_own_cgroups", lambda: {"": "/system.slice/dsec.service"})
    monkeypatch.setenv("DSEC_SUPERVISOR_CPU_WEIGHT", "500")
    layout = CgroupLayout("v2", tmp_path, "system.slice/dsec.service", delegated=True)
    sup = supervisor.reserve(layout)
    assert sup is not None and sup.came_from == []  # a base with controllers takes none back
    assert (base / "dsec-supervisor" / "cpu.weight").read_text() == "500"


def test_v1_only_the_cpu_hierarchy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "cpu.shares").write_text("1024")
    monkeypatch.setattr(
        supervisor, "_own_cgroups", lambda: {"cpu,cpuacct": "/", "memory": "/", "": "/"}
    )
    sup = supervisor.reserve(CgroupLayout("v1", tmp_path))
    assert sup is not None
    assert (cpu / "dsec-supervisor/cpu.shares").read_text() == "10240"
    assert (cpu / "dsec-supervisor/cgroup.procs").read_text() == str(os.getpid())
    assert sup.came_from == [cpu]


def test_off_and_bad_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_SUPERVISOR_CGROUP", "off")
    assert supervisor.reserve(CgroupLayout("v1", tmp_path)) is None
    monkeypatch.setenv("DSEC_SUPERVISOR_CGROUP", "on")
    for bad in ("0", "20000", "lots"):
        monkeypatch.setenv("DSEC_SUPERVISOR_CPU_WEIGHT", bad)
        with pytest.raises(SystemExit, match="DSEC_SUPERVISOR_CPU_WEIGHT"):
            supervisor.reserve(CgroupLayout("v1", tmp_path))
    # a host without what it needs: logged, dsec runs where it started
    monkeypatch.setenv("DSEC_SUPERVISOR_CPU_WEIGHT", "1000")
    assert supervisor.reserve(CgroupLayout("v1", tmp_path)) is None
