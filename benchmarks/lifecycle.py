"""RL lifecycle benchmark (issue 6): prints a table, writes benchmarks/results/lifecycle.json.

Measured end to end on real container sandboxes: a ``dsec serve`` child process (apiserver +
edge + container tier) on a free loopback port with its own DSEC_HOME, driven through the
public async SDK (``AsyncSandbox``, ``AsyncJobs``), so every number includes HTTP, the
apiserver, the edge and the runtime:

  * pause / resume latency p50/p99 of one sandbox (``sb.pause()`` / ``sb.resume()``, client
    wall time; the server's own ``last_pause.duration_ms`` alongside)
  * pause / resume of a job of 100 sandboxes (``AsyncJobs.pause/resume``: wall time per call)
  * memory of a paused vs running sandbox with a warm page cache: a sandbox whose image
    stack includes a 100 MB layer reads it (page cache) and holds a small shell heap; the
    ``last_pause`` report and the sandbox's memory cgroup (``memory.usage_in_bytes``, read
    directly) before and after
  * fast-forward rate of the trajectory log: N ``true`` execs, then a new
    ``AsyncSandbox.connect(id, replay=True)`` client repeats them (replayed commands/s), one
    at a time and with 32 in flight; the p50 of a plain ``sb.refresh()`` GET is the HTTP floor
  * snapshot (``pack_diff``) of a 100 MB change written inside the sandbox (``dd`` from
    /dev/urandom), restore-as-new (create with ``layers=[digest]`` to first exec) and fork(4);
    and the snapshot of a 100 MB change that is half random, half text

Each section's failure is recorded in the JSON (``{"error": ...}``) and the run goes on.
``--quick`` (< 60 s): 20 sandboxes in the job, 300 commands, a 40 MB change; it writes
benchmarks/results/lifecycle_quick.json instead.

Usage: .venv/bin/python benchmarks/lifecycle.py [--quick] [--home DIR]   (root)
Targets: pause and resume p50 <= 20 ms; paused <= 25% of running memory; fast-forward
>= 10,000 replayed commands/s; pack_diff of 100 MB <= 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec import AsyncClient, AsyncSandbox
from dsec.runtimes.container.bundle import cgroup_parent
from dsec.sdk.jobs import AsyncJobs
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
WINDOW = 32
"""Calls in flight in the windowed fast-forward."""
HEAP_BYTES = 16 << 20
"""Heap held by an idle shell in the memory measurement, bytes."""
SMALL = {"cpu": 0.05, "memory_mb": 64, "disk_mb": 64}
"""Limits of the sandboxes of the 100-sandbox job (100 of them fit the overcommit caps)."""


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def ms_since(t0: float) -> float:
    """Milliseconds elapsed since the ``time.perf_counter()`` value ``t0``."""
    return (time.perf_counter() - t0) * 1000


class MemoryCgroup:
    """Reads a sandbox's v1 memory cgroup directly (bytes)."""

    def __init__(self, home: Path, sandbox_id: str) -> None:
        self.dir = Path("/sys/fs/cgroup/memory") / cgroup_parent(home) / sandbox_id

    def usage(self) -> int:
        """``memory.usage_in_bytes``, bytes."""
        return int((self.dir / "memory.usage_in_bytes").read_text())

    def stat_mib(self) -> dict[str, float]:
        """cache / rss / shmem / mapped_file of ``memory.stat``, MiB."""
        out: dict[str, float] = {}
        for line in (self.dir / "memory.stat").read_text().splitlines():
            key, val = line.split()
            if key in ("cache", "rss", "shmem", "mapped_file", "swap"):
                out[key] = round(int(val) / MIB, 1)
        return out


async def bench_pause_one(client: AsyncClient, rounds: int) -> dict[str, Any]:
    """Pause then resume one running sandbox ``rounds`` times (after 3 warm-up rounds)."""
    sb = await AsyncSandbox.create(client=client)
    try:
        await sb.commands.run("cat /bin/busybox > /dev/null")
        pauses: list[float] = []
        resumes: list[float] = []
        server_pause: list[float] = []
        for i in range(rounds + 3):
            t0 = time.perf_counter()
            info = await sb.pause()
            p_ms = ms_since(t0)
            t0 = time.perf_counter()
            after = await sb.resume()
            r_ms = ms_since(t0)
            assert info.state == "paused" and after.state == "running", (info.state, after.state)
            if i >= 3:
                pauses.append(p_ms)
                resumes.append(r_ms)
                if info.last_pause is not None:
                    server_pause.append(info.last_pause.duration_ms)
        r = await sb.commands.run("echo alive")
        assert r.stdout == "alive\n", r
        return {
            "sandboxes": 1,
            "rounds": rounds,
            "pause_p50_ms": round(pct(pauses, 50), 2),
            "pause_p99_ms": round(pct(pauses, 99), 2),
            "resume_p50_ms": round(pct(resumes, 50), 2),
            "resume_p99_ms": round(pct(resumes, 99), 2),
            "server_pause_p50_ms": round(pct(server_pause, 50), 2),
        }
    finally:
        await sb.kill()


async def bench_pause_job(client: AsyncClient, n: int, rounds: int) -> dict[str, Any]:
    """A job of ``n`` small sandboxes: wall time of each ``jobs.pause`` / ``jobs.resume`` call."""
    job = f"bench-lifecycle-{os.getpid()}"
    sbs: list[AsyncSandbox] = []
    sem = asyncio.Semaphore(8)

    async def one() -> None:
        async with sem:
            sb = await AsyncSandbox.create(client=client, job=job, **SMALL)  # type: ignore[arg-type]
            sbs.append(sb)
            await sb.commands.run("cat /bin/busybox > /dev/null")

    jobs = AsyncJobs(client=client)
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one() for _ in range(n)))
        create_s = time.perf_counter() - t0
        pauses: list[float] = []
        resumes: list[float] = []
        failures = 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            rp = await jobs.pause(job)
            pauses.append(ms_since(t0))
            t0 = time.perf_counter()
            rr = await jobs.resume(job)
            resumes.append(ms_since(t0))
            failures += sum(not o.ok for o in rp.outcomes.values())
            failures += sum(not o.ok for o in rr.outcomes.values())
            assert len(rp.outcomes) == n and len(rr.outcomes) == n, (len(rp.outcomes), n)
        return {
            "sandboxes": n,
            "rounds": rounds,
            "create_all_s": round(create_s, 2),
            "pause_p50_ms": round(pct(pauses, 50), 2),
            "pause_p99_ms": round(pct(pauses, 99), 2),
            "resume_p50_ms": round(pct(resumes, 50), 2),
            "resume_p99_ms": round(pct(resumes, 99), 2),
            "pause_per_sandbox_ms": round(pct(pauses, 50) / n, 2),
            "failed_outcomes": failures,
        }
    finally:
        await jobs.kill(job)
        await asyncio.gather(*(sb.close() for sb in sbs), return_exceptions=True)


async def bench_trajectory(client: AsyncClient, n: int) -> dict[str, Any]:
    """``n`` live ``true`` execs, then a fresh ``connect(replay=True)`` client repeats them."""
    sb = await AsyncSandbox.create(client=client)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            r = await sb.commands.run("true")
            assert r.exit_code == 0 and not r.replayed, r
        live_s = time.perf_counter() - t0
        again = await AsyncSandbox.connect(sb.id, replay=True, client=client)
        t0 = time.perf_counter()
        replayed = 0
        for _ in range(n):
            r = await again.commands.run("true")
            replayed += r.replayed
        ff_s = time.perf_counter() - t0
        assert replayed == n, f"only {replayed} of {n} calls were replayed"
        # the same, with WINDOW calls in flight (a trainer replaying many rollouts at once)
        window = await AsyncSandbox.connect(sb.id, replay=True, client=client)
        sem = asyncio.Semaphore(WINDOW)

        async def one() -> bool:
            async with sem:
                return (await window.commands.run("true")).replayed

        t0 = time.perf_counter()
        flags = await asyncio.gather(*(one() for _ in range(n)))
        ff_window_s = time.perf_counter() - t0
        assert all(flags), f"only {sum(flags)} of {n} windowed calls were replayed"
        r = await again.commands.run("true")  # the first call past the log runs live
        assert not r.replayed, r
        # the floor of any SDK call: one GET of the sandbox over the same HTTP client
        floor: list[float] = []
        for _ in range(100):
            t0 = time.perf_counter()
            await sb.refresh()
            floor.append(ms_since(t0))
        return {
            "commands": n,
            "live_per_s": round(n / live_s),
            "fast_forward_per_s": round(n / ff_s),
            "fast_forward_ms_per_command": round(ff_s * 1000 / n, 3),
            f"fast_forward_{WINDOW}_in_flight_per_s": round(n / ff_window_s),
            "http_get_p50_ms": round(pct(floor, 50), 2),
        }
    finally:
        await sb.kill()


async def bench_snapshot(client: AsyncClient, mib: int) -> dict[str, Any]:
    """Write ``mib`` MiB of random files in a sandbox, snapshot it, restore it, fork it."""
    disk = mib + 128
    sb = await AsyncSandbox.create(client=client, disk_mb=disk, memory_mb=max(512, disk + 128))
    forks: list[AsyncSandbox] = []
    restored: AsyncSandbox | None = None
    try:
        per = 10
        script = (
            f"mkdir -p /data && for i in $(seq 1 {mib // per}); do "
            f"dd if=/dev/urandom of=/data/blob$i bs=1M count={per} 2>/dev/null || exit 1; done"
        )
        r = await sb.commands.run(script, timeout=300)
        assert r.exit_code == 0, r
        du = await sb.commands.run("du -sm /data")
        t0 = time.perf_counter()
        layer = await sb.snapshot(name=None)
        snap_s = time.perf_counter() - t0
        # restore-as-new: a new sandbox on top of the snapshot, to its first command
        t0 = time.perf_counter()
        restored = await AsyncSandbox.create(
            client=client, layers=[layer.digest], disk_mb=128, memory_mb=max(512, disk + 128)
        )
        r = await restored.commands.run(f"test -f /data/blob{mib // per}")
        restore_ms = ms_since(t0)
        assert r.exit_code == 0, r
        # the same without the new layer: what a plain create-to-first-exec costs here
        t0 = time.perf_counter()
        plain = await AsyncSandbox.create(client=client, disk_mb=128)
        await plain.commands.run("true")
        plain_ms = ms_since(t0)
        await plain.kill()
        t0 = time.perf_counter()
        forks = await sb.fork(4)
        rs = await asyncio.gather(*(f.commands.run("test -d /data") for f in forks))
        fork_ms = ms_since(t0)
        assert all(x.exit_code == 0 for x in rs), rs
        meta = layer.meta.get("pack_diff", {})
        return {
            "change_mib": mib,
            "du_mib": int(du.stdout.split()[0]) if du.stdout else None,
            "pack_s": round(snap_s, 3),
            "server_mkfs_ms": meta.get("mkfs_ms"),
            "server_scan_ms": meta.get("scan_ms"),
            "server_import_ms": meta.get("import_ms"),
            "layer_mib": round(layer.size / MIB, 1),
            "layer_digest": layer.digest,
            "restore_as_new_ms": round(restore_ms, 1),
            "plain_create_first_exec_ms": round(plain_ms, 1),
            "fork4_to_first_exec_ms": round(fork_ms, 1),
        }
    finally:
        for f in forks:
            await f.kill()
        if restored is not None:
            await restored.kill()
        await sb.kill()


async def bench_snapshot_mixed(client: AsyncClient, mib: int) -> dict[str, Any]:
    """pack_diff of a change that is half random bytes, half text (``seq`` output): closer
    to what a build leaves (wheels + sources) than all-random data, which lz4 cannot shrink."""
    disk = mib + 128
    sb = await AsyncSandbox.create(client=client, disk_mb=disk, memory_mb=max(512, disk + 128))
    try:
        half = mib // 2
        script = (
            f"mkdir -p /data && dd if=/dev/urandom of=/data/blob bs=1M count={half} 2>/dev/null"
            f" && seq 1 99999999 | head -c {half * MIB} > /data/text"
        )
        r = await sb.commands.run(script, timeout=300)
        assert r.exit_code == 0, r
        t0 = time.perf_counter()
        layer = await sb.snapshot(name=None)
        snap_s = time.perf_counter() - t0
        meta = layer.meta.get("pack_diff", {})
        return {
            "change_mib": mib,
            "pack_s": round(snap_s, 3),
            "server_mkfs_ms": meta.get("mkfs_ms"),
            "layer_mib": round(layer.size / MIB, 1),
        }
    finally:
        await sb.kill()


async def bench_memory(
    client: AsyncClient, home: Path, data_layer: str, data_mib: int
) -> dict[str, Any]:
    """A sandbox reads ``data_mib`` MiB from a layer (warm page cache) and holds a small shell
    heap; its memory running vs paused (the server's report and the cgroup itself)."""
    sb = await AsyncSandbox.create(client=client, layers=[data_layer], memory_mb=512)
    try:
        cg = MemoryCgroup(home, sb.id)
        r = await sb.commands.run("cat /data/* > /dev/null && cat /data/* > /dev/null")
        assert r.exit_code == 0, r
        # an idle process holding heap (a shell variable), like an agent's REPL: a command
        # left in flight while we measure, pause and resume
        holder = asyncio.create_task(
            sb.commands.run(
                f"x=$(head -c {HEAP_BYTES} /dev/zero | tr '\\0' a); echo held; sleep 120; echo done",
                timeout=300,
            )
        )
        await asyncio.sleep(2.0)
        procs = await sb.commands.run("ps | grep -c 'sleep 120'")
        running = cg.usage()
        running_stat = cg.stat_mib()
        info = await sb.pause()
        paused = cg.usage()
        paused_stat = cg.stat_mib()
        rep = info.last_pause
        await sb.resume()
        r = await sb.commands.run("cat /data/blob1 | wc -c")
        assert r.exit_code == 0, r
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        return {
            "case": f"{data_mib} MiB read from a layer + {HEAP_BYTES / MIB:.0f} MiB shell heap",
            "heap_holder_running": procs.stdout.strip() not in ("", "0", "1"),
            "cgroup_running_mib": round(running / MIB, 1),
            "cgroup_paused_mib": round(paused / MIB, 1),
            "cgroup_held_fraction": round(paused / running, 3) if running else None,
            "cgroup_running_stat_mib": running_stat,
            "cgroup_paused_stat_mib": paused_stat,
            "report_before_mib": round(rep.memory_before_bytes / MIB, 1) if rep else None,
            "report_after_mib": round(rep.memory_after_bytes / MIB, 1) if rep else None,
            "report_held_fraction": (
                round(rep.memory_after_bytes / rep.memory_before_bytes, 3)
                if rep and rep.memory_before_bytes
                else None
            ),
            "report_method": rep.method if rep else None,
            "report_duration_ms": rep.duration_ms if rep else None,
            "report_notes": rep.notes if rep else [],
        }
    finally:
        await sb.kill()


async def run(url: str, api_key: str, home: Path, quick: bool) -> dict[str, Any]:
    """Every measurement, in order; each section's failure is recorded, not fatal."""
    results: dict[str, Any] = {"quick": quick}
    many = 20 if quick else 100
    change = 40 if quick else 100
    steps: list[tuple[str, Any]] = [
        ("pause_1", lambda c: bench_pause_one(c, 15 if quick else 50)),
        ("trajectory", lambda c: bench_trajectory(c, 300 if quick else 2000)),
        ("snapshot", lambda c: bench_snapshot(c, change)),
        ("snapshot_mixed", lambda c: bench_snapshot_mixed(c, change)),
        (f"pause_job_{many}", lambda c: bench_pause_job(c, many, 4 if quick else 15)),
    ]
    async with AsyncClient(url, api_key) as client:
        for key, fn in steps:
            t0 = time.perf_counter()
            try:
                results[key] = await fn(client)
            except Exception as e:  # recorded in the JSON and shown in the table
                results[key] = {"error": repr(e)}
            print(f"  {key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            if key == "snapshot" and "layer_digest" in results[key]:
                t0 = time.perf_counter()
                try:
                    results["memory"] = await bench_memory(
                        client, home, results[key]["layer_digest"], change
                    )
                except Exception as e:
                    results["memory"] = {"error": repr(e)}
                print(f"  memory: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return results


def verdict(value: Any, ok: bool) -> str:
    return f"{value}  {'OK' if ok else 'MISS'}"


def print_table(res: dict[str, Any]) -> None:
    """The table: what, target, measured."""
    rows: list[tuple[str, str, str]] = []

    def get(key: str) -> dict[str, Any]:
        v = res.get(key, {})
        return v if isinstance(v, dict) else {}

    p1 = get("pause_1")
    if "error" in p1:
        rows.append(("pause/resume, 1 sandbox", "", p1["error"][:60]))
    elif p1:
        rows.append((
            "pause, 1 sandbox, p50 / p99 ms", "<= 20 ms",
            verdict(f"{p1['pause_p50_ms']} / {p1['pause_p99_ms']}", p1["pause_p50_ms"] <= 20),
        ))  # fmt: skip
        rows.append((
            "resume, 1 sandbox, p50 / p99 ms", "<= 20 ms",
            verdict(f"{p1['resume_p50_ms']} / {p1['resume_p99_ms']}", p1["resume_p50_ms"] <= 20),
        ))  # fmt: skip
    for key in [k for k in res if k.startswith("pause_job_")]:
        pj = get(key)
        if "error" in pj:
            rows.append((key, "", pj["error"][:60]))
            continue
        n = pj["sandboxes"]
        rows.append((f"jobs.pause, {n} sandboxes, p50 / p99 ms", "",
                     f"{pj['pause_p50_ms']} / {pj['pause_p99_ms']}"))  # fmt: skip
        rows.append((f"jobs.resume, {n} sandboxes, p50 / p99 ms", "",
                     f"{pj['resume_p50_ms']} / {pj['resume_p99_ms']}"))  # fmt: skip
        if pj["failed_outcomes"]:
            rows.append(("  failed per-sandbox outcomes", "0", str(pj["failed_outcomes"])))
    m = get("memory")
    if "error" in m:
        rows.append(("paused vs running memory", "", m["error"][:60]))
    elif m:
        f = m["cgroup_held_fraction"]
        rows.append((
            "paused/running, memory cgroup (MiB)", "<= 25 %",
            verdict(f"{m['cgroup_running_mib']} -> {m['cgroup_paused_mib']} ({f:.0%})", f <= 0.25),
        ))  # fmt: skip
        if m["report_held_fraction"] is not None:
            rows.append((
                "paused/running, last_pause report (MiB)", "",
                f"{m['report_before_mib']} -> {m['report_after_mib']} "
                f"({m['report_held_fraction']:.0%})",
            ))  # fmt: skip
    t = get("trajectory")
    if "error" in t:
        rows.append(("trajectory fast-forward", "", t["error"][:60]))
    elif t:
        rows.append(("live `true` execs/s", "", str(t["live_per_s"])))
        rows.append((
            f"fast-forward (replay=True), {t['commands']} cmds", ">= 10,000/s",
            verdict(f"{t['fast_forward_per_s']}/s", t["fast_forward_per_s"] >= 10_000),
        ))  # fmt: skip
        w = t[f"fast_forward_{WINDOW}_in_flight_per_s"]
        rows.append((f"fast-forward, {WINDOW} calls in flight", ">= 10,000/s",
                     verdict(f"{w}/s", w >= 10_000)))  # fmt: skip
        rows.append(("HTTP floor: sb.refresh() p50 ms", "", str(t["http_get_p50_ms"])))
    s = get("snapshot")
    if "error" in s:
        rows.append(("snapshot", "", s["error"][:60]))
    elif s:
        rows.append((
            f"snapshot (pack_diff) of {s['change_mib']} MiB, s", "<= 2 s",
            verdict(s["pack_s"], s["pack_s"] <= 2),
        ))  # fmt: skip
        sm = get("snapshot_mixed")
        if "pack_s" in sm:
            rows.append((
                "  same, half random / half text, s", "<= 2 s",
                verdict(f"{sm['pack_s']} (layer {sm['layer_mib']} MiB)", sm["pack_s"] <= 2),
            ))  # fmt: skip
        elif sm:
            rows.append(("  same, half random / half text", "", str(sm.get("error"))[:60]))
        rows.append(("restore-as-new (create -> first exec) ms", "",
                     f"{s['restore_as_new_ms']} (plain {s['plain_create_first_exec_ms']})"))  # fmt: skip
        rows.append(
            ("fork(4) (snapshot + 4 creates) -> exec ms", "", str(s["fork4_to_first_exec_ms"]))
        )
    print(f"{'what':<46}{'target':<14}measured")
    for what, target, measured in rows:
        print(f"{what:<46}{target:<14}{measured}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 20 sandboxes, 40 MB")
    ap.add_argument("--home", default=None, help="DSEC_HOME of the server (default: a temp dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (dsec serve runs containers)")
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-lifecycle-")).resolve()
    t0 = time.perf_counter()
    try:
        with ServeProcess(home) as srv:
            results = asyncio.run(run(srv.url, srv.api_key, home, args.quick))
    finally:
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    name = "lifecycle_quick.json" if args.quick else "lifecycle.json"
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"(total {results['total_s']} s; wrote {RESULTS / name})")


if __name__ == "__main__":
    main()
