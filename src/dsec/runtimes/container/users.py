"""Resolve a sandbox user (``name``, ``uid``, ``name:gid`` or ``uid:gid``) from its own
``/etc/passwd`` and ``/etc/group``, read safely from the rootfs on the host.

Semantics follow Docker's ``--user``: a name must exist in ``/etc/passwd``; a numeric
uid need not (then gid 0 and home ``/``); supplementary groups are the groups of
``/etc/group`` that list the user by name (plus nothing for unknown uids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.errors import InvalidRequest

__all__ = ["ResolvedUser", "parse_group", "parse_passwd", "resolve_user"]

_MAX_ID = 2**32 - 2


@dataclass(frozen=True)
class ResolvedUser:
    uid: int
    gid: int
    name: str | None
    home: str
    groups: list[int] = field(default_factory=list)


def parse_passwd(text: str) -> list[tuple[str, int, int, str]]:
    """``(name, uid, gid, home)`` of each well-formed line."""
    out = []
    for line in text.splitlines():
        f = line.split(":")
        if len(f) < 7 or not f[2].isdigit() or not f[3].isdigit():
            continue
        out.append((f[0], int(f[2]), int(f[3]), f[5] or "/"))
    return out


def parse_group(text: str) -> list[tuple[str, int, list[str]]]:
    """``(name, gid, members)`` of each well-formed line."""
    out = []
    for line in text.splitlines():
        f = line.split(":")
        if len(f) < 4 or not f[2].isdigit():
            continue
        out.append((f[0], int(f[2]), [m for m in f[3].split(",") if m]))
    return out


def resolve_user(spec: str | None, passwd: str | None, group: str | None) -> ResolvedUser:
    """Resolve ``spec`` (None = root) against the given file contents (None = absent).

    Raises:
        InvalidRequest: unknown user name, or an id out of range.
    """
    if spec is None or spec == "":
        spec = "0"
    user_part, _, gid_part = spec.partition(":")
    users = parse_passwd(passwd or "")
    groups = parse_group(group or "")
    entry = None
    if user_part.isdigit():
        uid = int(user_part)
        entry = next((u for u in users if u[1] == uid), None)
    else:
        entry = next((u for u in users if u[0] == user_part), None)
        if entry is None:
            raise InvalidRequest(
                f"unknown user {user_part!r} (not in the sandbox's /etc/passwd)", user=spec
            )
        uid = entry[1]
    name = entry[0] if entry else None
    gid = entry[2] if entry else 0
    home = entry[3] if entry else "/"
    if gid_part:
        if not gid_part.isdigit():
            raise InvalidRequest(f"invalid group in user {spec!r}", user=spec)
        gid = int(gid_part)
    if uid > _MAX_ID or gid > _MAX_ID:
        raise InvalidRequest(f"user {spec!r}: id out of range", user=spec)
    supplementary = sorted({g[1] for g in groups if name is not None and name in g[2]} - {gid})
    return ResolvedUser(uid=uid, gid=gid, name=name, home=home, groups=supplementary)
