"""The unmodified ``e2b.AsyncSandbox`` against dsec's E2B API over the fake edge."""

from __future__ import annotations

import asyncio

import pytest
from tests.timing import budget

from conftest import E2BServer
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEvent,
    FilesystemEventType,
    SandboxNotFoundException,
    SandboxQuery,
    TimeoutException,
)


async def test_async_lifecycle_and_commands(e2b_server: E2BServer) -> None:
    sbx = await AsyncSandbox.create("base", metadata={"suite": "async"}, envs={"A": "1"})
    try:
        info = await sbx.get_info()
        assert info.metadata == {"suite": "async"}
        listed = await AsyncSandbox.list(
            query=SandboxQuery(metadata={"suite": "async"})
        ).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        await sbx.set_timeout(900)
        out: list[str] = []
        r = await sbx.commands.run("echo $A; echo two", on_stdout=out.append, cwd="/home/user")
        assert r.stdout == "1\ntwo\n" and "".join(out) == "1\ntwo\n"
        with pytest.raises(CommandExitException) as exc:
            await sbx.commands.run("echo bad >&2; exit 7")
        assert exc.value.exit_code == 7 and exc.value.stderr == "bad\n"
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 20", timeout=0.5)
        async with asyncio.timeout(budget(5)):  # the server kills it at the same deadline
            while await sbx.commands.list():
                await asyncio.sleep(0.05)

        bg = await sbx.commands.run("read x; echo got:$x", background=True, stdin=True)
        assert [p.pid for p in await sbx.commands.list()] == [bg.pid]
        attached = await sbx.commands.connect(bg.pid)
        await sbx.commands.send_stdin(bg.pid, "42\n")
        assert (await bg.wait()).stdout == "got:42\n"
        assert (await attached.wait()).exit_code == 0

        killme = await sbx.commands.run("sleep 30", background=True)
        assert await killme.kill() is True
        with pytest.raises(CommandExitException):
            await killme.wait()
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.commands.run("echo via-connect")).stdout == "via-connect\n"
    finally:
        assert await sbx.kill() is True
    assert await sbx.kill() is False
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)


async def test_async_files_and_watch_stream(e2b_server: E2BServer) -> None:
    sbx = await AsyncSandbox.create("base")
    try:
        await sbx.files.write("/tmp/w/a.txt", "a")
        assert await sbx.files.read("/tmp/w/a.txt") == "a"
        await sbx.files.write_files([{"path": "/tmp/w/b.txt", "data": b"b"}])
        assert sorted(e.name for e in await sbx.files.list("/tmp/w")) == ["a.txt", "b.txt"]
        assert await sbx.files.exists("/tmp/w/b.txt")
        assert (await sbx.files.get_info("/tmp/w/b.txt")).size == 1
        await sbx.files.rename("/tmp/w/b.txt", "/tmp/w/c.txt")
        assert await sbx.files.make_dir("/tmp/w/d") is True

        events: list[FilesystemEvent] = []
        got = asyncio.Event()

        def on_event(ev: FilesystemEvent) -> None:
            events.append(ev)
            if any(e.type == FilesystemEventType.REMOVE for e in events):
                got.set()

        handle = await sbx.files.watch_dir("/tmp/w", on_event, recursive=True)
        await sbx.files.write("/tmp/w/d/deep.txt", "deep")
        await sbx.files.remove("/tmp/w/a.txt")
        await asyncio.wait_for(got.wait(), 5)
        await handle.stop()
        kinds = {(e.name, e.type) for e in events}
        assert ("d/deep.txt", FilesystemEventType.CREATE) in kinds
        assert ("a.txt", FilesystemEventType.REMOVE) in kinds
        await sbx.files.remove("/tmp/w")
        assert not await sbx.files.exists("/tmp/w/c.txt")
    finally:
        await sbx.kill()
