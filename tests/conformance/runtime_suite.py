"""The runtime conformance suite: the behaviour every :class:`~dsec.contract.runtime.Runtime`
owes the edge, checked on the runtime itself (no edge, no server, no SDK), over a factory.

containerd's ``SnapshotterSuite(t, name, factory)`` in pytest's terms: :class:`RuntimeConformance`
holds the checks and asks for one fixture, ``harness``, that a wiring module provides (a
:class:`RuntimeHarness`: the runtime started, and how to make a spec of one of its sandboxes).
A new runtime is a few lines of wiring::

    class TestMyRuntime(RuntimeConformance):
        @pytest.fixture
        async def harness(self, tmp_path):
            rt = MyRuntime(tmp_path)
            await rt.start()
            yield RuntimeHarness(rt, spec_factory(rt.tier), traits=None, real_commands=True)
            await rt.close()

Wired today: the fakes without root (``tests/unit/test_runtime_conformance.py``:
:class:`~dsec.testing.MemoryRuntime` and the E2B tests' bubblewrap runtime) and every
registered tier as root (``tests/conformance/test_runtime_conformance_root.py``). The checks:
create, exec (output, exit codes, stdin, streaming), files, limits (the output cap, the
wall-clock limit), kill, pause where the runtime is ``Pausable``, sandboxes apart from each
other, and that the tier's registered traits agree with what its runtime implements. The
SDK-level suite (``tests/conformance/test_conformance.py``) stays: it checks the same through
the server, with the edge's rules on top.

Commands are those the fakes' interpreter answers (``echo``, ``cat`` of stdin, ``true``,
``false``, ``/bin/sh -c 'exit N'``); checks that need a real shell (a file seen by a
command, ``sleep``) run when the harness says ``real_commands``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from dsec.contract.runtime import Handle, Pausable, Runtime, SandboxSpec, capabilities_of
from dsec.errors import DsecError, FileNotFound
from dsec.models import ExecRequest
from dsec.tiers import TierTraits

__all__ = ["RuntimeConformance", "RuntimeHarness", "spec_factory"]

SpecFactory = Callable[[], SandboxSpec]


def spec_factory(
    tier: str, layer_paths: list[str] | None = None, layer_digests: list[str] | None = None
) -> SpecFactory:
    """Specs of new sandboxes of ``tier`` over the given layers (each with a fresh id),
    sized as the SDK conformance suite sizes them (1 core, 256 MiB)."""

    def make() -> SandboxSpec:
        return SandboxSpec(
            id=f"sb-conf-{uuid.uuid4().hex[:12]}",
            tier=tier,
            layer_paths=list(layer_paths or []),
            layer_digests=list(layer_digests or []),
            cpu=1.0,
            memory_mb=256,
            disk_mb=256,
            pids=256,
            env={"CONFORMANCE": "1"},
            user=None,
            workdir="/",
        )

    return make


@dataclass
class RuntimeHarness:
    """A started runtime under test and how to make its sandboxes.

    Attributes:
        runtime: the runtime, started; the wiring closes it after the test.
        spec: makes the spec of a new sandbox (:func:`spec_factory`).
        traits: the traits its tier is registered with, checked against the runtime's
            capabilities (None: a fake standing in for several tiers).
        real_commands: commands really run in a shell (else the fakes' interpreter).
    """

    runtime: Runtime
    spec: SpecFactory
    traits: TierTraits | None = None
    real_commands: bool = True


Make = Callable[..., Awaitable[Handle]]


class RuntimeConformance:
    """The checks (see the module docstring). Subclass as ``Test<Name>`` with a ``harness``
    fixture."""

    @pytest.fixture
    async def make(self, harness: RuntimeHarness) -> AsyncIterator[Make]:
        """Creates sandboxes of the runtime; destroys every one afterwards."""
        made: list[Handle] = []

        async def make() -> Handle:
            h = await harness.runtime.create(harness.spec())
            made.append(h)
            return h

        yield make
        for h in made:
            await harness.runtime.destroy(h)

    @staticmethod
    async def run(harness: RuntimeHarness, h: Handle, cmd: str | list[str], **kw: Any) -> Any:
        return await harness.runtime.exec(h, ExecRequest(cmd=cmd, **kw))

    # --- create and exec ----------------------------------------------------------------------

    async def test_create_makes_a_live_sandbox(self, harness: RuntimeHarness, make: Make) -> None:
        assert harness.runtime.facts().available
        h = await make()
        assert await harness.runtime.alive(h)
        assert h.id not in await harness.runtime.list_orphans({h.id})

    async def test_exec_output_and_exit_codes(self, harness: RuntimeHarness, make: Make) -> None:
        h = await make()
        r = await self.run(harness, h, ["echo", "hello", "conformance"])
        assert (r.stdout, r.exit_code, r.timed_out) == ("hello conformance\n", 0, False)
        assert (await self.run(harness, h, "true")).exit_code == 0
        assert (await self.run(harness, h, "false")).exit_code == 1
        assert (await self.run(harness, h, ["/bin/sh", "-c", "exit 3"])).exit_code == 3

    async def test_exec_stdin(self, harness: RuntimeHarness, make: Make) -> None:
        h = await make()
        assert (await self.run(harness, h, "cat", stdin="to stdin\n")).stdout == "to stdin\n"

    async def test_exec_streams_to_its_sink(self, harness: RuntimeHarness, make: Make) -> None:
        h = await make()
        seen: list[tuple[str, bytes]] = []

        async def sink(stream: str, chunk: bytes) -> None:
            seen.append((stream, chunk))

        r = await harness.runtime.exec(h, ExecRequest(cmd=["echo", "streamed"]), sink)
        assert r.exit_code == 0
        assert b"".join(c for s, c in seen if s == "stdout") == b"streamed\n"

    # --- limits --------------------------------------------------------------------------------

    async def test_output_is_capped_and_flagged(self, harness: RuntimeHarness, make: Make) -> None:
        h = await make()
        r = await self.run(harness, h, ["/bin/sh", "-c", "echo " + "x" * 5000], max_output_bytes=64)
        assert r.stdout_truncated and 0 < len(r.stdout.encode()) <= 64

    async def test_exec_wall_clock_limit(self, harness: RuntimeHarness, make: Make) -> None:
        if not harness.real_commands:
            pytest.skip("the fake's commands take no time")
        h = await make()
        t0 = time.monotonic()
        r = await self.run(harness, h, ["sleep", "30"], timeout_s=1)
        assert r.timed_out and r.exit_code != 0
        assert time.monotonic() - t0 < 15

    # --- files ---------------------------------------------------------------------------------

    async def test_files_roundtrip(self, harness: RuntimeHarness, make: Make) -> None:
        h = await make()
        files = harness.runtime.files(h)
        data = bytes(range(256)) * 4
        await files.mkdir("/tmp/conf", parents=True)
        info = await files.write("/tmp/conf/a.bin", data)
        assert info.size == len(data)
        assert await files.read("/tmp/conf/a.bin", 1 << 20) == data
        assert (await files.stat("/tmp/conf/a.bin")).size == len(data)
        assert "/tmp/conf/a.bin" in {f.path for f in await files.list("/tmp/conf")}
        await files.rename("/tmp/conf/a.bin", "/tmp/conf/b.bin")
        assert await files.read("/tmp/conf/b.bin", 1 << 20) == data
        await files.remove("/tmp/conf", recursive=True)
        with pytest.raises(FileNotFound):
            await files.stat("/tmp/conf/b.bin")

    async def test_files_are_what_commands_see(self, harness: RuntimeHarness, make: Make) -> None:
        if not harness.real_commands:
            pytest.skip("the fake's commands do not read files")
        h = await make()
        files = harness.runtime.files(h)
        await files.write("/tmp/from-api.txt", b"api\n")
        assert (await self.run(harness, h, ["cat", "/tmp/from-api.txt"])).stdout == "api\n"
        await self.run(harness, h, ["/bin/sh", "-c", "echo cmd > /tmp/from-cmd.txt"])
        assert await files.read("/tmp/from-cmd.txt", 1024) == b"cmd\n"

    async def test_sandboxes_are_apart(self, harness: RuntimeHarness, make: Make) -> None:
        a, b = await make(), await make()
        await harness.runtime.files(a).write("/tmp/only-in-a", b"a")
        with pytest.raises(FileNotFound):
            await harness.runtime.files(b).stat("/tmp/only-in-a")

    # --- kill and pause ------------------------------------------------------------------------

    async def test_destroy_is_final_and_idempotent(
        self, harness: RuntimeHarness, make: Make
    ) -> None:
        h = await make()
        await harness.runtime.destroy(h)
        assert not await harness.runtime.alive(h)
        await harness.runtime.destroy(h)  # again: a no-op
        with pytest.raises(DsecError):
            await self.run(harness, h, ["echo", "after"])

    async def test_pause_and_resume(self, harness: RuntimeHarness, make: Make) -> None:
        rt = harness.runtime
        if not isinstance(rt, Pausable):
            pytest.skip(f"{rt.tier} is not Pausable (its capability table says pause=False)")
        h = await make()
        await rt.pause(h)
        await asyncio.wait_for(rt.resume(h), 30)
        assert (await self.run(harness, h, ["echo", "resumed"])).stdout == "resumed\n"

    # --- the registration ------------------------------------------------------------------------

    async def test_traits_agree_with_the_runtime(self, harness: RuntimeHarness) -> None:
        if harness.traits is None:
            pytest.skip("a fake standing in for any tier: no registration to agree with")
        caps = capabilities_of(harness.runtime)
        assert caps.ports == harness.traits.ports
        assert harness.runtime.facts().persistent == harness.traits.persistent
