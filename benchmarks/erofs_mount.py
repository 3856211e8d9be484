"""What a loop device costs an EROFS layer mount (issue 39): file-backed vs loop-backed.

A/B in one run, interleaved: ``mount_erofs`` + ``umount`` of one layer image, ``--reps``
times each with ``DSEC_EROFS_MOUNT=file`` (kernel 6.12+) and ``=loop`` (bind a loop device,
mount it, unmount: AUTOCLEAR frees it), and the same with a first read of a file in the layer.
Reported: p50 / p90 in milliseconds per mount + unmount. Needs root.

Usage: python benchmarks/erofs_mount.py [--reps 50] [--image FILE.erofs]
Writes benchmarks/results/erofs_mount.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec.layers.erofs import mkfs_erofs
from dsec.privileged.mount import EROFS_MOUNT_ENV, erofs_mount_reason, mount_erofs, umount

RESULTS = Path(__file__).resolve().parent / "results"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else float("nan")


def one(image: Path, target: Path, mode: str, read: str | None) -> float:
    os.environ[EROFS_MOUNT_ENV] = mode
    t0 = time.perf_counter()
    source = mount_erofs(image, target)
    if read is not None:
        (target / read).read_bytes()
    umount(target)
    dt = (time.perf_counter() - t0) * 1000
    assert source.startswith("/dev/loop") == (mode == "loop"), source
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--image", type=Path, help="an EROFS file (default: a tiny one made here)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-erofs-"))
    try:
        image, read = args.image, None
        if image is None:
            src = work / "src"
            src.mkdir()
            (src / "hello").write_text("hello\n" * 1000)
            image, read = work / "layer.erofs", "hello"
            mkfs_erofs(src, image)
        target = work / "mnt"
        target.mkdir()
        times: dict[str, list[float]] = {"file": [], "loop": []}
        for _ in range(args.reps):
            for mode in ("file", "loop"):
                times[mode].append(one(image, target, mode, read))
        os.environ.pop(EROFS_MOUNT_ENV, None)
        rows = {m: {"p50_ms": pct(t, 50), "p90_ms": pct(t, 90)} for m, t in times.items()}
        out: dict[str, Any] = {
            "kernel": os.uname().release,
            "auto": erofs_mount_reason(),
            "reps": args.reps,
            "image_bytes": image.stat().st_size,
            "read_in_layer": read,
            **rows,
        }
        print(f"kernel {out['kernel']}, {args.reps} mount + unmount each, interleaved")
        print(f"{'mode':6} {'p50 ms':>8} {'p90 ms':>8}")
        for m, r in rows.items():
            print(f"{m:6} {r['p50_ms']:8.3f} {r['p90_ms']:8.3f}")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "erofs_mount.json").write_text(json.dumps(out, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
