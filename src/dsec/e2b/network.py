"""E2B's egress settings mapped onto a dsec :class:`~dsec.network.NetworkPolicy`.

E2B filters by address: by default a sandbox reaches the whole internet, ``deny_out``
(CIDRs/IPs) removes destinations, ``allow_out`` (CIDRs, IPs, domains, ``*.`` wildcards)
puts them back (an allow *wins* over a deny), and ``allow_internet_access=False`` is the
same as ``deny_out=["0.0.0.0/0"]``. dsec is default deny with a DNS allowlist and
deny rules that win. The mapping:

=============================================  ===========================================
E2B                                            dsec
=============================================  ===========================================
nothing (no ``network``, no                    ``network=None``: no network at all (dsec's
``allow_internet_access``) or                  safe default; E2B's default is open)
``allow_internet_access=False`` alone
closed (``allow_internet_access=False`` or     ``allow_domains`` = the domains of
``"0.0.0.0/0"`` in ``deny_out``)               ``allow_out``, ``allow_cidrs`` = its
                                               addresses (the denies are moot: allow wins)
closed with an empty ``allow_out``             a network that reaches nothing
                                               (:data:`BLOCK_ALL`), changeable later
open (``allow_internet_access=True`` or any    ``allow_cidrs=["0.0.0.0/0"]`` (every public
other ``network``)                             IPv4 address) minus the ``deny_out``
                                               networks not covered by an ``allow_out``
                                               address; ``allow_out`` domains resolve
``dns_servers``                                added to ``allow_cidrs`` (E2B: "all traffic
                                               to it is allowed")
=============================================  ===========================================

Every mapped policy covers ``tcp``, ``udp`` and ``icmp`` on every port (E2B has no port
or protocol rules). Names resolve only through the node's resolver and only when
allowed, so an open sandbox reaches any public address but resolves only the domains of
its ``allow_out``. Never reachable whatever E2B asks: the node, other sandboxes,
link-local/metadata and the operator's protected networks.

Refused (``E2BError`` 422): ``egress_proxy``, ``rules`` (request transforms),
``mask_request_host`` and ``https_ports`` (dsec has no egress proxy). Malformed lists:
400. ``allow_public_traffic=True`` is not egress: the control plane makes the sandbox's
ports public (``public_ports``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from dsec.e2b.errors import E2BError
from dsec.network.policy import MAX_CIDRS, NetworkPolicy, normalize_cidr

__all__ = ["ALL_TRAFFIC", "BLOCK_ALL", "E2BEgress", "e2b_view", "policy_from_e2b"]

ALL_TRAFFIC = "0.0.0.0/0"
"""E2B's "all traffic" sentinel (``e2b.ALL_TRAFFIC``)."""

PROTOCOLS = ["tcp", "udp", "icmp"]

BLOCK_ALL = NetworkPolicy(allow_cidrs=[ALL_TRAFFIC], deny_cidrs=[ALL_TRAFFIC], protocols=PROTOCOLS)
"""A policy that reaches nothing (the deny wins) but keeps the sandbox networked, so a
later update can open it: what E2B's "closed, nothing allowed" becomes."""


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise E2BError(400, f"{what} must be a list of strings")
    return [v.strip() for v in value]


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The network an address-like entry names (host bits allowed), None for a name."""
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def _subtract(
    denied: Iterable[ipaddress.IPv4Network], allowed: list[ipaddress.IPv4Network]
) -> list[ipaddress.IPv4Network]:
    """``denied`` minus every ``allowed`` network (E2B: an allow wins over a deny)."""
    out = list(denied)
    for a in allowed:
        nxt: list[ipaddress.IPv4Network] = []
        for d in out:
            if not d.overlaps(a):
                nxt.append(d)
            elif a.subnet_of(d):
                nxt.extend(d.address_exclude(a))
            # else d lies inside a: nothing of it stays denied
        out = nxt
    return sorted(out)


class E2BEgress:
    """The egress fields of an E2B ``network`` object (create or update), checked.

    Args:
        allow_out, deny_out, dns_servers: the lists as sent (None: absent).
        unsupported: names of E2B features set in the request that dsec refuses.
    """

    def __init__(
        self,
        allow_out: Any = None,
        deny_out: Any = None,
        dns_servers: Any = None,
        unsupported: Iterable[str] = (),
    ) -> None:
        refused = list(unsupported)
        if refused:
            raise E2BError(422, "not supported by dsec: network " + ", ".join(refused))
        self.given = any(v is not None for v in (allow_out, deny_out, dns_servers))
        """Whether any egress field was sent (a ``network`` of ``allow_public_traffic``
        alone says nothing of egress)."""
        self.allow_out = _strings(allow_out, "network.allow_out")
        self.deny_out = _strings(deny_out, "network.deny_out")
        self.dns_servers = _strings(dns_servers, "network.dns_servers")
        for what, entries in (
            ("allow_out", self.allow_out),
            ("deny_out", self.deny_out),
            ("dns_servers", self.dns_servers),
        ):
            for entry in entries:
                net = _network(entry)
                if net is not None and net.version != 4:
                    raise E2BError(
                        400, f"network.{what}: IPv6 is not supported (sandboxes are IPv4-only)"
                    )
                if net is not None:
                    normalize_cidr(entry)  # host bits set: 400 naming the fix
        for entry in self.deny_out:
            if _network(entry) is None:
                raise E2BError(
                    400, f"network.deny_out takes CIDRs or IP addresses, not names: {entry!r}"
                )
        for entry in self.dns_servers:
            net = _network(entry)
            if net is None or net.num_addresses != 1:
                raise E2BError(400, f"network.dns_servers takes IP addresses: {entry!r}")

    @classmethod
    def from_wire(cls, obj: Any) -> E2BEgress:
        """From the generated ``SandboxNetworkConfig`` / ``SandboxNetworkUpdateConfig``."""
        from e2b.api.client.types import Unset

        def get(name: str) -> Any:
            value = getattr(obj, name, None)
            return None if isinstance(value, Unset) else value

        unsupported = []
        if get("egress_proxy") is not None:
            unsupported.append("egress_proxy (dsec has no egress proxy)")
        rules = get("rules")
        if rules is not None and rules.to_dict():
            unsupported.append("rules (request transforms)")
        if get("mask_request_host") is not None:
            unsupported.append("mask_request_host (the port proxy keeps the Host header)")
        if get("https_ports"):
            unsupported.append("https_ports (the port proxy speaks plain HTTP to the sandbox)")
        return cls(get("allow_out"), get("deny_out"), get("dns_servers"), unsupported)


def policy_from_e2b(
    allow_internet_access: bool | None, egress: E2BEgress | None, *, updating: bool = False
) -> NetworkPolicy | None:
    """The dsec policy for E2B's settings (see the module docstring), or None for no
    network. ``updating``: the sandbox already has a network, so "nothing allowed" is
    :data:`BLOCK_ALL` rather than None, and omitted fields mean E2B's defaults (open).
    Raises ``InvalidRequest`` (400) for entries dsec's policy refuses (IPv6, host bits,
    malformed names, too many entries)."""
    if egress is None:
        if allow_internet_access is not True and not updating:
            return None
        egress = E2BEgress()
    domains: list[str] = []
    allow_nets: list[str] = []
    for entry in egress.allow_out:
        (allow_nets if _network(entry) is not None else domains).append(entry)
    allow_nets += egress.dns_servers
    denies = [_network(e) for e in egress.deny_out]
    closed = allow_internet_access is False or any(
        d is not None and d.prefixlen == 0 and d.version == 4 for d in denies
    )
    if closed:
        if not (domains or allow_nets):
            return BLOCK_ALL
        return NetworkPolicy(allow_domains=domains, allow_cidrs=allow_nets, protocols=PROTOCOLS)
    v4_allows = [n for n in map(_network, allow_nets) if isinstance(n, ipaddress.IPv4Network)]
    v4_denies = [d for d in denies if isinstance(d, ipaddress.IPv4Network)]
    deny_cidrs = [str(n) for n in _subtract(v4_denies, v4_allows)]
    if len(deny_cidrs) > MAX_CIDRS:
        raise E2BError(
            400,
            f"network.deny_out minus the addresses of allow_out is {len(deny_cidrs)} networks; "
            f"dsec takes at most {MAX_CIDRS} (allow fewer addresses inside denied ranges)",
        )
    return NetworkPolicy(
        allow_domains=domains,
        allow_cidrs=[ALL_TRAFFIC],
        deny_cidrs=deny_cidrs,
        protocols=PROTOCOLS,
    )


def e2b_view(policy: NetworkPolicy | None) -> tuple[bool, dict[str, Any] | None]:
    """``(allow_internet_access, network)`` as ``get_info`` shows them for a dsec policy:
    open when every address is allowed and not denied; ``network`` lists the allowed
    names and networks (``allow_out``) and the denied networks (``deny_out``, or
    ``["0.0.0.0/0"]`` when closed). None for a sandbox without a network."""
    if policy is None:
        return False, None
    open_ = ALL_TRAFFIC in policy.allow_cidrs and ALL_TRAFFIC not in policy.deny_cidrs
    allow_out = [*policy.allow_domains, *(c for c in policy.allow_cidrs if c != ALL_TRAFFIC)]
    deny_out = list(policy.deny_cidrs) if open_ else [ALL_TRAFFIC]
    return open_, {"allowOut": allow_out, "denyOut": deny_out}
