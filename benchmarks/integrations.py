"""Harness-integration benchmark: prints a table and writes benchmarks/results/integrations.json.

Measured in one run against one ``dsec serve`` child process (debian image, container tier),
with the plain SDK exec as the peer every other number is compared with:
  * SDK ``commands.run("true")`` round trip (the floor: one exec)
  * SWE-ReX ``DsecRuntime``: ``create_session``; ``run_in_session`` of ``true`` on a
    pseudo-terminal session and on a pipe session (one exec each, plus the helper's work);
    ``execute(Command)``
  * mini-swe-agent ``DsecEnvironment.execute`` (``bash -lc``, like its docker environment)
  * ``dsec-docker exec`` (one Python process per call, what tools shelling out to docker pay)

Usage: .venv/bin/python benchmarks/integrations.py [--n 30] [--home DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from dsec import AsyncSandbox
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def timed(n: int, fn: Callable[[], Awaitable[Any]]) -> list[float]:
    await fn()  # warm-up
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def measure(url: str, key: str, n: int, docker_exe: Path) -> dict[str, list[float]]:
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

    from dsec.integrations.minisweagent import DsecEnvironment
    from dsec.integrations.swerex import DsecRuntime

    res: dict[str, list[float]] = {}
    async with await AsyncSandbox.create(image="debian", url=url, api_key=key) as sb:
        res["sdk exec true"] = await timed(n, lambda: sb.commands.run("true"))
        pty = DsecRuntime(sb, session_terminal="on")
        pipe = DsecRuntime(sb, session_terminal="off")
        names = iter(range(10**6))
        res["swerex create_session"] = await timed(
            min(n, 10),
            lambda: pty.create_session(CreateBashSessionRequest(session=f"s{next(names)}")),
        )
        await pty.create_session(CreateBashSessionRequest(session="bench"))
        await pipe.create_session(CreateBashSessionRequest(session="bench"))
        act = BashAction(command="true", session="bench", timeout=30, check="raise")
        res["swerex run_in_session (pty)"] = await timed(n, lambda: pty.run_in_session(act))
        res["swerex run_in_session (pipe)"] = await timed(n, lambda: pipe.run_in_session(act))
        res["swerex execute"] = await timed(n, lambda: pty.execute(Command(command=["true"])))
        await pty.close()
        await pipe.close()
        os.environ["DSEC_API_KEY"] = key  # mini's configs carry no key: the SDK reads it here
        env = await asyncio.to_thread(DsecEnvironment, image="debian", url=url)
        try:
            res["mini DsecEnvironment.execute"] = await timed(
                n, lambda: asyncio.to_thread(env.execute, {"command": "true"})
            )
        finally:
            env.cleanup()
        child = {**os.environ, "DSEC_URL": url, "DSEC_API_KEY": key}
        res["dsec-docker exec (process)"] = await timed(
            max(5, n // 3),
            lambda: asyncio.to_thread(
                subprocess.run, [str(docker_exe), "exec", sb.id, "true"], env=child, check=True
            ),
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--home", type=Path, default=None)
    args = ap.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="dsec-bench-intg-"))
    src = Path(__file__).resolve().parents[1] / "src"
    exe = home / "dsec-docker"
    home.mkdir(parents=True, exist_ok=True)
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{src}" exec {sys.executable} -m dsec.cli.docker "$@"\n')
    exe.chmod(0o755)
    with ServeProcess(home / "home") as srv:
        res = asyncio.run(measure(srv.url, srv.api_key, args.n, exe))
    floor = pct(res["sdk exec true"], 50)
    rows = []
    print(f"{'what':34} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'x sdk exec':>10}")
    for name, xs in res.items():
        p50, p99 = pct(xs, 50), pct(xs, 99)
        rows.append(
            {
                "what": name,
                "n": len(xs),
                "p50_ms": round(p50, 2),
                "p99_ms": round(p99, 2),
                "vs_sdk_exec": round(p50 / floor, 2),
            }
        )
        print(f"{name:34} {len(xs):>4} {p50:>8.1f} {p99:>8.1f} {p50 / floor:>10.1f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "integrations.json"
    out.write_text(json.dumps({"rows": rows, "n": args.n, "when": time.time()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
