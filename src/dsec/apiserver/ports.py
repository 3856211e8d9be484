"""The port proxy: HTTP, WebSocket and raw TCP from clients to TCP ports inside sandboxes.

A server inside a sandbox (``python3 -m http.server 8000``, a Jupyter kernel gateway,
noVNC's websockify, ``swerex-remote``) is reached through the apiserver, never directly:
the edge opens the TCP connection from inside the sandbox
(:class:`~dsec.contract.edge.PortForwarding`), so it works for a sandbox without any
network and nothing else on the node can reach a sandbox's address.

Routes (every one ends at ``127.0.0.1:<port>`` inside the sandbox)::

    path     /v1/sandboxes/{sandbox_id}/ports/{port}/{path}     HTTP and WebSocket
    host     {port}-{sandbox_id}.<DSEC_PORTS_DOMAIN>/{path}     HTTP and WebSocket, TLS too
    E2B      /e2b/envd/{path} with E2b-Sandbox-Id and            what e2b-code-interpreter
             E2b-Sandbox-Port headers (port != 49983)            sends (its E2B_SANDBOX_URL)
    raw TCP  /v1/sandboxes/{sandbox_id}/tcp/{port}               a WebSocket whose binary
                                                                 messages are the bytes
                                                                 (``dsec port-forward``)

A host-routed request for port 49983 (E2B's envd port) is the E2B in-sandbox API itself
(``/e2b/envd``), so the e2b SDK works with ``E2B_DOMAIN`` alone.

Credentials, any one of (checked in this order; whatever is dsec's is removed before the
request reaches the sandbox):

* the sandbox's access token (:class:`PortTokens`) in the URL: a ``/_dsec_token/<token>``
  first path segment (for clients that append paths to a base URL and send no headers of
  ours, such as SWE-ReX's ``RemoteRuntime``) or a ``dsec_token`` query parameter. It is
  taken off the URL whatever headers come with it (an ``Authorization`` of the client's
  own does not make the sandbox's server see ``/_dsec_token/...``), and sets the cookie on
  the answer, so a browser that opened ``get_url(6080, "/vnc.html")`` keeps access for the
  page's other requests and its WebSocket (``HttpOnly``, ``SameSite=Lax``, ``Secure`` over
  TLS, scoped to the host, or to the port's path prefix on path routes);
* ``Authorization: Bearer <API key>`` of the sandbox's owner (or the key's E2B form);
* the access token in a header: ``Authorization: Bearer <token>``, ``X-Dsec-Port-Token``
  or ``E2B-Traffic-Access-Token``;
* E2B's ``X-Access-Token`` (the ``envdAccessToken``) on E2B-routed requests;
* the ``dsec_port_token`` cookie;
* none, for a sandbox created with ``public_ports=True``: its id then carries 96 random
  bits and is the secret (anyone who has the URL reaches its ports).

Answers of the proxy itself are JSON errors: 400 bad port (0, > 65535, not a number), 401
no valid credential on a ``/v1`` route (as the rest of dsec's API), 403 no valid
credential on a host or E2B route (as E2B's proxy answers a missing or wrong traffic
token), 404 a sandbox that does not exist or belongs to another key (the same
answer), 429 too many connections to that sandbox, 502 nothing listens on the port (or
the server there closed without answering), 503 the sandbox's node is unreachable. A
paused sandbox is resumed by the connection. Everything else comes from the sandbox's
server, streamed both ways without buffering (chunked bodies, server-sent events,
long polls).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httptools
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.apiserver.auth import KeyVerifier
from dsec.contract.edge import EdgeAPI, PortForwarding, PortStream
from dsec.edge.ports import check_port
from dsec.errors import (
    AuthenticationError,
    BadGateway,
    CapabilityNotSupported,
    DsecError,
    InternalError,
    InvalidRequest,
    PermissionDenied,
    SandboxNotFound,
)

__all__ = [
    "COOKIE_NAME",
    "ENVD_PORT",
    "HOST_ROUTE",
    "PATH_ROUTE",
    "TCP_ROUTE",
    "TOKEN_PATH_PREFIX",
    "TOKEN_QUERY",
    "PortProxy",
    "PortTokens",
    "PortsDispatch",
    "ports_domain_from_env",
]

log = logging.getLogger("dsec.ports")

PATH_ROUTE = "/v1/sandboxes/{sandbox_id}/ports/{port}/{path}"
HOST_ROUTE = "{port}-{sandbox_id}.<ports domain>/{path}"
E2B_ROUTE = "/e2b/envd/{path} (E2b-Sandbox-Port)"
TCP_ROUTE = "/v1/sandboxes/{sandbox_id}/tcp/{port}"
COOKIE_NAME = "dsec_port_token"
TOKEN_QUERY = "dsec_token"
TOKEN_PATH_PREFIX = "/_dsec_token/"
TOKEN_HEADERS = (b"x-dsec-port-token", b"e2b-traffic-access-token")
ENVD_PORT = 49983
"""E2B's in-sandbox API port: a request for it is envd (``/e2b/envd``), not a proxy."""
READ_CHUNK = 1024 * 1024

_PATH_RE = re.compile(r"^/v1/sandboxes/(?P<sid>[^/]+)/ports/(?P<port>[^/]+)(?P<rest>/.*)?$")
_TCP_RE = re.compile(r"^/v1/sandboxes/(?P<sid>[^/]+)/tcp/(?P<port>[^/]+)/?$")
_SANDBOX_ID_RE = re.compile(r"^sb-[a-z0-9]{1,12}-[0-9a-f]{1,32}$")
_HOST_LABEL_RE = re.compile(r"^(?P<port>[0-9]{1,6})-(?P<sid>sb-[a-z0-9]{1,12}-[0-9a-f]{1,32})$")
_TOKEN_SEGMENT_RE = re.compile(r"^/_dsec_token/(?P<token>[A-Za-z0-9_=.-]{1,256})(?P<rest>/.*)?$")
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_WS_HANDSHAKE = frozenset(
    {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions"}
)


def ports_domain_from_env() -> str | None:
    """``DSEC_PORTS_DOMAIN``: the domain of host-routed ports, as clients write it
    (``ports.example.com``, or ``ports.test:8443`` when the TLS listener is not on 443),
    lower case, no scheme; None when unset (path routes only)."""
    raw = os.environ.get("DSEC_PORTS_DOMAIN", "").strip().lower().rstrip(".")
    if not raw:
        return None
    if "/" in raw or not re.fullmatch(r"[a-z0-9.-]+(:[0-9]{1,5})?", raw):
        raise InvalidRequest(f"DSEC_PORTS_DOMAIN must be a domain name[:port], not {raw!r}")
    return raw


class PortTokens:
    """Per-sandbox access tokens: ``<owner, base64url>.<HMAC-SHA256 of sandbox id and owner
    under a server secret, hex>``. Stateless (any replica with the secret checks one), one
    per sandbox (good for all its ports, for the sandbox's life), never valid for another
    sandbox.

    Args:
        secret: the HMAC key; give every apiserver replica the same one
            (``DSEC_PORTS_SECRET``, or ``$DSEC_HOME/ports_secret`` shared).
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise InvalidRequest("the port token secret needs at least 16 bytes")
        self._secret = secret

    @classmethod
    def from_home(cls, home: Path | None) -> PortTokens:
        """The secret from ``DSEC_PORTS_SECRET``, else from ``<home>/ports_secret``
        (created, mode 0600, at first use), else a random one for this process."""
        env = os.environ.get("DSEC_PORTS_SECRET", "")
        if env:
            return cls(env.encode())
        if home is None:
            return cls(secrets.token_bytes(32))
        path = Path(home) / "ports_secret"
        try:
            return cls(path.read_bytes().strip())
        except FileNotFoundError:
            pass
        value = secrets.token_hex(32).encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process won the race
            return cls(path.read_bytes().strip())
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        return cls(value)

    def _mac(self, sandbox_id: str, owner: str) -> str:
        msg = f"dsec-ports\0{sandbox_id}\0{owner}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def issue(self, sandbox_id: str, owner: str) -> str:
        """The token with which anyone reaches ``sandbox_id``'s ports as ``owner``."""
        owner_b64 = base64.urlsafe_b64encode(owner.encode()).decode().rstrip("=")
        return f"{owner_b64}.{self._mac(sandbox_id, owner)}"

    def verify(self, sandbox_id: str, token: str) -> str | None:
        """The owner ``token`` was issued to for ``sandbox_id``, or None."""
        owner_b64, sep, mac = token.partition(".")
        if not sep or len(mac) != 64 or not 0 < len(owner_b64) <= 256:
            return None
        try:
            owner = base64.urlsafe_b64decode(owner_b64 + "=" * (-len(owner_b64) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        if not hmac.compare_digest(mac, self._mac(sandbox_id, owner)):
            return None
        return owner


@dataclass
class _Target:
    """One request for the proxy: where it goes and what reaches the sandbox."""

    sandbox_id: str
    port_text: str
    path: str  # the path the sandbox's server sees (with the query string)
    route: str  # the route template (metrics, access log)
    cookie_path: str  # where a token cookie applies
    via_e2b: bool = False
    tcp: bool = False


class PortProxy:
    """Relays requests to sandbox ports (see the module docstring).

    Args:
        edge: the edge; it must implement :class:`~dsec.contract.edge.PortForwarding`
            (otherwise every proxied request answers 422 ``capability_not_supported``).
        keys: API keys (``Authorization: Bearer``).
        tokens: the per-sandbox access tokens.
        domain: ``DSEC_PORTS_DOMAIN`` (None: no host routing).
        host_scheme: what clients use for host routes (``https`` behind the TLS listener).
        envd_verify: ``(sandbox_id, X-Access-Token) -> owner | None`` of the E2B API
            (None: E2B-routed requests need one of dsec's credentials).
    """

    def __init__(
        self,
        edge: EdgeAPI,
        keys: KeyVerifier,
        tokens: PortTokens,
        *,
        domain: str | None = None,
        host_scheme: str = "https",
        envd_verify: Callable[[str, str], str | None] | None = None,
    ) -> None:
        self.edge = edge
        self.host_scheme = host_scheme
        self.keys = keys
        self.tokens = tokens
        self.domain = domain
        self.domain_host = domain.rsplit(":", 1)[0] if domain and ":" in domain else domain
        self.envd_verify = envd_verify
        self._public: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.open_connections = 0
        """Client connections being relayed now (HTTP requests, WebSockets, TCP)."""

    # ------------------------------------------------------------------ routing
    def host_target(self, scope: Scope) -> tuple[str, str] | None:
        """``(port text, sandbox id)`` when the request's Host is ``{port}-{id}.<domain>``
        (any label before the domain: a malformed one is answered by the proxy)."""
        if not self.domain_host:
            return None
        host = _header(scope, b"host")
        if not host:
            return None
        text = host.decode("latin-1").lower()
        name = text.rsplit(":", 1)[0] if ":" in text else text
        suffix = "." + self.domain_host
        if not name.endswith(suffix):
            return None
        label = name[: -len(suffix)]
        m = _HOST_LABEL_RE.match(label)
        if m is None:
            return ("", label)  # ours, but not a sandbox port host: 404 below
        return m["port"], m["sid"]

    def target(self, scope: Scope) -> _Target | None:
        """What the proxy does with this request, or None (not a proxied request)."""
        if scope["type"] not in ("http", "websocket"):
            return None
        path: str = scope.get("path", "")
        query = scope.get("query_string", b"")
        qs = ("?" + query.decode("latin-1")) if query else ""
        hosted = self.host_target(scope)
        if hosted is not None:
            port, sid = hosted
            return _Target(
                sid,
                port,
                (scope.get("raw_path") or path.encode()).decode("latin-1").split("?", 1)[0] + qs,
                HOST_ROUTE,
                "/",
            )
        m = _PATH_RE.match(path)
        if m is not None:
            raw = (scope.get("raw_path") or path.encode()).decode("latin-1").split("?", 1)[0]
            prefix = f"/v1/sandboxes/{m['sid']}/ports/{m['port']}"
            rest = raw[len(prefix) :] if raw.startswith(prefix) else (m["rest"] or "")
            return _Target(m["sid"], m["port"], (rest or "/") + qs, PATH_ROUTE, prefix + "/")
        m = _TCP_RE.match(path)
        if m is not None:
            return _Target(m["sid"], m["port"], "/", TCP_ROUTE, "/", tcp=True)
        if path == "/e2b/envd" or path.startswith("/e2b/envd/"):
            wanted = _header(scope, b"e2b-sandbox-port")
            if wanted is not None and wanted.strip() != str(ENVD_PORT).encode():
                sid = (_header(scope, b"e2b-sandbox-id") or b"").decode("latin-1").strip()
                rest = path[len("/e2b/envd") :] or "/"
                return _Target(
                    sid, wanted.decode("latin-1").strip(), rest + qs, E2B_ROUTE, "/", via_e2b=True
                )
        return None

    def route_of(self, scope: Scope) -> str | None:
        """The route template of a proxied request (None: not one): the apiserver's
        middleware skips its own key check and body limit for these."""
        if scope["type"] != "http":
            return None
        t = self.target(scope)
        if t is None:
            return None
        if t.route == HOST_ROUTE and t.port_text == str(ENVD_PORT):
            return None  # envd itself, through the E2B app
        return t.route

    # ------------------------------------------------------------------ access
    def _credentials(self, scope: Scope, target: _Target) -> tuple[str | None, str | None, _Target]:
        """``(owner or None, a token that arrived in the URL (to set as a cookie) or None,
        the target with dsec's URL credential removed)``.

        A valid token in the URL comes first and is always taken off the path, whatever
        else the request carries: a client that adds its own ``Authorization: Bearer
        <key>`` to a URL of ``sb.get_url()`` reaches the path it meant, not
        ``/_dsec_token/...`` (the URL is the credential it was given)."""
        sid = target.sandbox_id
        owner, url_token, target = self._url_credential(sid, target)
        if owner is not None:
            return owner, url_token, target
        auth = _header(scope, b"authorization")
        if auth is not None:
            scheme, _, value = auth.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                value = value.strip()
                owner = self.keys.verify(value) or self.tokens.verify(sid, value)
                if owner is not None:
                    return owner, None, target
        for name in TOKEN_HEADERS:
            value_b = _header(scope, name)
            if value_b:
                owner = self.tokens.verify(sid, value_b.decode("latin-1").strip())
                if owner is not None:
                    return owner, None, target
        if target.via_e2b and self.envd_verify is not None:
            value_b = _header(scope, b"x-access-token")
            if value_b:
                owner = self.envd_verify(sid, value_b.decode("latin-1").strip())
                if owner is not None:
                    return owner, None, target
        cookie = _header(scope, b"cookie")
        if cookie:
            token = _cookie_value(cookie.decode("latin-1"), COOKIE_NAME)
            if token:
                owner = self.tokens.verify(sid, token)
                if owner is not None:
                    return owner, None, target
        return None, None, target

    def _url_credential(self, sid: str, target: _Target) -> tuple[str | None, str | None, _Target]:
        """A valid token in the URL (a first ``/_dsec_token/<token>`` path segment, else a
        ``dsec_token`` query parameter): ``(its owner, the token, the target without it)``;
        ``(None, None, target)`` when there is none (an invalid one stays in the path)."""
        path, _, query = target.path.partition("?")
        m = _TOKEN_SEGMENT_RE.match(path)
        if m is not None:
            owner = self.tokens.verify(sid, m["token"])
            if owner is not None:
                new_path = (m["rest"] or "/") + (("?" + query) if query else "")
                return owner, m["token"], _replace(target, path=new_path)
        if query and TOKEN_QUERY in query:
            pairs = parse_qsl(query, keep_blank_values=True)
            found = [v for k, v in pairs if k == TOKEN_QUERY]
            if found:
                owner = self.tokens.verify(sid, found[0])
                if owner is not None:
                    rest = [(k, v) for k, v in pairs if k != TOKEN_QUERY]
                    new_path = path + (("?" + urlencode(rest)) if rest else "")
                    return owner, found[0], _replace(target, path=new_path)
        return None, None, target

    async def _public_owner(self, sandbox_id: str) -> str | None:
        """The owner of a sandbox created with ``public_ports`` (cached 10 s), else None."""
        cached = self._public.get(sandbox_id)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        if not isinstance(self.edge, PortForwarding):
            return None
        try:
            owner = await self.edge.public_port_owner(sandbox_id)
        except DsecError:
            return None
        self._public[sandbox_id] = (owner, now + 10.0)
        while len(self._public) > 4096:
            self._public.popitem(last=False)
        return owner

    async def _authorize(self, scope: Scope, target: _Target) -> tuple[str, str | None, _Target]:
        if not _SANDBOX_ID_RE.match(target.sandbox_id):
            if target.via_e2b and not target.sandbox_id:
                raise InvalidRequest("missing E2b-Sandbox-Id header")
            raise SandboxNotFound(f"sandbox {target.sandbox_id[:80]} not found")
        check_port(target.port_text)
        owner, url_token, target = self._credentials(scope, target)
        if owner is None:
            owner = await self._public_owner(target.sandbox_id)
        if owner is None:
            message = (
                "this sandbox port needs a credential: 'Authorization: Bearer <key>', the "
                "sandbox's access token (X-Dsec-Port-Token or E2B-Traffic-Access-Token "
                "header, dsec_port_token cookie, ?dsec_token= or a /_dsec_token/<token> path "
                "prefix; see sb.get_url()), or a sandbox created with public_ports=True"
            )
            if target.route == PATH_ROUTE or target.tcp:
                raise AuthenticationError(message)  # dsec's API: no valid key is 401
            # the routes E2B's clients use: E2B's proxy answers a missing or wrong
            # traffic token with 403
            raise PermissionDenied(message)
        scope.setdefault("state", {})["owner"] = owner
        return owner, url_token, target

    async def _open(self, sandbox_id: str, owner: str, port: int) -> PortStream:
        if not isinstance(self.edge, PortForwarding):
            raise CapabilityNotSupported("this server's edge cannot connect to sandbox ports")
        return await self.edge.open_port(sandbox_id, owner, port)

    # ------------------------------------------------------------------ ASGI
    async def handle(self, scope: Scope, receive: Receive, send: Send, target: _Target) -> None:
        """Serve one proxied request or WebSocket (``target`` from :meth:`target`)."""
        self.open_connections += 1
        try:
            if scope["type"] == "websocket":
                await self._websocket(scope, receive, send, target)
            else:
                await self._http(scope, receive, send, target)
        finally:
            self.open_connections -= 1

    async def _http(self, scope: Scope, receive: Receive, send: Send, target: _Target) -> None:
        started = [False]

        async def send_tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            owner, url_token, target = await self._authorize(scope, target)
            if target.tcp:
                raise InvalidRequest(f"{TCP_ROUTE} is a WebSocket route (raw TCP bytes)")
            port = check_port(target.port_text)
            stream = await self._open(target.sandbox_id, owner, port)
        except DsecError as e:
            await _send_error(send, e)
            return
        cookie = self._cookie(scope, target, url_token) if url_token else None
        try:
            await _HttpExchange(scope, receive, send_tracked, stream, target, cookie).run()
        except DsecError as e:
            if not started[0]:
                await _send_error(send, e)
        except Exception:
            if not started[0]:
                log.exception("port proxy failed")
                await _send_error(send, InternalError("the port proxy failed (see server log)"))
        finally:
            await stream.close()

    def _cookie(self, scope: Scope, target: _Target, token: str) -> bytes:
        secure = "; Secure" if scope.get("scheme") in ("https", "wss") else ""
        return (
            f"{COOKIE_NAME}={token}; Path={target.cookie_path}; HttpOnly; SameSite=Lax{secure}"
        ).encode("latin-1")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, target: _Target) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        try:
            owner, _, target = await self._authorize(scope, target)
            port = check_port(target.port_text)
            stream = await self._open(target.sandbox_id, owner, port)
        except DsecError as e:
            await _deny_websocket(scope, send, e)
            return
        try:
            if target.tcp:
                await _tcp_over_websocket(receive, send, stream)
            else:
                await _WebSocketBridge(scope, receive, send, stream, target).run()
        finally:
            await stream.close()


def _replace(target: _Target, **changes: Any) -> _Target:
    from dataclasses import replace

    return replace(target, **changes)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return bytes(v)
    return None


def _cookie_value(header: str, name: str) -> str | None:
    try:
        jar: SimpleCookie = SimpleCookie()
        jar.load(header)
    except Exception:  # a malformed Cookie header is the app's business, not ours
        for part in header.split(";"):
            k, _, v = part.strip().partition("=")
            if k == name:
                return v
        return None
    morsel = jar.get(name)
    return morsel.value if morsel is not None else None


def _strip_cookie(header: bytes) -> bytes | None:
    """The Cookie header without dsec's own cookie (None: nothing left)."""
    parts = [
        p
        for p in header.split(b";")
        if p.strip() and not p.strip().startswith(COOKIE_NAME.encode() + b"=")
    ]
    return b";".join(parts).strip() or None


def _forward_headers(
    scope: Scope, target: _Target, *, websocket: bool = False
) -> list[tuple[bytes, bytes]]:
    """The client's headers as the sandbox's server gets them: hop-by-hop headers and
    dsec's credentials removed, ``X-Forwarded-*`` added."""
    out: list[tuple[bytes, bytes]] = []
    host = b""
    forwarded_for = b""
    drop = _HOP_BY_HOP | set(TOKEN_HEADERS) | (_WS_HANDSHAKE if websocket else frozenset())
    if target.via_e2b:
        drop = drop | {b"x-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port"}
    for k, v in scope.get("headers", ()):
        if k == b"host":
            host = v
        if k in drop:
            continue
        if k == b"authorization" and _is_dsec_bearer(v):
            continue
        if k == b"cookie":
            stripped = _strip_cookie(v)
            if stripped is None:
                continue
            v = stripped
        if k == b"x-forwarded-for":
            forwarded_for = v + b", "
            continue
        out.append((k, v))
    client = scope.get("client")
    if client:
        out.append((b"x-forwarded-for", forwarded_for + str(client[0]).encode()))
    if host:
        out.append((b"x-forwarded-host", host))
    out.append(
        (b"x-forwarded-proto", b"https" if scope.get("scheme") in ("https", "wss") else b"http")
    )
    if target.route == PATH_ROUTE:
        out.append((b"x-forwarded-prefix", target.cookie_path.rstrip("/").encode()))
    out.insert(0, (b"host", host or b"localhost"))
    return out


_DSEC_BEARER = re.compile(
    rb"^\s*bearer\s+(dsec_[A-Za-z0-9_-]{20,}|e2b_647365635f(?:[0-9a-f]{2}){20,}"
    rb"|[A-Za-z0-9_-]{1,256}\.[0-9a-f]{64})\s*$",
    re.I,
)


def _is_dsec_bearer(value: bytes) -> bool:
    """Whether an Authorization header carries a dsec key (also in its E2B form,
    ``e2b_`` + the hex of ``dsec_...``) or port token (never forwarded; any other
    Authorization is the sandbox app's own and passes)."""
    return _DSEC_BEARER.match(value) is not None


async def _send_error(send: Send, err: DsecError) -> None:
    body = json.dumps(err.to_wire()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    retry = err.details.get("retry_after_s")
    if isinstance(retry, int | float) and not isinstance(retry, bool):
        headers.append((b"retry-after", str(max(1, round(retry))).encode()))
    await send({"type": "http.response.start", "status": err.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _deny_websocket(scope: Scope, send: Send, err: DsecError) -> None:
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = json.dumps(err.to_wire()).encode()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": err.http_status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": err.code})


class _ResponseHead:
    """httptools callbacks collecting one response (head, then body pieces)."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.body: list[bytes] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class _HttpExchange:
    """One HTTP request relayed to the sandbox and its answer streamed back."""

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        stream: PortStream,
        target: _Target,
        cookie: bytes | None,
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.stream = stream
        self.target = target
        self.cookie = cookie
        self.disconnected = asyncio.Event()

    def _request_head(self) -> tuple[bytes, bool]:
        """The request line and headers, and whether the body goes chunked."""
        method = str(self.scope.get("method", "GET")).encode()
        headers = _forward_headers(self.scope, self.target)
        length = _header(self.scope, b"content-length")
        chunked = False
        if length is not None:
            headers.append((b"content-length", length))
        elif (_header(self.scope, b"transfer-encoding") or b"").lower().strip() == b"chunked":
            headers.append((b"transfer-encoding", b"chunked"))
            chunked = True
        headers.append((b"connection", b"close"))
        lines = [method + b" " + self.target.path.encode("latin-1") + b" HTTP/1.1"]
        lines += [k + b": " + v for k, v in headers]
        return b"\r\n".join(lines) + b"\r\n\r\n", chunked

    async def _pump_body(self, chunked: bool) -> None:
        """Client body -> sandbox, then wait for the client to go away."""
        more = True
        while more:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return
            data = message.get("body", b"")
            more = bool(message.get("more_body", False))
            if data:
                await self.stream.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            await self.stream.write(b"0\r\n\r\n")
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def run(self) -> None:
        head, chunked = self._request_head()
        await self.stream.write(head)
        body_task = asyncio.create_task(self._pump_body(chunked))
        relay_task = asyncio.create_task(self._relay_response())
        try:
            done, _ = await asyncio.wait(
                {relay_task, asyncio.create_task(self.disconnected.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if relay_task in done:
                relay_task.result()
            else:
                relay_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await relay_task
        finally:
            body_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await body_task

    async def _relay_response(self) -> None:
        collector = _ResponseHead()
        parser = httptools.HttpResponseParser(collector)
        head_only = self.scope.get("method") == "HEAD"
        started = False
        while True:
            data = await self.stream.read(READ_CHUNK)
            if not data:
                if not started:
                    raise BadGateway(
                        "the server in the sandbox closed the connection without answering"
                    )
                # a body delimited by the end of the connection (HTTP/1.0 style) ends here
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                raise BadGateway(
                    "the server in the sandbox switched protocols on a plain request"
                ) from None
            except httptools.HttpParserError as e:
                if not started:
                    raise BadGateway(
                        f"the server in the sandbox answered something that is not HTTP: {e}"[:200]
                    ) from None
                return  # mid-body: the client sees a cut answer, as from any origin
            if collector.head_done and not started:
                status = parser.get_status_code()
                if 100 <= status < 200:  # an interim answer (100 Continue): wait for the real one
                    collector = _ResponseHead()
                    parser = httptools.HttpResponseParser(collector)
                    continue
                headers = [
                    (k.lower(), v) for k, v in collector.headers if k.lower() not in _RESPONSE_DROP
                ]
                length = next(
                    (v for k, v in collector.headers if k.lower() == b"content-length"), None
                )
                if length is not None and not any(
                    k.lower() == b"transfer-encoding" for k, _ in collector.headers
                ):
                    headers.append((b"content-length", length))
                if self.cookie is not None:
                    headers.append((b"set-cookie", self.cookie))
                    headers.append((b"referrer-policy", b"same-origin"))
                await self.send(
                    {"type": "http.response.start", "status": status, "headers": headers}
                )
                started = True
                if head_only or status in (204, 304):
                    await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
            if collector.body:
                body = b"".join(collector.body) if len(collector.body) > 1 else collector.body[0]
                collector.body.clear()
                await self.send({"type": "http.response.body", "body": body, "more_body": True})
            if collector.complete:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return


_RESPONSE_DROP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"trailer",
    }
)


class _WebSocketBridge:
    """A client WebSocket (ASGI) relayed message by message to a WebSocket server in the
    sandbox (websockets' sans-I/O client protocol over the port stream)."""

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, stream: PortStream, target: _Target
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.stream = stream
        self.target = target
        self._pending: list[Any] = []  # frames that arrived with the handshake answer

    async def run(self) -> None:
        from websockets.client import ClientProtocol
        from websockets.datastructures import Headers
        from websockets.http11 import Response
        from websockets.uri import parse_uri

        host = (_header(self.scope, b"host") or b"localhost").decode("latin-1")
        path = self.target.path
        offered = [str(p) for p in self.scope.get("subprotocols") or ()]
        proto = ClientProtocol(
            parse_uri(f"ws://{host.split(':')[0] or 'localhost'}{path}"),
            subprotocols=offered or None,  # type: ignore[arg-type]
            max_size=None,
        )
        request = proto.connect()
        headers = Headers()
        for k, v in _forward_headers(self.scope, self.target, websocket=True):
            name = k.decode("latin-1")
            if name.lower() == "host":
                continue
            headers[name] = v.decode("latin-1")
        for name in (
            "Upgrade",
            "Connection",
            "Sec-WebSocket-Key",
            "Sec-WebSocket-Version",
            "Sec-WebSocket-Protocol",
        ):
            if name in headers:
                del headers[name]
            if name in request.headers:
                headers[name] = request.headers[name]
        headers["Host"] = host
        request.headers = headers
        proto.send_request(request)
        await self._flush(proto)
        response: Response | None = None
        while response is None:
            data = await self.stream.read(READ_CHUNK)
            if not data:
                await _deny_websocket(
                    self.scope,
                    self.send,
                    BadGateway("the server in the sandbox closed the WebSocket handshake"),
                )
                return
            proto.receive_data(data)
            for event in proto.events_received():
                if isinstance(event, Response):
                    response = event
                else:
                    self._pending.append(event)
        if response.status_code != 101:
            await self._refused(response)
            return
        if proto.handshake_exc is not None:
            await _deny_websocket(
                self.scope,
                self.send,
                BadGateway(
                    f"the WebSocket server in the sandbox answered a bad handshake: {proto.handshake_exc}"[
                        :300
                    ]
                ),
            )
            return
        subprotocol = response.headers.get("Sec-WebSocket-Protocol")
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if subprotocol:
            accept["subprotocol"] = subprotocol
        await self.send(accept)
        up = asyncio.create_task(self._upstream(proto))
        down = asyncio.create_task(self._downstream(proto))
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                with contextlib.suppress(Exception):
                    t.result()
        finally:
            for t in (up, down):
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(up, down, return_exceptions=True)

    async def _flush(self, proto: Any) -> None:
        for chunk in proto.data_to_send():
            if chunk:
                await self.stream.write(chunk)

    async def _refused(self, response: Any) -> None:
        """The sandbox's server did not accept the WebSocket: its answer goes to the client
        (as a denial response where the server supports it)."""
        if "websocket.http.response" in (self.scope.get("extensions") or {}):
            body = bytes(response.body or b"")
            headers = [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.raw_items()
                if k.lower().encode("latin-1") not in _RESPONSE_DROP
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await self.send(
                {
                    "type": "websocket.http.response.start",
                    "status": response.status_code,
                    "headers": headers,
                }
            )
            await self.send({"type": "websocket.http.response.body", "body": body})
        else:
            await self.send({"type": "websocket.close", "code": 1011})

    async def _upstream(self, proto: Any) -> None:
        """Client -> sandbox."""
        while True:
            message = await self.receive()
            kind = message["type"]
            if kind == "websocket.receive":
                if message.get("bytes") is not None:
                    proto.send_binary(message["bytes"])
                else:
                    proto.send_text((message.get("text") or "").encode())
                await self._flush(proto)
            elif kind == "websocket.disconnect":
                with contextlib.suppress(Exception):
                    proto.send_close(_close_code(message.get("code", 1000)))
                    await self._flush(proto)
                return

    async def _downstream(self, proto: Any) -> None:
        """Sandbox -> client, reassembling fragmented messages."""
        from websockets.frames import Opcode

        parts: list[bytes] = []
        kind: Any = None
        pending, self._pending = self._pending, []
        while True:
            events = pending
            pending = []
            if not events:
                data = await self.stream.read(READ_CHUNK)
                if not data:
                    proto.receive_eof()
                    await self.send(
                        {
                            "type": "websocket.close",
                            "code": 1006 if proto.close_rcvd is None else proto.close_rcvd.code,
                        }
                    )
                    return
                proto.receive_data(data)
                events = proto.events_received()
                await self._flush(proto)  # pongs, close echoes
            for frame in events:
                op = frame.opcode
                if op in (Opcode.TEXT, Opcode.BINARY):
                    kind, parts = op, [frame.data]
                elif op == Opcode.CONT:
                    parts.append(frame.data)
                elif op == Opcode.CLOSE:
                    code = proto.close_rcvd.code if proto.close_rcvd is not None else 1000
                    await self.send(
                        {
                            "type": "websocket.close",
                            "code": _close_code(code),
                            "reason": proto.close_rcvd.reason if proto.close_rcvd else "",
                        }
                    )
                    return
                else:
                    continue  # ping/pong: answered by the protocol
                if frame.fin and kind is not None:
                    data = b"".join(parts) if len(parts) > 1 else parts[0]
                    if kind == Opcode.TEXT:
                        await self.send(
                            {"type": "websocket.send", "text": data.decode("utf-8", "replace")}
                        )
                    else:
                        await self.send({"type": "websocket.send", "bytes": data})
                    parts, kind = [], None


def _close_code(code: Any) -> int:
    """A close code a WebSocket may send (1005/1006/1015 are reserved: 1000 instead)."""
    try:
        code = int(code)
    except (TypeError, ValueError):
        return 1000
    if code in (1005, 1006, 1015) or not (1000 <= code < 5000):
        return 1000
    return code


async def _tcp_over_websocket(receive: Receive, send: Send, stream: PortStream) -> None:
    """The raw TCP route: binary messages are the bytes (text messages too, UTF-8)."""
    await send({"type": "websocket.accept"})

    async def up() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                if data is None:
                    data = (message.get("text") or "").encode()
                if data:
                    await stream.write(data)
            elif message["type"] == "websocket.disconnect":
                return

    async def down() -> None:
        while True:
            data = await stream.read(READ_CHUNK)
            if not data:
                await send({"type": "websocket.close", "code": 1000})
                return
            await send({"type": "websocket.send", "bytes": data})

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PortsDispatch:
    """ASGI wrapper in front of the apiserver app: proxied requests (path, host, E2B
    header routes) go to the :class:`PortProxy`; a host-routed request for E2B's envd port
    goes to the E2B in-sandbox API (``/e2b/envd``); everything else to ``app``."""

    def __init__(self, app: ASGIApp, proxy: PortProxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = self.proxy.target(scope) if scope["type"] in ("http", "websocket") else None
        if target is None:
            await self.app(scope, receive, send)
            return
        if target.route == HOST_ROUTE and target.port_text == str(ENVD_PORT):
            scope = dict(scope)
            scope["path"] = "/e2b/envd" + scope["path"]
            scope["raw_path"] = b"/e2b/envd" + (scope.get("raw_path") or b"")
            headers = list(scope.get("headers", ()))
            if not any(k == b"e2b-sandbox-id" for k, _ in headers):
                headers.append((b"e2b-sandbox-id", target.sandbox_id.encode()))
            scope["headers"] = headers
            await self.app(scope, receive, send)
            return
        await self.proxy.handle(scope, receive, send, target)
