"""The audit recorder (dsec.edge.audit) without a kernel: exact counts, the per-sandbox cap
on details (first half kept, then the newest), sampled counters, the bounded memory of
stopped sandboxes, following, the placement of entries in a trajectory export, and the
parsing of the kernel's seccomp records."""

from __future__ import annotations

import asyncio
import json
import os

from dsec.contract.runtime import Handle
from dsec.edge.audit import AuditRecorder, AuditSettings, EdgeAudit, interleave_audit, place_entries
from dsec.errors import PathOutsideSandbox
from dsec.models import AuditEntry, ExecResult
from dsec.privileged.seccomp_log import (
    GuardLog,
    audit_id_of,
    parse_guard_log,
    parse_landlock,
    parse_record,
    syscall_name,
)

RECORD = (
    b"audit(1796641437.214:2): auid=1234567 uid=0 gid=0 ses=1 pid=15452 "
    b'comm="python3" exe="/usr/bin/python3.11" sig=0 arch=c000003e syscall=101 '
    b"compat=0 ip=0x7f717a91f829 code=0x50000"
)


def _recorder(cap: int = 8, kept: int = 4) -> AuditRecorder:
    return AuditRecorder(AuditSettings(enabled=True, entries_cap=cap, stopped_kept=kept))


def test_counts_stay_exact_when_details_are_capped() -> None:
    rec = _recorder(cap=8)
    rec.open("sb-a", "k1", "container")
    for i in range(10_000):
        rec.record("sb-a", "syscall", "ptrace", f"attempt {i}")
    rep = rec.report("sb-a")
    assert rep.counts == {"syscall.ptrace": 10_000}
    assert rep.total == 10_000 and rep.evidence
    assert len(rep.entries) == 8 and rep.dropped == 10_000 - 8 and rep.cap == 8
    ids = [e.id for e in rep.entries]
    assert ids == [1, 2, 3, 4, 9997, 9998, 9999, 10_000]  # the first half, then the newest
    assert rep.entries[0].detail == "attempt 0"


def test_long_texts_are_clipped_and_limits_are_no_evidence() -> None:
    rec = _recorder()
    rec.open("sb-a", "k1", "container")
    rec.record("sb-a", "limits", "exec_timeout", "x" * 10_000, cmdline="y" * 10_000)
    rep = rec.report("sb-a")
    assert not rep.evidence and rep.total == 1
    assert len(rep.entries[0].detail) == 256 and len(rep.entries[0].cmdline or "") == 256


def test_sampled_counters_record_increases_only() -> None:
    rec = _recorder()
    rec.open("sb-a", "k1", "container")
    rec.sample("sb-a", "network", "blocked", "1.2.3.4:80/tcp", 3, "dropped")
    rec.sample("sb-a", "network", "blocked", "1.2.3.4:80/tcp", 3, "dropped")
    rec.sample("sb-a", "network", "blocked", "1.2.3.4:80/tcp", 5, "dropped")
    rec.sample("sb-a", "network", "blocked", "5.6.7.8:53/udp", 1, "dropped")
    rep = rec.report("sb-a")
    assert rep.counts == {"network.blocked": 6}
    assert [e.count for e in rep.entries] == [3, 2, 1]


def test_stopped_sandboxes_are_remembered_within_a_bound() -> None:
    rec = _recorder(kept=2)
    for n in range(4):
        rec.open(f"sb-{n}", "k1", "container", job="j")
        rec.record(f"sb-{n}", "files", "dotdot", "..")
        summary = rec.close(f"sb-{n}")
        assert summary is not None and summary.stopped and summary.total == 1
    assert rec.summary("sb-0").total == 0  # forgotten: the oldest beyond the bound
    assert rec.summary("sb-3").total == 1
    rec.record("sb-3", "files", "dotdot", "..")  # stopped: no more records
    assert rec.summary("sb-3").total == 1
    rec.forget(["sb-3"])
    assert rec.summary("sb-3").total == 0


def test_disabled_recorder_keeps_nothing() -> None:
    rec = AuditRecorder(AuditSettings(enabled=False))
    rec.open("sb-a", "k1", "container")
    rec.record("sb-a", "syscall", "ptrace")
    rep = rec.report("sb-a")
    assert not rep.enabled and rep.total == 0 and rep.entries == []


def test_follow_yields_new_entries_until_the_sandbox_stops() -> None:
    async def go() -> list[int]:
        rec = _recorder(cap=100)
        rec.open("sb-a", "k1", "container")
        rec.record("sb-a", "syscall", "mount")
        got: list[int] = []

        async def reader() -> None:
            async for e in rec.follow("sb-a", after=0):
                got.append(e.id)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        rec.record("sb-a", "syscall", "bpf")
        await asyncio.sleep(0.01)
        rec.close("sb-a")
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(go()) == [1, 2]


class _Rt:
    """A runtime that only answers the audit's questions."""

    log_denials = True
    log_landlock = True

    def audit_id(self, handle: Handle) -> int | None:
        return 1234567

    def limit_counters(self, handle: Handle) -> dict[str, int]:
        return {"oom_kill": 1, "pids_max": 0}


def test_seccomp_records_map_to_their_sandbox_by_audit_id() -> None:
    async def go() -> None:
        audit = EdgeAudit(AuditSettings(enabled=True, entries_cap=8))
        audit.sandbox_added("sb-a", "k1", "container", None, _Rt(), Handle("sb-a", {"auid": 1}))  # type: ignore[arg-type]
        rec = parse_record(RECORD)
        assert rec is not None
        audit._on_seccomp([rec])
        other = parse_record(RECORD.replace(b"auid=1234567", b"auid=7"))
        assert other is not None
        audit._on_seccomp([other])
        rep = audit.recorder.report("sb-a")
        assert rep.counts == {"syscall.ptrace": 1}
        assert rep.entries[0].comm == "python3" and "seccomp" in rep.entries[0].detail
        assert audit.recorder.unattributed == 1
        audit.refusal("sb-a", "k2", PathOutsideSandbox("path '/..' contains '..'"))  # not theirs
        audit.refusal("sb-a", "k1", PathOutsideSandbox("path '/..' contains '..'"))
        audit.exec_result("sb-a", ExecResult(timed_out=True, stdout_truncated=True), ["sleep"])
        summary = await audit.sandbox_stopping("sb-a", _Rt(), Handle("sb-a"))  # type: ignore[arg-type]
        assert summary is not None
        assert summary.counts == {
            "files.dotdot": 1,
            "limits.exec_timeout": 1,
            "limits.oom_kill": 1,
            "limits.output_cap": 1,
            "syscall.ptrace": 1,
        }

    asyncio.run(go())


def test_an_oom_kill_in_an_exec_result_counts_where_no_counter_shows_it() -> None:
    """The VM tiers (not Audited: no cgroup of the sandbox on the host) tell an OOM kill in
    the command's result; a tier whose cgroup counts them is not counted twice."""
    audit = EdgeAudit(AuditSettings(enabled=True, entries_cap=8))
    for sid in ("sb-vm", "sb-ct"):
        audit.recorder.open(sid, "k1", "microvm", None)
    killed = ExecResult(exit_code=137, oom_killed=True)
    audit.exec_result("sb-vm", killed, ["tail", "/dev/zero"], oom_from_result=True)
    audit.exec_result("sb-ct", killed, ["tail", "/dev/zero"])  # its cgroup's counter says it
    audit.exec_result("sb-vm", ExecResult(exit_code=0), ["true"], oom_from_result=True)
    vm = audit.recorder.report("sb-vm")
    assert vm.counts == {"limits.oom_kill": 1}
    assert vm.entries[0].cmdline == "tail /dev/zero" and not vm.evidence
    assert audit.recorder.report("sb-ct").counts == {}


def test_record_parsing_and_names() -> None:
    rec = parse_record(RECORD)
    assert rec is not None
    assert (rec.auid, rec.pid, rec.syscall, rec.errno, rec.comm) == (
        1234567,
        15452,
        101,
        0,  # the record names the action, not the errno it returned
        "python3",
    )
    assert parse_record(b"audit(1.2:3): nothing here") is None
    assert syscall_name(0xC000003E, 101) in ("ptrace", "syscall_101")
    assert audit_id_of("sb-x") == audit_id_of("sb-x") >= 1 << 30
    assert audit_id_of("sb-x") != audit_id_of("sb-y")


def test_entries_sit_between_the_calls_they_happened_between() -> None:
    lines = [
        json.dumps({"type": "header"}) + "\n",
        json.dumps({"type": "entry", "seq": 1, "begun_at": 10.0, "committed_at": 11.0}) + "\n",
        json.dumps({"type": "entry", "seq": 2, "begun_at": 20.0, "committed_at": 21.0}) + "\n",
    ]
    entries = [
        AuditEntry(id=1, ts=15.0, category="syscall", kind="mount"),
        AuditEntry(id=2, ts=25.0, category="files", kind="dotdot"),
        AuditEntry(id=3, ts=5.0, category="limits", kind="oom_kill"),
    ]
    out = [json.loads(x) for x in interleave_audit(lines, entries)]
    assert [(o["type"], o.get("seq"), o.get("id")) for o in out] == [
        ("header", None, None),
        ("audit", None, 3),
        ("entry", 1, None),
        ("audit", 1, 1),
        ("entry", 2, None),
        ("audit", 2, 2),
    ]
    fresh = [
        AuditEntry(id=1, ts=15.0, category="files", kind="dotdot"),
        # a kernel record stamped just before call 2 began, while call 1 had ended: call 2's
        AuditEntry(id=2, ts=19.998, category="syscall", kind="mount"),
        # ... and one stamped while call 1 still ran, though call 2 began within the slack
        AuditEntry(id=3, ts=29.999, category="syscall", kind="mount"),
    ]
    place_entries(fresh, [(1, 10.0, 19.0), (2, 20.0, 29.9995), (3, 30.001, None)])
    assert [e.seq for e in fresh] == [1, 2, 2]


def test_kernel_records_are_placed_by_their_stamp_and_arrival() -> None:
    from dsec.edge.audit import place_record

    calls = [(1, 10.000, 10.006), (2, 10.009, 10.015)]
    # stamped after call 1 ended: call 2's, whatever the arrival
    assert place_record(10.007, 10.012, calls) == 2
    # stamped while call 1 ran, arrived before call 2 began: call 1's
    assert place_record(10.004, 10.0065, calls) == 1
    # stamped just before call 1 ended (the clock lags a tick), arrived well into call 2
    assert place_record(10.0055, 10.013, calls) == 2
    assert place_record(9.0, 9.5, calls) is None
    assert place_record(10.020, 10.021, [*calls, (3, 10.018, None)]) == 3


class _GuardRt:
    """A VM tier's guard as the edge sees it: a fixed answer of the guest agent."""

    def __init__(self, answer: list[bytes]) -> None:
        self.answer = answer
        self.asked: list[int] = []

    async def guard_log(self, handle: Handle, after: int) -> GuardLog | None:
        self.asked.append(after)
        return parse_guard_log(self.answer)


def _guard_line(seq: int, syscall: int, pid: int, arch: str = "c000003e") -> bytes:
    return (
        f"{seq} audit(1796641434.782:{seq}): auid=4294967295 uid=0 gid=0 ses=4294967295 "
        f'pid={pid} comm="mount" exe="/bin/busybox" sig=0 arch={arch} syscall={syscall} '
        "compat=0 ip=0x4b2f0e code=0x50001"
    ).encode()


def test_guard_refusals_from_the_guest_keep_exact_counts() -> None:
    async def go() -> None:
        audit = EdgeAudit(AuditSettings(enabled=True, entries_cap=8))
        audit.recorder.open("sb-v", "k1", "microvm")
        # 5 refused mounts, the guest kept the details of the last 2 (one process), and a
        # clone3 (the libc fallback: no evidence)
        rt = _GuardRt(
            [b"9 6 0", b"165=5 435=1", _guard_line(7, 165, 42) + b"\n" + _guard_line(8, 165, 42)]
        )
        await audit.sample("sb-v", rt, Handle("sb-v"), network=False)  # type: ignore[arg-type]
        rep = audit.recorder.report("sb-v")
        assert rep.counts == {"guard.mount": 5} and rep.evidence
        detailed = [e for e in rep.entries if e.comm == "mount"]
        assert [e.count for e in detailed] == [2] and "guest pid 42" in detailed[0].detail
        assert sum(e.count for e in rep.entries) == 5  # the rest: one entry without details
        assert audit.fallbacks == 1
        await audit.sample("sb-v", rt, Handle("sb-v"), network=False)  # type: ignore[arg-type]
        assert audit.recorder.report("sb-v").counts == {"guard.mount": 5}  # not twice
        assert rt.asked == [0, 8]  # the next read asks for what is newer
        assert audit.sources(rt)["guard"]  # type: ignore[arg-type]

    asyncio.run(go())


def test_guard_log_parsing() -> None:
    log = parse_guard_log([b"3 2 1", b"165=1 1024=1", _guard_line(1, 165, 7) + b"\njunk\n"])
    assert (log.next, log.total, log.lost, log.counts) == (3, 2, 1, {165: 1, 1024: 1})
    assert [(seq, d.syscall, d.pid) for seq, d in log.records] == [(1, 165, 7)]
    empty = parse_guard_log([b"1 0 0", b"", b""])
    assert empty.counts == {} and empty.records == []


LL_ACCESS = (
    b'audit(1796653301.214:77): domain=1a2b3c4d5 blockers=fs.make_char path="/tmp" '
    b'dev="tmpfs" ino=1'
)


def test_landlock_records_map_by_the_domain_maker() -> None:
    """A refusal names its domain only; the domain's record names the process that made it,
    whose loginuid names the sandbox (here: this process's own)."""
    with open("/proc/self/loginuid") as f:
        own = int(f.read())
    domain = f'audit(1796653301.214:78): domain=1a2b3c4d5 status=allocated mode=enforcing pid={os.getpid()} uid=0 exe="/x" comm="x"'.encode()
    access = parse_landlock(1423, LL_ACCESS)
    made = parse_landlock(1424, domain)
    assert access is not None and made is not None
    assert (access.kind, access.domain, access.blockers, access.object) == (
        "access",
        0x1A2B3C4D5,
        "fs.make_char",
        "path=/tmp",
    )
    assert (made.kind, made.pid) == ("domain", os.getpid())
    assert parse_landlock(1424, b"audit(1.2:3): domain=1a status=deallocated denials=1") is None
    audit = EdgeAudit(AuditSettings(enabled=True, entries_cap=8))
    rt = _Rt()
    rt.audit_id = lambda handle: own  # type: ignore[method-assign]
    audit.sandbox_added("sb-l", "k1", "fncall", None, rt, Handle("sb-l", {"auid": own}))  # type: ignore[arg-type]
    audit._on_landlock([access])  # its domain is not known yet: it waits
    assert audit.recorder.summary("sb-l").total == 0
    audit._on_landlock([made, access])
    rep = audit.recorder.report("sb-l")
    assert rep.counts == {"landlock.fs.make_char": 2} and rep.evidence
    assert "path=/tmp" in rep.entries[0].detail
