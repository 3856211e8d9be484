"""``sb.metrics()`` on real sandboxes (root): a ``dsec serve`` with the container and fncall
tiers and networking on a subnet of its own. CPU burnt by a command shows in the cumulative
counter and the rate, files written to the writable layer in disk and cache, packets sent
in the network counters, and a paused sandbox is measured without being resumed."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.isolation import worker_subnet

from dsec import NetworkPolicy, Sandbox
from dsec.errors import SandboxNotFound
from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,  # a server start, a second of CPU burnt per tier
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, crun, netns)"),
]

SUBNET = worker_subnet(222)  # a subnet of its own (other tests' servers use others)
BURN = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"


@pytest.fixture(scope="module")
def server(shared_layers: Path) -> Iterator[BackgroundServer]:
    home = Path(f"/tmp/dsec-metrics-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    try:
        with BackgroundServer(
            home, tiers=["container", "fncall"], network_options={"subnet": SUBNET}
        ) as srv:
            yield srv
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_container_metrics(server: BackgroundServer) -> None:
    with Sandbox.create(
        image="busybox", cpu=1.0, memory_mb=128, disk_mb=64, url=server.url, api_key=server.api_key
    ) as sb:
        idle = sb.metrics()
        assert idle.source == "cgroup v1" or idle.source == "cgroup v2"
        assert idle.memory.limit_bytes == 128 << 20
        assert idle.disk.total_bytes is not None and 60 << 20 <= idle.disk.total_bytes <= 64 << 20
        assert idle.network is None and idle.pids is not None and idle.pids >= 1

        assert sb.commands.run(BURN, timeout=120).exit_code == 0
        assert sb.commands.run("dd if=/dev/zero of=/blob bs=1M count=24", timeout=60).ok
        busy = sb.metrics()
        burnt = busy.cpu.usage_s - idle.cpu.usage_s
        assert burnt > 0.05, busy
        # the rate covers the time since the previous sample
        assert busy.cpu.used_cores == pytest.approx(burnt / busy.interval_s, rel=0.2, abs=0.01)
        assert 0 < busy.cpu.used_pct <= 100 * 1.5
        assert busy.disk.used_bytes is not None and busy.disk.used_bytes >= 24 << 20
        assert busy.memory.cache_bytes >= 20 << 20  # tmpfs pages are charged to it

        # paused: measured frozen, and still paused afterwards
        sb.pause()
        frozen = sb.metrics()
        assert frozen.state == "paused"
        time.sleep(0.3)
        again = sb.metrics()
        assert again.cpu.usage_s - frozen.cpu.usage_s < 0.01
        assert sb.refresh().state == "paused"

        # another key: not found
        other = server.keys.create_key("metrics-other")
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sb.id, url=server.url, api_key=other).metrics()


def test_container_network_counters(server: BackgroundServer) -> None:
    assert server.edge is not None and server.edge.network.started
    policy = NetworkPolicy(allow_domains=["allowed.invalid"])
    with Sandbox.create(
        image="busybox", network=policy, url=server.url, api_key=server.api_key
    ) as sb:
        before = sb.metrics().network
        assert before is not None
        # DNS queries go to the node's resolver through the sandbox's veth (and are refused)
        sb.commands.run("nslookup not-allowed.invalid; true", timeout=30)
        after = sb.metrics().network
        assert after is not None
        assert after.tx_packets > before.tx_packets and after.tx_bytes > before.tx_bytes
        assert after.rx_packets > before.rx_packets  # the refusals came back


@pytest.mark.debian
def test_fncall_metrics(server: BackgroundServer) -> None:
    with Sandbox.create(
        tier="fncall", image="debian", url=server.url, api_key=server.api_key
    ) as sb:
        first = sb.metrics()
        assert first.tier == "fncall" and first.network is None
        assert first.disk.total_bytes is not None and first.disk.total_bytes > 0
        r = sb.commands.run(
            'python3 -c \'sum(range(3_000_000)); open("/work/f","w").write("x"*2_000_000)\''
        )
        assert r.exit_code == 0, r.stderr
        second = sb.metrics()
        assert second.cpu.usage_s > first.cpu.usage_s
        assert second.disk.used_bytes is not None and second.disk.used_bytes >= 2_000_000
