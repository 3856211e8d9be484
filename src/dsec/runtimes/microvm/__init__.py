"""The ``microvm`` tier: QEMU microvm guests restored from per-image memory templates.
Registered in :mod:`dsec.tiers`; :func:`node_runtime` is its factory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.runtimes.microvm.runtime import MicroVMConfig, MicroVMRuntime

if TYPE_CHECKING:
    from dsec.tiers import TierContext

__all__ = ["MicroVMConfig", "MicroVMRuntime", "node_runtime"]


def node_runtime(ctx: TierContext) -> MicroVMRuntime:
    """The tier's runtime on a node (:data:`dsec.tiers.TierFactory`)."""
    return MicroVMRuntime(ctx.paths)
