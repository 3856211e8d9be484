"""Placement simulation at DSec scale (issue 8): the real ``dsec.placement.Placer``, simulated nodes.

One run compares the policies random, least-loaded, power-of-2 and power-of-k on the same
workload (same seed) and prints a table; results go to benchmarks/results/placement_sim.json.

Cluster: 160 nodes of 192 cores and 1.5 TB (1.5e12 bytes) each, caps 10x CPU and 1.5x memory on
requested totals, at most 4000 sandboxes per node.

Workload (DSec's published figures where there are some; assumptions are marked):
  * lifetime: lognormal, median 17 min, p99 3.5 h (mu = ln 1020 s, sigma = 1.081)
  * actual CPU: 90% of sandboxes use <= 5% of their requested CPU (uniform 0..5%), the rest
    5..100%; actual memory 20..70% of the request (assumption)
  * requests (assumption): CPU 0.25/0.5/1/2 cores (30/50/15/5%), memory 256 MiB/512 MiB/1 GiB/
    4 GiB (40/35/20/5%)
  * images: fan-out (sandboxes per image) lognormal, median 3, p90 28; 256 images active at
    once, each arrival picks one at random; every image is one layer (locality bonus)
  * steady state from t=0: ``--prefill`` sandboxes with residual lifetimes (length-biased
    lognormal x uniform age), then Poisson arrivals at prefill / mean lifetime per second
    (Little's law keeps the level), and at ``--burst-at`` one burst of ``--burst`` creations
    (all decided while in flight, committed after, as the edges would admit them).
  * event-driven simulated time: a heap of departures; every node reports its actual usage
    every ``--report-s`` simulated seconds (``Placer.observe``).

Measured per policy: placements/s (scheduler time only: sum of wall-clock per decision on this
core), p50/p99/max decision latency (place + begin + commit, wall clock), peak concurrent
sandboxes, rejection rate, utilisation at the peak (requested vs caps, actual vs physical,
mean and hottest node), locality hit rate, the burst's scheduler time, and an independent cap
check (the simulator's own per-node totals, not the placer's, against the caps).

Usage: .venv/bin/python benchmarks/placement_sim.py [--quick] [--seed N] [--duration S]
Targets (issue 8): >= 20,000 placements/s; p99 decision <= 1 ms; >= 380,000 concurrent without
any node over its caps; a 32k burst in <= 5 s of scheduler time.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsec.errors import QuotaExceeded  # noqa: E402
from dsec.placement import (  # noqa: E402
    Node,
    NodeUsage,
    Overcommit,
    PlacementRequest,
    Placer,
    Policy,
    Reservation,
)

RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20
GiB = 1 << 30

# lifetime: median 17 min, p99 3.5 h  ->  sigma = ln(12600 / 1020) / z(0.99)
LIFETIME_MEDIAN_S = 17 * 60.0
LIFETIME_P99_S = 3.5 * 3600.0
Z99 = 2.3263
Z90 = 1.2816
LIFE_MU = math.log(LIFETIME_MEDIAN_S)
LIFE_SIGMA = math.log(LIFETIME_P99_S / LIFETIME_MEDIAN_S) / Z99
LIFE_MEAN_S = math.exp(LIFE_MU + LIFE_SIGMA**2 / 2)
# image fan-out: median 3, p90 28
FANOUT_MU = math.log(3.0)
FANOUT_SIGMA = math.log(28.0 / 3.0) / Z90

CPU_CHOICES = ([0.25, 0.5, 1.0, 2.0], [30, 50, 15, 5])
MEM_CHOICES = ([256 * MiB, 512 * MiB, 1 * GiB, 4 * GiB], [40, 35, 20, 5])
ACTIVE_IMAGES = 256


def _table(choices: tuple[list[Any], list[int]]) -> list[Any]:
    """20 slots, each value repeated weight/5 times: one uniform draw picks by weight."""
    values, weights = choices
    table = [v for v, w in zip(values, weights, strict=True) for _ in range(w // 5)]
    assert len(table) == 20
    return table


CPU_TABLE: list[float] = _table(CPU_CHOICES)
MEM_TABLE: list[int] = _table(MEM_CHOICES)


def pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


@dataclass(frozen=True)
class Config:
    nodes: int
    cores: int
    memory_bytes: int
    max_sandboxes: int
    prefill: int
    burst: int
    burst_at_s: float
    duration_s: float
    report_s: float
    seed: int


class Workload:
    """Draws sandboxes: request, lifetime, actual usage, image (deterministic per seed)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_image = 0
        self.active: list[list[int]] = [self._new_image() for _ in range(ACTIVE_IMAGES)]
        # request objects are shared: one per (cpu, memory, image) would be too many; the
        # layer tuple is per image, so cache by key
        self._requests: dict[tuple[float, int, int], PlacementRequest] = {}

    def _new_image(self) -> list[int]:
        fanout = max(1, round(self.rng.lognormvariate(FANOUT_MU, FANOUT_SIGMA)))
        self.next_image += 1
        return [self.next_image, fanout]

    def image(self) -> int:
        slot = int(self.rng.random() * ACTIVE_IMAGES)
        entry = self.active[slot]
        entry[1] -= 1
        if entry[1] <= 0:
            self.active[slot] = self._new_image()
        return entry[0]

    def lifetime(self, residual: bool = False) -> float:
        if residual:  # steady-state remaining life: length-biased lognormal x uniform age
            return self.rng.lognormvariate(LIFE_MU + LIFE_SIGMA**2, LIFE_SIGMA) * self.rng.random()
        return self.rng.lognormvariate(LIFE_MU, LIFE_SIGMA)

    def sandbox(self) -> tuple[PlacementRequest, float, int]:
        """(request, actual cores used, actual bytes used)."""
        rng = self.rng
        cpu = CPU_TABLE[int(rng.random() * 20)]
        mem = MEM_TABLE[int(rng.random() * 20)]
        image = self.image()
        key = (cpu, mem, image)
        req = self._requests.get(key)
        if req is None:
            req = PlacementRequest(cpu=cpu, memory_bytes=mem, layers=(f"sha256:img{image}",))
            self._requests[key] = req
        frac = rng.random() * 0.05 if rng.random() < 0.9 else 0.05 + rng.random() * 0.95
        return req, cpu * frac, int(mem * (0.2 + 0.5 * rng.random()))


def run_policy(name: str, policy: Policy, k: int, cfg: Config, capacity: bool) -> dict[str, Any]:
    """One full simulation with one policy; returns its metrics. ``capacity``: afterwards,
    keep creating until the first rejection."""
    nodes = [
        Node(
            f"node{i:03d}",
            cfg.cores,
            cfg.memory_bytes,
            max_sandboxes=cfg.max_sandboxes,
            tiers=frozenset({"container", "microvm"}),
        )
        for i in range(cfg.nodes)
    ]
    overcommit = Overcommit(cpu=10.0, memory=1.5)
    placer = Placer(
        nodes, k=k, policy=policy, overcommit=overcommit, rng=random.Random(cfg.seed + 1)
    )
    work = Workload(cfg.seed)
    ids = [n.node_id for n in nodes]
    index_of = {nid: i for i, nid in enumerate(ids)}
    # the simulator's own truth per node (independent of the placer's bookkeeping)
    used_cpu = [0.0] * cfg.nodes
    used_mem = [0] * cfg.nodes
    count = [0] * cfg.nodes
    req_cpu = [0.0] * cfg.nodes
    req_mem = [0] * cfg.nodes
    cpu_cap = cfg.cores * overcommit.cpu
    mem_cap = cfg.memory_bytes * overcommit.memory
    departures: list[tuple[float, int, int, PlacementRequest, float, int]] = []
    seq = 0
    latencies: list[float] = []  # wall-clock seconds per decision
    cpu_latencies: list[int] = []  # this thread's CPU nanoseconds per decision
    placed = rejected = local_hits = 0
    concurrent = peak = 0
    cap_violations = 0
    max_frac = {"cpu_requested": 0.0, "memory_requested": 0.0, "sandboxes": 0.0}
    place, begin, commit = placer.place, placer.begin, placer.commit
    perf = time.perf_counter
    cpu = time.thread_time_ns

    def report() -> None:
        nonlocal cap_violations
        for i, nid in enumerate(ids):
            placer.observe(nid, NodeUsage(used_cpu[i], used_mem[i], count[i]))
            if req_cpu[i] > cpu_cap + 1e-6 or req_mem[i] > mem_cap or count[i] > cfg.max_sandboxes:
                cap_violations += 1
            max_frac["cpu_requested"] = max(max_frac["cpu_requested"], req_cpu[i] / cpu_cap)
            max_frac["memory_requested"] = max(max_frac["memory_requested"], req_mem[i] / mem_cap)
            max_frac["sandboxes"] = max(max_frac["sandboxes"], count[i] / cfg.max_sandboxes)

    def admit(i: int, req: PlacementRequest, cpu_used: float, mem_used: int, end: float) -> None:
        nonlocal seq, concurrent, peak
        used_cpu[i] += cpu_used
        used_mem[i] += mem_used
        count[i] += 1
        req_cpu[i] += req.cpu
        req_mem[i] += req.memory_bytes
        seq += 1
        heapq.heappush(departures, (end, seq, i, req, cpu_used, mem_used))
        concurrent += 1
        if concurrent > peak:
            peak = concurrent

    def one(now: float, residual: bool) -> None:
        """One arrival: decide, put in flight, commit (the edge admits)."""
        nonlocal placed, rejected, local_hits
        req, cpu_used, mem_used = work.sandbox()
        life = work.lifetime(residual)
        c0 = cpu()
        t0 = perf()
        try:
            decision = place(req)
        except QuotaExceeded:
            latencies.append(perf() - t0)
            cpu_latencies.append(cpu() - c0)
            rejected += 1
            return
        if req.layers[0] in placer.node(decision.node_id).layers:
            local_hits += 1  # the chosen node already held the image (a set lookup)
        commit(begin(decision.node_id, req))
        latencies.append(perf() - t0)
        cpu_latencies.append(cpu() - c0)
        i = index_of[decision.node_id]
        placed += 1
        admit(i, req, cpu_used, mem_used, now + life)

    def depart_until(now: float) -> None:
        nonlocal concurrent
        while departures and departures[0][0] <= now:
            _, _, i, req, cpu_used, mem_used = heapq.heappop(departures)
            placer.release(ids[i], req)
            used_cpu[i] -= cpu_used
            used_mem[i] -= mem_used
            count[i] -= 1
            req_cpu[i] -= req.cpu
            req_mem[i] -= req.memory_bytes
            concurrent -= 1

    def utilisation() -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float]:
            return {"mean": round(sum(xs) / len(xs), 4), "max": round(max(xs), 4)}

        return {
            "cpu_requested_of_cap": stats([x / cpu_cap for x in req_cpu]),
            "memory_requested_of_cap": stats([x / mem_cap for x in req_mem]),
            "cpu_used_of_physical": stats([x / cfg.cores for x in used_cpu]),
            "memory_used_of_physical": stats([x / cfg.memory_bytes for x in used_mem]),
            "sandboxes_of_cap": stats([x / cfg.max_sandboxes for x in count]),
            "regular_pool_utilisation": round(placer.regular_utilisation, 4),
        }

    wall0 = perf()
    gc.collect()
    gc.freeze()  # the simulator's objects are long-lived; keep collector pauses out of p99
    # 1. steady state at t=0: the prefill, with usage reports as if time had passed
    for n in range(cfg.prefill):
        one(0.0, residual=True)
        if n % 5000 == 4999:
            report()
    report()
    prefill_latencies = len(latencies)
    # 2. Poisson arrivals at the rate that keeps the level (Little), a burst, reports
    rate = cfg.prefill / LIFE_MEAN_S
    rng = random.Random(cfg.seed + 2)
    now = 0.0
    next_report = cfg.report_s
    burst_done = False
    burst: dict[str, Any] = {}
    util_at_peak: dict[str, Any] = {}
    while True:
        now += rng.expovariate(rate)
        if now > cfg.duration_s:
            break
        while next_report <= now:
            depart_until(next_report)
            report()
            next_report += cfg.report_s
        depart_until(now)
        if not burst_done and now >= cfg.burst_at_s:
            burst_done = True
            burst = run_burst(
                placer, work, cfg.burst, now, admit, index_of, latencies, cpu_latencies
            )
            placed += burst["placed"]
            rejected += burst["rejected"]
            report()
            util_at_peak = utilisation()
            util_at_peak["concurrent"] = concurrent
        one(now, residual=False)
    depart_until(cfg.duration_s)
    report()
    main_placed, main_rejected, main_peak = placed, rejected, peak
    # 3. capacity: keep creating (no departures) until the first rejection. Every policy falls
    # back to a full scan before rejecting, so this measures how much the caps let in.
    fill_start = concurrent
    while capacity:
        rejected_before = rejected
        one(cfg.duration_s, residual=False)
        if rejected > rejected_before:
            break
        if (placed - main_placed) % 5000 == 0:
            report()
    report()
    fill = {
        "concurrent_at_first_rejection": concurrent if capacity else None,
        "added": concurrent - fill_start,
        "utilisation": utilisation(),
    }
    gc.unfreeze()
    wall = perf() - wall0
    decisions = len(latencies)
    sched = sum(latencies)
    sched_cpu = sum(cpu_latencies) / 1e9
    return {
        "name": name,
        "policy": policy,
        "k": k,
        "placements": main_placed,
        "rejections": main_rejected,
        "rejection_rate": round(main_rejected / max(1, main_placed + main_rejected), 5),
        "decisions_timed": decisions,
        # one core's worth: CPU time of this thread per decision (excludes preemption)
        "placements_per_cpu_s": round(decisions / sched_cpu) if sched_cpu else None,
        "decision_cpu_ms": {
            "p50": round(pct(cpu_latencies, 50) / 1e6, 4),
            "p99": round(pct(cpu_latencies, 99) / 1e6, 4),
            "max": round(max(cpu_latencies) / 1e6, 3),
        },
        # wall clock: includes time this process was preempted by others on a shared host
        "placements_per_s": round(decisions / sched) if sched else None,
        "decision_ms": {
            "p50": round(pct(latencies, 50) * 1e3, 4),
            "p99": round(pct(latencies, 99) * 1e3, 4),
            "max": round(max(latencies) * 1e3, 3),
        },
        "prefill_decisions": prefill_latencies,
        "peak_concurrent": main_peak,
        "concurrent_at_end": concurrent,
        "utilisation_after_burst": util_at_peak,
        "max_node_fraction_of_cap": {k_: round(v, 4) for k_, v in max_frac.items()},
        "cap_violations": cap_violations,
        "locality_hit_rate": round(local_hits / max(1, placed), 4),
        "burst": burst,
        "fill_to_first_rejection": fill,
        "sim_wall_s": round(wall, 2),
    }


def run_burst(
    placer: Placer,
    work: Workload,
    n: int,
    now: float,
    admit: Any,
    index_of: dict[str, int],
    latencies: list[float],
    cpu_latencies: list[int],
) -> dict[str, Any]:
    """``n`` creations at once: every decision is made while the earlier ones are still in
    flight (no usage report in between), then all are committed. Scheduler time is the wall
    clock of the decide + begin loop plus the commits."""
    items = [(work.sandbox(), work.lifetime()) for _ in range(n)]
    reservations: list[Reservation | None] = []
    rejected = 0
    perf = time.perf_counter
    cpu = time.thread_time_ns
    cpu_start = time.thread_time()
    t_start = perf()
    for (req, _cpu, _mem), _life in items:
        c0 = cpu()
        t0 = perf()
        try:
            decision = placer.place(req)
            reservations.append(placer.begin(decision.node_id, req))
        except QuotaExceeded:
            reservations.append(None)
            rejected += 1
        latencies.append(perf() - t0)
        cpu_latencies.append(cpu() - c0)
    t_decided = perf()
    for r in reservations:
        if r is not None:
            placer.commit(r)
    t_end = perf()
    cpu_s = time.thread_time() - cpu_start
    per_node: dict[str, int] = {}
    for r, ((req, cpu_used, mem_used), life) in zip(reservations, items, strict=True):
        if r is not None:
            admit(index_of[r.node_id], req, cpu_used, mem_used, now + life)
            per_node[r.node_id] = per_node.get(r.node_id, 0) + 1
    spread = sorted(per_node.values())
    return {
        "size": n,
        "placed": n - rejected,
        "rejected": rejected,
        "scheduler_s": round(t_end - t_start, 3),
        "decide_s": round(t_decided - t_start, 3),
        "scheduler_cpu_s": round(cpu_s, 3),
        "placements_per_cpu_s": round(n / cpu_s) if cpu_s > 0 else None,
        "nodes_used": len(per_node),
        "per_node_min": spread[0] if spread else 0,
        "per_node_max": spread[-1] if spread else 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: 16 nodes, 1/10 the load")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=160)
    ap.add_argument("--prefill", type=int, default=355_000, help="sandboxes at t=0")
    ap.add_argument("--burst", type=int, default=32_000)
    ap.add_argument("--burst-at", type=float, default=60.0, help="simulated seconds")
    ap.add_argument("--duration", type=float, default=120.0, help="simulated seconds")
    ap.add_argument("--report-s", type=float, default=10.0, help="usage report interval, s")
    ap.add_argument("--k", type=int, default=4, help="k of the power-of-k policy")
    ap.add_argument("--out", type=Path, default=None, help="default results/placement_sim.json")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.prefill, args.burst = 16, 35_500, 3_200
    if args.out is None:
        args.out = RESULTS / ("placement_sim_quick.json" if args.quick else "placement_sim.json")
    cfg = Config(
        nodes=args.nodes,
        cores=192,
        memory_bytes=1_500_000_000_000,
        max_sandboxes=4000,
        prefill=args.prefill,
        burst=args.burst,
        burst_at_s=args.burst_at,
        duration_s=args.duration,
        report_s=args.report_s,
        seed=args.seed,
    )
    policies: list[tuple[str, Policy, int]] = [
        ("random", "random", 2),
        ("least-loaded", "least_loaded", 2),
        ("power-of-2", "power_of_k", 2),
        (f"power-of-{args.k}", "power_of_k", args.k),
    ]
    load_start = os.getloadavg()
    rows = []
    for n, (name, policy, k) in enumerate(policies):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        # capacity (fill to the first rejection) once, with the last policy: every policy
        # scans all nodes before rejecting, so they all reach the same count (+- one request)
        rows.append(run_policy(name, policy, k, cfg, capacity=n == len(policies) - 1))
        gc.collect()
    hdr = (
        f"{'policy':<13}{'cpu pl/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'wall pl/s':>10}{'p99 ms':>8}{'peak':>9}{'reject%':>9}"
        f"{'cpuUse max':>11}{'memReq max':>11}{'local%':>8}{'burst s':>9}"
        f"{'burst/cpu-s':>12}{'caps ok':>8}"
    )
    print(hdr)
    for r in rows:
        u = r["utilisation_after_burst"]
        print(
            f"{r['name']:<13}{r['placements_per_cpu_s']:>9}{r['decision_cpu_ms']['p50']:>8.3f}"
            f"{r['decision_cpu_ms']['p99']:>8.3f}{r['placements_per_s']:>10}"
            f"{r['decision_ms']['p99']:>8.3f}{r['peak_concurrent']:>9}"
            f"{100 * r['rejection_rate']:>9.3f}"
            f"{u.get('cpu_used_of_physical', {}).get('max', float('nan')):>11.3f}"
            f"{u.get('memory_requested_of_cap', {}).get('max', float('nan')):>11.3f}"
            f"{100 * r['locality_hit_rate']:>8.1f}{r['burst'].get('scheduler_s', float('nan')):>9.3f}"
            f"{r['burst'].get('placements_per_cpu_s') or 0:>12}"
            f"{'yes' if r['cap_violations'] == 0 else 'NO':>8}"
        )
    capacity = rows[-1]["fill_to_first_rejection"]["concurrent_at_first_rejection"]
    print(f"capacity ({rows[-1]['name']}, fill to the first rejection): {capacity} sandboxes")
    targets = {
        "placements_per_s": 20_000,
        "p99_decision_ms": 1.0,
        "peak_concurrent": 380_000 if not args.quick else 38_000,
        "burst_scheduler_s": 5.0,
    }
    out = {
        "benchmark": "placement_sim",
        "quick": args.quick,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": load_start,
            "loadavg_at_end": os.getloadavg(),
            "note": "wall-clock latencies include preemption by other processes on this host",
        },
        "config": cfg.__dict__,
        "workload": {
            "lifetime_lognormal": {
                "mu": round(LIFE_MU, 4),
                "sigma": round(LIFE_SIGMA, 4),
                "median_s": LIFETIME_MEDIAN_S,
                "p99_s": LIFETIME_P99_S,
                "mean_s": round(LIFE_MEAN_S, 1),
            },
            "fanout_lognormal": {"mu": round(FANOUT_MU, 4), "sigma": round(FANOUT_SIGMA, 4)},
            "cpu_choices": CPU_CHOICES,
            "memory_choices": MEM_CHOICES,
            "arrival_rate_per_s": round(cfg.prefill / LIFE_MEAN_S, 2),
        },
        "targets": targets,
        "capacity_at_first_rejection": capacity,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
