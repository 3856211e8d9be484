"""The host matrix: dsec checked on the hosts users run, one QEMU guest after another.

Usage (root; ``make host-matrix`` runs the default set)::

    .venv/bin/python -m hosts.matrix [--hosts debian12-6.1-v2,debian12-6.12-v2 | all]
        [--mode full|smoke] [--no-conformance] [--out benchmarks/results/host_matrix.json]
        [--work /var/tmp/dsec-host-matrix] [--timeout 5400] [--tests PATH [PATH ...]]

Each host boots (never two guests at once: a CI machine has two cores), runs the checks of
``hosts/inguest.py`` and powers off; the matrix prints a table (host, kernel, cgroup layout
as measured in the guest, tiers available or why not in the words of ``dsec doctor`` /
``dsec info``, checks passed/failed/skipped, create-to-first-exec p50 per tier, time) and
writes every result as JSON. The evidence of each guest (serial console, the guest's logs,
``dsec serve``'s log, the conformance suite's output) stays in ``--work``.

``--tests`` runs chosen tests of this checkout in each guest after the checks (files,
directories or node ids, as pytest takes them; e.g. the fork and group tests with
``--mode smoke --tiers container --tests tests/integration/test_groups_root.py``): one
check ``tests`` with their counts, printed under the table; their output and junit report
are ``out/tests.log`` and ``out/tests.xml`` in the host's evidence.

Exit status: 0 when every host ran to the end (whatever its checks said), 1 when a guest
could not report at all: the matrix measures, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hosts.guest import GuestRun, RunOptions, run_host
from hosts.payload import CONFORMANCE_IMAGES
from hosts.spec import resolve_hosts

__all__ = ["main", "summarize", "table"]

REPO = Path(__file__).resolve().parent.parent


def _checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    return list(results.get("checks") or [])


def _doctor_tiers(results: dict[str, Any]) -> dict[str, str]:
    """``tier: what dsec doctor says`` from the lines under its ``Tiers:`` heading."""
    lines = ((results.get("doctor") or {}).get("output") or "").splitlines()
    found: dict[str, str] = {}
    if "Tiers:" in lines:
        for line in lines[lines.index("Tiers:") + 1 :]:
            if not line.startswith(" ") or ":" not in line:
                break
            tier, _, text = line.strip().partition(":")
            found[tier] = text.strip()
    return found


def _phases(row: dict[str, Any]) -> str:
    p = row["phases"]
    parts = []
    for key, label in (
        ("image_build_s", "image built"), ("image_found_s", "image found"),
        ("payload_s", "payload"), ("boot_s", "boot"), ("install_s", "dsec install"),
        ("checks_s", "checks"), ("conformance_s", "of which conformance"),
        ("guest_s", "guest in all"),
    ):  # fmt: skip
        if p.get(key) is not None:
            parts.append(f"{label} {p[key]:.0f} s")
    return ", ".join(parts)


def summarize(run: GuestRun, tiers: tuple[str, ...]) -> dict[str, Any]:
    """One row of the table, from a host's results (about ``tiers``)."""
    r = run.results
    checks = _checks(r)
    passed = [c["name"] for c in checks if c.get("ok") is True]
    failed = [c["name"] for c in checks if c.get("ok") is False]
    skipped = [c["name"] for c in checks if c.get("ok") is None]
    available: dict[str, str] = {}
    for tier, cap in (r.get("tiers") or {}).items():
        if tier not in tiers:
            continue
        available[tier] = "yes" if cap.get("available") else f"no: {cap.get('reason') or '?'}"
    if not available:  # no server to ask: what `dsec doctor` said about each tier
        available = {t: v for t, v in _doctor_tiers(r).items() if t in tiers}
    p50 = {}
    for c in checks:
        if c["name"].endswith(".latency"):
            p50[c["name"].split(".")[0]] = (c.get("detail") or {}).get("p50_ms")
    facts = r.get("facts") or {}
    doctor = r.get("doctor") or {}
    conformance = {}
    suites: dict[str, dict[str, int]] = {}
    for c in checks:
        if c["name"] == "conformance":
            conformance["conformance_s"] = c["seconds"]
        if c["name"] in ("conformance", "tests"):
            detail = c.get("detail") or {}
            keys = ("passed", "failed", "errors", "skipped")
            if any(k in detail for k in keys):
                suites[c["name"]] = {k: int(detail.get(k) or 0) for k in keys}
    return {
        "host": run.host.name,
        "kernel": facts.get("kernel") or r.get("host", {}).get("kernel_release", "?"),
        "cgroup": (facts.get("cgroup") or {}).get("layout", "?"),
        "tiers": available,
        "doctor": "missing (dsec info used)" if doctor.get("missing") else "ran",
        "passed": len(passed),
        "failed": len(failed),
        "skipped": len(skipped),
        "failed_checks": failed,
        "p50_ms": p50,
        "suites": suites,
        "error": r.get("error"),
        "phases": {**run.phases, **(r.get("phases") or {}), **conformance},
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table (with the failed checks and errors below)."""
    head = ("HOST", "KERNEL", "CGROUP", "TIERS", "PASS/FAIL/SKIP", "CREATE->EXEC P50", "GUEST")
    lines = []
    for row in rows:
        tiers = "; ".join(f"{t} {v}" for t, v in row["tiers"].items()) or "-"
        p50 = " ".join(f"{t} {v:.0f} ms" for t, v in row["p50_ms"].items() if v) or "-"
        guest = row["phases"].get("guest_s")
        lines.append(
            (
                row["host"],
                row["kernel"],
                row["cgroup"],
                tiers,
                f"{row['passed']}/{row['failed']}/{row['skipped']}",
                p50,
                f"{guest:.0f} s" if guest else "-",
            )
        )
    widths = [
        min(70, max(len(h), *(len(line[i]) for line in lines))) if lines else len(h)
        for i, h in enumerate(head)
    ]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    for row in rows:
        out.append(f"{row['host']}: {_phases(row)}")
        for name, n in (row.get("suites") or {}).items():
            counts = ", ".join(f"{v} {k}" for k, v in n.items())
            out.append(f"{row['host']}: {name} {counts}")
        if row["failed_checks"] or row["error"]:
            out.append(f"{row['host']}: failed {', '.join(row['failed_checks']) or '-'}")
            if row["error"]:
                out.append(f"{row['host']}: error {str(row['error'])[:400]}")
    return "\n".join(out)


def _checkout() -> dict[str, Any]:
    def git(*args: str) -> str:
        proc = subprocess.run(
            ["git", "-C", os.fspath(REPO), *args], capture_output=True, text=True, check=False
        )
        return proc.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hosts.matrix", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--hosts", help="comma-separated host names, or 'all' (default: Debian 12 set)"
    )
    parser.add_argument("--mode", choices=("full", "smoke"), default="full")
    parser.add_argument("--no-conformance", action="store_true", help="skip the conformance suite")
    parser.add_argument("--tiers", default="container,fncall")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/host_matrix.json")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/dsec-host-matrix"))
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per guest")
    parser.add_argument(
        "--tests",
        nargs="+",
        default=[],
        metavar="PATH",
        help="tests of this checkout to run in each guest after the checks (pytest paths)",
    )
    args = parser.parse_args(argv)
    missing = [t for t in args.tests if not (REPO / t.split("::", 1)[0]).exists()]
    if missing:
        parser.error(f"no such test path in {REPO}: {', '.join(missing)}")
    if os.geteuid() != 0:
        print("the host matrix needs root (debootstrap, mkfs, QEMU's disks)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM unwinds like ^C: the running guest is killed on the way out (hosts.guest)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hosts = resolve_hosts(args.hosts)
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    options = RunOptions(
        mode=args.mode,
        tiers=tiers,
        # smoke: the smallest image each tier can run (fncall's worker needs Python 3)
        images={
            t: (CONFORMANCE_IMAGES.get(t, "busybox") if args.mode == "smoke" else "debian")
            for t in tiers
        },
        conformance=not args.no_conformance,
        tests=tuple(args.tests),
        timeout_s=args.timeout,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkout": _checkout(),
        "mode": args.mode,
        "tiers": list(tiers),
        "tests": list(args.tests),
        "hosts": [],
    }
    unreported = 0
    for host in hosts:
        run_dir = args.work / stamp / host.name
        print(f"== {host.name}: evidence in {run_dir}", flush=True)
        try:
            run = run_host(host, run_dir, options)
        except Exception as e:  # the image or payload could not be made: the row says why
            logging.exception("%s", host.name)
            run = GuestRun(host, {"error": f"{type(e).__name__}: {e}"}, run_dir)
        row = summarize(run, tiers)
        rows.append(row)
        if not _checks(run.results):
            unreported += 1
        report["hosts"].append({"summary": row, "evidence": str(run_dir), "results": run.results})
        print(table([row]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print()
    print(table(rows))
    print(f"\nwritten to {args.out}")
    return 1 if unreported else 0


if __name__ == "__main__":
    sys.exit(main())
