"""Creates beside busy sandboxes (issue 23): how long a fresh create takes while N other
sandboxes run CPU-bound commands, with the idle-aware CPU weights on (the default) and off.

N sandboxes each run a foreground busy loop (their commands hold their full CPU weight); then
``--m`` sequential creates (warm pool off, so each is a ``crun run`` and an exec-server
attach) are timed through the SDK, each killed before the next. Reported: create p50 / max and
the exec server's attach p50 / max (the runtime's ``create_ms``), per setting, in one run.

Usage: python benchmarks/create_under_load.py [--n 40] [--m 15]
Writes benchmarks/results/create_under_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from create_profile import sandbox_state
from dsec import AsyncSandbox
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"


def attach_ms(home: Path, sandbox_id: str) -> float | None:
    """The exec server's part of the create, from the runtime's state file."""
    ms = (sandbox_state(home, sandbox_id).get("create_ms") or {}).get("exec_server")
    return None if ms is None else float(ms)


async def phase(srv: ServeProcess, n: int, m: int, busy_s: float) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "tier": "container",
        "image": "busybox",
        "cpu": 0.4,  # n x 0.4 cores stays under the node's CPU overcommit cap
        "memory_mb": 64,
        "url": srv.url,
        "api_key": srv.api_key,
    }
    busy: list[AsyncSandbox] = []
    tasks: list[asyncio.Task[Any]] = []
    try:
        for _ in range(n):
            busy.append(await AsyncSandbox.create(**kw))
        loop = f"timeout {busy_s:g} sh -c 'while :; do :; done'"
        tasks = [asyncio.create_task(sb.commands.run(loop, timeout=busy_s + 30)) for sb in busy]
        await asyncio.sleep(2)
        return await timed_creates(srv, kw, m, busy_s)
    finally:  # the server keeps sandboxes across its own exit: kill what this made
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(sb.kill() for sb in busy), return_exceptions=True)


async def timed_creates(
    srv: ServeProcess, kw: dict[str, Any], m: int, busy_s: float
) -> dict[str, Any]:
    lat: list[float] = []
    att: list[float] = []
    errors: list[str] = []
    t_end = time.monotonic() + busy_s - 4
    for _ in range(m):
        if time.monotonic() > t_end:
            errors.append("the busy loops ended before this create")
            break
        t = time.perf_counter()
        try:
            sb = await AsyncSandbox.create(**kw)
        except Exception as e:  # counted, shown
            errors.append(repr(e))
            continue
        lat.append((time.perf_counter() - t) * 1000)
        a = attach_ms(srv.home, sb.id)
        if a is not None:
            att.append(a)
        await sb.kill()
    return {
        "creates": len(lat),
        "create_p50_ms": statistics.median(lat) if lat else None,
        "create_max_ms": max(lat) if lat else None,
        "attach_p50_ms": statistics.median(att) if att else None,
        "attach_max_ms": max(att) if att else None,
        "errors": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=40, help="busy sandboxes")
    ap.add_argument("--m", type=int, default=15, help="timed creates per setting")
    ap.add_argument("--busy-s", type=float, default=90.0, help="length of the busy loops")
    ap.add_argument("--out", default=str(RESULTS / "create_under_load.json"))
    args = ap.parse_args()
    res: dict[str, Any] = {"n": args.n, "m": args.m, "host_probe_s": [host_probe_s()]}
    for name, shares in (("idle_weights_on", "2"), ("idle_weights_off", "0")):
        home = Path(tempfile.mkdtemp(prefix="dsec-bench-cul-"))
        env = {"DSEC_CONTAINER_POOL": "0", "DSEC_IDLE_CPU_SHARES": shares}
        with ServeProcess(home, env=env) as srv:
            res[name] = asyncio.run(phase(srv, args.n, args.m, args.busy_s))
        res["host_probe_s"].append(host_probe_s())
    print(f"fresh creates beside {args.n} sandboxes running busy loops (pool off)")
    print(f"{'setting':<18} {'creates':>7} {'p50':>9} {'max':>9} {'attach p50':>11} {'max':>8}")
    for name in ("idle_weights_on", "idle_weights_off"):
        r = res[name]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f}ms"

        print(
            f"{name:<18} {r['creates']:>7} {ms(r['create_p50_ms']):>9} {ms(r['create_max_ms']):>9}"
            f" {ms(r['attach_p50_ms']):>11} {ms(r['attach_max_ms']):>8}"
            + (f"  errors: {len(r['errors'])} ({r['errors'][0]})" if r["errors"] else "")
        )
    print("host probe (s): " + " / ".join(f"{p:.4f}" for p in res["host_probe_s"]))
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
