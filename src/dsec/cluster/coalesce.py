"""Single creations coalesced: concurrent ``create`` requests at one apiserver replica go
to the edges as few actor calls.

A creation that finds fewer than ``max_in_flight`` coalesced calls under way is sent at
once (a lone create waits for nothing); the ones arriving while that many are in flight
queue, and the queue leaves as soon as one of them returns: whatever arrived meanwhile,
grouped by what the placer needs to know of a request (:class:`PlacementRequest`), one
placement decision per group and node (``Placer.place``, then a reservation per item on
the chosen node, at most ``max_group`` per call) and one ``EdgeActor.create_each`` call
per node. Each item keeps its own answer: a sandbox, or its own error.

An item the node refused (``QuotaExceeded``, its edge unavailable or the node lost before
the call was made), or whose call went unanswered because Ray reported the node dead
(``NodeRelay.settle``: what it made there died with it), is placed again through
``retry``, the one-by-one path, without that node. An unanswered call to a node that is
not known dead is not placed again (its edge may have made the sandbox): its items fail
with the retryable ``ServiceUnavailable``, as a single call's would.

Creations carry no idempotency key (the trajectory log's keys are per sandbox, for the
calls made on it), so none is merged: every item is one sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import (
    DsecError,
    InternalError,
    NodeLost,
    QuotaExceeded,
    ServiceUnavailable,
    error_from_wire,
)
from dsec.models import CreateSandboxRequest, SandboxInfo
from dsec.placement import PlacementRequest

__all__ = ["CreationCoalescer", "replaceable"]

log = logging.getLogger("dsec.cluster")


def replaceable(e: DsecError) -> bool:
    """Whether ``e`` from a node is a refusal that made nothing there: the edge answered
    ``QuotaExceeded`` or ``ServiceUnavailable``, or the node was lost before the call was
    sent. A call sent and never answered (``details["unreachable"]``) is not: see
    ``NodeRelay.settle``."""
    return isinstance(e, QuotaExceeded | NodeLost | ServiceUnavailable) and not e.details.get(
        "unreachable"
    )


@dataclass
class _Item:
    req: CreateSandboxRequest
    owner: str
    preq: PlacementRequest
    done: asyncio.Future[SandboxInfo] = field(repr=False)


class CreationCoalescer:
    """Coalesces single creations (see the module's docstring). Built by
    :class:`~dsec.cluster.edge.ClusterEdge`, which owns the relay and placement.

    Args:
        edge: the cluster edge (its ``relay``, ``placement``, ``options``).
        record: writes a new sandbox to the registry before it is answered.
        retry: the one-by-one creation path, ``retry(req, owner, exclude=nodes)``.
        max_in_flight: coalesced calls under way before arrivals queue.
        max_group: items in one call to one node.
    """

    def __init__(
        self,
        edge: Any,
        record: Callable[[str, SandboxInfo], Awaitable[None]],
        retry: Callable[..., Awaitable[SandboxInfo]],
        *,
        max_in_flight: int = 4,
        max_group: int = 64,
    ) -> None:
        self.edge = edge
        self.record = record
        self.retry = retry
        self.max_in_flight = max(1, max_in_flight)
        self.max_group = max(1, max_group)
        self.calls = 0  # coalesced calls sent (for tests and /metrics)
        self.items = 0  # items they carried
        self._queue: list[_Item] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def create(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        """Create one sandbox of ``req`` for ``owner``, coalesced with the creations
        arriving meanwhile."""
        preq = self.edge.placement.request(req)
        item = _Item(req, owner, preq, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._kick()
        return await item.done

    def _kick(self) -> None:
        while self._queue and self._in_flight < self.max_in_flight:
            batch, self._queue = self._queue, []
            self._in_flight += 1
            task = asyncio.create_task(self._flush(batch), name="dsec-coalesced-create")
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        self._kick()

    async def _flush(self, batch: list[_Item]) -> None:
        try:
            groups: dict[PlacementRequest, list[_Item]] = {}
            for item in batch:
                groups.setdefault(item.preq, []).append(item)
            sends: list[Awaitable[None]] = []
            for preq, items in groups.items():
                sends += self._place(preq, items)
            failures = await asyncio.gather(*sends, return_exceptions=True)
            failure = next((f for f in failures if isinstance(f, BaseException)), None)
        except BaseException as e:  # never leave a creation waiting for an answer
            failure = e
        for item in batch:
            if not item.done.done():
                log.error("coalesced creation left unanswered: %r", failure)
                item.done.set_exception(
                    InternalError(f"creation failed: {type(failure).__name__}: {failure}")
                )

    def _place(self, preq: PlacementRequest, items: list[_Item]) -> list[Awaitable[None]]:
        """One decision per node for ``items`` (all of ``preq``): as many as the chosen
        node admits (up to ``max_group``) reserved there; what is left is placed again.
        Items no decision fits take the one-by-one path (which raises the right error)."""
        sends: list[Awaitable[None]] = []
        placer = self.edge.placement.placer
        left = items
        while left:
            try:
                node = placer.place(preq).node_id
            except DsecError:
                break
            took: list[tuple[_Item, Any]] = []
            for item in left[: self.max_group]:
                try:
                    took.append((item, placer.begin(node, preq)))
                except DsecError:
                    break
            if not took:
                break
            left = left[len(took) :]
            sends.append(self._send(placer, node, took))
        sends += [self._one(item, frozenset()) for item in left]
        return sends

    async def _one(self, item: _Item, exclude: frozenset[str]) -> None:
        try:
            item.done.set_result(await self.retry(item.req, item.owner, exclude=exclude))
        except BaseException as e:  # the item's own outcome
            if not item.done.done():
                item.done.set_exception(e)

    async def _send(self, placer: Any, node: str, took: list[tuple[_Item, Any]]) -> None:
        edge = self.edge
        self.calls += 1
        self.items += len(took)
        answers: list[SandboxInfo | DsecError]
        try:
            raw = await edge.relay.actor_call(
                node,
                "create_each",
                [(item.req, item.owner) for item, _ in took],
                timeout=edge.options.create_timeout_s,
            )
            answers = [
                value if status == "ok" else error_from_wire(0, value) for status, value in raw
            ]
        except AttributeError:  # an edge actor of an older dsec: no create_each
            for _, r in took:
                placer.abort(r)
            await asyncio.gather(*(self._one(item, frozenset()) for item, _ in took))
            return
        except DsecError as e:
            answers = [e] * len(took)
            if e.details.get("unreachable") and await edge.relay.settle(
                node, edge.options.lost_after_s + 2 * edge.options.report_interval_s
            ):
                log.info(
                    "node %s died with %d creation(s) in flight: placed again", node, len(took)
                )
                answers = [NodeLost(e.message, node=node)] * len(took)  # made nothing that lives
        made: list[tuple[_Item, SandboxInfo]] = []
        again: list[_Item] = []
        for (item, r), answer in zip(took, answers, strict=True):
            if isinstance(answer, SandboxInfo):
                with contextlib.suppress(DsecError):
                    placer.commit(r)
                made.append((item, answer))
                continue
            placer.abort(r)
            if replaceable(answer):
                edge.rejections_retried += 1
                again.append(item)
            elif not item.done.done():
                item.done.set_exception(answer)
        await asyncio.gather(
            *(self._answer(item, info) for item, info in made),
            *(self._one(item, frozenset({node})) for item in again),
        )

    async def _answer(self, item: _Item, info: SandboxInfo) -> None:
        try:
            await self.record(item.owner, info)
        finally:
            if not item.done.done():
                item.done.set_result(info)
