"""Code-interpreter tests: the server as a subprocess on a loopback port, driven by the
unmodified e2b-code-interpreter client.

The server runs under Debian's ``/usr/bin/python3`` with Debian's ipykernel, jupyter_client
and tornado (``scripts/bootstrap.sh`` installs them): the very stack of the
``code-interpreter`` image. The client finds it the way a user points the E2B SDK at a
self-hosted deployment: ``E2B_API_URL`` names a control plane (here a small fake that
records what it is asked, see :class:`FakeControlPlane`) and ``E2B_SANDBOX_URL`` the
sandbox's traffic endpoint, which e2b-code-interpreter uses for port 49999 as well (it
adds the ``E2b-Sandbox-Port: 49999`` header).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tests.conftest import free_port

from dsec.guest import codeinterp

SYSTEM_PYTHON = "/usr/bin/python3"
API_KEY = "e2b_codeinterp_test_key"


def _system_python_ready() -> str | None:
    """None if /usr/bin/python3 has the server's Debian packages, else why not."""
    if not os.path.exists(SYSTEM_PYTHON):
        return f"{SYSTEM_PYTHON} is missing"
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import ipykernel, jupyter_client, tornado, matplotlib"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if probe.returncode != 0:
        return (
            "Debian's python3-ipykernel, python3-jupyter-client, python3-tornado and "
            "python3-matplotlib are needed (scripts/bootstrap.sh installs them): "
            + probe.stderr.strip().splitlines()[-1]
        )
    return None


@dataclass
class CodeInterpreterServer:
    """A running ``python3 -m dsec_codeinterp``: its URL, process and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    home: Path
    scratch: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def kernel_pids(server_pid: int) -> list[int]:
    """Pids of the processes whose parent is ``server_pid`` (its kernels)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid:
            out.append(int(entry.name))
    return out


@contextlib.contextmanager
def run_server(tmp: Path, *extra: str) -> Iterator[CodeInterpreterServer]:
    """Install the server into ``tmp/site`` and run it on a free loopback port."""
    why = _system_python_ready()
    if why:
        pytest.skip(why)
    site = tmp / "site"
    codeinterp.install_into(site)
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    scratch = tmp / "scratch"  # the server's TMPDIR: empty again once it stopped
    scratch.mkdir(exist_ok=True)
    port = free_port()
    log = tmp / "server.log"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PYTHONPATH": str(site),
        "LANG": "C.UTF-8",
        "DSEC_CI_MARKER": "from-the-server-env",
        "TMPDIR": str(scratch),
    }
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                SYSTEM_PYTHON,
                "-m",
                codeinterp.PACKAGE_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--cwd",
                str(home),
                *extra,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=tmp,
        )
    url = f"http://127.0.0.1:{port}"
    server = CodeInterpreterServer(url=url, proc=proc, log=log, home=home, scratch=scratch)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{server.log_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not get ready:\n{server.log_text()}")
            time.sleep(0.1)
        yield server
    finally:
        kernels = kernel_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for pid in kernels:  # none should survive the server; never leave any behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class FakeControlPlane:
    """E2B's control-plane routes the SDK needs for create/kill, recording each request."""

    url: str = ""
    requests: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    sandboxes: set[str] = field(default_factory=set)

    def app(self) -> Starlette:
        async def create(request: Request) -> Response:
            body = await request.json()
            self.requests.append(("POST", "/v2/sandboxes", body))
            if request.headers.get("x-api-key") != API_KEY:
                return JSONResponse({"code": 401, "message": "bad key"}, status_code=401)
            sandbox_id = "ci" + uuid.uuid4().hex[:18]
            self.sandboxes.add(sandbox_id)
            return JSONResponse(
                {
                    "templateID": body.get("templateID", ""),
                    "sandboxID": sandbox_id,
                    "clientID": "dsec",
                    "envdVersion": "0.6.3",
                    "envdAccessToken": "envd-token-" + sandbox_id,
                    "trafficAccessToken": "traffic-token-" + sandbox_id,
                    "domain": "dsec.invalid",
                },
                status_code=201,
            )

        async def kill(request: Request) -> Response:
            sandbox_id = request.path_params["sandbox_id"]
            self.requests.append(("DELETE", f"/sandboxes/{sandbox_id}", {}))
            if sandbox_id not in self.sandboxes:
                return JSONResponse({"code": 404, "message": "not found"}, status_code=404)
            self.sandboxes.discard(sandbox_id)
            return Response(status_code=204)

        return Starlette(
            routes=[
                Route("/v2/sandboxes", create, methods=["POST"]),
                Route("/sandboxes/{sandbox_id}", kill, methods=["DELETE"]),
            ]
        )


@contextlib.contextmanager
def serve_control_plane() -> Iterator[FakeControlPlane]:
    plane = FakeControlPlane()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            plane.app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the fake control plane did not start")
        time.sleep(0.01)
    plane.url = f"http://127.0.0.1:{port}"
    try:
        yield plane
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def ci_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CodeInterpreterServer]:
    with run_server(
        tmp_path_factory.mktemp("codeinterp"),
        "--max-output-bytes",
        str(1 << 20),
        "--interrupt-grace",
        "2",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def e2b_env(ci_server: CodeInterpreterServer) -> Iterator[FakeControlPlane]:
    """E2B_* pointing the unmodified SDK at the fake control plane and the server."""
    with serve_control_plane() as plane:
        env = {"E2B_API_URL": plane.url, "E2B_SANDBOX_URL": ci_server.url, "E2B_API_KEY": API_KEY}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield plane
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def sandbox(e2b_env: FakeControlPlane) -> Iterator[Any]:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create()
    try:
        yield sbx
    finally:
        sbx.kill()
