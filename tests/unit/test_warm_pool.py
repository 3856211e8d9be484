"""The warm pool's policy (sizing by demand, caps, idle and memory-pressure trims, close),
with fake containers: no root needed. The container runtime's use of it is tested in
tests/integration/test_container_pool_root.py."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from dsec.runtimes.container.pool import PoolConfig, WarmPool


class Fakes:
    def __init__(self) -> None:
        self.ids = itertools.count()
        self.made: list[int] = []
        self.discarded: list[int] = []
        self.fail = False

    async def make(self, template: str) -> int:
        await asyncio.sleep(0)
        if self.fail:
            raise OSError("no more containers")
        n = next(self.ids)
        self.made.append(n)
        return n

    async def discard(self, entry: int) -> None:
        self.discarded.append(entry)

    def live(self) -> set[int]:
        return set(self.made) - set(self.discarded)


async def settle(pool: WarmPool[str, str, int]) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
        tasks = [k.task for k in pool._keys.values() if k.task and not k.task.done()]
        if not tasks:
            return
        await asyncio.gather(*tasks)


async def test_first_claim_misses_then_the_key_is_kept_warm() -> None:
    f = Fakes()
    pool: WarmPool[str, str, int] = WarmPool(
        PoolConfig(min_ready=2), make=f.make, discard=f.discard
    )
    assert pool.take("busybox", "tmpl") is None  # nothing made before demand
    await settle(pool)
    assert pool.ready_count("busybox") == 2 and pool.ready_count("other") == 0
    got = pool.take("busybox", "tmpl")
    assert got in f.made and pool.stats.hits == 1 and pool.stats.misses == 1
    await settle(pool)
    assert pool.ready_count("busybox") == 2  # refilled in the background
    await pool.close()
    assert f.live() == {got}  # close destroyed every unclaimed one, not the claimed one


async def test_demand_sizes_a_key_within_its_caps() -> None:
    f = Fakes()
    cfg = PoolConfig(
        min_ready=1, max_per_key=6, max_total=8, window_s=10.0, lead_s=1.0, burst_keep_s=30.0
    )
    pool: WarmPool[str, str, int] = WarmPool(cfg, make=f.make, discard=f.discard)
    for _ in range(4):  # 4 claims just now: 4 per (at least) 1 s x 1 s lead = 4 wanted
        pool.take("a", "t")
    assert pool.target("a") == 4
    now = pool._keys["a"].claims[0]
    assert pool.target("a", now + 4.0) == 4  # 1/s over 4 s, but a burst of 4: kept
    assert pool.target("a", now + 10.5) == 4  # out of the rate's window, not the burst's
    assert pool.target("a", now + 30.5) == 1  # both past: min_ready
    for _ in range(20):
        pool.take("a", "t")
    assert pool.target("a") == 6  # the per-key cap
    await settle(pool)
    assert pool.ready_count("a") == 6
    pool.take("b", "t")
    await settle(pool)
    assert pool.ready_count() <= 8  # the total cap holds across keys
    await pool.close()
    assert f.live() == set() and pool.ready_count() == 0  # none was claimed: all destroyed


async def test_a_burst_of_claims_keeps_its_size_warm() -> None:
    """A shared fork of 16 claims 16 at once: the key keeps 16 for the next fork, though 16
    claims every 2.5 s are a rate of 6.4/s, and though the next group's set-up takes longer
    than the rate's window."""
    f = Fakes()
    cfg = PoolConfig(
        min_ready=1, max_per_key=16, max_total=32, window_s=10.0, lead_s=1.0, burst_keep_s=60.0
    )
    pool: WarmPool[str, str, int] = WarmPool(cfg, make=f.make, discard=f.discard)
    for _ in range(16):
        pool.take("a", "t")
    k = pool._keys["a"]
    assert k.burst == 16
    last = k.claims[-1]
    assert pool.target("a", k.claims[0] + 2.5) == 16
    assert pool.target("a", last + 30.0) == 16  # the rate's window is past, not the burst's
    assert pool.target("a", last + 60.5) == 1  # the burst is forgotten
    await settle(pool)
    assert pool.ready_count("a") == 16
    await pool.close()


async def test_idle_keys_and_memory_pressure_empty_the_pool() -> None:
    f = Fakes()
    available = [0.5]
    pool: WarmPool[str, str, int] = WarmPool(
        PoolConfig(min_ready=2, idle_s=1000.0),
        make=f.make,
        discard=f.discard,
        memory_fraction=lambda: available[0],
    )
    pool.take("a", "t")
    await settle(pool)
    assert pool.ready_count() == 2
    available[0] = 0.02  # under pressure: everything goes, nothing is refilled
    assert await pool.trim() == 2 and pool.ready_count() == 0
    assert pool.stats.pressure_drains == 1
    pool.take("a", "t")
    await settle(pool)
    assert pool.ready_count() == 0
    available[0] = 0.5
    pool.config.idle_s = 0.0  # and a key nobody claims is emptied
    pool.take("a", "t")
    await settle(pool)
    await asyncio.sleep(0.01)
    await pool.trim()
    assert pool.ready_count() == 0 and not pool._keys
    await pool.close()
    assert f.live() == set()


async def test_failures_stop_the_fill_and_the_off_switch_holds() -> None:
    f = Fakes()
    f.fail = True
    pool: WarmPool[str, str, int] = WarmPool(PoolConfig(), make=f.make, discard=f.discard)
    pool.take("a", "t")
    await settle(pool)
    assert pool.ready_count() == 0 and pool.stats.failed >= 1
    await pool.close()
    off: WarmPool[str, str, int] = WarmPool(
        PoolConfig(enabled=False), make=f.make, discard=f.discard
    )
    assert off.take("a", "t") is None and not off._keys


def test_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_CONTAINER_POOL", "0")
    assert not PoolConfig.from_env().enabled
    monkeypatch.setenv("DSEC_CONTAINER_POOL", "1")
    monkeypatch.setenv("DSEC_CONTAINER_POOL_MAX", "3")
    monkeypatch.setenv("DSEC_CONTAINER_POOL_IDLE_S", "5")
    cfg = PoolConfig.from_env()
    assert cfg.enabled and cfg.max_total == 3 and cfg.max_per_key == 3 and cfg.idle_s == 5.0
    monkeypatch.setenv("DSEC_CONTAINER_POOL_MAX", "0")
    assert not PoolConfig.from_env().enabled


async def test_refill_waits_while_a_ready_container_is_left() -> None:
    f = Fakes()
    cfg = PoolConfig(min_ready=2, refill_delay_s=0.2)
    pool: WarmPool[str, str, int] = WarmPool(cfg, make=f.make, discard=f.discard)
    pool.take("a", "t")  # empty key: filled at once
    await settle(pool)
    assert pool.ready_count("a") == 2
    pool.take("a", "t")  # one left: the refill waits out the first commands of the claim
    for _ in range(5):
        await asyncio.sleep(0)
    assert pool.ready_count("a") == 1 and len(f.made) == 2
    await settle(pool)
    assert pool.ready_count("a") == 2 and len(f.made) == 3
    pool.take("a", "t")
    pool.take("a", "t")  # none left by the time the refill starts: no wait
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(f.made) >= 4
    await pool.close()


async def test_a_claim_that_empties_the_key_ends_the_refill_delay() -> None:
    f = Fakes()
    cfg = PoolConfig(min_ready=2, refill_delay_s=30.0)
    pool: WarmPool[str, str, int] = WarmPool(cfg, make=f.make, discard=f.discard)
    pool.take("a", "t")
    await settle(pool)
    pool.take("a", "t")  # one left: the refill waits (30 s here)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(f.made) == 2
    pool.take("a", "t")  # the last one: the refill starts now, not after 30 s
    await asyncio.wait_for(settle(pool), 5.0)
    assert pool.ready_count("a") >= 2
    await pool.close()
