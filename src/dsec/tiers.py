"""Tiers by registration: a tier is its package plus one :class:`TierRegistration`.

A *tier* is an isolation mechanism with a runtime of its own (:class:`dsec.contract.runtime.Runtime`).
Everything outside a tier's package that needs to know the tiers reads this registry: the
node builds one runtime per registered tier (:func:`dsec.node.build_runtimes`), the edge
refuses a tier nobody registered (``InvalidRequest``, HTTP 400), and the CLI, the
integrations, migration, the host report, the fakes of :mod:`dsec.testing` and both
conformance suites decide what differs by a tier's :class:`TierTraits`, never by its name.

A registration is light: a name, the dotted path of the tier's factory (imported only when a
node builds its runtime, so that ``import dsec`` loads no node code), the traits, and the
image its conformance tests use. The built-in tiers are registered at the bottom of this
module; another package adds its own under the ``dsec.tiers`` entry-point group (name = the
tier, value = ``module:attr`` of a :class:`TierRegistration`; the module should be as light
as this one), read the first time a name is looked up that is not registered yet.

Example (a package's ``pyproject.toml``, and the registration it names)::

    [project.entry-points."dsec.tiers"]
    gvisor = "dsec_gvisor.tier:TIER"

    TIER = TierRegistration(
        name="gvisor",
        factory="dsec_gvisor.runtime:node_runtime",  # (TierContext) -> Runtime
        traits=TierTraits(allow_setuid=True),
        conformance_image="busybox",
    )

On the wire a tier stays a string (``CreateSandboxRequest.tier``): an SDK sends names it has
never heard of, and the server it talks to decides.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.errors import InvalidRequest

if TYPE_CHECKING:
    from dsec.config import Paths
    from dsec.contract.runtime import Runtime

__all__ = [
    "BUILTIN_TIERS",
    "ENTRY_POINT_GROUP",
    "TierContext",
    "TierFactory",
    "TierRegistration",
    "TierTraits",
    "get_tier",
    "load_factory",
    "register_tier",
    "require_tier",
    "tier_has",
    "tier_names",
    "tier_traits",
    "tiers_with",
    "unregister_tier",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dsec.tiers"
"""Packages add tiers under this entry-point group: name = the tier, value = ``module:attr``
of a :class:`TierRegistration`."""

TIER_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
"""What a tier may be called (the wire's pattern for ``CreateSandboxRequest.tier``)."""


@dataclass(frozen=True)
class TierTraits:
    """What code outside a tier's package decides by tier, known from the registration
    alone: on a client, in the CLI, in a host report made without a node. What a running
    tier can do (pause, snapshot, fork, memory forks, a display) is its capability table,
    derived from the protocols its runtime implements (:func:`dsec.contract.runtime.capabilities_of`);
    the runtime conformance suite checks that the two agree where they overlap.

    Attributes:
        guest_kernel: its sandboxes are virtual machines with a kernel of their own:
            ``full_guest`` is allowed, a migration moves the memory state where the tier
            can capture it, and the host report notes how guests run (KVM or TCG).
        allow_setuid: ``allow_setuid`` is allowed (setuid programs such as sudo raise
            privileges; the E2B API sets it on these tiers).
        persistent: a sandbox outlives one command (``fncall``: no, each call is a new
            worker), which agent harnesses such as Harbor need.
        ports: ports inside a sandbox are reachable through the port proxy
            (``PortConnectable``; the fakes then stand in with ``MemoryPortRuntime``).
        cgroups: it confines its sandboxes with cgroups (it cannot run on a host whose
            cgroup layout is unusable).
        host_needs: host features (:attr:`dsec.models.HostFeature.name`) without which it
            cannot run, besides root and cgroups.
        host_note: the host feature whose value the host report shows as the tier's note
            (``"OCI runtime"``: which runtime the container tier drives).
    """

    guest_kernel: bool = False
    allow_setuid: bool = False
    persistent: bool = True
    ports: bool = True
    cgroups: bool = True
    host_needs: tuple[str, ...] = ()
    host_note: str | None = None


@dataclass(frozen=True)
class TierContext:
    """What a node hands a tier's factory: its paths, the layer mounts every tier shares,
    its layer store (a :class:`~dsec.layers.store.LayerStore`, or a ``LayerSource`` fake),
    and its network manager (None: networking off)."""

    paths: Paths
    mounts: Any
    layer_store: Any
    network: Any = None


TierFactory = Callable[[TierContext], "Runtime"]
"""Makes a tier's runtime for one node. May raise ImportError: the tier is then left out of
the node with a log line (a dependency it needs is not installed)."""


@dataclass(frozen=True)
class TierRegistration:
    """One tier: its name, its factory (a :data:`TierFactory` or the ``module:attr`` path of
    one, imported on first use), its traits and the image its sandboxes use in the
    conformance suites (one with ``/bin/sh``, ``echo`` and ``cat``)."""

    name: str
    factory: TierFactory | str
    traits: TierTraits = field(default_factory=TierTraits)
    conformance_image: str = "busybox"


_TIERS: dict[str, TierRegistration] = {}
_lock = threading.Lock()
_plugins_read = False


def register_tier(registration: TierRegistration) -> TierRegistration:
    """Add a tier (a later registration of the same name replaces the earlier one).
    Returns ``registration``."""
    if not TIER_NAME.fullmatch(registration.name):
        raise ValueError(f"invalid tier name {registration.name!r}: expected {TIER_NAME.pattern}")
    with _lock:
        _TIERS[registration.name] = registration
    return registration


def unregister_tier(name: str) -> None:
    """Remove a tier (tests that registered one)."""
    with _lock:
        _TIERS.pop(name, None)


def _read_plugins() -> None:
    """Register the tiers of the ``dsec.tiers`` entry points, once per process."""
    global _plugins_read
    if _plugins_read:
        return
    _plugins_read = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _TIERS:
            continue
        try:
            reg = ep.load()
        except Exception:
            log.exception("tier %s: its entry point %s does not load", ep.name, ep.value)
            continue
        if not isinstance(reg, TierRegistration) or reg.name != ep.name:
            log.error("tier %s: %s is not a TierRegistration of that name", ep.name, ep.value)
            continue
        register_tier(reg)


def tier_names() -> tuple[str, ...]:
    """Every registered tier, the built-in ones first, in registration order."""
    _read_plugins()
    return tuple(_TIERS)


def get_tier(name: str) -> TierRegistration | None:
    """The registration of ``name``, or None when no one registered it."""
    reg = _TIERS.get(name)
    if reg is None and not _plugins_read:
        _read_plugins()
        reg = _TIERS.get(name)
    return reg


def require_tier(name: str) -> TierRegistration:
    """The registration of ``name``; ``InvalidRequest`` (HTTP 400) naming the known tiers
    when there is none."""
    reg = get_tier(name)
    if reg is None:
        raise InvalidRequest(
            f"unknown tier {name!r}; tiers are {', '.join(tier_names())}", tier=name
        )
    return reg


def tier_traits(name: str) -> TierTraits | None:
    """The traits of ``name``, or None for a tier this process does not know (a client
    leaves what depends on them to the server)."""
    reg = get_tier(name)
    return reg.traits if reg is not None else None


def tier_has(name: str, trait: Callable[[TierTraits], bool]) -> bool:
    """Whether ``name`` is a registered tier whose traits satisfy ``trait``, e.g.
    ``tier_has("vm", lambda t: t.guest_kernel)`` (False for a tier no one registered)."""
    reg = get_tier(name)
    return reg is not None and trait(reg.traits)


def tiers_with(trait: Callable[[TierTraits], bool]) -> tuple[str, ...]:
    """The registered tiers whose traits satisfy ``trait``, e.g.
    ``tiers_with(lambda t: t.guest_kernel)``: ``("microvm", "vm")``."""
    return tuple(t for t in tier_names() if trait(_TIERS[t].traits))


def load_factory(reg: TierRegistration) -> TierFactory:
    """The factory of ``reg``, imported if it is a ``module:attr`` path (ImportError when
    the module or a dependency of it is missing)."""
    if not isinstance(reg.factory, str):
        return reg.factory
    module, _, attr = reg.factory.partition(":")
    factory: TierFactory = getattr(importlib.import_module(module), attr)
    return factory


# --- the built-in tiers -----------------------------------------------------------------------

_POSIX_LAYERS = ("EROFS", "overlayfs", "seccomp", "pidfd", "openat2")

for _builtin in (
    TierRegistration(
        "fncall",
        "dsec.runtimes.fncall:node_runtime",
        TierTraits(persistent=False, ports=False, host_needs=_POSIX_LAYERS),
        conformance_image="debian",
    ),
    TierRegistration(
        "container",
        "dsec.runtimes.container:node_runtime",
        TierTraits(
            allow_setuid=True, host_needs=(*_POSIX_LAYERS, "OCI runtime"), host_note="OCI runtime"
        ),
        conformance_image="busybox",
    ),
    TierRegistration(
        "microvm",
        "dsec.runtimes.microvm:node_runtime",
        TierTraits(guest_kernel=True, host_needs=("QEMU",)),
        conformance_image="busybox",
    ),
    TierRegistration(
        "vm",
        "dsec.runtimes.vm:node_runtime",
        TierTraits(guest_kernel=True, host_needs=("QEMU",)),
        conformance_image="debian",
    ),
):
    register_tier(_builtin)

BUILTIN_TIERS: tuple[str, ...] = tuple(_TIERS)
"""The tiers dsec itself ships: ``fncall``, ``container``, ``microvm``, ``vm``."""
