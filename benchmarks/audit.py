"""Audit of refusals (issue 36), its cost: prints a table, writes benchmarks/results/audit.json.

Three ``dsec serve`` child processes run side by side, the same but for ``DSEC_AUDIT``: one
records refusals (the exec server installs each command's seccomp filter with
``SECCOMP_FILTER_FLAG_LOG`` and a per-sandbox loginuid, the edge listens on the audit
netlink log group), the two others do not (``off``, and ``control``: the A/A comparison
that shows how far two identical servers differ here). Driven through the public async SDK,
rotating among the three call by call so that the noise of this shared machine falls on all
alike:

  * exec round trip: ``sb.commands.run("true")`` on a live busybox sandbox, p50/p90
  * create -> first exec: ``AsyncSandbox.create(image="busybox")`` then ``run("true")``,
    client wall time, p50/p90 (the sandbox is killed after)
  * refusals: one command making ``REFUSED`` refused ``mount`` calls (busybox ``mount`` in a
    shell loop: a fork and exec each), its wall time, and what the audit counted

The verdict compares the p50s: auditing on is within 5% of the two servers without it,
their samples pooled (``on/both``); ``ctl/off`` is how far two identical servers differ.

``--tier fncall``: the same on the fncall tier (``debian`` sandboxes: a worker claimed from
the warm pool, whose filter carries the log flag and whose agent set a loginuid of its own
when it was made, and whose Landlock domain logs too); results in ``audit_fncall.json``.

Usage: .venv/bin/python benchmarks/audit.py [--rounds N] [--quick] [--tier fncall]   (root)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"
SMALL = {"cpu": 0.1, "memory_mb": 64, "disk_mb": 32}
TIERS: dict[str, dict[str, Any]] = {
    "container": {"image": "busybox", **SMALL},
    "fncall": {"tier": "fncall", "image": "debian", "cpu": 0.1, "memory_mb": 256, "disk_mb": 32},
}
"""The sandbox each tier's run creates (``--tier``)."""
SANDBOX: dict[str, Any] = dict(TIERS["container"])
REFUSED = 200
MODES = ("on", "off", "control")
"""``control``: a second server without auditing, to show how far two identical servers
differ on this machine (an A/A comparison beside the A/B one)."""


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(p / 100 * len(s)))], 3) if s else float("nan")


async def exec_block(sb: AsyncSandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        res = await sb.commands.run("true")
        out.append((time.perf_counter() - t) * 1000)
        assert res.exit_code == 0, res
    return out


async def create_block(url: str, key: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb = await AsyncSandbox.create(url=url, api_key=key, **SANDBOX)
        try:
            res = await sb.commands.run("true")
            out.append((time.perf_counter() - t) * 1000)
            assert res.exit_code == 0, res
        finally:
            await sb.kill()
    return out


async def refusals(url: str, key: str) -> dict[str, Any]:
    loop = (
        f"i=0; while [ $i -lt {REFUSED} ]; do mount -t tmpfs none /mnt 2>/dev/null; "
        "i=$((i+1)); done"
    )
    async with await AsyncSandbox.create(url=url, api_key=key, **SANDBOX) as sb:
        t = time.perf_counter()
        await sb.commands.run(loop, timeout=300)
        wall = (time.perf_counter() - t) * 1000
        await asyncio.sleep(0.5)  # the kernel's records arrive within milliseconds
        rep = await sb.audit()
        return {
            "wall_ms": round(wall, 1),
            "per_refusal_ms": round(wall / REFUSED, 3),
            "counted": rep.counts.get("syscall.mount", 0),
            "entries_kept": len(rep.entries),
            "dropped": rep.dropped,
            "enabled": rep.enabled,
        }


async def run(servers: dict[str, ServeProcess], rounds: int, per_block: int) -> dict[str, Any]:
    execs: dict[str, list[float]] = {m: [] for m in MODES}
    creates: dict[str, list[float]] = {m: [] for m in MODES}
    live = {
        m: await AsyncSandbox.create(url=s.url, api_key=s.api_key, **SANDBOX)
        for m, s in servers.items()
    }
    probes = []
    try:
        for m in MODES:  # warm both: images built, pools filled, first requests paid
            await exec_block(live[m], 20)
            await create_block(servers[m].url, servers[m].api_key, 3)
        for r in range(rounds):
            probes.append(host_probe_s())
            # call by call, A B then B A: the noise of a shared machine falls on both alike
            for i in range(per_block):
                order = MODES[(r + i) % 3 :] + MODES[: (r + i) % 3]
                for m in order:
                    execs[m] += await exec_block(live[m], 1)
            for i in range(max(2, per_block // 10)):
                order = MODES[(r + i) % 3 :] + MODES[: (r + i) % 3]
                for m in order:
                    creates[m] += await create_block(servers[m].url, servers[m].api_key, 1)
    finally:
        for sb in live.values():
            await sb.kill()
    out: dict[str, Any] = {"rounds": rounds, "host_probe_ms": round(1000 * min(probes), 1)}
    for name, data in (("exec_ms", execs), ("create_to_first_exec_ms", creates)):
        row: dict[str, Any] = {}
        for m in MODES:
            row[m] = {"n": len(data[m]), "p50": pct(data[m], 50), "p90": pct(data[m], 90)}
        row["p50_on_vs_off_pct"] = round(100 * (row["on"]["p50"] / row["off"]["p50"] - 1), 2)
        row["p50_control_vs_off_pct"] = round(
            100 * (row["control"]["p50"] / row["off"]["p50"] - 1), 2
        )
        both_off = data["off"] + data["control"]  # the two servers without auditing, pooled
        row["p50_off_pooled"] = pct(both_off, 50)
        row["p50_on_vs_pooled_off_pct"] = round(100 * (row["on"]["p50"] / pct(both_off, 50) - 1), 2)
        row["within_5pct"] = abs(row["p50_on_vs_pooled_off_pct"]) <= 5.0
        out[name] = row
    out["refusals"] = {
        m: await refusals(s.url, s.api_key) for m, s in servers.items() if m != "control"
    }
    out["mean_exec_ms"] = {m: round(statistics.fmean(execs[m]), 3) for m in MODES}
    return out


def print_table(res: dict[str, Any]) -> None:
    print(
        f"{'what':<30}{'on':>9}{'off':>9}{'control':>9}{'on/off':>9}{'ctl/off':>9}"
        f"{'on/both':>9}  verdict"
    )
    rows = (
        ("exec_ms", "exec round trip p50 ms"),
        ("create_to_first_exec_ms", "create -> 1st exec p50 ms"),
    )
    for key, label in rows:
        row = res[key]
        verdict = "ok (<= 5%)" if row["within_5pct"] else "OVER 5%"
        print(
            f"{label:<30}{row['on']['p50']:>9}{row['off']['p50']:>9}{row['control']['p50']:>9}"
            f"{row['p50_on_vs_off_pct']:>+8.2f}%{row['p50_control_vs_off_pct']:>+8.2f}%"
            f"{row['p50_on_vs_pooled_off_pct']:>+8.2f}%  {verdict}"
        )
        print(f"{'  p90':<30}{row['on']['p90']:>9}{row['off']['p90']:>9}{row['control']['p90']:>9}")
    ref = res["refusals"]
    print(
        f"{f'{REFUSED} refused mounts, wall ms':<30}{ref['on']['wall_ms']:>9}{ref['off']['wall_ms']:>9}"
    )
    print(f"{'  counted by the audit':<30}{ref['on']['counted']:>9}{ref['off']['counted']:>9}")
    print(
        f"(rounds {res['rounds']}, host probe {res['host_probe_ms']} ms; total {res['total_s']} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10)")
    ap.add_argument("--per-block", type=int, default=50, help="execs per block (default 50)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 20")
    ap.add_argument("--tier", choices=sorted(TIERS), default="container", help="the tier measured")
    args = ap.parse_args()
    SANDBOX.clear()
    SANDBOX.update(TIERS[args.tier])
    tiers = {"DSEC_TIERS": args.tier}
    if os.geteuid() != 0:
        sys.exit("needs root (dsec serve runs containers)")
    rounds, per_block = (3, 20) if args.quick else (args.rounds, args.per_block)
    base = Path(tempfile.mkdtemp(prefix="dsec-bench-audit-"))
    t0 = time.perf_counter()
    try:
        with (
            ServeProcess(base / "on", env={"DSEC_AUDIT": "on", **tiers}) as on,
            ServeProcess(base / "off", env={"DSEC_AUDIT": "off", **tiers}) as off,
            ServeProcess(base / "control", env={"DSEC_AUDIT": "off", **tiers}) as control,
        ):
            servers = {"on": on, "off": off, "control": control}
            results = asyncio.run(run(servers, rounds, per_block))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    results["quick"] = args.quick
    results["tier"] = args.tier
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if args.tier == "container" else f"_{args.tier}"
    name = f"audit{suffix}_quick.json" if args.quick else f"audit{suffix}.json"
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"(wrote {RESULTS / name})")


if __name__ == "__main__":
    main()
