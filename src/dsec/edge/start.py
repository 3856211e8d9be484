"""What a sandbox gets from its image when it is created: the image config's defaults
(``Env``, ``WorkingDir``, ``User``) and its start command.

* :func:`with_image_defaults`: the creation request as the edge runs it. The request's own
  ``env`` entries win over the image's ``Env``; an unset ``workdir`` / ``user`` becomes the
  image's ``WorkingDir`` / ``User``. A config value a sandbox cannot take (an env name or a
  user spec the API refuses) is skipped with a log line, never an error the caller did not
  cause.
* :class:`StartProcess`: the image's :class:`~dsec.images.config.StartCommand`
  running in one sandbox, through the runtime's ``exec`` with a sink into the sandbox's
  :class:`~dsec.edge.logs.SandboxLogs`, and :meth:`StartProcess.wait_ready`, the readiness
  loop a creation waits on. The command is not in the trajectory log: it is part of the
  sandbox's creation, which a replay repeats anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any

from pydantic import ValidationError

from dsec.contract.runtime import Handle, Runtime
from dsec.edge.logs import SandboxLogs
from dsec.edge.registry import ResolvedRequest
from dsec.errors import DsecError, StartFailed
from dsec.images.config import ImageConfig, StartCommand
from dsec.models import CreateSandboxRequest, ExecRequest, ExecResult, ImageInfo

__all__ = ["START_TIMEOUT_S", "StartProcess", "start_command_of", "with_image_defaults"]

log = logging.getLogger(__name__)

START_TIMEOUT_S = 24 * 3600.0
"""A start command runs at most this long (the longest exec a sandbox takes), seconds."""
_READY_POLL_S = 0.2
_READY_CHECK_TIMEOUT_S = 10.0
_RESULT_CAP_BYTES = 1 << 20
"""Output a start command may send on a runtime whose cap also bounds the sink (VM tiers)."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")


def image_config_of(image: ImageInfo) -> ImageConfig:
    """The image's config (empty when it has none or it is malformed)."""
    try:
        return ImageConfig.from_meta(image.meta)
    except ValidationError as e:
        log.warning("image %s has a malformed config (ignored): %s", image.name, e)
        return ImageConfig()


def start_command_of(image: ImageInfo) -> StartCommand | None:
    """The image's start command (None when it has none or it is malformed)."""
    try:
        return StartCommand.from_meta(image.meta)
    except ValidationError as e:
        log.warning("image %s has a malformed start command (ignored): %s", image.name, e)
        return None


def with_image_defaults(req: CreateSandboxRequest, image: ImageInfo) -> ResolvedRequest:
    """``req`` with the image config's defaults filled in (see the module docstring): the
    request the registry stores."""
    cfg = image_config_of(image)
    update: dict[str, Any] = {}
    image_env = {k: v for k, v in cfg.env_dict().items() if _ENV_NAME.match(k) and "\0" not in v}
    if image_env:
        update["env"] = {**image_env, **req.env}
    if req.workdir is None:
        wd = cfg.WorkingDir
        update["workdir"] = wd if wd and wd.startswith("/") and "\0" not in wd else "/"
    if req.user is None and cfg.User:
        update["user"] = cfg.User
    if not update and isinstance(req, ResolvedRequest):
        return req
    try:
        return ResolvedRequest.model_validate({**req.model_dump(), **update})
    except ValidationError as e:  # e.g. USER name:group, which the sandbox API refuses
        log.warning("image %s: config not applied in full: %s", image.name, e)
        update.pop("user", None)
        return ResolvedRequest.model_validate({**req.model_dump(), **update})


class StartProcess:
    """The start command of one sandbox (see the module docstring).

    Args:
        runtime: the sandbox's tier.
        handle: the sandbox.
        start: what to run.
        workdir: its working directory (the sandbox's).
        logs: where its output goes.
        sink_sees_all: the runtime streams all output to a sink whatever the result's cap
            (:attr:`~dsec.contract.runtime.RuntimeFacts.sink_sees_all_output`).
    """

    def __init__(
        self,
        runtime: Runtime,
        handle: Handle,
        start: StartCommand,
        workdir: str,
        logs: SandboxLogs,
        *,
        sink_sees_all: bool,
    ) -> None:
        self.runtime = runtime
        self.handle = handle
        self.start = start
        self.workdir = workdir
        self.logs = logs
        self._cap = 0 if sink_sees_all else _RESULT_CAP_BYTES
        self.task: asyncio.Task[ExecResult] | None = None

    def launch(self) -> None:
        """Start the command (returns at once; :attr:`task` ends when it does)."""
        self.task = asyncio.create_task(self._run(), name=f"start {self.handle.id}")
        self.task.add_done_callback(_retrieve)

    async def _sink(self, stream: str, chunk: bytes) -> None:
        self.logs.write(stream, chunk)

    async def _run(self) -> ExecResult:
        req = ExecRequest(
            cmd=self.start.cmd,
            cwd=self.workdir,
            timeout_s=START_TIMEOUT_S,
            max_output_bytes=self._cap,
        )
        try:
            res = await self.runtime.exec(self.handle, req, self._sink)
        except asyncio.CancelledError:
            self.logs.close("start command stopped with its sandbox")
            raise
        except DsecError as e:
            self.logs.close(f"start command failed: {e.public_message}")
            raise
        except Exception as e:
            self.logs.close(f"start command failed: {e}")
            raise
        if res.oom_killed:
            note = "start command killed: out of memory"
        elif res.timed_out:
            note = f"start command killed after {START_TIMEOUT_S:.0f} s"
        elif res.signal:
            note = f"start command killed by signal {res.signal}"
        else:
            note = f"start command exited with code {res.exit_code}"
        self.logs.close(note)
        return res

    def _failed(self, message: str, **details: Any) -> StartFailed:
        return StartFailed(
            message, sandbox_id=self.handle.id, logs_tail=self.logs.tail(4096), **details
        )

    def _check_exited(self) -> None:
        """Raise StartFailed if the command ended badly (a clean exit 0 may be a daemon)."""
        task = self.task
        if task is None or not task.done():
            return
        if task.cancelled():
            raise self._failed("the start command was stopped")
        err = task.exception()
        if err is not None:
            raise self._failed(f"the start command could not run: {err}")
        res = task.result()
        if res.exit_code != 0 or res.timed_out:
            how = f"exited with code {res.exit_code}"
            if res.exit_code is None:
                how = f"was killed by signal {res.signal}"
            raise self._failed(
                f"the start command {how} before it was ready",
                exit_code=res.exit_code,
                signal=res.signal,
            )

    async def wait_ready(self) -> float:
        """Run the readiness check until it exits 0; returns the seconds waited. Raises
        :class:`StartFailed` when the start command fails first or time runs out."""
        ready = self.start.ready_cmd
        t0 = time.monotonic()
        if ready is None:
            return 0.0
        deadline = t0 + self.start.ready_timeout_s
        while True:
            self._check_exited()
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failed(
                    f"the start command was not ready after {self.start.ready_timeout_s:g} s "
                    f"(readiness check: {ready})",
                    ready_cmd=ready,
                )
            check = ExecRequest(
                cmd=ready,
                cwd=self.workdir,
                timeout_s=max(0.1, min(_READY_CHECK_TIMEOUT_S, left)),
                max_output_bytes=4096,
            )
            res = await self.runtime.exec(self.handle, check)
            if res.exit_code == 0:
                return time.monotonic() - t0
            self._check_exited()
            await asyncio.sleep(min(_READY_POLL_S, max(0.0, deadline - time.monotonic())))

    async def stop(self) -> None:
        """Cancel the command's exec (the sandbox is going away). Idempotent."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _retrieve(task: asyncio.Task[ExecResult]) -> None:
    """Mark a finished start task's exception as seen (its logs tell the story)."""
    if not task.cancelled():
        task.exception()
