#!/usr/bin/env python3
"""What one access-log line costs: the apiserver app driven through ASGI directly (no
sockets, no client), A/B/C in one run: ``DSEC_ACCESS_LOG=off``, ``text`` (through the
server's log format, as ``dsec serve`` sets it up) and ``json``; lines go to /dev/null.

Two routes: ``GET /healthz`` (the cheapest answer, so the log's share is largest) and
``GET /v1/sandboxes/{sandbox_id}`` (auth + a FakeEdge lookup + a pydantic answer).
Reports CPU microseconds per request (process time, median of ``--rounds`` rounds).

Usage: .venv/bin/python benchmarks/access_log.py [--requests N] [--rounds R]
Writes benchmarks/results/access_log.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.apiserver.middleware import configure_access_log
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge, http_scope

KEY = "dsec_bench_access_log"
RESULTS = Path(__file__).resolve().parent / "results" / "access_log.json"


async def _drive(app: Any, path: str, n: int) -> float:
    """CPU seconds for ``n`` GET requests of ``path`` through the ASGI app."""
    scope_base = http_scope("GET", path, [(b"authorization", f"Bearer {KEY}".encode())])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    t0 = time.process_time()
    for _ in range(n):
        await app(dict(scope_base), receive, send)
    spent = time.process_time() - t0
    assert set(statuses) == {200}, set(statuses)
    return spent


async def main(requests: int, rounds: int) -> dict[str, Any]:
    devnull = open("/dev/null", "w")  # lives for the run
    root = logging.getLogger()
    root.handlers[:] = [logging.StreamHandler(devnull)]
    root.handlers[0].setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.setLevel(logging.INFO)
    edge = FakeEdge()
    from dsec.apiserver.auth import owner_id

    info = await edge.create_sandbox(CreateSandboxRequest(), owner_id(KEY))
    routes = {"/healthz": "/healthz", "/v1/sandboxes/{sandbox_id}": f"/v1/sandboxes/{info.id}"}
    out: dict[str, Any] = {"requests_per_round": requests, "rounds": rounds, "us_per_request": {}}
    apps = {}
    for mode in ("off", "text", "json"):
        apps[mode] = create_app(edge, StaticKeys([KEY]), access_log=mode)
    for label, path in routes.items():
        per_mode: dict[str, list[float]] = {m: [] for m in apps}
        for _ in range(rounds):  # interleaved, so drift hits every mode alike
            for mode, app in apps.items():
                configure_access_log(mode, stream=devnull)  # type: ignore[arg-type]
                await _drive(app, path, requests // 10)  # warm-up
                per_mode[mode].append(await _drive(app, path, requests) / requests * 1e6)
        out["us_per_request"][label] = {m: statistics.median(v) for m, v in per_mode.items()}
    # the line alone: build it and log it (the only work the access log adds per request)
    from dsec.apiserver.middleware import ApiMiddleware, access_log

    alone: dict[str, float] = {"off": 0.0}
    for mode in ("text", "json"):
        configure_access_log(mode, stream=devnull)  # type: ignore[arg-type]
        mw = next(m for m in _middlewares(apps[mode]))
        samples = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(requests):
                access_log.info(
                    mw._access_line("GET", "/healthz", 200, 0.000123, "k0123456789abcdef", "ab" * 8)
                )
            samples.append((time.process_time() - t0) / requests * 1e6)
        alone[mode] = statistics.median(samples)
    out["us_per_request"]["the log line alone"] = alone
    assert isinstance(mw, ApiMiddleware)
    configure_access_log("text")
    return out


def _middlewares(app: Any) -> Any:
    """The app's ApiMiddleware instance (built on its first request)."""
    from dsec.apiserver.middleware import ApiMiddleware

    node = app.middleware_stack
    while node is not None:
        if isinstance(node, ApiMiddleware):
            yield node
        node = getattr(node, "app", None)


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"{'route':32} {'off us':>8} {'text us':>8} {'json us':>8} {'text +us':>9} {'json +us':>9}"
    ]
    for route, m in res["us_per_request"].items():
        lines.append(
            f"{route:32} {m['off']:8.1f} {m['text']:8.1f} {m['json']:8.1f} "
            f"{m['text'] - m['off']:9.1f} {m['json'] - m['off']:9.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    res = asyncio.run(main(args.requests, args.rounds))
    print(_table(res))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {RESULTS}")
