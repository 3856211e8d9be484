"""How fast this host's CPU runs right now, for benchmarks to print next to their numbers.

This machine is a VM on shared cores: the same code runs up to 2-4x slower from one minute
to the next. Anything CPU-bound (emulated guest code above all) follows it, so benchmarks
record a probe before each batch and report it with the batch."""

from __future__ import annotations

import contextlib
import hashlib
import time

_DATA = b"\0" * (16 << 20)


def host_probe_s() -> float:
    """Seconds for a fixed CPU-bound job (SHA-256 of 16 MiB), best of 3. About 11 ms when
    this host runs at full speed; higher is slower."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        hashlib.sha256(_DATA).digest()
        best = min(best, time.perf_counter() - t)
    return best


def meminfo_kib() -> dict[str, int]:
    """Every field of /proc/meminfo, KiB (page counts as they are)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            with contextlib.suppress(ValueError, IndexError):
                out[name] = int(rest.split()[0])
    return out


def mem_available_kib() -> int:
    """The host's ``MemAvailable`` (/proc/meminfo), KiB; 0 if it cannot be read."""
    return meminfo_kib().get("MemAvailable", 0)
