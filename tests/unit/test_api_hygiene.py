"""What the API must never show (keys, server paths, bug texts) and its access log.

The apps are the real ones (``create_app`` plus the run_code router and the E2B app, wired
as ``dsec.server.build_app`` wires them) over the fake edge, driven through
``httpx.ASGITransport``.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.apiserver.middleware import access_log_mode, configure_access_log
from dsec.apiserver.routes_runcode import make_runcode_router, request_api_key
from dsec.e2b import make_e2b_app
from dsec.runtimes.fncall.service import (
    CodeRunRequest,
    CodeRunResult,
    RunCodeRequest,
    RunCodeResponse,
    RunCodeService,
    RunStatus,
)
from dsec.serverpaths import hide_server_path
from dsec.testing import FakeEdge

KEY = "dsec_hygiene_test_key_0123456789abcdefghijklmnopq"
OWNER = owner_id(KEY)
SERVER_HOME = "/srv/dsec-hygiene-home"


class _Service:
    """RunCodeService's two methods, answering at once."""

    async def run_code(self, req: RunCodeRequest) -> RunCodeResponse:
        return RunCodeResponse(status=RunStatus.Success, message="", executor_pod_name="p/w1")

    async def run(self, req: CodeRunRequest) -> CodeRunResult:
        return CodeRunResult(outcome="ok")


def _app(edge: FakeEdge, access_log: str = "text") -> Any:
    """The full HTTP surface, as ``dsec.server.build_app`` builds it."""
    keys = StaticKeys([KEY])
    app = create_app(edge, keys, access_log=access_log)
    e2b = make_e2b_app(edge, keys.verify)
    app.mount("/e2b", e2b)
    app.router.routes.extend(e2b.state.e2b.envd.files_routes())

    def authorize(request: Any) -> str | None:
        key = request_api_key(request)
        return keys.verify(key) if key else None

    service = _Service()
    app.include_router(make_runcode_router(lambda: service, authorize))  # type: ignore[arg-type,return-value]
    return app


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
async def client(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(edge))
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
        yield c


AUTH = {"authorization": f"Bearer {KEY}"}


# --- leaks ------------------------------------------------------------------------
async def test_unknown_keyed_route_does_not_echo_the_key(client: httpx.AsyncClient) -> None:
    for method, path in [("POST", f"/k/{KEY}/nope"), ("GET", f"/k/{KEY}/run_code")]:
        r = await client.request(method, path)
        assert r.status_code in (404, 405), r.text
        assert KEY not in r.text and KEY not in str(r.headers)
        assert "/k/{api_key}/" in r.json()["error"]["message"], r.text


async def test_405_lists_every_method_of_the_path(client: httpx.AsyncClient) -> None:
    sid = (await client.post("/v1/sandboxes", json={}, headers=AUTH)).json()["id"]
    r = await client.request("PATCH", f"/v1/sandboxes/{sid}/files?path=/a", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "invalid_request"
    # three routes share the path, one per method: all of them are allowed
    assert set(r.headers["allow"].split(", ")) >= {"GET", "PUT", "DELETE"}


@pytest.fixture
def hidden_home() -> Iterator[str]:
    hide_server_path(SERVER_HOME, "$DSEC_HOME")
    yield SERVER_HOME


async def test_server_paths_are_hidden_in_every_error_shape(
    client: httpx.AsyncClient, edge: FakeEdge, hidden_home: str
) -> None:
    sid = (await client.post("/v1/sandboxes", json={}, headers=AUTH)).json()["id"]
    where = f"{hidden_home}/sandboxes/{sid}/rootfs"

    def failure() -> E.DsecError:
        return E.SandboxError(f"cannot remove {where}: busy", path=where, paths=[where])

    # the dsec API's JSON errors
    edge.inject_error("exec", failure())
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=AUTH)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert hidden_home not in r.text
    assert err["message"] == f"cannot remove $DSEC_HOME/sandboxes/{sid}/rootfs: busy"
    assert err["details"]["paths"] == [f"$DSEC_HOME/sandboxes/{sid}/rootfs"]
    # E2B's control plane
    edge.inject_error("kill_sandbox", failure())
    r = await client.delete(f"/e2b/sandboxes/{sid}", headers={"x-api-key": KEY})
    assert r.status_code == 500 and hidden_home not in r.text and "$DSEC_HOME" in r.text
    # a path that only starts like the home is somebody else's: left alone
    other = E.SandboxError(f"cannot read {hidden_home}2/x")
    assert other.to_wire()["error"]["message"] == f"cannot read {hidden_home}2/x"
    # the exception keeps the real path for the server's own log
    assert where in failure().message


async def test_sandboxfusion_answers_name_no_server_path(tmp_path: Path) -> None:
    runtime = SimpleNamespace(paths=SimpleNamespace(home=tmp_path))
    service = RunCodeService(runtime)  # type: ignore[arg-type]
    resp = await service.run_code(RunCodeRequest(code="x", language="cobol"))
    assert resp.status == RunStatus.SandboxError and "cobol" in resp.message
    assert str(tmp_path) not in resp.model_dump_json()
    assert resp.executor_pod_name == "dsec-fncall"
    named = RunCodeService(runtime, pod_name="dsec-fncall@node1")  # type: ignore[arg-type]
    resp = await named.run_code(RunCodeRequest(code="x", language="cobol"))
    assert resp.executor_pod_name == "dsec-fncall@node1"


async def test_e2b_process_bug_text_stays_in_the_log(
    edge: FakeEdge, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a process stream (an exception that is not a dsec error, whose text names
    a server file) reaches the E2B client as a generic internal error."""
    from dsec.e2b.interactive import ExecStreamProcess
    from dsec.models import CreateSandboxRequest, ExecRequest

    info = await edge.create_sandbox(CreateSandboxRequest(), "o")

    async def broken(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise OSError(f"[Errno 5] Input/output error: '{SERVER_HOME}/sandboxes/x/exec.sock'")
        yield  # pragma: no cover

    edge.exec_stream = broken  # type: ignore[method-assign]
    proc = ExecStreamProcess(edge, info.id, "o", ExecRequest(cmd="true"))
    with caplog.at_level(logging.ERROR, "dsec.e2b"), pytest.raises(E.InternalError) as got:
        await proc.wait()
    assert SERVER_HOME not in got.value.message and "server log" in got.value.message
    assert any(SERVER_HOME in (r.exc_text or "") for r in caplog.records)


# --- access log ---------------------------------------------------------------------
LINE = re.compile(
    r"^method=(?P<method>\S+) route=(?P<route>\S+) status=(?P<status>\d+) "
    r"ms=(?P<ms>\d+\.\d\d) owner=(?P<owner>\S+) request_id=(?P<rid>[0-9a-f]{16})$"
)


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    out = []
    for rec in caplog.records:
        if rec.name == "dsec.access":
            m = LINE.match(rec.getMessage())
            assert m, rec.getMessage()
            out.append(m.groupdict())
    return out


async def test_access_log_one_line_per_request_with_templates(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dsec.access")
    r = await client.post("/v1/sandboxes", json={}, headers=AUTH)
    sid = r.json()["id"]
    rid = r.headers["x-request-id"]
    await client.put(f"/v1/sandboxes/{sid}/files?path=/etc/hostname", content=b"h", headers=AUTH)
    await client.get(f"/v1/sandboxes/{sid}/files?path=/etc/hostname", headers=AUTH)
    await client.get(f"/v1/sandboxes/{sid}")  # no key: 401 before any route ran
    await client.post(f"/k/{KEY}/run_code", json={"code": "1", "language": "python"})
    await client.post("/k/not-a-key/run_code", json={"code": "1", "language": "python"})
    await client.post(f"/k/{KEY}/elsewhere")
    await client.post("/v1/run_code", json={"code": "1", "language": "python"}, headers=AUTH)
    await client.get(f"/e2b/sandboxes/{sid}", headers={"x-api-key": KEY})
    await client.get("/e2b/no/such/route", headers={"x-api-key": KEY})
    await client.get("/healthz")
    got = [(x["method"], x["route"], x["status"], x["owner"]) for x in _lines(caplog)]
    assert got == [
        ("POST", "/v1/sandboxes", "201", OWNER),
        ("PUT", "/v1/sandboxes/{sandbox_id}/files", "200", OWNER),
        ("GET", "/v1/sandboxes/{sandbox_id}/files", "200", OWNER),
        ("GET", "/v1/sandboxes/{sandbox_id}", "401", "-"),
        ("POST", "/k/{api_key}/run_code", "200", OWNER),
        ("POST", "/k/{api_key}/run_code", "401", "-"),
        ("POST", "<unmatched>", "404", "-"),
        ("POST", "/v1/run_code", "200", OWNER),
        ("GET", "/e2b/sandboxes/{sandbox_id}", "200", OWNER),
        ("GET", "/e2b/{rest:path}", "501", "-"),
        ("GET", "/healthz", "200", "-"),
    ]
    first = _lines(caplog)[0]
    assert first["rid"] == rid and float(first["ms"]) >= 0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in text and sid not in text and "not-a-key" not in text
    assert "/etc/hostname" not in text and "elsewhere" not in text


async def test_access_log_covers_envd_and_bugs(
    edge: FakeEdge, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dsec.access")
    app = _app(edge)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
        r = await c.post(
            "/e2b/sandboxes", json={"templateID": "busybox"}, headers={"x-api-key": KEY}
        )
        assert r.status_code == 201, r.text
        sbx = r.json()
        envd = {"e2b-sandbox-id": sbx["sandboxID"], "x-access-token": sbx["envdAccessToken"]}
        r = await c.post(
            "/e2b/envd/filesystem.Filesystem/Stat",
            json={"path": "/"},
            headers={**envd, "content-type": "application/json", "connect-protocol-version": "1"},
        )
        assert r.status_code == 200, r.text
        r = await c.post("/e2b/envd/files?path=/tmp/f", content=b"x", headers=envd)
        assert r.status_code == 200, r.text
        edge.inject_error("list_sandboxes", RuntimeError("a bug"))
        r = await c.get("/v1/sandboxes", headers=AUTH)
        assert r.status_code == 500
    got = [(x["method"], x["route"], x["status"], x["owner"]) for x in _lines(caplog)]
    assert got[1:] == [
        ("POST", "/e2b/envd/filesystem.Filesystem/Stat", "200", OWNER),
        ("POST", "/e2b/envd/files", "200", OWNER),
        ("GET", "/v1/sandboxes", "500", OWNER),
    ]
    assert sbx["envdAccessToken"] not in "\n".join(r.getMessage() for r in caplog.records)


async def test_access_log_json_format_parses(edge: FakeEdge) -> None:
    stream = io.StringIO()
    configure_access_log("json", stream=stream)
    try:
        transport = httpx.ASGITransport(app=_app(edge, access_log="json"))
        async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
            r = await c.post("/v1/sandboxes", json={}, headers=AUTH)
            await c.post(f"/k/{KEY}/run_code", json={"code": "1", "language": "python"})
    finally:
        configure_access_log("text")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["method"], x["route"], x["status"]) for x in lines] == [
        ("POST", "/v1/sandboxes", 201),
        ("POST", "/k/{api_key}/run_code", 200),
    ]
    first = lines[0]
    assert set(first) == {"ts", "type", "method", "route", "status", "ms", "owner", "request_id"}
    assert first["type"] == "access" and first["owner"] == OWNER
    assert first["request_id"] == r.headers["x-request-id"]
    assert isinstance(first["ms"], float) and first["ms"] >= 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert KEY not in stream.getvalue()


async def test_access_log_off_and_bad_settings(
    edge: FakeEdge, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "dsec.access")
    transport = httpx.ASGITransport(app=_app(edge, access_log="off"))
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
        assert (await c.get("/healthz")).status_code == 200
    assert _lines(caplog) == []
    monkeypatch.setenv("DSEC_ACCESS_LOG", "JSON")
    assert access_log_mode() == "json"
    monkeypatch.delenv("DSEC_ACCESS_LOG")
    assert access_log_mode() == "text"
    with pytest.raises(E.InvalidRequest, match="text, json, off"):
        access_log_mode("verbose")


async def test_405_allow_prefers_the_static_route(client: httpx.AsyncClient) -> None:
    """``/v1/sandboxes/batch`` also matches ``/v1/sandboxes/{sandbox_id}`` (GET, DELETE),
    but only POST is served there."""
    r = await client.request("OPTIONS", "/v1/sandboxes/batch", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


async def test_static_route_with_another_method_is_405_not_a_bad_id(
    client: httpx.AsyncClient,
) -> None:
    """``GET /v1/sandboxes/batch`` is the batch route asked with the wrong method, not
    ``GET /v1/sandboxes/{sandbox_id}`` with a malformed id."""
    r = await client.get("/v1/sandboxes/batch", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    r = await client.get("/v1/sandboxes/Not-An-Id", headers=AUTH)  # still a bad id
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


async def test_e2b_refusals_are_json_never_500(client: httpx.AsyncClient) -> None:
    """Found by the fuzz (tests/integration/test_api_fuzz_root.py): a deeply nested body
    was a 500 on the control plane; envd's router answered 405 in plain text."""
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/e2b/sandboxes", "/e2b/sandboxes/sb-x/refreshes"):
        r = await client.post(path, content=deep, headers={"x-api-key": KEY})
        assert r.status_code == 400 and "nested too deeply" in r.json()["message"], r.text
    r = await client.post("/e2b/envd/health")
    assert r.status_code == 405 and r.json()["code"] == 405, r.text
    assert "GET" in r.headers["allow"]
    r = await client.request("OPTIONS", "/e2b/sandboxes", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["code"] == 405, r.text


def test_reasons_in_answers_hide_server_paths(hidden_home: str) -> None:
    """A failed creation's ``stopped_reason`` and an unavailable tier's ``reason`` are
    answers (200), not errors, and can quote a server path too."""
    from datetime import UTC, datetime

    from dsec.models import BatchItemError, Capabilities, SandboxInfo

    now = datetime.now(UTC)
    info = SandboxInfo(
        id="sb-x-1",
        tier="container",
        image="busybox",
        state="stopped",
        cpu=1,
        memory_mb=64,
        disk_mb=64,
        node="x",
        created_at=now,
        updated_at=now,
        stopped_reason=f"creation failed: [Errno 2] '{hidden_home}/sandboxes/sb-x-1/bundle'",
    )
    wire = info.model_dump_json()
    assert hidden_home not in wire and "'$DSEC_HOME/sandboxes/sb-x-1/bundle'" in wire
    assert info.stopped_reason is not None and hidden_home in info.stopped_reason  # the log's
    caps = Capabilities(tier="microvm", available=False, reason=f"no kernel in {hidden_home}/vm")
    assert caps.model_dump()["reason"] == "no kernel in $DSEC_HOME/vm"
    # a batch's per-sandbox error quotes its error's message: shown without the path too
    item = BatchItemError(index=0, code="sandbox_error", message=f"no {hidden_home}/vm")
    assert item.model_dump()["message"] == "no $DSEC_HOME/vm" and hidden_home in item.message


def test_an_e2b_app_dropped_without_aclose_leaves_no_scratch_directory() -> None:
    import gc

    keys = StaticKeys([KEY])
    app = make_e2b_app(FakeEdge(), keys.verify)
    scratch = list(app.state.e2b.scratch)
    assert scratch and all(p.is_dir() for p in scratch)
    del app
    gc.collect()
    assert not any(p.exists() for p in scratch)
