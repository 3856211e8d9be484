"""The sandbox fields every harness config shares (SWE-ReX, mini-swe-agent, inspect_ai)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dsec.network.policy import NetworkPolicy
from dsec.tiers import TIER_NAME

__all__ = ["SandboxFields"]


class SandboxFields(BaseModel):
    """What a harness's sandbox is made of and may use. Sizes in MiB; each field as
    :meth:`dsec.AsyncSandbox.create` takes it."""

    tier: str = Field("container", pattern=TIER_NAME.pattern)
    """Isolation tier: ``container``, ``microvm``, ``vm`` (or ``fncall``, or a tier another
    package registered on the server, :mod:`dsec.tiers`)."""
    layers: list[str] = []
    """Extra layers (workspaces, toolkits) stacked on the image."""
    cpu: float = 1.0
    memory_mb: int = 1024
    disk_mb: int = 2048
    pids: int = 1024
    network: NetworkPolicy | None = None
    """None: no network at all. Else a dsec network policy (its dict form:
    ``{"allow_domains": ["pypi.org"], "presets": ["pypi"]}``, see docs/network.md)."""
    labels: dict[str, str] = {}
    """Free-form labels of the sandbox (``dsec ps``, listing by label)."""
