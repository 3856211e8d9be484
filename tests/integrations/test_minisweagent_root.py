"""mini-swe-agent (2.x, the real package) on dsec: its agent loop with its deterministic
test model against ``DsecEnvironment``, its ``mini`` CLI, and its own ``DockerEnvironment``
with ``MSWEA_DOCKER_EXECUTABLE`` pointing at ``dsec-docker``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output
from tests.conftest import LiveServer
from tests.timing import budget

from dsec import Sandbox
from dsec.integrations.minisweagent import DsecEnvironment

pytestmark = [pytest.mark.root, pytest.mark.debian]

ENV_CLASS = "dsec.integrations.minisweagent.DsecEnvironment"

# the scripted episode: write a file, look at it (non-zero exit), fix it, submit
EPISODE = [
    (
        "I will create the file.",
        "mkdir -p src && printf 'def add(a, b):\\n    return a - b\\n' > src/calc.py",
    ),
    (
        "Run the check.",
        "python3 -B -c 'import sys; sys.path.insert(0, \"src\"); import calc; assert calc.add(2, 2) == 4'",
    ),
    (
        "Fix the bug.",
        "sed -i 's/a - b/a + b/' src/calc.py && python3 -B -c 'import sys; sys.path.insert(0, \"src\"); import calc; print(calc.add(2, 2))'",
    ),
    ("Submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat src/calc.py"),
]


def _agent_config() -> dict:
    return yaml.safe_load((builtin_config_dir / "default.yaml").read_text())["agent"]


def test_episode_with_deterministic_model(sdk_env: LiveServer) -> None:
    env = get_environment(
        {
            "environment_class": ENV_CLASS,
            "image": "debian",
            "cwd": "/repo",
            "memory_mb": 512,
            "disk_mb": 512,
        }
    )
    assert isinstance(env, DsecEnvironment)
    model = DeterministicModel(outputs=[make_output(t, [{"command": c}]) for t, c in EPISODE])
    agent = DefaultAgent(model, env, **_agent_config())
    try:
        result = agent.run("make add() add")
        assert result["exit_status"] == "Submitted"
        assert result["submission"] == "def add(a, b):\n    return a + b\n"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert len(observations) == 3
        assert "<returncode>0</returncode>" in observations[0]
        assert (
            "<returncode>1</returncode>" in observations[1] and "AssertionError" in observations[1]
        )
        assert "<returncode>0</returncode>" in observations[2] and "\n4\n" in observations[2]
        data = agent.serialize()
        assert data["info"]["config"]["environment_type"] == ENV_CLASS
        assert data["info"]["dsec"]["sandbox_id"] == env.sandbox_id
        json.dumps(data)  # the trajectory is JSON (no credentials in it)
        assert "api_key" not in json.dumps(data["info"]["config"]["environment"])
    finally:
        env.cleanup()
    assert Sandbox.connect(env.sandbox_id).info.state == "stopped"


def test_execute_like_docker_environment(
    sdk_env: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOST_VAR", "from-host")
    env = DsecEnvironment(
        image="debian",
        cwd="/work",
        env={"SET_VAR": "set", "HOST_VAR": "env-wins"},
        forward_env=["HOST_VAR", "UNSET_VAR"],
        timeout=5,
        memory_mb=256,
        disk_mb=256,
    )
    try:
        r = env.execute(
            {"command": "pwd; echo $SET_VAR $HOST_VAR [$UNSET_VAR]; echo err >&2; exit 3"}
        )
        assert r == {
            "output": "/work\nset env-wins []\nerr\n",
            "returncode": 3,
            "exception_info": "",
        }
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        r = env.execute({"command": "echo partial; sleep 10"}, timeout=1)
        assert r["returncode"] == -1 and r["output"] == "partial\n"
        assert r["extra"]["exception_type"] == "TimeoutExpired"
        assert "timed out after 1 seconds" in r["exception_info"]
        assert env.execute({"command": "shopt -q login_shell && echo login"})["output"] == "login\n"
        with pytest.raises(Submitted) as e:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo result"})
        assert e.value.messages[0]["extra"]["submission"] == "result\n"
        # a failing submit command is not a submission
        r = env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false"})
        assert r["returncode"] == 1
        tv = env.get_template_vars(extra="x")
        uname = env.sandbox.commands.run("uname -r").stdout.strip()
        assert tv["system"] == "Linux" and tv["release"] == uname and tv["extra"] == "x"
        assert tv["cwd"] == "/work" and tv["timeout"] == 5
    finally:
        env.cleanup()
        env.cleanup()  # idempotent


def _mini_config(tmp_path: Path, environment: dict) -> Path:
    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
    config["model"] = {
        "model_class": "deterministic",
        "model_name": "deterministic",
        "outputs": [make_output(t, [{"command": c}]) for t, c in EPISODE],
    }
    config["environment"] = {**config.get("environment", {}), **environment}
    config["agent"]["mode"] = "yolo"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run_mini(config: Path, tmp_path: Path, env: dict[str, str]) -> dict:
    out = tmp_path / "traj.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisweagent.run.mini",
            "-c",
            str(config),
            "-t",
            "make add() add",
            "-y",
            "--exit-immediately",
            "-o",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_mini_cli_with_dsec_environment(child_env: dict[str, str], tmp_path: Path) -> None:
    config = _mini_config(
        tmp_path, {"environment_class": ENV_CLASS, "image": "debian", "cwd": "/repo"}
    )
    traj = _run_mini(config, tmp_path, child_env)
    assert traj["info"]["exit_status"] == "Submitted"
    assert traj["info"]["submission"] == "def add(a, b):\n    return a + b\n"
    assert (
        Sandbox.connect(
            traj["info"]["dsec"]["sandbox_id"],
            url=child_env["DSEC_URL"],
            api_key=child_env["DSEC_API_KEY"],
        ).info.state
        == "stopped"
    )


def test_mini_docker_environment_through_dsec_docker(
    child_env: dict[str, str], docker_exe: Path, tmp_path: Path
) -> None:
    """mini's own DockerEnvironment (docker run -d / exec / stop / rm -f), unmodified, with
    MSWEA_DOCKER_EXECUTABLE naming the dsec-docker executable."""
    env = {**child_env, "MSWEA_DOCKER_EXECUTABLE": str(docker_exe)}
    config = _mini_config(
        tmp_path, {"environment_class": "docker", "image": "debian", "cwd": "/repo"}
    )
    traj = _run_mini(config, tmp_path, env)
    assert traj["info"]["exit_status"] == "Submitted"
    assert traj["info"]["submission"] == "def add(a, b):\n    return a + b\n"
    assert traj["info"]["config"]["environment"]["executable"] == str(docker_exe)
    observations = [m["content"] for m in traj["messages"] if m["role"] == "user"][1:]
    assert "<returncode>1</returncode>" in observations[1]
    # the environment's cleanup (docker stop, in the background) ends the container
    names = subprocess.run(
        [str(docker_exe), "ps", "--format", "{{.Names}}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    import time

    deadline = time.monotonic() + budget(60)
    while time.monotonic() < deadline:
        if "minisweagent-" not in names.stdout:
            break
        time.sleep(1)
        names = subprocess.run(
            [str(docker_exe), "ps", "--format", "{{.Names}}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert "minisweagent-" not in names.stdout
