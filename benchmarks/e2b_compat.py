"""E2B compatibility benchmark (issue 9): create + ``commands.run("echo hi")`` + kill.

The same server is driven two ways in one run, interleaved A/B so drift hits
both equally. By default that server is a real ``dsec serve`` child process (its
apiserver mounts the E2B app at ``/e2b``; container tier, network off), which is
what a user runs and keeps the benchmark client's CPU apart from the server's:

  * ``e2b``    the unmodified ``e2b.AsyncSandbox`` (E2B_API_URL / E2B_SANDBOX_URL)
  * ``native`` dsec's own ``dsec.AsyncSandbox`` over one shared ``dsec.AsyncClient``
    (the overhead target compares with this one)
  * ``native-new-client`` the same with a new client per sandbox (``url=``/``api_key=``),
    which pays for a new httpx client and connection each cycle

It prints p50/p90 latency (ms) of one create-run-kill cycle and the sequential
rate (cycles/s) for each, the E2B overhead at p50, and writes
``benchmarks/results/e2b_compat.json`` (``_inprocess`` / ``_fake`` for those modes). Target: E2B p50 <= 1.2 x native p50.

Usage:
    .venv/bin/python benchmarks/e2b_compat.py [-n 30] [--image busybox] [--home DIR]   (root)
    .venv/bin/python benchmarks/e2b_compat.py --in-process   (server in a thread of this
                                                              process, as before)
    .venv/bin/python benchmarks/e2b_compat.py --fake    (fake edge from tests/e2b: bwrap,
                                                          no root; protocol cost only)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsec.server import ServeProcess  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


@contextlib.asynccontextmanager
async def open_edge(fake: bool, home: Path) -> AsyncIterator[Any]:
    """The edge under test: the real in-process edge, or the tests' bwrap fake."""
    if fake:
        sys.path.insert(0, str(ROOT / "tests" / "e2b"))
        from fake_edge import FakeEdge

        fake_edge = FakeEdge(home)
        try:
            yield fake_edge
        finally:
            await fake_edge.close()
        return
    from dsec.server import embedded_edge

    async with embedded_edge(home) as edge:
        try:
            yield edge
        finally:
            with contextlib.suppress(Exception):
                await edge.close(kill_sandboxes=True)


class Server:
    """dsec's apiserver + the E2B app on a loopback port, served from a background thread."""

    def __init__(self, fake: bool, home: Path) -> None:
        self.fake, self.home = fake, home
        home.mkdir(parents=True, exist_ok=True)
        self.url = ""
        self.api_key = ""
        self._ready = threading.Event()
        self._server: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        import socket

        import uvicorn

        from dsec.apiserver.app import create_app
        from dsec.apiserver.auth import KeyStore, StaticKeys
        from dsec.e2b import make_e2b_app

        async with open_edge(self.fake, self.home) as edge:
            if self.fake:
                self.api_key = "bench-key"
                keys: Any = StaticKeys([self.api_key])
            else:
                keys = KeyStore(self.home)
                self.api_key = (self.home / "api_key").read_text().strip()
            app = create_app(edge, keys)
            e2b_app = make_e2b_app(edge, keys.verify)
            app.mount("/e2b", e2b_app)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            server = uvicorn.Server(
                uvicorn.Config(
                    app, host="127.0.0.1", port=port, log_level="warning", access_log=False
                )
            )
            self._server = server
            task = asyncio.create_task(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            self._ready.set()
            await task
            await e2b_app.state.e2b.aclose()

    def __enter__(self) -> Server:
        self._thread.start()
        self._ready.wait(900)
        if self._error is not None or not self.url:
            raise RuntimeError(f"server failed to start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(300)


async def e2b_cycle(template: str) -> None:
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create(template, timeout=300)
    r = await sbx.commands.run("echo hi")
    assert r.stdout == "hi\n", r
    await sbx.kill()


def native_cycle_factories(
    url: str, api_key: str, image: str
) -> tuple[dict[str, Callable[[], Awaitable[None]]], Callable[[], Awaitable[None]]] | None:
    """The native paths and a closer: ``native`` shares one ``dsec.AsyncClient`` (one
    connection pool, as the e2b SDK keeps one per process), ``native-new-client`` opens a
    client per sandbox (``AsyncSandbox.create(url=...)``: a new httpx client each time)."""
    try:
        from dsec import AsyncClient, AsyncSandbox
    except ImportError:
        return None
    shared: list[AsyncClient] = []

    async def pooled() -> None:
        if not shared:
            shared.append(AsyncClient(url, api_key))
        sb = await AsyncSandbox.create(image=image, client=shared[0], ttl_s=300)
        r = await sb.commands.run("echo hi")
        assert r.stdout == "hi\n", r
        await sb.kill()

    async def fresh() -> None:
        sb = await AsyncSandbox.create(image=image, url=url, api_key=api_key, ttl_s=300)
        r = await sb.commands.run("echo hi")
        assert r.stdout == "hi\n", r
        await sb.kill()

    async def close() -> None:
        for client in shared:
            await client.close()

    return {"native": pooled, "native-new-client": fresh}, close


async def measure(
    n: int,
    warmup: int,
    paths: dict[str, Callable[[], Awaitable[None]]],
    close: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for i in range(warmup + n):
            for name, cycle in paths.items():  # interleaved A/B
                t0 = time.perf_counter()
                await cycle()
                if i >= warmup:
                    times[name].append((time.perf_counter() - t0) * 1000)
    finally:
        if close is not None:
            await close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", type=int, default=30, help="measured cycles per path")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--image", default="busybox", help="dsec image (used as the E2B template too)")
    ap.add_argument(
        "--home", default=None, help="DSEC_HOME for the real edge (default: a temp dir)"
    )
    ap.add_argument("--fake", action="store_true", help="use the bwrap fake edge from tests/e2b")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="serve from a thread of this process instead of a `dsec serve` child",
    )
    args = ap.parse_args()
    if not args.fake and os.geteuid() != 0:
        raise SystemExit("the real edge needs root; use --fake to measure the protocol layer only")
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="dsec-e2b-bench-"))
    if args.fake:
        args.image = "debian" if args.image == "busybox" else args.image
    try:
        subprocess_server = not (args.fake or args.in_process)
        server: Server | ServeProcess = (
            ServeProcess(home) if subprocess_server else Server(args.fake, home)
        )
        with server as srv:
            os.environ.update(
                {
                    "E2B_API_URL": f"{srv.url}/e2b",
                    "E2B_SANDBOX_URL": f"{srv.url}/e2b/envd",
                    "E2B_API_KEY": srv.api_key,
                }
            )
            # "<tier>/<image>": the same tier and image as the native path
            template = args.image if args.fake else f"container/{args.image}"
            paths: dict[str, Callable[[], Awaitable[None]]] = {"e2b": lambda: e2b_cycle(template)}
            native = native_cycle_factories(srv.url, srv.api_key, args.image)
            close = None
            if native is None:
                print(
                    "dsec.AsyncSandbox is not available (native SDK not installed yet): e2b path only"
                )
            else:
                paths.update(native[0])
                close = native[1]
            t0 = time.perf_counter()
            times = asyncio.run(measure(args.n, args.warmup, paths, close))
            wall = time.perf_counter() - t0
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    report: dict[str, Any] = {
        "edge": (
            "fake (bwrap)"
            if args.fake
            else ("real, in-process" if args.in_process else "real, `dsec serve` child process")
        ),
        "tier": "fake" if args.fake else "container",
        "image": args.image,
        "n": args.n,
        "wall_s": round(wall, 2),
        "paths": {},
    }
    print(
        f"\ncreate + commands.run('echo hi') + kill, {args.n} cycles per path, edge: {report['edge']}"
    )
    print(f"{'path':18} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9} {'cycles/s':>9}")
    for name, xs in times.items():
        row = {
            "p50_ms": round(pct(xs, 50), 2),
            "p90_ms": round(pct(xs, 90), 2),
            "mean_ms": round(statistics.fmean(xs), 2),
            "rate_per_s": round(1000 * len(xs) / sum(xs), 2),
        }
        report["paths"][name] = row
        print(
            f"{name:18} {row['p50_ms']:9.1f} {row['p90_ms']:9.1f} {row['mean_ms']:9.1f} {row['rate_per_s']:9.2f}"
        )
    if "native" in times:
        overhead = pct(times["e2b"], 50) / pct(times["native"], 50) - 1
        report["e2b_overhead_p50"] = round(overhead, 4)
        report["target_met"] = overhead <= 0.20
        print(
            f"E2B overhead at p50: {overhead * 100:+.1f}% (target <= +20%: {'met' if overhead <= 0.2 else 'NOT met'})"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_fake" if args.fake else ("_inprocess" if args.in_process else "")
    out = RESULTS / f"e2b_compat{suffix}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
