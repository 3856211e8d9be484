"""openai-agents' E2B sandboxes (``openai-agents[e2b]``, unmodified) on a real ``dsec serve``
with a plain dsec key.

openai-agents pins e2b 2.31, whose client refuses any ``E2B_API_KEY`` not shaped
``e2b_<hex>`` before it sends a request ("Invalid API key format"); the server's e2b 2.63
excludes it, so it lives in a venv of its own, ``.venv-openai-agents``
(``scripts/bootstrap.sh``; ``DSEC_OPENAI_AGENTS_PYTHON`` names another). The key is one
``dsec key create`` made, given in its E2B form (``dsec key e2b``): the same key to the
server. Another key's E2B form reaches nothing of the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import container_server
from tests.isolation import worker_subnet
from tests.side_venv import side_venv_python
from tests.timing import budget

from dsec.apiserver.auth import e2b_form, owner_id
from dsec.models import SandboxRef
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = worker_subnet(248)
PROBE = Path(__file__).with_name("openai_agents_probe.py")


def agents_python() -> Path:
    """The Python of the openai-agents venv, or a skip saying why there is none."""
    return side_venv_python(
        ".venv-openai-agents", "DSEC_OPENAI_AGENTS_PYTHON", "agents.extensions.sandbox.e2b"
    )


@pytest.fixture(scope="module")
def server(dsec_home_root: Path, shared_layers: Path) -> Iterator[BackgroundServer]:
    home = dsec_home_root / "openai-agents"
    options = {"network_options": {"subnet": SUBNET}}
    with container_server(home, shared_layers, "e2b-base", **options) as bg:
        yield bg


def _run(python: Path, server: BackgroundServer, key: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "E2B_API_URL": f"{server.url}/e2b",
        "E2B_SANDBOX_URL": f"{server.url}/e2b/envd",
        "E2B_API_KEY": key,
    }
    return subprocess.run(
        [str(python), str(PROBE), "base"],
        capture_output=True,
        text=True,
        env=env,
        timeout=budget(300),
    )


def test_openai_agents_e2b_sandbox_with_a_plain_dsec_key(server: BackgroundServer) -> None:
    python = agents_python()
    key = server.keys.create_key("openai-agents")  # what `dsec key create` makes
    assert key.startswith("dsec_")
    # as it is, e2b 2.31 refuses it before any request
    refused = _run(python, server, key)
    assert refused.returncode != 0 and "Invalid API key format" in refused.stderr
    shown = subprocess.run(  # `dsec key e2b -`: the key read from stdin, never an argument
        [sys.executable, "-m", "dsec.cli.main", "key", "e2b", "-"],
        input=key,
        capture_output=True,
        text=True,
        timeout=budget(60),
    )
    form = shown.stdout.strip()
    assert shown.returncode == 0 and form == e2b_form(key), shown.stderr
    done = _run(python, server, form)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["exec"] == {"stdout": "user\n/home/user/workspace\n42\n", "exit_code": 0}
    assert seen["read"] == "from openai-agents\n"
    assert seen["failed_exit_code"] == 3 and seen["running"] is True
    # the sandbox was the key's: made by its owner, gone after the session
    sid = seen["sandbox_id"]
    info = server.call(server.edge.get_sandbox(SandboxRef(sandbox_id=sid), owner_id(key)))  # type: ignore[union-attr]
    assert info.state == "stopped"


def test_another_keys_e2b_form_reaches_nothing(server: BackgroundServer) -> None:
    import httpx
    from e2b.exceptions import SandboxNotFoundException

    from e2b import Sandbox

    key, other = server.keys.create_key("mine"), server.keys.create_key("theirs")
    env = {"api_url": f"{server.url}/e2b", "sandbox_url": f"{server.url}/e2b/envd"}
    sbx = Sandbox.create("base", api_key=e2b_form(key), timeout=300, **env)
    try:
        assert sbx.commands.run("id -un").stdout == "user\n"
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=e2b_form(other), **env)
        assert not Sandbox.kill(sbx.sandbox_id, api_key=e2b_form(other), **env)
        r = httpx.get(
            f"{server.url}/v1/sandboxes/{sbx.sandbox_id}",
            headers={"authorization": f"Bearer {e2b_form(other)}"},
        )
        assert r.status_code == 404
        r = httpx.get(
            f"{server.url}/v1/sandboxes/{sbx.sandbox_id}",
            headers={"authorization": f"Bearer {e2b_form(key)}"},
        )
        assert r.status_code == 200 and r.json()["id"] == sbx.sandbox_id
    finally:
        sbx.kill()
