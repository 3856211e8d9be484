"""The unmodified e2b-code-interpreter client against dsec's code-interpreter server."""

from __future__ import annotations

import base64
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.codeinterp.conftest import CodeInterpreterServer, kernel_pids
from tests.conftest import wait_until
from tests.timing import budget

from e2b import NotFoundException, SandboxException, TimeoutException

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _dead(pid: int) -> bool:
    """``pid`` exited and its parent can tell: gone, or a zombie whose other threads are gone
    too (a multi-threaded process's leader shows ``Z`` before its parent can reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(os.listdir(f"/proc/{pid}/task")) == 1
    except OSError:
        return True


def test_state_persists_across_calls(sandbox: Any) -> None:
    first = sandbox.run_code("state_x = 41\nprint('set')")
    assert first.error is None
    assert first.logs.stdout == ["set\n"]
    second = sandbox.run_code("state_x + 1")
    assert second.text == "42"
    assert second.results[0].is_main_result
    assert second.execution_count == first.execution_count + 1


def test_string_result_loses_its_quotes(sandbox: Any) -> None:
    assert sandbox.run_code("'abc' * 2").text == "abcabc"


def test_matplotlib_figure_comes_back_as_png(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('squares')\n"
        "plt.show()\n"
    )
    assert execution.error is None, execution.error
    pngs = [r for r in execution.results if r.png]
    assert len(pngs) == 1
    assert not pngs[0].is_main_result
    assert base64.b64decode(pngs[0].png).startswith(PNG_MAGIC)
    assert "png" in pngs[0].formats()


def test_rich_results_html_markdown_latex_json(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "from IPython.display import display, HTML, Markdown, Latex, JSON, SVG\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('# title'))\n"
        "display(Latex(r'$x^2$'))\n"
        "display(JSON({'a': [1, 2]}))\n"
        "display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"><rect/></svg>'))\n"
    )
    assert execution.error is None, execution.error
    by_format = {f: r for r in execution.results for f in r.formats() if f != "text"}
    assert by_format["html"].html == "<b>bold</b>"
    assert by_format["markdown"].markdown == "# title"
    assert by_format["latex"].latex == "$x^2$"
    assert by_format["json"].json == {"a": [1, 2]}
    assert "<rect" in by_format["svg"].svg


def test_dataframe_data_and_html(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})"
    )
    assert execution.error is None, execution.error
    result = execution.results[0]
    assert result.is_main_result
    assert result.data == {"a": [1, 2], "b": ["x", "y"]}
    assert "<table" in result.html


def test_exception_with_traceback(sandbox: Any) -> None:
    execution = sandbox.run_code("def broken():\n    return 1 / 0\nbroken()")
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    tb = execution.error.traceback
    assert "broken()" in tb and "return 1 / 0" in tb
    assert "\x1b[" not in tb  # no ANSI colours, as E2B's template configures IPython
    # the kernel survives the exception
    assert sandbox.run_code("'still here'").text == "still here"


def test_error_callback_and_streaming_callbacks(sandbox: Any) -> None:
    seen: dict[str, list[Any]] = {"out": [], "err": [], "res": [], "error": []}
    sandbox.run_code(
        "import sys\nprint('o')\nprint('e', file=sys.stderr)\ndisplay(7)\nraise KeyError('k')",
        on_stdout=seen["out"].append,
        on_stderr=seen["err"].append,
        on_result=seen["res"].append,
        on_error=seen["error"].append,
    )
    assert [m.line for m in seen["out"]] == ["o\n"]
    assert [m.line for m in seen["err"]] == ["e\n"]
    assert seen["err"][0].error is True
    assert [r.text for r in seen["res"]] == ["7"]
    assert seen["error"][0].name == "KeyError"


def test_output_is_streamed_as_it_is_produced(sandbox: Any, tmp_path: Path) -> None:
    """The cell prints 'second' only once the client's on_stdout has seen 'first' (and said
    so with a file): were output delivered at the end, the cell would wait in vain."""
    ack = tmp_path / "ack"
    lines: list[str] = []

    def on_stdout(m: Any) -> None:
        lines.append(m.line)
        if m.line == "first\n":
            ack.touch()

    sandbox.run_code(
        f"import os, time\nprint('first', flush=True)\nfor _ in range({int(budget(10) / 0.05)}):\n"
        f"    if os.path.exists({str(ack)!r}):\n        break\n    time.sleep(0.05)\n"
        "else:\n    print('no ack')\nprint('second')",
        on_stdout=on_stdout,
    )
    assert lines == ["first\n", "second\n"]


def test_timeout_interrupts_the_kernel(sandbox: Any) -> None:
    sandbox.run_code("before_timeout = 'kept'")
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\ntime.sleep(60)", timeout=1.5)
    assert time.monotonic() - start < budget(5)  # the 1.5 s time-out, not the 60 s sleep
    # The server saw the client go away and interrupted the sleep: the next call runs at
    # once, and the interrupt did not restart the kernel (its state is still there).
    start = time.monotonic()
    assert sandbox.run_code("before_timeout").text == "kept"
    assert time.monotonic() - start < budget(4)  # not after the rest of the 60 s sleep


def test_interrupt_ignored_restarts_the_kernel(
    ci_server: CodeInterpreterServer, sandbox: Any
) -> None:
    ctx = sandbox.create_code_context()
    code = (
        "import time, signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "stubborn = 1\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(TimeoutException):
        sandbox.run_code(code, context=ctx, timeout=1.5)
    execution = sandbox.run_code("stubborn", context=ctx)
    assert execution.error is not None and execution.error.name == "NameError"
    assert any("restarted" in line for line in execution.logs.stderr)
    sandbox.remove_code_context(ctx)


def test_env_vars_per_call(sandbox: Any) -> None:
    code = "import os\nos.environ.get('CI_FOO', 'unset') + '|' + os.environ['DSEC_CI_MARKER']"
    tricky = "bar 'q' \"d\"\n$x \\ ${y}"
    printed = sandbox.run_code(
        "import os\nprint(os.environ['CI_FOO'], end='')", envs={"CI_FOO": tricky}
    )
    assert printed.logs.stdout == [tricky]
    assert sandbox.run_code(code).text == "unset|from-the-server-env"
    # a variable that existed before the call gets its value back
    changed = sandbox.run_code(code, envs={"DSEC_CI_MARKER": "overridden"})
    assert changed.text.endswith("|overridden")
    assert sandbox.run_code(code).text.endswith("|from-the-server-env")
    # subprocesses see the call's variables
    sub = sandbox.run_code(
        "import subprocess\nsubprocess.check_output(['sh', '-c', "
        "'echo $CI_SUB'], text=True).strip()",
        envs={"CI_SUB": "child"},
    )
    assert sub.text == "child"


def test_execution_count_not_consumed_by_env_helpers(sandbox: Any) -> None:
    a = sandbox.run_code("1", envs={"CI_A": "1"})
    b = sandbox.run_code("2")
    assert b.execution_count == a.execution_count + 1


def test_contexts_create_list_restart_remove(sandbox: Any, tmp_path: Any) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    ctx = sandbox.create_code_context(cwd=str(workdir), language="python")
    assert ctx.language == "python" and ctx.cwd == str(workdir)
    assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
    assert sandbox.run_code("import os\nos.getcwd()", context=ctx).text == str(workdir)
    sandbox.run_code("only_here = 5", context=ctx)
    assert sandbox.run_code("only_here", context=ctx).text == "5"
    assert sandbox.run_code("only_here").error.name == "NameError"  # the default context
    sandbox.restart_code_context(ctx)
    assert sandbox.run_code("only_here", context=ctx).error.name == "NameError"
    assert sandbox.run_code("import os\nos.getcwd()", context=ctx).text == str(workdir)
    sandbox.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sandbox.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sandbox.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sandbox.restart_code_context(ctx)
    with pytest.raises(NotFoundException):
        sandbox.remove_code_context(ctx)


def test_bad_requests_are_refused(sandbox: Any, tmp_path: Any) -> None:
    with pytest.raises(SandboxException, match="400"):
        sandbox.create_code_context(cwd=str(tmp_path / "missing"))
    with pytest.raises(SandboxException, match=r"400.*not available"):
        sandbox.create_code_context(language="cobol")
    with pytest.raises(SandboxException, match=r"400.*not available"):
        sandbox.run_code("1", language="cobol")


def test_kernel_death_is_reported_and_recovered(
    ci_server: CodeInterpreterServer, sandbox: Any
) -> None:
    ctx = sandbox.create_code_context()
    sandbox.run_code("doomed = 1", context=ctx)
    execution = sandbox.run_code(
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", context=ctx
    )
    assert execution.error is not None
    assert execution.error.name == "ContextRestarting"
    assert "SIGKILL" in execution.error.value
    after = sandbox.run_code("doomed", context=ctx)
    assert after.error is not None and after.error.name == "NameError"
    assert sandbox.run_code("1 + 1", context=ctx).text == "2"
    restarted = [c for c in httpx.get(f"{ci_server.url}/contexts").json() if c["id"] == ctx.id]
    assert restarted[0]["restarts"] == 1
    sandbox.remove_code_context(ctx)


def test_kernel_killed_while_idle(ci_server: CodeInterpreterServer, sandbox: Any) -> None:
    ctx = sandbox.create_code_context()
    pid = int(sandbox.run_code("import os\nos.getpid()", context=ctx).text)
    os.kill(pid, 9)
    assert wait_until(lambda: _dead(pid), timeout_s=5)
    execution = sandbox.run_code("'alive'", context=ctx)
    assert execution.text == "alive"
    assert any("state was lost" in line for line in execution.logs.stderr)
    sandbox.remove_code_context(ctx)


def test_huge_output_is_bounded(sandbox: Any) -> None:
    # the test server forwards at most 1 MiB per execution
    execution = sandbox.run_code("for i in range(200):\n    print('x' * 50_000)")
    total = sum(len(s) for s in execution.logs.stdout)
    assert 500_000 < total <= 1 << 20
    assert any("output truncated" in s for s in execution.logs.stderr)
    assert sandbox.run_code("'next'").text == "next"


def test_one_context_serializes_two_contexts_run_in_parallel(sandbox: Any, tmp_path: Path) -> None:
    other = sandbox.create_code_context()
    sandbox.run_code("1", context=other)  # its kernel is up: the meeting below is not its start
    results: dict[str, Any] = {}

    def run(name: str, code: str = "import time\ntime.sleep(1)\n'done'", **kw: Any) -> None:
        results[name] = sandbox.run_code(code, **kw)

    def meet(me: str, peer: str) -> str:
        """A cell that says it is running, then waits for its peer to say so: 'together'
        only if both run at once ('alone' after its bounded wait if they were serialized)."""
        mine, theirs = str(tmp_path / me), str(tmp_path / peer)
        return (
            f"import os, time\nopen({mine!r}, 'w').close()\n"
            f"for _ in range({int(budget(10) / 0.05)}):\n"
            f"    if os.path.exists({theirs!r}):\n        break\n    time.sleep(0.05)\n"
            "else:\n    raise SystemExit('alone')\n'together'"
        )

    threads = [
        threading.Thread(target=run, args=("a", meet("a", "b"))),
        threading.Thread(target=run, args=("b", meet("b", "a")), kwargs={"context": other}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget(30))
    assert results["a"].text == results["b"].text == "together"

    start = time.monotonic()
    threads = [
        threading.Thread(target=run, args=(n,), kwargs={"context": other}) for n in ("c", "d")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget(30))
    assert time.monotonic() - start >= 2.0  # one after the other: 2 x 1 s
    counts = sorted(results[n].execution_count for n in ("c", "d"))
    assert counts[1] == counts[0] + 1
    sandbox.remove_code_context(other)


def test_shell_escape_and_magics(sandbox: Any) -> None:
    execution = sandbox.run_code("!echo from-shell\n%time 1+1")
    assert execution.error is None
    assert any("from-shell" in s for s in execution.logs.stdout)


def test_user_namespace_is_clean(sandbox: Any) -> None:
    names = sandbox.run_code("sorted(n for n in dir() if 'dsec' in n or n == 'os')").text
    assert "dsec" not in names


@pytest.mark.asyncio
async def test_async_client(e2b_env: Any) -> None:
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create()
    try:
        lines: list[str] = []
        execution = await sbx.run_code(
            "print('async hi')\n6 * 7", on_stdout=lambda m: lines.append(m.line)
        )
        assert execution.text == "42"
        assert lines == ["async hi\n"]
        ctx = await sbx.create_code_context()
        assert ctx.id in [c.id for c in await sbx.list_code_contexts()]
        await sbx.restart_code_context(ctx)
        await sbx.remove_code_context(ctx)
        with pytest.raises(TimeoutException):
            await sbx.run_code("import time\ntime.sleep(30)", timeout=1)
        assert (await sbx.run_code("'ok'")).text == "ok"
    finally:
        await sbx.kill()


def test_no_kernel_leaks(ci_server: CodeInterpreterServer, sandbox: Any) -> None:
    before = len(kernel_pids(ci_server.proc.pid))
    for _ in range(3):
        ctx = sandbox.create_code_context()
        sandbox.run_code("1", context=ctx)
        sandbox.restart_code_context(ctx)
        sandbox.remove_code_context(ctx)
    # a removed context's kernel exits (and is reaped) just after the answer
    assert wait_until(lambda: len(kernel_pids(ci_server.proc.pid)) == before, timeout_s=5)


def test_execution_right_after_an_error_runs(sandbox: Any) -> None:
    # ipykernel aborts requests that arrive just after an error when stop_on_error is set;
    # the server serializes executions itself, so none may be aborted
    for i in range(10):
        assert sandbox.run_code("raise ValueError('v')").error.name == "ValueError"
        assert sandbox.run_code(f"{i} * 2").text == str(i * 2)


def test_chart_data_of_matplotlib_figures(sandbox: Any) -> None:
    from e2b_code_interpreter.charts import BarChart, ChartType, LineChart, PieChart, SuperChart

    line = (
        sandbox.run_code(
            "import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\nplt.title('growth')\n"
            "plt.xlabel('n')\nplt.show()"
        )
        .results[0]
        .chart
    )
    assert isinstance(line, LineChart) and line.type == ChartType.LINE
    assert line.title == "growth" and line.x_label == "n"
    assert line.elements[0].label == "squares"
    assert line.elements[0].points == [(1, 1), (2, 4), (3, 9)]
    bar = sandbox.run_code("plt.bar(['a', 'b'], [3, 1])\nplt.show()").results[0].chart
    assert isinstance(bar, BarChart)
    assert [(e.label, e.value) for e in bar.elements] == [("a", 3), ("b", 1)]
    pie = sandbox.run_code("plt.pie([1, 3], labels=['one', 'three'])\nplt.show()").results[0]
    assert isinstance(pie.chart, PieChart)
    assert [(e.label, e.angle) for e in pie.chart.elements] == [("one", 90.0), ("three", 270.0)]
    both = (
        sandbox.run_code(
            "fig, (a, b) = plt.subplots(1, 2)\na.plot([1, 2])\nb.bar(['x'], [1])\nplt.show()"
        )
        .results[0]
        .chart
    )
    assert isinstance(both, SuperChart)
    assert [c.type for c in both.elements] == [ChartType.LINE, ChartType.BAR]


def test_execute_mime_bundles_flag_is_parsed() -> None:
    """dsec's ``mime_bundles`` extension of ``/execute`` (what ``/run_jupyter`` sends)."""
    from dsec.guest.codeinterp.protocol import RequestError, parse_execute

    assert parse_execute(b'{"code": "1"}').mime_bundles is False
    assert parse_execute(b'{"code": "1", "mime_bundles": true}').mime_bundles is True
    with pytest.raises(RequestError) as e:
        parse_execute(b'{"code": "1", "mime_bundles": "yes"}')
    assert e.value.status == 422
