"""Sandbox networking end to end, on loopback-only infrastructure built by the tests.

A fake "internet" and "package mirror" live in their own network namespaces
(dsec.network.testbed, 198.18.0.0/15) with a test DNS zone; sandboxes are namespaces
made by NetworkManager, and probes run inside them through sockets created in those
namespaces (or ``nsenter`` for real tools). No traffic leaves this node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from tests.isolation import subnet_host, worker_subnet
from tests.timing import budget

from dsec.errors import Conflict, InvalidRequest, SandboxNotFound
from dsec.network import NetworkManager, NetworkPolicy, ResolverLimits, SandboxNetwork, dns
from dsec.network.testbed import (
    CLOUD_SERVICE_ADDRS,
    DNS_ADDR,
    METADATA_ADDR,
    MIRROR_TCP_PORTS,
    UDP_ECHO_PORT,
    Testbed,
    dns_query,
    tcp_probe,
    udp_probe,
)
from dsec.privileged.netns import RtNetlink, in_netns

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)"),
]

SUBNET = worker_subnet(213)
GATEWAY = subnet_host(SUBNET, 1)
SPOOFED = subnet_host(SUBNET, 3 * 256 + 99)  # an address of the subnet no sandbox has
MIRROR = "198.18.1.2"


@pytest.fixture
async def testbed(tmp_path: Path) -> AsyncIterator[Testbed]:
    tb = Testbed(tmp_path / "tb")
    await tb.start()
    try:
        yield tb
    finally:
        await tb.close()


Factory = Callable[..., Awaitable[NetworkManager]]


@pytest.fixture
async def make_manager(tmp_path: Path, testbed: Testbed) -> AsyncIterator[Factory]:
    """Factory for started managers; tears down every sandbox and closes them after."""
    made: list[NetworkManager] = []

    async def make(**kwargs: object) -> NetworkManager:
        kwargs.setdefault("upstream_dns", [DNS_ADDR])
        kwargs.setdefault("subnet", SUBNET)
        mgr = NetworkManager(tmp_path / "net", **kwargs)  # type: ignore[arg-type]
        await mgr.start()
        made.append(mgr)
        return mgr

    yield make
    for mgr in reversed(made):
        if mgr.started:
            for sandbox_id in list(mgr.sandbox_ids()):
                await mgr.teardown(sandbox_id)
            await mgr.close()


@pytest.fixture
async def manager(make_manager: Factory) -> NetworkManager:
    return await make_manager()


async def resolve(net: SandboxNetwork, name: str, qtype: int = dns.TYPE_A) -> dns.Message:
    reply = await dns_query(net.netns_path, net.gateway, name, qtype)
    assert reply is not None, f"no DNS reply for {name}"
    return reply


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def addresses(reply: dns.Message) -> list[str]:
    return [str(r.data) for r in reply.answers if r.rtype == dns.TYPE_A]


async def test_default_deny_until_dns_admits(manager: NetworkManager, testbed: Testbed) -> None:
    net = await manager.setup("sb-deny", NetworkPolicy(allow_domains=["allowed.example.test"]))
    # nothing is reachable before the resolver admitted an answer, not even the allowed host
    assert await tcp_probe(net.netns_path, "198.18.0.2", 80, 0.4) is None
    assert await tcp_probe(net.netns_path, MIRROR, 80, 0.4) is None
    reply = await resolve(net, "allowed.example.test")
    assert reply.rcode == dns.RCODE_NOERROR and addresses(reply) == ["198.18.0.2"]
    assert await tcp_probe(net.netns_path, "198.18.0.2", 80) == "198.18.0.2:80"
    # ports=None: every port of an admitted destination; still nothing else
    assert await tcp_probe(net.netns_path, "198.18.0.2", 8080) == "198.18.0.2:8080"
    assert await tcp_probe(net.netns_path, MIRROR, 80, 0.4) is None
    # the namespace holds exactly lo and eth0, eth0 carries one /32
    links = await asyncio.to_thread(lambda: RtNetlink(net.netns_path).link_names())
    assert sorted(links) == ["eth0", "lo"]
    assert net.resolv_conf.startswith(f"nameserver {GATEWAY}\n")


async def test_allowed_domain_works_sibling_does_not(
    manager: NetworkManager, testbed: Testbed
) -> None:
    net = await manager.setup("sb-sib", NetworkPolicy(allow_domains=["allowed.example.test"]))
    assert addresses(await resolve(net, "allowed.example.test")) == ["198.18.0.2"]
    sibling = await resolve(net, "sibling.example.test")
    assert sibling.rcode == dns.RCODE_REFUSED and not sibling.answers
    assert await tcp_probe(net.netns_path, "198.18.0.3", 80, 0.4) is None  # its address, raw
    assert await tcp_probe(net.netns_path, "198.18.0.2", 80) == "198.18.0.2:80"
    # a CNAME chain from an allowed name admits the final address
    net2 = await manager.setup("sb-cname", NetworkPolicy(allow_domains=["cdn.example.test"]))
    reply = await resolve(net2, "cdn.example.test")
    assert addresses(reply) == ["198.18.0.7"]
    assert await tcp_probe(net2.netns_path, "198.18.0.7", 80) == "198.18.0.7:80"
    assert (
        await tcp_probe(net2.netns_path, "198.18.0.2", 80, 0.4) is None
    )  # admitted for sb-sib only
    stats = await manager.stats("sb-sib")
    assert stats["dns"]["refused_names"] == {"sibling.example.test": 1}
    assert any(
        b["destination"] == "198.18.0.3" and b["port"] == 80 and b["packets"] >= 1
        for b in stats["blocked"]
    )
    assert any(
        a["destination"] == "198.18.0.2" and a["names"] == ["allowed.example.test"]
        for a in stats["allowed"]
    )


async def test_wildcard_rules(manager: NetworkManager, testbed: Testbed) -> None:
    net = await manager.setup(
        "sb-wild",
        NetworkPolicy(allow_domains=["*.wild.test"], deny_domains=["deep.api.wild.test"]),
    )
    assert addresses(await resolve(net, "api.wild.test")) == ["198.18.0.4"]
    assert await tcp_probe(net.netns_path, "198.18.0.4", 443) == "198.18.0.4:443"
    # the wildcard does not cover the apex; the deny rule wins over the wildcard
    assert (await resolve(net, "wild.test")).rcode == dns.RCODE_REFUSED
    assert (await resolve(net, "deep.api.wild.test")).rcode == dns.RCODE_REFUSED
    assert await tcp_probe(net.netns_path, "198.18.0.5", 80, 0.4) is None
    assert await tcp_probe(net.netns_path, "198.18.0.6", 80, 0.4) is None
    assert "deep.api.wild.test" not in testbed.zone.queries


async def test_cidr_port_and_protocol_rules(manager: NetworkManager, testbed: Testbed) -> None:
    net = await manager.setup(
        "sb-cidr", NetworkPolicy(allow_cidrs=[f"{MIRROR}/32"], ports=[443, "8000-8100"])
    )
    ns = net.netns_path
    assert await tcp_probe(ns, MIRROR, 443) == f"{MIRROR}:443"
    assert await tcp_probe(ns, MIRROR, 8080) == f"{MIRROR}:8080"
    for port in (22, 80, 3128, 9000):
        assert await tcp_probe(ns, MIRROR, port, 0.3) is None, port
    # udp is not in the default protocols; a udp policy opens udp but not tcp
    udp = await manager.setup(
        "sb-udp",
        NetworkPolicy(allow_cidrs=["198.18.0.2"], protocols=["udp"], ports=[UDP_ECHO_PORT]),
    )
    assert not await udp_probe(ns, "198.18.0.2", UDP_ECHO_PORT, 0.4)
    assert await udp_probe(udp.netns_path, "198.18.0.2", UDP_ECHO_PORT)
    assert await tcp_probe(udp.netns_path, "198.18.0.2", 80, 0.3) is None
    # a deny CIDR wins over a wider allow
    deny = await manager.setup(
        "sb-denycidr",
        NetworkPolicy(allow_cidrs=["198.18.0.0/24"], deny_cidrs=["198.18.0.3/32"]),
    )
    assert await tcp_probe(deny.netns_path, "198.18.0.2", 80) == "198.18.0.2:80"
    assert await tcp_probe(deny.netns_path, "198.18.0.3", 80, 0.3) is None


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox for ping")
async def test_icmp_rule(manager: NetworkManager, testbed: Testbed) -> None:
    net = await manager.setup(
        "sb-icmp", NetworkPolicy(allow_cidrs=["198.18.0.2"], protocols=["icmp"])
    )

    def ping(address: str) -> int:
        cmd = ["nsenter", f"--net={net.netns_path}", "busybox", "ping", "-c1", "-W1", address]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode

    assert await asyncio.to_thread(ping, "198.18.0.2") == 0
    assert await asyncio.to_thread(ping, "198.18.0.3") != 0
    assert await tcp_probe(net.netns_path, "198.18.0.2", 80, 0.3) is None


async def test_port_scan_finds_only_allowed(manager: NetworkManager, testbed: Testbed) -> None:
    net = await manager.setup("sb-scan", NetworkPolicy(allow_cidrs=[f"{MIRROR}/32"], ports=[443]))
    ports = sorted(set(range(1, 1025)) | set(MIRROR_TCP_PORTS))
    sem = asyncio.Semaphore(256)

    async def probe(port: int) -> int | None:
        async with sem:
            return port if await tcp_probe(net.netns_path, MIRROR, port, 0.5) else None

    open_ports = {p for p in await asyncio.gather(*(probe(p) for p in ports)) if p}
    assert open_ports == {443}
    # the scan of the whole mirror range also finds nothing on the other fake hosts
    others = await asyncio.gather(
        *(tcp_probe(net.netns_path, "198.18.0.2", p, 0.3) for p in (80, 443))
    )
    assert others == [None, None]
    stats = await manager.stats("sb-scan")
    blocked_ports = {b["port"] for b in stats["blocked"] if b["destination"] == MIRROR}
    assert {22, 80, 3128} <= blocked_ports and 443 not in blocked_ports


async def test_raw_ip_to_non_admitted_address_fails(
    manager: NetworkManager, testbed: Testbed
) -> None:
    net = await manager.setup("sb-raw", NetworkPolicy(allow_domains=["multi.example.test"]))
    reply = await resolve(net, "multi.example.test")
    assert sorted(addresses(reply)) == ["198.18.0.8", "198.18.0.9"]
    for admitted in ("198.18.0.8", "198.18.0.9"):
        assert await tcp_probe(net.netns_path, admitted, 80) == f"{admitted}:80"
    for not_admitted in ("198.18.0.2", "198.18.0.4", MIRROR, DNS_ADDR):
        assert await tcp_probe(net.netns_path, not_admitted, 80, 0.3) is None
    # the upstream DNS server itself is not reachable directly either (only the resolver)
    assert await dns_query(net.netns_path, DNS_ADDR, "multi.example.test", timeout=0.4) is None


async def test_dns_tunnelling_is_refused_not_forwarded(
    manager: NetworkManager, testbed: Testbed
) -> None:
    net = await manager.setup("sb-tunnel", NetworkPolicy(allow_domains=["allowed.example.test"]))
    secret = "6578666974726174652d6d65"
    names = [f"{secret}.allowed.example.test", f"{secret}.exfil.test", f"{secret}.example.test"]
    for name in names:
        reply = await resolve(net, name)
        assert reply.rcode == dns.RCODE_REFUSED, name
    # other record types of an allowed name get an empty answer and are not forwarded either
    txt = await resolve(net, "allowed.example.test", qtype=16)
    assert txt.rcode == dns.RCODE_NOERROR and not txt.answers
    aaaa = await resolve(net, "allowed.example.test", qtype=dns.TYPE_AAAA)
    assert aaaa.rcode == dns.RCODE_NOERROR and not aaaa.answers
    assert not any(secret in q for q in testbed.zone.queries)
    assert testbed.zone.queries == []
    # garbage does not crash the resolver
    sock = in_netns(net.netns_path, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    sock.settimeout(1)
    sock.sendto(b"\x12\x34" + b"\xff" * 30, (GATEWAY, 53))
    data = await asyncio.to_thread(sock.recv, 512)
    sock.close()
    assert data[:2] == b"\x12\x34" and data[3] & 0xF == dns.RCODE_FORMERR
    assert addresses(await resolve(net, "allowed.example.test")) == ["198.18.0.2"]


async def test_runtime_update_flips_access_both_ways(
    manager: NetworkManager, testbed: Testbed
) -> None:
    net = await manager.setup("sb-flip", NetworkPolicy(allow_domains=["allowed.example.test"]))
    ns = net.netns_path
    await resolve(net, "allowed.example.test")
    assert await tcp_probe(ns, "198.18.0.2", 80) == "198.18.0.2:80"

    await manager.update("sb-flip", NetworkPolicy(allow_domains=["sibling.example.test"]))
    assert await tcp_probe(ns, "198.18.0.2", 80, 0.4) is None  # admission revoked at once
    assert (await resolve(net, "allowed.example.test")).rcode == dns.RCODE_REFUSED
    assert addresses(await resolve(net, "sibling.example.test")) == ["198.18.0.3"]
    assert await tcp_probe(ns, "198.18.0.3", 80) == "198.18.0.3:80"

    await manager.update(
        "sb-flip", NetworkPolicy(allow_domains=["allowed.example.test"], allow_cidrs=[MIRROR])
    )
    assert await tcp_probe(ns, "198.18.0.3", 80, 0.4) is None
    assert await tcp_probe(ns, MIRROR, 80) == f"{MIRROR}:80"  # CIDR: no DNS needed
    assert addresses(await resolve(net, "allowed.example.test")) == ["198.18.0.2"]
    assert await tcp_probe(ns, "198.18.0.2", 80) == "198.18.0.2:80"

    await manager.update("sb-flip", NetworkPolicy(allow_cidrs=[MIRROR], ports=[443]))
    assert await tcp_probe(ns, MIRROR, 80, 0.4) is None
    assert await tcp_probe(ns, MIRROR, 443) == f"{MIRROR}:443"

    with pytest.raises(SandboxNotFound):
        await manager.update("sb-gone", NetworkPolicy(allow_cidrs=[MIRROR]))
    await manager.teardown("sb-flip")
    with pytest.raises(SandboxNotFound):
        await manager.update("sb-flip", NetworkPolicy(allow_cidrs=[MIRROR]))


async def test_host_other_sandboxes_and_metadata_never_reachable(
    manager: NetworkManager, testbed: Testbed
) -> None:
    everything = NetworkPolicy(allow_cidrs=["0.0.0.0/0"], protocols=["tcp", "udp"])
    net = await manager.setup("sb-open", everything)
    other = await manager.setup("sb-other", everything)
    ns = net.netns_path
    await testbed.tcp_listener_on_host("198.18.0.1", 17070)  # the "apiserver" on a host address
    await testbed.tcp_listener_on_host(GATEWAY, 17071)  # the "edge" on the gateway address
    await testbed.tcp_listener_in(other.netns_path, "0.0.0.0", 18000)
    # the policy really is wide open ...
    assert await tcp_probe(ns, "198.18.0.2", 80) == "198.18.0.2:80"
    assert await tcp_probe(ns, MIRROR, 9000) == f"{MIRROR}:9000"
    # ... yet the host, the other sandbox and metadata stay out of reach
    for address, port in [
        ("198.18.0.1", 17070),
        (GATEWAY, 17071),
        (GATEWAY, 22),
        ("198.18.1.1", 17070),
        (other.ip, 18000),
        (METADATA_ADDR, 80),
        *((addr, 80) for addr in CLOUD_SERVICE_ADDRS),  # Alibaba, Azure, Oracle (issue 32)
    ]:
        assert await tcp_probe(ns, address, port, 0.4) is None, (address, port)
    # the cloud addresses are served (the probes above were refused by the filter, not
    # unanswered): the unfiltered testbed namespace reaches them
    for addr in CLOUD_SERVICE_ADDRS:
        assert await tcp_probe(testbed.ns["plain"], addr, 80) == f"{addr}:80"
    # the other sandbox's own service works from inside it (the listener is real)
    assert await tcp_probe(other.netns_path, "127.0.0.1", 18000) == "127.0.0.1:18000"
    # a DNS answer pointing at metadata is withheld, not admitted
    open_dns = await manager.setup(
        "sb-meta", NetworkPolicy(allow_domains=["meta.example.test"], protocols=["tcp"])
    )
    reply = await resolve(open_dns, "meta.example.test")
    assert reply.rcode == dns.RCODE_NOERROR and addresses(reply) == []
    # spoofing another source address from inside the sandbox gets nowhere

    def add_second_address() -> None:
        with RtNetlink() as nl:
            nl.add_address(nl.link_index("eth0"), SPOOFED, 32)

    await asyncio.to_thread(in_netns, ns, add_second_address)

    def spoofed_connect() -> bool:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(0.5)
        try:
            s.bind((SPOOFED, 0))
            s.connect(("198.18.0.2", 80))
            return True
        except OSError:
            return False
        finally:
            s.close()

    assert not await asyncio.to_thread(in_netns, ns, spoofed_connect)
    stats = await manager.stats("sb-open")
    assert any(b["destination"] == METADATA_ADDR for b in stats["blocked"])
    assert any(b["destination"] == other.ip for b in stats["blocked"])


async def test_the_node_itself_cannot_connect_to_a_sandbox(
    manager: NetworkManager, testbed: Testbed
) -> None:
    """A process on the node (here: this test, in the node's namespace) cannot open a
    connection to a sandbox's address, whatever the sandbox's policy: only the port proxy
    reaches a sandbox's ports, from inside its namespace. DNS answers still flow."""
    everything = NetworkPolicy(allow_cidrs=["0.0.0.0/0"], protocols=["tcp", "udp"])
    net = await manager.setup("sb-served", everything)
    await testbed.tcp_listener_in(net.netns_path, "0.0.0.0", 18002)
    assert await tcp_probe(net.netns_path, "127.0.0.1", 18002) == "127.0.0.1:18002"

    def connect_from_node() -> str | None:
        with socket.socket() as s:
            s.settimeout(0.5)
            try:
                s.connect((net.ip, 18002))
            except OSError as e:
                return None if isinstance(e, TimeoutError | ConnectionRefusedError) else repr(e)
            return "connected"

    for _ in range(3):
        assert await asyncio.to_thread(connect_from_node) is None
    # the sandbox still resolves names through the resolver on the node (its answers are
    # replies, not new connections)
    reply = await resolve(
        await manager.setup(
            "sb-dns", NetworkPolicy(allow_domains=["allowed.example.test"], protocols=["tcp"])
        ),
        "allowed.example.test",
    )
    assert addresses(reply) == ["198.18.0.2"]


async def test_resolver_rate_limit_is_per_sandbox(make_manager: Factory, testbed: Testbed) -> None:
    mgr = await make_manager(limits=ResolverLimits(queries_per_s=50, burst=50))
    policy = NetworkPolicy(allow_domains=["allowed.example.test"])
    noisy = await mgr.setup("sb-noisy", policy)
    quiet = await mgr.setup("sb-quiet", policy)
    query = dns.build_query(7, "allowed.example.test")

    def flood() -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        sent = 0
        for _ in range(3000):
            try:
                s.sendto(query, (GATEWAY, 53))
                sent += 1
            except BlockingIOError:
                pass
        s.close()
        return sent

    started = time.monotonic()
    flood_task = asyncio.create_task(asyncio.to_thread(in_netns, noisy.netns_path, flood))
    answered = 0
    for _ in range(20):
        reply = await dns_query(
            quiet.netns_path, GATEWAY, "allowed.example.test", timeout=budget(1.0)
        )
        answered += reply is not None and addresses(reply) == ["198.18.0.2"]
    await flood_task
    assert answered == 20
    noisy_dns = (await mgr.stats("sb-noisy"))["dns"]
    took = time.monotonic() - started
    quiet_dns = (await mgr.stats("sb-quiet"))["dns"]
    # of its 3000 queries: at most the burst plus 50/s over the time they took to serve
    assert noisy_dns["rate_limited"] > 0 and noisy_dns["answered"] <= 50 + 50 * took + 1
    assert quiet_dns["rate_limited"] == 0


async def test_presets_and_static_records(make_manager: Factory, testbed: Testbed) -> None:
    mgr = await make_manager(
        presets={"mirror": {"domains": ["pypi.mirror.internal"]}, "lan": ["198.18.0.9/32"]},
        static_records={"pypi.mirror.internal": [MIRROR]},
    )
    net = await mgr.setup("sb-preset", NetworkPolicy(presets=["mirror", "lan"], ports=[443, 80]))
    reply = await resolve(net, "pypi.mirror.internal")
    assert addresses(reply) == [MIRROR] and reply.answers[0].ttl > 0
    assert await tcp_probe(net.netns_path, MIRROR, 443) == f"{MIRROR}:443"
    assert await tcp_probe(net.netns_path, "198.18.0.9", 80) == "198.18.0.9:80"
    assert "pypi.mirror.internal" not in testbed.zone.queries  # static: never asked upstream
    with pytest.raises(InvalidRequest, match="unknown network preset 'nope'"):
        await mgr.setup("sb-bad", NetworkPolicy(presets=["nope"]))
    with pytest.raises(Conflict):
        await mgr.setup("sb-preset", NetworkPolicy(presets=["mirror"]))
    with pytest.raises(InvalidRequest):
        await mgr.setup("../etc", NetworkPolicy(presets=["mirror"]))
    with pytest.raises(InvalidRequest, match="never reachable"):
        await mgr.setup("sb-subnet", NetworkPolicy(allow_cidrs=[f"{subnet_host(SUBNET, 0)}/24"]))
    with pytest.raises(SandboxNotFound):
        await mgr.stats("sb-unknown")
    assert mgr.sandbox_ids() == {"sb-preset"}


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_resolv_conf_with_real_tools(
    manager: NetworkManager, testbed: Testbed, tmp_path: Path
) -> None:
    """glibc's resolver and curl inside the namespace, with the resolv.conf we hand out."""
    net = await manager.setup("sb-tools", NetworkPolicy(allow_domains=["allowed.example.test"]))
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(net.resolv_conf)
    script = (
        f"mount --bind {resolv} /etc/resolv.conf && "
        "getent ahostsv4 allowed.example.test | head -n1 && "
        "curl --http0.9 -sS -m 3 http://allowed.example.test:8080/; "
        "if getent ahostsv4 sibling.example.test; then echo LEAK; fi; "
        "curl -sS -m 1 http://198.18.0.3/ || echo BLOCKED"
    )
    cmd = ["nsenter", f"--net={net.netns_path}", "unshare", "-m", "sh", "-c", script]
    proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
    lines = proc.stdout.split()
    assert lines[0] == "198.18.0.2", proc.stdout + proc.stderr
    assert "198.18.0.2:8080" in lines
    assert "LEAK" not in lines and lines[-1] == "BLOCKED"
    stats = await manager.stats("sb-tools")
    assert stats["dns"]["refused_names"].get("sibling.example.test", 0) >= 1
    assert any(a["destination"] == "198.18.0.2" and a["port"] == 8080 for a in stats["allowed"])


async def test_teardown_leaves_nothing(make_manager: Factory, testbed: Testbed) -> None:
    mgr = await make_manager()
    nets = [
        await mgr.setup(
            f"sb-t{i}", NetworkPolicy(allow_domains=["allowed.example.test"], allow_cidrs=[MIRROR])
        )
        for i in range(3)
    ]
    for net in nets:
        await resolve(net, "allowed.example.test")
        await tcp_probe(net.netns_path, "198.18.0.3", 80, 0.2)  # leaves a blocked counter
    flt = mgr._filter
    assert flt is not None
    for net in nets:
        await mgr.teardown(net.sandbox_id)
        await mgr.teardown(net.sandbox_id)  # idempotent
        assert not net.netns_path.exists()
        assert not link_exists(net.host_ifname)
    listing = await asyncio.to_thread(flt.nft.run, f"list table inet {flt.table}")
    for net in nets:
        assert net.ip not in listing and net.host_ifname not in listing
    assert not list((mgr.state_dir / "records").iterdir())
    table = flt.table
    await mgr.close()
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert table not in out
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert mgr.iface_prefix not in links


async def test_restart_then_reconcile_keeps_live_removes_dead(
    tmp_path: Path, testbed: Testbed
) -> None:
    state = tmp_path / "net-restart"
    policy = NetworkPolicy(allow_domains=["allowed.example.test"], allow_cidrs=[MIRROR])
    first = NetworkManager(state, upstream_dns=[DNS_ADDR], subnet=SUBNET)
    await first.start()
    live = await first.setup("sb-live", policy)
    dead = await first.setup("sb-dead", policy)
    await resolve(live, "allowed.example.test")
    await first.close()  # sandboxes remain: their filter stays in place
    assert await tcp_probe(live.netns_path, "198.18.0.4", 80, 0.3) is None  # still filtered
    second = NetworkManager(state, upstream_dns=[DNS_ADDR], subnet=SUBNET)
    await second.start()
    try:
        await second.reconcile({"sb-live"})
        assert second.sandbox_ids() == {"sb-live"}
        assert not dead.netns_path.exists()
        assert not link_exists(dead.host_ifname)
        # the DNS admission survived the restart; CIDR rules and the resolver work
        assert await tcp_probe(live.netns_path, "198.18.0.2", 80) == "198.18.0.2:80"
        assert await tcp_probe(live.netns_path, MIRROR, 80) == f"{MIRROR}:80"
        assert addresses(await resolve(live, "allowed.example.test")) == ["198.18.0.2"]
        assert (await resolve(live, "sibling.example.test")).rcode == dns.RCODE_REFUSED
        # a fresh sandbox after reconcile gets a working network too
        fresh = await second.setup("sb-fresh", policy)
        assert await tcp_probe(fresh.netns_path, MIRROR, 80) == f"{MIRROR}:80"
    finally:
        for sandbox_id in list(second.sandbox_ids()):
            await second.teardown(sandbox_id)
        await second.close()
