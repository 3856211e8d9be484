"""inspect_ai (0.3.285, the real package) on dsec: inspect's own sandbox conformance checks
(``inspect_ai.util._sandbox.self_check``) against the ``dsec`` provider, ``inspect eval`` of
examples/inspect_eval (a scripted model, ``mockllm``, calls the ``bash()`` and ``python()``
tools in a dsec sandbox; container and microvm tiers), two named sandboxes per sample, one
built from a Dockerfile, and the connection command, cleanup after an eval left its sandboxes
(``--no-sandbox-cleanup``, then ``inspect sandbox cleanup dsec``), and the cleanup of one
API key never touching another key's sandboxes.

``inspect`` runs as a child process that finds the provider as an installed ``dsec`` does,
through the ``inspect_ai`` entry point group: a ``dsec`` dist-info on its ``PYTHONPATH``
carries the entry points this checkout's pyproject.toml declares (so the test checks the
checkout, also where an older editable install is on the machine)."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from inspect_ai.log import read_eval_log
from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F403  (inspect's checks, collected here)
from tests.conftest import LiveServer
from tests.timing import budget

from dsec import AsyncClient
from dsec.contract.runtime import capabilities_of
from dsec.integrations.inspect import DsecSandboxConfig, DsecSandboxEnvironment

pytestmark = [
    pytest.mark.root,
    pytest.mark.debian,
    pytest.mark.asyncio(loop_scope="module"),
]

ROOT = Path(__file__).resolve().parents[2]
INSPECT = Path(sys.executable).with_name("inspect")
EXAMPLE = ROOT / "examples" / "inspect_eval"

ROOT_WRITES = "root writes a file whatever its mode (as inspect's docker-root)"
SELF_CHECK: dict[str, tuple[DsecSandboxConfig, dict[str, str]]] = {
    # the default image as root, as inspect's docker provider runs by default
    "debian-root": (
        DsecSandboxConfig(image="debian", memory_mb=512),
        {
            "test_write_text_file_without_permissions": ROOT_WRITES,
            "test_write_binary_file_without_permissions": ROOT_WRITES,
        },
    ),
    # a user without rights (permissions hold) on busybox's tools (as inspect's alpine run)
    "busybox-nonroot": (
        DsecSandboxConfig(image="busybox", user="sandbox", workdir="/home/agent", memory_mb=512),
        {"test_exec_as_user": "dsec's busybox image has no adduser"},
    ),
}


@pytest.fixture(scope="module")
def dsec_env(live_server: LiveServer) -> Iterator[LiveServer]:
    """DSEC_URL/DSEC_API_KEY of the test server, for the whole module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_URL", live_server.url)
        mp.setenv("DSEC_API_KEY", live_server.api_key)
        yield live_server


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(SELF_CHECK))
async def _self_check_env(
    request: pytest.FixtureRequest, dsec_env: LiveServer
) -> AsyncIterator[tuple[SandboxEnvironment, dict[str, str]]]:
    """One sandbox per config, shared by every check (they clean up after themselves), made
    and cleaned up through the provider's lifecycle as inspect's own runner does."""
    config, xfails = SELF_CHECK[request.param]
    await DsecSandboxEnvironment.task_init("self_check", config)
    envs = await DsecSandboxEnvironment.sample_init("self_check", config, {})
    try:
        yield envs["default"], xfails
    finally:
        await DsecSandboxEnvironment.sample_cleanup("self_check", config, envs, False)
        await DsecSandboxEnvironment.task_cleanup("self_check", config, True)
    sb = envs["default"].as_type(DsecSandboxEnvironment).sandbox
    assert (await sb.refresh()).state == "stopped"


@pytest.fixture
def sandbox_env(
    request: pytest.FixtureRequest, _self_check_env: tuple[SandboxEnvironment, dict[str, str]]
) -> SandboxEnvironment:
    """What inspect's checks take (``self_check``'s module docstring): known failures are
    strict xfails of the check, per config."""
    env, xfails = _self_check_env
    reason = xfails.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return env


# --- inspect eval (examples/inspect_eval) --------------------------------------------------


def _provider_as_installed(tmp_path: Path) -> Path:
    """A ``dsec`` dist-info with this checkout's ``inspect_ai`` entry points (see the module
    docstring); its directory goes first on the child's ``PYTHONPATH``."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    site = tmp_path / "site"
    info = site / "dsec-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[inspect_ai]\n" + "".join(f"{k} = {v}\n" for k, v in eps["inspect_ai"].items())
    )
    return site


def _child_env(tmp_path: Path, server: LiveServer, key: str | None = None) -> dict[str, str]:
    site = _provider_as_installed(tmp_path)
    return {
        **os.environ,
        "DSEC_URL": server.url,
        "DSEC_API_KEY": key or server.api_key,
        "PYTHONPATH": f"{site}:{ROOT / 'src'}",
        "INSPECT_LOG_DIR": str(tmp_path / "logs"),
        "INSPECT_DISPLAY": "plain",
        "NO_COLOR": "1",
    }


def _inspect(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> Any:
    return subprocess.run(
        [str(INSPECT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=budget(timeout),
    )


def _write_task(tmp_path: Path, tier: str, mark: str) -> None:
    """examples/inspect_eval's task, with its dsec.yaml set to ``tier`` and ``mark``."""
    (tmp_path / "task.py").write_text((EXAMPLE / "task.py").read_text())
    config = yaml.safe_load((EXAMPLE / "dsec.yaml").read_text())
    config["tier"] = tier
    config["env"]["INSPECT_MARK"] = mark
    (tmp_path / "dsec.yaml").write_text(yaml.safe_dump(config))


async def _made_by_eval(client: AsyncClient, since: datetime) -> list[Any]:
    """The sandboxes examples/inspect_eval's task made since ``since``, whatever their
    state (others of the provider, e.g. the self-check's, may be running meanwhile)."""
    found = await client.list_sandboxes(
        labels={"inspect.provider": "dsec", "inspect.task": "tools_in_dsec"},
        include_stopped=True,
    )
    return [s for s in found if s.created_at >= since]


def _tier_or_skip(server: LiveServer, tier: str) -> None:
    if (
        tier not in server.edge.runtimes
        or not capabilities_of(server.edge.runtimes[tier]).available
    ):
        pytest.skip(f"tier {tier} is not available on this node")


@pytest.mark.slow
@pytest.mark.timeout(900)  # a microvm's first sandbox boots the tier's template (QEMU TCG)
@pytest.mark.parametrize("tier", ["container", pytest.param("microvm", marks=pytest.mark.vm)])
async def test_inspect_eval_runs_the_tools_in_dsec(
    tier: str, tmp_path: Path, dsec_env: LiveServer
) -> None:
    _tier_or_skip(dsec_env, tier)
    mark = secrets.token_hex(8)
    _write_task(tmp_path, tier, mark)
    started = datetime.now(UTC)
    r = _inspect(
        ["eval", "task.py", "--log-format", "json"],
        _child_env(tmp_path, dsec_env),
        tmp_path,
        timeout=700 if tier == "microvm" else 300,
    )
    assert r.returncode == 0, f"inspect eval failed:\n{r.stdout}\n{r.stderr}"
    (log_file,) = (tmp_path / "logs").glob("*.json")
    log = read_eval_log(str(log_file))
    assert log.status == "success", log.error
    (sample,) = log.samples or []
    tool_output = {m.function: m.text for m in sample.messages if m.role == "tool"}
    # the commands ran in the sandbox: the environment the config gave it, its kernel
    # (a microvm runs its own), the file one tool wrote read by the other and by the scorer
    bash_words = tool_output["bash"].split()
    assert bash_words[0] == "bash-says" and bash_words[1] == "42" and bash_words[3] == mark
    if tier == "microvm":
        assert bash_words[2] != os.uname().release
    assert tool_output["python"].split() == ["python-says", "42", mark, "found"]
    assert sample.scores is not None and sample.scores["answer_file"].value == "C"
    # one sandbox was made for the sample, on the tier, with the provider's labels; it is gone
    async with AsyncClient() as client:
        made = await _made_by_eval(client, started)
    assert [(s.tier, s.state, s.labels["inspect.sandbox"]) for s in made] == [
        (tier, "stopped", "default")
    ]


@pytest.mark.slow
async def test_cleanup_after_an_eval_left_its_sandboxes_is_per_key(
    tmp_path: Path, dsec_env: LiveServer
) -> None:
    """``--no-sandbox-cleanup`` leaves the sample's sandbox running and says how to clean
    up; ``inspect sandbox cleanup dsec RUN`` with another key kills nothing (that key sees
    none of them), with the eval's key it kills them."""
    _write_task(tmp_path, "container", "left")
    env = _child_env(tmp_path, dsec_env)
    r = _inspect(["eval", "task.py", "--no-sandbox-cleanup"], env, tmp_path, timeout=300)
    assert r.returncode == 0, f"inspect eval failed:\n{r.stdout}\n{r.stderr}"
    hint = re.search(r"inspect sandbox cleanup dsec ([0-9a-f]{16})", r.stdout)
    assert hint is not None, r.stdout
    run_id = hint.group(1)
    async with AsyncClient() as client:
        left = await client.list_sandboxes(labels={"inspect.run": run_id})
        assert [s.labels["inspect.task"] for s in left] == ["tools_in_dsec"]

        other = _child_env(tmp_path, dsec_env, key=dsec_env.keys.create_key("inspect-other"))
        for args in (["sandbox", "cleanup", "dsec", run_id], ["sandbox", "cleanup", "dsec"]):
            r = _inspect(args, other, tmp_path, timeout=120)
            assert r.returncode == 0 and "No dsec sandboxes" in r.stdout, r.stdout + r.stderr
        r = _inspect(["sandbox", "cleanup", "dsec", left[0].id], other, tmp_path, timeout=120)
        assert r.returncode == 0 and f"No sandbox {left[0].id}" in r.stdout, r.stdout + r.stderr
        assert [s.id for s in await client.list_sandboxes(labels={"inspect.run": run_id})] == [
            left[0].id
        ]

        r = _inspect(["sandbox", "cleanup", "dsec", run_id], env, tmp_path, timeout=120)
        assert r.returncode == 0 and left[0].id in r.stdout, r.stdout + r.stderr
        assert await client.list_sandboxes(labels={"inspect.run": run_id}) == []


async def test_named_sandboxes_dockerfile_and_connection(
    tmp_path: Path, dsec_env: LiveServer
) -> None:
    """Two sandboxes per sample (the one marked default first), one built from a Dockerfile
    and its context by dsec; the connection command runs a command in the sandbox."""
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "flag.txt").write_text("flag{dsec}\n")
    (tmp_path / "ctx" / "Dockerfile").write_text(
        "FROM busybox\nCOPY flag.txt /srv/flag.txt\nENV FROM_DOCKERFILE=yes\nWORKDIR /srv\n"
    )
    (tmp_path / "dsec.yaml").write_text(
        yaml.safe_dump(
            {
                "memory_mb": 256,
                "sandboxes": {
                    "attacker": {"image": "busybox", "env": {"ROLE": "attacker"}},
                    "victim": {"dockerfile": "ctx/Dockerfile", "default": True},
                },
            }
        )
    )
    config = str(tmp_path / "dsec.yaml")
    await DsecSandboxEnvironment.task_init("named", config)
    envs = await DsecSandboxEnvironment.sample_init("named", config, {"__sample_id__": "s1"})
    try:
        assert list(envs) == ["victim", "attacker"]
        victim = envs["victim"].as_type(DsecSandboxEnvironment)
        assert victim.sandbox.info.image.startswith("inspect-")
        assert victim.sandbox.info.labels["inspect.sandbox"] == "victim"
        assert victim.sandbox.info.labels["inspect.sample"] == "s1"
        r = await victim.exec(["sh", "-c", "echo $FROM_DOCKERFILE; pwd"])
        assert r.stdout == "yes\n/srv\n"
        assert await victim.read_file("flag.txt") == "flag{dsec}\n"
        r = await envs["attacker"].exec(["sh", "-c", "echo $ROLE"])
        assert r.stdout == "attacker\n"

        connection = await victim.connection()
        argv = shlex.split(connection.command)
        assert argv[0] == "dsec" and argv[-1] == "--" and connection.container == victim.sandbox.id
        r = subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", *argv[1:], "cat", "/srv/flag.txt"],
            env={**_child_env(tmp_path, dsec_env), "PYTHONPATH": str(ROOT / "src")},
            capture_output=True,
            text=True,
            timeout=budget(120),
        )
        assert (r.returncode, r.stdout) == (0, "flag{dsec}\n"), r.stderr
    finally:
        await DsecSandboxEnvironment.sample_cleanup("named", config, envs, True)
        await DsecSandboxEnvironment.task_cleanup("named", config, True)
    for env in envs.values():
        assert (await env.as_type(DsecSandboxEnvironment).sandbox.refresh()).state == "stopped"
    with pytest.raises(ConnectionError):
        await victim.connection()
