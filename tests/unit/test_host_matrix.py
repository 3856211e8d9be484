"""The host matrix's own logic, without a guest: a host's row and table from the results a
guest wrote (the counts of the tests chosen with ``--tests`` under the table), and
``--tests`` refusing a path the checkout does not have before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
from hosts.guest import GuestRun
from hosts.matrix import main, summarize, table
from hosts.spec import HOSTS


def _results() -> dict:
    counts = {"passed": 14, "failed": 1, "errors": 0, "skipped": 0}
    detail = {**counts, "exit_code": 1, "failures": ["test_x: boom"]}
    return {
        "facts": {"kernel": "6.1.0-50-cloud-amd64", "cgroup": {"layout": "v2"}},
        "tiers": {"container": {"available": True, "reason": None}},
        "checks": [
            {"name": "container.create", "ok": True, "seconds": 1.0},
            {"name": "tests", "ok": False, "seconds": 94.0, "error": "1", "detail": detail},
        ],
    }


def test_a_row_counts_the_chosen_tests(tmp_path: Path) -> None:
    run = GuestRun(HOSTS["debian12-6.1-v2"], _results(), tmp_path, {"guest_s": 246.0})
    row = summarize(run, ("container",))
    assert row["suites"] == {"tests": {"passed": 14, "failed": 1, "errors": 0, "skipped": 0}}
    assert (row["passed"], row["failed"], row["failed_checks"]) == (1, 1, ["tests"])
    text = table([row])
    assert "debian12-6.1-v2: tests 14 passed, 1 failed, 0 errors, 0 skipped" in text
    assert "v2" in text.splitlines()[1] and "1/1/0" in text.splitlines()[1]


def test_a_row_without_suites(tmp_path: Path) -> None:
    run = GuestRun(HOSTS["debian12-6.1-v2"], {"error": "no results"}, tmp_path)
    row = summarize(run, ("container",))
    assert row["suites"] == {} and " tests " not in table([row])


def test_tests_must_exist_in_the_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--hosts", "debian12-6.1-v2", "--tests", "tests/no_such_file.py::test_x"])
    assert exited.value.code == 2
    assert "tests/no_such_file.py" in capsys.readouterr().err
