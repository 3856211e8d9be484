"""Cost of create, exec and kill as the number of live sandboxes grows (issue 23).

Through the SDK against a ``dsec serve`` child process: grow the node to each of the
``--steps`` live counts (idle busybox containers asking 1 core each, the caps raised), and at each step measure
K sequential creates (with the server's own breakdown from the sandbox's ``state.json``:
rootfs, OCI runtime, exec server), K kills, and the exec round trip of ``true`` in one of
the idle crowd. Then kill the whole crowd as one job (``job_action kill``) and report the
rate. Prints a table and writes benchmarks/results/live_scaling.json.

The crowd grows ``--clients`` creations at a time (1: sequential); each stretch's growth
rate is reported with the step (creations/s while going from the previous step to this one),
and the host memory each idle sandbox holds (MemAvailable's drop since the first step, per
sandbox added).

Usage: python benchmarks/live_scaling.py [--steps 0,250,500] [--k 10] [--clients 8] [--home DIR]
       [--profile DIR]  (perf record -a -g and py-spy of the server around each step)
Targets (issue 38): creation rate with 5,000 idle >= 0.8x the empty node's, 10,000 >= 0.6x;
<= 1 MiB of host memory each; exec p50 <= 5 ms and p99 <= 30 ms among them; kill <= 5 ms;
a batch kill of 10,000 in <= 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
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
from hostprobe import host_probe_s, meminfo_kib

RESULTS = Path(__file__).resolve().parent / "results"
MEMINFO_KINDS = (
    "AnonPages", "Shmem", "Cached", "SUnreclaim", "SReclaimable", "KernelStack", "PageTables",
    "Percpu",
)  # fmt: skip


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
    # the execs first: among the idle crowd, not beside the teardowns and the pool refills
    # the creates and kills below start
    execs = []
    for _ in range(30):
        t0 = time.perf_counter()
        await probe.commands.run("true")
        execs.append((time.perf_counter() - t0) * 1000)
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

    def med(key: str) -> float:
        vals = [b[key] for b in breakdown if key in b]
        return statistics.median(vals) if vals else float("nan")

    return {
        "create_p50_ms": pct(create, 50),
        "create_p99_ms": pct(create, 99),
        "kill_p50_ms": pct(kill, 50),
        "kill_p99_ms": pct(kill, 99),
        "exec_p50_ms": pct(execs, 50),
        "exec_p99_ms": pct(execs, 99),
        "server_rootfs_ms": med("rootfs"),
        "server_oci_run_ms": med("oci_run"),
        "server_exec_server_ms": med("exec_server"),
        "server_total_ms": med("total"),
        "host_probe_s": host_probe_s(),
    }


class Profiler:
    """``perf record -a -g`` of the whole machine (the kernel's share) and ``py-spy record``
    of the server (dsec's), around one step's measurement; files in ``out_dir``."""

    def __init__(self, out_dir: Path, server_pid: int) -> None:
        self.out_dir, self.server_pid = out_dir, server_pid
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, live: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        perf = ["perf", "record", "-a", "-g", "-o", str(self.out_dir / f"perf-{live}.data")]
        self.procs = [subprocess.Popen(perf, stderr=subprocess.DEVNULL)]
        spy = shutil.which("py-spy")
        if spy:
            raw = self.out_dir / f"py-spy-{live}.txt"
            cmd = [spy, "record", "--pid", str(self.server_pid), "--format", "raw", "--nonblocking"]
            self.procs.append(subprocess.Popen([*cmd, "-o", str(raw)], stderr=subprocess.DEVNULL))
        time.sleep(1)  # both attached

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            p.wait(timeout=120)
        self.procs = []


async def run(
    home: Path,
    url: str,
    key: str,
    steps: list[int],
    k: int,
    clients: int,
    profiler: Profiler | None = None,
) -> dict[str, Any]:
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
    sem = asyncio.Semaphore(clients)

    async def one() -> None:
        async with sem:
            crowd.append(await AsyncSandbox.create(**kw, job="crowd"))

    out: dict[str, Any] = {"steps": [], "clients": clients}
    probe = await AsyncSandbox.create(**kw)
    mem0: tuple[int, dict[str, int]] | None = None  # (live, /proc/meminfo) at the first step
    try:
        for n in steps:
            t0 = time.perf_counter()
            need = n - len(crowd)
            await asyncio.gather(*(one() for _ in range(max(0, need))))
            grow_s = time.perf_counter() - t0
            print(f"  {len(crowd)} live ...", flush=True)
            await asyncio.sleep(2)  # the pool's refill and the kills' teardowns settle
            mem = meminfo_kib()
            if mem0 is None:
                mem0 = (len(crowd), mem)
            if profiler:
                profiler.start(len(crowd))
            step = await measure_step(home, k, kw, probe)
            if profiler:
                profiler.stop()
            step["live"] = len(crowd)
            step["grow_per_s"] = need / grow_s if need > 0 else None
            added = len(crowd) - mem0[0]
            step["host_mib_per_sandbox"] = (
                (mem0[1]["MemAvailable"] - mem["MemAvailable"]) / 1024 / added if added else None
            )
            # where it goes: KiB per sandbox added, by /proc/meminfo's kind
            step["host_kib_per_sandbox_by_kind"] = {
                kind: (mem.get(kind, 0) - mem0[1].get(kind, 0)) / added
                for kind in MEMINFO_KINDS
                if added
            }
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
    ap.add_argument(
        "--clients", type=int, default=8, help="creations in flight while the crowd grows"
    )
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=str(RESULTS / "live_scaling.json"))
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="record perf (whole machine) and py-spy (server) around each step's measurement",
    )
    args = ap.parse_args()
    steps = sorted(int(x) for x in args.steps.split(","))
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-scale-"))
    env = {
        "DSEC_CPU_OVERCOMMIT": "5000",
        "DSEC_MEMORY_OVERCOMMIT": "100",
        "DSEC_MAX_SANDBOXES": str(max(steps) + 4 * args.k + 100),
        **dict(e.split("=", 1) for e in args.env),
    }
    with ServeProcess(home, env=env) as srv:
        profiler = Profiler(Path(args.profile), srv.proc.pid) if args.profile else None
        res = asyncio.run(run(home, srv.url, srv.api_key, steps, args.k, args.clients, profiler))
    res["server_env"] = env
    rows = res["steps"]
    base = rows[0]
    print()
    hdr = (
        f"{'live':>6} {'grown/s':>8} {'create p50/p99':>15} {'rate/s':>7} {'vs 0':>6} "
        f"{'oci run':>8} {'kill p50/p99':>13} {'exec p50/p99':>14} {'MiB each':>9} {'probe':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rate = 1000 / r["create_p50_ms"]
        r["create_rate_per_s"] = rate
        r["rate_vs_first"] = rate / (1000 / base["create_p50_ms"])
        grown = f"{r['grow_per_s']:.1f}" if r["grow_per_s"] else "-"
        mib = f"{r['host_mib_per_sandbox']:.2f}" if r["host_mib_per_sandbox"] else "-"
        print(
            f"{r['live']:>6} {grown:>8} {r['create_p50_ms']:>6.1f}/{r['create_p99_ms']:<6.1f}ms "
            f"{rate:>7.1f} {r['rate_vs_first']:>5.2f}x {r['server_oci_run_ms']:>5.1f} ms "
            f"{r['kill_p50_ms']:>5.1f}/{r['kill_p99_ms']:<5.1f}ms "
            f"{r['exec_p50_ms']:>6.2f}/{r['exec_p99_ms']:<6.2f} {mib:>9} "
            f"{r['host_probe_s'] * 1000:>5.1f}ms"
        )
    last = rows[-1].get("host_kib_per_sandbox_by_kind") or {}
    if last:
        print(
            f"host memory per idle sandbox at {rows[-1]['live']} (KiB, /proc/meminfo): "
            + ", ".join(f"{k} {v:.0f}" for k, v in last.items())
        )
    jk = res["job_kill"]
    print(f"job kill: {jk['sandboxes']} sandboxes in {jk['seconds']:.2f} s = {jk['per_s']:.0f}/s")
    print(
        f"  torn down {jk['settle_s']:.2f} s later: {jk['per_s_settled']:.0f}/s with the teardowns"
    )
    print(
        "targets: rate at 5,000 >= 0.8x rate at 0, at 10,000 >= 0.6x; <= 1 MiB each; exec "
        "p50 <= 5 ms, p99 <= 30 ms; kill <= 5 ms; 10,000 killed in <= 60 s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    if not args.home:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
