"""E2B compatibility: the unmodified ``e2b`` SDK drives dsec sandboxes.

Point the SDK at a dsec server with two environment variables (plus a dsec key)::

    E2B_API_URL=http://127.0.0.1:7070/e2b          # control plane
    E2B_SANDBOX_URL=http://127.0.0.1:7070/e2b/envd # in-sandbox API (envd)
    E2B_API_KEY=<a dsec API key>

The SDK appends its REST paths to ``E2B_API_URL`` and its Connect/HTTP paths to
``E2B_SANDBOX_URL`` (both keep a path prefix), and names the sandbox in the
``E2b-Sandbox-Id`` header, so one port serves everything.

Wiring (the lead's ``dsec serve``)::

    e2b_app = make_e2b_app(edge, verify_key)
    app.mount("/e2b", e2b_app)                      # envd under /e2b/envd
    ...
    await e2b_app.state.e2b.aclose()                # on shutdown: kill tracked processes

Pass ``envd_path=None`` to leave envd out of this app and serve
``app.state.e2b.envd`` (an ASGI app) on a port of its own instead.

Example (a client)::

    from e2b import Sandbox
    with Sandbox.create("base") as sbx:          # dsec image 'debian'
        print(sbx.commands.run("echo hi").stdout)
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Mount

from dsec.contract.edge import EdgeAPI
from dsec.e2b.access import DEFAULT_TEMPLATE_ALIASES, AccessTokens, TemplateMap
from dsec.e2b.control import (
    ENVD_VERSION,
    ControlPlane,
    NetworkDefault,
    TrafficTokens,
    VerifyKey,
)
from dsec.e2b.envd import DEFAULT_MAX_UPLOAD_BYTES, EnvdApp
from dsec.e2b.errors import e2b_http_exception_handlers
from dsec.e2b.interactive import (
    ExecStreamProcess,
    InteractiveExec,
    InteractiveProcess,
    OutputChunk,
    PtySize,
)
from dsec.e2b.process import ProcessRegistry
from dsec.e2b.templates import TemplateAPI, TemplateFiles

__all__ = [
    "DEFAULT_TEMPLATE_ALIASES",
    "ENVD_VERSION",
    "AccessTokens",
    "E2BCompat",
    "ExecStreamProcess",
    "InteractiveExec",
    "InteractiveProcess",
    "NetworkDefault",
    "OutputChunk",
    "PtySize",
    "TemplateAPI",
    "TemplateMap",
    "make_e2b_app",
]


@dataclass
class E2BCompat:
    """The state behind one E2B app: control plane, envd and the process table."""

    control: ControlPlane
    envd: EnvdApp
    registry: ProcessRegistry
    templates: TemplateAPI
    scratch: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        # an app dropped without aclose() (embedded, or built by a test) still removes
        # its scratch directories: when it is collected, or at the interpreter's exit
        for p in self.scratch:
            weakref.finalize(self, shutil.rmtree, p, True)

    async def aclose(self) -> None:
        """Kill every process started through the E2B API, stop every directory
        watcher's background poll and every template build still running (server
        shutdown)."""
        self.envd.filesystem.aclose()
        await self.templates.aclose()
        await self.registry.aclose()
        for p in self.scratch:
            shutil.rmtree(p, ignore_errors=True)


def make_e2b_app(
    edge: EdgeAPI,
    verify_key: VerifyKey,
    *,
    envd_path: str | None = "/envd",
    token_secret: bytes | None = None,
    templates: TemplateMap | None = None,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    watch_poll_interval_s: float = 0.25,
    default_network: NetworkDefault = "open",
    default_public_ports: bool = True,
    template_files_dir: Path | None = None,
    max_build_context_bytes: int | None = None,
    sandbox_domain: str | None = None,
    traffic_tokens: TrafficTokens | None = None,
) -> Starlette:
    """Build the E2B-compatible ASGI app.

    Args:
        edge: the edge (``EdgeAPI``); an edge that also implements
            :class:`InteractiveExec` gets stdin after start and signals.
        verify_key: ``X-API-Key`` -> owner id, or ``None`` for an unknown key.
        envd_path: where envd is mounted inside this app (``/envd``), or ``None``
            to serve ``app.state.e2b.envd`` separately.
        token_secret: HMAC key for envd access tokens; share it between replicas
            (``None``: random per process).
        templates: E2B template -> dsec tier/image map (default: ``base`` -> ``debian``).
        max_upload_bytes: largest file upload, bytes.
        watch_poll_interval_s: seconds between two listings of a watched directory.
        default_network: what a sandbox created without network settings gets: ``open``
            (E2B's default: every public IPv4 address, where the tier has networking) or
            ``closed`` (dsec's default: no network). ``dsec serve`` reads
            ``DSEC_E2B_NETWORK_DEFAULT``.
        default_public_ports: whether a sandbox created without
            ``network.allow_public_traffic`` has public ports (E2B's default, True: its
            ``get_host(port)`` URLs need no traffic token, its id is the secret) or private
            ones (False: they need ``trafficAccessToken``). ``dsec serve`` reads
            ``DSEC_E2B_PORTS_DEFAULT=public|private``.
        template_files_dir: where the files of templates' COPY steps are kept per key
            (``None``: a temporary directory removed at ``aclose()``; ``dsec serve`` uses
            ``$DSEC_HOME/e2b-template-files``).
        max_build_context_bytes: largest upload and largest set of files of one template
            build, bytes (default: ``DSEC_MAX_BUILD_CONTEXT_BYTES`` or 256 MiB).
        sandbox_domain: the ``domain`` answered to the SDK (the port proxy's
            ``DSEC_PORTS_DOMAIN``; None: ``dsec.invalid``, a name that never resolves).
        traffic_tokens: issues the ``trafficAccessToken`` (the port proxy's tokens).

    Returns:
        A Starlette app; ``app.state.e2b`` is the :class:`E2BCompat` (call
        ``aclose()`` on shutdown).
    """
    tokens = AccessTokens(token_secret)
    registry = ProcessRegistry(edge)
    envd = EnvdApp(
        edge,
        tokens,
        registry,
        max_upload_bytes=max_upload_bytes,
        watch_poll_interval_s=watch_poll_interval_s,
    )
    if default_network not in ("open", "closed"):
        raise ValueError(f"default_network must be 'open' or 'closed', not {default_network!r}")
    template_map = templates or TemplateMap()
    scratch: list[Path] = []
    if template_files_dir is None:
        template_files_dir = Path(tempfile.mkdtemp(prefix="dsec-e2b-files-"))
        scratch.append(template_files_dir)
    if max_build_context_bytes is None:
        from dsec.builds.engine import BuildLimits

        max_build_context_bytes = BuildLimits.from_env().max_context_bytes
    template_api = TemplateAPI(
        edge,
        template_map,
        TemplateFiles(template_files_dir, max_file_bytes=max_build_context_bytes),
        secret=token_secret,
        max_context_bytes=max_build_context_bytes,
    )
    control = ControlPlane(
        edge,
        verify_key,
        tokens,
        template_map,
        registry,
        envd.filesystem,
        template_api,
        default_network=default_network,
        default_public_ports=default_public_ports,
        sandbox_domain=sandbox_domain,
        traffic_tokens=traffic_tokens,
    )
    routes: list[BaseRoute] = []
    if envd_path is not None:
        routes.append(Mount(envd_path, app=envd))
    routes.extend(control.routes())

    async def not_implemented(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "code": 501,
                "message": f"{request.method} {request.url.path} is not implemented by dsec's E2B API",
            },
            status_code=501,
        )

    routes.append(Mount("/", app=_fallback(not_implemented)))
    app = Starlette(routes=routes, exception_handlers=e2b_http_exception_handlers())
    app.state.e2b = E2BCompat(
        control=control, envd=envd, registry=registry, templates=template_api, scratch=scratch
    )
    return app


def _fallback(endpoint: object) -> Starlette:
    from starlette.routing import Route

    return Starlette(
        routes=[
            Route(
                "/{rest:path}",
                endpoint,  # type: ignore[arg-type]
                methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
            )
        ],
        exception_handlers=e2b_http_exception_handlers(),
    )
