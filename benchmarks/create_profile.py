"""Where a container create's time goes (issue 23: "a profile of where the remaining create
time goes").

Part 1, through the SDK against a ``dsec serve`` child: ``--n`` sequential create -> first
exec -> kill, split into layers by what each one records: the client's wall time of the
create call, the server's time for ``POST /v1/sandboxes`` (its access log), the container
runtime's own part (``state.json`` ``create_ms``: a warm-pool claim, or rootfs + ``crun run``
+ exec server attach on a miss), and the first exec. The differences are the SDK + HTTP
(client - server) and the apiserver + edge (server - runtime).

Part 1b, through the SDK against a ``dsec serve`` with networking on (``DSEC_NETWORK=on``,
``--subnet``): ``--n`` creates with a network policy and ``--n`` without, alternating, each
killed before the next; "networking added" is the difference of the client-side p50s.

Part 2, in process: ``cProfile`` over ``--n`` ``EdgeAgent.create_sandbox`` + ``kill_sandbox``
calls (no HTTP), the top functions by cumulative and own time.

Usage: python benchmarks/create_profile.py [--n 40]
Writes benchmarks/results/create_profile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import re
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


_ACCESS = re.compile(r"method=POST route=/v1/sandboxes status=201 ms=([0-9.]+)")


async def through_sdk(home: Path, srv: ServeProcess, n: int) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    async with AsyncClient(srv.url, srv.api_key) as client:
        kw: dict[str, Any] = {"tier": "container", "image": "busybox", "client": client}
        for _ in range(3):  # image resolution, warm pool demand
            await (await AsyncSandbox.create(**kw)).kill()
        await asyncio.sleep(1.0)
        log = home / "serve.log"
        for _ in range(n):
            mark = log.stat().st_size
            t0 = time.perf_counter()
            sb = await AsyncSandbox.create(**kw)
            t1 = time.perf_counter()
            await sb.commands.run("true")
            t2 = time.perf_counter()
            st = sandbox_state(home, sb.id)
            await sb.kill()
            with open(log) as f:
                f.seek(mark)
                m = _ACCESS.findall(f.read())
            cm = st.get("create_ms") or {}
            rows.append(
                {
                    "client_create_ms": (t1 - t0) * 1000,
                    "server_create_ms": float(m[0]) if m else float("nan"),
                    "runtime_ms": float(cm.get("total", float("nan"))),
                    "claimed": 1.0 if "claim" in cm else 0.0,
                    "first_exec_ms": (t2 - t1) * 1000,
                }
            )
            await asyncio.sleep(0.05)
    return {"rows": rows}


async def networked(srv: ServeProcess, n: int) -> dict[str, Any]:
    plain: list[float] = []
    with_net: list[float] = []
    policy = {"allow_domains": ["example.test"]}
    async with AsyncClient(srv.url, srv.api_key) as client:
        kw: dict[str, Any] = {"tier": "container", "image": "busybox", "client": client}
        for _ in range(3):
            await (await AsyncSandbox.create(**kw)).kill()
            await (await AsyncSandbox.create(**kw, network=policy)).kill()
        await asyncio.sleep(1.0)
        for _ in range(n):
            for out, extra in ((plain, {}), (with_net, {"network": policy})):
                t0 = time.perf_counter()
                sb = await AsyncSandbox.create(**kw, **extra)
                out.append((time.perf_counter() - t0) * 1000)
                await sb.kill()
                await asyncio.sleep(0.05)
    return {"plain_ms": plain, "network_ms": with_net}


async def in_process(home: Path, n: int) -> str:
    import os

    from dsec.models import CreateSandboxRequest
    from dsec.node import embedded_edge

    os.environ["DSEC_NETWORK"] = "off"  # as the SDK part's server (ServeProcess's default)

    async with embedded_edge(home, tiers=["container"]) as edge:
        req = CreateSandboxRequest(tier="container", image="busybox")
        for _ in range(3):
            info = await edge.create_sandbox(req, "bench")
            await edge.kill_sandbox(info.id, "bench")
        await asyncio.sleep(1.0)
        prof = cProfile.Profile()
        for _ in range(n):
            prof.enable()
            info = await edge.create_sandbox(req, "bench")
            prof.disable()
            await edge.kill_sandbox(info.id, "bench")
            await asyncio.sleep(0.05)  # the pool refills between creates, outside the profile
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs().sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(15)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--out", default=str(RESULTS / "create_profile.json"))
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    ap.add_argument(
        "--subnet", default="10.231.0.0/16", help="sandbox subnet of the networked part"
    )
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-prof-"))
    res: dict[str, Any] = {"n": args.n, "host_probe_s": [host_probe_s()]}
    try:
        with ServeProcess(home / "sdk", env=dict(e.split("=", 1) for e in args.env)) as srv:
            res["sdk"] = asyncio.run(through_sdk(home / "sdk", srv, args.n))
        res["host_probe_s"].append(host_probe_s())
        net_env = {"DSEC_NETWORK": "on", "DSEC_NET_SUBNET": args.subnet}
        with ServeProcess(home / "net", env=net_env) as srv:
            res["network"] = asyncio.run(networked(srv, args.n))
        (home / "inproc").mkdir()
        if (home / "sdk" / "layers").is_symlink():
            (home / "inproc" / "layers").symlink_to((home / "sdk" / "layers").resolve())
        res["cprofile"] = asyncio.run(in_process(home / "inproc", args.n))
        res["host_probe_s"].append(host_probe_s())
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rows = res["sdk"]["rows"]

    def med(key: str, sel: list[dict[str, float]] = rows) -> float:
        return statistics.median(r[key] for r in sel) if sel else float("nan")

    claimed = [r for r in rows if r["claimed"]]
    summary = {
        "claimed_share": len(claimed) / len(rows),
        "client_create_p50_ms": med("client_create_ms"),
        "server_create_p50_ms": med("server_create_ms"),
        "runtime_p50_ms": med("runtime_ms"),
        "runtime_claim_p50_ms": med("runtime_ms", claimed),
        "first_exec_p50_ms": med("first_exec_ms"),
        "sdk_http_p50_ms": statistics.median(
            r["client_create_ms"] - r["server_create_ms"] for r in rows
        ),
        "apiserver_edge_p50_ms": statistics.median(
            r["server_create_ms"] - r["runtime_ms"] for r in rows
        ),
    }
    net = res["network"]
    summary["net_plain_create_p50_ms"] = statistics.median(net["plain_ms"])
    summary["net_create_p50_ms"] = statistics.median(net["network_ms"])
    summary["networking_added_p50_ms"] = (
        summary["net_create_p50_ms"] - summary["net_plain_create_p50_ms"]
    )
    res["summary"] = summary
    print(res["cprofile"])
    print("create -> first exec, medians over", len(rows), "creates through the SDK:")
    print(f"  warm-pool claims: {summary['claimed_share'] * 100:.0f}% of creates")
    for key, label in (
        ("client_create_p50_ms", "create, client wall time"),
        ("sdk_http_p50_ms", "  SDK + HTTP (client - server)"),
        ("apiserver_edge_p50_ms", "  apiserver + edge (server - runtime)"),
        ("runtime_p50_ms", "  container runtime"),
        ("runtime_claim_p50_ms", "    of which a claim"),
        ("first_exec_p50_ms", "first exec (`true`)"),
        ("net_plain_create_p50_ms", "create, networking on, no policy"),
        ("net_create_p50_ms", "create with a network policy"),
        ("networking_added_p50_ms", "  networking added"),
    ):
        print(f"  {label:<40} {summary[key]:7.2f} ms")
    print(f"host probe {', '.join(f'{p * 1000:.1f}' for p in res['host_probe_s'])} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
