"""The edge agent: the one process per node that owns sandboxes.

It makes the final admission decision (limits, node capacity), resolves images into
layers, asks the tier's runtime to create the sandbox, keeps the durable registry,
expires idle sandboxes, and on start reconciles the registry with what actually runs
(live sandboxes stay usable, dead ones and orphans are cleaned up).

It implements :class:`dsec.contract.edge.EdgeAPI`; the apiserver calls it directly in
embedded mode (``dsec serve``) and through a remote transport in cluster mode.

Where things are: the core (live table, registry, admission, use and destroy, the
trajectory hook, start/close/reconcile) is :class:`dsec.edge.core.EdgeCore`; each group of
verbs is one module of :mod:`dsec.edge.abilities`, a mixin over the core:

==================  ==========================================================
``sandboxes``       create (one, many), get, list, kill, TTL, job actions
``exec``            commands (one-shot, streamed), E2B interactive processes
``files``           the files API
``pausing``         pause and resume (also the auto-resume and the idle reaper's pause)
``recovery``        reconcile after a (re)start, the idle reaper
``forks``           snapshot, fork (shared, packed, memory)
``migration``       export/import of a sandbox's disk and memory (cluster moves)
``display``         the desktop: screenshots, input, windows
``network``         network policy and counters, ports
``observe``         metrics, trajectory export, audit, logs
``code``            run_code on the fncall tier
``images``          images and builds
``node``            capabilities, node info, usage
==================  ==========================================================
"""

from __future__ import annotations

from dsec.edge.abilities.code import CodeVerbs
from dsec.edge.abilities.display import DisplayVerbs
from dsec.edge.abilities.exec import ExecVerbs
from dsec.edge.abilities.files import FileVerbs
from dsec.edge.abilities.forks import ForkVerbs
from dsec.edge.abilities.images import ImageVerbs
from dsec.edge.abilities.migration import MigrationVerbs
from dsec.edge.abilities.network import NetworkVerbs
from dsec.edge.abilities.node import NodeVerbs
from dsec.edge.abilities.observe import ObserveVerbs
from dsec.edge.abilities.pausing import PauseVerbs
from dsec.edge.abilities.recovery import RecoveryVerbs
from dsec.edge.abilities.sandboxes import SandboxVerbs
from dsec.edge.core import node_name
from dsec.edge.limits import EdgeLimits

__all__ = ["EdgeAgent", "EdgeLimits", "node_name"]


class EdgeAgent(
    MigrationVerbs,  # over ForkVerbs, over SandboxVerbs, over PauseVerbs
    ForkVerbs,
    SandboxVerbs,
    RecoveryVerbs,  # over PauseVerbs
    PauseVerbs,
    ExecVerbs,
    FileVerbs,
    DisplayVerbs,
    NetworkVerbs,
    ObserveVerbs,
    CodeVerbs,
    ImageVerbs,
    NodeVerbs,
):
    """Embedded edge. Construct, ``await start()``, use, ``await close()``; the arguments
    are :class:`~dsec.edge.core.EdgeCore`'s."""
