"""Code contexts: one Jupyter kernel each, driven through jupyter_client.

A *context* is E2B's name for a stateful interpreter: an id, a language and a working
directory. :class:`CodeContext` owns one kernel (an :class:`AsyncKernelManager` and its
client). Executions on one context are serialized by its lock; different contexts run in
parallel (each kernel is its own process).

Robustness rules:

* a kernel that dies (during an execution or between two) is started again by the next
  use; the execution it died in ends with an ``error`` line named ``ContextRestarting``
  (what E2B's server reports when Jupyter restarts a kernel), one that finds it dead
  starts with a ``stderr`` line saying the state was lost;
* output is bounded: past ``max_output_bytes`` per execution the stream and result lines
  are dropped and one ``stderr`` line says so (the execution itself goes on);
* a client that goes away mid-execution (E2B's client closes the connection when its
  ``timeout`` passes) gets its kernel interrupted (SIGINT to the kernel's process group);
  if the kernel is not idle ``interrupt_grace_s`` later it is restarted, so the next
  execution never waits behind an abandoned one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jupyter_client.session
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.manager import AsyncKernelManager

from . import protocol
from .protocol import RequestError

__all__ = ["CodeContext", "ContextRegistry", "KernelCatalog", "Limits"]

log = logging.getLogger("dsec_codeinterp")

_HERE = Path(__file__).resolve().parent
_IPC_PATH_MAX = 107
"""Longest unix socket path (``sizeof(sun_path) - 1``)."""

# jupyter_client parses every date of every message header with dateutil (about a third of
# this server's CPU per execution); the only date used here is copied out as ISO 8601
# text, which the header already holds, so headers are left as sent.
jupyter_client.session.extract_dates = lambda obj: obj


@dataclass(frozen=True)
class Limits:
    """Bounds of one server (all per execution unless said otherwise).

    Attributes:
        max_output_bytes: stdout + stderr + result bytes forwarded per execution.
        keepalive_s: a ``keepalive`` line after this many seconds without output.
        interrupt_grace_s: after an interrupt, how long the kernel may take to go idle
            before it is restarted.
        kernel_start_timeout_s: how long a kernel may take to answer its first request.
        max_contexts: contexts one server keeps at once (each is a process).
    """

    max_output_bytes: int = 16 << 20
    keepalive_s: float = 5.0
    interrupt_grace_s: float = 3.0
    kernel_start_timeout_s: float = 60.0
    max_contexts: int = 64


class KernelCatalog(KernelSpecManager):
    """The kernels this server can start, by language (no kernelspec directories needed).

    * ``python``: ipykernel with the inline matplotlib backend (``pykernel.py``);
    * ``bash``: a persistent bash behind a pty (``bashkernel.py``, needs ``bash``);
    * ``javascript``: a persistent Node.js ``vm`` context (``jskernel.py``, needs ``node``).

    Every kernel runs under this server's Python (``python``), so it must have ipykernel.
    """

    def __init__(self, python: str = sys.executable, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._python = python

    def languages(self) -> list[str]:
        """The languages whose kernels can start here (their interpreters exist)."""
        out = ["python"]
        if shutil.which("bash"):
            out.append("bash")
        if shutil.which("node") or shutil.which("nodejs"):
            out.append("javascript")
        return out

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        scripts = {"python": "pykernel.py", "bash": "bashkernel.py", "javascript": "jskernel.py"}
        if kernel_name == "python3":  # jupyter_client's name for its native kernel
            kernel_name = "python"
        script = scripts.get(kernel_name)
        if script is None or kernel_name not in self.languages():
            raise NoSuchKernel(kernel_name)
        return KernelSpec(
            argv=[self._python, str(_HERE / script), "-f", "{connection_file}"],
            display_name=kernel_name,
            language=kernel_name,
            env={},
        )

    def find_kernel_specs(self) -> dict[str, str]:
        return {name: str(_HERE) for name in self.languages()}


class _Finished(Exception):
    """Internal: the execution ended (idle seen, or the kernel died)."""


@dataclass
class _ExecutionState:
    msg_id: str
    emitted_bytes: int = 0
    truncated: bool = False
    errored: bool = False
    idle: bool = False
    reply: dict[str, Any] | None = None
    lines: list[bytes] = field(default_factory=list)


class CodeContext:
    """One kernel: ``id``, ``language``, ``cwd``; :meth:`execute` streams E2B output lines."""

    def __init__(
        self,
        context_id: str,
        language: str,
        cwd: str,
        catalog: KernelCatalog,
        limits: Limits,
        env: dict[str, str],
    ) -> None:
        self.id = context_id
        self.language = language
        self.cwd = cwd
        self.restarts = 0
        self._catalog = catalog
        self._limits = limits
        self._env = env
        self.lock = asyncio.Lock()
        self._km: AsyncKernelManager | None = None
        self._kc: Any = None
        self._lost_state_note: str | None = None
        self._closed = False
        self._restart_requested = False
        self.generation = 0
        """Incremented by every kernel start (so a restart knows if one happened meanwhile)."""

    def describe(self) -> dict[str, Any]:
        """The JSON E2B's client reads (``id``, ``language``, ``cwd``) plus ``restarts``."""
        return {
            "id": self.id,
            "language": self.language,
            "cwd": self.cwd,
            "restarts": self.restarts,
        }

    # --- kernel lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the kernel and wait until it answers (``kernel_start_timeout_s``)."""
        # ZMQ over unix sockets in a private directory: faster than loopback TCP and out of
        # reach of other users' processes in the sandbox; loopback TCP when that directory's
        # path is too long for a socket address (108 bytes with the port suffix)
        sockets = os.environ.get("JUPYTER_RUNTIME_DIR") or tempfile.gettempdir()
        prefix = os.path.join(sockets, f"k-{self.id[:8]}-{self.generation}")
        if len(prefix.encode()) + 8 < _IPC_PATH_MAX:
            os.makedirs(sockets, mode=0o700, exist_ok=True)
            km = AsyncKernelManager(
                kernel_name=self.language,
                kernel_spec_manager=self._catalog,
                transport="ipc",
                ip=prefix,
            )
        else:
            km = AsyncKernelManager(
                kernel_name=self.language, kernel_spec_manager=self._catalog, ip="127.0.0.1"
            )
        km.shutdown_wait_time = 1.0
        env = {**self._env, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        await km.start_kernel(env=env, cwd=self.cwd)
        self.generation += 1
        kc = km.client()
        kc.start_channels()
        self._km, self._kc = km, kc
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.kernel_start_timeout_s
        while True:  # ready, dead (fail at once, not after the timeout) or too slow
            try:
                await kc.wait_for_ready(timeout=1.0)
                return
            except (RuntimeError, TimeoutError) as e:
                why = str(e)
            if not await self._alive():
                why = await self._death_note()
            elif loop.time() < deadline:
                continue
            await self._stop_kernel()
            raise RuntimeError(f"the {self.language} kernel did not start: {why}")

    async def _stop_kernel(self) -> None:
        kc, km = self._kc, self._km
        self._kc = self._km = None
        if kc is not None:
            with contextlib.suppress(Exception):
                kc.stop_channels()
        if km is not None:
            pgid = _pid_of(km)
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)
            if pgid:  # the kernel's children too (it leads its own process group)
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)

    def _kill_process(self) -> None:
        """SIGKILL the kernel's process group now (a running execution then sees it die)."""
        pgid = _pid_of(self._km) if self._km is not None else None
        if pgid:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)

    async def restart(self) -> None:
        """Kill the kernel and start a fresh one (its state is gone).

        An execution running on the context ends at once with a ``ContextRestarting``
        error (its kernel is killed; that execution starts the new kernel).
        """
        generation = self.generation
        if self.lock.locked():
            self._restart_requested = True
            self._kill_process()
        async with self.lock:
            self._restart_requested = False
            if self.generation != generation and self._km is not None:
                return  # the interrupted execution already started a new kernel
            await self._stop_kernel()
            self.restarts += 1
            await self.start()

    async def close(self) -> None:
        """Stop the kernel for good (``DELETE /contexts/{id}``, server shutdown); a running
        execution ends with a ``ContextRemoved`` error."""
        self._closed = True
        self._kill_process()
        async with self.lock:
            await self._stop_kernel()

    async def _alive(self) -> bool:
        km = self._km
        if km is None:
            return False
        try:
            return bool(await km.is_alive())
        except Exception:
            return False

    async def _death_note(self) -> str:
        code = _exit_code_of(self._km)
        if code is None:
            return "the kernel process died"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the kernel process was killed by {name}"
        return f"the kernel process exited with status {code}"

    async def _revive(self, why: str) -> None:
        log.warning("context %s: %s; restarting its kernel", self.id, why)
        await self._stop_kernel()
        self.restarts += 1
        await self.start()

    async def ensure_running(self) -> None:
        """Start again a kernel found dead, remembering to tell the next execution."""
        if self._closed:
            raise RequestError(404, f"Context {self.id} not found")
        if self._km is None or not await self._alive():
            why = await self._death_note() if self._km is not None else "the kernel was stopped"
            await self._revive(why)
            self._lost_state_note = (
                f"[dsec] {why}; the context was restarted and its state was lost\n"
            )

    # --- execution --------------------------------------------------------------------------

    async def _run_silent(self, code: str, timeout_s: float = 30.0) -> None:
        """Run a helper cell (``silent``: no history, no execution count, no output)."""
        kc = self._kc
        msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RuntimeError("a helper cell did not finish")
            try:
                msg = await kc.get_shell_msg(timeout=min(remaining, 1.0))
            except Exception:
                if not await self._alive():
                    raise RuntimeError("the kernel died") from None
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return

    async def execute(
        self, code: str, env: dict[str, str], disconnected: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        """Run ``code`` with ``env`` set for this call; yield NDJSON lines as they come.

        The caller holds :attr:`lock`. ``disconnected()`` says whether the client went away:
        then the kernel is interrupted (and restarted if it does not go idle in time) and
        the generator ends.
        """
        protocol.check_env_names(self.language, env)
        note = self._lost_state_note
        self._lost_state_note = None
        if note:
            yield protocol.output_line(
                {"type": "stderr", "text": note, "timestamp": protocol.timestamp_of({})}
            )
        if env:
            await self._run_silent(protocol.env_set_code(self.language, env))
        try:
            async for line in self._execute_cell(code, disconnected):
                yield line
        finally:
            if env and self._km is not None:
                try:
                    await self._run_silent(protocol.env_restore_code(self.language, env))
                except RuntimeError:
                    log.warning("context %s: could not restore the environment", self.id)

    async def _execute_cell(
        self, code: str, disconnected: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        kc = self._kc
        loop = asyncio.get_running_loop()
        # stop_on_error=False: executions are serialized here, so there is no queue to
        # abort; with True, ipykernel would abort a request arriving just after an error.
        st = _ExecutionState(
            msg_id=kc.execute(
                code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False
            )
        )
        last_sent = loop.time()
        shell_task: asyncio.Task[Any] | None = None
        try:
            while not (st.idle and st.reply is not None):
                if disconnected():
                    await self._abandon(st)
                    return
                if shell_task is None and st.reply is None:
                    shell_task = asyncio.ensure_future(self._next_reply(st.msg_id))
                if st.idle and shell_task is not None:
                    # idle came first: the reply is on its way (or the kernel is odd)
                    try:
                        st.reply = await asyncio.wait_for(asyncio.shield(shell_task), 2.0)
                    except TimeoutError:
                        st.reply = {}
                    shell_task = None
                    continue
                try:
                    msg = await kc.get_iopub_msg(timeout=1.0)
                except Exception:  # queue.Empty: nothing within a second
                    msg = None
                if shell_task is not None and shell_task.done():
                    st.reply = shell_task.result() or {}
                    shell_task = None
                if msg is None:
                    if st.reply is not None:
                        # replied and a second of silence: the idle status was lost (a
                        # SUB socket drops messages past its high-water mark)
                        break
                    if not await self._alive():
                        if self._closed:
                            yield protocol.output_line(
                                {
                                    "type": "error",
                                    "name": "ContextRemoved",
                                    "value": "Context was removed",
                                    "traceback": "",
                                }
                            )
                            return
                        if self._restart_requested:
                            why = "restarted on request"
                        else:
                            why = await self._death_note()
                        yield protocol.output_line(
                            {
                                "type": "error",
                                "name": "ContextRestarting",
                                "value": f"Context was restarted: {why}",
                                "traceback": "",
                            }
                        )
                        await self._revive(why)
                        return
                    if loop.time() - last_sent >= self._limits.keepalive_s:
                        last_sent = loop.time()
                        yield protocol.output_line({"type": "keepalive"})
                    continue
                for line in self._convert(st, msg):
                    last_sent = loop.time()
                    yield line
            status = (st.reply or {}).get("content", {}).get("status")
            if status in ("abort", "aborted") and not st.errored:
                yield protocol.output_line(
                    {
                        "type": "error",
                        "name": "ExecutionAborted",
                        "value": "Execution was aborted",
                        "traceback": "",
                    }
                )
        finally:
            if shell_task is not None:
                shell_task.cancel()

    async def _next_reply(self, msg_id: str) -> dict[str, Any]:
        """The ``execute_reply`` to ``msg_id`` (other shell replies are skipped)."""
        kc = self._kc
        while True:
            try:
                msg = await kc.get_shell_msg(timeout=3600.0)
            except Exception:
                await asyncio.sleep(0.05)
                continue
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return dict(msg)

    def _convert(self, st: _ExecutionState, msg: dict[str, Any]) -> list[bytes]:
        if msg.get("parent_header", {}).get("msg_id") != st.msg_id:
            return []  # output of an earlier, abandoned cell or of a background thread
        kind = msg.get("msg_type")
        content = msg.get("content", {})
        if kind == "status":
            if content.get("execution_state") == "idle":
                st.idle = True
            return []
        if kind == "execute_input":
            count = content.get("execution_count")
            return [
                protocol.output_line({"type": "number_of_executions", "execution_count": count})
            ]
        if kind == "error":
            if st.errored:
                return []
            st.errored = True
            return [
                protocol.output_line(
                    {
                        "type": "error",
                        "name": str(content.get("ename", "")),
                        "value": str(content.get("evalue", "")),
                        "traceback": "\n".join(str(t) for t in content.get("traceback", [])),
                    }
                )
            ]
        if kind == "stream":
            name = content.get("name")
            if name not in ("stdout", "stderr"):
                return []
            return self._bounded(
                st,
                {
                    "type": name,
                    "text": str(content.get("text", "")),
                    "timestamp": protocol.timestamp_of(msg),
                },
            )
        if kind in ("execute_result", "display_data"):
            data = content.get("data") or {}
            return self._bounded(st, protocol.result_fields(dict(data), kind == "execute_result"))
        return []

    def _bounded(self, st: _ExecutionState, obj: dict[str, Any]) -> list[bytes]:
        if st.truncated:
            return []
        line = protocol.output_line(obj)
        if st.emitted_bytes + len(line) <= self._limits.max_output_bytes:
            st.emitted_bytes += len(line)
            return [line]
        st.truncated = True
        out = []
        room = self._limits.max_output_bytes - st.emitted_bytes - 256
        text = obj.get("text")
        if obj["type"] in ("stdout", "stderr") and isinstance(text, str) and room > 0:
            # keep the head of the message that overflows (JSON escaping may grow it)
            cut = text.encode()[:room].decode(errors="ignore")
            while cut:
                line = protocol.output_line({**obj, "text": cut})
                if st.emitted_bytes + len(line) <= self._limits.max_output_bytes:
                    st.emitted_bytes += len(line)
                    out.append(line)
                    break
                cut = cut[: len(cut) * 3 // 4]
        return [
            *out,
            protocol.output_line(
                {
                    "type": "stderr",
                    "text": f"\n[dsec] output truncated: this execution produced more than "
                    f"{self._limits.max_output_bytes} bytes; the rest was dropped\n",
                    "timestamp": protocol.timestamp_of({}),
                }
            ),
        ]

    async def _abandon(self, st: _ExecutionState) -> None:
        """The client left: interrupt, wait for idle, else restart the kernel."""
        km, kc = self._km, self._kc
        if km is None:
            return
        log.info("context %s: client went away; interrupting the kernel", self.id)
        with contextlib.suppress(Exception):
            await km.interrupt_kernel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.interrupt_grace_s
        while loop.time() < deadline:
            try:
                msg = await kc.get_iopub_msg(timeout=max(0.01, deadline - loop.time()))
            except Exception:
                break
            if (
                msg.get("parent_header", {}).get("msg_id") == st.msg_id
                and msg.get("msg_type") == "status"
                and msg.get("content", {}).get("execution_state") == "idle"
            ):
                return
        await self._revive("an abandoned execution did not stop after an interrupt")
        self._lost_state_note = (
            "[dsec] an earlier execution ignored its interrupt; the context was restarted "
            "and its state was lost\n"
        )


def _pid_of(km: AsyncKernelManager | None) -> int | None:
    try:
        proc = km.provisioner.process  # type: ignore[union-attr]
        return int(proc.pid) if proc is not None else None
    except Exception:
        return None


def _exit_code_of(km: AsyncKernelManager | None) -> int | None:
    try:
        proc = km.provisioner.process  # type: ignore[union-attr]
        return None if proc is None else proc.poll()
    except Exception:
        return None


class ContextRegistry:
    """All contexts of one server, and the default context of each language."""

    def __init__(
        self,
        catalog: KernelCatalog,
        limits: Limits,
        default_cwd: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.catalog = catalog
        self.limits = limits
        self.default_cwd = default_cwd
        self._env = dict(os.environ if env is None else env)
        self._contexts: dict[str, CodeContext] = {}
        self._defaults: dict[str, str] = {}
        self._default_locks: dict[str, asyncio.Lock] = {}
        self.ready = asyncio.Event()

    def list(self) -> list[CodeContext]:
        return list(self._contexts.values())

    def get(self, context_id: str) -> CodeContext:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RequestError(404, f"Context {context_id} not found")
        return ctx

    def _check_language(self, language: str) -> None:
        languages = self.catalog.languages()
        if language not in languages:
            raise RequestError(
                400,
                f"language {language!r} is not available in this sandbox "
                f"(available: {', '.join(languages)})",
            )

    async def create(self, language: str, cwd: str | None) -> CodeContext:
        """Start a new context (400 for an unknown language or a missing directory)."""
        self._check_language(language)
        path = cwd or self.default_cwd
        if not await asyncio.to_thread(os.path.isdir, path):
            raise RequestError(400, f"cwd {path!r} is not a directory")
        if len(self._contexts) >= self.limits.max_contexts:
            raise RequestError(
                400, f"at most {self.limits.max_contexts} contexts at once: remove one first"
            )
        ctx = CodeContext(str(uuid.uuid4()), language, path, self.catalog, self.limits, self._env)
        self._contexts[ctx.id] = ctx
        try:
            await ctx.start()
        except BaseException:
            self._contexts.pop(ctx.id, None)
            raise
        return ctx

    async def default(self, language: str) -> CodeContext:
        """The default context of ``language`` (made on first use, like E2B's)."""
        self._check_language(language)
        lock = self._default_locks.setdefault(language, asyncio.Lock())
        async with lock:
            cid = self._defaults.get(language)
            if cid is not None and cid in self._contexts:
                return self._contexts[cid]
            ctx = await self.create(language, None)
            self._defaults[language] = ctx.id
            if language == protocol.DEFAULT_LANGUAGE:
                self.ready.set()
            return ctx

    async def remove(self, context_id: str) -> None:
        ctx = self._contexts.pop(self.get(context_id).id)
        for lang, cid in list(self._defaults.items()):
            if cid == context_id:
                del self._defaults[lang]
        await ctx.close()

    async def close_all(self) -> None:
        contexts, self._contexts = list(self._contexts.values()), {}
        await asyncio.gather(*(c.close() for c in contexts), return_exceptions=True)
