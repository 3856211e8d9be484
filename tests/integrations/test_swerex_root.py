"""SWE-ReX (swe-rex 1.4, the real package) driving dsec sandboxes through
``dsec.integrations.swerex.DsecDeployment``. Several checks mirror SWE-ReX's own
``tests/test_execution.py`` (which runs them against its pexpect runtime)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SessionNotInitializedError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from tests.conftest import LiveServer
from tests.timing import budget

from dsec import Unsupported
from dsec.integrations.swerex import DsecDeployment, DsecDeploymentConfig, DsecRuntime

pytestmark = [pytest.mark.root, pytest.mark.debian]


def A(command: str, **kw: object) -> BashAction:  # SWE-ReX's tests use a 5 s default
    kw.setdefault("timeout", 20)
    return BashAction(command=command, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def deployment(sdk_env: LiveServer) -> AsyncIterator[DsecDeployment]:
    d = DsecDeployment(image="debian", memory_mb=512, disk_mb=512, labels={"test": "swerex"})
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def rt(deployment: DsecDeployment) -> AsyncIterator[DsecRuntime]:
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    yield runtime


async def test_session_keeps_shell_state(rt: DsecRuntime) -> None:
    await rt.run_in_session(A("mkdir -p /work/a && cd /work/a", check="raise"))
    await rt.run_in_session(A("export GREETING=hello; LOCAL=only-here", check="raise"))
    await rt.run_in_session(A('greet() { echo "$GREETING, $1"; }', check="raise"))
    await rt.run_in_session(A("alias ll='echo listing'; set -o pipefail", check="raise"))
    await rt.run_in_session(A("declare -A table=([k]=v); (sleep 30) &", check="raise"))
    r = await rt.run_in_session(A('pwd; greet world; echo "$LOCAL ${table[k]}"; ll', check="raise"))
    assert r.output == "/work/a\nhello, world\nonly-here v\nlisting\n"
    assert r.exit_code == 0
    # exported variables reach child processes; shell options persist
    r = await rt.run_in_session(A("bash -c 'echo $GREETING'; false | true", check="silent"))
    assert r.output == "hello\n" and r.exit_code == 1  # pipefail is still on
    r = await rt.run_in_session(A("jobs -p | wc -l", check="raise"))
    assert r.output.strip() == "1"  # the background job is still the session's


async def test_exit_codes_and_check(rt: DsecRuntime) -> None:
    r = await rt.run_in_session(A("doesntexist", check="silent"))
    assert r.exit_code == 127
    assert r.output == "bash: line 1: doesntexist: command not found\n"
    assert (await rt.run_in_session(A("false && true", check="silent"))).exit_code == 1
    await rt.run_in_session(A("false || true", check="raise"))
    with pytest.raises(NonZeroExitCodeError, match="exit code 3") as e:
        await rt.run_in_session(
            A("echo out; exit_with() { return $1; }; exit_with 3", check="raise")
        )
    assert "out" in str(e.value)
    with pytest.raises(NonZeroExitCodeError, match=r"^custom: "):
        await rt.run_in_session(A("false", check="raise", error_msg="custom"))
    r = await rt.run_in_session(A("false", check="ignore"))
    assert r.exit_code is None
    r = await rt.run_in_session(A("echo $?", check="raise"))
    assert r.output == "1\n"  # $? is the previous command's status, as at a prompt


async def test_output_is_exact(rt: DsecRuntime) -> None:
    cases = {
        "echo ''": "\n",
        "printf '\\nx'": "\nx",
        "printf '\\n\\nx\\n\\n\\n'": "\n\nx\n\n\n",
        "printf '  x'": "  x",
        "echo 'hello\nworld'": "hello\nworld\n",
        "\n\n\n echo 'test1' \n  \n \n echo 'test2' \n\n\n": "test1\ntest2\n",
        "python3 <<EOF\nprint('hello world')\nprint('hello world 2')\nEOF": "hello world\nhello world 2\n",
        "for i in {1..3};\n do echo 'hello world';\n done": "hello world\n" * 3,
        "echo 'hw';A=();echo 'asdf'": "hw\nasdf\n",
        "# echo 'hello world'": "",
        "printf '\\033[31mred\\033[0m\\n'": "red\n",  # ANSI escapes removed, as SWE-ReX does
        "echo 'a!b'": "a!b\n",  # no history expansion
    }
    for command, expected in cases.items():
        r = await rt.run_in_session(A(command, check="raise"))
        assert r.output == expected, command
    for empty in ("", "\n", "\n\n \n"):
        await rt.run_in_session(A(empty, check="raise"))


async def test_timeout_then_interrupt(rt: DsecRuntime) -> None:
    with pytest.raises(CommandTimeoutError, match=r"timeout after 0\.5 seconds"):
        await rt.run_in_session(A("echo started; sleep 30; echo not-reached", timeout=0.5))
    r = await rt.run_in_session(BashInterruptAction())
    assert r.exit_code == 0
    assert "started" in r.output and "not-reached" not in r.output
    r = await rt.run_in_session(A("echo $?; echo asdf", check="raise"))
    assert r.output == "130\nasdf\n"
    # a pure-bash loop (no child process) is interrupted too, as by Ctrl-C at a prompt
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(A("x=0; while true; do x=$((x+1)); done", timeout=0.5))
    await rt.run_in_session(BashInterruptAction())
    r = await rt.run_in_session(A("[ $x -gt 0 ] && echo counted", check="raise"))
    assert r.output == "counted\n"


async def test_interrupt_falls_back_to_kill(rt: DsecRuntime) -> None:
    stubborn = (
        "python3 -c 'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        'print("up", flush=True); time.sleep(60)\''
    )
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(A(stubborn, timeout=1.5))
    r = await rt.run_in_session(BashInterruptAction(timeout=0.3, n_retry=2))
    assert "up" in r.output and "kill" in r.output.lower()
    assert (await rt.run_in_session(A("echo alive", check="raise"))).output == "alive\n"


async def test_output_after_a_timeout_comes_with_the_next_call(rt: DsecRuntime) -> None:
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(A("sleep 1; echo late; : > /tmp/late-done", timeout=0.2))
    # a command given while the previous one runs is typed into its terminal (as with
    # SWE-ReX's sendline); waiting for it returns the first command's output
    done = Command(command="test -e /tmp/late-done", shell=True)
    async with asyncio.timeout(budget(10)):  # the first command has ended
        while (await rt.execute(done)).exit_code != 0:
            await asyncio.sleep(0.1)
    r = await rt.run_in_session(BashInterruptAction())
    assert r.output == "late"


async def test_syntax_error_is_refused_before_running(rt: DsecRuntime) -> None:
    with pytest.raises(BashIncorrectSyntaxError) as e:
        await rt.run_in_session(A("(a"))
    assert "bash_stdout" in e.value.extra_info
    assert "syntax error" in e.value.extra_info["bash_stderr"]
    assert (await rt.run_in_session(A("echo still-fine", check="raise"))).output == "still-fine\n"


async def test_interactive_program(rt: DsecRuntime) -> None:
    r = await rt.run_in_session(A("python3", is_interactive_command=True, expect=[">>> "]))
    assert "Python 3" in r.output and r.expect_string == ">>> "
    r = await rt.run_in_session(
        A("x = 6 * 7; print(x)", is_interactive_command=True, expect=[">>> "])
    )
    assert r.output == "42"
    await rt.run_in_session(A("quit()\n", is_interactive_quit=True, check="raise"))
    r = await rt.run_in_session(A("echo back in bash; cat </dev/null", check="raise"))
    assert r.output == "back in bash\n"
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(
            A("python3", is_interactive_command=True, expect=["WONTHITTHIS"], timeout=1)
        )
    await rt.run_in_session(BashInterruptAction())


async def test_sessions_are_isolated(rt: DsecRuntime) -> None:
    await rt.create_session(CreateBashSessionRequest(session="shell1"))
    await rt.create_session(CreateBashSessionRequest(session="shell2"))
    await asyncio.gather(
        rt.run_in_session(A("x=42", session="shell1", check="raise")),
        rt.run_in_session(A("y=24", session="shell2", check="raise")),
    )
    assert (await rt.run_in_session(A("echo $x $y", session="shell1"))).output == "42\n"
    assert (await rt.run_in_session(A("echo $x $y", session="shell2"))).output == "24\n"
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest(session="shell1"))
    await rt.close_session(CloseBashSessionRequest(session="shell1"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.close_session(CloseBashSessionRequest(session="shell1"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(A("echo", session="shell1"))
    await rt.close_session(CloseBashSessionRequest(session="shell2"))
    # closing killed the shells: only the default session's remains
    r = await rt.execute(Command(command="ls /tmp/.dsec-sessions | wc -l", shell=True))
    assert r.stdout.strip() == "1"


async def test_startup_source_and_exit(rt: DsecRuntime) -> None:
    await rt.write_file(
        WriteFileRequest(path="/root/env.sh", content="export FROM_RC=yes\necho sourced\n")
    )
    r = await rt.create_session(
        CreateBashSessionRequest(session="rc", startup_source=["/root/env.sh"], startup_timeout=20)
    )
    assert r.output == "sourced\n"
    assert (await rt.run_in_session(A("echo $FROM_RC", session="rc"))).output == "yes\n"
    with pytest.raises(SessionNotInitializedError):
        await rt.run_in_session(A("exit 3", session="rc"))
    with pytest.raises(SessionNotInitializedError):
        await rt.run_in_session(A("echo gone", session="rc"))
    await rt.close_session(CloseBashSessionRequest(session="rc"))


async def test_pipe_mode_session(deployment: DsecDeployment) -> None:
    runtime = DsecRuntime(deployment.sandbox, session_terminal="off")
    await runtime.create_session(CreateBashSessionRequest(session="p"))
    await runtime.run_in_session(A("cd /tmp; v=1", session="p", check="raise"))
    r = await runtime.run_in_session(A("pwd; echo $v; [ -t 1 ] || echo no-tty", session="p"))
    assert r.output == "/tmp\n1\nno-tty\n"
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(A("sleep 30", session="p", timeout=0.3))
    await runtime.run_in_session(BashInterruptAction(session="p"))
    assert (await runtime.run_in_session(A("echo $?", session="p"))).output == "130\n"
    await runtime.close()


async def test_execute(rt: DsecRuntime) -> None:
    assert (
        await rt.execute(Command(command="echo 'hello world'", shell=True))
    ).stdout == "hello world\n"
    r = await rt.execute(Command(command=["echo", "-n", "\nhello world"]))
    assert r.stdout == "\nhello world" and r.exit_code == 0
    r = await rt.execute(
        Command(command=["bash", "-c", "echo out; echo err 1>&2"], merge_output_streams=True)
    )
    assert r.stdout.splitlines() == ["out", "err"] and r.stderr == ""
    r = await rt.execute(Command(command=["bash", "-c", "echo out; echo err 1>&2; exit 4"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 4)
    with pytest.raises(NonZeroExitCodeError):
        await rt.execute(Command(command="exit 2", shell=True, check=True))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "10"], timeout=0.3))
    with pytest.raises(FileNotFoundError):
        await rt.execute(Command(command=["no-such-program"]))
    with pytest.raises(FileNotFoundError):
        await rt.execute(Command(command="pwd", shell=True, cwd="/no/such/dir"))
    r = await rt.execute(Command(command="pwd", shell=True, cwd="/tmp"))
    assert r.stdout == "/tmp\n"
    # env= replaces the environment, as subprocess's does
    r = await rt.execute(Command(command="echo $ONLY:$HOME", shell=True, env={"ONLY": "x"}))
    assert r.stdout == "x:\n"
    await rt.execute(Command(command="", shell=True, check=True))


async def test_files(rt: DsecRuntime, tmp_path: Path) -> None:
    await rt.write_file(WriteFileRequest(path="/work/new/dir/t.txt", content="test ü"))
    assert (await rt.read_file(ReadFileRequest(path="/work/new/dir/t.txt"))).content == "test ü"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/work/missing.txt"))
    big = "x" * (1 << 20)
    await rt.write_file(WriteFileRequest(path="/work/big.txt", content=big))
    assert len((await rt.read_file(ReadFileRequest(path="/work/big.txt"))).content) == len(big)
    (tmp_path / "one.txt").write_text("one")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.txt").write_text("b")
    await rt.upload(UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/up/one.txt"))
    await rt.upload(UploadRequest(source_path=str(src), target_path="/up/dir"))
    r = await rt.run_in_session(A("cat /up/one.txt /up/dir/a.txt /up/dir/sub/b.txt", check="raise"))
    assert r.output == "oneab"
    with pytest.raises(ValueError):
        await rt.upload(UploadRequest(source_path=str(tmp_path / "nope"), target_path="/x"))


async def test_deployment_lifecycle(sdk_env: LiveServer) -> None:
    d = DsecDeploymentConfig(image="debian", memory_mb=256, disk_mb=256).get_deployment()
    with pytest.raises(DeploymentNotStartedError):
        await d.is_alive()
    with pytest.raises(DeploymentNotStartedError):
        _ = d.runtime
    await d.start()
    sandbox = d.sandbox
    assert await d.is_alive()
    assert sandbox.info.memory_mb == 256
    await d.stop()
    await d.stop()  # idempotent
    info = await sandbox.refresh()
    assert info.state == "stopped"


async def test_sessions_need_bash(sdk_env: LiveServer) -> None:
    d = DsecDeployment(image="busybox", memory_mb=64, disk_mb=64)
    await d.start()
    try:
        with pytest.raises(Unsupported, match="need bash"):
            await d.runtime.create_session(CreateBashSessionRequest())
        r = await d.runtime.execute(Command(command="echo works", shell=True))
        assert r.stdout == "works\n"
    finally:
        await d.stop()
