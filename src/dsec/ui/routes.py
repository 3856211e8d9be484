"""The dashboard's HTTP surface under ``/ui`` (kept out of the OpenAPI schema: it is a page,
not an API for clients).

=========================  ===================================================================
``GET  /ui``               the page (a session) or the sign-in form (none, or a bad one)
``POST /ui/login``         form ``key`` + ``token``: a session cookie, then back to ``/ui``;
                           a wrong key: the sign-in form again, 401, saying only that
``POST /ui/logout``        ends the session (CSRF header required)
``GET  /ui/static/...``    the built front end (``ui/`` in the repository, see its README)
``GET  /ui/api/session``   who is signed in, the CSRF token, what this server offers
``GET  /ui/api/overview``  nodes, capacity and usage, sandboxes by tier and state, and the
                           charts' series over the last hour (the operator: the node's)
=========================  ===================================================================

``/ui/api`` is authenticated by the API middleware like ``/v1`` (a bearer key or the session
cookie); everything the page *does* (pause, kill, files, trajectory, metrics) goes through
the ``/v1`` routes, with the same checks as the SDK.
"""

from __future__ import annotations

import hashlib
import html
import math
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Match

from dsec.apiserver.deps import current_owner
from dsec.contract.edge import EdgeAPI, KeyQuotas, NodeReports
from dsec.edge.quotas import UNLIMITED
from dsec.errors import AuthenticationError, DsecError
from dsec.models import ListSandboxesRequest, SandboxInfo
from dsec.ui.series import ActivityRecorder, NodeSampler
from dsec.ui.session import COOKIE, LOGIN_COOKIE, Session, SessionAuthority

__all__ = ["STATIC_DIR", "make_ui_router"]

STATIC_DIR = Path(__file__).parent / "static"
"""Where the built front end is (package data, written by ``ui/build.mjs``)."""


_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; frame-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'; object-src 'none'"
)
_PAGE_HEADERS = {
    "content-security-policy": _CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _asset_version() -> str:
    """A short digest of the built bundle (a new build is a new URL: no stale cache)."""
    h = hashlib.sha256()
    for name in ("app.js", "app.css"):
        p = STATIC_DIR / name
        if p.is_file():
            st = p.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _built() -> bool:
    return (STATIC_DIR / "app.js").is_file() and (STATIC_DIR / "app.css").is_file()


def _head(title: str) -> str:
    css = (
        f'<link rel="stylesheet" href="/ui/static/app.css?v={_asset_version()}">'
        if _built()
        else ""
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title>{css}</head>"
    )


def signin_page(token: str, message: str | None = None) -> str:
    """The sign-in form (no script): an API key field and the double-submitted token."""
    note = f'<p class="signin-error" role="alert">{html.escape(message)}</p>' if message else ""
    return (
        _head("dsec: sign in") + '<body class="signin"><main class="signin-box"><h1>dsec</h1>'
        "<p>Sign in with an API key. It is checked once and never kept by this page.</p>"
        f"{note}"
        '<form method="post" action="/ui/login" autocomplete="off">'
        '<label for="key">API key</label>'
        '<input id="key" name="key" type="password" required maxlength="256" '
        'spellcheck="false" autofocus>'
        f'<input type="hidden" name="token" value="{html.escape(token)}">'
        '<button type="submit">Sign in</button></form></main></body></html>'
    )


def app_page() -> str:
    """The page shell: the built bundle renders everything."""
    if not _built():
        return (
            _head("dsec")
            + '<body><main class="signin-box"><h1>dsec</h1><p>The dashboard\'s front end is '
            "not built on this server. Run <code>scripts/bootstrap.sh</code> (it installs the "
            "front-end packages with npm and builds <code>ui/</code>).</p></main></body></html>"
        )
    return (
        _head("dsec") + '<body><div id="app"></div>'
        f'<script type="module" src="/ui/static/app.js?v={_asset_version()}"></script>'
        "</body></html>"
    )


def _page(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=_PAGE_HEADERS)


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


_PROBE = "/v1/sandboxes/sb-probe-000000000000"


def _serves(request: Request, method: str, path: str) -> bool:
    """Whether the app has a route for ``method path`` (asked of its router, so routes other
    parts add later, and FastAPI's included routers, count)."""
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}
    return any(r.matches(scope)[0] is Match.FULL for r in request.app.router.routes)


def features(request: Request) -> dict[str, bool]:
    """What this server offers the page beyond the core API (routes other parts add)."""
    return {
        "logs": _serves(request, "GET", f"{_PROBE}/logs"),
        "port_proxy": _serves(request, "GET", f"{_PROBE}/ports/6080/vnc.html"),
        "builds": _serves(request, "GET", "/v1/builds"),
        "metrics": _serves(request, "GET", f"{_PROBE}/metrics"),
        "audit": _serves(request, "GET", f"{_PROBE}/audit"),
    }


def _by_tier_state(sandboxes: list[SandboxInfo]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in sandboxes:
        out.setdefault(s.tier, {}).setdefault(s.state, 0)
        out[s.tier][s.state] += 1
    return out


def _creation_series(sandboxes: list[SandboxInfo], ts: list[int], step: int) -> list[int]:
    """Sandboxes created in each step of ``ts`` (the edge keeps stopped ones for an hour)."""
    counts = dict.fromkeys(ts, 0)
    for s in sandboxes:
        t = int(s.created_at.timestamp()) // step * step
        if t in counts:
            counts[t] += 1
    return [counts[t] for t in ts]


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def make_ui_router(
    sessions: SessionAuthority, activity: ActivityRecorder, sampler: NodeSampler
) -> APIRouter:
    """The ``/ui`` routes over the app's sessions, activity series and node sampler."""
    router = APIRouter(include_in_schema=False)

    def session_of(request: Request) -> Session | None:
        return sessions.session_of(request.scope)

    def signin(request: Request, message: str | None = None, status: int = 200) -> Response:
        token = sessions.login_token()
        resp = _page(signin_page(token, message), status)
        resp.set_cookie(
            LOGIN_COOKIE,
            token,
            max_age=3600,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=_secure(request),
        )
        if request.cookies.get(COOKIE):  # a forged, expired or revoked session: drop it
            resp.delete_cookie(COOKIE, path="/", samesite="strict", secure=_secure(request))
        return resp

    @router.get("/ui")
    @router.get("/ui/")
    async def page(request: Request) -> Response:
        cookie = request.cookies.get(COOKIE)
        if not cookie:
            return signin(request)
        try:
            sessions.verify(cookie)
        except AuthenticationError as e:
            return signin(request, e.message, 401)
        sampler.start()
        return _page(app_page())

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        try:
            sessions.check_origin(request.scope)
            form = await request.form()
        except DsecError:
            return signin(request, "cross-origin sign-in refused", 403)
        except Exception:  # a body that is not a form
            return signin(request, "sign in with the form", 400)
        key, token = form.get("key"), form.get("token")
        expected = request.cookies.get(LOGIN_COOKIE)
        if not isinstance(token, str) or not expected or token != expected:
            return signin(request, "the sign-in form expired: try again", 403)
        owner = sessions.keys.verify(key) if isinstance(key, str) and key else None
        if owner is None:
            return signin(request, "invalid or revoked API key", 401)
        value, session = sessions.issue(owner)
        resp = RedirectResponse("/ui", status_code=303, headers={"cache-control": "no-store"})
        resp.set_cookie(
            COOKIE,
            value,
            max_age=int(session.expires_at - time.time()),
            path="/",
            httponly=True,
            samesite="strict",
            secure=_secure(request),
        )
        resp.delete_cookie(LOGIN_COOKIE, path="/ui", samesite="strict", secure=_secure(request))
        return resp

    @router.post("/ui/logout")
    async def logout(request: Request) -> Response:
        session = sessions.authenticate(request.scope)  # CSRF-checked: a DsecError otherwise
        resp = Response(status_code=204)
        if session is not None:
            sessions.sign_out(session)
        resp.delete_cookie(COOKIE, path="/", samesite="strict", secure=_secure(request))
        return resp

    @router.get("/ui/api/session")
    async def session_info(request: Request) -> JSONResponse:
        owner = await current_owner(request, None)
        session = request.scope.get("state", {}).get("session")
        edge: EdgeAPI = request.app.state.edge
        node = await edge.node_info()
        sampler.start()
        return JSONResponse(
            {
                "owner": owner,
                "operator": sessions.keys.is_operator(owner),
                "csrf": sessions.csrf_token(session) if isinstance(session, Session) else None,
                "expires_at": session.expires_at if isinstance(session, Session) else None,
                "features": features(request),
                "node": node.node,
                "version": node.version,
                "tiers": [c.model_dump(mode="json") for c in node.tiers],
            },
            headers={"cache-control": "no-store"},
        )

    @router.get("/ui/api/overview")
    async def overview(request: Request) -> JSONResponse:
        owner = await current_owner(request, None)
        operator = sessions.keys.is_operator(owner)
        edge: EdgeAPI = request.app.state.edge
        sampler.start()
        node = await edge.node_info()
        mine = (
            await edge.list_sandboxes(ListSandboxesRequest(include_stopped=True), owner)
        ).sandboxes
        live = [s for s in mine if s.state != "stopped"]
        series = activity.series(None if operator else owner)
        if not operator:  # a key's own, exactly (the edge keeps stopped ones for an hour);
            # the operator's: every create request through this apiserver
            series["creations"] = _creation_series(mine, series["t"], activity.step_s)
        body: dict[str, Any] = {
            "owner": owner,
            "operator": operator,
            "step_s": activity.step_s,
            "node": {
                "name": node.node,
                "version": node.version,
                "cpus": node.cpus,
                "memory_mb": node.memory_mb,
                "sandboxes": node.sandboxes,
                "tiers": {c.tier: c.available for c in node.tiers},
            },
            "mine": {
                "sandboxes": len(live),
                "by_tier_state": _by_tier_state(mine),
                "requested_cpu": round(sum(s.cpu for s in live), 3),
                "requested_memory_mb": sum(s.memory_mb for s in live),
                # what the operator lets this key hold (dsec key set): None, no limit
                "quota": (
                    sessions.keys.quota_of(owner)
                    if isinstance(sessions.keys, KeyQuotas)
                    else UNLIMITED
                ).model_dump(mode="json"),
            },
            "activity": series,
        }
        if operator:
            body["nodes"] = await _nodes(edge, node)
            body["node_series"] = sampler.series()
            body["tenants"] = _tenants(edge)
            if isinstance(edge, NodeReports):
                u = edge.usage()
                body["capacity"] = {
                    "cpus": u.cpus,
                    "memory_mb": u.memory_mb,
                    "max_sandboxes": u.max_sandboxes,
                    "cpu_cap": u.cpus * u.cpu_overcommit,
                    "memory_cap_mb": u.memory_mb * u.memory_overcommit,
                    "requested_cpu": round(u.requested_cpu, 3),
                    "requested_memory_mb": u.requested_memory_mb,
                    "sandboxes": u.sandboxes,
                }
            latest = sampler.latest()
            if latest is not None and latest.mem_total:
                body.setdefault("capacity", {})["host_memory_used"] = latest.mem_used
                body["capacity"]["host_memory_total"] = latest.mem_total
        return JSONResponse(_clean(body), headers={"cache-control": "no-store"})

    return router


async def _nodes(edge: EdgeAPI, node: Any) -> list[dict[str, Any]]:
    """The nodes, as the edge describes them: a cluster's from its reports, else this one."""
    stats = await edge.stats()
    nodes = stats.get("nodes")
    if isinstance(nodes, dict):
        return [{"name": n, **(v if isinstance(v, dict) else {})} for n, v in sorted(nodes.items())]
    by_state: dict[str, int] = {}
    for key, n in (stats.get("by_tier_state") or {}).items():
        by_state[key] = int(n)
    return [
        {
            "name": node.node,
            "state": "alive",
            "sandboxes": node.sandboxes,
            "cpus": node.cpus,
            "memory_mb": node.memory_mb,
            "by_tier_state": by_state,
        }
    ]


def _tenants(edge: EdgeAPI) -> list[dict[str, Any]]:
    """Live sandboxes per owner (where the edge can say: an embedded node)."""
    if not isinstance(edge, NodeReports):
        return []
    per: dict[str, dict[str, Any]] = {}
    for owner, info in edge.owned_sandboxes():
        t = per.setdefault(owner, {"owner": owner, "sandboxes": 0, "cpu": 0.0, "memory_mb": 0})
        t["sandboxes"] += 1
        t["cpu"] = round(t["cpu"] + info.cpu, 3)
        t["memory_mb"] += info.memory_mb
    return sorted(per.values(), key=lambda t: -int(t["sandboxes"]))
