"""Dashboard sessions: a signed cookie in place of the API key, and CSRF protection.

Sign-in (``POST /ui/login``) verifies an API key once and answers with a session cookie; the
key itself is never stored, in the page or in the cookie. The cookie is stateless, so any
apiserver replica that shares the signing secret accepts it::

    dsec_session = v1.<base64url(JSON payload)>.<base64url(HMAC-SHA256(secret, payload))>
    payload      = {"o": owner id, "iat": unix s, "exp": unix s, "n": random nonce}

It is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page makes the
browser send it), ``Secure`` when the request came over TLS, ``Path=/`` (the page calls the
``/v1`` API with it). A cookie whose signature does not verify, that has expired, whose
nonce was signed out on this replica, or whose owner has no key any more (a revoked key, for
key stores that can say so: :class:`dsec.apiserver.auth.KeyDirectory`) is refused with
``401 unauthenticated`` and the page goes back to sign-in.

CSRF: a request authenticated by the cookie that changes state (anything but ``GET``,
``HEAD``, ``OPTIONS``) must carry ``X-Dsec-CSRF: <token>``, the token ``GET /ui/api/session``
gives the page (an HMAC of the nonce: a third-party page can neither read it nor derive
it), and an ``Origin`` header, when sent, must name this server. The sign-in form itself is
protected by a double-submitted token (a ``SameSite=Strict`` cookie matched against a hidden
field), so no other site can sign a browser in with a key of its choosing.

The secret: ``DSEC_UI_SECRET`` (hex, at least 32 bytes: what replicas behind one load
balancer share), else ``$DSEC_HOME/ui_secret`` (32 random bytes, mode 0600, made on first
start), else a random one per process (sessions then end with the process).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.types import Scope

from dsec.apiserver.auth import KeyDirectory, KeyVerifier
from dsec.errors import AuthenticationError, InvalidRequest, PermissionDenied

__all__ = [
    "COOKIE",
    "CSRF_HEADER",
    "LOGIN_COOKIE",
    "Session",
    "SessionAuthority",
    "load_secret",
]

COOKIE = "dsec_session"
LOGIN_COOKIE = "dsec_login"
CSRF_HEADER = "x-dsec-csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_TTL_S = 8 * 3600.0


def load_secret(home: Path | None) -> bytes:
    """The signing secret: ``$DSEC_UI_SECRET`` (hex), else ``home/ui_secret`` (created
    0600), else a fresh random one (see the module docstring)."""
    raw = os.environ.get("DSEC_UI_SECRET", "").strip()
    if raw:
        try:
            secret = bytes.fromhex(raw)
        except ValueError:
            raise InvalidRequest("DSEC_UI_SECRET must be hex (at least 64 digits)") from None
        if len(secret) < 32:
            raise InvalidRequest("DSEC_UI_SECRET must be at least 32 bytes (64 hex digits)")
        return secret
    if home is None:
        return secrets.token_bytes(32)
    path = home / "ui_secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) >= 32:
            return secret
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        secret = secrets.token_bytes(32)
        f.write(secret)
    return secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Session:
    """A verified session: whose it is, when it ends (unix s) and its nonce."""

    owner: str
    expires_at: float
    nonce: str


def _cookies(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            k, sep, v = part.strip().partition("=")
            if sep and k not in out:
                out[k] = v
    return out


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def _same_host(origin: str, scope: Scope) -> bool:
    """Whether an ``Origin`` names the host this request was sent to (any scheme: a TLS
    proxy in front of the server changes it)."""
    host = (_header(scope, b"host") or "").lower()
    return bool(host) and urlsplit(origin).netloc.lower() == host


class SessionAuthority:
    """Issues and checks dashboard sessions (see the module docstring).

    Args:
        keys: the app's key verifier (sign-in; revocation where it is a ``KeyDirectory``).
        secret: the signing secret (:func:`load_secret`).
        ttl_s: how long a session lasts, seconds.
    """

    def __init__(self, keys: KeyVerifier, secret: bytes, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.keys = keys
        self._secret = secret
        self.ttl_s = ttl_s
        self._signed_out: dict[str, float] = {}  # nonce -> expiry
        self._lock = threading.Lock()

    # --- tokens -------------------------------------------------------------------------
    def _mac(self, purpose: bytes, data: bytes) -> bytes:
        return hmac.new(self._secret, purpose + b"\0" + data, hashlib.sha256).digest()

    def issue(self, owner: str, *, now: float | None = None) -> tuple[str, Session]:
        """A new session for ``owner``: the cookie value and the session."""
        now = time.time() if now is None else now
        session = Session(owner, now + self.ttl_s, secrets.token_urlsafe(16))
        payload = json.dumps(
            {"o": owner, "iat": int(now), "exp": int(session.expires_at), "n": session.nonce},
            separators=(",", ":"),
        ).encode()
        return f"v1.{_b64(payload)}.{_b64(self._mac(b'session', payload))}", session

    def verify(self, cookie: str, *, now: float | None = None) -> Session:
        """The session a cookie value stands for; ``AuthenticationError`` if it is forged,
        expired, signed out or its owner's key is gone."""
        now = time.time() if now is None else now
        try:
            version, body, mac = cookie.split(".")
            payload = _unb64(body)
            good = hmac.compare_digest(_unb64(mac), self._mac(b"session", payload))
            data: Any = json.loads(payload) if good and version == "v1" else None
        except (ValueError, binascii.Error, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            raise AuthenticationError("invalid session: sign in again")
        owner, exp, nonce = data.get("o"), data.get("exp"), data.get("n")
        if not isinstance(owner, str) or not isinstance(exp, int) or not isinstance(nonce, str):
            raise AuthenticationError("invalid session: sign in again")
        if exp <= now:
            raise AuthenticationError("session expired: sign in again")
        with self._lock:
            if nonce in self._signed_out:
                raise AuthenticationError("signed out: sign in again")
        if isinstance(self.keys, KeyDirectory) and not self.keys.has_owner(owner):
            raise AuthenticationError("the key of this session was revoked: sign in again")
        return Session(owner, float(exp), nonce)

    def csrf_token(self, session: Session) -> str:
        """The token state-changing requests of this session carry in ``X-Dsec-CSRF``."""
        return _b64(self._mac(b"csrf", session.nonce.encode()))

    def sign_out(self, session: Session) -> None:
        """Refuse this session from now on (on this replica; it also ends at its expiry)."""
        now = time.time()
        with self._lock:
            self._signed_out = {n: e for n, e in self._signed_out.items() if e > now}
            self._signed_out[session.nonce] = session.expires_at

    def login_token(self) -> str:
        """A fresh token for the sign-in form (double-submitted: cookie and field)."""
        return secrets.token_urlsafe(24)

    # --- requests -----------------------------------------------------------------------
    def check_origin(self, scope: Scope) -> None:
        """``PermissionDenied`` if the request names an ``Origin`` other than this server."""
        origin = _header(scope, b"origin")
        if origin is not None and not _same_host(origin, scope):
            raise PermissionDenied("cross-origin request refused")

    def authenticate(self, scope: Scope) -> Session | None:
        """The session of an HTTP request, None if it carries no session cookie. Raises
        ``AuthenticationError`` for a bad cookie and ``PermissionDenied`` for a
        state-changing request without the CSRF token or from another origin."""
        cookie = _cookies(scope).get(COOKIE)
        if not cookie:
            return None
        session = self.verify(cookie)
        if scope.get("method", "GET") not in SAFE_METHODS:
            self.check_origin(scope)
            token = _header(scope, CSRF_HEADER.encode())
            if token is None or not hmac.compare_digest(token, self.csrf_token(session)):
                raise PermissionDenied(
                    f"missing or wrong {CSRF_HEADER} header (requests the dashboard makes "
                    "carry it; an API client sends Authorization: Bearer instead)"
                )
        return session

    def session_of(self, scope: Scope) -> Session | None:
        """Like :meth:`authenticate` for safe reads, without raising: None if absent or bad."""
        try:
            cookie = _cookies(scope).get(COOKIE)
            return self.verify(cookie) if cookie else None
        except AuthenticationError:
            return None

    @staticmethod
    def cookie_value(scope: Scope, name: str) -> str | None:
        return _cookies(scope).get(name)
