"""The verb table (:data:`dsec.contract.edge.VERBS`): each row agrees with the method its
ability protocol declares, and the route, the cluster forwarder and the SDK call generated
from it behave as a hand-written route did (strict requests, 400 before the edge, another
key's sandbox not found, 422 for an edge without the ability)."""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.builds.wire import BuildStarted
from dsec.contract.edge import SANDBOX_VERBS, VERBS, EdgeAPI, MetricsEdge
from dsec.contract.verbs import REPLAYED_HEADER, Envelope, Verb, VerbTable
from dsec.display import Click
from dsec.errors import ImageNotFound
from dsec.models import (
    DeleteImageRequest,
    DisplayActRequest,
    ExecRequest,
    NetworkPolicyRequest,
    NodeQuery,
    PauseRequest,
    PushImageRequest,
    RemoveFileRequest,
    SandboxExecRequest,
    SandboxInfo,
    SandboxRef,
    ScreenRequest,
    SetTTLRequest,
    ShareImageRequest,
)
from dsec.network.policy import NetworkPolicy
from dsec.sdk import AsyncClient, AsyncSandbox
from dsec.testing import FakeEdge, http_scope

KEY, OTHER = "dsec_verbs_key_a", "dsec_verbs_key_b"


def test_every_row_is_the_method_its_ability_declares() -> None:
    assert len(list(VERBS)) >= 5
    for verb in VERBS:
        fn = vars(verb.ability).get(verb.call)
        assert fn is not None, f"{verb.call} is not declared on {verb.ability.__name__}"
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters)
        takes_env = verb.sequenced or verb.keyed
        want = ["self", "req", "owner", "env"] if takes_env else ["self", "req", "owner"]
        if not verb.owned:  # a node-wide answer, the same for every key
            want = ["self", "req"]
        assert params == want, (verb.name, params)
        assert hints["req"] is verb.request, verb.name
        assert hints["return"] == (type(None) if verb.answer is None else verb.answer), verb.name
        if takes_env:
            assert hints["env"] is Envelope
        assert verb.path.startswith("/") and not verb.path.startswith("/v1")
        assert (verb.call in SANDBOX_VERBS) == verb.sandbox_scoped


def test_a_row_is_checked_when_it_is_written() -> None:
    class Lost(BaseModel):
        job: str

    with pytest.raises(ValueError, match="not in the request"):
        Verb("x", Lost, SandboxInfo, "GET", "/jobs/{name}", EdgeAPI, "x")
    with pytest.raises(ValueError, match="sandbox_id"):
        Verb("x", SandboxRef, SandboxInfo, "GET", "/sandboxes/all", EdgeAPI, "x")
    row = Verb("x", SandboxRef, SandboxInfo, "GET", "/sandboxes/{sandbox_id}/x", EdgeAPI, "x")
    with pytest.raises(ValueError, match="twice"):
        VerbTable(row, row)
    with pytest.raises(ValueError, match="owner"):
        Verb(
            "x",
            SandboxRef,
            SandboxInfo,
            "GET",
            "/sandboxes/{sandbox_id}",
            EdgeAPI,
            "x",
            owned=False,
        )


def test_the_wire_form_of_a_request() -> None:
    verb = VERBS["pause_sandbox"]
    req = PauseRequest(sandbox_id="sb-n-1")
    assert verb.url(req) == "/v1/sandboxes/sb-n-1/pause"
    assert verb.wire(req) == {}  # the server's default mode applies
    assert verb.wire(PauseRequest(sandbox_id="sb-n-1", mode="freeze")) == {"mode": "freeze"}
    answer = {
        "id": "sb-n-1",
        "tier": "container",
        "state": "paused",
        "image": "busybox",
        "cpu": 1.0,
        "memory_mb": 512,
        "disk_mb": 0,
        "node": "n",
        "created_at": "2026-12-07T00:00:00Z",
        "updated_at": "2026-12-07T00:00:00Z",
        "a_newer_field": 1,  # a newer server's: an SDK reading the answer drops it
    }
    assert verb.read_answer(answer, {"dsec.answer": True}).state == "paused"


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


def _client(edge: Any, key: str) -> httpx.AsyncClient:
    app = create_app(edge, StaticKeys([KEY, OTHER]))
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://dsec",
        headers={"authorization": f"Bearer {key}"},
    )


@pytest.fixture
async def clients(edge: FakeEdge) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with _client(edge, KEY) as a, _client(edge, OTHER) as b:
        yield a, b


async def _sandbox(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/sandboxes", json={"image": "busybox"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


_SAMPLES: dict[str, Any] = {
    "cmd": "true",
    "ttl_s": 5,
    "n": 1,
    "path": "/tmp",
    "src": "/a",
    "dst": "/b",
    "policy": {"presets": ["pypi"]},
}
"""A well-formed value of each required request field of the sandbox verbs."""
_ACTIONS: dict[str, Any] = {
    "display_move": {"x": 1, "y": 1},
    "display_drag": {"from_x": 1, "from_y": 1, "to_x": 2, "to_y": 2},
    "display_type": {"text": "a"},
    "display_key": {"name": "a"},
    "display_open": {"target": "/a"},
    "display_launch": {"app": "a"},
}
"""A well-formed body of each display action's row (the others' fields all have defaults)."""


def _code(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return str(r.json()["error"]["code"])


async def test_generated_routes_refuse_bad_requests_before_the_edge(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    a, _ = clients
    sid = await _sandbox(a)
    bad = [
        a.post(f"/v1/sandboxes/{sid}/ttl", json={"ttl_s": 0}),
        a.post(f"/v1/sandboxes/{sid}/ttl", json={"ttl_s": 5, "sandbox_id": sid}),  # path only
        a.post(f"/v1/sandboxes/{sid}/ttl", json={"ttl_s": "soon"}),
        a.post(f"/v1/sandboxes/{sid}/ttl"),  # the body is required
        a.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "hibernate"}),
        a.post(f"/v1/sandboxes/{sid}/pause", json={"mode": "freeze", "typo": 1}),
        a.post("/v1/sandboxes/SB-Upper/resume"),
        a.post(
            f"/v1/sandboxes/{sid}/pause",
            content=b"{not json",
            headers={"content-type": "application/json"},
        ),
    ]
    for call in bad:
        assert _code(await call, 400) == "invalid_request"
    assert edge.calls_to("set_ttl") == [] and edge.calls_to("pause_sandbox") == []


async def test_generated_routes_answer_as_the_edge_does(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    a, b = clients
    sid = await _sandbox(a)
    r = await a.post(f"/v1/sandboxes/{sid}/ttl", json={"ttl_s": 90})
    assert r.status_code == 200 and r.json()["ttl_s"] == 90
    assert edge.calls_to("set_ttl")[-1] == {
        "req": SetTTLRequest(sandbox_id=sid, ttl_s=90),
        "owner": owner_id(KEY),
    }
    r = await a.post(f"/v1/sandboxes/{sid}/pause")  # no body: the default mode
    assert r.status_code == 200 and r.json()["state"] == "paused"
    assert edge.calls_to("pause_sandbox")[-1]["req"] == PauseRequest(sandbox_id=sid)
    assert (await a.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
    # another key: not found, on every table verb about a sandbox
    for verb in VERBS:
        if not verb.sandbox_scoped:
            continue
        fields = {
            name: _SAMPLES[name] if name != "action" else _ACTIONS.get(verb.name, {})
            for name, f in verb.request.model_fields.items()
            if f.is_required() and name != "sandbox_id"
        }
        path = "/v1" + verb.path.format(sandbox_id=sid)
        if verb.in_query:
            r = await b.request(verb.method, path, params=fields)
        elif verb.body is not None:  # the field's value is the whole body
            r = await b.request(verb.method, path, json=fields[verb.body])
        else:
            r = await b.request(verb.method, path, json=fields or None)
        assert _code(r, 404) == "sandbox_not_found", verb.name
    # a single node cannot migrate: 422, after the sandbox was found
    r = await a.post(f"/v1/sandboxes/{sid}/migrate", json={})
    assert _code(r, 422) == "capability_not_supported"


async def test_lists_and_lookups_answer_only_the_keys_own(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    a, b = clients
    sid = await _sandbox(a)
    mine = (await a.get("/v1/sandboxes", params=[("label", "x=1"), ("state", "running")])).json()
    assert mine == {"sandboxes": []}  # no such label
    assert [s["id"] for s in (await a.get("/v1/sandboxes")).json()["sandboxes"]] == [sid]
    assert (await b.get("/v1/sandboxes", params={"include_stopped": "true"})).json() == {
        "sandboxes": []
    }
    assert edge.calls_to("list_sandboxes")[0]["req"].labels == {"x": "1"}
    before = len(edge.calls_to("list_sandboxes"))
    for bad in (
        {"label": "no-equals-sign"},
        {"state": "asleep"},
        {"job": "j" * 129},
        {"include_stopped": "perhaps"},
        {"typo": "1"},
    ):
        r = await a.get("/v1/sandboxes", params=bad)
        if "typo" in bad:  # an unknown query parameter is ignored, as before
            assert r.status_code == 200
            continue
        assert _code(r, 400) == "invalid_request", bad
    assert len(edge.calls_to("list_sandboxes")) == before + 1
    # get and kill: another key's sandbox is not found, its owner's is
    assert _code(await b.get(f"/v1/sandboxes/{sid}"), 404) == "sandbox_not_found"
    assert _code(await b.delete(f"/v1/sandboxes/{sid}"), 404) == "sandbox_not_found"
    assert (await a.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"
    assert _code(await a.get("/v1/sandboxes/SB-Upper"), 400) == "invalid_request"
    assert (await a.delete(f"/v1/sandboxes/{sid}")).json()["state"] == "stopped"
    # node-wide answers: the same for every key, and still only with a key
    for path in ("/v1/node", "/v1/capabilities"):
        assert (await a.get(path)).json() == (await b.get(path)).json()
        async with httpx.AsyncClient(transport=a._transport, base_url="http://dsec") as anonymous:
            assert _code(await anonymous.get(path), 401) == "unauthenticated"
    assert edge.calls_to("capabilities")[-1] == {"req": NodeQuery()}


class _SlowCreation(FakeEdge):
    async def create_sandbox(self, req: Any, owner: str, *args: Any, **kw: Any) -> SandboxInfo:
        await asyncio.sleep(0.05)  # the client's disconnect is read meanwhile
        return await super().create_sandbox(req, owner, *args, **kw)


async def _departing(
    app: Any, path: str, body: dict[str, Any], *headers: tuple[bytes, bytes]
) -> None:
    """POST ``body`` to ``path`` from a client whose disconnect arrives while the edge
    works (driven as ASGI messages: the route sees the ``http.disconnect``)."""
    raw = json.dumps(body).encode()
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": raw, "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # nothing more comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = http_scope(
        "POST",
        path,
        [
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            *headers,
        ],
    )
    await app(scope, receive, send)


async def test_a_batch_whose_client_left_is_taken_back() -> None:
    """The row's ``undo``: the generated batch route kills the sandboxes its client did not
    wait for (the client's disconnect arrives while the edge creates)."""
    edge = _SlowCreation()
    app = create_app(edge, StaticKeys([KEY]))
    await _departing(app, "/v1/sandboxes/batch", {"n": 2, "sandbox": {"image": "busybox"}})
    (made,) = edge.calls_to("create_sandboxes")
    killed = edge.calls_to("kill_sandbox")
    assert [k["owner"] for k in killed] == [made["owner"]] * 2 == [owner_id(KEY)] * 2
    assert [info.state for info in edge.sandboxes.values()] == ["stopped"] * 2


async def test_a_keyed_creation_whose_client_left_is_taken_back_unless_retried() -> None:
    """``create_sandbox`` is ``keyed``: its undo hands the sandbox to ``abandon_sandbox``,
    which kills it when no retry under the same key took it, and forgets the key, so the
    retry that comes after makes a new one."""
    edge = _SlowCreation()
    app = create_app(edge, StaticKeys([KEY]))
    key = (b"idempotency-key", b"rollout-7")
    await _departing(app, "/v1/sandboxes", {"image": "busybox"}, key)
    (gone,) = edge.sandboxes.values()
    assert gone.state == "stopped"
    async with _client(edge, KEY) as a:
        r = await a.post(
            "/v1/sandboxes", json={"image": "busybox"}, headers={"idempotency-key": "rollout-7"}
        )
        assert r.status_code == 201 and r.json()["id"] != gone.id and r.json()["state"] == "running"


class _NoMetrics:
    """An edge without the MetricsEdge ability: every EdgeAPI method of a real edge, and
    nothing else (the route must check the ability, not assume it)."""

    def __init__(self, inner: FakeEdge) -> None:
        for name in vars(EdgeAPI):
            if not name.startswith("_") and callable(getattr(inner, name, None)):
                setattr(self, name, getattr(inner, name))


async def test_an_edge_without_the_ability_answers_422_after_the_sandbox_is_found(
    edge: FakeEdge,
) -> None:
    bare = _NoMetrics(edge)
    assert isinstance(bare, EdgeAPI) and not isinstance(bare, MetricsEdge)
    async with _client(bare, KEY) as a, _client(bare, OTHER) as b:
        sid = await _sandbox(a)
        assert _code(await a.get(f"/v1/sandboxes/{sid}/metrics"), 422) == (
            "capability_not_supported"
        )
        assert _code(await b.get(f"/v1/sandboxes/{sid}/metrics"), 404) == "sandbox_not_found"


async def test_the_sdk_sends_table_verbs_through_its_transport(edge: FakeEdge) -> None:
    app = create_app(edge, StaticKeys([KEY]))
    transport = httpx.ASGITransport(app=app)
    async with await AsyncSandbox.create(
        image="busybox", api_key=KEY, url="http://dsec", transport=transport
    ) as sb:
        assert (await sb.set_ttl(120)).ttl_s == 120
        assert (await sb.pause()).state == "paused"
        assert (await sb.resume()).state == "running"
        assert (await sb.metrics()).sandbox_id == sb.id
        assert (await sb.commands.run("echo hi")).stdout == "hi\n"
    calls = [name for name, _ in edge.calls if name in VERBS]
    assert calls == [
        "create_sandbox",  # keyed: its Idempotency-Key reached the edge as its envelope
        "set_ttl",
        "pause_sandbox",
        "resume_sandbox",
        "sandbox_metrics",
        "exec",
        "kill_sandbox",  # leaving the block
    ]
    (create,) = edge.calls_to("create_sandbox")
    assert create["env"].idem_key and create["env"].seq is None
    (run,) = edge.calls_to("exec")  # sequenced: its number reached the edge as its envelope
    assert run["req"] == SandboxExecRequest(
        sandbox_id=sb.id, cmd="echo hi", timeout_s=60.0, max_output_bytes=1 << 20
    )
    assert run["env"] == Envelope(seq=1)


def test_a_row_may_name_its_body_model() -> None:
    """exec's body is an ExecRequest, documented under that name as the body of
    ``.../exec/stream`` is, and its route keeps the name it had (its operationId); a body
    model that is not the request's body fields is refused when the row is written."""
    doc = create_app(FakeEdge(), StaticKeys([KEY])).openapi()
    for path in ("/v1/sandboxes/{sandbox_id}/exec", "/v1/sandboxes/{sandbox_id}/exec/stream"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": "#/components/schemas/ExecRequest"}, path
    exec_route = doc["paths"]["/v1/sandboxes/{sandbox_id}/exec"]["post"]
    assert exec_route["operationId"] == "exec_command_v1_sandboxes__sandbox_id__exec_post"
    assert VERBS["exec"].wire(SandboxExecRequest(sandbox_id="sb-n-1", cmd="ls")) == {"cmd": "ls"}
    with pytest.raises(ValueError, match="body model"):
        Verb(
            "x",
            SetTTLRequest,
            SandboxInfo,
            "POST",
            "/sandboxes/{sandbox_id}/x",
            EdgeAPI,
            "x",
            body_model=ExecRequest,
        )


async def test_a_row_reads_its_answer_headers_from_the_answer(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    """exec's ``headers``: a repeat answered from the trajectory log says so in
    ``X-Dsec-Replayed`` (and in its body); the first answer has no such header."""
    a, _ = clients
    sid = await _sandbox(a)
    url, seq = f"/v1/sandboxes/{sid}/exec", {"x-dsec-seq": "1"}
    first = await a.post(url, json={"cmd": "echo once"}, headers=seq)
    assert first.status_code == 200 and REPLAYED_HEADER not in first.headers
    again = await a.post(url, json={"cmd": "echo once"}, headers=seq)
    assert again.headers[REPLAYED_HEADER] == "1" and again.json()["replayed"] is True
    assert again.json()["stdout"] == first.json()["stdout"] == "once\n"
    assert edge.executed["exec"] == 1


class _Relay:
    """The cluster's relay to the nodes, as a recorder: what each call asked, within how
    long."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...], float | None]] = []

    async def on_sandbox(self, sandbox_id: str, method: str, *args: Any, **kw: Any) -> Any:
        assert kw.pop("route_only") and set(kw) == {"timeout"}  # the request travels whole
        self.calls.append((sandbox_id, method, args, kw["timeout"]))
        return VERBS[method].read_answer({} if method == "exec" else None)


async def test_the_cluster_relays_a_call_within_its_own_time_budget() -> None:
    """exec's ``timeout``: the cluster relays an exec within its command's timeout plus
    the margin (``exec_margin_s``); a verb without a budget of its own within the default
    call timeout (None)."""
    from dsec.cluster.actor import NodeConfig
    from dsec.cluster.edge import ClusterEdge, ClusterOptions

    edge = ClusterEdge(None, NodeConfig(), ClusterOptions(exec_margin_s=7.0))
    relay = _Relay()
    edge.relay = relay  # type: ignore[assignment]
    req = SandboxExecRequest(sandbox_id="sb-node1-0123456789ab", cmd="sleep 1", timeout_s=5)
    assert (await edge.exec(req, "o", Envelope(seq=3))).exit_code is None
    await edge.remove_file(RemoveFileRequest(sandbox_id=req.sandbox_id, path="/tmp/x"), "o")
    assert relay.calls == [
        (req.sandbox_id, "exec", (req, "o", Envelope(seq=3)), 12.0),
        (
            req.sandbox_id,
            "remove_file",
            (RemoveFileRequest(sandbox_id=req.sandbox_id, path="/tmp/x"), "o"),
            None,
        ),
    ]


async def test_uptime_a_verb_added_by_one_row(edge: FakeEdge) -> None:
    """``sandbox_uptime`` was added after the table: its answer model, its protocol method
    and row, the edge's method and the SDK's (four files; the route, the cluster forwarder
    and the sync API came from the row)."""
    from dsec.cluster.edge import ClusterEdge

    assert "sandbox_uptime" in SANDBOX_VERBS and callable(vars(ClusterEdge)["sandbox_uptime"])
    app = create_app(edge, StaticKeys([KEY]))
    transport = httpx.ASGITransport(app=app)
    async with await AsyncSandbox.create(
        image="busybox", api_key=KEY, url="http://dsec", transport=transport, ttl_s=600
    ) as sb:
        first = await sb.uptime()
        assert first.sandbox_id == sb.id and first.state == "running"
        assert 0 <= first.idle_s <= first.uptime_s and 0 < first.expires_in_s <= 600
        await sb.pause()
        paused = await sb.uptime()
        assert paused.state == "paused" and paused.expires_in_s is None  # not resumed
        assert paused.uptime_s >= first.uptime_s
    assert not any(name == "resume_sandbox" for name, _ in edge.calls)
    # killed: answered while the node remembers it, its age frozen at the kill
    async with await AsyncSandbox.connect(
        sb.id, api_key=KEY, url="http://dsec", transport=transport
    ) as again:
        stopped = await again.uptime()
        assert stopped.state == "stopped" and stopped.expires_in_s is None
        assert (await again.uptime()).uptime_s == stopped.uptime_s


def test_image_names_travel_whole_in_the_path() -> None:
    """``{name:path}``: a name with ``/`` and ``:`` is one path parameter, quoted as the SDK
    always did (``/`` escaped, ``:`` kept); the documented path names it ``{name}``."""
    verb = VERBS["push_image"]
    req = PushImageRequest(name="k0123456789abcdef/app:1", target="oci://h:5000/r:t")
    assert verb.url(req) == "/v1/images/k0123456789abcdef%2Fapp:1/push"
    assert verb.template == "/images/{name}/push" and verb.path_params == ("name",)
    assert verb.wire(req) == {"target": "oci://h:5000/r:t"}
    policy = VERBS["update_network"]  # a body that is one field's value, not wrapped
    assert policy.wire(
        NetworkPolicyRequest(sandbox_id="sb-n-1", policy=NetworkPolicy(presets=["pypi"]))
    ) == NetworkPolicy(presets=["pypi"]).model_dump(mode="json")


async def test_image_and_build_verbs_are_the_keys_own(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], edge: FakeEdge
) -> None:
    """Node-wide verbs about a key's images and builds: another key's is not found, a
    malformed request a 400 before the edge, a system image the operator's alone."""
    a, b = clients
    layer = edge.memory_layers.get_image("busybox").layers
    edge.memory_layers.put_image("mine:1", layer, owner=owner_id(KEY))
    assert (await a.get("/v1/images/mine:1")).json()["name"] == "mine:1"
    assert "mine:1" in {i["name"] for i in (await a.get("/v1/images")).json()["images"]}
    assert "mine:1" not in {i["name"] for i in (await b.get("/v1/images")).json()["images"]}
    assert set((await a.get("/v1/layers")).json()) == {"layers"}
    for call in [
        b.get("/v1/images/mine:1"),
        b.delete("/v1/images/mine:1"),
        b.patch("/v1/images/mine:1", json={"shared": True}),
        b.post("/v1/images/mine:1/push", json={"target": "oci://127.0.0.1:1/x:y"}),
    ]:
        assert _code(await call, 404) == "image_not_found"
    shared = (await a.patch("/v1/images/mine:1", json={"shared": True})).json()
    seen = await b.get(f"/v1/images/{shared['owner']}%2Fmine:1")  # <owner>/<name>
    assert seen.status_code == 200 and seen.json()["layers"] == layer
    for call in [
        a.get("/v1/images/Bad Name!"),
        a.patch("/v1/images/mine:1", json={"shared": "sometimes"}),
        a.patch("/v1/images/mine:1", json={"shared": True, "typo": 1}),
        a.patch("/v1/images/mine:1"),  # the body is required
        a.post("/v1/images/mine:1/push", json={"target": "http://nowhere"}),
        a.post("/v1/images/pull", json={"ref": ""}),
        a.delete("/v1/images/mine:1", params={"system": "maybe"}),
        a.get("/v1/builds/-nope"),
    ]:
        assert _code(await call, 400) == "invalid_request"
    assert edge.calls_to("share_image")[-1]["req"] == ShareImageRequest(name="mine:1", shared=True)
    assert _code(await a.delete("/v1/images/busybox", params={"system": True}), 403)
    assert _code(await a.post("/v1/images/pull", json={"ref": "x/y:1", "system": True}), 403)
    assert (await a.delete("/v1/images/mine:1")).status_code == 204
    assert _code(await a.get("/v1/images/mine:1"), 404) == "image_not_found"
    # builds: the key's own records
    started = BuildStarted(build_id="b-1", name="app:1", base="busybox", steps=1)

    async def one_event() -> AsyncIterator[Any]:
        yield started

    async for _ in edge.build_records.record(owner_id(KEY), one_event()):
        pass
    assert [x["build_id"] for x in (await a.get("/v1/builds")).json()["builds"]] == ["b-1"]
    assert (await a.get("/v1/builds/b-1")).json()["build_id"] == "b-1"
    assert (await b.get("/v1/builds")).json()["builds"] == []
    assert _code(await b.get("/v1/builds/b-1"), 404) == "not_found"


async def test_the_sdk_sends_image_verbs_through_its_transport(edge: FakeEdge) -> None:
    app = create_app(edge, StaticKeys([KEY]))
    async with AsyncClient(
        api_key=KEY, url="http://dsec", transport=httpx.ASGITransport(app=app)
    ) as client:
        layer = edge.memory_layers.get_image("busybox").layers
        edge.memory_layers.put_image("mine:1", layer, owner=owner_id(KEY))
        assert (await client.get_image("mine:1")).owner == owner_id(KEY)
        assert "mine:1" in {i.name for i in await client.list_images()}
        assert (await client.share_image("mine:1")).shared
        assert {x.digest for x in await client.list_layers()} >= set(layer)
        await client.delete_image("mine:1")
        with pytest.raises(ImageNotFound):
            await client.get_image("mine:1")
    calls = [name for name, _ in edge.calls if name in VERBS]
    assert calls == [
        "get_image",
        "list_images",
        "share_image",
        "list_layers",
        "delete_image",
        "get_image",
    ]
    assert edge.calls_to("delete_image")[0]["req"] == DeleteImageRequest(name="mine:1")


def test_rows_may_share_a_method_and_carry_query_fields_with_a_body() -> None:
    """``call``: the edge method a row calls (its name by default); several rows may call
    one (the display actions). ``query``: fields of a ``POST`` that travel in the query.
    ``body_type``: the one kind a row's body field takes. Each is checked when written."""
    assert VERBS["set_ttl"].call == "set_ttl"
    rows = [v for v in VERBS if v.call == "display_act"]
    assert {v.name for v in rows} == {
        f"display_{kind}"
        for kind in ("move", "click", "drag", "scroll", "button", "type", "key", "open", "launch")
    }
    assert "display_act" in VERBS.calls() and "display_move" not in VERBS.calls()
    assert "display_act" in SANDBOX_VERBS and "display_move" not in SANDBOX_VERBS
    click = VERBS["display_click"]
    assert click.body_type is Click and click.query_fields == ("screen",)
    assert click.body_fields == ("action",) and VERBS["display_state"].body_fields == ()
    req = DisplayActRequest(sandbox_id="sb-n-1", action=Click(x=1, y=2), screen="console")
    assert click.url(req) == "/v1/sandboxes/sb-n-1/display/click"
    assert click.params(req) == {"screen": "console"}
    assert click.wire(req) == {"action": "click", "x": 1, "y": 2, "button": "left", "double": False}
    assert click.params(DisplayActRequest(sandbox_id="sb-n-1", action=Click())) == {}
    assert VERBS["display_state"].wire(ScreenRequest(sandbox_id="sb-n-1")) is None  # a GET

    def row(method: Any, **kw: Any) -> Verb:
        path = "/sandboxes/{sandbox_id}/display/x"
        return Verb("x", DisplayActRequest, None, method, path, EdgeAPI, "x", **kw)

    assert row("POST", call="display_act").call == "display_act"
    with pytest.raises(ValueError, match="query"):
        row("GET", query=("screen",))  # a GET's fields are all in the query already
    with pytest.raises(ValueError, match="query"):
        row("POST", query=("sandbox_id",))  # a path parameter
    with pytest.raises(ValueError, match="query"):
        row("POST", query=("nothing",))
    with pytest.raises(ValueError, match="body_type"):
        row("POST", body_type=Click)
    with pytest.raises(ValueError, match="only field"):
        row("POST", body="action")  # screen would be in the body beside it
    assert row("POST", body="action", query=("screen",), body_type=Click).body_fields == ("action",)


async def test_a_display_action_on_an_edge_without_the_display(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    """The FakeEdge has no DisplayEdge: the owner's sandbox is a 422, another key's a 404,
    a malformed action a 400 before either."""
    a, b = clients
    sid = await _sandbox(a)
    path = f"/v1/sandboxes/{sid}/display/click"
    assert _code(await a.post(path, json={"x": 1, "y": 1}), 422) == "capability_not_supported"
    assert _code(await b.post(path, json={"x": 1, "y": 1}), 404) == "sandbox_not_found"
    assert _code(await a.post(path, json={"x": 1}), 400) == "invalid_request"
    r = await a.post(path, params={"screen": "tv"}, json={})
    assert _code(r, 400) == "invalid_request"
    async with _client(object(), KEY) as bare:  # no edge verbs at all: says what it lacks
        r = await bare.post(path, json={"x": 1, "y": 1})
        assert _code(r, 422) == "capability_not_supported"


async def test_the_cluster_relays_a_shared_method_by_its_request() -> None:
    """``display_act`` (nine rows, one method) is relayed whole to the node its request's
    sandbox id names, as every table verb about a sandbox."""
    from dsec.cluster.actor import NodeConfig
    from dsec.cluster.edge import ClusterEdge, ClusterOptions

    sent: list[tuple[Any, ...]] = []

    class Relay:
        async def on_sandbox(self, sandbox_id: str, method: str, *args: Any, **kw: Any) -> None:
            sent.append((sandbox_id, method, *args, kw["route_only"]))

    edge = ClusterEdge(None, NodeConfig(), ClusterOptions())
    edge.relay = Relay()  # type: ignore[assignment]
    req = DisplayActRequest(sandbox_id="sb-n2-1", action=Click(x=1, y=2))
    await edge.display_act(req, "owner")
    assert sent == [("sb-n2-1", "display_act", req, "owner", True)]
