"""Image build benchmark: prints a table, writes benchmarks/results/builds.json.

A 3-step build on busybox (``RUN`` that writes a file, ``COPY`` of a 1 MiB context file,
``RUN`` that reads it) through a real node: ``ImageBuilder`` over an in-process
``EdgeAgent`` with the container tier (``dsec.server.embedded_edge``; networking off, as
these steps need none), its own ``DSEC_HOME`` and the shared test layer cache. Measured:

  * cold: a key with an empty cache (a new owner each round), every step in a sandbox;
  * fully cached: the same build again (no sandbox is made), engine only and through the
    SDK (``Image.build_async``) over the ``POST /v1/builds`` wire format (an in-process
    ASGI app: HTTP framing without sockets);
  * one changed middle step: the COPY's file changes, so it and the last RUN rebuild.

Usage: .venv/bin/python benchmarks/builds.py [--rounds N] [--home DIR]   (root)
Target: a fully cached rebuild <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import secrets
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import httpx

from dsec import AsyncClient, Image
from dsec.builds import BuildRequest, decode_build_upload, ndjson_lines
from dsec.builds.engine import ImageBuilder
from dsec.builds.wire import BuildDone
from dsec.errors import DsecError
from dsec.server import embedded_edge

RESULTS = Path(__file__).resolve().parent / "results"
LAYER_CACHE = Path(os.environ.get("DSEC_TEST_LAYER_CACHE", "/var/cache/dsec-test-layers"))
PAYLOAD = 1 << 20


def request(name: str) -> BuildRequest:
    return BuildRequest.parse(
        {
            "name": name,
            "steps": [
                {"op": "from_image", "image": "busybox"},
                {"op": "run", "cmd": "echo one > /one"},
                {"op": "copy", "src": ["data.bin"], "dest": "/app/"},
                {"op": "run", "cmd": "wc -c /app/data.bin > /two"},
            ],
        }
    )


def payload(seed: bytes) -> bytes:
    return (hashlib.sha256(seed).digest() * (PAYLOAD // 32))[:PAYLOAD]


def context(seed: bytes) -> bytes:
    data = payload(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("data.bin")
        info.size, info.mtime = len(data), 1_700_000_000
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def timed_build(
    builder: ImageBuilder, owner: str, req: BuildRequest, ctx: bytes
) -> tuple[float, BuildDone]:
    t0 = time.perf_counter()
    last: Any = None
    async for ev in builder.build(owner, req, ctx):
        last = ev
    took = time.perf_counter() - t0
    if not isinstance(last, BuildDone):
        raise RuntimeError(f"build failed: {last}")
    return took, last


def wire_app(builder: ImageBuilder) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def builds(r: Request) -> Response:
        key = r.headers.get("authorization", "").removeprefix("Bearer ")
        owner = "k" + hashlib.sha256(key.encode()).hexdigest()[:16]
        try:
            req, ctx = decode_build_upload(await r.body())
            events = builder.build(owner, req, ctx)
            first = await anext(events)
        except DsecError as e:
            return JSONResponse(e.to_wire(), status_code=e.http_status)
        return StreamingResponse(ndjson_lines(first, events), media_type="application/x-ndjson")

    return Starlette(routes=[Route("/v1/builds", builds, methods=["POST"])])


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median_s": round(statistics.median(xs), 4),
        "min_s": round(xs[0], 4),
        "max_s": round(xs[-1], 4),
    }


async def run(home: Path, src: Path, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": rounds, "payload_bytes": PAYLOAD}
    async with embedded_edge(home, tiers=["container"]) as edge:
        builder = ImageBuilder(edge, edge.layers, cache_db=home / "build-cache.db")
        try:
            await edge.layers.ensure_image("busybox")
            ctx = context(b"v1")
            cold, cached, changed = [], [], []
            made_by_cached = 0
            for i in range(rounds):
                owner = "k" + secrets.token_hex(8)
                took, d = await timed_build(builder, owner, request("bench"), ctx)
                assert d.built_steps == 3
                cold.append(took)
                for _ in range(5):
                    before = len(await edge.list_sandboxes(owner, include_stopped=True))
                    took, d = await timed_build(builder, owner, request("bench"), ctx)
                    after = len(await edge.list_sandboxes(owner, include_stopped=True))
                    assert d.cached_steps == 3
                    made_by_cached += after - before
                    cached.append(took)
                took, d = await timed_build(
                    builder, owner, request("bench"), context(f"v{i + 2}".encode())
                )
                assert (d.built_steps, d.cached_steps) == (2, 1)
                changed.append(took)
            out["cold"] = stats(cold)
            out["cached_engine"] = stats(cached)
            out["cached_sandboxes_made"] = made_by_cached
            out["changed_middle_step"] = stats(changed)
            # through the SDK and the wire format
            key = "bench_" + secrets.token_hex(8)
            image = (
                Image.from_image("busybox")
                .run("echo one > /one")
                .copy(src / "data.bin", "/app/")
                .run("wc -c /app/data.bin > /two")
            )
            transport = httpx.ASGITransport(app=wire_app(builder))
            async with AsyncClient("http://bench", key, transport=transport) as client:
                t0 = time.perf_counter()
                await image.build_async("bench-sdk", client=client)
                out["cold_sdk_s"] = round(time.perf_counter() - t0, 4)
                sdk = []
                for _ in range(5 * rounds):
                    t0 = time.perf_counter()
                    await image.build_async("bench-sdk", client=client)
                    sdk.append(time.perf_counter() - t0)
                out["cached_sdk_wire"] = stats(sdk)
        finally:
            builder.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--home", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (sandboxes need mounts and cgroups)")
    os.environ["DSEC_NETWORK"] = "off"  # these steps need none
    home = args.home or Path(tempfile.mkdtemp(prefix="dsec-bench-builds-"))
    home.mkdir(parents=True, exist_ok=True)
    if LAYER_CACHE.is_dir() and not (home / "layers").exists():
        (home / "layers").symlink_to(LAYER_CACHE, target_is_directory=True)
    src = Path(tempfile.mkdtemp(prefix="dsec-bench-ctx-"))
    (src / "data.bin").write_bytes(payload(b"sdk"))
    try:
        result = asyncio.run(run(home, src, args.rounds))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    result["target_cached_s"] = 1.0
    result["cached_meets_target"] = result["cached_sdk_wire"]["median_s"] <= 1.0
    rows = [
        ("cold 3-step build (3 sandboxes)", result["cold"]),
        ("fully cached rebuild, engine", result["cached_engine"]),
        ("fully cached rebuild, SDK + wire", result["cached_sdk_wire"]),
        ("changed middle step (2 rebuilt)", result["changed_middle_step"]),
    ]
    print(f"{'what':38} {'n':>3} {'median':>10} {'min':>10} {'max':>10}")
    for label, s in rows:
        print(
            f"{label:38} {s['n']:>3} {s['median_s'] * 1000:>8.1f}ms "
            f"{s['min_s'] * 1000:>8.1f}ms {s['max_s'] * 1000:>8.1f}ms"
        )
    print(f"cold build through the SDK: {result['cold_sdk_s'] * 1000:.1f} ms")
    print(f"sandboxes made by cached rebuilds: {result['cached_sandboxes_made']}")
    print(f"target: cached rebuild <= 1 s: {'met' if result['cached_meets_target'] else 'MISSED'}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "builds.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'builds.json'}")


if __name__ == "__main__":
    main()
