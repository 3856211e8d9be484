"""KeyStore and the apiserver's authentication (hermetic: FakeEdge + ASGITransport)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import KeyStore, StaticKeys, generate_key, owner_id
from dsec.testing import FakeEdge


def test_generate_key_shape() -> None:
    key = generate_key()
    assert key.startswith("dsec_") and len(key) == 5 + 43
    assert generate_key() != key


def test_keystore_first_start_writes_key_file(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "home")
    key_file = tmp_path / "home" / "api_key"
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "home" / "api_keys.json").stat().st_mode) == 0o600
    assert store.verify(key) == owner_id(key)
    assert key not in (tmp_path / "home" / "api_keys.json").read_text()  # only the hash
    # A second start reuses the key instead of making a new one.
    again = KeyStore(tmp_path / "home")
    assert key_file.read_text().strip() == key
    assert again.verify(key) == owner_id(key)
    assert len(again.list()) == 1


def test_keystore_registers_a_provisioned_key(tmp_path: Path) -> None:
    tmp_path.joinpath("api_key").write_text("dsec_provisioned\n")
    store = KeyStore(tmp_path)
    assert store.verify("dsec_provisioned") == owner_id("dsec_provisioned")


def test_keystore_create_verify_revoke(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    new = store.create_key("ci")
    owner = store.verify(new)
    assert owner is not None and owner.startswith("k") and len(owner) == 17
    assert owner != store.verify(tmp_path.joinpath("api_key").read_text().strip())
    assert store.verify(new + "x") is None
    assert store.verify("") is None
    assert store.verify("x" * 10_000) is None
    # Another process (another KeyStore on the same dir) sees the revocation.
    other = KeyStore(tmp_path)
    assert other.revoke(owner) is True
    assert other.revoke(owner) is False
    assert store.verify(new) is None
    key2 = store.create_key()
    assert store.revoke(key2) is True  # by the key itself
    assert store.verify(key2) is None
    assert [r.name for r in store.list()] == ["default"]
    assert json.loads(tmp_path.joinpath("api_keys.json").read_text())["keys"][0]["owner"]


async def _client(
    app: object, key: str | None, client_addr: str = "127.0.0.1"
) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app, client=(client_addr, 4242))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://dsec", headers=headers)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "Basic abc"},
        {"authorization": "Bearer "},
    ],
)
async def test_v1_requires_a_valid_key(headers: dict[str, str]) -> None:
    edge = FakeEdge()
    app = create_app(edge, StaticKeys(["dsec_good"]))
    async with await _client(app, None) as c:
        for method, path in [
            ("GET", "/v1/sandboxes"),
            ("POST", "/v1/sandboxes"),
            ("GET", "/v1/node"),
            ("GET", "/v1/images"),
            ("GET", "/v1/does-not-exist"),
            ("DELETE", "/v1/sandboxes/sb-x-1"),
        ]:
            r = await c.request(method, path, headers=headers, content=b"{not json")
            assert r.status_code == 401, (method, path)
            assert r.json()["error"]["code"] == "unauthenticated"
            assert r.headers["x-request-id"]
    assert edge.calls == []  # nothing reached the edge


async def test_owner_isolation() -> None:
    edge = FakeEdge()
    app = create_app(edge, StaticKeys(["dsec_alice", "dsec_bob"]))
    async with await _client(app, "dsec_alice") as alice, await _client(app, "dsec_bob") as bob:
        created = (await alice.post("/v1/sandboxes", json={})).json()
        assert edge.calls_to("create_sandbox")[0]["owner"] == owner_id("dsec_alice")
        r = await bob.get(f"/v1/sandboxes/{created['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        assert (await bob.get("/v1/sandboxes")).json() == {"sandboxes": []}
        assert len((await alice.get("/v1/sandboxes")).json()["sandboxes"]) == 1


async def test_open_routes_and_metrics_policy() -> None:
    app = create_app(FakeEdge(), StaticKeys(["dsec_good"]))
    async with await _client(app, None, "10.9.8.7") as remote:
        assert (await remote.get("/healthz")).json()["status"] == "ok"
        assert (await remote.get("/metrics")).status_code == 401
        ok = await remote.get("/metrics", headers={"authorization": "Bearer dsec_good"})
        assert ok.status_code == 200
    async with await _client(app, None, "127.0.0.1") as local:
        r = await local.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert "# TYPE dsec_file_ops_total counter" in r.text  # the edge's own metrics are appended
        assert 'dsec_api_errors_total{code="unauthenticated"} 1.0' in r.text
        assert 'route="/metrics",status="401"' in r.text
    async with await _client(app, None, "::1") as local6:
        assert (await local6.get("/metrics")).status_code == 200


def test_concurrent_key_creation_loses_nothing(tmp_path: Path) -> None:
    import threading

    stores = [KeyStore(tmp_path) for _ in range(4)]
    created: list[str] = []

    def make(store: KeyStore) -> None:
        for _ in range(10):
            created.append(store.create_key())

    threads = [threading.Thread(target=make, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = KeyStore(tmp_path)
    assert len(fresh.list()) == 41
    assert all(fresh.verify(k) == owner_id(k) for k in created)
