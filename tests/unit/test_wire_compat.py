"""A newer server never breaks an older SDK, and the SDK a trainer imports carries no server.

* Answers with fields this SDK does not know (at any depth), new tiers, states, layer kinds
  and event types still parse: a transport adds them to every answer of a real apiserver
  (over FakeEdge) and the SDK's whole surface keeps working.
* Requests stay strict where the server reads them: an unknown field is a 400.
* ``import dsec`` loads no server, node, edge or runtime module and none of their packages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec import AsyncClient, AsyncSandbox
from dsec.models import SandboxInfo
from dsec.testing import FakeEdge, app_transport
from dsec.wire import ANSWER

_MAPS = frozenset(
    {"labels", "env", "meta", "details", "outcomes", "config", "by_tier_state", "counts", "sources"}
)
"""Keys whose value is a map of the user's (not an object of the API's)."""


def _newer(value: Any) -> Any:
    """``value`` as a newer server would send it: an extra field in every object, and
    enumerations with members this SDK has never seen."""
    if isinstance(value, list):
        return [_newer(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: v if k in _MAPS else _newer(v) for k, v in value.items()}
    out["added_in_a_later_version"] = {"nested": [1, 2, 3]}
    if out.get("kind") in ("base", "workspace", "toolkit"):
        out["kind"] = "dataset"
    return out


class NewerServer(httpx.AsyncBaseTransport):
    """Forwards to ``inner`` and rewrites every JSON (and NDJSON) answer with :func:`_newer`;
    the stream of an exec gains an event type this SDK does not know."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        ctype = response.headers.get("content-type", "")
        if not ctype.startswith(("application/json", "application/x-ndjson")):
            return response
        body = await response.aread()
        if ctype.startswith("application/json"):
            new = json.dumps(_newer(json.loads(body))).encode() if body else body
        else:
            lines = [json.dumps({"type": "progress", "percent": 50})]
            lines += [json.dumps(_newer(json.loads(x))) for x in body.splitlines() if x.strip()]
            new = ("\n".join(lines) + "\n").encode()
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-length"]
        return httpx.Response(response.status_code, headers=headers, content=new)


async def test_an_older_sdk_reads_a_newer_servers_answers() -> None:
    edge = FakeEdge()
    inner, key = app_transport(edge)
    conn: dict[str, Any] = {"api_key": key, "transport": NewerServer(inner)}
    sb = await AsyncSandbox.create(image="busybox", labels={"t": "1"}, **conn)
    assert sb.info.state == "running"
    r = await sb.commands.run("echo hi")
    assert r.stdout == "hi\n" and r.exit_code == 0
    events = [e async for e in sb.commands.stream("echo streamed")]
    assert [e.type for e in events] == ["stdout", "exit"]  # the unknown event is skipped
    await sb.files.write("/f.txt", b"data")
    assert await sb.files.read("/f.txt") == b"data"
    assert [f.name for f in await sb.files.list("/")] == ["f.txt"]
    assert (await sb.files.stat("/f.txt")).size == 4
    layer = await sb.snapshot()
    assert layer.kind == "dataset"  # a layer kind this SDK does not know
    await sb.pause()
    await sb.resume()
    client = AsyncClient(**conn)
    assert [s.id for s in await client.list_sandboxes()] == [sb.id]
    assert [i.name for i in await client.list_images()] == ["busybox"]
    assert {c.tier for c in await client.capabilities()} >= {"container"}
    assert (await client.node_info()).node == "fake"
    await sb.kill()
    await client.close()


def test_answers_with_unknown_tiers_and_states_parse() -> None:
    info = {
        "id": "sb-n-1",
        "tier": "gpu",
        "image": "x",
        "state": "migrating",
        "cpu": 1,
        "memory_mb": 1,
        "disk_mb": 1,
        "node": "n",
        "created_at": "2026-12-01T00:00:00Z",
        "updated_at": "2026-12-01T00:00:00Z",
        "on_timeout": "hibernate",
        "network": {"allow_domains": ["a.b"], "quic": True},
        "energy_j": 3,
    }
    parsed = SandboxInfo.model_validate(info, context=ANSWER)
    assert (parsed.tier, parsed.state, parsed.on_timeout) == ("gpu", "migrating", "hibernate")
    with pytest.raises(ValueError):  # a server reading the same thing is strict
        SandboxInfo.model_validate(info)


async def test_requests_stay_strict_and_tiers_are_the_servers_call() -> None:
    edge = FakeEdge()
    transport, key = app_transport(edge)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        h = {"Authorization": f"Bearer {key}"}
        r = await http.post("/v1/sandboxes", json={"image": "busybox", "cpuu": 1}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await http.post(
            "/v1/sandboxes",
            json={"image": "busybox", "network": {"allow_domainz": ["x.y"]}},
            headers=h,
        )
        assert r.status_code == 400  # a typo in a policy never passes silently
    # the SDK sends a tier it does not know; the server is the one to refuse it
    with pytest.raises(E.InvalidRequest, match="unknown tier 'gpu'"):
        await AsyncSandbox.create(tier="gpu", api_key=key, transport=transport)
    assert edge.calls_to("create_sandbox")[-1]["req"].tier == "gpu"


def test_import_dsec_loads_no_server() -> None:
    code = """
import json, sys
import dsec
from dsec import AsyncSandbox, Sandbox, Client
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    server_side = (
        "dsec.apiserver",
        "dsec.cluster",
        "dsec.e2b",
        "dsec.edge",
        "dsec.layers",
        "dsec.network.manager",
        "dsec.privileged",
        "dsec.runtimes",
        "dsec.server",
        "dsec.testing",
        "fastapi",
        "starlette",
        "uvicorn",
        "uvloop",
        "ray",
        "mfusepy",
        "e2b",
        "prometheus_client",
    )
    bad = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in server_side))
    assert bad == []
