"""The ``fncall`` tier: warm pools of locked-down, single-use workers (see docs/design/fncall.md).

Modules:
    runtime    FncallRuntime (the Runtime contract), FncallConfig
    pool       WorkerPool, Worker, PoolConfig (server side of zygotes and workers)
    zygote     the zygote and worker agent (runs inside the image's Python; stdlib only)
    seccomp    the workers' seccomp-BPF program (stdlib only)
    service    RunCodeService and the SandboxFusion / dsec run_code models
    languages  LanguageSpec table; toolkits: Debian toolkit layers; files: WorkerFiles
    testkit    a real runtime on a private DSEC_HOME for tests and benchmarks

Names are imported lazily so that ``zygote`` and ``seccomp`` stay importable on their own.
Registered in :mod:`dsec.tiers`; :func:`node_runtime` is its factory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.runtimes.fncall.runtime import FncallRuntime
    from dsec.tiers import TierContext

__all__ = [
    "FncallConfig",
    "FncallRuntime",
    "PoolConfig",
    "RunCodeLimits",
    "RunCodeService",
    "WorkerPool",
    "node_runtime",
]

_WHERE = {
    "FncallConfig": "runtime",
    "FncallRuntime": "runtime",
    "PoolConfig": "pool",
    "WorkerPool": "pool",
    "RunCodeLimits": "service",
    "RunCodeService": "service",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec.runtimes.fncall' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dsec.runtimes.fncall.{module}"), name)


def node_runtime(ctx: TierContext) -> FncallRuntime:
    """The tier's runtime on a node (:data:`dsec.tiers.TierFactory`)."""
    from dsec.runtimes.fncall.runtime import FncallRuntime

    return FncallRuntime(ctx.paths, ctx.mounts, ctx.layer_store)
