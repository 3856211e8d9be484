"""Soak benchmark: nothing leaks over thousands of sandboxes. Prints a table, writes
benchmarks/results/soak.json.

A ``dsec serve`` child process (``dsec.server.ServeProcess``: apiserver + edge +
container tier, networking on with its own subnet) is driven through the public async SDK
for ``--cycles`` create / exec / kill cycles (default 2,000), one sandbox at a time. One
cycle in ten gets a network policy (its own namespace, veth pair and filter), one in ten a
pause and resume, one in twenty is killed while a command still runs. Measured:

  * cycles/s and the p50 / p99 latency of one cycle (client wall time)
  * the server's footprint (``dsec.footprint``) after a warm-up and at the end: zombie
    children, processes below it, threads, open fds, mounts under its home, cgroups of
    the install in every v1 hierarchy, network namespaces and host links, OCI runtime
    state entries, sandbox directories; sampled every 200 cycles too (zombies must not
    pile up while it runs)
  * the machine's pid usage (tasks: processes + threads, from /proc/loadavg) before the
    server started and after it exited, and the forks the machine made meanwhile
    (/proc/stat ``processes``; machine-wide, other work included)

``--quick``: 200 cycles, writes benchmarks/results/soak_quick.json.
Usage: .venv/bin/python benchmarks/soak.py [--cycles N] [--quick] [--home DIR]   (root)
Targets: 0 zombies; threads, fds, processes back to the warm baseline (fixed slack: 8
threads, 16 fds); no mount, cgroup, namespace, link, state entry or directory left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec import AsyncClient, AsyncSandbox
from dsec.errors import SandboxStopped
from dsec.footprint import ServerFootprint, machine_tasks, server_footprint
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"
SUBNET = "10.224.0.0/16"
THREAD_SLACK, FD_SLACK = 8, 16
SAMPLE_EVERY = 200
SMALL = {"cpu": 0.1, "memory_mb": 64, "disk_mb": 64}


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def forks_since_boot() -> int:
    """Processes created on the machine since boot (/proc/stat ``processes``)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("processes "):
            return int(line.split()[1])
    return 0


async def cycle(client: AsyncClient, i: int) -> None:
    """One lifecycle: create, exec, (network / pause / kill-in-flight by ``i``), kill."""
    network = {"allow_domains": ["example.test"]} if i % 10 == 1 else None
    sb = await AsyncSandbox.create(image="busybox", network=network, client=client, **SMALL)
    killed = False
    try:
        r = await sb.commands.run(f"echo {i}")
        if r.stdout != f"{i}\n":
            raise AssertionError(f"cycle {i}: {r}")
        if i % 10 == 2:
            await sb.pause()
            await sb.resume()
            await sb.commands.run("true")
        elif i % 20 == 3:
            run = asyncio.create_task(sb.commands.run("sleep 60", timeout=120))
            await asyncio.sleep(0.05)
            await sb.kill()
            killed = True
            try:
                await run
            except SandboxStopped:
                pass
    finally:
        if not killed:
            await sb.kill()


async def settle(
    pid: int, home: Path, baseline: ServerFootprint, timeout_s: float = 30.0
) -> tuple[ServerFootprint, dict[str, Any]]:
    """The footprint once teardown settled (or ``timeout_s`` passed), and its growth."""
    deadline = time.monotonic() + timeout_s
    while True:
        fp = server_footprint(pid, home)
        grew = fp.growth(baseline, threads=THREAD_SLACK, fds=FD_SLACK)
        if not grew or time.monotonic() > deadline:
            return fp, grew
        await asyncio.sleep(0.2)


async def soak(srv: ServeProcess, cycles: int) -> dict[str, Any]:
    pid = srv.proc.pid
    async with AsyncClient(srv.url, srv.api_key) as client:
        for i in range(20):  # warm-up: every kind of cycle, pools and caches made
            await cycle(client, i)
        start = server_footprint(pid, srv.home)
        for _ in range(100):  # the last kill's zombies: reaped within a reaper pass
            if not start.zombies:
                break
            await asyncio.sleep(0.1)
            start = server_footprint(pid, srv.home)
        timeline: list[dict[str, Any]] = []
        latencies: list[float] = []
        failures: list[str] = []
        t0 = time.perf_counter()
        for i in range(cycles):
            c0 = time.perf_counter()
            try:
                await cycle(client, i)
            except Exception as e:
                failures.append(f"cycle {i}: {e!r}"[:300])
            latencies.append((time.perf_counter() - c0) * 1000)
            if (i + 1) % SAMPLE_EVERY == 0:
                fp = server_footprint(pid, srv.home)
                timeline.append(
                    {"cycles": i + 1, "elapsed_s": round(time.perf_counter() - t0, 1)}
                    | {k: v for k, v in fp.counts().items() if k != "machine_tasks"}
                )
        elapsed = time.perf_counter() - t0
        end, grew = await settle(pid, srv.home, start)
    return {
        "cycles": cycles,
        "elapsed_s": round(elapsed, 1),
        "cycles_per_s": round(cycles / elapsed, 2),
        "cycle_p50_ms": round(pct(latencies, 50), 1),
        "cycle_p99_ms": round(pct(latencies, 99), 1),
        "failures": failures[:20],
        "failed_cycles": len(failures),
        "start": start.counts(),
        "end": end.counts(),
        "growth": grew,
        "max_zombies_sampled": max((s["zombies"] for s in timeline), default=0),
        "timeline": timeline,
    }


def print_table(res: dict[str, Any]) -> None:
    s, e = res["start"], res["end"]
    ok = not res["growth"] and res["failed_cycles"] == 0
    rows = [
        ("cycles (create/exec/kill)", str(res["cycles"])),
        ("cycles/s", str(res["cycles_per_s"])),
        ("cycle p50 / p99 ms", f"{res['cycle_p50_ms']} / {res['cycle_p99_ms']}"),
        ("failed cycles", str(res["failed_cycles"])),
        ("zombies: start / end / max sampled",
         f"{s['zombies']} / {e['zombies']} / {res['max_zombies_sampled']}"),
        ("server processes below it: start / end", f"{s['descendants']} / {e['descendants']}"),
        ("server threads: start / end", f"{s['threads']} / {e['threads']}"),
        ("server open fds: start / end", f"{s['fds']} / {e['fds']}"),
        ("mounts under home: start / end", f"{s['mounts']} / {e['mounts']}"),
        ("cgroups of the install: start / end", f"{s['cgroups']} / {e['cgroups']}"),
        ("netns (+records): start / end", f"{s['netns']} / {e['netns']}"),
        ("host links: start / end", f"{s['links']} / {e['links']}"),
        ("OCI state entries: start / end", f"{s['oci_state']} / {e['oci_state']}"),
        ("sandbox dirs: start / end", f"{s['sandbox_dirs']} / {e['sandbox_dirs']}"),
        ("machine tasks (pids): before / after",
         f"{res['machine_tasks_before']} / {res['machine_tasks_after']}"),
        ("machine forks during the run", str(res["machine_forks"])),
        ("machine load (1 min) before / after", f"{res['load_before']:.2f} / {res['load_after']:.2f}"),
        ("leaks", "none" if ok else json.dumps(res["growth"])[:200]),
    ]  # fmt: skip
    for what, measured in rows:
        print(f"{what:<44}{measured}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cycles", type=int, default=None, help="cycles (default 2000; quick 200)")
    ap.add_argument("--quick", action="store_true", help="200 cycles, soak_quick.json")
    ap.add_argument("--home", default=None, help="DSEC_HOME of the server (default: a temp dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (dsec serve runs containers)")
    cycles = args.cycles or (200 if args.quick else 2000)
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-soak-")).resolve()
    env = {"DSEC_TIERS": "container", "DSEC_NETWORK": "on", "DSEC_NET_SUBNET": SUBNET}
    tasks_before, forks_before = machine_tasks(), forks_since_boot()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        with ServeProcess(home, env=env) as srv:
            results = asyncio.run(soak(srv, cycles))
        time.sleep(1.0)
        results["machine_tasks_before"] = tasks_before
        results["machine_tasks_after"] = machine_tasks()
        results["machine_forks"] = forks_since_boot() - forks_before
        results["pid_max"] = int(Path("/proc/sys/kernel/pid_max").read_text())
        results["load_before"] = load_before
        results["load_after"] = os.getloadavg()[0]
    finally:
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    name = "soak_quick.json" if args.quick else "soak.json"
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"(total {results['total_s']} s; wrote {RESULTS / name})")


if __name__ == "__main__":
    main()
