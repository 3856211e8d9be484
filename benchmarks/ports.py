"""Port proxy benchmark (issue 22): what the proxy adds to HTTP, WebSocket and bulk
transfers to a server inside a sandbox.

One ``dsec serve`` child process (container tier, no network), one ``debian`` sandbox
running a small Python server (stdlib, threads): ``GET /small`` (13 bytes), ``GET
/bulk?mb=N`` (N MiB from memory), and a WebSocket echo (RFC 6455, tests' ``ws_echo.py``).
Each measurement is taken two ways in the same run, interleaved:

* ``direct``: from this process, a socket made inside the sandbox's network namespace
  (what the proxy itself does), to ``127.0.0.1:<port>`` there;
* ``proxied``: through the apiserver's path route
  ``/v1/sandboxes/{id}/ports/{port}/...`` with the API key.

HTTP requests open a new connection each, both ways (``Connection: close``; the proxy opens
one to the sandbox per request). Results: p50/p90 latency, added latency at p50 and the
ratio; WebSocket echo round trip p50 (one connection, 32-byte messages); bulk throughput
(one connection, ``--bulk-mb`` MiB). Targets: <= 1.5 ms added at p50 for HTTP,
<= 2 ms WebSocket round trip at p50, >= 1 GB/s bulk through the proxy on loopback.

Usage (root): .venv/bin/python benchmarks/ports.py [-n 300] [--bulk-mb 1024] [--home DIR]
Writes benchmarks/results/ports.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsec.server import ServeProcess  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WS_ECHO = ROOT / "tests" / "integration" / "data" / "ws_echo.py"

SERVER = r"""
import socket, sys, threading
CHUNK = b"x" * (1 << 20)

def serve(conn):
    try:
        req = b""
        while b"\r\n\r\n" not in req:
            data = conn.recv(65536)
            if not data:
                return
            req += data
        target = req.split(b" ", 2)[1]
        if target.startswith(b"/bulk"):
            mb = int(target.split(b"mb=")[1]) if b"mb=" in target else 64
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (mb << 20))
            view = memoryview(CHUNK)
            for _ in range(mb):
                conn.sendall(view)
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\nconnection: close\r\n\r\nhello, world\n")
    finally:
        conn.close()

srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(512)
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def http_once(connect: Callable[[], socket.socket], request: bytes) -> float:
    """One request on a new connection, answer read to its end; seconds."""
    t0 = time.perf_counter()
    s = connect()
    try:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if b"hello, world\n" in data:
                break
    finally:
        s.close()
    dt = time.perf_counter() - t0
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"hello, world\n"), data[:200]
    return dt


def bulk_once(connect: Callable[[], socket.socket], request: bytes, size: int) -> float:
    """Read a ``size``-byte body; bytes per second."""
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    s = connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    t0 = time.perf_counter()
    try:
        s.sendall(request)
        got = 0
        head = b""
        while b"\r\n\r\n" not in head:
            n = s.recv_into(view)
            head += bytes(view[:n])
        got = len(head) - head.index(b"\r\n\r\n") - 4
        while got < size:
            n = s.recv_into(view)
            if not n:
                break
            got += n
    finally:
        s.close()
    dt = time.perf_counter() - t0
    assert got >= size, (got, size)
    return size / dt


async def ws_rtts(connect_kw: dict[str, Any], url: str, n: int) -> list[float]:
    import websockets

    out = []
    async with websockets.connect(url, compression=None, **connect_kw) as ws:
        for _ in range(20):
            await ws.send("w" * 32)
            await ws.recv()
        for _ in range(n):
            t0 = time.perf_counter()
            await ws.send("p" * 32)
            await ws.recv()
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=300, help="HTTP requests and WS round trips per way")
    ap.add_argument("--bulk-mb", type=int, default=1024, help="MiB per bulk transfer")
    ap.add_argument("--bulk-runs", type=int, default=3)
    ap.add_argument("--home", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (dsec serve)")
    import httpx

    from dsec.privileged.netns import setns

    home = args.home or Path(tempfile.mkdtemp(prefix="dsec-bench-ports-")) / "home"
    env = {"DSEC_TIERS": "container", "DSEC_NETWORK": "off", "DSEC_ACCESS_LOG": "off"}
    with ServeProcess(home, env=env) as srv:
        auth = {"authorization": f"Bearer {srv.api_key}"}
        api = httpx.Client(base_url=srv.url, headers=auth, timeout=600)
        r = api.post("/v1/sandboxes", json={"image": "debian", "memory_mb": 1024, "cpu": 2})
        r.raise_for_status()
        sid = r.json()["id"]
        try:
            for name, text in (("/srv/bench.py", SERVER), ("/srv/ws_echo.py", WS_ECHO.read_text())):
                api.put(f"/v1/sandboxes/{sid}/files", params={"path": name}, content=text.encode())
            cmd = (
                "python3 /srv/bench.py 8000 >/tmp/b.log 2>&1 & "
                "python3 /srv/ws_echo.py 8765 >/tmp/w.log 2>&1 & sleep 0.5; echo ok"
            )
            r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_s": 30})
            assert r.json()["stdout"] == "ok\n", r.text
            pid = int((home / "sandboxes" / sid / "init.pid").read_text())
            netns_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)

            def inside() -> socket.socket:
                setns(netns_fd)
                try:
                    s = socket.socket()
                finally:
                    setns(host_fd)
                return s

            def direct(port: int) -> Callable[[], socket.socket]:
                def connect() -> socket.socket:
                    s = inside()
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    s.connect(("127.0.0.1", port))
                    return s

                return connect

            def proxied() -> socket.socket:
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s

            plain = b"GET /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            via = (
                f"GET /v1/sandboxes/{sid}/ports/8000/small HTTP/1.1\r\nhost: x\r\n"
                f"authorization: Bearer {srv.api_key}\r\nconnection: close\r\n\r\n"
            ).encode()
            for _ in range(30):  # warm up both paths
                http_once(direct(8000), plain)
                http_once(proxied, via)
            d_lat, p_lat = [], []
            for _ in range(args.n):
                d_lat.append(http_once(direct(8000), plain))
                p_lat.append(http_once(proxied, via))

            ws_direct = asyncio.run(
                ws_rtts({"sock": direct(8765)()}, "ws://127.0.0.1:8765/", args.n)
            )
            ws_proxied = asyncio.run(
                ws_rtts(
                    {"additional_headers": auth},
                    f"{srv.url.replace('http', 'ws', 1)}/v1/sandboxes/{sid}/ports/8765/",
                    args.n,
                )
            )

            size = args.bulk_mb << 20
            bplain = f"GET /bulk?mb={args.bulk_mb} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
            bvia = (
                f"GET /v1/sandboxes/{sid}/ports/8000/bulk?mb={args.bulk_mb} HTTP/1.1\r\n"
                f"host: x\r\nauthorization: Bearer {srv.api_key}\r\n\r\n"
            ).encode()
            b_direct, b_proxied = [], []
            for _ in range(args.bulk_runs):
                b_direct.append(bulk_once(direct(8000), bplain, size))
                b_proxied.append(bulk_once(proxied, bvia, size))
            os.close(netns_fd)
            os.close(host_fd)
        finally:
            api.delete(f"/v1/sandboxes/{sid}")
            api.close()
    if args.home is None:
        shutil.rmtree(home.parent, ignore_errors=True)

    ms = 1000.0
    http = {
        "direct_p50_ms": pct(d_lat, 50) * ms,
        "direct_p90_ms": pct(d_lat, 90) * ms,
        "proxied_p50_ms": pct(p_lat, 50) * ms,
        "proxied_p90_ms": pct(p_lat, 90) * ms,
    }
    http["added_p50_ms"] = http["proxied_p50_ms"] - http["direct_p50_ms"]
    http["ratio_p50"] = http["proxied_p50_ms"] / http["direct_p50_ms"]
    ws = {
        "direct_p50_ms": pct(ws_direct, 50) * ms,
        "proxied_p50_ms": pct(ws_proxied, 50) * ms,
        "proxied_p90_ms": pct(ws_proxied, 90) * ms,
    }
    ws["ratio_p50"] = ws["proxied_p50_ms"] / ws["direct_p50_ms"]
    bulk = {
        "mib_per_transfer": args.bulk_mb,
        "direct_median_gbps": statistics.median(b_direct) / 1e9,
        "proxied_median_gbps": statistics.median(b_proxied) / 1e9,
    }
    bulk["ratio"] = bulk["proxied_median_gbps"] / bulk["direct_median_gbps"]
    targets = {
        "http_added_p50_le_1_5_ms": http["added_p50_ms"] <= 1.5,
        "ws_rtt_p50_le_2_ms": ws["proxied_p50_ms"] <= 2.0,
        "bulk_ge_1_gbps": bulk["proxied_median_gbps"] >= 1.0,
    }
    print(f"{'measurement':<34} {'direct':>10} {'proxied':>10} {'ratio':>7}")
    print(
        f"{'HTTP request p50 (ms)':<34} {http['direct_p50_ms']:>10.3f} {http['proxied_p50_ms']:>10.3f} {http['ratio_p50']:>7.2f}"
    )
    print(
        f"{'HTTP request p90 (ms)':<34} {http['direct_p90_ms']:>10.3f} {http['proxied_p90_ms']:>10.3f}"
    )
    print(f"{'HTTP added at p50 (ms)':<34} {'':>10} {http['added_p50_ms']:>10.3f}")
    print(
        f"{'WebSocket echo RTT p50 (ms)':<34} {ws['direct_p50_ms']:>10.3f} {ws['proxied_p50_ms']:>10.3f} {ws['ratio_p50']:>7.2f}"
    )
    print(
        f"{'bulk download, median (GB/s)':<34} {bulk['direct_median_gbps']:>10.2f} {bulk['proxied_median_gbps']:>10.2f} {bulk['ratio']:>7.2f}"
    )
    print("targets:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "ports",
        "n": args.n,
        "http": http,
        "websocket": ws,
        "bulk": bulk,
        "targets": targets,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (RESULTS / "ports.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'ports.json'}")


if __name__ == "__main__":
    main()
