"""The dashboard's server side through the real app over FakeEdge (no browser): sign-in, the
session cookie's flags, CSRF, forged / expired / revoked sessions, what each key sees
through ``/ui/api`` and ``/v1`` with the cookie, and the time series behind the charts."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from tests.timing import budget

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import KeyStore, StaticKeys, owner_id
from dsec.testing import FakeEdge
from dsec.ui.series import LATENCY_BOUNDS_MS, ActivityRecorder, NodeSampler, percentile
from dsec.ui.session import COOKIE, SessionAuthority, load_secret

OP = "dsec_ui_operator_key_1"
ALICE = "dsec_ui_alice_key_1"
BOB = "dsec_ui_bob_key_1"


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


def _client(app: object, base: str = "http://dsec") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)  # type: ignore[arg-type]


@pytest.fixture
async def app(edge: FakeEdge) -> AsyncIterator[object]:
    yield create_app(edge, StaticKeys([OP, ALICE, BOB], operators=[OP]), access_log="off")


async def _sign_in(c: httpx.AsyncClient, key: str) -> httpx.Response:
    page = await c.get("/ui")
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    assert token, page.text
    return await c.post("/ui/login", data={"key": key, "token": token.group(1)})


def _use(c: httpx.AsyncClient, cookie: str) -> None:
    """Send exactly this session cookie from now on."""
    c.cookies.clear()
    c.cookies.set(COOKIE, cookie)


async def _csrf(c: httpx.AsyncClient) -> str:
    r = await c.get("/ui/api/session")
    assert r.status_code == 200, r.text
    return str(r.json()["csrf"])


async def test_sign_in_sets_a_strict_httponly_cookie_and_never_the_key(app: object) -> None:
    async with _client(app) as c:
        page = await c.get("/ui")
        assert page.status_code == 200 and 'type="password"' in page.text
        assert "content-security-policy" in page.headers
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        r = await _sign_in(c, ALICE)
        assert r.status_code == 303 and r.headers["location"] == "/ui"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
        assert "Path=/" in cookie and "Secure" not in cookie  # plain http here
        assert ALICE not in cookie and ALICE not in r.text
        shell = await c.get("/ui")
        assert shell.status_code == 200 and ALICE not in shell.text
        me = (await c.get("/ui/api/session")).json()
        assert me["owner"] == owner_id(ALICE) and me["operator"] is False and me["csrf"]


async def test_the_cookie_is_secure_over_tls(app: object) -> None:
    async with _client(app, "https://dsec") as c:
        r = await _sign_in(c, ALICE)
        assert r.status_code == 303 and "Secure" in r.headers["set-cookie"]


async def test_a_wrong_key_says_so_and_shows_nothing_else(app: object, edge: FakeEdge) -> None:
    async with _client(app) as c:
        r = await _sign_in(c, "dsec_not_a_key")
        assert r.status_code == 401
        assert "invalid or revoked API key" in r.text
        assert COOKIE + "=" not in r.headers.get("set-cookie", "")
        assert "sb-" not in r.text and "app.js" not in r.text
        assert (await c.get("/ui/api/session")).status_code == 401
        assert (await c.get("/v1/sandboxes")).status_code == 401


async def test_login_needs_the_forms_token_and_the_same_origin(app: object) -> None:
    async with _client(app) as c:
        await c.get("/ui")
        r = await c.post("/ui/login", data={"key": ALICE, "token": "forged"})
        assert r.status_code == 403 and COOKIE not in r.headers.get("set-cookie", "")
        page = await c.get("/ui")
        token = re.search(r'name="token" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
        r = await c.post(
            "/ui/login",
            data={"key": ALICE, "token": token},
            headers={"origin": "http://evil.example"},
        )
        assert r.status_code == 403
        r = await c.post("/ui/login", content=b"\xff\xfe", headers={"content-type": "text/x"})
        assert r.status_code in (400, 403)


async def test_forged_expired_and_revoked_sessions_go_back_to_sign_in(tmp_path: Path) -> None:
    keys = KeyStore(tmp_path)
    alice = keys.create_key("alice")
    app = create_app(FakeEdge(), keys, access_log="off", ui_secret=b"s" * 32)
    sessions: SessionAuthority = app.state.dashboard.sessions
    async with _client(app) as c:
        await _sign_in(c, alice)
        good = c.cookies[COOKIE]
        version, body, mac = good.split(".")
        # a changed first character of the MAC (the last ones may differ in padding bits only)
        other_mac = ("B" if mac[0] != "B" else "C") + mac[1:]
        for forged in (f"{version}.{body}.{other_mac}", "v1.e30.AAAA", "garbage", good + "x"):
            _use(c, forged)
            assert (await c.get("/ui/api/session")).status_code == 401
            page = await c.get("/ui")
            assert page.status_code == 401 and 'type="password"' in page.text
        # expired: a cookie issued nine hours ago
        old, _ = sessions.issue(owner_id(alice), now=time.time() - 9 * 3600)
        _use(c, old)
        r = await c.get("/ui/api/session")
        assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
        # another server's secret
        other = SessionAuthority(keys, b"t" * 32)
        _use(c, other.issue(owner_id(alice))[0])
        assert (await c.get("/v1/sandboxes")).status_code == 401
        # revoked: the key is gone, so is the session
        _use(c, good)
        assert (await c.get("/v1/sandboxes")).status_code == 200
        keys.revoke(alice)
        assert (await c.get("/v1/sandboxes")).status_code == 401


async def test_state_changes_need_the_csrf_header(app: object, edge: FakeEdge) -> None:
    async with _client(app) as c:
        await _sign_in(c, ALICE)
        r = await c.post("/v1/sandboxes", json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert not edge.calls_to("create_sandbox")
        csrf = await _csrf(c)
        r = await c.post("/v1/sandboxes", json={}, headers={"x-dsec-csrf": "wrong"})
        assert r.status_code == 403
        r = await c.post(
            "/v1/sandboxes",
            json={},
            headers={"x-dsec-csrf": csrf, "origin": "http://evil.example"},
        )
        assert r.status_code == 403
        r = await c.post("/v1/sandboxes", json={}, headers={"x-dsec-csrf": csrf})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert edge.calls_to("create_sandbox")[0]["owner"] == owner_id(ALICE)
        # reads need no token; deletes do
        assert (await c.get(f"/v1/sandboxes/{sid}")).status_code == 200
        assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 403
        assert (
            await c.delete(f"/v1/sandboxes/{sid}", headers={"x-dsec-csrf": csrf})
        ).status_code == 200
        # sign-out ends it (and needs the token too)
        assert (await c.post("/ui/logout")).status_code == 403
        assert (await c.post("/ui/logout", headers={"x-dsec-csrf": csrf})).status_code == 204
        c.cookies.clear()


async def test_signed_out_cookie_is_refused_even_if_replayed(app: object) -> None:
    async with _client(app) as c:
        await _sign_in(c, ALICE)
        cookie = c.cookies[COOKIE]
        csrf = await _csrf(c)
        await c.post("/ui/logout", headers={"x-dsec-csrf": csrf})
        _use(c, cookie)
        assert (await c.get("/ui/api/session")).status_code == 401


async def test_a_second_key_sees_none_of_the_first_keys(app: object, edge: FakeEdge) -> None:
    async with _client(app) as a, _client(app) as b:
        await _sign_in(a, ALICE)
        csrf = await _csrf(a)
        sid = (
            await a.post("/v1/sandboxes", json={"job": "j"}, headers={"x-dsec-csrf": csrf})
        ).json()["id"]
        await _sign_in(b, BOB)
        bcsrf = await _csrf(b)
        assert (await b.get("/v1/sandboxes")).json()["sandboxes"] == []
        for path in ("", "/metrics", "/trajectory", "/files/list?path=/"):
            r = await b.get(f"/v1/sandboxes/{sid}{path}")
            assert r.status_code == 404, (path, r.text)
        for verb in ("pause", "resume"):
            r = await b.post(f"/v1/sandboxes/{sid}/{verb}", headers={"x-dsec-csrf": bcsrf})
            assert r.status_code == 404
        assert (
            await b.delete(f"/v1/sandboxes/{sid}", headers={"x-dsec-csrf": bcsrf})
        ).status_code == 404
        r = await b.post("/v1/jobs/j/kill", headers={"x-dsec-csrf": bcsrf})
        assert r.json()["outcomes"] == {}
        view = (await b.get("/ui/api/overview")).json()
        assert view["mine"]["sandboxes"] == 0 and view["mine"]["by_tier_state"] == {}
        assert "tenants" not in view and "nodes" not in view  # no operator view for a user
        assert sid not in (await b.get("/ui/api/overview")).text
        assert edge.sandboxes[sid].state == "running"


async def test_the_operator_sees_the_node(app: object, edge: FakeEdge) -> None:
    async with _client(app) as a, _client(app) as op:
        await _sign_in(a, ALICE)
        csrf = await _csrf(a)
        for _ in range(3):
            await a.post("/v1/sandboxes", json={}, headers={"x-dsec-csrf": csrf})
        await _sign_in(op, OP)
        me = (await op.get("/ui/api/session")).json()
        assert me["operator"] is True
        view = (await op.get("/ui/api/overview")).json()
        assert view["operator"] and view["mine"]["sandboxes"] == 0
        assert view["tenants"] == [
            {"owner": owner_id(ALICE), "sandboxes": 3, "cpu": 3.0, "memory_mb": 3 * 512}
        ]
        assert view["nodes"][0]["name"] == "fake" and view["nodes"][0]["sandboxes"] == 3
        assert view["capacity"]["sandboxes"] == 3
        assert sum(view["activity"]["creations"]) == 3  # every key's, through this apiserver
        # the operator still cannot act on another key's sandbox
        sid = next(iter(edge.sandboxes))
        r = await op.delete(f"/v1/sandboxes/{sid}", headers={"x-dsec-csrf": me["csrf"]})
        assert r.status_code == 404


async def test_bearer_keys_work_on_ui_api_and_bad_input_is_never_a_500(app: object) -> None:
    async with _client(app) as c:
        r = await c.get("/ui/api/overview", headers={"authorization": f"Bearer {ALICE}"})
        assert r.status_code == 200 and r.json()["owner"] == owner_id(ALICE)
        assert r.json()["activity"]["t"]
        me = (await c.get("/ui/api/session", headers={"authorization": f"Bearer {ALICE}"})).json()
        assert me["csrf"] is None
        for method, path in (
            ("GET", "/ui/api/nope"),
            ("POST", "/ui/api/overview"),
            ("GET", "/ui/static/../../etc/passwd"),
            ("GET", "/ui/static/nothing.js"),
            ("POST", "/ui/logout"),
        ):
            r = await c.request(method, path, headers={"authorization": f"Bearer {ALICE}"})
            assert r.status_code < 500, (method, path, r.status_code)
        _use(c, "v1.%%%.%%%")
        assert (await c.get("/ui")).status_code == 401


async def test_features_follow_the_routes(app: object) -> None:
    from fastapi import APIRouter

    async with _client(app) as c:
        me = (await c.get("/ui/api/session", headers={"authorization": f"Bearer {ALICE}"})).json()
        assert me["features"] == {
            "logs": True,
            "port_proxy": False,
            "builds": True,
            "metrics": True,
            "audit": True,
        }
        extra = APIRouter()

        @extra.get("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}")
        async def proxy() -> None: ...

        app.include_router(extra)  # type: ignore[attr-defined]
        me = (await c.get("/ui/api/session", headers={"authorization": f"Bearer {ALICE}"})).json()
        assert me["features"]["port_proxy"] is True


def test_unbuilt_front_end_says_how_to_build_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import dsec.ui.routes as routes

    monkeypatch.setattr(routes, "STATIC_DIR", tmp_path)
    assert "scripts/bootstrap.sh" in routes.app_page()
    (tmp_path / "app.js").write_text("")
    (tmp_path / "app.css").write_text("")
    assert "/ui/static/app.js?v=" in routes.app_page()


def test_the_secret_is_kept_in_the_home_and_shared_through_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSEC_UI_SECRET", raising=False)
    a = load_secret(tmp_path)
    assert load_secret(tmp_path) == a and len(a) == 32
    assert (tmp_path / "ui_secret").stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("DSEC_UI_SECRET", "ab" * 32)
    assert load_secret(tmp_path) == bytes.fromhex("ab" * 32)
    monkeypatch.setenv("DSEC_UI_SECRET", "short")
    with pytest.raises(Exception, match="hex"):
        load_secret(tmp_path)


# --- the series -------------------------------------------------------------------------
def test_percentiles_from_a_histogram() -> None:
    bounds = (10.0, 20.0, 40.0, float("inf"))
    assert percentile(bounds, [0, 0, 0, 0], 0.5) is None
    assert percentile(bounds, [10, 0, 0, 0], 0.5) == pytest.approx(5.0)
    assert percentile(bounds, [0, 10, 0, 0], 0.95) == pytest.approx(19.5)
    assert percentile(bounds, [5, 5, 0, 0], 0.5) == pytest.approx(10.0)
    assert percentile(bounds, [0, 0, 0, 3], 0.5) == 40.0  # the overflow bucket


def test_activity_recorder_per_owner_and_total() -> None:
    rec = ActivityRecorder(step_s=10, window_s=60)
    now = 1_000_000.0
    for ms in (1.5, 3, 4, 8):
        rec.record("ka", "POST", "/v1/sandboxes/{sandbox_id}/exec", 200, ms / 1000, now=now)
    rec.record("ka", "POST", "/v1/sandboxes/{sandbox_id}/exec", 409, 0.002, now=now)
    rec.record("kb", "POST", "/v1/sandboxes", 201, 0.05, now=now - 20)
    rec.record(None, "GET", "/v1/sandboxes", 401, 0.001, now=now)
    a = rec.series("ka", now=now)
    assert len(a["t"]) == 6 and a["t"][-1] == 1_000_000
    assert a["execs"][-1] == 5 and a["exec_errors"][-1] == 1 and a["errors"][-1] == 1
    assert 2 <= a["exec_p50_ms"][-1] <= 5 and a["exec_p95_ms"][-1] <= 10
    assert a["creations"] == [0] * 6
    b = rec.series("kb", now=now)
    assert b["creations"][-3] == 1 and b["execs"] == [0] * 6
    total = rec.series(None, now=now)
    assert total["requests"][-1] == 6 and total["creations"][-3] == 1
    assert rec.series("nobody", now=now)["requests"] == [0] * 6
    # the window slides: an hour later nothing is left
    assert sum(rec.series("ka", now=now + 3600)["requests"]) == 0
    assert LATENCY_BOUNDS_MS[-1] == float("inf")


def test_activity_recorder_takes_late_requests_in_their_step() -> None:
    rec = ActivityRecorder(step_s=10, window_s=30)  # steps 110, 120, 130 shown
    for t in (100, 110, 120, 130):
        rec.record("k", "GET", "/v1/sandboxes", 200, 0.001, now=t)
    rec.record("k", "GET", "/v1/sandboxes", 200, 0.001, now=115)  # ended late
    rec.record("k", "GET", "/v1/sandboxes", 200, 0.001, now=50)  # outside the window
    assert rec.series("k", now=130)["requests"] == [2, 1, 1]


def test_activity_recorder_forgets_idle_owners() -> None:
    rec = ActivityRecorder(step_s=10, window_s=60, max_owners=3)
    for i in range(10):
        rec.record(f"k{i}", "GET", "/v1/sandboxes", 200, 0.001, now=1000.0 + i * 100)
    assert len(rec._owners) <= 4  # three owners and the total


async def test_node_sampler_rates_from_the_edges_counters(edge: FakeEdge) -> None:
    from dsec.models import CreateSandboxRequest, SandboxExecRequest

    sampler = NodeSampler(edge, step_s=10)
    sampler.sample(now=1000.0)
    info = await edge.create_sandbox(CreateSandboxRequest(), "kowner000000000001")
    for _ in range(6):
        run = SandboxExecRequest(sandbox_id=info.id, cmd="true")
        await edge.exec(run, "kowner000000000001")
    sampler.sample(now=1060.0)
    s = sampler.series()
    assert s["t"] == [1060]
    assert s["creations_per_min"] == [1.0] and s["execs_per_min"] == [6.0]
    assert s["exec_errors_per_min"] == [0.0] and s["running"] == [1.0]
    # the fake's execs take well under a millisecond: their histogram's p50, not a stray value
    assert s["exec_p50_ms"][0] is not None and s["exec_p50_ms"][0] < budget(10)
    assert s["host_cpu_pct"][0] is None or 0 <= s["host_cpu_pct"][0] <= 100
    assert s["requested_cpu"] == [1.0]
