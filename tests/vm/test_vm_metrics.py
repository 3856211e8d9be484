"""Usage of a microvm sandbox (the runtime's ``Measurable`` ability), under TCG: CPU and host
memory from QEMU's cgroup, memory from the guest's ``/proc/meminfo`` while it runs, and a
paused guest measured without being resumed (host numbers only)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from dsec.contract.runtime import Handle, Measurable
from dsec.models import ExecRequest
from dsec.runtimes.microvm import MicroVMRuntime

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow]


async def test_microvm_usage(
    microvm: MicroVMRuntime, make_vm: Callable[..., Awaitable[Handle]]
) -> None:
    assert isinstance(microvm, Measurable)
    h = await make_vm(memory_mb=256, disk_mb=64)
    first = await microvm.usage(h)
    assert "guest /proc/meminfo" in first.source, first
    assert first.memory_limit_bytes == 256 << 20
    assert 0 < first.memory_used_bytes < 1 << 30
    assert first.host_memory_bytes is not None and first.host_memory_bytes > 0
    assert first.disk_total_bytes == 64 << 20 and first.net is None

    burn = "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"
    r = await microvm.exec(h, ExecRequest(cmd=burn))
    assert r.exit_code == 0
    second = await microvm.usage(h)
    assert second.cpu_usage_ns > first.cpu_usage_ns

    await microvm.pause(h)
    paused = await microvm.usage(h)
    assert "guest" not in paused.source  # a stopped guest cannot answer: host numbers
    assert paused.memory_used_bytes == paused.host_memory_bytes
    assert microvm._live[h.id].paused  # still paused
    await microvm.resume(h)
