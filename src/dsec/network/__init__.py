"""Sandbox networking: default deny, domain allowlists enforced outside the sandbox.

Public API::

    from dsec.network import NetworkManager, NetworkPolicy, NetworkPreset, SandboxNetwork

See :mod:`dsec.network.manager` for the wiring and lifecycle, :mod:`dsec.network.policy`
for the policy semantics, and docs/design/network.md for the design and measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec.network.policy import DEFAULT_PRESETS, NetworkPolicy, NetworkPreset

if TYPE_CHECKING:
    from dsec.network.manager import NetworkManager, SandboxNetwork
    from dsec.network.resolver import ResolverLimits

__all__ = [
    "DEFAULT_PRESETS",
    "NetworkManager",
    "NetworkPolicy",
    "NetworkPreset",
    "ResolverLimits",
    "SandboxNetwork",
]


def __getattr__(name: str) -> Any:
    """The node-side parts load on first use: a client importing the policy model (``import
    dsec``) must not load the netns and nftables machinery."""
    if name in ("NetworkManager", "SandboxNetwork"):
        from dsec.network import manager

        return getattr(manager, name)
    if name == "ResolverLimits":
        from dsec.network.resolver import ResolverLimits

        return ResolverLimits
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
