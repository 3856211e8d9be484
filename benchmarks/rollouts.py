"""RL rollout load (issue 23): N agents, each an episode loop over its own sandbox.

Each agent creates a sandbox, then for ``--turns`` turns thinks for a log-normal time
(median ``--think`` seconds, sigma 1) and runs one command drawn from a mix through the SDK:

  ls       ``ls -la /usr/bin``                                  (45%)
  python   a ~50 ms Python computation (``python3 -c``)         (30%)
  file     write 64 KiB with the files API, read it back        (20%)
  compile  a 0.5 s CPU burst (``python3``, 0.5 s of CPU time)   (5%)

then kills it and starts a new episode, until ``--duration`` seconds are over. Reported per
command kind: p50/p99 latency under load against the same command on an otherwise idle node
(the inflation); creations and kills per second while the load runs; host memory
(``MemAvailable`` drop) and CPU (``/proc/stat`` busy share) sampled each second. Then the
same load with ``pause`` between turns (the agent pauses its sandbox while it thinks; the
next request resumes it), unless ``--no-pause``.

Usage: python benchmarks/rollouts.py [--n 500] [--duration 60] [--image e2b-base] [--quick]
Writes benchmarks/results/rollouts.json (``rollouts_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
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

PY_50MS = "python3 -c 's=0\nfor i in range(600000): s+=i*i\nprint(s)'"
PY_BURST = "python3 -c 'import time\nt=time.process_time()\nwhile time.process_time()-t<0.5: pass'"
MIX: list[tuple[str, float]] = [("ls", 0.45), ("python", 0.30), ("file", 0.20), ("compile", 0.05)]
PAYLOAD = bytes(range(256)) * 256  # 64 KiB


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


async def run_command(sb: AsyncSandbox, kind: str) -> None:
    if kind == "ls":
        r = await sb.commands.run("ls -la /usr/bin > /dev/null")
    elif kind == "python":
        r = await sb.commands.run(PY_50MS)
    elif kind == "compile":
        r = await sb.commands.run(PY_BURST, timeout=120)
    else:
        await sb.files.write("/tmp/rollout.bin", PAYLOAD)
        if await sb.files.read("/tmp/rollout.bin") != PAYLOAD:
            raise AssertionError("file read back differs")
        return
    if r.exit_code != 0:
        raise AssertionError(f"{kind}: exit {r.exit_code}: {r.stderr[:200]}")


async def idle_baseline(kw: dict[str, Any], reps: int) -> dict[str, list[float]]:
    sb = await AsyncSandbox.create(**kw)
    try:
        for kind, _ in MIX:  # warm every path once
            await run_command(sb, kind)
        out: dict[str, list[float]] = {k: [] for k, _ in MIX}
        for kind, _ in MIX:
            for _ in range(reps if kind != "compile" else max(3, reps // 3)):
                t0 = time.perf_counter()
                await run_command(sb, kind)
                out[kind].append((time.perf_counter() - t0) * 1000)
        return out
    finally:
        await sb.kill()


async def load(
    kw: dict[str, Any], n: int, duration: float, think: float, turns: int, pause: bool
) -> dict[str, Any]:
    lat: dict[str, list[float]] = {k: [] for k, _ in MIX}
    counts = {"creates": 0, "kills": 0, "errors": 0, "turns": 0}
    errors: list[str] = []
    kinds = [k for k, _ in MIX]
    weights = [w for _, w in MIX]
    stop = time.monotonic() + duration
    rng = random.Random(23)
    create_gate = asyncio.Semaphore(16)

    async def agent(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, min(duration / 4, think * 2)))  # staggered start
        while time.monotonic() < stop:
            try:
                async with create_gate:
                    sb = await AsyncSandbox.create(**kw)
                counts["creates"] += 1
            except Exception as e:
                counts["errors"] += 1
                errors.append(f"create: {e!r}"[:200])
                await asyncio.sleep(1.0)
                continue
            try:
                for _ in range(turns):
                    if time.monotonic() >= stop:
                        break
                    if pause:
                        await sb.pause()
                    await asyncio.sleep(rng.lognormvariate(math.log(think), 1.0))
                    if time.monotonic() >= stop:
                        break
                    kind = rng.choices(kinds, weights)[0]
                    t0 = time.perf_counter()
                    await run_command(sb, kind)
                    lat[kind].append((time.perf_counter() - t0) * 1000)
                    counts["turns"] += 1
            except Exception as e:
                counts["errors"] += 1
                errors.append(f"turn: {e!r}"[:200])
            finally:
                try:
                    await sb.kill()
                    counts["kills"] += 1
                except Exception as e:
                    errors.append(f"kill: {e!r}"[:200])

    samples: list[dict[str, float]] = []

    async def sampler() -> None:
        mem0 = mem_available_kib()
        busy0, tot0 = cpu_times()
        while time.monotonic() < stop:
            await asyncio.sleep(1.0)
            busy, tot = cpu_times()
            samples.append(
                {
                    "mem_drop_mib": (mem0 - mem_available_kib()) / 1024,
                    "cpu_busy": (busy - busy0) / max(1, tot - tot0),
                }
            )
            busy0, tot0 = busy, tot

    t0 = time.monotonic()
    probe_before = host_probe_s()
    await asyncio.gather(sampler(), *(agent(i) for i in range(n)))
    took = time.monotonic() - t0
    return {
        "latency_ms": lat,
        "counts": counts,
        "seconds": took,
        "creates_per_s": counts["creates"] / took,
        "kills_per_s": counts["kills"] / took,
        "mem_drop_mib_max": max((s["mem_drop_mib"] for s in samples), default=float("nan")),
        "cpu_busy_mean": sum(s["cpu_busy"] for s in samples) / max(1, len(samples)),
        "host_probe_s": [probe_before, host_probe_s()],
        "errors_sample": errors[:10],
    }


def table(title: str, base: dict[str, list[float]], res: dict[str, Any]) -> list[dict[str, Any]]:
    print(f"\n{title}")
    hdr = f"{'command':<8} {'n':>6} {'idle p50':>9} {'load p50':>9} {'load p99':>9} {'inflation p50':>14}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for kind, _ in MIX:
        xs = res["latency_ms"][kind]
        b50 = pct(base[kind], 50)
        row = {
            "kind": kind,
            "n": len(xs),
            "idle_p50_ms": b50,
            "load_p50_ms": pct(xs, 50),
            "load_p99_ms": pct(xs, 99),
            "inflation_p50": pct(xs, 50) / b50 if xs else float("nan"),
        }
        rows.append(row)
        print(
            f"{kind:<8} {row['n']:>6} {b50:>7.1f}ms {row['load_p50_ms']:>7.1f}ms "
            f"{row['load_p99_ms']:>7.1f}ms {row['inflation_p50']:>13.2f}x"
        )
    c = res["counts"]
    print(
        f"creations {res['creates_per_s']:.1f}/s, kills {res['kills_per_s']:.1f}/s, "
        f"{c['turns']} turns, {c['errors']} errors; host memory in use: up to "
        f"{res['mem_drop_mib_max']:.0f} MiB more (MemAvailable), CPU {res['cpu_busy_mean'] * 100:.0f}% busy; probe "
        f"{res['host_probe_s'][0] * 1000:.1f}/{res['host_probe_s'][1] * 1000:.1f} ms"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=500, help="concurrent agents (sandboxes)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per load phase")
    ap.add_argument("--think", type=float, default=2.0, help="median think time, seconds")
    ap.add_argument("--turns", type=int, default=10, help="turns per episode (sandbox)")
    ap.add_argument("--image", default="e2b-base", help="an image with python3")
    ap.add_argument("--no-pause", action="store_true", help="skip the pause-between-turns phase")
    ap.add_argument("--quick", action="store_true", help="n=50, 20 s phases")
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = ap.parse_args()
    if args.quick:
        args.n, args.duration = min(args.n, 50), min(args.duration, 20.0)
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-rollouts-"))
    env = {
        "DSEC_CPU_OVERCOMMIT": "5000",
        "DSEC_MEMORY_OVERCOMMIT": "100",
        "DSEC_MAX_SANDBOXES": str(max(4096, args.n * 2)),
        **dict(e.split("=", 1) for e in args.env),
    }
    results: dict[str, Any] = {"args": vars(args), "server_env": env}
    with ServeProcess(home, env=env) as srv:

        async def go() -> None:
            async with AsyncClient(srv.url, srv.api_key) as client:
                kw: dict[str, Any] = {
                    "tier": "container",
                    "image": args.image,
                    "cpu": 1.0,
                    "memory_mb": 256,
                    "client": client,
                }
                print("idle-node baseline ...", flush=True)
                results["idle_ms"] = await idle_baseline(kw, 10)
                print(f"load: {args.n} agents, {args.duration:.0f} s ...", flush=True)
                results["load"] = await load(
                    kw, args.n, args.duration, args.think, args.turns, pause=False
                )
                if not args.no_pause:
                    print(f"load with pause between turns ({args.duration:.0f} s) ...", flush=True)
                    results["load_pause"] = await load(
                        kw, args.n, args.duration, args.think, args.turns, pause=True
                    )

        asyncio.run(go())
    results["table"] = table(
        f"{args.n} agents, think median {args.think} s", results["idle_ms"], results["load"]
    )
    if "load_pause" in results:
        results["table_pause"] = table(
            "same, with pause between turns", results["idle_ms"], results["load_pause"]
        )
    out = Path(args.out or RESULTS / ("rollouts_quick.json" if args.quick else "rollouts.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    if not args.home:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
