"""NetworkPolicy validation, preset expansion and name matching; the DNS codec; the
resolver's decisions over loopback (no root: the resolver listens on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.errors import InvalidRequest
from dsec.network import NetworkManager, dns
from dsec.network.policy import (
    DEFAULT_PRESETS,
    MAX_CIDRS,
    MAX_DOMAINS,
    NEVER_REACHABLE,
    NetworkPolicy,
    NetworkPreset,
    normalize_domain,
)
from dsec.network.resolver import ResolverLimits, SandboxResolver, ZoneServer


def test_defaults_and_normalisation() -> None:
    p = NetworkPolicy(allow_domains=["PyPI.org.", "*.GitHub.com", "pypi.org"], ports=["443", 80])
    assert p.allow_domains == ["pypi.org", "*.github.com"]
    assert p.protocols == ["tcp"] and p.ports == [443, 80]
    assert NetworkPolicy(allow_cidrs=["10.0.0.1"]).allow_cidrs == ["10.0.0.1/32"]
    assert NetworkPolicy(allow_domains=["bücher.example"]).allow_domains == [
        "xn--bcher-kva.example"
    ]
    assert NetworkPolicy(allow_cidrs=["1.2.3.0/24"], ports=["8000 - 8100"]).port_ranges() == [
        (8000, 8100)
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "allows nothing"),
        ({"allow_domains": []}, "allows nothing"),
        ({"allow_domains": ["exa mple.com"]}, "invalid domain"),
        ({"allow_domains": ["a..b.com"]}, "empty label"),
        ({"allow_domains": ["-bad.com"]}, "must be 1-63"),
        ({"allow_domains": ["x" * 64 + ".com"]}, "must be 1-63"),
        ({"allow_domains": [("a" * 60 + ".") * 5 + "com"]}, "longer than 253"),
        ({"allow_domains": ["*"]}, "empty domain|too broad|invalid"),
        ({"allow_domains": ["*.com"]}, "too broad"),
        ({"allow_domains": ["foo.*.com"]}, "only as a leading"),
        ({"allow_domains": ["10.0.0.1"]}, "use allow_cidrs"),
        ({"allow_domains": ["http://x.com"]}, "looks like an address"),
        ({"allow_domains": "pypi.org"}, "must be a list"),
        ({"allow_cidrs": ["10.0.0.1/8"]}, r"host bits set \(did you mean 10.0.0.0/8\?\)"),
        ({"allow_cidrs": ["300.1.1.1"]}, "invalid CIDR"),
        ({"allow_cidrs": ["::1/128"]}, "IPv6"),
        ({"allow_cidrs": ["169.254.169.254"]}, "never reachable"),
        ({"allow_cidrs": ["127.0.0.0/8"]}, "never reachable"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": [0]}, "1-65535"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": [70000]}, "1-65535"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": ["90-80"]}, "start is above end"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": ["http"]}, "invalid port"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": [True]}, "invalid port"),
        ({"allow_cidrs": ["1.1.1.1"], "ports": []}, "ports is empty"),
        ({"allow_cidrs": ["1.1.1.1"], "protocols": ["sctp"]}, "invalid protocol"),
        ({"allow_cidrs": ["1.1.1.1"], "protocols": []}, "protocols is empty"),
        ({"presets": ["Bad Name"]}, "invalid preset name"),
        ({"allow_cidrs": ["1.1.1.1"], "colour": "red"}, "Extra inputs"),
        ({"allow_domains": [f"h{i}.example.com" for i in range(MAX_DOMAINS + 1)]}, "at most"),
        ({"allow_cidrs": [f"10.0.{i // 256}.{i % 256}" for i in range(MAX_CIDRS + 1)]}, "at most"),
    ],
)
def test_bad_input_is_invalid_request(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        NetworkPolicy(**kwargs)  # type: ignore[arg-type]
    assert info.value.code == "invalid_request" and info.value.http_status == 400
    assert str(info.value).startswith("invalid network policy")


def test_parse_accepts_json_like_input() -> None:
    p = NetworkPolicy.parse({"allow_domains": ["pypi.org"], "ports": [443]})
    assert NetworkPolicy.parse(p.model_dump()) == p
    with pytest.raises(InvalidRequest):
        NetworkPolicy.parse(["pypi.org"])


def test_matching_wildcards_and_denies() -> None:
    r = NetworkPolicy(
        allow_domains=["pypi.org", "*.github.com"],
        deny_domains=["gist.github.com", "*.evil.github.com"],
        allow_cidrs=["198.18.0.0/24"],
        deny_cidrs=["198.18.0.9/32"],
    ).resolve()
    assert r.allows_name("pypi.org") and not r.allows_name("www.pypi.org")
    assert r.allows_name("api.github.com") and r.allows_name("a.b.github.com")
    assert not r.allows_name("github.com")  # a wildcard does not cover its apex
    assert not r.allows_name("evilgithub.com")
    assert not r.allows_name("gist.github.com")  # deny wins
    assert not r.allows_name("x.evil.github.com")
    assert r.address_denied("198.18.0.9") and not r.address_denied("198.18.0.8")


def test_every_address_resolves_every_name_not_denied() -> None:
    # E2B's open network: every public address, so every name (denied names still refused)
    r = NetworkPolicy(allow_cidrs=["0.0.0.0/0"], deny_domains=["*.evil.test"]).resolve()
    assert r.every_address and r.allows_name("pypi.org") and r.allows_name("a.b.c.example")
    assert not r.allows_name("x.evil.test")
    # all addresses allowed but also all denied (E2B's closed "nothing allowed"): no names
    blocked = NetworkPolicy(allow_cidrs=["0.0.0.0/0"], deny_cidrs=["0.0.0.0/0"]).resolve()
    assert not blocked.every_address and not blocked.allows_name("pypi.org")
    some = NetworkPolicy(allow_cidrs=["198.18.0.0/24"], allow_domains=["pypi.org"]).resolve()
    assert not some.every_address and not some.allows_name("github.com")


def test_presets_expand_and_operator_overrides() -> None:
    r = NetworkPolicy(presets=["pypi", "github"]).resolve()
    assert r.allows_name("files.pythonhosted.org") and r.allows_name("codeload.github.com")
    mirror = {"pypi": NetworkPreset.coerce(["pypi.mirror.internal", "10.9.0.0/16"])}
    r2 = NetworkPolicy(presets=["pypi"]).resolve(mirror)
    assert r2.exact == {"pypi.mirror.internal"} and r2.cidrs == ("10.9.0.0/16",)
    assert not r2.allows_name("pypi.org")
    with pytest.raises(InvalidRequest, match="unknown network preset 'npm'"):
        NetworkPolicy(presets=["npm"]).resolve(mirror)
    with pytest.raises(InvalidRequest, match="never reachable"):
        NetworkPolicy(allow_cidrs=["10.203.1.0/24"]).resolve(never=["10.203.0.0/16"])
    with pytest.raises(InvalidRequest):
        NetworkPreset.coerce({"domains": ["bad domain"]})
    assert set(DEFAULT_PRESETS) >= {"pypi", "npm", "debian", "github"}


CLOUD_SERVICES = {
    "AWS, GCP, Azure, OCI, DigitalOcean, ... metadata": "169.254.169.254",
    "AWS ECS task metadata": "169.254.170.2",
    "Tencent Cloud metadata": "169.254.0.23",
    "Scaleway metadata": "169.254.42.42",
    "Alibaba Cloud metadata": "100.100.100.200",
    "Azure wireserver": "168.63.129.16",
    "Oracle Cloud legacy metadata": "192.0.0.192",
}
"""Each public cloud's per-instance services a sandbox's packets must never reach."""


@pytest.mark.parametrize("address", CLOUD_SERVICES.values(), ids=list(CLOUD_SERVICES))
def test_cloud_metadata_and_host_services_are_never_reachable(address: str, tmp_path: Path) -> None:
    """0.0.0.0/0 (E2B's default) opens everything but these (issue 32, item 4): no policy
    names them, and the manager's never list (the packet filter's and the resolver's) holds
    them beside the operator's own protected networks."""
    ip = ipaddress.IPv4Address(address)
    assert any(ip in ipaddress.IPv4Network(n) for n in NEVER_REACHABLE)
    with pytest.raises(InvalidRequest, match="never reachable"):
        NetworkPolicy(allow_cidrs=[address])
    mgr = NetworkManager(tmp_path / "net", protected_cidrs=["10.99.0.0/16"])
    assert any(ip in ipaddress.IPv4Network(n) for n in mgr.never)
    assert "10.99.0.0/16" in mgr.never
    # an open policy is still open to the rest
    assert NetworkPolicy(allow_cidrs=["0.0.0.0/0"]).resolve().every_address


def test_ipv6_metadata_is_out_of_reach_because_policies_are_ipv4_only() -> None:
    """AWS's IPv6 metadata (fd00:ec2::254) and link-local fe80::/10 need no never entry:
    no policy can name IPv6 (and the filter drops every IPv6 packet from a sandbox)."""
    for cidr in ("fd00:ec2::254", "fe80::/10", "::/0"):
        with pytest.raises(InvalidRequest, match="IPv6"):
            NetworkPolicy(allow_cidrs=[cidr])


def test_normalize_domain_rejects_wildcard_where_not_allowed() -> None:
    with pytest.raises(InvalidRequest, match="not allowed here"):
        normalize_domain("*.a.com", allow_wildcard=False)


def test_dns_codec_round_trip_and_hostile_input() -> None:
    q = dns.parse_message(dns.build_query(0x1234, "Api.Example.COM"))
    assert q.id == 0x1234 and q.questions == [dns.Question("api.example.com", dns.TYPE_A)]
    answers = [
        dns.Record("api.example.com", dns.TYPE_CNAME, 60, "edge.cdn.net"),
        dns.Record("edge.cdn.net", dns.TYPE_A, 30, "198.18.0.7"),
    ]
    r = dns.parse_message(dns.build_response(q, dns.RCODE_NOERROR, answers))
    assert r.is_response and r.rcode == 0 and r.answers == answers
    # a pointer loop, a forward pointer and a truncated message are rejected, not followed
    header = b"\x00\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    for bad in (
        header + b"\xc0\x0c\x00\x01\x00\x01",
        header + b"\xc0\x20",
        header + b"\x05ab",
        b"\x00",
    ):
        with pytest.raises(dns.DnsFormatError):
            dns.parse_message(bad)
    # oversized answers are truncated with TC instead of exceeding 512 bytes
    many = [
        dns.Record("a.example.com", dns.TYPE_A, 1, f"10.0.{i // 256}.{i % 256}") for i in range(40)
    ]
    big = dns.build_response(q, dns.RCODE_NOERROR, many)
    assert len(big) <= 512 and dns.parse_message(big).flags & 0x0200


def _udp(host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, 0))
    s.setblocking(False)
    return s


@pytest.fixture
async def resolver_env() -> AsyncIterator[
    tuple[SandboxResolver, ZoneServer, list[tuple[str, list[str], int]]]
]:
    zone = ZoneServer(
        {
            "ok.test": ["198.18.0.2"],
            "meta.test": ["169.254.169.254"],
            "two.test": ["198.18.0.3", "198.18.0.4"],
        },
        cnames={"alias.test": "ok.test"},
        ttl=3600,
    )
    zsock = _udp()
    await zone.start(zsock)
    admitted: list[tuple[str, list[str], int]] = []
    probe = _udp()
    port = probe.getsockname()[1]
    probe.close()
    resolver = SandboxResolver(
        ("127.0.0.1", port),
        upstreams=[zsock.getsockname()],
        static_records={"mirror.internal": ["198.18.1.2"]},
        admit=lambda ip, dests, timeout, refresh: admitted.append((ip, dests, timeout)),
        never=["169.254.0.0/16"],
        # a burst of 5 and next to no refill: how fast the test asks does not matter
        limits=ResolverLimits(queries_per_s=0.001, burst=5, max_answer_ttl=120),
    )
    await resolver.start()
    try:
        yield resolver, zone, admitted
    finally:
        await resolver.close()
        await zone.close()


async def _ask(resolver: SandboxResolver, name: str, qtype: int = dns.TYPE_A) -> dns.Message | None:
    loop = asyncio.get_running_loop()
    s = _udp()
    try:
        await loop.sock_connect(s, resolver.listen)
        await loop.sock_sendall(s, dns.build_query(99, name, qtype))
        return dns.parse_message(await asyncio.wait_for(loop.sock_recv(s, 2048), budget(1.0)))
    except TimeoutError:
        return None
    finally:
        s.close()


async def test_resolver_decisions(
    resolver_env: tuple[SandboxResolver, ZoneServer, list[tuple[str, list[str], int]]],
) -> None:
    resolver, zone, admitted = resolver_env
    policy = NetworkPolicy(
        allow_domains=["ok.test", "alias.test", "meta.test", "mirror.internal", "two.test"],
        deny_cidrs=["198.18.0.4/32"],
    ).resolve()
    resolver.register("sb-1", "127.0.0.1", policy)
    r = await _ask(resolver, "alias.test")
    assert r is not None and [a.data for a in r.answers] == ["ok.test", "198.18.0.2"]
    assert all(a.ttl == 120 for a in r.answers)  # clamped to max_answer_ttl
    assert admitted[-1] == ("127.0.0.1", ["198.18.0.2"], 130)  # TTL + grace, before the reply
    r = await _ask(resolver, "nope.test")
    assert r is not None and r.rcode == dns.RCODE_REFUSED
    r = await _ask(resolver, "meta.test")  # metadata answer withheld and never admitted
    assert r is not None and r.rcode == 0 and not r.answers
    r = await _ask(resolver, "two.test")  # a denied address is withheld
    assert r is not None and [a.data for a in r.answers] == ["198.18.0.3"]
    assert zone.queries == ["alias.test", "meta.test", "two.test"]  # nope.test never forwarded
    # rate limit: the bucket (5) is spent; further queries are dropped silently
    replies = [await _ask(resolver, "mirror.internal") for _ in range(3)]
    assert None in replies
    stats = resolver.stats("127.0.0.1")
    assert stats["rate_limited"] >= 1 and stats["refused"] == 1
    assert stats["refused_names"] == {"nope.test": 1}
    # a policy change reports the admissions it no longer justifies
    revoke = resolver.set_policy("127.0.0.1", NetworkPolicy(allow_domains=["two.test"]).resolve())
    assert sorted(revoke) == ["198.18.0.2", "198.18.1.2"]  # two.test's address stays


async def test_resolver_ignores_unknown_sources(
    resolver_env: tuple[SandboxResolver, ZoneServer, list[tuple[str, list[str], int]]],
) -> None:
    resolver, zone, _ = resolver_env
    assert await _ask(resolver, "ok.test") is None  # 127.0.0.1 is not a registered sandbox
    assert resolver.totals["unknown_source"] == 1 and zone.queries == []
