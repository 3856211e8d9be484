"""A node: the parts one machine runs for dsec, composed.

One place builds them, for every process that runs an edge: ``dsec serve`` (the embedded
edge), each Ray node's edge actor in cluster mode, tests and benchmarks. What is built is set
by the operator's environment (``DSEC_TIERS``, ``DSEC_NETWORK``, ``DSEC_NET_*``; see
:func:`build_network`) and by arguments.

* :func:`prepare_host`: the host made ready once per process (dsec's cgroup subtree) and
  the tiers it rules out, with why (the edge reports them unavailable with that reason);
* :func:`build_network`: the node's network manager (or None);
* :func:`build_runtimes`: one runtime per tier the node can run;
* :func:`open_edge`: an :class:`~dsec.edge.agent.EdgeAgent` over them and the node's layer
  store, not yet started;
* :func:`embedded_edge`: the same, started, as an ``async with`` block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.config import Paths
from dsec.contract.runtime import Runtime
from dsec.edge.agent import EdgeAgent, EdgeLimits
from dsec.errors import InvalidRequest
from dsec.layers.store import LayerStore

if TYPE_CHECKING:
    from dsec.models import HostCgroups, HostReport

__all__ = [
    "build_network",
    "build_runtimes",
    "embedded_edge",
    "open_edge",
    "prepare_host",
    "tiers_from_env",
]

log = logging.getLogger("dsec.node")


def tiers_from_env() -> list[str] | None:
    """``DSEC_TIERS`` (e.g. ``container,fncall``): the tiers this node serves (None: all it can)."""
    return _list_env("DSEC_TIERS") if os.environ.get("DSEC_TIERS", "").strip() else None


def _json_env(name: str) -> Any:
    try:
        return json.loads(os.environ[name])
    except ValueError as e:
        raise InvalidRequest(f"${name} is not valid JSON: {e}") from None


def _list_env(name: str) -> list[str]:
    return [item.strip() for item in os.environ[name].split(",") if item.strip()]


_PREPARED: dict[tuple[str, str, str], HostCgroups] = {}
_PREPARE_LOCK = threading.Lock()


def _prepare_cgroups() -> HostCgroups:
    """dsec's cgroup subtree made ready (:func:`dsec.privileged.cgroups.prepare`), once per
    process and layout; the layout as the host report shows it, not usable if that failed."""
    from dsec.hostreport import cgroups_section
    from dsec.privileged.cgroups import host_layout, prepare

    layout = host_layout()
    if not layout.usable:
        return cgroups_section(layout)
    key = (layout.mode, str(layout.mount), layout.base)
    with _PREPARE_LOCK:
        done = _PREPARED.get(key)
        if done is not None:
            return done
        section = cgroups_section(layout)
        try:
            for action in prepare(layout):
                log.info("cgroups: %s", action)
            log.info("cgroups: %s", layout.describe())
        except OSError as e:
            section = section.model_copy(
                update={
                    "usable": False,
                    "reason": f"could not make dsec's cgroup subtree ready at "
                    f"{layout.base_dir}: {e}",
                }
            )
        _PREPARED[key] = section
        return section


def prepare_host(tiers: list[str] | None = None) -> dict[str, str]:
    """Make this host ready for dsec's tiers, at node start, before any tier makes a cgroup:
    dsec's cgroup subtree (once per process: controllers enabled, dsec's own processes moved
    out of its v2 base; see :mod:`dsec.privileged.cgroups.layout`). Returns the tiers of
    ``tiers`` (None: all) the host rules out, each with why: an unusable cgroup layout, no way
    to mount EROFS, no overlayfs (:func:`dsec.hostreport.tier_blockers`). Each is logged; the
    edge reports them unavailable with that reason (``dsec doctor`` says the same without a
    node)."""
    from dsec.hostreport import erofs_feature, overlay_feature, tier_blockers
    from dsec.tiers import tier_names

    cgroups = _prepare_cgroups()
    blocked = tier_blockers(cgroups, [erofs_feature(), overlay_feature()])
    wanted = tiers or list(tier_names())
    out = {tier: why for tier, why in blocked.items() if tier in wanted}
    for tier, why in out.items():
        log.error("%s tier unavailable on this host: %s", tier, why)
    return out


def _host_report_of(paths: Paths, tiers: list[str] | None) -> Callable[[], HostReport]:
    def make() -> HostReport:
        from dsec.hostreport import host_report

        return host_report(paths=paths, wanted=tiers)

    return make


def build_network(paths: Paths, options: dict[str, Any] | None = None) -> Any:
    """The node's network manager (started by the edge), configured by the operator:

    * ``DSEC_NETWORK=off`` disables networking;
    * ``DSEC_NET_SUBNET``: the sandbox subnet (default ``10.203.0.0/16``);
    * ``DSEC_NET_UPSTREAM_DNS``: comma-separated resolvers allowed names are forwarded to
      (``ip`` or ``ip:port``); unset: only static records are answered;
    * ``DSEC_NET_STATIC_RECORDS``: JSON ``{"name": ["ipv4", ...]}`` answered locally;
    * ``DSEC_NET_PRESETS``: JSON ``{"name": {"domains": [...], "cidrs": [...]}}``
      replacing the built-in presets of the same name;
    * ``DSEC_NET_PROTECTED_CIDRS``: comma-separated networks no sandbox may reach.

    ``options`` (keyword arguments of :class:`dsec.network.NetworkManager`) override the
    environment; embedders and tests pass them through :func:`embedded_edge`.
    """
    if os.environ.get("DSEC_NETWORK", "on") == "off":
        return None
    from dsec.network import NetworkManager

    kw: dict[str, Any] = {}
    if os.environ.get("DSEC_NET_SUBNET"):
        kw["subnet"] = os.environ["DSEC_NET_SUBNET"]
    if os.environ.get("DSEC_NET_UPSTREAM_DNS"):
        kw["upstream_dns"] = _list_env("DSEC_NET_UPSTREAM_DNS")
    if os.environ.get("DSEC_NET_STATIC_RECORDS"):
        kw["static_records"] = _json_env("DSEC_NET_STATIC_RECORDS")
    if os.environ.get("DSEC_NET_PRESETS"):
        kw["presets"] = _json_env("DSEC_NET_PRESETS")
    if os.environ.get("DSEC_NET_PROTECTED_CIDRS"):
        kw["protected_cidrs"] = _list_env("DSEC_NET_PROTECTED_CIDRS")
    kw.update(options or {})
    return NetworkManager(paths.home / "net", **kw)


def build_runtimes(
    paths: Paths,
    layer_store: Any,
    tiers: list[str] | None = None,
    network: Any = None,
    skip: Collection[str] = (),
) -> dict[str, Runtime]:
    """Instantiate the runtimes this node can run: one per tier of ``tiers`` (None: every
    registered tier, :mod:`dsec.tiers`), made by the tier's registered factory. Tiers whose
    factory cannot be imported are left out (the edge then answers ``TierUnavailable``) with
    a log line saying why; so are those of ``skip`` (the tiers :func:`prepare_host` ruled
    out) and names no one registered."""
    from dsec.layers.mounts import LayerMounts

    mounts = LayerMounts(paths.layer_mounts)
    # layers an earlier edge mounted (they outlive it): known with no user, so that the
    # sandboxes recovered take them over and the container tier unmounts the rest once the
    # edge has reconciled (ContainerRuntime.reconciled)
    mounts.adopt_existing()
    from dsec.tiers import TierContext, get_tier, load_factory, tier_names

    ctx = TierContext(paths, mounts, layer_store, network)
    runtimes: dict[str, Runtime] = {}
    for tier in [t for t in tiers or tier_names() if t not in skip]:
        reg = get_tier(tier)
        if reg is None:
            log.warning("%s tier not available: no such tier is registered", tier)
            continue
        try:
            runtimes[tier] = load_factory(reg)(ctx)
        except ImportError as e:
            log.info("%s tier not available: %s", tier, e)
    return runtimes


def open_edge(
    paths: Paths,
    *,
    tiers: list[str] | None = None,
    network: bool | dict[str, Any] = True,
    limits: EdgeLimits | None = None,
    node: str | None = None,
) -> tuple[EdgeAgent, LayerStore]:
    """The node's edge and its layer store (``paths.layers``), with the network manager
    (``network``: False for none, or :class:`~dsec.network.NetworkManager` options) and the
    runtimes of ``tiers``. Call ``await edge.start()`` before use; ``await edge.close()``,
    then ``store.close()`` after."""
    paths.ensure()
    blocked = prepare_host(tiers)
    store = LayerStore(paths.layers, paths.scratch)
    manager = None
    if network is not False:
        manager = build_network(paths, network if isinstance(network, dict) else None)
    edge = EdgeAgent(
        paths,
        build_runtimes(paths, store, tiers, manager, skip=blocked),
        store,
        limits=limits,
        node=node,
        network=manager,
        unavailable=blocked,
        host_report=_host_report_of(paths, tiers),
    )
    return edge, store


@contextlib.asynccontextmanager
async def embedded_edge(
    home: Path | None = None,
    *,
    tiers: list[str] | None = None,
    limits: EdgeLimits | None = None,
    network_options: dict[str, Any] | None = None,
) -> AsyncIterator[EdgeAgent]:
    """An in-process edge for tests and embedding: ``async with embedded_edge() as edge``.

    ``network_options``: keyword arguments of the node's
    :class:`~dsec.network.NetworkManager` (see :func:`build_network`)."""
    from dsec.layers.store import LayerStore
    from dsec.serverpaths import hide_server_path

    paths = Paths(home) if home else Paths.from_env()
    paths.ensure()
    # errors that leave the server show $DSEC_HOME, not where it is (nor where layers/ leads)
    hide_server_path(paths.layers, "$DSEC_HOME/layers")
    hide_server_path(paths.home, "$DSEC_HOME")
    blocked = prepare_host(tiers)
    store = LayerStore(paths.layers, paths.scratch)
    network = build_network(paths, network_options)
    edge = EdgeAgent(
        paths,
        build_runtimes(paths, store, tiers, network, skip=blocked),
        store,
        limits=limits,
        network=network,
        unavailable=blocked,
        host_report=_host_report_of(paths, tiers),
    )
    await edge.start()
    store.prestart_lazy()  # the on-demand layer server's ~1 s start off the first sandbox
    try:
        yield edge
    finally:
        try:
            await edge.close()
        finally:
            store.close()  # stops the lazy layer server cleanly
