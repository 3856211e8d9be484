"""``DsecSandboxEnvironment``: inspect_ai's ``SandboxEnvironment`` over one dsec sandbox.

Semantics are those of inspect's own providers (``docker``, ``local``), through dsec's
exec and files APIs; where they differ it says so below.

exec(cmd, input, cwd, env, user, timeout, ...)
    ``cmd`` is exec'd as an argv (``cmd[0]`` found on the sandbox's ``PATH``, ``env``
    applied first, through the API, never as an ``env`` prefix); ``input`` is its stdin
    (text or bytes); a relative ``cwd`` is relative to the sandbox's working directory.
    dsec enforces ``timeout`` itself (it kills every process the command started) and
    the command then raises ``TimeoutError`` with the output so far
    (``truncated_output``); ``timeout_retry`` has nothing to retry (the time-out is
    decided by the node, not by a client waiting on a daemon) and ``concurrency`` is
    for local sandboxes. A command killed by signal N returns ``128 + N``. A program
    that exists but cannot be executed raises ``PermissionError``; one that is not found
    returns 127; an unknown ``user`` or missing ``cwd`` return 126 with dsec's message.
    Output over ``SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE`` (per stream; dsec
    returns at most 64 MiB) raises ``OutputLimitExceededError`` with the first part of it. A sandbox that is gone
    raises ``SandboxUnavailableError``. Commands over 1 MiB of arguments or over 16 MiB
    of input go through a script and a file under ``/tmp`` (removed afterwards).

read_file(file, text) / write_file(file, contents)
    Through dsec's files API (no command runs; any size up to the limits). As the
    sandbox's default user sees them: a non-root user gets ``PermissionError`` where
    the file's mode refuses it (write: the file, or for a new file its nearest existing
    directory); for root, a file whose owner may not read it is unreadable (as inspect's
    Docker provider) and every file is writable. A symlink is followed. Errors:
    ``FileNotFoundError``, ``IsADirectoryError``, ``PermissionError``,
    ``UnicodeDecodeError`` (text), ``OutputLimitExceededError`` (over
    ``MAX_READ_FILE_SIZE``). ``write_file`` makes missing parent directories and keeps an
    existing file's mode. The files API does not reach ``/proc``, ``/sys`` and ``/dev``
    (``OSError`` ``EINVAL``: use ``exec``).

connection()
    ``dsec --url URL exec ID --`` (append a command): dsec's CLI has no interactive shell.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import re
import secrets
import shlex
import stat
from typing import Any, Literal, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    sandboxenv,
)
from rich import print as rich_print
from typing_extensions import override

from dsec.errors import (
    DsecError,
    FileNotFound,
    InvalidRequest,
    PayloadTooLarge,
    SandboxNotFound,
    SandboxStopped,
)
from dsec.models import FileInfo
from dsec.sdk.image import Image
from dsec.sdk.sandbox import AsyncSandbox

from ._config import CONFIG_FILES, DEFAULT_IMAGE, DsecSandboxConfig, DsecSandboxSpec, load_config
from ._lifecycle import (
    LABEL_EPOCH,
    LABEL_NAME,
    LABEL_PROVIDER,
    LABEL_RUN,
    LABEL_SAMPLE,
    LABEL_TASK,
    PROVIDER,
    Run,
    client_for,
    current_run,
    kill_listed,
)

__all__ = ["DsecSandboxEnvironment"]

log = logging.getLogger("dsec.integrations.inspect")

MAX_EXEC_S = 24 * 3600.0
"""The longest command dsec runs (``ExecRequest.timeout_s``): a command without a timeout."""
MAX_OUTPUT_BYTES = 64 << 20
"""The most one exec returns per stream (``ExecRequest.max_output_bytes``)."""
INLINE_CMD_CHARS = 1 << 20
"""Arguments up to this many characters in all go in the exec request itself."""
INLINE_INPUT_BYTES = 16 << 20
"""Input up to this size goes in the exec request itself; more is uploaded as a file."""
_CREATE_FIELDS = set(
    "tier layers cpu memory_mb disk_mb pids env user workdir network full_guest".split()
)
"""The fields of a :class:`DsecSandboxSpec` that :meth:`AsyncSandbox.create` takes as they are."""
_MAX_SYMLINKS = 40
_STRERROR = {os.strerror(code): code for code in errno.errorcode}


@sandboxenv(name=PROVIDER)
class DsecSandboxEnvironment(SandboxEnvironment):
    """One dsec sandbox of a sample (see the module docstring). ``sandbox`` is the SDK's
    :class:`~dsec.AsyncSandbox` for what inspect has no verb for (snapshots, forks,
    network policy changes, ports)."""

    def __init__(self, sandbox: AsyncSandbox, name: str, url: str) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.name = name
        self.url = url
        """The server the sandbox lives on."""
        self._identity: tuple[int, set[int]] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, id={self.sandbox.id!r})"

    # --- provider: configuration ----------------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        return list(CONFIG_FILES)

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> DsecSandboxConfig:
        return DsecSandboxConfig.model_validate(config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        """No limit of inspect's: the server queues creations past its admission limits
        (the SDK waits for them), and ``--max-sandboxes`` sets one."""
        return None

    # --- provider: lifecycle --------------------------------------------------------------

    @override
    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Check the config, that the server answers and has the tiers it names, and build
        its Dockerfiles (once per run; the builder's step cache makes repeats cheap)."""
        cfg = await asyncio.to_thread(load_config, config)
        specs = cfg.specs()
        run = current_run(fresh=True)
        client = run.client(cfg.url)
        tiers = {c.tier: c for c in await client.capabilities()}
        for name, spec in specs.items():
            caps = tiers.get(spec.tier)
            if caps is None or not caps.available:
                why = caps.reason if caps is not None else "not a tier of this server"
                raise RuntimeError(
                    f"dsec sandbox {name!r}: tier {spec.tier} is not available at "
                    f"{client.url}: {why}"
                )
        for spec in specs.values():
            await _image(spec, cfg, run)

    @override
    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        """Create the sample's sandboxes at once (the default one first); if one fails, kill
        the others and raise its error."""
        cfg = await asyncio.to_thread(load_config, config)
        specs = cfg.specs()
        run = current_run()
        labels = {**run.labels(), LABEL_TASK: task_name[:1024]}
        sample_id = metadata.get("__sample_id__")
        if sample_id is not None:
            labels[LABEL_SAMPLE] = str(sample_id)[:1024]
        epoch = _epoch()
        if epoch is not None:
            labels[LABEL_EPOCH] = str(epoch)

        made: dict[str, DsecSandboxEnvironment] = {}

        async def create(name: str, spec: DsecSandboxSpec) -> None:
            image = await _image(spec, cfg, run)
            sb = await AsyncSandbox.create(
                image=image,
                **spec.model_dump(include=_CREATE_FIELDS),
                labels={**spec.labels, **labels, LABEL_NAME: name[:1024]},
                ttl_s=cfg.ttl_s,
                job=cfg.job,
                timeout=cfg.startup_timeout,
                client=run.client(cfg.url),
            )
            run.live[sb.id] = sb
            made[name] = cls(sb, name, run.client(cfg.url).url)
            if spec.workdir is not None:
                await sb.files.make_dir(spec.workdir)

        try:
            results = await asyncio.gather(
                *(create(name, spec) for name, spec in specs.items()), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            with anyio.CancelScope(shield=True):
                await run.kill(env.sandbox for env in made.values())
            raise
        return {name: made[name] for name in specs}

    @override
    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        """Kill the sample's sandboxes, also when it was interrupted (what cannot be killed
        now is tried again by ``task_cleanup``)."""
        run = current_run()
        sandboxes = [env.as_type(DsecSandboxEnvironment).sandbox for env in environments.values()]
        for sandbox_id, error in await run.kill(sandboxes):
            log.warning(
                "dsec: could not kill sandbox %s (task_cleanup retries): %s", sandbox_id, error
            )

    @override
    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        """Kill what the run still has: the sandboxes it tracks, and any carrying its label
        (a creation whose answer never came back). With ``--no-sandbox-cleanup``, list them
        and how to clean them up instead."""
        run = current_run()
        if not cleanup:
            if run.live:
                rich_print("\ndsec sandboxes left running (until their idle TTL):")
                for sb in run.live.values():
                    labels = sb.info.labels
                    rich_print(
                        f"  {sb.id}  sample {labels.get(LABEL_SAMPLE, '')} "
                        f"epoch {labels.get(LABEL_EPOCH, '')} {labels.get(LABEL_NAME, '')}"
                    )
                rich_print(
                    f"Clean them up: [blue]inspect sandbox cleanup dsec {run.id}[/blue] "
                    "(one: [blue]dsec kill ID[/blue])\n"
                )
            await run.close()
            return
        for sandbox_id, error in await run.kill(list(run.live.values())):
            log.warning("dsec: could not kill sandbox %s: %s", sandbox_id, error)
        for client in run.clients.values():
            try:
                await kill_listed(client, run.labels())
            except DsecError as e:
                log.warning("dsec: could not list the run's sandboxes at %s: %s", client.url, e)
        await run.close()

    @override
    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup dsec [ID]``: kill the caller's key's sandboxes made by
        this provider; ``ID`` limits it to one run (an ``inspect.run`` label, as printed
        by ``--no-sandbox-cleanup``) or one sandbox (``sb-...``)."""
        labels = {LABEL_PROVIDER: PROVIDER}
        only: str | None = None
        if id is not None and id.startswith("sb-"):
            only = id
        elif id is not None:
            labels[LABEL_RUN] = id
        client = client_for(None)
        try:
            if only is not None:
                found = [i for i in await client.list_sandboxes(labels=labels) if i.id == only]
                if not found:
                    rich_print(f"No sandbox {only} made by inspect for this key.")
                    return
                sb = AsyncSandbox(found[0], client, owns_client=False)
                await sb.kill()
                rich_print(f"Killed {only}.")
                return
            killed = await kill_listed(client, labels)
        finally:
            await client.close()
        if not killed:
            rich_print("No dsec sandboxes made by inspect to clean up.")
            return
        for info in killed:
            rich_print(f"  {info.id}  {info.state}  {info.labels.get(LABEL_TASK, '')}")
        rich_print(f"Killed {len(killed)} dsec sandbox(es).")

    # --- exec ----------------------------------------------------------------------------

    @override
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        argv, stdin, staged = await self._stage(cmd, input)
        try:
            r = await self.sandbox.commands.run(
                argv,
                cwd=self._path(cwd) if cwd is not None else None,
                env=dict(env) if env else None,
                timeout=min(float(timeout), MAX_EXEC_S) if timeout is not None else MAX_EXEC_S,
                stdin=stdin,
                user=user,
                max_output_bytes=min(limit, MAX_OUTPUT_BYTES),
            )
        except InvalidRequest as e:
            if user is not None and "unknown user" in e.message.lower():
                return ExecResult(False, 126, "", f"unable to find user {user}: {e.message}\n")
            if "cwd" in e.details:
                return ExecResult(False, 126, "", f"{e.message}\n")
            raise
        except (SandboxNotFound, SandboxStopped) as e:
            raise SandboxUnavailableError(
                f"The sandbox is not running and cannot execute: {e.message}"
            ) from e
        finally:
            with anyio.CancelScope(shield=True):  # also when the exec was cancelled
                for path in staged:
                    await self._remove(path)
        if r.timed_out:
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            if r.stdout or r.stderr:
                error.truncated_output = r.stdout + r.stderr  # type: ignore[attr-defined]
            raise error
        if r.truncated:
            raise OutputLimitExceededError(
                limit_str=SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                truncated_output=r.stdout + r.stderr,
            )
        code = r.exit_code if r.exit_code is not None else 128 + (r.signal or 9)
        if code == 126 and not staged and _not_executable(r.stdout, r.stderr, argv[0]):
            raise PermissionError(errno.EACCES, "Permission denied executing command", cmd[0])
        return ExecResult(code == 0, code, r.stdout, r.stderr)

    async def _stage(
        self, cmd: list[str], input: str | bytes | None
    ) -> tuple[list[str], str | bytes | None, list[str]]:
        """``(argv, stdin, files)``: ``cmd`` and ``input`` as one exec request carries them,
        or, when too large for it, a script (and an input file) under ``/tmp`` that
        ``/bin/sh`` runs, to be removed afterwards."""
        data = input.encode() if isinstance(input, str) else input
        big_input = data is not None and len(data) > INLINE_INPUT_BYTES
        if sum(len(a) for a in cmd) <= INLINE_CMD_CHARS and not big_input:
            return cmd, input, []
        stem = f"/tmp/.dsec-inspect-{secrets.token_hex(8)}"
        files: list[str] = []
        script = ""
        if big_input:
            assert data is not None
            files.append(f"{stem}.in")
            await self.sandbox.files.write(files[-1], data, mode=0o644)
            script += f"exec 0<{shlex.quote(files[-1])}\n"
        files.append(f"{stem}.sh")
        await self.sandbox.files.write(files[-1], f"{script}exec {shlex.join(cmd)}\n", mode=0o644)
        return ["/bin/sh", files[-1]], None if big_input else input, files

    async def _remove(self, path: str) -> None:
        try:
            await self.sandbox.files.remove(path)
        except DsecError as e:
            log.debug("dsec: could not remove %s: %s", path, e)

    # --- files ---------------------------------------------------------------------------

    @override
    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        info = await self._stat_following(path, file)
        if info is not None and info.type == "dir":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if info is not None:
            path = info.path
            if not await self._may(info, stat.S_IWUSR):
                raise PermissionError(errno.EACCES, "Permission denied", file)
        elif not await self._may_create(path):
            raise PermissionError(errno.EACCES, "Permission denied", file)
        data = contents.encode() if isinstance(contents, str) else contents
        mode = stat.S_IMODE(info.mode) if info is not None else 0o644
        try:
            await self.sandbox.files.write(path, data, mode=mode)
        except (InvalidRequest, FileNotFound) as e:
            raise _os_error(e, file) from e

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    @override
    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        info = await self._stat_following(self._path(file), file)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        if info.type == "dir":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if info.type != "file":
            raise OSError(errno.EINVAL, "Not a regular file", file)
        if info.size > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise _read_limit_error()
        if not await self._may(info, stat.S_IRUSR):
            raise PermissionError(errno.EACCES, "Permission denied", file)
        try:
            data = await self.sandbox.files.read(info.path)
        except PayloadTooLarge:
            raise _read_limit_error() from None
        except (InvalidRequest, FileNotFound) as e:
            raise _os_error(e, file) from e
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:  # grew meanwhile
            raise _read_limit_error()
        return data.decode("utf-8") if text else data

    def _path(self, file: str) -> str:
        """``file`` in the sandbox: relative paths are relative to its working directory."""
        return posixpath.join(self.sandbox.info.workdir or "/", file)

    async def _stat_following(self, path: str, file: str) -> FileInfo | None:
        """``stat`` of ``path`` following symlinks (``path`` of the answer: the target);
        None when it does not exist."""
        for _ in range(_MAX_SYMLINKS):
            try:
                info = await self.sandbox.files.stat(path)
            except FileNotFound:
                return None
            except InvalidRequest as e:
                raise _os_error(e, file) from e
            if info.type != "symlink" or info.target is None:
                return info
            path = posixpath.normpath(posixpath.join(posixpath.dirname(path), info.target))
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), file)

    async def _user(self) -> tuple[int, set[int]]:
        """The default user's uid and groups (asked once: ``id -u; id -G``)."""
        if self._identity is None:
            r = await self.sandbox.commands.run(["/bin/sh", "-c", "id -u; id -G"], timeout=60)
            lines = r.stdout.split("\n")
            try:
                self._identity = (int(lines[0]), {int(g) for g in lines[1].split()})
            except (ValueError, IndexError):
                log.warning("dsec: `id` failed in %s (%s): taken as root", self.sandbox.id, r)
                self._identity = (0, {0})
        return self._identity

    async def _may(self, info: FileInfo, bit: int) -> bool:
        """Whether the default user may read (``bit=S_IRUSR``), write (``S_IWUSR``) or
        search (``S_IXUSR``, a directory) ``info``: the owner's, group's or others' bit;
        root may do all but read what its owner may not (inspect's Docker provider)."""
        owner, group, other = bit, bit >> 3, bit >> 6
        if info.mode & owner and info.mode & group and info.mode & other:
            return True
        uid, groups = await self._user()
        if uid == 0:
            return bit != stat.S_IRUSR or bool(info.mode & owner)
        if info.uid == uid:
            return bool(info.mode & owner)
        if info.gid in groups:
            return bool(info.mode & group)
        return bool(info.mode & other)

    async def _may_create(self, path: str) -> bool:
        """Whether the default user may create ``path``: its nearest existing directory is
        writable and searchable (the files API makes the missing ones)."""
        parent = posixpath.dirname(path)
        while True:
            info = await self._stat_following(parent, parent)
            if info is not None or parent == "/":
                break
            parent = posixpath.dirname(parent)
        if info is None or info.type != "dir":
            return True  # the write itself reports what is wrong (ENOTDIR)
        return await self._may(info, stat.S_IWUSR) and await self._may(info, stat.S_IXUSR)

    # --- connection ----------------------------------------------------------------------

    @override
    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """``dsec --url URL exec ID --``, to which a command is appended (dsec's CLI has no
        interactive shell). Raises ``ConnectionError`` when the sandbox is not running;
        ``NotImplementedError`` for a ``user`` (``dsec exec`` runs commands as the
        sandbox's default user)."""
        if user is not None:
            raise NotImplementedError(
                f"dsec exec runs commands as the sandbox's default user: no connection as {user!r}"
            )
        try:
            info = await self.sandbox.refresh()
        except SandboxNotFound as e:
            raise ConnectionError(f"sandbox {self.sandbox.id} is gone") from e
        if info.state not in ("running", "paused"):
            raise ConnectionError(f"sandbox {info.id} is {info.state}")
        return SandboxConnection(
            type=PROVIDER,
            command=shlex.join(["dsec", "--url", self.url, "exec", info.id, "--"]),
            container=info.id,
        )

    def default_polling_interval(self) -> float:
        return 0.2


async def _image(spec: DsecSandboxSpec, cfg: DsecSandboxConfig, run: Run) -> str:
    """The image of ``spec``: its ``image``, or its Dockerfile built by dsec as this key's
    image ``inspect-<hash>`` (once per run)."""
    if spec.dockerfile is None:
        return spec.image or DEFAULT_IMAGE
    name = f"inspect-{(await asyncio.to_thread(spec.build_key))[:20]}"
    lock = run.build_locks.setdefault(name, anyio.Lock())
    async with lock:
        if name in run.images:
            return name
        image = await asyncio.to_thread(
            Image.from_dockerfile, spec.dockerfile, spec.build_context(), build_args=spec.build_args
        )
        try:
            await image.build_async(name, client=run.client(cfg.url), timeout=cfg.build_timeout)
        except DsecError as e:
            tail = str((e.details or {}).get("output_tail") or "").strip()
            raise RuntimeError(
                f"dsec could not build {spec.dockerfile}: {e.message}"
                + (f"\n--- output ---\n{tail[-2000:]}" if tail else "")
            ) from e
        run.images.add(name)
    return name


def _epoch() -> int | None:
    """The running sample's epoch, when inspect says (its ``sample_active``)."""
    try:
        from inspect_ai.log._samples import sample_active

        active = sample_active()
    except Exception:  # a private API of inspect's: the label is a convenience
        return None
    return active.epoch if active is not None else None


_NOT_EXECUTABLE = re.compile(r"dsec: (?:exec )?(.+): Permission denied\n?")


def _not_executable(stdout: str, stderr: str, program: str) -> bool:
    """Whether a 126 is dsec saying ``program`` exists but cannot be executed (the
    container tier's ``dsec: PROG: ...`` or the guest agent's ``dsec: exec PROG: ...``),
    not a command's own 126."""
    m = _NOT_EXECUTABLE.fullmatch(stderr)
    return not stdout and m is not None and m.group(1) == program


def _read_limit_error() -> OutputLimitExceededError:
    return OutputLimitExceededError(
        limit_str=SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
    )


def _os_error(e: DsecError, file: str) -> OSError:
    """The builtin error of a refused file operation (``file`` as the caller named it):
    the errno the server gave, or the one its message names."""
    if isinstance(e, FileNotFound):
        return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
    code = e.details.get("errno")
    if not isinstance(code, int):
        head = e.message.split(":", 1)[0].strip()
        code = _STRERROR.get(head) or _STRERROR.get(head.capitalize()) or errno.EINVAL
    return OSError(code, f"{os.strerror(code)} ({e.message})", file)
