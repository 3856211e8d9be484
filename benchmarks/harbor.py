"""Harbor benchmark: prints a table and writes benchmarks/results/harbor.json.

In one run against one ``dsec serve`` (``BackgroundServer``, container tier): ``--trials``
trials (default 32) of a local Terminal-Bench-format task (busybox base, one RUN step;
Harbor's ``oracle`` agent; ``--concurrent`` at once, default 8) through

* ``--env dsec.integrations.harbor:DsecEnvironment`` (dsec's own builds; later trials start
  from a snapshot of the first started environment), and
* ``--env e2b``: Harbor's E2B environment, the unmodified e2b SDK pointed at dsec's E2B API
  (template build through ``/v3/templates``, sandboxes through ``/e2b``).

Reported per environment: the job's wall time (Harbor's process, start to end), and per
trial the environment start overhead (Harbor's ``environment_setup`` phase: build or
template check, sandbox create, set-up) and the whole trial, p50/p90/max in ms.

Harbor needs Python >= 3.12: ``--harbor-python`` (default ``.venv-harbor/bin/python``, made
by scripts/bootstrap.sh). Root (the container tier).

Usage: .venv/bin/python benchmarks/harbor.py [--trials 32] [--concurrent 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from dsec.server import BackgroundServer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENVS = {"dsec": "dsec.integrations.harbor:DsecEnvironment", "e2b": "e2b"}


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def ms(phase: dict[str, Any] | None) -> float | None:
    if not phase or not phase.get("started_at") or not phase.get("finished_at"):
        return None
    a = datetime.fromisoformat(phase["started_at"].replace("Z", "+00:00"))
    b = datetime.fromisoformat(phase["finished_at"].replace("Z", "+00:00"))
    return (b - a).total_seconds() * 1000


def write_task(root: Path) -> Path:
    from tests.integrations.test_harbor_root import write_task as write

    return write(
        root, "FROM busybox\nWORKDIR /app\nRUN printf '1\\n2\\n39\\n' > /app/numbers.txt\n"
    )


def run(bg: Any, python: Path, env_name: str, task: Path, jobs: Path, args: Any) -> dict[str, Any]:
    harbor = python.parent / "harbor"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "DSEC_URL": bg.url,
        "DSEC_API_KEY": bg.api_key,
        "E2B_API_URL": f"{bg.url}/e2b",
        "E2B_SANDBOX_URL": f"{bg.url}/e2b/envd",
        "E2B_API_KEY": bg.api_key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    cmd = [str(harbor), "run", "-p", str(task), "-a", "oracle", "-e", ENVS[env_name]]
    cmd += ["-o", str(jobs), "-y", "-q", "-k", str(args.trials), "-n", str(args.concurrent)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"harbor failed ({env_name}): {r.stderr[-2000:]}")
    trials = [
        json.loads(p.read_text())
        for p in jobs.rglob("result.json")
        if p.parent.parent.parent == jobs
    ]
    rewards = [
        ((t.get("verifier_result") or {}).get("rewards") or {}).get("reward") for t in trials
    ]
    setup = [x for x in (ms(t.get("environment_setup")) for t in trials) if x is not None]
    whole = [x for x in (ms(t) for t in trials) if x is not None]
    return {
        "env": env_name,
        "trials": len(trials),
        "reward_1": sum(1 for x in rewards if x == 1.0),
        "wall_s": round(wall, 2),
        "setup_ms": {k: round(f(setup), 1) for k, f in _STATS.items()},
        "trial_ms": {k: round(f(whole), 1) for k, f in _STATS.items()},
    }


_STATS = {"p50": lambda xs: pct(xs, 50), "p90": lambda xs: pct(xs, 90), "max": max}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--harbor-python", default=str(ROOT / ".venv-harbor" / "bin" / "python"))
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    python = Path(args.harbor_python)
    if not python.exists():
        raise SystemExit(f"no Harbor venv at {python} (scripts/bootstrap.sh; Python >= 3.12)")
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-harbor-"))
    home = Path(args.home) if args.home else work / "home"
    rows = []
    try:
        home.mkdir(parents=True, exist_ok=True)
        cache = Path(os.environ.get("DSEC_TEST_LAYER_CACHE", "/var/cache/dsec-test-layers"))
        if cache.is_dir() and not (home / "layers").exists():
            (home / "layers").symlink_to(cache, target_is_directory=True)
        opts = {"subnet": os.environ.get("DSEC_NET_SUBNET", "10.239.0.0/16")}
        with BackgroundServer(home, tiers=["container"], network_options=opts) as bg:
            assert bg.edge is not None
            bg.call(bg.edge.layers.ensure_image("busybox"))
            for name in ("dsec", "e2b"):
                task = write_task(work / f"task-{name}")
                rows.append(run(bg, python, name, task, work / f"jobs-{name}", args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.trials} trials, {args.concurrent} at once, oracle agent, busybox task")
    print(
        f"{'environment':<12} {'reward 1':>8} {'wall s':>8} {'setup p50':>10} {'p90':>8} "
        f"{'max':>8} {'trial p50':>10} {'p90':>8}"
    )
    for r in rows:
        s, t = r["setup_ms"], r["trial_ms"]
        print(
            f"{r['env']:<12} {r['reward_1']:>8} {r['wall_s']:>8} {s['p50']:>10} {s['p90']:>8} "
            f"{s['max']:>8} {t['p50']:>10} {t['p90']:>8}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"trials": args.trials, "concurrent": args.concurrent, "results": rows}
    (RESULTS / "harbor.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
