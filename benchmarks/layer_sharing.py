"""What a page cache per key costs (issue 32): layer mounts per key against one per node.

A/B in one run, two ``dsec serve`` children one after the other: ``DSEC_LAYER_SHARING=node``
(each layer mounted once per node: every key's sandboxes share its page cache, a channel
between keys) and ``key`` (the default: a key's own mounts, its own page cache). In each,
1, 2, then 4 keys use the same image (``code-interpreter`` without its start command; each
sandbox runs ``python3 -c 'import numpy, pandas, matplotlib.pyplot'``). Per key: its first
sandbox (a new key: in ``key`` mode its reads are cold, and the warm pool has no container of
its scope yet) and a second one (a warm key), each timed as create and first command.
After 1, 2 and 4 keys: the page cache the sandboxes' cgroups were charged, and the image's
page cache summed over the server's layer mounts (``fincore`` on every file, through
``/proc/<pid>/root``: the mounts live in the server's mount namespace). Once, after the
first key: the layer files' own page cache (EROFS ``directio`` keeps it to the metadata the
mounts read through it, shared by every mount: data blocks are cached by each mount alone).

Usage: python benchmarks/layer_sharing.py [--image code-interpreter]
Writes benchmarks/results/layer_sharing.json. Built-in images come from
``DSEC_BUILTIN_CACHE`` when it is set (else the first create builds the image).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsec import AsyncClient, AsyncSandbox
from dsec.apiserver.auth import KeyStore
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOAD = "python3 -c 'import numpy, pandas, matplotlib.pyplot'"
KEY_COUNTS = (1, 2, 4)
MIB = 1 << 20


def resident_bytes(files: list[str]) -> int:
    """Bytes of ``files`` resident in the page cache (``fincore``: mmap + mincore, no
    reads)."""
    total = 0
    for i in range(0, len(files), 2000):
        batch = files[i : i + 2000]
        out = subprocess.run(
            ["fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", *batch],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        total += sum(int(x) for x in out.split())
    return total


def evict(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: Path) -> list[str]:
    """Regular files below ``root`` that are not empty (symbolic links are not followed:
    through ``/proc/<pid>/root`` an absolute one would lead to the host's files)."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size:
                out.append(path)
    return out


async def page_cache(srv: ServeProcess, sandboxes: list[AsyncSandbox]) -> dict[str, float]:
    """The image's page cache, MiB: the layer files' own (the metadata the mounts read
    through them: inodes, directories, inline file tails; data is read with ``directio``),
    what the sandboxes' cgroups were charged (every page they brought in), then what every
    layer mount of the server (each scope's) holds, from ``fincore`` over all its files
    (which reads all of the image's metadata, and so comes last)."""
    files = resident_bytes(files_under(srv.home / "layers" / "blobs"))
    ms = await asyncio.gather(*(sb.metrics() for sb in sandboxes))
    charged = sum(m.memory.cache_bytes for m in ms)
    mnt = Path(f"/proc/{srv.proc.pid}/root") / str(srv.home).lstrip("/") / "mnt" / "layers"
    mounts = sorted(p for p in mnt.iterdir() if p.is_dir())
    held = sum(resident_bytes(files_under(m)) for m in mounts)
    return {
        "layer_mounts": len(mounts),
        "charged_mib": round(charged / MIB, 1),
        "mounts_mib": round(held / MIB, 1),
        "files_mib": round(files / MIB, 1),
    }


async def timed_sandbox(client: AsyncClient, image: str) -> tuple[AsyncSandbox, float, float]:
    """A new sandbox: (it, create ms, first command ms)."""
    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(
        client=client, tier="container", image=image, start=False, cpu=0.5, memory_mb=512
    )
    t1 = time.perf_counter()
    r = await sb.commands.run(WORKLOAD, timeout=600)
    assert r.exit_code == 0, r
    return sb, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


async def measure(srv: ServeProcess, keys: list[str], image: str) -> dict[str, Any]:
    """Each key's new and warm sandbox, and the page cache after 1, 2 and 4 keys."""
    clients = [AsyncClient(srv.url, k) for k in keys]
    sandboxes: list[AsyncSandbox] = []
    per_key: list[dict[str, float]] = []
    memory: dict[str, Any] = {}
    try:
        # the image is in the node's store before anything is timed
        warmup = await AsyncSandbox.create(
            client=clients[0], tier="container", image=image, start=False
        )
        await warmup.kill()
        await asyncio.sleep(1.0)
        # the layer files' own cache starts empty (the store hashed them, other stores on
        # the machine may share their inodes): what it holds after is what the mounts read
        evict(files_under(srv.home / "layers" / "blobs"))
        probe = host_probe_s()
        for i, client in enumerate(clients):
            row: dict[str, float] = {}
            for which in ("new", "warm"):
                sb, create_ms, cmd_ms = await timed_sandbox(client, image)
                sandboxes.append(sb)
                row[f"{which}_create_ms"] = round(create_ms, 1)
                row[f"{which}_cmd_ms"] = round(cmd_ms, 1)
                await asyncio.sleep(1.0)  # the key's pool refills before the next
            per_key.append(row)
            if i + 1 in KEY_COUNTS:
                memory[str(i + 1)] = await page_cache(srv, sandboxes)
    finally:
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)
        for c in clients:
            await c.close()

    def med(field: str, rows: list[dict[str, float]]) -> float:
        return round(statistics.median(r[field] for r in rows), 1)

    later = per_key[1:]  # keys after the first: the image is warm in node mode
    return {
        "memory": memory,
        "per_key": per_key,
        "new_key_create_ms": med("new_create_ms", later),
        "new_key_cmd_ms": med("new_cmd_ms", later),
        "warm_key_create_ms": med("warm_create_ms", per_key),
        "warm_key_cmd_ms": med("warm_cmd_ms", per_key),
        "host_probe_ms": round(probe * 1000, 2),
    }


def one_server(sharing: str, image: str) -> dict[str, Any]:
    """A ``dsec serve`` child with ``DSEC_LAYER_SHARING=sharing`` and 4 keys, measured."""
    env = {"DSEC_LAYER_SHARING": sharing, "DSEC_CPU_OVERCOMMIT": "100"}
    with (
        tempfile.TemporaryDirectory(prefix="dsec-bench-share-", ignore_cleanup_errors=True) as tmp,
        ServeProcess(Path(tmp), env=env) as srv,
    ):
        store = KeyStore(srv.home)
        keys = [srv.api_key, *(store.create_key(f"bench {i}") for i in range(1, max(KEY_COUNTS)))]
        return asyncio.run(measure(srv, keys, image))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--image", default="code-interpreter", help="the image every key uses")
    args = ap.parse_args()
    t0 = time.monotonic()
    rows = {mode: one_server(mode, args.image) for mode in ("node", "key")}
    print(f"{'sharing':<8} {'keys':>4} {'mounts':>6} {'charged MiB':>11} {'mounts MiB':>10}")
    for mode, r in rows.items():
        for n in KEY_COUNTS:
            m = r["memory"][str(n)]
            print(
                f"{mode:<8} {n:>4} {m['layer_mounts']:>6} {m['charged_mib']:>11.1f} "
                f"{m['mounts_mib']:>10.1f}"
            )
    print(
        f"\n{'sharing':<8} {'new key create':>14} {'first cmd':>10} "
        f"{'warm key create':>15} {'first cmd':>10}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<8} {r['new_key_create_ms']:>12.1f}ms {r['new_key_cmd_ms']:>8.0f}ms "
            f"{r['warm_key_create_ms']:>13.1f}ms {r['warm_key_cmd_ms']:>8.0f}ms"
        )
    extra = [
        rows["key"]["memory"][str(n)]["mounts_mib"] - rows["node"]["memory"][str(n)]["mounts_mib"]
        for n in KEY_COUNTS
    ]
    print(
        "the layer file's own cache after the first key (metadata, shared by every mount): "
        + ", ".join(f"{mode} {r['memory']['1']['files_mib']:.1f} MiB" for mode, r in rows.items())
    )
    print(
        "page cache of key over node mode: "
        + ", ".join(f"{n} keys +{e:.1f} MiB" for n, e in zip(KEY_COUNTS, extra, strict=True))
    )
    out = {
        "benchmark": "layer_sharing",
        "image": args.image,
        "workload": WORKLOAD,
        "modes": rows,
        "extra_page_cache_mib_key_vs_node": dict(
            zip([str(n) for n in KEY_COUNTS], [round(e, 1) for e in extra], strict=True)
        ),
        "duration_s": round(time.monotonic() - t0, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "layer_sharing.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
