"""Hermetic checks of ``dsec docker``'s engine verbs (no root, no server): ``version``,
``info``, ``inspect``, ``port``, ``images``, ``rmi``, and ``run``'s ``--entrypoint``,
``--network``, ``-p``, capability and security options, against the real apiserver in front
of :class:`dsec.testing.FakeEdge` (two API keys), and the ``-p`` binding rules
(:mod:`dsec.cli.docker_ports`) on loopback."""

from __future__ import annotations

import io
import json
import os
import shlex
import socket
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import httpx
import pytest

from dsec import Sandbox
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.cli import docker as docker_cli
from dsec.cli import docker_ports
from dsec.cli.docker_inspect import DOCKER_VERSION, get_config, put_config
from dsec.testing import FAKE_BUSYBOX, FakeEdge

KEY = "dsec_" + "k" * 43
OTHER = "dsec_" + "o" * 43
DETACH = ["/bin/sh", "-c", 'set -m; "$@" </dev/null >/dev/null 2>&1 &', "sh"]


class Cli:
    """``dsec docker`` in this process, against a FakeEdge behind the real apiserver."""

    def __init__(self) -> None:
        self.edge = FakeEdge()
        self.transport = httpx.ASGITransport(app=create_app(self.edge, StaticKeys([KEY, OTHER])))
        self.edge.memory_layers.put_image(
            "pyimg",
            [FAKE_BUSYBOX],
            meta={
                "config": {
                    "Env": ["PATH=/usr/bin", "IMG=1"],
                    "Cmd": ["python3"],
                    "WorkingDir": "/app",
                    "User": "1000",
                    "Labels": {"from": "image"},
                }
            },
        )

    def __call__(self, *args: str, key: str = KEY) -> tuple[int, str, str]:
        docker_cli.transport_factory = lambda: self.transport
        out, err = io.StringIO(), io.StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                code = docker_cli.main(list(args), url="http://fake", api_key=key)
        finally:
            docker_cli.transport_factory = None
        return code, out.getvalue(), err.getvalue()

    def detached(self, *argv: str) -> None:
        """Let ``run -d IMAGE argv...`` start its command in the fake sandbox."""
        self.edge.program(shlex.join([*DETACH, *argv]))

    def created(self) -> list[object]:
        return [c["req"] for c in self.edge.calls_to("create_sandbox")]


@pytest.fixture
def cli() -> Iterator[Cli]:
    yield Cli()


def test_version(cli: Cli) -> None:
    code, out, _ = cli("version")
    assert code == 0 and out.startswith("Client: dsec docker\n Version:           27.5.1\n")
    assert "\nServer: dsec " in out and " dsec:\n" in out
    code, out, _ = cli("version", "--format", "json")  # what inspect_ai parses
    doc = json.loads(out)
    assert doc["Client"]["Version"] == DOCKER_VERSION and doc["Client"]["ApiVersion"]
    assert [c["Name"] for c in doc["Server"]["Components"]] == ["Engine", "dsec"]
    code, out, _ = cli("version", "-f", "{{.Server.Version}} {{.Client.Version}}")
    assert (code, out) == (0, f"{DOCKER_VERSION} {DOCKER_VERSION}\n")
    code, _, err = cli("version", "--format", "{{.Nope}}")
    assert code == 1 and 'map has no entry for key "Nope"' in err
    code, _, err = cli("version", "--format", "{{.Client")
    assert code == 64 and err.startswith("template parsing error: template: :1: unclosed action")
    assert cli("-v")[1] == f"Docker version {DOCKER_VERSION}, build dsec\n"


def test_version_without_a_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = docker_cli.main(["version"], url=f"http://127.0.0.1:{port}", api_key="k")
    assert code == 1 and out.getvalue().startswith("Client: dsec docker\n")
    assert "Server:" not in out.getvalue() and "Cannot connect to the dsec server" in err.getvalue()


def test_info(cli: Cli) -> None:
    cli.detached("sleep", "9")
    assert cli("run", "-d", "--name", "a", "busybox", "sleep", "9")[0] == 0
    code, out, _ = cli("info")
    assert code == 0 and " Containers: 1\n  Running: 1\n" in out
    code, out, _ = cli("info", "--format", "{{.ServerVersion}} {{.ContainersRunning}} {{.NCPU}}")
    assert code == 0 and out.startswith(f"{DOCKER_VERSION} 1 ")
    doc = json.loads(cli("info", "--format", "json")[1])
    assert doc["OSType"] == "linux" and "container" in doc["Runtimes"]
    assert cli("info", "--format", "{{.Nope}}")[0] == 1


def test_run_entrypoint_env_and_inspect(cli: Cli) -> None:
    """verifiers' docker runtime: run --entrypoint sleep, then inspect {{json .Config}}."""
    cli.detached("sleep", "infinity")
    code, out, err = cli(
        "run", "--label", "verifiers.run=r1", "--detach", "--network", "bridge", "--cpus", "1.0",
        "--memory", "1g", "--env", "A=1", "--entrypoint", "sleep", "--name", "vf-1", "pyimg",
        "infinity",
    )  # fmt: skip
    assert code == 0, err
    sandbox_id = out.strip()
    [req] = cli.created()
    assert req.network is not None and req.network.allow_cidrs == ["0.0.0.0/0"]  # type: ignore[attr-defined]
    assert req.env == {"A": "1"} and req.memory_mb == 1024  # type: ignore[attr-defined]
    assert req.workdir is None  # the image's WorkingDir applies  # type: ignore[attr-defined]
    code, out, _ = cli("inspect", "--format", "{{json .Config}}", "vf-1")
    config = json.loads(out)
    assert config["Env"] == ["PATH=/usr/bin", "IMG=1", "A=1"]
    assert (config["Image"], config["User"], config["WorkingDir"]) == ("pyimg", "1000", "/app")
    assert (config["Entrypoint"], config["Cmd"]) == (["sleep"], ["infinity"])
    assert config["Labels"] == {"from": "image", "verifiers.run": "r1"}
    fmt = "{{.State.Running}} {{.State.Status}} {{.Path}} {{.Args}} {{.HostConfig.NetworkMode}} {{.Name}} {{.Id}}"
    assert cli("inspect", "-f", fmt, sandbox_id[:-3])[1] == (
        f"true running sleep [infinity] bridge /vf-1 {sandbox_id}\n"
    )
    doc = json.loads(cli("inspect", "vf-1")[1])[0]
    assert doc["HostConfig"]["NanoCpus"] == 10**9 and doc["Dsec"]["Tier"] == "container"
    # without --entrypoint: the image's Cmd runs when no command is given
    cli.detached("python3")
    assert cli("run", "-d", "--name", "py", "pyimg")[0] == 0
    assert (
        cli("inspect", "-f", "{{json .Config.Cmd}} {{.Path}}", "py")[1] == '["python3"] python3\n'
    )
    # --entrypoint "" resets it: the arguments alone
    cli.detached("echo", "hi")
    assert cli("run", "-d", "--entrypoint", "", "pyimg", "echo", "hi")[0] == 0


def test_inspect_objects_and_errors(cli: Cli) -> None:
    cli.detached("sleep", "9")
    assert cli("run", "-d", "--name", "box", "busybox", "sleep", "9")[0] == 0
    code, out, err = cli("inspect", "box", "busybox", "ghost")
    docs = json.loads(out)
    assert code == 1 and err == "Error: No such object: ghost\n"
    assert docs[0]["Name"] == "/box" and docs[1]["RepoTags"] == ["busybox:latest"]
    assert docs[0]["Image"] == docs[1]["Id"]  # the container's image is that image
    assert cli("inspect", "ghost") == (1, "[]\n", "Error: No such object: ghost\n")
    assert (
        cli("inspect", "--type", "container", "busybox")[2] == "Error: No such container: busybox\n"
    )
    assert cli("inspect", "--type", "image", "box")[2] == "Error: No such image: box\n"
    code, out, _ = cli("image", "inspect", "-f", "{{index .RepoTags 0}} {{.Os}}", "busybox")
    assert (code, out) == (0, "busybox:latest linux\n")
    assert cli("container", "inspect", "-f", "{{.State.Status}}", "box")[1] == "running\n"
    code, _, err = cli("inspect", "-f", "{{.State.Nope}}", "box")
    assert code == 1 and err.startswith('template: :1:2: executing "" at <.State.Nope>:')
    code, _, err = cli("inspect", "-f", "{{.State", "box")
    assert code == 1 and err.startswith("template parsing error: ")
    assert cli("inspect")[0] == 125
    assert cli("kill", "box") == (0, "box\n", "")
    assert (
        cli("inspect", "-f", "{{.State.Status}} {{.State.Running}}", "box")[1] == "exited false\n"
    )
    code, _, err = cli("kill", "box")
    assert code == 1 and "is not running" in err


def test_another_keys_containers_are_no_such_container(cli: Cli) -> None:
    cli.detached("sleep", "9")
    assert cli("run", "-d", "--name", "mine", "busybox", "sleep", "9")[0] == 0
    for args in (
        ("inspect", "mine"),
        ("port", "mine"),
        ("kill", "mine"),
        ("stop", "mine"),
        ("rm", "-f", "mine"),
        ("container", "inspect", "mine"),
    ):
        code, _, err = cli(*args, key=OTHER)
        assert code == 1 and ("No such container: mine" in err or "No such object: mine" in err), (
            args
        )
    assert cli("info", "--format", "{{.Containers}}", key=OTHER)[1] == "0\n"
    assert "mine" not in cli("ps", "-a", key=OTHER)[1]
    assert cli("inspect", "-f", "{{.State.Running}}", "mine")[1] == "true\n"  # untouched


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--network", "host"], "network mode host is not supported by dsec"),
        (["--network", "container:other"], "network mode container:other is not supported"),
        (["--network", "my-net"], "network my-net not found"),
        (["--privileged"], "--privileged is not supported by dsec"),
        (["--cap-add", "SYS_ADMIN"], "--cap-add SYS_ADMIN is not supported by dsec"),
        (["--cap-add", "ALL"], "--cap-add ALL is not supported by dsec"),
        (["--cap-drop", "ALL"], "--cap-drop ALL is not supported by dsec"),
        (["--cap-drop", "chown"], "--cap-drop CHOWN is not supported by dsec"),
        (["--cap-add", "CAP_WIZARD"], 'invalid CapAdd: unknown capability: "CAP_WIZARD"'),
        (["--security-opt", "seccomp=unconfined"], "dsec's own seccomp filter"),
        (["--security-opt", "apparmor=my-profile"], "use no AppArmor or SELinux"),
        (["--security-opt", "systempaths=unconfined"], "/proc and /sys stay masked"),
        (["--security-opt", "bogus"], 'invalid --security-opt: "bogus"'),
        (["--sysctl", "net.ipv4.ip_forward=1"], "sysctl 'net.ipv4.ip_forward=1' is not supported"),
        (["-v", "/tmp:/tmp"], "unsupported flag: -v (dsec docker: no bind mounts"),
        (["--mount", "type=bind,src=/a,dst=/b"], "unsupported flag: --mount"),
        (["--gpus", "all"], "unsupported flag: --gpus"),
        (["--add-host", "h:host-gateway"], "unsupported flag: --add-host"),
        (["-p", "8000-8010:8000-8010"], "port ranges are not supported"),
        (["-p", "53:53/udp"], "invalid proto: udp"),
        (["-p", "300.1.1.1::80"], "invalid IP address: 300.1.1.1"),
        (["-p", "0"], "invalid containerPort: 0"),
    ],
)
def test_run_refuses_what_dsec_cannot_honour(cli: Cli, args: list[str], needle: str) -> None:
    code, _, err = cli("run", *args, "busybox", "true")
    assert code == 125 and needle in err, err
    assert not cli.created()  # refused before anything was made


def test_run_accepts_what_dsec_already_meets(cli: Cli) -> None:
    """What verifiers asks in its restricted mode, and other restrictions sandboxes meet."""
    cli.detached("sleep", "9")
    code, _, err = cli(
        "run", "-d", "--name", "strict", "--cap-drop", "NET_ADMIN", "--cap-drop", "CAP_NET_RAW",
        "--cap-drop", "mknod", "--cap-add", "DAC_OVERRIDE",
        "--security-opt", "no-new-privileges", "--security-opt", "no-new-privileges:true",
        "--security-opt", "apparmor=unconfined", "--security-opt", "label=disable",
        "--sysctl", "net.ipv6.conf.all.disable_ipv6=1", "--network", "none",
        "busybox", "sleep", "9",
    )  # fmt: skip
    assert code == 0, err
    assert cli.created()[0].network is None  # type: ignore[attr-defined]
    host = json.loads(cli("inspect", "-f", "{{json .HostConfig}}", "strict")[1])
    assert host["CapDrop"] == ["NET_ADMIN", "NET_RAW", "MKNOD"] and host["CapAdd"] == [
        "DAC_OVERRIDE"
    ]
    assert host["NetworkMode"] == "none" and len(host["SecurityOpt"]) == 4


def test_sandbox_capabilities_are_the_container_tiers() -> None:
    """The caps the CLI says sandboxes hold are the ones the container tier grants."""
    from dsec.contract.isolation import CAPABILITIES

    assert {c.removeprefix("CAP_") for c in CAPABILITIES} == set(docker_cli.SANDBOX_CAPABILITIES)


def test_port_of_a_published_container(cli: Cli) -> None:
    labels = {"docker.name": "web"}
    ports = {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "41234"}]}
    ports["22/tcp"] = [{"HostIp": "::1", "HostPort": "2222"}]
    put_config(labels, {"Ports": ports, "PortBindings": ports})
    assert get_config(labels)["Ports"] == ports
    Sandbox.create(image="busybox", labels=labels, transport=cli.transport, api_key=KEY)
    assert cli("port", "web") == (
        0,
        "22/tcp -> [::1]:2222\n8000/tcp -> 127.0.0.1:41234\n",
        "",
    )
    assert cli("port", "web", "8000/tcp") == (0, "127.0.0.1:41234\n", "")
    assert cli("port", "web", "8000") == (0, "127.0.0.1:41234\n", "")
    assert cli("port", "web", "8001") == (
        1,
        "",
        "Error: No public port '8001/tcp' published for web\n",
    )
    assert cli("container", "port", "web", "22")[1] == "[::1]:2222\n"
    assert "127.0.0.1:41234->8000/tcp" in cli("ps", "--format", "{{.Ports}}")[1]
    code, out, _ = cli(
        "inspect", "-f", '{{(index (index .NetworkSettings.Ports "8000/tcp") 0).HostPort}}', "web"
    )
    assert (code, out) == (0, "41234\n")
    assert "docker.config" not in cli("ps", "--format", "{{.Labels}}")[1]  # env lives there
    assert cli("port")[0] == 125
    assert cli("port", "ghost")[2] == "Error response from daemon: No such container: ghost\n"


def test_images_and_rmi(cli: Cli) -> None:
    code, out, _ = cli("images")
    lines = out.splitlines()
    assert lines[0].split() == ["REPOSITORY", "TAG", "IMAGE", "ID", "CREATED", "SIZE"]
    assert any(line.startswith("busybox ") and " latest " in line for line in lines)
    assert cli("images", "--format", "{{.Repository}}:{{.Tag}}", "pyimg")[1] == "pyimg:latest\n"
    ids = cli("images", "-q")[1].split()
    assert ids and all(len(i) == 12 for i in ids)
    assert json.loads(cli("images", "--format", "json", "busybox")[1])["Repository"] == "busybox"
    assert cli("image", "ls", "-q", "busybox")[1].strip() in ids
    code, _, err = cli("rmi", "busybox")  # a system image: read-only to keys
    assert code == 1 and err.startswith("Error response from daemon: ")
    assert cli("rmi", "ghost") == (1, "", "Error response from daemon: No such image: ghost\n")
    assert cli("image", "rm", "ghost")[0] == 1


def test_ps_templates_are_go_templates(cli: Cli) -> None:
    cli.detached("sleep", "9")
    assert cli("run", "-d", "--name", "t", "-l", "team=rl", "busybox", "sleep", "9")[0] == 0
    code, out, _ = cli(
        "ps", "--format", '{{if eq .State "running"}}{{.Names}}:{{.Label "team"}}{{end}}'
    )
    assert (code, out) == (0, "t:rl\n")
    code, _, err = cli("ps", "--format", "{{.Nope}}")
    assert code == 125 and "can't evaluate field Nope" in err
    code, _, err = cli("ps", "--format", "{{.Names")
    assert code == 125 and "template parsing error" in err


def test_groups_and_unknown_verbs(cli: Cli) -> None:
    code, _, err = cli("image", "frobnicate")
    assert code == 1 and "'image frobnicate' is not a docker command" in err
    code, out, _ = cli("image")
    assert code == 0 and "inspect" in out
    assert cli("container-inspect", "x")[0] == 1  # the internal names are not verbs
    assert cli("inspect", "--help")[1].startswith("Usage:  docker inspect")


# -- -p on this machine (dsec.cli.docker_ports) -------------------------------------------


@pytest.mark.parametrize(
    ("spec", "binding"),
    [
        ("8000", ("127.0.0.1", 0, 8000)),
        ("8000/tcp", ("127.0.0.1", 0, 8000)),
        ("9000:8000", ("127.0.0.1", 9000, 8000)),
        ("127.0.0.1::8765", ("127.0.0.1", 0, 8765)),
        ("0.0.0.0:9000:80", ("0.0.0.0", 9000, 80)),
        ("[::1]:9000:80/TCP", ("::1", 9000, 80)),
    ],
)
def test_publish_specs(spec: str, binding: tuple[str, int, int]) -> None:
    b = docker_ports.parse_publish(spec)
    assert (b.host_ip, b.host_port, b.container_port) == binding


def test_bind_reports_a_port_in_use_as_docker_does() -> None:
    [(b, sock)] = docker_ports.bind([docker_ports.parse_publish("127.0.0.1::80")])
    try:
        assert b.host_port > 0 and sock.getsockname()[1] == b.host_port
        with pytest.raises(docker_ports.PublishError) as e:
            docker_ports.bind(
                [
                    docker_ports.parse_publish("127.0.0.1::81"),
                    docker_ports.parse_publish(f"127.0.0.1:{b.host_port}:80"),
                ]
            )
        assert str(e.value) == f"Bind for 127.0.0.1:{b.host_port} failed: port is already allocated"
    finally:
        sock.close()


def test_forwarder_state_dir_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("DSEC_DOCKER_STATE", str(shared))
    with pytest.raises(docker_ports.PublishError):
        docker_ports.state_dir()
    monkeypatch.setenv("DSEC_DOCKER_STATE", str(tmp_path / "mine"))
    assert docker_ports.state_dir().stat().st_mode & 0o777 == 0o700
    # no forwarder known: stopping one is a no-op
    docker_ports.stop_forwarder("sb-fake-000000000000")
    assert not os.listdir(tmp_path / "mine")
