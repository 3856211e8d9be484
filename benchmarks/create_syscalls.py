"""Kernel-lock round trips per sandbox (issue 31): what one create + exec + kill costs in the
operations the kernel serialises node-wide.

Each ``cgroup.procs`` write and cgroup mkdir/rmdir holds the kernel's ``cgroup_mutex`` (a v1
``cgroup.procs`` write through an RCU grace period); every mount and unmount takes the
mount namespace semaphore. Under a burst of creations these queue behind each other, so
their number per sandbox is the cost that grows with concurrency. This counts them with
``strace -f`` on a ``dsec serve`` child (every thread and every process it starts: crun,
the containers' inits, exec servers), over ``--n`` sequential create + ``true`` + kill
cycles after a warm-up, with the warm pool on (its refills are counted: they are the
creations' work moved ahead) and off. strace slows the processes it traces: the counts are
what matters, not the times.

Usage: python benchmarks/create_syscalls.py [--n 20] [--label after]
Writes benchmarks/results/create_syscalls.json (the label's entry; others are kept).
Needs strace (``apt install strace``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if "DSEC_BENCH_SRC" not in os.environ:  # else: the dsec under test is on PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec import Sandbox
from dsec.server import ServeProcess

RESULTS = Path(__file__).resolve().parent / "results"
TRACED = "mkdir,mkdirat,rmdir,unlinkat,mount,umount2,write,pwrite64,clone,clone3,fork,vfork"
_CALL = re.compile(r"^\d+\s+(\w+)\((.*)")


def classify(line: str) -> str | None:
    """The category of one strace line (None: not counted)."""
    m = _CALL.match(line)
    if not m or "= -1" in line:
        return None
    name, rest = m.groups()
    cg = "/sys/fs/cgroup" in rest
    if name in ("write", "pwrite64"):
        if cg and ("cgroup.procs>" in rest or "/tasks>" in rest):
            return "cgroup.procs writes"
        return "other cgroup writes" if cg else None
    if name in ("mkdir", "mkdirat") and cg:
        return "cgroup mkdir"
    if (name == "rmdir" or (name == "unlinkat" and "AT_REMOVEDIR" in rest)) and cg:
        return "cgroup rmdir"
    if name == "mount":
        return "mounts"
    if name == "umount2":
        return "unmounts"
    if name in ("clone", "clone3", "fork", "vfork"):
        return "processes started"
    return None


def measure(pool: bool, n: int) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-sc-"))
    trace = home / "trace"
    env = {"DSEC_CONTAINER_POOL": "1" if pool else "0"}
    try:
        with ServeProcess(home, env=env) as srv:
            kw: dict[str, Any] = {"image": "busybox", "url": srv.url, "api_key": srv.api_key}
            for _ in range(3):  # warm: image, layer mounts, the key's groups, the pool's key
                sb = Sandbox.create(**kw)
                sb.commands.run("true")
                sb.kill()
            time.sleep(2)
            cmd = ["strace", "-f", "-qq", "-y", "-e", f"trace={TRACED}", "-o", str(trace)]
            for tid in os.listdir(f"/proc/{srv.proc.pid}/task"):
                cmd += ["-p", tid]
            tracer = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
            time.sleep(2)  # attached
            for _ in range(n):
                sb = Sandbox.create(**kw)
                assert sb.commands.run("true").exit_code == 0
                sb.kill()
            time.sleep(3)  # the last kill's teardown and the pool's refill
            tracer.terminate()
            tracer.wait(30)
        counts: collections.Counter[str] = collections.Counter()
        with open(trace, errors="replace") as f:
            for line in f:
                kind = classify(line)
                if kind:
                    counts[kind] += 1
        return {k: round(v / n, 1) for k, v in sorted(counts.items())}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=20, help="create + exec + kill cycles")
    ap.add_argument("--label", default="after", help="name of this run in the results file")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("needs strace: apt install strace")
    rows = {"pool off": measure(False, args.n), "pool on": measure(True, args.n)}
    kinds = sorted({k for r in rows.values() for k in r})
    print(f"per create + exec + kill ({args.label}, n={args.n})")
    print(f"{'':<22}" + "".join(f"{m:>10}" for m in rows))
    for k in kinds:
        print(f"{k:<22}" + "".join(f"{rows[m].get(k, 0):>10.1f}" for m in rows))
    out_file = RESULTS / "create_syscalls.json"
    data = json.loads(out_file.read_text()) if out_file.exists() else {}
    data["benchmark"] = "create_syscalls"
    data.setdefault("runs", {})[args.label] = {"n": args.n, "per_sandbox": rows}
    RESULTS.mkdir(exist_ok=True)
    out_file.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
