"""``benchmarks/cell.py --quick``: the cell benchmark starts Ray, PostgreSQL, simulated
edges and an apiserver replica, and drives them through the SDK without an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.root]

ROOT = Path(__file__).resolve().parents[2]


def test_cell_benchmark_quick_run(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (PostgreSQL runs as the postgres user)")
    pytest.importorskip("ray")
    out = tmp_path / "cell.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cell.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (size,) = result["sizes"]
    (step,) = size["steps"]
    assert size["nodes"] == 4 and step["live"] == 200
    for op in ("fill", "create", "exec", "kill"):
        assert not step[f"{op}_errors"], (op, step[f"{op}_errors"])
    assert step["create_ok"] == 100 and step["exec_ok"] == 100 and step["kill_ok"] == 100
    assert step["create_cpu_ms_total"] > 0 and step["create_pg_statements"] > 0
    job = size["job"]
    assert job["created"] == 300 and not job["create_errors"]
    for action in ("pause", "resume", "kill"):
        assert job[action]["outcomes"] == 300 and job[action]["failed"] == 0, job[action]
    assert size["job_kill"]["failed"] == 0
