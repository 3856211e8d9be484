"""The edge actor: one :class:`~dsec.edge.agent.EdgeAgent` per Ray node, as a Ray actor.

:func:`ensure_edge_actor` starts it pinned to its node (``NodeAffinitySchedulingStrategy``,
``soft=False``), detached and named ``dsec-edge-<node>-<ray node id>-<node root hash>`` in the
``dsec`` namespace, with ``max_restarts=-1``: Ray restarts it on the same node when its process dies, and the new
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
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsec.contract.edge import STREAM_VERBS, edge_verbs
from dsec.contract.verbs import Envelope
from dsec.errors import DsecError, InternalError, InvalidRequest
from dsec.models import SYSTEM_OWNER

__all__ = [
    "ACTOR_NAMESPACE",
    "ACTOR_PREFIX",
    "NODE_LABEL",
    "EdgeActor",
    "NodeConfig",
    "actor_name",
    "edge_names_of",
    "ensure_edge_actor",
    "node_name_of",
]

log = logging.getLogger("dsec.cluster.actor")

ACTOR_NAMESPACE = "dsec"
ACTOR_PREFIX = "dsec-edge-"
NODE_LABEL = "dsec.io/node"
BURST_LABEL = "dsec.io/burst"

# EdgeAgent methods an apiserver may call through ``EdgeActor.call`` (the edge contract's
# verbs) and through ``EdgeActor.stream`` (those that answer with a stream)
_CALLABLE = edge_verbs() - STREAM_VERBS
_STREAMING = STREAM_VERBS


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
        edge_factory: ``"module:function"`` building each node's ``EdgeAgent`` as
            ``function(data dir, node name, this config)`` instead of the node's real
            runtimes (None): e.g. ``"dsec.testing:memory_node_edge"``, in-memory sandboxes
            for a simulated cell whose control plane alone is measured.
        edges_per_node: edge actors per Ray node, each a dsec node of its own (named
            ``<node>e<i>``, own data dir). 1 in production (one edge owns a host's
            runtimes); more only with an ``edge_factory`` whose sandboxes share nothing,
            to simulate more nodes than Ray nodes fit on one machine.
    """

    node_root: str = "/var/lib/dsec/nodes"
    shared_layers: str | None = None
    tiers: tuple[str, ...] | None = None
    network: bool = True
    env: dict[str, str] = field(default_factory=dict)
    edge_factory: str | None = None
    edges_per_node: int = 1


def node_name_of(ray_node: dict[str, Any]) -> str:
    """The dsec node name of a ``ray.nodes()`` entry (see the module docstring)."""
    labels = ray_node.get("Labels") or {}
    raw = str(labels.get(NODE_LABEL) or "")
    name = re.sub(r"[^a-z0-9]", "", raw.lower())[:12]
    return name or "n" + str(ray_node["NodeID"])[:11]


def edge_names_of(ray_node: dict[str, Any], config: NodeConfig) -> list[str]:
    """The dsec node names of the edges a Ray node runs: its :func:`node_name_of`, or with
    ``config.edges_per_node`` k > 1 the k names ``<first 8 of it>e<i>``."""
    base = node_name_of(ray_node)
    k = max(1, config.edges_per_node)
    return [base] if k == 1 else [f"{base[:8]}e{i}" for i in range(k)]


def actor_name(node: str, ray_node_id: str, node_root: str) -> str:
    """``dsec-edge-<node>-<first 12 hex of the Ray node id>-<6 hex of node_root's hash>``:
    every replica of one deployment (same ``node_root``) finds the same actor for a node; a
    node that rejoins (a new Ray node id) gets a fresh one, and so does a second deployment
    on the same Ray cluster with another ``node_root`` (its own data dirs, tiers, settings)."""
    root = hashlib.sha256(node_root.encode()).hexdigest()[:6]
    return f"{ACTOR_PREFIX}{node}-{ray_node_id[:12]}-{root}"


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

    _KEEP_SNAPSHOTS = 16
    """Generations :meth:`sandbox_changes` can answer a difference from (each replica
    asks once a report interval; an older cursor gets the full list)."""

    def __init__(self, node: str, config: NodeConfig) -> None:
        self.node = node
        self.config = config
        self.home = Path(config.node_root) / node
        self.agent: Any = None
        self._start_lock: asyncio.Lock | None = None
        self._started_at = 0.0
        self._cpu_sample: tuple[float, float] | None = None  # (monotonic s, cpuacct ns)
        # memory migrations: captures leaving this node (export id -> (tier, snapshot,
        # file name -> bytes)) and staging dirs of captures arriving (import id -> (dir,
        # the source's export description))
        self._exports: dict[str, tuple[str, Any, dict[str, int]]] = {}
        self._imports: dict[str, tuple[Path, dict[str, Any]]] = {}
        # sandbox_changes: the live ids' states at the last few generations, and this
        # incarnation's token (a restarted actor's cursors never match an older one's)
        self._token = secrets.token_hex(8)
        self._generation = 0
        self._snapshots: list[tuple[int, dict[str, str]]] = []
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
        from dsec.node import open_edge
        from dsec.privileged.reaper import become_subreaper

        become_subreaper()  # sandbox inits come back to this process, whose reaper waits for them
        self.home.mkdir(parents=True, exist_ok=True)
        if self.config.shared_layers and not (self.home / "layers").exists():
            (self.home / "layers").symlink_to(self.config.shared_layers, target_is_directory=True)
        if self.config.edge_factory:
            import importlib

            module, _, name = self.config.edge_factory.partition(":")
            factory = getattr(importlib.import_module(module), name)
            agent = factory(self.home, self.node, self.config)
        else:
            agent, _store = open_edge(
                Paths(self.home),
                tiers=list(self.config.tiers) if self.config.tiers else None,
                network=self.config.network,
                node=self.node,
            )
        await agent.start()  # reconciles with what still runs on this node
        await self._start_port_gateway(agent)
        self._started_at = time.time()
        log.info("edge %s started in %s (pid %d)", self.node, self.home, os.getpid())
        return agent

    async def _start_port_gateway(self, agent: Any) -> None:
        """The node's port gateway (:class:`dsec.edge.ports.PortGateway`): where the
        cluster's apiservers pick up the sandbox connections this edge opens. It listens on
        the node's Ray address (``DSEC_PORTS_GATEWAY_HOST`` to choose another one) on
        ``DSEC_PORTS_GATEWAY_PORT`` (default: any free port; tickets carry it)."""
        from dsec.edge.ports import PortGateway

        host = os.environ.get("DSEC_PORTS_GATEWAY_HOST", "").strip()
        if not host:
            try:
                import ray

                host = ray.util.get_node_ip_address()
            except Exception:
                host = "127.0.0.1"
        try:
            port = int(os.environ.get("DSEC_PORTS_GATEWAY_PORT", "0") or 0)
        except ValueError:
            port = 0
        gateway = PortGateway(host, port)
        try:
            await gateway.start()
        except OSError as e:
            log.error("edge %s: no port gateway on %s:%d (%s)", self.node, host, port, e)
            return
        agent.port_gateway = gateway
        log.info("edge %s: port gateway on %s:%d", self.node, host, gateway.port)

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
        usage = agent.usage()
        cpu_used, mem_used = self._cgroup_usage(agent)
        caps = (await agent.capabilities()).tiers
        try:
            layers = [x.digest for x in agent.layers.list_owned_layers(SYSTEM_OWNER)]
        except Exception:
            layers = []
        stat = os.statvfs(self.home)
        return {
            "node": self.node,
            "cpus": usage.cpus,
            "memory_bytes": usage.memory_mb << 20,
            "cpu_used": cpu_used,
            "memory_used": mem_used,
            "sandboxes": usage.sandboxes,
            "requested_cpu": usage.requested_cpu,
            "requested_memory": usage.requested_memory_mb << 20,
            "disk_free_bytes": stat.f_bavail * stat.f_frsize,
            "max_sandboxes": usage.max_sandboxes,
            "cpu_overcommit": usage.cpu_overcommit,
            "memory_overcommit": usage.memory_overcommit,
            "tiers": [c.tier for c in caps if c.available],
            "layers": layers,
            "started_at": self._started_at,
            "pid": os.getpid(),
        }

    def _cgroup_usage(self, agent: Any) -> tuple[float, int]:
        """(cores used since the previous report, bytes of memory used) of this edge's
        sandboxes, from the container runtime's cgroup parent (0 when unknown)."""
        from dsec.privileged.cgroups import cgroup
        from dsec.runtimes.container.runtime import ContainerRuntime

        rt = agent.runtimes.get("container")
        if not isinstance(rt, ContainerRuntime) or not rt.cgroup_parent:
            return 0.0, 0
        parent = cgroup(rt.cgroup_parent)
        mem = cpu_ns = 0
        with contextlib.suppress(OSError, ValueError):
            mem = parent.memory_charge().usage
        with contextlib.suppress(OSError, ValueError):
            cpu_ns = parent.cpu_usage_ns() or 0
        now = time.monotonic()
        cores = 0.0
        if self._cpu_sample is not None and now > self._cpu_sample[0]:
            cores = max(0.0, (cpu_ns - self._cpu_sample[1]) / 1e9 / (now - self._cpu_sample[0]))
        self._cpu_sample = (now, cpu_ns)
        return cores, mem

    async def sandbox_changes(
        self, since: tuple[str, int] | None, live_ids: bool = False
    ) -> dict[str, Any]:
        """What the registry needs to learn of this node since the answer whose
        ``cursor`` was ``since``: ``{"cursor", "full", "changed", "gone"}``. ``changed``:
        (owner, SandboxInfo) of sandboxes live here that are new or in another state since
        then; ``gone``: ids live then and not now. ``full`` (first call, an unknown or too
        old cursor, a restarted actor): ``changed`` holds every live sandbox and the
        registry rows of this node absent from it are to be stopped. The work is that of
        the changes, plus a scan of the live ids' states here: a report does not grow with
        the sandboxes that did not change. ``live_ids``: also ``"live"``, every live id
        (for the registry's periodic reconcile, which catches sandboxes that started and
        stopped between two reports)."""
        agent = await self._agent()
        now = agent.live_states()
        last = self._snapshots[-1][1] if self._snapshots else None
        if now != last:
            self._generation += 1
            self._snapshots.append((self._generation, now))
            del self._snapshots[: -self._KEEP_SNAPSHOTS]
        cursor = (self._token, self._generation)
        before = None
        if since is not None and since[0] == self._token:
            before = next((snap for g, snap in self._snapshots if g == since[1]), None)
        if before is None:
            return {"cursor": cursor, "full": True, "changed": agent.owned_sandboxes(), "gone": []}
        extra = {"live": list(now)} if live_ids else {}
        changed = []
        for sid, st in now.items():
            if before.get(sid) != st:
                found = agent.owned_sandbox(sid)
                if found is not None:
                    changed.append(found)
        gone = [sid for sid in before if sid not in now]
        return {"cursor": cursor, "full": False, "changed": changed, "gone": gone, **extra}

    async def owned_sandboxes(self) -> list[tuple[str, Any]]:
        """(owner, SandboxInfo) of every live sandbox here (for the cluster registry)."""
        agent = await self._agent()
        owned: list[tuple[str, Any]] = agent.owned_sandboxes()
        return owned

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

    async def create_each(self, items: list[tuple[Any, str]]) -> Any:
        """Create a sandbox for each ``(CreateSandboxRequest, owner)`` of ``items``: single
        creations an apiserver coalesced into one call (:mod:`dsec.cluster.coalesce`), run
        as concurrent ``EdgeAgent.create_sandbox`` calls. ``("ok", answers)``, one answer
        per item in order, each ``("ok", SandboxInfo)`` or ``("error", wire error)``: an
        item's refusal or failure leaves the others alone."""
        try:
            agent = await self._agent()
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)
        outs = await asyncio.gather(
            *(agent.create_sandbox(req, owner) for req, owner in items), return_exceptions=True
        )
        return _ok([_err(x) if isinstance(x, BaseException) else _ok(x) for x in outs])

    async def stream(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncIterator[Any]:
        """Run the streaming verb ``EdgeAgent.<method>(*args, **kwargs)`` (Ray streaming
        generator): each item ``("ok", item)``; an error ends the stream as one
        ``("error", wire error)`` item."""
        if method not in _STREAMING:
            yield _err(InvalidRequest(f"edge method {method!r} does not stream"))
            return
        try:
            agent = await self._agent()
            gen = getattr(agent, method)(*args, **kwargs)
            async with contextlib.aclosing(gen):
                async for item in gen:
                    yield _ok(item)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError | GeneratorExit):
                raise
            yield _err(e)

    async def exec_stream(self, req: Any, owner: str, env: Envelope) -> AsyncIterator[Any]:
        """Stream an exec's events (Ray streaming generator; each item one ``ExecEvent``);
        ``req`` is a ``SandboxExecRequest``."""
        from dsec.models import ExecEvent

        try:
            agent = await self._agent()
            async for ev in agent.exec_stream(req, owner, env):
                yield ev
        except DsecError as e:
            yield ExecEvent(type="error", error=e.to_wire()["error"])
        except Exception as e:
            log.exception("exec stream on %s failed", req.sandbox_id)
            yield ExecEvent(
                type="error",
                error=InternalError(
                    f"exec failed on the node ({type(e).__name__}); the node logged it"
                ).to_wire()["error"],
            )

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

    async def put_image(self, owner: str, image: Any) -> Any:
        """Register ``image`` (an ``ImageInfo`` of another node, whose layers were moved
        here first) as ``owner``'s: a build's image on every node."""
        try:
            agent = await self._agent()
            return _ok(
                agent.layers.put_image(image.name, list(image.layers), meta=image.meta, owner=owner)
            )
        except BaseException as e:
            return _err(e)

    # --- VM migration by memory state (dsec.cluster.migrate drives these) ----------------
    # Source: export_memory -> read_export_chunk (one object per chunk, handed by reference
    # to the target's write_import_chunk) -> drop_export. Target: prepare_import ->
    # write_import_chunk ... -> finish_import, or abort_import.

    async def export_memory(self, sandbox_id: str, owner: str) -> Any:
        """Capture ``sandbox_id``'s memory for migration (:meth:`EdgeAgent.export_memory`;
        the sandbox keeps running). ``("ok", export)``: the description without this node's
        snapshot handle, plus ``export_id`` for :meth:`read_export_chunk` and
        :meth:`drop_export`."""
        try:
            agent = await self._agent()
            export = dict(await agent.export_memory(sandbox_id, owner))
            snapshot = export.pop("snapshot")
            export_id = secrets.token_hex(8)
            self._exports[export_id] = (str(export["tier"]), snapshot, dict(export["files"]))
            export["export_id"] = export_id
            return _ok(export)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def read_export_chunk(self, export_id: str, name: str, offset: int, length: int) -> Any:
        """``("ok", bytes)``: ``length`` bytes at ``offset`` of file ``name`` of a capture.
        The caller passes this call's object reference on to the target's
        :meth:`write_import_chunk`: the bytes go node to node through the object store."""
        try:
            entry = self._exports.get(export_id)
            if entry is None:
                raise InvalidRequest(f"no memory export {export_id!r} on node {self.node}")
            _, snapshot, files = entry
            if name not in files or offset < 0 or length < 0 or offset + length > files[name]:
                raise InvalidRequest(f"{name!r} [{offset}, +{length}) is not in the export")
            path = Path(snapshot.dir) / name

            def read() -> bytes:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    return os.pread(fd, length, offset)
                finally:
                    os.close(fd)

            data = await asyncio.to_thread(read)
            if len(data) != length:
                raise InternalError(f"{name} of export {export_id} is shorter than recorded")
            return _ok(data)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def drop_export(self, export_id: str) -> Any:
        """Delete a capture made by :meth:`export_memory` (idempotent)."""
        try:
            entry = self._exports.pop(export_id, None)
            if entry is not None:
                agent = await self._agent()
                await agent.drop_memory_export(entry[0], entry[1])
            return _ok(None)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    def _staging_root(self, agent: Any) -> Path:
        return Path(agent.paths.scratch) / "migrate-in"

    async def prepare_import(self, export: dict[str, Any]) -> Any:
        """Check that this node can take the capture ``export`` (another node's
        :meth:`export_memory` answer; :meth:`EdgeAgent.check_memory_import`) and make its
        staging directory with empty files. ``("ok", import_id)``. Staging dirs an earlier
        incarnation of this actor left behind are removed here."""
        try:
            agent = await self._agent()
            await agent.check_memory_import(export)
            for name in export["files"]:
                if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", name):
                    raise InvalidRequest(f"bad file name {name!r} in a memory export")
            root = self._staging_root(agent)
            known = {str(d) for d, _ in self._imports.values()}
            if root.is_dir():
                for stale in root.iterdir():
                    if str(stale) not in known:
                        await asyncio.to_thread(shutil.rmtree, stale, True)
            import_id = secrets.token_hex(8)
            d = root / import_id
            d.mkdir(mode=0o700, parents=True)
            for name in export["files"]:
                (d / name).touch(mode=0o600)
            self._imports[import_id] = (d, dict(export))
            return _ok(import_id)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def write_import_chunk(
        self, import_id: str, name: str, offset: int, read_result: Any
    ) -> Any:
        """Write one chunk of a capture into its staging file: ``read_result`` is the
        source's :meth:`read_export_chunk` answer (Ray resolves the object reference to it
        here). ``("ok", bytes written)``."""
        try:
            status, value = read_result
            if status == "error":
                return ("error", value)
            entry = self._imports.get(import_id)
            if entry is None:
                raise InvalidRequest(f"no memory import {import_id!r} on node {self.node}")
            d, export = entry
            size = int(export["files"].get(name, -1))
            data: bytes = value
            if size < 0 or offset < 0 or offset + len(data) > size:
                raise InvalidRequest(f"{name!r} [{offset}, +{len(data)}) is not in the export")

            def write() -> int:
                fd = os.open(d / name, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)

            return _ok(await asyncio.to_thread(write))
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def finish_import(self, import_id: str, owner: str) -> Any:
        """Start the migrated sandbox from the staged files
        (:meth:`EdgeAgent.import_memory`); the staging directory is removed whatever the
        outcome. ``("ok", SandboxInfo)``."""
        try:
            entry = self._imports.pop(import_id, None)
            if entry is None:
                raise InvalidRequest(f"no memory import {import_id!r} on node {self.node}")
            d, export = entry
            try:
                for name, size in export["files"].items():
                    got = (await asyncio.to_thread((d / name).stat)).st_size
                    if got != int(size):
                        raise InternalError(
                            f"{name} arrived with {got} of {size} bytes", import_id=import_id
                        )
                agent = await self._agent()
                return _ok(await agent.import_memory(export, owner, str(d)))
            finally:
                await asyncio.to_thread(shutil.rmtree, d, True)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            return _err(e)

    async def abort_import(self, import_id: str) -> Any:
        """Drop a capture's staging directory (idempotent)."""
        entry = self._imports.pop(import_id, None)
        if entry is not None:
            await asyncio.to_thread(shutil.rmtree, entry[0], True)
        return _ok(None)

    async def shutdown(self, kill_sandboxes: bool = False) -> None:
        """Close the edge (sandboxes keep running unless ``kill_sandboxes``)."""
        if self.agent is not None:
            if self.agent.port_gateway is not None:
                await self.agent.port_gateway.close()
            await self.agent.close(kill_sandboxes=kill_sandboxes)
            self.agent = None


def ensure_edge_actor(ray_node: dict[str, Any], config: NodeConfig, node: str | None = None) -> Any:
    """The edge actor of ``ray_node`` (a ``ray.nodes()`` entry) for dsec node ``node``
    (default: its :func:`node_name_of`): the existing one with its name, or a new one
    pinned to that node. Returns the actor handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node or node_name_of(ray_node)
    remote_cls = ray.remote(EdgeActor)
    return remote_cls.options(
        name=actor_name(node, ray_node["NodeID"], config.node_root),
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
