"""The port proxy (dsec.apiserver.ports) over the real apiserver and the real edge rules
(FakeEdge: ports of fake sandboxes are loopback servers this test runs), served by uvicorn
on a loopback port: HTTP (streamed both ways), WebSocket, raw TCP, the three routes, every
credential, and the bad-input answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from tests.timing import budget

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.apiserver.ports import PortTokens
from dsec.models import CreateSandboxRequest, PauseRequest
from dsec.testing import FakeEdge

websockets = pytest.importorskip("websockets")

KEY = "dsec_" + "k" * 43
OTHER = "dsec_" + "o" * 43
DOMAIN = "ports.test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Upstream:
    """The servers "inside" the fake sandboxes: a small asyncio HTTP/1.1 server whose
    answers depend on the path, and a WebSocket echo server."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.release = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers.setdefault(k.strip().lower(), v.strip())
        body = b""
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    await reader.readline()
                    break
                body += await reader.readexactly(size)
                await reader.readline()
        self.requests.append({"method": method, "target": target, "headers": headers, "body": body})
        if target.startswith("/stream"):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for i in range(3):
                line = json.dumps({"i": i}).encode() + b"\n"
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
                if i == 0:
                    await self.release.wait()
            writer.write(b"0\r\n\r\n")
        elif target.startswith("/hold"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
            await writer.drain()
            await self.release.wait()
            writer.write(b"ok")
        elif target.startswith("/close-early"):
            pass  # closes without an answer
        elif target.startswith("/until-eof"):
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        else:
            payload = json.dumps(
                {
                    "method": method,
                    "target": target,
                    "body": body.decode("latin-1"),
                    "headers": headers,
                }
            ).encode()
            writer.write(
                b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nx-app: yes\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
        with contextlib.suppress(Exception):
            await writer.drain()
        writer.close()


class Harness:
    def __init__(self) -> None:
        self.edge = FakeEdge(available_tiers=("container", "fncall"))
        self.tokens = PortTokens(b"s" * 32)
        self.app = create_app(
            self.edge,
            StaticKeys([KEY, OTHER]),
            port_tokens=self.tokens,
            ports_domain=DOMAIN,
            ports_scheme="http",
            access_log="off",
        )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self.upstream = Upstream()
        self.http_addr: tuple[str, int] = ("127.0.0.1", 0)
        self.ws_addr: tuple[str, int] = ("127.0.0.1", 0)

    def call(self, coro: Any) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def __enter__(self) -> Harness:
        ready = threading.Event()
        self._stop = threading.Event()

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.upstream.release = asyncio.Event()
            http_srv = await asyncio.start_server(self.upstream.handle, "127.0.0.1", 0)
            self.http_addr = http_srv.sockets[0].getsockname()[:2]

            async def echo(ws: Any) -> None:
                async for msg in ws:
                    await ws.send(msg)

            ws_srv = await websockets.serve(echo, "127.0.0.1", 0, subprotocols=["binary", "other"])
            self.ws_addr = next(iter(ws_srv.sockets)).getsockname()[:2]
            server = uvicorn.Server(
                uvicorn.Config(
                    self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
                )
            )
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
            server.should_exit = True
            await task
            http_srv.close()
            ws_srv.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert ready.wait(20)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(20)

    def sandbox(self, owner_key: str = KEY, **kw: Any) -> str:
        from dsec.apiserver.auth import owner_id

        info = self.call(self.edge.create_sandbox(CreateSandboxRequest(**kw), owner_id(owner_key)))
        sid: str = info.id
        if kw.get("tier", "container") != "fncall":
            self.edge.serve_port(sid, 8000, self.http_addr)
            self.edge.serve_port(sid, 8765, self.ws_addr)
        return sid


@pytest.fixture(scope="module")
def h() -> Iterator[Harness]:
    with Harness() as harness:
        yield harness


def client(h: Harness, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=h.url, timeout=10, **kw)


BEARER = {"authorization": f"Bearer {KEY}"}


def test_path_route_relays_method_path_query_body_and_answer(h: Harness) -> None:
    sid = h.sandbox()
    with client(h) as c:
        r = c.post(
            f"/v1/sandboxes/{sid}/ports/8000/api/x?a=1&b=2", headers=BEARER, content=b"hello"
        )
    assert r.status_code == 201, r.text
    assert r.headers["x-app"] == "yes"
    seen = r.json()
    assert (
        seen["method"] == "POST" and seen["target"] == "/api/x?a=1&b=2" and seen["body"] == "hello"
    )
    assert "authorization" not in seen["headers"]  # dsec's key never reaches the sandbox
    assert seen["headers"]["x-forwarded-prefix"] == f"/v1/sandboxes/{sid}/ports/8000"
    # the sandbox app's own Authorization passes through untouched
    with client(h) as c:
        r = c.get(
            f"/v1/sandboxes/{sid}/ports/8000/",
            headers={
                "authorization": "Basic dXNlcjpwdw==",
                "x-dsec-port-token": h.tokens.issue(sid, _owner(KEY)),
            },
        )
    assert r.json()["headers"]["authorization"] == "Basic dXNlcjpwdw=="
    assert "x-dsec-port-token" not in r.json()["headers"]


def _owner(key: str) -> str:
    from dsec.apiserver.auth import owner_id

    return owner_id(key)


def test_every_kind_of_token_and_the_cookie_it_sets(h: Harness) -> None:
    sid = h.sandbox()
    token = h.tokens.issue(sid, _owner(KEY))
    base = f"/v1/sandboxes/{sid}/ports/8000"
    with client(h) as c:
        assert c.get(f"{base}/x", headers={"e2b-traffic-access-token": token}).status_code == 201
        assert c.get(f"{base}/x", headers={"authorization": f"Bearer {token}"}).status_code == 201
        r = c.get(f"{base}/page?dsec_token={token}&keep=1")
        assert r.status_code == 201
        assert r.json()["target"] == "/page?keep=1"  # the token is not forwarded
        assert "dsec_port_token=" in r.headers["set-cookie"]
        assert f"Path={base}/" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
        # the cookie alone opens the other pages (a browser after its first visit)
        r = c.get(f"{base}/other.js")
        assert r.status_code == 201 and "dsec_port_token" not in r.json()["headers"].get(
            "cookie", ""
        )
    with client(h) as c:
        r = c.get(f"{base}/_dsec_token/{token}/is_alive")  # SWE-ReX style base URL
        assert r.status_code == 201 and r.json()["target"] == "/is_alive"
        assert "set-cookie" in r.headers
    # a token of another sandbox opens nothing
    other = h.sandbox()
    with client(h) as c:
        r = c.get(f"/v1/sandboxes/{other}/ports/8000/", headers={"x-dsec-port-token": token})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"


def test_a_token_in_the_url_is_consumed_whatever_headers_come_with_it(h: Harness) -> None:
    """A URL of ``sb.get_url()`` fetched by a client that also sends headers of its own (the
    key, another credential, the app's own Authorization): the token is the credential and
    never reaches the sandbox's server, which sees the path that was meant."""
    sid = h.sandbox()
    token = h.tokens.issue(sid, _owner(KEY))
    base = f"/v1/sandboxes/{sid}/ports/8000"
    with client(h) as c:
        for headers in (
            BEARER,
            {"x-dsec-port-token": token},
            {"authorization": f"Bearer {token}"},
            {"authorization": "Basic dXNlcjpwdw=="},
            {"cookie": f"dsec_port_token={token}"},
        ):
            r = c.get(f"{base}/_dsec_token/{token}/is_alive?x=1", headers=headers)
            assert r.status_code == 201, (headers, r.text)
            seen = r.json()
            assert seen["target"] == "/is_alive?x=1", headers
            assert token not in json.dumps(seen["headers"])
            assert KEY not in json.dumps(seen["headers"])
            r = c.get(f"{base}/page?dsec_token={token}&keep=1", headers=headers)
            assert r.status_code == 201 and r.json()["target"] == "/page?keep=1", headers
        r = c.get(f"{base}/_dsec_token/{token}/", headers={"authorization": "Basic dXNlcjpwdw=="})
        assert r.json()["headers"]["authorization"] == "Basic dXNlcjpwdw=="  # the app's own
        r = c.get(f"/p?dsec_token={token}", headers={"host": f"8000-{sid}.{DOMAIN}", **BEARER})
        assert r.status_code == 201 and r.json()["target"] == "/p"
    # a second key: its key, or the token of its own sandbox, opens nothing of this one
    theirs = h.sandbox(OTHER)
    their_token = h.tokens.issue(theirs, _owner(OTHER))
    with client(h) as c:
        other_key = {"authorization": f"Bearer {OTHER}"}
        r = c.get(f"{base}/_dsec_token/{their_token}/x", headers=other_key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        r = c.get(f"{base}/_dsec_token/{their_token}/x")
        assert r.status_code == 401
        r = c.get(f"/v1/sandboxes/{theirs}/ports/8000/_dsec_token/{token}/x", headers=BEARER)
        assert r.status_code == 404
        r = c.get("/x", headers={"host": f"8000-{sid}.{DOMAIN}", **other_key})
        assert r.status_code == 404
        r = c.get(f"/x?dsec_token={their_token}", headers={"host": f"8000-{sid}.{DOMAIN}"})
        assert r.status_code == 403


def test_bad_input_answers(h: Harness) -> None:
    sid = h.sandbox()
    fn = h.sandbox(tier="fncall")
    theirs = h.sandbox(OTHER)
    with client(h, headers=BEARER) as c:
        for port in ("0", "65536", "99999", "abc", "-1"):
            r = c.get(f"/v1/sandboxes/{sid}/ports/{port}/")
            assert r.status_code == 400, (port, r.text)
            assert r.json()["error"]["code"] == "invalid_request"
        r = c.get(f"/v1/sandboxes/{sid}/ports/9/")  # nothing listens
        assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_listening"
        r = c.get(f"/v1/sandboxes/{sid}/ports/8000/close-early")
        assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"
        missing = c.get("/v1/sandboxes/sb-fake-0123456789ab/ports/8000/")
        other = c.get(f"/v1/sandboxes/{theirs}/ports/8000/")
        assert missing.status_code == other.status_code == 404
        assert (
            missing.json()["error"]["code"] == other.json()["error"]["code"] == "sandbox_not_found"
        )
        r = c.get(f"/v1/sandboxes/{fn}/ports/8000/")
        assert r.status_code == 422 and r.json()["error"]["code"] == "capability_not_supported"
    with client(h) as c:
        r = c.get(f"/v1/sandboxes/{sid}/ports/8000/")
        assert r.status_code == 401
        r = c.get(
            f"/v1/sandboxes/{sid}/ports/8000/", headers={"authorization": "Bearer dsec_wrong"}
        )
        assert r.status_code == 401


def test_streamed_answer_arrives_before_it_is_complete(h: Harness) -> None:
    sid = h.sandbox()
    h.call(_clear(h.upstream))
    with (
        client(h) as c,
        c.stream("GET", f"/v1/sandboxes/{sid}/ports/8000/stream", headers=BEARER) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        assert json.loads(next(lines)) == {"i": 0}  # while the server waits for release
        h.call(_set(h.upstream))
        assert [json.loads(x) for x in lines if x] == [{"i": 1}, {"i": 2}]


async def _clear(up: Upstream) -> None:
    up.release.clear()


async def _set(up: Upstream) -> None:
    up.release.set()


def test_chunked_request_body_and_until_eof_answer(h: Harness) -> None:
    sid = h.sandbox()

    def gen() -> Iterator[bytes]:
        yield b"part1-"
        yield b"part2"

    with client(h, headers=BEARER) as c:
        r = c.post(f"/v1/sandboxes/{sid}/ports/8000/up", content=gen())
        assert r.status_code == 201 and r.json()["body"] == "part1-part2"
        r = c.get(f"/v1/sandboxes/{sid}/ports/8000/until-eof")
        assert r.status_code == 200 and r.text == "all of it"
        r = c.head(f"/v1/sandboxes/{sid}/ports/8000/x")
        assert r.status_code == 201 and r.content == b""


def test_host_route_and_e2b_header_route(h: Harness) -> None:
    sid = h.sandbox()
    token = h.tokens.issue(sid, _owner(KEY))
    with client(h) as c:
        r = c.get(
            "/some/page?q=1", headers={"host": f"8000-{sid}.{DOMAIN}", "x-dsec-port-token": token}
        )
        assert r.status_code == 201 and r.json()["target"] == "/some/page?q=1"
        assert r.json()["headers"]["host"] == f"8000-{sid}.{DOMAIN}"
        # the app's paths may be anything, /v1 included: the host decides
        r = c.get(
            "/v1/sandboxes",
            headers={"host": f"8000-{sid}.{DOMAIN}:7070", "x-dsec-port-token": token},
        )
        assert r.status_code == 201 and r.json()["target"] == "/v1/sandboxes"
        r = c.get("/", headers={"host": f"nonsense.{DOMAIN}"})
        assert r.status_code == 404
        # no token, or a wrong one: 403 as E2B's proxy answers (the /v1 route says 401)
        for bad in ({}, {"e2b-traffic-access-token": "nope"}, {"x-dsec-port-token": "nope"}):
            r = c.get("/", headers={"host": f"8000-{sid}.{DOMAIN}", **bad})
            assert r.status_code == 403, (bad, r.text)
            assert r.json()["error"]["code"] == "permission_denied"
            assert "E2B-Traffic-Access-Token" in r.json()["error"]["message"]
        r = c.get("/", headers={"host": f"0-{sid}.{DOMAIN}", "x-dsec-port-token": token})
        assert r.status_code == 400
        r = c.post(
            "/e2b/envd/execute",
            headers={
                "e2b-sandbox-id": sid,
                "e2b-sandbox-port": "8000",
                "e2b-traffic-access-token": token,
            },
            json={"code": "1+1"},
        )
        assert r.status_code == 201 and r.json()["target"] == "/execute"
        assert "e2b-sandbox-port" not in r.json()["headers"]


def test_connections_are_bounded_per_sandbox(h: Harness) -> None:
    sid = h.sandbox()
    limit = h.edge.limits.max_port_connections
    h.edge.limits.max_port_connections = 2
    h.call(_clear(h.upstream))
    try:
        with (
            client(h, headers=BEARER) as c1,
            client(h, headers=BEARER) as c2,
            client(h, headers=BEARER) as c3,
        ):
            with (
                c1.stream("GET", f"/v1/sandboxes/{sid}/ports/8000/hold") as a,
                c2.stream("GET", f"/v1/sandboxes/{sid}/ports/8000/hold") as b,
            ):
                assert a.status_code == b.status_code == 200
                r = c3.get(f"/v1/sandboxes/{sid}/ports/8000/x")
                assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections"
                assert "retry-after" in r.headers
                h.call(_set(h.upstream))
                assert a.read() == b.read() == b"ok"
            deadline = time.monotonic() + budget(5)
            while time.monotonic() < deadline:
                r = c3.get(f"/v1/sandboxes/{sid}/ports/8000/x")
                if r.status_code == 201:
                    break
                time.sleep(0.05)
            assert r.status_code == 201  # slots come back once connections close
    finally:
        h.edge.limits.max_port_connections = limit


def test_paused_sandbox_is_resumed_by_a_request(h: Harness) -> None:
    from dsec.apiserver.auth import owner_id

    sid = h.sandbox()
    h.call(h.edge.pause_sandbox(PauseRequest(sandbox_id=sid), owner_id(KEY)))
    with client(h, headers=BEARER) as c:
        assert c.get(f"/v1/sandboxes/{sid}/ports/8000/").status_code == 201
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


def test_public_sandbox_needs_no_credential_and_has_a_long_id(h: Harness) -> None:
    sid = h.sandbox(public_ports=True)
    assert len(sid.rsplit("-", 1)[1]) == 24
    with client(h) as c:
        assert c.get(f"/v1/sandboxes/{sid}/ports/8000/").status_code == 201
        assert c.get("/", headers={"host": f"8000-{sid}.{DOMAIN}"}).status_code == 201
        access = c.get(f"/v1/sandboxes/{sid}/ports", headers=BEARER).json()
    assert access["public"] is True and access["domain"] == DOMAIN


def test_access_endpoint(h: Harness) -> None:
    sid = h.sandbox()
    with client(h) as c:
        r = c.get(f"/v1/sandboxes/{sid}/ports", headers=BEARER)
        assert r.status_code == 200
        body = r.json()
        assert body["token"] == h.tokens.issue(sid, _owner(KEY))
        assert body["public"] is False and body["scheme"] == "http"
        assert (
            c.get(
                f"/v1/sandboxes/{sid}/ports", headers={"authorization": f"Bearer {OTHER}"}
            ).status_code
            == 404
        )


async def _ws_roundtrip(url: str, **kw: Any) -> list[Any]:
    out: list[Any] = []
    async with websockets.connect(url, **kw) as ws:
        out.append(ws.subprotocol)
        await ws.send("hello")
        out.append(await ws.recv())
        await ws.send(b"\x00\x01" * 40000)
        out.append(await ws.recv())
    return out


def test_websocket_through_path_and_host_routes(h: Harness) -> None:
    sid = h.sandbox()
    token = h.tokens.issue(sid, _owner(KEY))
    ws_url = h.url.replace("http", "ws")
    got = asyncio.run(
        _ws_roundtrip(
            f"{ws_url}/v1/sandboxes/{sid}/ports/8765/",
            additional_headers=BEARER,
            subprotocols=["binary"],
        )
    )
    assert got == ["binary", "hello", b"\x00\x01" * 40000]
    got = asyncio.run(
        _ws_roundtrip(
            f"ws://8765-{sid}.{DOMAIN}:{h.port}/websockify?dsec_token={token}",
            host="127.0.0.1",  # no DNS for the test domain: connect to the server directly
            port=h.port,
            subprotocols=["other"],
        )
    )
    assert got == ["other", "hello", b"\x00\x01" * 40000]


def test_websocket_refusals(h: Harness) -> None:
    sid = h.sandbox()
    ws_url = h.url.replace("http", "ws")

    async def attempt(url: str, **kw: Any) -> int:
        try:
            async with websockets.connect(url, **kw):
                return 101
        except websockets.exceptions.InvalidStatus as e:
            return int(e.response.status_code)

    assert asyncio.run(attempt(f"{ws_url}/v1/sandboxes/{sid}/ports/8765/")) == 401
    assert (
        asyncio.run(attempt(f"{ws_url}/v1/sandboxes/{sid}/ports/9/", additional_headers=BEARER))
        == 502
    )
    # a plain HTTP server refuses the upgrade: its answer reaches the client
    assert (
        asyncio.run(attempt(f"{ws_url}/v1/sandboxes/{sid}/ports/8000/", additional_headers=BEARER))
        == 201
    )


def test_raw_tcp_route(h: Harness) -> None:
    sid = h.sandbox()

    async def go() -> bytes:
        url = h.url.replace("http", "ws") + f"/v1/sandboxes/{sid}/tcp/8000"
        async with websockets.connect(url, additional_headers=BEARER) as ws:
            await ws.send(b"GET /raw HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            data = b""
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                while True:
                    data += await ws.recv()
            return data

    data = asyncio.run(go())
    assert data.startswith(b"HTTP/1.1 201 Created") and b'"target": "/raw"' in data


async def _aiter(xs: list[bytes]) -> AsyncIterator[bytes]:
    for x in xs:
        yield x


async def test_host_route_of_the_envd_port_is_the_e2b_api() -> None:
    """``49983-{id}.<domain>`` (E2B's envd port) is the E2B in-sandbox API itself, so the
    e2b SDK works with E2B_DOMAIN alone; E2B-routed ports come with the traffic token."""
    from dsec.server import PortsSettings, build_app

    edge = FakeEdge(available_tiers=("container",))
    app = build_app(edge, StaticKeys([KEY]), PortsSettings(domain=DOMAIN))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=10
    ) as c:
        r = await c.post(
            "/e2b/sandboxes",
            json={"templateID": "busybox", "network": {"allowPublicTraffic": False}},
            headers={"x-api-key": KEY},
        )
        assert r.status_code == 201, r.text
        body = r.json()
        sid, envd_token = body["sandboxID"], body["envdAccessToken"]
        assert body["domain"] == DOMAIN and body["trafficAccessToken"]
        host = {"host": f"49983-{sid}.{DOMAIN}"}
        r = await c.get("/health", headers={**host, "x-access-token": envd_token})
        assert r.status_code == 204, r.text
        r = await c.get("/health", headers={**host, "x-access-token": "nope"})
        assert r.status_code == 502  # envd's "sandbox not found" for a wrong token
        # another port through E2B's headers: the envd token is a credential there
        r = await c.get(
            "/e2b/envd/x",
            headers={
                "e2b-sandbox-id": sid,
                "e2b-sandbox-port": "8000",
                "x-access-token": envd_token,
            },
        )
        assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_listening"
        r = await c.get("/e2b/envd/x", headers={"e2b-sandbox-id": sid, "e2b-sandbox-port": "8000"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    from dsec.server import close_app

    await close_app(app)


def test_port_forward_cli_refuses_bad_specs() -> None:
    from typer.testing import CliRunner

    from dsec.cli.main import app

    runner = CliRunner(env={"DSEC_API_KEY": KEY, "DSEC_URL": "http://dsec.invalid"})
    for spec in ("abc", "0", "70000", "x:80", "99999:80"):
        r = runner.invoke(app, ["port-forward", "sb-fake-0123456789ab", spec])
        assert r.exit_code == 1, (spec, r.output)
        assert "bad port spec" in r.output
