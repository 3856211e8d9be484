"""Container tier benchmark: prints a table and writes benchmarks/results/container.json.

Measured in one run, on the same busybox rootfs:
  * create-to-first-exec latency (p50/p99) over N sequential sandboxes, through the SDK + HTTP
  * sustained creations/s with C concurrent clients for D seconds (create + kill loops)
  * exec round trip (p50/p99) of `true` in a running sandbox, through the SDK + HTTP
  * host memory per idle sandbox with M sandboxes running
  * peers: a raw `crun run` loop (bundle on the same EROFS layer) and `podman run --rm`
    (image imported from the same rootfs), when podman is installed

Usage: .venv/bin/python benchmarks/container.py [--quick] [--home DIR]
Targets (the create-path issue): create-to-first-exec p50 <= 15 ms and >= 15x faster than
podman in the same run; >= 100 creations/s with 16 clients; exec round trip p50 <= 2.5 ms;
<= 1 MiB host memory per idle sandbox.

A kill answers before the container's teardown has finished (it continues in the server):
the sustained rate is also given over the window plus the time the server took afterwards
to finish the teardowns of the window's kills ("settled"). Warm containers of the pool are
idle containers too: the idle-memory figures divide by sandboxes plus warm containers. Host
memory is the drop of ``MemAvailable`` (what the node lost, shared pages and kernel objects
outside any cgroup included, but moved by anything else running on the machine); "charged"
is the growth of the install's parent memory cgroup (the sandboxes' processes, page cache and
the kernel memory charged to them: unaffected by other work on the node, but without the
mounts, namespaces and cgroup structures themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec import AsyncSandbox
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def slab_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1])
    return 0


def claimed(home: Path, sandbox_id: str) -> bool:
    """Whether the container runtime made this sandbox from a warm-pool claim."""
    from dsec.runtimes.container.bundle import cgroup_parent

    tmpfs = Path("/dev/shm") / cgroup_parent(home) / "sandbox-state" / f"{sandbox_id}.json"
    for path in (tmpfs, home / "sandboxes" / sandbox_id / "state.json"):
        if path.exists():
            return "warm_id" in json.loads(path.read_text())
    return False


async def bench_create_first_exec(
    n: int, kw: dict[str, Any], home: Path, claims: list[bool]
) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(**kw)
        r = await sb.commands.run("true")
        lat.append((time.perf_counter() - t0) * 1000)
        assert r.exit_code == 0, r
        claims.append(claimed(home, sb.id))
        await sb.kill()
    return lat


def charged_bytes(home: Path) -> int:
    """Memory charged to the install's parent memory cgroup (every sandbox and warm
    container below it: their processes, page cache and kernel objects), bytes."""
    from dsec.runtimes.container.bundle import cgroup_parent

    path = Path("/sys/fs/cgroup/memory") / cgroup_parent(home) / "memory.usage_in_bytes"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def sandbox_dirs(home: Path) -> tuple[int, int]:
    """(sandboxes, warm containers of the pool) with a directory on the node now."""
    names = (
        [d.name for d in (home / "sandboxes").iterdir()] if (home / "sandboxes").is_dir() else []
    )
    warm = sum(1 for n in names if n.startswith("wp-"))
    return len(names) - warm, warm


async def wait_torn_down(home: Path, timeout_s: float = 120.0) -> float:
    """Seconds until no sandbox directory but warm containers' is left (kills' teardowns
    done)."""
    t0 = time.monotonic()
    while sandbox_dirs(home)[0] and time.monotonic() - t0 < timeout_s:
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def bench_sustained(
    clients: int, duration: float, kw: dict[str, Any], home: Path
) -> dict[str, float]:
    stop = time.monotonic() + duration
    created = 0
    errors = 0

    async def client() -> None:
        nonlocal created, errors
        while time.monotonic() < stop:
            try:
                sb = await AsyncSandbox.create(**kw)
                created += 1
                await sb.kill()
            except Exception as e:  # counted, shown in the table
                errors += 1
                if errors < 3:
                    print(f"  sustained: error {e!r}", file=sys.stderr)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    took = time.monotonic() - t0
    settle = await wait_torn_down(home)
    return {
        "creations": created,
        "seconds": took,
        "per_s": created / took,
        "settle_s": settle,
        "per_s_settled": created / (took + settle),
        "errors": errors,
    }


async def bench_exec(n: int, kw: dict[str, Any]) -> list[float]:
    sb = await AsyncSandbox.create(**kw)
    try:
        for _ in range(20):
            await sb.commands.run("true")
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            await sb.commands.run("true")
            lat.append((time.perf_counter() - t0) * 1000)
        return lat
    finally:
        await sb.kill()


async def bench_idle_memory(m: int, kw: dict[str, Any], home: Path) -> dict[str, float]:
    def drop_caches() -> None:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")

    await wait_torn_down(home)
    await asyncio.to_thread(drop_caches)
    await asyncio.sleep(1)
    _, warm_before = sandbox_dirs(home)
    charged0 = charged_bytes(home)
    before = mem_available_kib()
    slab0 = slab_kib()
    sbs = []
    sem = asyncio.Semaphore(8)

    async def one() -> None:
        async with sem:
            sbs.append(await AsyncSandbox.create(**kw))

    await asyncio.gather(*(one() for _ in range(m)))
    # every sandbox runs one command so its exec path is warm, then idles
    await asyncio.gather(*(sb.commands.run("true") for sb in sbs))
    await asyncio.sleep(2)
    after = mem_available_kib()
    slab1 = slab_kib()
    _, warm_after = sandbox_dirs(home)
    charged1 = charged_bytes(home)
    containers = m + warm_after - warm_before  # the pool's new warm containers idle too
    try:
        per = (before - after) / containers / 1024
        return {
            "sandboxes": m,
            "warm_containers": warm_after - warm_before,
            "mib_per_sandbox": per,
            "charged_mib_per_sandbox": (charged1 - charged0) / containers / (1 << 20),
            "slab_mib_per_sandbox": (slab1 - slab0) / containers / 1024,
        }
    finally:
        await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)


def crun_bin() -> str | None:
    return shutil.which("crun") or shutil.which("runc")


def bench_raw_crun(rootfs: Path, n: int) -> list[float]:
    """`crun run` of `true` on a read-only bundle over the same EROFS layer (no cgroups limits
    beyond the defaults, no exec path): the floor our container tier is compared with."""
    rt = crun_bin()
    assert rt
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-crun-"))
    subprocess.run([rt, "spec"], cwd=work, check=True)
    cfg = json.loads((work / "config.json").read_text())
    cfg["root"] = {"path": str(rootfs), "readonly": True}
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/true"]
    cfg["linux"]["cgroupsPath"] = "/dsec-bench/raw"
    (work / "config.json").write_text(json.dumps(cfg))
    state = work / "state"
    lat = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            subprocess.run(
                [rt, "--root", str(state), "run", "--bundle", str(work), f"raw{i}"],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
            lat.append((time.perf_counter() - t0) * 1000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lat


def bench_podman(rootfs: Path, n: int) -> list[float] | str:
    podman = shutil.which("podman")
    if not podman:
        return "podman not installed (apt-get install podman)"
    tar = Path(tempfile.mkdtemp(prefix="dsec-bench-podman-")) / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tar), "."], check=True)
    img = "localhost/dsec-bench-busybox:latest"
    subprocess.run([podman, "import", str(tar), img], check=True, stdout=subprocess.DEVNULL)
    args = [
        podman,
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        img,
        "/bin/true",
    ]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return f"podman run failed: {r.stderr.strip()[:300]}"
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        lat.append((time.perf_counter() - t0) * 1000)
    shutil.rmtree(tar.parent, ignore_errors=True)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    ap.add_argument(
        "--home", default=None, help="DSEC_HOME for the benchmark server (default: a temp dir)"
    )
    ap.add_argument(
        "--out", default=None, help="default: results/container.json (_quick with --quick)"
    )
    args = ap.parse_args()
    q = args.quick
    n_seq = 20 if q else 100
    duration = 5.0 if q else 30.0
    n_exec = 100 if q else 1000
    n_idle = 20 if q else 200
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-"))
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    # the server runs as its own process, as in production (an in-process server would share
    # the GIL with the benchmark's clients and inflate every latency)
    with ServeProcess(home) as srv:
        # most RL sandboxes idle (DSec: 90% use <= 5% of what they request): the idle-memory
        # run asks for 0.05 core so 200 fit under the 10x CPU overcommit cap of a 2-core node;
        # latency runs ask for a full core (a 0.05-core sandbox is CFS-throttled while it works)
        kw = {
            "tier": "container",
            "image": "busybox",
            "cpu": 1.0,
            "memory_mb": 128,
            "url": srv.url,
            "api_key": srv.api_key,
        }
        idle_kw = {**kw, "cpu": 0.05}

        async def run_sdk() -> None:
            await (await AsyncSandbox.create(**kw)).kill()  # image build + warm caches
            print("create-to-first-exec ...", flush=True)
            claims: list[bool] = []
            results["create_to_first_exec_ms"] = await bench_create_first_exec(
                n_seq, kw, home, claims
            )
            results["warm_pool_claims"] = sum(claims) / max(1, len(claims))
            print("exec round trip ...", flush=True)
            results["exec_ms"] = await bench_exec(n_exec, kw)
            print(f"sustained creations ({duration:.0f} s, 16 clients) ...", flush=True)
            results["sustained"] = await bench_sustained(16, duration, {**kw, "cpu": 0.1}, home)
            print(f"idle memory ({n_idle} sandboxes) ...", flush=True)
            results["idle_memory"] = await bench_idle_memory(n_idle, idle_kw, home)

        asyncio.run(run_sdk())

    from dsec.layers.mounts import LayerMounts
    from dsec.layers.store import LayerStore

    store = LayerStore(home / "layers", home / "images")
    digest = store.get_image("busybox").layers[-1]
    mounts = LayerMounts(home / "mnt" / "bench")
    mp = mounts.acquire(digest, store.layer_path(digest))
    try:
        print("raw crun loop ...", flush=True)
        results["raw_runtime_ms"] = bench_raw_crun(mp, n_seq)
        print("podman ...", flush=True)
        results["podman_ms"] = bench_podman(mp, 10 if q else 20)
    finally:
        mounts.release(digest)
        mounts.close()

    cfe = results["create_to_first_exec_ms"]
    ex = results["exec_ms"]
    raw = results["raw_runtime_ms"]
    pod = results["podman_ms"]
    sus = results["sustained"]
    rows = [
        ("create-to-first-exec p50", f"{pct(cfe, 50):.1f} ms", "<= 15 ms"),
        ("create-to-first-exec p99", f"{pct(cfe, 99):.1f} ms", ""),
        ("  of which warm-pool claims", f"{results['warm_pool_claims'] * 100:.0f}%", ""),
        (
            "sustained creations/s (16 clients)",
            f"{sus['per_s']:.1f}/s ({sus['errors']} errors)",
            ">= 100/s",
        ),
        (
            "  with the teardowns settled",
            f"{sus['per_s_settled']:.1f}/s (+{sus['settle_s']:.2f} s)",
            "",
        ),
        ("exec round trip p50", f"{pct(ex, 50):.2f} ms", "<= 2.5 ms"),
        ("exec round trip p99", f"{pct(ex, 99):.2f} ms", ""),
        (
            "host memory per idle sandbox",
            f"{results['idle_memory']['mib_per_sandbox']:.2f} MiB ({n_idle} running"
            f" + {results['idle_memory']['warm_containers']} warm)",
            "<= 1 MiB",
        ),
        (
            "  charged to the sandboxes' cgroups",
            f"{results['idle_memory']['charged_mib_per_sandbox']:.2f} MiB",
            "",
        ),
        ("raw `crun run true` p50", f"{pct(raw, 50):.1f} ms", ""),
        ("dsec / raw runtime (p50)", f"{pct(cfe, 50) / pct(raw, 50):.2f}x", ""),
    ]
    if isinstance(pod, list):
        rows.append(("podman run --rm p50", f"{pct(pod, 50):.1f} ms", ""))
        rows.append(("podman / dsec (p50)", f"{pct(pod, 50) / pct(cfe, 50):.1f}x faster", ">= 15x"))
    else:
        rows.append(("podman run --rm", pod, ""))
    w = max(len(r[0]) for r in rows)
    print()
    print(f"{'metric'.ljust(w)}  {'measured'.ljust(34)}  target")
    print("-" * (w + 50))
    for name, val, target in rows:
        print(f"{name.ljust(w)}  {val.ljust(34)}  {target}")
    summary = {
        "create_to_first_exec_p50_ms": pct(cfe, 50),
        "create_to_first_exec_p99_ms": pct(cfe, 99),
        "sustained_creations_per_s": sus["per_s"],
        "sustained_creations_per_s_settled": sus["per_s_settled"],
        "exec_p50_ms": pct(ex, 50),
        "exec_p99_ms": pct(ex, 99),
        "idle_mib_per_sandbox": results["idle_memory"]["mib_per_sandbox"],
        "idle_charged_mib_per_sandbox": results["idle_memory"]["charged_mib_per_sandbox"],
        "raw_runtime_p50_ms": pct(raw, 50),
        "ratio_vs_raw_runtime": pct(cfe, 50) / pct(raw, 50),
        "podman_p50_ms": pct(pod, 50) if isinstance(pod, list) else None,
    }
    results["summary"] = summary
    out = Path(args.out or RESULTS / ("container_quick.json" if args.quick else "container.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    if not args.home:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
