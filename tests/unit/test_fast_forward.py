"""Client-side fast-forward: after ``connect(replay=True)`` the SDK answers repeats of recorded
commands from the trajectory log it fetched once, without a request per command."""

from __future__ import annotations

import pytest

from dsec import AsyncSandbox
from dsec.errors import SequenceConflict
from dsec.testing import FakeEdge, app_transport


async def test_replay_answers_recorded_commands_locally() -> None:
    edge = FakeEdge()
    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(image="busybox", transport=transport, api_key=key)
    first = [await sb.commands.run(f"echo step-{i}") for i in range(50)]
    ran = edge.executed.get("exec", 0)
    exec_calls = len(edge.calls_to("exec"))

    again = await AsyncSandbox.connect(sb.id, replay=True, transport=transport, api_key=key)
    calls = len(edge.calls)
    replayed = [await again.commands.run(f"echo step-{i}") for i in range(50)]
    assert [r.stdout for r in replayed] == [r.stdout for r in first]
    assert all(r.replayed for r in replayed)
    assert edge.executed.get("exec", 0) == ran  # nothing ran twice
    assert len(edge.calls_to("exec")) == exec_calls  # and nothing was even sent
    # the only request of the 50 replays: the log, fetched once
    assert [name for name, _ in edge.calls[calls:]] == ["export_trajectory"]
    # past the recorded log the object continues live, numbering where the log ends
    live = await again.commands.run("echo step-50")
    assert not live.replayed and live.stdout == "step-50\n"
    assert edge.executed["exec"] == ran + 1


async def test_a_different_command_under_a_recorded_number_is_a_conflict() -> None:
    edge = FakeEdge()
    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(image="busybox", transport=transport, api_key=key)
    await sb.commands.run("echo a")
    await sb.commands.run("echo b")
    again = await AsyncSandbox.connect(sb.id, replay=True, transport=transport, api_key=key)
    assert (await again.commands.run("echo a")).replayed
    with pytest.raises(SequenceConflict):
        await again.commands.run("echo not-b")  # not answered locally: the edge refuses it
