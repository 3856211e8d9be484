"""Idle-aware CPU weights (issue 23): does an idle crowd slow the sandbox that works?

A/B in one run, two ``dsec serve`` children one after the other: ``DSEC_IDLE_CPU_SHARES=2``
(the default: a sandbox with no command running has 2 CPU shares, 1024 x cpu while one runs)
and ``DSEC_IDLE_CPU_SHARES=0`` (off: every sandbox keeps 1024 x cpu). In each, ``--noisy``
sandboxes start a CPU burner in the background (``while :; do :; done &``: the exec returns
at once, so to the edge they are idle, but they burn CPU, as a left-over process of an agent
would), then one sandbox runs a fixed CPU job (a busybox shell loop) ``--reps`` times. Reported:
the job's p50 wall time alone (before the burners) and among them, and the inflation.

Usage: python benchmarks/idle_cpu.py [--noisy 8] [--reps 15]
Writes benchmarks/results/idle_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsec import AsyncClient, AsyncSandbox
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "i=0; while [ $i -lt 60000 ]; do i=$((i+1)); done"
BURN = "sh -c 'while :; do :; done' >/dev/null 2>&1 &"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


async def job_times(sb: AsyncSandbox, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = await sb.commands.run(JOB, timeout=120)
        assert r.exit_code == 0, r
        out.append((time.perf_counter() - t0) * 1000)
    return out


def one_server(shares: str, noisy: int, reps: int) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-idlecpu-"))
    env = {"DSEC_IDLE_CPU_SHARES": shares, "DSEC_CPU_OVERCOMMIT": "100"}
    try:
        with ServeProcess(home, env=env) as srv:

            async def go() -> dict[str, Any]:
                async with AsyncClient(srv.url, srv.api_key) as client:
                    kw: dict[str, Any] = {
                        "tier": "container",
                        "image": "busybox",
                        "cpu": 1.0,
                        "memory_mb": 64,
                        "client": client,
                    }
                    worker = await AsyncSandbox.create(**kw)
                    crowd = [await AsyncSandbox.create(**kw) for _ in range(noisy)]
                    try:
                        await job_times(worker, 2)  # warm
                        alone = await job_times(worker, reps)
                        for sb in crowd:
                            await sb.commands.run(BURN)
                        await asyncio.sleep(1.0)
                        probe = host_probe_s()
                        among = await job_times(worker, reps)
                    finally:
                        await asyncio.gather(*(s.kill() for s in [worker, *crowd]))
                    return {"alone_ms": alone, "among_ms": among, "host_probe_s": probe}

            return asyncio.run(go())
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--noisy", type=int, default=8, help="idle sandboxes with a CPU burner")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "idle_cpu.json"))
    args = ap.parse_args()
    res: dict[str, Any] = {"noisy": args.noisy, "reps": args.reps, "job": JOB}
    for name, shares in (("idle_weights_on", "2"), ("idle_weights_off", "0")):
        print(f"{name} (DSEC_IDLE_CPU_SHARES={shares}) ...", flush=True)
        res[name] = one_server(shares, args.noisy, args.reps)
    print()
    hdr = f"{'idle weights':<14} {'job alone p50':>14} {'among burners p50':>18} {'inflation':>10}"
    print(hdr)
    print("-" * len(hdr))
    for name in ("idle_weights_on", "idle_weights_off"):
        r = res[name]
        a, b = pct(r["alone_ms"], 50), pct(r["among_ms"], 50)
        r["inflation_p50"] = b / a
        label = "on (2 shares)" if name.endswith("on") else "off"
        print(f"{label:<14} {a:>11.1f} ms {b:>15.1f} ms {b / a:>9.2f}x")
    print(f"({args.noisy} idle sandboxes each burning a core in the background, 2-core node)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
