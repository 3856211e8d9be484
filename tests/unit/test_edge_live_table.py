"""The edge's live table: admission, usage and lookups from running totals (issue 23)."""

from __future__ import annotations

import pytest

import dsec.errors as E
from dsec.edge.live import LiveTable
from dsec.models import CreateSandboxRequest, SandboxRef
from dsec.testing import FakeEdge


def test_totals_follow_adds_replacements_and_removals() -> None:
    t: LiveTable[str] = LiveTable()
    t.add("a", "A", cpu=0.5, memory_mb=100)
    t.add("b", "B", cpu=1.25, memory_mb=50)
    assert (len(t), t.requested_cpu, t.requested_memory_mb) == (2, 1.75, 150)
    t.add("a", "A2", cpu=2.0, memory_mb=10)  # a replacement replaces its request
    assert (t["a"], t.requested_cpu, t.requested_memory_mb) == ("A2", 3.25, 60)
    assert t.pop("a") == "A2" and t.pop("a") is None  # a second pop changes nothing
    assert (t.requested_cpu, t.requested_memory_mb) == (1.25, 50)
    assert "b" in t and "a" not in t and t.get("a") is None and list(t) == ["b"]
    for i in range(1000):  # float drift does not survive an empty table
        t.add(f"x{i}", "x", cpu=0.1, memory_mb=1)
    for i in range(1000):
        t.pop(f"x{i}")
    t.pop("b")
    assert (len(t), t.requested_cpu, t.requested_memory_mb) == (0, 0.0, 0)
    with pytest.raises(KeyError):
        t["b"]


async def test_admission_and_usage_come_from_the_running_totals() -> None:
    edge = FakeEdge()
    edge.limits.cpu_overcommit = 2.0 / edge._cpus  # the node admits 2 cores in all
    req = CreateSandboxRequest(tier="container", image="busybox", cpu=0.75, memory_mb=64)
    a = await edge.create_sandbox(req, "k1")
    b = await edge.create_sandbox(req, "k2")  # another key counts against the same node
    usage = edge.usage()
    assert (usage.sandboxes, usage.requested_cpu, usage.requested_memory_mb) == (2, 1.5, 128)
    with pytest.raises(E.QuotaExceeded, match="CPU overcommit"):
        await edge.create_sandbox(req, "k1")  # 2.25 > 2 cores
    assert edge.usage().sandboxes == 2  # the refused one left nothing counted
    await edge.kill_sandbox(SandboxRef(sandbox_id=a.id), "k1")
    assert edge.usage().requested_cpu == 0.75
    c = await edge.create_sandbox(req, "k1")  # the freed share is admitted again
    await edge.kill_sandbox(SandboxRef(sandbox_id=b.id), "k2")
    await edge.kill_sandbox(SandboxRef(sandbox_id=c.id), "k1")
    assert (edge.usage().sandboxes, edge.usage().requested_cpu) == (0, 0.0)
    await edge.close()


async def test_a_create_commits_twice_to_the_registry() -> None:
    """The row as ``creating`` (what a restarted edge cleans up), then ``running`` with its
    handle and activity time in one commit (it was three commits)."""
    edge = FakeEdge()
    writes: list[str] = []
    edge.registry._db.set_trace_callback(
        lambda sql: (
            writes.append(sql) if sql.lstrip().upper().startswith(("INSERT", "UPDATE")) else None
        )
    )
    info = await edge.create_sandbox(CreateSandboxRequest(tier="container"), "k1")
    edge.registry._db.set_trace_callback(None)
    assert len(writes) == 2, writes
    row = edge.registry.get(info.id)
    assert (
        row is not None
        and row.state == "running"
        and row.last_active > 0
        and row.handle == {"fake": True}
    )
    await edge.close()
