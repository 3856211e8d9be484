"""envd's ``process.Process`` Connect service over dsec.

E2B's in-sandbox agent (envd) keeps a table of running processes that outlive
the request that started them. :class:`ProcessRegistry` is that table on the
apiserver side: each entry holds an :class:`~dsec.e2b.interactive.InteractiveProcess`,
a pump task that reads its output and fans it out to every attached stream
(the ``Start`` stream and any ``Connect`` streams), and the process config for
``List``. An entry disappears when its process exits.

Pids are virtual: unique per apiserver process, not the pid inside the sandbox.
A process's ``timeout`` (the ``Connect-Timeout-Ms`` of its ``Start`` request) is
its wall-clock limit: the edge kills it then, as envd does. Dropping a stream
(``disconnect()``) leaves the process running.

Backpressure (as envd): output is never dropped for an attached stream. When a
stream has more than :data:`SUBSCRIBER_BUFFER_BYTES` unread, the pump stops
reading the process's output until that stream has caught up (half the budget);
the edge then stops draining the process's pipe and the process blocks in
``write(2)``. Memory per stream is therefore bounded; a stream that never reads
stalls its process until it is dropped. With no stream attached output is read
and discarded. Pausing the sandbox ends its open streams with ``CANCELED`` (the
processes live on; ``commands.connect`` re-attaches after a resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal as signal_mod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from pydantic import ValidationError

from dsec.contract.edge import EdgeAPI
from dsec.e2b.errors import (
    sandbox_gone_message,
    sandbox_ref,
    stream_ended_error,
    to_connect_error,
)
from dsec.e2b.interactive import InteractiveProcess, PtySize, start_interactive
from dsec.e2b.users import SandboxUsers, user_from_headers
from dsec.errors import DsecError, SandboxNotFound, SandboxStopped
from dsec.models import ExecRequest, ExecResult

__all__ = [
    "ManagedProcess",
    "ProcessRegistry",
    "ProcessService",
    "paused_error",
    "user_from_headers",
]

log = logging.getLogger("dsec.e2b")

Event = process_pb.ProcessEvent
MAX_PROCESS_TIMEOUT_S = 24 * 3600.0
"""Limit for a process started without a timeout (``timeout=0``): ExecRequest's maximum."""
MAX_OUTPUT_BYTES = 64 << 20
"""Per-stream output cap handed to the edge (ExecRequest's maximum)."""
SUBSCRIBER_BUFFER_BYTES = 4 << 20
"""Unread output one attached stream may hold, bytes. Beyond it the pump waits for the
stream to drain to half of this (backpressure: the process is slowed, nothing is dropped)."""
MAX_PROCESSES_PER_SANDBOX = 256
PAUSE_CHECK_INTERVAL_S = 2.0
"""How often a stream with no output checks whether its sandbox was paused, seconds."""

BASH_FALLBACK = 'if [ -x /bin/bash ]; then exec /bin/bash "$@"; fi; exec /bin/sh "$@"'
"""E2B runs every command as ``/bin/bash -l -c <cmd>``; images without bash get ``/bin/sh -l -c``."""


def _start_event(pid: int) -> Event:
    payload: Oneof[Literal["start"], Event.StartEvent] = Oneof("start", Event.StartEvent(pid=pid))
    return Event(event=payload)


def _data_event(stream: str, data: bytes) -> Event:
    if stream == "stderr":
        err: Oneof[Literal["stderr"], bytes] = Oneof("stderr", data)
        output = Event.DataEvent(output=err)
    elif stream == "pty":
        pty: Oneof[Literal["pty"], bytes] = Oneof("pty", data)
        output = Event.DataEvent(output=pty)
    else:
        out: Oneof[Literal["stdout"], bytes] = Oneof("stdout", data)
        output = Event.DataEvent(output=out)
    payload: Oneof[Literal["data"], Event.DataEvent] = Oneof("data", output)
    return Event(event=payload)


def _keepalive_event() -> Event:
    payload: Oneof[Literal["keepalive"], Event.KeepAlive] = Oneof("keepalive", Event.KeepAlive())
    return Event(event=payload)


def _end_event(end: Event.EndEvent) -> Event:
    payload: Oneof[Literal["end"], Event.EndEvent] = Oneof("end", end)
    return Event(event=payload)


def paused_error(sandbox_id: str) -> ConnectError:
    """What an open process stream of a sandbox that was paused ends with (the SDK raises
    ``TimeoutException``, as when an E2B sandbox pauses)."""
    return ConnectError(
        Code.CANCELED,
        f"sandbox {sandbox_id} was paused; the process keeps its state and continues "
        "after a resume (commands.connect re-attaches)",
    )


def _exit_status(result: ExecResult) -> str:
    """Go's ``ProcessState.String()``, which envd reports as ``status``."""
    if result.exit_code is not None:
        return f"exit status {result.exit_code}"
    names: dict[int, str] = {
        signal_mod.SIGKILL: "killed",
        signal_mod.SIGTERM: "terminated",
        signal_mod.SIGINT: "interrupt",
    }
    sig = result.signal or signal_mod.SIGKILL
    return f"signal: {names.get(sig, str(sig))}"


class Subscriber:
    """The event buffer of one attached stream (``Start`` or ``Connect``).

    :meth:`offer` never blocks; the pump calls :meth:`wait_for_room` after each chunk,
    which blocks while more than :data:`SUBSCRIBER_BUFFER_BYTES` are unread here.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[Event | None, int]] = asyncio.Queue()
        self._pending = 0
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False
        self.error: ConnectError | None = None
        """Set when the stream was ended for a reason other than the process's exit."""

    @property
    def pending_bytes(self) -> int:
        """Output queued here and not yet read by the stream, bytes."""
        return self._pending

    def offer(self, event: Event | None, size: int = 0) -> None:
        """Queue ``event`` (``None``: end of stream) of ``size`` output bytes."""
        if self.closed:
            return
        if event is None:
            self.closed = True
            self._room.set()
        self._pending += size
        if self._pending > SUBSCRIBER_BUFFER_BYTES and not self.closed:
            self._room.clear()
        self._queue.put_nowait((event, size))

    def fail(self, error: ConnectError) -> None:
        """End the stream with ``error`` once it has read what is already queued."""
        if not self.closed:
            self.error = error
            self.offer(None)

    def detach(self) -> None:
        """The stream went away: stop holding the pump back."""
        self.closed = True
        self._room.set()

    async def wait_for_room(self) -> None:
        """Return once this stream holds at most half its budget unread (or ended)."""
        await self._room.wait()

    async def get(self) -> Event | None:
        event, size = await self._queue.get()
        self._pending -= size
        if self._pending <= SUBSCRIBER_BUFFER_BYTES // 2:
            self._room.set()
        return event


@dataclass(eq=False)
class ManagedProcess:
    """One process in the registry."""

    pid: int
    sandbox_id: str
    owner: str
    tag: str | None
    config: process_pb.ProcessConfig
    proc: InteractiveProcess
    stdin_open: bool
    has_pty: bool
    subscribers: set[Subscriber] = field(default_factory=set)
    result: ExecResult | None = None
    error: DsecError | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.detach()

    def info(self) -> process_pb.ProcessInfo:
        return process_pb.ProcessInfo(config=self.config, pid=self.pid, tag=self.tag)


class ProcessRegistry:
    """Running processes per sandbox (see the module docstring)."""

    def __init__(self, edge: EdgeAPI, users: SandboxUsers | None = None) -> None:
        self._edge = edge
        self.users = users if users is not None else SandboxUsers(edge)
        """The sandboxes' users and homes (shared with the filesystem service)."""
        self._pids = itertools.count(1000)
        self._procs: dict[str, dict[int, ManagedProcess]] = {}

    async def start(
        self,
        sandbox_id: str,
        owner: str,
        request: process_pb.StartRequest,
        *,
        timeout_s: float | None,
        user: str | None,
    ) -> tuple[ManagedProcess, Subscriber]:
        """Start a process and attach the caller's stream before any output can be lost."""
        config = request.process or process_pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
        argv = [config.cmd, *config.args]
        if config.cmd == "/bin/bash":
            argv = ["/bin/sh", "-c", BASH_FALLBACK, "sh", *config.args]
        live = self._procs.get(sandbox_id, {})
        if len(live) >= MAX_PROCESSES_PER_SANDBOX:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"at most {MAX_PROCESSES_PER_SANDBOX} running processes per sandbox",
            )
        try:  # as envd: a relative cwd, or none, is taken in the user's home
            cwd = await self.users.cwd(
                sandbox_id, owner, user, config.cwd if config.has_field("cwd") else None
            )
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        try:
            exec_req = ExecRequest(
                cmd=argv,
                cwd=cwd,
                env=dict(config.envs),
                timeout_s=min(timeout_s or MAX_PROCESS_TIMEOUT_S, MAX_PROCESS_TIMEOUT_S),
                user=user,
                max_output_bytes=MAX_OUTPUT_BYTES,
            )
        except ValidationError as e:
            msg = "; ".join(str(err["msg"]) for err in e.errors())
            raise ConnectError(Code.INVALID_ARGUMENT, msg) from None
        pty = None
        if request.pty is not None:
            size = request.pty.size or process_pb.PTY.Size(cols=80, rows=24)
            pty = PtySize(cols=size.cols or 80, rows=size.rows or 24)
        stdin = bool(request.stdin) if request.has_field("stdin") else False
        try:
            proc = await start_interactive(
                self._edge, sandbox_id, owner, exec_req, stdin=stdin or pty is not None, pty=pty
            )
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        tag = request.tag if request.has_field("tag") else None
        managed = ManagedProcess(
            pid=next(self._pids),
            sandbox_id=sandbox_id,
            owner=owner,
            tag=tag,
            config=process_pb.ProcessConfig(
                cmd=config.cmd, args=list(config.args), envs=dict(config.envs), cwd=cwd
            ),
            proc=proc,
            stdin_open=stdin or pty is not None,
            has_pty=pty is not None,
        )
        queue = managed.subscribe()
        self._procs.setdefault(sandbox_id, {})[managed.pid] = managed
        managed.pump = asyncio.create_task(self._pump(managed))
        return managed, queue

    @staticmethod
    def _broadcast(managed: ManagedProcess, event: Event | None, size: int = 0) -> None:
        for sub in list(managed.subscribers):
            sub.offer(event, size)
            if sub.closed:
                managed.subscribers.discard(sub)

    async def end_streams_if_paused(self, sandbox_id: str, owner: str) -> None:
        """:meth:`end_streams` with the pause error when the edge says the sandbox is paused."""
        try:
            info = await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)
        except DsecError:
            return  # gone: the pump sees it
        if info.state == "paused":
            self.end_streams(sandbox_id, paused_error(sandbox_id))

    def end_streams(self, sandbox_id: str, error: ConnectError) -> int:
        """End every stream attached to a process of this sandbox with ``error`` (the
        processes keep running). Returns how many streams were ended."""
        ended = 0
        for managed in list(self._procs.get(sandbox_id, {}).values()):
            for sub in list(managed.subscribers):
                sub.fail(error)
                managed.subscribers.discard(sub)
                ended += 1
        return ended

    async def _pump(self, managed: ManagedProcess) -> None:
        try:
            while True:
                chunk = await managed.proc.read_output()
                if chunk is None:
                    break
                stream, data = chunk
                self._broadcast(managed, _data_event(stream, data), len(data))
                for sub in list(managed.subscribers):  # backpressure: see the module docstring
                    await sub.wait_for_room()
            managed.result = await managed.proc.wait()
        except DsecError as e:
            managed.error = e
        except asyncio.CancelledError:
            managed.error = None
            managed.result = ExecResult(exit_code=None, signal=signal_mod.SIGKILL)
            with contextlib.suppress(Exception):
                await managed.proc.signal(signal_mod.SIGKILL)
        except Exception:
            from dsec.errors import InternalError

            # a bug: its text (which may name server paths) goes to the log, not the client
            log.exception("E2B process pump of sandbox %s failed", managed.sandbox_id)
            managed.error = InternalError("process pump failed (see the server log)")
        finally:
            procs = self._procs.get(managed.sandbox_id)
            if procs is not None:
                procs.pop(managed.pid, None)
                if not procs:
                    self._procs.pop(managed.sandbox_id, None)
            managed.finished.set()
            self._broadcast(managed, None)

    def get(
        self, sandbox_id: str, owner: str, selector: process_pb.ProcessSelector | None
    ) -> ManagedProcess:
        """The process a selector names (pid or tag) in this sandbox; ``NOT_FOUND`` otherwise."""
        procs = self._procs.get(sandbox_id, {})
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=pid):
                found = procs.get(int(pid))
            case Oneof(field="tag", value=tag):
                found = next((p for p in procs.values() if p.tag == tag), None)
            case _:
                raise ConnectError(
                    Code.INVALID_ARGUMENT, "process selector (pid or tag) is required"
                )
        if found is None or found.owner != owner:
            raise ConnectError(Code.NOT_FOUND, f"process {selector.selector.value} not found")  # type: ignore[union-attr]
        return found

    async def check_running(self, sandbox_id: str, owner: str) -> None:
        """Raise the Connect error for a sandbox that is gone (or not this owner's)."""
        try:
            info = await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        if info.state == "stopped":
            raise ConnectError(Code.UNAVAILABLE, sandbox_gone_message(sandbox_id))

    async def wait_gone(self, sandbox_id: str, owner: str, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s`` seconds) until the edge reports the sandbox stopped or
        unknown: a sandbox being destroyed still shows as running for a moment."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                if (
                    await self._edge.get_sandbox(sandbox_ref(sandbox_id), owner)
                ).state == "stopped":
                    return
            except DsecError:
                return
            await asyncio.sleep(0.05)

    def list(self, sandbox_id: str, owner: str) -> list[ManagedProcess]:
        return [p for p in self._procs.get(sandbox_id, {}).values() if p.owner == owner]

    async def drop_sandbox(self, sandbox_id: str) -> None:
        """Stop tracking (and kill) every process of a sandbox that is being killed."""
        self.users.drop_sandbox(sandbox_id)
        procs = list(self._procs.get(sandbox_id, {}).values())
        for p in procs:
            if p.pump is not None:
                p.pump.cancel()
        for p in procs:
            if p.pump is not None:
                with contextlib.suppress(BaseException):
                    await p.pump

    async def aclose(self) -> None:
        """Kill every tracked process (server shutdown)."""
        for sandbox_id in list(self._procs):
            await self.drop_sandbox(sandbox_id)


def _keepalive_interval(ctx: RequestContext) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        value = float(raw) if raw else 50.0
    except ValueError:
        value = 50.0
    return min(max(value, 1.0), 300.0)


Authorize = Callable[[RequestContext], Awaitable[tuple[str, str]]]
"""Checks an envd request's sandbox id and token; returns ``(sandbox_id, owner)``."""


class ProcessService(process_connect.Process):
    """The ``process.Process`` Connect service (envd's process API)."""

    def __init__(self, registry: ProcessRegistry, authorize: Authorize) -> None:
        self._registry = registry
        self._authorize = authorize

    async def _stream(
        self,
        managed: ManagedProcess,
        queue: Subscriber,
        ctx: RequestContext,
        *,
        wrap: Callable[[Event], object],
        started: bool,
    ) -> AsyncIterator[object]:
        """Yield start, data, end and keepalive events of one attached stream."""
        keepalive = _keepalive_interval(ctx)
        deadline = ctx.timeout_ms
        loop = asyncio.get_running_loop()
        end_at = loop.time() + deadline / 1000.0 if deadline is not None else None
        next_keepalive = loop.time() + keepalive
        try:
            yield wrap(_start_event(managed.pid))
            while True:
                wait = min(next_keepalive - loop.time(), PAUSE_CHECK_INTERVAL_S)
                if end_at is not None:
                    wait = min(wait, end_at - loop.time())
                    if wait <= 0:
                        raise ConnectError(
                            Code.DEADLINE_EXCEEDED,
                            f"process {managed.pid}: stream timeout reached"
                            + (" (process killed)" if started else ""),
                        )
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=max(wait, 0.0))
                except TimeoutError:
                    # a quiet stream: was the sandbox paused behind the E2B API's back
                    # (on_timeout="pause")? End it as Sandbox.pause does.
                    await self._registry.end_streams_if_paused(managed.sandbox_id, managed.owner)
                    if queue.closed:
                        continue  # the error is queued
                    now = loop.time()
                    if now >= next_keepalive and (end_at is None or now < end_at):
                        yield wrap(_keepalive_event())
                        next_keepalive = now + keepalive
                    continue
                if event is not None:
                    yield wrap(event)
                    continue
                if queue.error is not None:
                    raise queue.error
                if isinstance(managed.error, SandboxNotFound | SandboxStopped):
                    # the sandbox went away under the process (killed, timed out): as envd.
                    # The SDK then asks /health: answer once the edge says it is gone
                    await self._registry.wait_gone(managed.sandbox_id, managed.owner)
                    raise stream_ended_error(managed.sandbox_id)
                if managed.error is not None:
                    raise to_connect_error(managed.error, managed.sandbox_id)
                result = managed.result or ExecResult(exit_code=None, signal=signal_mod.SIGKILL)
                if result.timed_out and started:
                    raise ConnectError(
                        Code.DEADLINE_EXCEEDED,
                        f"process {managed.pid} was killed when its timeout expired",
                    )
                end = Event.EndEvent(
                    exit_code=result.exit_code if result.exit_code is not None else -1,
                    exited=result.exit_code is not None,
                    status=_exit_status(result),
                    # envd sends cmd.Wait()'s error: "exit status N" / "signal: killed"
                    error=(
                        "out of memory"
                        if result.oom_killed
                        else None
                        if result.exit_code == 0
                        else _exit_status(result)
                    ),
                )
                yield wrap(_end_event(end))
                return
        finally:
            managed.unsubscribe(queue)

    async def list(
        self, request: process_pb.ListRequest, ctx: RequestContext
    ) -> process_pb.ListResponse:
        sandbox_id, owner = await self._authorize(ctx)
        await self._registry.check_running(sandbox_id, owner)
        procs = self._registry.list(sandbox_id, owner)
        return process_pb.ListResponse(processes=[p.info() for p in procs])

    async def start(
        self, request: process_pb.StartRequest, ctx: RequestContext
    ) -> AsyncIterator[process_pb.StartResponse]:
        sandbox_id, owner = await self._authorize(ctx)
        timeout_ms = ctx.timeout_ms
        managed, queue = await self._registry.start(
            sandbox_id,
            owner,
            request,
            timeout_s=(timeout_ms / 1000.0) if timeout_ms is not None else None,
            user=user_from_headers(ctx.request_headers),
        )
        async for msg in self._stream(
            managed, queue, ctx, wrap=lambda e: process_pb.StartResponse(event=e), started=True
        ):
            yield msg  # type: ignore[misc]

    async def connect(
        self, request: process_pb.ConnectRequest, ctx: RequestContext
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        sandbox_id, owner = await self._authorize(ctx)
        managed = self._registry.get(sandbox_id, owner, request.process)
        queue = managed.subscribe()
        async for msg in self._stream(
            managed, queue, ctx, wrap=lambda e: process_pb.ConnectResponse(event=e), started=False
        ):
            yield msg  # type: ignore[misc]

    async def update(
        self, request: process_pb.UpdateRequest, ctx: RequestContext
    ) -> process_pb.UpdateResponse:
        sandbox_id, owner = await self._authorize(ctx)
        managed = self._registry.get(sandbox_id, owner, request.process)
        if request.pty is not None and request.pty.size is not None:
            if not managed.has_pty:
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {managed.pid} has no PTY")
            try:
                await managed.proc.resize(PtySize(request.pty.size.cols, request.pty.size.rows))
            except DsecError as e:
                raise to_connect_error(e, sandbox_id) from None
        return process_pb.UpdateResponse()

    async def _write(self, managed: ManagedProcess, data: bytes) -> None:
        if not managed.stdin_open:
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"stdin of process {managed.pid} is not open (start it with stdin=True)",
            )
        try:
            await managed.proc.write_stdin(data)
        except DsecError as e:
            raise to_connect_error(e, managed.sandbox_id) from None

    @staticmethod
    def _input_bytes(inp: process_pb.ProcessInput | None) -> bytes:
        match inp.input if inp is not None else None:
            case Oneof(field="stdin" | "pty", value=data):
                return bytes(data)
            case _:
                return b""

    async def stream_input(
        self, request: AsyncIterator[process_pb.StreamInputRequest], ctx: RequestContext
    ) -> process_pb.StreamInputResponse:
        sandbox_id, owner = await self._authorize(ctx)
        managed: ManagedProcess | None = None
        async for msg in request:
            match msg.event:
                case Oneof(
                    field="start", value=process_pb.StreamInputRequest.StartEvent() as start
                ):
                    managed = self._registry.get(sandbox_id, owner, start.process)
                case Oneof(field="data", value=process_pb.StreamInputRequest.DataEvent() as data):
                    if managed is None:
                        raise ConnectError(
                            Code.INVALID_ARGUMENT, "stream input must begin with a start event"
                        )
                    await self._write(managed, self._input_bytes(data.input))
                case _:
                    pass
        return process_pb.StreamInputResponse()

    async def send_input(
        self, request: process_pb.SendInputRequest, ctx: RequestContext
    ) -> process_pb.SendInputResponse:
        sandbox_id, owner = await self._authorize(ctx)
        managed = self._registry.get(sandbox_id, owner, request.process)
        await self._write(managed, self._input_bytes(request.input))
        return process_pb.SendInputResponse()

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: RequestContext
    ) -> process_pb.SendSignalResponse:
        sandbox_id, owner = await self._authorize(ctx)
        managed = self._registry.get(sandbox_id, owner, request.process)
        sig = request.signal.value if request.signal is not None else 0
        if sig not in (signal_mod.SIGKILL, signal_mod.SIGTERM):
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {sig}")
        try:
            await managed.proc.signal(sig)
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        return process_pb.SendSignalResponse()

    async def close_stdin(
        self, request: process_pb.CloseStdinRequest, ctx: RequestContext
    ) -> process_pb.CloseStdinResponse:
        sandbox_id, owner = await self._authorize(ctx)
        managed = self._registry.get(sandbox_id, owner, request.process)
        if managed.has_pty:
            raise ConnectError(Code.FAILED_PRECONDITION, "a PTY has no stdin to close; send Ctrl-D")
        try:
            await managed.proc.close_stdin()
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        managed.stdin_open = False
        return process_pb.CloseStdinResponse()
