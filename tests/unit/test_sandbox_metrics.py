"""Per-sandbox metrics: the kernel-file parsers (cgroup v1 and v2, net, meminfo), the edge's
rates, ``GET /v1/sandboxes/{id}/metrics`` through the real app over FakeEdge (a second key
gets 404, a paused sandbox stays paused, the TTL is not extended), and ``sb.metrics()``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.timing import budget

from dsec import AsyncSandbox, Sandbox, SandboxMetrics
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.errors import CapabilityNotSupported, SandboxNotFound
from dsec.models import SandboxRef
from dsec.runtimes.usage import (
    NetCounters,
    disk_usage,
    parse_flat_keyed,
    parse_meminfo,
    parse_net_dev,
    parse_proc_stat_cpu,
    processes_cpu_ns,
    read_cgroup,
    read_cgroup_v1,
    read_cgroup_v2,
    read_veth_counters,
)
from dsec.testing import FAKE_BASE_MEMORY, FAKE_CPU_NS_PER_EXEC, FakeEdge

KEY_A = "dsec_metrics_a"
KEY_B = "dsec_metrics_b"


# --- parsers -----------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


V1_STAT = """cache 1048576
rss 4194304
shmem 524288
inactive_file 262144
total_cache 2097152
total_rss 4194304
total_inactive_file 1048576
total_active_file 524288
"""


def test_cgroup_v1_counters(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "cpuacct/dsec-x/sb-1/cpuacct.usage": "1500000000\n",
            "memory/dsec-x/sb-1/memory.usage_in_bytes": "9437184\n",
            "memory/dsec-x/sb-1/memory.stat": V1_STAT,
            "memory/dsec-x/sb-1/memory.limit_in_bytes": "268435456\n",
            "memory/dsec-x/sb-1/memory.max_usage_in_bytes": "10485760\n",
            "pids/dsec-x/sb-1/pids.current": "7\n",
        },
    )
    cg = read_cgroup("/dsec-x/sb-1", tmp_path)
    assert cg.version == 1
    assert cg.cpu_usage_ns == 1_500_000_000
    # working set: usage minus the hierarchy's inactive file cache
    assert cg.memory_used_bytes == 9437184 - 1048576
    assert cg.memory_cache_bytes == 2097152  # total_ wins over the local counter
    assert cg.memory_limit_bytes == 256 << 20
    assert cg.memory_peak_bytes == 10 << 20
    assert cg.pids == 7


def test_cgroup_v1_unlimited_and_missing_optional_files(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "cpuacct/a/cpuacct.usage": "0",
            "memory/a/memory.usage_in_bytes": "4096",
            "memory/a/memory.stat": "cache 0\ninactive_file 8192\n",
            "memory/a/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    cg = read_cgroup_v1("a", tmp_path)
    assert cg.memory_limit_bytes is None  # the kernel's "no limit"
    assert cg.memory_used_bytes == 0  # never negative
    assert cg.memory_peak_bytes is None and cg.pids is None


def test_cgroup_v2_counters(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "dsec/sb-2/cgroup.controllers": "cpu memory pids\n",
            "dsec/sb-2/cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
            "dsec/sb-2/memory.current": "20971520\n",
            "dsec/sb-2/memory.stat": "anon 10485760\nfile 8388608\ninactive_file 4194304\n",
            "dsec/sb-2/memory.max": "max\n",
            "dsec/sb-2/memory.peak": "31457280\n",
            "dsec/sb-2/pids.current": "3\n",
        },
    )
    cg = read_cgroup("dsec/sb-2", tmp_path)
    assert cg.version == 2
    assert cg.cpu_usage_ns == 2_500_000_000
    assert cg.memory_used_bytes == 20971520 - 4194304
    assert cg.memory_cache_bytes == 8388608
    assert cg.memory_limit_bytes is None
    assert cg.memory_peak_bytes == 30 << 20 and cg.pids == 3
    (tmp_path / "dsec/sb-2/memory.max").write_text("536870912\n")
    assert read_cgroup_v2("dsec/sb-2", tmp_path).memory_limit_bytes == 512 << 20


def test_cgroup_v1_without_cpuacct(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "memory/w/memory.usage_in_bytes": "4096",
            "memory/w/memory.stat": "total_cache 0\n",
            "memory/w/memory.limit_in_bytes": "1048576",
        },
    )
    assert read_cgroup("w", tmp_path).cpu_usage_ns is None


def test_proc_stat_cpu() -> None:
    # utime=100 stime=50 cutime=7 cstime=3 ticks; a command name with spaces and a ')'
    fields = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", "100", "50", "7", "3"]
    text = "1234 (my (odd) cmd) " + " ".join(fields) + " 20 0 1 0 0\n"
    assert parse_proc_stat_cpu(text, 100) == 160 * 10_000_000
    # this process: at least the CPU it has used so far, and a vanished pid is skipped
    t0 = time.process_time_ns()
    assert processes_cpu_ns([os.getpid(), 2**22 + 1]) >= t0 - 20_000_000


def test_a_cgroup_in_neither_layout_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_cgroup("nope", tmp_path)


def test_flat_keyed_skips_what_is_not_an_integer() -> None:
    assert parse_flat_keyed("a 1\nb x\n\nc 3 4\nd  5\n") == {"a": 1, "d": 5}


def test_meminfo_in_bytes() -> None:
    text = "MemTotal:        1016156 kB\nMemAvailable:     800000 kB\nHugePages_Total:       0\n"
    mi = parse_meminfo(text + "garbage line\nBad: x kB\n")
    assert mi == {"MemTotal": 1016156 * 1024, "MemAvailable": 800000 * 1024, "HugePages_Total": 0}


def test_net_dev_table() -> None:
    text = (
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs\n"
        "    lo:    1000      10    0    0    0     0          0         0     1000      10    0"
        "    0    0     0       0          0\n"
        "  eth0: 5000 50 0 0 0 0 0 0 7000 70 0 0 0 0 0 0\n"
        "  short: 1 2 3\n"
    )
    table = parse_net_dev(text)
    assert table["eth0"] == NetCounters(rx_bytes=5000, tx_bytes=7000, rx_packets=50, tx_packets=70)
    assert table["lo"].rx_packets == 10 and "short" not in table


def test_veth_counters_are_seen_from_the_sandbox(tmp_path: Path) -> None:
    stats = tmp_path / "vd1" / "statistics"
    for name, value in {"rx_bytes": 11, "tx_bytes": 22, "rx_packets": 1, "tx_packets": 2}.items():
        _write(stats, {name: f"{value}\n"})
    # what the host end received, the sandbox sent
    assert read_veth_counters("vd1", tmp_path) == NetCounters(22, 11, 2, 1)
    with pytest.raises(FileNotFoundError):
        read_veth_counters("gone", tmp_path)


def test_disk_usage_of_real_filesystems(tmp_path: Path) -> None:
    used, total = disk_usage([tmp_path])
    st = os.statvfs(tmp_path)
    assert total == st.f_blocks * st.f_frsize and 0 <= used <= total
    _, total2 = disk_usage([tmp_path, tmp_path])
    assert total2 == 2 * total


# --- the route and the SDK over FakeEdge -------------------------------------------------
@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
async def clients(edge: FakeEdge) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    app = create_app(edge, StaticKeys([KEY_A, KEY_B]), access_log="off")
    transport = httpx.ASGITransport(app=app)
    a = httpx.AsyncClient(transport=transport, base_url="http://dsec")
    b = httpx.AsyncClient(transport=transport, base_url="http://dsec")
    a.headers["authorization"] = f"Bearer {KEY_A}"
    b.headers["authorization"] = f"Bearer {KEY_B}"
    async with a, b:
        yield a, b


async def test_metrics_route(clients: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    a, b = clients
    r = await a.post(
        "/v1/sandboxes",
        json={
            "cpu": 0.5,
            "memory_mb": 256,
            "disk_mb": 64,
            "network": {"allow_domains": ["pypi.org"]},
        },
    )
    sid = r.json()["id"]
    await a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/w/f"}, content=b"x" * 1000)
    for _ in range(4):
        assert (await a.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})).status_code == 200
    r = await a.get(f"/v1/sandboxes/{sid}/metrics")
    assert r.status_code == 200, r.text
    m = SandboxMetrics.model_validate(r.json())
    assert (m.sandbox_id, m.tier, m.state, m.source) == (sid, "container", "running", "fake")
    assert m.cpu.usage_s == pytest.approx(4 * FAKE_CPU_NS_PER_EXEC / 1e9)
    assert m.cpu.limit_cores == 0.5
    # the first sample averages since creation
    assert m.cpu.used_cores == pytest.approx(m.cpu.usage_s / m.interval_s, rel=0.05)
    assert m.cpu.used_pct == pytest.approx(100 * m.cpu.used_cores / 0.5, rel=0.01)
    assert m.memory.used_bytes == FAKE_BASE_MEMORY + 1000 and m.memory.limit_bytes == 256 << 20
    assert m.disk.used_bytes == 1000 and m.disk.total_bytes == 64 << 20
    assert m.network is not None and m.network.rx_bytes == 0
    # the next sample's rate covers the time since this one
    await a.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    await asyncio.sleep(0.2)
    m2 = SandboxMetrics.model_validate((await a.get(f"/v1/sandboxes/{sid}/metrics")).json())
    assert 0.2 <= m2.interval_s < budget(5)  # at least the 0.2 s slept since the last sample
    assert m2.cpu.usage_s - m.cpu.usage_s == pytest.approx(FAKE_CPU_NS_PER_EXEC / 1e9)
    assert m2.cpu.used_cores == pytest.approx(FAKE_CPU_NS_PER_EXEC / 1e9 / m2.interval_s, rel=0.02)

    # another key: exactly as a sandbox that does not exist
    r = await b.get(f"/v1/sandboxes/{sid}/metrics")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = await a.get("/v1/sandboxes/sb-fake-000000000000/metrics")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    # a sandbox without network has none
    bare = (await a.post("/v1/sandboxes", json={})).json()["id"]
    assert (await a.get(f"/v1/sandboxes/{bare}/metrics")).json()["network"] is None
    # stopped: 409
    await a.delete(f"/v1/sandboxes/{sid}")
    r = await a.get(f"/v1/sandboxes/{sid}/metrics")
    assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_stopped"


async def test_metrics_neither_resume_nor_extend_the_ttl(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    a, _ = clients
    sid = (await a.post("/v1/sandboxes", json={"ttl_s": 600})).json()["id"]
    assert (await a.post(f"/v1/sandboxes/{sid}/pause")).json()["state"] == "paused"
    before = edge._live[sid].row.last_active
    await asyncio.sleep(1.1)  # activity is written through at most once a second
    r = await a.get(f"/v1/sandboxes/{sid}/metrics")
    assert r.status_code == 200 and r.json()["state"] == "paused"
    assert (await a.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"
    assert edge._live[sid].row.last_active == before
    assert edge.calls_to("resume_sandbox") == []


async def test_capabilities_say_metrics(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    a, _ = clients
    tiers = {c["tier"]: c for c in (await a.get("/v1/capabilities")).json()["tiers"]}
    assert tiers["container"]["metrics"] is True
    assert tiers["vm"]["metrics"] is False  # not on this node


class _NoMetrics:
    """FakeEdge seen without the MetricsEdge ability (an edge that never implemented it)."""

    def __init__(self, inner: FakeEdge) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name == "sandbox_metrics":
            raise AttributeError(name)
        return getattr(self._inner, name)


async def test_an_edge_without_the_ability_says_so_after_the_owner_check(
    edge: FakeEdge,
) -> None:
    app = create_app(_NoMetrics(edge), StaticKeys([KEY_A, KEY_B]), access_log="off")  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
        sid = (
            await c.post("/v1/sandboxes", json={}, headers={"authorization": f"Bearer {KEY_A}"})
        ).json()["id"]
        r = await c.get(
            f"/v1/sandboxes/{sid}/metrics", headers={"authorization": f"Bearer {KEY_B}"}
        )
        assert r.status_code == 404
        r = await c.get(
            f"/v1/sandboxes/{sid}/metrics", headers={"authorization": f"Bearer {KEY_A}"}
        )
        assert r.status_code == 422 and r.json()["error"]["code"] == "capability_not_supported"


async def test_sdk_metrics_async_and_sync(edge: FakeEdge) -> None:
    app = create_app(edge, StaticKeys([KEY_A, KEY_B]), access_log="off")
    transport = httpx.ASGITransport(app=app)
    async with await AsyncSandbox.create(api_key=KEY_A, transport=transport) as sb:
        await sb.commands.run("true")
        m = await sb.metrics()
        assert isinstance(m, SandboxMetrics) and m.sandbox_id == sb.id
        assert m.cpu.usage_s == pytest.approx(FAKE_CPU_NS_PER_EXEC / 1e9)
        with pytest.raises(SandboxNotFound):  # another key: connect already says not found
            await AsyncSandbox.connect(sb.id, api_key=KEY_B, transport=transport)


def test_sdk_sync_metrics() -> None:
    edge = FakeEdge()
    app = create_app(edge, StaticKeys([KEY_A]), access_log="off")
    with Sandbox.create(api_key=KEY_A, transport=httpx.ASGITransport(app=app)) as sb:
        m = sb.metrics()
        assert m.memory.used_bytes == FAKE_BASE_MEMORY and m.pids == 1


async def test_a_tier_without_usage_is_capability_not_supported() -> None:
    from dsec import CreateSandboxRequest
    from dsec.testing import MemoryRuntime

    class Blind(MemoryRuntime):
        usage = None  # type: ignore[assignment]

    edge = FakeEdge()
    edge.runtimes["container"].__class__ = Blind
    info = await edge.create_sandbox(CreateSandboxRequest(), "kowner000000000000")
    with pytest.raises(CapabilityNotSupported):
        await edge.sandbox_metrics(SandboxRef(sandbox_id=info.id), "kowner000000000000")
    assert not next(c for c in (await edge.capabilities()).tiers if c.tier == "container").metrics
