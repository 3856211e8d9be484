"""What a sandbox takes from its image at creation: the config's Env/WorkingDir/User as
defaults, and the start command (its output the sandbox's logs, its readiness check gating
the creation). Through the real apiserver app and SDK over the test edge (a real
``EdgeAgent`` on the in-memory runtime); the container tier's version is in
tests/integration/test_builds_root.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from tests.timing import budget

from dsec import AsyncSandbox, ExecRequest, ExecResult, SandboxInfo
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.errors import SandboxNotFound, StartFailed
from dsec.testing import FAKE_BUSYBOX, FakeEdge

KEY_A = "dsec_test_a_" + "1" * 20
KEY_B = "dsec_test_b_" + "2" * 20


def _edge(handler: Any = None) -> tuple[FakeEdge, httpx.AsyncBaseTransport]:
    edge = FakeEdge(exec_handler=handler) if handler is not None else FakeEdge()
    app = create_app(edge, StaticKeys([KEY_A, KEY_B]))
    return edge, httpx.ASGITransport(app=app)


def _image(edge: FakeEdge, name: str, **meta: Any) -> None:
    edge.memory_layers.put_image(name, [FAKE_BUSYBOX], meta=meta)


async def _create(transport: httpx.AsyncBaseTransport, key: str = KEY_A, **kw: Any) -> AsyncSandbox:
    return await AsyncSandbox.create(url="http://t", api_key=key, transport=transport, **kw)


def _cmd(req: ExecRequest) -> str:
    return req.cmd if isinstance(req.cmd, str) else " ".join(req.cmd)


async def test_the_image_config_is_the_sandboxs_default() -> None:
    edge, transport = _edge()
    _image(
        edge,
        "app:1",
        config={
            "Env": ["PATH=/opt/bin:/usr/bin", "MODE=image"],
            "WorkingDir": "/srv",
            "User": "1000",
        },
    )
    sb = await _create(transport, image="app:1", env={"MODE": "request"})
    assert (sb.info.workdir, sb.info.user) == ("/srv", "1000")
    spec = edge.runtimes["container"].sandboxes[sb.id].spec  # type: ignore[attr-defined]
    assert spec.env == {"PATH": "/opt/bin:/usr/bin", "MODE": "request"}  # the request wins
    assert spec.workdir == "/srv"
    mine = await _create(transport, image="app:1", workdir="/", user="root")
    assert (mine.info.workdir, mine.info.user) == ("/", "root")  # given: kept
    plain = await _create(transport, image="busybox")
    assert (plain.info.workdir, plain.info.user) == ("/", None)


async def test_a_config_the_sandbox_api_refuses_is_skipped_not_an_error() -> None:
    edge, transport = _edge()
    _image(
        edge, "odd", config={"Env": ["bad name=x", "OK=1"], "User": "www:data", "WorkingDir": "rel"}
    )
    sb = await _create(transport, image="odd")
    assert (sb.info.workdir, sb.info.user) == ("/", None)
    spec = edge.runtimes["container"].sandboxes[sb.id].spec  # type: ignore[attr-defined]
    assert spec.env == {"OK": "1"}


async def test_the_start_commands_output_is_the_logs() -> None:
    edge, transport = _edge()
    _image(edge, "srv", start={"cmd": ["serve", "--port", "80"]}, config={"WorkingDir": "/srv"})
    edge.program(["serve", "--port", "80"], stdout="listening on 80\n", stderr="warn\n")
    sb = await _create(transport, image="srv")
    async with asyncio.timeout(budget(5)):  # the start command runs in the background
        while (
            not (lines := [(x.stream, x.data) async for x in sb.logs()]) or lines[-1][0] != "dsec"
        ):
            await asyncio.sleep(0.01)
    assert lines == [
        ("stdout", "listening on 80\n"),
        ("stderr", "warn\n"),
        ("dsec", "start command exited with code 0"),
    ]
    assert '"serve"' not in await sb.trajectory()  # part of the creation, not an action
    quiet = await _create(transport, image="srv", start=False)
    assert [x async for x in quiet.logs()] == []
    plain = await _create(transport, image="busybox")
    assert [x async for x in plain.logs(follow=True)] == []  # no start command: ends at once


async def test_follow_streams_until_the_command_ends() -> None:
    release = asyncio.Event()

    async def handler(info: SandboxInfo, req: ExecRequest) -> ExecResult:
        if _cmd(req) == "long":
            await release.wait()
            return ExecResult(stdout="done\n", exit_code=0)
        return ExecResult(exit_code=0)

    edge, transport = _edge(handler)
    _image(edge, "long", start={"cmd": "long"})
    sb = await _create(transport, image="long")
    got: list[tuple[str, str]] = []

    async def follow() -> None:
        async for line in sb.logs(follow=True, timeout=budget(10)):
            got.append((line.stream, line.data))

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.1)  # a while to (wrongly) end or print: nothing is due yet
    assert not task.done() and got == []
    release.set()
    await asyncio.wait_for(task, budget(5))
    assert got == [("stdout", "done\n"), ("dsec", "start command exited with code 0")]


async def test_the_readiness_check_gates_the_creation() -> None:
    checks = 0

    async def handler(info: SandboxInfo, req: ExecRequest) -> ExecResult:
        nonlocal checks
        if _cmd(req) == "server":
            await asyncio.sleep(30)  # a server: runs until the sandbox goes
        if _cmd(req) == "probe":
            checks += 1
            return ExecResult(exit_code=0 if checks >= 3 else 7)
        return ExecResult(exit_code=0)

    edge, transport = _edge(handler)
    _image(edge, "srv", start={"cmd": "server", "ready_cmd": "probe", "ready_timeout_s": 10})
    sb = await _create(transport, image="srv")
    assert checks == 3 and sb.info.state == "running"
    await sb.kill()  # stops the start command with it
    await asyncio.sleep(0)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(f"start {sb.id}")]


async def test_a_start_command_that_fails_first_fails_the_creation() -> None:
    async def handler(info: SandboxInfo, req: ExecRequest) -> ExecResult:
        if _cmd(req) == "crash":
            return ExecResult(stderr="boom: no config\n", exit_code=3)
        return ExecResult(exit_code=1)  # the probe never passes

    edge, transport = _edge(handler)
    _image(edge, "bad", start={"cmd": "crash", "ready_cmd": "probe", "ready_timeout_s": 5})
    with pytest.raises(StartFailed) as e:
        await _create(transport, image="bad")
    assert e.value.details["exit_code"] == 3 and "boom" in e.value.details["logs_tail"]
    assert "exited with code 3" in e.value.message
    sid = e.value.details["sandbox_id"]
    assert edge.sandboxes[sid].state == "stopped"  # killed, not left running
    assert edge.sandboxes[sid].stopped_reason == "start command failed"


async def test_a_start_command_never_ready_fails_the_creation_in_time() -> None:
    async def handler(info: SandboxInfo, req: ExecRequest) -> ExecResult:
        if _cmd(req) == "hang":
            await asyncio.sleep(60)
        return ExecResult(exit_code=1)

    edge, transport = _edge(handler)
    _image(edge, "slow", start={"cmd": "hang", "ready_cmd": "probe", "ready_timeout_s": 0.5})
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StartFailed) as e:
        await _create(transport, image="slow")
    assert asyncio.get_running_loop().time() - t0 < budget(5)  # the 0.5 s, not the 60 s hang
    assert "not ready after 0.5 s" in e.value.message and e.value.details["ready_cmd"] == "probe"
    assert all(s.state == "stopped" for s in edge.sandboxes.values())


async def test_another_keys_logs_are_not_found() -> None:
    edge, transport = _edge()
    _image(edge, "srv", start={"cmd": "serve"})
    sb = await _create(transport, image="srv")
    other = httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"authorization": f"Bearer {KEY_B}"}
    )
    r = await other.get(f"/v1/sandboxes/{sb.id}/logs")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    missing = await other.get("/v1/sandboxes/sb-fake-000000000000/logs")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "sandbox_not_found"
    bad = await other.get(f"/v1/sandboxes/{sb.id}/logs", params={"follow": "maybe"})
    assert bad.status_code == 400 and "error" in bad.json()
    with pytest.raises(SandboxNotFound):
        await AsyncSandbox.connect(sb.id, url="http://t", api_key=KEY_B, transport=transport)


async def test_builds_on_a_node_that_cannot_build_are_a_clear_refusal() -> None:
    _, transport = _edge()
    client = httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"authorization": f"Bearer {KEY_A}"}
    )
    from dsec.builds.wire import BuildRequest, encode_build_upload

    body = encode_build_upload(
        BuildRequest.parse({"name": "x", "steps": [{"op": "from_image", "image": "busybox"}]}), b""
    )
    r = await client.post("/v1/builds", content=body, headers={"content-type": "application/x-tar"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "capability_not_supported"
    r = await client.post(
        "/v1/builds", content=b"not a tar", headers={"content-type": "application/x-tar"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


async def test_a_follower_gets_every_line_when_the_end_comes_while_it_reads() -> None:
    from dsec.edge.logs import SandboxLogs

    logs = SandboxLogs(max_bytes=1 << 16)
    logs.write("stdout", b"one\n")
    got: list[str] = []
    async for line in logs.read(follow=True):
        got.append(line.data)
        if line.data == "one\n":  # the command prints its last line and ends meanwhile
            logs.write("stdout", b"two\n")
            logs.close("start command exited with code 0")
    assert got == ["one\n", "two\n", "start command exited with code 0"]


def test_the_logs_keep_the_newest_output_within_their_bound() -> None:
    from dsec.edge.logs import SandboxLogs

    logs = SandboxLogs(max_bytes=10)
    for i in range(6):
        logs.write("stdout", f"{i}{i}{i}\n".encode())
    logs.write("stderr", "é".encode()[:1])  # half a character: held back until the rest
    logs.write("stderr", "é".encode()[1:])
    assert logs.tail(100) == "444\n555\né" and logs.dropped == 4
    logs.write("stdout", b"x" * 50)  # one chunk over the bound: its end is kept
    assert logs.tail(100) == "x" * 10
