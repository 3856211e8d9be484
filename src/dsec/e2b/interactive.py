"""Interactive processes: what the E2B layer needs beyond ``EdgeAPI.exec_stream``.

E2B's process API keeps a command running after the request that started it
(``commands.run(background=True)``), writes to its stdin later
(``send_stdin`` / ``stream_input`` / ``close_stdin``), signals it (``kill``) and
lets other requests attach to its output (``commands.connect``). An edge with the optional
:class:`~dsec.contract.edge.InteractiveExec` ability gives full fidelity:
``start_process()`` returns an :class:`~dsec.contract.edge.InteractiveProcess` whose stdin
stays open until closed.

An edge without it still works through :class:`ExecStreamProcess`, an adapter
over ``exec_stream``: output streams, exit codes, kill (by cancelling the
stream) and timeouts work; stdin after start and signals other than
SIGKILL/SIGTERM raise :class:`~dsec.errors.CapabilityNotSupported`.

Units: sizes in bytes, times in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal as signal_mod
from collections.abc import AsyncIterator

from dsec.contract.edge import (
    EdgeAPI,
    InteractiveExec,
    InteractiveProcess,
    OutputChunk,
    PtySize,
)
from dsec.e2b.errors import sandbox_ref
from dsec.errors import CapabilityNotSupported, DsecError, InternalError
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxExecRequest

log = logging.getLogger("dsec.e2b")

__all__ = [
    "ExecStreamProcess",
    "InteractiveExec",
    "InteractiveProcess",
    "OutputChunk",
    "PtySize",
    "start_interactive",
]


class ExecStreamProcess:
    """An :class:`InteractiveProcess` over ``EdgeAPI.exec_stream`` (no stdin after start).

    A background task drains the edge's event stream into a queue. ``signal``
    with SIGKILL/SIGTERM/SIGINT cancels that stream (the edge kills the process
    when its stream is closed); other signals and stdin writes raise
    ``CapabilityNotSupported``.
    """

    _QUEUE_CHUNKS = 256

    def __init__(self, edge: EdgeAPI, sandbox_id: str, owner: str, req: ExecRequest) -> None:
        self._queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue(self._QUEUE_CHUNKS)
        self._result: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self._killed_by: int | None = None
        self._sandbox_id = sandbox_id
        events = edge.exec_stream(SandboxExecRequest.of(sandbox_id, req), owner)
        self._task = asyncio.create_task(self._pump(events))

    async def _pump(self, events: AsyncIterator[ExecEvent]) -> None:
        result: ExecResult | BaseException | None = None
        try:
            async for event in events:
                if event.type == "stdout" and event.data:
                    await self._queue.put(("stdout", event.data.encode()))
                elif event.type == "stderr" and event.data:
                    await self._queue.put(("stderr", event.data.encode()))
                elif event.type == "exit":
                    result = event.result or ExecResult()
                elif event.type == "error":
                    err = event.error or {}
                    from dsec.errors import error_from_wire

                    result = error_from_wire(500, {"error": err})
        except asyncio.CancelledError:
            result = ExecResult(exit_code=None, signal=self._killed_by or signal_mod.SIGKILL)
        except DsecError as e:
            result = e
        except Exception:
            # a bug: its text (which may name server paths) goes to the log, not the client
            log.exception("E2B exec stream of sandbox %s failed", self._sandbox_id)
            result = InternalError("exec stream failed (see the server log)")
        finally:
            with contextlib.suppress(Exception):
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
            if result is None:
                result = InternalError("exec stream ended without an exit event")
            if not self._result.done():
                if isinstance(result, BaseException):
                    self._result.set_exception(result)
                else:
                    self._result.set_result(result)
            # The consumer may be gone; never block on the terminator.
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(None)

    async def read_output(self) -> OutputChunk | None:
        if self._task.done() and self._queue.empty():
            return None
        return await self._queue.get()

    async def write_stdin(self, data: bytes) -> None:
        raise CapabilityNotSupported(
            "this dsec edge cannot write to the stdin of a running process "
            "(it lacks InteractiveExec); pass input at start instead"
        )

    async def close_stdin(self) -> None:
        # The process got an empty stdin at start: it already sees EOF.
        return None

    async def signal(self, signum: int) -> None:
        if signum not in (signal_mod.SIGKILL, signal_mod.SIGTERM, signal_mod.SIGINT):
            raise CapabilityNotSupported(
                f"this dsec edge can only kill a running process, not send signal {signum}"
            )
        if not self._task.done():
            self._killed_by = signum
            self._task.cancel()

    async def resize(self, size: PtySize) -> None:
        raise CapabilityNotSupported("process has no terminal")

    async def wait(self) -> ExecResult:
        return await asyncio.shield(self._result)


async def start_interactive(
    edge: EdgeAPI,
    sandbox_id: str,
    owner: str,
    req: ExecRequest,
    *,
    stdin: bool,
    pty: PtySize | None,
) -> InteractiveProcess:
    """Start ``req`` with :class:`InteractiveExec` when the edge has it (and it works for this
    sandbox's tier), else over ``exec_stream``."""
    if isinstance(edge, InteractiveExec):
        try:
            return await edge.start_process(sandbox_id, owner, req, stdin=stdin, pty=pty)
        except CapabilityNotSupported:
            # The edge has the call but not this sandbox's tier (e.g. dsec's EdgeAgent on a
            # tier whose runtime has no interactive processes): run it over exec_stream.
            if pty is not None:
                raise
    if pty is not None:
        raise CapabilityNotSupported(
            "this dsec edge has no interactive processes (InteractiveExec): no PTY"
        )
    # Fail fast on a missing or foreign sandbox, as start_process would.
    await edge.get_sandbox(sandbox_ref(sandbox_id), owner)
    proc = ExecStreamProcess(edge, sandbox_id, owner, req)
    return proc
