"""Build records (``GET /v1/builds``): per owner, bounded, states from the events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from dsec.builds import records as R
from dsec.builds.wire import BuildDone, BuildError, BuildStarted, StepOutput, StepStarted
from dsec.errors import NodeLost, NotFound
from dsec.models import ImageInfo

IMAGE = ImageInfo(name="app:1", layers=["sha256:" + "a" * 64], size=1, created_at=datetime.now(UTC))


async def events(build_id: str, *tail: Any) -> AsyncIterator[Any]:
    yield BuildStarted(build_id=build_id, name="app:1", base="debian", steps=2)
    yield StepStarted(step=2, total=2, instruction="RUN make", line=2)
    yield StepOutput(step=2, stream="stdout", data="compiling\n")
    for event in tail:
        if isinstance(event, BaseException):
            raise event
        yield event


async def drain(records: R.BuildRecords, owner: str, it: AsyncIterator[Any]) -> list[Any]:
    return [e async for e in records.record(owner, it)]


async def test_states_logs_and_owners() -> None:
    records = R.BuildRecords()
    done = BuildDone(image=IMAGE, cached_steps=1, built_steps=1, duration_ms=12.5)
    assert len(await drain(records, "alice", events("b-1", done))) == 4
    fail = BuildError(code="build_failed", message="step 2 failed", step=2, output_tail="x")
    await drain(records, "alice", events("b-2", fail))
    with pytest.raises(NodeLost):
        await drain(records, "alice", events("b-3", NodeLost("node gone")))
    listed = records.list("alice").builds
    assert [(b.build_id, b.state) for b in listed] == [
        ("b-3", "failed"),
        ("b-2", "failed"),
        ("b-1", "done"),
    ]
    assert listed[2].image == "app:1" and listed[2].duration_ms == 12.5 and listed[2].log is None
    assert listed[1].error is not None and listed[1].error["details"]["step"] == 2
    assert listed[0].error is not None and listed[0].error["code"] == "node_lost"
    one = records.get("b-1", "alice")
    assert one.log == ["step 2/2 (line 2): RUN make\n", "compiling\n"]
    assert records.list("bob").builds == []
    with pytest.raises(NotFound):
        records.get("b-1", "bob")


async def test_a_caller_that_stops_reading_cancels_the_record() -> None:
    records = R.BuildRecords()
    it = records.record("alice", events("b-1", BuildDone(image=IMAGE)))
    assert isinstance(await anext(it), BuildStarted)
    await it.aclose()
    assert records.get("b-1", "alice").state == "cancelled"


async def test_refusals_before_the_start_leave_no_record() -> None:
    async def refused() -> AsyncIterator[Any]:
        raise NotFound("no image 'nope'")
        yield  # pragma: no cover

    records = R.BuildRecords()
    with pytest.raises(NotFound):
        await drain(records, "alice", refused())
    assert records.list("alice").builds == []


async def test_bounded_per_owner_and_per_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "MAX_LOG_BYTES", 100)
    records = R.BuildRecords(max_per_owner=3)
    running = records.record("alice", events("b-0"))
    await anext(running)  # b-0 stays running: finished ones are forgotten first
    for i in range(1, 6):
        out = [StepOutput(step=2, stream="stdout", data="y" * 40 + "\n") for _ in range(10)]
        await drain(records, "alice", events(f"b-{i}", *out, BuildDone(image=IMAGE)))
    ids = [b.build_id for b in records.list("alice").builds]
    assert ids == ["b-5", "b-4", "b-0"]
    last = records.get("b-5", "alice")
    assert last.log is not None and sum(len(x) for x in last.log) <= 100
    assert last.log_dropped_bytes > 0
    await running.aclose()
