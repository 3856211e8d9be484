"""The streams a sandbox's runtime hands up through the edge: a process's output and its
terminal, a watched directory's events, a TCP connection into the sandbox. Runtimes
implement them; the edge and the apiserver consume them (contract: no implementation here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from dsec.models import ExecResult

__all__ = [
    "DirectoryWatcher",
    "FileEvent",
    "FileEventKind",
    "InteractiveProcess",
    "OutputChunk",
    "PortStream",
    "PtySize",
    "StreamName",
]


StreamName = Literal["stdout", "stderr", "pty"]
OutputChunk = tuple[StreamName, bytes]
"""One piece of output: which stream (``pty`` when the process has a terminal) and its bytes."""


@dataclass(frozen=True)
class PtySize:
    """Terminal size in character cells."""

    cols: int
    rows: int


@runtime_checkable
class InteractiveProcess(Protocol):
    """One process running in a sandbox, started by :meth:`dsec.contract.edge.InteractiveExec.start_process`.

    Life cycle: output is read with :meth:`read_output` until it returns ``None``
    (every output stream closed), then :meth:`wait` returns the result. Calls after
    the process exited are harmless no-ops (``signal``) or raise
    ``SandboxStopped``-free ``Conflict`` errors (``write_stdin``).
    """

    async def read_output(self) -> OutputChunk | None:
        """The next chunk of output, or ``None`` once all output streams are closed."""
        ...

    async def write_stdin(self, data: bytes) -> None:
        """Write ``data`` to the process's stdin (or terminal input when it has a PTY)."""
        ...

    async def close_stdin(self) -> None:
        """Close stdin so the process reads EOF. Idempotent."""
        ...

    async def signal(self, signum: int) -> None:
        """Send signal ``signum`` (e.g. ``signal.SIGKILL``) to the process. No-op once exited."""
        ...

    async def resize(self, size: PtySize) -> None:
        """Resize the process's terminal; ``CapabilityNotSupported`` without a PTY."""
        ...

    async def wait(self) -> ExecResult:
        """Wait for exit; ``stdout``/``stderr`` of the result are empty (they were streamed)."""
        ...


FileEventKind = Literal["create", "write", "remove", "rename", "chmod"]


@dataclass(frozen=True)
class FileEvent:
    """One change below a watched directory: ``path`` (absolute, in the sandbox) and what
    happened to it (the kinds of E2B's ``watch_dir``)."""

    path: str
    kind: FileEventKind


@runtime_checkable
class DirectoryWatcher(Protocol):
    """The changes below one directory, as they happen (:meth:`dsec.contract.edge.DirectoryWatch.watch_directory`)."""

    async def events(self, timeout_s: float) -> list[FileEvent]:
        """Events since the last call, waiting up to ``timeout_s`` seconds for the first
        (``[]`` if none came). Once the watch has ended (the directory was removed:
        ``FileNotFound``; the sandbox stopped: ``SandboxStopped``) and its last events
        were returned, it raises that."""
        ...

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        ...


@runtime_checkable
class PortStream(Protocol):
    """One TCP connection to a port inside a sandbox, opened by
    :meth:`dsec.contract.edge.PortForwarding.open_port`: bytes in both directions, like a socket.

    ``read`` returns ``b""`` once the sandbox side has closed its half (EOF); ``write``
    waits while the connection's buffers are full (backpressure); ``write_eof`` closes
    this side's half (the server reads EOF); ``close`` ends the connection and releases
    everything it holds (idempotent; also when the sandbox is killed meanwhile)."""

    async def read(self, max_bytes: int = 65536) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def write_eof(self) -> None: ...
    async def close(self) -> None: ...
