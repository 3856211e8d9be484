"""Run a script from a mount namespace made on each CPU in turn (root tests of namespace pins).

Linux 6.18 numbers mount namespaces out of per-CPU batches and refuses (EINVAL) the pin of a
namespace numbered below the namespace the bind is made in: whether a pin takes depends on
the CPUs two namespaces were made on. A script run once from a namespace made on each CPU
meets both orders. The script resets its affinity to every CPU first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.timing import budget

ANY_CPU = "import os; os.sched_setaffinity(0, range(os.cpu_count() or 1))\n"


def from_each_cpu(
    script: str, base: Path, propagation: str, *args: str
) -> dict[int, tuple[str, str]]:
    """Run ``script`` (``sys.argv[1]``: a directory of its own, then ``args``) in a new mount
    namespace of ``propagation`` made on each CPU; each CPU's stdout (stripped) and stderr.
    Fails on an error."""
    out: dict[int, tuple[str, str]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        proc = subprocess.run(
            [
                *("taskset", "--cpu-list", str(cpu), "unshare", "--mount"),
                *("--propagation", propagation, sys.executable, "-c", ANY_CPU + script),
                *(str(base / str(cpu)), *args),
            ],
            capture_output=True,
            text=True,
            timeout=budget(300),
            cwd=Path(__file__).resolve().parents[1],
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[cpu] = proc.stdout.strip(), proc.stderr[-2000:]
    return out
