"""The ``container`` tier: OCI containers (crun or runc) over EROFS layers (see
docs/design/container.md). Registered in :mod:`dsec.tiers`; :func:`node_runtime` is its factory."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.runtimes.container.runtime import ContainerRuntime
    from dsec.tiers import TierContext

__all__ = ["node_runtime"]


def node_runtime(ctx: TierContext) -> ContainerRuntime:
    """The tier's runtime on a node (:data:`dsec.tiers.TierFactory`)."""
    from dsec.runtimes.container.runtime import ContainerRuntime

    return ContainerRuntime(ctx.paths, ctx.mounts, network=ctx.network)
