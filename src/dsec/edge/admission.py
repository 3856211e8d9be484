"""Admission of sandbox creations into the runtime: a bounded, fair queue.

A node that starts every creation at once when hundreds arrive together (an RL step's
rollouts) makes each one slower (the kernel serialises cgroup and mount work under global
locks) until the OCI runtime times out and creations are lost. :class:`CreationGate` lets
``slots`` creations run at once; the others wait, first come first served within a key and
the keys served in turn, so one key's burst of 500 does not hold back another key's one.
A waiting creation ends only when

* it gets a slot (it then runs, however long the queue was);
* its client goes away (the request is cancelled: nothing was created);
* the queue is full (``max_waiting``) or it waited ``max_wait_s``: :class:`~dsec.errors.NodeBusy`
  (HTTP 503 with ``Retry-After``): nothing was created, and the SDK retries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dsec.errors import NodeBusy

__all__ = ["CreationGate", "GateStats"]


@dataclass(frozen=True)
class GateStats:
    """What the gate holds now."""

    slots: int
    running: int
    waiting: int
    keys_waiting: int


class CreationGate:
    """At most ``slots`` creations at once; the rest wait in per-key FIFO queues served
    round-robin. ``max_waiting`` bounds the waiters (beyond it: :class:`NodeBusy` at once),
    ``max_wait_s`` one waiter's wait."""

    def __init__(self, slots: int, *, max_waiting: int = 10_000, max_wait_s: float = 900.0):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self.slots = slots
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._free = slots
        self._queues: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._turn: collections.deque[str] = collections.deque()  # keys with waiters, in turn
        self._waiting = 0
        self._mean_s = 1.0  # a creation's time in its slot (moving average), for Retry-After

    def stats(self) -> GateStats:
        return GateStats(
            slots=self.slots,
            running=self.slots - self._free,
            waiting=self._waiting,
            keys_waiting=len(self._queues),
        )

    def _retry_after_s(self) -> float:
        return max(1.0, round((self._waiting / self.slots + 1) * self._mean_s, 1))

    @contextlib.asynccontextmanager
    async def slot(self, owner: str) -> AsyncIterator[None]:
        """Hold a slot for one creation (see the module's doc)."""
        await self._acquire(owner)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._mean_s = 0.9 * self._mean_s + 0.1 * (time.monotonic() - t0)
            self._release()

    async def _acquire(self, owner: str) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        if self._waiting >= self.max_waiting:
            raise NodeBusy(
                f"the node has {self._waiting} creations waiting (at most {self.max_waiting}); "
                "nothing was created: retry later",
                retry_after_s=self._retry_after_s(),
                waiting=self._waiting,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(owner, collections.deque())
        if not queue:
            self._turn.append(owner)
        queue.append(fut)
        self._waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self._release()  # granted as it gave up: pass the slot on
            else:
                fut.cancel()
                self._forget(owner, fut)
            if isinstance(e, TimeoutError):
                raise NodeBusy(
                    f"the creation waited {self.max_wait_s:g} s for one of the node's "
                    f"{self.slots} creation slots; nothing was created: retry later",
                    retry_after_s=self._retry_after_s(),
                    waiting=self._waiting,
                ) from None
            raise

    def _forget(self, owner: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(owner)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(fut)
            self._waiting -= 1
        if not queue:
            del self._queues[owner]
            with contextlib.suppress(ValueError):
                self._turn.remove(owner)

    def _release(self) -> None:
        """Hand the slot to the next key's first waiter, or free it."""
        while self._turn:
            owner = self._turn.popleft()
            queue = self._queues[owner]
            fut = queue.popleft()
            self._waiting -= 1
            if queue:
                self._turn.append(owner)  # its next waiter waits for the other keys' turn
            else:
                del self._queues[owner]
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1
