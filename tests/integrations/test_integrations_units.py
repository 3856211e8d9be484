"""Hermetic checks of the integrations (no root, no server): the persistent-shell engine
run against this machine's bash through a local stand-in for the sandbox's exec/files
calls, the docker CLI's flag parsing and formats (against dsec.testing.FakeEdge), and the
harness config models."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dsec.cli import docker as docker_cli
from dsec.integrations._session import ShellSession
from dsec.models import ExecResult
from dsec.network.policy import NetworkPolicy
from dsec.testing import FakeEdge, MemoryLayers, app_transport

# -- the session engine on the local bash ------------------------------------------------


@dataclass
class _Info:
    image: str = "local"
    workdir: str = "/"


def _default_signals() -> None:
    """Start a command with SIGINT and SIGQUIT at their defaults, as a sandbox's exec server
    starts every command, even when this test process was started with them ignored (as a
    background job of a non-interactive shell is): an ignored SIGINT survives exec, and bash
    cannot trap a signal it found ignored."""
    for s in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)


class _LocalCommands:
    async def run(
        self,
        cmd: list[str],
        *,
        stdin: bytes | None = None,
        timeout: float = 60,
        cwd: str | None = None,
        max_output_bytes: int = 1 << 20,
        **_: Any,
    ) -> ExecResult:
        def go() -> ExecResult:
            try:
                p = subprocess.run(
                    cmd,
                    input=stdin or b"",
                    capture_output=True,
                    timeout=timeout,
                    cwd=cwd,
                    start_new_session=True,
                    preexec_fn=_default_signals,
                )
            except subprocess.TimeoutExpired:
                return ExecResult(timed_out=True)
            return ExecResult(
                stdout=p.stdout.decode(errors="replace"),
                stderr=p.stderr.decode(errors="replace"),
                exit_code=p.returncode,
            )

        return await asyncio.to_thread(go)


class _LocalFiles:
    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        def go() -> None:
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data.encode() if isinstance(data, str) else data)
            p.chmod(mode)

        await asyncio.to_thread(go)


class LocalSandbox:
    """The two calls ShellSession makes (commands.run with an argv, files.write), done on
    this machine: the same script, the same protocol, no kernel features needed."""

    info = _Info()
    commands = _LocalCommands()
    files = _LocalFiles()


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture(params=["on", "off"] if shutil.which("script") else ["off"])
async def shell(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    s = ShellSession(
        LocalSandbox(), "unit", root=str(tmp_path / "sessions"), terminal=request.param
    )  # type: ignore[arg-type]
    await s.start()
    assert s.terminal == ("pty" if request.param == "on" else "pipe")
    yield s
    await s.close()
    assert not await asyncio.to_thread(os.path.exists, s.directory)


@needs_bash
async def test_state_persists_and_output_is_exact(shell: ShellSession, tmp_path: Path) -> None:
    r = await shell.run(f"cd {tmp_path} && export V=1 && f() {{ echo f$1; }}", timeout=10)
    assert (r.status, r.exit_code) == ("done", 0)
    r = await shell.run("pwd; echo $V; f 2; printf 'no newline'", timeout=10)
    out = r.output.replace("\r\n", "\n")
    assert out == f"{tmp_path}\n1\nf2\nno newline"
    r = await shell.run("printf '\\xff\\xfe'; exit_code() { return 5; }; exit_code", timeout=10)
    assert r.exit_code == 5 and r.output.encode("utf-8", "surrogateescape") == b"\xff\xfe"
    r = await shell.run("nope-command", timeout=10)
    assert r.exit_code == 127 and r.output.startswith("bash: line 1: nope-command")


@needs_bash
async def test_timeout_keeps_output_for_the_next_call(shell: ShellSession) -> None:
    r = await shell.run("echo before; sleep 30", timeout=0.5)
    assert r.status == "timeout" and shell.running
    r = await shell.interrupt(timeout=5)
    assert r.status == "done" and r.exit_code == 130 and "before" in r.output
    assert not shell.running
    r = await shell.run("echo $?", timeout=10)
    assert r.output.strip() == "130"


@needs_bash
async def test_expect_and_terminal_input(shell: ShellSession) -> None:
    r = await shell.run("echo start; read -r line; echo got:$line", timeout=10, expect=["start"])
    assert r.status == "matched" and r.matched == 0 and shell.running
    r = await shell.send("hello\n", timeout=10)
    assert r.status == "done" and "got:hello" in r.output


@needs_bash
async def test_syntax_error_and_exit(shell: ShellSession) -> None:
    r = await shell.run("(a", timeout=10)
    assert r.status == "syntax" and "syntax error" in r.output and not shell.running
    r = await shell.run("exit 4", timeout=10)
    assert r.status == "exited" and not shell.alive
    with pytest.raises(RuntimeError):
        await shell.run("echo", timeout=1)


@needs_bash
async def test_output_cap(tmp_path: Path) -> None:
    s = ShellSession(LocalSandbox(), "cap", root=str(tmp_path), terminal="off", output_cap=1000)  # type: ignore[arg-type]
    await s.start()
    try:
        r = await s.run("head -c 5000 /dev/zero | tr '\\0' x", timeout=10)
        assert r.status == "done" and r.output.startswith("x" * 1000)
        assert "output truncated: 4000 more bytes" in r.output
        r = await s.run("echo next", timeout=10)
        assert r.output == "next\n"  # the dropped rest and the end marker are skipped
    finally:
        await s.close()


# -- docker CLI: parsing ---------------------------------------------------------------


def test_docker_flag_parsing() -> None:
    opts, pos = docker_cli.parse(
        "run",
        [
            "-di",
            "--name=x",
            "-wdir",
            "-e",
            "A=1",
            "--env=B=2",
            "--rm=false",
            "img",
            "cmd",
            "-d",
            "--name",
            "y",
        ],
    )
    assert opts["detach"] and opts["interactive"] and not opts["rm"]
    assert opts["name"] == "x" and opts["workdir"] == "dir" and opts["env"] == ["A=1", "B=2"]
    assert pos == ["img", "cmd", "-d", "--name", "y"]  # run stops at the image
    opts, pos = docker_cli.parse("ps", ["-a", "--format", "{{.ID}}", "-q"])
    assert opts["all"] and opts["quiet"] and opts["format"] == "{{.ID}}" and pos == []
    opts, pos = docker_cli.parse("rm", ["a", "-f", "b"])  # flags anywhere for rm
    assert opts["force"] and pos == ["a", "b"]
    assert docker_cli.parse("exec", ["c", "--", "ls"])[1] == ["c", "--", "ls"]


@pytest.mark.parametrize(
    ("verb", "args", "needle"),
    [
        ("run", ["--publish"], "flag needs an argument: --publish"),
        ("run", ["-x", "80"], "unknown shorthand flag: 'x' in -x"),
        ("run", ["--volume", "/a:/b", "img"], "unsupported flag: --volume"),
        ("run", ["-it", "img"], "unsupported flag: -t"),
        ("exec", ["--privileged", "c"], "unknown flag: --privileged"),
        ("run", ["--name"], "flag needs an argument: --name"),
        ("run", ["--rm=maybe", "img"], 'invalid argument "maybe" for "--rm"'),
        ("stop", ["-t"], "flag needs an argument"),
    ],
)
def test_docker_bad_flags(verb: str, args: list[str], needle: str) -> None:
    with pytest.raises(docker_cli.DockerError) as e:
        docker_cli.parse(verb, args)
    assert e.value.code == docker_cli.EXIT_DAEMON and needle in e.value.message


def _run_cli(args: list[str], edge: FakeEdge | None = None) -> tuple[int, str, str]:
    transport, key = app_transport(edge or FakeEdge())
    docker_cli.transport_factory = lambda: transport
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = docker_cli.main(args, url="http://fake", api_key=key)
    finally:
        docker_cli.transport_factory = None
    return code, out.getvalue(), err.getvalue()


def test_docker_ps_formats_against_the_api() -> None:
    edge = FakeEdge()
    transport, key = app_transport(edge)
    from dsec import Sandbox

    sb = Sandbox.create(
        image="busybox",
        transport=transport,
        api_key=key,
        labels={"docker.name": "web", "docker.command": "sleep infinity-and-beyond"},
    )
    Sandbox.create(image="busybox", transport=transport, api_key=key)  # made without docker
    docker_cli.transport_factory = lambda: transport
    try:
        out = io.StringIO()
        with redirect_stdout(out):
            assert docker_cli.main(["ps"], api_key=key) == 0
        lines = out.getvalue().splitlines()
        assert lines[0].startswith("CONTAINER ID   ")
        web = next(line for line in lines if line.endswith("web"))
        assert '"sleep infinity-and-…"' in web  # docker cuts commands to 20 characters
        assert web.index("busybox") == lines[0].index("IMAGE")
        out = io.StringIO()
        with redirect_stdout(out):
            assert docker_cli.main(["ps", "--no-trunc", "--format", "{{json .}}"], api_key=key) == 0
        rows = [json.loads(line) for line in out.getvalue().splitlines()]
        other = next(r for r in rows if r["Names"] != "web")
        assert other["Names"] == other["ID"]  # a sandbox not made by docker: named by its id
        assert any(r["Command"] == '"sleep infinity-and-beyond"' for r in rows)
        out = io.StringIO()
        with redirect_stdout(out):
            docker_cli.main(["ps", "--format", '{{.ID}}\\t{{.Label "docker.name"}}'], api_key=key)
        assert f"{sb.id}\tweb" in out.getvalue().splitlines()
    finally:
        docker_cli.transport_factory = None


def test_docker_errors_against_the_api() -> None:
    code, _, err = _run_cli(["stop", "ghost"])
    assert code == 1 and "No such container: ghost" in err
    code, _, err = _run_cli(["ps", "--format", "{{range .}}x"])
    assert code == docker_cli.EXIT_DAEMON and "template parsing error" in err
    code, out, _ = _run_cli(["--help"])
    assert code == 0 and "run" in out and "exec" in out
    code, out, _ = _run_cli(["cp", "--help"])
    assert code == 0 and "docker cp" in out


def test_docker_unreachable_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    err = io.StringIO()
    with redirect_stderr(err):
        assert docker_cli.main(["ps"], url=f"http://127.0.0.1:{port}", api_key="k") == 1
        assert (
            docker_cli.main(["run", "busybox"], url=f"http://127.0.0.1:{port}", api_key="k") == 125
        )
    assert "Cannot connect to the dsec server" in err.getvalue()


def test_docker_human_durations_and_table() -> None:
    assert [docker_cli._human(s) for s in (0.5, 1, 59, 60, 61 * 60, 3600, 5 * 3600, 3 * 86400)] == [
        "Less than a second",
        "1 second",
        "59 seconds",
        "About a minute",
        "About an hour",
        "About an hour",
        "5 hours",
        "3 days",
    ]
    table = docker_cli._table([["A", "BB", "C"], ["long-cell-value", "x", "y"]])
    first, second = table.splitlines()
    assert first.index("BB") == second.index("x") == len("long-cell-value") + 3


# -- harness config models -------------------------------------------------------------


def test_swerex_config_model() -> None:
    from dsec.integrations.swerex import DsecDeployment, DsecDeploymentConfig

    c = DsecDeploymentConfig.model_validate(
        {"type": "dsec", "image": "debian", "network": {"allow_domains": ["pypi.org"]}}
    )
    assert isinstance(c.network, NetworkPolicy) and c.network.allow_domains == ["pypi.org"]
    assert isinstance(c.get_deployment(), DsecDeployment)
    with pytest.raises(ValidationError):
        DsecDeploymentConfig.model_validate({"image": "debian", "api_key": "secret"})
    with pytest.raises(ValidationError):
        DsecDeploymentConfig.model_validate({"type": "docker"})
    with pytest.raises(ValidationError):
        DsecDeploymentConfig.model_validate({"tier": "Kubernetes!"})  # no tier's name
    # a well-formed name is the server's to judge (a tier another package registered there)
    assert DsecDeploymentConfig.model_validate({"tier": "gvisor"}).tier == "gvisor"
    dumped = DsecDeployment(image="debian", cpu=2).config.model_dump()
    assert dumped["cpu"] == 2 and "api_key" not in dumped


def test_minisweagent_config_model() -> None:
    from dsec.integrations.minisweagent import DsecEnvironmentConfig

    c = DsecEnvironmentConfig(
        image="debian", cwd="/testbed", timeout=60, interpreter=["bash", "-c"]
    )
    assert c.interpreter == ["bash", "-c"]
    with pytest.raises(ValidationError):
        DsecEnvironmentConfig(image="debian", run_args=["--rm"])  # a docker-only field


def test_swerex_clean_matches_swerex() -> None:
    from swerex.runtime.local import _strip_control_chars

    from dsec.integrations.swerex import clean

    sample = "\x1b[31mred\x1b[0m\r\nline\r\n\x1b[?2004hprompt"
    assert clean(sample) == _strip_control_chars(sample)


def test_docker_pull_from_a_registry_goes_to_the_server() -> None:
    edge = FakeEdge(layers=MemoryLayers(registry={"localhost:5000/team/app:1": {}}))
    code, out, _ = _run_cli(["pull", "-q", "localhost:5000/team/app:1"], edge)
    assert (code, out) == (0, "localhost:5000/team/app:1\n")  # the reference names it
    assert edge.calls_to("pull_image")[0]["req"].ref == "localhost:5000/team/app:1"
    code, _, err = _run_cli(["pull", "python:3.11"], edge)  # Docker Hub: not reachable here
    assert code == 1 and "pull access denied for python:3.11" in err
    assert len(edge.calls_to("pull_image")) == 1


@needs_bash
async def test_interrupt_twice_in_a_row(shell: ShellSession) -> None:
    """Each interrupt stops its command: a child process, then a pure-bash loop (bash runs
    no INT trap after one returned from a sourced file until it forks again)."""
    for command in ("sleep 30", "while true; do :; done", "sleep 30", "x=0; while :; do x=1; done"):
        assert (await shell.run(command, timeout=0.3)).status == "timeout"
        r = await shell.interrupt(timeout=5)
        assert (r.status, r.exit_code) == ("done", 130), command


def test_docker_cp_refuses_an_unsafe_tar_on_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import tarfile

    from dsec import Sandbox

    edge = FakeEdge()
    transport, key = app_transport(edge)
    sb = Sandbox.create(
        image="busybox", transport=transport, api_key=key, labels={"docker.name": "box"}
    )
    sb.files.make_dir("/work")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        member = tarfile.TarInfo("../escape.txt")
        member.size = 1
        tar.addfile(member, io.BytesIO(b"x"))

    class _Stdin:
        buffer = io.BytesIO(buf.getvalue())

    monkeypatch.setattr(sys, "stdin", _Stdin())
    docker_cli.transport_factory = lambda: transport
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            assert docker_cli.main(["cp", "-", "box:/work"], api_key=key) == 1
    finally:
        docker_cli.transport_factory = None
    assert "unsafe tar member" in err.getvalue()
    assert not edge.calls_to("upload_tar")
