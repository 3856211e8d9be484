"""NetworkManager: per-sandbox network namespaces with default-deny, domain-based egress.

How a networked sandbox is wired (all of it outside the sandbox)::

      sandbox netns                         host (the node)
    +-----------------+   veth pair   +------------------------------------------+
    | eth0 10.203.x.y |---------------| dsv<tag><slot>  10.203.0.1/32            |
    | lo              |               |   route 10.203.x.y/32 dev dsv...         |
    | default via     |               | nftables table inet dsec_<tag>  (filter) |
    |   10.203.0.1    |               | resolver on 10.203.0.1:53  (UDP)         |
    | resolv.conf ->  |               | masquerade out of every other link       |
    |   10.203.0.1    |               +------------------------------------------+
    +-----------------+

Every host-side veth carries the same gateway address (``10.203.0.1/32`` by default) and
each sandbox gets one ``/32``; the resolver therefore listens on one address for all.
Nothing from a sandbox reaches the host except DNS to that address; nothing reaches
another sandbox, the never-reachable ranges or anything its policy does not admit.

Lifecycle (what the edge calls)::

    mgr = NetworkManager(state_dir, upstream_dns=["192.0.2.53"])
    await mgr.start()                                   # table, resolver, forwarding
    net = await mgr.setup("sb-1", NetworkPolicy(allow_domains=["pypi.org"]))
    # the container runtime joins net.netns_path; write net.resolv_conf to /etc/resolv.conf
    await mgr.update("sb-1", NetworkPolicy(allow_domains=["*.github.com"]))
    print(await mgr.stats("sb-1"))
    await mgr.teardown("sb-1")                          # idempotent
    await mgr.close()

A sandbox created with ``network=None`` never reaches this class: the container runtime
gives it a fresh namespace with only loopback.

Restart: state lives in ``state_dir`` (one JSON record per sandbox, written before any
kernel object is made). ``start()`` rebuilds the filter from the records in one atomic
transaction (keeping live DNS admissions); ``reconcile(live_ids)`` then removes whatever
belongs to sandboxes that no longer exist. ``close()`` leaves the kernel state of
running sandboxes in place (their filter keeps dropping), and removes the node-wide
objects only when no sandbox is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.errors import Conflict, InvalidRequest, SandboxError, SandboxNotFound, ServiceUnavailable
from dsec.network.nft_filter import NftablesFilter, SandboxFilterEntry
from dsec.network.policy import (
    DEFAULT_PRESETS,
    NEVER_REACHABLE,
    NetworkPolicy,
    NetworkPreset,
    ResolvedPolicy,
    normalize_cidr,
)
from dsec.network.resolver import ResolverLimits, SandboxResolver, parse_hostport
from dsec.privileged.hostsysctl import HeldSysctl
from dsec.privileged.netns import (
    RtNetlink,
    create_netns,
    delete_netns,
    in_netns,
    pin_netns,
    sync_link,
    write_sysctl,
)
from dsec.privileged.nft import Nftables, NftError

__all__ = ["NetworkManager", "SandboxNetwork"]

log = logging.getLogger(__name__)

_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SANDBOX_IFNAME = "eth0"


@dataclass(frozen=True)
class SandboxNetwork:
    """The network of one sandbox, as the container runtime needs it.

    Attributes:
        sandbox_id: the sandbox this belongs to.
        netns_path: the namespace to join (OCI ``{"type": "network", "path": ...}``).
        ip: the sandbox's IPv4 address (on ``eth0`` inside, a /32).
        gateway: the host address it routes through; also its DNS server.
        host_ifname: the host end of the veth pair.
        resolv_conf: text to write to ``/etc/resolv.conf`` inside the sandbox.
    """

    sandbox_id: str
    netns_path: Path
    ip: str
    gateway: str
    host_ifname: str
    resolv_conf: str


@dataclass
class _Sandbox:
    sandbox_id: str
    slot: int
    ip: str
    ifname: str
    mark: int
    policy: NetworkPolicy
    resolved: ResolvedPolicy
    netns_path: Path


def _random_mac() -> bytes:
    """A random locally administered unicast MAC address."""
    raw = bytearray(secrets.token_bytes(6))
    raw[0] = (raw[0] & 0xFC) | 0x02
    return bytes(raw)


def _check_id(sandbox_id: str) -> None:
    if not isinstance(sandbox_id, str) or not _SANDBOX_ID.match(sandbox_id):
        raise InvalidRequest(f"invalid sandbox id {sandbox_id!r}")


class NetworkManager:
    """Node-wide owner of sandbox networking. See the module docstring.

    Args:
        state_dir: where namespaces are pinned (``netns/``) and records kept (``records/``).
            Its path also names the kernel objects (``dsv<tag>...`` links, table
            ``dsec_<tag>``), so two managers with different dirs never collide.
        presets: operator presets (name -> NetworkPreset, ``{"domains", "cidrs"}`` or a
            flat list); they replace the built-in :data:`DEFAULT_PRESETS` of the same name.
        upstream_dns: servers (``"ip"`` or ``"ip:port"``) the resolver forwards allowed
            names to. None or empty: only static records are answered.
        static_records: name -> IPv4 addresses answered without asking upstream (internal
            mirrors). A name is still answered only if the sandbox's policy allows it.
        subnet: sandbox addresses (IPv4, /12 to /28). The first host address is the
            gateway/resolver; the default ``10.203.0.0/16`` is checked against the
            node's routes at start and refused if it overlaps one.
        protected_cidrs: extra networks no sandbox may reach whatever its policy (e.g. the
            cluster's control network, where other nodes' apiservers live).
        limits: resolver rates and TTL clamps.
        dns_packets_per_s: kernel cap of DNS packets per sandbox (above the resolver's).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        presets: Mapping[str, NetworkPreset | Mapping[str, Any] | Sequence[str]] | None = None,
        upstream_dns: list[str] | None = None,
        static_records: dict[str, list[str]] | None = None,
        subnet: str = "10.203.0.0/16",
        protected_cidrs: Sequence[str] = (),
        limits: ResolverLimits | None = None,
        dns_packets_per_s: int = 1000,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        tag = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:4]
        self.tag = tag
        self.iface_prefix = f"dsv{tag}"
        self.table = f"dsec_{tag}"
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as e:
            raise InvalidRequest(f"invalid sandbox subnet {subnet!r}: {e}") from None
        if not 12 <= net.prefixlen <= 28:
            raise InvalidRequest(f"sandbox subnet {subnet} must be between /12 and /28")
        for never in NEVER_REACHABLE:
            if net.overlaps(ipaddress.IPv4Network(never)):
                raise InvalidRequest(f"sandbox subnet {subnet} overlaps reserved range {never}")
        self.subnet = net
        self.gateway = str(net.network_address + 1)
        self.capacity = net.num_addresses - 3
        self.protected = [normalize_cidr(c) for c in protected_cidrs]
        self.never = [*NEVER_REACHABLE, str(net), *self.protected]
        table: dict[str, NetworkPreset] = dict(DEFAULT_PRESETS)
        for name, value in (presets or {}).items():
            table[name] = NetworkPreset.coerce(value)
        self.presets = table
        try:
            self.upstreams = [parse_hostport(u) for u in (upstream_dns or [])]
        except ValueError as e:
            raise InvalidRequest(f"invalid upstream DNS server: {e}") from None
        self.static_records = dict(static_records or {})
        self.limits = limits or ResolverLimits()
        self.dns_packets_per_s = dns_packets_per_s
        self.netns_dir = self.state_dir / "netns"
        self.records_dir = self.state_dir / "records"
        self._forwarding = HeldSysctl("net.ipv4.ip_forward", "1", str(self.state_dir))
        self._sandboxes: dict[str, _Sandbox] = {}
        self._slots: dict[int, str] = {}
        self._cursor = 0
        self._lock = asyncio.Lock()
        self._nft: Nftables | None = None
        self._filter: NftablesFilter | None = None
        self._resolver: SandboxResolver | None = None

    # ---- node-wide -----------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._resolver is not None

    def _check_subnet_free(self) -> None:
        """Refuse a subnet that overlaps a route of the node (not counting our links)."""
        with open("/proc/net/route") as f:
            next(f)
            for line in f:
                fields = line.split()
                dev, dest, mask = fields[0], int(fields[1], 16), int(fields[7], 16)
                if mask == 0 or dev.startswith(self.iface_prefix):
                    continue
                prefix = bin(mask).count("1")
                route = ipaddress.IPv4Network(
                    (ipaddress.IPv4Address(dest.to_bytes(4, "little")), prefix)
                )
                if route.overlaps(self.subnet):
                    raise Conflict(
                        f"sandbox subnet {self.subnet} overlaps route {route} on {dev}; "
                        "configure NetworkManager(subnet=...) with a free range",
                        route=str(route),
                        device=dev,
                    )

    def _records(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                log.warning("unreadable network record %s: removing", path)
                path.unlink(missing_ok=True)
        return out

    async def start(self) -> None:
        """Create the filter table, start the resolver, enable forwarding, load records."""
        if self.started:
            return
        for d in (self.state_dir, self.netns_dir, self.records_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self._check_subnet_free()
        self._nft = Nftables()
        self._filter = NftablesFilter(
            self._nft,
            table=self.table,
            iface_prefix=self.iface_prefix,
            subnet=str(self.subnet),
            gateway=self.gateway,
            never=self.never,
            dns_packets_per_s=self.dns_packets_per_s,
        )
        dead: list[str] = []
        for rec in self._records():
            try:
                sb = self._sandbox_from_record(rec)
            except Exception as e:  # a record from an incompatible config: drop its sandbox
                log.warning(
                    "network record %s unusable (%s): tearing it down", rec.get("sandbox_id"), e
                )
                dead.append(str(rec.get("sandbox_id")))
                continue
            if not sb.netns_path.exists():
                dead.append(sb.sandbox_id)
                continue
            self._sandboxes[sb.sandbox_id] = sb
            self._slots[sb.slot] = sb.sandbox_id
        try:
            self._filter.install(self._entry(sb) for sb in self._sandboxes.values())
        except NftError as e:
            raise ServiceUnavailable(f"cannot install the network filter: {e}") from None
        self._enable_forwarding()
        self._resolver = SandboxResolver(
            (self.gateway, 53),
            upstreams=self.upstreams,
            static_records=self.static_records,
            admit=self._filter_admit,
            never=self.never,
            limits=self.limits,
        )
        try:
            await self._resolver.start()
        except OSError as e:
            self._resolver = None
            raise ServiceUnavailable(
                f"cannot start the sandbox resolver on {self.gateway}:53: {e}"
            ) from None
        for sb in self._sandboxes.values():
            self._resolver.register(sb.sandbox_id, sb.ip, sb.resolved)
        for sandbox_id in dead:
            await self._teardown_record_only(sandbox_id)

    def _enable_forwarding(self) -> None:
        legacy = self.state_dir / "ip_forward.restore"  # an older node's own note
        found = legacy.read_text().strip() if legacy.exists() else None
        self._forwarding.hold(found_before=found or None)
        legacy.unlink(missing_ok=True)

    async def close(self) -> None:
        """Stop the resolver. With no sandbox left, also remove the table and restore
        ``ip_forward``; otherwise running sandboxes stay filtered (fail closed)."""
        if self._resolver is not None:
            await self._resolver.close()
            self._resolver = None
        if self._filter is not None and not self._sandboxes:
            with contextlib.suppress(NftError):
                self._filter.remove()
            self._forwarding.release()
        if self._nft is not None:
            self._nft.close()
        self._nft = None
        self._filter = None

    def _require(self) -> tuple[NftablesFilter, SandboxResolver]:
        if self._filter is None or self._resolver is None:
            raise ServiceUnavailable("the network manager is not started")
        return self._filter, self._resolver

    def _filter_admit(
        self, ip: str, destinations: list[str], timeout_s: int, refresh: bool
    ) -> None:
        if self._filter is not None:
            self._filter.admit(ip, destinations, timeout_s, refresh=refresh)

    # ---- records ---------------------------------------------------------------

    def _record_path(self, sandbox_id: str) -> Path:
        return self.records_dir / f"{sandbox_id}.json"

    def _write_record(self, sb: _Sandbox) -> None:
        data = {
            "sandbox_id": sb.sandbox_id,
            "slot": sb.slot,
            "ip": sb.ip,
            "ifname": sb.ifname,
            "mark": sb.mark,
            "policy": sb.policy.model_dump(),
            "netns_path": str(sb.netns_path),
        }
        path = self._record_path(sb.sandbox_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def _sandbox_from_record(self, rec: dict[str, Any]) -> _Sandbox:
        policy = NetworkPolicy.parse(rec["policy"])
        slot = int(rec["slot"])
        if self._ip(slot) != rec["ip"] or self._ifname(slot) != rec["ifname"]:
            raise ValueError("record does not match this manager's subnet")
        return _Sandbox(
            sandbox_id=str(rec["sandbox_id"]),
            slot=slot,
            ip=str(rec["ip"]),
            ifname=str(rec["ifname"]),
            mark=int(rec["mark"]),
            policy=policy,
            resolved=self._resolve(policy),
            netns_path=Path(rec["netns_path"]),
        )

    def _ip(self, slot: int) -> str:
        return str(self.subnet.network_address + 2 + slot)

    def _ifname(self, slot: int) -> str:
        return f"{self.iface_prefix}{slot:06x}"

    def _entry(self, sb: _Sandbox) -> SandboxFilterEntry:
        return SandboxFilterEntry(ifname=sb.ifname, ip=sb.ip, mark=sb.mark, policy=sb.resolved)

    def _resolve(self, policy: NetworkPolicy) -> ResolvedPolicy:
        return policy.resolve(self.presets, never=[str(self.subnet), *self.protected])

    def _allocate_slot(self) -> int:
        if len(self._slots) >= self.capacity:
            raise ServiceUnavailable(
                f"sandbox subnet {self.subnet} is full ({self.capacity} sandboxes)"
            )
        # round robin: an address is reused as late as possible
        for i in range(self.capacity):
            slot = (self._cursor + i) % self.capacity
            if slot not in self._slots:
                self._cursor = slot + 1
                return slot
        raise ServiceUnavailable("no free sandbox address")  # pragma: no cover

    # ---- per sandbox -------------------------------------------------------------

    async def setup(
        self, sandbox_id: str, policy: NetworkPolicy, *, netns: str | None = None
    ) -> SandboxNetwork:
        """Create the sandbox's namespace, veth, routes and filter state; return its network.

        ``netns``: an existing, still empty network namespace to wire instead of a new one
        (``/proc/<pid>/ns/net`` of a warm container's init: only ``lo`` in it); it is
        pinned at the network's ``netns_path`` like a new one, and unpinned by teardown.

        Raises InvalidRequest (bad id, unknown preset), Conflict (already set up),
        ServiceUnavailable (not started, subnet full), SandboxError (the kernel refused).
        """
        _check_id(sandbox_id)
        policy = NetworkPolicy.parse(policy)
        flt, resolver = self._require()
        resolved = self._resolve(policy)
        async with self._lock:
            if sandbox_id in self._sandboxes or self._record_path(sandbox_id).exists():
                raise Conflict(f"sandbox {sandbox_id} already has a network", sandbox_id=sandbox_id)
            slot = self._allocate_slot()
            sb = _Sandbox(
                sandbox_id=sandbox_id,
                slot=slot,
                ip=self._ip(slot),
                ifname=self._ifname(slot),
                mark=secrets.randbits(31) + 1,
                policy=policy,
                resolved=resolved,
                netns_path=self.netns_dir / sandbox_id,
            )
            self._slots[slot] = sandbox_id
            self._sandboxes[sandbox_id] = sb
            try:
                self._write_record(sb)
                self._wire(sb, netns)
                flt.add_sandbox(self._entry(sb))
            except Exception as e:
                await self._teardown_locked(sandbox_id)
                if isinstance(e, FileExistsError):
                    raise Conflict(
                        f"a namespace for {sandbox_id} already exists at {sb.netns_path}"
                    ) from None
                raise SandboxError(f"network setup for {sandbox_id} failed: {e}") from e
            resolver.register(sandbox_id, sb.ip, resolved)
        return self._network(sb)

    def _network(self, sb: _Sandbox) -> SandboxNetwork:
        return SandboxNetwork(
            sandbox_id=sb.sandbox_id,
            netns_path=sb.netns_path,
            ip=sb.ip,
            gateway=self.gateway,
            host_ifname=sb.ifname,
            resolv_conf=f"nameserver {self.gateway}\noptions timeout:2 attempts:2\n",
        )

    def _wire(self, sb: _Sandbox, netns: str | None = None) -> None:
        """Kernel side of setup: netns (new, or ``netns`` pinned), veth pair, addresses,
        routes, sysctls."""
        if netns is None:
            create_netns(sb.netns_path)
        else:
            pin_netns(sb.netns_path, netns)
        host_mac, sandbox_mac = _random_mac(), _random_mac()
        with RtNetlink() as host:
            index = host.add_veth(
                sb.ifname,
                SANDBOX_IFNAME,
                sb.netns_path,
                alias=f"dsec {sb.sandbox_id}",
                address=host_mac,
                peer_address=sandbox_mac,
            )
            write_sysctl(f"net.ipv6.conf.{sb.ifname}.disable_ipv6", "1")
            host.add_address(index, self.gateway, 32)
            host.set_up(index)
            host.add_route(f"{sb.ip}/32", oif=index)
            host.add_neighbor(index, sb.ip, sandbox_mac)
        gateway, ip = self.gateway, sb.ip

        def inside() -> None:
            for key in ("all", "default"):
                with open(f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6", "w") as f:
                    f.write("1")
            # ICMP echo through unprivileged "ping" sockets (iputils ping uses them): raw
            # sockets need CAP_NET_RAW, which sandboxes never have, so without this a policy
            # allowing "icmp" could not be used. Per network namespace; the filter decides
            # where ICMP may go, as for tcp and udp.
            with open("/proc/sys/net/ipv4/ping_group_range", "w") as f:
                f.write("0 2147483647")
            with RtNetlink() as nl:
                nl.set_up(1)  # lo
                eth = nl.link_index(SANDBOX_IFNAME)
                nl.add_address(eth, ip, 32)
                nl.set_up(eth)
                nl.add_route("0.0.0.0/0", oif=eth, gateway=gateway, onlink=True)
                nl.add_neighbor(eth, gateway, host_mac)
            sync_link(SANDBOX_IFNAME)

        in_netns(sb.netns_path, inside)
        # the host end was opened first (peer down): its qdisc activation is pending
        sync_link(sb.ifname)

    def _get(self, sandbox_id: str) -> _Sandbox:
        _check_id(sandbox_id)
        sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} has no network", sandbox_id=sandbox_id)
        return sb

    async def update(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace a running sandbox's policy. New connections see it at once; established
        ones continue. Admissions the new policy no longer justifies are revoked."""
        policy = NetworkPolicy.parse(policy)
        flt, resolver = self._require()
        async with self._lock:
            sb = self._get(sandbox_id)
            resolved = self._resolve(policy)
            state = resolver.sandboxes.get(sb.ip)
            revoke = []
            if state is not None:
                revoke = [
                    d
                    for d, names in state.admitted.items()
                    if resolved.address_denied(d) or not any(resolved.allows_name(n) for n in names)
                ]
            # admissions carried over a restart have no names: revoke those not justified
            known = set(state.admitted) if state is not None else set()
            revoke += [
                d for d in flt.dynamic_destinations(sb.ip) if d not in known and d not in revoke
            ]
            try:
                flt.replace_policy(sb.ip, sb.resolved, resolved, revoke)
            except NftError as e:
                raise SandboxError(f"network policy update for {sandbox_id} failed: {e}") from None
            resolver.set_policy(sb.ip, resolved)
            sb.policy, sb.resolved = policy, resolved
            self._write_record(sb)

    async def stats(self, sandbox_id: str) -> dict[str, Any]:
        """Allowed connections and blocked packets by destination, plus DNS counters.

        ``allowed`` counts new connections (first packets) per destination, with the names
        whose answers admitted it; ``blocked`` counts every dropped packet per destination
        (a retried SYN counts again). Counters of a destination age out after an hour idle.
        """
        flt, resolver = self._require()
        sb = self._get(sandbox_id)
        allowed, blocked = await asyncio.to_thread(flt.counts, sb.ip)
        state = resolver.sandboxes.get(sb.ip)
        names = state.names_by_destination() if state is not None else {}
        now = time.monotonic()
        admitted = {
            d: {"names": sorted(n), "expires_in_s": max(0, int(max(n.values()) - now))}
            for d, n in (state.admitted.items() if state is not None else [])
        }
        return {
            "sandbox_id": sandbox_id,
            "ip": sb.ip,
            "gateway": self.gateway,
            "policy": sb.policy.model_dump(),
            "allowed": [
                {
                    "destination": r.destination,
                    "protocol": r.protocol,
                    "port": r.port,
                    "connections": r.packets,
                    "names": names.get(r.destination, []),
                }
                for r in allowed
            ],
            "blocked": [
                {
                    "destination": r.destination,
                    "protocol": r.protocol,
                    "port": r.port,
                    "packets": r.packets,
                }
                for r in blocked
            ],
            "allowed_total": sum(r.packets for r in allowed),
            "blocked_total": sum(r.packets for r in blocked),
            "admitted": admitted,
            "dns": resolver.stats(sb.ip),
        }

    async def teardown(self, sandbox_id: str) -> None:
        """Remove the sandbox's namespace, veth, routes, filter elements and record.

        Idempotent: tearing down an unknown or already removed sandbox does nothing.
        """
        _check_id(sandbox_id)
        async with self._lock:
            await self._teardown_locked(sandbox_id)

    async def _teardown_locked(self, sandbox_id: str) -> None:
        sb = self._sandboxes.pop(sandbox_id, None)
        if sb is None:
            await self._teardown_record_only(sandbox_id)
            return
        if self._resolver is not None:
            self._resolver.unregister(sb.ip)
        flt = self._filter

        def kernel() -> None:
            with RtNetlink() as host:
                host.delete_link(sb.ifname)
            delete_netns(sb.netns_path)
            if flt is not None:
                flt.remove_sandbox(sb.ip, sb.ifname)

        try:
            await asyncio.to_thread(kernel)
        finally:
            self._slots.pop(sb.slot, None)
            self._record_path(sandbox_id).unlink(missing_ok=True)

    async def _teardown_record_only(self, sandbox_id: str) -> None:
        """Clean up after a sandbox known only from disk (record and/or pinned netns)."""
        path = self._record_path(sandbox_id)
        rec: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            rec = json.loads(path.read_text())
        flt = self._filter
        ifname = rec.get("ifname")
        ip = rec.get("ip")

        def kernel() -> None:
            if isinstance(ifname, str) and ifname.startswith(self.iface_prefix):
                with RtNetlink() as host:
                    host.delete_link(ifname)
            delete_netns(self.netns_dir / sandbox_id)
            if flt is not None and isinstance(ip, str):
                flt.remove_sandbox(ip, ifname if isinstance(ifname, str) else None)

        await asyncio.to_thread(kernel)
        path.unlink(missing_ok=True)

    async def reconcile(self, live_ids: set[str]) -> None:
        """After a restart: tear down what belongs to sandboxes not in live_ids (records,
        pinned namespaces, host veths, filter elements); keep the live ones untouched."""
        flt, _ = self._require()
        async with self._lock:
            for sandbox_id in [s for s in self._sandboxes if s not in live_ids]:
                await self._teardown_locked(sandbox_id)
            for rec_path in self.records_dir.glob("*.json"):
                if rec_path.stem not in self._sandboxes:
                    await self._teardown_record_only(rec_path.stem)
            for ns in self.netns_dir.iterdir():
                if ns.name not in self._sandboxes:
                    await asyncio.to_thread(delete_netns, ns)
            keep_links = {sb.ifname for sb in self._sandboxes.values()}
            keep_ips = {sb.ip for sb in self._sandboxes.values()}

            def kernel() -> None:
                with RtNetlink() as host:
                    for name in host.link_names():
                        if name.startswith(self.iface_prefix) and name not in keep_links:
                            host.delete_link(name)
                flt.purge(keep_ips=keep_ips)

            await asyncio.to_thread(kernel)

    def sandbox_ids(self) -> set[str]:
        """Sandboxes that currently have a network."""
        return set(self._sandboxes)

    def network(self, sandbox_id: str) -> SandboxNetwork:
        """The network of a set-up sandbox (SandboxNotFound otherwise)."""
        return self._network(self._get(sandbox_id))

    def ifnames(self) -> Iterable[str]:
        return (sb.ifname for sb in self._sandboxes.values())
