"""The unmodified ``sandbox-fusion`` PyPI client against the run_code router, over real HTTP.

A small FastAPI app mounts ``make_runcode_router`` (as ``dsec serve`` does) in a uvicorn
thread; the fncall runtime lives on that thread's loop. Keyless calls are accepted from
127.0.0.0/8 only on the first app; the second app takes keys only (header or URL path).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.conftest import free_port

sandbox_fusion = pytest.importorskip("sandbox_fusion")

from fastapi import FastAPI, Request  # noqa: E402

from dsec.apiserver.routes_runcode import make_runcode_router, request_api_key  # noqa: E402
from dsec.runtimes.fncall.pool import PoolConfig  # noqa: E402
from dsec.runtimes.fncall.service import RunCodeService  # noqa: E402
from dsec.runtimes.fncall.testkit import fncall_service  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.debian,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

API_KEY = "dsec_test_" + secrets.token_hex(8)


def _make_app(home: Path, keyless: list[str]) -> FastAPI:
    holder: dict[str, RunCodeService] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with fncall_service(
            home, pool=PoolConfig(min_ready=2, max_ready=8, memory_mb=256, pids=64)
        ) as svc:
            holder["svc"] = svc
            yield

    def authorize(request: Request) -> str | None:
        return "owner-1" if request_api_key(request) == API_KEY else None

    app = FastAPI(lifespan=lifespan)
    app.include_router(
        make_runcode_router(lambda: holder["svc"], authorize, keyless_networks=keyless)
    )
    return app


@contextlib.contextmanager
def _serve(app: FastAPI) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def keyless_url(dsec_home_root: Path) -> Iterator[str]:
    with _serve(_make_app(dsec_home_root / f"sf-{secrets.token_hex(3)}", ["127.0.0.0/8"])) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(dsec_home_root: Path) -> Iterator[str]:
    with _serve(_make_app(dsec_home_root / f"sf-k-{secrets.token_hex(3)}", [])) as url:
        yield url


def test_client_runs_python_keyless(keyless_url: str) -> None:
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    resp = run_code(
        RunCodeRequest(code="print(1+1)", language="python"), endpoint=keyless_url, max_attempts=1
    )
    assert resp.status == RunStatus.Success
    assert (
        resp.run_result is not None
        and resp.run_result.stdout == "2\n"
        and resp.run_result.return_code == 0
    )
    assert resp.run_result.execution_time is not None and resp.run_result.execution_time < 5


def test_client_files_stdin_fetch(keyless_url: str) -> None:
    from sandbox_fusion import RunCodeRequest, run_code

    req = RunCodeRequest(
        code="import sys\nopen('out.txt','w').write(open('in.txt').read() + sys.stdin.read())",
        language="python",
        stdin="B",
        files={"in.txt": base64.b64encode(b"A").decode()},
        fetch_files=["out.txt"],
    )
    resp = run_code(req, endpoint=keyless_url, max_attempts=1)
    assert base64.b64decode(resp.files["out.txt"]) == b"AB"


def test_client_summary_of_failures(keyless_url: str) -> None:
    from sandbox_fusion import RunCodeRequest, SummaryMapping, run_code, summary_run_code_result

    mapping = SummaryMapping(CompileFailed="CE", RunFailed="RE", RunTimeout="TLE")
    resp = run_code(
        RunCodeRequest(code="raise SystemExit(2)", language="python"),
        endpoint=keyless_url,
        max_attempts=1,
    )
    assert summary_run_code_result(resp, mapping) == "RE"
    resp = run_code(
        RunCodeRequest(code="import time; time.sleep(9)", language="python", run_timeout=0.5),
        endpoint=keyless_url,
        max_attempts=1,
    )
    assert summary_run_code_result(resp, mapping) == "TLE"
    resp = run_code(
        RunCodeRequest(code="echo hi; exit 1", language="bash"),
        endpoint=keyless_url,
        max_attempts=1,
    )
    assert resp.run_result is not None and resp.run_result.stdout == "hi\n"
    assert summary_run_code_result(resp, mapping) == "RE"


def test_client_sees_sandbox_error_for_bad_input(keyless_url: str) -> None:
    import requests
    from sandbox_fusion import RunCodeRequest, run_code

    with pytest.raises(Exception, match=r"may not use '\.\.'"):
        run_code(
            RunCodeRequest(code="print(1)", language="python", fetch_files=["/mnt/../etc/passwd"]),
            endpoint=keyless_url,
            max_attempts=1,
        )
    # a language the client does not know, sent raw (verl posts JSON itself)
    r = requests.post(
        f"{keyless_url}/run_code",
        json={"code": "x", "language": "cobol", "memory_limit_MB": 64},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["status"] == "SandboxError"
    r = requests.post(f"{keyless_url}/run_code", data=b"{not json", timeout=30)
    assert r.status_code == 400


def test_key_in_url_path_and_header(keyed_url: str) -> None:
    import requests
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    resp = run_code(
        RunCodeRequest(code="print('k')", language="python"),
        endpoint=f"{keyed_url}/k/{API_KEY}",
        max_attempts=1,
    )
    assert (
        resp.status == RunStatus.Success
        and resp.run_result is not None
        and resp.run_result.stdout == "k\n"
    )
    with pytest.raises(Exception, match="401"):
        run_code(
            RunCodeRequest(code="print(1)", language="python"), endpoint=keyed_url, max_attempts=1
        )
    with pytest.raises(Exception, match="401"):
        run_code(
            RunCodeRequest(code="print(1)", language="python"),
            endpoint=f"{keyed_url}/k/wrong",
            max_attempts=1,
        )
    r = requests.post(
        f"{keyed_url}/v1/run_code",
        json={"code": "print(3)", "language": "python"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert (
        r.status_code == 200 and r.json()["outcome"] == "ok" and r.json()["run"]["stdout"] == "3\n"
    )
