"""Per-key quotas: what the operator lets each API key hold and how fast it may create.

The operator sets a key's :class:`~dsec.models.KeyQuota` (``dsec key create --max-sandboxes
100 ...``, ``dsec key set <owner> ...``); the key store keeps it (``api_keys.json`` on one
node, PostgreSQL in a cluster) and answers :class:`KeyQuotas`. An edge checks every
creation (create, batch, fork, restore, memory import) against it with a
:class:`QuotaGuard`, before anything is made:

* live sandboxes, requested cores and requested memory: the key's usage (the edge's running
  totals; a cluster's registry) plus the creations admitted but not finished yet, plus this
  one, must fit. Beyond: :class:`~dsec.errors.QuotaExceeded` (429) naming the quota, its limit
  and what the key holds: nothing was made, and retrying does not help until the key frees
  something.
* creations a second: a token bucket per key holding one second's worth (at least one).
  Beyond: :class:`~dsec.errors.CreationRateExceeded` (429 with ``Retry-After``: when the
  bucket has a token again); the SDK waits and retries.

A cluster's apiserver replicas each keep their own buckets and in-flight counts: with R
replicas a key may briefly exceed ``creations_per_s`` R-fold and its live limits by what
the replicas admit at the same moment (the registry catches up within one creation).

A ``run_code`` call (:class:`dsec.contract.edge.CodeRuns`) is checked the same way: it
counts as one live sandbox of :func:`code_run_size` while it runs and spends one creation.

``cpu_weight`` is not checked here: the container tier puts each key's sandboxes under one
cgroup with that weight (:mod:`dsec.runtimes.container.runtime`), so a key's 500 busy
sandboxes share what one busy key gets when another key's 10 want CPU too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dsec.contract.edge import KeyQuotas
from dsec.errors import CreationRateExceeded, QuotaExceeded
from dsec.models import CodeRunRequest, KeyQuota, KeyUsage, RunCodeRequest

__all__ = [
    "CODE_RUN_CPU",
    "CODE_RUN_MEMORY_MB",
    "UNLIMITED",
    "QuotaGuard",
    "code_run_size",
]

UNLIMITED = KeyQuota()

CODE_RUN_CPU = 1.0
"""Cores a ``run_code`` call counts as: an fncall worker's (``PoolConfig.cpu``)."""
CODE_RUN_MEMORY_MB = 1024
"""MiB a ``run_code`` call without a memory limit of its own counts as: an fncall worker's
default (``PoolConfig.memory_mb``)."""


def code_run_size(req: CodeRunRequest | RunCodeRequest) -> tuple[float, int]:
    """``(cores, MiB)`` a ``run_code`` call counts as against its key's quota while it runs:
    the worker's core and the call's memory limit (``memory_mb``; SandboxFusion's
    ``memory_limit_MB`` when positive), else the worker's default. One rule on a node and
    in a cluster, whose apiserver checks before it knows which node runs the call."""
    asked = req.memory_mb if isinstance(req, CodeRunRequest) else req.memory_limit_MB
    return CODE_RUN_CPU, asked if asked is not None and asked > 0 else CODE_RUN_MEMORY_MB


@dataclass
class _Bucket:
    tokens: float
    at: float


class QuotaGuard:
    """Checks creations of each key against its quota (see the module's doc).

    Args:
        source: where quotas come from (None: every key unlimited).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self, source: KeyQuotas | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.source = source
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._pending: dict[str, KeyUsage] = {}  # admitted, not yet in the key's usage

    def quota(self, owner: str) -> KeyQuota:
        return self.source.quota_of(owner) if self.source is not None else UNLIMITED

    def check(
        self, owner: str, usage: KeyUsage, *, cpu: float, memory_mb: int, count: int = 1
    ) -> None:
        """Raise :class:`QuotaExceeded` if ``count`` more sandboxes of ``cpu`` cores and
        ``memory_mb`` MiB each would take ``owner`` past its quota, counting ``usage`` (what
        it holds) and the creations of it admitted and not finished yet."""
        q = self.quota(owner)
        pending = self._pending.get(owner, KeyUsage())
        held = KeyUsage(
            sandboxes=usage.sandboxes + pending.sandboxes,
            cpu=usage.cpu + pending.cpu,
            memory_mb=usage.memory_mb + pending.memory_mb,
        )
        limits: tuple[tuple[str, float | None, float, float, str], ...] = (
            ("max_sandboxes", q.max_sandboxes, held.sandboxes, count, "live sandboxes"),
            ("max_cpu", q.max_cpu, held.cpu, cpu * count, "cores requested"),
            ("max_memory_mb", q.max_memory_mb, held.memory_mb, memory_mb * count, "MiB requested"),
        )
        for name, limit, used, more, what in limits:
            if limit is not None and used + more > limit + 1e-9:
                raise QuotaExceeded(
                    f"this key's quota {name}={_num(limit)} would be exceeded: it holds "
                    f"{_num(used)} {what} and asks for {_num(more)} more (kill sandboxes, or ask "
                    "the operator for a larger quota)",
                    quota=name,
                    limit=limit,
                    used=used,
                    requested=more,
                )

    def take(self, owner: str, count: int = 1) -> None:
        """Spend ``count`` creations of ``owner``'s rate, or raise
        :class:`CreationRateExceeded` (with when to retry) and spend nothing."""
        rate = self.quota(owner).creations_per_s
        if rate is None:
            self._buckets.pop(owner, None)
            return
        burst = max(1.0, rate)
        b = self._bucket(owner, rate)
        if count > burst:
            raise QuotaExceeded(
                f"a batch of {count} is more than this key's creations_per_s={_num(rate)} "
                f"quota allows at once ({int(burst)}); create them in smaller batches",
                quota="creations_per_s",
                limit=rate,
                requested=count,
            )
        if b.tokens + 1e-9 < count:
            wait = (count - b.tokens) / rate
            raise CreationRateExceeded(
                f"this key creates sandboxes faster than its quota creations_per_s="
                f"{_num(rate)}; retry in {wait:.1f} s",
                quota="creations_per_s",
                limit=rate,
                retry_after_s=round(max(wait, 0.1), 2),
            )
        b.tokens -= count

    def room(
        self, owner: str, usage: KeyUsage, *, cpu: float, memory_mb: int, want: int
    ) -> tuple[int, QuotaExceeded | None]:
        """How many of ``want`` sandboxes (``cpu`` cores, ``memory_mb`` MiB each) fit
        ``owner``'s live quotas and rate now, with the refusal for the rest (None: all fit).
        The rate tokens of the ones that fit are spent (a batch that is not all or
        nothing)."""
        fits = 0
        refusal: QuotaExceeded | None = None
        lo, hi = 0, want  # the live quotas are monotonic in the count: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                self.check(owner, usage, cpu=cpu, memory_mb=memory_mb, count=mid)
                lo = mid
            except QuotaExceeded as e:
                refusal, hi = e, mid - 1
        fits = lo
        rate = self.quota(owner).creations_per_s
        if rate is not None and fits:
            b = self._bucket(owner, rate)
            spend = min(fits, int(b.tokens + 1e-9))
            if spend < fits:
                fits = spend
                refusal = CreationRateExceeded(
                    f"this key creates sandboxes faster than its quota creations_per_s="
                    f"{_num(rate)}",
                    quota="creations_per_s",
                    limit=rate,
                    retry_after_s=round(max(1.0 / rate, 0.1), 2),
                )
            b.tokens -= spend
        return fits, (refusal if fits < want else None)

    def _bucket(self, owner: str, rate: float) -> _Bucket:
        burst = max(1.0, rate)
        now = self._clock()
        b = self._buckets.get(owner)
        if b is None:
            b = self._buckets[owner] = _Bucket(burst, now)
        b.tokens = min(burst, b.tokens + (now - b.at) * rate)
        b.at = now
        return b

    @contextlib.contextmanager
    def admitted(self, owner: str, *, cpu: float, memory_mb: int, count: int = 1) -> Iterator[None]:
        """Count ``count`` creations of ``owner`` as held while they are being made (so
        concurrent creations cannot all pass :meth:`check`); the caller adds them to the
        key's usage before leaving, or they failed."""
        p = self._pending.setdefault(owner, KeyUsage())
        p.sandboxes += count
        p.cpu += cpu * count
        p.memory_mb += memory_mb * count
        try:
            yield
        finally:
            p.sandboxes -= count
            p.cpu -= cpu * count
            p.memory_mb -= memory_mb * count
            if p.sandboxes <= 0:
                self._pending.pop(owner, None)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)
