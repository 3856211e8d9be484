"""Lazy (on-demand) vs full-pull image loading: prints a table, writes
benchmarks/results/lazy_images.json.

The image (>= 1 GiB): the Debian base layer + the gcc toolchain layer from the shared test
cache (``/var/cache/dsec-test-layers``; built on first use otherwise) + a data layer holding
one large incompressible file. Its blobs are served from a loopback HTTP range server
(:class:`dsec.layers.blobserver.BlobHTTPServer`) throttled to ``--rate`` (100 MB/s) by a token
bucket. Each measured phase runs ``dsec serve`` as a child process with a fresh DSEC_HOME
whose layer store has the image's layers recorded as *remote*; page cache is dropped
(``echo 3 > /proc/sys/vm/drop_caches``) before each phase.

Phases, all in one run:
  full       fetch every layer (``LayerStore.fetch_layer``: full download, digest verified),
             then start N container sandboxes together, each running the task
  lazy       start the N sandboxes straight away; layers mounted from the FUSE server,
             chunks fetched on first read (chunk cache empty)
  lazy-warm  second start of the same image on the lazy node: chunk cache warm, page cache
             dropped
  local      second start on the full-pull node (fully local image), page cache dropped

The task (per sandbox): ``gcc --version``, ``python3 -c 'import json'``, read a 96 MiB slice
of the data file shared by all tasks plus 1 MiB of its own: < 10% of the image.
Reported: wall time until all tasks are done, bytes fetched from the blob server, bytes
written to local disk (layer blobs for full, chunk cache for lazy). Every layer has a chunk
table in the blob store (as ``dsec image push`` publishes), so lazy phases check each fetched
chunk against it; "fetched" counts the tables too.

Usage: .venv/bin/python benchmarks/lazy_images.py [--sandboxes 32] [--rate 100e6]
       [--data-mib 1024] [--chunk-sizes 1048576] [--quick]
Targets (issue 4): lazy >= 2x faster than full; >= 75% fewer bytes written; lazy-warm within
1.2x of local.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec import AsyncSandbox
from dsec.layers.blobserver import BlobHTTPServer, copy_into_dir_store
from dsec.layers.blobstore import LocalDirStore
from dsec.layers.chunktable import publish_chunk_table
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.lazy import LazyServer
from dsec.layers.mounts import mountinfo_entries
from dsec.layers.store import LayerStore
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"
SHARED_CACHE = Path(os.environ.get("DSEC_TEST_LAYER_CACHE", "/var/cache/dsec-test-layers"))
IMAGE = "lazybench"
SHARED_SLICE_MIB = 96


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def base_layers() -> list[tuple[Path, str, str, str | None, dict[str, Any]]]:
    """(file, digest, kind, name, meta) of the Debian base and gcc toolchain layers."""
    store = LayerStore(SHARED_CACHE, SHARED_CACHE.parent / "dsec-test-images")
    try:
        debian = store.ensure_image_sync("debian")
        out: list[tuple[Path, str, str, str | None, dict[str, Any]]] = []
        digests = list(debian.layers)
        for img in store.list_images():
            if img.name.startswith("fncall-gcc") and img.layers[0] == debian.layers[0]:
                digests = list(img.layers)  # debian + the gcc toolchain layer
                break
        for d in digests:
            info = store.get_layer(d)
            out.append((store.layer_path(d), d, info.kind, info.name, info.meta))
        return out
    finally:
        store.close()


def data_layer(work: Path, mib: int) -> tuple[Path, str]:
    """An EROFS layer with /data/blob.bin of ``mib`` MiB of random bytes (cached in work)."""
    img = work / f"data-{mib}.erofs"
    if not img.exists():
        src = work / "data-src"
        shutil.rmtree(src, ignore_errors=True)
        (src / "data").mkdir(parents=True)
        with open(src / "data" / "blob.bin", "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        tmp = work / "data.tmp.erofs"
        mkfs_erofs(src, tmp, compress=None)
        shutil.rmtree(src)
        os.rename(tmp, img)
    with open(img, "rb") as f:
        digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    return img, digest


def prepare_home(
    home: Path, layers: list[tuple[Path, str, str, str | None, dict[str, Any]]], url: str
) -> None:
    """A fresh DSEC_HOME whose store records the image's layers as remote."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    store = LayerStore(home / "layers", home / "images")
    try:
        for path, digest, kind, name, meta in layers:
            size = path.stat().st_size
            store.add_remote_layer(digest, size, url, meta, kind=kind, name=name)  # type: ignore[arg-type]
        store.put_image(IMAGE, [d for _, d, *_ in layers])
    finally:
        store.close()


def task_command(i: int) -> str:
    own = SHARED_SLICE_MIB + 64 + i * 4  # a MiB of its own, past the shared slice
    return (
        "gcc --version >/dev/null 2>&1 || true; python3 -c 'import json' && "
        f"dd if=/data/blob.bin of=/dev/null bs=1M count={SHARED_SLICE_MIB} 2>/dev/null && "
        f"dd if=/data/blob.bin of=/dev/null bs=1M skip={own} count=1 2>/dev/null && echo ok"
    )


async def run_tasks(srv: ServeProcess, n: int) -> tuple[float, list[float]]:
    """Create n sandboxes together, run the task in each; seconds until all are done."""
    kw: dict[str, Any] = {
        "tier": "container",
        "image": IMAGE,
        "cpu": 0.5,
        "memory_mb": 256,
        "url": srv.url,
        "api_key": srv.api_key,
    }
    t0 = time.perf_counter()
    per: list[float] = []

    async def one(i: int) -> Any:
        sb = await AsyncSandbox.create(**kw)
        r = await sb.commands.run(["sh", "-c", task_command(i)], timeout=240)
        per.append(time.perf_counter() - t0)
        if r.exit_code != 0 or "ok" not in r.stdout:
            raise RuntimeError(f"task {i} failed: {r.exit_code} {r.stdout!r} {r.stderr!r}")
        return sb

    sbs = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
    return wall, per


def lazy_counters(home: Path) -> dict[str, Any]:
    store = LayerStore(home / "layers", home / "images")
    try:
        return store.lazy_stats()
    finally:
        store.close()


def cleanup_mounts(home: Path) -> None:
    if (home / "layers" / "lazy").is_dir():  # the node's server outlives `dsec serve`
        LazyServer(home / "layers" / "lazy").shutdown()
    for e in sorted(mountinfo_entries(home), key=lambda e: -len(e.mountpoint.parts)):
        subprocess.run(["umount", "-l", str(e.mountpoint)], check=False)


def phase(
    name: str,
    home: Path,
    http: BlobHTTPServer,
    n: int,
    env: dict[str, str],
    *,
    full_pull: bool,
    second_start: bool,
) -> dict[str, Any]:
    """One measured phase; see the module docstring."""
    out: dict[str, Any] = {"phase": name}
    sent0 = http.bytes_sent
    fetch_s = 0.0
    written = 0
    if full_pull:
        drop_page_cache()
        store = LayerStore(home / "layers", home / "images")
        t0 = time.perf_counter()
        layers = store.get_image(IMAGE).layers

        async def fetch_all() -> None:
            await asyncio.gather(*(asyncio.to_thread(store.fetch_layer, d) for d in layers))

        asyncio.run(fetch_all())
        fetch_s = time.perf_counter() - t0
        written = sum(store.get_layer(d).size for d in layers)
        store.close()
    with ServeProcess(home, env=env, layer_cache=home / "no-shared-cache") as srv:
        if second_start:
            asyncio.run(run_tasks(srv, n))  # first start (not measured): warms the node
            time.sleep(1.5)  # layers are unmounted once their last sandbox is gone
            sent0 = http.bytes_sent
            before = lazy_counters(home)["node"].get("bytes_written", 0)
        drop_page_cache()
        wall, per = asyncio.run(run_tasks(srv, n))
        stats = lazy_counters(home)
        out["layer_stats"] = stats.get("layers", {})
    lazy_written = stats["node"].get("bytes_written", 0)
    if second_start:
        lazy_written -= before
    out.update(
        fetch_s=round(fetch_s, 3),
        tasks_s=round(wall, 3),
        total_s=round(wall if second_start else fetch_s + wall, 3),
        task_p50_s=round(sorted(per)[len(per) // 2], 3),
        bytes_fetched=http.bytes_sent - sent0,
        bytes_written=written + lazy_written,
        lazy=stats.get("node", {}),
    )
    cleanup_mounts(home)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=32)
    ap.add_argument("--rate", type=float, default=100e6, help="blob server bytes/s")
    ap.add_argument("--data-mib", type=int, default=1024)
    ap.add_argument("--chunk-sizes", default=str(1 << 20), help="comma-separated bytes")
    ap.add_argument("--work", default="/var/tmp/dsec-lazy-bench")
    ap.add_argument("--quick", action="store_true", help="8 sandboxes, 256 MiB data")
    ap.add_argument("--readahead-chunks", type=int, default=None, help="lazy readahead")
    ap.add_argument("--lazy-only", action="store_true", help="only the lazy cold phases")
    ap.add_argument("--phases", default=None, help="comma-separated subset of phase names")
    args = ap.parse_args()
    if args.quick:
        args.sandboxes, args.data_mib = 8, 256
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    n = args.sandboxes
    print("preparing the image ...", flush=True)
    layers = base_layers()
    data_file, data_digest = data_layer(work, args.data_mib)
    layers.append((data_file, data_digest, "workspace", "bench-data", {}))
    blobs = LocalDirStore(work / "blobs")
    for i, (path, digest, kind, name, meta) in enumerate(layers):
        copy_into_dir_store(blobs, path, digest)
        # each fetched chunk is checked against the layer's chunk table, as for pushed images
        table, _ = publish_chunk_table(blobs, path)
        layers[i] = (path, digest, kind, name, {**meta, "chunk_table": table})
    image_bytes = sum(p.stat().st_size for p, *_ in layers)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "sandboxes": n,
        "rate_bytes_per_s": args.rate,
        "image_bytes": image_bytes,
        "layers": [{"digest": d, "bytes": p.stat().st_size} for p, d, *_ in layers],
        "task_reads_bytes_max": (SHARED_SLICE_MIB + 1) << 20,
        "phases": [],
    }
    print(f"image: {len(layers)} layers, {image_bytes / 1e9:.2f} GB; {n} sandboxes", flush=True)
    with BlobHTTPServer(blobs.root, rate=args.rate) as http:
        url = http.url
        chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
        plan: list[tuple[str, int, bool, bool]] = [("full", chunk_sizes[0], True, False)]
        plan += [(f"lazy@{c >> 10}K", c, False, False) for c in chunk_sizes]
        plan += [("lazy-warm", chunk_sizes[0], False, True), ("local", chunk_sizes[0], True, True)]
        if args.lazy_only:
            plan = [p for p in plan if p[0].startswith("lazy@")]
        if args.phases:
            plan = [p for p in plan if p[0] in args.phases.split(",")]
        for name, chunk, full, second in plan:
            home = work / f"home-{name.replace('@', '-')}"
            prepare_home(home, layers, url)
            # a node keeps its lazy FUSE server up: start it with `dsec serve`, not with the
            # first sandbox (the full-pull node has no remote layers left, so it starts none)
            env = {"DSEC_LAZY_CHUNK_SIZE": str(chunk), "DSEC_LAZY_PRESTART": "1"}
            if args.readahead_chunks is not None:
                env["DSEC_LAZY_READAHEAD_CHUNKS"] = str(args.readahead_chunks)
            print(f"phase {name} ...", flush=True)
            try:
                r = phase(name, home, http, n, env, full_pull=full, second_start=second)
            finally:
                cleanup_mounts(home)
            r["chunk_size"] = chunk
            results["phases"].append(r)
            print(
                f"  {r['total_s']:.2f} s, fetched {r['bytes_fetched'] / 1e6:.0f} MB, "
                f"written {r['bytes_written'] / 1e6:.0f} MB",
                flush=True,
            )
            with contextlib.suppress(OSError):
                shutil.rmtree(home)
    for r in results["phases"]:
        print(r["phase"], {d[7:19]: v["bytes_fetched"] for d, v in r["layer_stats"].items()})
    if args.lazy_only or args.phases:
        return
    by = {r["phase"]: r for r in results["phases"]}
    lazy = by[f"lazy@{chunk_sizes[0] >> 10}K"]
    results["speedup_lazy_vs_full"] = by["full"]["total_s"] / lazy["total_s"]
    results["bytes_written_reduction"] = 1 - lazy["bytes_written"] / by["full"]["bytes_written"]
    results["warm_vs_local"] = by["lazy-warm"]["total_s"] / by["local"]["total_s"]
    print()
    print(
        f"{'phase':<14}{'fetch s':>9}{'tasks s':>9}{'total s':>9}{'fetched MB':>12}{'written MB':>12}"
    )
    for r in results["phases"]:
        print(
            f"{r['phase']:<14}{r['fetch_s']:>9.2f}{r['tasks_s']:>9.2f}{r['total_s']:>9.2f}"
            f"{r['bytes_fetched'] / 1e6:>12.1f}{r['bytes_written'] / 1e6:>12.1f}"
        )
    print()
    print(
        f"lazy vs full: {results['speedup_lazy_vs_full']:.2f}x faster (target >= 2x); "
        f"{results['bytes_written_reduction'] * 100:.0f}% fewer bytes written (target >= 75%); "
        f"warm lazy / local = {results['warm_vs_local']:.2f} (target <= 1.2)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lazy_images.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
