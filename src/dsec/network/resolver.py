"""The sandbox DNS resolver: the only name service a networked sandbox can reach.

It listens on the gateway address that every sandbox veth shares (``10.203.0.1:53`` by
default), tells sandboxes apart by source address (the packet filter drops spoofed
sources), and for each query:

1. drops it when the sandbox exceeded its rate (token bucket per sandbox; the packet
   filter also caps packets per source in the kernel, so a flood never starves others);
2. answers ``REFUSED`` when the name is not allowed or is denied, **without** sending
   anything upstream, so names cannot carry data out (DNS tunnelling);
3. for allowed names answers ``A`` queries from the operator's static records, else from
   a shared cache, else by forwarding to the upstream servers; ``AAAA`` and other types
   get an empty answer (sandboxes are IPv4-only);
4. **before replying**, admits exactly the answered addresses for that sandbox into the
   packet filter for the answer's TTL (clamped, plus a grace period), so the first
   connection after the answer never races the filter. Addresses in never-reachable or
   denied ranges are removed from the answer and never admitted.

Also here: :class:`ZoneServer`, a tiny authoritative server (static A records, NXDOMAIN
otherwise, records every query it sees). Tests and benchmarks use it as the "upstream".
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import dsec.network.dns as dns
from dsec.network.policy import ResolvedPolicy, normalize_domain

__all__ = [
    "AdmitFunction",
    "ResolverLimits",
    "SandboxDnsState",
    "SandboxResolver",
    "ZoneServer",
    "parse_hostport",
]

log = logging.getLogger(__name__)

IP_FREEBIND = 15

AdmitFunction = Callable[[str, list[str], int, bool], None]
"""admit(sandbox_ip, destinations, timeout_s, refresh): put answers into the filter."""


@dataclass(frozen=True)
class ResolverLimits:
    """Resolver tuning. Times in seconds, rates in queries per second."""

    queries_per_s: float = 100.0
    burst: int = 200
    max_answer_ttl: int = 300
    min_admit_s: int = 30
    admit_grace_s: int = 10
    static_ttl: int = 60
    negative_ttl: int = 30
    upstream_timeout_s: float = 1.0
    upstream_attempts: int = 2
    max_addresses: int = 8
    cache_entries: int = 10000
    max_pending: int = 1024
    refused_names_kept: int = 100


def parse_hostport(value: str, default_port: int = 53) -> tuple[str, int]:
    """``"10.0.0.2"`` or ``"10.0.0.2:5353"`` -> (address, port). IPv4 only."""
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    host = host or value
    ipaddress.IPv4Address(host)
    return host, int(port) if port else default_port


class _TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.capacity = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class SandboxDnsState:
    """What the resolver keeps per sandbox: policy, rate limiter, counters, admissions."""

    sandbox_id: str
    ip: str
    policy: ResolvedPolicy
    bucket: _TokenBucket
    counters: Counter[str] = field(default_factory=Counter)
    refused_names: Counter[str] = field(default_factory=Counter)
    # destination -> {name: monotonic expiry of its admission}
    admitted: dict[str, dict[str, float]] = field(default_factory=dict)

    def admitted_expiry(self, destination: str) -> float:
        names = self.admitted.get(destination)
        return max(names.values()) if names else 0.0

    def prune(self, now: float) -> None:
        for dest in list(self.admitted):
            names = {n: t for n, t in self.admitted[dest].items() if t > now}
            if names:
                self.admitted[dest] = names
            else:
                del self.admitted[dest]

    def names_by_destination(self) -> dict[str, list[str]]:
        return {d: sorted(n) for d, n in self.admitted.items()}


@dataclass
class _CacheEntry:
    rcode: int
    chain: list[dns.Record]  # CNAMEs then As, as answered
    addresses: list[str]
    expires: float


class _UpstreamProtocol(asyncio.DatagramProtocol):
    def __init__(self, owner: SandboxResolver) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.owner._upstream_reply(data, addr)


class _ListenProtocol(asyncio.DatagramProtocol):
    def __init__(self, owner: SandboxResolver) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.owner._query(data, addr)


class SandboxResolver:
    """The per-node resolver. See the module docstring.

    Args:
        listen: (address, port) to bind; the address need not exist yet (IP_FREEBIND),
            since it appears on the first sandbox veth.
        upstreams: servers to forward allowed names to, tried in order.
        static_records: operator names -> IPv4 addresses, answered without upstream.
        admit: callback putting answered addresses into the packet filter.
        never: networks never answered or admitted (besides each policy's deny CIDRs).
        limits: rates, TTL clamps and timeouts.
    """

    def __init__(
        self,
        listen: tuple[str, int],
        *,
        upstreams: Sequence[tuple[str, int]],
        static_records: Mapping[str, Sequence[str]],
        admit: AdmitFunction,
        never: Iterable[str],
        limits: ResolverLimits | None = None,
    ) -> None:
        self.listen = listen
        self.upstreams = list(upstreams)
        self.static = {
            normalize_domain(name, allow_wildcard=False): [
                str(ipaddress.IPv4Address(a)) for a in addrs
            ]
            for name, addrs in static_records.items()
        }
        self.admit_fn = admit
        self.never = [ipaddress.IPv4Network(n) for n in never]
        self.limits = limits or ResolverLimits()
        self.sandboxes: dict[str, SandboxDnsState] = {}
        self.cache: dict[tuple[str, int], _CacheEntry] = {}
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._pending_meta: dict[int, tuple[tuple[str, int], dns.Question]] = {}
        self._listen_transport: asyncio.DatagramTransport | None = None
        self._upstream_transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.totals: Counter[str] = Counter()

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            # no SO_REUSEADDR: a second resolver on this address must fail loudly rather
            # than silently receive part of the sandboxes' queries
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.bind(self.listen)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        transport, _ = await loop.create_datagram_endpoint(lambda: _ListenProtocol(self), sock=sock)
        self._listen_transport = transport
        up = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        up.bind(("0.0.0.0", 0))
        up.setblocking(False)
        up_transport, _ = await loop.create_datagram_endpoint(
            lambda: _UpstreamProtocol(self), sock=up
        )
        self._upstream_transport = up_transport

    async def close(self) -> None:
        for tr in (self._listen_transport, self._upstream_transport):
            if tr is not None:
                tr.close()
        self._listen_transport = self._upstream_transport = None
        await asyncio.sleep(0)  # let the transports close their sockets now
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()

    # ---- sandboxes -------------------------------------------------------------

    def register(self, sandbox_id: str, ip: str, policy: ResolvedPolicy) -> SandboxDnsState:
        state = SandboxDnsState(
            sandbox_id=sandbox_id,
            ip=ip,
            policy=policy,
            bucket=_TokenBucket(self.limits.queries_per_s, self.limits.burst),
        )
        self.sandboxes[ip] = state
        return state

    def unregister(self, ip: str) -> None:
        self.sandboxes.pop(ip, None)

    def set_policy(self, ip: str, policy: ResolvedPolicy) -> list[str]:
        """Replace a sandbox's policy; return the admitted destinations it no longer justifies
        (the caller revokes them in the filter)."""
        state = self.sandboxes[ip]
        state.policy = policy
        now = time.monotonic()
        state.prune(now)
        revoke: list[str] = []
        for dest in list(state.admitted):
            names = {n: t for n, t in state.admitted[dest].items() if policy.allows_name(n)}
            if not names or policy.address_denied(dest):
                revoke.append(dest)
                del state.admitted[dest]
            else:
                state.admitted[dest] = names
        return revoke

    # ---- query path ------------------------------------------------------------

    def _send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._listen_transport is not None:
            self._listen_transport.sendto(data, addr)

    def _query(self, data: bytes, addr: tuple[str, int]) -> None:
        state = self.sandboxes.get(addr[0])
        if state is None:
            self.totals["unknown_source"] += 1
            return
        state.counters["queries"] += 1
        if not state.bucket.take():
            state.counters["rate_limited"] += 1
            return
        try:
            msg = dns.parse_message(data)
        except dns.DnsFormatError:
            state.counters["malformed"] += 1
            if len(data) >= 12:
                bare = dns.Message(id=int.from_bytes(data[:2], "big"), flags=0)
                self._send(dns.build_response(bare, dns.RCODE_FORMERR), addr)
            return
        if msg.is_response:
            state.counters["malformed"] += 1
            return
        if msg.opcode != 0 or len(msg.questions) != 1:
            state.counters["not_implemented"] += 1
            self._send(dns.build_response(msg, dns.RCODE_NOTIMP), addr)
            return
        q = msg.questions[0]
        if q.qclass != dns.CLASS_IN or not state.policy.allows_name(q.name):
            state.counters["refused"] += 1
            self._note_refused(state, q.name)
            self._send(dns.build_response(msg, dns.RCODE_REFUSED), addr)
            return
        if q.qtype != dns.TYPE_A:
            state.counters["nodata"] += 1
            self._send(dns.build_response(msg, dns.RCODE_NOERROR), addr)
            return
        static = self.static.get(q.name)
        if static is not None:
            records = [dns.Record(q.name, dns.TYPE_A, self.limits.static_ttl, a) for a in static]
            self._answer(state, msg, addr, dns.RCODE_NOERROR, records, self.limits.static_ttl)
            return
        entry = self.cache.get((q.name, q.qtype))
        now = time.monotonic()
        if entry is not None and entry.expires > now:
            self._answer_cached(state, msg, addr, entry, now)
            return
        if not self.upstreams:
            state.counters["servfail"] += 1
            self._send(dns.build_response(msg, dns.RCODE_SERVFAIL), addr)
            return
        if len(self._pending) >= self.limits.max_pending:
            state.counters["servfail"] += 1
            self._send(dns.build_response(msg, dns.RCODE_SERVFAIL), addr)
            return
        task = asyncio.get_running_loop().create_task(self._forward(state, msg, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _note_refused(self, state: SandboxDnsState, name: str) -> None:
        if name in state.refused_names or len(state.refused_names) < self.limits.refused_names_kept:
            state.refused_names[name] += 1
        else:
            state.refused_names["(other)"] += 1

    def _usable(self, state: SandboxDnsState, address: str) -> bool:
        ip = ipaddress.IPv4Address(address)
        if any(ip in n for n in self.never):
            return False
        return not state.policy.address_denied(address)

    def _answer(
        self,
        state: SandboxDnsState,
        msg: dns.Message,
        addr: tuple[str, int],
        rcode: int,
        chain: list[dns.Record],
        ttl: int,
    ) -> None:
        """Filter the chain's addresses, admit them, then reply (in that order)."""
        ttl = max(0, min(ttl, self.limits.max_answer_ttl))
        answers: list[dns.Record] = []
        addresses: list[str] = []
        for rr in chain:
            if rr.rtype == dns.TYPE_A:
                assert isinstance(rr.data, str)
                if not self._usable(state, rr.data) or len(addresses) >= self.limits.max_addresses:
                    state.counters["addresses_withheld"] += 1
                    continue
                addresses.append(rr.data)
            answers.append(dns.Record(rr.name, rr.rtype, ttl, rr.data))
        if addresses:
            try:
                self._admit(state, msg.questions[0].name, addresses, ttl)
            except Exception:
                log.exception("admitting %s for %s failed", addresses, state.sandbox_id)
                state.counters["servfail"] += 1
                self._send(dns.build_response(msg, dns.RCODE_SERVFAIL), addr)
                return
        state.counters["answered" if addresses else "nodata"] += 1
        self._send(dns.build_response(msg, rcode, answers), addr)

    def _answer_cached(
        self,
        state: SandboxDnsState,
        msg: dns.Message,
        addr: tuple[str, int],
        entry: _CacheEntry,
        now: float,
    ) -> None:
        if entry.rcode != dns.RCODE_NOERROR:
            state.counters["nxdomain" if entry.rcode == dns.RCODE_NXDOMAIN else "servfail"] += 1
            self._send(dns.build_response(msg, entry.rcode), addr)
            return
        self._answer(state, msg, addr, dns.RCODE_NOERROR, entry.chain, int(entry.expires - now))

    def _admit(self, state: SandboxDnsState, name: str, addresses: list[str], ttl: int) -> None:
        now = time.monotonic()
        timeout = max(ttl, self.limits.min_admit_s) + self.limits.admit_grace_s
        fresh: list[str] = []
        refresh: list[str] = []
        for a in addresses:
            current = state.admitted_expiry(a)
            if current >= now + ttl + 2:
                pass  # already admitted long enough for this answer
            elif current > now:
                refresh.append(a)
            else:
                fresh.append(a)
        if fresh:
            self.admit_fn(state.ip, fresh, timeout, False)
        if refresh:
            self.admit_fn(state.ip, refresh, timeout, True)
        for a in addresses:
            names = state.admitted.setdefault(a, {})
            names[name] = max(names.get(name, 0.0), now + timeout)

    async def _forward(
        self, state: SandboxDnsState, msg: dns.Message, addr: tuple[str, int]
    ) -> None:
        q = msg.questions[0]
        reply: dns.Message | None = None
        for attempt in range(self.limits.upstream_attempts):
            upstream = self.upstreams[attempt % len(self.upstreams)]
            reply = await self._ask_upstream(q, upstream)
            if reply is not None:
                break
        if reply is None or reply.rcode not in (dns.RCODE_NOERROR, dns.RCODE_NXDOMAIN):
            state.counters["servfail"] += 1
            self._send(dns.build_response(msg, dns.RCODE_SERVFAIL), addr)
            return
        now = time.monotonic()
        if reply.rcode == dns.RCODE_NXDOMAIN:
            self._cache_put(
                q, _CacheEntry(dns.RCODE_NXDOMAIN, [], [], now + self.limits.negative_ttl)
            )
            state.counters["nxdomain"] += 1
            self._send(dns.build_response(msg, dns.RCODE_NXDOMAIN), addr)
            return
        # follow the CNAME chain from the question; ignore records not on it
        owners = {q.name}
        chain: list[dns.Record] = []
        ttl = self.limits.max_answer_ttl
        for rr in reply.answers:
            if rr.name not in owners or rr.rclass != dns.CLASS_IN:
                continue
            if rr.rtype == dns.TYPE_CNAME and isinstance(rr.data, str):
                owners.add(rr.data)
            elif rr.rtype != dns.TYPE_A:
                continue
            chain.append(rr)
            ttl = min(ttl, rr.ttl)
        addresses = [str(r.data) for r in chain if r.rtype == dns.TYPE_A]
        expires = now + (ttl if addresses else self.limits.negative_ttl)
        self._cache_put(q, _CacheEntry(dns.RCODE_NOERROR, chain, addresses, expires))
        self._answer(state, msg, addr, dns.RCODE_NOERROR, chain, ttl)

    def _cache_put(self, q: dns.Question, entry: _CacheEntry) -> None:
        if len(self.cache) >= self.limits.cache_entries:
            now = time.monotonic()
            for key in [k for k, v in self.cache.items() if v.expires <= now]:
                del self.cache[key]
            while len(self.cache) >= self.limits.cache_entries:
                del self.cache[next(iter(self.cache))]
        self.cache[(q.name, q.qtype)] = entry

    async def _ask_upstream(self, q: dns.Question, upstream: tuple[str, int]) -> dns.Message | None:
        if self._upstream_transport is None:
            return None
        loop = asyncio.get_running_loop()
        ident = random.getrandbits(16)
        while ident in self._pending:
            ident = random.getrandbits(16)
        fut: asyncio.Future[bytes] = loop.create_future()
        self._pending[ident] = fut
        self._pending_meta[ident] = (upstream, q)
        try:
            self._upstream_transport.sendto(dns.build_query(ident, q.name, q.qtype), upstream)
            data = await asyncio.wait_for(fut, self.limits.upstream_timeout_s)
        except (TimeoutError, OSError):
            self.totals["upstream_timeouts"] += 1
            return None
        finally:
            self._pending.pop(ident, None)
            self._pending_meta.pop(ident, None)
        try:
            return dns.parse_message(data)
        except dns.DnsFormatError:
            self.totals["upstream_malformed"] += 1
            return None

    def _upstream_reply(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(data) < 12:
            return
        ident = int.from_bytes(data[:2], "big")
        fut = self._pending.get(ident)
        meta = self._pending_meta.get(ident)
        if fut is None or meta is None or fut.done():
            return
        upstream, q = meta
        if (addr[0], addr[1]) != upstream:
            self.totals["upstream_spoofed"] += 1
            return
        try:
            msg = dns.parse_message(data)
        except dns.DnsFormatError:
            return
        if not msg.is_response or len(msg.questions) != 1 or msg.questions[0] != q:
            self.totals["upstream_mismatch"] += 1
            return
        fut.set_result(data)

    def stats(self, ip: str) -> dict[str, object]:
        """DNS counters of one sandbox: queries, answered, refused, rate_limited, ..."""
        state = self.sandboxes.get(ip)
        if state is None:
            return {}
        state.prune(time.monotonic())
        return {
            **{
                k: state.counters.get(k, 0)
                for k in ("queries", "answered", "refused", "rate_limited")
            },
            **{
                k: v
                for k, v in state.counters.items()
                if k not in ("queries", "answered", "refused", "rate_limited")
            },
            "refused_names": dict(state.refused_names.most_common(20)),
        }


class _ZoneProtocol(asyncio.DatagramProtocol):
    def __init__(self, owner: ZoneServer) -> None:
        self.owner = owner
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.owner.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class ZoneServer:
    """A minimal authoritative DNS server over UDP: static A records and CNAMEs.

    ``records`` maps names to IPv4 addresses; ``cnames`` maps names to target names.
    Every query name is appended to :attr:`queries` (tests assert what reached it).
    Start it with a socket made wherever it should listen (e.g. inside a namespace).
    """

    def __init__(
        self,
        records: Mapping[str, Sequence[str]],
        *,
        cnames: Mapping[str, str] | None = None,
        ttl: int = 300,
    ) -> None:
        self.records = {k.lower().rstrip("."): list(v) for k, v in records.items()}
        self.cnames = {
            k.lower().rstrip("."): v.lower().rstrip(".") for k, v in (cnames or {}).items()
        }
        self.ttl = ttl
        self.queries: list[str] = []
        self._transport: asyncio.BaseTransport | None = None

    def answer(self, data: bytes) -> bytes | None:
        try:
            msg = dns.parse_message(data)
        except dns.DnsFormatError:
            return None
        if msg.is_response or len(msg.questions) != 1:
            return None
        q = msg.questions[0]
        self.queries.append(q.name)
        chain: list[dns.Record] = []
        name = q.name
        for _ in range(8):
            if name in self.cnames:
                chain.append(dns.Record(name, dns.TYPE_CNAME, self.ttl, self.cnames[name]))
                name = self.cnames[name]
            else:
                break
        if name not in self.records and not chain:
            return dns.build_response(msg, dns.RCODE_NXDOMAIN, authoritative=True)
        if q.qtype == dns.TYPE_A:
            chain += [dns.Record(name, dns.TYPE_A, self.ttl, a) for a in self.records.get(name, [])]
        return dns.build_response(msg, dns.RCODE_NOERROR, chain, authoritative=True)

    async def start(self, sock: socket.socket) -> None:
        """Serve on an already bound UDP socket (ownership passes to the server)."""
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _ZoneProtocol(self), sock=sock
        )

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            await asyncio.sleep(0)  # the socket closes in a loop callback
