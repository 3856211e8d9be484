"""Kernel samepage merging (KSM) controls for the VM tiers.

QEMU guest RAM is marked mergeable (memory backend ``merge=on``, and the launcher's
``prctl(PR_SET_MEMORY_MERGE)`` for the whole process); ``ksmd`` does the merging only while
``/sys/kernel/mm/ksm/run`` is 1. That switch is node policy; :func:`ksmd_acquire` turns it on
for a runtime configured to (``MicroVMConfig.ksmd``) and :func:`ksmd_release` puts the
previous values back when the last user is gone.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

__all__ = ["KSM_SYSFS", "ksm_stats", "ksmd_acquire", "ksmd_release", "ksmd_set", "wait_ksm_settled"]

KSM_SYSFS = Path("/sys/kernel/mm/ksm")

_users = 0
_saved: dict[str, str] = {}


def _read(name: str) -> str:
    return (KSM_SYSFS / name).read_text().strip()


def ksmd_set(run: int, pages_to_scan: int | None = None) -> dict[str, str]:
    """Write ``run`` (0 stop, 1 merge) and ``pages_to_scan``; returns the previous values."""
    prev = {"run": _read("run"), "pages_to_scan": _read("pages_to_scan")}
    if pages_to_scan is not None:
        (KSM_SYSFS / "pages_to_scan").write_text(str(pages_to_scan))
    (KSM_SYSFS / "run").write_text(str(run))
    return prev


def ksmd_acquire(pages_to_scan: int) -> bool:
    """Turn ksmd on (first user saves the previous settings). False if there is no KSM."""
    global _users, _saved
    if not (KSM_SYSFS / "run").exists():
        return False
    if _users == 0:
        try:
            _saved = ksmd_set(1, pages_to_scan)
        except OSError:
            return False
    _users += 1
    return True


def ksmd_release() -> None:
    """Drop one user; the last one restores ``run`` and ``pages_to_scan`` as they were."""
    global _users
    if _users == 0:
        return
    _users -= 1
    if _users == 0 and _saved:
        with contextlib.suppress(OSError):
            (KSM_SYSFS / "pages_to_scan").write_text(_saved["pages_to_scan"])
            (KSM_SYSFS / "run").write_text(_saved["run"])


def ksm_stats() -> dict[str, int]:
    """ksmd counters: pages_shared, pages_sharing, full_scans, ... (0 where absent)."""
    out: dict[str, int] = {}
    for name in ("run", "pages_shared", "pages_sharing", "pages_unshared", "full_scans",
                 "pages_to_scan", "sleep_millisecs"):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            out[name] = int(_read(name))
    return out


def wait_ksm_settled(
    timeout_s: float, min_full_scans: int = 2, poll_s: float = 0.5
) -> dict[str, int]:
    """Wait until ksmd has done ``min_full_scans`` more full scans and ``pages_sharing``
    stopped growing (less than 1% between two polls), or ``timeout_s`` seconds passed.
    Returns the last counters plus ``settled`` (1/0) and ``waited_ms``."""
    t0 = time.monotonic()
    start = ksm_stats()
    last = start
    while True:
        time.sleep(poll_s)
        now = ksm_stats()
        scans = now.get("full_scans", 0) - start.get("full_scans", 0)
        grew = now.get("pages_sharing", 0) - last.get("pages_sharing", 0)
        stable = grew <= max(1, last.get("pages_sharing", 0) // 100)
        waited = time.monotonic() - t0
        if (scans >= min_full_scans and stable) or waited > timeout_s:
            return {**now, "settled": int(scans >= min_full_scans and stable),
                    "waited_ms": int(waited * 1000)}  # fmt: skip
        last = now
