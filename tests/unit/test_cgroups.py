"""The cgroup layer without a kernel: the v2 driver (limits, weights, usage, OOM kills,
freezing, reclaim) and the v1 one's limit order on directories under ``tmp_path`` standing
in for a cgroup file system, and :func:`detect_layout` on fake mounts (v1, hybrid, v2 with
a base cgroup, unsupported). Moving processes (``prepare``, ``attach``) needs a kernel: the
root tests do it."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.privileged.cgroups import (
    Cgroup,
    CgroupLayout,
    CgroupV1,
    CgroupV2,
    LimitWrite,
    cgroup,
    detect_layout,
    parse_flat_keyed,
    reset_layout,
    shares_to_weight,
    weight_to_shares,
)
from dsec.runtimes.usage import read_cgroup

V2_FILES = {
    "cgroup.procs": "",
    "cgroup.freeze": "0\n",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.max": "max 100000\n",
    "cpu.weight": "100\n",
    "cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
    "memory.swap.max": "max\n",
    "memory.swap.current": "4096\n",
    "memory.current": "20971520\n",
    "memory.peak": "31457280\n",
    "memory.reclaim": "",
    "memory.stat": (
        "anon 10485760\nfile 8388608\nshmem 1048576\nfile_mapped 2097152\ninactive_file 4194304\n"
    ),
    "memory.events": "low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n",
    "pids.max": "max\n",
    "pids.current": "3\n",
}


def fake_v2(base: Path, rel: str, files: dict[str, str] | None = None) -> CgroupV2:
    """A v2 cgroup ``rel`` below ``base`` made of plain files."""
    d = base / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, text in (V2_FILES if files is None else files).items():
        (d / name).write_text(text)
    return CgroupV2(rel, base, "system.slice/dsec.service")


def read(cg: Cgroup, w: LimitWrite) -> str:
    return (cg.dirs()[w.hierarchy] / w.file).read_text()


# --- the v2 driver ---------------------------------------------------------------------------
def test_v2_limit_writes_and_setters(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "dsec-x/sb-1")
    assert cg.limit_writes(cpu=0.5, memory_bytes=96 << 20, pids=77) == [
        LimitWrite("", "cpu.max", "50000 100000"),
        LimitWrite("", "memory.max", str(96 << 20)),
        LimitWrite("", "memory.swap.max", "0"),  # no swap while it runs (v1: memsw = limit)
        LimitWrite("", "pids.max", "77"),
    ]
    assert cg.limit_writes(cpu=0.001) == [LimitWrite("", "cpu.max", "1000 100000")]  # a floor
    assert cg.accounts_swap()
    cg.set_cpu(1.5)
    cg.set_memory(128 << 20)
    cg.set_pids(64)
    assert (cg.dir / "cpu.max").read_text() == "150000 100000"
    assert cg.memory_limit() == 128 << 20
    assert (cg.dir / "memory.swap.max").read_text() == "0"
    assert (cg.dir / "pids.max").read_text() == "64"
    # without swap accounting (no memory.swap.max) only the limit is written
    bare = fake_v2(
        tmp_path / "noswap", "sb", {k: v for k, v in V2_FILES.items() if "swap" not in k}
    )
    assert [w.file for w in bare.limit_writes(memory_bytes=1 << 20)] == ["memory.max"]
    assert not bare.accounts_swap()


def test_v2_where_it_is(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "dsec-x/sb-1")
    assert cg.oci_path() == "/system.slice/dsec.service/dsec-x/sb-1"
    assert cg.dirs() == {"": tmp_path / "dsec-x/sb-1"} and cg.every_dir() == [cg.dir]
    assert cg.exists() and not CgroupV2("dsec-x/nope", tmp_path).exists()
    assert CgroupV2("a", tmp_path).oci_path() == "/a"  # the hierarchy's root as base
    parent = CgroupV2("dsec-x", tmp_path, "system.slice/dsec.service")
    assert parent.children() == ["sb-1"]
    assert parent.child("sb-1").oci_path() == cg.oci_path()


def test_v2_create_enables_controllers_down_the_path(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    CgroupV2("dsec-x", tmp_path).create()
    assert (tmp_path / "dsec-x").is_dir()
    # only what is missing, of what dsec uses (plain files: the write replaces the content)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +pids"
    # the kernel gives a new cgroup its files; here the test does
    (tmp_path / "dsec-x/cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "dsec-x/cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory pids\n")
    CgroupV2("dsec-x/sb-1", tmp_path).create()
    assert (tmp_path / "dsec-x/sb-1").is_dir()
    assert (tmp_path / "dsec-x/cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "cpu memory pids\n"


def test_v2_cpu_shares_are_weights(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "sb")
    for shares, weight in ((2, 1), (512, 20), (1024, 39), (1536, 59), (262144, 10000)):
        (cg.dir / "cpu.weight").write_text("")  # cgroupfs needs no truncation; a file does
        cg.set_cpu_shares(shares)
        assert (cg.dir / "cpu.weight").read_text() == str(weight)
        assert cg.cpu_shares() == weight_to_shares(weight)
        assert shares_to_weight(cg.cpu_shares()) == weight


def test_shares_and_weights_map_back_and_forth() -> None:
    assert [shares_to_weight(s) for s in (0, 2, 1024, 262144, 10**6)] == [1, 1, 39, 10000, 10000]
    for w in (1, 2, 39, 100, 9999, 10000):
        s = weight_to_shares(w)
        assert shares_to_weight(s) == w and (s == 2 or shares_to_weight(s - 1) == w - 1)


def test_v2_usage_and_memory_charge(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "dsec-x/sb-2")
    u = cg.usage()
    assert u.version == 2 and u.cpu_usage_ns == 2_500_000_000
    assert u.memory_used_bytes == 20971520 - 4194304  # the working set
    assert u.memory_cache_bytes == 8388608 and u.memory_limit_bytes is None
    assert u.memory_peak_bytes == 30 << 20 and u.pids == 3
    assert cg.cpu_usage_ns() == 2_500_000_000
    charge = cg.memory_charge()
    assert (charge.usage, charge.cache, charge.rss) == (20971520, 8388608, 10485760)
    assert (charge.shmem, charge.mapped_file, charge.swap) == (1048576, 2097152, 4096)
    # no memory.peak (kernels before 5.19), no pids controller
    (cg.dir / "memory.peak").unlink()
    (cg.dir / "pids.current").unlink()
    assert cg.usage().memory_peak_bytes is None and cg.usage().pids is None
    with pytest.raises(FileNotFoundError):
        CgroupV2("gone", tmp_path).usage()


def test_v2_oom_kills(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "sb")
    assert cg.oom_kills_file() == cg.dir / "memory.events"
    assert cg.oom_kills() == 2
    assert Cgroup.parse_oom_kills(cg.oom_kills_file().read_text()) == 2
    assert CgroupV2("gone", tmp_path).oom_kills() == 0
    # v1's memory.oom_control parses the same way
    assert Cgroup.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert Cgroup.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0


def test_memory_limit_hits_both_layouts(tmp_path: Path) -> None:
    """Counted at the charge that hit the limit, before any OOM kill is (v1 memory.failcnt;
    v2 memory.events' max and oom)."""
    v2 = fake_v2(tmp_path / "v2", "sb")
    (v2.dir / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 0\n")
    assert v2.memory_limit_hits() == 5 and v2.oom_kills() == 0
    assert CgroupV2("gone", tmp_path / "v2").memory_limit_hits() == 0
    v1 = fake_v1(tmp_path / "v1", "sb", memsw=False)
    assert v1.memory_limit_hits() == 0  # no memory.failcnt: nothing counted
    (tmp_path / "v1" / "memory" / "sb" / "memory.failcnt").write_text("7\n")
    assert v1.memory_limit_hits() == 7


def test_v2_freezing(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "sb")
    assert not cg.freeze_requested() and not cg.is_frozen()
    cg.freeze()
    assert cg.freeze_requested() and not cg.is_frozen()  # freezing: the kernel says when
    (cg.dir / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert cg.is_frozen()
    cg.thaw()
    assert not cg.freeze_requested()


def test_v2_reclaim_lifts_swap_only_for_compressed_swap(tmp_path: Path) -> None:
    cg = fake_v2(tmp_path, "sb")
    (cg.dir / "memory.swap.max").write_text("0")
    notes: list[str] = []
    assert cg.reclaim(swap_to="zram", notes=notes, keep_bytes=4 << 20) == "memory.reclaim"
    assert (cg.dir / "memory.reclaim").read_text() == str(20971520 - (4 << 20))
    assert (cg.dir / "memory.swap.max").read_text() == "0" and not notes  # restored
    (cg.dir / "memory.reclaim").write_text("")
    assert cg.reclaim(swap_to="disk", notes=notes, keep_bytes=1 << 30) == "memory.reclaim"
    assert (cg.dir / "memory.reclaim").read_text() == ""  # nothing above what may stay


def test_remove_if_empty_never_removes_what_is_used(tmp_path: Path) -> None:
    (tmp_path / "dsec-x/sb-1").mkdir(parents=True)
    parent = CgroupV2("dsec-x", tmp_path)
    assert not parent.remove_if_empty() and (tmp_path / "dsec-x").is_dir()
    (tmp_path / "dsec-x/sb-1").rmdir()
    assert parent.remove_if_empty() and not (tmp_path / "dsec-x").exists()
    assert parent.remove_if_empty()  # gone already


def test_kill_all_of_a_cgroup_removed_meanwhile_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two parties removing one cgroup (the edge noticing a dead VM, its exec noticing the
    lost agent): the files of a cgroup the other removed answer ENODEV; that is done, not a
    crash (it was a 500 to the exec's client)."""
    cg = fake_v2(tmp_path, "dsec-x/sb-1")

    def gone() -> list[int]:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(cg, "procs", gone)
    cg.kill_all(timeout_s=0.1)  # returns: nothing left to kill

    def broken() -> list[int]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cg, "procs", broken)
    with pytest.raises(OSError):
        cg.kill_all(timeout_s=0.1)  # any other error still surfaces


# --- the v1 driver ---------------------------------------------------------------------------
def fake_v1(mount: Path, rel: str, memsw: bool) -> CgroupV1:
    for c in ("cpu", "cpuacct", "memory", "pids", "freezer"):
        (mount / c / rel).mkdir(parents=True, exist_ok=True)
    if memsw:
        (mount / "memory" / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")
    d = mount / "memory" / rel
    (d / "memory.limit_in_bytes").write_text(str(256 << 20))
    (mount / "cpu" / rel / "cpu.shares").write_text("1024\n")
    return CgroupV1(rel, mount)


def test_v1_memory_and_swap_limits_keep_their_order(tmp_path: Path) -> None:
    cg = fake_v1(tmp_path, "dsec-x/sb-1", memsw=True)
    files = [w.file for w in cg.limit_writes(memory_bytes=1 << 30, raising_memory=True)]
    assert files == ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]  # raised first
    files = [w.file for w in cg.limit_writes(memory_bytes=1 << 20, raising_memory=False)]
    assert files == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]  # lowered last
    assert cg.accounts_swap() and cg.oci_path() == "/dsec-x/sb-1"
    cg.set_memory(96 << 20)
    assert cg.memory_limit() == 96 << 20
    assert (cg.path("memory") / "memory.memsw.limit_in_bytes").read_text() == str(96 << 20)
    (cg.path("cpu") / "cpu.shares").write_text("")  # cgroupfs needs no truncation
    cg.set_cpu_shares(2)
    assert cg.cpu_shares() == 2
    plain = fake_v1(tmp_path / "nomemsw", "sb", memsw=False)
    assert not plain.accounts_swap()
    assert [w.file for w in plain.limit_writes(memory_bytes=1 << 20)] == ["memory.limit_in_bytes"]


# --- layouts ---------------------------------------------------------------------------------
def v1_mount(mount: Path, controllers: tuple[str, ...], hybrid: bool = False) -> Path:
    for c in controllers:
        (mount / c).mkdir(parents=True)
        (mount / c / "cgroup.procs").write_text("")
    if "memory" in controllers:
        (mount / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    if hybrid:
        (mount / "unified").mkdir()
        (mount / "unified" / "cgroup.controllers").write_text("")
    return mount


def proc_cgroup(tmp_path: Path, line: str) -> Path:
    p = tmp_path / "proc-self-cgroup"
    p.write_text(line + "\n")
    return p


@pytest.fixture(autouse=True)
def _no_parent_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_CGROUP_PARENT", raising=False)


def test_detect_v1_and_hybrid(tmp_path: Path) -> None:
    needed = ("cpu", "cpuacct", "memory", "pids", "freezer")
    layout = detect_layout(v1_mount(tmp_path / "v1", needed), proc_cgroup(tmp_path, "0::/"))
    assert layout.mode == "v1" and layout.usable and not layout.hybrid
    assert layout.describe() == "v1"
    hybrid = detect_layout(v1_mount(tmp_path / "hy", (*needed, "devices"), hybrid=True))
    assert hybrid.mode == "v1" and hybrid.hybrid and hybrid.usable
    assert "hybrid" in hybrid.describe()
    partial = detect_layout(v1_mount(tmp_path / "nofreezer", needed[:-1]))
    assert partial.mode == "v1" and partial.missing == ("freezer",) and not partial.usable
    assert isinstance(layout.cgroup("dsec-x/sb"), CgroupV1)


def v2_mount(mount: Path, base: str = "", controllers: str = "cpuset cpu io memory pids") -> Path:
    mount.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text(controllers + "\n")
    (mount / "cgroup.procs").write_text("")
    if base:
        (mount / base).mkdir(parents=True)
        (mount / base / "cgroup.controllers").write_text(controllers + "\n")
    return mount


def test_detect_v2_root_and_named_base(tmp_path: Path) -> None:
    mount = v2_mount(tmp_path / "v2", "system.slice/dsec.service")
    # started from a shell (its cgroup not delegated): dsec's subtree is the hierarchy's root
    layout = detect_layout(mount, proc_cgroup(tmp_path, "0::/user.slice/session-1.scope"))
    assert layout.mode == "v2" and layout.base == "" and layout.usable
    assert layout.base_dir == mount
    # named by DSEC_CGROUP_PARENT (here the argument): sandboxes go below it
    named = detect_layout(mount, proc_cgroup(tmp_path, "0::/"), parent="/system.slice/dsec.service")
    assert named.base == "system.slice/dsec.service" and named.usable
    cg = named.cgroup("dsec-x/sb-1")
    assert isinstance(cg, CgroupV2) and cg.dir == mount / "system.slice/dsec.service/dsec-x/sb-1"
    assert cg.oci_path() == "/system.slice/dsec.service/dsec-x/sb-1"
    assert named.describe() == "v2 (unified), base /system.slice/dsec.service"


def test_detect_v2_delegated_base(tmp_path: Path) -> None:
    mount = v2_mount(tmp_path / "v2", "system.slice/dsec.service")
    try:
        os.setxattr(mount / "system.slice/dsec.service", "trusted.delegate", b"1")
    except OSError:
        try:
            os.setxattr(mount / "system.slice/dsec.service", "user.delegate", b"1")
        except OSError:
            pytest.skip("no extended attributes on this file system")
    for own in ("system.slice/dsec.service", "system.slice/dsec.service/dsec-supervisor"):
        layout = detect_layout(mount, proc_cgroup(tmp_path, f"0::/{own}"))
        assert layout.base == "system.slice/dsec.service" and layout.delegated, own
        assert "delegated by systemd" in layout.describe()


def test_detect_v2_without_controllers(tmp_path: Path) -> None:
    mount = v2_mount(tmp_path / "v2", "system.slice/dsec.service", controllers="cpu pids")
    layout = detect_layout(mount, proc_cgroup(tmp_path, "0::/"), parent="system.slice/dsec.service")
    assert layout.mode == "v2" and layout.missing == ("memory",) and not layout.usable
    assert layout.reason is not None and "Delegate=yes" in layout.reason
    missing = detect_layout(mount, proc_cgroup(tmp_path, "0::/"), parent="no/such/cgroup")
    assert missing.mode == "unsupported" and not missing.usable


def test_detect_unsupported(tmp_path: Path) -> None:
    # systemd's legacy layout on a kernel without CONFIG_MEMCG_V1: no v1 memory hierarchy
    legacy = v1_mount(tmp_path / "legacy", ("cpu", "pids", "freezer"), hybrid=True)
    layout = detect_layout(legacy, proc_cgroup(tmp_path, "0::/"))
    assert layout.mode == "unsupported" and not layout.usable
    assert layout.reason is not None and "CONFIG_MEMCG_V1" in layout.reason
    (tmp_path / "empty").mkdir()
    nothing = detect_layout(tmp_path / "empty", proc_cgroup(tmp_path, "0::/"))
    assert nothing.mode == "unsupported" and "no cgroup filesystem" in (nothing.reason or "")


@pytest.fixture
def v2_host(tmp_path: Path) -> Iterator[Path]:
    """This process's layout replaced by a fake v2 one (restored after)."""
    mount = v2_mount(tmp_path / "host", "dsec.slice")
    reset_layout(CgroupLayout("v2", mount, "dsec.slice", controllers=("cpu", "memory", "pids")))
    try:
        yield mount
    finally:
        reset_layout()


def test_cgroup_and_read_cgroup_follow_the_host_layout(v2_host: Path) -> None:
    cg = cgroup("dsec-x/sb-3")
    assert isinstance(cg, CgroupV2) and cg.dir == v2_host / "dsec.slice/dsec-x/sb-3"
    assert cg.oci_path() == "/dsec.slice/dsec-x/sb-3"
    fake_v2(v2_host / "dsec.slice", "dsec-x/sb-3")
    u = read_cgroup("dsec-x/sb-3")
    assert u.version == 2 and u.pids == 3


def test_flat_keyed() -> None:
    assert parse_flat_keyed("a 1\nb x\n\nc 3 4\nd  5\n") == {"a": 1, "d": 5}
