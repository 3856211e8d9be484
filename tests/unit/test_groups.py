"""Sandbox groups through the SDK against the real apiserver in front of FakeEdge (whose
tier packs: a group falls back to the packed fork there), and the fork request's new fields
on the wire. The shared fork itself is tested on a real node (tests/integration/
test_groups_root.py)."""

from __future__ import annotations

from typing import Any

import pytest

import dsec.errors as E
from dsec import AsyncSandbox, Sandbox
from dsec.models import ForkRequest, ForkResult
from dsec.sdk import AsyncSandboxGroup, SandboxGroup
from dsec.testing import FakeEdge


async def test_create_group_runs_the_setup_once(edge: FakeEdge, conn: dict[str, Any]) -> None:
    edge.program("make setup", stdout="done\n")
    async with await AsyncSandbox.create_group(
        3, image="busybox", setup=["make setup"], labels={"task": "t"}, **conn
    ) as group:
        assert isinstance(group, AsyncSandboxGroup) and len(group) == 3
        assert group.method == "pack" and group.parent is None  # the fake tier packs
        assert group.job.startswith("grp-")
        assert [c["req"].n for c in edge.calls_to("fork_sandbox")] == [3]
        assert len(edge.calls_to("create_sandbox")) == 1  # the forks' are inside the fork
        for sb in group:
            assert sb.info.job == group.job and sb.info.labels == {"task": "t"}
        assert group[0].id != group[1].id and len(group[0:2]) == 2
        assert (await group.pause()).ok and (await group.resume()).ok
    assert {c["req"].job for c in edge.calls_to("create_sandbox")} == {group.job}


async def test_setup_function_and_failures(edge: FakeEdge, conn: dict[str, Any]) -> None:
    async def setup(sb: AsyncSandbox) -> None:
        await sb.files.write("/w/state", "ready")

    group = await AsyncSandbox.create_group(
        2, image="busybox", setup=setup, keep_parent=True, job="mine", **conn
    )
    assert group.job == "mine" and group.parent is not None
    assert [await sb.files.read_text("/w/state") for sb in group] == ["ready", "ready"]
    assert len((await group.kill()).outcomes) == 3  # the kept parent is of the job too
    edge.program("false", exit_code=1, stderr="nope\n")
    with pytest.raises(E.StartFailed) as failed:
        await AsyncSandbox.create_group(2, image="busybox", setup=["false"], **conn)
    assert failed.value.details["exit_code"] == 1
    with pytest.raises(E.InvalidRequest):  # nothing made for a bad n or argument
        await AsyncSandbox.create_group(0, image="busybox", **conn)
    with pytest.raises(ValueError):
        await AsyncSandbox.create_group(257, image="busybox", **conn)
    with pytest.raises(E.InvalidRequest):
        await AsyncSandbox.create_group(2, image="busybox", cpuu=1, **conn)
    # the two set-up sandboxes (the group's, the one whose set-up failed); none for the rest
    assert len(edge.calls_to("create_sandbox")) == 2


def test_sync_group(edge: FakeEdge, conn: dict[str, Any]) -> None:
    seen: list[str] = []

    def setup(sb: Sandbox) -> None:  # a plain function gets the sync sandbox
        assert isinstance(sb, Sandbox)
        sb.files.write("/w/x", "1")
        seen.append(sb.id)

    with Sandbox.create_group(2, image="busybox", setup=setup, **conn) as group:
        assert isinstance(group, SandboxGroup) and len(group) == 2
        assert all(isinstance(sb, Sandbox) for sb in group)
        assert group[1].files.read_text("/w/x") == "1" and len(seen) == 1
    assert all(sb.refresh().state == "stopped" for sb in group)


def test_fork_request_wire() -> None:
    assert ForkRequest(sandbox_id="sb-n-1", n=2).model_dump()["method"] == "auto"
    assert (
        ForkRequest(sandbox_id="sb-n-1", n=2).model_dump()["parent"] == "keep"
    )  # as fork always was: the parent runs on
    for bad in ({"n": 2, "method": "copy"}, {"n": 2, "parent": "stop"}, {"n": 257}):
        with pytest.raises(ValueError):
            ForkRequest.model_validate(bad)
    # an answer from an older server (no method) still reads; a newer field is dropped
    old = ForkResult.model_validate({"layer": None, "sandboxes": []})
    assert old.method == "pack"
