"""RL rollout load (issues 23, 31): N agents, each an episode loop over its own sandbox.

Each agent creates a sandbox, then for ``--turns`` turns thinks for a log-normal time
(median ``--think`` seconds, sigma 1) and runs one command drawn from a mix through the SDK:

  ls       ``ls -la /usr/bin``                                  (45%)
  python   a ~50 ms Python computation (``python3 -c``)         (30%)
  file     write 64 KiB with the files API, read it back        (20%)
  compile  a 0.5 s CPU burst (``python3``, 0.5 s of CPU time)   (5%)

then kills it and starts a new episode, until ``--duration`` seconds are over. The agents
run in ``--procs`` processes (one Python event loop for hundreds of agents queues their
requests itself; how late the loops woke is reported). Reported: the offered CPU demand
(N x mean command CPU / (mean think + mean command CPU), in cores, against the node's; each
kind's CPU time measured from its sandbox's cgroup on the idle node); per command kind the
p50/mean/p99 latency under load, on the idle node, and what fair processor sharing would
give at that load; failures by cause; creations and kills per second; host memory
(``MemAvailable`` drop), CPU busy share and ``dsec serve``'s own CPU each second; where a
creation's time went in the server (admission, the creation gate's queue, the runtime, the
start command: the ``/metrics`` histogram); and a probe
of the platform's own latency from a process of its own (a 10-byte file read through the
API, an ``echo`` in an idle sandbox and a ``GET`` of it, and a new sandbox created to its first
exec and killed, twice a second) against the idle node. Then the same load with ``pause``
between turns, unless ``--no-pause``.

Usage: python benchmarks/rollouts.py [--n 500] [--think 2] [--duration 60] [--procs 4]
       [--image e2b-base] [--quick]
Writes benchmarks/results/rollouts.json (``rollouts_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
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
from hostprobe import host_probe_s, mem_available_kib

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


def cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def sandbox_kw(image: str, client: AsyncClient) -> dict[str, Any]:
    """What every sandbox of the benchmark is created with (agents, probe, baseline)."""
    return {"tier": "container", "image": image, "cpu": 1.0, "memory_mb": 256, "client": client}


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


async def idle_baseline(
    kw: dict[str, Any], reps: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each kind's latency on an otherwise idle node (ms), and its CPU time (seconds, from
    the sandbox's cgroup: what the kernel must give it however busy the node is)."""
    sb = await AsyncSandbox.create(**kw)
    try:
        for kind, _ in MIX:  # warm every path once
            await run_command(sb, kind)
        out: dict[str, list[float]] = {k: [] for k, _ in MIX}
        cpu: dict[str, float] = {}
        for kind, _ in MIX:
            n = reps if kind != "compile" else max(3, reps // 3)
            before = (await sb.metrics()).cpu.usage_s
            for _ in range(n):
                t0 = time.perf_counter()
                await run_command(sb, kind)
                out[kind].append((time.perf_counter() - t0) * 1000)
            cpu[kind] = max(0.0, ((await sb.metrics()).cpu.usage_s - before) / n)
        return out, cpu
    finally:
        await sb.kill()


def processor_sharing(
    n: int, think_median_s: float, cpu_s: dict[str, float], cores: int
) -> dict[str, Any]:
    """What fair processor sharing gives this closed loop (N agents, log-normal think time of
    median Z and sigma 1, the mix's commands of CPU time S_k, C cores): the offered demand
    N·S/(Z+S) in cores and each kind's expected latency. Saturated (demand > C), a command
    of size S_k takes about S_k·(N·S/C - Z)/S (every runnable command gets an equal share);
    below, S_k/(1 - rho) with rho = demand/C (M/G/1-PS)."""
    z = think_median_s * math.exp(0.5)  # the mean of the log-normal
    s_mean = sum(cpu_s[k] * w for k, w in MIX)
    demand = n * s_mean / (z + s_mean) if s_mean > 0 else 0.0
    rho = demand / cores
    if rho >= 1:
        mean_response = max(s_mean, n * s_mean / cores - z)
        factor = mean_response / s_mean
    else:
        factor = 1 / (1 - rho)
    return {
        "think_mean_s": z,
        "command_cpu_mean_s": s_mean,
        "offered_cores": demand,
        "cores": cores,
        "utilisation": rho,
        "stretch": factor,
        "ps_ms": {k: cpu_s[k] * factor * 1000 for k, _ in MIX},
    }


def _cause(e: BaseException) -> str:
    """A failure's cause for the table: the error's wire code, else its type."""
    code = getattr(e, "code", None)
    return f"{type(e).__name__}({code})" if isinstance(code, str) else type(e).__name__


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` and its reaped children, seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def agents(
    kw: dict[str, Any],
    n: int,
    duration: float,
    think: float,
    turns: int,
    pause: bool,
    client_gate: int,
    seed: int,
) -> dict[str, Any]:
    """``n`` agents' episode loops for ``duration`` seconds (one process's share of the load):
    each kind's latencies, counts, failures by cause, and how late this process's own event
    loop woke (its queue adds to every latency it measures)."""
    lat: dict[str, list[float]] = {k: [] for k, _ in MIX}
    counts = {"creates": 0, "kills": 0, "errors": 0, "turns": 0}
    errors: list[str] = []
    causes: dict[str, int] = {}

    def failed(what: str, e: BaseException) -> None:
        counts["errors"] += 1
        key = f"{what}: {_cause(e)}"
        causes[key] = causes.get(key, 0) + 1
        errors.append(f"{what}: {e!r}"[:200])

    kinds = [k for k, _ in MIX]
    weights = [w for _, w in MIX]
    stop = time.monotonic() + duration
    rng = random.Random(seed)
    # the server admits creations itself; a client-side gate only for comparisons
    create_gate = asyncio.Semaphore(client_gate) if client_gate > 0 else contextlib.nullcontext()

    async def agent() -> None:
        await asyncio.sleep(rng.uniform(0, min(duration / 4, think * 2)))  # staggered start
        while time.monotonic() < stop:
            try:
                async with create_gate:
                    sb = await AsyncSandbox.create(**kw)
                counts["creates"] += 1
            except Exception as e:
                failed("create", e)
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
                failed("turn", e)
            finally:
                try:
                    await sb.kill()
                    counts["kills"] += 1
                except Exception as e:
                    failed("kill", e)

    lag = [0.0]

    async def lag_meter() -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            await asyncio.sleep(0.5)
            lag[0] = max(lag[0], time.monotonic() - t0 - 0.5)

    await asyncio.gather(lag_meter(), *(agent() for _ in range(n)))
    return {
        "latency_ms": lat,
        "counts": counts,
        "failures_by_cause": causes,
        "errors_sample": errors[:10],
        "loop_lag_s_max": lag[0],
    }


async def agents_main(args: argparse.Namespace) -> dict[str, Any]:
    """A load process (``--agents-url``): its agents against the server."""
    async with AsyncClient(args.agents_url, os.environ["DSEC_API_KEY"]) as client:
        kw = sandbox_kw(args.image, client)
        return await agents(
            kw,
            args.n,
            args.duration,
            args.think,
            args.turns,
            args.pause_turns,
            args.client_gate,
            args.seed,
        )


async def _child_json(argv: list[str], key: str) -> dict[str, Any]:
    """Run this script with ``argv`` in a process of its own; its last stdout line (JSON)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *argv,
        env={**os.environ, "DSEC_API_KEY": key},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"{argv[0]}: the process exited {proc.returncode}") from None


PHASES = ("admit", "queue", "runtime", "start")


async def create_phases(url: str) -> dict[str, tuple[float, float]]:
    """The server's creation phases so far (``dsec_sandbox_create_phase_seconds`` of
    ``/metrics``, which answers loopback without a key): phase -> (sum in s, count)."""
    import httpx

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics", timeout=30)).text
    out: dict[str, list[float]] = {phase: [0.0, 0.0] for phase in PHASES}
    for line in text.splitlines():
        if not line.startswith("dsec_sandbox_create_phase_seconds_"):
            continue
        name, _, value = line.rpartition(" ")
        for phase in PHASES:
            if f'phase="{phase}"' in name:
                if name.startswith("dsec_sandbox_create_phase_seconds_sum"):
                    out[phase][0] += float(value)
                elif name.startswith("dsec_sandbox_create_phase_seconds_count"):
                    out[phase][1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def phase_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Each phase's mean (ms) over the creations between two :func:`create_phases`."""
    means = {}
    for phase in PHASES:
        n = after[phase][1] - before[phase][1]
        means[phase] = (after[phase][0] - before[phase][0]) / n * 1000 if n else float("nan")
    return means


async def load(
    url: str,
    key: str,
    args: argparse.Namespace,
    pause: bool,
    server_pid: int,
) -> dict[str, Any]:
    """The load: ``args.n`` agents spread over ``args.procs`` processes (one Python event
    loop for hundreds of agents queues their requests itself), the platform probe in another,
    the node sampled each second from this one."""
    duration = args.duration
    stop = time.monotonic() + duration
    shares = [args.n // args.procs + (i < args.n % args.procs) for i in range(args.procs)]

    def worker_argv(i: int, n: int) -> list[str]:
        argv = ["--agents-url", url, "--n", str(n), "--duration", str(duration)]
        argv += ["--think", str(args.think), "--turns", str(args.turns), "--image", args.image]
        argv += ["--client-gate", str(args.client_gate), "--seed", str(23 + i)]
        return argv + (["--pause-turns"] if pause else [])

    samples: list[dict[str, float]] = []

    async def sampler() -> None:
        mem0 = mem_available_kib()
        busy0, tot0 = cpu_times()
        srv0, t0 = process_cpu_s(server_pid), time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(1.0)
            busy, tot = cpu_times()
            srv, t = process_cpu_s(server_pid), time.monotonic()
            samples.append(
                {
                    "mem_drop_mib": (mem0 - mem_available_kib()) / 1024,
                    "cpu_busy": (busy - busy0) / max(1, tot - tot0),
                    "server_cores": (srv - srv0) / (t - t0),
                }
            )
            busy0, tot0, srv0, t0 = busy, tot, srv, t

    phases_before = await create_phases(url)
    t0 = time.monotonic()
    probe_before = host_probe_s()
    probe_argv = ["--probe-url", url, "--probe-seconds", str(duration), "--image", args.image]
    got = await asyncio.gather(
        sampler(),
        _child_json(probe_argv, key),
        *(_child_json(worker_argv(i, n), key) for i, n in enumerate(shares) if n),
        return_exceptions=True,
    )
    took = time.monotonic() - t0
    phases = phase_means_ms(phases_before, await create_phases(url))
    lat: dict[str, list[float]] = {k: [] for k, _ in MIX}
    counts = {"creates": 0, "kills": 0, "errors": 0, "turns": 0}
    causes: dict[str, int] = {}
    errors: list[str] = []
    lags: list[float] = []
    platform: dict[str, list[float]] = {"api_file_read": [], "echo": [], "info": []}
    if isinstance(got[1], dict):
        platform.update(got[1])
    else:
        causes["probe: process"] = 1
    for part in got[2:]:
        if not isinstance(part, dict):
            causes["load process"] = causes.get("load process", 0) + 1
            errors.append(repr(part)[:200])
            continue
        for kind, xs in part["latency_ms"].items():
            lat[kind] += xs
        for k, v in part["counts"].items():
            counts[k] += v
        for k, v in part["failures_by_cause"].items():
            causes[k] = causes.get(k, 0) + v
        errors += part["errors_sample"]
        lags.append(part["loop_lag_s_max"])
    return {
        "latency_ms": lat,
        "counts": counts,
        "seconds": took,
        "processes": args.procs,
        "creates_per_s": counts["creates"] / took,
        "kills_per_s": counts["kills"] / took,
        "mem_drop_mib_max": max((s["mem_drop_mib"] for s in samples), default=float("nan")),
        "cpu_busy_mean": sum(s["cpu_busy"] for s in samples) / max(1, len(samples)),
        "server_cores_mean": sum(s["server_cores"] for s in samples) / max(1, len(samples)),
        "server_cores_max": max((s["server_cores"] for s in samples), default=float("nan")),
        "client_lag_s_max": max(lags, default=float("nan")),
        "host_probe_s": [probe_before, host_probe_s()],
        "errors_sample": errors[:10],
        "failures_by_cause": causes,
        "platform_ms": platform,
        "create_phases_mean_ms": phases,
    }


def table(
    title: str,
    base: dict[str, list[float]],
    res: dict[str, Any],
    ps: dict[str, Any],
    idle_probe: dict[str, float],
) -> list[dict[str, Any]]:
    print(f"\n{title}")
    print(
        f"offered demand {ps['offered_cores']:.1f} cores on {ps['cores']} "
        f"(utilisation {ps['utilisation']:.2f}; mean think {ps['think_mean_s']:.1f} s, mean "
        f"command CPU {ps['command_cpu_mean_s'] * 1000:.0f} ms): fair sharing stretches each "
        f"command {ps['stretch']:.0f}x"
    )
    hdr = (
        f"{'command':<8} {'n':>6} {'cpu':>7} {'idle p50':>9} {'load p50':>9} {'load mean':>10} "
        f"{'load p99':>9} {'PS mean':>9} {'mean/PS':>8} {'PS@busy':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for kind, _ in MIX:
        xs = res["latency_ms"][kind]
        b50 = pct(base[kind], 50)
        mean = sum(xs) / len(xs) if xs else float("nan")
        ps_ms = ps["ps_ms"][kind]
        # the same model at the utilisation measured (platform, clients and idle sandboxes
        # use CPU the commands' demand leaves out)
        busy = min(res["cpu_busy_mean"], 0.99)
        cpu_ms = ps_ms / ps["stretch"]
        ps_busy_ms = max(ps_ms, cpu_ms / (1 - busy))
        row = {
            "kind": kind,
            "n": len(xs),
            "cpu_ms": ps_ms / ps["stretch"],
            "idle_p50_ms": b50,
            "load_p50_ms": pct(xs, 50),
            "load_mean_ms": mean,
            "load_p99_ms": pct(xs, 99),
            "inflation_p50": pct(xs, 50) / b50 if xs else float("nan"),
            "ps_mean_ms": ps_ms,
            "mean_over_ps": mean / ps_ms if ps_ms > 0 else float("nan"),
            "ps_at_measured_busy_ms": ps_busy_ms,
        }
        rows.append(row)
        print(
            f"{kind:<8} {row['n']:>6} {row['cpu_ms']:>5.0f}ms {b50:>7.1f}ms "
            f"{row['load_p50_ms']:>7.1f}ms {mean:>8.1f}ms {row['load_p99_ms']:>7.1f}ms "
            f"{ps_ms:>7.0f}ms {row['mean_over_ps']:>7.2f}x {ps_busy_ms:>7.0f}ms"
        )
    c = res["counts"]
    print(
        f"creations {res['creates_per_s']:.1f}/s, kills {res['kills_per_s']:.1f}/s, "
        f"{c['turns']} turns, {c['errors']} failures; host memory in use: up to "
        f"{res['mem_drop_mib_max']:.0f} MiB more (MemAvailable), CPU {res['cpu_busy_mean'] * 100:.0f}% busy; probe "
        f"{res['host_probe_s'][0] * 1000:.1f}/{res['host_probe_s'][1] * 1000:.1f} ms"
    )
    print(
        f"dsec serve's own CPU: {res['server_cores_mean']:.2f} cores on average, "
        f"{res['server_cores_max']:.2f} at most (1 s samples); the load processes' event "
        f"loops woke up to {res['client_lag_s_max'] * 1000:.0f} ms late"
    )
    phases = res.get("create_phases_mean_ms") or {}
    print(
        "a creation's time in the server (mean): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items())
        + " (queue: waiting for the node's creation gate)"
    )
    for cause, k in sorted(res["failures_by_cause"].items(), key=lambda kv: -kv[1]):
        print(f"  failed: {k} x {cause}")
    print("platform probe (p50 / p99 under load; idle p50; p50 ratio):")
    if res["platform_ms"].get("create") and idle_probe.get("create"):
        load_rate = 1000 / pct(res["platform_ms"]["create"], 50)
        idle_rate = 1000 / idle_probe["create"]
        print(
            f"  one client's creations (to first exec): {load_rate:.1f}/s under load, "
            f"{idle_rate:.1f}/s idle: {load_rate / idle_rate:.2f}x"
        )
    for name, xs in res["platform_ms"].items():
        idle = idle_probe.get(name, float("nan"))
        print(
            f"  {name:<14} {pct(xs, 50):>7.1f} / {pct(xs, 99):>7.1f} ms; idle {idle:.1f} ms; "
            f"{pct(xs, 50) / idle if idle else float('nan'):.1f}x"
        )
    return rows


async def probe_main(url: str, image: str, seconds: float) -> dict[str, list[float]]:
    """Twice a second for ``seconds``: a 10-byte file read through the API, an ``echo`` in
    an otherwise idle sandbox, a ``GET`` of the sandbox, and a creation of a new sandbox to
    its first exec (``create``, one client's sequential creation rate is 1000 / its p50)
    followed by its kill (ms each)."""
    names = ("api_file_read", "echo", "info", "create", "kill")
    out: dict[str, list[float]] = {name: [] for name in names}
    stop = time.monotonic() + seconds
    async with AsyncClient(url, os.environ["DSEC_API_KEY"]) as client:
        kw = sandbox_kw(image, client)
        sb = await AsyncSandbox.create(**kw)
        try:
            await sb.files.write("/tmp/probe.txt", "0123456789")
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                await sb.files.read("/tmp/probe.txt")
                t1 = time.perf_counter()
                await sb.commands.run("echo probe")
                t2 = time.perf_counter()
                await sb.refresh()
                t3 = time.perf_counter()
                fresh = await AsyncSandbox.create(**kw)
                await fresh.commands.run("true")
                t4 = time.perf_counter()
                await fresh.kill()
                t5 = time.perf_counter()
                for name, ms in zip(
                    names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
                ):
                    out[name].append(ms * 1000)
                await asyncio.sleep(max(0.0, 0.5 - (t5 - t0)))
        finally:
            await sb.kill()
    return out


async def idle_probe(url: str, key: str, image: str) -> dict[str, float]:
    """The platform probe on the idle node, 10 s (p50, ms)."""
    got = await _child_json(["--probe-url", url, "--probe-seconds", "10", "--image", image], key)
    return {k: pct(v, 50) for k, v in got.items()}


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
    ap.add_argument(
        "--client-gate",
        type=int,
        default=0,
        help="creations each phase lets run at once from the client (0: none; the server admits)",
    )
    ap.add_argument(
        "--procs", type=int, default=4, help="load processes the agents are spread over"
    )
    ap.add_argument("--probe-url", help=argparse.SUPPRESS)  # the probe's own process
    ap.add_argument("--probe-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--agents-url", help=argparse.SUPPRESS)  # a load process
    ap.add_argument("--seed", type=int, default=23, help=argparse.SUPPRESS)
    ap.add_argument("--pause-turns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_url:
        got = asyncio.run(probe_main(args.probe_url, args.image, args.probe_seconds))
        print(json.dumps(got))
        return
    if args.agents_url:
        print(json.dumps(asyncio.run(agents_main(args))))
        return
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
                kw = sandbox_kw(args.image, client)
                print("idle-node baseline ...", flush=True)
                results["idle_ms"], results["command_cpu_s"] = await idle_baseline(kw, 10)
                results["idle_probe_ms"] = await idle_probe(srv.url, srv.api_key, args.image)
                print(
                    f"load: {args.n} agents in {args.procs} processes, {args.duration:.0f} s ...",
                    flush=True,
                )
                results["load"] = await load(srv.url, srv.api_key, args, False, srv.proc.pid)
                if not args.no_pause:
                    print(f"load with pause between turns ({args.duration:.0f} s) ...", flush=True)
                    results["load_pause"] = await load(
                        srv.url, srv.api_key, args, True, srv.proc.pid
                    )

        asyncio.run(go())
    ps = processor_sharing(args.n, args.think, results["command_cpu_s"], os.cpu_count() or 1)
    results["processor_sharing"] = ps
    title = f"{args.n} agents, think median {args.think} s"
    results["table"] = table(
        title, results["idle_ms"], results["load"], ps, results["idle_probe_ms"]
    )
    if "load_pause" in results:
        results["table_pause"] = table(
            "same, with pause between turns",
            results["idle_ms"],
            results["load_pause"],
            ps,
            results["idle_probe_ms"],
        )
    out = Path(args.out or RESULTS / ("rollouts_quick.json" if args.quick else "rollouts.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    if not args.home:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
