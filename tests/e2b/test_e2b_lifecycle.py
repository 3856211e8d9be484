"""Pause, resume, snapshots and fork through the e2b SDK (mapped to the edge's RL lifecycle)."""

from __future__ import annotations

from tests.conftest import wait_until

from conftest import E2BServer
from dsec.models import SandboxRef
from e2b import Sandbox, SandboxState


def test_pause_resume_and_transparent_resume(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/state.txt", "v1")
        bg = sbx.commands.run("sleep 30", background=True)
        assert sbx.pause() is True
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        assert sbx.pause() is False  # already paused
        listed = Sandbox.list().next_items()
        assert {s.sandbox_id: s.state for s in listed}[sbx.sandbox_id] == SandboxState.PAUSED
        again = Sandbox.connect(sbx.sandbox_id)  # connect resumes
        assert again.get_info().state == SandboxState.RUNNING
        assert [p.pid for p in again.commands.list()] == [bg.pid]  # the process survived
        assert again.commands.run("cat /home/user/state.txt").stdout == "v1"
        sbx.pause()
        assert sbx.commands.run("echo awake").stdout == "awake\n"  # any request resumes
        assert sbx.get_info().state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_on_timeout_pause(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base", timeout=1, lifecycle={"on_timeout": "pause"})
    try:
        assert (
            e2b_server.call(
                e2b_server.edge.get_sandbox(SandboxRef(sandbox_id=sbx.sandbox_id), "alice")
            ).on_timeout
            == "pause"
        )
        # its 1 s is over: paused by the edge's TTL check (every 0.05 s here)
        assert wait_until(
            lambda: Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, timeout_s=5
        )
        Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert sbx.get_info().state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_snapshot_then_create_from_it_and_fork(e2b_server: E2BServer) -> None:
    sbx = Sandbox.create("base", metadata={"origin": "parent"})
    made: list[Sandbox] = []
    try:
        sbx.files.write("/home/user/work.txt", "built")
        snap = sbx.create_snapshot(name="e2b-test-snap")
        assert snap.snapshot_id == "e2b-test-snap"
        clone = Sandbox.create(snap.snapshot_id)
        made.append(clone)
        assert clone.files.read("/home/user/work.txt") == "built"
        assert clone.get_info().template_id == "e2b-test-snap"
        forks = sbx.fork(count=2)
        assert len(forks) == 2
        for child in forks:
            assert isinstance(child, Sandbox)
            made.append(child)
            assert child.sandbox_id != sbx.sandbox_id
            assert child.commands.run("cat /home/user/work.txt").stdout == "built"
            assert child.get_info().metadata == {"origin": "parent"}
    finally:
        for s in [sbx, *made]:
            s.kill()
