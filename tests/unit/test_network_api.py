"""Network policy through every client surface, against FakeEdge (in-process, no traffic):
the routes (``/v1/sandboxes/{id}/network``), the async and sync SDK (``sb.network``), the
CLI (``dsec run --allow-domain``, ``dsec network ID show|update``) and the E2B layer
(``allow_internet_access`` / ``network`` mapped to a NetworkPolicy, ``update_network``).

The real enforcement is proven in tests/integration/test_network_sandbox_root.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import pytest
from tests.conftest import free_port
from tests.timing import budget
from typer.testing import CliRunner

import dsec.cli.main as cli
import dsec.errors as E
from dsec import AsyncSandbox, NetworkPolicy, Sandbox
from dsec.apiserver.app import create_app, openapi_document
from dsec.apiserver.auth import StaticKeys
from dsec.e2b.errors import E2BError
from dsec.e2b.network import ALL_TRAFFIC, BLOCK_ALL, E2BEgress, e2b_view, policy_from_e2b
from dsec.sdk import AsyncNetwork, Network
from dsec.testing import FakeEdge, app_transport

KEY = "dsec_network_api_test"
ALL_PROTOCOLS = ["tcp", "udp", "icmp"]


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
async def client(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(edge, StaticKeys([KEY]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://dsec",
        headers={"authorization": f"Bearer {KEY}"},
    ) as c:
        yield c


@pytest.fixture
def conn(edge: FakeEdge) -> dict[str, Any]:
    transport, key = app_transport(edge)
    return {"transport": transport, "api_key": key}


async def _create(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == code, err
    return err


# --- routes ---------------------------------------------------------------------
async def test_create_update_and_stats_routes(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _create(client, network={"allow_domains": ["PyPI.org."], "ports": [443]})
    req = edge.calls_to("create_sandbox")[0]["req"]
    assert req.network == NetworkPolicy(allow_domains=["pypi.org"], ports=[443])
    info = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert info["network"]["allow_domains"] == ["pypi.org"]

    body = {"allow_domains": ["*.github.com"], "deny_cidrs": ["10.9.0.0/16"], "presets": ["npm"]}
    r = await client.post(f"/v1/sandboxes/{sid}/network", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["network"]["allow_domains"] == ["*.github.com"]
    call = edge.calls_to("update_network")[0]
    policy = call["req"].policy
    assert isinstance(policy, NetworkPolicy) and call["req"].sandbox_id == sid
    assert policy.presets == ["npm"] and policy.ports is None

    stats = (await client.get(f"/v1/sandboxes/{sid}/network")).json()
    assert stats["enabled"] is True and stats["allowed"] == [] and stats["blocked"] == []
    assert stats["policy"]["allow_domains"] == ["*.github.com"]
    assert {"allowed_total", "blocked_total", "admitted", "dns", "ip"} <= set(stats)
    # the policy in force is what the registry keeps: a restarted edge, a fork and an export
    # see it, not the policy the sandbox was created with
    stored = edge.registry.get(sid)
    assert stored is not None and stored.request.network == policy


BAD_POLICIES: list[Any] = [
    {},  # allows nothing: use network=None
    {"allow_domains": []},
    {"allow_domains": ["bad..name"]},
    {"allow_domains": ["-x.example.com"]},
    {"allow_domains": ["a.*.example.com"]},
    {"allow_domains": ["*.com"]},
    {"allow_domains": ["10.0.0.1"]},
    {"allow_domains": ["a" * 64 + ".com"]},
    {"allow_domains": "pypi.org"},  # not a list
    {"allow_domains": [f"h{i}.example.com" for i in range(513)]},
    {"allow_cidrs": ["10.0.0.1/8"]},  # host bits set
    {"allow_cidrs": ["::1/128"]},
    {"allow_cidrs": ["169.254.169.254/32"]},  # metadata: never reachable
    {"allow_cidrs": ["not-a-cidr"]},
    {"allow_domains": ["a.example.com"], "ports": [0]},
    {"allow_domains": ["a.example.com"], "ports": [70000]},
    {"allow_domains": ["a.example.com"], "ports": ["443-80"]},
    {"allow_domains": ["a.example.com"], "ports": []},
    {"allow_domains": ["a.example.com"], "protocols": ["sctp"]},
    {"allow_domains": ["a.example.com"], "presets": ["Bad Name"]},
    {"allow_domains": ["a.example.com"], "surprise": True},
    ["pypi.org"],
    "pypi.org",
    None,
]


@pytest.mark.parametrize("body", BAD_POLICIES)
async def test_bad_policies_are_400_and_reach_nothing(
    client: httpx.AsyncClient, edge: FakeEdge, body: Any
) -> None:
    sid = await _create(client, network={"allow_domains": ["pypi.org"]})
    r = await client.post(f"/v1/sandboxes/{sid}/network", json=body)
    err = _error(r, 400, "invalid_request")
    assert err["message"]
    assert edge.calls_to("update_network") == []
    r = await client.post("/v1/sandboxes", json={"network": body})
    if body is not None:  # network=None is the valid "no network at all"
        _error(r, 400, "invalid_request")
        assert len(edge.calls_to("create_sandbox")) == 1


async def test_malformed_json_body_is_400(client: httpx.AsyncClient) -> None:
    sid = await _create(client, network={"allow_domains": ["pypi.org"]})
    r = await client.post(
        f"/v1/sandboxes/{sid}/network",
        content=b'{"allow_domains": [',
        headers={"content-type": "application/json"},
    )
    _error(r, 400, "invalid_request")


async def test_dead_unknown_and_networkless_sandboxes(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    policy = {"allow_domains": ["pypi.org"]}
    sid = await _create(client, network=policy)
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 200
    _error(await client.post(f"/v1/sandboxes/{sid}/network", json=policy), 409, "sandbox_stopped")
    _error(await client.get(f"/v1/sandboxes/{sid}/network"), 409, "sandbox_stopped")

    missing = "sb-fake-000000000000"
    r = await client.post(f"/v1/sandboxes/{missing}/network", json=policy)
    _error(r, 404, "sandbox_not_found")
    _error(
        await client.post("/v1/sandboxes/not-an-id/network", json=policy), 400, "invalid_request"
    )

    plain = await _create(client)  # network=None: no network, and none can be added
    assert (await client.get(f"/v1/sandboxes/{plain}/network")).json() == {"enabled": False}
    r = await client.post(f"/v1/sandboxes/{plain}/network", json=policy)
    _error(r, 422, "capability_not_supported")


async def test_routes_need_a_key(edge: FakeEdge) -> None:
    app = create_app(edge, StaticKeys([KEY]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://dsec"
    ) as anon:
        r = await anon.get("/v1/sandboxes/sb-fake-000000000000/network")
        _error(r, 401, "unauthenticated")


def test_openapi_documents_the_network_routes() -> None:
    doc = openapi_document()
    ops = doc["paths"]["/v1/sandboxes/{sandbox_id}/network"]
    assert set(ops) == {"get", "post"}
    body = ops["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/NetworkPolicy")
    assert ops["post"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("/SandboxInfo")
    assert ops["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/NetworkStats"
    )
    fields = doc["components"]["schemas"]["NetworkPolicy"]["properties"]
    assert {"allow_domains", "allow_cidrs", "ports", "protocols", "presets"} <= set(fields)


# --- SDK ------------------------------------------------------------------------
async def test_async_sdk_network(edge: FakeEdge, conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(
        network={"allow_domains": ["pypi.org"], "ports": ["8000-8100", 443]}, **conn
    ) as sb:
        assert isinstance(sb.network, AsyncNetwork)
        sent = edge.calls_to("create_sandbox")[0]["req"].network
        assert sent.ports == ["8000-8100", 443]
        assert sb.network.policy == sent
        info = await sb.network.update(NetworkPolicy(presets=["pypi"], allow_cidrs=["10.1.2.0/24"]))
        assert info.network is not None and info.network.presets == ["pypi"]
        assert sb.info.network == info.network  # the object's view follows
        stats = await sb.network.stats()
        assert stats["enabled"] is True and stats["policy"]["presets"] == ["pypi"]

        # validated client-side: nothing reaches the server
        with pytest.raises(E.InvalidRequest, match="invalid domain"):
            await sb.network.update({"allow_domains": ["bad..x"]})
        with pytest.raises(E.InvalidRequest, match="must be a NetworkPolicy or a dict"):
            await sb.network.update("pypi.org")  # type: ignore[arg-type]
        assert len(edge.calls_to("update_network")) == 1
    with pytest.raises(E.InvalidRequest, match="allows nothing"):
        await AsyncSandbox.create(network={}, **conn)
    assert len(edge.calls_to("create_sandbox")) == 1

    async with await AsyncSandbox.create(**conn) as plain:
        assert plain.network.policy is None
        assert await plain.network.stats() == {"enabled": False}
        with pytest.raises(E.CapabilityNotSupported):
            await plain.network.update({"allow_domains": ["pypi.org"]})
    killed = await AsyncSandbox.create(network=NetworkPolicy(allow_domains=["a.test"]), **conn)
    await killed.kill()
    with pytest.raises(E.SandboxStopped):
        await killed.network.update({"allow_domains": ["b.test"]})


def test_sync_sdk_network(edge: FakeEdge, conn: dict[str, Any]) -> None:
    with Sandbox.create(network=NetworkPolicy(allow_domains=["pypi.org"]), **conn) as sb:
        assert isinstance(sb.network, Network)
        assert sb.network.policy == NetworkPolicy(allow_domains=["pypi.org"])
        info = sb.network.update({"allow_domains": ["files.pythonhosted.org"]})
        assert info.network.allow_domains == ["files.pythonhosted.org"]
        assert sb.network.stats()["policy"]["allow_domains"] == ["files.pythonhosted.org"]
        assert "Replace the sandbox's policy" in (type(sb.network).update.__doc__ or "")


# --- CLI ------------------------------------------------------------------------
@pytest.fixture
def runner(edge: FakeEdge, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    transport, key = app_transport(edge)
    monkeypatch.setattr(cli, "transport_factory", lambda: transport)
    yield CliRunner(env={"DSEC_API_KEY": key, "DSEC_URL": "http://dsec.invalid", "COLUMNS": "200"})


def test_cli_run_with_network_options(runner: CliRunner, edge: FakeEdge) -> None:
    result = runner.invoke(
        cli.app,
        ["run", "--allow-domain", "pypi.org", "--allow-domain", "*.pythonhosted.org",
         "--port", "443", "--preset", "github", "--", "true"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    policy = edge.calls_to("create_sandbox")[0]["req"].network
    assert policy == NetworkPolicy(
        allow_domains=["pypi.org", "*.pythonhosted.org"], ports=[443], presets=["github"]
    )
    assert runner.invoke(cli.app, ["run", "--", "true"]).exit_code == 0
    assert edge.calls_to("create_sandbox")[1]["req"].network is None  # default: no network

    for args in (["--port", "443"], ["--allow-domain", "bad..x"], ["--allow-cidr", "10.0.0.1/8"]):
        result = runner.invoke(cli.app, ["run", *args, "--", "true"])
        assert result.exit_code == 1, result.output
        assert "invalid_request" in result.stderr and "Traceback" not in result.output
        assert len(result.stderr.strip().splitlines()) == 1
    assert len(edge.calls_to("create_sandbox")) == 2


def test_cli_network_show_and_update(runner: CliRunner, edge: FakeEdge) -> None:
    runner.invoke(cli.app, ["run", "--keep", "--allow-domain", "pypi.org", "--", "true"])
    sid = edge.calls_to("exec_stream")[0]["req"].sandbox_id

    shown = runner.invoke(cli.app, ["network", sid, "show"])
    assert shown.exit_code == 0, shown.output
    assert "allow_domains=pypi.org" in shown.stdout and "ports=all" in shown.stdout
    assert "allowed" in shown.stdout and "blocked" in shown.stdout and "dns:" in shown.stdout
    raw = runner.invoke(cli.app, ["network", sid, "show", "--json"])
    assert '"enabled": true' in raw.stdout

    updated = runner.invoke(
        cli.app, ["network", sid, "update", "--allow-cidr", "10.1.0.0/16", "--protocol", "udp"]
    )
    assert updated.exit_code == 0, updated.output
    assert "allow_cidrs=10.1.0.0/16" in updated.stdout and "protocols=udp" in updated.stdout
    assert edge.calls_to("update_network")[-1]["req"].policy == NetworkPolicy(
        allow_cidrs=["10.1.0.0/16"], protocols=["udp"]
    )
    from_stdin = runner.invoke(
        cli.app, ["network", sid, "update", "--file", "-"], input='{"presets": ["pypi"]}'
    )
    assert from_stdin.exit_code == 0, from_stdin.output
    assert edge.calls_to("update_network")[-1]["req"].policy.presets == ["pypi"]

    calls = len(edge.calls_to("update_network"))
    for args in (
        ["update"],  # nothing to allow
        ["update", "--allow-domain", "a.test", "--file", "-"],
        ["update", "--file", "/nonexistent/policy.json"],
        ["update", "--deny-cidr", "10.0.0.0/8"],
        ["frobnicate"],
    ):
        result = runner.invoke(cli.app, ["network", sid, *args], input="{}")
        assert result.exit_code != 0, (args, result.output)
        assert "Traceback" not in result.output
    assert len(edge.calls_to("update_network")) == calls

    runner.invoke(cli.app, ["run", "--keep", "--", "true"])
    plain = edge.calls_to("exec_stream")[-1]["req"].sandbox_id
    assert "no network" in runner.invoke(cli.app, ["network", plain, "show"]).stdout
    result = runner.invoke(cli.app, ["network", plain, "update", "--allow-domain", "a.test"])
    assert result.exit_code == 1 and "capability_not_supported" in result.stderr


# --- E2B mapping ------------------------------------------------------------------
def _egress(**kw: Any) -> E2BEgress:
    return E2BEgress(**kw)


def test_e2b_defaults_mean_no_network() -> None:
    assert policy_from_e2b(None, None) is None
    assert policy_from_e2b(False, None) is None


def test_e2b_closed_allowlists() -> None:
    policy = policy_from_e2b(
        None, _egress(allow_out=["pypi.org", "*.github.com", "8.8.8.8"], deny_out=[ALL_TRAFFIC])
    )
    assert policy == NetworkPolicy(
        allow_domains=["pypi.org", "*.github.com"],
        allow_cidrs=["8.8.8.8/32"],
        protocols=ALL_PROTOCOLS,
    )
    # allow_internet_access=False is deny_out=[0.0.0.0/0]; other denies are moot (allow wins)
    assert policy_from_e2b(False, _egress(allow_out=["pypi.org"], deny_out=["1.2.3.0/24"])) == (
        NetworkPolicy(allow_domains=["pypi.org"], protocols=ALL_PROTOCOLS)
    )
    # closed with nothing allowed: networked (changeable later) but reaching nothing
    assert policy_from_e2b(None, _egress(deny_out=[ALL_TRAFFIC])) is BLOCK_ALL
    assert policy_from_e2b(False, None, updating=True) is BLOCK_ALL
    # dns_servers: "all traffic to it is allowed"
    assert policy_from_e2b(False, _egress(allow_out=["a.test"], dns_servers=["9.9.9.9"])) == (
        NetworkPolicy(allow_domains=["a.test"], allow_cidrs=["9.9.9.9/32"], protocols=ALL_PROTOCOLS)
    )


def test_e2b_open_internet_minus_denies() -> None:
    assert policy_from_e2b(True, None) == NetworkPolicy(
        allow_cidrs=[ALL_TRAFFIC], protocols=ALL_PROTOCOLS
    )
    assert policy_from_e2b(None, None, updating=True) == policy_from_e2b(True, None)
    # deny 1.2.3.0/24 except the allowed 1.2.3.4: E2B's allow wins over its deny
    policy = policy_from_e2b(
        None, _egress(allow_out=["1.2.3.4", "api.test"], deny_out=["1.2.3.0/24", "5.6.7.8"])
    )
    assert policy is not None
    assert policy.allow_cidrs == [ALL_TRAFFIC] and policy.allow_domains == ["api.test"]
    assert "5.6.7.8/32" in policy.deny_cidrs and "1.2.3.4/32" not in policy.deny_cidrs
    denied = {ip for c in policy.deny_cidrs for ip in ipaddress.ip_network(c)}
    assert len(denied) == 256 and {str(ip) for ip in denied} >= {"1.2.3.5", "5.6.7.8"}
    # a deny entirely inside an allow disappears
    policy = policy_from_e2b(True, _egress(allow_out=["10.0.0.0/8"], deny_out=["10.1.0.0/16"]))
    assert policy is not None and policy.deny_cidrs == []


@pytest.mark.parametrize(
    ("kwargs", "status", "match"),
    [
        ({"deny_out": ["evil.example.com"]}, 400, "not names"),
        ({"allow_out": ["::1"]}, 400, "IPv6"),
        ({"allow_out": "pypi.org"}, 400, "list of strings"),
        ({"dns_servers": ["10.0.0.0/8"]}, 400, "IP addresses"),
        ({"unsupported": ["egress_proxy"]}, 422, "not supported by dsec"),
    ],
)
def test_e2b_bad_egress(kwargs: dict[str, Any], status: int, match: str) -> None:
    with pytest.raises(E2BError, match=match) as exc:
        _egress(**kwargs)
    assert exc.value.status == status


def test_e2b_entries_dsec_refuses_are_invalid_request() -> None:
    with pytest.raises(E.InvalidRequest, match=r"did you mean 10\.0\.0\.0/8"):
        _egress(allow_out=["10.0.0.1/8"])
    with pytest.raises(E.InvalidRequest, match="invalid domain"):
        policy_from_e2b(False, _egress(allow_out=["bad..name"]))
    with pytest.raises(E.InvalidRequest, match="never reachable"):
        policy_from_e2b(False, _egress(allow_out=["169.254.169.254"]))


def test_e2b_view_round_trips() -> None:
    assert e2b_view(None) == (False, None)
    closed = policy_from_e2b(False, _egress(allow_out=["pypi.org", "8.8.8.8"]))
    assert e2b_view(closed) == (
        False,
        {"allowOut": ["pypi.org", "8.8.8.8/32"], "denyOut": [ALL_TRAFFIC]},
    )
    opened = policy_from_e2b(True, _egress(deny_out=["5.6.7.8"]))
    assert e2b_view(opened) == (True, {"allowOut": [], "denyOut": ["5.6.7.8/32"]})
    assert e2b_view(BLOCK_ALL) == (False, {"allowOut": [], "denyOut": [ALL_TRAFFIC]})


E2B_BAD_CREATES: list[tuple[dict[str, Any], int]] = [
    ({"network": []}, 400),
    ({"network": "x"}, 400),
    ({"network": {"allowOut": "pypi.org"}}, 400),
    ({"network": {"allowOut": [1]}}, 400),
    ({"network": {"denyOut": ["a.com"]}}, 400),
    ({"network": {"allowOut": ["::1"]}}, 400),
    ({"network": {"dnsServers": ["x"]}}, 400),
    ({"network": {"rules": {"a": "b"}}}, 400),
    ({"network": {"allowOut": ["a" * 300]}}, 400),
    ({"network": {"allowOut": ["10.0.0.1/8"]}}, 400),
    ({"network": {"allowOut": [f"h{i}.t.test" for i in range(600)], "denyOut": [ALL_TRAFFIC]}}, 400),
    ({"network": {"denyOut": [f"{i}.0.0.0/8" for i in range(1, 200)],
                  "allowOut": [f"{i}.1.2.3" for i in range(1, 200)]}}, 400),
    ({"allow_internet_access": "yes"}, 400),
    ({"network": {"egressProxy": {"address": "p:1080"}}}, 422),
    ({"network": {"httpsPorts": [443]}}, 422),
    ({"network": {"maskRequestHost": "x.example.com"}}, 422),
]  # fmt: skip

E2B_BAD_UPDATES: list[tuple[Any, int]] = [
    ([], 400),
    ({"allowOut": "x"}, 400),
    ({"allow_internet_access": "no"}, 400),
    ({"denyOut": ["a.com"]}, 400),
    ({"allowOut": ["bad..x"]}, 400),
    ({"egressProxy": {"address": "p:1080"}}, 422),
    ({"rules": {"a.test": [{"transform": {"headers": {"a": "b"}}}]}}, 422),
]


@pytest.fixture
async def e2b_http(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    from dsec.e2b import make_e2b_app

    app = make_e2b_app(edge, {"e2b-key": "alice"}.get)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://e2b",
        headers={"x-api-key": "e2b-key"},
    ) as c:
        yield c


@pytest.mark.parametrize(("extra", "status"), E2B_BAD_CREATES)
async def test_e2b_raw_bad_creates(
    e2b_http: httpx.AsyncClient, edge: FakeEdge, extra: dict[str, Any], status: int
) -> None:
    r = await e2b_http.post("/sandboxes", json={"templateID": "busybox", **extra})
    assert r.status_code == status, r.text
    assert r.json()["message"]
    assert edge.calls_to("create_sandbox") == []


async def test_e2b_allow_public_traffic_makes_public_ports(edge: FakeEdge) -> None:
    """``allowPublicTraffic`` is about the sandbox's ports, not its egress: the sandbox is
    created with ``public_ports`` (it was refused with 422 before the port proxy). A private
    sandbox gets the port proxy's token as ``trafficAccessToken``, a public one none (as in
    E2B); ``domain`` is the ports domain."""
    from dsec.apiserver.ports import PortTokens
    from dsec.e2b import make_e2b_app

    tokens = PortTokens(b"s" * 32)
    app = make_e2b_app(
        edge, {"e2b-key": "alice"}.get, sandbox_domain="ports.test", traffic_tokens=tokens
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://e2b",
        headers={"x-api-key": "e2b-key"},
    ) as c:
        for public in (True, False):
            r = await c.post(
                "/sandboxes",
                json={"templateID": "busybox", "network": {"allowPublicTraffic": public}},
            )
            assert r.status_code == 201, r.text
            body = r.json()
            assert edge.calls_to("create_sandbox")[-1]["req"].public_ports is public
            assert body["domain"] == "ports.test"
            if public:
                assert "trafficAccessToken" not in body
            else:
                assert body["trafficAccessToken"] == tokens.issue(body["sandboxID"], "alice")


@pytest.mark.parametrize(("body", "status"), E2B_BAD_UPDATES)
async def test_e2b_raw_bad_updates(
    e2b_http: httpx.AsyncClient, edge: FakeEdge, body: Any, status: int
) -> None:
    r = await e2b_http.post("/sandboxes", json={"templateID": "busybox", "network": {}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert edge.calls_to("create_sandbox")[0]["req"].network == policy_from_e2b(True, None)
    r = await e2b_http.put(f"/sandboxes/{sid}/network", json=body)
    assert r.status_code == status, r.text
    assert edge.calls_to("update_network") == []


# --- E2B through the unmodified e2b SDK --------------------------------------------


@contextlib.contextmanager
def _serve_e2b(
    edge: FakeEdge, default_network: Literal["open", "closed"] = "open"
) -> Iterator[str]:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from dsec.e2b import make_e2b_app

    app = make_e2b_app(edge, {"e2b-key": "alice"}.get, default_network=default_network)
    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Mount("/e2b", app=app)]),
            host="127.0.0.1",
            port=free_port(),
            log_level="warning",
            lifespan="off",
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + budget(10)
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}/e2b"
    finally:
        asyncio.run_coroutine_threadsafe(app.state.e2b.aclose(), loop).result(30)
        server.should_exit = True
        thread.join(10)


def test_e2b_sdk_network(edge: FakeEdge, monkeypatch: pytest.MonkeyPatch) -> None:
    e2b = pytest.importorskip("e2b")
    with _serve_e2b(edge) as root:
        monkeypatch.setenv("E2B_API_URL", root)
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{root}/envd")
        monkeypatch.setenv("E2B_API_KEY", "e2b-key")

        sbx = e2b.Sandbox.create(
            "busybox", network={"deny_out": [e2b.ALL_TRAFFIC], "allow_out": ["pypi.org"]}
        )
        try:
            sent = edge.calls_to("create_sandbox")[-1]["req"].network
            assert sent == NetworkPolicy(allow_domains=["pypi.org"], protocols=ALL_PROTOCOLS)
            info = sbx.get_info()
            assert info.allow_internet_access is False
            assert info.network == {
                "allow_out": ["pypi.org"],
                "deny_out": [e2b.ALL_TRAFFIC],
                "allow_public_traffic": True,  # E2B's default
            }

            sbx.update_network({"allow_out": ["github.com"], "deny_out": [e2b.ALL_TRAFFIC]})
            assert edge.calls_to("update_network")[-1]["req"].policy == NetworkPolicy(
                allow_domains=["github.com"], protocols=ALL_PROTOCOLS
            )
            sbx.update_network({"deny_out": ["5.6.7.8"]})  # open: everything but 5.6.7.8
            assert sbx.get_info().allow_internet_access is True
            with pytest.raises(e2b.SandboxException) as exc:
                sbx.update_network({"allow_out": ["bad..name"]})
            assert exc.value.status_code == 400
        finally:
            sbx.kill()
        with pytest.raises(e2b.SandboxNotFoundException):
            e2b.Sandbox.update_network(sbx.sandbox_id, {"allow_out": ["pypi.org"]})

        opened = e2b.Sandbox.create("busybox", allow_internet_access=True)
        plain = e2b.Sandbox.create("busybox")  # E2B's default: open, as asked explicitly
        try:
            assert opened.get_info().allow_internet_access is True
            assert plain.get_info().allow_internet_access is True
            sent = edge.calls_to("create_sandbox")[-1]["req"].network
            assert sent == NetworkPolicy(allow_cidrs=["0.0.0.0/0"], protocols=ALL_PROTOCOLS)
            plain.update_network({"allow_out": ["pypi.org"], "deny_out": [e2b.ALL_TRAFFIC]})
            assert plain.get_info().allow_internet_access is False
            closed = e2b.Sandbox.create("busybox", allow_internet_access=False)
            try:  # asked closed: no network at all, as before
                assert edge.calls_to("create_sandbox")[-1]["req"].network is None
                with pytest.raises(e2b.SandboxException) as exc:  # created without a network
                    closed.update_network({"allow_out": ["pypi.org"]})
                assert exc.value.status_code == 422
            finally:
                closed.kill()
        finally:
            opened.kill()
            plain.kill()


def test_e2b_network_default_can_be_closed_by_the_operator(
    edge: FakeEdge, monkeypatch: pytest.MonkeyPatch
) -> None:
    e2b = pytest.importorskip("e2b")
    with _serve_e2b(edge, default_network="closed") as root:
        monkeypatch.setenv("E2B_API_URL", root)
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{root}/envd")
        monkeypatch.setenv("E2B_API_KEY", "e2b-key")
        plain = e2b.Sandbox.create("busybox")
        try:  # dsec's own default: no network
            assert edge.calls_to("create_sandbox")[-1]["req"].network is None
            assert plain.get_info().allow_internet_access is False
        finally:
            plain.kill()
    from dsec.e2b import make_e2b_app

    with pytest.raises(ValueError):
        make_e2b_app(edge, {}.get, default_network="half-open")  # type: ignore[arg-type]


def test_dsec_api_default_stays_no_network(edge: FakeEdge) -> None:
    from dsec.models import CreateSandboxRequest

    assert CreateSandboxRequest().network is None  # the dsec API: default deny
