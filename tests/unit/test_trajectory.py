"""TrajectoryLog: sequencing rules, durability under kill -9, export, fast-forward rate."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsec.edge.trajectory import (
    FORMAT,
    OutcomeUnknown,
    SequenceConflict,
    SequenceGap,
    TrajectoryLog,
    canonical_digest,
    digest_value,
)
from dsec.errors import Conflict, InvalidRequest, SandboxStopped, SandboxTimeout

SB = "sb-test-000001"


@pytest.fixture
def log(tmp_path: Path) -> TrajectoryLog:
    tl = TrajectoryLog(tmp_path / "trajectory.db")
    yield tl
    tl.close()


def _exec_req(cmd: str) -> dict[str, object]:
    return {"cmd": cmd, "cwd": None, "env": {}, "timeout_s": 60.0}


def test_new_then_replay_returns_recorded_result(log: TrajectoryLog) -> None:
    b = log.begin(SB, 1, None, "exec", _exec_req("echo hi"))
    assert (b.kind, b.seq, b.status) == ("new", 1, "pending")
    log.commit(SB, 1, {"exit_code": 0, "stdout": "hi\n"}, {"run_ms": 3.5})
    again = log.begin(SB, 1, None, "exec", _exec_req("echo hi"))
    assert again.kind == "replay"
    assert again.result == {"exit_code": 0, "stdout": "hi\n"}
    assert again.timings == {"run_ms": 3.5}
    assert again.gidx == b.gidx
    assert log.next_seq(SB) == 2


def test_gap_is_an_error_with_expected_seq(log: TrajectoryLog) -> None:
    log.begin(SB, 1, None, "exec", _exec_req("a"))
    with pytest.raises(SequenceGap) as ei:
        log.begin(SB, 3, None, "exec", _exec_req("c"))
    assert isinstance(ei.value, Conflict)
    assert ei.value.details["expected_seq"] == 2
    assert ei.value.details["seq"] == 3
    assert "expected seq=2" in ei.value.message
    with pytest.raises(SequenceGap):
        log.begin("sb-other", 2, None, "exec", _exec_req("x"))  # a new sandbox starts at 1


def test_conflicting_repeat_is_an_error(log: TrajectoryLog) -> None:
    log.begin(SB, 1, None, "exec", _exec_req("a"))
    log.commit(SB, 1, {"exit_code": 0})
    with pytest.raises(SequenceConflict) as ei:
        log.begin(SB, 1, None, "exec", _exec_req("b"))
    d = ei.value.details
    assert d["expected_seq"] == 2 and d["seq"] == 1
    assert d["recorded_digest"] == canonical_digest(_exec_req("a"))
    with pytest.raises(SequenceConflict):  # same request body, other op
        log.begin(SB, 1, None, "write_file", _exec_req("a"))


def test_uncommitted_entry_is_unknown_and_never_new(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    first = TrajectoryLog(db)
    first.begin(SB, 1, None, "exec", _exec_req("rm -rf /work"))
    first.close()  # the edge "crashed" while the command ran
    second = TrajectoryLog(db)
    b = second.begin(SB, 1, None, "exec", _exec_req("rm -rf /work"))
    assert b.kind == "unknown"
    err = b.unknown_error()
    assert isinstance(err, OutcomeUnknown) and isinstance(err, Conflict)
    assert err.details["status"] == "unknown" and err.details["expected_seq"] == 2
    entry = next(second.entries(SB))
    assert entry["status"] == "unknown"
    # the client may carry on with the next seq
    assert second.begin(SB, 2, None, "exec", _exec_req("ls")).kind == "new"
    second.close()


def test_idempotency_keys(log: TrajectoryLog) -> None:
    b = log.begin(SB, None, "step-a", "write_file", {"path": "/x", "data": b"1"})
    assert b.kind == "new" and b.seq == 1
    log.commit(SB, b.seq, {"path": "/x", "size": 1})
    r = log.begin(SB, None, "step-a", "write_file", {"path": "/x", "data": b"1"})
    assert r.kind == "replay" and r.seq == 1 and r.result == {"path": "/x", "size": 1}
    with pytest.raises(SequenceConflict):
        log.begin(SB, None, "step-a", "write_file", {"path": "/x", "data": b"2"})
    with pytest.raises(SequenceConflict):  # key bound to seq 1, not 2
        log.begin(SB, 2, "step-a", "write_file", {"path": "/x", "data": b"1"})
    # unkeyed, unsequenced calls take the next seq
    assert log.begin(SB, None, None, "exec", _exec_req("true")).seq == 2


def test_recorded_error_is_replayed_as_the_same_error(log: TrajectoryLog) -> None:
    log.begin(SB, 1, None, "exec", _exec_req("sleep 99"))
    log.commit_error(SB, 1, SandboxTimeout("took too long", limit_s=1))
    r = log.begin(SB, 1, None, "exec", _exec_req("sleep 99"))
    assert r.kind == "replay" and r.status == "error"
    assert isinstance(r.error, SandboxTimeout)
    assert r.error.details == {"limit_s": 1}


def test_abort_lets_the_last_seq_be_retried(log: TrajectoryLog) -> None:
    log.begin(SB, 1, None, "exec", _exec_req("a"))
    assert log.abort(SB, 1, SandboxStopped("gone")) is True
    assert log.next_seq(SB) == 1
    assert log.begin(SB, 1, None, "exec", _exec_req("a")).kind == "new"
    log.begin(SB, 2, None, "exec", _exec_req("b"))
    # seq 1 is no longer the last: it is committed as an error instead of leaving a hole
    assert log.abort(SB, 1, SandboxStopped("gone")) is False
    assert isinstance(log.begin(SB, 1, None, "exec", _exec_req("a")).error, SandboxStopped)


def test_bad_input(log: TrajectoryLog) -> None:
    with pytest.raises(InvalidRequest):
        log.begin(SB, 0, None, "exec", {})
    with pytest.raises(InvalidRequest):
        log.begin(SB, 1, None, "", {})
    with pytest.raises(InvalidRequest):
        log.commit(SB, 5, {})  # never begun
    log.begin(SB, 1, None, "exec", {})
    log.commit(SB, 1, {})
    with pytest.raises(InvalidRequest):
        log.commit(SB, 1, {})  # already committed


def test_purged_seq_is_a_conflict_not_a_rerun(log: TrajectoryLog) -> None:
    log.begin(SB, 1, None, "exec", _exec_req("a"))
    log.commit(SB, 1, {})
    assert log.purge(SB) == 1
    with pytest.raises(SequenceConflict):
        log.begin(SB, 1, None, "exec", _exec_req("a"))
    assert log.next_seq(SB) == 2


def test_global_order_spans_sandboxes(log: TrajectoryLog) -> None:
    seen = []
    for i in range(1, 4):
        for sb in ("sb-a", "sb-b"):
            seen.append(log.begin(sb, i, None, "exec", _exec_req(f"{sb}{i}")).gidx)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_concurrent_begins_assign_unique_seqs(log: TrajectoryLog) -> None:
    seqs: list[int] = []

    def worker(k: int) -> None:
        for i in range(50):
            b = log.begin(SB, None, None, "exec", _exec_req(f"{k}-{i}"))
            log.commit(SB, b.seq, {"k": k})
            seqs.append(b.seq)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs) == list(range(1, 201))


def test_export_jsonl_digests_large_values(log: TrajectoryLog) -> None:
    big = "x" * 10_000
    blob = os.urandom(100_000)
    log.begin(SB, 1, None, "exec", _exec_req("yes | head"))
    log.commit(SB, 1, {"exit_code": 3, "stdout": big, "stderr": "e"}, {"run_ms": 1})
    log.begin(SB, 2, None, "write_file", {"path": "/blob", "data": blob})
    log.commit(SB, 2, {"path": "/blob", "size": len(blob)})
    log.begin(SB, 3, None, "exec", _exec_req("hang"))  # never committed
    lines = list(log.export_jsonl(SB, header={"create": {"image": "busybox"}}))
    assert all(line.endswith("\n") for line in lines)
    head, *entries = (json.loads(x) for x in lines)
    assert head == {
        "type": "header",
        "format": FORMAT,
        "sandbox_id": SB,
        "create": {"image": "busybox"},
    }
    assert [e["seq"] for e in entries] == [1, 2, 3]
    e1, e2, e3 = entries
    assert e1["exit_code"] == 3
    assert e1["result"]["stdout"] == {"$sha256": digest_value(big), "size": 10_000}
    assert e1["stdout_sha256"] == digest_value(big)
    assert e1["result"]["stderr"] == "e"
    assert e1["timings"] == {"run_ms": 1}
    # a large upload is stored as its digest (over inline_bytes) and exported as such
    assert e2["request"]["data"]["$sha256"] == digest_value(blob)
    assert e3["status"] == "unknown" and e3["result"] is None
    assert e1["gidx"] < e2["gidx"] < e3["gidx"]


_CRASH_WRITER = r"""
import sys, os
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from dsec.edge.trajectory import TrajectoryLog
log = TrajectoryLog(Path(sys.argv[1]))
seq = log.next_seq("sb-crash")
print("start", seq, flush=True)
payload = "r" * 200_000
while True:
    b = log.begin("sb-crash", seq, None, "exec", {"cmd": f"step {seq}"})
    if b.kind == "new":
        log.commit("sb-crash", seq, {"exit_code": 0, "stdout": payload + str(seq)})
    seq += 1
"""


def test_kill_9_mid_write_leaves_a_consistent_log(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    script = tmp_path / "writer.py"
    script.write_text(_CRASH_WRITER)
    src = str(Path(__file__).resolve().parents[2] / "src")
    rng = random.Random(1234)
    for _round in range(6):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(db), src], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("start")
        time.sleep(rng.uniform(0.01, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raw = sqlite3.connect(db)
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        raw.close()
        log = TrajectoryLog(db)
        entries = list(log.entries("sb-crash"))
        seqs = [e["seq"] for e in entries]
        assert seqs == list(range(1, len(seqs) + 1)), "no holes"
        assert log.next_seq("sb-crash") == len(seqs) + 1
        # every entry but the last is committed with its own result; the last may be pending
        for e in entries[:-1]:
            assert e["status"] == "ok"
            res = e["result"]
            assert res.get("resolved") or res["stdout"].endswith(str(e["seq"]))
        last = entries[-1]
        again = log.begin("sb-crash", last["seq"], None, "exec", {"cmd": f"step {last['seq']}"})
        assert again.kind == ("unknown" if last["status"] == "unknown" else "replay")
        if again.kind == "unknown":  # resolve it so the next round's writer can go on
            log.commit("sb-crash", last["seq"], {"exit_code": None, "resolved": True})
        log.close()
    assert len(seqs) > 6


def test_fast_forward_replays_every_entry(tmp_path: Path) -> None:
    """5,000 recorded entries begun again are all replays with their own results (the rate,
    >= 10,000 entries/s, is measured by benchmarks/lifecycle.py, not asserted here)."""
    log = TrajectoryLog(tmp_path / "ff.db")
    n = 5000
    reqs = [_exec_req(f"python step.py --n {i}") for i in range(1, n + 1)]
    for i, req in enumerate(reqs, 1):
        log.begin(SB, i, None, "exec", req)
        log.commit(SB, i, {"exit_code": 0, "stdout": f"reward {i}\n", "stderr": ""})
    for i, req in enumerate(reqs, 1):
        b = log.begin(SB, i, None, "exec", req)
        assert b.kind == "replay" and b.result is not None
        assert b.result["stdout"] == f"reward {i}\n"
    assert log.next_seq(SB) == n + 1
    log.close()


# --------------------------------------------------------------------------- replay
from dsec.replay import create_kwargs, read_header, replay_lines  # noqa: E402


def _record(log: TrajectoryLog, sb: str, seq: int, op: str, req: dict, res: dict) -> None:
    log.begin(sb, seq, None, op, req)
    log.commit(sb, seq, res)


def _sample_log(log: TrajectoryLog) -> list[str]:
    _record(log, SB, 1, "write_file", {"path": "/w/a.txt", "data": b"alpha\n", "mode": 0o644},
            {"path": "/w/a.txt", "size": 6})  # fmt: skip
    _record(log, SB, 2, "exec", _exec_req("cat /w/a.txt"),
            {"exit_code": 0, "stdout": "alpha\n", "stderr": "", "timed_out": False})  # fmt: skip
    _record(log, SB, 3, "exec", _exec_req("echo done"),
            {"exit_code": 0, "stdout": "done\n", "stderr": "", "timed_out": False})  # fmt: skip
    log.begin(SB, 4, None, "remove_file", {"path": "/missing", "recursive": False})
    from dsec.errors import FileNotFound

    log.commit_error(SB, 4, FileNotFound("no /missing", path="/missing"))
    return list(
        log.export_jsonl(SB, header={"create": {"image": "busybox", "cpu": 0.5, "job": "j"}})
    )


async def test_replay_against_the_real_sdk_and_a_fake_edge(log: TrajectoryLog) -> None:
    from dsec.sdk import AsyncSandbox
    from dsec.testing import FakeEdge, app_transport

    lines = _sample_log(log)
    assert create_kwargs(read_header(lines)) == {"image": "busybox", "cpu": 0.5}
    edge = FakeEdge()
    edge.program("cat /w/a.txt", stdout="alpha\n")
    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(api_key=key, transport=transport, url="http://test")
    try:
        report = await replay_lines(lines, sb)
    finally:
        await sb.kill()
        await sb.close()
    assert report.ok, report.format_text()
    assert (report.entries, report.applied, report.compared, report.matched) == (4, 4, 4, 4)
    assert [c["req"].cmd for c in edge.calls_to("exec")] == ["cat /w/a.txt", "echo done"]


async def test_replay_reports_every_divergence(log: TrajectoryLog) -> None:
    from dsec.sdk import AsyncSandbox
    from dsec.testing import FakeEdge, app_transport

    lines = _sample_log(log)
    edge = FakeEdge()
    edge.program("cat /w/a.txt", stdout="beta\n", exit_code=1)  # diverges: output and exit
    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(api_key=key, transport=transport, url="http://test")
    try:
        await sb.files.write("/missing", "now it exists")  # the recorded error will not recur
        report = await replay_lines(lines, sb)
    finally:
        await sb.kill()
        await sb.close()
    assert not report.ok
    got = {(d.seq, d.field) for d in report.divergences}
    assert got == {(2, "exit_code"), (2, "stdout_sha256"), (4, "error")}
    d4 = next(d for d in report.divergences if d.seq == 4)
    assert (d4.expected, d4.actual) == ("file_not_found", "no error")
    text = report.format_text()
    assert "seq 2 exec: exit_code expected 0, got 1" in text


async def test_replay_skips_what_cannot_be_reproduced(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path / "t.db", inline_bytes=16)
    _record(log, SB, 1, "write_file", {"path": "/big", "data": b"x" * 100, "mode": 0o644},
            {"size": 100})  # fmt: skip
    log.begin(SB, 2, None, "exec", _exec_req("echo maybe"))  # never committed
    lines = list(log.export_jsonl(SB))
    log.close()

    class Result:
        exit_code, timed_out, stdout, stderr = 0, False, "maybe\n", ""

    class Commands:
        async def run(self, cmd: object, **kw: object) -> Result:
            return Result()

    class Target:
        commands = Commands()
        files = None

    report = await replay_lines(lines, Target())
    assert report.applied == 1 and report.compared == 0
    assert [s["seq"] for s in report.skipped] == [1, 2]
    assert [d.field for d in report.divergences] == ["not_reproducible"]


async def test_replay_rejects_foreign_input() -> None:
    class Target:
        commands = files = None

    with pytest.raises(InvalidRequest):
        await replay_lines(['{"type": "header", "format": "other/1"}'], Target())
    with pytest.raises(InvalidRequest):
        await replay_lines(["not json"], Target())


def test_next_seqs_matches_next_seq_for_many(log: TrajectoryLog) -> None:
    ids = [f"sb-n-{i:04d}" for i in range(1203)]
    for i, sid in enumerate(ids[:40]):
        for seq in range(1, i % 4 + 2):
            log.begin(sid, seq, None, "exec", _exec_req(f"echo {seq}"))
            log.commit(sid, seq, {"exit_code": 0})
    got = log.next_seqs(ids)
    assert got == {sid: log.next_seq(sid) for sid in ids}
    assert got[ids[3]] == 5 and got[ids[1000]] == 1 and log.next_seqs([]) == {}


def test_replays_are_counted_and_exported(tmp_path: Path) -> None:
    # a log written before replays were counted gets the column on open
    old = tmp_path / "old.db"
    db = sqlite3.connect(old)
    db.executescript(
        "CREATE TABLE trajectory (gidx INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT "
        "NULL, seq INTEGER NOT NULL, idem_key TEXT, op TEXT NOT NULL, request TEXT NOT NULL, "
        "request_digest TEXT NOT NULL, status TEXT NOT NULL, result TEXT, timings TEXT, "
        "begun_at REAL NOT NULL, committed_at REAL, UNIQUE (sandbox_id, seq));"
    )
    db.close()
    log = TrajectoryLog(old)
    req = {"cmd": "echo hi"}
    b = log.begin("sb-a", 1, None, "exec", req)
    log.commit("sb-a", b.seq, {"exit_code": 0, "stdout": "hi\n"})
    assert next(log.entries("sb-a"))["replays"] == 0
    assert log.begin("sb-a", 1, None, "exec", req).kind == "replay"
    assert log.begin("sb-a", 1, None, "exec", req).kind == "replay"
    lines = [json.loads(x) for x in log.export_jsonl("sb-a")]
    assert lines[1]["replays"] == 2 and lines[1]["exit_code"] == 0
    log.close()
