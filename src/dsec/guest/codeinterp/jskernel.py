"""A JavaScript kernel: a persistent Node.js process, spoken to through ipykernel.

Run as a script by the server (``python3 jskernel.py -f CONNECTION_FILE``). Cells run in
the global context of one ``node`` process (``jskernel.js``): declarations, ``require``d
modules and ``process.env`` persist; the value of the last expression comes back as the
cell's result (``util.inspect`` text; a Promise is awaited first); ``console.log`` /
``console.error`` stream as stdout / stderr; a thrown error is an ``error`` with its
``name``, ``message`` and stack. An interrupt stops a running script (``breakOnSigint``)
or a pending await. If node dies, a new one starts and the cell reports ``NodeExited``.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]

from ipykernel.kernelapp import IPKernelApp  # noqa: E402
from ipykernel.kernelbase import Kernel  # noqa: E402

_INTERRUPT_WAIT_S = 1.0
"""How long an interrupted command may take to stop before the shell (or node) is
replaced; below the server's --interrupt-grace, so the kernel and its other state stay."""


def _node() -> str:
    return shutil.which("node") or shutil.which("nodejs") or "node"


class JavaScriptKernel(Kernel):
    implementation = "dsec-javascript"
    implementation_version = "1.0"
    language = "javascript"
    language_version = "ES2022"
    language_info = {
        "name": "javascript",
        "mimetype": "application/javascript",
        "file_extension": ".js",
    }
    banner = "dsec JavaScript kernel (Node.js)"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl = -1
        self._ctl_buf = b""
        self._start_node()

    def _start_node(self) -> None:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, "DSEC_JS_CTL_FD": str(write_fd), "NODE_NO_WARNINGS": "1"}
        self._proc = subprocess.Popen(
            [_node(), os.path.join(_HERE, "jskernel.js")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            cwd=os.getcwd(),
        )
        os.close(write_fd)
        self._ctl = read_fd
        self._ctl_buf = b""
        for stream in (self._proc.stdout, self._proc.stderr):
            assert stream is not None
            os.set_blocking(stream.fileno(), False)

    def _stop_node(self) -> None:
        proc = self._proc
        self._proc = None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if self._ctl >= 0:
            os.close(self._ctl)
            self._ctl = -1

    def _forward(self, fd: int, name: str) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.send_response(
                self.iopub_socket, "stream", {"name": name, "text": chunk.decode(errors="replace")}
            )

    def _wait_reply(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Stream node's output until its answer; None if node died."""
        import time

        assert self._proc is not None and self._proc.stdout and self._proc.stderr
        out, err = self._proc.stdout.fileno(), self._proc.stderr.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if b"\n" in self._ctl_buf:
                line, self._ctl_buf = self._ctl_buf.split(b"\n", 1)
                self._forward(out, "stdout")
                self._forward(err, "stderr")
                return dict(json.loads(line))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            ready, _, _ = select.select([self._ctl, out, err], [], [], 0.5)
            if out in ready:
                self._forward(out, "stdout")
            if err in ready:
                self._forward(err, "stderr")
            if self._ctl in ready:
                chunk = os.read(self._ctl, 65536)
                if not chunk:
                    self._forward(out, "stdout")
                    self._forward(err, "stderr")
                    return None
                self._ctl_buf += chunk

    def do_execute(self, code: str, silent: bool, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return self._execute(code, silent)
        except Exception as e:  # a fault of this kernel, reported rather than swallowed
            return self._error("KernelError", f"{type(e).__name__}: {e}", [], silent)

    def _execute(
        self,
        code: str,
        silent: bool,
        store_history: bool = True,
        user_expressions: Any = None,
        allow_stdin: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            try:
                self._proc.stdin.write(json.dumps({"code": code}).encode() + b"\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass
            reply = self._wait_reply()
        except KeyboardInterrupt:
            # node got the same SIGINT (the server signals the kernel's process group); a
            # second one could land while vm has no SIGINT handler installed and kill it.
            # node keeps the SIGINT disposition it inherited (ignored, as ipykernel set it;
            # libuv resets it for the processes node spawns)
            try:
                reply = self._wait_reply(_INTERRUPT_WAIT_S)
            except (TimeoutError, KeyboardInterrupt):
                reply = None
            if reply is None:
                self._stop_node()
                self._start_node()
            return self._error("KeyboardInterrupt", "the cell was interrupted", [], silent)
        if reply is None:
            status = self._proc.wait() if self._proc is not None else None
            self._stop_node()
            self._start_node()
            return self._error(
                "NodeExited",
                f"node exited (status {status}); a new one was started and the state was lost",
                [],
                silent,
            )
        if not reply.get("ok"):
            return self._error(
                str(reply.get("ename", "Error")),
                str(reply.get("evalue", "")),
                [str(t) for t in reply.get("traceback", [])],
                silent,
            )
        result = reply.get("result")
        if result is not None and not silent:
            self.send_response(
                self.iopub_socket,
                "execute_result",
                {
                    "execution_count": self.execution_count,
                    "data": {"text/plain": result},
                    "metadata": {},
                },
            )
        return {
            "status": "ok",
            "execution_count": self.execution_count,
            "payload": [],
            "user_expressions": {},
        }

    def _error(self, name: str, value: str, traceback: list[str], silent: bool) -> dict[str, Any]:
        content = {"ename": name, "evalue": value, "traceback": traceback or [f"{name}: {value}"]}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        return {"status": "error", "execution_count": self.execution_count, **content}

    def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self._stop_node()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaScriptKernel)
