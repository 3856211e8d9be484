"""Code-interpreter round trip: ``run_code("1+1")`` against dsec's server on loopback.

Starts ``python3 -m dsec_codeinterp`` (Debian's ``/usr/bin/python3``, the stack of the
``code-interpreter`` image) on a free loopback port and measures, interleaved so that
drift hits all equally:

  * ``client``   the unmodified e2b-code-interpreter ``Sandbox.run_code("1+1")`` (it is
                 pointed at the server with ``sandbox_url``, as ``E2B_SANDBOX_URL`` does)
  * ``raw-http`` one ``POST /execute`` over a kept-alive httpx connection, reading the
                 NDJSON stream to its end (server + kernel cost without the client)
  * ``bash``, ``javascript``  ``echo 2`` / ``1+1`` in those kernels through the client

It prints p50/p90/p99 (ms) and writes ``benchmarks/results/codeinterp.json``.
Target: client p50 <= 10 ms.

Usage:
    .venv/bin/python benchmarks/codeinterp.py [-n 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsec.guest import codeinterp  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PYTHON = "/usr/bin/python3"
TARGET_P50_MS = 10.0


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server() -> Iterator[str]:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="dsec-codeinterp-bench-"))
    codeinterp.install_into(tmp / "site")
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp),
        "PYTHONPATH": str(tmp / "site"),
        "LANG": "C.UTF-8",
    }
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            codeinterp.PACKAGE_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--cwd",
            str(tmp),
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "the server did not start:\n" + (tmp / "server.log").read_text(errors="replace")
                )
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def client_sandbox(url: str) -> Any:
    """An e2b-code-interpreter ``Sandbox`` whose traffic goes to ``url`` (no control
    plane: the benchmark measures the code-interpreter round trip only)."""
    import warnings

    from e2b_code_interpreter import Sandbox

    from e2b import ConnectionConfig

    config = ConnectionConfig(sandbox_url=url, api_key="e2b_bench")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Sandbox(
            sandbox_id="bench",
            sandbox_domain=None,
            envd_version="0.6.3",
            envd_access_token=None,
            connection_config=config,
        )


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=300, help="round trips per mode")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    with server() as url:
        sbx = client_sandbox(url)
        http = httpx.Client(timeout=30)

        def via_client() -> None:
            assert sbx.run_code("1+1").text == "2"

        def raw_http() -> None:
            with http.stream("POST", f"{url}/execute", json={"code": "1+1"}) as r:
                lines = [json.loads(line) for line in r.iter_lines() if line]
            assert any(x.get("text") == "2" for x in lines), lines

        def bash() -> None:
            assert sbx.run_code("echo 2", language="bash").logs.stdout == ["2\n"]

        def javascript() -> None:
            assert sbx.run_code("1+1", language="javascript").text == "2"

        modes: dict[str, Callable[[], None]] = {
            "client": via_client,
            "raw-http": raw_http,
            "bash": bash,
        }
        if shutil.which("node") or shutil.which("nodejs"):
            modes["javascript"] = javascript
        for fn in modes.values():  # warm: kernels started, connections open
            for _ in range(10):
                fn()
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.n):
            for name, fn in modes.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1000)
        http.close()

    rows = {
        name: {
            "p50_ms": round(pct(xs, 50), 3),
            "p90_ms": round(pct(xs, 90), 3),
            "p99_ms": round(pct(xs, 99), 3),
            "n": len(xs),
        }
        for name, xs in samples.items()
    }
    print(f"{'mode':<12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'n':>5}")
    for name, row in rows.items():
        print(
            f"{name:<12} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{row['n']:>5}"
        )
    load = (round(load_before, 2), round(os.getloadavg()[0], 2))
    print(f"load average (1 min) before/after: {load[0]} / {load[1]} on {os.cpu_count()} cores")
    ok = rows["client"]["p50_ms"] <= TARGET_P50_MS
    print(f"target: client p50 <= {TARGET_P50_MS} ms: {'met' if ok else 'NOT met'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "codeinterp",
        "what": "run_code('1+1') round trip on loopback",
        "python": PYTHON,
        "target_p50_ms": TARGET_P50_MS,
        "target_met": ok,
        "modes": rows,
        "load_average_before_after": list(load),
        "unix_time": int(time.time()),
    }
    (RESULTS / "codeinterp.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'codeinterp.json'}")


if __name__ == "__main__":
    main()
