"""What a key's image builds did: ``GET /v1/builds`` and ``GET /v1/builds/{id}``.

A build's events stream to the caller that asked for it (``POST /v1/builds``, ``dsec image
build``, ``Image.build``, E2B's template builds); :class:`BuildRecords` keeps, per owner,
a record of each build as its events pass: state, the step it is on, cache hits, the
image it made or the error that stopped it, and its log (step headers and output), so
the dashboard, ``dsec image builds`` or a second client can look at a build later or
while it runs.

Bounds (nothing grows with the number of builds): :data:`MAX_BUILDS_PER_OWNER` records per
owner (the oldest finished ones go first), :data:`MAX_LOG_BYTES` of log per build (the
oldest lines dropped, and the record says so). The records live in the process that runs
the build's edge (a node's ``dsec serve``; in cluster mode the node's edge actor that ran
it, which every apiserver replica asks) and are gone when it restarts: the images a build
made are what lasts.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from dsec.builds.wire import (
    BuildDone,
    BuildError,
    BuildStarted,
    StepCached,
    StepDone,
    StepOutput,
    StepStarted,
)
from dsec.errors import DsecError, NotFound
from dsec.wire import WireModel

__all__ = [
    "MAX_BUILDS_PER_OWNER",
    "MAX_LOG_BYTES",
    "BuildList",
    "BuildRecord",
    "BuildRecords",
]

MAX_BUILDS_PER_OWNER = 100
"""Build records kept per owner; past it the oldest finished build is forgotten."""
MAX_LOG_BYTES = 256 << 10
"""Log kept per build record (UTF-8 bytes); past it the oldest lines are dropped."""

BuildState = Literal["building", "done", "failed", "cancelled"]


class BuildRecord(WireModel):
    """One build of a key's image. ``state``: ``building`` while it runs, then ``done``
    (``image`` names what it stored), ``failed`` (``error``: the ``{"code", "message",
    "details"}`` of its error event) or ``cancelled`` (its caller went away before the end).
    Times are Unix seconds; ``log`` (only in ``GET /v1/builds/{id}``) is the step headers
    and the steps' output, oldest first; ``log_dropped_bytes`` how much of its start was
    dropped to stay within the bound."""

    build_id: str
    name: str
    state: BuildState
    base: str = ""
    started_at: float
    ended_at: float | None = None
    steps: int = Field(0, description="steps of the build, the FROM included")
    step: int = Field(0, description="the step running now (or the last one that ran)")
    cached_steps: int = 0
    built_steps: int = 0
    duration_ms: float | None = None
    image: str | None = None
    error: dict[str, Any] | None = None
    notes: list[str] = Field(default_factory=list)
    log: list[str] | None = None
    log_dropped_bytes: int = 0


class BuildList(WireModel):
    """A key's build records, newest first (without their logs)."""

    builds: list[BuildRecord]


@dataclass
class _Record:
    """A build's record as it grows: its wire view (``info``, without the log) and the log."""

    info: BuildRecord
    log: collections.deque[str] = field(default_factory=collections.deque)
    log_bytes: int = 0

    def add_log(self, text: str) -> None:
        size = len(text.encode())
        self.log.append(text)
        self.log_bytes += size
        while self.log_bytes > MAX_LOG_BYTES and len(self.log) > 1:
            gone = len(self.log.popleft().encode())
            self.log_bytes -= gone
            self.info.log_dropped_bytes += gone

    def end(self, state: BuildState) -> None:
        self.info.state = state
        self.info.ended_at = time.time()

    def view(self, with_log: bool) -> BuildRecord:
        return self.info.model_copy(update={"log": list(self.log) if with_log else None}, deep=True)


class BuildRecords:
    """The build records of one edge (see the module docstring)."""

    def __init__(self, max_per_owner: int = MAX_BUILDS_PER_OWNER) -> None:
        self.max_per_owner = max_per_owner
        self._by_owner: dict[str, collections.OrderedDict[str, _Record]] = {}

    def list(self, owner: str) -> BuildList:
        """``owner``'s builds, newest first, without logs."""
        records = self._by_owner.get(owner)
        if records is None:
            return BuildList(builds=[])
        return BuildList(builds=[r.view(False) for r in reversed(records.values())])

    def get(self, build_id: str, owner: str) -> BuildRecord:
        """``owner``'s build ``build_id`` with its log; another owner's is not found."""
        records = self._by_owner.get(owner)
        record = records.get(build_id) if records is not None else None
        if record is None:
            raise NotFound(f"no build {build_id!r}", build_id=build_id)
        return record.view(True)

    def _start(self, owner: str, event: BuildStarted) -> _Record:
        records = self._by_owner.setdefault(owner, collections.OrderedDict())
        record = _Record(
            BuildRecord(
                build_id=event.build_id,
                name=event.name,
                state="building",
                started_at=time.time(),
                base=event.base,
                steps=event.steps,
                notes=list(event.notes),
            )
        )
        records[event.build_id] = record
        while len(records) > self.max_per_owner:
            finished = next((k for k, r in records.items() if r.info.state != "building"), None)
            records.pop(finished if finished is not None else next(iter(records)))
        return record

    async def record(self, owner: str, events: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        """Pass ``events`` (one build's) through, keeping its record. Refusals before the
        build started raise as they come and leave no record."""
        record: _Record | None = None
        try:
            async for event in events:
                if isinstance(event, BuildStarted):
                    record = self._start(owner, event)
                elif record is not None:
                    self._update(record, event)
                yield event
        except DsecError as e:  # e.g. the building node was lost
            if record is not None and record.info.state == "building":
                record.end("failed")
                record.info.error = e.to_wire()["error"]
            raise
        finally:
            if record is not None and record.info.state == "building":
                record.end("cancelled")
            if isinstance(events, AsyncGenerator):
                with contextlib.suppress(Exception):
                    await events.aclose()

    @staticmethod
    def _update(record: _Record, event: Any) -> None:
        info = record.info
        if isinstance(event, StepStarted):
            info.step = event.step
            line = f" (line {event.line})" if event.line else ""
            record.add_log(f"step {event.step}/{event.total}{line}: {event.instruction}\n")
        elif isinstance(event, StepCached):
            info.step = event.step
            record.add_log(f"step {event.step}: cached\n")
        elif isinstance(event, StepOutput):
            record.add_log(event.data)
        elif isinstance(event, StepDone):
            info.step = event.step
        elif isinstance(event, BuildDone):
            record.end("done")
            info.image = event.image.name
            info.cached_steps = event.cached_steps
            info.built_steps = event.built_steps
            info.duration_ms = event.duration_ms
        elif isinstance(event, BuildError):
            record.end("failed")
            assert info.ended_at is not None
            info.duration_ms = round((info.ended_at - info.started_at) * 1000, 1)
            info.error = event.to_wire_error()["error"]
            if event.step is not None:
                info.step = event.step
