"""The unmodified ``e2b`` SDK against a real ``dsec serve`` on the container tier.

A full server (apiserver + edge, ``dsec.server.BackgroundServer``) with the container
runtime; the SDK is pointed at it through ``E2B_API_URL=<url>/e2b``,
``E2B_SANDBOX_URL=<url>/e2b/envd`` and ``E2B_API_KEY``, as a user would. Template
``container/busybox`` is the dsec image ``busybox`` (built once into the shared test
layer cache). Interactive processes (stdin after start, kill, connect, pty) go through
the edge's ``start_process`` and the container exec server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b.sandbox.commands.command_handle import PtySize
from tests.conftest import container_server
from tests.timing import budget

from conftest import pause_during_stream
from dsec.models import PauseRequest, SandboxRef, SetTTLRequest
from dsec.wire import validated
from e2b import (
    CommandExitException,
    FileNotFoundException,
    FileType,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    TimeoutException,
)

pytestmark = pytest.mark.root

TEMPLATE = "container/busybox"


class RealServer:
    """The server's URLs and keys (``other_key`` belongs to another owner)."""

    def __init__(self, url: str, api_key: str, other_key: str, bg: Any) -> None:
        self.url = url
        self.api_key = api_key
        self.other_key = other_key
        self.bg = bg


@pytest.fixture(scope="module")
def real(dsec_home_root: Path, shared_layers: Path) -> Iterator[RealServer]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = dsec_home_root / "e2b-real"
    with container_server(home, shared_layers, "busybox") as bg:
        env = {
            "E2B_API_URL": f"{bg.url}/e2b",
            "E2B_SANDBOX_URL": f"{bg.url}/e2b/envd",
            "E2B_API_KEY": bg.api_key,
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield RealServer(bg.url, bg.api_key, bg.keys.create_key("e2b-other"), bg)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="module")
def sbx(real: RealServer) -> Iterator[Sandbox]:
    s = Sandbox.create(TEMPLATE, envs={"GREETING": "hello"}, metadata={"suite": "real"})
    yield s
    s.kill()


def test_lifecycle_list_info_timeout_pause_connect_kill(real: RealServer) -> None:
    s = Sandbox.create(TEMPLATE, timeout=120, metadata={"batch": "real-lc"}, envs={"A": "1"})
    try:
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.metadata == {"batch": "real-lc"}
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
        s.set_timeout(600)
        assert (s.get_info().end_at - info.started_at).total_seconds() > 590
        listed = Sandbox.list(query=SandboxQuery(metadata={"batch": "real-lc"})).next_items()
        assert [x.sandbox_id for x in listed] == [s.sandbox_id]
        assert s.commands.run("echo a=$A").stdout == "a=1\n"
        s.commands.run("echo kept > /tmp/state")

        assert s.pause() is True
        assert s.get_info().state.value == "paused"
        again = Sandbox.connect(s.sandbox_id)  # resumes it
        assert s.get_info().state.value == "running"
        assert again.commands.run("cat /tmp/state").stdout == "kept\n"

        # another key's owner sees nothing
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(s.sandbox_id, api_key=real.other_key)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(s.sandbox_id, api_key=real.other_key)
        assert Sandbox.kill(s.sandbox_id, api_key=real.other_key) is False
        others = Sandbox.list(api_key=real.other_key).next_items()
        assert s.sandbox_id not in {x.sandbox_id for x in others}
    finally:
        assert s.kill() is True
    assert s.kill() is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(s.sandbox_id)


def test_run_foreground(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $GREETING $EXTRA; pwd; id -u", envs={"EXTRA": "world"}, cwd="/tmp")
    assert r.stdout == "hello world\n/tmp\n0\n" and r.exit_code == 0
    assert sbx.commands.run("id -u", user="65534").stdout == "65534\n"
    # streamed as printed, not delivered at the end: each line waits until the client's
    # on_stdout has seen the one before it (and said so by writing /tmp/ack<i>)
    out: list[str] = []
    err: list[str] = []
    acked: list[int] = []

    def on_stdout(chunk: str) -> None:
        out.append(chunk)
        for i in (1, 2, 3):
            if f"out{i}\n" in "".join(out) and i not in acked:
                acked.append(i)
                sbx.files.write(f"/tmp/ack{i}", "")

    polls = int(budget(5) / 0.05)
    r = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; n=0; until [ -e /tmp/ack$i ]; do"
        f' n=$((n+1)); [ $n -gt {polls} ] && {{ echo "no ack$i"; break; }}; sleep 0.05; done;'
        " done",
        on_stdout=on_stdout,
        on_stderr=err.append,
    )
    assert "".join(out) == "out1\nout2\nout3\n" and acked == [1, 2, 3]
    assert "".join(err) == "err1\nerr2\nerr3\n"
    # more output than the edge buffers (1 MiB) and the pipes hold: nothing lost
    big = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
    assert len(big.stdout) == 3_000_000 and set(big.stdout) == {"a"}
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3 and exc.value.stdout == "partial\n"
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - started < budget(10)  # the 1 s time-out, not the 30 s sleep
    wait_no_processes(sbx)  # the timed-out command was killed


def wait_no_processes(sbx: Sandbox, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + budget(timeout_s)
    while sbx.commands.list() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sbx.commands.list() == []


def test_background_stdin_list_connect_kill(sbx: Sandbox) -> None:
    wait_no_processes(sbx)
    handle = sbx.commands.run("cat; echo eof >&2", background=True, stdin=True)
    assert [p.pid for p in sbx.commands.list()] == [handle.pid]
    sbx.commands.send_stdin(handle.pid, "line one\n")
    sbx.commands.send_stdin(handle.pid, "two\n")
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert result.stdout == "line one\ntwo\n" and result.stderr == "eof\n"
    assert result.exit_code == 0

    sleeper = sbx.commands.run("echo started; sleep 30", background=True)
    attached = sbx.commands.connect(sleeper.pid)
    assert {p.pid for p in sbx.commands.list()} == {sleeper.pid}
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    with pytest.raises(CommandExitException):
        attached.wait()
    assert sbx.commands.kill(sleeper.pid) is False
    wait_no_processes(sbx)
    # the process group died with it: no sleep left in the sandbox
    ps = sbx.commands.run("ps -o pid,args").stdout
    assert "ps -o pid,args" in ps and "sleep 30" not in ps


def test_pty(sbx: Sandbox) -> None:
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=100), timeout=20)
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=120))
    sbx.pty.send_stdin(term.pid, b"stty size; [ -t 0 ] && echo is-tty; echo pty-$((40+2))\n")
    sbx.pty.send_stdin(term.pid, b"exit 0\n")
    result = term.wait(on_pty=out.extend)
    assert result.exit_code == 0
    text = out.decode(errors="replace")
    assert "pty-42" in text and "30 120" in text and "is-tty" in text


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("/srv/dir/a.txt", "alpha")
    assert info.path == "/srv/dir/a.txt" and info.type == FileType.FILE
    assert sbx.files.read("/srv/dir/a.txt") == "alpha"
    assert sbx.commands.run("cat /srv/dir/a.txt").stdout == "alpha"
    blob = bytes(range(256)) * 40
    sbx.files.write_files(
        [{"path": "/srv/dir/b.bin", "data": blob}, {"path": "/srv/dir/sub/c.txt", "data": "c"}]
    )
    assert bytes(sbx.files.read("/srv/dir/b.bin", format="bytes")) == blob
    assert sorted(e.name for e in sbx.files.list("/srv/dir")) == ["a.txt", "b.bin", "sub"]
    assert "/srv/dir/sub/c.txt" in {e.path for e in sbx.files.list("/srv/dir", depth=2)}
    st = sbx.files.get_info("/srv/dir/b.bin")
    assert st.size == len(blob) and st.type == FileType.FILE
    assert sbx.files.exists("/srv/dir/a.txt") and not sbx.files.exists("/nope")
    moved = sbx.files.rename("/srv/dir/a.txt", "/srv/moved.txt")
    assert moved.path == "/srv/moved.txt" and not sbx.files.exists("/srv/dir/a.txt")
    assert sbx.files.make_dir("/srv/newdir") is True
    assert sbx.files.make_dir("/srv/newdir") is False
    assert sbx.files.get_info("/srv/newdir").type == FileType.DIR
    sbx.files.remove("/srv/dir")
    assert not sbx.files.exists("/srv/dir/sub/c.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/srv/missing.txt")


def test_edge_start_process_directly(real: RealServer, sbx: Sandbox) -> None:
    """``EdgeAgent.start_process`` (the InteractiveExec the E2B layer uses), without the SDK."""
    import asyncio
    import json
    import signal

    from dsec.e2b.interactive import InteractiveProcess, PtySize
    from dsec.errors import CapabilityNotSupported, Conflict, SandboxNotFound
    from dsec.models import ExecRequest

    edge = real.bg.edge
    sid = sbx.sandbox_id
    owner = edge.registry.get(sid).owner

    async def drain(p: InteractiveProcess) -> list[tuple[str, bytes]]:
        chunks: list[tuple[str, bytes]] = []
        while (c := await p.read_output()) is not None:
            chunks.append(c)
        return chunks

    async def scenario() -> None:
        p = await edge.start_process(sid, owner, ExecRequest(cmd="cat; echo bye >&2"), stdin=True)
        assert isinstance(p, InteractiveProcess)
        await p.write_stdin(b"ping\n")
        assert await p.read_output() == ("stdout", b"ping\n")
        with pytest.raises(CapabilityNotSupported):
            await p.resize(PtySize(80, 24))
        await p.close_stdin()
        assert await drain(p) == [("stderr", b"bye\n")]
        res = await p.wait()
        assert res.exit_code == 0 and res.stdout == ""
        with pytest.raises(Conflict):
            await p.write_stdin(b"late")
        await p.signal(signal.SIGKILL)  # after exit: a no-op

        # a signal right after start reaches the command (even before its setsid)
        p = await edge.start_process(sid, owner, ExecRequest(cmd="sleep 30"))
        await p.signal(signal.SIGTERM)
        assert await drain(p) == []
        assert (await asyncio.wait_for(p.wait(), budget(5))).signal == signal.SIGTERM

        p = await edge.start_process(sid, owner, ExecRequest(cmd="sleep 30", timeout_s=0.3))
        await drain(p)
        res = await p.wait()
        assert res.timed_out and res.signal == signal.SIGKILL

        p = await edge.start_process(sid, owner, ExecRequest(cmd=["/no/such/binary"]))
        assert b"/no/such/binary" in b"".join(c for _, c in await drain(p))
        assert (await p.wait()).exit_code == 127

        p = await edge.start_process(
            sid, owner, ExecRequest(cmd="stty size; exit 5"), stdin=True, pty=PtySize(91, 17)
        )
        out = b"".join(c for kind, c in await drain(p) if kind == "pty")
        assert b"17 91" in out and (await p.wait()).exit_code == 5

        with pytest.raises(SandboxNotFound):
            await edge.start_process(sid, "someone-else", ExecRequest(cmd="true"))

        async def stty_entries() -> list[dict[str, Any]]:
            lines = (await edge.export_trajectory(sid, owner)).splitlines()
            entries = [json.loads(x) for x in lines if '"interactive":true' in x.replace(" ", "")]
            return [e for e in entries if e["request"].get("pty") == {"cols": 91, "rows": 17}]

        async with asyncio.timeout(budget(5)):  # committed just after the exit
            while not (stty := await stty_entries()) or stty[-1]["status"] != "ok":
                await asyncio.sleep(0.05)
        assert stty[-1]["result"]["exit_code"] == 5

    real.bg.call(scenario(), timeout=budget(60))


def test_process_survives_pause_and_ends_with_its_sandbox(real: RealServer) -> None:
    from dsec.errors import SandboxStopped
    from dsec.models import CreateSandboxRequest, ExecRequest

    edge = real.bg.edge

    async def scenario() -> None:
        req = CreateSandboxRequest(tier="container", image="busybox")
        sid = (await edge.create_sandbox(req, "e2b-real-owner")).id
        p = await edge.start_process(sid, "e2b-real-owner", ExecRequest(cmd="cat"), stdin=True)
        await p.write_stdin(b"before\n")
        assert await p.read_output() == ("stdout", b"before\n")
        await edge.pause_sandbox(PauseRequest(sandbox_id=sid), "e2b-real-owner")
        await edge.resume_sandbox(SandboxRef(sandbox_id=sid), "e2b-real-owner")
        await p.write_stdin(b"after\n")
        assert await p.read_output() == ("stdout", b"after\n")
        sleeper = await edge.start_process(sid, "e2b-real-owner", ExecRequest(cmd="sleep 60"))
        await edge.kill_sandbox(SandboxRef(sandbox_id=sid), "e2b-real-owner")
        assert await p.read_output() is None and await sleeper.read_output() is None
        for proc in (p, sleeper):
            with pytest.raises(SandboxStopped):
                await proc.wait()

    real.bg.call(scenario(), timeout=budget(60))


def test_huge_timeouts_are_refused_and_old_huge_rows_still_render(
    real: RealServer, sbx: Sandbox
) -> None:
    import httpx

    from dsec.errors import InvalidRequest

    edge = real.bg.edge
    sid = sbx.sandbox_id
    row = edge.registry.get(sid)
    assert row is not None
    # EdgeAgent.set_ttl's request refuses it for every caller (E2B, dsec API, SDK)
    for ttl_s in (1e12, 0.0, -5.0, float("nan"), float("inf"), 30 * 24 * 3600 + 1.0):
        with pytest.raises(InvalidRequest):
            validated(SetTTLRequest, sandbox_id=sid, ttl_s=ttl_s)
    headers = {"X-API-Key": real.api_key}
    for path, body in (("timeout", {"timeout": 1e300}), ("connect", {"timeout": 10**12})):
        r = httpx.post(f"{real.url}/e2b/sandboxes/{sid}/{path}", json=body, headers=headers)
        assert r.status_code == 400 and r.json()["code"] == 400, r.text
    # a row stored with a huge TTL before the bound existed: info and list still work
    edge.registry.set_ttl(sid, 1e300)
    edge._live[sid].row.ttl_s = 1e300
    try:
        assert sbx.get_info().end_at.year == 9999
        assert sid in {x.sandbox_id for x in Sandbox.list().next_items()}
        r = httpx.get(f"{real.url}/e2b/sandboxes/{sid}", headers=headers)
        assert r.status_code == 200, r.text
    finally:
        sbx.set_timeout(300)
    assert sbx.get_info().end_at.year < 9999


def test_output_beyond_the_stream_buffer_arrives_whole(sbx: Sandbox) -> None:
    result = sbx.commands.run("head -c 30000000 /dev/zero | tr '\\0' a", timeout=120)
    assert len(result.stdout) == 30_000_000 and set(result.stdout) == {"a"}


def test_pause_ends_a_streaming_command(real: RealServer) -> None:
    s = Sandbox.create(TEMPLATE, timeout=120)
    try:
        blocked, outcome = pause_during_stream(s, budget(15))
        assert not blocked, "the stream stayed open after pause"
        assert "paused" in str(outcome.get("error")), outcome
        assert s.is_running() is False
        Sandbox.connect(s.sandbox_id)
        assert s.is_running() is True
    finally:
        s.kill()
