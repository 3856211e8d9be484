"""RL lifecycle benchmark (issue 6): prints a table, writes benchmarks/results/lifecycle.json.

Measured on the components themselves (bare cgroups with real processes, a real overlay of
EROFS layers, the real trajectory database), so the numbers isolate each mechanism:

  * pause / resume latency p50/p99 for 1 sandbox and for 100 sandboxes paused at once
    (each "sandbox" = a cgroup holding a shell that warmed 4 MiB of its own page cache)
  * memory of a paused vs running sandbox with a warm page cache: a Python process with a
    32 MiB heap that read 128 MiB of files; and, honestly, the same with 32 MiB written
    to a tmpfs (a sandbox's upper layer is tmpfs: shmem, not reclaimable without swap)
  * trajectory log: new entries/s (begin + commit, durable) and fast-forward entries/s
  * pack_diff of a 100 MB change, and restore-as-new (mount the layer + assemble the overlay)

Usage: .venv/bin/python benchmarks/lifecycle.py [--quick] [--home DIR]   (root)
Targets: pause and resume p50 <= 20 ms; paused <= 25% of running memory; fast-forward
>= 10,000 entries/s; pack_diff of 100 MB <= 2 s.
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

from dsec.edge.trajectory import TrajectoryLog
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import assemble_rootfs, teardown_rootfs, upper_dir
from dsec.layers.snapshot import pack_diff
from dsec.layers.store import LayerStore
from dsec.privileged.cgroups import CONTROLLERS, CgroupV1
from dsec.runtimes.container.pause import compressed_swap_status, pause, resume

RESULTS = Path(__file__).resolve().parent / "results"


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def make_file(path: Path, mib: int) -> None:
    """A file of ``mib`` MiB that is *not* in the page cache (so a reader gets charged)."""
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


_JOIN = "; ".join(f"echo $$ > /sys/fs/cgroup/{c}/$CG/cgroup.procs" for c in CONTROLLERS)


def spawn_shell(cg: CgroupV1, data: Path) -> subprocess.Popen[bytes]:
    """A shell that joins ``cg``, reads ``data`` (page cache) and sleeps."""
    script = f"{_JOIN}; cat {data} > /dev/null; echo ready; exec sleep 3600"
    p = subprocess.Popen(
        ["/bin/sh", "-c", script], env={"CG": cg.rel, "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


_PY_CHILD = r"""
import os, sys
for c in sys.argv[3].split(","):
    open(f"/sys/fs/cgroup/{c}/{sys.argv[1]}/cgroup.procs", "w").write(str(os.getpid()))
for name in sys.argv[2].split(","):
    with open(name, "rb") as f:
        while f.read(1 << 20):
            pass
heap = bytearray(os.urandom(1 << 20) * 32)
if len(sys.argv) > 4:   # write 32 MiB to a tmpfs: shmem, like a sandbox's upper layer
    with open(sys.argv[4], "wb") as f:
        f.write(os.urandom(32 << 20))
print("ready", flush=True)
sys.stdin.read()
"""


async def bench_pause(base: str, tmp: Path, n: int, rounds: int) -> dict[str, Any]:
    cgs = [CgroupV1(f"{base}/n{n}-{i}") for i in range(n)]
    procs = []
    try:
        for i, cg in enumerate(cgs):
            cg.create()
            data = tmp / f"warm-{n}-{i}"
            make_file(data, 4)
            procs.append(spawn_shell(cg, data))
        pauses: list[float] = []
        resumes: list[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            reps = await asyncio.gather(*(pause(cg) for cg in cgs))
            t1 = time.perf_counter()
            await asyncio.gather(*(resume(cg, prefetch=True) for cg in cgs))
            t2 = time.perf_counter()
            if n == 1:
                pauses.append(reps[0].total_ms)
                resumes.append((t2 - t1) * 1000)
            else:  # the whole job: wall time of pausing all n at once
                pauses.append((t1 - t0) * 1000)
                resumes.append((t2 - t1) * 1000)
        return {
            "sandboxes": n,
            "pause_p50_ms": round(pct(pauses, 50), 2),
            "pause_p99_ms": round(pct(pauses, 99), 2),
            "resume_p50_ms": round(pct(resumes, 50), 2),
            "resume_p99_ms": round(pct(resumes, 99), 2),
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for cg in cgs:
            cg.remove()


async def bench_memory(base: str, tmp: Path, with_tmpfs: bool) -> dict[str, Any]:
    cg = CgroupV1(f"{base}/mem-{int(with_tmpfs)}")
    cg.create()
    files = []
    for i in range(4):
        f = tmp / f"cache-{int(with_tmpfs)}-{i}"
        make_file(f, 32)
        files.append(str(f))
    shm = tmp / "shm"
    argv = [sys.executable, "-c", _PY_CHILD, cg.rel, ",".join(files), ",".join(CONTROLLERS)]
    if with_tmpfs:
        shm.mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "bench", str(shm)], check=True)
        argv.append(str(shm / "upper-file"))
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        rep = await pause(cg)
        await resume(cg, prefetch=True)
        return {
            "case": "warm cache + 32 MiB heap" + (" + 32 MiB tmpfs writes" if with_tmpfs else ""),
            "running_mib": rep.before.mib(),
            "paused_mib": rep.after.mib(),
            "held_fraction": round(rep.held_fraction, 3),
            "reclaim_method": rep.reclaim_method,
            "compressed_swap": rep.compressed_swap,
        }
    finally:
        p.kill()
        p.wait()
        cg.remove()
        if with_tmpfs:
            subprocess.run(["umount", str(shm)], check=False)


def bench_trajectory(tmp: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"entries": n}
    for sync in ("NORMAL", "FULL"):
        log = TrajectoryLog(tmp / f"traj-{sync}.db", synchronous=sync)  # type: ignore[arg-type]
        reqs = [{"cmd": f"python step.py {i}", "timeout_s": 60.0} for i in range(1, n + 1)]
        t0 = time.perf_counter()
        for i, req in enumerate(reqs, 1):
            log.begin("sb-bench", i, None, "exec", req)
            log.commit("sb-bench", i, {"exit_code": 0, "stdout": f"reward {i}\n"}, {"run_ms": 1})
        out[f"new_per_s_{sync.lower()}"] = round(n / (time.perf_counter() - t0))
        if sync == "NORMAL":
            t0 = time.perf_counter()
            for i, req in enumerate(reqs, 1):
                assert log.begin("sb-bench", i, None, "exec", req).kind == "replay"
            out["fast_forward_per_s"] = round(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            lines = sum(1 for _ in log.export_jsonl("sb-bench"))
            out["export_lines_per_s"] = round(lines / (time.perf_counter() - t0))
        log.close()
    return out


def bench_pack_diff(tmp: Path, mib: int) -> dict[str, Any]:
    store = LayerStore(tmp / "layers", tmp / "scratch")
    mounts = LayerMounts(tmp / "mnt")
    base = tmp / "base"
    (base / "srv").mkdir(parents=True)
    (base / "srv/readme").write_text("base\n")
    lower = store.build_layer(base, "base", name="bench-base")
    sb1, sb2 = tmp / "sb1", tmp / "sb2"
    acquired = []
    try:
        root = assemble_rootfs(
            sb1, [mounts.acquire(lower.digest, store.layer_path(lower.digest))], disk_mb=mib + 64
        )
        acquired.append(lower.digest)
        # half incompressible, half text-like: what a build leaves (wheels + sources)
        text = b"".join(b"def f%d(x):\n    return x * %d\n" % (i, i) for i in range(40000))
        for i in range(mib // 2):
            d = root / "work" / f"d{i % 10}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"blob{i}.bin").write_bytes(os.urandom(1 << 20))
            (d / f"src{i}.py").write_bytes(text[: 1 << 20])
        t0 = time.perf_counter()
        layer = pack_diff(
            upper_dir(sb1), store, name="bench-snap", secret_values=["not-present-token"]
        )
        pack_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        lowers = [mounts.acquire(d, store.layer_path(d)) for d in (lower.digest, layer.digest)]
        acquired += [lower.digest, layer.digest]
        root2 = assemble_rootfs(sb2, lowers, disk_mb=64)
        restore_ms = (time.perf_counter() - t0) * 1000
        assert (root2 / "work/d0/src0.py").read_bytes() == text[: 1 << 20]
        return {
            "change_mib": mib,
            "pack_s": round(pack_s, 3),
            "mkfs_ms": layer.meta["pack_diff"]["mkfs_ms"],
            "scan_ms": layer.meta["pack_diff"]["scan_ms"],
            "import_ms": layer.meta["pack_diff"]["import_ms"],
            "layer_mib": round(layer.size / (1 << 20), 1),
            "restore_as_new_ms": round(restore_ms, 2),
        }
    finally:
        for sdir in (sb2, sb1):
            teardown_rootfs(sdir)
        for d in acquired:
            mounts.release(d)
        store.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 20 sandboxes, 40 MB")
    ap.add_argument("--home", default=None, help="scratch dir (default: a temp dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (cgroups, mounts)")
    tmp = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-lifecycle-"))
    os.makedirs(tmp, exist_ok=True)
    base = f"dsec-bench-lifecycle-{os.getpid()}"
    many = 20 if args.quick else 100
    results: dict[str, Any] = {"compressed_swap": compressed_swap_status().detail}
    try:
        results["pause_1"] = await bench_pause(base, tmp, 1, 20 if args.quick else 50)
        results[f"pause_{many}"] = await bench_pause(base, tmp, many, 5 if args.quick else 15)
        results["memory"] = [
            await bench_memory(base, tmp, False),
            await bench_memory(base, tmp, True),
        ]
        results["trajectory"] = bench_trajectory(tmp, 2000 if args.quick else 10000)
        results["pack_diff"] = bench_pack_diff(tmp, 40 if args.quick else 100)
    finally:
        for c in CONTROLLERS:
            p = Path("/sys/fs/cgroup") / c / base
            if p.exists():
                p.rmdir()
        if args.home is None:
            shutil.rmtree(tmp, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lifecycle.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"compressed swap: {results['compressed_swap']}")
    print(f"{'what':<44}{'result':>40}")
    for k in ("pause_1", f"pause_{many}"):
        r = results[k]
        print(
            f"{'pause p50/p99 ms, ' + str(r['sandboxes']) + ' sandbox(es)':<44}{r['pause_p50_ms']:>20} / {r['pause_p99_ms']:<17}"
        )
        print(
            f"{'resume p50/p99 ms, ' + str(r['sandboxes']) + ' sandbox(es)':<44}{r['resume_p50_ms']:>20} / {r['resume_p99_ms']:<17}"
        )
    for m in results["memory"]:
        line = f"{m['running_mib']['usage']} -> {m['paused_mib']['usage']} MiB ({m['held_fraction']:.0%})"
        print(f"{m['case']:<44}{line:>40}")
    t = results["trajectory"]
    print(
        f"{'trajectory new entries/s (NORMAL / FULL)':<44}{t['new_per_s_normal']:>20} / {t['new_per_s_full']:<17}"
    )
    print(f"{'trajectory fast-forward entries/s':<44}{t['fast_forward_per_s']:>40}")
    pdr = results["pack_diff"]
    print(f"{'pack_diff s (' + str(pdr['change_mib']) + ' MiB change)':<44}{pdr['pack_s']:>40}")
    print(f"{'restore-as-new ms (mount + overlay)':<44}{pdr['restore_as_new_ms']:>40}")


if __name__ == "__main__":
    asyncio.run(main())
