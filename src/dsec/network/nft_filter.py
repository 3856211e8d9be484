"""The packet filter: one nftables table per node, per-sandbox state only in set elements.

Why one static ruleset with shared sets keyed by the sandbox address (instead of a
chain and sets per sandbox): libnftables loads the table's set list before every
command, so with a few hundred per-sandbox sets each DNS admission cost ~1 ms instead
of ~0.1 ms, and per-packet cost would grow with chains. Here the rules never change;
adding a sandbox, changing its policy, admitting a DNS answer and removing it are all
element updates in one atomic transaction each. See docs/design/network.md.

The table (``inet dsec_<tag>``)::

    forward hook (prio -10):   from a sandbox veth -> chain from_sandbox
                               to a sandbox veth: only established/related, else drop
    input hook (prio -10):     from a sandbox veth -> chain to_host:
                               only UDP to <gateway>:53 (rate-limited per source), else drop
    output hook (prio -10):    from the node itself to a sandbox veth: only
                               established/related (the resolver's answers), else drop:
                               no process of the node opens a connection to a sandbox's
                               address (the port proxy connects from inside the sandbox's
                               own namespace instead, see dsec.edge.ports)
    postrouting (srcnat):      sandbox subnet leaving by a non-sandbox link -> masquerade

    from_sandbox:  IPv6 -> drop; (iifname, saddr) not registered -> drop (anti-spoofing)
                   established/related of this sandbox's incarnation -> accept
                   daddr in @never -> blocked; (saddr, daddr) in @deny -> blocked
                   (saddr, proto, dport) in @ports and (saddr, daddr) in @cidr -> allowed
                   (saddr, proto, dport) in @ports and (saddr, daddr) in @dyn  -> allowed
                   else blocked
    allowed:       count new connections in @alw (per destination), mark the
                   connection with the sandbox incarnation, accept
    blocked:       count in @blk (per destination), drop

``@dyn`` holds DNS admissions with timeouts (the resolver adds them before answering).
The connection mark ties established flows to one incarnation of a sandbox, so a new
sandbox that reuses an address cannot ride a dead one's conntrack entries.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dsec.network.policy import ResolvedPolicy
from dsec.privileged.nft import Nftables, NftError

__all__ = ["DestinationCount", "NftablesFilter", "SandboxFilterEntry"]

_PROTO_NUM = {"tcp": 6, "udp": 17, "icmp": 1}
_PROTO_NAME = {6: "tcp", 17: "udp", 1: "icmp", 58: "ipv6-icmp", 132: "sctp"}
COUNTER_SET_SIZE = 65536
"""Bound on per-destination counter elements (all sandboxes together); older ones age out."""
DYN_SET_SIZE = 262144
"""Bound on DNS admissions (all sandboxes together)."""


@dataclass(frozen=True)
class SandboxFilterEntry:
    """What the filter needs to know about one sandbox."""

    ifname: str
    ip: str
    mark: int
    policy: ResolvedPolicy


@dataclass(frozen=True)
class DestinationCount:
    """Packets counted for one destination (address, protocol, port; port None for icmp)."""

    destination: str
    protocol: str
    port: int | None
    packets: int


def _merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _collapse(cidrs: Iterable[str]) -> list[str]:
    nets = [ipaddress.IPv4Network(c) for c in cidrs]
    return [str(n) for n in ipaddress.collapse_addresses(nets)]


def _json_value(v: Any) -> str:
    """Render one field of a JSON set element back into nft syntax."""
    if isinstance(v, dict):
        if "prefix" in v:
            return f"{v['prefix']['addr']}/{v['prefix']['len']}"
        if "range" in v:
            lo, hi = v["range"]
            return f"{_json_value(lo)}-{_json_value(hi)}"
        raise ValueError(f"unexpected nft element value {v!r}")
    return str(v)


def _render_key(set_name: str, key: Sequence[Any]) -> str:
    """A listed element key back in nft syntax (interface names quoted)."""
    parts = []
    for i, v in enumerate(key):
        if i == 0 and set_name in ("src", "live", "gen"):
            parts.append(json.dumps(str(v)))
        else:
            parts.append(_json_value(v))
    return " . ".join(parts)


class NftablesFilter:
    """Owns the node's nftables table for sandbox networking.

    Args:
        nft: an open libnftables context.
        table: table name (``dsec_<tag>``); family ``inet``.
        iface_prefix: prefix of every host-side sandbox veth (``dsv<tag>``).
        subnet: the sandbox subnet (never reachable from a sandbox; masqueraded outward).
        gateway: the host address on every sandbox veth, where the resolver listens.
        never: CIDRs no sandbox may reach (NEVER_REACHABLE + subnet + operator additions).
        dns_packets_per_s: kernel-side cap of DNS packets per sandbox (the resolver's own
            per-sandbox token bucket sits below it).
    """

    def __init__(
        self,
        nft: Nftables,
        *,
        table: str,
        iface_prefix: str,
        subnet: str,
        gateway: str,
        never: Sequence[str],
        dns_packets_per_s: int = 1000,
    ) -> None:
        self.nft = nft
        self.table = table
        self.iface_prefix = iface_prefix
        self.subnet = subnet
        self.gateway = gateway
        self.never = _collapse(never)
        self.dns_packets_per_s = dns_packets_per_s

    # ---- whole table -------------------------------------------------------------

    def exists(self) -> bool:
        try:
            self.nft.run(f"list table inet {self.table}")
        except NftError:
            return False
        return True

    def _ruleset(self) -> str:
        t = f"inet {self.table}"
        pfx = f'"{self.iface_prefix}*"'
        never = ", ".join(self.never)
        burst = self.dns_packets_per_s * 2
        return f"""
add table {t}
delete table {t}
table {t} {{
  set never {{ type ipv4_addr; flags interval; elements = {{ {never} }} }}
  set src {{ type ifname . ipv4_addr; }}
  set live {{ type ifname . mark; }}
  map gen {{ type ifname : mark; }}
  set ports {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}
  set cidr {{ type ipv4_addr . ipv4_addr; flags interval; }}
  set deny {{ type ipv4_addr . ipv4_addr; flags interval; }}
  set dyn {{ type ipv4_addr . ipv4_addr; flags timeout; size {DYN_SET_SIZE}; }}
  set alw {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; size {COUNTER_SET_SIZE};
            flags dynamic,timeout; timeout 1h; counter; }}
  set blk {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; size {COUNTER_SET_SIZE};
            flags dynamic,timeout; timeout 1h; counter; }}
  set dnsrate {{ type ipv4_addr; size 65535; flags dynamic,timeout; timeout 10s; }}

  chain blocked {{
    meta l4proto {{ tcp, udp }} update @blk {{ ip saddr . ip daddr . meta l4proto . th dport }}
    meta l4proto != {{ tcp, udp }} update @blk {{ ip saddr . ip daddr . meta l4proto . 0 }}
    counter drop
  }}
  chain allowed {{
    ct state new meta l4proto {{ tcp, udp }} update @alw {{ ip saddr . ip daddr . meta l4proto . th dport }}
    ct state new meta l4proto != {{ tcp, udp }} update @alw {{ ip saddr . ip daddr . meta l4proto . 0 }}
    ct mark set iifname map @gen
    accept
  }}
  chain from_sandbox {{
    meta nfproto ipv6 counter drop
    iifname . ip saddr != @src counter drop
    ct state established,related iifname . ct mark @live accept
    ip daddr @never goto blocked
    ip saddr . ip daddr @deny goto blocked
    ip saddr . meta l4proto . th dport @ports ip saddr . ip daddr @cidr goto allowed
    ip saddr . meta l4proto . th dport @ports ip saddr . ip daddr @dyn goto allowed
    goto blocked
  }}
  chain to_host {{
    meta nfproto ipv6 counter drop
    iifname . ip saddr != @src counter drop
    ip daddr {self.gateway} udp dport 53 update @dnsrate {{ ip saddr limit rate over {self.dns_packets_per_s}/second burst {burst} packets }} counter drop
    ip daddr {self.gateway} udp dport 53 accept
    ct state established,related accept
    goto blocked
  }}
  chain sb_forward {{
    type filter hook forward priority -10; policy accept;
    iifname {pfx} jump from_sandbox
    oifname {pfx} ct state established,related accept
    oifname {pfx} counter drop
  }}
  chain sb_input {{
    type filter hook input priority -10; policy accept;
    iifname {pfx} jump to_host
  }}
  chain sb_output {{
    type filter hook output priority -10; policy accept;
    oifname {pfx} ct state established,related accept
    oifname {pfx} counter drop
  }}
  chain sb_postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {self.subnet} oifname != {pfx} masquerade
  }}
}}
"""

    def install(self, entries: Iterable[SandboxFilterEntry], *, keep_dynamic: bool = True) -> None:
        """(Re)create the table with every given sandbox in one atomic transaction.

        When the table already exists (edge restart) its live DNS admissions are carried
        over for the sandboxes kept, so running downloads keep resolving-free access until
        their TTL. There is no moment where a sandbox veth is unfiltered.
        """
        entries = list(entries)
        kept_ips = {e.ip for e in entries}
        carried: list[str] = []
        if keep_dynamic and self.exists():
            for key, extra in self._elements("dyn"):
                if key[0] in kept_ips and extra.get("expires", 0) > 1:
                    carried.append(f"{key[0]} . {key[1]} timeout {int(extra['expires'])}s")
        script = [self._ruleset()]
        for e in entries:
            script.extend(self._sandbox_adds(e))
        if carried:
            script.append(f"add element inet {self.table} dyn {{ {', '.join(carried)} }}")
        self.nft.run("\n".join(script))

    def remove(self) -> None:
        """Delete the whole table. Idempotent."""
        self.nft.run(f"add table inet {self.table}\ndelete table inet {self.table}")

    # ---- per sandbox -----------------------------------------------------------

    def _policy_elements(self, ip: str, policy: ResolvedPolicy) -> dict[str, list[str]]:
        ports: list[str] = []
        ranges = (
            _merge_ranges(policy.port_ranges) if policy.port_ranges is not None else [(0, 65535)]
        )
        for proto in policy.protocols:
            if proto == "icmp":
                ports.append(f"{ip} . icmp . 0-65535")
                continue
            for lo, hi in ranges:
                ports.append(
                    f"{ip} . {proto} . {lo}-{hi}" if lo != hi else f"{ip} . {proto} . {lo}"
                )
        return {
            "ports": ports,
            "cidr": [f"{ip} . {c}" for c in _collapse(policy.cidrs)],
            "deny": [f"{ip} . {c}" for c in _collapse(policy.deny_cidrs)],
        }

    def _sandbox_adds(self, e: SandboxFilterEntry) -> list[str]:
        t = f"inet {self.table}"
        lines = [
            f'add element {t} src {{ "{e.ifname}" . {e.ip} }}',
            f'add element {t} live {{ "{e.ifname}" . {e.mark} }}',
            f'add element {t} gen {{ "{e.ifname}" : {e.mark} }}',
        ]
        for set_name, elems in self._policy_elements(e.ip, e.policy).items():
            if elems:
                lines.append(f"add element {t} {set_name} {{ {', '.join(elems)} }}")
        return lines

    def add_sandbox(self, entry: SandboxFilterEntry) -> None:
        """Register a sandbox (anti-spoofing pair, incarnation mark, policy) atomically."""
        self.nft.run("\n".join(self._sandbox_adds(entry)))

    def replace_policy(
        self,
        ip: str,
        old: ResolvedPolicy,
        new: ResolvedPolicy,
        revoke: Iterable[str] = (),
    ) -> None:
        """Swap a sandbox's policy elements and revoke DNS admissions, in one transaction.

        ``revoke`` are admitted destinations no longer justified by the new policy.
        Connections already established continue; new ones see the new policy at once.
        """
        t = f"inet {self.table}"
        lines: list[str] = []
        old_e = self._policy_elements(ip, old)
        new_e = self._policy_elements(ip, new)
        for set_name in ("ports", "cidr", "deny"):
            if old_e[set_name]:
                lines.append(f"delete element {t} {set_name} {{ {', '.join(old_e[set_name])} }}")
            if new_e[set_name]:
                lines.append(f"add element {t} {set_name} {{ {', '.join(new_e[set_name])} }}")
        revoke = list(revoke)
        if revoke:
            # add-then-delete: deleting an element the kernel already expired would fail
            elems = ", ".join(f"{ip} . {d}" for d in revoke)
            lines.append(f"add element {t} dyn {{ {elems} }}")
            lines.append(f"delete element {t} dyn {{ {elems} }}")
        if lines:
            self.nft.run("\n".join(lines))

    def admit(self, ip: str, destinations: Sequence[str], timeout_s: int, *, refresh: bool) -> None:
        """Allow ip -> each destination for timeout_s seconds (the DNS admission).

        ``refresh`` replaces elements that may exist with a shorter timeout (adding an
        existing element does not extend it).
        """
        if not destinations:
            return
        t = f"inet {self.table}"
        with_timeout = ", ".join(f"{ip} . {d} timeout {int(timeout_s)}s" for d in destinations)
        if refresh:
            plain = ", ".join(f"{ip} . {d}" for d in destinations)
            self.nft.run(
                f"add element {t} dyn {{ {plain} }}\n"
                f"delete element {t} dyn {{ {plain} }}\n"
                f"add element {t} dyn {{ {with_timeout} }}"
            )
        else:
            self.nft.run(f"add element {t} dyn {{ {with_timeout} }}")

    def remove_sandbox(self, ip: str, ifname: str | None) -> None:
        """Remove every element that mentions this sandbox (by address and by veth name)."""
        self.purge(keep_ips=None, only_ip=ip, only_ifname=ifname)

    def purge(
        self,
        *,
        keep_ips: set[str] | None,
        only_ip: str | None = None,
        only_ifname: str | None = None,
    ) -> int:
        """Delete elements of sandboxes: either those of one (only_ip/only_ifname) or all
        whose address is not in keep_ips. Returns how many elements were deleted."""

        def doomed_ip(addr: str) -> bool:
            if only_ip is not None:
                return addr == only_ip
            return keep_ips is not None and addr not in keep_ips

        doomed_ifnames: set[str] = set()
        for key, _ in self._elements("src"):
            if doomed_ip(key[1]) or (only_ifname is not None and key[0] == only_ifname):
                doomed_ifnames.add(key[0])
        if only_ifname is not None:
            doomed_ifnames.add(only_ifname)
        deleted = 0
        for set_name in (
            "src",
            "live",
            "gen",
            "ports",
            "cidr",
            "deny",
            "dyn",
            "alw",
            "blk",
            "dnsrate",
        ):
            elems: list[str] = []
            for key, _ in self._elements(set_name):
                if set_name in ("live", "gen", "src"):
                    hit = key[0] in doomed_ifnames or (set_name == "src" and doomed_ip(key[1]))
                else:
                    hit = doomed_ip(key[0])
                if hit:
                    elems.append(_render_key(set_name, key[:1] if set_name == "gen" else key))
            deleted += self._delete_elements(set_name, elems)
        return deleted

    def _delete_elements(self, set_name: str, elems: list[str]) -> int:
        if not elems:
            return 0
        t = f"inet {self.table}"
        try:
            self.nft.run(f"delete element {t} {set_name} {{ {', '.join(elems)} }}")
            return len(elems)
        except NftError:
            # an element expired between listing and deleting: fall back to one by one
            n = 0
            for el in elems:
                try:
                    self.nft.run(f"delete element {t} {set_name} {{ {el} }}")
                    n += 1
                except NftError:
                    pass
            return n

    # ---- reading ---------------------------------------------------------------

    def _elements(self, set_name: str) -> list[tuple[list[Any], dict[str, Any]]]:
        """Elements of a set or map as (key fields, extras such as counter/expires)."""
        kind = "map" if set_name == "gen" else "set"
        try:
            items = self.nft.json(f"list {kind} inet {self.table} {set_name}")
        except NftError:
            return []
        out: list[tuple[list[Any], dict[str, Any]]] = []
        for item in items:
            body = item.get(kind)
            if not body:
                continue
            for raw in body.get("elem", []):
                extra: dict[str, Any] = {}
                value = raw
                if set_name == "gen" and isinstance(raw, list):
                    value = raw[0]
                if isinstance(value, dict) and "elem" in value:
                    extra = {k: v for k, v in value["elem"].items() if k != "val"}
                    value = value["elem"]["val"]
                key = value["concat"] if isinstance(value, dict) and "concat" in value else [value]
                out.append((key, extra))
        return out

    def counts(self, ip: str) -> tuple[list[DestinationCount], list[DestinationCount]]:
        """(allowed new connections, blocked packets) of one sandbox, by destination."""
        result: list[list[DestinationCount]] = []
        for set_name in ("alw", "blk"):
            rows: list[DestinationCount] = []
            for key, extra in self._elements(set_name):
                if key[0] != ip:
                    continue
                proto = key[2]
                proto_name = (
                    proto if isinstance(proto, str) else _PROTO_NAME.get(int(proto), str(proto))
                )
                port = int(key[3]) if proto_name in ("tcp", "udp") else None
                packets = int((extra.get("counter") or {}).get("packets", 0))
                rows.append(DestinationCount(str(key[1]), proto_name, port, packets))
            rows.sort(key=lambda r: (-r.packets, r.destination, r.port or 0))
            result.append(rows)
        return result[0], result[1]

    def dynamic_destinations(self, ip: str) -> dict[str, int]:
        """DNS admissions of one sandbox: destination -> seconds until it expires."""
        return {
            str(key[1]): int(extra.get("expires", 0))
            for key, extra in self._elements("dyn")
            if key[0] == ip
        }

    def sandbox_ips(self) -> set[str]:
        """Addresses registered in the anti-spoofing set (one per sandbox)."""
        return {str(key[1]) for key, _ in self._elements("src")}

    def ifnames(self) -> set[str]:
        return {str(key[0]) for key, _ in self._elements("src")}
