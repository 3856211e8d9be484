"""The async SDK against the real apiserver app in front of FakeEdge (in-process)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec import AsyncClient, AsyncSandbox, CommandResult, ExecEvent
from dsec.apiserver.auth import owner_id
from dsec.testing import FakeEdge, app_transport


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def conn(edge: FakeEdge) -> dict[str, Any]:
    transport, key = app_transport(edge, max_upload_bytes=1 << 20)
    return {"transport": transport, "api_key": key}


async def test_create_run_and_kill_on_exit(edge: FakeEdge, conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(
        tier="fncall", image="busybox", cpu=0.25, memory_mb=64, env={"A": "b"}, ttl_s=None,
        labels={"k": "v"}, job="job-1", user="1000:1000", **conn,
    ) as sb:  # fmt: skip
        assert sb.id.startswith("sb-fake-") and sb.info.state == "running"
        req = edge.calls_to("create_sandbox")[0]["req"]
        assert (req.tier, req.cpu, req.memory_mb, req.ttl_s, req.job) == (
            "fncall",
            0.25,
            64,
            None,
            "job-1",
        )
        assert edge.calls_to("create_sandbox")[0]["owner"] == owner_id(conn["api_key"])
        result = await sb.commands.run("echo hello world")
        assert isinstance(result, CommandResult)
        assert (result.stdout, result.exit_code, result.ok, result.truncated) == (
            "hello world\n",
            0,
            True,
            False,
        )
        failed = await sb.commands.run(["false"])
        assert failed.exit_code == 1 and not failed.ok  # no exception for a non-zero exit
        assert (await sb.refresh()).state == "running"
        assert (await sb.set_ttl(90)).ttl_s == 90
    assert sb.info.state == "stopped"
    assert edge.calls_to("kill_sandbox")[0]["req"].sandbox_id == sb.id


async def test_run_parameters_reach_the_edge(edge: FakeEdge, conn: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**conn)
    result = await sb.commands.run(
        "cat",
        cwd="/tmp",
        env={"X": "1"},
        timeout=7,
        stdin=b"\x00\xffbin",
        user="nobody",
        max_output_bytes=3,
    )
    req = edge.calls_to("exec")[0]["req"]
    assert (req.cwd, req.env, req.timeout_s, req.user, req.max_output_bytes) == (
        "/tmp",
        {"X": "1"},
        7,
        "nobody",
        3,
    )
    assert req.stdin is None and base64.b64decode(req.stdin_b64) == b"\x00\xffbin"
    assert result.stdout_truncated and result.truncated
    text = await sb.commands.run("cat", stdin="héllo")
    assert text.stdout == "héllo"
    with pytest.raises(E.InvalidRequest, match="cmd"):
        await sb.commands.run("   ")  # validated client-side: nothing sent
    assert len(edge.calls_to("exec")) == 2
    await sb.kill()


async def test_callbacks_get_what_only_the_result_carries() -> None:
    """A tier that answers without streaming (a command that could not start: the message
    is in the result only) still reaches ``on_stderr`` and the result."""
    from dsec.contract.runtime import Handle, OutputSink
    from dsec.models import ExecRequest, ExecResult
    from dsec.testing import MemoryLayers, MemoryPortRuntime

    class Unstreamed(MemoryPortRuntime):
        async def exec(
            self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
        ) -> ExecResult:
            return await super().exec(handle, req, None)

    layers = MemoryLayers()
    edges: list[FakeEdge] = []

    async def answer(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await edges[0]._answer(sandbox_id, req)

    edge = FakeEdge(layers=layers, runtime_factory=lambda tier: Unstreamed(tier, layers, answer))
    edges.append(edge)
    edge.program("nope", stderr="exec: nope: not found\n", exit_code=127)
    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(transport=transport, api_key=key)
    err: list[str] = []
    result = await sb.commands.run("nope", on_stderr=err.append)
    assert err == ["exec: nope: not found\n"] and result.stderr == err[0]
    assert result.exit_code == 127
    await sb.kill()


async def test_callbacks_and_stream(edge: FakeEdge, conn: dict[str, Any]) -> None:
    edge.program("build", stdout="one\ntwo\n", stderr="warn\n", exit_code=3)
    sb = await AsyncSandbox.create(**conn)
    out: list[str] = []
    err: list[str] = []

    async def on_err(chunk: str) -> None:
        err.append(chunk)

    result = await sb.commands.run("build", on_stdout=out.append, on_stderr=on_err)
    assert out == ["one\n", "two\n"] and err == ["warn\n"]
    assert (result.stdout, result.stderr, result.exit_code) == ("one\ntwo\n", "warn\n", 3)
    events = [e async for e in sb.commands.stream("build")]
    assert [e.type for e in events] == ["stdout", "stdout", "stderr", "exit"]
    assert all(isinstance(e, ExecEvent) for e in events)
    assert events[-1].result is not None and events[-1].result.exit_code == 3

    edge.inject_error("exec_stream", E.SandboxError("crashed", step=2))
    with pytest.raises(E.SandboxError, match="crashed") as info:
        async for _ in sb.commands.stream("build"):
            pass
    assert info.value.details == {"step": 2}
    await sb.kill()


async def test_files(tmp_path: Path, conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sb:
        info = await sb.files.write("/work/a.txt", "héllo", mode=0o600)
        assert (info.size, info.mode) == (len("héllo".encode()), 0o600)
        assert await sb.files.read("/work/a.txt") == "héllo".encode()
        assert await sb.files.read_text("/work/a.txt") == "héllo"
        await sb.files.write("/work/b.bin", b"\x00" * 10)
        assert (await sb.files.stat("/work/b.bin")).size == 10
        assert await sb.files.exists("/work/a.txt") and not await sb.files.exists("/nope")
        assert (await sb.files.make_dir("/work/d/e")).type == "dir"
        assert (await sb.files.rename("/work/b.bin", "/work/d/c.bin")).path == "/work/d/c.bin"
        names = {f.path for f in await sb.files.list("/work", depth=3)}
        assert names == {"/work/a.txt", "/work/d", "/work/d/e", "/work/d/c.bin"}
        with pytest.raises(E.FileNotFound) as missing:
            await sb.files.read("/work/missing")
        assert isinstance(missing.value, FileNotFoundError)
        with pytest.raises(E.InvalidRequest):
            await sb.files.write("relative/path", "x")
        with pytest.raises(E.PayloadTooLarge):
            await sb.files.write("/big", b"x" * ((1 << 20) + 1))
        await sb.files.remove("/work", recursive=True)
        assert not await sb.files.exists("/work/a.txt")


async def test_upload_and_download_dir(tmp_path: Path, conn: dict[str, Any]) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("x = 1\n")
    (src / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(3000))
    (src / "top.txt").write_text("top")
    async with await AsyncSandbox.create(**conn) as sb:
        count = await sb.files.upload_dir(src, "/app")
        assert count == 5
        assert (
            await sb.files.read("/app/pkg/sub/data.bin")
            == (src / "pkg" / "sub" / "data.bin").read_bytes()
        )
        dest = tmp_path / "dest"
        written = await sb.files.download_dir("/app", dest)
        assert set(written) == {"pkg", "pkg/__init__.py", "pkg/sub", "pkg/sub/data.bin", "top.txt"}
        for rel in ("pkg/__init__.py", "pkg/sub/data.bin", "top.txt"):
            assert (dest / rel).read_bytes() == (src / rel).read_bytes()
        with pytest.raises(E.InvalidRequest, match="not a local directory"):
            await sb.files.upload_dir(tmp_path / "missing", "/x")


def _tar(*members: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    m.linkname = link
    m.size = 1 if kind == tarfile.REGTYPE else 0
    return m


@pytest.mark.parametrize(
    "member",
    [
        _member("../escape"),
        _member("/etc/passwd"),
        _member("a/../../escape"),
        _member("link", tarfile.SYMTYPE, "/etc/passwd"),
        _member("link", tarfile.SYMTYPE, "../../outside"),
        _member("hard", tarfile.LNKTYPE, "../outside"),
        _member("dev", tarfile.CHRTYPE),
        _member("fifo", tarfile.FIFOTYPE),
        _member("d/" * 2100 + "deep.txt"),  # a path longer than the kernel takes
        _member("n" * 256),  # a name longer than the kernel takes
    ],
    ids=lambda m: (f"{m.name}->{m.linkname}" if m.linkname else m.name)[:40],
)
async def test_download_dir_refuses_unsafe_archives(
    tmp_path: Path, member: tarfile.TarInfo
) -> None:
    class EvilEdge(FakeEdge):
        async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
            return _tar(_member("ok.txt"), member)

    transport, key = app_transport(EvilEdge())
    sb = await AsyncSandbox.create(transport=transport, api_key=key)
    dest = tmp_path / "dest"
    with pytest.raises(E.InvalidRequest):
        await sb.files.download_dir("/x", dest)
    assert not (dest / "ok.txt").exists()  # validated before anything is written
    assert not (tmp_path / "escape").exists() and not (tmp_path / "outside").exists()


@pytest.mark.parametrize(
    "cls",
    [E.InvalidRequest, E.PathOutsideSandbox, E.SandboxNotFound, E.FileNotFound, E.SandboxTimeout,
     E.SandboxStopped, E.FileExists_, E.TierUnavailable, E.CapabilityNotSupported, E.QuotaExceeded,
     E.SandboxError, E.ServiceUnavailable, E.InternalError, E.Conflict, E.Unsupported],
    ids=lambda c: c.code,
)  # fmt: skip
async def test_errors_arrive_intact(
    edge: FakeEdge, conn: dict[str, Any], cls: type[E.DsecError]
) -> None:
    sb = await AsyncSandbox.create(**conn)
    edge.inject_error("exec", cls("nope", limit=5))
    with pytest.raises(cls) as info:
        await sb.commands.run("true")
    assert type(info.value) is cls
    assert (info.value.message, info.value.details) == ("nope", {"limit": 5})


async def test_connect_list_and_client(
    edge: FakeEdge, conn: dict[str, Any], tmp_path: Path
) -> None:
    a = await AsyncSandbox.create(labels={"team": "x"}, job="j", **conn)
    b = await AsyncSandbox.create(labels={"team": "y"}, **conn)
    again = await AsyncSandbox.connect(a.id, **conn)
    assert again.info == a.info
    with pytest.raises(E.SandboxNotFound):
        await AsyncSandbox.connect("sb-fake-00000000", **conn)
    with pytest.raises(E.InvalidRequest):
        await AsyncSandbox.connect("../../v1/images", **conn)
    assert [s.id for s in await AsyncSandbox.list(labels={"team": "x"}, **conn)] == [a.id]
    assert [s.id for s in await AsyncSandbox.list(job="j", **conn)] == [a.id]
    await b.kill()
    await b.kill()  # idempotent
    assert {s.id for s in await AsyncSandbox.list(**conn)} == {a.id}
    assert {s.id for s in await AsyncSandbox.list(include_stopped=True, **conn)} == {a.id, b.id}

    async with AsyncClient(**conn) as client:
        shared = await AsyncSandbox.create(client=client)
        assert shared.id in {s.id for s in await client.list_sandboxes()}
        assert (await client.node_info()).node == "fake"
        assert [c.tier for c in await client.capabilities()] == [
            "fncall",
            "container",
            "microvm",
            "vm",
        ]
        assert [i.name for i in await client.list_images()] == ["busybox"]
        assert (await client.get_image("busybox")).name == "busybox"
        with pytest.raises(E.ImageNotFound):
            await client.get_image("nope:1")
        assert len(await client.list_layers()) == 1
        archive = tmp_path / "ctx.tar"
        with tarfile.open(archive, "w") as tf:  # a local tar archive is uploaded as it is
            tf.add(__file__, arcname="t.py")
        built = await client.build_image(archive, "x:1", kind="toolkit")
        assert built.name == "x:1"
        call = edge.calls_to("build_image")[0]
        assert call["req"].kind == "toolkit" and call["context"] == archive.read_bytes()
        await shared.kill()  # does not close a shared client
        assert (await client.node_info()).node == "fake"


async def test_kill_on_exit_tolerates_a_vanished_sandbox(
    edge: FakeEdge, conn: dict[str, Any]
) -> None:
    async with await AsyncSandbox.create(**conn) as sb:
        edge.forget(sb.id)  # the server forgot it (expired and purged)
    assert sb.info.state == "running"  # nothing to update, and no exception


def _recording_transport(seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"sandboxes": []})

    return httpx.MockTransport(handler)


async def test_config_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[httpx.Request] = []
    transport = _recording_transport(seen)
    monkeypatch.setenv("DSEC_URL", "http://dsec.test:9999/")
    monkeypatch.setenv("DSEC_API_KEY", "dsec_from_env")
    await AsyncSandbox.list(transport=transport)
    assert str(seen[-1].url) == "http://dsec.test:9999/v1/sandboxes"
    assert seen[-1].headers["authorization"] == "Bearer dsec_from_env"

    monkeypatch.delenv("DSEC_API_KEY")
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    tmp_path.joinpath("api_key").write_text("dsec_from_file\n")
    await AsyncSandbox.list(transport=transport)
    assert seen[-1].headers["authorization"] == "Bearer dsec_from_file"

    await AsyncSandbox.list(transport=transport, api_key="dsec_arg", url="http://other:1")
    assert seen[-1].headers["authorization"] == "Bearer dsec_arg"
    assert seen[-1].url.host == "other"

    tmp_path.joinpath("api_key").unlink()
    await AsyncSandbox.list(transport=transport)
    assert "authorization" not in seen[-1].headers


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectError("Connection refused"), E.ServiceUnavailable),
        (httpx.ReadTimeout("timed out"), E.SandboxTimeout),
        (httpx.ConnectTimeout("timed out"), E.SandboxTimeout),
        (httpx.RemoteProtocolError("peer closed"), E.ServiceUnavailable),
    ],
)
async def test_transport_failures_are_mapped(exc: Exception, expected: type[E.DsecError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(expected) as info:
        await AsyncSandbox.create(transport=httpx.MockTransport(handler), api_key="k")
    if expected is E.ServiceUnavailable and isinstance(exc, httpx.ConnectError):
        assert "dsec serve" in info.value.message


async def test_connection_refused_on_loopback() -> None:
    with pytest.raises(E.ServiceUnavailable, match="dsec serve") as info:
        await AsyncClient("http://127.0.0.1:1", api_key="k").node_info()
    assert isinstance(info.value, ConnectionError)


async def test_non_json_error_bodies() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, text="<html>bad gateway</html>")

    with pytest.raises(E.InternalError, match="bad gateway"):
        await AsyncClient(transport=httpx.MockTransport(handler), api_key="k").node_info()


async def test_sandbox_survives_a_new_event_loop(conn: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**conn)

    def other_loop() -> str:
        return asyncio.run(sb.commands.run("echo again")).stdout

    assert await asyncio.to_thread(other_loop) == "again\n"
    assert (await sb.commands.run("echo here")).stdout == "here\n"
    await sb.kill()
    json.dumps(sb.info.model_dump(mode="json"))
