"""A real multi-node Ray cluster on loopback, PostgreSQL on loopback, and ``dsec serve
--cluster`` in front of them.

* PostgreSQL 15 (Debian's ``postgresql`` package): ``initdb`` + ``pg_ctl`` as the
  ``postgres`` user in a temp dir, a free port on 127.0.0.1, its socket in the temp dir
  (``benchmarks/cluster_parts.py``, shared with ``benchmarks/cell.py``). The system cluster
  is never touched.
* Ray: ``ray.cluster_utils.Cluster``: a head and two worker nodes (separate raylets, each
  labelled ``dsec.io/node`` = ``head`` / ``w1`` / ``w2``) on this host (Ray binds the
  host's own address; nothing leaves the machine), with fast node
  health checks so a killed node is declared dead in about a second. ``w2``'s raylet runs
  with ``DSEC_CPU_OVERCOMMIT=1`` (its edge admits only 1x its cores), which the apiserver's
  placer does not know: the "full node rejects, next admits" path.
* ``dsec serve --cluster ADDR --database DSN`` as a child process: one edge actor per
  node, each with its own data dir under ``<base>/nodes/<node>``, layers from the shared
  test cache, the container and fncall tiers (``run_code`` is placed on a node).

The fixtures also provide what the conformance suite expects of ``sdk_env`` so it runs
unchanged against the cluster apiserver (container tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchmarks.cluster_parts import PG_BIN, Postgres, serve_replica
from tests.conftest import free_port


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not (PG_BIN / "initdb").exists():
        pytest.skip("PostgreSQL is not installed (apt install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="dsec-cl-pg-"))
    pg = Postgres.start(base, port=free_port())
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class RayTestCluster:
    cluster: Any
    address: str
    workers: dict[str, Any] = field(default_factory=dict)

    def kill_node(self, name: str) -> None:
        """Kill a worker node's raylet and its processes at once (no graceful drain)."""
        self.cluster.remove_node(self.workers.pop(name), allow_graceful=False)

    def add_worker(self, name: str, **env: str) -> None:
        self.workers[name] = self.cluster.add_node(
            num_cpus=1,
            labels={"dsec.io/node": name},
            env_vars=dict(env),
        )


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayTestCluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    ray_cluster_utils = pytest.importorskip("ray.cluster_utils")
    # Ray records the head's address in <user temp dir>/ray/ray_current_cluster whatever
    # temp_dir the nodes use, and does not create that directory on a fresh machine
    from ray._common.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    cluster = ray_cluster_utils.Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "labels": {"dsec.io/node": "head"},
            "include_dashboard": False,
            "temp_dir": "/tmp/dsec-cl-ray",
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_timeout_ms": 500,
                "health_check_failure_threshold": 3,
                "health_check_initial_delay_ms": 0,
            },
        },
    )
    rc = RayTestCluster(cluster=cluster, address=cluster.address)
    try:
        rc.add_worker("w1")
        rc.add_worker("w2", DSEC_CPU_OVERCOMMIT="1")
        cluster.wait_for_nodes()
        yield rc
    finally:
        cluster.shutdown()
        if not os.environ.get("DSEC_TEST_KEEP_RAY_LOGS"):  # else the actors' logs stay there
            shutil.rmtree("/tmp/dsec-cl-ray", ignore_errors=True)


@dataclass
class ClusterServer:
    url: str
    api_key: str
    home: Path
    node_root: Path
    proc: Any
    dsn: str
    address: str

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=300
        )


def start_cluster_server(
    home: Path, node_root: Path, address: str, dsn: str, layers: Path, **env: str
) -> tuple[subprocess.Popen[bytes], str]:
    """``dsec serve --cluster`` as a child process; returns (process, url) once healthy."""
    return serve_replica(
        home,
        node_root,
        address,
        dsn,
        free_port(),
        {
            "DSEC_TIERS": "container",
            "DSEC_NETWORK": "off",
            "DSEC_CLUSTER_SHARED_LAYERS": str(layers),
            "DSEC_CLUSTER_REPORT_INTERVAL_S": "0.5",
            "DSEC_CLUSTER_PROBE_TIMEOUT_S": "3",
            "DSEC_CLUSTER_LOST_AFTER_S": "6",
            **env,
        },
    )


def _shutdown_edges(address: str) -> None:
    """Close every edge actor with its sandboxes (what a cluster teardown does)."""
    import ray

    ray.init(address=address, namespace="dsec", log_to_driver=False)
    from ray.util import list_named_actors

    try:
        actors: dict[str, Any] = {}
        for entry in list_named_actors(all_namespaces=True):
            if entry["namespace"] == "dsec" and entry["name"].startswith("dsec-edge-"):
                with contextlib.suppress(Exception):
                    actors[entry["name"]] = ray.get_actor(entry["name"], namespace="dsec")
        for name, a in actors.items():  # evidence: what each edge still holds
            with contextlib.suppress(Exception):
                held = ray.get(a.owned_sandboxes.remote(), timeout=10)
                if held:
                    print(f"teardown: {name} still holds {[(i.id, i.state) for _, i in held]}")
        refs = {a.shutdown.remote(True): name for name, a in actors.items()}
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=30)
        for ref in pending:
            print(f"teardown: edge {refs[ref]} did not close in 30 s")
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
    finally:
        ray.shutdown()


def _clean_node_dirs(node_root: Path) -> None:
    """Reap what killed nodes left behind (their edges died without closing)."""
    from dsec.privileged.mount import mount_points, umount_quiet
    from dsec.server import embedded_edge

    async def close(home: Path) -> None:
        async with embedded_edge(home, tiers=["container"]) as edge:
            await edge.close(kill_sandboxes=True)

    from dsec.edge.registry import Registry

    os.environ["DSEC_NETWORK"] = "off"
    for home in sorted(p for p in node_root.iterdir() if p.is_dir()):
        if not (home / "state.db").exists():
            continue
        registry = Registry(home / "state.db")
        try:
            live = registry.select(states=("creating", "running", "paused"))
        finally:
            registry.close()
        if live:  # only a node whose edge died with sandboxes needs the embedded reaper
            with contextlib.suppress(Exception):
                asyncio.run(close(home))
    for mp in sorted(mount_points(node_root), key=lambda p: len(str(p)), reverse=True):
        umount_quiet(mp)


@pytest.fixture(scope="session")
def cluster_server(
    ray_cluster: RayTestCluster, postgres: Postgres, shared_layers: Path
) -> Iterator[ClusterServer]:
    base = Path(tempfile.mkdtemp(prefix="dsec-cl-"))
    home, node_root = base / "api", base / "nodes"
    proc, url = start_cluster_server(
        home,
        node_root,
        ray_cluster.address,
        postgres.dsn,
        shared_layers,
        DSEC_TIERS="container,fncall",
    )
    srv = ClusterServer(
        url=url,
        api_key=(home / "api_key").read_text().strip(),
        home=home,
        node_root=node_root,
        proc=proc,
        dsn=postgres.dsn,
        address=ray_cluster.address,
    )
    try:
        yield srv
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            _shutdown_edges(ray_cluster.address)
        t1 = time.monotonic()
        _clean_node_dirs(node_root)
        print(f"teardown: edges closed in {t1 - t0:.1f} s, dirs in {time.monotonic() - t1:.1f} s")
        leaked = mount_leaks(node_root)
        shutil.rmtree(base, ignore_errors=True)
        assert not leaked, f"leaked mounts under {node_root}: {leaked[:5]}"


def mount_leaks(root: Path) -> list[Path]:
    from dsec.privileged.mount import mount_points

    return [p for p in mount_points(root) if "/sandboxes/" in str(p)]


# --- what the conformance suite expects of sdk_env ----------------------------------------
class _HttpEdge:
    """The two edge calls the conformance fixtures make, answered over HTTP."""

    def __init__(self, srv: ClusterServer) -> None:
        self.srv = srv

    async def capabilities(self) -> Any:
        from dsec.models import CapabilityList

        async with httpx.AsyncClient(
            base_url=self.srv.url, headers={"Authorization": f"Bearer {self.srv.api_key}"}
        ) as c:
            r = await c.get("/v1/capabilities")
            r.raise_for_status()
            return CapabilityList.model_validate(r.json())


@dataclass
class ClusterLiveServer:
    url: str
    api_key: str
    home: Path
    edge: Any
    keys: Any
    tiers: list[str]

    def call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="session")
def cluster_live(cluster_server: ClusterServer) -> Iterator[ClusterLiveServer]:
    from dsec.cluster.state import ClusterState, PgKeyStore

    state = ClusterState(cluster_server.dsn)
    keys = PgKeyStore(state, cluster_server.home)
    try:
        yield ClusterLiveServer(
            url=cluster_server.url,
            api_key=cluster_server.api_key,
            home=cluster_server.home,
            edge=_HttpEdge(cluster_server),
            keys=keys,
            tiers=["container"],
        )
    finally:
        keys.close()
        state.close()


@pytest.fixture
def sdk_env(cluster_live: ClusterLiveServer, monkeypatch: pytest.MonkeyPatch) -> ClusterLiveServer:
    monkeypatch.setenv("DSEC_URL", cluster_live.url)
    monkeypatch.setenv("DSEC_API_KEY", cluster_live.api_key)
    return cluster_live


@pytest.fixture(params=["container"])
def tier(request: pytest.FixtureRequest, sdk_env: ClusterLiveServer) -> str:
    return str(request.param)
