"""Placement: choose the node for each sandbox (capability filter, power-of-k sampling on
actual usage, overcommit caps on requested totals, an in-flight overlay, a burst pool).

The apiserver calls :class:`Placer`; ``benchmarks/placement_sim.py`` drives the same code
against 160 simulated nodes. Design and measurements: ``docs/design/placement.md``.
"""

from dsec.placement.engine import (
    BatchPlacement,
    Decision,
    Node,
    NodeLoad,
    NodeUsage,
    Overcommit,
    PlacementRequest,
    Placer,
    Policy,
    Reservation,
    admits,
)

__all__ = [
    "BatchPlacement",
    "Decision",
    "Node",
    "NodeLoad",
    "NodeUsage",
    "Overcommit",
    "PlacementRequest",
    "Placer",
    "Policy",
    "Reservation",
    "admits",
]
