"""The sync SDK (generated from the async one) against the in-process app."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any

import pytest

import dsec.errors as E
from dsec import AsyncSandbox, Client, CommandResult, Sandbox
from dsec.sdk import Commands, Files
from dsec.sdk.sync import runner
from dsec.testing import FakeEdge


def test_sync_sandbox_end_to_end(edge: FakeEdge, conn: dict[str, Any], tmp_path: Path) -> None:
    with Sandbox.create(image="busybox", labels={"a": "b"}, **conn) as sb:
        assert isinstance(sb, Sandbox) and sb.id.startswith("sb-fake-")
        assert isinstance(sb.commands, Commands) and isinstance(sb.files, Files)
        result = sb.commands.run("echo sync")
        assert isinstance(result, CommandResult) and result.stdout == "sync\n" and result.ok
        chunks: list[str] = []
        sb.commands.run("echo cb", on_stdout=chunks.append)
        assert chunks == ["cb\n"]
        events = list(sb.commands.stream("echo a"))
        assert [e.type for e in events] == ["stdout", "exit"]
        sb.files.write("/f.txt", "data")
        assert sb.files.read_text("/f.txt") == "data" and sb.files.exists("/f.txt")
        assert [f.path for f in sb.files.list("/")] == ["/f.txt"]
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "x").write_text("x")
        assert sb.files.upload_dir(tmp_path / "up", "/up") == 1
        assert sb.files.download_dir("/up", tmp_path / "down") == ["x"]
        assert sb.refresh().state == "running" and sb.info.state == "running"
        assert repr(sb).startswith("Sandbox(id='sb-fake-")
    assert sb.info.state == "stopped"
    assert edge.calls_to("kill_sandbox")[0]["req"].sandbox_id == sb.id


def test_sync_errors_and_classmethods(edge: FakeEdge, conn: dict[str, Any]) -> None:
    with pytest.raises(E.SandboxNotFound):
        Sandbox.connect("sb-fake-00000000", **conn)
    sb = Sandbox.create(**conn)
    assert Sandbox.connect(sb.id, **conn).info == sb.info
    assert [s.id for s in Sandbox.list(**conn)] == [sb.id]
    edge.inject_error("exec", E.QuotaExceeded("too many", limit=1))
    with pytest.raises(E.QuotaExceeded, match="too many"):
        sb.commands.run("true")
    sb.kill()
    with pytest.raises(E.SandboxStopped):
        sb.commands.run("true")


def test_sync_client(conn: dict[str, Any], tmp_path: Path) -> None:
    client = Client(**conn)
    assert client.node_info().node == "fake"
    assert [i.name for i in client.list_images()] == ["busybox"]
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "f").write_text("x")
    assert (
        client.build_image(context, "ws:2", "workspace", "busybox").layers[0].startswith("sha256:")
    )
    sb = Sandbox.create(client=client)  # a sync Client is accepted where AsyncClient is
    assert [s.id for s in client.list_sandboxes()] == [sb.id]
    client.close()


def test_breaking_out_of_a_stream_closes_it(edge: FakeEdge, conn: dict[str, Any]) -> None:
    edge.program("many", stdout="".join(f"{i}\n" for i in range(100)))
    sb = Sandbox.create(**conn)
    for event in sb.commands.stream("many"):
        assert event.data == "0\n"
        break
    assert sb.commands.run("echo still works").stdout == "still works\n"


def test_signatures_and_docs_are_copied() -> None:
    params = inspect.signature(Sandbox.create).parameters
    assert list(params)[:3] == ["tier", "image", "layers"]
    assert "memory_mb" in params and "transport" in params
    assert Sandbox.create.__doc__ == AsyncSandbox.create.__doc__
    assert "exit" in (Commands.stream.__doc__ or "")
    assert inspect.isgeneratorfunction(Commands.stream) is False  # returns an iterator
    with pytest.raises(AttributeError):
        Sandbox.no_such_method  # noqa: B018
    with pytest.raises(TypeError):
        Sandbox()  # build it with create()/connect()


def test_sync_api_from_its_own_loop_is_refused(conn: dict[str, Any]) -> None:
    sb = Sandbox.create(**conn)
    seen: list[BaseException] = []

    def reenter(chunk: str) -> None:
        try:
            sb.commands.run("true")
        except RuntimeError as exc:
            seen.append(exc)

    sb.commands.run("echo x", on_stdout=reenter)
    assert len(seen) == 1 and "async API" in str(seen[0])


def test_runner_is_one_daemon_thread(conn: dict[str, Any]) -> None:
    Sandbox.create(**conn)
    loop_threads = [t for t in threading.enumerate() if t.name == "dsec-sync-loop"]
    assert len(loop_threads) == 1 and loop_threads[0].daemon
    assert runner.loop().is_running()


async def test_sync_api_inside_a_running_loop_of_another_thread(conn: dict[str, Any]) -> None:
    # e.g. a notebook: the caller's loop is blocked while the call runs on the runner thread
    with Sandbox.create(**conn) as sb:
        assert sb.commands.run("echo nb").stdout == "nb\n"


def test_fake_edge_satisfies_the_edge_protocol() -> None:
    from dsec.contract.edge import EdgeAPI

    assert isinstance(FakeEdge(), EdgeAPI)
