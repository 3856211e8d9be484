"""Every apiserver route against FakeEdge, through the real app (httpx.ASGITransport)."""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxExecRequest, SetTTLRequest
from dsec.testing import FakeEdge

KEY = "dsec_routes_test"
OWNER = owner_id(KEY)


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
async def client(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(edge, StaticKeys([KEY]), max_upload_bytes=64 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://dsec", headers={"authorization": f"Bearer {KEY}"}
    ) as c:
        yield c


async def _sandbox(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == code, err
    return err


# --- lifecycle ------------------------------------------------------------------
async def test_sandbox_lifecycle(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(
        client,
        image="busybox",
        cpu=0.5,
        memory_mb=256,
        labels={"task": "a"},
        job="j1",
        env={"A": "1"},
    )
    assert sid.startswith("sb-fake-")
    req = edge.calls_to("create_sandbox")[0]["req"]
    assert (req.cpu, req.memory_mb, req.env, req.job) == (0.5, 256, {"A": "1"}, "j1")

    info = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert info["state"] == "running" and info["labels"] == {"task": "a"}

    r = await client.post(f"/v1/sandboxes/{sid}/ttl", json={"ttl_s": 30})
    assert r.status_code == 200 and r.json()["ttl_s"] == 30
    assert edge.calls_to("set_ttl")[0] == {
        "req": SetTTLRequest(sandbox_id=sid, ttl_s=30),
        "owner": OWNER,
    }

    other = await _sandbox(client, labels={"task": "b"})
    listed = (await client.get("/v1/sandboxes", params=[("label", "task=a")])).json()
    assert [s["id"] for s in listed["sandboxes"]] == [sid]
    listed = (await client.get("/v1/sandboxes", params={"job": "j1", "state": "running"})).json()
    assert [s["id"] for s in listed["sandboxes"]] == [sid]
    assert edge.calls_to("list_sandboxes")[-1]["req"].state == "running"

    r = await client.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    running = (await client.get("/v1/sandboxes")).json()["sandboxes"]
    assert [s["id"] for s in running] == [other]
    everything = (await client.get("/v1/sandboxes", params={"include_stopped": "true"})).json()
    assert {s["id"] for s in everything["sandboxes"]} == {sid, other}
    _error(
        await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}), 409, "sandbox_stopped"
    )


async def test_create_errors_from_the_edge(client: httpx.AsyncClient) -> None:
    _error(await client.post("/v1/sandboxes", json={"tier": "vm"}), 422, "tier_unavailable")
    _error(await client.post("/v1/sandboxes", json={"image": "nope"}), 404, "image_not_found")


# --- exec -------------------------------------------------------------------------
async def test_exec(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(client)
    edge.program("make test", stdout="ok\n", stderr="warn\n", exit_code=2, duration_ms=5.0)
    r = await client.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": "make test", "cwd": "/src", "env": {"X": "y"}, "timeout_s": 5, "user": "1000"},
    )
    result = ExecResult.model_validate(r.json())
    assert (result.stdout, result.stderr, result.exit_code, result.ok) == (
        "ok\n",
        "warn\n",
        2,
        False,
    )
    req: ExecRequest = edge.calls_to("exec")[0]["req"]
    assert (req.cwd, req.env, req.timeout_s, req.user) == ("/src", {"X": "y"}, 5, "1000")
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin": "in"})
    assert r.json()["stdout"] == "in"


async def test_exec_stream_ndjson(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(client)
    edge.program("build", stdout="a\nb\n", stderr="c\n", exit_code=0)
    r = await client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "build"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-ndjson"
    events = [ExecEvent.model_validate_json(line) for line in r.text.splitlines()]
    assert [(e.type, e.data) for e in events[:-1]] == [
        ("stdout", "a\n"),
        ("stdout", "b\n"),
        ("stderr", "c\n"),
    ]
    assert events[-1].type == "exit" and events[-1].result is not None
    assert events[-1].result.exit_code == 0


async def test_exec_stream_errors(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    # Before the stream starts: a real HTTP status.
    _error(
        await client.post("/v1/sandboxes/sb-fake-0/exec/stream", json={"cmd": "x"}),
        404,
        "sandbox_not_found",
    )
    sid = await _sandbox(client)
    # During the stream: one error event, and it is the last line.
    edge.inject_error("exec_stream", E.SandboxError("runtime crashed", reason="oci"))
    r = await client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"})
    lines = r.text.splitlines()
    assert r.status_code == 200 and len(lines) == 1
    event = json.loads(lines[0])
    assert event == {
        "type": "error",
        "error": {
            "code": "sandbox_error",
            "message": "runtime crashed",
            "details": {"reason": "oci"},
        },
    }
    # A bug in the edge mid-stream: an internal error event with a request id, never a 500.
    edge.inject_error("exec_stream", RuntimeError("boom"))
    r = await client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"})
    event = json.loads(r.text.splitlines()[-1])
    assert event["type"] == "error" and event["error"]["code"] == "internal"
    assert event["error"]["details"]["request_id"] == r.headers["x-request-id"]


async def test_exec_stream_without_exit_is_reported(client: httpx.AsyncClient) -> None:
    class TruncatedEdge(FakeEdge):
        async def exec_stream(
            self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
        ) -> AsyncIterator[ExecEvent]:
            yield ExecEvent(type="stdout", data="partial")

    edge = TruncatedEdge()
    app = create_app(edge, StaticKeys([KEY]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://d",
        headers={"authorization": f"Bearer {KEY}"},
    ) as c:
        sid = await _sandbox(c)
        lines = (
            await c.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"})
        ).text.splitlines()
    assert json.loads(lines[0])["type"] == "stdout"
    assert json.loads(lines[-1])["error"]["code"] == "internal"


# --- files ----------------------------------------------------------------------------
async def test_files_routes(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(client)
    base = f"/v1/sandboxes/{sid}/files"
    r = await client.put(
        base, params={"path": "/w/a.bin", "mode": "0o600"}, content=b"\x00\xffdata"
    )
    assert r.status_code == 200 and r.json()["size"] == 6 and r.json()["mode"] == 0o600
    assert edge.calls_to("write_file")[0]["mode"] == 0o600
    r = await client.get(base, params={"path": "/w/a.bin"})
    assert r.content == b"\x00\xffdata" and r.headers["content-type"] == "application/octet-stream"
    assert (await client.get(f"{base}/stat", params={"path": "/w/a.bin"})).json()["type"] == "file"
    r = await client.post(f"{base}/mkdir", json={"path": "/w/sub/deep"})
    assert r.json()["type"] == "dir"
    r = await client.post(f"{base}/rename", json={"src": "/w/a.bin", "dst": "/w/sub/b.bin"})
    assert r.json()["path"] == "/w/sub/b.bin"
    listing = (await client.get(f"{base}/list", params={"path": "/w", "depth": 2})).json()[
        "entries"
    ]
    assert {e["path"] for e in listing} == {"/w/sub", "/w/sub/deep", "/w/sub/b.bin"}
    assert edge.calls_to("list_files")[0]["req"].depth == 2

    tar_bytes = (await client.get(f"{base}/tar", params={"path": "/w"})).content
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        assert "sub/b.bin" in tar.getnames()
    r = await client.put(
        f"{base}/tar",
        params={"path": "/copy"},
        content=tar_bytes,
        headers={"content-type": "application/x-tar"},
    )
    assert r.status_code == 200 and r.json()["files"] >= 3
    assert (await client.get(base, params={"path": "/copy/sub/b.bin"})).content == b"\x00\xffdata"

    _error(await client.delete(base, params={"path": "/w"}), 400, "invalid_request")  # non-empty
    r = await client.delete(base, params={"path": "/w", "recursive": "true"})
    assert r.status_code == 204 and r.content == b""
    _error(await client.get(base, params={"path": "/w/sub/b.bin"}), 404, "file_not_found")


# --- images, node -----------------------------------------------------------------------
def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_images_and_node(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    images = (await client.get("/v1/images")).json()["images"]
    assert [i["name"] for i in images] == ["busybox"]
    assert (await client.get("/v1/images/busybox")).json()["layers"] == images[0]["layers"]
    _error(await client.get("/v1/images/missing:1.0"), 404, "image_not_found")
    assert len((await client.get("/v1/layers")).json()["layers"]) == 1
    # a path on the server is never read: a JSON build request is refused, whatever it names
    err = _error(
        await client.post("/v1/images/build", json={"path": "/etc", "name": "x"}),
        400,
        "invalid_request",
    )
    assert "uploaded build context" in err["message"] and not edge.calls_to("build_image")
    context = _tar({"app/main.py": b"print(1)\n"})
    r = await client.post(
        "/v1/images/build",
        params={"name": "ws:1", "base": "busybox"},
        content=context,
        headers={"content-type": "application/x-tar"},
    )
    assert r.status_code == 201 and r.json()["name"] == "ws:1" and len(r.json()["layers"]) == 2
    assert r.json()["owner"] == OWNER
    call = edge.calls_to("build_image")[0]
    assert call["owner"] == OWNER and call["context"] == context
    assert (call["req"].name, call["req"].kind, call["req"].base) == (
        "ws:1",
        "workspace",
        "busybox",
    )
    node = (await client.get("/v1/node")).json()
    assert node["node"] == "fake" and len(node["tiers"]) == 4
    tiers = (await client.get("/v1/capabilities")).json()["tiers"]
    assert {t["tier"]: t["available"] for t in tiers} == {
        "fncall": True, "container": True, "microvm": False, "vm": False,
    }  # fmt: skip


# --- error mapping -------------------------------------------------------------------------
def _error_classes() -> list[type[E.DsecError]]:
    out: list[type[E.DsecError]] = []
    todo: list[type[E.DsecError]] = [E.DsecError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(out, key=lambda c: c.code)


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.code)
async def test_every_error_class_is_mapped(
    client: httpx.AsyncClient, edge: FakeEdge, cls: type[E.DsecError]
) -> None:
    sid = await _sandbox(client)
    edge.inject_error("get_sandbox", cls("it went wrong", sandbox_id=sid, n=3))
    r = await client.get(f"/v1/sandboxes/{sid}")
    err = _error(r, cls.http_status, cls.code)
    assert err == {
        "code": cls.code,
        "message": "it went wrong",
        "details": {"sandbox_id": sid, "n": 3},
    }
    rebuilt = E.error_from_wire(r.status_code, r.json())
    assert type(rebuilt) is cls and rebuilt.details == {"sandbox_id": sid, "n": 3}


async def test_unexpected_edge_exception_is_500_with_request_id(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    edge.inject_error("list_images", KeyError("bug"))
    r = await client.get("/v1/images")
    err = _error(r, 500, "internal")
    assert err["details"]["request_id"] == r.headers["x-request-id"]
    assert "bug" not in err["message"]  # internals are logged, not leaked


# --- validation and fuzzing -------------------------------------------------------------------
async def test_validation_is_400_with_field_errors(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    err = _error(
        await client.post("/v1/sandboxes", json={"cpu": -1, "memory_mb": "lots"}),
        400,
        "invalid_request",
    )
    locs = {tuple(e["loc"]) for e in err["details"]["errors"]}
    assert locs == {("body", "cpu"), ("body", "memory_mb")}
    assert err["message"].startswith("body.")
    err = _error(await client.post("/v1/sandboxes", json={"unknown": 1}), 400, "invalid_request")
    assert err["details"]["errors"][0]["type"] == "extra_forbidden"
    r = await client.post(
        "/v1/sandboxes", content=b"{", headers={"content-type": "application/json"}
    )
    _error(r, 400, "invalid_request")
    assert edge.calls_to("create_sandbox") == []


MALFORMED_PATH_IDS = [
    "SB-UPPER",
    "sb-",
    "sb-a_b",
    "x" * 80,
    "sb-" + "a" * 70,
    "..",
    "%00",
    "sb-a%2Fb",
]


@pytest.mark.parametrize("sid", MALFORMED_PATH_IDS)
async def test_malformed_sandbox_ids(client: httpx.AsyncClient, edge: FakeEdge, sid: str) -> None:
    r = await client.get(f"/v1/sandboxes/{sid}")
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["code"] in ("invalid_request", "not_found")
    assert edge.calls == []


@pytest.mark.parametrize(
    "params",
    [{}, {"path": "relative"}, {"path": "/a\x00b"}, {"path": "/" + "a" * 5000}, {"path": "/a", "mode": "999"},
     {"path": "/a", "mode": "0o17777"}, {"path": "/a", "mode": "-1"}],
)  # fmt: skip
async def test_malformed_file_params(
    client: httpx.AsyncClient, edge: FakeEdge, params: dict[str, str]
) -> None:
    sid = await _sandbox(client)
    r = await client.put(f"/v1/sandboxes/{sid}/files", params=params, content=b"x")
    _error(r, 400, "invalid_request")
    assert edge.calls_to("write_file") == []


async def test_label_filter_validation(client: httpx.AsyncClient) -> None:
    _error(await client.get("/v1/sandboxes", params={"label": "novalue"}), 400, "invalid_request")
    _error(await client.get("/v1/sandboxes", params={"state": "zombie"}), 400, "invalid_request")


async def test_fuzz_bodies_never_500(client: httpx.AsyncClient) -> None:
    sid = await _sandbox(client)
    rng = random.Random(1234)
    atoms: list[Any] = [
        None,
        True,
        0,
        -1,
        1e308,
        float("inf"),
        "",
        "x" * 300,
        "\x00",
        [],
        {},
        [1, "a"],
        {"a": {}},
    ]
    keys = ["cmd", "cwd", "env", "timeout_s", "stdin", "stdin_b64", "user", "max_output_bytes", "tier",
            "image", "layers", "cpu", "memory_mb", "labels", "ttl_s", "path", "src", "dst", "name", "kind"]  # fmt: skip
    targets = [
        ("POST", "/v1/sandboxes"),
        ("POST", f"/v1/sandboxes/{sid}/exec"),
        ("POST", f"/v1/sandboxes/{sid}/exec/stream"),
        ("POST", f"/v1/sandboxes/{sid}/ttl"),
        ("POST", f"/v1/sandboxes/{sid}/files/mkdir"),
        ("POST", f"/v1/sandboxes/{sid}/files/rename"),
        ("POST", "/v1/images/build"),
    ]
    raw_bodies = [b"", b"null", b"[]", b"\xff\xfe", b'{"cmd": "a"' * 50, b"1e99999", b'"str"']
    for i in range(150):
        method, path = targets[i % len(targets)]
        if i % 5 == 0:
            content = rng.choice(raw_bodies)
        else:
            body = {rng.choice(keys): rng.choice(atoms) for _ in range(rng.randint(0, 4))}
            content = json.dumps(body, allow_nan=True).encode()
        r = await client.request(
            method, path, content=content, headers={"content-type": "application/json"}
        )
        assert r.status_code < 500, (path, content, r.text)
        if r.status_code >= 400:
            assert "error" in r.json()


# --- size limits and routing ------------------------------------------------------------------
async def test_payload_too_large(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(client)
    big = b"x" * (64 * 1024 + 1)
    err = _error(await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=big),
                 413, "payload_too_large")  # fmt: skip
    assert err["details"]["limit_bytes"] == 64 * 1024

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted while streaming
        for _ in range(20):
            yield b"y" * 4096

    r = await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=chunks())
    _error(r, 413, "payload_too_large")
    r = await client.post(
        f"/v1/sandboxes/{sid}/exec", content=chunks(), headers={"content-type": "application/json"}
    )
    assert _error(r, 413, "payload_too_large")["details"] == {"limit_bytes": 64 * 1024}
    assert edge.calls_to("write_file") == []
    ok = await client.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "/ok"}, content=b"x" * 64 * 1024
    )
    assert ok.status_code == 200


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    _error(await client.get("/v1/nothing/here"), 404, "not_found")
    _error(await client.get("/nothing"), 404, "not_found")
    r = await client.put("/v1/sandboxes")
    assert r.status_code == 405 and r.json()["error"]["code"] == "invalid_request"


async def test_metrics_count_routes_by_template(client: httpx.AsyncClient) -> None:
    sid = await _sandbox(client)
    await client.get(f"/v1/sandboxes/{sid}")
    await client.get("/v1/sandboxes/sb-fake-missing")
    text = (await client.get("/metrics")).text
    assert (
        'dsec_api_requests_total{method="GET",route="/v1/sandboxes/{sandbox_id}",status="200"} 1.0'
        in text
    )
    assert (
        'dsec_api_requests_total{method="GET",route="/v1/sandboxes/{sandbox_id}",status="404"} 1.0'
        in text
    )
    assert 'dsec_api_errors_total{code="sandbox_not_found"} 1.0' in text
    assert "dsec_api_request_duration_seconds_bucket" in text
    assert sid not in text  # raw paths never become labels


async def test_metrics_split_a_creation_into_its_phases(client: httpx.AsyncClient) -> None:
    """``dsec_sandbox_create_phase_seconds``: one observation per phase of each creation
    (admission, the creation gate's queue, the runtime, the start command)."""
    await _sandbox(client)
    await _sandbox(client)
    text = (await client.get("/metrics")).text
    for phase in ("admit", "queue", "runtime", "start"):
        counts = [
            line
            for line in text.splitlines()
            if line.startswith("dsec_sandbox_create_phase_seconds_count")
            and f'phase="{phase}"' in line
        ]
        assert len(counts) == 1 and counts[0].endswith(" 2.0"), (phase, counts)
