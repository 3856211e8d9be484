"""Warm containers: create is a claim of a container made before it was asked for.

``crun run --detach`` is most of a container's creation (14-60 ms here, growing with the
node's live count: namespace and cgroup set-up in the kernel). The pool runs it ahead of
demand: per **pool key** (the layer stack, the writable layer's size, the hostname, the CPU
group and the layer mounts' scope, i.e. the owning key unless ``DSEC_LAYER_SHARING=node``:
what is fixed once a container runs) it keeps a few containers made with an empty environment,
no network (a network namespace with only ``lo``), and their exec server attached. A
create whose spec has that key *claims* one: the runtime renames it to the new sandbox's
id, writes the sandbox's CPU, memory and pids limits into its cgroups and records its
environment, user and workdir (which the exec server applies per command); a create with
a network policy then has the container's own namespace wired as a new one would be
(veth, address, routes, filter, resolver, ``/etc/resolv.conf``: ``NetworkManager.setup``
with ``netns``). What the claim cannot change is in the key.

A claimed container is indistinguishable from a fresh one from inside: nothing ran in it but
its init (which holds no state) and nothing wrote to its upper layer; it has its own pid,
mount, ipc, uts, network and cgroup namespaces, the sandbox's hostname, and the same kernel
clock and entropy source as every container (no time namespace, ``getrandom`` is the
kernel's). The one trace is its init's start time (``ps -o etime 1``), at most the pool's
idle time older than the claim.

Sizing by demand: each key's target is the claims of the last ``window_s`` seconds (or of
the time since the first of them, at least 1 s), scaled to ``lead_s`` seconds of demand, or
its largest burst of claims (``burst_s`` apart at most: a fork's children) of the last
``burst_keep_s`` if that is more (at least ``min_ready`` once a key was asked for, at most
``max_per_key``), and the pool as a whole holds at most ``max_total``. A key nobody claimed
for ``idle_s`` seconds is emptied. Under memory pressure (``MemAvailable`` below
``min_available_fraction`` of the node's memory) the pool empties and refills nothing until
it recovers. Off switch: ``DSEC_CONTAINER_POOL=0`` (or ``PoolConfig(enabled=False)``).

Example::

    pool = WarmPool(PoolConfig.from_env(), make=runtime._make_warm, discard=runtime._discard_warm)
    entry = pool.take(key, template)   # None: a miss (the caller creates fresh)
    ...
    await pool.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["PoolConfig", "PoolStats", "WarmPool", "memory_available_fraction"]

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")  # what a key's containers are made from (a template spec)
E = TypeVar("E")  # one warm container


def memory_available_fraction() -> float:
    """``MemAvailable / MemTotal`` from ``/proc/meminfo`` (1.0 if unreadable)."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1])
                elif line.startswith("MemAvailable:"):
                    avail = int(line.split()[1])
    except OSError:
        return 1.0
    return avail / total if total else 1.0


@dataclass
class PoolConfig:
    """How many warm containers to keep. Times in seconds.

    ``enabled``: the off switch. ``max_total``: warm containers in all. ``max_per_key``,
    ``min_ready``: bounds of a key's target. ``window_s``, ``lead_s``: a key's target is its
    claims per second over the last ``window_s`` (or since the first claim in it, at least
    1 s) times ``lead_s``. ``idle_s``: a key with no
    claim for this long is emptied. ``min_available_fraction``: below this share of memory
    available the pool empties. ``fill_concurrency``: containers made at once per key.
    ``refill_delay_s``: after a claim that leaves the key a ready container, its refill waits
    this long, so the claimed sandbox's first commands run without the refill's ``crun run``
    beside them (on 2 cores that overlap doubled the first exec: CPU, and the kernel's locks
    of namespace and cgroup creation). A key left empty refills at once, also when a claim
    empties it during the wait. ``burst_s``: claims this close together are a burst (a
    shared fork's n children claim at once); a key's target is at least its largest burst
    of the last ``burst_keep_s`` (a rate over the window saw 16 claims every 2.5 s as 7/s and
    kept 7 warm: 9 of each fork's 16 children were made cold; and a burst kept only for
    ``window_s`` was forgotten by the next group whose set-up took longer than that: a
    parent writing 1 GiB between forks had most of its 16 children made cold)."""

    enabled: bool = True
    max_total: int = 32
    max_per_key: int = 16
    min_ready: int = 2
    window_s: float = 10.0
    lead_s: float = 1.0
    idle_s: float = 120.0
    min_available_fraction: float = 0.10
    fill_concurrency: int = 2
    refill_delay_s: float = 0.05
    burst_s: float = 0.5
    burst_keep_s: float = 120.0

    @classmethod
    def from_env(cls) -> PoolConfig:
        """Defaults, overridden by ``DSEC_CONTAINER_POOL`` (``0``/``off``: no pool),
        ``DSEC_CONTAINER_POOL_MAX`` (warm containers in all) and
        ``DSEC_CONTAINER_POOL_IDLE_S`` (seconds without a claim before a key is emptied)."""
        cfg = cls()
        raw = os.environ.get("DSEC_CONTAINER_POOL", "").strip().lower()
        if raw in ("0", "off", "false", "no"):
            cfg.enabled = False
        if "DSEC_CONTAINER_POOL_MAX" in os.environ:
            try:
                cfg.max_total = max(0, int(os.environ["DSEC_CONTAINER_POOL_MAX"]))
            except ValueError as e:
                raise SystemExit(f"invalid DSEC_CONTAINER_POOL_MAX: {e}") from e
            cfg.max_per_key = min(cfg.max_per_key, cfg.max_total)
            cfg.min_ready = min(cfg.min_ready, cfg.max_per_key)
        if "DSEC_CONTAINER_POOL_IDLE_S" in os.environ:
            try:
                cfg.idle_s = float(os.environ["DSEC_CONTAINER_POOL_IDLE_S"])
            except ValueError as e:
                raise SystemExit(f"invalid DSEC_CONTAINER_POOL_IDLE_S: {e}") from e
        if cfg.max_total == 0:
            cfg.enabled = False
        return cfg


@dataclass
class PoolStats:
    """Counters since the pool started."""

    hits: int = 0
    misses: int = 0
    made: int = 0
    failed: int = 0
    discarded: int = 0  # emptied: idle keys, memory pressure, close
    pressure_drains: int = 0


@dataclass
class _Key(Generic[T, E]):
    template: T
    ready: collections.deque[E] = field(default_factory=collections.deque)
    filling: int = 0
    claims: collections.deque[float] = field(default_factory=collections.deque)
    last_claim: float = 0.0
    burst: int = 0  # the most claims within burst_s seen since burst_at (a fork of n: n)
    burst_at: float = 0.0
    task: asyncio.Task[None] | None = None
    emptied: asyncio.Event = field(default_factory=asyncio.Event)  # a claim took the last


class WarmPool(Generic[K, T, E]):
    """Warm containers per key (see the module docstring).

    Args:
        config: sizes and switches.
        make: makes one warm container from a key's template (raises on failure).
        discard: destroys a warm container that will never be claimed.
        memory_fraction: ``MemAvailable / MemTotal`` now (tests pass their own).
    """

    def __init__(
        self,
        config: PoolConfig,
        *,
        make: Callable[[T], Awaitable[E]],
        discard: Callable[[E], Awaitable[None]],
        memory_fraction: Callable[[], float] = memory_available_fraction,
    ) -> None:
        self.config = config
        self._make = make
        self._discard = discard
        self._memory_fraction = memory_fraction
        self._keys: dict[K, _Key[T, E]] = {}
        self.stats = PoolStats()
        self._closed = False
        self._janitor: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enabled and not self._closed

    def ready_count(self, key: K | None = None) -> int:
        """Warm containers ready to be claimed (of ``key``, or in all)."""
        if key is not None:
            k = self._keys.get(key)
            return len(k.ready) if k is not None else 0
        return sum(len(k.ready) for k in self._keys.values())

    def _total(self) -> int:
        return sum(len(k.ready) + k.filling for k in self._keys.values())

    def target(self, key: K, now: float | None = None) -> int:
        """How many warm containers ``key`` should have (ready + being made)."""
        k = self._keys.get(key)
        if k is None:
            return 0
        now = time.monotonic() if now is None else now
        while k.claims and k.claims[0] < now - self.config.window_s:
            k.claims.popleft()
        if now - k.last_claim > self.config.idle_s:
            return 0
        # claims per second over the window, or over the time since the window's first
        # claim when that is shorter (at least 1 s): a key claimed 40 times in its first
        # second wants 40/s, not 4/s (which kept sequential create loops missing for the
        # first 10 s)
        span = min(self.config.window_s, max(1.0, now - k.claims[0])) if k.claims else 1.0
        rate = len(k.claims) / span
        burst = k.burst if now - k.burst_at <= self.config.burst_keep_s else 0
        want = max(self.config.min_ready, math.ceil(rate * self.config.lead_s), burst)
        return min(self.config.max_per_key, want)

    def _note_burst(self, k: _Key[T, E], now: float) -> None:
        """Count the claims of the last ``burst_s`` (``now``'s among them, the newest last);
        keep the largest such count of the window."""
        n = 0
        for t in reversed(k.claims):
            if t < now - self.config.burst_s or n >= self.config.max_per_key:
                break
            n += 1
        if n >= k.burst or now - k.burst_at > self.config.burst_keep_s:
            k.burst, k.burst_at = n, now

    def take(self, key: K, template: T) -> E | None:
        """A warm container of ``key``, or None (a miss: create fresh). Either way the claim
        counts as demand for ``key`` (``template`` is what its containers are made from)."""
        if not self.enabled:
            return None
        now = time.monotonic()
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _Key(template)
        k.claims.append(now)
        k.last_claim = now
        self._note_burst(k, now)
        entry = k.ready.popleft() if k.ready else None
        if not k.ready:
            k.emptied.set()  # a refill waiting out its delay starts now
        if entry is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        self._kick(key, k)
        if self._janitor is None:
            self._janitor = asyncio.create_task(self._janitor_loop(), name="dsec-pool-janitor")
        return entry

    def _kick(self, key: K, k: _Key[T, E]) -> None:
        if k.task is None or k.task.done():
            k.task = asyncio.create_task(self._fill(key, k), name="dsec-pool-fill")

    def _pressure(self) -> bool:
        return self._memory_fraction() < self.config.min_available_fraction

    async def _fill(self, key: K, k: _Key[T, E]) -> None:
        """Make containers for ``key`` until it has its target (a few at once)."""
        if k.ready and self.config.refill_delay_s > 0:
            k.emptied.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(k.emptied.wait(), self.config.refill_delay_s)
        failures = 0
        while self.enabled and failures < 3:
            want = self.target(key) - len(k.ready) - k.filling
            room = self.config.max_total - self._total()
            n = min(want, room, self.config.fill_concurrency)
            if n <= 0 or self._pressure():
                return
            k.filling += n
            results = await asyncio.gather(
                *(self._make(k.template) for _ in range(n)), return_exceptions=True
            )
            k.filling -= n
            for r in results:
                if isinstance(r, BaseException):
                    self.stats.failed += 1
                    failures += 1
                    if not isinstance(r, asyncio.CancelledError):
                        log.warning("warm container for the pool failed: %s", r)
                elif self.enabled and self.target(key) > 0:
                    k.ready.append(r)
                    self.stats.made += 1
                else:
                    await self._drop(r)

    async def _drop(self, entry: E) -> None:
        self.stats.discarded += 1
        try:
            await self._discard(entry)
        except Exception as e:  # a warm container nobody will claim: log, go on
            log.warning("discarding a warm container failed: %s", e)

    async def trim(self) -> int:
        """Empty idle keys, and every key under memory pressure; returns how many went."""
        pressure = self._pressure()
        if pressure and self.ready_count():
            self.stats.pressure_drains += 1
            log.info("memory pressure: emptying the container pool")
        dropped: list[E] = []
        for key, k in list(self._keys.items()):
            keep = 0 if pressure else self.target(key)
            while len(k.ready) > keep:
                dropped.append(k.ready.pop())
            if keep == 0 and not k.ready and not k.filling and (k.task is None or k.task.done()):
                del self._keys[key]
        for entry in dropped:
            await self._drop(entry)
        return len(dropped)

    async def _janitor_loop(self, interval_s: float = 1.0) -> None:
        while not self._closed:
            await asyncio.sleep(interval_s)
            try:
                await self.trim()
            except Exception:
                log.exception("container pool trim failed")

    async def close(self) -> None:
        """Stop refilling and destroy every warm container (idempotent)."""
        self._closed = True
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._janitor
        # fills are not cancelled (a container made meanwhile would be lost with its task):
        # they stop after the containers in flight, which they discard as the pool is closed
        for t in [k.task for k in self._keys.values() if k.task]:
            with contextlib.suppress(Exception):
                await t
        for k in self._keys.values():
            while k.ready:
                await self._drop(k.ready.pop())
        self._keys.clear()
