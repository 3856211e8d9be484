"""``dsec doctor``: can this host run dsec, and which tiers? No server needed.

Probes the host directly (:mod:`dsec.hostreport`) and prints the report in sections, as
``docker info`` does: Host, Kernel features, cgroups, Tiers; each line ``name: value``, with a
reason in parentheses for anything missing. ``--json`` prints the
:class:`~dsec.models.HostReport` instead. Run it as root, where ``dsec serve`` runs: most
probes say "unknown" otherwise.

Exit status: 0 when every tier the operator asked for (``--tiers``, default ``DSEC_TIERS``)
can run (with neither set: when at least one can), 1 otherwise, naming each tier and why; 2
for a ``DSEC_TIERS`` naming an unknown tier.

Nothing is left behind: the probe container (as root) is removed with its cgroup, and no
mount outlives its probe; the host is not changed (``dsec serve`` makes dsec's cgroups ready
at its start, and may mount the hugetlb v1 hierarchy a hybrid host lacks).

Test hook: set :data:`report_factory` to a callable taking the wanted tiers and returning a
:class:`~dsec.models.HostReport`, and the command prints and judges that instead of probing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from dsec.models import HostReport

__all__ = ["doctor", "report_factory", "unavailable_wanted"]

report_factory: Callable[[list[str] | None], HostReport] | None = None
"""Test hook (see the module docstring). None: probe this host."""


def _wanted(option: str | None) -> list[str] | None:
    from dsec.tiers import tier_names

    raw = option if option is not None else os.environ.get("DSEC_TIERS", "")
    wanted = [t.strip() for t in raw.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in tier_names()]
    if unknown:
        where = "--tiers" if option is not None else "DSEC_TIERS"
        print(
            f"error: {where} names unknown tier(s) {', '.join(unknown)}; "
            f"tiers are {', '.join(tier_names())}",
            file=sys.stderr,
        )
        raise typer.Exit(2)
    return wanted or None


def _probe(wanted: list[str] | None, home: Path | None) -> HostReport:
    from dsec.config import Paths
    from dsec.hostreport import host_report, probe_oci

    paths = Paths(home) if home else Paths.from_env()
    oci = probe_oci(paths) if os.geteuid() == 0 else None
    return host_report(paths=paths, oci=oci, wanted=wanted)


def unavailable_wanted(report: HostReport, wanted: list[str] | None) -> list[tuple[str, str]]:
    """``(tier, reason)`` of each wanted tier that cannot run; with no tier asked for, of
    every tier when none can run (a node needs at least one)."""
    down = [(t.tier, t.reason or "unavailable") for t in report.tiers if not t.available]
    if wanted is not None:
        return [(tier, why) for tier, why in down if tier in wanted]
    return down if len(down) == len(report.tiers) else []


def doctor(
    json_output: Annotated[
        bool, typer.Option("--json", help="print the report as JSON (for machines)")
    ] = False,
    tiers: Annotated[
        str | None,
        typer.Option(
            "--tiers",
            help="the tiers that must run, comma-separated (default $DSEC_TIERS: those of "
            "dsec serve)",
            show_default=False,
        ),
    ] = None,
    home: Annotated[
        Path | None,
        typer.Option(help="state directory (default $DSEC_HOME)", show_default=False),
    ] = None,
) -> None:
    """Check this host for dsec (kernel, cgroups, kernel features, tiers); no server needed."""
    from dsec.hostreport import render

    wanted = _wanted(tiers)
    report = report_factory(wanted) if report_factory is not None else _probe(wanted, home)
    if json_output:
        print(report.model_dump_json(indent=2))
    else:
        print(render(report))
    failing = unavailable_wanted(report, wanted)
    if failing:
        for tier, why in failing:
            print(f"error: the {tier} tier cannot run: {why}", file=sys.stderr)
        raise typer.Exit(1)
