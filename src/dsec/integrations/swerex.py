"""SWE-ReX backend: a dsec sandbox as a SWE-ReX deployment (``swe-rex`` 1.4).

Import path: ``dsec.integrations.swerex:DsecDeployment`` (config class
:class:`DsecDeploymentConfig`, ``type: "dsec"``). Example (times in seconds, sizes in
MiB)::

    from dsec.integrations.swerex import DsecDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    deployment = DsecDeployment(image="debian", memory_mb=1024)
    await deployment.start()
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    await rt.run_in_session(BashAction(command="cd /tmp && export X=1", check="raise"))
    obs = await rt.run_in_session(BashAction(command="pwd; echo $X", timeout=10))
    print(obs.output, obs.exit_code)          # "/tmp\\n1\\n" 0
    await deployment.stop()

The runtime (:class:`DsecRuntime`) talks to the sandbox through dsec's exec and file APIs
directly: nothing is installed or served inside the sandbox (SWE-ReX's own deployments
start ``swerex-remote`` in the container). Sessions are persistent bash shells kept by
:mod:`dsec.integrations._session` (see its docstring for how, and for the limits); they
follow SWE-ReX's ``BashAction`` semantics: state persists between calls, ``check``
(``raise``/``silent``/``ignore``), ``timeout`` (``CommandTimeoutError``; the output stays
for the next call, as in pexpect), ``expect`` (regular expressions, as pexpect's),
``is_interactive_command``/``is_interactive_quit``, ``BashInterruptAction`` (SIGINT, then
SIGKILL after ``n_retry`` tries), ``bash -n`` syntax checks (``BashIncorrectSyntaxError``).
Output is cleaned as SWE-ReX cleans it (ANSI escapes removed, ``\\r\\n`` to ``\\n``).

Credentials are never part of the config (it is serialized into trajectories): the
connection comes from ``DSEC_URL`` / ``DSEC_API_KEY`` / ``$DSEC_HOME/api_key`` as in the
SDK, or from ``url`` and the environment.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import re
import shlex
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SessionNotInitializedError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.utils.log import get_logger

from dsec.errors import DsecError, InvalidRequest, SandboxNotFound, SandboxStopped
from dsec.integrations._fields import SandboxFields
from dsec.integrations._session import (
    DEFAULT_SESSION_ROOT,
    NO_TIMEOUT_S,
    ShellOutput,
    ShellSession,
    Terminal,
    printable,
)
from dsec.sdk.sandbox import CREATE_TIMEOUT_S, AsyncSandbox

__all__ = ["DsecDeployment", "DsecDeploymentConfig", "DsecRuntime"]

PS1 = "SHELLPS1PREFIX"
"""What ``BashObservation.expect_string`` says when the command ended (SWE-ReX's local
runtime reports its prompt string there; callers compare it with their ``expect`` list)."""

_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")
_EXEC_OUTPUT_BYTES = 64 << 20  # the most one exec returns per stream


def clean(text: str) -> str:
    """Terminal output as SWE-ReX returns it: ANSI escapes removed, ``\\r\\n`` -> ``\\n``,
    undecodable bytes as ``\\xNN`` (``swerex.runtime.local._strip_control_chars``)."""
    return _ANSI.sub("", printable(text)).replace("\r\n", "\n")


class DsecDeploymentConfig(SandboxFields):
    """A dsec sandbox as a SWE-ReX deployment (``tier``, sizes, ``network``, ``labels``:
    :class:`~dsec.integrations._fields.SandboxFields`; ``fncall`` has no sessions). Sizes
    in MiB, times in seconds."""

    type: Literal["dsec"] = "dsec"
    """Discriminator for (de)serialization/CLI. Do not change."""

    image: str = "debian"
    """dsec image name (``debian``, an image built with ``dsec image build``, ...)."""
    env: dict[str, str] = {}
    """Environment of every command (and of the session shells)."""
    job: str | None = None
    """Training-job id (``dsec job pause JOB`` acts on every sandbox of the job)."""
    user: str | None = None
    workdir: str = "/"
    ttl_s: float | None = 3600.0
    """Idle seconds before the sandbox is killed; the safety net when ``stop()`` is never
    called."""
    url: str | None = None
    """dsec server; default ``$DSEC_URL`` (the key: ``$DSEC_API_KEY`` or
    ``$DSEC_HOME/api_key``, never stored here)."""
    startup_timeout: float = CREATE_TIMEOUT_S
    """How long ``start()`` waits for the sandbox, seconds."""
    session_terminal: Terminal = "auto"
    """Sessions on a pseudo-terminal (``on``, needs util-linux ``script`` in the image),
    on pipes (``off``), or a terminal when possible (``auto``)."""
    session_root: str = DEFAULT_SESSION_ROOT
    """Directory in the sandbox that holds the sessions' FIFOs and output."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> DsecDeployment:
        return DsecDeployment.from_config(self)


class _Session:
    def __init__(self, shell: ShellSession) -> None:
        self.shell = shell
        self.lock = asyncio.Lock()


class DsecRuntime(AbstractRuntime):
    """SWE-ReX's ``AbstractRuntime`` over one dsec sandbox (see the module docstring).

    ``close()`` ends the sessions, not the sandbox (:meth:`DsecDeployment.stop` kills it).
    """

    def __init__(
        self,
        sandbox: AsyncSandbox,
        *,
        logger: logging.Logger | None = None,
        session_terminal: Terminal = "auto",
        session_root: str = DEFAULT_SESSION_ROOT,
    ) -> None:
        self._sb = sandbox
        self._sessions: dict[str, _Session] = {}
        self._terminal: Terminal = session_terminal
        self._root = session_root
        self.logger = logger or get_logger("rex-runtime")

    @property
    def sandbox(self) -> AsyncSandbox:
        """The dsec sandbox (pause, snapshot, fork, network... through the dsec SDK)."""
        return self._sb

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Alive while the sandbox is running or paused (a request resumes it)."""
        try:
            info = await asyncio.wait_for(self._sb.refresh(), timeout)
        except TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"no answer within {timeout} s")
        except DsecError as e:
            return IsAliveResponse(is_alive=False, message=f"{e.code}: {e.message}")
        if info.state in ("running", "paused"):
            return IsAliveResponse(is_alive=True)
        return IsAliveResponse(is_alive=False, message=f"sandbox {info.id} is {info.state}")

    # -- sessions ------------------------------------------------------------------

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        """Start a persistent bash (``request.session`` names it)."""
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        shell = ShellSession(self._sb, request.session, root=self._root, terminal=self._terminal)
        await shell.start()
        self._sessions[request.session] = _Session(shell)
        output = ""
        if request.startup_source:
            command = "\n".join(f"source {shlex.quote(p)}" for p in request.startup_source)
            r = await shell.run(command, timeout=request.startup_timeout)
            if r.status == "timeout":
                await shell.interrupt(timeout=1.0)
                raise CommandTimeoutError(
                    f"timeout after {request.startup_timeout} seconds while sourcing "
                    f"{request.startup_source}"
                )
            output = clean(r.output)
        return CreateBashSessionResponse(output=output)

    def _session(self, name: str) -> _Session:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionDoesNotExistError(f"session {name!r} does not exist") from None

    async def run_in_session(self, action: Action) -> Observation:
        """Run a ``BashAction`` or a ``BashInterruptAction`` in its session."""
        session = self._session(action.session)
        async with session.lock:
            shell = session.shell
            if not shell.alive:
                raise SessionNotInitializedError(f"the shell of session {action.session!r} exited")
            if isinstance(action, BashInterruptAction):
                return await self._interrupt(shell, action)
            if action.is_interactive_command or action.is_interactive_quit:
                return await self._interactive(shell, action)
            return await self._normal(shell, action)

    async def _give(self, shell: ShellSession, action: BashAction) -> ShellOutput:
        """The action's text as a new command, or, while a command is still running (a
        timeout that was not interrupted, an interactive program), typed into its
        terminal: where SWE-ReX's ``sendline`` puts it."""
        if shell.running:
            return await shell.send(
                action.command + "\n", timeout=action.timeout, expect=action.expect
            )
        return await shell.run(action.command, timeout=action.timeout, expect=action.expect)

    def _raise_common(self, action: BashAction, r: ShellOutput) -> None:
        if r.status == "syntax":
            msg = (
                f"Error (exit code {r.exit_code}) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{printable(r.output)}\n---- Stdout ----\n{printable(r.syntax_stdout)}"
            )
            raise BashIncorrectSyntaxError(
                msg,
                extra_info={
                    "bash_stdout": printable(r.syntax_stdout),
                    "bash_stderr": printable(r.output),
                },
            )
        if r.status == "timeout":
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            )
        if r.status == "exited":
            raise SessionNotInitializedError(
                f"the shell of session {action.session!r} exited while running "
                f"{action.command!r}; its last output:\n{clean(r.output)[-4000:]}"
            )

    def _expect_string(self, action: BashAction | BashInterruptAction, r: ShellOutput) -> str:
        return action.expect[r.matched] if r.matched is not None else PS1

    async def _normal(self, shell: ShellSession, action: BashAction) -> BashObservation:
        r = await self._give(shell, action)
        self._raise_common(action, r)
        output = clean(r.output)
        expect_string = self._expect_string(action, r)
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None, expect_string=expect_string)
        exit_code = r.exit_code
        if exit_code is None and action.check == "raise":
            # an expected pattern appeared while the command still runs: no exit code yet
            raise NoExitCodeError(
                f"no exit code for {action.command!r}: it is still running "
                f"(matched {expect_string!r})"
            )
        if action.check == "raise" and exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {exit_code}. "
                f"Here is the output:\n{output!r}"
            )
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return BashObservation(output=output, exit_code=exit_code, expect_string=expect_string)

    async def _interactive(self, shell: ShellSession, action: BashAction) -> BashObservation:
        r = await self._give(shell, action)
        if r.status == "timeout":
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            )
        self._raise_common(action, r)
        output = clean(r.output)
        if action.is_interactive_command:
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(
            output=output, exit_code=0, expect_string=self._expect_string(action, r)
        )

    async def _interrupt(self, shell: ShellSession, action: BashInterruptAction) -> BashObservation:
        """SIGINT up to ``n_retry`` times (each waits ``timeout`` s for the command to end
        or an ``expect`` pattern), then SIGKILL of the command (and the session's
        background jobs)."""
        if not shell.running:
            r = await shell.wait(timeout=0)
            return BashObservation(output=clean(r.output).strip(), exit_code=0, expect_string=PS1)
        output = ""
        for _ in range(max(1, action.n_retry)):
            r = await shell.interrupt(timeout=action.timeout, expect=action.expect)
            if r.status in ("done", "matched", "idle"):
                output += clean(r.output)
                return BashObservation(
                    output=output.strip(), exit_code=0, expect_string=self._expect_string(action, r)
                )
            if r.status == "exited":
                raise SessionNotInitializedError(
                    f"the shell of session {action.session!r} exited while being interrupted"
                )
        r = await shell.kill(timeout=max(action.timeout, 2.0))
        if r.status == "done":
            output += clean(r.output)
            output += "\n[dsec: the command did not stop on SIGINT: killed with SIGKILL]"
            return BashObservation(output=output.strip(), exit_code=0, expect_string=PS1)
        raise CommandTimeoutError("Failed to interrupt session")

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        """Kill the session's shell (and its process group) and forget it."""
        session = self._session(request.session)
        del self._sessions[request.session]
        await session.shell.close()
        return CloseBashSessionResponse()

    # -- one-off commands and files ------------------------------------------------------

    async def execute(self, command: Command) -> CommandResponse:
        """Run one command in a fresh process, as ``subprocess.run`` would (``shell``,
        ``env`` replacing the environment, ``cwd``, ``timeout``, ``check``,
        ``merge_output_streams``)."""
        if command.shell:
            parts = [command.command] if isinstance(command.command, str) else list(command.command)
            argv = ["/bin/sh", "-c", *parts]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        if not argv or (command.shell and not argv[2].strip()):
            argv = ["/bin/sh", "-c", ":"]  # subprocess runs an empty shell command as a no-op
        program = argv[0]
        if command.env is not None:  # subprocess's env= replaces the whole environment
            argv = ["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), *argv]
        if command.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        timeout = NO_TIMEOUT_S if command.timeout is None else float(command.timeout)
        try:
            r = await self._sb.commands.run(
                argv, cwd=command.cwd, timeout=timeout, max_output_bytes=_EXEC_OUTPUT_BYTES
            )
        except InvalidRequest as e:
            if "cwd" in e.details:
                raise FileNotFoundError(
                    errno.ENOENT, os.strerror(errno.ENOENT), command.cwd
                ) from None
            raise
        if r.timed_out:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command"
            )
        if (
            not command.shell
            and r.exit_code in (126, 127)
            and not r.stdout
            and r.stderr.startswith(f"dsec: {program}: ")
        ):
            code = errno.ENOENT if r.exit_code == 127 else errno.EACCES
            exc = FileNotFoundError if code == errno.ENOENT else PermissionError
            raise exc(code, os.strerror(code), program)
        exit_code = r.exit_code if r.exit_code is not None else -(r.signal or 9)
        response = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=exit_code)
        if command.check and exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {exit_code}. "
                f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return response

    def _abs(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self._sb.info.workdir or "/", path))

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """Read a file as text (``FileNotFoundError`` if missing)."""
        data = await self._sb.files.read(self._abs(request.path))
        content = data.decode(request.encoding or "utf-8", request.errors or "strict")
        return ReadFileResponse(content=content)

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Write a text file, creating its parent directories."""
        await self._sb.files.write(self._abs(request.path), request.content)
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copy a local file to ``target_path``, or a local directory's contents into the
        directory ``target_path``."""
        source, kind, data, mode = await asyncio.to_thread(_read_source, request.source_path)
        target = self._abs(request.target_path)
        if kind == "dir":
            await self._sb.files.upload_dir(source, target)
        elif kind == "file":
            await self._sb.files.write(target, data, mode=mode)
        else:
            raise ValueError(f"Source path {source} is not a file or directory")
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """End every session (the sandbox stays)."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            try:
                await session.shell.close()
            except DsecError as e:
                self.logger.warning("closing session %s: %s", session.shell.name, e)
        return CloseResponse()


def _read_source(path: str) -> tuple[Path, str, bytes, int]:
    """(resolved path, "dir"/"file"/"", a file's bytes, its permission bits)."""
    source = Path(path).resolve()
    if source.is_dir():
        return source, "dir", b"", 0
    if source.is_file():
        return source, "file", source.read_bytes(), source.stat().st_mode & 0o777
    return source, "", b"", 0


class DsecDeployment(AbstractDeployment):
    """A dsec sandbox as a SWE-ReX deployment. Keyword arguments: see
    :class:`DsecDeploymentConfig`. ``start()`` creates the sandbox, ``stop()`` kills it."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = DsecDeploymentConfig(**kwargs)
        self._sandbox: AsyncSandbox | None = None
        self._runtime: DsecRuntime | None = None
        self.logger = logger or get_logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()

    @classmethod
    def from_config(cls, config: DsecDeploymentConfig) -> DsecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    @property
    def config(self) -> DsecDeploymentConfig:
        return self._config

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Raises ``DeploymentNotStartedError`` before ``start()``."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the sandbox and wait until it runs."""
        if self._runtime is not None:
            self.logger.warning("Deployment is already started. Ignoring duplicate start() call.")
            return
        c = self._config
        self._hooks.on_custom_step("Starting dsec sandbox")
        t0 = time.monotonic()
        self._sandbox = await AsyncSandbox.create(
            tier=c.tier,
            image=c.image,
            layers=c.layers,
            cpu=c.cpu,
            memory_mb=c.memory_mb,
            disk_mb=c.disk_mb,
            pids=c.pids,
            env=c.env,
            ttl_s=c.ttl_s,
            labels=c.labels,
            user=c.user,
            job=c.job,
            workdir=c.workdir,
            network=c.network,
            url=c.url,
            timeout=c.startup_timeout,
        )
        self._runtime = DsecRuntime(
            self._sandbox,
            logger=self.logger,
            session_terminal=c.session_terminal,
            session_root=c.session_root,
        )
        self.logger.info(
            "Sandbox %s (%s, image %s) started in %.2fs",
            self._sandbox.id,
            c.tier,
            c.image,
            time.monotonic() - t0,
        )

    async def stop(self) -> None:
        """End the sessions and kill the sandbox (idempotent)."""
        runtime, sandbox = self._runtime, self._sandbox
        self._runtime = self._sandbox = None
        if runtime is not None:
            await runtime.close()
        if sandbox is not None:
            try:
                await sandbox.kill()
            except (SandboxNotFound, SandboxStopped):
                pass

    @property
    def runtime(self) -> DsecRuntime:
        """Raises ``DeploymentNotStartedError`` before ``start()``."""
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    @property
    def sandbox(self) -> AsyncSandbox:
        """The dsec sandbox. Raises ``DeploymentNotStartedError`` before ``start()``."""
        if self._sandbox is None:
            raise DeploymentNotStartedError()
        return self._sandbox

    def __del__(self) -> None:
        # SWE-ReX's base class runs stop() on an event loop from __del__; lifecycles here
        # are explicit: an unstopped sandbox is killed by its idle TTL (ttl_s).
        if getattr(self, "_sandbox", None) is not None:
            logging.getLogger(__name__).warning(
                "DsecDeployment garbage-collected without stop(): sandbox %s lives until "
                "its idle TTL",
                self._sandbox.id if self._sandbox is not None else "?",
            )
