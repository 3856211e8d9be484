"""Who envd acts as, and where relative paths land: users from the sandbox's own passwd.

envd runs every request as a user: the one the SDK names (``Authorization: Basic
base64("<user>:")`` on RPCs, ``username=`` on ``/files``), else the template's default
user (``user`` in E2B's templates). A relative path, a relative ``cwd`` and a command
started without ``cwd`` are taken relative to that user's home directory, and entries are
owned by user and group *names*. dsec reads the same facts from the sandbox's
``/etc/passwd`` and ``/etc/group`` (through the edge, so on every tier with a files API)
and caches them per sandbox.

Cache: one parsed copy per sandbox (at most :data:`MAX_CACHED_SANDBOXES`, least recently
used dropped), re-read when it is older than :data:`REFRESH_S` and a name or id is not in
it (a ``useradd`` inside the sandbox is seen within that time), and dropped when the
sandbox is killed. A sandbox without a readable ``/etc/passwd`` (or another tier's
error) falls back to the sandbox's working directory and numeric ids.
"""

from __future__ import annotations

import base64
import posixpath
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from dsec.contract.edge import EdgeAPI
from dsec.e2b.errors import sandbox_ref
from dsec.errors import DsecError, InvalidRequest, SandboxNotFound
from dsec.models import SandboxPathRequest
from dsec.runtimes.container.users import parse_group, parse_passwd

__all__ = [
    "MAX_CACHED_SANDBOXES",
    "REFRESH_S",
    "SandboxUsers",
    "resolve_path",
    "user_from_headers",
]

MAX_CACHED_SANDBOXES = 4096
REFRESH_S = 2.0
"""A cached passwd older than this is re-read when it does not know a user, seconds."""
_MAX_DB_BYTES = 1 << 20


@dataclass
class _Db:
    users: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    """name -> (uid, gid, home)"""
    uid_names: dict[int, str] = field(default_factory=dict)
    gid_names: dict[int, str] = field(default_factory=dict)
    loaded_at: float = 0.0
    readable: bool = False
    existing_dirs: set[str] = field(default_factory=set)
    """Home directories seen to exist (a command's default cwd)."""


def user_from_headers(headers: object) -> str | None:
    """The user envd would run as: ``Authorization: Basic base64("<user>:")``, else ``None``."""
    get = getattr(headers, "get", None)
    value = get("authorization") if get is not None else None
    if not value or not value.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(value[6:].strip(), validate=True).decode()
    except ValueError:
        raise ConnectError(Code.INVALID_ARGUMENT, "malformed Authorization header") from None
    user = decoded.split(":", 1)[0]
    return user or None


def resolve_path(path: str, base: str) -> str:
    """``path`` made absolute against ``base`` (a relative path) and normalised."""
    if path.startswith("/"):
        return posixpath.normpath(path) if path != "/" else "/"
    return posixpath.normpath(posixpath.join(base or "/", path))


class SandboxUsers:
    """Users, groups and homes of each sandbox (see the module docstring)."""

    def __init__(self, edge: EdgeAPI) -> None:
        self._edge = edge
        self._dbs: OrderedDict[str, _Db] = OrderedDict()

    def drop_sandbox(self, sandbox_id: str) -> None:
        """Forget a killed sandbox."""
        self._dbs.pop(sandbox_id, None)

    async def _read(self, sandbox_id: str, owner: str, path: str) -> str | None:
        try:
            data = await self._edge.read_file(sandbox_id, owner, path)
        except SandboxNotFound:
            raise
        except DsecError:
            return None
        return data[:_MAX_DB_BYTES].decode(errors="replace")

    async def _db(self, sandbox_id: str, owner: str, *, fresh: bool = False) -> _Db:
        db = self._dbs.get(sandbox_id)
        if db is not None and not (fresh and time.monotonic() - db.loaded_at > REFRESH_S):
            self._dbs.move_to_end(sandbox_id)
            return db
        passwd = await self._read(sandbox_id, owner, "/etc/passwd")
        group = await self._read(sandbox_id, owner, "/etc/group")
        db = _Db(loaded_at=time.monotonic(), readable=passwd is not None)
        for name, uid, gid, home in parse_passwd(passwd or ""):
            db.users.setdefault(name, (uid, gid, home))
            db.uid_names.setdefault(uid, name)
        for name, gid, _members in parse_group(group or ""):
            db.gid_names.setdefault(gid, name)
        self._dbs[sandbox_id] = db
        self._dbs.move_to_end(sandbox_id)
        while len(self._dbs) > MAX_CACHED_SANDBOXES:
            self._dbs.popitem(last=False)
        return db

    async def home(self, sandbox_id: str, owner: str, user: str | None) -> str:
        """The home directory of ``user`` (``None``: the sandbox's default user) in the
        sandbox; the sandbox's working directory when its passwd does not say, or when
        neither the request nor the sandbox names a user (who runs its commands is then
        the tier's choice: root on the container tier, ``sandbox`` on fncall).

        Raises:
            InvalidRequest: ``user`` is a name the sandbox's passwd does not have.
            SandboxNotFound: the sandbox does not exist for ``owner``.
        """
        info = await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)
        spec = user if user is not None else info.user
        if not spec:
            return info.workdir or "/"
        name = spec.partition(":")[0]
        db = await self._db(sandbox_id, owner)
        found = self._lookup(db, name)
        if found is None and db.readable:
            db = await self._db(sandbox_id, owner, fresh=True)
            found = self._lookup(db, name)
        if found is not None:
            return found
        if db.readable and not name.isdigit():
            raise InvalidRequest(f"user {name!r} does not exist in the sandbox", user=name)
        return info.workdir or "/"

    async def cwd(self, sandbox_id: str, owner: str, user: str | None, cwd: str | None) -> str:
        """Where a command of ``user`` starts, as envd: ``cwd`` (a relative one against the
        user's home), else the template's working directory (the sandbox's, when its image
        set one: not ``/``), else the user's home when it exists, else ``/``."""
        home = await self.home(sandbox_id, owner, user)
        if cwd:
            return resolve_path(cwd, home)
        workdir = (await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)).workdir
        if workdir and workdir != "/":
            return workdir
        db = await self._db(sandbox_id, owner)
        if home in db.existing_dirs:
            return home
        try:
            info = await self._edge.stat_file(
                SandboxPathRequest(sandbox_id=sandbox_id, path=home), owner
            )
        except SandboxNotFound:
            raise
        except DsecError:
            info = None
        if info is not None and info.type == "dir":
            db.existing_dirs.add(home)
            return home
        return (await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)).workdir or "/"

    @staticmethod
    def _lookup(db: _Db, name: str) -> str | None:
        if name.isdigit():
            uid = int(name)
            return next((h for (u, _g, h) in db.users.values() if u == uid), None)
        entry = db.users.get(name)
        return entry[2] if entry is not None else None

    async def names(self, sandbox_id: str, owner: str, uid: int, gid: int) -> tuple[str, str]:
        """The user and group names of ``uid``/``gid`` in the sandbox (the number as text
        when its passwd or group has none)."""
        db = await self._db(sandbox_id, owner)
        if (uid not in db.uid_names or gid not in db.gid_names) and db.readable:
            db = await self._db(sandbox_id, owner, fresh=True)
        return db.uid_names.get(uid, str(uid)), db.gid_names.get(gid, str(gid))

    async def resolve(self, sandbox_id: str, owner: str, path: str, user: str | None) -> str:
        """``path`` as an absolute sandbox path: relative ones against ``user``'s home."""
        if not path:
            raise InvalidRequest("path is empty")
        if "\0" in path:
            raise InvalidRequest("path contains a NUL byte")
        if path.startswith("/"):
            return resolve_path(path, "/")
        return resolve_path(path, await self.home(sandbox_id, owner, user))
