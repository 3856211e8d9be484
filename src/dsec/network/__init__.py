"""Sandbox networking: default deny, domain allowlists enforced outside the sandbox.

Public API::

    from dsec.network import NetworkManager, NetworkPolicy, NetworkPreset, SandboxNetwork

See :mod:`dsec.network.manager` for the wiring and lifecycle, :mod:`dsec.network.policy`
for the policy semantics, and docs/design/network.md for the design and measurements.
"""

from dsec.network.manager import NetworkManager, SandboxNetwork
from dsec.network.policy import DEFAULT_PRESETS, NetworkPolicy, NetworkPreset
from dsec.network.resolver import ResolverLimits

__all__ = [
    "DEFAULT_PRESETS",
    "NetworkManager",
    "NetworkPolicy",
    "NetworkPreset",
    "ResolverLimits",
    "SandboxNetwork",
]
