"""The edge actor: one :class:`~dsec.edge.agent.EdgeAgent` per Ray node, as a Ray actor.

:func:`ensure_edge_actor` starts it pinned to its node (``NodeAffinitySchedulingStrategy``,
``soft=False``), detached and named ``dsec-edge-<node>-<ray node id>`` in the ``dsec`` namespace, with
``max_restarts=-1``: Ray restarts it on the same node when its process dies, and the new
incarnation's ``EdgeAgent.start()`` reconciles with what still runs there (the data dir
is the same). A second apiserver replica finds the same actor by name (``get_if_exists``).

Every actor method answers ``("ok", value)`` or ``("error", wire_error)`` so a typed
:class:`~dsec.errors.DsecError` crosses Ray intact (the caller rebuilds it with
:func:`~dsec.errors.error_from_wire`); ``exec_stream`` is a Ray streaming generator of
:class:`~dsec.models.ExecEvent` (errors arrive as an ``error`` event).

Node name: the Ray node label ``dsec.io/node`` when set (stable across restarts of the
node: its data dir and the node part of sandbox ids stay the same), else ``n`` + the
first 11 hex digits of the Ray node id. Data dir: ``<node_root>/<node name>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import DsecError, InternalError, InvalidRequest

__all__ = [
    "ACTOR_NAMESPACE",
    "ACTOR_PREFIX",
    "NODE_LABEL",
    "EdgeActor",
    "NodeConfig",
    "actor_name",
    "ensure_edge_actor",
    "node_name_of",
]

log = logging.getLogger("dsec.cluster.actor")

ACTOR_NAMESPACE = "dsec"
ACTOR_PREFIX = "dsec-edge-"
NODE_LABEL = "dsec.io/node"
BURST_LABEL = "dsec.io/burst"

# EdgeAgent methods an apiserver may call through ``EdgeActor.call``
_CALLABLE = frozenset(
    {
        "create_sandbox",
        "create_sandboxes",
        "get_sandbox",
        "list_sandboxes",
        "kill_sandbox",
        "set_ttl",
        "exec",
        "read_file",
        "write_file",
        "list_files",
        "stat_file",
        "remove_file",
        "make_dir",
        "rename_file",
        "upload_tar",
        "download_tar",
        "pause_sandbox",
        "pause_sandbox_mode",
        "resume_sandbox",
        "snapshot_sandbox",
        "fork_sandbox",
        "job_action",
        "export_trajectory",
        "update_network",
        "network_stats",
        "list_images",
        "get_image",
        "list_layers",
        "pull_image",
        "build_image",
        "push_image",
        "attach_image",
        "node_info",
        "capabilities",
        "stats",
        "display_screenshot",
        "display_click",
        "display_type",
        "display_key",
        "export_sandbox",
        "import_sandbox",
    }
)


@dataclass(frozen=True)
class NodeConfig:
    """How every edge actor of a cluster is set up (sent to the actor; picklable).

    Attributes:
        node_root: parent of the per-node data dirs (``<node_root>/<node name>``) on each node.
        shared_layers: a layer store directory every node can read (a shared FS mount, or on
            one host a local cache); linked as each node's ``layers`` when set.
        tiers: tiers each edge serves (None: every tier the node can run).
        network: give sandboxes networks (``DSEC_NETWORK`` on the node still applies).
        env: extra environment for the edge (e.g. ``DSEC_CPU_OVERCOMMIT``); the node's own
            environment (``ray start`` environment) applies first.
    """

    node_root: str = "/var/lib/dsec/nodes"
    shared_layers: str | None = None
    tiers: tuple[str, ...] | None = None
    network: bool = True
    env: dict[str, str] = field(default_factory=dict)


def node_name_of(ray_node: dict[str, Any]) -> str:
    """The dsec node name of a ``ray.nodes()`` entry (see the module docstring)."""
    labels = ray_node.get("Labels") or {}
    raw = str(labels.get(NODE_LABEL) or "")
    name = re.sub(r"[^a-z0-9]", "", raw.lower())[:12]
    return name or "n" + str(ray_node["NodeID"])[:11]


def actor_name(node: str, ray_node_id: str) -> str:
    """``dsec-edge-<node>-<first 12 hex of the Ray node id>``: every replica finds the same
    actor for a node; a node that rejoins (a new Ray node id) gets a fresh one."""
    return f"{ACTOR_PREFIX}{node}-{ray_node_id[:12]}"


def _ok(value: Any) -> tuple[str, Any]:
    return ("ok", value)


def _err(e: BaseException) -> tuple[str, Any]:
    if isinstance(e, DsecError):
        return ("error", e.to_wire())
    log.exception("edge actor call failed")
    return ("error", InternalError(f"{type(e).__name__}: {e}").to_wire())


class EdgeActor:
    """The Ray actor body (decorated by :func:`ensure_edge_actor`). Its ``EdgeAgent`` is
    started on the first call (Ray actor constructors cannot await)."""

    def __init__(self, node: str, config: NodeConfig) -> None:
        self.node = node
        self.config = config
        self.home = Path(config.node_root) / node
        self.agent: Any = None
        self._start_lock: asyncio.Lock | None = None
        self._started_at = 0.0
        self._cpu_sample: tuple[float, float] | None = None  # (monotonic s, cpuacct ns)
        for k, v in config.env.items():
            os.environ[k] = v
        os.environ["DSEC_NODE"] = node

    async def _agent(self) -> Any:
        if self.agent is not None:
            return self.agent
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.agent is None:
                self.agent = await self._start()
        return self.agent

    async def _start(self) -> Any:
        from dsec.config import Paths
        from dsec.edge.agent import EdgeAgent
        from dsec.layers.store import LayerStore
        from dsec.server import _become_subreaper, build_network, build_runtimes

        _become_subreaper()  # sandbox inits come back to this process, which reaps them
        self.home.mkdir(parents=True, exist_ok=True)
        if self.config.shared_layers and not (self.home / "layers").exists():
            (self.home / "layers").symlink_to(self.config.shared_layers, target_is_directory=True)
        paths = Paths(self.home)
        paths.ensure()
        store = LayerStore(paths.layers, paths.scratch)
        network = build_network(paths) if self.config.network else None
        tiers = list(self.config.tiers) if self.config.tiers else None
        agent = EdgeAgent(
            paths,
            build_runtimes(paths, store, tiers, network),
            store,
            node=self.node,
            network=network,
        )
        await agent.start()  # reconciles with what still runs on this node
        self._started_at = time.time()
        log.info("edge %s started in %s (pid %d)", self.node, self.home, os.getpid())
        return agent

    # --- health and reports -----------------------------------------------------------
    async def ping(self) -> dict[str, Any]:
        """Liveness: node name, process id, when the edge started (unix s)."""
        await self._agent()
        return {"node": self.node, "pid": os.getpid(), "started_at": self._started_at}

    async def report(self) -> dict[str, Any]:
        """Actual usage for the placer: cores used since the last report, bytes used, live
        sandboxes, layers present, tiers, limits, and the requested totals the edge admits
        against."""
        agent = await self._agent()
        live = [lv.row for lv in agent._live.values()]
        cpu_used, mem_used = self._cgroup_usage(agent)
        caps = await agent.capabilities()
        try:
            layers = [x.digest for x in agent.layers.list_layers()]
        except Exception:
            layers = []
        stat = os.statvfs(self.home)
        return {
            "node": self.node,
            "cpus": agent._cpus,
            "memory_bytes": agent._mem_mb << 20,
            "cpu_used": cpu_used,
            "memory_used": mem_used,
            "sandboxes": len(live),
            "requested_cpu": sum(float(r.request.get("cpu", 0)) for r in live),
            "requested_memory": sum(int(r.request.get("memory_mb", 0)) << 20 for r in live),
            "disk_free_bytes": stat.f_bavail * stat.f_frsize,
            "max_sandboxes": agent.limits.max_sandboxes,
            "cpu_overcommit": agent.limits.cpu_overcommit,
            "memory_overcommit": agent.limits.memory_overcommit,
            "tiers": [c.tier for c in caps if c.available],
            "layers": layers,
            "started_at": self._started_at,
            "pid": os.getpid(),
        }

    def _cgroup_usage(self, agent: Any) -> tuple[float, int]:
        """(cores used since the previous report, bytes of memory used) of this edge's
        sandboxes, from the container runtime's cgroup v1 parent (0 when unknown)."""
        rt = agent.runtimes.get("container")
        parent = getattr(rt, "cgroup_parent", None)
        if not parent:
            return 0.0, 0
        root = Path("/sys/fs/cgroup")
        mem = cpu_ns = 0
        with contextlib.suppress(OSError, ValueError):
            mem = int((root / "memory" / parent / "memory.usage_in_bytes").read_text())
        with contextlib.suppress(OSError, ValueError):
            cpu_ns = int((root / "cpuacct" / parent / "cpuacct.usage").read_text())
        now = time.monotonic()
        cores = 0.0
        if self._cpu_sample is not None and now > self._cpu_sample[0]:
            cores = max(0.0, (cpu_ns - self._cpu_sample[1]) / 1e9 / (now - self._cpu_sample[0]))
        self._cpu_sample = (now, cpu_ns)
        return cores, mem

    async def owned_sandboxes(self) -> list[tuple[str, Any]]:
        """(owner, SandboxInfo) of every live sandbox here (for the cluster registry)."""
        agent = await self._agent()
        return [(lv.row.owner, agent._info(lv.row)) for lv in list(agent._live.values())]

    # --- relayed calls ----------------------------------------------------------------
    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``EdgeAgent.<method>(*args, **kwargs)``: ``("ok", result)`` or
        ``("error", wire error)``."""
        if method not in _CALLABLE:
            return _err(InvalidRequest(f"edge method {method!r} is not callable remotely"))
        try:
            agent = await self._agent()
            fn = getattr(agent, method, None)
            if fn is None:
                raise InvalidRequest(f"this edge has no {method!r}")
            return _ok(await fn(*args, **kwargs))
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def exec_stream(
        self, sandbox_id: str, owner: str, req: Any, seq: int | None, idem_key: str | None
    ) -> AsyncIterator[Any]:
        """Stream an exec's events (Ray streaming generator; each item one ``ExecEvent``)."""
        from dsec.models import ExecEvent

        try:
            agent = await self._agent()
            async for ev in agent.exec_stream(sandbox_id, owner, req, seq=seq, idem_key=idem_key):
                yield ev
        except DsecError as e:
            yield ExecEvent(type="error", error=e.to_wire()["error"])
        except Exception as e:
            log.exception("exec stream on %s failed", sandbox_id)
            yield ExecEvent(type="error", error=InternalError(str(e)).to_wire()["error"])

    async def read_layer(self, digest: str) -> Any:
        """The EROFS file of a layer as bytes, with its metadata: ``("ok", (bytes, info))``."""
        try:
            agent = await self._agent()
            info = agent.layers.get_layer(digest)
            data = await asyncio.to_thread(agent.layers.layer_path(digest).read_bytes)
            return _ok((data, info))
        except BaseException as e:
            return _err(e)

    async def missing_layers(self, digests: list[str]) -> Any:
        """Which of ``digests`` this node's layer store lacks."""
        from dsec.errors import LayerNotFound

        try:
            agent = await self._agent()
            missing = []
            for d in digests:
                try:
                    agent.layers.layer_path(d)
                except LayerNotFound:
                    missing.append(d)
            return _ok(missing)
        except BaseException as e:
            return _err(e)

    async def put_layer(self, read_result: Any) -> Any:
        """Adopt a layer file moved from another node: ``read_result`` is that node's
        :meth:`read_layer` answer (Ray resolves the object reference to it here, so the
        bytes go node to node). Its digest must match."""
        import tempfile

        try:
            status, value = read_result
            if status == "error":
                return ("error", value)
            data, info = value
            agent = await self._agent()
            fd, tmp = tempfile.mkstemp(dir=agent.paths.scratch, suffix=".erofs")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            layer = await asyncio.to_thread(
                agent.layers.import_layer_file,
                Path(tmp),
                info.kind,
                name=info.name,
                meta=dict(info.meta),
            )
            if layer.digest != info.digest:
                raise InternalError(
                    f"layer moved as {info.digest} arrived as {layer.digest}", digest=info.digest
                )
            return _ok(layer)
        except BaseException as e:
            return _err(e)

    async def shutdown(self, kill_sandboxes: bool = False) -> None:
        """Close the edge (sandboxes keep running unless ``kill_sandboxes``)."""
        if self.agent is not None:
            await self.agent.close(kill_sandboxes=kill_sandboxes)
            self.agent = None


def ensure_edge_actor(ray_node: dict[str, Any], config: NodeConfig) -> Any:
    """The edge actor of ``ray_node`` (a ``ray.nodes()`` entry): the existing one with its
    name, or a new one pinned to that node. Returns the actor handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_name_of(ray_node)
    remote_cls = ray.remote(EdgeActor)
    return remote_cls.options(
        name=actor_name(node, ray_node["NodeID"]),
        namespace=ACTOR_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=0,
        max_concurrency=1000,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node["NodeID"], soft=False),
    ).remote(node, config)


def config_dict(config: NodeConfig) -> dict[str, Any]:
    return asdict(config)
