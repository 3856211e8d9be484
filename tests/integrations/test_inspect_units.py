"""The inspect_ai provider without a node: its config model, how the package declares it,
and its whole lifecycle, exec and files against ``dsec.testing.FakeEdge`` (the real edge
and apiserver over in-memory sandboxes, reached through ``transport_factory``). No root.
The real thing (inspect's own checks, ``inspect eval``, two keys): test_inspect_root.py."""

from __future__ import annotations

import errno
import json
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inspect_ai.util import (
    OutputLimitExceededError,
    SandboxEnvironmentSpec,
    SandboxUnavailableError,
)
from inspect_ai.util._sandbox.lifecycle import sandbox_lifecycle_scope
from inspect_ai.util._sandbox.limits import (
    override_max_exec_output_size,
    override_max_read_file_size,
)
from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

from dsec import AsyncSandbox
from dsec.errors import InvalidRequest, SandboxStopped
from dsec.integrations.inspect import DsecSandboxConfig, DsecSandboxEnvironment, _lifecycle
from dsec.integrations.inspect._config import load_config
from dsec.integrations.inspect._lifecycle import current_run
from dsec.testing import FakeEdge, app_transport

ROOT = Path(__file__).resolve().parents[2]
ID = ["/bin/sh", "-c", "id -u; id -G"]


def test_the_package_declares_the_provider() -> None:
    """``pip install dsec`` registers the entry point inspect loads providers from; the
    module it names registers ``dsec`` (what ``sandbox="dsec"`` finds)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["inspect_ai"] == {"dsec": "dsec.integrations.inspect"}
    assert any(
        r.startswith("inspect_ai==") for r in project["optional-dependencies"]["integrations"]
    )
    assert registry_find_sandboxenv("dsec") is DsecSandboxEnvironment
    assert DsecSandboxEnvironment.config_files() == ["dsec.yaml", "dsec.yml", "dsec.json"]
    assert not DsecSandboxEnvironment.is_docker_compatible()


def test_config_named_sandboxes_inherit_and_default_comes_first() -> None:
    cfg = DsecSandboxConfig(
        tier="microvm",
        memory_mb=2048,
        dockerfile="/task/Dockerfile",
        sandboxes={
            "helper": {"image": "busybox"},
            "target": {"default": True, "cpu": 2},
        },
    )
    specs = cfg.specs()
    assert list(specs) == ["target", "helper"]
    assert specs["target"].dockerfile == "/task/Dockerfile" and specs["target"].cpu == 2
    assert specs["helper"].image == "busybox" and specs["helper"].dockerfile is None
    assert {s.tier for s in specs.values()} == {"microvm"}
    assert {s.memory_mb for s in specs.values()} == {2048}
    assert list(DsecSandboxConfig().specs()) == ["default"]
    assert list(DsecSandboxConfig(sandboxes={"a": {}, "default": {}}).specs()) == ["default", "a"]
    with pytest.raises(ValueError, match="no default"):
        DsecSandboxConfig(sandboxes={"a": {}, "b": {}}).specs()
    with pytest.raises(ValueError, match="more than one"):
        DsecSandboxConfig(sandboxes={"a": {"default": True}, "b": {"default": True}}).specs()
    with pytest.raises(ValueError, match="not both"):
        DsecSandboxConfig(image="debian", dockerfile="Dockerfile")
    with pytest.raises(ValueError, match="extra"):
        DsecSandboxConfig.model_validate({"api_key": "secret"})  # keys never in a config


def test_config_files_and_round_trip(tmp_path: Path) -> None:
    """YAML, JSON and a Dockerfile as the config; relative paths relative to the file; the
    object survives the eval log (``config_deserialize``) and is hashable (inspect keeps
    specs in sets)."""
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "Dockerfile").write_text("FROM busybox\n")
    (tmp_path / "dsec.yaml").write_text(
        "tier: container\nsandboxes:\n  default: {dockerfile: env/Dockerfile}\n"
        "  db: {image: 'postgres:16', network: {presets: [debian]}}\n"
    )
    cfg = load_config(str(tmp_path / "dsec.yaml"))
    assert cfg.sandboxes["default"].dockerfile == str(tmp_path / "env" / "Dockerfile")
    assert cfg.specs()["default"].build_context() == str(tmp_path / "env")
    assert cfg.sandboxes["db"].network is not None
    assert cfg.sandboxes["db"].network.presets == ["debian"]

    (tmp_path / "c.json").write_text(json.dumps({"image": "python:3.12", "cpu": 0.5}))
    assert load_config(str(tmp_path / "c.json")).specs()["default"].cpu == 0.5
    assert load_config(str(tmp_path / "env" / "Dockerfile")).dockerfile == str(
        tmp_path / "env" / "Dockerfile"
    )
    (tmp_path / "bad.yaml").write_text("memroy_mb: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match=r"expected a \.yaml"):
        load_config(str(tmp_path / "env"))

    again = DsecSandboxEnvironment.config_deserialize(json.loads(cfg.model_dump_json()))
    assert again == cfg and hash(again) == hash(cfg)
    spec = SandboxEnvironmentSpec.model_validate(
        json.loads(SandboxEnvironmentSpec("dsec", cfg).model_dump_json())
    )
    assert spec.config == cfg


@pytest.fixture
def edge(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeEdge]:
    """A fake node the provider's clients talk to (``DSEC_URL``/``DSEC_API_KEY`` as set)."""
    edge = FakeEdge(available_tiers=("container", "microvm"))
    transport, key = app_transport(edge)
    monkeypatch.setenv("DSEC_URL", "http://fake")
    monkeypatch.setenv("DSEC_API_KEY", key)
    monkeypatch.setattr(_lifecycle, "transport_factory", lambda: transport)
    yield edge


def _created(edge: FakeEdge) -> list[Any]:
    return [c["req"] for c in edge.calls_to("create_sandbox")]


async def test_lifecycle_labels_cleanup_and_interruption(edge: FakeEdge) -> None:
    cfg = DsecSandboxConfig(
        image="busybox",
        env={"A": "1"},
        ttl_s=600,
        sandboxes={
            "default": {"workdir": "/work", "network": {"allow_domains": ["pypi.org"]}},
            "db": {"tier": "microvm", "memory_mb": 256, "labels": {"team": "x"}},
        },
    )
    await DsecSandboxEnvironment.task_init("t", cfg)
    run = current_run()
    envs = await DsecSandboxEnvironment.sample_init("t", cfg, {"__sample_id__": "7"})
    assert list(envs) == ["default", "db"]
    reqs = {r.labels["inspect.sandbox"]: r for r in _created(edge)}
    assert reqs["default"].tier == "container" and reqs["db"].tier == "microvm"
    assert reqs["default"].workdir == "/work" and reqs["default"].network is not None
    assert reqs["db"].memory_mb == 256 and reqs["db"].env == {"A": "1"} and reqs["db"].ttl_s == 600
    for name, req in reqs.items():
        assert {k: v for k, v in req.labels.items() if k.startswith("inspect.")} == {
            "inspect.provider": "dsec",
            "inspect.run": run.id,
            "inspect.task": "t",
            "inspect.sample": "7",
            "inspect.sandbox": name,
        }
    assert reqs["db"].labels["team"] == "x"
    default = envs["default"].as_type(DsecSandboxEnvironment)
    assert default.sandbox.id in run.live

    # an interrupted sample's sandboxes die with it, not at the end of the task
    await DsecSandboxEnvironment.sample_cleanup("t", cfg, envs, True)
    states = {s.labels["inspect.sandbox"]: s.state for s in edge.sandboxes.values()}
    assert states == {"default": "stopped", "db": "stopped"} and run.live == {}

    # what a creation left without an answer is found by the run's label at task end;
    # another run's sandbox and one inspect did not make are left alone
    client = _lifecycle.client_for(None)
    lost = await AsyncSandbox.create(image="busybox", labels=run.labels(), client=client)
    other_run = await AsyncSandbox.create(
        image="busybox",
        labels={"inspect.provider": "dsec", "inspect.run": "another"},
        client=client,
    )
    mine = await AsyncSandbox.create(image="busybox", client=client)
    await DsecSandboxEnvironment.task_cleanup("t", cfg, True)
    states = {i: s.state for i, s in edge.sandboxes.items()}
    assert states[lost.id] == "stopped"
    assert states[other_run.id] == states[mine.id] == "running"

    # inspect sandbox cleanup dsec: every sandbox of the provider, not the key's others
    await DsecSandboxEnvironment.cli_cleanup(None)
    states = {i: s.state for i, s in edge.sandboxes.items()}
    assert states[other_run.id] == "stopped" and states[mine.id] == "running"
    await DsecSandboxEnvironment.cli_cleanup(mine.id)  # not inspect's: refused
    assert edge.sandboxes[mine.id].state == "running"


async def test_a_failed_creation_kills_the_sample_s_others(edge: FakeEdge) -> None:
    cfg = DsecSandboxConfig(sandboxes={"default": {"image": "busybox"}, "b": {"image": "nope"}})
    with sandbox_lifecycle_scope():  # as inspect's eval runs it
        with pytest.raises(Exception, match="nope"):
            await DsecSandboxEnvironment.sample_init("t", cfg, {})
        assert [s.state for s in edge.sandboxes.values()] == ["stopped"]
        assert current_run().live == {}


async def test_task_init_refuses_a_tier_the_server_lacks(edge: FakeEdge) -> None:
    with pytest.raises(RuntimeError, match="tier vm is not available at http://fake"):
        await DsecSandboxEnvironment.task_init("t", DsecSandboxConfig(tier="vm"))


@pytest.fixture
async def env(edge: FakeEdge) -> DsecSandboxEnvironment:
    envs = await DsecSandboxEnvironment.sample_init(
        "t", DsecSandboxConfig(image="busybox", workdir="/work"), {}
    )
    return envs["default"].as_type(DsecSandboxEnvironment)


async def test_exec_maps_results_as_inspect_s_providers(
    edge: FakeEdge, env: DsecSandboxEnvironment
) -> None:
    r = await env.exec(["echo", "hi"], cwd="sub", env={"K": "v"}, user="1000", timeout=5)
    assert (r.success, r.returncode, r.stdout) == (True, 0, "hi\n")
    req = edge.calls_to("exec")[-1]["req"]
    assert (req.cwd, req.env, req.user, req.timeout_s) == ("/work/sub", {"K": "v"}, "1000", 5)
    assert (await env.exec(["cat"], input=b"\x00\xff")).stdout == "\x00\ufffd"

    edge.program(["sh", "-c", "kill -TERM $$"], exit_code=None, signal=15)
    assert (await env.exec(["sh", "-c", "kill -TERM $$"])).returncode == 143

    edge.program(["sleep", "9"], stdout="so far\n", exit_code=None, signal=9, timed_out=True)
    with pytest.raises(TimeoutError) as timed_out:
        await env.exec(["sleep", "9"], timeout=1)
    assert getattr(timed_out.value, "truncated_output", None) == "so far\n"

    edge.program(["/etc/passwd"], stderr="dsec: /etc/passwd: Permission denied\n", exit_code=126)
    with pytest.raises(PermissionError):
        await env.exec(["/etc/passwd"])
    edge.program(["./own.sh"], stderr="./own.sh: Permission denied\n", exit_code=126)
    assert (await env.exec(["./own.sh"])).returncode == 126  # the command's own 126

    edge.program(["yes"], stdout="y" * 10, stdout_truncated=True)
    with override_max_exec_output_size(10), pytest.raises(OutputLimitExceededError) as big:
        await env.exec(["yes"])
    assert big.value.truncated_output == "y" * 10
    assert edge.calls_to("exec")[-1]["req"].max_output_bytes == 10

    edge.inject_error("exec", InvalidRequest("unknown user 'bob'", user="bob"))
    r = await env.exec(["whoami"], user="bob")
    assert r.returncode == 126 and "bob" in r.stderr
    edge.inject_error("exec", SandboxStopped("sandbox is stopped"))
    with pytest.raises(SandboxUnavailableError):
        await env.exec(["true"])


async def test_exec_stages_what_one_request_cannot_carry(
    edge: FakeEdge, env: DsecSandboxEnvironment
) -> None:
    """Over 1 MiB of arguments: a script under /tmp that /bin/sh runs, removed afterwards."""
    big = ["printf", "%s", *(["x" * 65536] * 16)]
    await env.exec(big)
    argv = edge.calls_to("exec")[-1]["req"].cmd
    assert argv[0] == "/bin/sh" and argv[1].startswith("/tmp/.dsec-inspect-")
    written = [c for c in edge.calls_to("write_file") if c["path"] == argv[1]]
    assert written and written[0]["data"].decode().startswith("exec printf %s xxx")
    assert not await env.sandbox.files.exists(argv[1])


async def test_files_as_inspect_s_providers(edge: FakeEdge, env: DsecSandboxEnvironment) -> None:
    await env.write_file("d/a.txt", "line\r\n")
    assert await env.sandbox.files.read("/work/d/a.txt") == b"line\r\n"
    assert await env.read_file("d/a.txt") == "line\r\n"
    await env.write_file("/bin.dat", b"\xc3\x28")
    assert await env.read_file("/bin.dat", text=False) == b"\xc3\x28"
    with pytest.raises(UnicodeDecodeError):
        await env.read_file("/bin.dat")
    with pytest.raises(FileNotFoundError) as missing:
        await env.read_file("nope")
    assert "nope" in str(missing.value)
    with pytest.raises(IsADirectoryError):
        await env.read_file("d")
    with pytest.raises(IsADirectoryError):
        await env.write_file("d", "x")
    with override_max_read_file_size(3), pytest.raises(OutputLimitExceededError):
        await env.read_file("d/a.txt")

    # an existing file keeps its mode; a file its owner may not read is unreadable (root
    # writes it anyway, as in inspect's docker provider)
    await env.sandbox.files.write("/work/run.sh", "#!/bin/sh\n", mode=0o755)
    await env.write_file("run.sh", "#!/bin/sh\necho\n")
    assert (await env.sandbox.files.stat("/work/run.sh")).mode == 0o755
    edge.program(ID, stdout="0\n0\n")
    await env.sandbox.files.write("/work/secret", "s", mode=0o200)
    with pytest.raises(PermissionError) as denied:
        await env.read_file("secret")
    assert denied.value.errno == errno.EACCES and "secret" in str(denied.value)
    await env.write_file("secret", "t")


async def test_files_for_a_user_without_rights(edge: FakeEdge, env: DsecSandboxEnvironment) -> None:
    """Files the fake makes belong to root (uid 0): a user 1000 may read what others may
    read, and write nothing of root's."""
    edge.program(ID, stdout="1000\n1000 100\n")
    await env.sandbox.files.write("/etc/conf", "c", mode=0o644)
    assert await env.read_file("/etc/conf") == "c"
    with pytest.raises(PermissionError):
        await env.write_file("/etc/conf", "x")
    with pytest.raises(PermissionError):
        await env.write_file("/etc/new/file", "x")
    await env.sandbox.files.make_dir("/shared")
    await env.sandbox.files.write("/shared/.keep", "", mode=0o666)
    await env.write_file("/shared/.keep", "ok")  # writable by others
