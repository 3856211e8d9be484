"""Fair CPU between keys (issue 31): can one key's crowd of busy sandboxes starve another key?

A/B in one run, two ``dsec serve`` children one after the other: ``DSEC_KEY_CPU_GROUPS=on``
(the default: each key's container sandboxes share one cgroup of the key's ``cpu_weight``)
and ``off`` (every sandbox competes alone). In each, key A ("the crowd") runs ``--crowd``
sandboxes, each a busy command for the window (a foreground exec: to the edge they are
working, at their full weight); key B runs one sandbox that does a fixed CPU job (a busybox
shell loop of ``--iters``, about a second: longer than the exec boost) ``--reps`` times, first alone, then during the crowd's window. Reported per mode:
B's job p50 alone and among the crowd, the inflation, and the cores each key got during the
window (from each sandbox's cgroup CPU time). With fair sharing between keys B's one
sandbox gets what one core can give (the two keys' cgroups split the node), not 1/(crowd+1)
of the node.

Usage: python benchmarks/key_fairness.py [--crowd 8] [--reps 9]
Writes benchmarks/results/key_fairness.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsec import AsyncClient, AsyncSandbox
from dsec.apiserver.auth import KeyStore
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"


def job(iters: int) -> str:
    return f"i=0; while [ $i -lt {iters} ]; do i=$((i+1)); done"


def busy(seconds: float) -> str:
    return f"timeout {seconds:g} sh -c 'while :; do :; done'; true"


async def job_times(sb: AsyncSandbox, reps: int, iters: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = await sb.commands.run(job(iters), timeout=600)
        assert r.exit_code == 0, r
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def cpu_s(sbs: list[AsyncSandbox]) -> float:
    ms = await asyncio.gather(*(sb.metrics() for sb in sbs))
    return sum(m.cpu.usage_s for m in ms)


def one_server(groups: str, crowd: int, reps: int, iters: int) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-fair-"))
    env = {"DSEC_KEY_CPU_GROUPS": groups, "DSEC_CPU_OVERCOMMIT": "100"}
    try:
        with ServeProcess(home, env=env) as srv:
            key_b = KeyStore(home).create_key("bench: the key with one sandbox")

            async def go() -> dict[str, Any]:
                async with AsyncClient(srv.url, srv.api_key) as a, AsyncClient(srv.url, key_b) as b:
                    kw: dict[str, Any] = {
                        "tier": "container",
                        "image": "busybox",
                        "cpu": 1.0,
                        "memory_mb": 64,
                    }
                    crowd_sbs = [await AsyncSandbox.create(client=a, **kw) for _ in range(crowd)]
                    worker = await AsyncSandbox.create(client=b, **kw)
                    try:
                        await job_times(worker, 1, iters)  # warm
                        alone = await job_times(worker, reps, iters)
                        # long enough for B's jobs even at 1/(crowd+1) of the node
                        window = statistics.median(alone) / 1000 * reps * (crowd + 1) * 1.5 + 10
                        a0, b0 = await cpu_s(crowd_sbs), await cpu_s([worker])
                        t0 = time.monotonic()
                        burners = [
                            asyncio.create_task(sb.commands.run(busy(window), timeout=window + 120))
                            for sb in crowd_sbs
                        ]
                        await asyncio.sleep(1.0)
                        probe = host_probe_s()
                        among = await job_times(worker, reps, iters)
                        a1, b1 = await cpu_s(crowd_sbs), await cpu_s([worker])
                        elapsed = time.monotonic() - t0
                        await asyncio.gather(*burners, return_exceptions=True)
                    finally:
                        await asyncio.gather(*(s.kill() for s in [worker, *crowd_sbs]))
                    return {
                        "alone_p50_ms": round(statistics.median(alone), 1),
                        "among_p50_ms": round(statistics.median(among), 1),
                        "inflation": round(statistics.median(among) / statistics.median(alone), 2),
                        "crowd_cores": round((a1 - a0) / elapsed, 2),
                        "single_key_cores": round((b1 - b0) / elapsed, 2),
                        "window_s": round(elapsed, 1),
                        "host_probe_ms": round(probe * 1000, 2),
                    }

            return asyncio.run(go())
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--crowd", type=int, default=8, help="key A's busy sandboxes")
    ap.add_argument("--reps", type=int, default=5, help="key B's jobs, alone and among")
    ap.add_argument(
        "--iters",
        type=int,
        default=1_000_000,
        help="loop iterations of B's job (longer than the exec boost, DSEC_EXEC_BOOST_MS)",
    )
    args = ap.parse_args()
    rows = {mode: one_server(mode, args.crowd, args.reps, args.iters) for mode in ("off", "on")}
    print(
        f"{'key groups':<11} {'B alone p50':>12} {'B among p50':>12} {'inflation':>10} "
        f"{'A cores':>8} {'B cores':>8}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<11} {r['alone_p50_ms']:>10.1f}ms {r['among_p50_ms']:>10.1f}ms "
            f"{r['inflation']:>9.2f}x {r['crowd_cores']:>8.2f} {r['single_key_cores']:>8.2f}"
        )
    ratio = rows["off"]["among_p50_ms"] / rows["on"]["among_p50_ms"]
    print(f"B's job among the crowd: {ratio:.2f}x faster with key groups than without")
    out = {
        "benchmark": "key_fairness",
        "crowd": args.crowd,
        "reps": args.reps,
        "job_iters": args.iters,
        "modes": rows,
        "among_speedup_on_vs_off": round(ratio, 2),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "key_fairness.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
