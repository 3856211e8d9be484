"""Migration of a microvm between cluster nodes by its memory state (``memory_snapshot``):
the guest continues on the target with its processes, memory and tmpfs files.

Runs on the session's three-node Ray cluster, but with its own ``dsec serve --cluster``
(``DSEC_TIERS=microvm``), its own node root (so its own edge actors: their names carry the
node root's hash) and its own PostgreSQL database, so the container-tier cluster tests are
not disturbed. Each node's guest kernel build is the VM tests' one (a symlink to
``$DSEC_VM_TEST_HOME/bin``). ``w2``'s edge admits only 1x its cores (see conftest): a
2-core sandbox fills it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.cluster.conftest import ClusterServer, Postgres, RayTestCluster, start_cluster_server
from tests.conftest import wait_until
from tests.isolation import WORKER

from dsec import Sandbox
from dsec.errors import InvalidRequest, NotFound, QuotaExceeded

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.root, pytest.mark.timeout(600)]

PREFER = "dsec.io/prefer-node"
NODES = ("head", "w1", "w2")
VM_HOME = Path(os.environ.get("DSEC_VM_TEST_HOME", f"/tmp/dsec-vmtest-{WORKER}"))  # tests/vm's

# a background shell whose only copy of $v is its own memory; on SIGUSR1 it writes it out
_HOLDER = (
    "v=kept-$((6*7)); "
    "(trap 'echo $v > /tmp/said' USR1; while :; do sleep 1; done) </dev/null >/dev/null 2>&1 & "
    "echo $!"
)
_ASK = (
    "rm -f /tmp/said; kill -USR1 {pid}; "
    "for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.2; done; cat /tmp/said"
)
_BOOT_ID = "cat /proc/sys/kernel/random/boot_id"


def _database(pg: Postgres, name: str, *, drop: bool = False) -> str:
    """Create (or drop) database ``name`` in the test PostgreSQL; returns its DSN."""
    import psycopg

    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not drop:
            conn.execute(f'CREATE DATABASE "{name}"')
    return pg.dsn.rsplit("/", 1)[0] + "/" + name


def _shutdown_own_edges(address: str, node_root: Path) -> None:
    """Close this module's edge actors (the ones named for ``node_root``) with their
    sandboxes, then release them."""
    import hashlib

    import ray
    from ray.util import list_named_actors

    suffix = "-" + hashlib.sha256(str(node_root).encode()).hexdigest()[:6]
    ray.init(address=address, namespace="dsec", log_to_driver=False)
    try:
        actors = []
        for entry in list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == "dsec" and name.startswith("dsec-edge-"):
                if name.endswith(suffix):
                    with contextlib.suppress(Exception):
                        actors.append(ray.get_actor(name, namespace="dsec"))
        refs = [a.shutdown.remote(True) for a in actors]
        ray.wait(refs, num_returns=len(refs), timeout=60)
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
    finally:
        ray.shutdown()


def _own_qemus(node_root: Path) -> list[int]:
    """QEMU processes of this module's nodes (named ``dsec:<tag>-microvm:...``)."""
    from dsec.config import Paths
    from dsec.runtimes.microvm import MicroVMRuntime
    from dsec.runtimes.microvm.qemu import qemu_processes

    pids: list[int] = []
    for node in NODES:
        rt = MicroVMRuntime(Paths(node_root / node))
        pids += list(qemu_processes(rt.qemu_tag).values())
    return pids


@pytest.fixture(scope="module")
def vm_cluster(
    ray_cluster: RayTestCluster, postgres: Postgres, shared_layers: Path
) -> Iterator[ClusterServer]:
    from dsec.config import Paths
    from dsec.privileged.cgroups import cgroup
    from dsec.runtimes.microvm import MicroVMRuntime

    base = Path(tempfile.mkdtemp(prefix="dsec-clvm-"))
    home, node_root = base / "api", base / "nodes"
    (VM_HOME / "bin").mkdir(parents=True, exist_ok=True)
    for node in NODES:  # the guest kernel/initramfs build is per node: reuse the VM tests'
        (node_root / node).mkdir(parents=True)
        (node_root / node / "bin").symlink_to(VM_HOME / "bin", target_is_directory=True)
    db = f"dsec_vmmig_{os.getpid()}"
    dsn = _database(postgres, db)
    proc = None
    try:
        proc, url = start_cluster_server(
            home, node_root, ray_cluster.address, dsn, shared_layers, DSEC_TIERS="microvm"
        )
        yield ClusterServer(
            url=url,
            api_key=(home / "api_key").read_text().strip(),
            home=home,
            node_root=node_root,
            proc=proc,
            dsn=dsn,
            address=ray_cluster.address,
        )
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(Exception):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
        with contextlib.suppress(Exception):
            _shutdown_own_edges(ray_cluster.address, node_root)
        leftover = _own_qemus(node_root)
        for node in NODES:
            rt = MicroVMRuntime(Paths(node_root / node))
            rt.remove_templates()
            for rel in (rt.cgroup_prefix, f"dsec-{rt.tag}"):
                with contextlib.suppress(OSError):
                    cgroup(rel).remove_if_empty()
        shutil.rmtree(base, ignore_errors=True)
        with contextlib.suppress(Exception):
            _database(postgres, db, drop=True)
        assert not leftover, f"QEMUs left running after the edges closed: {leftover}"


def _create(srv: ClusterServer, node: str, **kw: Any) -> Sandbox:
    kw.setdefault("ttl_s", 900)
    return Sandbox.create(
        url=srv.url,
        api_key=srv.api_key,
        tier="microvm",
        image="busybox",
        labels={PREFER: node},
        **kw,
    )


def _leftovers(srv: ClusterServer) -> dict[str, list[str]]:
    """Migration files still on disk: captures on the nodes, staging dirs on targets."""
    out: dict[str, list[str]] = {}
    for node in NODES:
        d = srv.node_root / node
        found = [p.name for p in (d / "microvm" / "forks").glob("*")]
        found += [p.name for p in (d / "scratch" / "migrate-in").glob("*")]
        if found:
            out[node] = found
    return out


def test_microvm_migrates_with_its_processes(vm_cluster: ClusterServer) -> None:
    # 2 vCPUs: on w2 (edge admits 1x its cores) the migrated sandbox fills the node
    sb = _create(vm_cluster, "w1", cpu=2)
    made = [sb]
    try:
        assert sb.info.node == "w1"
        old_id = sb.id
        pid = sb.commands.run(_HOLDER).stdout.strip()
        assert pid.isdigit(), pid
        sb.files.write("/root/note.txt", b"only in guest RAM\n")  # the upper layer is tmpfs
        boot_id = sb.commands.run(_BOOT_ID).stdout

        # bad targets first: typed errors, the sandbox untouched
        with pytest.raises(NotFound):
            sb.migrate(node="nosuchnode")
        with pytest.raises(InvalidRequest):
            sb.migrate(node="w1")
        assert sb.id == old_id and sb.refresh().state == "running"

        t0 = time.monotonic()
        result = sb.migrate(node="w2")
        took = time.monotonic() - t0
        assert result.method == "memory_snapshot" and result.processes_carried is True
        assert result.from_node == "w1" and result.to_node == "w2"
        assert result.from_id == old_id and sb.id == result.sandbox.id != old_id
        assert sb.id.startswith("sb-w2-") and sb.info.node == "w2"
        assert result.state_bytes > 1 << 20
        print(
            f"\nmicrovm (memory_mb={sb.info.memory_mb}) migrated w1 -> w2 in "
            f"{result.duration_ms:.0f} ms (client {took:.2f} s), "
            f"{result.state_bytes / 1e6:.1f} MB of state, {result.layer_bytes} layer bytes"
        )
        with contextlib.suppress(OSError):  # the apiserver's breakdown, when it logs at INFO
            for line in (vm_cluster.home / "serve.log").read_text().splitlines():
                if "memory migration" in line:
                    print(line)

        # the same guest: same kernel boot, same process with its memory, same tmpfs file
        assert sb.commands.run(_BOOT_ID).stdout == boot_id
        assert sb.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
        assert sb.commands.run(_ASK.format(pid=pid)).stdout.strip() == "kept-42"
        assert sb.files.read("/root/note.txt") == b"only in guest RAM\n"
        assert sb.commands.run("echo hi; uname -m").exit_code == 0
        old = Sandbox.connect(old_id, url=vm_cluster.url, api_key=vm_cluster.api_key)
        assert old.info.state == "stopped"
        # the source's files go with its teardown, which may end just after the answer
        assert wait_until(lambda: not _leftovers(vm_cluster)), _leftovers(vm_cluster)

        # w2 is now full by its own admission (the placer thinks it has room): the target
        # refuses before any byte moves, the source keeps running, nothing is left anywhere
        other = _create(vm_cluster, "w1", cpu=2)
        made.append(other)
        other_pid = other.commands.run(_HOLDER).stdout.strip()
        before = {s.id for s in Sandbox.list(url=vm_cluster.url, api_key=vm_cluster.api_key)}
        with pytest.raises(QuotaExceeded):
            other.migrate(node="w2")
        assert other.refresh().state == "running" and other.info.node == "w1"
        assert other.commands.run(_ASK.format(pid=other_pid)).stdout.strip() == "kept-42"
        after = {s.id for s in Sandbox.list(url=vm_cluster.url, api_key=vm_cluster.api_key)}
        assert after == before
        # the source's files go with its teardown, which may end just after the answer
        assert wait_until(lambda: not _leftovers(vm_cluster)), _leftovers(vm_cluster)

        # no target named: the placer picks another node, the guest carries on there
        again = sb.migrate()
        assert again.method == "memory_snapshot" and again.to_node in ("head", "w1")
        assert sb.commands.run(_ASK.format(pid=pid)).stdout.strip() == "kept-42"
        assert sb.commands.run(_BOOT_ID).stdout == boot_id
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()
