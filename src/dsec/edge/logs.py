"""A sandbox's logs: what its image's start command writes, kept by the edge.

The start command (:class:`~dsec.images.config.StartCommand`) runs once per sandbox,
from its creation, with stdin ``/dev/null``. Its stdout and stderr go to a
:class:`SandboxLogs`: a bounded buffer of :class:`~dsec.models.LogLine` chunks in arrival
order (the oldest dropped first once ``max_bytes`` is passed), which readers page through
or follow (``GET /v1/sandboxes/{id}/logs?follow=true``). When the command ends, one line
on the ``dsec`` stream says how; a following reader then ends. The buffer lives as long
as the sandbox does on its node: logs are not kept after the sandbox is gone.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import time
from collections import deque
from collections.abc import AsyncIterator

from dsec.models import LogLine

__all__ = ["DEFAULT_LOG_BYTES", "SandboxLogs"]

DEFAULT_LOG_BYTES = 1 << 20
"""Bytes of log text kept per sandbox (``DSEC_LOG_BYTES``)."""


def log_bytes_from_env() -> int:
    """``DSEC_LOG_BYTES`` (>= 4096), else :data:`DEFAULT_LOG_BYTES`."""
    raw = os.environ.get("DSEC_LOG_BYTES")
    if not raw:
        return DEFAULT_LOG_BYTES
    try:
        value = int(raw)
    except ValueError as e:
        raise SystemExit(f"DSEC_LOG_BYTES must be an integer, not {raw!r}") from e
    return max(4096, value)


class SandboxLogs:
    """The bounded, followable output of one sandbox's start command."""

    def __init__(self, max_bytes: int = DEFAULT_LOG_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lines: deque[tuple[int, LogLine]] = deque()  # (sequence number, line)
        self._next = 0
        self._bytes = 0
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")
        }
        self._changed = asyncio.Event()
        self.closed = False
        self.end_note: str | None = None
        """How the command ended (the ``dsec`` line of :meth:`close`), None while it runs."""
        self.dropped = 0
        """Lines dropped to stay under ``max_bytes``."""

    def write(self, stream: str, data: bytes) -> None:
        """Add a chunk of ``stream`` (``stdout`` or ``stderr``) output."""
        decoder = self._decoders.get(stream)
        text = decoder.decode(data) if decoder is not None else data.decode("utf-8", "replace")
        if text:
            self._add(LogLine(ts=time.time(), stream=stream, data=text))

    def close(self, note: str) -> None:
        """The command ended: flush partial characters, add ``note`` on the ``dsec`` stream,
        and end every follower. Idempotent."""
        if self.closed:
            return
        for stream, decoder in self._decoders.items():
            tail = decoder.decode(b"", final=True)
            if tail:
                self._add(LogLine(ts=time.time(), stream=stream, data=tail))
        self._add(LogLine(ts=time.time(), stream="dsec", data=note))
        self.closed = True
        self.end_note = note
        self._changed.set()

    def reopen(self, note: str) -> None:
        """The command runs again (a desktop restart): add ``note`` on the ``dsec`` stream
        and take output again; earlier lines stay."""
        self._add(LogLine(ts=time.time(), stream="dsec", data=note))
        self.closed = False
        self.end_note = None
        self._changed.set()

    def _add(self, line: LogLine) -> None:
        size = len(line.data)
        if size > self.max_bytes:  # one huge chunk: keep its end
            line = line.model_copy(update={"data": line.data[-self.max_bytes :]})
            size = self.max_bytes
        self._lines.append((self._next, line))
        self._next += 1
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._lines) > 1:
            _, old = self._lines.popleft()
            self._bytes -= len(old.data)
            self.dropped += 1
        self._changed.set()

    def tail(self, max_chars: int) -> str:
        """The last ``max_chars`` characters of output (both streams, as they came)."""
        out: list[str] = []
        n = 0
        for _, line in reversed(self._lines):
            if line.stream == "dsec":
                continue
            out.append(line.data)
            n += len(line.data)
            if n >= max_chars:
                break
        return "".join(reversed(out))[-max_chars:]

    async def read(self, *, follow: bool = False) -> AsyncIterator[LogLine]:
        """The lines kept now, in order; with ``follow``, then every new line until the
        command has ended (lines dropped while a slow reader waited are skipped)."""
        seen = -1
        while True:
            batch = [line for n, line in self._lines if n > seen]
            if self._lines:
                seen = self._lines[-1][0]
            for line in batch:
                yield line
            if not follow:
                return
            self._changed.clear()
            if self._lines and self._lines[-1][0] != seen:
                continue  # something arrived while the batch was being read
            if self.closed:
                return
            await self._changed.wait()
