"""The runtime conformance suite (tests/conformance/runtime_suite.py) on the fakes, without
root: :class:`~dsec.testing.MemoryRuntime` (what ``FakeEdge`` and the simulated cluster nodes
run) and the E2B tests' bubblewrap runtime (when ``bwrap`` is installed)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.conformance.runtime_suite import RuntimeConformance, RuntimeHarness, spec_factory

from dsec.models import ExecRequest, ExecResult
from dsec.testing import FAKE_BUSYBOX, MemoryLayers, MemoryRuntime, _interpret


async def _interpreter(sandbox_id: str, req: ExecRequest) -> ExecResult:
    """The fakes' interpreter (what FakeEdge answers a command it was not programmed for)."""
    return _interpret(req)


class TestMemoryRuntime(RuntimeConformance):
    @pytest.fixture
    async def harness(self) -> AsyncIterator[RuntimeHarness]:
        rt = MemoryRuntime("container", MemoryLayers(), _interpreter)
        await rt.start()
        yield RuntimeHarness(rt, spec_factory("container", [], [FAKE_BUSYBOX]), real_commands=False)
        await rt.close()


class TestBwrapRuntime(RuntimeConformance):
    @pytest.fixture
    async def harness(self, tmp_path: Path) -> AsyncIterator[RuntimeHarness]:
        if shutil.which("bwrap") is None:
            pytest.skip("the bubblewrap runtime needs bwrap (apt-get install bubblewrap)")
        from tests.e2b.fake_edge import BwrapRuntime

        layers = MemoryLayers(system_images=("debian",))
        rt = BwrapRuntime("container", tmp_path / "sandboxes", layers)
        await rt.start()
        digests = layers.get_image("debian").layers
        yield RuntimeHarness(rt, spec_factory("container", [], digests), real_commands=True)
        await rt.close()
