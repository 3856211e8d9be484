"""E2B's defaults on a server nobody configured: the port proxy's default ports domain and
TLS listener (:meth:`dsec.server.PortsSettings.from_env`), and sandboxes created through
the E2B API with public ports unless ``allow_public_traffic=False`` while dsec's own API
keeps them private (over the real apiserver and E2B app on :class:`dsec.testing.FakeEdge`)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec.server
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.server import DEFAULT_PORTS_DOMAIN, PortsSettings, build_app, close_app
from dsec.testing import FakeEdge

KEY = "dsec_" + "k" * 43
OTHER = "dsec_" + "o" * 43
PORTS_ENV = (
    "DSEC_PORTS_DOMAIN",
    "DSEC_PORTS_TLS_PORT",
    "DSEC_PORTS_TLS_CERT",
    "DSEC_PORTS_TLS_KEY",
)


@pytest.fixture
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PORTS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def free_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A free port standing in for DEFAULT_TLS_PORT (7443 may be held on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    monkeypatch.setattr(dsec.server, "DEFAULT_TLS_PORT", port)
    yield port


def _settings(home: Path) -> PortsSettings:
    return PortsSettings.from_env(home, host="127.0.0.1", port=7070)


def test_nothing_configured_serves_host_routes_on_localhost_with_tls(
    no_settings: None, free_default: int, tmp_path: Path
) -> None:
    from cryptography import x509

    s = _settings(tmp_path)
    try:
        assert s.tls_socket is not None and s.tls_port == free_default
        assert s.tls_socket.getsockname() == ("127.0.0.1", free_default)
        assert s.domain == f"{DEFAULT_PORTS_DOMAIN}:{free_default}"
        assert s.tls is not None and s.tls.ca == tmp_path / "ports-tls" / "ca.pem"
        cert = x509.load_pem_x509_certificates(s.tls.cert.read_bytes())[0]
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) == {
            "dsec.localhost",
            "*.dsec.localhost",
            "localhost",
        }
        assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    finally:
        assert s.tls_socket is not None
        s.tls_socket.close()


def test_a_taken_default_port_gives_another(
    no_settings: None, free_default: int, tmp_path: Path
) -> None:
    holder = socket.create_server(("127.0.0.1", free_default))
    try:
        s = _settings(tmp_path)
        assert s.tls_socket is not None
        assert s.tls_port not in (None, free_default)
        assert s.domain == f"{DEFAULT_PORTS_DOMAIN}:{s.tls_port}"
        s.tls_socket.close()
    finally:
        holder.close()


def test_operator_settings_win(
    no_settings: None, free_default: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an operator's domain: TLS only where DSEC_PORTS_TLS_PORT says (as before)
    monkeypatch.setenv("DSEC_PORTS_DOMAIN", "ports.example.com")
    s = _settings(tmp_path)
    assert (s.domain, s.tls_port, s.tls, s.tls_socket) == ("ports.example.com", None, None, None)
    # host routes off: no domain and no listener
    monkeypatch.setenv("DSEC_PORTS_DOMAIN", "off")
    s = _settings(tmp_path)
    assert (s.domain, s.tls_port, s.tls_socket) == (None, None, None)
    # TLS off: the default domain names the plain listener
    monkeypatch.delenv("DSEC_PORTS_DOMAIN")
    monkeypatch.setenv("DSEC_PORTS_TLS_PORT", "off")
    s = _settings(tmp_path)
    assert (s.domain, s.tls_port, s.tls_socket) == (f"{DEFAULT_PORTS_DOMAIN}:7070", None, None)
    # a TLS port chosen: bound by the listener itself, the default domain names it
    monkeypatch.setenv("DSEC_PORTS_TLS_PORT", "443")
    s = _settings(tmp_path)
    assert (s.domain, s.tls_port, s.tls_socket) == (DEFAULT_PORTS_DOMAIN, 443, None)
    monkeypatch.setenv("DSEC_PORTS_TLS_PORT", "https")
    with pytest.raises(SystemExit, match="DSEC_PORTS_TLS_PORT"):
        _settings(tmp_path)


def test_localhost_names_resolve_reads_nsswitch(tmp_path: Path) -> None:
    from dsec.server import localhost_names_resolve

    conf = tmp_path / "nsswitch.conf"
    conf.write_text("passwd: files\nhosts:          files dns\n")
    assert not localhost_names_resolve(conf)
    conf.write_text("hosts: files myhostname dns\n")
    assert localhost_names_resolve(conf)
    conf.write_text("hosts: files resolve [!UNAVAIL=return] dns\n")
    assert localhost_names_resolve(conf)
    assert not localhost_names_resolve(tmp_path / "missing")


async def test_e2b_sandboxes_have_public_ports_unless_asked_otherwise() -> None:
    """E2B's default (``allow_public_traffic`` true): a port of a sandbox made through the
    E2B API answers without any credential and the create hands out no traffic token;
    ``allow_public_traffic=False`` makes them private; dsec's own API keeps private ports;
    another key reaches no private port and learns nothing of either sandbox."""
    edge = FakeEdge(available_tiers=("container",))
    app = build_app(edge, StaticKeys([KEY, OTHER]), PortsSettings(domain="ports.test"))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=10) as c:

            async def e2b_create(body: dict[str, object]) -> dict[str, str]:
                r = await c.post("/e2b/sandboxes", json=body, headers={"x-api-key": KEY})
                assert r.status_code == 201, r.text
                return dict(r.json())

            public = await e2b_create({"templateID": "busybox"})
            private = await e2b_create(
                {"templateID": "busybox", "network": {"allowPublicTraffic": False}}
            )
            explicit = await e2b_create(
                {"templateID": "busybox", "network": {"allowPublicTraffic": True}}
            )
            r = await c.post(
                "/e2b/sandboxes",
                json={"templateID": "busybox", "network": {"allowPublicTraffic": "yes"}},
                headers={"x-api-key": KEY},
            )
            assert r.status_code == 400
            assert "trafficAccessToken" not in public and "trafficAccessToken" not in explicit
            assert private["trafficAccessToken"]
            assert len(public["sandboxID"].rsplit("-", 1)[1]) == 24  # the id is the secret
            r = await c.post(
                "/v1/sandboxes",
                json={"tier": "container"},
                headers={"authorization": f"Bearer {KEY}"},
            )
            native = r.json()["id"]
            assert r.json()["public_ports"] is False

            def port(sid: str, **headers: str) -> dict[str, str]:
                return {"host": f"8000-{sid}.ports.test", **headers}

            # reached (nothing listens on 8000 in a fake sandbox: 502 from the sandbox's side)
            r = await c.get("/", headers=port(public["sandboxID"]))
            assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_listening"
            for sid in (private["sandboxID"], native):
                r = await c.get("/", headers=port(sid))
                assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
            r = await c.get(
                "/",
                headers=port(
                    private["sandboxID"],
                    **{"e2b-traffic-access-token": private["trafficAccessToken"]},
                ),
            )
            assert r.status_code == 502
            info = (
                await c.get(f"/e2b/sandboxes/{public['sandboxID']}", headers={"x-api-key": KEY})
            ).json()
            assert info["network"]["allowPublicTraffic"] is True
            info = (
                await c.get(f"/e2b/sandboxes/{private['sandboxID']}", headers={"x-api-key": KEY})
            ).json()
            assert info["network"]["allowPublicTraffic"] is False
            # a second key: its key opens no port of KEY's sandboxes, public ones included
            # (a key names its owner, and these are not its sandboxes), nor the sandboxes
            theirs = {"authorization": f"Bearer {OTHER}"}
            for sid in (public["sandboxID"], private["sandboxID"], native):
                r = await c.get("/", headers=port(sid, **theirs))
                assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
                r = await c.get(f"/e2b/sandboxes/{sid}", headers={"x-api-key": OTHER})
                assert r.status_code == 404
            assert owner_id(OTHER) != owner_id(KEY)
    finally:
        await close_app(app)
