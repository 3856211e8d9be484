"""verifiers (Prime Intellect's RL environments, 0.4.0) running its docker runtime,
unmodified, against a real ``dsec serve``: ``docker`` on its ``PATH`` is ``dsec-docker``.

verifiers 0.4 pins ``prime-sandboxes``, which needs ``connectrpc<0.12``, while dsec's
server extra pins ``e2b==2.63.0``, which needs ``connectrpc>=0.12.1``: the two cannot share
a venv, so verifiers lives in one of its own (``.venv-verifiers`` at the repository root,
made by ``scripts/bootstrap.sh``; or ``DSEC_VERIFIERS_PYTHON``), and the runtime is driven
by ``verifiers_checks.py`` with that Python as a subprocess. It only talks to ``docker``.

What it shows (``verifiers_checks.py``): ``DockerRuntime.start()`` runs ``docker version``,
``docker run --network bridge --publish 127.0.0.1::8000 --cpus --memory --entrypoint sleep
... IMAGE infinity``, ``docker inspect --format '{{json .Config}}'``, ``docker exec --user
0 ... sh -c 'mkdir -p ... && chown ...'`` and ``docker port NAME 8000/tcp``, all served;
its last step, the callback listener made inside the container's network namespace by a
helper container (``--network container:NAME --volume DIR:/run/vf --cap-drop ALL ...``)
and handed back over a unix socket, cannot be served by a remote engine and fails with
dsec's refusal (docs/integrations.md says why). Everything else of the runtime then works:
``run`` (environment, working directory, exit codes, stderr), ``write``/``read``,
``run_background`` of a server on the service port reached at the URL ``expose(8000)``
gives (``-p`` through dsec's port proxy), ``alive``, ``stop`` (the container and its host
port gone), and ``DockerRuntime.attach`` to a container made with ``docker run -d``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import LiveServer
from tests.side_venv import side_venv_python
from tests.timing import budget

from dsec import Sandbox

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("verifiers_checks.py")


def verifiers_python() -> Path:
    """The Python of the verifiers venv, or a skip saying why there is none."""
    return side_venv_python(
        ".venv-verifiers", "DSEC_VERIFIERS_PYTHON", "verifiers.v1.runtimes.docker"
    )


@pytest.fixture
def docker_env(docker_exe: Path, child_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """verifiers' environment: ``docker`` first on ``PATH`` is dsec-docker (a symlink, as
    a user would make one), the test server's URL and key, forwarder state of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").symlink_to(docker_exe)
    return {
        **child_env,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "DSEC_DOCKER_STATE": str(tmp_path / "state"),
        "VF_RUN_ID": f"dsec-test-{uuid.uuid4().hex[:8]}",
    }


def docker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, env=env, timeout=budget(120)
    )


def closed(url: str) -> bool:
    host, _, port = url.removeprefix("http://").partition(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_verifiers_docker_runtime(docker_env: dict[str, str], sdk_env: LiveServer) -> None:
    python = verifiers_python()
    name = f"borrowed-{uuid.uuid4().hex[:8]}"
    r = docker(
        docker_env,
        "run",
        "-d",
        "--name",
        name,
        "-w",
        "/work",
        "-e",
        "GIVEN=yes",
        "debian",
        "sleep",
        "infinity",
    )
    assert r.returncode == 0, r.stderr
    try:
        p = subprocess.run(
            [str(python), str(CHECKS), "debian", name, str(budget(30))],
            capture_output=True,
            text=True,
            env=docker_env,
            timeout=budget(600),
        )
        assert p.returncode == 0, p.stderr[-3000:]
        report: dict[str, Any] = json.loads(p.stdout)
        owned, borrowed = report["owned"], report["borrowed"]
        # start(): every step served until the helper container a remote engine cannot run
        assert owned["start"].startswith(
            "docker proxy listener failed: docker: unsupported flag: --volume"
        )
        assert owned["id"].startswith("sb-")
        assert owned["service_url"].startswith("http://127.0.0.1:")
        assert owned["run"] == [0, "bar\n/app\n0\n", ""]
        assert owned["run_failing"] == [3, "", "oops\n"]
        assert owned["read_back"] and owned["served"] and owned["alive"]
        # stop(): the container is gone (docker rm --force), and its host port with it
        assert closed(owned["service_url"])
        mine = Sandbox.list(labels={"docker.name": owned["container"]}, include_stopped=True)
        assert [s.state for s in mine] == ["stopped"]
        assert mine[0].labels["verifiers.run"] == docker_env["VF_RUN_ID"]
        assert mine[0].network is not None  # --network bridge: dsec's open network
        # attach(): a borrowed container, its config from docker inspect, left running
        assert borrowed["image"] == "debian" and borrowed["workdir"] == "/work"
        assert borrowed["image_env"] == {"GIVEN": "yes"}
        assert borrowed["run"] == [0, "yes x\n/work\n"] and borrowed["read"] == "borrowed\n"
        assert docker(docker_env, "inspect", "-f", "{{.State.Running}}", name).stdout == "true\n"
    finally:
        docker(docker_env, "rm", "-f", name)
