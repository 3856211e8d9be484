"""The network policy model: what a sandbox may reach, validated at the door.

A sandbox has either no network at all (``network=None``, the default: the container
keeps a loopback-only namespace and none of this code runs) or a :class:`NetworkPolicy`:

* ``allow_domains``: exact names (``pypi.org``) and wildcards (``*.github.com`` matches
  ``api.github.com`` and ``a.b.github.com`` but not ``github.com`` itself).
* ``allow_cidrs``: IPv4 addresses or networks reachable without DNS.
* ``ports`` / ``protocols``: which destination ports (numbers or ``"lo-hi"`` ranges;
  ``None`` means every port) and which of ``tcp``, ``udp``, ``icmp`` the allows cover.
* ``deny_domains`` / ``deny_cidrs``: always win over allows (a denied name is refused by
  the resolver; a denied network is dropped by the packet filter).
* ``presets``: names an operator configured (``pypi``, ``npm``, ``debian``, ``github``,
  ...) that expand to domains and mirror addresses, see :data:`DEFAULT_PRESETS`.

Never reachable whatever the policy (enforced by the manager, not expressible here):
the node's own addresses (so the apiserver and edge ports), other sandboxes, every cloud's
instance metadata and host services (link-local 169.254.0.0/16, Alibaba 100.100.100.200,
Azure 168.63.129.16, ...: see :data:`NEVER_REACHABLE`), loopback, multicast and reserved
ranges, and the operator's protected networks.

Invalid input raises :class:`dsec.errors.InvalidRequest` naming the field and the
offending value. Example::

    policy = NetworkPolicy(allow_domains=["pypi.org", "*.pythonhosted.org"], ports=[443])
    resolved = policy.resolve(DEFAULT_PRESETS)
    assert resolved.allows_name("files.pythonhosted.org")
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.errors import InvalidRequest
from dsec.wire import WireModel

__all__ = [
    "DEFAULT_PRESETS",
    "MAX_CIDRS",
    "MAX_DOMAINS",
    "MAX_PORT_RULES",
    "MAX_PRESETS",
    "NEVER_REACHABLE",
    "NetworkPolicy",
    "NetworkPreset",
    "Protocol",
    "ResolvedPolicy",
    "normalize_cidr",
    "normalize_domain",
]

Protocol = Literal["tcp", "udp", "icmp"]

MAX_DOMAINS = 512
"""Most domain patterns per list (allow or deny), after preset expansion too."""
MAX_CIDRS = 256
"""Most CIDRs per list (allow or deny), after preset expansion too."""
MAX_PORT_RULES = 64
"""Most port numbers/ranges in one policy."""
MAX_PRESETS = 16
"""Most presets named by one policy."""

NEVER_REACHABLE: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network"
    "100.100.100.200/32",  # Alibaba Cloud instance metadata
    "127.0.0.0/8",  # loopback
    "168.63.129.16/32",  # Azure wireserver (guest agent, extension settings, DNS, DHCP)
    "169.254.0.0/16",  # link-local: the metadata of AWS, GCP, Azure, OCI, ... (below)
    "192.0.0.0/24",  # IETF protocol assignments; Oracle Cloud's legacy metadata 192.0.0.192
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved + limited broadcast
)
"""IPv4 ranges no policy can open (the manager adds its sandbox subnet, host addresses and
the operator's ``protected_cidrs``). ``0.0.0.0/0`` (E2B's default) opens everything else.

Every public cloud's per-instance services (instance metadata with its credentials, host
agents) are here, because a sandbox's packets leave with the node's address and those
services trust whoever sends from it:

* link-local ``169.254.0.0/16``: the metadata of AWS (``169.254.169.254``, Time Sync
  ``.123``, DNS ``.253``, ECS/EKS ``169.254.170.2``/``.23``), GCP
  (``metadata.google.internal``), Azure IMDS, Oracle Cloud, DigitalOcean, Hetzner,
  Linode, Vultr, OpenStack, IBM, Huawei, Tencent (``169.254.0.23``), Scaleway
  (``169.254.42.42``);
* Alibaba Cloud's metadata ``100.100.100.200`` (its other services in ``100.100.0.0/16``
  are DNS, NTP and mirrors; protect the range with ``protected_cidrs`` if you wish);
* Azure's wireserver ``168.63.129.16`` (a public address Microsoft routes to the host);
* Oracle Cloud's legacy metadata ``192.0.0.192`` (the whole non-global ``192.0.0.0/24``).

IPv6 needs no entry: sandboxes are IPv4-only (IPv6 is disabled in their namespace and the
filter drops every IPv6 packet from them), so AWS's ``fd00:ec2::254`` and link-local
``fe80::/10`` are out of reach too. The VM tiers have no network device at all.
"""

_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_PORT_RANGE = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")


def normalize_domain(value: str, *, allow_wildcard: bool = True) -> str:
    """Lower-case, strip the trailing dot, IDNA-encode and check one domain pattern.

    Raises InvalidRequest (a ValueError) with the reason.
    """
    if not isinstance(value, str):
        raise InvalidRequest(f"domain must be a string, got {type(value).__name__}")
    raw = value.strip().lower().rstrip(".")
    if not raw:
        raise InvalidRequest("empty domain")
    wildcard = raw.startswith("*.")
    body = raw[2:] if wildcard else raw
    if wildcard and not allow_wildcard:
        raise InvalidRequest(f"wildcards are not allowed here: {value!r}")
    if "*" in body:
        raise InvalidRequest(f"invalid domain {value!r}: '*' only as a leading '*.' label")
    if "/" in body or ":" in body:
        raise InvalidRequest(f"invalid domain {value!r}: looks like an address; use allow_cidrs")
    try:
        ipaddress.ip_address(body)
    except ValueError:
        pass
    else:
        raise InvalidRequest(f"invalid domain {value!r}: an IP address; use allow_cidrs")
    try:
        ascii_body = body.encode("idna").decode("ascii") if not body.isascii() else body
    except UnicodeError as e:
        raise InvalidRequest(f"invalid domain {value!r}: {e}") from None
    if len(ascii_body) > 253:
        raise InvalidRequest(f"invalid domain {value!r}: longer than 253 characters")
    labels = ascii_body.split(".")
    for label in labels:
        if not label:
            raise InvalidRequest(f"invalid domain {value!r}: empty label")
        if not _LABEL.match(label):
            raise InvalidRequest(
                f"invalid domain {value!r}: label {label!r} must be 1-63 of a-z, 0-9, '-', '_' "
                "and not start or end with '-'"
            )
    if labels[-1].isdigit():
        raise InvalidRequest(f"invalid domain {value!r}: the top-level label is numeric")
    if wildcard and len(labels) < 2:
        raise InvalidRequest(
            f"wildcard {value!r} is too broad: name at least two labels (*.example.com)"
        )
    return ("*." if wildcard else "") + ascii_body


def normalize_cidr(value: str) -> str:
    """Check an IPv4 address or network (host bits must be zero); return its canonical form."""
    if not isinstance(value, str):
        raise InvalidRequest(f"CIDR must be a string, got {type(value).__name__}")
    text = value.strip()
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        msg = str(e)
        if "host bits set" in msg:
            fixed = ipaddress.ip_network(text, strict=False)
            raise InvalidRequest(
                f"invalid CIDR {value!r}: host bits set (did you mean {fixed}?)"
            ) from None
        raise InvalidRequest(f"invalid CIDR {value!r}: {msg}") from None
    if net.version != 4:
        raise InvalidRequest(
            f"invalid CIDR {value!r}: IPv6 is not supported (sandboxes are IPv4-only)"
        )
    return str(net)


def _inside_never(net: ipaddress.IPv4Network) -> str | None:
    for never in NEVER_REACHABLE:
        n = ipaddress.IPv4Network(never)
        if net.subnet_of(n):
            return never
    return None


def _dedup(values: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def _check_list(value: Any, what: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidRequest(f"{what} must be a list")
    if len(value) > limit:
        raise InvalidRequest(f"{what} has {len(value)} entries; at most {limit}")
    return list(value)


def _parse_port(value: Any) -> tuple[int, int]:
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid port {value!r}")
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        text = value.strip()
        m = _PORT_RANGE.match(text)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
        elif text.isdigit():
            lo = hi = int(text)
        else:
            raise InvalidRequest(f"invalid port {value!r}: a number 1-65535 or a range 'lo-hi'")
    else:
        raise InvalidRequest(f"invalid port {value!r}: a number 1-65535 or a range 'lo-hi'")
    if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
        raise InvalidRequest(f"invalid port {value!r}: ports are 1-65535")
    if lo > hi:
        raise InvalidRequest(f"invalid port range {value!r}: start is above end")
    return lo, hi


class NetworkPreset(WireModel):
    """What an operator-configured preset name expands to: domains and/or mirror CIDRs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    domains: list[str] = Field(default_factory=list)
    cidrs: list[str] = Field(default_factory=list)

    @field_validator("domains", mode="before")
    @classmethod
    def _domains(cls, v: Any) -> list[str]:
        return _dedup(normalize_domain(d) for d in _check_list(v, "preset domains", MAX_DOMAINS))

    @field_validator("cidrs", mode="before")
    @classmethod
    def _cidrs(cls, v: Any) -> list[str]:
        return _dedup(normalize_cidr(c) for c in _check_list(v, "preset cidrs", MAX_CIDRS))

    @classmethod
    def coerce(cls, value: NetworkPreset | Mapping[str, Any] | Sequence[str]) -> NetworkPreset:
        """Accept a preset, a ``{"domains": [...], "cidrs": [...]}`` mapping, or a flat list
        mixing domains and CIDRs (anything that parses as an IPv4 network is a CIDR)."""
        if isinstance(value, NetworkPreset):
            return value
        try:
            if isinstance(value, Mapping):
                return cls.model_validate(dict(value))
            domains: list[str] = []
            cidrs: list[str] = []
            for item in _check_list(value, "preset", MAX_DOMAINS + MAX_CIDRS):
                try:
                    ipaddress.ip_network(str(item).strip(), strict=False)
                except ValueError:
                    domains.append(item)
                else:
                    cidrs.append(item)
            return cls(domains=domains, cidrs=cidrs)
        except ValidationError as e:
            raise InvalidRequest(_format_errors(e)) from None


DEFAULT_PRESETS: dict[str, NetworkPreset] = {
    "pypi": NetworkPreset(domains=["pypi.org", "files.pythonhosted.org"]),
    "npm": NetworkPreset(domains=["registry.npmjs.org", "registry.yarnpkg.com"]),
    "debian": NetworkPreset(
        domains=[
            "deb.debian.org",
            "security.debian.org",
            "ftp.debian.org",
            "cdn-fastly.deb.debian.org",
        ]
    ),
    "github": NetworkPreset(
        domains=[
            "github.com",
            "*.github.com",
            "*.githubusercontent.com",
            "github-releases.githubusercontent.com",
        ]
    ),
}
"""Public upstreams. Operators override these (e.g. point ``pypi`` at an internal mirror's
name or address) through ``NetworkManager(presets=...)``."""


def _default_protocols() -> list[Protocol]:
    return ["tcp"]


def _format_errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid network policy: " + "; ".join(parts)


class NetworkPolicy(WireModel):
    """A sandbox's network allowlist. See the module docstring for the semantics.

    Constructing with bad values raises :class:`dsec.errors.InvalidRequest`; use
    :meth:`parse` for JSON-like input (``model_validate`` raises pydantic's
    ValidationError carrying the same messages).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_domains: list[str] = Field(
        default_factory=list, description="exact names and '*.' wildcards"
    )
    allow_cidrs: list[str] = Field(default_factory=list, description="IPv4 addresses/networks")
    ports: list[int | str] | None = Field(
        None, description="destination ports or 'lo-hi' ranges; None = every port"
    )
    protocols: list[Protocol] = Field(
        default_factory=_default_protocols, description="tcp, udp, icmp"
    )
    deny_domains: list[str] = Field(default_factory=list, description="win over allow_domains")
    deny_cidrs: list[str] = Field(default_factory=list, description="win over every allow")
    presets: list[str] = Field(default_factory=list, description="operator-configured names")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise InvalidRequest(_format_errors(e)) from None

    @classmethod
    def parse(cls, data: Any) -> NetworkPolicy:
        """Validate a mapping (e.g. a JSON body); errors become InvalidRequest."""
        if isinstance(data, NetworkPolicy):
            return data
        if not isinstance(data, Mapping):
            raise InvalidRequest("network policy must be an object")
        return cls(**dict(data))

    @field_validator("allow_domains", "deny_domains", mode="before")
    @classmethod
    def _domains(cls, v: Any) -> list[str]:
        return _dedup(normalize_domain(d) for d in _check_list(v, "domain list", MAX_DOMAINS))

    @field_validator("allow_cidrs", mode="before")
    @classmethod
    def _allow_cidrs(cls, v: Any) -> list[str]:
        out = []
        for c in _check_list(v, "allow_cidrs", MAX_CIDRS):
            norm = normalize_cidr(c)
            never = _inside_never(ipaddress.IPv4Network(norm))
            if never:
                raise InvalidRequest(
                    f"allow_cidrs {c!r} lies inside {never}, which is never reachable"
                )
            out.append(norm)
        return _dedup(out)

    @field_validator("deny_cidrs", mode="before")
    @classmethod
    def _deny_cidrs(cls, v: Any) -> list[str]:
        return _dedup(normalize_cidr(c) for c in _check_list(v, "deny_cidrs", MAX_CIDRS))

    @field_validator("ports", mode="before")
    @classmethod
    def _ports(cls, v: Any) -> list[int | str] | None:
        if v is None:
            return None
        items = _check_list(v, "ports", MAX_PORT_RULES)
        if not items:
            raise InvalidRequest("ports is empty: omit it (null) to allow every port")
        out: list[int | str] = []
        for item in items:
            lo, hi = _parse_port(item)
            out.append(lo if lo == hi else f"{lo}-{hi}")
        return list(dict.fromkeys(out))

    @field_validator("protocols", mode="before")
    @classmethod
    def _protocols(cls, v: Any) -> list[str]:
        items = _check_list(v, "protocols", 3)
        if not items:
            raise InvalidRequest("protocols is empty: name at least one of tcp, udp, icmp")
        out = []
        for p in items:
            if not isinstance(p, str) or p.lower() not in ("tcp", "udp", "icmp"):
                raise InvalidRequest(f"invalid protocol {p!r}: one of tcp, udp, icmp")
            out.append(p.lower())
        return _dedup(out)

    @field_validator("presets", mode="before")
    @classmethod
    def _presets(cls, v: Any) -> list[str]:
        out = []
        for p in _check_list(v, "presets", MAX_PRESETS):
            if not isinstance(p, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,63}", p):
                raise InvalidRequest(f"invalid preset name {p!r}")
            out.append(p)
        return _dedup(out)

    @model_validator(mode="after")
    def _allows_something(self) -> NetworkPolicy:
        if not (self.allow_domains or self.allow_cidrs or self.presets):
            raise InvalidRequest(
                "the policy allows nothing: name allow_domains, allow_cidrs or presets "
                "(for no network at all, pass network=None)"
            )
        if "icmp" in self.protocols and self.protocols == ["icmp"] and self.ports is not None:
            raise InvalidRequest("ports apply to tcp/udp; a policy of only icmp cannot name ports")
        return self

    def port_ranges(self) -> list[tuple[int, int]] | None:
        """Allowed destination port ranges (inclusive), or None for every port."""
        if self.ports is None:
            return None
        return [_parse_port(p) for p in self.ports]

    def resolve(
        self,
        presets: Mapping[str, NetworkPreset] | None = None,
        *,
        never: Sequence[str] = (),
    ) -> ResolvedPolicy:
        """Expand presets and return the flat form the resolver and the filter use.

        ``never`` are extra never-reachable CIDRs (the manager's sandbox subnet): an
        allow CIDR entirely inside one is an error. Unknown presets raise InvalidRequest.
        """
        table = DEFAULT_PRESETS if presets is None else presets
        domains = list(self.allow_domains)
        cidrs = list(self.allow_cidrs)
        for name in self.presets:
            preset = table.get(name)
            if preset is None:
                known = ", ".join(sorted(table)) or "none configured"
                raise InvalidRequest(f"unknown network preset {name!r} (known: {known})")
            domains.extend(preset.domains)
            cidrs.extend(preset.cidrs)
        domains = _dedup(domains)
        cidrs = _dedup(cidrs)
        if len(domains) > MAX_DOMAINS:
            raise InvalidRequest(f"policy expands to {len(domains)} domains; at most {MAX_DOMAINS}")
        if len(cidrs) > MAX_CIDRS:
            raise InvalidRequest(f"policy expands to {len(cidrs)} CIDRs; at most {MAX_CIDRS}")
        for c in cidrs:
            net = ipaddress.IPv4Network(c)
            for n in never:
                if net.subnet_of(ipaddress.IPv4Network(n)):
                    raise InvalidRequest(
                        f"allow CIDR {c} lies inside {n}, which is never reachable"
                    )
        return ResolvedPolicy(
            exact=frozenset(d for d in domains if not d.startswith("*.")),
            wildcards=tuple(sorted({d[1:] for d in domains if d.startswith("*.")})),
            deny_exact=frozenset(d for d in self.deny_domains if not d.startswith("*.")),
            deny_wildcards=tuple(sorted({d[1:] for d in self.deny_domains if d.startswith("*.")})),
            cidrs=tuple(cidrs),
            deny_cidrs=tuple(self.deny_cidrs),
            port_ranges=None if self.ports is None else tuple(self.port_ranges() or ()),
            protocols=tuple(self.protocols),
        )


@dataclass(frozen=True)
class ResolvedPolicy:
    """A policy with presets expanded. Wildcards are stored as suffixes (``.github.com``)."""

    exact: frozenset[str]
    wildcards: tuple[str, ...]
    deny_exact: frozenset[str]
    deny_wildcards: tuple[str, ...]
    cidrs: tuple[str, ...]
    deny_cidrs: tuple[str, ...]
    port_ranges: tuple[tuple[int, int], ...] | None
    protocols: tuple[str, ...]

    def denies_name(self, name: str) -> bool:
        """True if a deny rule matches the (lower-case, dotless-end) name."""
        return name in self.deny_exact or any(name.endswith(s) for s in self.deny_wildcards)

    @property
    def every_address(self) -> bool:
        """The policy reaches every public address (``0.0.0.0/0`` allowed and not denied)."""
        return "0.0.0.0/0" in self.cidrs and "0.0.0.0/0" not in self.deny_cidrs

    def allows_name(self, name: str) -> bool:
        """True if the resolver may answer this name: no deny matches, and an allow does or
        the policy reaches :attr:`every_address` (a name filter behind an open address
        filter keeps nothing out, it only breaks clients: E2B's default network)."""
        if self.denies_name(name):
            return False
        if self.every_address:
            return True
        return name in self.exact or any(name.endswith(s) for s in self.wildcards)

    def address_denied(self, address: str) -> bool:
        """True if address lies in a deny CIDR."""
        ip = ipaddress.IPv4Address(address)
        return any(ip in ipaddress.IPv4Network(c) for c in self.deny_cidrs)
