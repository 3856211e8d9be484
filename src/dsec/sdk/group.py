"""Sandbox groups: one environment set up once and forked ``n`` ways (GRPO and its kin).

:meth:`dsec.AsyncSandbox.create_group` creates one sandbox, runs the set-up in it, forks it
``n`` ways and returns an :class:`AsyncSandboxGroup`: a list of the ``n`` sandboxes that is
also a job (pause, resume and kill them as one). On a tier whose capabilities say
``fork_shared`` (the container tier) the fork costs the same whatever the set-up wrote: the
children stack on the set-up sandbox's frozen writable layer, nothing is copied::

    from dsec import Sandbox

    with Sandbox.create_group(16, image="python", setup=["pip install -e /work"]) as group:
        results = [sb.commands.run("pytest -q") for sb in group]
    # every sandbox of the group is killed here

The set-up sandbox (the *parent*) is killed once the group exists unless ``keep_parent``
(its frozen layer lives on while a child stacks on it). In a cluster the group's sandboxes
are on the parent's node (a fork stays on its node).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import overload

from dsec.models import JobActionResult
from dsec.sdk.client import AsyncClient
from dsec.sdk.jobs import AsyncJobs
from dsec.sdk.sandbox import AsyncSandbox, AsyncSandboxBatch

__all__ = ["AsyncSandboxGroup"]


class AsyncSandboxGroup(AsyncSandboxBatch):
    """What :meth:`dsec.AsyncSandbox.create_group` made: ``n`` sandboxes forked from one
    set-up (list-like: ``len``, iteration, indexing), all of job :attr:`job`.
    ``async with`` kills them all on exit (the kept parent too); a group is all or nothing,
    so its batch ``errors`` are empty."""

    def __init__(
        self,
        job: str,
        sandboxes: builtins.list[AsyncSandbox],
        parent: AsyncSandbox | None,
        client: AsyncClient,
        owns_client: bool,
        *,
        method: str = "shared",
    ) -> None:
        super().__init__(len(sandboxes), sandboxes, [], client, owns_client)
        self._job = job
        self._parent = parent
        self._method = method

    def __repr__(self) -> str:
        return f"{type(self).__name__}(job={self._job!r}, n={len(self._sandboxes)})"

    @property
    def job(self) -> str:
        """The job id every sandbox of the group has (see :mod:`dsec.jobs`)."""
        return self._job

    @property
    def parent(self) -> AsyncSandbox | None:
        """The set-up sandbox, if kept (``keep_parent=True``); it is of the group's job."""
        return self._parent

    @property
    def method(self) -> str:
        """How the fork was made: ``shared`` (frozen layer) or ``pack`` (packed layer)."""
        return self._method

    def __len__(self) -> int:
        return len(self._sandboxes)

    def __iter__(self) -> Iterator[AsyncSandbox]:
        return iter(self._sandboxes)

    @overload
    def __getitem__(self, index: int) -> AsyncSandbox: ...
    @overload
    def __getitem__(self, index: slice) -> builtins.list[AsyncSandbox]: ...
    def __getitem__(self, index: int | slice) -> AsyncSandbox | builtins.list[AsyncSandbox]:
        return self._sandboxes[index]

    def _owned(self) -> builtins.list[AsyncSandbox]:
        return [*self._sandboxes, *([self._parent] if self._parent is not None else [])]

    async def pause(self) -> JobActionResult:
        """Pause every sandbox of the group's job (per-sandbox outcomes)."""
        return await AsyncJobs(self._client).pause(self._job)

    async def resume(self) -> JobActionResult:
        """Resume every paused sandbox of the group's job (per-sandbox outcomes)."""
        return await AsyncJobs(self._client).resume(self._job)

    async def kill(self) -> JobActionResult:
        """Kill every sandbox of the group's job (the parent too if kept; with a ``job`` of
        your own, its other sandboxes too: :meth:`kill_all` kills only the group's) and
        release this object's connections."""
        try:
            return await AsyncJobs(self._client).kill(self._job)
        finally:
            await self.close()
