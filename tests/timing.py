"""Time budgets for tests, scaled to how fast this machine runs now: the one place they come from.

A test asserts a contract (order, completeness, that an event happened), never how fast the
scheduler was. Where it must bound a wait (a time-out that has to fire, a kill that must not
hang, an image build), the bound is written for an idle machine at full speed and passed
through :func:`budget`, which stretches it by :func:`slowness`:

* the CPU probe of ``benchmarks/hostprobe.py`` (SHA-256 of 16 MiB, best of 3: ~11 ms on this
  kind of machine at full speed; twice that is a machine running at half speed), and
* how crowded the cores are: the test workers of this run plus whatever else kept the CPUs
  busy while the probe ran, divided by the cores.

``DSEC_TEST_SLOWNESS`` overrides the measured factor (the main pytest process measures it once
and hands it to its xdist workers through that variable, so every worker scales alike).

pytest-timeout's limits (the ini default and every ``@pytest.mark.timeout``) are scaled by the
same factor in ``tests/conftest.py``.

Example::

    from tests.timing import budget

    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sb.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < budget(10)  # the time-out fired; 30 s would mean it did not
"""

from __future__ import annotations

import os
import time

from benchmarks.hostprobe import host_probe_s

ENV = "DSEC_TEST_SLOWNESS"
REFERENCE_PROBE_S = 0.011
"""The probe's time on this kind of machine, idle, at full speed."""
MAX_SLOWNESS = 8.0


def _busy_cpus(interval_s: float = 0.3) -> float:
    """CPUs kept busy by everything on the machine over ``interval_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(interval_s)
    total1, idle1 = sample()
    total = total1 - total0
    if total <= 0:
        return 0.0
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / total)


def measure(workers: int = 1) -> float:
    """The slowness factor (>= 1) of this machine now, for ``workers`` test processes."""
    cores = os.cpu_count() or 1
    cpu = host_probe_s() / REFERENCE_PROBE_S
    crowd = (workers + _busy_cpus()) / cores
    return round(min(MAX_SLOWNESS, max(1.0, cpu) * max(1.0, crowd)), 2)


_cached: float | None = None


def slowness() -> float:
    """The factor budgets are stretched by: ``$DSEC_TEST_SLOWNESS``, else measured once."""
    global _cached
    if _cached is None:
        env = os.environ.get(ENV)
        _cached = max(1.0, float(env)) if env else measure()
    return _cached


def budget(seconds: float) -> float:
    """``seconds`` (what the wait takes on an idle machine at full speed, with margin)
    stretched for this machine now."""
    return seconds * slowness()


def vm_boot_budgets() -> dict[str, float]:
    """The VM tiers' boot time-outs (``MicroVMConfig``) stretched like every other bound: a
    TCG cold boot that takes 9 s on an idle machine took over 60 s beside the rest of the
    suite and a QEMU host guest."""
    return {"cold_boot_timeout_s": budget(60.0), "restore_timeout_s": budget(30.0)}
