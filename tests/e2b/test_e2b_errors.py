"""Bad input, refused features and isolation between API keys, as the e2b SDK sees them."""

from __future__ import annotations

import json
import struct

import httpx
import pytest

from conftest import E2BServer
from e2b import (
    AuthenticationException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
)


def test_unknown_template_is_not_found(e2b_server: E2BServer) -> None:
    with pytest.raises(SandboxException) as exc:
        Sandbox.create("no-such-template")
    assert exc.value.status_code == 404 and "not found" in str(exc.value)


def test_bad_api_key(e2b_server: E2BServer) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create("base", api_key="key-mallory")


def test_invalid_metadata_and_envs_are_400(e2b_server: E2BServer) -> None:
    with pytest.raises(SandboxException) as exc:
        Sandbox.create("base", metadata={"bad key!": "x"})
    assert exc.value.status_code == 400
    with pytest.raises(SandboxException) as exc:
        Sandbox.create("base", envs={"1BAD": "x"})
    assert exc.value.status_code == 400


def test_refused_features_say_so(e2b_server: E2BServer) -> None:
    for kwargs in (
        # network policies are mapped (tests/unit/test_network_api.py); these are not
        {"network": {"allow_out": ["a.example.com"], "egress_proxy": {"address": "p:1080"}}},
        {"network": {"rules": {"a.example.com": [{"transform": {"headers": {"X": "1"}}}]}}},
    ):
        with pytest.raises(SandboxException) as exc:
            Sandbox.create("base", **kwargs)
        assert exc.value.status_code == 422 and "not supported by dsec" in str(exc.value)
    sbx = Sandbox.create("base")
    try:
        with pytest.raises(SandboxException) as exc:  # this fake tier cannot measure
            sbx.get_metrics()
        assert exc.value.status_code == 422 and "cannot measure" in str(exc.value)
        with pytest.raises(SandboxException) as exc:
            sbx.create_snapshot(mode="full")
        assert exc.value.status_code == 422 and "filesystem-only" in str(exc.value)
    finally:
        sbx.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause(sbx.sandbox_id)


def test_a_malformed_sandbox_id_is_not_found(e2b_server: E2BServer) -> None:
    """E2B answers an id of no form as it answers an unknown one: 404, never dsec's 400."""
    headers = {"X-API-Key": "key-alice"}
    for sid in ("SB-Upper", "not-an-id", "sb-" + "a" * 80):
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{e2b_server.api_url}/sandboxes/{sid}", headers=headers)
            assert r.status_code == 404 and r.json()["code"] == 404, (method, sid, r.text)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("not-an-id")
    assert Sandbox.kill("not-an-id") is False
    for verb in ("metrics", "resume", "connect"):  # the table verbs' requests too
        method = "GET" if verb == "metrics" else "POST"
        url = f"{e2b_server.api_url}/sandboxes/not-an-id/{verb}"
        r = httpx.request(method, url, headers=headers, json=None if method == "GET" else {})
        assert r.status_code == 404 and r.json()["code"] == 404, (verb, r.text)
    r = httpx.get(
        f"{e2b_server.api_url}/sandboxes/metrics",
        params={"sandbox_ids": "not-an-id"},
        headers=headers,
    )
    assert r.status_code == 200 and r.json() == {"sandboxes": {}}, r.text  # left out


def test_another_owner_sees_nothing(e2b_server: E2BServer) -> None:
    alice = Sandbox.create("base", metadata={"who": "alice"})
    bob = Sandbox.create("base", api_key="key-bob", metadata={"who": "bob"})
    try:
        alice.files.write("/tmp/secret.txt", "alice-secret")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(alice.sandbox_id, api_key="key-bob")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(alice.sandbox_id, api_key="key-bob")
        assert Sandbox.kill(alice.sandbox_id, api_key="key-bob") is False
        bobs = Sandbox.list(api_key="key-bob").next_items()
        assert [s.sandbox_id for s in bobs] == [bob.sandbox_id]
        assert not Sandbox.list(
            query=SandboxQuery(metadata={"who": "alice"}), api_key="key-bob"
        ).next_items()

        # envd: bob's valid token presented for alice's sandbox, a forged token, no token.
        bob_token = bob._envd_access_token
        url = f"{e2b_server.sandbox_url}/files"
        params = {"path": "/tmp/secret.txt"}
        for token, status in ((bob_token, 502), ("Ym9i." + "0" * 64, 502), (None, 401)):
            headers = {"E2b-Sandbox-Id": alice.sandbox_id}
            if token:
                headers["X-Access-Token"] = token
            r = httpx.get(url, params=params, headers=headers)
            assert r.status_code == status and b"alice-secret" not in r.content
        rpc = httpx.post(
            f"{e2b_server.sandbox_url}/filesystem.Filesystem/Stat",
            json={"path": "/tmp/secret.txt"},
            headers={"E2b-Sandbox-Id": alice.sandbox_id, "X-Access-Token": bob_token or ""},
        )
        assert rpc.status_code == 503 and rpc.json()["code"] == "unavailable"
        assert "secret" not in rpc.text
        # Bob's own handle pointed at alice's id through the SDK: the sandbox "does not exist".
        forged = Sandbox(
            sandbox_id=alice.sandbox_id,
            sandbox_domain=None,
            envd_version=bob._envd_version,
            envd_access_token=bob_token,
            traffic_access_token=None,
            connection_config=type(bob.connection_config)(
                extra_sandbox_headers={
                    "E2b-Sandbox-Id": alice.sandbox_id,
                    "X-Access-Token": bob_token or "",
                }
            ),
        )
        with pytest.raises(SandboxNotRunningException):
            forged.files.read("/tmp/secret.txt")
        with pytest.raises(SandboxNotRunningException):
            forged.commands.run("cat /tmp/secret.txt")
        assert alice.files.read("/tmp/secret.txt") == "alice-secret"
    finally:
        alice.kill()
        bob.kill()


def test_killed_sandbox_is_not_running(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base")
    sbx.kill()
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("echo hi")
    with pytest.raises(SandboxNotRunningException):
        sbx.files.read("/etc/passwd")


def test_oversized_files(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base")
    try:
        with pytest.raises(SandboxException) as exc:
            sbx.files.write("/tmp/big.bin", b"x" * ((1 << 20) + 1))  # server limit: 1 MiB
        assert "413" in str(exc.value)
        sbx.commands.run("head -c 9000000 /dev/zero > /tmp/huge.bin")
        with pytest.raises(SandboxException) as exc:
            sbx.files.read("/tmp/huge.bin")  # fake edge read limit: 8 MiB
        assert "413" in str(exc.value)
    finally:
        sbx.kill()


def _envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def test_malformed_connect_requests_never_500(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base")
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
        base = e2b_server.sandbox_url
        stream_ct = {**headers, "Content-Type": "application/connect+json"}
        cases = [
            # truncated envelope (declares 100 bytes, sends 3)
            (f"{base}/process.Process/Start", stream_ct, struct.pack(">BI", 0, 100) + b"{}}"),
            # envelope around invalid JSON
            (f"{base}/process.Process/Start", stream_ct, _envelope(b"{not json")),
            # a well-formed but wrongly typed message
            (
                f"{base}/process.Process/Start",
                stream_ct,
                _envelope(json.dumps({"process": 5}).encode()),
            ),
            # an empty command
            (f"{base}/process.Process/Start", stream_ct, _envelope(b'{"process": {"cmd": ""}}')),
            # unknown compression flag
            (f"{base}/process.Process/Start", stream_ct, _envelope(b"{}", flags=0x01)),
            # unary with garbage body
            (
                f"{base}/filesystem.Filesystem/Stat",
                {**headers, "Content-Type": "application/json"},
                b"\xff\xfe",
            ),
            # unknown method
            (
                f"{base}/process.Process/Nope",
                {**headers, "Content-Type": "application/json"},
                b"{}",
            ),
            # unsupported content type
            (f"{base}/process.Process/List", {**headers, "Content-Type": "text/plain"}, b"{}"),
        ]
        for url, hdrs, body in cases:
            r = httpx.post(url, content=body, headers=hdrs, timeout=10)
            assert r.status_code < 500 or r.status_code == 503, (url, r.status_code, r.text)
            if r.status_code == 200:  # stream errors travel in the end-of-stream envelope
                assert b'"error"' in r.content, r.content
            elif r.headers.get("content-type") == "application/json":
                assert r.json()["code"] in {
                    "invalid_argument",
                    "unimplemented",
                    "internal",
                    "not_found",
                }, r.text
        # The server still works.
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_unknown_control_routes_are_501(e2b_server: E2BServer) -> None:
    r = httpx.post(f"{e2b_server.api_url}/volumes", headers={"X-API-Key": "key-alice"}, json={})
    assert r.status_code == 501 and "not implemented" in r.json()["message"]
    # the fake edge cannot build images: the template build route says so (no 500)
    r = httpx.post(
        f"{e2b_server.api_url}/v3/templates", headers={"X-API-Key": "key-alice"}, json={}
    )
    assert r.status_code == 400  # no name
    r = httpx.post(
        f"{e2b_server.api_url}/v3/templates",
        headers={"X-API-Key": "key-alice"},
        json={"name": "t1"},
    ).json()
    r = httpx.post(
        f"{e2b_server.api_url}/v2/templates/{r['templateID']}/builds/{r['buildID']}",
        headers={"X-API-Key": "key-alice"},
        json={"fromImage": "busybox"},
    )
    assert r.status_code == 422 and "build images" in r.json()["message"]
    r = httpx.post(
        f"{e2b_server.api_url}/v2/sandboxes", headers={"X-API-Key": "key-alice"}, content=b"{oops"
    )
    assert r.status_code == 400
    r = httpx.post(
        f"{e2b_server.api_url}/v2/sandboxes", headers={"X-API-Key": "key-alice"}, json={}
    )
    assert r.status_code == 400
