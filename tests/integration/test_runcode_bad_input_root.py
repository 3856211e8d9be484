"""Bad input to ``/run_code`` and ``/v1/run_code`` against real fncall workers (QA findings).

The run_code router runs in this test's event loop (httpx ``ASGITransport``) in front of a real
:class:`RunCodeService`, so each case goes HTTP body -> route -> service -> worker and back.
Client mistakes must come back as 4xx (dsec route) or ``SandboxError`` with a message naming
the field (SandboxFusion route), never as a 500 or a worker's internal exception text.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI

from dsec.apiserver.routes_runcode import make_runcode_router
from dsec.privileged.cgroups import cgroup
from dsec.runtimes.fncall.pool import PoolConfig
from dsec.runtimes.fncall.testkit import fncall_service

pytestmark = [
    pytest.mark.root,
    pytest.mark.debian,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(dsec_home_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    home = dsec_home_root / f"runcode-bad-{secrets.token_hex(3)}"
    async with fncall_service(
        home, pool=PoolConfig(min_ready=1, max_ready=4, memory_mb=512, pids=64)
    ) as svc:
        app = FastAPI()
        app.include_router(make_runcode_router(lambda: svc))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://dsec.test", timeout=120
        ) as c:
            yield c
    prefix = svc.runtime.cgroup_prefix
    assert not cgroup(prefix).exists(), "fncall cgroups leaked"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def as_json(body: dict[str, Any]) -> dict[str, Any]:
    """Request arguments for ``body`` as ASCII JSON (lone surrogates as ``\\udc80`` escapes, as
    a Python client's ``json.dumps`` sends them)."""
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


async def sandboxfusion(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post("/run_code", **as_json(body))
    assert r.status_code == 200, r.text[:500]
    answer: dict[str, Any] = r.json()
    return answer


async def native(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/run_code", **as_json(body))


# (case, body fields, text the message must contain, dsec status)
BAD_INPUT = [
    ("file and dir", {"files": {"a": b64(b"x"), "a/b": b64(b"y")}}, "needs 'a' to be a dir", 400),
    ("long name", {"files": {"a" * 300: b64(b"x")}}, "component of 300 bytes", 400),
    ("surrogate fetch", {"fetch_files": ["\udc80"]}, "fetch_files[0]", 400),
    ("bad base64", {"files": {"a": "!!!notb64"}}, "files['a'] is not valid base64", 400),
    ("run timeout", {"run_timeout": 301, "timeout_s": 301}, "run timeout", 400),
]


@pytest.mark.parametrize(
    ("case", "fields", "says", "status"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT]
)
async def test_bad_input_is_named_and_never_500(
    client: httpx.AsyncClient, case: str, fields: dict[str, Any], says: str, status: int
) -> None:
    sf_fields = {k: v for k, v in fields.items() if k != "timeout_s"}
    resp = await sandboxfusion(client, {"code": "print(1)", "language": "python", **sf_fields})
    assert resp["status"] == "SandboxError" and says in resp["message"], resp
    assert "worker" not in resp["message"] and "Error:" not in resp["message"], resp
    dsec_fields = {k: v for k, v in fields.items() if k != "run_timeout"}
    r = await native(client, {"code": "print(1)", "language": "python", **dsec_fields})
    assert r.status_code == status and says in r.json()["error"]["message"], r.text[:500]


async def test_env_too_big_for_execve_is_413(client: httpx.AsyncClient) -> None:
    r = await native(
        client, {"code": "int main(){return 0;}", "language": "c", "env": {"A": "x" * (200 << 10)}}
    )
    assert r.status_code == 413 and "env['A']" in r.json()["error"]["message"], r.text[:500]


async def test_a_foreign_path_does_not_stop_the_compiler(client: httpx.AsyncClient) -> None:
    """argv[0] of the compiler is absolute: gcc starts and reports what it cannot find."""
    r = await native(
        client, {"code": "int main(){return 0;}", "language": "c", "env": {"PATH": "/nonexistent"}}
    )
    assert r.status_code == 200, r.text[:500]
    assert r.json()["outcome"] == "compile_error" and "gcc" in r.json()["compile"]["stderr"]


async def test_deeply_nested_body_is_400(client: httpx.AsyncClient) -> None:
    deep = b'{"code":"x","language":"python","files":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/run_code", "/v1/run_code"):
        r = await client.post(path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


async def test_payload_over_the_memory_limit_is_the_callers(client: httpx.AsyncClient) -> None:
    """A worker killed by the call's own memory limit while reading the call: 400, not 500."""
    files = {"big": b64(b"x" * (40 << 20))}
    resp = await sandboxfusion(
        client, {"code": "print(1)", "language": "python", "memory_limit_MB": 16, "files": files}
    )
    # refused up front (the files do not fit the /work the memory limit leaves) or killed by
    # the limit while reading the call: the caller's, either way
    caller = ("memory limit", "/work holds")
    assert resp["status"] == "SandboxError" and any(c in resp["message"] for c in caller), resp
    # 16 MiB: killed while reading the call; 64 MiB: while writing the files to /work (tmpfs
    # pages count against the limit), before it could report
    for memory_mb in (16, 64):
        r = await native(
            client,
            {"code": "print(1)", "language": "python", "memory_mb": memory_mb, "files": files},
        )
        assert r.status_code in (400, 413), r.text[:500]  # killed by it, or refused up front
        message = r.json()["error"]["message"]
        assert f"memory limit ({memory_mb} MiB)" in message or "/work holds" in message, message


async def test_bash_honours_env(client: httpx.AsyncClient) -> None:
    env = {"FOO": "bar", "PATH": "/opt/x:/usr/bin"}
    r = await native(client, {"code": "echo $FOO $PATH", "language": "bash", "env": env})
    assert r.status_code == 200 and r.json()["run"]["stdout"] == "bar /opt/x:/usr/bin\n", r.text
    r = await native(client, {"code": "echo ${FOO-unset}", "language": "bash"})
    assert r.status_code == 200 and r.json()["run"]["stdout"] == "unset\n", r.text


async def test_base64_with_line_breaks(client: httpx.AsyncClient) -> None:
    data = b"0123456789" * 20
    resp = await sandboxfusion(
        client,
        {
            "code": "print(len(open('a','rb').read()))",
            "language": "python",
            "files": {"a": base64.encodebytes(data).decode()},
        },
    )
    assert resp["status"] == "Success" and resp["run_result"]["stdout"] == "200\n", resp


async def test_time_limit_has_no_return_code(client: httpx.AsyncClient) -> None:
    resp = await sandboxfusion(
        client,
        {
            "code": "print('a', flush=True)\nwhile True: pass",
            "language": "python",
            "run_timeout": 0.5,
        },
    )
    run = resp["run_result"]
    assert resp["status"] == "Failed" and run["status"] == "TimeLimitExceeded", resp
    assert run["return_code"] is None and run["stdout"] == "a\n", resp


async def test_fetch_every_spelling_and_symlink_reasons(client: httpx.AsyncClient) -> None:
    code = (
        "import os\n"
        "open('o','w').write('O')\n"
        "os.symlink('/work/o', 'abs')\n"
        "os.symlink('/etc/passwd', 'out')\n"
        "os.symlink('o', 'rel')\n"
    )
    names = ["o", "/work/o", "./o", "abs", "out", "rel", "missing"]
    resp = await sandboxfusion(client, {"code": code, "language": "python", "fetch_files": names})
    assert resp["status"] == "Success", resp
    assert {k: base64.b64decode(v) for k, v in resp["files"].items()} == {
        "o": b"O",
        "/work/o": b"O",
        "./o": b"O",
        "rel": b"O",
    }
    assert "fetch abs: not followed: the path goes through an absolute symlink" in resp["message"]
    assert "fetch out: not followed" in resp["message"]
    assert "cross-device" not in resp["message"]
    assert "fetch missing: No such file or directory" in resp["message"]


async def test_compile_timeout_ignored_without_a_compile_step(client: httpx.AsyncClient) -> None:
    resp = await sandboxfusion(
        client, {"code": "print(1)", "language": "python", "compile_timeout": 0}
    )
    assert resp["status"] == "Success", resp


async def test_a_worker_that_never_answers_is_a_retryable_503(
    dsec_home_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the call's own time limits and the grace, a worker that has not answered (stuck,
    or starved by a saturated node) is the node's failure: 503 node_busy with a retry time,
    not a 500; the worker is killed and the next call runs."""
    import asyncio

    from dsec.runtimes.fncall.pool import Worker

    home = dsec_home_root / f"runcode-stuck-{secrets.token_hex(3)}"
    async with fncall_service(
        home, pool=PoolConfig(min_ready=1, max_ready=2, memory_mb=256, pids=64)
    ) as svc:
        svc.limits.grace_s = 0.5
        app = FastAPI()
        app.include_router(make_runcode_router(lambda: svc))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://dsec.test", timeout=120
        ) as c:
            answer = Worker.receive

            async def never(self: Worker) -> Any:
                await asyncio.sleep(3600)

            monkeypatch.setattr(Worker, "receive", never)
            body = {"code": "print(1)", "language": "python", "timeout_s": 1}
            r = await c.post("/v1/run_code", json=body)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "node_busy" and err["details"]["retry_after_s"] == 1, err
            monkeypatch.setattr(Worker, "receive", answer)
            r = await c.post("/v1/run_code", json=body)
            assert r.status_code == 200 and r.json()["run"]["stdout"] == "1\n", r.text
