"""Find flaky tests: run the suite several times while a CPU burner runs beside it.

A test that passes on an idle machine and fails on a busy one measures the scheduler, not
dsec. This script runs the root-free tests ``--unit-runs`` times (default 5) and the whole
suite ``--full-runs`` times (default 2, root only), each with ``--burn`` processes (default
1) spinning on the CPU beside it, and lists every test that did not pass in every run it
was part of: flaky (passed in some runs) or broken (failed in all).

    make test-flakes                                   # 5 root-free runs + 2 whole runs
    .venv/bin/python scripts/flakes.py --unit-runs 2 --full-runs 0 -- -k network

Extra pytest arguments go after ``--``. Writes the report as JSON (``--out``, default
``flakes.json`` in the working directory); exits 1 when any test was flaky or broken.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _burn() -> None:
    x = 0
    while True:  # a busy core, as another job on a CI machine
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _read_junit(junit: Path) -> tuple[dict[str, str], dict[str, str]]:
    """From a junit XML report: test id -> passed | failed | error | skipped, and test id ->
    the message of its failure or error."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    try:
        tree = ET.parse(junit)
    except (OSError, ET.ParseError):
        return outcomes, messages
    for case in tree.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            outcomes[name] = "failed"
        elif "error" in kinds:
            outcomes[name] = "error"
        elif "skipped" in kinds:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                messages[name] = (child.get("message") or "")[:500]
    return outcomes, messages


def _run(label: str, args: list[str], workers: int, extra: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="dsec-flakes-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            str(workers),
            "--dist",
            "loadgroup",
            f"--junitxml={junit}",
            *args,
            *extra,
        ]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - t0
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        outcomes, messages = _read_junit(junit)
        print(f"{label}: exit {proc.returncode} in {seconds:.0f} s: {tail[0]}", flush=True)
        for test, message in sorted(messages.items()):
            print(f"  {outcomes.get(test)}: {test}: {message.splitlines()[0] if message else ''}")
        return {
            "label": label,
            "exit": proc.returncode,
            "seconds": round(seconds, 1),
            "outcomes": outcomes,
            "failures": messages,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--unit-runs", type=int, default=5, help="runs of the root-free tests")
    p.add_argument("--full-runs", type=int, default=2, help="runs of the whole suite (root)")
    p.add_argument("--burn", type=int, default=1, help="CPU-burning processes beside the runs")
    p.add_argument("--workers", type=int, default=int(os.environ.get("TEST_WORKERS", "4")))
    p.add_argument("--out", type=Path, default=Path("flakes.json"))
    p.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    a = p.parse_args()
    if a.full_runs and os.geteuid() != 0:
        print("flakes: the whole suite needs root; running the root-free tests only")
        a.full_runs = 0
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(a.burn)]
    for b in burners:
        b.start()
    runs = []
    try:
        for i in range(a.unit_runs):
            runs.append(_run(f"root-free #{i + 1}", ["-m", "not root"], a.workers, a.pytest_args))
        for i in range(a.full_runs):
            runs.append(_run(f"whole suite #{i + 1}", [], a.workers, a.pytest_args))
    finally:
        for b in burners:
            b.terminate()
    seen: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for run in runs:
        for test, outcome in run["outcomes"].items():  # type: ignore[attr-defined]
            seen[test][outcome] += 1
    bad = {
        test: dict(counts)
        for test, counts in sorted(seen.items())
        if counts.get("failed", 0) + counts.get("error", 0) > 0
    }
    report = {
        "burners": a.burn,
        "workers": a.workers,
        "runs": [{k: v for k, v in r.items() if k != "outcomes"} for r in runs],  # with failures
        "tests": len(seen),
        "not_always_passing": {
            test: {"kind": "flaky" if counts.get("passed") else "broken", **counts}
            for test, counts in bad.items()
        },
    }
    a.out.write_text(json.dumps(report, indent=1))
    print(f"\n{len(seen)} tests in {len(runs)} runs with {a.burn} CPU burner(s) beside them")
    if not bad:
        print("every test passed in every run it was part of")
        return 0
    print(f"{'test':<100} {'kind':<7} runs")
    for test, info in report["not_always_passing"].items():  # type: ignore[union-attr]
        counts = ", ".join(f"{k} {v}" for k, v in info.items() if k != "kind")
        print(f"{test:<100} {info['kind']:<7} {counts}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
