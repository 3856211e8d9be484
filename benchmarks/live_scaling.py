"""Cost of create, exec and kill as the number of live sandboxes grows (issue 23).

Through the SDK against a ``dsec serve`` child process: grow the node to each of the
``--steps`` live counts (idle busybox containers asking 1 core each, the caps raised), and at each step measure
K sequential creates (with the server's own breakdown from the sandbox's ``state.json``:
rootfs, OCI runtime, exec server), K kills, and the exec round trip of ``true`` in one of
the idle crowd. Then kill the whole crowd as one job (``job_action kill``) and report the
rate. Prints a table and writes benchmarks/results/live_scaling.json.

Usage: python benchmarks/live_scaling.py [--steps 0,250,500] [--k 10] [--home DIR]
Target: the create rate at the largest step >= 0.8x the rate at 0 live; kill <= 10 ms;
batch kill of a job >= 200/s.
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

from dsec import AsyncSandbox
from dsec.sdk.jobs import AsyncJobs
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"


def sandbox_state(home: Path, sandbox_id: str) -> dict[str, Any]:
    """The container runtime's state of a live sandbox (its tmpfs file, or the sandbox
    directory's on a node without a private tmpfs)."""
    from dsec.runtimes.container.bundle import cgroup_parent

    tmpfs = Path("/dev/shm") / cgroup_parent(home) / "sandbox-state" / f"{sandbox_id}.json"
    for path in (tmpfs, home / "sandboxes" / sandbox_id / "state.json"):
        if path.exists():
            return dict(json.loads(path.read_text()))
    return {}


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def measure_step(
    home: Path, k: int, kw: dict[str, Any], probe: AsyncSandbox
) -> dict[str, Any]:
    create, kill, breakdown = [], [], []
    for _ in range(k):
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(**kw)
        create.append((time.perf_counter() - t0) * 1000)
        try:
            breakdown.append(sandbox_state(home, sb.id).get("create_ms") or {})
        except (OSError, ValueError):
            pass
        t0 = time.perf_counter()
        await sb.kill()
        kill.append((time.perf_counter() - t0) * 1000)
    execs = []
    for _ in range(30):
        t0 = time.perf_counter()
        await probe.commands.run("true")
        execs.append((time.perf_counter() - t0) * 1000)

    def med(key: str) -> float:
        vals = [b[key] for b in breakdown if key in b]
        return statistics.median(vals) if vals else float("nan")

    return {
        "create_p50_ms": pct(create, 50),
        "kill_p50_ms": pct(kill, 50),
        "exec_p50_ms": pct(execs, 50),
        "exec_p99_ms": pct(execs, 99),
        "server_rootfs_ms": med("rootfs"),
        "server_oci_run_ms": med("oci_run"),
        "server_exec_server_ms": med("exec_server"),
        "server_total_ms": med("total"),
        "host_probe_s": host_probe_s(),
    }


async def run(home: Path, url: str, key: str, steps: list[int], k: int) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "tier": "container",
        "image": "busybox",
        # a full core each: a tiny CFS quota throttles crun and every command (0.01 core:
        # 200 ms for `true`); the overcommit cap is raised for the crowd instead
        "cpu": 1.0,
        "memory_mb": 16,
        "url": url,
        "api_key": key,
    }
    await (await AsyncSandbox.create(**kw)).kill()  # image resolution, warm caches
    crowd: list[AsyncSandbox] = []
    sem = asyncio.Semaphore(8)

    async def one() -> None:
        async with sem:
            crowd.append(await AsyncSandbox.create(**kw, job="crowd"))

    out: dict[str, Any] = {"steps": []}
    probe = await AsyncSandbox.create(**kw)
    try:
        for n in steps:
            t0 = time.perf_counter()
            need = n - len(crowd)
            await asyncio.gather(*(one() for _ in range(max(0, need))))
            grow_s = time.perf_counter() - t0
            print(f"  {len(crowd)} live ...", flush=True)
            step = await measure_step(home, k, kw, probe)
            step["live"] = len(crowd)
            step["grow_per_s"] = need / grow_s if need > 0 else None
            out["steps"].append(step)
        t0 = time.perf_counter()
        n_crowd = len(crowd)
        if crowd:
            async with AsyncJobs(url=url, api_key=key) as jobs:
                await jobs.kill("crowd")
        took = time.perf_counter() - t0
        # a kill answers before the container's teardown: also the time until the node
        # has torn every one of them down (no sandbox directory left but warm containers')
        settled = time.perf_counter()
        while time.perf_counter() - settled < 120 and any(
            not d.name.startswith("wp-") and d.name != probe.id
            for d in (home / "sandboxes").iterdir()
        ):
            await asyncio.sleep(0.01)
        settle_s = time.perf_counter() - settled
        out["job_kill"] = {
            "sandboxes": n_crowd,
            "seconds": took,
            "per_s": n_crowd / took,
            "settle_s": settle_s,
            "per_s_settled": n_crowd / (took + settle_s),
        }
    finally:
        await probe.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", default="0,250,500", help="live counts to measure at")
    ap.add_argument("--k", type=int, default=10, help="sequential creates/kills per step")
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=str(RESULTS / "live_scaling.json"))
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = ap.parse_args()
    steps = sorted(int(x) for x in args.steps.split(","))
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-scale-"))
    env = {
        "DSEC_CPU_OVERCOMMIT": "5000",
        "DSEC_MEMORY_OVERCOMMIT": "100",
        **dict(e.split("=", 1) for e in args.env),
    }
    with ServeProcess(home, env=env) as srv:
        res = asyncio.run(run(home, srv.url, srv.api_key, steps, args.k))
    res["server_env"] = env
    rows = res["steps"]
    base = rows[0]
    print()
    hdr = (
        f"{'live':>6} {'create p50':>11} {'rate/s':>7} {'vs 0':>6} {'oci run':>8} "
        f"{'rootfs':>7} {'kill p50':>9} {'exec p50/p99':>14} {'probe':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rate = 1000 / r["create_p50_ms"]
        r["create_rate_per_s"] = rate
        r["rate_vs_first"] = rate / (1000 / base["create_p50_ms"])
        print(
            f"{r['live']:>6} {r['create_p50_ms']:>8.1f} ms {rate:>7.1f} {r['rate_vs_first']:>5.2f}x "
            f"{r['server_oci_run_ms']:>5.1f} ms {r['server_rootfs_ms']:>4.1f} ms "
            f"{r['kill_p50_ms']:>6.1f} ms {r['exec_p50_ms']:>6.2f}/{r['exec_p99_ms']:<6.2f} "
            f"{r['host_probe_s'] * 1000:>5.1f}ms"
        )
    jk = res["job_kill"]
    print(f"job kill: {jk['sandboxes']} sandboxes in {jk['seconds']:.2f} s = {jk['per_s']:.0f}/s")
    print(
        f"  torn down {jk['settle_s']:.2f} s later: {jk['per_s_settled']:.0f}/s with the teardowns"
    )
    print("targets: rate at the largest step >= 0.8x rate at 0; kill <= 10 ms; job kill >= 200/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    if not args.home:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
