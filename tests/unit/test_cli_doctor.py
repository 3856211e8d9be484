"""``dsec doctor`` (a faked host report, through its documented hook) and the host in
``dsec info``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

import dsec.cli.doctor as doctor
import dsec.cli.main as cli
from dsec.models import HostCgroups, HostFeature, HostReport, HostTier
from dsec.testing import FakeEdge, app_transport

NO_QEMU = "QEMU: not installed (the VM tiers need qemu-system-x86_64)"


def _report(wanted: list[str] | None) -> HostReport:
    return HostReport(
        kernel="6.12.48+deb13-amd64",
        distribution="Debian GNU/Linux 13 (trixie)",
        architecture="x86_64",
        root=True,
        cgroups=HostCgroups(
            mode="v2",
            description="v2 (unified), base /system.slice/dsec.service (delegated by systemd)",
            usable=True,
            base="/system.slice/dsec.service",
            delegated=True,
            controllers=["cpu", "memory", "pids"],
        ),
        features=[
            HostFeature(name="EROFS", available=True, value="file-backed mounts"),
            HostFeature(name="QEMU", available=False, value="not installed", note="..."),
        ],
        tiers=[
            HostTier(
                tier=t,
                available=t in ("fncall", "container"),
                reason=None if t in ("fncall", "container") else NO_QEMU,
                wanted=not wanted or t in wanted,
            )
            for t in ("fncall", "container", "microvm", "vm")
        ],
    )


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    monkeypatch.setattr(doctor, "report_factory", _report)
    monkeypatch.delenv("DSEC_TIERS", raising=False)
    yield CliRunner(env={"COLUMNS": "200"})


def test_doctor_prints_sections_and_json(runner: CliRunner) -> None:
    result = runner.invoke(cli.app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line for line in lines if not line.startswith(" ")] == [
        "Host:",
        "Kernel features:",
        "cgroups:",
        "Tiers:",
    ]
    assert " EROFS: file-backed mounts" in lines
    assert f" microvm: unavailable ({NO_QEMU})" in lines
    result = runner.invoke(cli.app, ["doctor", "--json"])
    assert result.exit_code == 0
    report = HostReport.model_validate(json.loads(result.stdout))
    assert report.cgroups.delegated and report.kernel.startswith("6.12")


def test_doctor_fails_naming_each_wanted_tier_that_cannot_run(runner: CliRunner) -> None:
    result = runner.invoke(cli.app, ["doctor"], env={"DSEC_TIERS": "container,microvm"})
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: the microvm tier cannot run: {NO_QEMU}"
    assert f" vm: not enabled (not in DSEC_TIERS; it could not run: {NO_QEMU})" in result.stdout
    assert " fncall: not enabled (not in DSEC_TIERS; it could run)" in result.stdout
    result = runner.invoke(cli.app, ["doctor", "--json", "--tiers", "vm"])
    assert result.exit_code == 1 and "the vm tier cannot run" in result.stderr
    assert json.loads(result.stdout)["tiers"][3]["wanted"] is True
    ok = runner.invoke(cli.app, ["doctor"], env={"DSEC_TIERS": "fncall, container"})
    assert ok.exit_code == 0 and ok.stderr == ""


def test_doctor_refuses_unknown_tiers(runner: CliRunner) -> None:
    result = runner.invoke(cli.app, ["doctor"], env={"DSEC_TIERS": "container,gpu"})
    assert result.exit_code == 2 and "DSEC_TIERS names unknown tier(s) gpu" in result.stderr


def test_doctor_with_no_tier_asked_fails_only_when_none_can_run() -> None:
    report = _report(None)
    assert doctor.unavailable_wanted(report, None) == []
    down = report.model_copy(
        update={"tiers": [t.model_copy(update={"available": False}) for t in report.tiers]}
    )
    assert [t for t, _ in doctor.unavailable_wanted(down, None)] == [
        "fncall",
        "container",
        "microvm",
        "vm",
    ]


def test_info_shows_the_host_in_short(monkeypatch: pytest.MonkeyPatch) -> None:
    edge = FakeEdge(host_report=lambda: _report(None))
    transport, key = app_transport(edge)
    monkeypatch.setattr(cli, "transport_factory", lambda: transport)
    runner = CliRunner(
        env={"DSEC_API_KEY": key, "DSEC_URL": "http://dsec.invalid", "COLUMNS": "200"}
    )
    result = runner.invoke(cli.app, ["info"])
    assert result.exit_code == 0, result.output
    assert "host: 6.12.48+deb13-amd64, Debian GNU/Linux 13 (trixie), cgroup v2" in result.stdout
    assert "missing: QEMU: not installed" in result.stdout
    node = json.loads(runner.invoke(cli.app, ["info", "-o", "json"]).stdout)
    assert node["host"]["distribution"] == "Debian GNU/Linux 13 (trixie)"
