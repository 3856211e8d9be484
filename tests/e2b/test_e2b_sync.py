"""The unmodified ``e2b.Sandbox`` (sync) against dsec's E2B API over the fake edge."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2b.sandbox.commands.command_handle import PtySize
from tests.timing import budget

from conftest import E2BServer
from dsec.models import SandboxRef
from e2b import (
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    TimeoutException,
)


@pytest.fixture
def sbx(e2b_server: E2BServer) -> Iterator[Sandbox]:
    s = Sandbox.create("base", envs={"GREETING": "hello"}, metadata={"suite": "sync"})
    yield s
    s.kill()


def test_lifecycle_info_timeout_connect_kill(e2b_server: E2BServer) -> None:
    s = Sandbox.create("base", timeout=120, metadata={"owner": "lifecycle", "n": "1"})
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id
    assert info.template_id == "base" and info.metadata == {"owner": "lifecycle", "n": "1"}
    assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
    s.set_timeout(600)
    assert (s.get_info().end_at - info.started_at).total_seconds() > 590
    # The fake edge created it from the dsec image the template maps to.
    assert (
        e2b_server.call(
            e2b_server.edge.get_sandbox(SandboxRef(sandbox_id=s.sandbox_id), "alice")
        ).image
        == "e2b-base"
    )
    again = Sandbox.connect(s.sandbox_id)
    assert again.commands.run("echo connected").stdout == "connected\n"
    assert s.is_running()
    assert s.kill() is True
    assert s.kill() is False
    assert not s.is_running()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(s.sandbox_id)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_list_metadata_filter_and_pagination(e2b_server: E2BServer) -> None:
    made = [Sandbox.create("base", metadata={"batch": "pg", "i": str(i)}) for i in range(3)]
    try:
        paginator = Sandbox.list(query=SandboxQuery(metadata={"batch": "pg"}), limit=2)
        first = paginator.next_items()
        assert len(first) == 2 and paginator.has_next
        second = paginator.next_items()
        assert len(second) == 1 and not paginator.has_next
        ids = {s.sandbox_id for s in first + second}
        assert ids == {s.sandbox_id for s in made}
        one = Sandbox.list(query=SandboxQuery(metadata={"batch": "pg", "i": "1"})).next_items()
        assert [s.sandbox_id for s in one] == [made[1].sandbox_id]
    finally:
        for s in made:
            s.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"batch": "pg"})).next_items() == []


def test_run_foreground_envs_cwd_user_and_streaming(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $GREETING $EXTRA; pwd; whoami", envs={"EXTRA": "world"}, cwd="/tmp")
    assert r.stdout == "hello world\n/tmp\nuser\n" and r.exit_code == 0  # E2B's default user
    assert sbx.commands.run("whoami; echo $HOME", user="root").stdout == "root\n/root\n"
    # streamed as printed, not delivered at the end: each line waits until the client's
    # on_stdout has seen the one before it (and said so by writing /tmp/ack<i>)
    chunks: list[str] = []
    errs: list[str] = []
    acked: list[int] = []

    def on_stdout(chunk: str) -> None:
        chunks.append(chunk)
        for i in (1, 2, 3):
            if f"out{i}\n" in "".join(chunks) and i not in acked:
                acked.append(i)
                sbx.files.write(f"/tmp/ack{i}", "")

    polls = int(budget(5) / 0.05)
    r = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; n=0; until [ -e /tmp/ack$i ]; do"
        f' n=$((n+1)); [ $n -gt {polls} ] && {{ echo "no ack$i"; break; }}; sleep 0.05; done;'
        " done",
        on_stdout=on_stdout,
        on_stderr=errs.append,
    )
    assert "".join(chunks) == "out1\nout2\nout3\n" and acked == [1, 2, 3]
    assert "".join(errs) == "err1\nerr2\nerr3\n"
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3 and exc.value.stdout == "partial\n"


def test_command_timeout_kills_the_process(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("echo $$ > /tmp/pid; sleep 30", timeout=1)
    assert time.monotonic() - started < budget(10)  # the 1 s time-out, not the 30 s sleep
    deadline = time.monotonic() + budget(5)
    while sbx.commands.list() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sbx.commands.list() == []


def test_background_list_stdin_connect_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    procs = sbx.commands.list()
    assert [p.pid for p in procs] == [handle.pid]
    assert procs[0].cmd == "/bin/bash" and procs[0].args == ["-l", "-c", "cat"]
    sbx.commands.send_stdin(handle.pid, "line one\n")
    sbx.commands.stream_input(handle.pid, ["two\n", b"three\n"])
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "line one\ntwo\nthree\n" and result.exit_code == 0
    assert sbx.commands.list() == []

    sleeper = sbx.commands.run("echo started; sleep 30", background=True)
    other = sbx.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as exc:
        sleeper.wait()
    assert exc.value.exit_code == -1
    with pytest.raises(CommandExitException):
        other.wait()
    assert sbx.commands.kill(sleeper.pid) is False
    assert sbx.commands.list() == []


def test_disconnect_keeps_the_process_running(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 0.5; echo done > /tmp/bg", background=True)
    handle.disconnect()
    assert [p.pid for p in sbx.commands.list()] == [handle.pid]
    deadline = time.monotonic() + budget(5)
    while not sbx.files.exists("/tmp/bg") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sbx.files.read("/tmp/bg") == "done\n"


def test_files_roundtrip(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/dir/a.txt", "alpha")
    assert info.path == "/home/user/dir/a.txt" and info.type == FileType.FILE
    assert sbx.files.read("/home/user/dir/a.txt") == "alpha"
    assert sbx.commands.run("cat /home/user/dir/a.txt").stdout == "alpha"
    blob = bytes(range(256)) * 40
    sbx.files.write_files(
        [
            {"path": "/home/user/dir/b.bin", "data": blob},
            {"path": "/home/user/dir/sub/c.txt", "data": "c"},
        ]
    )
    assert bytes(sbx.files.read("/home/user/dir/b.bin", format="bytes")) == blob
    sbx.files.write("/home/user/gz.txt", "zipped" * 100, gzip=True)
    assert sbx.files.read("/home/user/gz.txt") == "zipped" * 100
    names = sorted(e.name for e in sbx.files.list("/home/user/dir"))
    assert names == ["a.txt", "b.bin", "sub"]
    deep = sorted(e.path for e in sbx.files.list("/home/user/dir", depth=2))
    assert "/home/user/dir/sub/c.txt" in deep
    st = sbx.files.get_info("/home/user/dir/b.bin")
    assert st.size == len(blob) and st.type == FileType.FILE and st.permissions == "-rw-r--r--"
    assert sbx.files.exists("/home/user/dir/a.txt") and not sbx.files.exists("/nope")
    moved = sbx.files.rename("/home/user/dir/a.txt", "/home/user/moved.txt")
    assert moved.path == "/home/user/moved.txt" and not sbx.files.exists("/home/user/dir/a.txt")
    assert sbx.files.make_dir("/home/user/newdir") is True
    assert sbx.files.make_dir("/home/user/newdir") is False
    assert sbx.files.get_info("/home/user/newdir").type == FileType.DIR
    sbx.files.remove("/home/user/dir")
    assert not sbx.files.exists("/home/user/dir/sub/c.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/missing.txt")
    sbx.files.remove("/home/user/missing.txt")  # as envd: removing nothing succeeds


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/watched")
    sbx.files.write("/tmp/watched/old.txt", "x")
    handle = sbx.files.watch_dir("/tmp/watched", include_entry=True)
    sbx.files.write("/tmp/watched/new.txt", "1")
    sbx.files.remove("/tmp/watched/old.txt")
    events = handle.get_new_events()
    kinds = {(e.name, e.type) for e in events}
    assert ("new.txt", FilesystemEventType.CREATE) in kinds
    assert ("old.txt", FilesystemEventType.REMOVE) in kinds
    created = next(e for e in events if e.name == "new.txt")
    assert created.entry is not None and created.entry.size == 1
    time.sleep(0.01)
    sbx.files.write("/tmp/watched/new.txt", "12")
    # inotify: each change as it happened (the content, then the mode the write sets)
    assert [(e.name, e.type) for e in handle.get_new_events()] == [
        ("new.txt", FilesystemEventType.WRITE),
        ("new.txt", FilesystemEventType.CHMOD),
    ]
    handle.stop()


def test_pty(sbx: Sandbox) -> None:
    """An interactive shell on a PTY, driven as a person would: each line typed once the
    shell shows it is ready for it (input typed before the shell started readline could
    be read or echoed in another order on a busy machine)."""
    out = bytearray()
    results: list[Any] = []
    term = sbx.pty.create(PtySize(rows=24, cols=100), timeout=budget(20))
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=120))
    reader = threading.Thread(target=lambda: results.append(term.wait(on_pty=out.extend)))
    reader.start()

    def shown(text: str) -> bool:
        deadline = time.monotonic() + budget(10)
        while text not in out.decode(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.02)
        return text in out.decode(errors="replace")

    assert shown("$ "), out.decode(errors="replace")  # the prompt
    sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((40+2))\n")
    assert shown("pty-42\r\n"), out.decode(errors="replace")
    sbx.pty.send_stdin(term.pid, b"exit 0\n")
    reader.join(budget(20))
    assert results and results[0].exit_code == 0
    text = out.decode(errors="replace")
    assert "30 120\r\n" in text
