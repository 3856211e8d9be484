"""The host report (``dsec.hostreport``): probes over a fake host tree, tier verdicts, the
renderer, the node's tiers ruled out by its host, and ``GET /v1/node``'s ``host`` field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.hostreport import (
    LiveProbes,
    cgroups_section,
    host_report,
    os_release,
    render,
    tier_blockers,
)
from dsec.models import HostFeature, HostReport, NodeInfo
from dsec.privileged.cgroups import CgroupLayout
from dsec.privileged.nodesetup import NodeReport
from dsec.testing import FakeEdge
from dsec.wire import ANSWER

RELEASE = "6.1.0-18-amd64"
LOOP_REASON = f"this kernel cannot mount EROFS from a file: needs 6.12, this is {RELEASE}"
CRUN = NodeReport(oci_runtime="/usr/bin/crun", oci_runtime_name="crun", probe_ms=80.0)


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _host(
    root: Path,
    *,
    filesystems: tuple[str, ...] = ("ext4", "nodev\ttmpfs", "erofs", "nodev\tfuse"),
    modules: str | None = "kernel/fs/overlayfs/overlay.ko.xz:\nkernel/fs/erofs/erofs.ko.xz:\n",
    controllers: str = "cpuset cpu io memory hugetlb pids rdma misc",
    loop_control: bool = True,
) -> Path:
    """A Debian 12 host (6.1, cgroup v2) as files under ``root``."""
    _write(root, "etc/os-release", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n')
    lines = [f if "\t" in f else "\t" + f for f in filesystems]
    _write(root, "proc/filesystems", "".join(line + "\n" for line in lines))
    if modules is not None:
        _write(root, f"lib/modules/{RELEASE}/modules.dep", modules)
    _write(
        root,
        "proc/sys/kernel/seccomp/actions_avail",
        "kill_process kill_thread trap errno user_notif trace log allow\n",
    )
    _write(root, "proc/sys/user/max_user_namespaces", "63704\n")
    _write(root, "sys/kernel/mm/ksm/run", "0\n")
    _write(root, "sys/fs/cgroup/cgroup.controllers", controllers + "\n")
    _write(root, "sys/fs/cgroup/cgroup.procs", "1\n")
    _write(root, "proc/self/cgroup", "0::/\n")
    _write(root, "dev/fuse")
    if loop_control:
        _write(root, "dev/loop-control")
    return root


def _live(**over: object) -> LiveProbes:
    values: dict[str, object] = {
        "euid": 0,
        "pidfd_open": True,
        "pidfd_send_signal": True,
        "openat2": True,
        "landlock_abi": 3,
        "erofs_mode": "loop",
        "erofs_reason": LOOP_REASON,
        "kvm_api": None,
        "kvm_error": "/dev/kvm: No such file or directory",
        "nftables": True,
        "nftables_detail": "kernel nf_tables through libnftables",
        "qemu": "QEMU emulator version 7.2.0 (Debian 1:7.2+dfsg-7)",
        "oci_versions": {"crun": "crun version 1.8.1", "runc": "runc version 1.1.5"},
    }
    values.update(over)
    return LiveProbes(**values)  # type: ignore[arg-type]


def _report(root: Path, **kw: object) -> HostReport:
    kw.setdefault("live", _live())
    kw.setdefault("oci", CRUN)
    return host_report(root=root, release=RELEASE, **kw)  # type: ignore[arg-type]


def _feature(report: HostReport, name: str) -> HostFeature:
    (found,) = [f for f in [*report.features, *report.cgroups.features] if f.name == name]
    return found


@pytest.fixture(autouse=True)
def _no_cgroup_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_CGROUP_PARENT", raising=False)


def test_debian12_on_61_mounts_erofs_through_loop_devices(tmp_path: Path) -> None:
    report = _report(_host(tmp_path))
    assert (report.kernel, report.distribution, report.root) == (
        RELEASE,
        "Debian GNU/Linux 12 (bookworm)",
        True,
    )
    erofs = _feature(report, "EROFS")
    assert (erofs.available, erofs.value, erofs.note) == (True, "loop devices", LOOP_REASON)
    overlay = _feature(report, "overlayfs")  # not loaded yet, but the kernel has the module
    assert overlay.available and "module" in overlay.value
    assert "no passthrough before 6.9" in (_feature(report, "FUSE").note or "")
    assert "IOCTL_DEV" in (_feature(report, "Landlock").note or "")
    assert _feature(report, "KVM").available is False
    assert _feature(report, "OCI runtime").value.startswith("crun version 1.8.1")
    assert report.cgroups.mode == "v2" and report.cgroups.usable
    assert report.cgroups.description.startswith("v2 (unified), base /")
    assert _feature(report, "CLONE_INTO_CGROUP").available
    tiers = {t.tier: t for t in report.tiers}
    assert all(t.available and t.wanted for t in tiers.values())
    assert tiers["microvm"].reason is not None and tiers["microvm"].reason.startswith("TCG")

    text = render(report)
    sections = [line for line in text.splitlines() if not line.startswith(" ")]
    assert sections == ["Host:", "Kernel features:", "cgroups:", "Tiers:"]
    assert f" EROFS: loop devices ({LOOP_REASON})" in text.splitlines()
    assert " Distribution: Debian GNU/Linux 12 (bookworm)" in text.splitlines()
    short = render(report, short=True).splitlines()
    assert short[0].startswith(f"host: {RELEASE}, Debian GNU/Linux 12 (bookworm), cgroup v2")
    assert any(line.startswith("missing: KVM:") for line in short[1:])


def test_no_way_to_mount_erofs_rules_out_the_layer_tiers(tmp_path: Path) -> None:
    no_loop = _report(_host(tmp_path / "a", loop_control=False))
    assert _feature(no_loop, "EROFS").value == "none"
    no_erofs = _report(
        _host(tmp_path / "b", filesystems=("ext4",), modules="kernel/fs/ext4/ext4.ko:\n"),
        live=_live(erofs_mode="file", erofs_reason=""),
    )
    assert _feature(no_erofs, "EROFS").available is False
    assert _feature(no_erofs, "overlayfs").available is False
    for report in (no_loop, no_erofs):
        tiers = {t.tier: t for t in report.tiers}
        for tier in ("container", "fncall"):
            assert not tiers[tier].available and "EROFS: none" in (tiers[tier].reason or "")
        assert tiers["microvm"].available and tiers["vm"].available


def test_unknown_features_do_not_rule_a_tier_out(tmp_path: Path) -> None:
    # no module list for this kernel (a container image of a host): overlayfs unknown; the
    # OCI runtime not probed: unknown; neither blocks
    report = _report(
        _host(tmp_path, filesystems=("erofs",), modules=None),
        live=_live(nftables=None, nftables_detail="not probed (needs root)"),
        oci=None,
    )
    assert _feature(report, "overlayfs").available is None
    assert _feature(report, "OCI runtime").available is None
    assert all(t.available for t in report.tiers)
    assert "unknown: not probed" in render(report)


def test_unusable_cgroups_rule_out_every_tier(tmp_path: Path) -> None:
    # a v2 root that does not offer the memory controller
    report = _report(_host(tmp_path, controllers="cpu pids"))
    assert not report.cgroups.usable and report.cgroups.missing == ["memory"]
    assert all(not t.available for t in report.tiers)
    assert all(
        "cgroups: " in (t.reason or "") and "memory" in (t.reason or "") for t in report.tiers
    )
    unsupported = CgroupLayout(
        "unsupported", reason="no cgroup filesystem is mounted", missing=("memory",)
    )
    report = _report(_host(tmp_path / "b"), layout=unsupported)
    assert report.cgroups.mode == "unsupported"
    assert {t.tier: t.reason for t in report.tiers}["container"] == (
        "cgroups: no cgroup filesystem is mounted"
    )


def test_tiers_need_root_and_the_wanted_ones_are_marked(tmp_path: Path) -> None:
    report = _report(_host(tmp_path), live=_live(euid=1000), wanted=["container"])
    assert not report.root
    assert all(t.reason == "dsec runs its tiers as root" for t in report.tiers)
    assert {t.tier for t in report.tiers if t.wanted} == {"container"}
    assert "Running as: not root" in render(report)


def test_tier_blockers_only_count_what_is_known_missing() -> None:
    cgroups = cgroups_section(CgroupLayout("v1", controllers=("cpu", "memory")), RELEASE)
    feats = [
        HostFeature(name="QEMU", available=False, value="not installed"),
        HostFeature(name="seccomp", available=None, value="unknown"),
    ]
    assert tier_blockers(cgroups, feats) == {
        "microvm": "QEMU: not installed",
        "vm": "QEMU: not installed",
    }
    v1 = {f.name: f for f in cgroups.features}
    assert v1["cgroup.kill"].available is False and v1["cgroup.kill"].value == "cgroup v2 only"


def test_os_release(tmp_path: Path) -> None:
    assert os_release(tmp_path).startswith("unknown")
    _write(tmp_path, "usr/lib/os-release", 'NAME="Rocky Linux"\nVERSION="9.4 (Blue Onyx)"\n')
    assert os_release(tmp_path) == "Rocky Linux 9.4 (Blue Onyx)"


# --- the node: tiers ruled out by its host, and GET /v1/node -----------------------------------


def _client(app: object, key: str | None) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://dsec", headers=headers)


async def test_a_tier_the_host_rules_out_is_unavailable_with_the_reason() -> None:
    why = "cgroups: the v2 cgroup / does not offer the memory controller(s)"
    edge = FakeEdge(available_tiers=("fncall",), unavailable={"container": why})
    app = create_app(edge, StaticKeys(["dsec_alice"]))
    async with _client(app, "dsec_alice") as c:
        caps = {t["tier"]: t for t in (await c.get("/v1/capabilities")).json()["tiers"]}
        assert caps["container"]["available"] is False and caps["container"]["reason"] == why
        assert caps["vm"]["reason"] == "not enabled on this node"
        r = await c.post("/v1/sandboxes", json={"tier": "container"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "tier_unavailable"
        assert why in r.json()["error"]["message"]


async def test_node_info_carries_the_host_report_for_every_key(tmp_path: Path) -> None:
    host = _report(_host(tmp_path))
    edge = FakeEdge(available_tiers=("fncall", "container"), host_report=lambda: host)
    app = create_app(edge, StaticKeys(["dsec_alice", "dsec_bob"]))
    seen = []
    async with _client(app, "dsec_alice") as alice, _client(app, "dsec_bob") as bob:
        for c in (alice, bob):
            r = await c.get("/v1/node")
            assert r.status_code == 200
            seen.append(r.json()["host"])
        async with _client(app, None) as anonymous:
            assert (await anonymous.get("/v1/node")).status_code == 401
    assert seen[0] == seen[1]  # node data, the same for every tenant
    info = NodeInfo.model_validate(
        {**(await edge.node_info()).model_dump(mode="json")}, context=ANSWER
    )
    assert info.host is not None and info.host.kernel == RELEASE
    assert _feature(info.host, "EROFS").value == "loop devices"
    # the tiers are the edge's own, not the host's forecast
    tiers = {t["tier"]: t for t in seen[0]["tiers"]}
    assert tiers["container"]["available"] and tiers["container"]["wanted"]
    assert not tiers["vm"]["available"] and not tiers["vm"]["wanted"]
    assert tiers["vm"]["reason"] == "not enabled on this node"


def test_node_info_is_forward_compatible(tmp_path: Path) -> None:
    host = _report(_host(tmp_path)).model_dump(mode="json")
    host["features"][0]["since"] = "6.12"  # fields of a newer server are dropped
    host["gpu"] = {"count": 8}
    data = {"node": "n", "version": "9", "tiers": [], "sandboxes": 0, "cpus": 2, "memory_mb": 1}
    assert NodeInfo.model_validate(data, context=ANSWER).host is None  # an older server
    info = NodeInfo.model_validate({**data, "host": host}, context=ANSWER)
    assert info.host is not None and info.host.features[0].name == "EROFS"


async def test_a_failing_host_report_does_not_fail_node_info() -> None:
    def broken() -> HostReport:
        raise OSError("no /proc")

    info = await FakeEdge(host_report=broken).node_info()
    assert info.host is None and info.tiers


SYSTEMD_ROOT = "23 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
PRIVATE_ROOT = "23 1 254:1 / / rw,relatime - ext4 /dev/vda rw\n"


def test_mount_namespace_names_the_hosts_root_propagation(tmp_path: Path) -> None:
    """systemd hosts make ``/`` shared (sandbox mounts would propagate into the host's table);
    the report says so, and where ``dsec serve`` keeps them."""
    from dsec.privileged.mountns import root_propagation

    for name, text, want in (("a", SYSTEMD_ROOT, "shared"), ("b", PRIVATE_ROOT, "private")):
        root = _host(tmp_path / name)
        _write(root, "proc/1/mountinfo", text)
        assert root_propagation(str(root / "proc/1/mountinfo")) == want
        feature = next(f for f in _report(root).features if f.name == "mount namespace")
        assert feature.value == f"/ is {want} on the host"
        assert "own namespace" in (feature.note or "")
    assert root_propagation(str(tmp_path / "missing")) == "unknown"
