"""A loopback-only "internet" for testing and benchmarking sandbox networking.

Builds, on this node only, network namespaces that play the outside world, wired to the
host by veth pairs in the RFC 2544 benchmarking range 198.18.0.0/15 (never routed on
the real internet), with a test DNS zone served from inside them:

    inet ns    198.18.0.2-.9/24 (+ .53 DNS, + 169.254.77.77 "metadata", + the cloud
               service addresses 100.100.100.200, 168.63.129.16, 192.0.0.192)  via host 198.18.0.1
    mirror ns  198.18.1.2/24 (a "package mirror" with several open ports) via host 198.18.1.1
    plain ns   198.18.2.2/24, an unfiltered "sandbox" (baseline for benchmarks)

Every TCP server answers one line, ``<local address>:<local port>``, and closes; the UDP
server echoes. Nothing here sends traffic anywhere but these namespaces and the host.
Used by tests/integration/test_network*.py and benchmarks/network.py; needs root.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import dsec.network.dns as dns
from dsec.network.resolver import ZoneServer
from dsec.privileged.hostsysctl import HeldSysctl
from dsec.privileged.netns import RtNetlink, create_netns, delete_netns, in_netns

__all__ = ["CLOUD_SERVICE_ADDRS", "ZONE", "Testbed", "dns_query", "tcp_probe", "udp_probe"]

INET_LINK = ("198.18.0.1", "198.18.0.2")
MIRROR_LINK = ("198.18.1.1", "198.18.1.2")
PLAIN_LINK = ("198.18.2.1", "198.18.2.2")
INET_EXTRA = [
    "198.18.0.3",
    "198.18.0.4",
    "198.18.0.5",
    "198.18.0.6",
    "198.18.0.7",
    "198.18.0.8",
    "198.18.0.9",
]
DNS_ADDR = "198.18.0.53"
METADATA_ADDR = "169.254.77.77"
CLOUD_SERVICE_ADDRS = ["100.100.100.200", "168.63.129.16", "192.0.0.192"]
"""Alibaba's metadata, Azure's wireserver, Oracle's legacy metadata: served by the inet
namespace (host routes to it while the testbed runs), so a probe that gets through is
answered here instead of leaving the node by its default route."""
INET_TCP_PORTS = [80, 443, 8080]
MIRROR_TCP_PORTS = [22, 80, 443, 3128, 8080, 9000]
UDP_ECHO_PORT = 7

ZONE: dict[str, list[str]] = {
    "allowed.example.test": ["198.18.0.2"],
    "sibling.example.test": ["198.18.0.3"],
    "wild.test": ["198.18.0.6"],
    "api.wild.test": ["198.18.0.4"],
    "deep.api.wild.test": ["198.18.0.5"],
    "edge.cdnhost.test": ["198.18.0.7"],
    "other.example.test": ["198.18.0.8"],
    "mirror.example.test": ["198.18.1.2"],
    "meta.example.test": [METADATA_ADDR],
    "multi.example.test": ["198.18.0.8", "198.18.0.9"],
}
"""The test zone served by the upstream DNS server in the inet namespace."""
ZONE_CNAMES = {"cdn.example.test": "edge.cdnhost.test"}


@dataclass
class Testbed:
    """Namespaces, links and servers of the fake internet. ``await start()``, ``await close()``."""

    __test__ = False  # not a pytest test class despite the name

    root: Path
    ttl: int = 300
    zone: ZoneServer = field(init=False)
    _servers: list[asyncio.AbstractServer] = field(default_factory=list, init=False)
    _transports: list[asyncio.BaseTransport] = field(default_factory=list, init=False)
    _forwarding: HeldSysctl = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        tag = hashlib.sha256(str(self.root).encode()).hexdigest()[:4]
        self.links = {"inet": f"dtb{tag}i", "mirror": f"dtb{tag}m", "plain": f"dtb{tag}p"}
        self.ns = {name: self.root / f"ns-{name}" for name in self.links}
        self.zone = ZoneServer(ZONE, cnames=ZONE_CNAMES, ttl=self.ttl)
        self._forwarding = HeldSysctl("net.ipv4.ip_forward", "1", str(self.root))

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        await self.close_kernel()
        self._wire("inet", INET_LINK, [*INET_EXTRA, DNS_ADDR])
        self._wire("mirror", MIRROR_LINK, [])
        self._wire("plain", PLAIN_LINK, [])
        with RtNetlink(self.ns["inet"]) as nl:
            for addr in (METADATA_ADDR, *CLOUD_SERVICE_ADDRS):
                nl.add_address(nl.link_index("eth0"), addr, 32)
        with RtNetlink() as host:
            inet = host.link_index(self.links["inet"])
            for addr in (METADATA_ADDR, *CLOUD_SERVICE_ADDRS):
                host.add_route(f"{addr}/32", oif=inet)
        self._forwarding.hold()
        sock = in_netns(self.ns["inet"], lambda: _bound_udp(DNS_ADDR, 53))
        await self.zone.start(sock)
        for name, ports in (
            ("inet", INET_TCP_PORTS),
            ("mirror", MIRROR_TCP_PORTS),
            ("plain", [80]),
        ):
            for port in ports:
                await self._tcp_server(self.ns[name], "0.0.0.0", port)
        await self._udp_echo(self.ns["inet"], "0.0.0.0", UDP_ECHO_PORT)

    def _wire(self, name: str, link: tuple[str, str], extra: list[str]) -> None:
        host_addr, peer_addr = link
        ns = create_netns(self.ns[name])
        host_mac = bytes([0x02, 0xDB, 0, 0, len(name), 1])
        peer_mac = bytes([0x02, 0xDB, 0, 0, len(name), 2])
        with RtNetlink() as host:
            index = host.add_veth(
                self.links[name], "eth0", ns, address=host_mac, peer_address=peer_mac
            )
            host.add_address(index, host_addr, 24)
            host.set_up(index)
            # static neighbours: no ARP on fresh veths (see RtNetlink.add_neighbor)
            for a in [peer_addr, *extra]:
                host.add_neighbor(index, a, peer_mac)

        def inside() -> None:
            with RtNetlink() as nl:
                nl.set_up(1)
                eth = nl.link_index("eth0")
                nl.add_address(eth, peer_addr, 24)
                for a in extra:
                    nl.add_address(eth, a, 24)
                nl.set_up(eth)
                nl.add_route("0.0.0.0/0", oif=eth, gateway=host_addr)
                nl.add_neighbor(eth, host_addr, host_mac)

        in_netns(ns, inside)

    async def _tcp_server(self, ns: Path, host: str, port: int) -> None:
        sock = in_netns(ns, lambda: _listening_tcp(host, port))

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            local = writer.get_extra_info("sockname")
            with contextlib.suppress(OSError):
                writer.write(f"{local[0]}:{local[1]}\n".encode())
                await writer.drain()
                writer.close()
                await writer.wait_closed()

        self._servers.append(await asyncio.start_server(handle, sock=sock))

    async def tcp_listener_on_host(self, address: str, port: int) -> None:
        """A banner server in the host namespace (stands in for the apiserver or edge)."""

        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND: the gateway may not exist yet
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
            s.listen(64)
            s.setblocking(False)
            return s

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                writer.write(b"host\n")
                await writer.drain()
                writer.close()

        self._servers.append(await asyncio.start_server(handle, sock=make()))

    async def tcp_listener_in(self, ns: Path, address: str, port: int) -> None:
        """A banner server inside any namespace (e.g. another sandbox)."""
        await self._tcp_server(ns, address, port)

    async def _udp_echo(self, ns: Path, host: str, port: int) -> None:
        sock = in_netns(ns, lambda: _bound_udp(host, port))

        class Echo(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                self.transport.sendto(data, addr)  # type: ignore[attr-defined]

        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Echo, sock=sock)
        self._transports.append(transport)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)
        for tr in self._transports:
            tr.close()
        await asyncio.sleep(0)
        self._servers.clear()
        self._transports.clear()
        await self.zone.close()
        await self.close_kernel()
        self._forwarding.release()

    async def close_kernel(self) -> None:
        def kernel() -> None:
            with RtNetlink() as host:
                for link in self.links.values():
                    host.delete_link(link)
            for path in self.ns.values():
                delete_netns(path)

        await asyncio.to_thread(kernel)


def _bound_udp(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.setblocking(False)
    return s


def _listening_tcp(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(256)
    s.setblocking(False)
    return s


def _socket_in(ns: Path | str, kind: int) -> socket.socket:
    s = in_netns(ns, lambda: socket.socket(socket.AF_INET, kind))
    s.setblocking(False)
    return s


async def tcp_probe(ns: Path | str, address: str, port: int, timeout: float = 1.0) -> str | None:
    """Connect from inside ns; return the server's banner line, or None if it failed."""
    loop = asyncio.get_running_loop()
    sock = _socket_in(ns, socket.SOCK_STREAM)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (address, port)), timeout)
        data = await asyncio.wait_for(loop.sock_recv(sock, 256), timeout)
        return data.decode(errors="replace").strip()
    except (OSError, TimeoutError):
        return None
    finally:
        sock.close()


async def udp_probe(ns: Path | str, address: str, port: int, timeout: float = 1.0) -> bool:
    """Send one datagram from inside ns; True if it was echoed back."""
    loop = asyncio.get_running_loop()
    sock = _socket_in(ns, socket.SOCK_DGRAM)
    try:
        await loop.sock_connect(sock, (address, port))
        await loop.sock_sendall(sock, b"ping")
        data = await asyncio.wait_for(loop.sock_recv(sock, 64), timeout)
        return data == b"ping"
    except (OSError, TimeoutError):
        return False
    finally:
        sock.close()


async def dns_query(
    ns: Path | str,
    server: str,
    name: str,
    qtype: int = dns.TYPE_A,
    timeout: float = 1.0,
) -> dns.Message | None:
    """Ask server:53 from inside ns; the parsed reply, or None on timeout."""
    loop = asyncio.get_running_loop()
    sock = _socket_in(ns, socket.SOCK_DGRAM)
    try:
        await loop.sock_connect(sock, (server, 53))
        ident = int.from_bytes(os.urandom(2), "big")
        await loop.sock_sendall(sock, dns.build_query(ident, name, qtype))
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout)
        return dns.parse_message(data)
    except (OSError, TimeoutError, dns.DnsFormatError):
        return None
    finally:
        sock.close()
