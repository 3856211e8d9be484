"""Job groups: apply one action to every sandbox of a job, in parallel, and report each outcome.

A *job* is the ``job`` label given at creation (``Sandbox.create(..., job="run-42")``), typically
one training run. On trainer preemption the whole job is paused in one call, and resumed or
killed later. The edge lists the job's sandboxes and hands them to :func:`for_each_sandbox`
with its own per-sandbox coroutine (``pause_sandbox``, ``resume_sandbox``, ``kill_sandbox``...)::

    listed = await edge.list_sandboxes(ListSandboxesRequest(job="run-42"), owner)
    ids = [s.id for s in listed.sandboxes]
    outcomes = await for_each_sandbox(
        ids, lambda sid: edge.pause_sandbox(PauseRequest(sandbox_id=sid), owner)
    )
    # {"sb-n1-ab12": {"ok": True, "state": "paused", "error": None},
    #  "sb-n1-cd34": {"ok": False, "state": None,
    #                 "error": {"code": "sandbox_stopped", "message": ..., "details": {...}}}}

One failing sandbox never stops the others. Errors are reported in their wire form
(:meth:`dsec.errors.DsecError.to_wire`); an unexpected exception becomes ``internal`` and a
per-sandbox timeout ``timeout``. Cancelling the caller cancels every action still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypedDict

from dsec.errors import DsecError, InternalError, InvalidRequest, SandboxTimeout
from dsec.models import BatchCreateResult, BatchItemError, SandboxInfo

__all__ = ["DEFAULT_CONCURRENCY", "Outcome", "create_batch", "for_each_sandbox", "summarize"]

log = logging.getLogger("dsec.edge.jobs")

DEFAULT_CONCURRENCY = 64
"""Actions run at once per job call; pause/resume are ~ms each, so 64 keeps a 2-core node busy
without queueing thousands of threads."""


class Outcome(TypedDict):
    """One sandbox's result: ``ok``; its ``state`` after the action (None if unknown); the
    wire error body (``{"code", "message", "details"}``) when not ok."""

    ok: bool
    state: str | None
    error: dict[str, Any] | None


def _state_of(result: Any) -> str | None:
    if isinstance(result, dict):
        state = result.get("state")
    else:
        state = getattr(result, "state", None)
    return state if isinstance(state, str) else None


async def for_each_sandbox(
    sandbox_ids: Iterable[str],
    action: Callable[[str], Awaitable[Any]],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout_s: float | None = None,
) -> dict[str, Outcome]:
    """Run ``action(sandbox_id)`` for every id, at most ``concurrency`` at once.

    Args:
        sandbox_ids: the job's sandboxes (duplicates are acted on once).
        action: a coroutine function; its result's ``state`` (attribute or dict key), if
            any, is reported.
        concurrency: at most this many actions in flight (>= 1).
        timeout_s: per-sandbox time limit, seconds (None: no limit).

    Returns:
        ``{sandbox_id: Outcome}`` in the order the ids were given.

    Raises:
        InvalidRequest: ``concurrency`` < 1 or ``timeout_s`` <= 0.
    """
    if concurrency < 1:
        raise InvalidRequest(f"concurrency must be >= 1, not {concurrency}")
    if timeout_s is not None and timeout_s <= 0:
        raise InvalidRequest(f"timeout_s must be > 0, not {timeout_s}")
    ids = list(dict.fromkeys(sandbox_ids))
    gate = asyncio.Semaphore(concurrency)

    async def one(sid: str) -> Outcome:
        async with gate:
            try:
                if timeout_s is None:
                    result = await action(sid)
                else:
                    result = await asyncio.wait_for(action(sid), timeout_s)
            except DsecError as e:
                return {"ok": False, "state": None, "error": e.to_wire()["error"]}
            except TimeoutError:
                err = SandboxTimeout(
                    f"sandbox {sid} did not finish within {timeout_s} s",
                    sandbox_id=sid,
                    timeout_s=timeout_s,
                )
                return {"ok": False, "state": None, "error": err.to_wire()["error"]}
            except Exception as e:  # one broken sandbox must not sink the job call
                log.exception("job action on %s failed", sid)
                err2 = InternalError(f"{type(e).__name__}: {e}", sandbox_id=sid)
                return {"ok": False, "state": None, "error": err2.to_wire()["error"]}
            return {"ok": True, "state": _state_of(result), "error": None}

    results = await asyncio.gather(*(one(sid) for sid in ids))
    return dict(zip(ids, results, strict=True))


def summarize(outcomes: dict[str, Outcome]) -> dict[str, int]:
    """Counts for a reply or a log line: ``total``, ``ok``, ``failed`` and ``by_code``-style
    keys ``error:<code>``."""
    out = {"total": len(outcomes), "ok": 0, "failed": 0}
    for o in outcomes.values():
        if o["ok"]:
            out["ok"] += 1
        else:
            out["failed"] += 1
            code = (o["error"] or {}).get("code", "unknown")
            out[f"error:{code}"] = out.get(f"error:{code}", 0) + 1
    return out


async def create_batch(
    n: int,
    create: Callable[[int], Awaitable[SandboxInfo]],
    kill: Callable[[str], Awaitable[Any]],
    *,
    all_or_nothing: bool = False,
    concurrency: int = 8,
) -> BatchCreateResult:
    """Create ``n`` sandboxes with ``create(index)``, at most ``concurrency`` at once.

    Each failure is reported by index (its wire code and message); the others go on. With
    ``all_or_nothing``, the first failure stops the batch: creations not yet started are
    skipped, the sandboxes already made are killed with ``kill(id)`` and the failure is raised
    (its own :class:`DsecError` type), so nothing is left half-created.

    Returns:
        ``BatchCreateResult`` whose ``sandboxes`` are in index order.
    """
    if n < 1 or concurrency < 1:
        raise InvalidRequest(f"a batch needs n >= 1 and concurrency >= 1 (got {n}, {concurrency})")
    gate = asyncio.Semaphore(concurrency)
    made: dict[int, SandboxInfo] = {}
    errors: dict[int, BatchItemError] = {}
    first_failure: list[DsecError] = []

    async def one(i: int) -> None:
        async with gate:
            if all_or_nothing and first_failure:
                return
            try:
                made[i] = await create(i)
            except DsecError as e:
                errors[i] = BatchItemError(index=i, code=e.code, message=e.message)
                first_failure.append(e)
            except Exception as e:  # one broken creation must not sink the batch call
                log.exception("batch creation %d failed", i)
                err = InternalError(f"{type(e).__name__}: {e}")
                errors[i] = BatchItemError(index=i, code=err.code, message=err.message)
                first_failure.append(err)

    await asyncio.gather(*(one(i) for i in range(n)))
    if all_or_nothing and first_failure:
        outcomes = await for_each_sandbox([s.id for s in made.values()], kill)
        leaked = [sid for sid, o in outcomes.items() if not o["ok"]]
        cause = first_failure[0]
        details = dict(cause.details)
        details.update(batch_size=n, created_then_killed=len(made) - len(leaked))
        if leaked:
            details["kill_failed"] = leaked
        raise type(cause)(
            f"batch of {n} failed (all_or_nothing): {cause.message}; "
            f"{len(made)} sandbox(es) already created were killed",
            **details,
        )
    return BatchCreateResult(
        requested=n,
        sandboxes=[made[i] for i in sorted(made)],
        errors=[errors[i] for i in sorted(errors)],
    )
