"""``run_code``: one call, one worker, in SandboxFusion's shape and in dsec's own.

SandboxFusion shape (``POST /run_code``; field names as in the ``sandbox-fusion`` client)::

    RunCodeRequest  {code, language, compile_timeout=10, run_timeout=10, memory_limit_MB=-1,
                     stdin=None, files={path: base64|None}, fetch_files=[path]}
    RunCodeResponse {status: Success|Failed|SandboxError, message, compile_result, run_result,
                     executor_pod_name, files={path: base64}}
    CommandRunResult {status: Finished|Error|TimeLimitExceeded, execution_time (s),
                      cpu_time (s), return_code, stdout, stderr}

dsec shape (``POST /v1/run_code``): :class:`CodeRunRequest` -> :class:`CodeRunResult`, with
``ExecResult`` for the compile and run steps and an explicit ``outcome``.

Both are parsed into one :class:`CodeJob` (validated: language known, base64 valid, paths
inside ``/work`` that the worker can create, environment that ``execve`` accepts, sizes under
:class:`RunCodeLimits`) and executed by
:meth:`RunCodeService.execute`: claim a warm worker of the language's pool, lower its memory
limit if asked, send code + files + stdin, wait (bounded by compile + run timeouts + grace),
kill the worker. Bad input never reaches a worker; a worker that misbehaves is killed.

Served by a node's edge (:class:`dsec.contract.edge.CodeRuns`), a call also passes the
edge's admission (:class:`CodeRunAdmission`): the caller's key quota for the whole call,
the node's creation gate around the claim of its worker. Those refusals are raised in both
shapes, never turned into a SandboxFusion answer: the request was fine, the key or the node
is full, and a retry may pass.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import logging
import os
import posixpath
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import DsecError, InvalidRequest, NodeBusy, PayloadTooLarge, SandboxError
from dsec.models import (
    CodeRunRequest,
    CodeRunResult,
    CommandRunResult,
    CommandRunStatus,
    ExecResult,
    Outcome,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
)
from dsec.runtimes.fncall.languages import CLASSPATH, LanguageSpec, resolve_language
from dsec.runtimes.fncall.pool import ScratchSize
from dsec.runtimes.fncall.runtime import FncallRuntime, result_from_agent

log = logging.getLogger("dsec.fncall.service")

__all__ = [
    "CodeJob",
    "CodeRunAdmission",
    "CodeRunRequest",
    "CodeRunResult",
    "CommandRunResult",
    "CommandRunStatus",
    "RunCodeLimits",
    "RunCodeRequest",
    "RunCodeResponse",
    "RunCodeService",
    "RunStatus",
]


# --- the job --------------------------------------------------------------------------------


@dataclass
class RunCodeLimits:
    """Caps applied before a worker is claimed. Sizes in bytes, times in seconds.

    ``max_env_bytes`` counts ``len(KEY) + len(VALUE) + 2`` (UTF-8 bytes) over the call's
    variables; with the pool's own environment it stays far below the kernel's ``ARG_MAX``
    (a quarter of the 8 MiB stack limit), and no single ``KEY=VALUE`` may reach the kernel's
    ``MAX_ARG_STRLEN`` (128 KiB), so ``execve`` of the compiler or program cannot fail with
    ``E2BIG``.
    """

    max_code_bytes: int = 4 << 20
    max_files: int = 512
    max_files_bytes: int = 64 << 20
    max_stdin_bytes: int = 16 << 20
    max_fetch_bytes: int = 64 << 20
    max_output_bytes: int = 8 << 20
    max_run_timeout_s: float = 300.0
    max_compile_timeout_s: float = 300.0
    min_memory_mb: int = 16
    max_memory_mb: int = 8192
    max_env_vars: int = 1024
    max_env_bytes: int = 256 << 10
    grace_s: float = 5.0


@dataclass
class CodeJob:
    """A validated call, independent of the wire shape."""

    lang: LanguageSpec
    code: bytes
    files: list[tuple[str, bytes]] = field(default_factory=list)
    stdin: bytes = b""
    fetch: list[str] = field(default_factory=list)
    run_timeout_s: float = 10.0
    compile_timeout_s: float = 10.0
    memory_mb: int | None = None
    max_output_bytes: int = 1 << 20
    env: dict[str, str] = field(default_factory=dict)
    fetch_names: dict[str, list[str]] = field(default_factory=dict)
    """path under ``/work`` -> every name the caller asked for it by, in request order"""


@dataclass(frozen=True)
class CodeRunAdmission:
    """How an edge admits one call, as it admits a sandbox creation (see the module doc).

    Attributes:
        hold: entered once the request is valid, left when the call is over: the key's
            quota (raises ``QuotaExceeded`` / ``CreationRateExceeded`` before any worker
            is claimed).
        claim_slot: held while the call's worker is claimed, the call's creation: the
            node's creation gate (raises ``NodeBusy``).
    """

    hold: Callable[[], AbstractContextManager[Any]]
    claim_slot: Callable[[], AbstractAsyncContextManager[Any]]


@dataclass
class JobOutcome:
    compile: dict[str, Any] | None
    run: dict[str, Any] | None
    compile_result: ExecResult | None
    run_result: ExecResult | None
    files: dict[str, bytes]
    file_errors: dict[str, str]
    oom: bool
    worker: str
    duration_s: float


MAX_PATH_BYTES = 1024
"""Longest path accepted in ``files``/``fetch_files``, UTF-8 bytes (the kernel's is 4096)."""
NAME_MAX_BYTES = 255
"""Longest path component, UTF-8 bytes (``NAME_MAX`` of tmpfs: longer gives ENAMETOOLONG)."""
ARG_STRLEN_MAX = 32 * 4096
"""The kernel's ``MAX_ARG_STRLEN``: longest ``KEY=VALUE`` string ``execve`` takes, with its NUL."""


def work_relative(path: str, what: str = "file path", absolute_ok: bool = False) -> str:
    """``path`` relative to ``/work`` (relative paths are already so); anything leaving it raises.

    With ``absolute_ok`` (``fetch_files``: SandboxFusion fetches absolute paths) an absolute
    path outside ``/work`` is kept, normalised (``/mnt//b`` -> ``/mnt/b``), instead.
    Also refused (:class:`InvalidRequest`, message starting with ``what``): paths that are not
    UTF-8 (a lone surrogate), longer than ``MAX_PATH_BYTES`` or with a component longer than
    ``NAME_MAX_BYTES``, which the worker could not create or open, and ``..`` anywhere.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidRequest(f"{what} {path!r} is not a valid path", path=str(path)[:200])
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"{what} {path!r} is not valid UTF-8 (it holds a lone surrogate)"
        ) from None
    if size > MAX_PATH_BYTES:
        raise InvalidRequest(
            f"{what} is {size} bytes long; at most {MAX_PATH_BYTES}", path=path[:200]
        )
    absolute = False
    if path == "/work" or path.startswith("/work/"):
        rel = path[len("/work") :]
    elif path.startswith("/"):
        if not absolute_ok:
            raise InvalidRequest(f"{what} {path!r} is outside the work directory /work", path=path)
        rel, absolute = path, True
    else:
        rel = path
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts:
        raise InvalidRequest(
            f"{what} {path!r} names a directory ({'/' if absolute else '/work'}), not a file"
        )
    if ".." in parts:
        where = "" if absolute else " is outside the work directory /work"
        raise InvalidRequest(f"{what} {path!r}{where} (paths may not use '..')", path=path)
    for part in parts:
        if len(part.encode()) > NAME_MAX_BYTES:
            raise InvalidRequest(
                f"{what} {path!r} has a component of {len(part.encode())} bytes;"
                f" at most {NAME_MAX_BYTES}",
                path=path,
            )
    joined = posixpath.join(*parts)
    return "/" + joined if absolute else joined


def check_env(env: dict[str, str], limits: RunCodeLimits) -> None:
    """Refuse an environment that ``execve`` (or the warm interpreter) would not take.

    Names must be non-empty without ``=`` or NUL, values without NUL, both valid UTF-8; each
    ``KEY=VALUE`` shorter than ``ARG_STRLEN_MAX`` and all of them within ``limits``.
    Raises :class:`InvalidRequest` (or :class:`PayloadTooLarge` for the totals) naming the
    variable.
    """
    if len(env) > limits.max_env_vars:
        raise PayloadTooLarge(f"env has {len(env)} variables; at most {limits.max_env_vars}")
    total = 0
    for key, value in env.items():
        if not key or "=" in key or "\0" in key:
            raise InvalidRequest(f"env: invalid variable name {key[:100]!r}")
        if "\0" in value:
            raise InvalidRequest(f"env[{key[:100]!r}]: the value holds a NUL character")
        try:
            size = len(key.encode("utf-8")) + len(value.encode("utf-8")) + 2
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"env[{key[:100]!r}]: not valid UTF-8 (it holds a lone surrogate)"
            ) from None
        if size > ARG_STRLEN_MAX:
            raise PayloadTooLarge(
                f"env[{key[:100]!r}] is {size - 1} bytes as KEY=VALUE;"
                f" the kernel takes at most {ARG_STRLEN_MAX - 1}"
            )
        total += size
    if total > limits.max_env_bytes:
        raise PayloadTooLarge(f"env totals {total} bytes; at most {limits.max_env_bytes}")


_B64_WHITESPACE = str.maketrans("", "", " \t\n\r\v\f")


def _b64(data: str, what: str) -> bytes:
    """Standard base64 (``+/``, ``=`` padding) as SandboxFusion's ``b64decode`` reads it, less its
    leniency for garbage: ASCII whitespace anywhere (the line breaks of ``encodebytes``, MIME)
    is skipped; any other character outside the alphabet, or a wrong padding, raises
    :class:`InvalidRequest` naming ``what``."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return base64.b64decode(data.translate(_B64_WHITESPACE), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"{what} is not valid base64: {e}") from None


class RunCodeService:
    """Runs code in fncall workers. One instance per server; share it between routes."""

    def __init__(
        self, runtime: FncallRuntime, limits: RunCodeLimits | None = None, pod_name: str = ""
    ) -> None:
        """``pod_name``: SandboxFusion's ``executor_pod_name`` of answers no worker ran
        (``dsec serve`` passes ``dsec-fncall@<node>``); never a server path."""
        self.runtime = runtime
        self.limits = limits or RunCodeLimits()
        self.pod_name = pod_name or "dsec-fncall"

    # --- parsing ------------------------------------------------------------------------

    def _job(
        self,
        *,
        code: str,
        language: str,
        files: dict[str, bytes],
        stdin: bytes,
        fetch: list[str],
        run_timeout: float,
        compile_timeout: float,
        memory_mb: int | None,
        max_output: int,
        env: dict[str, str],
    ) -> CodeJob:
        lim = self.limits
        lang = resolve_language(language)
        code_b = code.encode("utf-8", "surrogatepass")
        if len(code_b) > lim.max_code_bytes:
            raise PayloadTooLarge(f"code is {len(code_b)} bytes; at most {lim.max_code_bytes}")
        if len(files) > lim.max_files:
            raise PayloadTooLarge(f"{len(files)} files; at most {lim.max_files}")
        total = sum(len(v) for v in files.values())
        if total > lim.max_files_bytes:
            raise PayloadTooLarge(f"files total {total} bytes; at most {lim.max_files_bytes}")
        if len(stdin) > lim.max_stdin_bytes:
            raise PayloadTooLarge(f"stdin is {len(stdin)} bytes; at most {lim.max_stdin_bytes}")
        rel_files: list[tuple[str, bytes]] = []
        asked: dict[str, str] = {lang.source_file: "the program source"}  # rel -> as given
        for path, data in files.items():
            rel = work_relative(path, "files: path")
            if rel == lang.source_file:
                raise InvalidRequest(
                    f"files: {path!r} would overwrite the program source {lang.source_file}"
                )
            if rel in asked:
                raise InvalidRequest(f"files: {path!r} and {asked[rel]!r} are the same file")
            asked[rel] = path
            rel_files.append((rel, data))
        for rel, path in asked.items():
            # a file cannot also be a directory: {"a": ..., "a/b": ...}
            parent = posixpath.dirname(rel)
            while parent:
                if parent in asked:
                    raise InvalidRequest(
                        f"files: {path!r} needs {parent!r} to be a directory,"
                        f" but {asked[parent]!r} is a file"
                    )
                parent = posixpath.dirname(parent)
        if len(fetch) > lim.max_files:
            raise PayloadTooLarge(f"{len(fetch)} fetch_files; at most {lim.max_files}")
        names: dict[str, list[str]] = {}
        for i, name in enumerate(fetch):
            key = work_relative(name, f"fetch_files[{i}]", absolute_ok=True)
            names.setdefault(key, []).append(name)
        if not (0 < run_timeout <= lim.max_run_timeout_s):
            raise InvalidRequest(
                f"run timeout must be in (0, {lim.max_run_timeout_s}] s (got {run_timeout})"
            )
        if lang.compile and not (0 < compile_timeout <= lim.max_compile_timeout_s):
            # languages without a compile step ignore it, as SandboxFusion does
            raise InvalidRequest(
                f"compile timeout must be in (0, {lim.max_compile_timeout_s}] s (got {compile_timeout})"
            )
        check_env(env, lim)
        if memory_mb is not None and not (lim.min_memory_mb <= memory_mb <= lim.max_memory_mb):
            raise InvalidRequest(
                f"memory limit must be in [{lim.min_memory_mb}, {lim.max_memory_mb}] MiB (got {memory_mb})"
            )
        if not (0 <= max_output <= lim.max_output_bytes):
            raise InvalidRequest(f"max_output_bytes must be in [0, {lim.max_output_bytes}]")
        return CodeJob(
            lang,
            code_b,
            rel_files,
            stdin,
            list(names),
            run_timeout,
            compile_timeout,
            memory_mb,
            max_output,
            env,
            names,
        )

    def job_from_sandboxfusion(self, req: RunCodeRequest) -> CodeJob:
        files = {p: _b64(v, f"files[{p!r}]") for p, v in req.files.items() if v is not None}
        return self._job(
            code=req.code,
            language=req.language,
            files=files,
            stdin=(req.stdin or "").encode("utf-8", "surrogatepass"),
            fetch=req.fetch_files,
            run_timeout=float(req.run_timeout),
            compile_timeout=float(req.compile_timeout),
            memory_mb=req.memory_limit_MB
            if req.memory_limit_MB and req.memory_limit_MB > 0
            else None,
            max_output=self.limits.max_output_bytes,
            env={},
        )

    def job_from_dsec(self, req: CodeRunRequest) -> CodeJob:
        if req.stdin is not None and req.stdin_b64 is not None:
            raise InvalidRequest("stdin and stdin_b64 are exclusive")
        if req.stdin is not None:
            try:
                stdin = req.stdin.encode()
            except UnicodeEncodeError:
                raise InvalidRequest(
                    "stdin is not valid UTF-8 (it holds a lone surrogate); send bytes as stdin_b64"
                ) from None
        else:
            stdin = _b64(req.stdin_b64 or "", "stdin_b64")
        files = {p: _b64(v, f"files[{p!r}]") for p, v in req.files.items()}
        return self._job(
            code=req.code,
            language=req.language,
            files=files,
            stdin=stdin,
            fetch=req.fetch_files,
            run_timeout=req.timeout_s,
            compile_timeout=req.compile_timeout_s,
            memory_mb=req.memory_mb,
            max_output=req.max_output_bytes,
            env=dict(req.env),
        )

    # --- execution ----------------------------------------------------------------------

    @staticmethod
    def _check_fits(job: CodeJob, work_mb: int, fsize_mb: int) -> None:
        """Refuse files the worker's ``/work`` (a ``work_mb`` MiB tmpfs for this call,
        ``RLIMIT_FSIZE`` of ``fsize_mb`` MiB) cannot hold, before a worker is claimed."""
        total = len(job.code) + sum(len(d) for _, d in job.files)
        if total > work_mb << 20:
            raise PayloadTooLarge(
                f"code and files total {total} bytes; /work holds {work_mb} MiB in this pool"
            )
        for rel, data in job.files:
            if len(data) > fsize_mb << 20:
                raise PayloadTooLarge(
                    f"files[{rel!r}] is {len(data)} bytes; at most {fsize_mb} MiB per file"
                )

    async def execute(
        self,
        job: CodeJob,
        claim_slot: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> JobOutcome:
        """Run one job in a fresh worker; the worker is killed afterwards whatever happens.
        ``claim_slot``: held while the worker is claimed (:class:`CodeRunAdmission`)."""
        t0 = time.monotonic()
        pool = await self.runtime.pool_for_language(job.lang)
        memory_mb = job.memory_mb if job.memory_mb is not None else pool.config.memory_mb
        scratch = ScratchSize.fit(memory_mb, pool.config.work_mb)
        self._check_fits(job, scratch.mb, pool.config.fsize_mb)
        async with claim_slot() if claim_slot is not None else nullcontext():
            w = await pool.claim()
        answered = False
        try:
            if memory_mb != pool.config.memory_mb:
                w.set_memory_limit(memory_mb << 20)
                w.fit_scratch(memory_mb, pool.config.work_mb)  # files stay within it
            lang = job.lang
            files = [{"path": lang.source_file, "size": len(job.code)}]
            blobs = [job.code]
            for rel, data in job.files:
                files.append({"path": rel, "size": len(data)})
                blobs.append(data)
            blobs.append(job.stdin)
            cpu = job.run_timeout_s
            run: dict[str, Any] = {
                "timeout_s": job.run_timeout_s,
                "cpu_s": cpu,
                "path": f"/work/{lang.source_file}",
            }
            # the warm bash got its environment when it was forked: a call with an env of its
            # own starts a fresh bash (a few ms more) instead
            warm = lang.warm != "none" and pool.warm == lang.warm
            if lang.warm == "bash" and job.env:
                warm = False
            run["argv"] = None if warm else _argv(lang.run, job)
            header: dict[str, Any] = {
                "op": "run",
                "files": files,
                "stdin_size": len(job.stdin),
                "max_output": job.max_output_bytes,
                "env": {**lang.env, **job.env},
                "run": run,
                "fetch": job.fetch,
                "fetch_max": self.limits.max_fetch_bytes,
                "compile": (
                    {
                        "argv": _argv(lang.compile, job),
                        "timeout_s": job.compile_timeout_s,
                        "cpu_s": job.compile_timeout_s,
                    }
                    if lang.compile
                    else None
                ),
            }
            try:
                await w.send(header, b"".join(blobs))
            except OSError as e:  # the worker died before it had read the whole call
                if await w.killed_by_memory_limit():
                    raise InvalidRequest(
                        f"the worker was killed by its memory limit"
                        f" ({job.memory_mb or pool.config.memory_mb} MiB) while"
                        f" receiving this call's {sum(len(b) for b in blobs)} bytes of code,"
                        " files and stdin; raise the memory limit",
                        memory_mb=job.memory_mb or pool.config.memory_mb,
                    ) from None
                raise SandboxError(
                    f"the fncall worker {pool.name}/w{w.wid} went away before the call was"
                    f" sent ({type(e).__name__})"
                ) from None
            budget = (
                job.run_timeout_s
                + (job.compile_timeout_s if lang.compile else 0.0)
                + self.limits.grace_s
            )
            try:
                reply, blob = await asyncio.wait_for(w.receive(), budget)
            except TimeoutError:
                # past the call's own time limits and the grace: the worker is stuck or was
                # starved of CPU by a saturated node, neither the caller's doing (it is
                # killed below); the call may be sent again
                raise NodeBusy(
                    f"the fncall worker did not answer within {budget:.1f} s (its run and"
                    " compile time limits and a grace); nothing of it is left: retry",
                    retry_after_s=1,
                ) from None
            except SandboxError:
                if await w.killed_by_memory_limit():
                    # the call's own data or program outgrew the call's limit: the caller's
                    raise InvalidRequest(
                        f"the worker was killed by its memory limit"
                        f" ({job.memory_mb or pool.config.memory_mb} MiB) before it could"
                        " report; raise the memory limit",
                        memory_mb=job.memory_mb or pool.config.memory_mb,
                    ) from None
                raise
            if reply.get("op") != "result":
                # the request was validated, so this is dsec's failure: the details (a Python
                # exception from inside the worker) go to the log, not to the client
                log.error(
                    "fncall worker %s/w%s failed: %s\n%s",
                    pool.name,
                    w.wid,
                    reply.get("message", reply),
                    reply.get("trace", ""),
                )
                raise SandboxError(
                    f"the fncall worker {pool.name}/w{w.wid} failed to run the call"
                    " (details in the server log)"
                )
            comp, run_res = reply.get("compile"), reply.get("run")
            signalled = any(r and r.get("signal") == 9 for r in (comp, run_res))
            oom = signalled and w.oom_kills() > 0
            offset = 0
            compile_result = run_result = None
            if comp is not None:
                compile_result = result_from_agent(comp, blob, oom=oom, offset=offset)
                offset += int(comp["stdout_len"]) + int(comp["stderr_len"])
            if run_res is not None:
                run_result = result_from_agent(run_res, blob, oom=oom, offset=offset)
                offset += int(run_res["stdout_len"]) + int(run_res["stderr_len"])
            fetched: dict[str, bytes] = {}
            errors: dict[str, str] = {}
            for f in reply.get("fetched") or []:
                rel = str(f["path"])
                asked_as = job.fetch_names.get(rel, [rel])
                if "error" in f:
                    for name in asked_as:
                        errors[name] = _fetch_error(rel, str(f["error"]))
                else:
                    size = int(f["size"])
                    for name in asked_as:  # one key per name asked for, as SandboxFusion
                        fetched[name] = blob[offset : offset + size]
                    offset += size
            outcome = JobOutcome(
                comp,
                run_res,
                compile_result,
                run_result,
                fetched,
                errors,
                oom,
                f"{pool.name}/w{w.wid}",
                time.monotonic() - t0,
            )
            answered = True
            return outcome
        finally:
            if answered:
                # the worker has answered and waits to be killed: kill it once the caller's
                # current step is done, so the answer goes out before its teardown (~3 ms of
                # CPU for two Python address spaces) competes with it for the CPUs
                asyncio.get_running_loop().call_soon(pool.discard, w)
            else:
                pool.discard(w)

    # --- the two wire shapes --------------------------------------------------------------

    def _sandbox_error(self, e: Exception) -> RunCodeResponse:
        """A failed call in SandboxFusion's shape: ``status=SandboxError`` with a message."""
        if isinstance(e, DsecError):
            message = e.public_message
        else:  # a bug: still answer in the client's shape
            log.exception("run_code failed", exc_info=e)
            message = f"internal error: {type(e).__name__}"
        return RunCodeResponse(
            status=RunStatus.SandboxError, message=message, executor_pod_name=self.pod_name
        )

    async def run_code(
        self, req: RunCodeRequest, admission: CodeRunAdmission | None = None
    ) -> RunCodeResponse:
        """SandboxFusion semantics. Errors of the request or of dsec come back as
        ``status=SandboxError`` with a message (never raised); ``admission``'s refusals
        are raised."""
        try:
            job = self.job_from_sandboxfusion(req)
        except Exception as e:
            return self._sandbox_error(e)
        with admission.hold() if admission is not None else nullcontext():
            try:
                out = await self.execute(job, admission.claim_slot if admission else None)
            except NodeBusy:  # only the creation gate says so here: a refusal, not an answer
                raise
            except Exception as e:
                return self._sandbox_error(e)
        compile_cr = (
            _command_result(out.compile, out.compile_result) if out.compile is not None else None
        )
        run_cr = _command_result(out.run, out.run_result) if out.run is not None else None
        ok = (
            run_cr is not None
            and run_cr.status == CommandRunStatus.Finished
            and run_cr.return_code == 0
        )
        notes = []
        if out.oom:
            notes.append("memory limit exceeded")
        if any(r is not None and r.truncated for r in (out.compile_result, out.run_result)):
            notes.append(f"output truncated to {job.max_output_bytes} bytes per stream")
        if out.file_errors:
            notes.append("; ".join(f"fetch {p}: {e}" for p, e in out.file_errors.items()))
        if compile_cr is not None and run_cr is None:
            notes.insert(
                0,
                "compile timed out"
                if compile_cr.status == CommandRunStatus.TimeLimitExceeded
                else "compile error",
            )
        return RunCodeResponse(
            status=RunStatus.Success if ok else RunStatus.Failed,
            message="; ".join(notes),
            compile_result=compile_cr,
            run_result=run_cr,
            executor_pod_name=out.worker or self.pod_name,
            files={p: base64.b64encode(d).decode() for p, d in out.files.items()},
        )

    async def run(
        self, req: CodeRunRequest, admission: CodeRunAdmission | None = None
    ) -> CodeRunResult:
        """dsec semantics: request and dsec errors are raised as :class:`DsecError`, and so
        are ``admission``'s refusals."""
        job = self.job_from_dsec(req)
        with admission.hold() if admission is not None else nullcontext():
            out = await self.execute(job, admission.claim_slot if admission else None)
        outcome: Outcome = "ok"
        if out.oom:
            outcome = "oom"
        elif out.compile_result is not None and out.run_result is None:
            outcome = "compile_timeout" if out.compile_result.timed_out else "compile_error"
        elif out.run_result is not None and out.run_result.timed_out:
            outcome = "timeout"
        elif out.run_result is None or not out.run_result.ok:
            outcome = "runtime_error"
        cpu = (out.run or {}).get("cpu_s")
        return CodeRunResult(
            outcome=outcome,
            compile=out.compile_result,
            run=out.run_result,
            files={p: base64.b64encode(d).decode() for p, d in out.files.items()},
            file_errors=out.file_errors,
            cpu_time_s=cpu,
            worker=out.worker,
            duration_ms=out.duration_s * 1000.0,
        )


_EXDEV = os.strerror(errno.EXDEV)


def _argv(argv: tuple[str, ...], job: CodeJob) -> list[str]:
    """``argv`` with :data:`CLASSPATH` replaced by ``.``, the language's jars and the call's
    ``*.jar`` files (SandboxFusion's ``-cp .:javatuples-1.2.jar:<files>.jar``)."""
    if CLASSPATH not in argv:
        return list(argv)
    cp = ":".join([".", *job.lang.jars, *(rel for rel, _ in job.files if rel.endswith(".jar"))])
    return [cp if a == CLASSPATH else a for a in argv]


def _fetch_error(rel: str, reason: str) -> str:
    """The worker's reason for not returning the fetched file ``rel`` (``strerror``, maybe
    after an ``"open <rel>: "`` prefix), in the client's terms."""
    reason = reason.removeprefix(f"open {rel}: ").removeprefix(f"open {rel.lstrip('/')}: ")
    if reason == _EXDEV:
        # openat2(RESOLVE_BENEATH) says EXDEV for any symlink it does not follow
        return (
            "not followed: the path goes through an absolute symlink or one leading out of"
            " /work (only relative symlinks that stay inside /work are followed)"
        )
    return reason


def _command_result(raw: dict[str, Any], res: ExecResult | None) -> CommandRunResult:
    assert res is not None
    if res.timed_out:
        status = CommandRunStatus.TimeLimitExceeded
    elif res.exit_code is None and res.signal is None:
        status = CommandRunStatus.Error
    else:
        status = CommandRunStatus.Finished
    rc = res.exit_code if res.exit_code is not None else (-res.signal if res.signal else None)
    if res.timed_out:
        rc = None  # SandboxFusion reports no return code for a step it stopped at its limit
    return CommandRunResult(
        status=status,
        execution_time=res.duration_ms / 1000.0,
        cpu_time=raw.get("cpu_s"),
        return_code=rc,
        stdout=res.stdout,
        stderr=res.stderr,
    )
