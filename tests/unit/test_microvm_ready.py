"""A guest's wait for its agent is timed by QEMU's own CPU time, not the wall clock: a boot
on a saturated host is slow, not stuck (:func:`dsec.runtimes.microvm.runtime.until_ready`).
A process stands for QEMU and a coroutine for the agent's answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from dsec.errors import SandboxError, SandboxTimeout
from dsec.runtimes.microvm import runtime as microvm
from dsec.runtimes.microvm.protocol import AgentClient
from dsec.runtimes.microvm.qemu import QemuProcess


@pytest.fixture
def qemu(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> QemuProcess:
        """A process that runs ``code`` once it is up (its start-up, slow under emulation,
        is not the guest's CPU: the wait starts after it)."""
        ready = "import sys; sys.stdout.write('up\\n'); sys.stdout.flush()\n"
        p = subprocess.Popen([sys.executable, "-c", ready + code], stdout=subprocess.PIPE)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        log = tmp_path / "qemu.log"
        log.write_text("qemu's log\n")
        return QemuProcess(pid=p.pid, dir=tmp_path, log=log, console=tmp_path / "console", popen=p)

    yield start
    for p in procs:
        p.kill()
        p.wait()


async def _answers_after(seconds: float) -> None:
    await asyncio.sleep(seconds)


AGENT = cast(AgentClient, object())  # never asked: each call passes its own first request


async def test_an_idle_qemu_waits_past_its_cpu_budget_on_the_wall_clock(qemu: Any) -> None:
    proc = qemu("import time; time.sleep(60)")  # a guest held up by the host, using no CPU
    # a 1 s budget of CPU, an agent that answers after 1.5 s: slow, not stuck
    await microvm.until_ready(proc, AGENT, 1.0, "cold boot", _answers_after(1.5))


async def test_a_qemu_that_spends_its_cpu_budget_times_out(
    qemu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(microvm, "_READY_POLL_S", 0.1)
    monkeypatch.setattr(microvm, "_READY_WALL_FACTOR", 1e6)  # only the CPU can end it
    proc = qemu("while True: pass")  # a guest spinning without its agent ever answering
    with pytest.raises(SandboxTimeout) as e:
        await microvm.until_ready(proc, AGENT, 0.5, "cold boot", _answers_after(3600))
    assert "QEMU spent" in e.value.message and "its budget: 0.5 s" in e.value.message
    assert "qemu's log" in e.value.message  # the evidence


async def test_a_qemu_that_waits_on_nothing_ends_at_the_wall_ceiling(
    qemu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(microvm, "_READY_WALL_FACTOR", 4.0)
    proc = qemu("import time; time.sleep(60)")
    with pytest.raises(SandboxTimeout) as e:
        await microvm.until_ready(proc, AGENT, 0.25, "restore", _answers_after(3600))
    assert "not ready 1 s into restore" in e.value.message


async def test_a_qemu_that_exits_fails_at_once(qemu: Any) -> None:
    proc = qemu("import sys; sys.exit(1)")
    with pytest.raises(SandboxError) as e:
        await microvm.until_ready(proc, AGENT, 30, "cold boot", _answers_after(3600))
    assert "stopped during cold boot" in e.value.message
