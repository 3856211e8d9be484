"""Pause/resume of a real cgroup: freeze, page-cache reclaim, prefetch, thaw (root)."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.errors import SandboxNotFound
from dsec.privileged.cgroups import Cgroup, cgroup
from dsec.runtimes.container.pause import (
    compressed_swap_status,
    memory_stat,
    pause,
    resume,
)

pytestmark = pytest.mark.root

CACHE_MB = 96

_CHILD = r"""
import os, sys, time
sys.stdin.readline()                         # the test has moved it into the cgroup
with open(sys.argv[1], "rb") as f:          # warm page cache, charged to this cgroup
    while f.read(1 << 20):
        pass
heap = bytearray(os.urandom(1 << 20) * 8)   # 8 MiB anonymous
def beat(n):
    with open(sys.argv[2] + ".tmp", "w") as f:  # renamed: a freeze mid-write never
        f.write(str(n))                          # leaves the beat file empty
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
beat(0)                                      # the file exists before "ready": a freeze
print("ready", flush=True)                   # right after it still finds a beat
n = 0
while True:                                  # a heartbeat that stops while frozen
    n += 1
    beat(n)
    time.sleep(0.002)
"""


@pytest.fixture
def sandbox_cgroup(tmp_path: Path) -> Iterator[tuple[Cgroup, Path]]:
    data = tmp_path / "data.bin"
    with open(data, "wb") as f:
        for _ in range(CACHE_MB):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        # drop it from the page cache so the child's reads charge the child's cgroup
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cg = cgroup(f"dsec-rltest-{os.getpid()}/sb-pause")
    cg.create()
    cg.set_memory(1 << 30)
    beat = tmp_path / "beat"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(data), str(beat)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        cg.attach(proc.pid)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "ready\n"
        yield cg, beat
    finally:
        proc.kill()
        cg.thaw()  # a test that failed while frozen: a frozen child only dies once thawed
        proc.communicate()  # waits, closes its pipes
        cgroup(cg.rel.split("/")[0]).remove()  # the parent, the sandbox's cgroup first


def _beat(p: Path) -> int:
    for _ in range(100):
        try:
            return int(p.read_text())
        except ValueError:  # caught mid-write
            time.sleep(0.001)
    raise AssertionError("no heartbeat")


async def test_pause_reclaims_page_cache_and_stops_tasks(
    sandbox_cgroup: tuple[Cgroup, Path],
) -> None:
    cg, beat = sandbox_cgroup
    running = memory_stat(cg)
    assert running.cache >= (CACHE_MB - 8) << 20, running.mib()
    rep = await pause(cg)
    assert cg.is_frozen()
    assert rep.reclaim_method in ("force_empty", "memory.reclaim"), rep.notes  # v1, v2
    assert rep.after.cache < rep.before.cache * 0.1, (rep.before.mib(), rep.after.mib())
    # warm page cache ~96 MiB, ~8 MiB heap + the interpreter: a paused sandbox holds little
    assert rep.held_fraction <= 0.25, rep.to_dict()
    assert rep.compressed_swap == compressed_swap_status().kind
    b1 = _beat(beat)
    await asyncio.sleep(0.05)
    assert _beat(beat) == b1, "a frozen task kept running"
    res = await resume(cg, prefetch=True)
    assert res.was_frozen and not cg.freeze_requested()
    assert res.prefetched_files >= 1  # at least the python binary is mapped
    deadline = time.monotonic() + budget(5)
    while _beat(beat) == b1:
        assert time.monotonic() < deadline, "the task did not run after resume"
        await asyncio.sleep(0.01)
    print("pause", rep.to_dict(), "resume", res.to_dict())


async def test_pause_resume_cycles_and_idempotence(sandbox_cgroup: tuple[Cgroup, Path]) -> None:
    """Repeated pause/resume cycles each freeze and thaw (their latency, target p50 <= 20 ms,
    is measured by benchmarks/lifecycle.py, not asserted here)."""
    cg, _ = sandbox_cgroup
    pauses, resumes = [], []
    for _ in range(15):
        t0 = time.perf_counter()
        assert not (await pause(cg)).was_frozen and cg.is_frozen()
        pauses.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        assert (await resume(cg, prefetch=True)).was_frozen and not cg.freeze_requested()
        resumes.append((time.perf_counter() - t0) * 1000)
    p50p, p50r = statistics.median(pauses), statistics.median(resumes)
    print(f"pause p50 {p50p:.2f} ms, resume p50 {p50r:.2f} ms")
    # idempotent: pausing twice and resuming twice are fine
    await pause(cg)
    again = await pause(cg)
    assert again.was_frozen and cg.is_frozen()
    await resume(cg, prefetch=False)
    second = await resume(cg, prefetch=False)
    assert not second.was_frozen and not cg.freeze_requested()


async def test_missing_cgroup_is_sandbox_not_found() -> None:
    gone = cgroup(f"dsec-rltest-{os.getpid()}-missing/sb")
    with pytest.raises(SandboxNotFound):
        await pause(gone)
    with pytest.raises(SandboxNotFound):
        await resume(gone, prefetch=True)


def test_compressed_swap_detection(tmp_path: Path) -> None:
    proc, sysfs = tmp_path / "proc", tmp_path / "sys"
    (sysfs / "module/zswap/parameters").mkdir(parents=True)
    proc.mkdir()
    header = "Filename\tType\tSize\tUsed\tPriority\n"
    (sysfs / "module/zswap/parameters/enabled").write_text("N\n")
    (proc / "swaps").write_text(header)
    assert compressed_swap_status(proc, sysfs).kind == "none"
    (proc / "swaps").write_text(header + "/dev/vdb partition 1024 0 -2\n")
    assert compressed_swap_status(proc, sysfs).kind == "disk"
    (sysfs / "module/zswap/parameters/enabled").write_text("Y\n")
    assert compressed_swap_status(proc, sysfs).usable
    (proc / "swaps").write_text(header + "/dev/zram0 partition 1024 0 100\n")
    assert compressed_swap_status(proc, sysfs).kind == "zram"
