"""Bash and JavaScript contexts, and smolagents' E2BExecutor, through the real clients."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget

from e2b import TimeoutException


def test_bash_state_exit_codes_and_env(sandbox: Any, tmp_path: Any) -> None:
    ctx = sandbox.create_code_context(language="bash", cwd=str(tmp_path))
    assert ctx.language == "bash"
    first = sandbox.run_code("GREETING=hello\nmkdir sub && cd sub\necho $GREETING", context=ctx)
    assert first.error is None
    assert first.logs.stdout == ["hello\n"]
    second = sandbox.run_code("echo $GREETING $PWD", context=ctx)
    assert "".join(second.logs.stdout) == f"hello {tmp_path}/sub\n"
    failed = sandbox.run_code("ls /definitely-not-here", context=ctx)
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("ExitCode", "2")
    assert "No such file" in "".join(failed.logs.stdout)
    env = sandbox.run_code('echo "[$CI_B]"', context=ctx, envs={"CI_B": "two words"})
    assert "".join(env.logs.stdout) == "[two words]\n"
    assert "".join(sandbox.run_code('echo "[${CI_B-unset}]"', context=ctx).logs.stdout) == (
        "[unset]\n"
    )
    with pytest.raises(Exception, match="400"):
        sandbox.run_code("true", context=ctx, envs={"not-a-name": "x"})
    sandbox.remove_code_context(ctx)


def test_bash_language_default_context_and_interrupt(sandbox: Any) -> None:
    assert "".join(sandbox.run_code("echo via-language", language="bash").logs.stdout) == (
        "via-language\n"
    )
    sandbox.run_code("KEEP=1", language="bash")
    with pytest.raises(TimeoutException):
        sandbox.run_code("sleep 60", language="bash", timeout=1.5)
    start = time.monotonic()
    after = sandbox.run_code("echo keep=$KEEP", language="bash")
    assert "".join(after.logs.stdout) == "keep=1\n"  # ^C stopped sleep, the shell stayed
    assert time.monotonic() - start < budget(4)  # not after the rest of the 60 s sleep


def test_bash_exit_starts_a_new_shell(sandbox: Any) -> None:
    ctx = sandbox.create_code_context(language="bash")
    execution = sandbox.run_code("exit 3", context=ctx)
    assert execution.error is not None and execution.error.name == "ShellExited"
    assert "".join(sandbox.run_code("echo again", context=ctx).logs.stdout) == "again\n"
    sandbox.remove_code_context(ctx)


needs_node = pytest.mark.skipif(
    not (shutil.which("node") or shutil.which("nodejs")),
    reason="needs Node.js (apt-get install nodejs)",
)


@needs_node
def test_javascript_state_results_errors(sandbox: Any) -> None:
    ctx = sandbox.create_code_context(language="js")
    assert ctx.language == "javascript"
    first = sandbox.run_code("const base = 40;\nconsole.log('hi');\nbase + 2", context=ctx)
    assert first.logs.stdout == ["hi\n"]
    assert first.text == "42"
    assert sandbox.run_code("base * 2", context=ctx).text == "80"
    assert sandbox.run_code("({a: [1, 2]})", context=ctx).text == "{ a: [ 1, 2 ] }"
    err = sandbox.run_code("function f() { throw new TypeError('bad'); }\nf()", context=ctx)
    assert err.error is not None
    assert (err.error.name, err.error.value) == ("TypeError", "bad")
    assert "at f" in err.error.traceback and "jskernel" not in err.error.traceback
    awaited = sandbox.run_code(
        "const later = await new Promise(r => setTimeout(() => r(7), 50))\nlater * 6", context=ctx
    )
    assert awaited.text == "42"
    assert sandbox.run_code("later", context=ctx).text == "7"
    assert sandbox.run_code("Promise.resolve('p')", context=ctx).text == "p"
    assert sandbox.run_code("console.error('e')", context=ctx).logs.stderr == ["e\n"]
    assert sandbox.run_code("process.env.CI_J", context=ctx, envs={"CI_J": "v"}).text == "v"
    assert sandbox.run_code("process.env.CI_J", context=ctx).text is None
    sandbox.remove_code_context(ctx)


@needs_node
def test_javascript_interrupt_keeps_state(sandbox: Any) -> None:
    sandbox.run_code("globalThis.kept = 'yes'", language="javascript")
    with pytest.raises(TimeoutException):
        sandbox.run_code("while (true) {}", language="javascript", timeout=1.5)
    start = time.monotonic()
    assert sandbox.run_code("kept", language="javascript").text == "yes"
    assert time.monotonic() - start < budget(4)  # the loop was interrupted
    with pytest.raises(TimeoutException):
        sandbox.run_code("await new Promise(() => {})", language="javascript", timeout=1.5)
    assert sandbox.run_code("kept", language="javascript").text == "yes"


def test_languages_in_one_list(sandbox: Any) -> None:
    sandbox.run_code("true", language="bash")
    languages = {c.language for c in sandbox.list_code_contexts()}
    assert {"python", "bash"} <= languages


def test_smolagents_e2b_executor(e2b_env: Any) -> None:
    from smolagents.default_tools import FinalAnswerTool
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import E2BExecutor
    from smolagents.utils import AgentError

    executor = E2BExecutor(additional_imports=[], logger=AgentLogger(level=LogLevel.OFF))
    try:
        assert [r[0] for r in e2b_env.requests[-1:]] == ["POST"]
        out = executor("x_smol = 20\nprint('working')\nx_smol + 22")
        assert out.output == "42" and not out.is_final_answer
        assert "working" in out.logs
        executor.send_variables({"given": [1, 2, 3]})
        assert executor("sum(given)").output == "6"
        with pytest.raises(AgentError, match="ZeroDivisionError"):
            executor("1 / 0")
        image = executor(
            "import matplotlib.pyplot as plt\nfig = plt.figure()\nplt.plot([1, 2])\nfig"
        )
        assert image.output is not None and image.output.format == "PNG"
        executor.send_tools({"final_answer": FinalAnswerTool()})
        final = executor("final_answer({'answer': x_smol * 2})")
        assert final.is_final_answer and final.output == {"answer": 40}
    finally:
        executor.cleanup()
    assert e2b_env.requests[-1][0] == "DELETE"


def test_server_leaves_no_files_or_processes(tmp_path: Path) -> None:
    """Kernels killed mid-cell, removed and restarted: once the server stops, its TMPDIR
    (private runtime directory, ipc sockets, connection files, bash cells) is empty and
    no kernel survives."""
    import httpx
    from tests.codeinterp.conftest import kernel_pids, run_server

    with run_server(tmp_path) as server:
        url = server.url
        ctx = httpx.post(f"{url}/contexts", json={"language": "bash"}, timeout=60).json()
        with httpx.stream(
            "POST",
            f"{url}/execute",
            timeout=60,
            json={"code": "echo $$; sleep 30", "context_id": ctx["id"]},
        ) as r:
            stream = (json.loads(line) for line in r.iter_lines() if line)
            assert next(stream)["type"] == "number_of_executions"
            first = next(stream)
            assert first["type"] == "stdout", first
            shell_pid = int(first["text"])
            kernel_pid = int(
                Path(f"/proc/{shell_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            )
            os.kill(kernel_pid, 9)  # the bash kernel, mid-cell
            lines = list(stream)
        assert any(x.get("name") == "ContextRestarting" for x in lines), lines
        httpx.post(f"{url}/contexts/{ctx['id']}/restart", timeout=60)
        httpx.delete(f"{url}/contexts/{ctx['id']}", timeout=60)
        pid = server.proc.pid
        kernels = kernel_pids(pid)
        assert kernels  # the default Python context
    assert server.proc.returncode == 0
    assert not [k for k in kernels if Path(f"/proc/{k}").exists()]
    assert list(server.scratch.iterdir()) == []


def test_bash_output_is_streamed(sandbox: Any, tmp_path: Path) -> None:
    """'second' is echoed only once the client's on_stdout has seen 'first' (and said so
    with a file): were output delivered at the end, the command would wait in vain."""
    ack = tmp_path / "ack"
    lines: list[str] = []

    def on_stdout(m: Any) -> None:
        lines.append(m.line)
        if m.line == "first\n":
            ack.touch()

    sandbox.run_code(
        f"echo first; n=0; until [ -e {ack} ]; do n=$((n+1));"
        f" [ $n -gt {int(budget(10) / 0.05)} ] && {{ echo 'no ack'; break; }}; sleep 0.05; done;"
        " echo second",
        language="bash",
        on_stdout=on_stdout,
    )
    assert lines == ["first\n", "second\n"]
