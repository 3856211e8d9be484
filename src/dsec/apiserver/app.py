"""The HTTP apiserver: ``create_app(edge, keys)`` builds the FastAPI app.

The app only parses HTTP into typed :class:`~dsec.contract.edge.EdgeAPI` calls; it holds
no sandbox state of its own (parse at the edge, act in the core). Auth, body limits,
request ids, metrics and the crash guard live in :mod:`dsec.apiserver.middleware`; the
error mapping in :mod:`dsec.apiserver.errors`.

Every request gets one access-log line (``DSEC_ACCESS_LOG=text|json|off``).

Open routes: ``GET /healthz``; ``GET /metrics`` from loopback (anyone else needs a key);
``/docs`` and ``/openapi.json``. Everything under ``/v1`` needs ``Authorization: Bearer``
(or the dashboard's session cookie: ``/ui``, :mod:`dsec.ui`).
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

from fastapi import FastAPI, Request, Response

from dsec.apiserver.auth import KeyVerifier
from dsec.apiserver.errors import install_error_handlers
from dsec.apiserver.metrics import ApiMetrics
from dsec.apiserver.middleware import ApiMiddleware, access_log_mode
from dsec.apiserver.ports import PortProxy, PortsDispatch, PortTokens
from dsec.apiserver.routes_audit import router as audit_router
from dsec.apiserver.routes_display import router as display_router
from dsec.apiserver.routes_images import router as images_router
from dsec.apiserver.routes_jobs import router as jobs_router
from dsec.apiserver.routes_keys import router as keys_router
from dsec.apiserver.routes_ports import router as ports_router
from dsec.apiserver.routes_sandboxes import UPLOAD_ROUTES
from dsec.apiserver.routes_sandboxes import router as sandboxes_router
from dsec.apiserver.schemas import Health
from dsec.apiserver.verbs import router as verbs_router
from dsec.contract.edge import EdgeAPI, KeyAccounting, KeyQuotas
from dsec.version import __version__

__all__ = [
    "DEFAULT_MAX_JSON_BYTES",
    "DEFAULT_MAX_UPLOAD_BYTES",
    "create_app",
    "openapi_document",
    "render_openapi",
]

DEFAULT_MAX_UPLOAD_BYTES = 256 << 20
"""Largest raw upload (file write, tar upload), bytes."""

DEFAULT_MAX_JSON_BYTES = 64 << 20
"""Largest JSON request body, bytes (an exec's stdin travels in JSON)."""

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(
    edge: EdgeAPI,
    keys: KeyVerifier,
    *,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    access_log: str | None = None,
    port_tokens: PortTokens | None = None,
    ports_domain: str | None = None,
    ports_scheme: str = "https",
    ui: bool = True,
    ui_secret: bytes | None = None,
) -> FastAPI:
    """Build the apiserver app in front of ``edge``.

    Args:
        edge: the edge to relay to (in-process ``EdgeAgent`` or a remote wrapper).
        keys: verifies bearer keys and returns their owner id (a :class:`KeyStore`).
        max_upload_bytes: body limit of raw uploads, bytes (default 256 MiB).
        max_json_bytes: body limit of JSON requests, bytes (default 64 MiB, at most
            ``max_upload_bytes``).
        access_log: ``text``, ``json`` or ``off``: one line per request on the
            ``dsec.access`` logger (default ``$DSEC_ACCESS_LOG``, else ``text``; see
            :mod:`dsec.apiserver.middleware`).
        port_tokens: the sandboxes' port access tokens (default: a random secret for
            this app; see :class:`~dsec.apiserver.ports.PortTokens`).
        ports_domain: the domain of host-routed ports (``DSEC_PORTS_DOMAIN``; None: path
            routes only).
        ports_scheme: the scheme clients use for host routes (``https`` when the TLS
            listener serves them).

    ``app.state.ports`` is the :class:`~dsec.apiserver.ports.PortProxy`.
        ui: serve the dashboard under ``/ui`` (:mod:`dsec.ui`).
        ui_secret: the dashboard's session signing secret (default: random per process;
            ``dsec serve`` keeps one in ``$DSEC_HOME/ui_secret``).
    """
    access_mode = access_log_mode(access_log)
    app = FastAPI(
        title="dsec",
        version=__version__,
        summary="Sandboxes for agentic RL: one API over four isolation tiers.",
        openapi_url="/openapi.json",
    )
    app.state.edge = edge
    app.state.keys = keys
    if isinstance(keys, KeyQuotas) and isinstance(edge, KeyAccounting):
        edge.key_quotas.source = keys  # each key's quota, checked on every creation
    metrics = ApiMetrics()
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(sandboxes_router)
    app.include_router(verbs_router)
    app.include_router(images_router)
    app.include_router(jobs_router)
    app.include_router(keys_router)
    app.include_router(display_router)
    app.include_router(ports_router)
    app.include_router(audit_router)
    proxy = PortProxy(
        edge,
        keys,
        port_tokens or PortTokens(os.urandom(32)),
        domain=ports_domain,
        host_scheme=ports_scheme,
    )
    app.state.ports = proxy
    dashboard = None
    if ui:
        from dsec.ui import Dashboard, install_ui

        dashboard = Dashboard(edge, keys, ui_secret)
        install_ui(app, dashboard)
    app.state.dashboard = dashboard

    @app.get("/healthz", response_model=Health, tags=["node"], summary="Liveness (no auth)")
    async def healthz() -> Health:
        return Health(status="ok", version=__version__)

    @app.get(
        "/metrics",
        response_class=Response,
        tags=["node"],
        summary="Prometheus metrics (no key needed from loopback)",
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics(request: Request) -> Response:
        body = metrics.render() + request.app.state.edge.metrics_text()
        return Response(content=body, media_type=PROMETHEUS_CONTENT_TYPE)

    app.add_middleware(PortsDispatch, proxy=proxy)  # inside ApiMiddleware (added next)
    app.add_middleware(
        ApiMiddleware,
        passthrough=proxy.route_of,
        keys=keys,
        metrics=metrics,
        routes=_route_templates(app),
        upload_routes=UPLOAD_ROUTES | {"/v1/images/build", "/v1/builds"},
        max_upload_bytes=max_upload_bytes,
        max_json_bytes=min(max_json_bytes, max_upload_bytes),
        access_log=access_mode,
        sessions=dashboard.sessions if dashboard is not None else None,
        activity=dashboard.activity if dashboard is not None else None,
    )
    return app


def _route_templates(app: FastAPI) -> list[tuple[str, set[str]]]:
    """(template, methods) of every API route, for metric labels."""
    routes = [
        *sandboxes_router.routes,
        *verbs_router.routes,
        *images_router.routes,
        *jobs_router.routes,
        *keys_router.routes,
        *display_router.routes,
        *ports_router.routes,
        *app.router.routes,
    ]
    out = []
    for route in routes:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path and methods:
            out.append((str(path), {str(m) for m in methods}))
    return out


class _SchemaOnlyEdge:
    """Stands in for an edge while the schema is rendered: routes are built, never called."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the schema-only app has no edge (asked for {name!r})")


class _NoKeys:
    def verify(self, key: str) -> str | None:
        return None

    def is_operator(self, owner: str) -> bool:
        return False


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of the app (independent of any edge or key), with the run_code
    and run_jupyter routes ``dsec serve`` adds on a node with the fncall (and container) tier."""
    from dsec.apiserver.routes_runcode import make_runcode_router

    app = create_app(cast(EdgeAPI, _SchemaOnlyEdge()), _NoKeys(), access_log="off", ui=False)

    def no_service() -> Any:
        raise RuntimeError("the schema-only app runs no code")

    app.include_router(make_runcode_router(no_service, get_jupyter=no_service))
    return app.openapi()


def render_openapi() -> str:
    """The checked-in form of :func:`openapi_document`: indented JSON, trailing newline."""
    return json.dumps(openapi_document(), indent=2, ensure_ascii=False) + "\n"
