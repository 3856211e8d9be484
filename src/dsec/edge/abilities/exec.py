"""Commands in a sandbox: one-shot, streamed, and E2B's interactive processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from dsec.contract.runtime import Interactive
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.edge.core import EdgeCore, LiveSandbox
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InternalError,
    SandboxError,
    SandboxStopped,
)
from dsec.models import ExecEvent, ExecRequest, ExecResult, SandboxExecRequest

log = logging.getLogger("dsec.edge")


class ExecVerbs(EdgeCore):
    """Commands in a sandbox: one-shot, streamed, and E2B's interactive processes."""

    # ------------------------------------------------------------------ exec
    async def exec(
        self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> ExecResult:
        return await self._exec(req.sandbox_id, owner, req.command, None, env)

    async def _exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        sink: Callable[[str, bytes], Awaitable[None]] | None,
        env: Envelope = NO_ENVELOPE,
    ) -> ExecResult:
        request = req.model_dump(mode="json", exclude_defaults=True)

        async def run(lv: LiveSandbox) -> ExecResult:
            rt = self.runtimes[lv.row.tier]
            if req.cwd is None:
                req.cwd = lv.row.request.workdir

            async def go() -> ExecResult:
                t0 = time.perf_counter()
                try:
                    res = await rt.exec(lv.handle, req, sink)
                except DsecError:
                    self.metrics.execs.labels(lv.row.tier, "error").inc()
                    raise
                self.metrics.exec_seconds.labels(lv.row.tier).observe(time.perf_counter() - t0)
                self.audit.exec_result(
                    lv.row.id, res, req.cmd, oom_from_result=lv.row.tier not in self.audited_tiers
                )
                outcome = (
                    "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
                )
                self.metrics.execs.labels(lv.row.tier, outcome).inc()
                return res

            return await self._logged(
                lv,
                "exec",
                request,
                env,
                go,
                lambda r: r.model_dump(mode="json", exclude={"replayed"}),
                lambda d: ExecResult.model_validate({**d, "replayed": True}),
            )

        return await self._use(sandbox_id, owner, run)

    async def exec_stream(
        self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> AsyncIterator[ExecEvent]:
        sandbox_id, command = req.sandbox_id, req.command
        # validate before the first event so errors become proper HTTP errors
        self._live_for(sandbox_id, owner)
        queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue(maxsize=256)

        async def sink(stream: str, chunk: bytes) -> None:
            await queue.put(ExecEvent(type=stream, data=chunk.decode("utf-8", errors="replace")))

        async def runner() -> None:
            try:
                res = await self._exec(sandbox_id, owner, command, sink, env)
                if res.replayed:  # nothing ran: give the recorded output as one chunk each
                    if res.stdout:
                        await queue.put(ExecEvent(type="stdout", data=res.stdout))
                    if res.stderr:
                        await queue.put(ExecEvent(type="stderr", data=res.stderr))
                await queue.put(ExecEvent(type="exit", result=res))
            except DsecError as e:
                await queue.put(ExecEvent(type="error", error=e.to_wire()["error"]))
            except Exception as e:  # pragma: no cover - reported to the client, logged here
                log.exception("exec stream failed")
                await queue.put(
                    ExecEvent(
                        type="error",
                        error=InternalError(
                            f"exec failed on the node ({type(e).__name__}); the node logged it"
                        ).to_wire()["error"],
                    )
                )
            finally:
                await queue.put(None)

        task = asyncio.create_task(runner())
        try:
            while True:
                ev = await queue.get()
                if ev is None:
                    break
                yield ev
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # --- interactive processes (E2B)
    async def start_process(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: Any = None,
    ) -> Any:
        """Start ``req`` and return while it runs: ``dsec.e2b.interactive.InteractiveExec``.

        ``stdin``: keep the process's stdin open for writes (``req.stdin`` is ignored);
        ``pty``: a terminal size (``cols``, ``rows``) to run it on a new terminal. Returns the
        runtime's process object (``InteractiveProcess``). A tier without interactive
        processes raises ``CapabilityNotSupported`` (so does a runtime without terminals
        when ``pty`` is given). The call is logged in the trajectory
        as an ``exec`` entry (request plus ``interactive``/``stdin_open``/``pty``), committed
        with the exit result (no output) when the process ends. The sandbox's TTL keeps
        running meanwhile: a process does not keep its sandbox alive.
        """
        request = req.model_dump(mode="json", exclude_defaults=True)
        request["interactive"] = True
        request["stdin_open"] = stdin
        if pty is not None:
            request["pty"] = {"cols": int(pty.cols), "rows": int(pty.rows)}

        async def run(lv: LiveSandbox) -> Any:
            rt = self.runtimes[lv.row.tier]
            if not isinstance(rt, Interactive):
                raise CapabilityNotSupported(
                    f"tier {lv.row.tier} has no interactive processes (stdin after start, pty)"
                )
            start = rt.start_process
            if req.cwd is None:
                req.cwd = lv.row.request.workdir
            sid = lv.row.id
            entry = await self._begin(sid, None, None, "exec", request)
            t0 = time.time()
            try:
                proc = await start(lv.handle, req, stdin=stdin, pty=pty)
            except DsecError as e:
                self.metrics.execs.labels(lv.row.tier, "error").inc()
                if isinstance(e, SandboxStopped):
                    self.trajectory.abort(sid, entry.seq, e)
                else:
                    self.trajectory.commit_error(sid, entry.seq, e)
                raise
            except BaseException as e:
                with contextlib.suppress(Exception):
                    self.trajectory.commit_error(sid, entry.seq, SandboxError(f"exec failed: {e}"))
                raise
            task = asyncio.create_task(self._finish_process(lv, entry.seq, t0, proc))
            tasks: set[asyncio.Task[None]] = self.__dict__.setdefault("_process_finishers", set())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return proc

        return await self._use(sandbox_id, owner, run)

    async def _finish_process(self, lv: LiveSandbox, seq: int, t0: float, proc: Any) -> None:
        """Commit an interactive process's trajectory entry and metrics when it exits."""
        tier, sid = lv.row.tier, lv.row.id
        try:
            res: ExecResult = await proc.wait()
        except DsecError as e:
            self.metrics.execs.labels(tier, "error").inc()
            with contextlib.suppress(Exception):
                self.trajectory.commit_error(sid, seq, e)
            return
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.trajectory.commit_error(sid, seq, SandboxError(f"exec failed: {e}"))
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.metrics.exec_seconds.labels(tier).observe(time.time() - t0)
        outcome = "timeout" if res.timed_out else ("ok" if res.exit_code == 0 else "nonzero")
        self.metrics.execs.labels(tier, outcome).inc()
        with contextlib.suppress(Exception):  # the sandbox may be gone (and purged) by now
            self.trajectory.commit(
                sid,
                seq,
                res.model_dump(mode="json", exclude={"replayed"}),
                {"started_at": t0, "run_ms": (time.time() - t0) * 1000},
            )
