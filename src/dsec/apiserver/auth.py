"""API keys: generation, storage and verification.

A key looks like ``dsec_<43 urlsafe chars>`` (32 random bytes). The server never stores
a key, only its SHA-256 (keys are high-entropy, so an unsalted hash is safe: there is
nothing to brute-force). Each key has an *owner id*, ``k<first 16 hex of the hash>``:
stable, short, and safe to log; the edge scopes every sandbox to it.

Every key also has an *E2B form*, ``e2b_`` + the key's text in hexadecimal
(:func:`e2b_form`), for E2B clients that refuse a key not shaped ``e2b_<hex>`` before
sending anything (``e2b`` 2.31, which ``openai-agents[e2b]`` pins). It is the same key,
not a second one: :func:`key_digest` reads it back to the key's text first, so it has
the key's owner, quota and role, and revoking either form revokes both. It is exactly as
secret (the two forms determine each other), so nothing about the check is weaker.

Files under the state directory (``$DSEC_HOME``)::

    api_key         the key generated at first start, plaintext, mode 0600, so local
                    SDK/CLI users on the node can read it (as root)
    api_keys.json   {"keys": [{"owner": ..., "sha256": ..., "created_at": ..., "name": ...,
                    "role": ..., "quota": {...}}]} mode 0600, rewritten atomically (write +
                    rename); ``quota`` is the key's :class:`~dsec.models.KeyQuota` (absent:
                    none) set by ``dsec key create/set``

:meth:`KeyStore.verify` re-reads ``api_keys.json`` when it changes (inode, mtime, size), so keys created
or revoked by another process (``dsec`` CLI) take effect without a restart; so do quotas.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dsec.edge.quotas import UNLIMITED
from dsec.models import KeyQuota

__all__ = [
    "KeyDirectory",
    "KeyRecord",
    "KeyStore",
    "KeyVerifier",
    "StaticKeys",
    "canonical_key",
    "e2b_form",
    "generate_key",
    "key_digest",
    "owner_id",
]

log = logging.getLogger(__name__)

KEY_PREFIX = "dsec_"


def generate_key() -> str:
    """A new random API key: ``dsec_`` + 32 random bytes, urlsafe base64 (43 chars)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


MAX_KEY_CHARS = 256
"""Longest key a server accepts (its E2B form is longer: ``e2b_`` + two hex digits a byte)."""
E2B_PREFIX = "e2b_"
_E2B_FORM = re.compile(r"e2b_(?:[0-9a-f]{2})+")


def e2b_form(key: str) -> str:
    """``key`` as E2B clients accept it: ``e2b_`` + its UTF-8 text in lower-case hex
    (``e2b_647365635f...`` for a ``dsec_...`` key). The server takes it as ``key`` itself.

    Example::

        os.environ["E2B_API_KEY"] = e2b_form(os.environ["DSEC_API_KEY"])
    """
    return E2B_PREFIX + key.encode("utf-8", "surrogateescape").hex()


def canonical_key(key: str) -> str:
    """The key a presented text stands for: the text of an E2B form (:func:`e2b_form`),
    else the text itself (a key that merely looks like one, e.g. an ``e2b_`` key an
    operator provisioned whose hex is not UTF-8 text, stays as it is)."""
    if key.startswith(E2B_PREFIX) and _E2B_FORM.fullmatch(key):
        try:
            return bytes.fromhex(key[len(E2B_PREFIX) :]).decode("utf-8")
        except UnicodeDecodeError:
            return key
    return key


def key_digest(key: str) -> str:
    """What a key is stored as: the hex SHA-256 of its text (surrogates kept); a key's E2B
    form (:func:`e2b_form`) has the key's digest."""
    return hashlib.sha256(canonical_key(key).encode("utf-8", "surrogateescape")).hexdigest()


def owner_id(key: str) -> str:
    """The stable owner id of a key: ``k`` + the first 16 hex digits of its SHA-256."""
    return "k" + key_digest(key)[:16]


class KeyVerifier(Protocol):
    """Anything that maps a presented key to its owner id (None: not a valid key), and
    says which owners are the operator's (they may publish and remove system images)."""

    def verify(self, key: str) -> str | None: ...
    def is_operator(self, owner: str) -> bool: ...


@runtime_checkable
class KeyDirectory(Protocol):
    """Optional ability of a key verifier: whether an owner still has a valid key. A
    dashboard session (which holds an owner id, never the key) ends when it is revoked."""

    def has_owner(self, owner: str) -> bool: ...


@dataclass(frozen=True)
class KeyRecord:
    """One stored key (never the key itself). ``role``: ``operator`` (the node's first key,
    or one created with ``dsec key create --operator``) or ``user``; ``quota``: the key's
    :class:`~dsec.models.KeyQuota` as stored (empty: no limits)."""

    owner: str
    sha256: str
    created_at: float  # unix seconds
    name: str = ""
    role: str = "user"
    quota: dict[str, Any] = field(default_factory=dict)

    def key_quota(self) -> KeyQuota:
        return KeyQuota.model_validate(self.quota) if self.quota else UNLIMITED


def _lookup(records: Iterable[KeyRecord], key: str) -> str | None:
    """Constant-time over all records: no early exit, compare_digest on every hash."""
    digest = key_digest(key)
    found: str | None = None
    for rec in records:
        if hmac.compare_digest(rec.sha256, digest):
            found = rec.owner
    return found


class StaticKeys:
    """A fixed, in-memory set of keys (tests, schema generation); ``operators`` are the
    operator's keys (none by default)."""

    def __init__(self, keys: Iterable[str], operators: Iterable[str] = ()) -> None:
        self._records = [KeyRecord(owner_id(k), key_digest(k), time.time()) for k in keys]
        self._operators = {owner_id(k) for k in operators}

    def verify(self, key: str) -> str | None:
        return _lookup(self._records, key)

    def is_operator(self, owner: str) -> bool:
        return owner in self._operators

    def has_owner(self, owner: str) -> bool:
        return any(r.owner == owner for r in self._records)

    def quota_of(self, owner: str) -> KeyQuota:
        """:class:`~dsec.edge.quotas.KeyQuotas`: no limits."""
        return UNLIMITED


class KeyStore:
    """Keys stored under a state directory (see the module docstring).

    Creating a ``KeyStore`` on a directory that has no keys yet generates the first key
    and writes it to ``<state_dir>/api_key`` (mode 0600). If ``api_key`` already exists
    (e.g. provisioned by an operator) its hash is registered instead.

    Args:
        state_dir: the node's state directory, normally ``$DSEC_HOME``. Created (0700)
            if missing.
    """

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        self.key_file = self.state_dir / "api_key"
        self.db_file = self.state_dir / "api_keys.json"
        self._lock = threading.Lock()
        self._records: list[KeyRecord] = []
        self._quotas: dict[str, KeyQuota] = {}
        self._version: tuple[int, int, int] | None = None
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._reload()
        if not self._records:
            self._bootstrap()

    # --- persistence --------------------------------------------------------
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Thread lock + an flock shared with other processes (read-modify-write of the file)."""
        with self._lock:
            fd = os.open(self.state_dir / ".api_keys.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def _reload(self, force: bool = False) -> None:
        """Re-read the keys file if it changed (always, with ``force``)."""
        try:
            st = self.db_file.stat()
        except FileNotFoundError:
            self._records, self._version = [], None
            return
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if version == self._version and not force:
            return
        raw = json.loads(self.db_file.read_text())
        entries = raw.get("keys", [])
        fields = set(KeyRecord.__dataclass_fields__)
        self._records = [KeyRecord(**{k: v for k, v in r.items() if k in fields}) for r in entries]
        if self._records and not any("role" in r for r in entries):
            # a store written before keys had roles: its first key is the node's own
            self._records[0] = replace(self._records[0], role="operator")
        self._quotas = self._parse_quotas()
        self._version = version

    def _parse_quotas(self) -> dict[str, KeyQuota]:
        out: dict[str, KeyQuota] = {}
        for r in self._records:
            if r.quota:
                try:
                    out[r.owner] = r.key_quota()
                except ValueError as e:  # a hand-edited file: say so, keep serving
                    log.error("api_keys.json: key %s has an invalid quota (%s)", r.owner, e)
        return out

    def _save(self) -> None:
        tmp = self.db_file.with_name(f".{self.db_file.name}.{os.getpid()}.tmp")
        body = json.dumps({"keys": [asdict(r) for r in self._records]}, indent=2) + "\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.db_file)
        self._quotas = self._parse_quotas()
        st = self.db_file.stat()
        self._version = (st.st_ino, st.st_mtime_ns, st.st_size)

    def _bootstrap(self) -> None:
        with self._exclusive():
            self._reload(force=True)
            if self._records:  # another process bootstrapped first
                return
            try:
                key = self.key_file.read_text().strip()
            except FileNotFoundError:
                key = ""
            if not key:
                key = generate_key()
                fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(key + "\n")
            os.chmod(self.key_file, 0o600)
            self._records.append(
                KeyRecord(owner_id(key), key_digest(key), time.time(), "default", "operator")
            )
            self._save()

    # --- API ----------------------------------------------------------------
    def verify(self, key: str) -> str | None:
        """The owner id of ``key`` (or of its E2B form), or None if it is not a valid
        (unrevoked) key."""
        if not key or len(key) > len(E2B_PREFIX) + 2 * MAX_KEY_CHARS:
            return None
        if len(canonical_key(key)) > MAX_KEY_CHARS:
            return None
        with self._lock:
            self._reload()
            records = list(self._records)
        return _lookup(records, key)

    def is_operator(self, owner: str) -> bool:
        """Whether ``owner`` is one of the operator's keys (see :class:`KeyRecord`)."""
        with self._lock:
            self._reload()
            return any(r.owner == owner and r.role == "operator" for r in self._records)

    def has_owner(self, owner: str) -> bool:
        """:class:`KeyDirectory`: whether ``owner`` has an unrevoked key."""
        with self._lock:
            self._reload()
            return any(r.owner == owner for r in self._records)

    def quota_of(self, owner: str) -> KeyQuota:
        """:class:`~dsec.edge.quotas.KeyQuotas`: ``owner``'s quota (``UNLIMITED``: none)."""
        with self._lock:
            self._reload()
            return self._quotas.get(owner, UNLIMITED)

    def create_key(
        self, name: str = "", *, operator: bool = False, quota: KeyQuota | None = None
    ) -> str:
        """Generate, register and return a new key (``operator``: with the operator's
        rights; ``quota``: its limits). The plaintext is not stored: keep it."""
        key = generate_key()
        role = "operator" if operator else "user"
        with self._exclusive():
            self._reload(force=True)
            self._records.append(
                KeyRecord(owner_id(key), key_digest(key), time.time(), name, role, _stored(quota))
            )
            self._save()
        return key

    def set_quota(self, key_or_owner: str, quota: KeyQuota) -> KeyRecord:
        """Replace the quota of a key (given as the key or its owner id); running servers
        apply it to their next creation. Raises ``KeyError`` if there is no such key."""
        with self._exclusive():
            self._reload(force=True)
            for i, r in enumerate(self._records):
                if r.owner == key_or_owner or hmac.compare_digest(
                    r.sha256, key_digest(key_or_owner)
                ):
                    self._records[i] = replace(r, quota=_stored(quota))
                    self._save()
                    return self._records[i]
        raise KeyError(key_or_owner)

    def revoke(self, key_or_owner: str) -> bool:
        """Revoke a key given the key itself or its owner id. True if something was revoked."""
        with self._exclusive():
            self._reload(force=True)
            keep = [
                r
                for r in self._records
                if r.owner != key_or_owner
                and not hmac.compare_digest(r.sha256, key_digest(key_or_owner))
            ]
            changed = len(keep) != len(self._records)
            if changed:
                self._records = keep
                self._save()
        return changed

    def list(self) -> list[KeyRecord]:
        """Every registered key record (owner ids and hashes, never keys)."""
        with self._lock:
            self._reload()
            return list(self._records)


def _stored(quota: KeyQuota | None) -> dict[str, Any]:
    """A quota as ``api_keys.json`` keeps it: only what differs from no limits."""
    if quota is None:
        return {}
    return quota.model_dump(mode="json", exclude_defaults=True)
