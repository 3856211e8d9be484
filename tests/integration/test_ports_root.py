"""The port proxy on real container sandboxes (a ``dsec serve`` in this process, with host
routes on ``ports.test`` and the TLS listener using the node's own certificate authority):

* the unmodified ``e2b`` SDK: ``get_host(8000)`` of a sandbox running
  ``python3 -m http.server`` (no network policy) answers over https through the proxy,
  with the ``trafficAccessToken``;
* a WebSocket echo server in the sandbox (stdlib only, ``data/ws_echo.py``) reached with the
  ``websockets`` client through path and host routes, and a browser's way in: a token in
  the first URL, then only the cookie (page, then its WebSocket);
* the dsec SDK's ``get_url``/``get_host`` and ``port_forward``;
* bad input on real sandboxes: 400, 404 (another key's = missing), 502, 429, a paused
  sandbox resumed; no fd or thread left behind after many proxied connections;
* a networked sandbox's address is not reachable from the node, only through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.isolation import worker_subnet
from tests.timing import budget

from dsec import Sandbox
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.slow]

websockets = pytest.importorskip("websockets")

DOMAIN = "ports.test"
SUBNET = worker_subnet(233)
WS_ECHO = Path(__file__).with_name("data") / "ws_echo.py"


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = Path(f"/tmp/dsec-ports-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    # built-in images come from the machine-wide cache (tests/warm_images.py)
    srv = BackgroundServer(
        home,
        tiers=["container", "fncall"],
        network_options={"subnet": SUBNET},
        ports_domain=DOMAIN,
        tls=True,
    )
    # clients name the TLS port in the host (E2B's get_host has no port of its own)
    srv.ports.domain = f"{DOMAIN}:{srv.tls_port}"
    with srv:
        # the built-in image the E2B tests use, built first on a fresh layer cache (while
        # it is built, a create answers a retryable 503 that E2B's SDK does not retry;
        # dsec's waits)
        Sandbox.create(image="debian", url=srv.url, api_key=srv.api_key, timeout=900).kill()
        yield srv
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def sdk(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> BackgroundServer:
    monkeypatch.setenv("DSEC_URL", server.url)
    monkeypatch.setenv("DSEC_API_KEY", server.api_key)
    return server


def tls_client(server: BackgroundServer) -> httpx.Client:
    """A client that trusts the node's authority and connects to the TLS listener
    whatever host a URL names (the test domain has no DNS): the host is kept for the
    Host header and for certificate checking (SNI)."""
    assert server.ca is not None and server.tls_port is not None
    ctx = ssl.create_default_context(cafile=str(server.ca))
    return httpx.Client(verify=ctx, timeout=30, transport=_PinnedTransport(ctx, server.tls_port))


class _PinnedTransport(httpx.HTTPTransport):
    def __init__(self, ctx: ssl.SSLContext, port: int) -> None:
        super().__init__(verify=ctx)
        self.port = port

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        request.extensions = {**request.extensions, "sni_hostname": host}
        request.headers["host"] = request.url.netloc.decode()
        request.url = request.url.copy_with(host="127.0.0.1", port=self.port)
        return super().handle_request(request)


def wait_listening(sb: Any, port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + budget(timeout_s)
    probe = (
        'python3 -c "import socket,sys; s=socket.socket(); s.settimeout(0.5); '
        f"sys.exit(s.connect_ex(('127.0.0.1', {port})))\""
    )
    while time.monotonic() < deadline:
        if sb.commands.run(probe, timeout=10).exit_code == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port} in {sb.id}")


def test_e2b_get_host_reaches_python_http_server(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from e2b import Sandbox as E2BSandbox

    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.api_key)
    sbx = E2BSandbox.create(
        "container/debian",
        timeout=300,
        allow_internet_access=False,
        network={"allow_public_traffic": False},  # E2B's default is public: private here
    )
    try:
        sbx.files.write("/srv/www/hello.txt", "hello from the sandbox\n")
        sbx.commands.run("cd /srv/www && python3 -m http.server 8000", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}:{server.tls_port}"
        assert sbx.traffic_access_token
        with tls_client(server) as c:
            deadline = time.monotonic() + budget(30)
            while True:
                r = c.get(
                    f"https://{host}/hello.txt",
                    headers={"e2b-traffic-access-token": sbx.traffic_access_token},
                )
                if r.status_code != 502 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # the server is still starting
            assert r.status_code == 200, r.text
            assert r.text == "hello from the sandbox\n"
            # without the token: refused; a directory listing as any browser gets it
            assert c.get(f"https://{host}/hello.txt").status_code == 403
            r = c.get(
                f"https://{host}/", headers={"e2b-traffic-access-token": sbx.traffic_access_token}
            )
            assert r.status_code == 200 and "hello.txt" in r.text
        # the sandbox has no network at all: the connection was made inside it
        assert sbx.get_info().allow_internet_access is False
    finally:
        sbx.kill()


def test_websocket_echo_in_sandbox_and_a_browser_session(sdk: BackgroundServer) -> None:
    with Sandbox.create(image="debian", memory_mb=256) as sb:
        sb.files.write("/srv/ws_echo.py", WS_ECHO.read_text())
        r = sb.commands.run("python3 /srv/ws_echo.py 8765 >/tmp/ws.log 2>&1 & echo started")
        assert r.stdout == "started\n"
        wait_listening(sb, 8765)
        url = sb.get_url(8765, "/", signed=False).replace("http", "ws", 1)
        auth = {"authorization": f"Bearer {sdk.api_key}"}

        async def echo(url: str, **kw: Any) -> list[Any]:
            out: list[Any] = []
            async with websockets.connect(url, **kw) as ws:
                for msg in ("hi", b"\x00" * 70000, "x" * 200):
                    await ws.send(msg)
                    out.append(await ws.recv())
                rtt = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    await ws.send("ping")
                    assert await ws.recv() == "ping"
                    rtt.append(time.perf_counter() - t0)
                out.append(sorted(rtt)[10])
            return out

        got = asyncio.run(echo(url, additional_headers=auth))
        assert got[:3] == ["hi", b"\x00" * 70000, "x" * 200]
        # a browser: the first URL carries the token, the rest rides on the cookie
        signed = sb.get_url(8765, "/index.html", host=True)
        assert "dsec_token=" in signed and signed.startswith(f"https://8765-{sb.id}.")
        with tls_client(sdk) as c:
            first = c.get(signed)
            assert first.status_code == 400  # the echo server answers plain HTTP with 400
            cookie = first.headers["set-cookie"]
            assert "HttpOnly" in cookie and "Secure" in cookie and "SameSite=Lax" in cookie
            token_cookie = cookie.split(";")[0]
        ctx = ssl.create_default_context(cafile=str(sdk.ca))
        got = asyncio.run(
            echo(
                f"wss://{sb.get_host(8765)}/websockify",
                ssl=ctx,
                host="127.0.0.1",
                port=sdk.tls_port,
                server_hostname=sb.get_host(8765).split(":")[0],
                additional_headers={"cookie": token_cookie},
            )
        )
        assert got[:3] == ["hi", b"\x00" * 70000, "x" * 200]


def test_dsec_sdk_urls_and_port_forward(sdk: BackgroundServer) -> None:
    with Sandbox.create(image="debian", memory_mb=256) as sb:
        sb.files.write("/srv/www/a.txt", "A\n")
        sb.commands.run("cd /srv/www && python3 -m http.server 8000 >/dev/null 2>&1 &")
        wait_listening(sb, 8000)
        url = sb.get_url(8000, "/a.txt")  # signed: works with no header at all
        assert "/_dsec_token/" in url
        assert httpx.get(url, timeout=30).text == "A\n"
        assert httpx.get(sb.get_url(8000, "/a.txt", signed=False), timeout=30).status_code == 401
        assert sb.get_host(8000) == f"8000-{sb.id}.{DOMAIN}:{sdk.tls_port}"
        with sb.port_forward(8000) as fwd:  # a local port, raw TCP to the sandbox's 8000
            assert fwd.local_port > 0
            for _ in range(3):
                r = httpx.get(f"http://127.0.0.1:{fwd.local_port}/a.txt", timeout=30)
                assert r.text == "A\n"


def test_bad_input_on_real_sandboxes(sdk: BackgroundServer) -> None:
    other_key = sdk.keys.create_key("other")
    with (
        Sandbox.create(image="busybox", memory_mb=64) as sb,
        Sandbox.create(image="busybox", memory_mb=64, api_key=other_key) as theirs,
        Sandbox.create(tier="fncall", image="debian") as fn,
    ):
        base = f"{sdk.url}/v1/sandboxes"
        auth = {"authorization": f"Bearer {sdk.api_key}"}
        with httpx.Client(headers=auth, timeout=30) as c:
            assert c.get(f"{base}/{sb.id}/ports/0/").status_code == 400
            assert c.get(f"{base}/{sb.id}/ports/65536/").status_code == 400
            r = c.get(f"{base}/{sb.id}/ports/8000/")
            assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_listening"
            missing = c.get(f"{base}/sb-{sdk.edge.node}-00000000000a/ports/8000/")
            other = c.get(f"{base}/{theirs.id}/ports/8000/")
            assert missing.status_code == other.status_code == 404
            assert missing.json()["error"]["code"] == other.json()["error"]["code"]
            r = c.get(f"{base}/{fn.id}/ports/8000/")
            assert r.status_code == 422 and r.json()["error"]["code"] == "capability_not_supported"
            # a paused sandbox is resumed by the connection
            sb.commands.run("mkdir -p /www && echo P > /www/p && httpd -p 8000 -h /www")
            sb.pause()
            assert sb.refresh().state == "paused"
            r = c.get(f"{base}/{sb.id}/ports/8000/p")
            assert r.status_code == 200 and r.text == "P\n"
            assert sb.refresh().state == "running"


def test_connections_bounded_and_nothing_leaks(sdk: BackgroundServer) -> None:
    from dsec.footprint import server_footprint

    with Sandbox.create(image="busybox", memory_mb=64) as sb:
        sb.commands.run("mkdir -p /www && echo ok > /www/x && httpd -p 8000 -h /www")
        url = sb.get_url(8000, "/x")

        def many(n: int) -> None:
            with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                for _ in range(n):
                    assert c.get(url).text == "ok\n"

        many(20)  # warm up (executor threads, netns worker)
        time.sleep(0.5)
        before = server_footprint(os.getpid(), sdk.home)
        threads = [threading.Thread(target=many, args=(100,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + budget(10)
        while True:
            grew = server_footprint(os.getpid(), sdk.home).growth(before, threads=4, fds=8)
            if not grew or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not grew, grew
        live = sdk.edge._live[sb.id]
        assert not live.ports and live.ports_opening == 0  # every connection released
        # the bound: held connections count, the next one is refused with 429
        limit = sdk.edge.limits.max_port_connections
        sdk.edge.limits.max_port_connections = 3
        try:
            from websockets.sync.client import connect

            tcp = f"{sdk.url.replace('http', 'ws', 1)}/v1/sandboxes/{sb.id}/tcp/8000"
            auth = {"authorization": f"Bearer {sdk.api_key}"}
            # raw TCP connections that send nothing: httpd waits for a request on each
            stack = contextlib.ExitStack()
            for _ in range(3):
                stack.enter_context(connect(tcp, additional_headers=auth))
            deadline = time.monotonic() + budget(10)
            while len(live.ports) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            r = httpx.get(url, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections"
            stack.close()
            deadline = time.monotonic() + budget(10)
            while live.ports and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(url, timeout=30).status_code == 200
        finally:
            sdk.edge.limits.max_port_connections = limit


def test_networked_sandbox_is_reached_only_through_the_proxy(sdk: BackgroundServer) -> None:
    closed = {"allow_cidrs": ["0.0.0.0/0"], "deny_cidrs": ["0.0.0.0/0"]}
    with Sandbox.create(image="busybox", memory_mb=64, network=closed) as sb:
        sb.commands.run("mkdir -p /www && echo in > /www/i && httpd -p 0.0.0.0:8000 -h /www")
        ip = sb.network.stats()["ip"]
        with socket.socket() as s:
            s.settimeout(1.0)
            with pytest.raises(OSError):
                s.connect((ip, 8000))
        assert httpx.get(sb.get_url(8000, "/i"), timeout=30).text == "in\n"
