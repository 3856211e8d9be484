"""`run_code` through the public SDK and HTTP, on a real server with the fncall tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.timing import budget

from dsec import Client
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.debian]


@pytest.fixture(scope="module")
def fncall_server(tmp_path_factory: pytest.TempPathFactory, shared_layers: Path):  # type: ignore[no-untyped-def]
    home = tmp_path_factory.mktemp("fncall-sdk") / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with BackgroundServer(home, tiers=["fncall"]) as srv:
        yield srv


def test_run_code_python_through_sdk(fncall_server) -> None:  # type: ignore[no-untyped-def]
    client = Client(url=fncall_server.url, api_key=fncall_server.api_key, timeout=budget(120))
    try:
        r = client.run_code("import sys; print(1 + 1); print('err', file=sys.stderr)", "python")
        assert r.outcome == "ok"
        assert r.run.stdout == "2\n"
        assert r.run.stderr == "err\n"
        bad = client.run_code("def f(:\n  pass", "python")
        assert bad.outcome == "runtime_error"
        files = client.run_code(
            "open('out.txt','w').write(open('in.txt').read().upper())",
            "python",
            files={"in.txt": b"hello"},
            fetch_files=["out.txt"],
        )
        assert files.outcome == "ok"
        import base64

        assert base64.b64decode(files.files["out.txt"]) == b"HELLO"
        slow = client.run_code("while True: pass", "python", timeout=1)
        assert slow.outcome == "timeout"
    finally:
        client.close()


def test_sandboxfusion_route_without_key_is_refused(fncall_server) -> None:  # type: ignore[no-untyped-def]
    import httpx

    r = httpx.post(f"{fncall_server.url}/run_code", json={"code": "print(1)", "language": "python"})
    assert r.status_code == 401
    r = httpx.post(
        f"{fncall_server.url}/k/{fncall_server.api_key}/run_code",
        json={"code": "print(1)", "language": "python"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "1\n"


def test_run_code_counts_against_the_key_quota(fncall_server) -> None:  # type: ignore[no-untyped-def]
    """A key's quota holds run_code as it holds creations (through the edge's admission):
    a call without a memory limit counts as a default worker and does not fit 512 MiB, a
    smaller one runs; SandboxFusion's route is refused with dsec's error, not an answer."""
    import httpx

    from dsec.errors import QuotaExceeded
    from dsec.models import KeyQuota

    key = fncall_server.keys.create_key("quota", quota=KeyQuota(max_memory_mb=512))
    client = Client(url=fncall_server.url, api_key=key, timeout=budget(120))
    try:
        with pytest.raises(QuotaExceeded) as e:
            client.run_code("print(1)", "python")
        assert e.value.details["quota"] == "max_memory_mb"
        r = client.run_code("print(1)", "python", memory_mb=256)
        assert r.outcome == "ok" and r.run.stdout == "1\n"
        refused = httpx.post(
            f"{fncall_server.url}/k/{key}/run_code",
            json={"code": "print(1)", "language": "python"},
            timeout=60,
        )
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
        ran = httpx.post(
            f"{fncall_server.url}/k/{key}/run_code",
            json={"code": "print(1)", "language": "python", "memory_limit_MB": 256},
            timeout=60,
        )
        assert ran.status_code == 200 and ran.json()["run_result"]["stdout"] == "1\n"
    finally:
        client.close()
