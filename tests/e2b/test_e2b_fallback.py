"""An edge without ``InteractiveExec``: commands run over ``EdgeAPI.exec_stream``."""

from __future__ import annotations

import time
from typing import Any

import pytest
from e2b.sandbox.commands.command_handle import PtySize
from tests.timing import budget

from conftest import E2BServer, StreamOnlyEdge, serve_e2b
from dsec.e2b import InteractiveExec
from dsec.errors import CapabilityNotSupported
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
        deadline = time.monotonic() + budget(5)
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
        # Nothing was left running in the sandbox (a killed process leaves the table once
        # its stream has ended: give it a moment, as the other process-table tests do).
        deadline = time.monotonic() + budget(10)
        while sbx.commands.list() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sbx.commands.list() == []
    finally:
        sbx.kill()


class TierWithoutInteractiveEdge:
    """An edge that has ``start_process`` but refuses it for the sandbox's tier, as dsec's
    EdgeAgent does for a runtime without interactive processes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.refused = 0

    async def start_process(self, *args: Any, **kwargs: Any) -> Any:
        self.refused += 1
        raise CapabilityNotSupported("tier test has no interactive processes")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_tier_without_interactive_processes_falls_back(fake_edge: object) -> None:
    edge = TierWithoutInteractiveEdge(fake_edge)
    assert isinstance(edge, InteractiveExec)
    with serve_e2b(edge) as (root, _app, _loop):
        sbx = Sandbox.create("base", api_key="key-alice", api_url=root, sandbox_url=f"{root}/envd")
        try:
            r = sbx.commands.run("echo over; echo stream >&2")
            assert r.stdout == "over\n" and r.stderr == "stream\n" and edge.refused == 1
            with pytest.raises(SandboxException) as err:
                sbx.pty.create(size=PtySize(rows=10, cols=40))
            assert "unimplemented" in str(err.value).lower()
        finally:
            sbx.kill()
