"""dsec's own processes in their reserved cgroup (dsec.privileged.cgroups.supervisor): a
``dsec serve`` runs weighted above every sandbox, on cgroup v1 and v2, and leaves nothing
behind. Needs root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.privileged.cgroups import host_layout
from dsec.privileged.cgroups.layout import SUPERVISOR_LEAF
from dsec.server import ServeProcess

pytestmark = pytest.mark.root


def _cgroup_of(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, hierarchy, path = line.split(":", 2)
        out[hierarchy] = path
    return out


def _leaf() -> Path:
    layout = host_layout()
    if layout.mode == "v2":
        return layout.base_dir / SUPERVISOR_LEAF
    return layout.mount / "cpu" / SUPERVISOR_LEAF


def _dsec_servers(leaf: Path) -> list[int]:
    pids = [int(p) for p in (leaf / "cgroup.procs").read_text().split()]
    return [p for p in pids if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_the_server_runs_in_its_weighted_cgroup_and_leaves_none(tmp_path: Path) -> None:
    layout = host_layout()
    leaf = _leaf()
    with ServeProcess(tmp_path / "home", env={"DSEC_SUPERVISOR_CPU_WEIGHT": "800"}) as srv:
        pid = srv.proc.pid
        where = _cgroup_of(pid)
        if layout.mode == "v2":
            assert where[""].rstrip("/").endswith(f"/{SUPERVISOR_LEAF}")
            assert (leaf / "cpu.weight").read_text().strip() == "800"
        else:
            cpu = next(p for k, p in where.items() if "cpu" in k.split(","))
            assert cpu == f"/{SUPERVISOR_LEAF}"
            assert (leaf / "cpu.shares").read_text().strip() == str(800 * 1024 // 100)
            # only the cpu hierarchy: memory and pids keep dsec where it was started
            assert where["memory"] == _cgroup_of(os.getpid())["memory"]
        assert pid in _dsec_servers(leaf)
    # gone with the last server that used it (another test's server may still run in it)
    assert not leaf.exists() or _dsec_servers(leaf)


def test_off_leaves_the_server_where_it_was_started(tmp_path: Path) -> None:
    with ServeProcess(tmp_path / "home", env={"DSEC_SUPERVISOR_CGROUP": "off"}) as srv:
        assert _cgroup_of(srv.proc.pid) == _cgroup_of(os.getpid())
