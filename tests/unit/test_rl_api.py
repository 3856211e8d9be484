"""RL surface over HTTP: trajectory headers, pause/resume, snapshot, fork, jobs, export.

Everything runs against the real apiserver app in front of FakeEdge, whose trajectory log is
the real :class:`~dsec.edge.trajectory.TrajectoryLog` (in memory), so sequence numbers,
replays, gaps and conflicts follow the real rules.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import json
import tarfile
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.timing import budget

import dsec
import dsec.errors as E
from dsec import AsyncClient, AsyncSandbox, Sandbox, jobs
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.replay import create_kwargs, read_header, replay_lines
from dsec.sdk.jobs import AsyncJobs, Jobs
from dsec.testing import FakeEdge, app_transport

KEY = "dsec_rl_test"
OWNER = owner_id(KEY)


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge(gap_wait_s=0.2)


@pytest.fixture
async def client(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(edge, StaticKeys([KEY]), max_upload_bytes=64 * 1024)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://dsec",
        headers={"authorization": f"Bearer {KEY}"},
    ) as c:
        yield c


@pytest.fixture
def conn(edge: FakeEdge) -> dict[str, Any]:
    transport, key = app_transport(edge, max_upload_bytes=64 * 1024)
    return {"transport": transport, "api_key": key}


async def _sandbox(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == code, err
    return err


def _seq(n: int) -> dict[str, str]:
    return {"X-Dsec-Seq": str(n)}


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --- trajectory headers on the routes -----------------------------------------------------
async def test_every_state_changing_route_passes_seq_and_key(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client)
    base = f"/v1/sandboxes/{sid}"
    calls = [
        ("exec", client.post(f"{base}/exec", json={"cmd": "true"}, headers=_seq(1))),
        ("exec_stream", client.post(f"{base}/exec/stream", json={"cmd": "true"}, headers=_seq(2))),
        ("write_file", client.put(f"{base}/files", params={"path": "/a"}, content=b"x", headers=_seq(3))),
        ("make_dir", client.post(f"{base}/files/mkdir", json={"path": "/d"}, headers=_seq(4))),
        ("rename_file", client.post(f"{base}/files/rename", json={"src": "/a", "dst": "/d/a"}, headers=_seq(5))),
        ("upload_tar", client.put(f"{base}/files/tar", params={"path": "/t"}, content=_tar({"f": b"1"}), headers=_seq(6))),
        ("remove_file", client.delete(f"{base}/files", params={"path": "/t/f"}, headers=_seq(7))),
        ("snapshot_sandbox", client.post(f"{base}/snapshot", json={}, headers={**_seq(8), "Idempotency-Key": "snap-1"})),
    ]  # fmt: skip
    for method, pending in calls:
        r = await pending
        assert r.status_code < 300, (method, r.text)
        recorded = edge.calls_to(method)[-1]
        # a verb of the table gets the headers as its envelope
        assert recorded["env"].seq == int(r.request.headers["x-dsec-seq"]), method
    assert edge.calls_to("snapshot_sandbox")[-1]["env"].idem_key == "snap-1"
    assert (await client.get(f"{base}")).json()["next_seq"] == 9
    # no headers: the edge numbers the call itself
    r = await client.post(f"{base}/exec", json={"cmd": "true"})
    assert r.status_code == 200 and edge.calls_to("exec")[-1]["env"].seq is None
    assert (await client.get(f"{base}")).json()["next_seq"] == 10


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Dsec-Seq": "abc"},
        {"X-Dsec-Seq": "0"},
        {"X-Dsec-Seq": "-3"},
        {"X-Dsec-Seq": "1.5"},
        {"X-Dsec-Seq": str(1 << 64)},
        {"Idempotency-Key": "has space"},
        {"Idempotency-Key": "x" * 257},
    ],
)
async def test_malformed_trajectory_headers_are_400_before_the_edge(
    client: httpx.AsyncClient, edge: FakeEdge, headers: dict[str, str]
) -> None:
    sid = await _sandbox(client)
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=headers)
    err = _error(r, 400, "invalid_request")
    assert err["details"]["errors"][0]["loc"][0] == "header"
    r = await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/a"}, content=b"x",
                         headers=headers)  # fmt: skip
    _error(r, 400, "invalid_request")
    assert edge.calls_to("exec") == [] and edge.calls_to("write_file") == []


async def test_repeat_is_answered_from_the_log_and_marked(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    edge.program("pytest -q", stdout="3 passed\n", exit_code=0)
    sid = await _sandbox(client)
    url = f"/v1/sandboxes/{sid}/exec"
    first = await client.post(url, json={"cmd": "pytest -q"}, headers=_seq(1))
    assert first.status_code == 200 and "x-dsec-replayed" not in first.headers
    assert first.json()["replayed"] is False
    edge.program("pytest -q", stdout="different now\n", exit_code=1)
    again = await client.post(url, json={"cmd": "pytest -q"}, headers=_seq(1))
    assert again.headers["x-dsec-replayed"] == "1"
    assert again.json()["replayed"] is True
    assert (again.json()["stdout"], again.json()["exit_code"]) == ("3 passed\n", 0)
    assert edge.executed["exec"] == 1  # nothing ran the second time
    # the same number for another request: a conflict, with what was recorded
    err = _error(await client.post(url, json={"cmd": "ls"}, headers=_seq(1)),
                 409, "sequence_conflict")  # fmt: skip
    assert err["details"]["recorded_op"] == "exec" and err["details"]["expected_seq"] == 2
    # skipping ahead: a gap once the short wait for late arrivals is over
    err = _error(await client.post(url, json={"cmd": "ls"}, headers=_seq(5)), 409, "sequence_gap")
    assert err["details"]["expected_seq"] == 2
    # a recorded error replays as the same error, without running
    write = f"/v1/sandboxes/{sid}/files/rename"
    body = {"src": "/missing", "dst": "/x"}
    _error(await client.post(write, json=body, headers=_seq(2)), 404, "file_not_found")
    _error(await client.post(write, json=body, headers=_seq(2)), 404, "file_not_found")
    assert edge.executed.get("rename_file", 0) == 0


async def test_idempotency_key_repeat(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    sid = await _sandbox(client)
    url = f"/v1/sandboxes/{sid}/files"
    h = {"Idempotency-Key": "write-a"}
    one = await client.put(url, params={"path": "/a"}, content=b"one", headers=h)
    two = await client.put(url, params={"path": "/a"}, content=b"one", headers=h)
    assert one.status_code == two.status_code == 200 and one.json() == two.json()
    assert edge.executed["write_file"] == 1
    other = await client.put(url, params={"path": "/a"}, content=b"two", headers=h)
    _error(other, 409, "sequence_conflict")


async def test_out_of_order_arrival_within_the_window(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client)
    edge.limits.gap_wait_s = budget(5)  # however slow this machine, seq 1 comes within it
    url = f"/v1/sandboxes/{sid}/exec"
    execs = len(edge.calls_to("exec"))
    later = asyncio.create_task(client.post(url, json={"cmd": "echo 2"}, headers=_seq(2)))
    async with asyncio.timeout(budget(5)):  # seq 2 arrives first and waits for seq 1
        while len(edge.calls_to("exec")) == execs:
            await asyncio.sleep(0.005)
    first = await client.post(url, json={"cmd": "echo 1"}, headers=_seq(1))
    second = await later
    assert (first.json()["stdout"], second.json()["stdout"]) == ("1\n", "2\n")


async def test_streamed_replay_carries_the_recorded_result(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client)
    url = f"/v1/sandboxes/{sid}/exec/stream"
    for _ in range(2):
        r = await client.post(url, json={"cmd": "echo hi"}, headers=_seq(1))
        events = [json.loads(line) for line in r.text.splitlines()]
        assert events[0] == {"type": "stdout", "data": "hi\n"}
    assert events[-1]["result"]["replayed"] is True
    assert edge.executed["exec"] == 1


# --- pause / resume ------------------------------------------------------------------------
async def test_pause_resume_and_transparent_resume(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client, ttl_s=60, on_timeout="pause", paused_ttl_s=600)
    info = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert (info["on_timeout"], info["paused_ttl_s"], info["paused_at"]) == ("pause", 600, None)
    paused = (await client.post(f"/v1/sandboxes/{sid}/pause")).json()
    assert paused["state"] == "paused" and paused["paused_at"] is not None
    report = paused["last_pause"]
    assert report["memory_after_bytes"] < report["memory_before_bytes"]
    again = (await client.post(f"/v1/sandboxes/{sid}/pause")).json()
    assert again["paused_at"] == paused["paused_at"]  # idempotent
    listed = (await client.get("/v1/sandboxes", params={"state": "paused"})).json()
    assert [s["id"] for s in listed["sandboxes"]] == [sid]
    # any request resumes it
    r = await client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo up"})
    assert r.json()["stdout"] == "up\n"
    info = (await client.get(f"/v1/sandboxes/{sid}")).json()
    assert info["state"] == "running" and info["paused_at"] is None
    await client.post(f"/v1/sandboxes/{sid}/pause")
    resumed = (await client.post(f"/v1/sandboxes/{sid}/resume")).json()
    assert resumed["state"] == "running"
    assert (await client.post(f"/v1/sandboxes/{sid}/resume")).json()["state"] == "running"
    await client.delete(f"/v1/sandboxes/{sid}")
    _error(await client.post(f"/v1/sandboxes/{sid}/pause"), 409, "sandbox_stopped")
    _error(await client.post(f"/v1/sandboxes/{sid}/resume"), 409, "sandbox_stopped")
    _error(await client.post("/v1/sandboxes/sb-fake-nope/pause"), 404, "sandbox_not_found")
    r = await client.post("/v1/sandboxes", json={"on_timeout": "sleep"})
    _error(r, 400, "invalid_request")


# --- snapshot and fork ---------------------------------------------------------------------
async def test_snapshot_restores_scrubs_and_refuses_secrets(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client)
    files = f"/v1/sandboxes/{sid}/files"
    for path, data in {
        "/app/main.py": b"print(1)",
        "/root/.cache/x": b"junk",
        "/env": b"ok",
    }.items():
        assert (await client.put(files, params={"path": path}, content=data)).status_code == 200
    r = await client.post(
        f"/v1/sandboxes/{sid}/snapshot", json={"name": "built:1", "scrub": ["/root/.cache"]}
    )
    assert r.status_code == 201, r.text
    layer = r.json()
    assert layer["kind"] == "workspace" and layer["digest"].startswith("sha256:")
    assert layer["meta"]["sandbox_id"] == sid
    layers = (await client.get("/v1/layers")).json()["layers"]
    assert layer["digest"] in [x["digest"] for x in layers]
    image = (await client.get("/v1/images/built:1")).json()
    assert image["layers"][-1] == layer["digest"]
    restored = await _sandbox(client, layers=[layer["digest"]])
    got = await client.get(f"/v1/sandboxes/{restored}/files", params={"path": "/app/main.py"})
    assert got.content == b"print(1)"
    gone = await client.get(f"/v1/sandboxes/{restored}/files", params={"path": "/root/.cache/x"})
    _error(gone, 404, "file_not_found")
    # a builder secret in any file: refused, nothing stored
    await client.put(files, params={"path": "/app/.netrc2"}, content=b"token=s3cr3t-value")
    r = await client.post(f"/v1/sandboxes/{sid}/snapshot", json={"secret_values": ["s3cr3t-value"]})
    err = _error(r, 400, "secret_in_snapshot")
    assert err["details"]["paths"] == ["/app/.netrc2"] and "s3cr3t" not in r.text
    assert len((await client.get("/v1/layers")).json()["layers"]) == len(layers)
    _error(await client.post(f"/v1/sandboxes/{sid}/snapshot", json={"scrub": ["relative"]}),
           400, "invalid_request")  # fmt: skip
    _error(await _sandbox_raw(client, layers=["sha256:" + "1" * 64]), 404, "layer_not_found")
    await client.delete(f"/v1/sandboxes/{sid}")
    _error(await client.post(f"/v1/sandboxes/{sid}/snapshot", json={}), 409, "sandbox_stopped")


async def _sandbox_raw(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/sandboxes", json=body)


async def test_fork(client: httpx.AsyncClient) -> None:
    sid = await _sandbox(client, labels={"task": "t1"}, job="j-fork", memory_mb=128)
    await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/w/state"}, content=b"s")
    r = await client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 3, "labels": {"branch": "b"}})
    assert r.status_code == 201, r.text
    result = r.json()
    forks = result["sandboxes"]
    assert len({f["id"] for f in forks}) == 3 and sid not in {f["id"] for f in forks}
    for f in forks:
        assert f["layers"] == [result["layer"]["digest"]]
        assert f["labels"] == {"task": "t1", "branch": "b"}
        assert (f["job"], f["memory_mb"], f["state"]) == ("j-fork", 128, "running")
        data = await client.get(f"/v1/sandboxes/{f['id']}/files", params={"path": "/w/state"})
        assert data.content == b"s"
    for bad in (0, -1, 257):
        _error(await client.post(f"/v1/sandboxes/{sid}/fork", json={"n": bad}),
               400, "invalid_request")  # fmt: skip


async def test_fork_beyond_quota_creates_nothing(edge: FakeEdge) -> None:
    small = FakeEdge(max_sandboxes=3)
    transport, key = app_transport(small)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://d", headers={"authorization": f"Bearer {key}"}
    ) as c:
        sid = await _sandbox(c)
        r = await c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 3})
        assert _error(r, 429, "quota_exceeded")["details"]["requested"] == 3
        assert len((await c.get("/v1/sandboxes")).json()["sandboxes"]) == 1
        assert (await c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2})).status_code == 201


# --- trajectory export ---------------------------------------------------------------------
async def test_trajectory_export_is_ndjson_in_seq_order(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    sid = await _sandbox(client, image="busybox", memory_mb=64, env={"A": "1"})
    base = f"/v1/sandboxes/{sid}"
    await client.post(f"{base}/exec", json={"cmd": "echo one"}, headers=_seq(1))
    await client.put(f"{base}/files", params={"path": "/f"}, content=b"data", headers=_seq(2))
    await client.post(f"{base}/exec", json={"cmd": "exit 3"}, headers=_seq(3))
    r = await client.get(f"{base}/trajectory")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    head, entries = lines[0], lines[1:]
    assert head["type"] == "header" and head["format"] == "dsec-trajectory/1"
    assert head["create"]["memory_mb"] == 64 and head["create"]["env"] == {"A": "1"}
    assert [(e["seq"], e["op"], e["status"]) for e in entries] == [
        (1, "exec", "ok"),
        (2, "write_file", "ok"),
        (3, "exec", "ok"),
    ]
    assert entries[2]["exit_code"] == 3 and "stdout_sha256" in entries[0]
    assert entries[0]["gidx"] < entries[1]["gidx"] < entries[2]["gidx"]
    _error(await client.get("/v1/sandboxes/sb-fake-zz/trajectory"), 404, "sandbox_not_found")


# --- jobs ------------------------------------------------------------------------------------
async def test_job_routes(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    ids = [await _sandbox(client, job="run-42") for _ in range(3)]
    other = await _sandbox(client, job="run-7")
    r = await client.post("/v1/jobs/run-42/pause")
    assert r.status_code == 200
    body = r.json()
    assert (body["job"], body["action"]) == ("run-42", "pause")
    assert list(body["outcomes"]) == ids
    assert all(
        o == {"ok": True, "state": "paused", "error": None} for o in body["outcomes"].values()
    )
    states = {
        s["id"]: s["state"] for s in (await client.get("/v1/jobs/run-42")).json()["sandboxes"]
    }
    assert states == dict.fromkeys(ids, "paused")
    assert (await client.get(f"/v1/sandboxes/{other}")).json()["state"] == "running"
    # one sandbox fails: reported, the others still act, the call is still 200
    edge.inject_error("resume_sandbox", E.SandboxError("thaw failed"))
    body = (await client.post("/v1/jobs/run-42/resume")).json()
    failed = [sid for sid, o in body["outcomes"].items() if not o["ok"]]
    assert len(failed) == 1 and body["outcomes"][failed[0]]["error"]["code"] == "sandbox_error"
    assert sum(o["state"] == "running" for o in body["outcomes"].values()) == 2
    body = (await client.post("/v1/jobs/run-42/kill")).json()
    assert {o["state"] for o in body["outcomes"].values()} == {"stopped"}
    assert (await client.get("/v1/jobs/run-42")).json()["sandboxes"] == []
    stopped = (await client.get("/v1/jobs/run-42", params={"include_stopped": True})).json()
    assert len(stopped["sandboxes"]) == 3
    assert (await client.post("/v1/jobs/nobody/pause")).json()["outcomes"] == {}
    _error(await client.post("/v1/jobs/run-42/freeze"), 400, "invalid_request")
    _error(await client.post("/v1/jobs/-bad/pause"), 400, "invalid_request")
    assert [c for c in edge.calls_to("job_action")][-1]["owner"] == OWNER


# --- SDK: numbering ------------------------------------------------------------------------
async def test_sdk_numbers_calls_from_create(edge: FakeEdge, conn: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**conn)
    assert sb.next_seq == 1
    await sb.commands.run("echo a")
    await sb.files.write("/f", "x")
    await sb.files.make_dir("/d")
    async for _ in sb.commands.stream("echo s"):
        pass
    await sb.commands.run("echo cb", on_stdout=lambda _: None)
    await sb.files.rename("/f", "/d/f")
    await sb.files.remove("/d", recursive=True)
    assert sb.next_seq == 8
    seqs = [
        args["env"].seq for name, args in edge.calls if "env" in args and name != "create_sandbox"
    ]
    assert seqs == [1, 2, 3, 4, 5, 6, 7]
    (create,) = edge.calls_to("create_sandbox")  # a creation has a key, not a number
    assert create["env"].seq is None and create["env"].idem_key
    # reads are not numbered
    await sb.files.exists("/d")
    await sb.files.list("/")
    assert sb.next_seq == 8
    # concurrent calls from one object: numbers taken at call start, all accepted
    results = await asyncio.gather(*(sb.commands.run(f"echo {i}") for i in range(12)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]
    assert (await sb.refresh()).next_seq == sb.next_seq == 20


async def test_sdk_hands_back_numbers_the_edge_never_saw(
    edge: FakeEdge, conn: dict[str, Any]
) -> None:
    sb = await AsyncSandbox.create(**conn)
    with pytest.raises(E.PayloadTooLarge):  # refused by the apiserver, before the edge
        await sb.files.write("/big", b"x" * (64 * 1024 + 1))
    with pytest.raises(E.InvalidRequest):  # refused by the SDK, no number taken
        await sb.files.write("relative", b"x")
    edge.inject_error("exec", E.SandboxStopped("went away"))  # raised before the log
    with pytest.raises(E.SandboxStopped):
        await sb.commands.run("true")
    with pytest.raises(E.FileNotFound):  # reached the edge: recorded as an error, used
        await sb.files.remove("/nope")
    assert sb.next_seq == 2
    assert (await sb.commands.run("echo ok")).stdout == "ok\n"
    assert sb.next_seq == 3 and (await sb.refresh()).next_seq == 3


async def test_connect_continues_and_replay_fast_forwards(
    edge: FakeEdge, conn: dict[str, Any]
) -> None:
    async def steps(sb: AsyncSandbox) -> list[str]:
        out = []
        for i in range(3):
            await sb.commands.run(f"echo step{i} >> /log")
            out.append((await sb.commands.run(f"echo result{i}")).stdout)
        return out

    edge.program("echo step0 >> /log", stdout="")
    edge.program("echo step1 >> /log", stdout="")
    edge.program("echo step2 >> /log", stdout="")
    first = await AsyncSandbox.create(**conn)
    before = await steps(first)
    ran = edge.executed["exec"]
    # a plain connect (e.g. from the CLI) continues after the recorded calls
    attached = await AsyncSandbox.connect(first.id, **conn)
    assert attached.next_seq == 7
    # a restarted trainer replays: same calls, recorded answers, nothing runs
    restarted = await AsyncSandbox.connect(first.id, replay=True, **conn)
    assert restarted.next_seq == 1
    assert await steps(restarted) == before
    assert edge.executed["exec"] == ran
    r = await restarted.commands.run("echo live")  # past the log: runs for real
    assert r.stdout == "live\n" and not r.replayed and edge.executed["exec"] == ran + 1
    # a restarted trainer that does something else at a recorded number: typed conflict
    diverged = await AsyncSandbox.connect(first.id, replay=True, **conn)
    with pytest.raises(E.SequenceConflict) as conflict:
        await diverged.commands.run("rm -rf /")
    assert conflict.value.details["recorded_op"] == "exec"
    replayed = await (await AsyncSandbox.connect(first.id, replay=True, **conn)).commands.run(
        "echo step0 >> /log"
    )
    assert replayed.replayed is True


async def test_sdk_sequence_errors_are_typed(edge: FakeEdge, conn: dict[str, Any]) -> None:
    sb = await AsyncSandbox.create(**conn)
    await sb.commands.run("true")
    await sb.commands.run("true")
    other = await AsyncSandbox.connect(sb.id, **conn)
    other._next_seq = 10  # as if calls 3..9 were lost
    with pytest.raises(E.SequenceGap) as gap:
        await other.commands.run("true")
    assert gap.value.details["expected_seq"] == 3
    assert other.next_seq == 10  # handed back: the edge never recorded it


# --- SDK: RL methods -------------------------------------------------------------------------
async def test_sdk_pause_snapshot_fork_trajectory(edge: FakeEdge, conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(
        job="run-1", on_timeout="pause", paused_ttl_s=120, ttl_s=30, **conn
    ) as sb:
        req = edge.calls_to("create_sandbox")[0]["req"]
        assert (req.job, req.on_timeout, req.paused_ttl_s) == ("run-1", "pause", 120)
        info = await sb.pause()
        assert info.state == "paused" and sb.info.last_pause is not None
        assert (await sb.resume()).state == "running"
        await sb.files.write("/ws/file.txt", "built")
        layer = await sb.snapshot(name="ws:1", scrub=["/tmp/*"])
        assert layer.name == "ws:1" and layer.kind == "workspace"
        with pytest.raises(E.SecretInSnapshot):
            await sb.snapshot(secret_values=["built"])
        with pytest.raises(E.InvalidRequest):
            await sb.snapshot(scrub=["not/absolute"])
        forks = await sb.fork(2, labels={"k": "v"})
        assert [type(f) for f in forks] == [AsyncSandbox, AsyncSandbox]
        for f in forks:
            assert f.next_seq == 1 and f.info.labels == {"k": "v"}
            assert await f.files.read_text("/ws/file.txt") == "built"
            await f.kill()
        with pytest.raises(E.InvalidRequest):
            await sb.fork(0)
        text = await sb.trajectory()
        ops = [json.loads(x)["op"] for x in text.splitlines()[1:]]
        assert ops == ["write_file", "snapshot", "snapshot"]  # the refused one is recorded
        assert json.loads(text.splitlines()[-1])["status"] == "error"


async def test_replay_module_against_the_sdk(edge: FakeEdge, conn: dict[str, Any]) -> None:
    edge.program("./run_tests", stdout="ok 3\n", exit_code=0)
    sb = await AsyncSandbox.create(memory_mb=128, **conn)
    await sb.files.write("/w/a.py", "x = 1\n")
    await sb.commands.run("./run_tests")
    lines = (await sb.trajectory()).splitlines(keepends=True)
    kwargs = create_kwargs(read_header(lines))
    assert kwargs["memory_mb"] == 128
    fresh = await AsyncSandbox.create(**kwargs, **conn)
    report = await replay_lines(lines, fresh)
    assert report.ok and report.matched == 2, report.format_text()
    edge.program("./run_tests", stdout="ok 2\n", exit_code=1)
    report = await replay_lines(lines, await AsyncSandbox.create(**kwargs, **conn))
    assert {d.field for d in report.divergences} == {"exit_code", "stdout_sha256"}


# --- SDK: jobs -------------------------------------------------------------------------------
async def test_async_jobs(edge: FakeEdge, conn: dict[str, Any]) -> None:
    client = AsyncClient(api_key=conn["api_key"], transport=conn["transport"])
    boxes = [await AsyncSandbox.create(job="run-9", client=client) for _ in range(2)]
    result = await client.jobs.pause("run-9")
    assert result.ok and set(result.outcomes) == {b.id for b in boxes}
    assert {i.state for i in await client.jobs.list("run-9")} == {"paused"}
    async with AsyncJobs(**conn) as api:
        assert (await api.resume("run-9")).ok
        assert {o.state for o in (await api.kill("run-9")).outcomes.values()} == {"stopped"}
        assert await api.list("run-9") == []
        assert len(await api.list("run-9", include_stopped=True)) == 2
        with pytest.raises(E.InvalidRequest):
            await api.pause("no spaces")
    await client.close()


def test_sync_jobs_module_and_fork(edge: FakeEdge, conn: dict[str, Any]) -> None:
    assert dsec.jobs is jobs is importlib.import_module("dsec.jobs")
    sb = Sandbox.create(job="run-s", **conn)
    forks = sb.fork(2)
    assert [type(f) for f in forks] == [Sandbox, Sandbox]
    assert forks[0].commands.run("echo in-fork").stdout == "in-fork\n"
    assert {s.id for s in jobs.list("run-s", **conn)} == {sb.id, *(f.id for f in forks)}
    result = jobs.pause("run-s", **conn)
    assert result.ok and len(result.outcomes) == 3
    assert sb.refresh().state == "paused"
    assert jobs.resume("run-s", **conn).ok
    assert Jobs(**conn).kill("run-s").ok
    assert _sync_client_job_list(conn) == []
    text = sb.trajectory()
    assert text.startswith('{"type":"header"')


def _sync_client_job_list(conn: dict[str, Any]) -> list[Any]:
    from dsec import Client

    client = Client(api_key=conn["api_key"], transport=conn["transport"])
    try:
        return list(client.jobs.list("run-s"))
    finally:
        client.close()
