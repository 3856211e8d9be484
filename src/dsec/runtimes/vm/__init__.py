"""The ``vm`` tier: full QEMU machines (q35) with a writable qcow2 disk and a display.
Registered in :mod:`dsec.tiers`; :func:`node_runtime` is its factory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.runtimes.vm.runtime import VMRuntime

if TYPE_CHECKING:
    from dsec.tiers import TierContext

__all__ = ["VMRuntime", "node_runtime"]


def node_runtime(ctx: TierContext) -> VMRuntime:
    """The tier's runtime on a node (:data:`dsec.tiers.TierFactory`)."""
    return VMRuntime(ctx.paths)
