"""A small DNS wire codec: exactly what the sandbox resolver needs (RFC 1035).

Parses queries (one question) and responses (answer section: A and CNAME records,
others skipped), builds responses with uncompressed names. Malformed input raises
:class:`DnsFormatError`; nothing here trusts lengths or pointers it is given
(compression pointers must point backwards and chains are bounded).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field

__all__ = [
    "CLASS_IN",
    "RCODE_FORMERR",
    "RCODE_NOERROR",
    "RCODE_NOTIMP",
    "RCODE_NXDOMAIN",
    "RCODE_REFUSED",
    "RCODE_SERVFAIL",
    "TYPE_A",
    "TYPE_AAAA",
    "TYPE_CNAME",
    "DnsFormatError",
    "Message",
    "Question",
    "Record",
    "build_query",
    "build_response",
    "parse_message",
]

TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
CLASS_IN = 1
RCODE_NOERROR = 0
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
RCODE_NXDOMAIN = 3
RCODE_NOTIMP = 4
RCODE_REFUSED = 5

FLAG_QR = 0x8000
FLAG_AA = 0x0400
FLAG_TC = 0x0200
FLAG_RD = 0x0100
FLAG_RA = 0x0080

_HEADER = struct.Struct("!HHHHHH")
_MAX_NAME = 255
_MAX_POINTERS = 32


class DnsFormatError(ValueError):
    """The bytes are not a DNS message this codec accepts."""


@dataclass(frozen=True)
class Question:
    """One question: a lower-cased name without the trailing dot, a type and a class."""

    name: str
    qtype: int
    qclass: int = CLASS_IN


@dataclass(frozen=True)
class Record:
    """One resource record. ``data`` is an IPv4 string for A, a name for CNAME, else raw."""

    name: str
    rtype: int
    ttl: int
    data: str | bytes
    rclass: int = CLASS_IN


@dataclass
class Message:
    """A parsed DNS message (answers only; authority and additional are ignored)."""

    id: int
    flags: int
    questions: list[Question] = field(default_factory=list)
    answers: list[Record] = field(default_factory=list)

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_QR)

    @property
    def opcode(self) -> int:
        return (self.flags >> 11) & 0xF

    @property
    def rcode(self) -> int:
        return self.flags & 0xF


def _read_name(data: bytes, offset: int) -> tuple[str, int]:
    """Read a possibly compressed name at offset; return (name, offset after it)."""
    labels: list[str] = []
    end: int | None = None
    pointers = 0
    total = 0
    pos = offset
    while True:
        if pos >= len(data):
            raise DnsFormatError("name runs past the message")
        length = data[pos]
        if length & 0xC0 == 0xC0:
            if pos + 1 >= len(data):
                raise DnsFormatError("truncated compression pointer")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= pos:
                raise DnsFormatError("compression pointer does not point backwards")
            pointers += 1
            if pointers > _MAX_POINTERS:
                raise DnsFormatError("too many compression pointers")
            if end is None:
                end = pos + 2
            pos = target
            continue
        if length & 0xC0:
            raise DnsFormatError("unsupported label type")
        if length == 0:
            pos += 1
            break
        label = data[pos + 1 : pos + 1 + length]
        if len(label) != length:
            raise DnsFormatError("label runs past the message")
        total += length + 1
        if total > _MAX_NAME:
            raise DnsFormatError("name longer than 255 bytes")
        try:
            labels.append(label.decode("ascii").lower())
        except UnicodeDecodeError as e:
            raise DnsFormatError("non-ASCII label") from e
        pos += 1 + length
    return ".".join(labels), (end if end is not None else pos)


def _encode_name(name: str) -> bytes:
    out = bytearray()
    if name:
        for label in name.split("."):
            raw = label.encode("ascii")
            if not 0 < len(raw) < 64:
                raise DnsFormatError(f"bad label in {name!r}")
            out.append(len(raw))
            out += raw
    out.append(0)
    if len(out) > _MAX_NAME:
        raise DnsFormatError("name longer than 255 bytes")
    return bytes(out)


def parse_message(data: bytes) -> Message:
    """Parse a query or response. Raises DnsFormatError on anything malformed."""
    if len(data) < _HEADER.size:
        raise DnsFormatError("shorter than a DNS header")
    ident, flags, qd, an, _ns, _ar = _HEADER.unpack_from(data)
    if qd > 4:
        raise DnsFormatError("too many questions")
    msg = Message(id=ident, flags=flags)
    off = _HEADER.size
    for _ in range(qd):
        name, off = _read_name(data, off)
        if off + 4 > len(data):
            raise DnsFormatError("truncated question")
        qtype, qclass = struct.unpack_from("!HH", data, off)
        off += 4
        msg.questions.append(Question(name, qtype, qclass))
    for _ in range(an):
        name, off = _read_name(data, off)
        if off + 10 > len(data):
            raise DnsFormatError("truncated record")
        rtype, rclass, ttl, rdlen = struct.unpack_from("!HHIH", data, off)
        off += 10
        rdata_start = off
        off += rdlen
        if off > len(data):
            raise DnsFormatError("record data runs past the message")
        rdata: str | bytes
        if rtype == TYPE_A and rclass == CLASS_IN:
            if rdlen != 4:
                raise DnsFormatError("A record is not 4 bytes")
            rdata = str(ipaddress.IPv4Address(data[rdata_start:off]))
        elif rtype == TYPE_CNAME:
            rdata, _ = _read_name(data, rdata_start)
        else:
            rdata = data[rdata_start:off]
        ttl = ttl if ttl < 0x80000000 else 0  # RFC 2181: values with the top bit set mean 0
        msg.answers.append(Record(name, rtype, ttl, rdata, rclass))
    return msg


def build_query(ident: int, name: str, qtype: int = TYPE_A, *, recursion: bool = True) -> bytes:
    """A standard query for one name."""
    flags = FLAG_RD if recursion else 0
    return (
        _HEADER.pack(ident, flags, 1, 0, 0, 0)
        + _encode_name(name)
        + struct.pack("!HH", qtype, CLASS_IN)
    )


def build_response(
    query: Message,
    rcode: int,
    answers: list[Record] | None = None,
    *,
    authoritative: bool = False,
) -> bytes:
    """A response to query: its id, RD bit and question echoed, the given answers (A/CNAME)."""
    answers = answers or []
    flags = FLAG_QR | FLAG_RA | (query.flags & FLAG_RD) | (rcode & 0xF)
    flags |= (query.opcode & 0xF) << 11
    if authoritative:
        flags |= FLAG_AA
    out = bytearray(_HEADER.pack(query.id, flags, len(query.questions), len(answers), 0, 0))
    for q in query.questions:
        out += _encode_name(q.name) + struct.pack("!HH", q.qtype, q.qclass)
    for rr in answers:
        if rr.rtype == TYPE_A:
            assert isinstance(rr.data, str)
            rdata = ipaddress.IPv4Address(rr.data).packed
        elif rr.rtype == TYPE_CNAME:
            assert isinstance(rr.data, str)
            rdata = _encode_name(rr.data)
        else:
            rdata = rr.data if isinstance(rr.data, bytes) else rr.data.encode()
        out += _encode_name(rr.name)
        out += struct.pack(
            "!HHIH", rr.rtype, rr.rclass, max(0, min(rr.ttl, 0x7FFFFFFF)), len(rdata)
        )
        out += rdata
    if len(out) > 512:
        # Classic UDP limit: drop answers and set TC rather than send an oversized datagram.
        header = _HEADER.pack(query.id, flags | FLAG_TC, len(query.questions), 0, 0, 0)
        qpart = b"".join(
            _encode_name(q.name) + struct.pack("!HH", q.qtype, q.qclass) for q in query.questions
        )
        return header + qpart
    return bytes(out)
