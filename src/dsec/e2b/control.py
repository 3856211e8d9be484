"""E2B's control-plane REST API (``E2B_API_URL``) over ``EdgeAPI``.

Request and response bodies are E2B's own generated models
(``e2b.api.client.models``): requests are parsed with ``from_dict`` and answers
built with ``to_dict``, so the JSON shapes are exactly what the SDK reads.

Mapping:

* ``X-API-Key`` -> ``verify_key(key)`` -> owner (401 when unknown).
* ``templateID`` -> (tier, image) by :class:`~dsec.e2b.access.TemplateMap`;
  kept in the label ``e2b.template`` (hidden from ``metadata``).
* ``metadata`` -> labels, ``envVars`` -> env, ``timeout`` (s) -> ``ttl_s``.
* sandbox state: dsec ``creating``/``running`` -> ``running``, ``paused`` ->
  ``paused``; a ``stopped`` sandbox no longer exists (404).
* pause / resume / connect-resumes -> ``pause_sandbox`` / ``resume_sandbox``;
  ``lifecycle.on_timeout`` -> ``on_timeout``; snapshots -> ``snapshot_sandbox``
  tagged as an image (the snapshot id is that image name, so it works as a
  template, and ``delete_snapshot`` deletes it like a template); fork -> ``fork_sandbox``.
* templates (``Template.build``, aliases, tags, list, delete) -> :mod:`dsec.e2b.templates`
  over the edge's image builds; a template is the key's images named after it.
* ``allow_internet_access`` and ``network`` (``allow_out``/``deny_out``/
  ``dns_servers``) -> a dsec ``NetworkPolicy`` (:mod:`dsec.e2b.network`);
  ``update_network`` -> ``update_network``; ``get_info`` shows the policy back.
* metrics (``GET /sandboxes/{id}/metrics``, ``GET /sandboxes/metrics?sandbox_ids=``) ->
  ``sandbox_metrics``: one sample, taken now (dsec samples on request and keeps no history),
  returned when ``now`` is inside the asked ``[start, end]``; CPU percent of the sandbox's
  cores, memory and disk in bytes (``get_metrics``).
* logs (``GET /sandboxes/{id}/logs``, ``GET /v2/sandboxes/{id}/logs``) -> the edge's
  ``sandbox_logs`` (what ``GET /v1/sandboxes/{id}/logs`` serves: the image start command's
  output): one entry per line, ``stdout`` at level ``info``, ``stderr`` ``error``, the edge's
  own note ``warn``; ``start``/``cursor`` in milliseconds, ``limit``, ``direction``,
  ``level`` (the lowest shown) and ``search`` (a substring) as E2B has them.
* features dsec does not have (listing/deleting snapshots,
  egress proxies and request transforms, MCP, volumes) answer
  422 (or 501 for routes not implemented at all) with a message that says so;
  the SDK raises ``SandboxException("<status>: <message>")``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import math
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from e2b.api.client.models import (
    ListedSandbox,
    NewSandboxV2,
    SandboxDetail,
    SandboxLifecycle,
    SandboxNetworkConfig,
    SandboxNetworkUpdateConfig,
    SandboxOnTimeout,
    SandboxState,
    SnapshotInfo,
)
from e2b.api.client.models import Sandbox as E2BSandbox
from e2b.api.client.types import UNSET, Unset
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsec.apiserver.departed import unless_departed
from dsec.contract.edge import EdgeAPI, MetricsEdge
from dsec.e2b.access import AccessTokens, TemplateMap, image_ref
from dsec.e2b.errors import E2BError, control_status, sandbox_ref, stream_ended_error
from dsec.e2b.filesystem import FilesystemService
from dsec.e2b.network import E2BEgress, e2b_view, policy_from_e2b
from dsec.e2b.process import ProcessRegistry, paused_error
from dsec.e2b.templates import TemplateAPI
from dsec.e2b.version import ENVD_VERSION
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    ImageNotFound,
    InvalidRequest,
    SandboxNotFound,
    SandboxStopped,
    ServiceUnavailable,
)
from dsec.models import (
    CreateSandboxRequest,
    DeleteImageRequest,
    ForkRequest,
    KeyScope,
    ListSandboxesRequest,
    NetworkPolicyRequest,
    PauseRequest,
    SandboxInfo,
    SandboxSnapshotRequest,
    SetTTLRequest,
)
from dsec.tiers import tier_has
from dsec.wire import validated

__all__ = [
    "AUTO_RESUME_LABEL",
    "ENVD_VERSION",
    "SANDBOX_DOMAIN",
    "TEMPLATE_LABEL",
    "ControlPlane",
    "NetworkDefault",
]

TEMPLATE_LABEL = "e2b.template"
AUTO_RESUME_LABEL = "e2b.auto_resume"
"""``off`` on a sandbox created with ``lifecycle auto_resume=False``: while it is paused,
in-sandbox requests are refused instead of resuming it (``connect()`` resumes it)."""
INTERNAL_LABELS = frozenset({TEMPLATE_LABEL, AUTO_RESUME_LABEL})
"""Labels the E2B API keeps for itself (never shown as ``metadata``)."""
DEFAULT_TIMEOUT_S = 300
SANDBOX_DOMAIN = "dsec.invalid"
"""``domain`` in create/connect/info answers when the server has no ports domain
(``DSEC_PORTS_DOMAIN``): ``sbx.get_host(port)`` gives ``<port>-<sandbox id>.dsec.invalid``,
a name that never resolves (RFC 2606), so no request meant for a dsec sandbox can reach
E2B's real ``e2b.app``. With a ports domain, that domain: ``get_host`` is then a host the
port proxy serves (see docs/e2b.md, docs/network.md)."""
MAX_TIMEOUT_S = 30 * 24 * 3600
"""Longest sandbox timeout (create, set_timeout, refresh, connect, resume, fork), seconds:
the bound dsec's ``CreateSandboxRequest.ttl_s`` has."""
LIST_PAGE_MAX = 100
EXPIRE_NOW_TTL_S = 0.001
"""The TTL ``set_timeout(0)`` sets: the sandbox's time is up at once."""
CLIENT_ID = "dsec"

VerifyKey = Callable[[str], "str | None"]
NetworkDefault = Literal["open", "closed"]
"""What a sandbox created through the E2B API without any network setting gets: ``open``
(E2B's default: every public IPv4 address) or ``closed`` (dsec's own default: none)."""


class TrafficTokens(Protocol):
    """Issues the ``trafficAccessToken`` of a sandbox: the port proxy's access token
    (:class:`dsec.apiserver.ports.PortTokens`), which e2b-code-interpreter sends as
    ``E2B-Traffic-Access-Token``."""

    def issue(self, sandbox_id: str, owner: str) -> str: ...


log = logging.getLogger(__name__)


def _aware(when: datetime) -> datetime:
    """``when`` with a time zone (naive times from the edge are UTC)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _unset(value: Any) -> Any:
    return None if isinstance(value, Unset) else value


def _seconds_value(value: Any, name: str) -> float:
    """``value`` as a timeout in seconds: a JSON number in (0, :data:`MAX_TIMEOUT_S`];
    anything else (a string, a bool, NaN, infinity, too large) is a 400."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise E2BError(
            400, f"{name} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S} (30 days)"
        )
    return float(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool | None:
    """``body[name]`` when it is a JSON boolean, ``None`` when absent or null; else 400."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise E2BError(400, f"{name} must be a boolean")
    return value


def _string_map(body: dict[str, Any], name: str) -> dict[str, str]:
    """``body[name]`` when it is an object of string values (absent/null: empty); else 400."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise E2BError(400, f"{name} must be an object whose values are strings")
    return value


def _check_create_body(body: dict[str, Any]) -> None:
    """The type checks E2B's API does on ``POST /sandboxes`` before anything else (400)."""
    template = body.get("templateID")
    if not isinstance(template, str) or not template.strip():
        raise E2BError(400, "templateID must be a non-empty string")
    if body.get("timeout") is not None:
        _seconds_value(body["timeout"], "timeout")
    for name in ("autoPause", "autoPauseMemory", "allow_internet_access"):
        _optional_bool(body, name)
    _string_map(body, "metadata")
    _string_map(body, "envVars")
    auto_resume = body.get("autoResume")
    if auto_resume is not None:
        if not isinstance(auto_resume, dict):
            raise E2BError(400, "autoResume must be an object")
        _optional_bool(auto_resume, "enabled")
    network = body.get("network")
    if network is not None:
        if not isinstance(network, dict):
            raise E2BError(400, "network must be an object")
        _check_network_body(network, "network.")


def _check_network_body(network: dict[str, Any], prefix: str = "") -> None:
    """Types of E2B's network settings (create's ``network``, ``PUT .../network``): 400."""
    for name in ("allowOut", "denyOut", "dnsServers"):
        value = network.get(name)
        if value is not None and (
            not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        ):
            raise E2BError(400, f"{prefix}{name} must be a list of strings")
    for name in ("allowPublicTraffic", "allow_internet_access"):
        _optional_bool(network, name)
    if network.get("maskRequestHost") is not None and not isinstance(
        network["maskRequestHost"], str
    ):
        raise E2BError(400, f"{prefix}maskRequestHost must be a string")
    ports = network.get("httpsPorts")
    if ports is not None and (
        not isinstance(ports, list)
        or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
    ):
        raise E2BError(400, f"{prefix}httpsPorts must be a list of integers")


def _encode_token(when: datetime, key: str) -> str:
    """A keyset page token: the last item's time and id."""
    return base64.urlsafe_b64encode(f"{_aware(when).isoformat()}|{key}".encode()).decode()


def _decode_token(token: str) -> tuple[datetime, str]:
    """The ``(time, id)`` of :func:`_encode_token`; 400 for anything else."""
    try:
        when_s, sep, key = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        if not sep:
            raise ValueError(token)
        return _aware(datetime.fromisoformat(when_s)), key
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise E2BError(400, "invalid nextToken") from None


_LOG_LEVELS = ("debug", "info", "warn", "error")
_LOG_LEVEL_OF = {"stdout": "info", "stderr": "error", "dsec": "warn"}


def _wire_entry(e: dict[str, Any]) -> dict[str, Any]:
    return {k: e[k] for k in ("timestamp", "message", "level", "fields")}


def _error(status: int, message: str, *, retry: bool | None = None) -> JSONResponse:
    headers = {"Should-Retry": "true" if retry else "false"} if retry is not None else None
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


class ControlPlane:
    """The REST routes; see :meth:`routes`."""

    def __init__(
        self,
        edge: EdgeAPI,
        verify_key: VerifyKey,
        tokens: AccessTokens,
        templates: TemplateMap,
        registry: ProcessRegistry,
        filesystem: FilesystemService,
        template_api: TemplateAPI | None = None,
        *,
        default_network: NetworkDefault = "open",
        default_public_ports: bool = True,
        sandbox_domain: str | None = None,
        traffic_tokens: TrafficTokens | None = None,
    ) -> None:
        self.edge = edge
        self.default_public_ports = default_public_ports
        self.template_api = template_api
        self.sandbox_domain = sandbox_domain or SANDBOX_DOMAIN
        self.traffic_tokens = traffic_tokens
        self.verify_key = verify_key
        self.tokens = tokens
        self.templates = templates
        self.registry = registry
        self.filesystem = filesystem
        self.default_network = default_network
        self._network_tiers: tuple[float, frozenset[str]] | None = None

    async def _tier_has_network(self, tier: str) -> bool:
        """Whether ``tier`` can give sandboxes a network on this edge (cached 10 s)."""
        now = time.monotonic()
        if self._network_tiers is None or now - self._network_tiers[0] > 10.0:
            caps = (await self.edge.capabilities()).tiers
            self._network_tiers = (now, frozenset(c.tier for c in caps if c.network))
        return tier in self._network_tiers[1]

    # --- plumbing -----------------------------------------------------------
    def routes(self) -> list[Route]:
        """Starlette routes, relative to the control plane's base URL (``E2B_API_URL``)."""
        g = self._guard
        return [
            Route("/sandboxes", g(self.create), methods=["POST"]),
            Route("/v2/sandboxes", g(self.create), methods=["POST"]),
            Route("/sandboxes", g(self.list_v1), methods=["GET"]),
            Route("/v2/sandboxes", g(self.list_v2), methods=["GET"]),
            Route("/sandboxes/metrics", g(self.metrics_many), methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", g(self.get), methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", g(self.kill), methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/timeout", g(self.set_timeout), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/refreshes", g(self.refresh), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/connect", g(self.connect), methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", g(self.connect), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/pause", g(self.pause), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/resume", g(self.resume), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/snapshots", g(self.snapshot), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/fork", g(self.fork), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/network", g(self.update_network), methods=["PUT"]),
            Route("/sandboxes/{sandbox_id}/metrics", g(self.metrics), methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/logs", g(self.logs_v1), methods=["GET"]),
            Route("/v2/sandboxes/{sandbox_id}/logs", g(self.logs_v2), methods=["GET"]),
            Route("/snapshots", g(self.list_snapshots), methods=["GET"]),
            # DELETE /templates/{id} (Sandbox.delete_snapshot too): the template API's, which
            # deletes any of the key's templates; without it, snapshots only
            *(
                self.template_api.routes(g)
                if self.template_api is not None
                else [
                    Route(
                        "/templates/{template_id:path}",
                        g(self.delete_snapshot),
                        methods=["DELETE"],
                    )
                ]
            ),
        ]

    def _guard(
        self, handler: Callable[[Request, str], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            key = request.headers.get("x-api-key")
            try:
                owner = self.verify_key(key) if key else None
            except Exception:
                owner = None
            if owner is None:
                return _error(401, "missing or invalid X-API-Key (use a dsec API key)")
            request.scope.setdefault("state", {})["owner"] = owner  # for the access log
            try:
                return await handler(request, owner)
            except E2BError as e:
                return _error(e.status, e.message)
            except ImageNotFound as e:
                return _error(404, f"template not found: {e.public_message}")
            except DsecError as e:
                status = control_status(e)
                retry = True if isinstance(e, ServiceUnavailable) else None
                return _error(status, e.public_message, retry=False if status == 429 else retry)
            except Exception:
                # never a bare (non-JSON) 500: the SDK parses the body
                log.exception("E2B control route %s %s failed", request.method, request.url.path)
                return _error(500, "internal error in dsec's E2B control plane (see server log)")

        return endpoint

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            raise E2BError(400, "request body is not valid JSON") from None
        except RecursionError:
            raise E2BError(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise E2BError(400, "request body must be a JSON object")
        return body

    # --- rendering ----------------------------------------------------------
    @staticmethod
    def _state(info: SandboxInfo) -> SandboxState:
        return SandboxState.PAUSED if info.state == "paused" else SandboxState.RUNNING

    @staticmethod
    def _end_at(info: SandboxInfo) -> datetime:
        if info.expires_at is not None:
            return _aware(info.expires_at)
        try:
            if info.ttl_s is not None:
                return _aware(info.updated_at) + timedelta(seconds=info.ttl_s)
            return _aware(info.created_at) + timedelta(days=30)
        except OverflowError:  # a row stored with a huge ttl before it was bounded
            return datetime.max.replace(tzinfo=UTC)

    @staticmethod
    def _metadata(info: SandboxInfo) -> dict[str, str]:
        return {k: v for k, v in info.labels.items() if k not in INTERNAL_LABELS}

    def _template(self, info: SandboxInfo) -> str:
        return info.labels.get(TEMPLATE_LABEL, info.image)

    def _created(self, info: SandboxInfo, owner: str) -> dict[str, Any]:
        return E2BSandbox(
            template_id=self._template(info),
            sandbox_id=info.id,
            client_id=CLIENT_ID,
            envd_version=ENVD_VERSION,
            alias=self._template(info),
            envd_access_token=self.tokens.issue(info.id, owner),
            traffic_access_token=self._traffic(info, owner),
            domain=self.sandbox_domain,
        ).to_dict()

    def _traffic(self, info: SandboxInfo, owner: str) -> Any:
        """The port proxy's token for the sandbox (E2B's ``trafficAccessToken``; a public
        sandbox needs none, as in E2B)."""
        if self.traffic_tokens is None or info.public_ports:
            return UNSET
        return self.traffic_tokens.issue(info.id, owner)

    def _listed(self, info: SandboxInfo) -> dict[str, Any]:
        return ListedSandbox(
            template_id=self._template(info),
            sandbox_id=info.id,
            client_id=CLIENT_ID,
            started_at=_aware(info.created_at),
            end_at=self._end_at(info),
            cpu_count=max(1, round(info.cpu)),
            memory_mb=info.memory_mb,
            disk_size_mb=info.disk_mb,
            state=self._state(info),
            envd_version=ENVD_VERSION,
            alias=self._template(info),
            metadata=self._metadata(info),
        ).to_dict()

    def _detail(self, info: SandboxInfo, owner: str) -> dict[str, Any]:
        internet, network = e2b_view(info.network)
        return SandboxDetail(
            template_id=self._template(info),
            sandbox_id=info.id,
            client_id=CLIENT_ID,
            started_at=_aware(info.created_at),
            end_at=self._end_at(info),
            envd_version=ENVD_VERSION,
            cpu_count=max(1, round(info.cpu)),
            memory_mb=info.memory_mb,
            disk_size_mb=info.disk_mb,
            state=self._state(info),
            alias=self._template(info),
            envd_access_token=self.tokens.issue(info.id, owner),
            allow_internet_access=internet,
            network=SandboxNetworkConfig.from_dict(
                {**(network or {}), "allowPublicTraffic": info.public_ports}
            ),
            domain=self.sandbox_domain,
            metadata=self._metadata(info),
            lifecycle=SandboxLifecycle(
                auto_resume=info.labels.get(AUTO_RESUME_LABEL) != "off",
                on_timeout=(
                    SandboxOnTimeout.PAUSE if info.on_timeout == "pause" else SandboxOnTimeout.KILL
                ),
            ),
        ).to_dict()

    async def _live(self, sandbox_id: str, owner: str) -> SandboxInfo:
        """The sandbox if it exists for this owner and is not stopped; 404 otherwise."""
        info = await self.edge.get_sandbox(sandbox_ref(sandbox_id), owner)
        if info.state == "stopped":
            raise E2BError(404, f"sandbox {sandbox_id} not found")
        return info

    # --- routes ---------------------------------------------------------------
    async def create(self, request: Request, owner: str) -> Response:
        body = await self._json(request)
        _check_create_body(body)
        try:
            new = NewSandboxV2.from_dict(body)
        except (KeyError, TypeError, ValueError) as e:
            raise E2BError(400, f"invalid sandbox request: {e}") from None
        refused = []
        auto_resume = _unset(new.auto_resume)
        no_auto_resume = auto_resume is not None and getattr(auto_resume, "enabled", True) is False
        # mcp: the SDK itself starts `mcp-gateway` in the sandbox after the create (dsec's
        # images have none, so it fails as E2B's does for a template without one)
        if _unset(new.volume_mounts):
            refused.append("volume_mounts")
        if _unset(new.iam) is not None:
            refused.append("iam")
        if refused:
            raise E2BError(422, "not supported by dsec: " + "; ".join(refused))
        internet = _unset(new.allow_internet_access)
        if internet is not None and not isinstance(internet, bool):
            raise E2BError(400, "allow_internet_access must be a boolean")
        wire_network = _unset(new.network)
        # E2B's default: sandbox URLs are public unless the create says otherwise (the
        # "project default", here the server's: DSEC_E2B_PORTS_DEFAULT)
        asked = _unset(wire_network.allow_public_traffic) if wire_network is not None else None
        if asked is not None and not isinstance(asked, bool):
            raise E2BError(400, "network.allowPublicTraffic must be a boolean")
        public = self.default_public_ports if asked is None else asked
        target = self.templates.resolve(new.template_id)
        sizes: dict[str, Any] = {}
        if self.template_api is not None:  # a template id, name:default; its cpu and memory
            target, sizes = await self.template_api.sandbox_target(owner, new.template_id, target)
        egress = E2BEgress.from_wire(wire_network) if wire_network is not None else None
        if egress is not None and not egress.given:
            egress = None  # e.g. network={"allow_public_traffic": False}: no egress setting
        if internet is None and egress is None and self.default_network == "open":
            # E2B's default: the internet is open. Only where the tier can give a network
            # (a node without networking creates sandboxes without one, as before)
            internet = True if await self._tier_has_network(target.tier) else None
        policy = policy_from_e2b(internet, egress)

        metadata = _unset(new.metadata) or {}
        envs = _unset(new.env_vars) or {}
        if not isinstance(metadata, dict) or not isinstance(envs, dict):
            raise E2BError(400, "metadata and envVars must be objects of strings")
        timeout = _unset(new.timeout)
        try:
            req = CreateSandboxRequest(
                tier=target.tier,
                image=target.image,
                **sizes,
                env={str(k): str(v) for k, v in envs.items()},
                labels={
                    **{str(k): str(v) for k, v in metadata.items()},
                    TEMPLATE_LABEL: new.template_id,
                    **({AUTO_RESUME_LABEL: "off"} if no_auto_resume else {}),
                },
                ttl_s=float(timeout if timeout is not None else DEFAULT_TIMEOUT_S),
                on_timeout="pause" if new.auto_pause is True else "kill",
                # lifecycle keep_memory=False: the timeout pause keeps only the files
                timeout_pause="filesystem" if _unset(new.auto_pause_memory) is False else "auto",
                network=policy,
                public_ports=public,
                # E2B's user has passwordless sudo: setuid programs work (container tier)
                allow_setuid=tier_has(target.tier, lambda t: t.allow_setuid),
            )
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise E2BError(400, f"invalid sandbox request: {msg}") from None

        async def undo(info: SandboxInfo) -> None:  # the client gave up: nothing stays
            await self.edge.kill_sandbox(sandbox_ref(info.id), owner)

        info = await unless_departed(request, self.edge.create_sandbox(req, owner), undo)
        return JSONResponse(self._created(info, owner), status_code=201)

    async def _filtered(self, request: Request, owner: str) -> list[SandboxInfo]:
        q = request.query_params
        labels: dict[str, str] | None = None
        if q.get("metadata"):
            labels = {
                urllib.parse.unquote(k): urllib.parse.unquote(v)
                for k, v in urllib.parse.parse_qsl(q["metadata"], keep_blank_values=True)
            }
        states = {s.strip() for s in q.get("state", "").split(",") if s.strip()}
        if states - {"running", "paused"}:
            raise E2BError(400, f"unknown state filter {sorted(states - {'running', 'paused'})}")
        try:
            req = ListSandboxesRequest.of(labels)
        except InvalidRequest:  # a label no sandbox can carry: no match (E2B's answer)
            return []
        listed = await self.edge.list_sandboxes(req, owner)
        out = [i for i in listed.sandboxes if i.state != "stopped"]
        if states:
            out = [i for i in out if self._state(i).value in states]
        if q.get("template"):
            out = [i for i in out if self._template(i) == q["template"]]
        if q.get("startedAfter"):
            try:
                after = datetime.fromisoformat(q["startedAfter"])
            except ValueError:
                raise E2BError(400, "startedAfter must be an ISO 8601 time") from None
            if after.tzinfo is None:
                after = after.replace(tzinfo=UTC)
            out = [i for i in out if _aware(i.created_at) >= after]
        return out

    async def list_v1(self, request: Request, owner: str) -> Response:
        infos = sorted(
            await self._filtered(request, owner),
            key=lambda i: (_aware(i.created_at), i.id),
            reverse=True,  # newest first, as E2B
        )
        return JSONResponse([self._listed(i) for i in infos])

    async def list_v2(self, request: Request, owner: str) -> Response:
        q = request.query_params
        order = q.get("order", "desc")  # E2B's default: newest first
        if order not in ("asc", "desc"):
            raise E2BError(400, "order must be 'asc' or 'desc'")
        try:
            limit = int(q.get("limit", LIST_PAGE_MAX))
        except ValueError:
            raise E2BError(400, "limit must be an integer") from None
        if not 1 <= limit <= LIST_PAGE_MAX:
            raise E2BError(400, f"limit must be between 1 and {LIST_PAGE_MAX}")
        desc = order == "desc"
        infos = sorted(
            await self._filtered(request, owner),
            key=lambda i: (_aware(i.created_at), i.id),
            reverse=desc,
        )
        token = q.get("nextToken")
        if token:
            last = _decode_token(token)
            infos = [
                i
                for i in infos
                if (
                    (_aware(i.created_at), i.id) < last
                    if desc
                    else (_aware(i.created_at), i.id) > last
                )
            ]
        page = infos[:limit]
        headers = {}
        if len(infos) > limit:
            headers["X-Next-Token"] = _encode_token(page[-1].created_at, page[-1].id)
        return JSONResponse([self._listed(i) for i in page], headers=headers)

    async def get(self, request: Request, owner: str) -> Response:
        info = await self._live(request.path_params["sandbox_id"], owner)
        return JSONResponse(self._detail(info, owner))

    async def kill(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        await self._live(sandbox_id, owner)
        await self.edge.kill_sandbox(sandbox_ref(sandbox_id), owner)
        # open process streams end as envd's do when their sandbox dies mid-stream
        self.registry.end_streams(sandbox_id, stream_ended_error(sandbox_id))
        await self.registry.drop_sandbox(sandbox_id)
        self.filesystem.drop_sandbox(sandbox_id)
        return Response(status_code=204)

    @staticmethod
    def _seconds(body: dict[str, Any], name: str) -> float:
        """``body[name]`` as seconds in (0, 30 days]; 400 otherwise (see :func:`_seconds_value`)."""
        return _seconds_value(body.get(name), name)

    async def set_timeout(self, request: Request, owner: str) -> Response:
        """``set_timeout(seconds)``; 0 (as E2B) ends the sandbox's time now: its lifecycle
        (kill, or pause) happens at the edge's next TTL check (about a second)."""
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        value = body.get("timeout")
        now = isinstance(value, int | float) and not isinstance(value, bool) and value == 0
        seconds = EXPIRE_NOW_TTL_S if now else self._seconds(body, "timeout")
        await self._live(sandbox_id, owner)
        await self.edge.set_ttl(_ttl(sandbox_id, seconds), owner)
        return Response(status_code=204)

    async def refresh(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        seconds = (
            self._seconds(body, "duration")
            if body.get("duration") is not None
            else float(DEFAULT_TIMEOUT_S)
        )
        info = await self._live(sandbox_id, owner)
        remaining = (self._end_at(info) - datetime.now(UTC)).total_seconds()
        if seconds > remaining:  # a refresh only ever extends the sandbox's end
            await self.edge.set_ttl(_ttl(sandbox_id, seconds), owner)
        return Response(status_code=204)

    async def connect(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        if body.get("timeout") is not None:
            self._seconds(body, "timeout")
        _optional_bool(body, "memory")
        info = await self._live(sandbox_id, owner)
        status = 200
        if info.state == "paused":
            if body.get("memory") is False:  # on_resume="reboot": boot afresh from its files
                await self._pause_filesystem(sandbox_id, owner)
            info = await self.edge.resume_sandbox(sandbox_ref(sandbox_id), owner)
            status = 201
        if body.get("timeout") is not None:
            seconds = self._seconds(body, "timeout")
            remaining = (self._end_at(info) - datetime.now(UTC)).total_seconds()
            if seconds > remaining:  # E2B only ever extends on connect
                info = await self.edge.set_ttl(_ttl(sandbox_id, seconds), owner)
        return JSONResponse(self._created(info, owner), status_code=status)

    async def _pause_filesystem(self, sandbox_id: str, owner: str) -> None:
        """E2B's filesystem-only pause (``keep_memory=False``): processes dropped, files
        kept, a fresh boot on resume (edges whose tier has ``pause_filesystem``)."""
        req = validated(PauseRequest, sandbox_id=sandbox_id, mode="filesystem")
        try:
            await self.edge.pause_sandbox(req, owner)
        except CapabilityNotSupported:
            raise E2BError(
                422, "this server has no filesystem-only pause (keep_memory=False)"
            ) from None

    async def pause(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        _optional_bool(body, "memory")
        _optional_bool(body, "requireHealthyGuest")
        info = await self._live(sandbox_id, owner)
        if info.state == "paused":
            return _error(409, f"sandbox {sandbox_id} is already paused")
        if body.get("memory") is False:
            await self._pause_filesystem(sandbox_id, owner)
        else:
            await self.edge.pause_sandbox(validated(PauseRequest, sandbox_id=sandbox_id), owner)
        # as E2B: pausing cuts the sandbox's open process streams (the SDK raises instead of
        # waiting forever); the processes resume with the sandbox and can be re-attached
        self.registry.end_streams(sandbox_id, paused_error(sandbox_id))
        return Response(status_code=204)

    async def resume(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        if body.get("timeout") is not None:
            self._seconds(body, "timeout")
        _optional_bool(body, "autoPause")
        info = await self._live(sandbox_id, owner)
        if info.state != "paused":
            return _error(409, f"sandbox {sandbox_id} is already running")
        info = await self.edge.resume_sandbox(sandbox_ref(sandbox_id), owner)
        if body.get("timeout") is not None:
            info = await self.edge.set_ttl(_ttl(sandbox_id, self._seconds(body, "timeout")), owner)
        return JSONResponse(self._created(info, owner), status_code=201)

    async def snapshot(self, request: Request, owner: str) -> Response:
        """A dsec snapshot (``pack_diff`` layer) tagged as an image; its name is the
        ``snapshot_id``, usable as a template (``Sandbox.create(snapshot_id)``)."""
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        _optional_bool(body, "memory")
        if body.get("name") is not None and not isinstance(body["name"], str):
            raise E2BError(400, "name must be a string")
        await self._live(sandbox_id, owner)
        if body.get("memory") is True:
            raise E2BError(
                422, "dsec snapshots are filesystem-only: use mode='filesystem' (or leave it unset)"
            )
        name = body.get("name") or f"e2b-snapshot-{secrets.token_hex(6)}"
        if not isinstance(name, str):
            raise E2BError(400, "name must be a string")
        try:
            req = SandboxSnapshotRequest(sandbox_id=sandbox_id, name=name)
        except ValidationError as e:
            raise E2BError(400, f"invalid snapshot name {name!r}: {e.errors()[0]['msg']}") from None
        await self.edge.snapshot_sandbox(req, owner)
        snap = SnapshotInfo(snapshot_id=name, names=[name])
        return JSONResponse(snap.to_dict(), status_code=201)

    async def fork(self, request: Request, owner: str) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 20:
            raise E2BError(400, "count must be an integer between 1 and 20")
        if body.get("timeout") is not None:
            self._seconds(body, "timeout")
        info = await self._live(sandbox_id, owner)
        # packed, not shared: E2B's fork leaves the source running with its processes (a
        # shared fork stops them: the source restarts on a fresh layer)
        fork = validated(
            ForkRequest, sandbox_id=sandbox_id, n=count, labels=dict(info.labels), method="pack"
        )
        result = await self.edge.fork_sandbox(fork, owner)
        out: list[dict[str, Any]] = []
        for child in result.sandboxes:
            if body.get("timeout") is not None:
                child = await self.edge.set_ttl(
                    _ttl(child.id, self._seconds(body, "timeout")), owner
                )
            out.append({"sandbox": self._created(child, owner)})
        return JSONResponse(out, status_code=201)

    async def update_network(self, request: Request, owner: str) -> Response:
        """Replace the egress rules of a running sandbox (E2B: omitted fields are reset to
        their defaults). The sandbox must have been created with a network."""
        sandbox_id = request.path_params["sandbox_id"]
        body = await self._json(request)
        _check_network_body(body)
        try:
            wire = SandboxNetworkUpdateConfig.from_dict(body)
        except (KeyError, TypeError, ValueError) as e:
            raise E2BError(400, f"invalid network update: {e}") from None
        internet = _unset(wire.allow_internet_access)
        if internet is not None and not isinstance(internet, bool):
            raise E2BError(400, "allow_internet_access must be a boolean")
        policy = policy_from_e2b(internet, E2BEgress.from_wire(wire), updating=True)
        await self._live(sandbox_id, owner)
        await self.edge.update_network(
            validated(NetworkPolicyRequest, sandbox_id=sandbox_id, policy=policy), owner
        )
        return Response(status_code=204)

    async def _metric(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """One E2B ``SandboxMetric`` of the sandbox, now."""
        if not isinstance(self.edge, MetricsEdge):
            await self._live(sandbox_id, owner)
            raise E2BError(422, "this dsec server cannot measure sandboxes")
        try:
            m = await self.edge.sandbox_metrics(sandbox_ref(sandbox_id), owner)
        except SandboxStopped:
            raise E2BError(404, f"sandbox {sandbox_id} not found") from None
        return {
            "timestamp": m.timestamp.isoformat().replace("+00:00", "Z"),
            "timestampUnix": int(m.timestamp.timestamp()),
            "cpuCount": max(1, math.ceil(m.cpu.limit_cores)),
            "cpuUsedPct": m.cpu.used_pct,
            "memUsed": m.memory.used_bytes,
            "memTotal": m.memory.limit_bytes or 0,
            "memCache": m.memory.cache_bytes,
            "diskUsed": m.disk.used_bytes or 0,
            "diskTotal": m.disk.total_bytes or 0,
        }

    @staticmethod
    def _time_window(request: Request) -> tuple[float, float]:
        """``start``/``end`` query parameters (Unix seconds; defaults: ever, now)."""
        q = request.query_params
        try:
            start = float(q["start"]) if q.get("start") else -math.inf
            end = float(q["end"]) if q.get("end") else math.inf
        except ValueError:
            raise E2BError(400, "start and end are Unix timestamps in seconds") from None
        return start, end

    async def metrics(self, request: Request, owner: str) -> Response:
        """E2B ``get_metrics``: the metric taken now, if now is inside ``[start, end]``."""
        sandbox_id = request.path_params["sandbox_id"]
        start, end = self._time_window(request)
        metric = await self._metric(sandbox_id, owner)
        inside = start - 1 <= metric["timestampUnix"] <= end + 1
        return JSONResponse([metric] if inside else [])

    async def metrics_many(self, request: Request, owner: str) -> Response:
        """E2B ``GET /sandboxes/metrics?sandbox_ids=a,b``: the latest metric of each of this
        key's running sandboxes among them (others, and unknown ids, are left out)."""
        raw = request.query_params.get("sandbox_ids", "")
        ids = [x for x in (p.strip() for p in raw.split(",")) if x][:100]
        out: dict[str, Any] = {}
        for sandbox_id in ids:
            try:
                out[sandbox_id] = await self._metric(sandbox_id, owner)
            except (E2BError, SandboxNotFound, SandboxStopped, CapabilityNotSupported):
                continue
        return JSONResponse({"sandboxes": out})

    async def _log_entries(self, sandbox_id: str, owner: str) -> list[dict[str, Any]]:
        """The sandbox's logs as E2B log entries (oldest first), one per line of output."""
        await self._live(sandbox_id, owner)
        out: list[dict[str, Any]] = []
        lines = self.edge.sandbox_logs(sandbox_id, owner, follow=False)
        async with contextlib.aclosing(lines):
            async for chunk in lines:
                level = _LOG_LEVEL_OF.get(str(chunk.stream), "info")
                when = datetime.fromtimestamp(float(chunk.ts), UTC)
                stamp = when.isoformat().replace("+00:00", "Z")
                for text in str(chunk.data).splitlines():
                    out.append(
                        {
                            "timestamp": stamp,
                            "ms": int(float(chunk.ts) * 1000),
                            "message": text,
                            "level": level,
                            "fields": {"stream": str(chunk.stream)},
                        }
                    )
        return out

    @staticmethod
    def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise E2BError(400, f"{name} must be an integer") from None
        if not lo <= value <= hi:
            raise E2BError(400, f"{name} must be between {lo} and {hi}")
        return value

    async def logs_v1(self, request: Request, owner: str) -> Response:
        """E2B ``GET /sandboxes/{id}/logs?start=<ms>&limit=<n>`` (oldest first)."""
        start = self._int_param(request, "start", 0, 0, 1 << 62)
        limit = self._int_param(request, "limit", 1000, 0, 10_000)
        entries = [
            e
            for e in await self._log_entries(request.path_params["sandbox_id"], owner)
            if e["ms"] >= start
        ][:limit]
        return JSONResponse(
            {
                "logs": [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries],
                "logEntries": [_wire_entry(e) for e in entries],
            }
        )

    async def logs_v2(self, request: Request, owner: str) -> Response:
        """E2B ``GET /v2/sandboxes/{id}/logs``: ``cursor`` (ms), ``limit``, ``direction``
        (``forward``: from the cursor on, oldest first; ``backward``: up to it, newest first),
        ``level`` (the lowest level shown) and ``search`` (a substring of the message)."""
        q = request.query_params
        limit = self._int_param(request, "limit", 1000, 0, 10_000)
        direction = q.get("direction") or "forward"
        if direction not in ("forward", "backward"):
            raise E2BError(400, "direction must be forward or backward")
        level = q.get("level") or "debug"
        if level not in _LOG_LEVELS:
            raise E2BError(400, f"level must be one of {', '.join(_LOG_LEVELS)}")
        search = q.get("search") or ""
        entries = await self._log_entries(request.path_params["sandbox_id"], owner)
        floor = _LOG_LEVELS.index(level)
        entries = [
            e
            for e in entries
            if _LOG_LEVELS.index(e["level"]) >= floor and (not search or search in e["message"])
        ]
        if direction == "forward":
            cursor = self._int_param(request, "cursor", 0, 0, 1 << 62)
            chosen = [e for e in entries if e["ms"] >= cursor][:limit]
        else:
            cursor = self._int_param(request, "cursor", 1 << 62, 0, 1 << 62)
            chosen = [e for e in reversed(entries) if e["ms"] <= cursor][:limit]
        return JSONResponse({"logs": [_wire_entry(e) for e in chosen]})

    async def list_snapshots(self, request: Request, owner: str) -> Response:
        """``owner``'s snapshots (its images made by a snapshot, E2B's or dsec's), newest
        first, filtered by ``sandboxID`` and ``name``; keyset pages of ``limit`` (1..100)
        with ``X-Next-Token``."""
        q = request.query_params
        try:
            limit = int(q.get("limit", LIST_PAGE_MAX))
        except ValueError:
            raise E2BError(400, "limit must be an integer") from None
        if not 1 <= limit <= LIST_PAGE_MAX:
            raise E2BError(400, f"limit must be between 1 and {LIST_PAGE_MAX}")
        images = [
            i
            for i in (await self.edge.list_images(KeyScope(), owner)).images
            if i.owner == owner and i.meta.get("snapshot_of") and i.status == "ready"
        ]
        if q.get("sandboxID"):
            images = [i for i in images if i.meta.get("snapshot_of") == q["sandboxID"]]
        if q.get("name"):
            images = [i for i in images if i.name == q["name"]]
        images.sort(key=lambda i: (_aware(i.created_at), i.name), reverse=True)
        token = q.get("nextToken")
        if token:
            last = _decode_token(token)
            images = [i for i in images if (_aware(i.created_at), i.name) < last]
        page = images[:limit]
        headers = {}
        if len(images) > limit:
            headers["X-Next-Token"] = _encode_token(page[-1].created_at, page[-1].name)
        body = [SnapshotInfo(snapshot_id=i.name, names=[i.name]).to_dict() for i in page]
        return JSONResponse(body, headers=headers)

    async def delete_snapshot(self, request: Request, owner: str) -> Response:
        """``Sandbox.delete_snapshot`` on an app without the template API: forget ``owner``'s
        snapshot image (its layers stay while sandboxes use them). Another key's, or no such
        snapshot: 404; a system image or an image that is not a snapshot: 403."""
        name = request.path_params["template_id"]
        try:
            image = await self.edge.get_image(image_ref(name), owner)
        except ImageNotFound:
            return _error(404, f"snapshot {name!r} not found")
        if image.owner != owner:
            return _error(403, f"template {name!r} is not yours to delete")
        if not image.meta.get("snapshot_of"):
            return _error(403, f"{name!r} is not a snapshot (dsec's E2B API deletes snapshots)")
        try:
            await self.edge.delete_image(DeleteImageRequest(name=name), owner)
        except ImageNotFound:
            return _error(404, f"snapshot {name!r} not found")
        return Response(status_code=204)


def _ttl(sandbox_id: str, seconds: float) -> SetTTLRequest:
    return validated(SetTTLRequest, sandbox_id=sandbox_id, ttl_s=seconds)
