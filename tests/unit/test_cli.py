"""The ``dsec`` CLI against the in-process app, through the documented transport hook."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import dsec.cli.main as cli
import dsec.errors as E
from dsec.testing import FakeEdge, app_transport


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def runner(edge: FakeEdge, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    transport, key = app_transport(edge)
    monkeypatch.setattr(cli, "transport_factory", lambda: transport)
    yield CliRunner(env={"DSEC_API_KEY": key, "DSEC_URL": "http://dsec.invalid", "COLUMNS": "200"})


def test_run_prints_output_and_exits_with_the_code(runner: CliRunner, edge: FakeEdge) -> None:
    edge.program(["make", "test"], stdout="building\n", stderr="warning\n", exit_code=3)
    result = runner.invoke(
        cli.app, ["run", "--image", "busybox", "--tier", "container", "--", "make", "test"]
    )
    assert result.exit_code == 3, result.output
    assert result.stdout == "building\n"
    assert "warning\n" in result.stderr
    req = (
        edge.calls_to("exec")[0]["req"]
        if edge.calls_to("exec")
        else edge.calls_to("exec_stream")[0]["req"]
    )
    assert req.cmd == ["make", "test"]
    assert edge.calls_to("kill_sandbox"), "run kills the sandbox unless --keep"


def test_run_single_argument_is_a_shell_command_and_keep(runner: CliRunner, edge: FakeEdge) -> None:
    result = runner.invoke(cli.app, ["run", "--keep", "-e", "A=1", "--", "echo hi there"])
    assert result.exit_code == 0 and result.stdout == "hi there\n"
    req = edge.calls_to("exec_stream")[0]["req"]
    assert req.cmd == "echo hi there" and req.env == {"A": "1"}
    assert edge.calls_to("kill_sandbox") == []
    assert "sandbox kept: sb-fake-" in result.stderr


def test_run_timeout_and_signal_exit_codes(runner: CliRunner, edge: FakeEdge) -> None:
    edge.program("slow", timed_out=True, exit_code=None)
    assert runner.invoke(cli.app, ["run", "--", "slow"]).exit_code == 124
    edge.program("killed", exit_code=None, signal=9)
    assert runner.invoke(cli.app, ["run", "--", "killed"]).exit_code == 137


def test_errors_are_one_red_line(runner: CliRunner) -> None:
    result = runner.invoke(cli.app, ["run", "--tier", "vm", "--", "true"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("error:")
    assert "tier_unavailable" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    result = runner.invoke(cli.app, ["run", "--"])
    assert result.exit_code != 0
    result = runner.invoke(cli.app, ["exec", "sb-fake-00000000", "--", "true"])
    assert result.exit_code == 1 and "sandbox_not_found" in result.stderr


def test_ps_exec_kill(runner: CliRunner, edge: FakeEdge) -> None:
    assert "no sandboxes" in runner.invoke(cli.app, ["ps"]).stdout
    runner.invoke(cli.app, ["run", "--keep", "--", "true"])
    sandbox_id = edge.calls_to("exec_stream")[0]["req"].sandbox_id
    ps = runner.invoke(cli.app, ["ps"])
    assert ps.exit_code == 0 and sandbox_id in ps.stdout and "running" in ps.stdout

    result = runner.invoke(cli.app, ["exec", sandbox_id, "--", "echo", "from", "exec"])
    assert result.exit_code == 0 and result.stdout == "from exec\n"
    result = runner.invoke(cli.app, ["exec", sandbox_id, "--", "exit 5"])
    assert result.exit_code == 5

    result = runner.invoke(cli.app, ["kill", sandbox_id, "sb-fake-00000000"])
    assert result.exit_code == 1
    assert f"killed {sandbox_id}" in result.stdout and "sb-fake-00000000" in result.stderr
    assert sandbox_id not in runner.invoke(cli.app, ["ps"]).stdout
    assert sandbox_id in runner.invoke(cli.app, ["ps", "--all"]).stdout


def test_image_commands_and_info(runner: CliRunner, edge: FakeEdge, tmp_path: Path) -> None:
    ls = runner.invoke(cli.app, ["image", "ls"])
    assert ls.exit_code == 0 and "busybox" in ls.stdout and "2.0 MiB" in ls.stdout
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "app.py").write_text("print('hi')\n")
    built = runner.invoke(
        cli.app,
        ["image", "build", str(ws), "--name", "ws:1", "--kind", "toolkit", "--base", "busybox"],
    )
    assert built.exit_code == 0, built.output
    assert "built ws:1: 2 layers" in built.stdout
    call = edge.calls_to("build_image")[0]
    assert (call["req"].name, call["req"].kind, call["req"].base) == ("ws:1", "toolkit", "busybox")
    with tarfile.open(fileobj=io.BytesIO(call["context"])) as tf:  # packed here, uploaded
        assert tf.extractfile("src/app.py").read() == b"print('hi')\n"  # type: ignore[union-attr]
    assert "ws:1" in runner.invoke(cli.app, ["image", "ls"]).stdout
    missing = runner.invoke(cli.app, ["image", "build", "/no/such/dir", "--name", "x"])
    assert missing.exit_code == 1 and "neither a directory nor a file" in missing.stderr
    bad = runner.invoke(cli.app, ["image", "build", str(ws), "--name", "Bad Name"])
    assert bad.exit_code == 1 and "invalid image name" in bad.stderr
    info = runner.invoke(cli.app, ["info"])
    assert info.exit_code == 0
    assert "node fake" in info.stdout
    for tier in ("fncall", "container", "microvm", "vm"):
        assert tier in info.stdout
    assert "not enabled on this node" in info.stdout


def test_unreachable_server_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "transport_factory", None)
    result = CliRunner().invoke(cli.app, ["--url", "http://127.0.0.1:1", "--api-key", "k", "ps"])
    assert result.exit_code == 1
    assert "dsec serve" in result.stderr and "Traceback" not in result.output


def test_key_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    created = runner.invoke(cli.app, ["key", "create", "--name", "ci", "--home", str(tmp_path)])
    assert created.exit_code == 0
    key = created.stdout.strip()
    assert key.startswith("dsec_")
    listed = runner.invoke(cli.app, ["key", "ls", "--home", str(tmp_path)])
    assert "default" in listed.stdout and "ci" in listed.stdout
    assert runner.invoke(cli.app, ["key", "revoke", key, "--home", str(tmp_path)]).exit_code == 0
    again = runner.invoke(cli.app, ["key", "revoke", key, "--home", str(tmp_path)])
    assert again.exit_code == 1 and "no such key" in again.stderr


# --- RL commands: pause/resume, snapshot, fork, jobs, trajectory, replay ------------------------
def _keep_sandbox(runner: CliRunner, edge: FakeEdge, *extra: str) -> str:
    result = runner.invoke(cli.app, ["run", "--keep", *extra, "--", "true"])
    assert result.exit_code == 0, result.output
    return str(edge.calls_to("exec_stream")[-1]["req"].sandbox_id)


def test_pause_resume_and_ps(runner: CliRunner, edge: FakeEdge) -> None:
    sid = _keep_sandbox(runner, edge)
    paused = runner.invoke(cli.app, ["pause", sid])
    assert paused.exit_code == 0, paused.output
    assert f"paused {sid}: paused, memory" in paused.stdout and "[fake]" in paused.stdout
    ps = runner.invoke(cli.app, ["ps"])
    assert "PAUSED" in ps.stdout and "paused" in ps.stdout and "s ago" in ps.stdout
    resumed = runner.invoke(cli.app, ["resume", sid, "sb-fake-00000000"])
    assert resumed.exit_code == 1  # one of the two does not exist
    assert f"resumed {sid}: running" in resumed.stdout and "sandbox_not_found" in resumed.stderr
    # the fake edge has no pause modes: a suspend is refused with a typed error
    suspended = runner.invoke(cli.app, ["pause", sid, "--mode", "suspend"])
    assert suspended.exit_code == 1 and "capability_not_supported" in suspended.stderr
    bad = runner.invoke(cli.app, ["pause", sid, "--mode", "hibernate"])
    assert bad.exit_code == 1 and "invalid_request" in bad.stderr


def test_snapshot_and_fork(runner: CliRunner, edge: FakeEdge) -> None:
    sid = _keep_sandbox(runner, edge)
    snap = runner.invoke(cli.app, ["snapshot", sid, "--name", "ws:2", "--scrub", "/tmp/*"])
    assert snap.exit_code == 0, snap.output
    digest = snap.stdout.strip()
    assert digest.startswith("sha256:") and "as ws:2" in snap.stderr
    req = edge.calls_to("snapshot_sandbox")[0]["req"]
    assert (req.name, req.scrub) == ("ws:2", ["/tmp/*"])
    # `run` took seq 1 in its own object; a CLI connect continues at the server's next_seq
    assert edge.calls_to("snapshot_sandbox")[0]["env"].seq == 2
    forked = runner.invoke(cli.app, ["fork", sid, "-n", "2", "--label", "b=1"])
    assert forked.exit_code == 0, forked.output
    ids = forked.stdout.split()
    assert len(ids) == 2 and all(i.startswith("sb-fake-") and i != sid for i in ids)
    bad = runner.invoke(cli.app, ["fork", sid, "-n", "0"])
    assert bad.exit_code == 1 and "invalid_request" in bad.stderr
    bad = runner.invoke(cli.app, ["fork", sid, "--label", "novalue"])
    assert bad.exit_code == 1 and "--label wants KEY=VALUE" in bad.stderr


def test_job_commands(runner: CliRunner, edge: FakeEdge) -> None:
    ids = [
        _keep_sandbox(runner, edge),  # not in the job
        *(_keep_sandbox(runner, edge, "--job", "run-42") for _ in range(2)),
    ]
    paused = runner.invoke(cli.app, ["job", "pause", "run-42"])
    assert paused.exit_code == 0, paused.output
    assert all(sid in paused.stdout for sid in ids[1:]) and ids[0] not in paused.stdout
    assert "2 ok, 0 failed" in paused.stderr
    listed = runner.invoke(cli.app, ["job", "ls", "run-42"])
    assert listed.stdout.count("paused") >= 2
    edge.inject_error("resume_sandbox", E.SandboxError("thaw failed"))
    resumed = runner.invoke(cli.app, ["job", "resume", "run-42"])
    assert resumed.exit_code == 1 and "thaw failed [sandbox_error]" in resumed.stdout
    assert "1 ok, 1 failed" in resumed.stderr
    killed = runner.invoke(cli.app, ["job", "kill", "run-42"])
    assert killed.exit_code == 0 and killed.stdout.count("stopped") == 2
    assert "no sandboxes" in runner.invoke(cli.app, ["job", "ls", "run-42"]).stdout
    assert runner.invoke(cli.app, ["job", "ls", "run-42", "--all"]).stdout.count("stopped") == 2
    assert "no sandboxes" in runner.invoke(cli.app, ["job", "pause", "empty"]).stdout
    bad = runner.invoke(cli.app, ["job", "pause", "bad job"])
    assert bad.exit_code == 1 and "not a job id" in bad.stderr


def test_trajectory_and_replay(runner: CliRunner, edge: FakeEdge, tmp_path: Path) -> None:
    edge.program("./check", stdout="3 passed\n", exit_code=0)
    sid = _keep_sandbox(runner, edge, "--memory-mb", "128")
    assert runner.invoke(cli.app, ["exec", sid, "--", "./check"]).exit_code == 0
    out = runner.invoke(cli.app, ["trajectory", sid])
    assert out.exit_code == 0 and out.stdout.startswith('{"type":"header"')
    log = tmp_path / "run.jsonl"
    saved = runner.invoke(cli.app, ["trajectory", sid, "-o", str(log)])
    assert saved.exit_code == 0 and "wrote 2 entries" in saved.stderr
    assert log.read_text() == out.stdout

    ok = runner.invoke(cli.app, ["replay", str(log)])
    assert ok.exit_code == 0, ok.output
    assert "2 entries, 2 applied, 2 compared, 2 matched, 0 divergence(s)" in ok.stdout
    fresh = edge.calls_to("create_sandbox")[-1]["req"]
    assert fresh.memory_mb == 128  # rebuilt from the log's header
    assert edge.sandboxes[fresh_id(edge)].state == "stopped"  # killed afterwards

    edge.program("./check", stdout="2 passed\n", exit_code=1)
    diverged = runner.invoke(cli.app, ["replay", str(log), "--image", "busybox", "--keep"])
    assert diverged.exit_code == 1
    assert "seq 2 exec: exit_code expected 0, got 1" in diverged.stdout
    assert "sandbox kept:" in diverged.stderr
    missing = runner.invoke(cli.app, ["replay", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and "cannot read" in missing.stderr
    (tmp_path / "junk.jsonl").write_text("not json\n")
    junk = runner.invoke(cli.app, ["replay", str(tmp_path / "junk.jsonl")])
    assert junk.exit_code == 1 and "not JSON" in junk.stderr


def fresh_id(edge: FakeEdge) -> str:
    """The id of the last sandbox the fake created."""
    return max(edge.sandboxes.values(), key=lambda info: info.created_at).id


# --- tables at 80 columns, and --output json ---------------------------------------------
@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[CliRunner, FakeEdge]]:
    edge = FakeEdge(node="nodename0012")  # the longest node name: 28-character ids
    transport, key = app_transport(edge)
    monkeypatch.setattr(cli, "transport_factory", lambda: transport)
    monkeypatch.setenv("COLUMNS", "80")
    yield (
        CliRunner(env={"DSEC_API_KEY": key, "DSEC_URL": "http://dsec.invalid", "COLUMNS": "80"}),
        edge,
    )


def _fits(output: str, width: int = 80) -> None:
    for line in output.splitlines():
        assert len(line) <= width, f"{len(line)} columns: {line!r}"
    assert "…" not in output, output


def test_tables_fit_80_columns_and_never_cut_ids(narrow: tuple[CliRunner, FakeEdge]) -> None:
    import json

    runner, edge = narrow
    for _ in range(3):
        r = runner.invoke(
            cli.app,
            ["run", "--keep", "--tier", "container", "--image", "busybox", "--", "true"],
        )
        assert r.exit_code == 0, r.output
    ids = sorted(edge.sandboxes)
    assert all(len(i) == 28 for i in ids)
    # a job, labels and a pause make every column non-empty
    info = edge.sandboxes[ids[0]]
    import asyncio

    from dsec.models import CreateSandboxRequest

    req = CreateSandboxRequest(
        job="rollout-0042-long-job-name", labels={"task": "swe-bench-lite-17", "split": "train"}
    )
    made = asyncio.run(edge.create_sandbox(req, edge.calls_to("create_sandbox")[0]["owner"]))
    ids.append(made.id)
    runner.invoke(cli.app, ["pause", ids[1]])

    ps = runner.invoke(cli.app, ["ps"])
    assert ps.exit_code == 0, ps.output
    _fits(ps.stdout)
    for sandbox_id in ids:
        assert sandbox_id in ps.stdout  # whole, on one line
    header = ps.stdout.splitlines()[0].split()
    assert header[:3] == ["ID", "TIER", "STATE"]
    assert "container" in ps.stdout and "paused" in ps.stdout and "running" in ps.stdout

    wide = runner.invoke(cli.app, ["ps", "-o", "wide"])
    assert "LABELS" in wide.stdout and "split=train" in wide.stdout
    data = json.loads(runner.invoke(cli.app, ["ps", "--output", "json"]).stdout)
    assert sorted(d["id"] for d in data) == sorted(ids) and info.tier == "container"

    for args in (
        ["job", "ls", "rollout-0042-long-job-name"],
        ["job", "pause", "rollout-0042-long-job-name"],
        ["image", "ls"],
        ["info"],
        ["metrics", ids[2]],
    ):
        out = runner.invoke(cli.app, args)
        assert out.exit_code == 0, (args, out.output)
        _fits(out.stdout)
        as_json = runner.invoke(cli.app, [*args, "-o", "json"])
        assert as_json.exit_code == 0, (args, as_json.output)
        json.loads(as_json.stdout)
    assert made.id in runner.invoke(cli.app, ["job", "ls", "rollout-0042-long-job-name"]).stdout
    m = json.loads(runner.invoke(cli.app, ["metrics", ids[2], "-o", "json"]).stdout)
    assert m["sandbox_id"] == ids[2] and "cpu" in m


def test_key_ls_fits_and_has_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("COLUMNS", "80")
    runner = CliRunner(env={"COLUMNS": "80"})
    home = str(tmp_path / "home")
    runner.invoke(cli.app, ["key", "create", "--home", home, "--name", "a" * 70])
    out = runner.invoke(cli.app, ["key", "ls", "--home", home])
    assert out.exit_code == 0, out.output
    _fits(out.stdout)
    records = json.loads(runner.invoke(cli.app, ["key", "ls", "--home", home, "-o", "json"]).stdout)
    assert len(records) == 2 and all("sha256" not in r for r in records)
    assert all(r["owner"] in out.stdout for r in records)


# --- dsec logs ------------------------------------------------------------------------------
LOG_LINES = [
    {"ts": 1.0, "stream": "stdout", "data": "server starting\n"},
    {"ts": 1.5, "stream": "stderr", "data": "warning: no config\n"},
    {"ts": 2.0, "stream": "stdout", "data": "listening on :8000\n"},
    {"ts": 3.0, "stream": "dsec", "data": "start command exited with code 0\n"},
]


@pytest.fixture
def logs_wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[httpx.Request]]:
    """The documented route shape (``GET /v1/sandboxes/{id}/logs``, NDJSON ``ts``/``stream``/
    ``data`` lines, ``?follow=true``), served by a mock transport that records requests."""
    import json

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path != "/v1/sandboxes/sb-node-000000000001/logs":
            body = {"error": {"code": "sandbox_not_found", "message": "sandbox not found"}}
            return httpx.Response(404, json=body)
        text = "".join(json.dumps(x) + "\n" for x in LOG_LINES) + "not json\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "application/x-ndjson"})

    monkeypatch.setattr(cli, "transport_factory", lambda: httpx.MockTransport(handler))
    yield seen


def test_logs_prints_each_stream_where_it_belongs(logs_wire: list[httpx.Request]) -> None:
    runner = CliRunner(env={"DSEC_API_KEY": "dsec_k", "DSEC_URL": "http://dsec.invalid"})
    r = runner.invoke(cli.app, ["logs", "sb-node-000000000001"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "server starting\nlistening on :8000\n"
    assert "warning: no config\n" in r.stderr and "exited with code 0" in r.stderr
    assert logs_wire[-1].url.params.get("follow") is None
    assert logs_wire[-1].headers["authorization"] == "Bearer dsec_k"
    r = runner.invoke(cli.app, ["logs", "-f", "sb-node-000000000001", "-o", "json"])
    assert r.exit_code == 0, r.output
    import json

    assert [json.loads(x) for x in r.stdout.splitlines()] == LOG_LINES
    assert logs_wire[-1].url.params["follow"] == "true"
    r = runner.invoke(cli.app, ["logs", "sb-node-000000000002"])
    assert r.exit_code == 1 and "sandbox_not_found" in r.stderr


def test_logs_against_the_edge_when_it_keeps_them(runner: CliRunner, edge: FakeEdge) -> None:
    r = runner.invoke(cli.app, ["run", "--keep", "--", "true"])
    sandbox_id = edge.calls_to("exec_stream")[0]["req"].sandbox_id
    r = runner.invoke(cli.app, ["logs", sandbox_id])
    assert r.exit_code == 0, r.output
    assert edge.calls_to("sandbox_logs")[0]["sandbox_id"] == sandbox_id
