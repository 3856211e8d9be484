"""fncall tier benchmark: prints a table and writes benchmarks/results/fncall.json.

Measured in one run, on the same debian layer:
  * run_code of ``print(1+1)``: p50/p99 in-process (RunCodeService on the server loop) and
    end to end through HTTP (SandboxFusion ``POST /run_code``, one keep-alive client; a lean
    wrk-style client, plus the same through httpx for reference: httpx alone costs ~2.6 ms
    of CPU per request here). The server runs on uvloop, as ``dsec serve`` does.
  * throughput with C concurrent clients: in-process and through HTTP (the HTTP load comes
    from a separate process so it does not share the server's GIL), with the CPU spent per
    call by the server, the zygotes and their workers (``cpu_ms_per_call``: 2 cores / this
    = the throughput ceiling of the machine) and the 1-minute load average
  * C compile-and-run latency (gcc toolkit layer)
  * peers in the same run: ``bwrap --unshare-all ... python3 -c 'print(1+1)'`` on the same
    rootfs, and a cold container sandbox per call (create + exec + kill through the edge)
  * the worker refill cost: workers created per second by one pool

Usage: .venv/bin/python benchmarks/fncall.py [--quick] [--home DIR]
Targets (issue 3): python p50 <= 3 ms through HTTP; >= 500 calls/s on 2 cores; >= 20x faster
than a cold container per call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hostprobe import host_probe_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RESULTS = Path(__file__).resolve().parent / "results"
PAYLOAD = {"code": "print(1+1)", "language": "python"}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50_ms": round(pct(xs, 50), 3),
        "p99_ms": round(pct(xs, 99), 3),
        "mean_ms": round(statistics.fmean(xs), 3) if xs else float("nan"),
    }


# --- load generator (separate process) ------------------------------------------------------


class _RawClient:
    """A minimal HTTP/1.1 keep-alive client (what wrk does): one POST, read one response.

    httpx costs ~2.6 ms of CPU per request on this VM (measured against a server that answers
    at once: 2.9 ms vs 0.3 ms per round trip), which on 2 shared cores is taken from the
    server under test. The load generator uses this client; ``http_latency_httpx`` keeps an
    httpx measurement for reference.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def _load(url: str, total: int, concurrency: int, gap_s: float = 0.0) -> dict[str, Any]:
    """``total`` calls from ``concurrency`` keep-alive connections (lean client)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", int(parts.port or 80)
    body = json.dumps(PAYLOAD).encode()
    lat: list[float] = []
    errors = 0
    counter = iter(range(total))

    async def worker() -> None:
        nonlocal errors
        client = _RawClient(host, port)
        try:
            for _ in counter:
                t = time.perf_counter()
                try:
                    status, data = await client.post("/run_code", body)
                    ok = (
                        status == 200
                        and (json.loads(data).get("run_result") or {}).get("stdout") == "2\n"
                    )
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    ok = False
                    await client.close()
                    client = _RawClient(host, port)
                lat.append((time.perf_counter() - t) * 1000)
                errors += 0 if ok else 1
                if gap_s:
                    await asyncio.sleep(gap_s)
        finally:
            await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    return {
        "client": "raw keep-alive",
        "calls": total,
        "concurrency": concurrency,
        "seconds": dt,
        "calls_per_s": total / dt,
        "errors": errors,
        **summary(lat),
    }


async def _load_httpx(url: str, total: int, concurrency: int, gap_s: float = 0.0) -> dict[str, Any]:
    """The same load through httpx (the client cost is included in every number)."""
    import httpx

    lat: list[float] = []
    errors = 0
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors
            for _ in counter:
                t = time.perf_counter()
                try:
                    r = await client.post("/run_code", json=PAYLOAD)
                    ok = (
                        r.status_code == 200
                        and (r.json().get("run_result") or {}).get("stdout") == "2\n"
                    )
                except httpx.HTTPError:
                    ok = False
                lat.append((time.perf_counter() - t) * 1000)
                errors += 0 if ok else 1
                if gap_s:
                    await asyncio.sleep(gap_s)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    return {
        "client": "httpx",
        "calls": total,
        "concurrency": concurrency,
        "seconds": dt,
        "calls_per_s": total / dt,
        "errors": errors,
        **summary(lat),
    }


# --- the server -----------------------------------------------------------------------------


class Server:
    """The run_code router + a fncall runtime in a uvicorn thread (as ``dsec serve`` mounts it)."""

    def __init__(self, home: Path, min_ready: int, max_ready: int) -> None:
        self.home = home
        self.min_ready = min_ready
        self.max_ready = max_ready
        self.svc: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    def __enter__(self) -> Server:
        import socket

        import uvicorn
        from fastapi import FastAPI

        from dsec.apiserver.routes_runcode import make_runcode_router
        from dsec.runtimes.fncall.pool import PoolConfig
        from dsec.runtimes.fncall.runtime import FncallConfig
        from dsec.runtimes.fncall.testkit import fncall_service

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> Any:
            pool = PoolConfig(min_ready=self.min_ready, max_ready=self.max_ready)
            async with fncall_service(self.home, pool=pool) as svc:
                svc.runtime.config = FncallConfig(pool=pool)
                self.svc = svc
                self.loop = asyncio.get_running_loop()
                yield

        app = FastAPI(lifespan=lifespan)
        app.include_router(make_runcode_router(lambda: self.svc, None))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=port,
                log_level="warning",
                lifespan="on",
                access_log=False,
            )
        )
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server failed to start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def _run(self) -> None:
        """The server's loop, as ``dsec serve`` runs it (uvloop when installed)."""
        try:
            import uvloop
        except ImportError:
            asyncio.run(self.server.serve())
        else:
            uvloop.run(self.server.serve())

    def tree_cpu_s(self) -> float:
        """CPU seconds (user + system) of this process and of every zygote with its reaped
        workers: the whole cost of the calls except the load generator's."""
        tick = os.sysconf("SC_CLK_TCK")
        pids = [os.getpid()]
        if self.svc is not None:
            pids += [p._proc.pid for p in self.svc.runtime._pools.values() if p._proc is not None]
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        return total

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def call(self, coro: Any, timeout: float = 600) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


async def _inproc_latency(
    svc: Any, n: int, lang: str = "python", code: str = "print(1+1)", gap_s: float = 0.0
) -> list[float]:
    from dsec.runtimes.fncall.service import RunCodeRequest

    lat = []
    for _ in range(n):
        t = time.perf_counter()
        r = await svc.run_code(RunCodeRequest(code=code, language=lang))
        lat.append((time.perf_counter() - t) * 1000)
        assert r.status.value == "Success", r
        if gap_s:
            await asyncio.sleep(gap_s)
    return lat


async def _inproc_throughput(svc: Any, total: int, concurrency: int) -> dict[str, Any]:
    from dsec.runtimes.fncall.service import RunCodeRequest

    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            await svc.run_code(RunCodeRequest(code="print(1+1)", language="python"))
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    dt = time.perf_counter() - t0
    return {
        "calls": total,
        "concurrency": concurrency,
        "seconds": dt,
        "calls_per_s": total / dt,
        **summary(lat),
    }


async def _refill_rate(svc: Any, n: int) -> dict[str, Any]:
    pools = [p for p in svc.runtime._pools.values() if p.warm == "python"]
    pool = pools[0]
    workers = [await pool.claim() for _ in range(len(pool.ready))]
    for w in workers:
        pool.discard(w)
    t0 = time.perf_counter()
    for _ in range(n):  # the ready set is empty: every claim waits for a fresh worker
        pool.discard(await pool.claim(timeout_s=120))
    dt = time.perf_counter() - t0
    return {"workers": n, "seconds": dt, "workers_per_s": n / dt}


def _load_process(
    url: str, total: int, concurrency: int, gap_s: float, client: str = "raw"
) -> dict[str, Any]:
    """Run the HTTP client in its own process (it must not share the server's GIL)."""
    flag = "--load" if client == "raw" else "--load-httpx"
    proc = subprocess.run(
        [sys.executable, __file__, flag, url, str(total), str(concurrency), str(gap_s)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-500:]}
    return dict(json.loads(proc.stdout))


def _bwrap(layer_file: Path, n: int) -> dict[str, Any]:
    from dsec.privileged.mount import MS_RDONLY, mount, umount_quiet

    if not shutil.which("bwrap"):
        return {"error": "bwrap not installed"}
    mp = Path(f"/tmp/dsec-bench-bwrap-{os.getpid()}")
    mp.mkdir(exist_ok=True)
    mount(layer_file, mp, "erofs", MS_RDONLY)
    try:
        cmd = [
            "bwrap",
            "--unshare-all",
            "--die-with-parent",
            "--ro-bind",
            str(mp),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            "python3",
            "-c",
            "print(1+1)",
        ]
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, check=True).stdout
            lat.append((time.perf_counter() - t) * 1000)
            assert out == b"2\n", out
        return summary(lat)
    finally:
        umount_quiet(mp)
        mp.rmdir()


async def _cold_container(
    home: Path, layer_files: list[Path], digests: list[str], n: int
) -> dict[str, Any]:
    """create + exec ``python3 -c 'print(1+1)'`` + destroy of a container sandbox per call,
    through the container runtime directly (the edge adds its own bookkeeping on top)."""
    from dsec.config import Paths
    from dsec.contract.runtime import SandboxSpec
    from dsec.layers.mounts import LayerMounts
    from dsec.models import ExecRequest
    from dsec.runtimes.container.runtime import ContainerRuntime

    paths = Paths(home)
    paths.ensure()
    rt = ContainerRuntime(paths, LayerMounts(paths.layer_mounts))
    await rt.start()
    lat = []
    try:
        for i in range(n + 1):
            spec = SandboxSpec(
                id=f"sb-bench-{os.getpid()}-{i}",
                tier="container",
                layer_paths=[str(f) for f in layer_files],
                layer_digests=digests,
                cpu=1,
                memory_mb=256,
                disk_mb=64,
                pids=256,
                env={},
                user=None,
                workdir="/",
            )
            t = time.perf_counter()
            h = await rt.create(spec)
            try:
                r = await rt.exec(h, ExecRequest(cmd=["python3", "-c", "print(1+1)"]))
            finally:
                await rt.destroy(h)
            if i:  # the first one warms the layer mounts
                lat.append((time.perf_counter() - t) * 1000)
            assert r.stdout == "2\n", r
    finally:
        await rt.close()
    return summary(lat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--home", default=f"/tmp/dsec-bench-fncall-{os.getpid()}")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--load", nargs=4, metavar=("URL", "TOTAL", "CONCURRENCY", "GAP_S"), help=argparse.SUPPRESS
    )
    ap.add_argument(
        "--load-httpx",
        nargs=4,
        metavar=("URL", "TOTAL", "CONCURRENCY", "GAP_S"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    for spec, fn in ((args.load, _load), (args.load_httpx, _load_httpx)):
        if spec:
            url, total_s, conc_s, gap_s = spec
            print(json.dumps(asyncio.run(fn(url, int(total_s), int(conc_s), float(gap_s)))))
            return
    n = 50 if args.quick else 300
    total = 300 if args.quick else 2000
    home = Path(args.home)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": os.uname().release,
            "load_avg_1m_at_start": os.getloadavg()[0],
        },
        "targets": {"http_p50_ms": 3.0, "calls_per_s": 500, "vs_cold_container": 20},
    }
    probes: dict[str, float] = {}
    results["host_probe_ms"] = probes  # hostprobe.py: ~11 ms at full host speed, higher = slower

    def probe(phase: str) -> None:
        probes[phase] = round(host_probe_s() * 1000, 1)

    with Server(home, min_ready=min(args.concurrency * 2, 64), max_ready=128) as srv:
        time.sleep(3)  # let the first pools fill
        srv.call(_inproc_latency(srv.svc, 5))
        probe("inproc_latency")
        results["inproc_latency_idle_pool"] = summary(
            srv.call(_inproc_latency(srv.svc, n, gap_s=0.02))
        )
        probe("http_latency")
        results["http_latency"] = _load_process(srv.url, n, 1, 0.02)
        results["http_latency"]["load_avg_1m"] = os.getloadavg()[0]
        results["http_latency_httpx"] = _load_process(srv.url, n // 2, 1, 0.02, client="httpx")
        probe("throughput")
        cpu0 = srv.tree_cpu_s()
        results["inproc_throughput"] = srv.call(
            _inproc_throughput(srv.svc, total, args.concurrency)
        )
        time.sleep(2)  # let the zygotes reap the last workers
        results["inproc_throughput"]["cpu_ms_per_call"] = round(
            (srv.tree_cpu_s() - cpu0) / total * 1000, 2
        )
        results["inproc_throughput"]["load_avg_1m"] = os.getloadavg()[0]
        cpu0 = srv.tree_cpu_s()
        results["http_throughput"] = _load_process(srv.url, total, args.concurrency, 0.0)
        time.sleep(2)
        results["http_throughput"]["cpu_ms_per_call"] = round(
            (srv.tree_cpu_s() - cpu0) / total * 1000, 2
        )
        results["http_throughput"]["load_avg_1m"] = os.getloadavg()[0]
        results["refill"] = srv.call(_refill_rate(srv.svc, 100 if args.quick else 300))
        c_code = '#include <stdio.h>\nint main(){printf("%d\\n",1+1);return 0;}'
        try:
            srv.call(_inproc_latency(srv.svc, 1, "c", c_code))
            results["c_compile_and_run"] = summary(
                srv.call(_inproc_latency(srv.svc, 10 if args.quick else 30, "c", c_code))
            )
        except Exception as e:
            results["c_compile_and_run"] = {"error": repr(e)[:500]}
        results["pools"] = srv.svc.runtime.pools()
        layer_files, digests = srv.call(srv.svc.runtime.image_layers("debian"))
    probe("bwrap_and_cold_container")
    results["bwrap_python"] = _bwrap(layer_files[0], 20 if args.quick else 50)
    try:
        results["cold_container"] = asyncio.run(
            _cold_container(home / "container", layer_files, digests, 5 if args.quick else 20)
        )
    except Exception as e:
        results["cold_container"] = {"error": repr(e)[:500]}
    http50 = results["http_latency"].get("p50_ms", float("nan"))
    cold = results["cold_container"].get("p50_ms")
    results["speedup_vs_cold_container"] = round(cold / http50, 1) if cold else None
    results["speedup_vs_bwrap"] = round(
        results["bwrap_python"].get("p50_ms", float("nan")) / http50, 1
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fncall.json").write_text(json.dumps(results, indent=2, default=str))
    rows = [
        ("python print(1+1), in-process", results["inproc_latency_idle_pool"]),
        ("python print(1+1), HTTP /run_code", results["http_latency"]),
        ("  same, httpx client", results["http_latency_httpx"]),
        (f"in-process, {args.concurrency} concurrent", results["inproc_throughput"]),
        (f"HTTP, {args.concurrency} concurrent clients", results["http_throughput"]),
        ("C compile + run", results["c_compile_and_run"]),
        ("bwrap --unshare-all python3", results["bwrap_python"]),
        ("cold container (create+exec+kill)", results["cold_container"]),
    ]
    print(f"{'measurement':40s} {'p50 ms':>9s} {'p99 ms':>9s} {'calls/s':>9s}")
    for name, r in rows:
        rate = f"{r['calls_per_s']:.0f}" if "calls_per_s" in r else ""
        if "error" in r:
            print(f"{name:40s} error: {r['error'][:60]}")
        else:
            print(f"{name:40s} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f} {rate:>9s}")
    print(
        "CPU per call (server + zygotes + workers): "
        f"in-process {results['inproc_throughput'].get('cpu_ms_per_call')} ms, "
        f"HTTP {results['http_throughput'].get('cpu_ms_per_call')} ms"
    )
    print(
        f"worker refill: {results['refill']['workers_per_s']:.0f} workers/s; "
        f"HTTP vs cold container: {results['speedup_vs_cold_container']}x; vs bwrap: {results['speedup_vs_bwrap']}x"
    )
    print(
        "host CPU probe (SHA-256 of 16 MiB, ~11 ms at full speed) before each phase: "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in probes.items())
    )
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
