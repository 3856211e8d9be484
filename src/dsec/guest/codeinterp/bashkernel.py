"""A bash kernel: one persistent interactive bash behind a pty, spoken to through ipykernel.

Run as a script by the server (``python3 bashkernel.py -f CONNECTION_FILE``). Each cell is
written to a file and run with ``source`` in the same shell, so variables, functions,
``cd`` and ``export`` persist from cell to cell. Output is streamed as it comes (a pty
merges stdout and stderr, so everything arrives as ``stdout``, like E2B's bash kernel). A
non-zero status of the cell's last command is reported as an ``error`` named
``ExitCode`` whose value is the status. An interrupt (the server's SIGINT on timeout)
sends ``^C`` to the shell's terminal: the running command stops, the shell and its state
stay. If the shell exits (``exit``), a new one is started and the cell reports
``ShellExited``.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import tempfile
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]

import pexpect  # noqa: E402
from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from ipykernel.kernelbase import Kernel  # noqa: E402

_INTERRUPT_WAIT_S = 1.0
"""How long an interrupted command may take to stop before the shell (or node) is
replaced; below the server's --interrupt-grace, so the kernel and its other state stay."""


def _default_sigint() -> None:
    """ipykernel ignores SIGINT outside of cells; the shell and its commands must not
    inherit that (a ``^C`` would not stop them)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class BashKernel(Kernel):
    implementation = "dsec-bash"
    implementation_version = "1.0"
    language = "bash"
    language_version = "5"
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh"}
    banner = "dsec bash kernel"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._token = secrets.token_hex(8)
        self._prompt = re.compile("\x1e" + self._token + r":(\d+)\x1f")
        # cells are files in the server's private runtime directory (removed with it, also
        # when this kernel is killed mid-cell)
        self._cells = os.environ.get("JUPYTER_RUNTIME_DIR") or tempfile.gettempdir()
        os.makedirs(self._cells, mode=0o700, exist_ok=True)
        self._child: Any = None
        self._start_shell()

    def _start_shell(self) -> None:
        env = dict(os.environ)
        env.update({"TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat"})
        child = pexpect.spawn(
            "bash",
            ["--norc", "--noprofile", "--noediting", "-i"],
            echo=False,
            encoding="utf-8",
            codec_errors="replace",
            env=env,
            cwd=os.getcwd(),
            dimensions=(50, 200),
            preexec_fn=_default_sigint,
        )
        child.delaybeforesend = None  # pexpect sleeps 50 ms before each send by default
        # prompt = RS token:status US; no continuation prompt
        child.sendline(
            f"PS1=$'\\x1e{self._token}:'\"\\$?\"$'\\x1f'; PS2=''; "
            "unset PROMPT_COMMAND; stty -echo -onlcr 2>/dev/null"
        )
        child.expect(self._prompt, timeout=30)
        self._child = child

    def _emit(self, text: str) -> None:
        if text:
            self.send_response(
                self.iopub_socket, "stream", {"name": "stdout", "text": text.replace("\r\n", "\n")}
            )

    def _read_until_prompt(self, deadline: float | None = None) -> int | None:
        """Stream output until the prompt; the cell's exit status, None on EOF.

        ``deadline`` (monotonic seconds) bounds the wait; past it TimeoutError.
        """
        import time

        buf = ""
        hold = len(self._token) + 24  # a prompt may be split across reads
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            try:
                buf += self._child.read_nonblocking(65536, timeout=0.05)
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                self._emit(buf)
                return None
            match = self._prompt.search(buf)
            if match:
                self._emit(buf[: match.start()])
                return int(match.group(1))
            # emit all but a possible start of the prompt (it begins with RS)
            cut = buf.rfind("\x1e")
            if cut < 0 or len(buf) - cut > hold:
                cut = len(buf)
            if cut:
                self._emit(buf[:cut])
                buf = buf[cut:]

    def _respawn(self) -> int:
        status = self._child.exitstatus if self._child is not None else None
        try:
            self._child.close(force=True)
        except Exception:
            pass
        self._start_shell()
        return -1 if status is None else int(status)

    def do_execute(self, code: str, silent: bool, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return self._execute(code, silent)
        except Exception as e:  # a fault of this kernel, reported rather than swallowed
            return self._error("KernelError", f"{type(e).__name__}: {e}", silent)

    def _execute(
        self,
        code: str,
        silent: bool,
        store_history: bool = True,
        user_expressions: Any = None,
        allow_stdin: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        import time

        fd, path = tempfile.mkstemp(prefix="dsec-bash-cell-", suffix=".sh", dir=self._cells)
        with os.fdopen(fd, "w") as f:
            f.write(code if code.endswith("\n") else code + "\n")
        try:
            self._child.sendline(f"source {path}")
            status = self._read_until_prompt()
        except KeyboardInterrupt:
            self._child.sendintr()
            try:
                self._read_until_prompt(time.monotonic() + _INTERRUPT_WAIT_S)
            except (TimeoutError, KeyboardInterrupt):
                self._respawn()
            return self._error("KeyboardInterrupt", "the cell was interrupted", silent)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        if status is None:
            code_ = self._respawn()
            return self._error(
                "ShellExited",
                f"bash exited (status {code_}); a new shell was started and the state was lost",
                silent,
            )
        if status != 0:
            return self._error("ExitCode", str(status), silent)
        return {
            "status": "ok",
            "execution_count": self.execution_count,
            "payload": [],
            "user_expressions": {},
        }

    def _error(self, name: str, value: str, silent: bool) -> dict[str, Any]:
        content = {"ename": name, "evalue": value, "traceback": [f"{name}: {value}"]}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        try:
            self._child.close(force=True)
        except Exception:
            pass
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
