"""An edge without ``InteractiveExec``: commands run over ``EdgeAPI.exec_stream``."""

from __future__ import annotations

import time

import pytest
from e2b.sandbox.commands.command_handle import PtySize

from conftest import E2BServer, StreamOnlyEdge
from dsec.e2b import InteractiveExec
from e2b import CommandExitException, Sandbox, SandboxException, TimeoutException


def test_fallback_edge_is_not_interactive(fake_edge: object) -> None:
    assert isinstance(fake_edge, InteractiveExec)
    assert not isinstance(StreamOnlyEdge(fake_edge), InteractiveExec)  # type: ignore[arg-type]


def test_commands_over_exec_stream(stream_only_server: E2BServer) -> None:
    sbx = Sandbox.create(
        "base",
        api_key="key-alice",
        api_url=stream_only_server.api_url,
        sandbox_url=stream_only_server.sandbox_url,
    )
    try:
        out: list[str] = []
        r = sbx.commands.run("echo a; echo b >&2; echo c", on_stdout=out.append, envs={"X": "1"})
        assert r.stdout == "a\nc\n" and r.stderr == "b\n" and "".join(out) == "a\nc\n"
        with pytest.raises(CommandExitException) as exc:
            sbx.commands.run("exit 4")
        assert exc.value.exit_code == 4
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 20", timeout=0.5)

        bg = sbx.commands.run("sleep 30", background=True)
        deadline = time.monotonic() + 5
        while [p.pid for p in sbx.commands.list()] != [bg.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.pid for p in sbx.commands.list()] == [bg.pid]
        assert sbx.commands.kill(bg.pid) is True
        with pytest.raises(CommandExitException) as exc:
            bg.wait()
        assert exc.value.exit_code == -1

        reader = sbx.commands.run("cat", background=True, stdin=True)
        with pytest.raises(SandboxException) as err:
            sbx.commands.send_stdin(reader.pid, "x\n")
        assert "unimplemented" in str(err.value).lower() and "stdin" in str(err.value)
        reader.kill()
        with pytest.raises(SandboxException) as err:
            sbx.pty.create(size=PtySize(rows=10, cols=40))
        assert "unimplemented" in str(err.value).lower()
        # Nothing was left running in the sandbox.
        assert sbx.commands.list() == []
    finally:
        sbx.kill()
