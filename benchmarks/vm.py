"""Benchmark the microvm tier: cold boot vs template restore, exec round trip, memory per clone.

Run as root (a dsec node)::

    .venv/bin/python benchmarks/vm.py [--runs 7] [--clones 10] [--ksm]

Prints a table and writes ``benchmarks/results/vm.json``. What is measured:

* cold boot: QEMU start to the guest agent answering, no template (private RAM), p50.
* template restore: QEMU start (or a pre-started pool QEMU) to agent ready, incl. the
  clock/RNG/hostname setup, p50; with the pool (default) and without it.
* 8 at once: 8 creates started together, cold and restored; the slowest one's time.
* exec round trip: ``echo hi`` as argv (no shell), p50 over warm execs.
* memory: N idle sandboxes from a template (RAM file shared copy-on-write) against N idle
  cold-booted ones (private RAM). Host memory = sum of the QEMUs' private pages plus, for the
  shared case, the template RAM file once. ``--ksm`` also turns ksmd on for a while and
  measures again (QEMUs are started with PR_SET_MEMORY_MERGE).

Uses ``DSEC_HOME=/tmp/dsec-vmbench`` unless set. Reports whether KVM or TCG ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from dsec.config import Paths
from dsec.errors import DsecError
from dsec.models import ExecRequest
from dsec.privileged.cgroups import CGROUP_ROOT, CONTROLLERS
from dsec.runtimes.base import Handle, SandboxSpec
from dsec.runtimes.microvm import MicroVMConfig, MicroVMRuntime
from dsec.runtimes.vm import VMRuntime

RESULTS = Path(__file__).resolve().parent / "results" / "vm.json"


def busybox_layers(paths: Paths) -> tuple[list[str], list[str]]:
    from dsec.layers.store import LayerStore

    paths.ensure()
    store = LayerStore(paths.layers, paths.scratch)
    try:
        info = store.ensure_image_sync("busybox")
        return [str(store.layer_path(d)) for d in info.layers], list(info.layers)
    finally:
        store.close()


class Bench:
    def __init__(self, paths: Paths, layers: tuple[list[str], list[str]]) -> None:
        self.paths = paths
        self.layers = layers
        self.n = 0

    def spec(self, memory_mb: int = 256) -> SandboxSpec:
        self.n += 1
        return SandboxSpec(
            id=f"sb-bench-{os.getpid()}-{self.n}", tier="microvm", layer_paths=self.layers[0],
            layer_digests=self.layers[1], cpu=1.0, memory_mb=memory_mb, disk_mb=64, pids=256,
            env={}, user=None, workdir="/",
        )  # fmt: skip

    async def runtime(self, **kw: Any) -> MicroVMRuntime:
        rt = MicroVMRuntime(self.paths, MicroVMConfig(**kw))
        await rt.start()
        if not rt.capabilities().available:
            raise SystemExit(f"microvm unavailable: {rt.capabilities().reason}")
        return rt


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def private_bytes(pid: int) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def template_file_bytes(tag: str) -> int:
    """Resident bytes of this node's template RAM files on /dev/shm."""
    return sum(p.stat().st_blocks * 512 for p in Path("/dev/shm").glob(f"dsec-{tag}-*.ram"))


def set_ksm(value: str) -> str:
    """Write /sys/kernel/mm/ksm/run; returns the previous value."""
    ksm = Path("/sys/kernel/mm/ksm/run")
    old = ksm.read_text().strip()
    ksm.write_text(value)
    return old


async def sequential_creates(
    rt: MicroVMRuntime, b: Bench, runs: int, pooled: bool
) -> tuple[list[float], list[float]]:
    ready, total = [], []
    for _ in range(runs):
        if pooled:
            await rt.pool_settled()
        h = await rt.create(b.spec())
        ready.append(rt.last_create["agent_ready_s"])
        total.append(rt.last_create["boot_s"])
        await rt.destroy(h)
    return ready, total


async def parallel_creates(rt: MicroVMRuntime, b: Bench, n: int) -> float:
    t = time.perf_counter()
    hs = await asyncio.gather(*(rt.create(b.spec()) for _ in range(n)))
    dt = time.perf_counter() - t
    await asyncio.gather(*(rt.destroy(h) for h in hs))
    return dt


async def idle_memory(
    rt: MicroVMRuntime, b: Bench, n: int, settle_s: float = 3.0
) -> tuple[list[Handle], int]:
    hs = []
    for _ in range(n):
        hs.append(await rt.create(b.spec()))
    await asyncio.sleep(settle_s)
    total = sum(private_bytes(int(h.state["pid"])) for h in hs)
    return hs, total


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--clones", type=int, default=10)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ksm", action="store_true", help="also measure with ksmd running")
    args = ap.parse_args()

    os.environ.setdefault("DSEC_HOME", "/tmp/dsec-vmbench")
    paths = Paths.from_env()
    b = Bench(paths, busybox_layers(paths))
    res: dict[str, Any] = {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
    }

    cold = await b.runtime(templates=False, pool_size=0)
    res["accel"] = cold.accel
    res["accel_reason"] = cold.accel_reason
    print(f"accelerator: {cold.accel.upper()} ({cold.accel_reason})")
    ready, _ = await sequential_creates(cold, b, max(3, args.runs // 2), False)
    res["cold_boot_ready_s"] = ready
    print(f"cold boot to agent-ready p50 {p50(ready):.3f} s")

    warm = await b.runtime(templates=True, pool_size=0)
    h = await warm.create(b.spec())  # builds the template if missing
    res["template_build_s"] = warm.last_create["template_build_s"]
    # exec round trip on a warm guest
    for _ in range(5):
        await warm.exec(h, ExecRequest(cmd=["echo", "hi"]))
    rtt = []
    for _ in range(40):
        t = time.perf_counter()
        r = await warm.exec(h, ExecRequest(cmd=["echo", "hi"]))
        rtt.append(time.perf_counter() - t)
        assert r.stdout == "hi\n"
    res["exec_echo_s"] = rtt
    await warm.destroy(h)
    ready, total = await sequential_creates(warm, b, args.runs, False)
    res["restore_ready_nopool_s"] = ready
    res["restore_create_nopool_s"] = total
    await warm.close()

    pool = await b.runtime(templates=True, pool_size=2)
    await pool.destroy(await pool.create(b.spec()))
    ready, total = await sequential_creates(pool, b, args.runs, True)
    res["restore_ready_pool_s"] = ready
    res["restore_create_pool_s"] = total
    await pool.close()

    warm = await b.runtime(templates=True, pool_size=0)
    res["parallel_restore_s"] = await parallel_creates(warm, b, args.parallel)
    res["parallel_cold_s"] = await parallel_creates(cold, b, args.parallel)

    # memory: N idle template clones vs N idle cold-booted guests
    hs, clone_private = await idle_memory(warm, b, args.clones)
    tpl_file = template_file_bytes(warm.tag)
    res["clones"] = args.clones
    res["shared_total_bytes"] = clone_private + tpl_file
    res["shared_per_clone_private_bytes"] = clone_private / args.clones
    res["template_ram_file_bytes"] = tpl_file
    if args.ksm:
        old = set_ksm("1")
        try:
            await asyncio.sleep(30)
            res["shared_ksm_total_bytes"] = (
                sum(private_bytes(int(h.state["pid"])) for h in hs) + tpl_file
            )
        finally:
            set_ksm(old)
    await asyncio.gather(*(warm.destroy(h) for h in hs))
    hs, cold_private = await idle_memory(cold, b, args.clones)
    res["unshared_total_bytes"] = cold_private
    await asyncio.gather(*(cold.destroy(h) for h in hs))
    await warm.close()
    await cold.close()
    cold.remove_templates()
    for c in CONTROLLERS:
        for rel in (cold.cgroup_prefix, cold.cgroup_prefix.split("/")[0]):
            with contextlib.suppress(OSError):
                (CGROUP_ROOT / c / rel).rmdir()

    # the vm tier (q35, BIOS boot of the bzImage, qcow2 disk, VGA): cold boot only
    full = VMRuntime(paths, MicroVMConfig())
    await full.start()
    res["vm_tier_boot_ready_s"], res["vm_tier_screenshot_s"] = [], []
    try:
        for _ in range(3):
            h = await full.create(b.spec())
            res["vm_tier_boot_ready_s"].append(full.last_create["agent_ready_s"])
            t = time.perf_counter()
            await full.screenshot(h)
            res["vm_tier_screenshot_s"].append(time.perf_counter() - t)
            await full.destroy(h)
    except DsecError as e:
        res["vm_tier_error"] = e.message
        print(f"vm tier failed: {e.message}")
    await full.close()

    mib = 1 << 20
    cold_p50 = p50(res["cold_boot_ready_s"])
    rows = [
        ("accelerator", res["accel"].upper(), ""),
        ("cold boot -> agent ready p50", f"{cold_p50 * 1000:.0f} ms", ""),
        ("template restore -> agent ready p50 (pool)", f"{p50(res['restore_ready_pool_s']) * 1000:.0f} ms",
         f"{cold_p50 / p50(res['restore_ready_pool_s']):.1f}x faster than cold; target <= 100 ms, >= 15x"),
        ("template restore -> agent ready p50 (no pool)", f"{p50(res['restore_ready_nopool_s']) * 1000:.0f} ms",
         f"{cold_p50 / p50(res['restore_ready_nopool_s']):.1f}x"),
        (f"{args.parallel} at once, restore (all ready)", f"{res['parallel_restore_s']:.2f} s", ""),
        (f"{args.parallel} at once, cold (all ready)", f"{res['parallel_cold_s']:.2f} s", ""),
        ("exec echo round trip p50", f"{p50(res['exec_echo_s']) * 1000:.1f} ms", "target <= 10 ms"),
        (f"host memory, {args.clones} idle clones (shared)", f"{res['shared_total_bytes'] / mib:.0f} MiB",
         f"{res['shared_total_bytes'] / args.clones / mib:.1f} MiB each; target <= 40"),
        (f"host memory, {args.clones} idle cold VMs (unshared)", f"{res['unshared_total_bytes'] / mib:.0f} MiB",
         f"sharing saves {100 * (1 - res['shared_total_bytes'] / res['unshared_total_bytes']):.0f}%; target >= 40%"),
    ]  # fmt: skip
    rows.append(
        ("vm tier (q35) boot -> agent ready p50", f"{p50(res['vm_tier_boot_ready_s']):.2f} s", "")
    )
    rows.append(
        ("vm tier screenshot (PNG) p50", f"{p50(res['vm_tier_screenshot_s']) * 1000:.0f} ms", "")
    )
    if "shared_ksm_total_bytes" in res:
        rows.append(
            ("  ... with ksmd on for 30 s", f"{res['shared_ksm_total_bytes'] / mib:.0f} MiB", "")
        )
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{w}}  {value:>10}  {note}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    asyncio.run(main())
