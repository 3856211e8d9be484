"""A persistent shell in a sandbox, kept over dsec's exec and file APIs alone.

dsec's public SDK runs one command per exec; agent harnesses (SWE-ReX sessions) want a
shell whose state survives between commands: the working directory, variables, functions,
aliases, shell options, background jobs, and an interactive program (a Python REPL) that
is still running and reading its terminal. No server runs in the sandbox for this.
:meth:`ShellSession.start` writes one script (``session.sh`` of this package) into a
private directory of the sandbox and launches one long-lived bash from it in the
background (under ``script(1)`` for a pseudo-terminal when the image has util-linux, else
on pipes). That bash reads command ids from a FIFO and *sources* each command's file, so
the command runs in the shell itself and its state persists. Every later call is one
exec of the same script's ``wait``, which hands over a command (or terminal input, or a
signal) and blocks until the command ends, new output appears (when expecting a
pattern), or the deadline passes. Output goes to one file in the session directory; this
object keeps the byte offset of what it has returned, so output that arrives after a
timeout is returned by the next call, as pexpect's buffer would.

Limits (also in docs/integrations.md):

* needs ``bash`` in the image (as SWE-ReX does), plus coreutils ``stat``/``tail``/
  ``base64`` and ``mkfifo``; ``script`` (util-linux) for a terminal;
* an interrupt is SIGINT to the shell's process group (what Ctrl-C does); a command that
  ignores it is SIGKILLed after the retries, and so are background jobs of the session;
  a builtin loop that traps SIGINT itself cannot be stopped without closing the session;
* ``exit`` in a command ends the session (as in an interactive shell);
* the session's files live in the sandbox (``/tmp/.dsec-sessions`` by default): a
  command that deletes them or closes the shell's inherited descriptors 3 and 4 breaks
  its session;
* when a sandbox migrates to another node its processes do not follow: the session
  reports ``exited``.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Literal

from dsec.errors import SandboxError, SandboxNotFound, SandboxStopped, Unsupported

if TYPE_CHECKING:
    from dsec.sdk.sandbox import AsyncSandbox

__all__ = [
    "DEFAULT_SESSION_ROOT",
    "NO_TIMEOUT_S",
    "ShellOutput",
    "ShellSession",
    "Terminal",
]

DEFAULT_SESSION_ROOT = "/tmp/.dsec-sessions"
"""Where session directories are made in the sandbox (hidden: ``rm -rf /tmp/*`` spares it)."""

NO_TIMEOUT_S = 23 * 3600.0
"""The wait used for "no timeout", seconds (an exec lives at most 24 hours)."""

OUTPUT_CAP_BYTES = 32 << 20
"""Most output one call returns, bytes; the rest of a finished command's output is
dropped with a note."""

_GRACE_S = 15.0  # the helper stops itself at its deadline; the exec may take this longer
_START_TIMEOUT_S = 60.0

Terminal = Literal["auto", "on", "off"]
"""``on``: a pseudo-terminal (needs ``script``); ``off``: pipes; ``auto``: a terminal when
the image has ``script``."""

Status = Literal["done", "matched", "timeout", "exited", "syntax", "idle"]


@dataclass
class ShellOutput:
    """What one call saw.

    ``status``: ``done`` (the command ended: ``exit_code``), ``matched`` (an expected
    pattern appeared first: ``matched`` is its index; ``exit_code`` is set if the command
    also ended), ``timeout`` (nothing is consumed: the next call returns that output),
    ``exited`` (the session's shell is gone), ``syntax`` (``bash -n`` refused the command:
    nothing ran; ``output`` is its stderr, ``syntax_stdout`` its stdout), ``idle``
    (nothing was running; ``output`` is what arrived since the last call).

    ``output``: text decoded as UTF-8; undecodable bytes are kept as surrogate escapes
    (:func:`printable` turns them into ``\\xNN``). No terminal clean-up is done here.
    """

    status: Status
    output: str = ""
    exit_code: int | None = None
    matched: int | None = None
    syntax_stdout: str = ""


def printable(text: str) -> str:
    """``text`` with surrogate escapes (undecodable bytes) shown as ``\\xNN``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class _Step:
    status: str
    rc: int | None
    marker_pos: int | None
    size: int | None
    data: bytes = b""
    extra: bytes = b""


@dataclass
class _State:
    offset: int = 0  # bytes of `out` consumed
    known: int = 0  # size of `out` when last seen
    running: str | None = None  # id of the command the shell is running
    pending: str = ""  # consumed but not yet returned (text after a match, before an end)
    dead: bool = False
    closed: bool = False
    terminal: str = ""


_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class ShellSession:
    """One persistent bash in ``sandbox`` (see the module docstring).

    Calls on one session must not overlap (the harness adapters hold a lock); sessions
    are independent of each other. Times are seconds.
    """

    def __init__(
        self,
        sandbox: AsyncSandbox,
        name: str = "default",
        *,
        root: str = DEFAULT_SESSION_ROOT,
        terminal: Terminal = "auto",
        output_cap: int = OUTPUT_CAP_BYTES,
    ) -> None:
        self._sb = sandbox
        self.name = name
        self._dir = f"{root.rstrip('/')}/{_SAFE.sub('_', name)[:64]}-{secrets.token_hex(4)}"
        self._script = f"{self._dir}/session.sh"
        self._want = terminal
        self._cap = output_cap
        self._st = _State()

    @property
    def directory(self) -> str:
        """The session's directory in the sandbox."""
        return self._dir

    @property
    def terminal(self) -> str:
        """``pty`` or ``pipe`` once started, else ``""``."""
        return self._st.terminal

    @property
    def running(self) -> bool:
        """True while a command given to the shell has not ended (after a timeout, or an
        interactive program that is still running)."""
        return self._st.running is not None

    @property
    def alive(self) -> bool:
        """False once the shell was seen gone, or the session closed."""
        return not self._st.dead

    async def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Write the helper script and launch the shell. Raises ``Unsupported`` when the
        image has no bash, ``SandboxError`` when the shell does not come up."""
        text = resources.files("dsec.integrations").joinpath("session.sh").read_bytes()
        await self._sb.files.write(self._script, text, mode=0o700)
        r = await self._sb.commands.run(
            ["bash", self._script, "start", self._dir, self._want], timeout=timeout
        )
        if r.exit_code in (126, 127) and r.stderr.startswith("dsec: bash:"):
            raise Unsupported(
                "persistent shell sessions need bash in the sandbox's image "
                f"(image {self._sb.info.image!r} has none)",
                image=self._sb.info.image,
            )
        head = r.stdout.split("\n", 1)[0].split()
        if len(head) < 3 or head[:2] != ["DSEC", "started"]:
            raise SandboxError(
                f"the session shell did not start: {(r.stderr or r.stdout).strip()[:2000]}",
                session=self.name,
            )
        self._st.terminal = head[2]

    async def run(
        self, command: str, *, timeout: float | None, expect: Sequence[str] = ()
    ) -> ShellOutput:
        """Give ``command`` (any bash text: several lines, heredocs) to the idle shell and
        wait for its end, or for one of the ``expect`` regular expressions to appear in
        its output, or ``timeout`` (None: no limit). Raises ``RuntimeError`` while a
        command is running (use :meth:`send`, :meth:`wait` or :meth:`interrupt`)."""
        if self._st.running is not None:
            raise RuntimeError(f"session {self.name!r} is still running a command")
        self._check_alive()
        self._st.running = secrets.token_hex(8)
        data = command.encode("utf-8", "surrogateescape")
        return await self._await("run", data, timeout, expect)

    async def send(
        self, text: str, *, timeout: float | None, expect: Sequence[str] = ()
    ) -> ShellOutput:
        """Type ``text`` into the terminal of the running command (an interactive program
        reads it) and wait as :meth:`run` does. Idle shell: ``RuntimeError``."""
        if self._st.running is None:
            raise RuntimeError(f"session {self.name!r} is not running a command")
        self._check_alive()
        return await self._await("input", text.encode("utf-8", "surrogateescape"), timeout, expect)

    async def wait(self, *, timeout: float | None, expect: Sequence[str] = ()) -> ShellOutput:
        """Wait for the running command as :meth:`run` does (idle: returns ``idle`` with
        the output that arrived since the last call)."""
        self._check_alive()
        if self._st.running is None:
            return await self._idle()
        return await self._await("wait", None, timeout, expect)

    async def interrupt(self, *, timeout: float, expect: Sequence[str] = ()) -> ShellOutput:
        """SIGINT to the shell's foreground work (Ctrl-C), then wait up to ``timeout``."""
        self._check_alive()
        if self._st.running is None:
            return await self._idle()
        return await self._await("intr", None, timeout, expect)

    async def kill(self, *, timeout: float) -> ShellOutput:
        """SIGKILL every process of the shell's process group but the shell itself (the
        running command and the session's background jobs), then wait up to ``timeout``."""
        self._check_alive()
        if self._st.running is None:
            return await self._idle()
        return await self._await("kill", None, timeout, ())

    async def close(self) -> None:
        """Kill the shell and everything in its process group; remove its directory."""
        if self._st.terminal and not self._st.closed:
            self._st.dead = self._st.closed = True
            try:
                await self._helper("close", "-", 10.0, poll=False, stdin=None)
            except (SandboxNotFound, SandboxStopped):
                pass

    # -- internals ---------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self._st.terminal:
            raise RuntimeError(f"session {self.name!r} was not started")
        if self._st.dead:
            raise RuntimeError(f"session {self.name!r} has exited or was closed")

    async def _idle(self) -> ShellOutput:
        step = await self._helper("wait", "-", 0.0, poll=False, stdin=None)
        text = self._st.pending + step.data.decode("utf-8", "surrogateescape")
        self._st.pending = ""
        self._st.offset += len(step.data)
        return ShellOutput("exited" if step.status == "dead" else "idle", text)

    async def _await(
        self, mode: str, stdin: bytes | None, timeout: float | None, expect: Sequence[str]
    ) -> ShellOutput:
        patterns = [re.compile(p, re.DOTALL) for p in expect]
        limit = NO_TIMEOUT_S if timeout is None else max(0.0, float(timeout))
        deadline = time.monotonic() + limit
        first = True
        while True:
            left = limit if first else max(0.0, deadline - time.monotonic())
            assert self._st.running is not None
            step = await self._helper(
                mode if first else "wait",
                self._st.running,
                left,
                poll=bool(patterns),
                stdin=stdin if first else None,
            )
            first = False
            if step.status == "syntax":
                self._st.running = None
                return ShellOutput(
                    "syntax",
                    step.extra.decode("utf-8", "surrogateescape"),
                    exit_code=step.rc,
                    syntax_stdout=step.data.decode("utf-8", "surrogateescape"),
                )
            if step.status == "timeout":
                return ShellOutput("timeout")
            if step.status == "done":
                await self._locate_marker(step)
            found = self._take(step, patterns)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                return ShellOutput("timeout")

    async def _locate_marker(self, step: _Step) -> None:
        """Set ``step.marker_pos``: where the running command's end marker is in the output
        (searched in the returned bytes; asked of the helper when they were cut at the cap).
        None when the command's output never reached the terminal (``exec >file``)."""
        assert self._st.running is not None
        marker = b"\x1e" + self._st.running.encode() + b"\x1f"
        pos = step.data.find(marker)
        if pos >= 0:
            step.marker_pos = pos
        elif len(step.data) >= self._cap:
            found = await self._helper("find", self._st.running, 10.0, poll=False, stdin=None)
            step.marker_pos = found.marker_pos

    def _take(self, step: _Step, patterns: list[re.Pattern[str]]) -> ShellOutput | None:
        """Consume what ``step`` returned; None: nothing to return yet (keep waiting)."""
        st = self._st
        if step.size is not None:
            st.known = step.size
        ended = step.status == "done"
        assert st.running is not None
        marker = b"\x1e" + st.running.encode() + b"\x1f"
        if ended and step.marker_pos is not None:
            body = step.data[: step.marker_pos]
            skip = step.marker_pos + len(marker)  # bytes up to and including the end marker
        else:
            body = step.data
            skip = len(step.data)
        # bash names the sourced file in its messages: say "bash" as `bash -c` would
        text = body.decode("utf-8", "surrogateescape").replace(f"{self._dir}/cmd: ", "bash: ")
        match = None
        for i, pattern in enumerate(patterns):
            m = pattern.search(text)
            if m is not None and (match is None or m.start() < match[1].start()):
                match = (i, m)
        if step.status == "dead":
            st.dead = True
            st.running = None
            out, st.pending = st.pending + text, ""
            st.offset += len(step.data)
            return ShellOutput("exited", out)
        if match is not None:
            i, m = match
            out = st.pending + text[: m.start()]
            if ended:
                st.offset += skip
                st.pending = text[m.end() :]
                st.running = None
                return ShellOutput("matched", out, exit_code=step.rc, matched=i)
            st.offset += len(text[: m.end()].encode("utf-8", "surrogateescape"))
            st.pending = ""
            return ShellOutput("matched", out, matched=i)
        if not ended:
            return None
        out, st.pending = st.pending + text, ""
        if step.marker_pos is not None and step.marker_pos > len(step.data):
            out += f"\n[dsec: output truncated: {step.marker_pos - len(step.data)} more bytes]\n"
        st.offset += skip
        st.running = None
        return ShellOutput("done", out, exit_code=step.rc)

    async def _helper(
        self, mode: str, cid: str, timeout: float, *, poll: bool, stdin: bytes | None
    ) -> _Step:
        st = self._st
        argv = [
            "bash",
            self._script,
            "wait",
            self._dir,
            mode,
            cid,
            str(int(timeout * 1000)),
            str(st.offset),
            str(st.known),
            "1" if poll else "0",
            str(self._cap),
        ]
        r = await self._sb.commands.run(
            argv,
            stdin=stdin,
            timeout=timeout + _GRACE_S,
            cwd="/",
            max_output_bytes=(self._cap // 3 + 1) * 4 + (self._cap >> 4) + 4096,
        )
        if r.timed_out:
            return _Step("timeout", None, None, None)
        head, _, rest = r.stdout.partition("\n")
        fields = head.split()
        if len(fields) != 5 or fields[0] != "DSEC":
            raise SandboxError(
                f"session {self.name!r}: its helper failed (exit {r.exit_code}): "
                f"{(r.stderr or r.stdout).strip()[:2000]}",
                session=self.name,
            )
        _, status, rc, pos, size = fields
        step = _Step(
            status,
            int(rc) if rc.lstrip("-").isdigit() else None,
            int(pos) if pos.isdigit() else None,
            int(size) if size.isdigit() else None,
        )
        try:
            if status == "syntax":
                out_b64, _, err_b64 = rest.partition("DSEC-SEP\n")
                step.data = base64.b64decode(out_b64)
                step.extra = base64.b64decode(err_b64)
            elif rest:
                step.data = base64.b64decode(rest)
        except binascii.Error as exc:
            raise SandboxError(f"session {self.name!r}: garbled helper output: {exc}") from exc
        if status == "dead":
            st.dead = True
        return step
