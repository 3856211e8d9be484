"""Evidence of cheating on the VM tiers, under TCG: the guest's guard refuses a command's
system call (its seccomp filter, installed with the log flag), the guest agent keeps the
guest kernel's record, and the edge's audit fetches it into the sandbox's record (category
``guard``). A sandbox restored from the same template starts clean, and a paused one is
not resumed to be read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from dsec.contract.runtime import GuardAudited, Handle
from dsec.edge.audit import AuditSettings, EdgeAudit
from dsec.models import ExecRequest
from dsec.runtimes.microvm import MicroVMRuntime

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow]

NR_MOUNT = 165


async def test_guard_refusal_reaches_the_sandbox_audit(
    microvm: MicroVMRuntime, make_vm: Callable[..., Awaitable[Handle]]
) -> None:
    assert isinstance(microvm, GuardAudited)
    audit = EdgeAudit(AuditSettings(enabled=True, entries_cap=16))
    h = await make_vm()
    audit.recorder.open(h.id, "owner", "microvm")
    assert (await microvm.exec(h, ExecRequest(cmd="echo hi; ls / >/dev/null"))).exit_code == 0
    await audit.sample(h.id, microvm, h, network=False)
    assert audit.recorder.summary(h.id).total == 0  # ordinary commands: nothing refused

    r = await microvm.exec(h, ExecRequest(cmd="mount -t tmpfs none /mnt"))
    assert r.exit_code != 0
    log = await microvm.guard_log(h, 0)
    assert log is not None and log.counts.get(NR_MOUNT) == 1, log
    assert [d.comm for _, d in log.records] == ["mount"]

    await audit.sample(h.id, microvm, h, network=False)
    rep = audit.recorder.report(h.id)
    assert rep.evidence and rep.counts == {"guard.mount": 1}, rep
    (entry,) = rep.entries
    assert entry.category == "guard" and entry.kind == "mount" and entry.comm == "mount"
    assert entry.exe == "/bin/busybox" and "guard" in entry.detail
    assert audit.sources(microvm)["guard"]

    # read again: nothing new is counted twice
    await audit.sample(h.id, microvm, h, network=False)
    assert audit.recorder.summary(h.id).counts == {"guard.mount": 1}

    # a flood: the counts stay exact, the guest keeps a bounded number of details
    flood = "i=0; while [ $i -lt 100 ]; do mount -t tmpfs none /mnt 2>/dev/null; i=$((i+1)); done"
    assert (await microvm.exec(h, ExecRequest(cmd=flood, timeout_s=120))).exit_code == 0
    await audit.sample(h.id, microvm, h, network=False)
    rep = audit.recorder.report(h.id)
    assert rep.counts == {"guard.mount": 101}, rep.counts
    assert len(rep.entries) <= 16

    # paused: not resumed to be read
    await microvm.pause(h)
    assert await microvm.guard_log(h, 0) is None
    assert microvm._live[h.id].paused
    await microvm.resume(h)

    # another sandbox restored from the same template starts with nothing
    h2 = await make_vm()
    log2 = await microvm.guard_log(h2, 0)
    assert log2 is not None and log2.total == 0 and log2.records == [], log2
