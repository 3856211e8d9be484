"""Network namespaces and rtnetlink, from Python, without spawning ``ip``.

Why not ``ip``: each ``ip`` process costs 2-5 ms on this node kind, and a networked
sandbox needs a veth pair, addresses and routes on both sides; through rtnetlink the
whole wiring takes well under a millisecond.

What is here:
    * :func:`create_netns` / :func:`delete_netns`: a persistent network namespace is a
      bind mount of ``/proc/thread-self/ns/net`` onto a regular file (what ``ip netns
      add`` does, but at a path we choose). A thread unshares, mounts and exits.
    * :func:`in_netns`: run a callable in a fresh OS thread that joined a namespace
      (``setns`` affects only the calling thread); sockets it creates stay in that
      namespace afterwards, which is how the tests and the resolver get sockets there.
    * :class:`NetnsSockets`: TCP sockets created inside another network namespace by one
      long-lived worker thread that joins the namespace, makes the socket and returns to
      the node's own namespace (the port proxy's connections into sandboxes).
    * :class:`RtNetlink`: the handful of rtnetlink requests a sandbox needs: create a
      veth pair with its peer in another namespace, bring links up, add addresses and
      routes, delete links.
    * :func:`write_sysctl`: write ``/proc/sys`` in the current (or a given) namespace.

Python 3.11 has no ``os.setns``/``os.unshare``, so both go through ctypes.
Nothing here parses client input; callers pass validated names and addresses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from dsec.privileged.mount import MNT_DETACH, MS_BIND, mount, umount

__all__ = [
    "CLONE_NEWNET",
    "NetnsSockets",
    "RtNetlink",
    "create_netns",
    "delete_netns",
    "in_netns",
    "sync_link",
    "write_sysctl",
]

T = TypeVar("T")

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]

# rtnetlink constants (linux/netlink.h, linux/rtnetlink.h, linux/if_link.h)
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_NEWROUTE = 24
RTM_NEWNEIGH = 28
IFLA_ADDRESS = 1
NDA_DST = 1
NDA_LLADDR = 2
NUD_PERMANENT = 0x80
IFLA_IFNAME = 3
IFLA_LINKINFO = 18
IFLA_IFALIAS = 20
IFLA_NET_NS_FD = 28
IFLA_INFO_KIND = 1
IFLA_INFO_DATA = 2
VETH_INFO_PEER = 1
IFA_ADDRESS = 1
IFA_LOCAL = 2
RTA_DST = 1
RTA_OIF = 4
RTA_GATEWAY = 5
RT_TABLE_MAIN = 254
RTPROT_STATIC = 4
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RTN_UNICAST = 1
RTNH_F_ONLINK = 4
IFF_UP = 0x1
NLA_F_NESTED = 0x8000

_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NDMSG = struct.Struct("=BxxxiHBB")
_NLMSGHDR = struct.Struct("=IHHII")
_RTATTR = struct.Struct("=HH")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """setns(2) for the calling thread only."""
    _check(_libc.setns(fd, nstype), "setns")


def _run_thread(fn: Callable[[], T]) -> T:
    """Run fn in a new OS thread (which may change its namespaces) and return its result."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, name="dsec-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def in_netns(netns_path: str | os.PathLike[str], fn: Callable[[], T]) -> T:
    """Run ``fn()`` in a fresh thread that has joined the network namespace at netns_path.

    The thread ends afterwards, so the caller's namespace never changes. Sockets created
    by fn keep living in that namespace.
    """

    def target() -> T:
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(fd, CLONE_NEWNET)
        finally:
            os.close(fd)
        return fn()

    return _run_thread(target)


class NetnsSockets:
    """Make TCP sockets that live in other network namespaces, without a thread each.

    ``setns(2)`` changes only the calling thread's namespace, so the work runs on one
    dedicated worker thread: it joins the target namespace (an open namespace fd), makes
    the socket and joins the node's namespace again (the fd of the namespace this object
    was created in) before it takes the next job. A socket keeps the namespace it was made
    in for its whole life: the caller connects and uses it from any thread. If the worker
    cannot get back to the node's namespace (it never can fail for root with a valid fd),
    the worker is discarded and a new one started, so no other job runs in a sandbox's
    namespace. Cost: ~10 us of system calls plus one thread hop per socket.
    """

    def __init__(self) -> None:
        self._home_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsec-netns-sockets")
        self._lock = threading.Lock()

    def _make(self, netns_fd: int, family: int, kind: int) -> socket.socket:
        setns(netns_fd, CLONE_NEWNET)
        try:
            return socket.socket(family, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        finally:
            try:
                setns(self._home_fd, CLONE_NEWNET)
            except OSError:
                with self._lock:  # this thread is lost to a sandbox namespace: retire it
                    old, self._pool = (
                        self._pool,
                        ThreadPoolExecutor(1, thread_name_prefix="dsec-netns-sockets"),
                    )
                old.shutdown(wait=False)
                raise

    async def socket(
        self, netns_fd: int, family: int = socket.AF_INET, kind: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A new non-blocking socket in the namespace of ``netns_fd`` (an open fd of
        ``/proc/<pid>/ns/net`` or of a pinned namespace file; the caller keeps it)."""
        import asyncio

        with self._lock:
            pool = self._pool
        return await asyncio.get_running_loop().run_in_executor(
            pool, self._make, netns_fd, family, kind
        )

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        self._pool.shutdown(wait=True)
        if self._home_fd >= 0:
            os.close(self._home_fd)
            self._home_fd = -1


def create_netns(path: str | os.PathLike[str]) -> Path:
    """Create a new, empty network namespace and pin it by a bind mount at path.

    Raises FileExistsError if path already exists (callers decide whether a leftover is
    theirs to remove). The namespace holds only a down ``lo`` until configured.
    """

    def target() -> None:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        pin_netns(path, "/proc/thread-self/ns/net")

    _run_thread(target)
    return Path(path)


def pin_netns(path: str | os.PathLike[str], source: str | os.PathLike[str]) -> Path:
    """Pin an existing network namespace (``source``: e.g. ``/proc/<pid>/ns/net`` of a
    container's init) by a bind mount at ``path``, as :func:`create_netns` pins a new one;
    :func:`delete_netns` unpins it. Raises FileExistsError if path already exists."""
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    os.close(fd)
    try:
        mount(str(source), p, None, MS_BIND)
    except BaseException:
        p.unlink(missing_ok=True)
        raise
    return p


def delete_netns(path: str | os.PathLike[str]) -> bool:
    """Unpin and remove a namespace file made by :func:`create_netns`. Idempotent.

    The namespace itself disappears when nothing else (a process, an open fd) holds it.
    Returns True if something was removed.
    """
    p = Path(path)
    removed = False
    try:
        umount(p, MNT_DETACH)
        removed = True
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):
            raise
    try:
        p.unlink()
        removed = True
    except FileNotFoundError:
        pass
    return removed


SIOCETHTOOL = 0x8946
ETHTOOL_GLINK = 0x0000000A


def sync_link(name: str) -> bool:
    """Make the kernel finish bringing a link up *now*; return its carrier state.

    A veth end opened while its peer was down only gets its real queueing discipline
    later, from the asynchronous linkwatch worker; until then the placeholder drops
    every packet sent through it (seen here as ~1-2% of fresh sandboxes losing their
    first DNS reply or ARP). ETHTOOL_GLINK runs that pending linkwatch work
    synchronously (``ethtool_op_get_link`` -> ``linkwatch_sync_dev``). Acts in the
    calling thread's namespace.
    """
    value = ctypes.create_string_buffer(struct.pack("=II", ETHTOOL_GLINK, 0))
    ifreq = struct.pack("16sP", name.encode(), ctypes.addressof(value)) + b"\0" * 16
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)
    _cmd, up = struct.unpack("=II", value.raw[:8])
    return bool(up)


def write_sysctl(key: str, value: str, netns_path: str | os.PathLike[str] | None = None) -> None:
    """Write ``/proc/sys/<key with dots as slashes>``, inside netns_path if given."""
    file = "/proc/sys/" + key.replace(".", "/")

    def write() -> None:
        with open(file, "w") as f:
            f.write(value)

    if netns_path is None:
        write()
    else:
        in_netns(netns_path, write)


def _attr(kind: int, payload: bytes) -> bytes:
    length = _RTATTR.size + len(payload)
    pad = (4 - length % 4) % 4
    return _RTATTR.pack(length, kind) + payload + b"\0" * pad


def _attr_str(kind: int, value: str) -> bytes:
    return _attr(kind, value.encode() + b"\0")


def _attr_u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("=I", value))


def _parse_attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + _RTATTR.size <= len(data):
        length, kind = _RTATTR.unpack_from(data, off)
        if length < _RTATTR.size:
            break
        out[kind & ~NLA_F_NESTED] = data[off + _RTATTR.size : off + length]
        off += (length + 3) & ~3
    return out


class RtNetlink:
    """A NETLINK_ROUTE socket bound to one network namespace.

    ``RtNetlink()`` talks to the caller's namespace; ``RtNetlink(netns_path)`` opens the
    socket from a thread inside that namespace, so every request acts there.
    Errors are OSError with the kernel's errno (EEXIST, ENODEV, ...).
    """

    def __init__(self, netns_path: str | os.PathLike[str] | None = None) -> None:
        def make() -> socket.socket:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)

        self._sock = make() if netns_path is None else in_netns(netns_path, make)
        self._sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RtNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, msg_type: int, flags: int, body: bytes) -> list[bytes]:
        """Send one request; return the payloads of reply messages (dumps) after the ACK."""
        self._seq += 1
        seq = self._seq
        header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags | NLM_F_REQUEST, seq, 0)
        self._sock.send(header + body)
        replies: list[bytes] = []
        while True:
            data = self._sock.recv(65536)
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, rtype, _rflags, rseq, _pid = _NLMSGHDR.unpack_from(data, off)
                payload = data[off + _NLMSGHDR.size : off + length]
                off += (length + 3) & ~3
                if rseq != seq:
                    continue
                if rtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code != 0:
                        raise OSError(-code, f"rtnetlink {msg_type}: {os.strerror(-code)}")
                    return replies
                if rtype == NLMSG_DONE:
                    return replies
                replies.append(payload)

    def add_veth(
        self,
        name: str,
        peer_name: str,
        peer_netns_path: str | os.PathLike[str],
        *,
        alias: str | None = None,
        address: bytes | None = None,
        peer_address: bytes | None = None,
    ) -> int:
        """Create veth ``name`` here with its peer ``peer_name`` inside peer_netns_path.

        Both ends start down (the kernel refuses IFF_UP before the pair is linked): bring
        them up with :meth:`set_up`. ``alias`` (ifalias, <= 255 bytes) labels the host end
        so leftovers can be recognised after a crash. ``address``/``peer_address`` set the
        MAC addresses (6 bytes; random when None). Returns the host end's ifindex.
        """
        fd = os.open(peer_netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            peer = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
            peer += _attr_str(IFLA_IFNAME, peer_name) + _attr_u32(IFLA_NET_NS_FD, fd)
            if peer_address:
                peer += _attr(IFLA_ADDRESS, peer_address)
            info = _attr_str(IFLA_INFO_KIND, "veth") + _attr(
                IFLA_INFO_DATA | NLA_F_NESTED, _attr(VETH_INFO_PEER | NLA_F_NESTED, peer)
            )
            body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
            body += _attr_str(IFLA_IFNAME, name)
            if address:
                body += _attr(IFLA_ADDRESS, address)
            if alias:
                body += _attr_str(IFLA_IFALIAS, alias)
            body += _attr(IFLA_LINKINFO | NLA_F_NESTED, info)
            self._request(RTM_NEWLINK, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body)
        finally:
            os.close(fd)
        return socket.if_nametoindex(name)

    def link_index(self, name: str) -> int:
        """ifindex of a link in this socket's namespace (OSError ENODEV if absent)."""
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _attr_str(IFLA_IFNAME, name)
        replies = self._request(RTM_GETLINK, NLM_F_ACK, body)
        for payload in replies:
            _family, _type, index, _flags, _change = _IFINFOMSG.unpack_from(payload)
            return int(index)
        raise OSError(errno.ENODEV, f"no link named {name}")

    def set_up(self, index: int) -> None:
        """Bring a link up (``ip link set dev X up``)."""
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP)
        self._request(RTM_NEWLINK, NLM_F_ACK, body)

    def delete_link(self, name: str) -> bool:
        """Delete a link by name (a veth takes its peer with it). False if it did not exist."""
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + _attr_str(IFLA_IFNAME, name)
        try:
            self._request(RTM_DELLINK, NLM_F_ACK, body)
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.ENOENT):
                return False
            raise
        return True

    def add_address(self, index: int, address: str, prefixlen: int) -> None:
        """Add an IPv4 address (``ip addr add address/prefixlen dev index``)."""
        raw = ipaddress.IPv4Address(address).packed
        body = _IFADDRMSG.pack(socket.AF_INET, prefixlen, 0, RT_SCOPE_UNIVERSE, index)
        body += _attr(IFA_LOCAL, raw) + _attr(IFA_ADDRESS, raw)
        self._request(RTM_NEWADDR, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, body)

    def add_neighbor(self, index: int, address: str, lladdr: bytes) -> None:
        """Pin a permanent IPv4 neighbour entry (``ip neigh replace ... nud permanent``).

        Used on both ends of a sandbox veth: no ARP is ever needed (the first ARP
        request into a freshly created veth is sometimes lost, costing a 1 s SYN retry),
        and the sandbox cannot answer ARP for addresses that are not its own.
        """
        body = _NDMSG.pack(socket.AF_INET, index, NUD_PERMANENT, 0, 0)
        body += _attr(NDA_DST, ipaddress.IPv4Address(address).packed) + _attr(NDA_LLADDR, lladdr)
        self._request(RTM_NEWNEIGH, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, body)

    def add_route(
        self,
        destination: str,
        *,
        oif: int,
        gateway: str | None = None,
        onlink: bool = False,
    ) -> None:
        """Add an IPv4 route in the main table (``ip route add destination [via gw] dev oif``).

        ``destination`` is a CIDR (``0.0.0.0/0`` for the default route). Without a gateway
        the route is scope link (directly on the wire); ``onlink`` lets the gateway sit
        outside every prefix of the link (a /32 peer).
        """
        net = ipaddress.IPv4Network(destination)
        scope = RT_SCOPE_UNIVERSE if gateway else RT_SCOPE_LINK
        body = _RTMSG.pack(
            socket.AF_INET,
            net.prefixlen,
            0,
            0,
            RT_TABLE_MAIN,
            RTPROT_STATIC,
            scope,
            RTN_UNICAST,
            RTNH_F_ONLINK if onlink else 0,
        )
        if net.prefixlen:
            body += _attr(RTA_DST, net.network_address.packed)
        if gateway:
            body += _attr(RTA_GATEWAY, ipaddress.IPv4Address(gateway).packed)
        body += _attr_u32(RTA_OIF, oif)
        self._request(RTM_NEWROUTE, NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE, body)

    def link_names(self) -> list[str]:
        """Names of every link in this socket's namespace."""
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        names: list[str] = []
        for payload in self._request(RTM_GETLINK, NLM_F_DUMP, body):
            attrs = _parse_attrs(payload[_IFINFOMSG.size :])
            if IFLA_IFNAME in attrs:
                names.append(attrs[IFLA_IFNAME].rstrip(b"\0").decode())
        return names
