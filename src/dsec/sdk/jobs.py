"""Job groups: pause, resume, kill or list every sandbox of a training job in one call.

A job is the ``job`` given at creation (``Sandbox.create(..., job="run-42")``). The edge
applies the action to all of the job's sandboxes in parallel and reports each outcome; one
failing sandbox never stops the others, and the call succeeds even if some failed (check
``result.ok`` and ``result.outcomes``).

Sync, module level (what a preemption handler calls)::

    from dsec import jobs

    result = jobs.pause("run-42")          # JobActionResult
    if not result.ok:
        print({sid: o.error for sid, o in result.outcomes.items() if not o.ok})
    jobs.resume("run-42")                  # (any request also resumes a sandbox)
    for info in jobs.list("run-42"):
        print(info.id, info.state, info.paused_at)
    jobs.kill("run-42")
    report = jobs.audit("run-42")          # JobAudit: which sandboxes tried what
    print(report.flagged)                  # ids of the sandboxes with evidence of cheating

The functions take ``url=``, ``api_key=`` (default ``$DSEC_URL``, ``$DSEC_API_KEY``) and
``transport=``, like :class:`dsec.Client`. Async, or to reuse a connection pool::

    from dsec.jobs import AsyncJobs

    async with AsyncJobs() as jobs_api:     # or AsyncJobs(client=an_async_client)
        await jobs_api.pause("run-42")

:class:`Jobs` is the sync class generated from :class:`AsyncJobs`; ``client.jobs`` on an
:class:`~dsec.AsyncClient` (or :class:`~dsec.Client`) returns one bound to that client.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from dsec.errors import InvalidRequest
from dsec.models import JobAction, JobActionRequest, JobActionResult, JobAudit, JobRef, SandboxInfo
from dsec.sdk.client import AsyncClient
from dsec.sdk.sync import runner
from dsec.wire import ANSWER

__all__ = ["JOB_TIMEOUT_S", "AsyncJobs", "audit", "kill", "list", "pause", "resume"]

JOB_TIMEOUT_S = 600.0
"""Default wait for a job action, seconds (a job may have thousands of sandboxes)."""

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_SANDBOXES = TypeAdapter(builtins.list[SandboxInfo])

T = TypeVar("T")


def _check_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB.match(job):
        raise InvalidRequest(
            f"not a job id: {job!r} (letters, digits and ._:- , at most 128)", job=str(job)
        )
    return job


class AsyncJobs:
    """The job API of one server (async). See the module docstring.

    Args:
        client: a shared :class:`~dsec.AsyncClient` (its connection pool is reused and it is
            not closed by :meth:`close`).
        url, api_key, transport: connection, when no ``client`` is given.
        timeout: default wait per job action, seconds.
    """

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = JOB_TIMEOUT_S,
    ) -> None:
        self._owns_client = client is None
        self._client = (
            client if client is not None else AsyncClient(url, api_key, transport=transport)
        )
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self._client.url!r})"

    async def _act(self, job: str, action: JobAction, timeout: float | None) -> JobActionResult:
        req = JobActionRequest(job=_check_job(job), action=action)
        t = self.timeout if timeout is None else timeout
        result: JobActionResult = await self._client._http.call("job_action", req, timeout=t)
        return result

    async def pause(self, job: str, *, timeout: float | None = None) -> JobActionResult:
        """Pause every sandbox of ``job`` (freeze, reclaim memory); per-sandbox outcomes."""
        return await self._act(job, "pause", timeout)

    async def resume(self, job: str, *, timeout: float | None = None) -> JobActionResult:
        """Resume every paused sandbox of ``job``; per-sandbox outcomes."""
        return await self._act(job, "resume", timeout)

    async def kill(self, job: str, *, timeout: float | None = None) -> JobActionResult:
        """Kill every sandbox of ``job``; per-sandbox outcomes."""
        return await self._act(job, "kill", timeout)

    async def list(self, job: str, *, include_stopped: bool = False) -> builtins.list[SandboxInfo]:
        """The sandboxes of ``job`` (running and paused; ``include_stopped`` for all)."""
        params = {"include_stopped": "true"} if include_stopped else None
        r = await self._client._http.request(
            "GET", f"/v1/jobs/{quote(_check_job(job), safe=':')}", params=params
        )
        return _SANDBOXES.validate_python(r.json()["sandboxes"], context=ANSWER)

    async def audit(self, job: str, *, timeout: float | None = None) -> JobAudit:
        """Which sandboxes of ``job`` tried what: each one's audit summary (exact counts by
        ``category.kind``, ``evidence``); ``result.flagged`` lists those with evidence.
        Stopped sandboxes are included while their nodes remember them."""
        t = self.timeout if timeout is None else timeout
        req = JobRef(job=_check_job(job))
        audit: JobAudit = await self._client._http.call("job_audit", req, timeout=t)
        return audit

    async def close(self) -> None:
        """Close pooled connections if this object opened them."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> AsyncJobs:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def _once(
    call: Callable[[AsyncJobs], Awaitable[T]],
    url: str | None,
    api_key: str | None,
    transport: httpx.AsyncBaseTransport | None,
) -> T:
    async def go() -> T:
        async with AsyncJobs(url=url, api_key=api_key, transport=transport) as api:
            return await call(api)

    return runner.run(go())


def pause(
    job: str,
    *,
    url: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> JobActionResult:
    """Pause every sandbox of ``job`` (sync). See the module docstring."""
    return _once(lambda api: api.pause(job), url, api_key, transport)


def resume(
    job: str,
    *,
    url: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> JobActionResult:
    """Resume every sandbox of ``job`` (sync)."""
    return _once(lambda api: api.resume(job), url, api_key, transport)


def kill(
    job: str,
    *,
    url: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> JobActionResult:
    """Kill every sandbox of ``job`` (sync)."""
    return _once(lambda api: api.kill(job), url, api_key, transport)


def audit(
    job: str,
    *,
    url: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> JobAudit:
    """Which sandboxes of ``job`` tried what (sync): see :meth:`AsyncJobs.audit`."""
    return _once(lambda api: api.audit(job), url, api_key, transport)


def list(
    job: str,
    *,
    include_stopped: bool = False,
    url: str | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> builtins.list[SandboxInfo]:
    """The sandboxes of ``job`` (sync)."""
    return _once(
        lambda api: api.list(job, include_stopped=include_stopped), url, api_key, transport
    )


def __getattr__(name: str) -> Any:
    if name == "Jobs":  # the sync class lives with the other generated ones
        from dsec.sdk.sync_api import Jobs

        return Jobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
