"""The placement engine: which node gets the next sandbox.

Glossary (see docs/design/placement.md for the reasoning and the measurements):

* **node**: one machine running one edge. Its static description is a :class:`Node`
  (cores, bytes of memory, tiers it serves, whether it belongs to the burst pool).
* **request**: what one sandbox asks for, a :class:`PlacementRequest` (cores, bytes of
  memory and disk, tier, layer digests, burstable or not).
* **requested totals**: the sum of the requests committed to a node plus those in flight.
  Overcommit caps apply to these: requested CPU <= ``cores x Overcommit.cpu``, requested
  memory <= ``memory x Overcommit.memory``, sandbox count <= ``Node.max_sandboxes``.
* **actual usage**: what the edge last reported through :meth:`Placer.observe` (cores used,
  bytes used, sandbox count). Scores use actual usage, plus the full request of every
  sandbox placed since the last report (it has not been measured yet).
* **in-flight overlay**: a placement that was decided but not yet admitted by the edge is a
  :class:`Reservation`. It counts against caps and scores at once, so a burst of decisions
  does not all pick the same node; :meth:`Placer.commit` or :meth:`Placer.abort` ends it.
* **burst pool**: nodes with ``Node.burst=True``. They take only burstable requests, and only
  while the regular pool's utilisation (:attr:`Placer.regular_utilisation`) is at or above
  ``burst_threshold``.

Life of a sandbox::

    decision = placer.place(request)              # choose; nothing is reserved yet
    reservation = placer.begin(decision.node_id, request)   # in flight (QuotaExceeded if full)
    ... edge admits ...  placer.commit(reservation)  # now part of the requested totals
    ... edge rejects ... placer.abort(reservation); try decision.fallbacks in order
    ... sandbox ends ... placer.release(node_id, request)

Every call is O(k) for ``policy="power_of_k"`` (k sampled candidates, one locality
candidate) except when the sampled candidates are all full, where one O(nodes) scan tells
"unlucky" from "cluster full". ``least_loaded`` takes the global minimum from a lazy heap
(O(k log nodes)); ``random`` takes the first admitting random node.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dsec.errors import (
    DsecError,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    ServiceUnavailable,
    TierUnavailable,
)

__all__ = [
    "BatchPlacement",
    "Decision",
    "Node",
    "NodeLoad",
    "NodeUsage",
    "Overcommit",
    "PlacementRequest",
    "Placer",
    "Policy",
    "Reservation",
    "admits",
]

Policy = Literal["power_of_k", "random", "least_loaded"]

_EPS = 1e-9
# Sampling rounds of k candidates before one full scan decides whether any node admits.
_SAMPLE_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class Overcommit:
    """Per-node caps on *requested* totals, as multiples of the physical amount.

    Attributes:
        cpu: requested cores may reach ``cpu x cores`` (default 10x: most RL sandboxes idle).
        memory: requested bytes may reach ``memory x bytes`` (default 1.5x).
    """

    cpu: float = 10.0
    memory: float = 1.5

    def __post_init__(self) -> None:
        if self.cpu <= 0 or self.memory <= 0:
            raise InvalidRequest("overcommit factors must be > 0", cpu=self.cpu, memory=self.memory)


@dataclass(frozen=True, slots=True)
class Node:
    """A node's static description.

    Attributes:
        node_id: unique name (the sandbox id encodes it).
        cpu_cores: physical cores.
        memory_bytes: physical memory, bytes.
        tiers: tiers the node's edge serves (``fncall``, ``container``, ``microvm``, ``vm``).
        disk_free_bytes: free disk for writable layers and pulled layers, bytes (updated by
            :meth:`Placer.observe`).
        max_sandboxes: cap on the number of sandboxes (committed + in flight).
        burst: member of the burst pool (e.g. cloud VMs added by the Ray autoscaler).
        layers: layer digests already present on the node.
    """

    node_id: str
    cpu_cores: float
    memory_bytes: int
    tiers: frozenset[str] = frozenset({"container"})
    disk_free_bytes: int = 1 << 50
    max_sandboxes: int = 4096
    burst: bool = False
    layers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.cpu_cores <= 0 or self.memory_bytes <= 0 or self.max_sandboxes <= 0:
            raise InvalidRequest(
                "node needs cores, memory and max_sandboxes > 0", node=self.node_id
            )


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What one sandbox asks for.

    Attributes:
        tier: isolation tier.
        cpu: cores requested (CFS quota).
        memory_bytes: memory limit, bytes.
        disk_bytes: writable-layer size, bytes (must fit the node's free disk).
        layers: layer digests the sandbox mounts; nodes holding them get a locality bonus.
        burstable: may run on the burst pool.
    """

    tier: str = "container"
    cpu: float = 1.0
    memory_bytes: int = 512 << 20
    disk_bytes: int = 0
    layers: tuple[str, ...] = ()
    burstable: bool = False

    def __post_init__(self) -> None:
        if self.cpu <= 0 or self.memory_bytes <= 0 or self.disk_bytes < 0:
            raise InvalidRequest(
                "request needs cpu > 0, memory_bytes > 0, disk_bytes >= 0",
                cpu=self.cpu,
                memory_bytes=self.memory_bytes,
                disk_bytes=self.disk_bytes,
            )


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """One usage report from a node's edge.

    Attributes:
        cpu_used: cores in use (e.g. averaged over the last report interval).
        memory_used: bytes in use.
        sandboxes: sandboxes running.
        disk_free_bytes: free disk, bytes; ``None`` keeps the previous value.
    """

    cpu_used: float
    memory_used: int
    sandboxes: int
    disk_free_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to create a sandbox: ``node_id`` first, then ``fallbacks`` in order if the edge
    rejects. ``score`` is the chosen node's load estimate (lower is better, ~0..1)."""

    node_id: str
    fallbacks: tuple[str, ...]
    score: float
    burst: bool


@dataclass(slots=True, eq=False)
class Reservation:
    """An in-flight placement: counted against ``node_id``'s caps until committed or aborted."""

    node_id: str
    request: PlacementRequest
    state: Literal["in_flight", "committed", "aborted"] = "in_flight"
    # the node incarnation it was made on (a removed and re-added node is a new NodeLoad)
    load: NodeLoad | None = field(default=None, repr=False)


@dataclass(slots=True)
class BatchPlacement:
    """Result of :meth:`Placer.place_many`: ``placed`` are in-flight reservations (commit or
    abort each); ``failed`` holds one typed error per sandbox that could not be placed."""

    placed: list[Reservation] = field(default_factory=list)
    failed: list[DsecError] = field(default_factory=list)


class NodeLoad:
    """A node's mutable load as the placer sees it (requested totals, in flight, usage)."""

    __slots__ = (
        "burst",
        "cpu_cap",
        "cpu_cores",
        "cpu_requested",
        "cpu_used",
        "dead",
        "disk_free_bytes",
        "index",
        "inflight_cpu",
        "inflight_memory",
        "inflight_sandboxes",
        "layers",
        "max_sandboxes",
        "memory_bytes",
        "memory_cap",
        "memory_requested",
        "memory_used",
        "node",
        "node_id",
        "observed_sandboxes",
        "sandboxes",
        "tiers",
        "unobserved_cpu",
        "unobserved_memory",
    )

    def __init__(self, node: Node, overcommit: Overcommit, index: int) -> None:
        self.node = node
        self.node_id = node.node_id
        self.index = index
        self.tiers = node.tiers
        self.burst = node.burst
        self.dead = False
        self.cpu_cores = float(node.cpu_cores)
        self.memory_bytes = node.memory_bytes
        self.cpu_cap = node.cpu_cores * overcommit.cpu + _EPS
        self.memory_cap = node.memory_bytes * overcommit.memory + _EPS
        self.max_sandboxes = node.max_sandboxes
        self.disk_free_bytes = node.disk_free_bytes
        self.layers: set[str] = set(node.layers)
        self.cpu_requested = 0.0  # committed requests, cores
        self.memory_requested = 0  # committed requests, bytes
        self.sandboxes = 0  # committed sandboxes
        self.inflight_cpu = 0.0
        self.inflight_memory = 0
        self.inflight_sandboxes = 0
        self.cpu_used = 0.0  # last report, cores
        self.memory_used = 0  # last report, bytes
        self.observed_sandboxes = 0
        self.unobserved_cpu = 0.0  # requests placed since the last report, cores
        self.unobserved_memory = 0  # requests placed since the last report, bytes

    def load_score(self) -> float:
        """Load estimate, lower is better (~0..1): the largest of estimated CPU use / cores,
        estimated memory use / bytes and sandbox count / max_sandboxes. Estimated use is the
        last report plus the full request of everything placed since."""
        cpu = (self.cpu_used + self.unobserved_cpu) / self.cpu_cores
        mem = (self.memory_used + self.unobserved_memory) / self.memory_bytes
        count = self.sandboxes + self.inflight_sandboxes
        if self.observed_sandboxes > count:
            count = self.observed_sandboxes
        s = count / self.max_sandboxes
        if cpu > s:
            s = cpu
        if mem > s:
            s = mem
        return s

    def score(self, request: PlacementRequest, locality_bonus: float) -> float:
        """:meth:`load_score` minus ``locality_bonus`` times the fraction of the request's
        layers already on the node."""
        s = self.load_score()
        layers = request.layers
        if layers and locality_bonus:
            have = self.layers
            if len(layers) == 1:
                if layers[0] in have:
                    s -= locality_bonus
            else:
                s -= locality_bonus * sum(1 for d in layers if d in have) / len(layers)
        return s

    def usage(self) -> dict[str, float]:
        """Requested totals as fractions of their caps and actual usage as fractions of the
        physical amounts (for reports and tests)."""
        return {
            "cpu_requested_of_cap": (self.cpu_requested + self.inflight_cpu) / self.cpu_cap,
            "memory_requested_of_cap": (self.memory_requested + self.inflight_memory)
            / self.memory_cap,
            "sandboxes_of_cap": (self.sandboxes + self.inflight_sandboxes) / self.max_sandboxes,
            "cpu_used": self.cpu_used / self.cpu_cores,
            "memory_used": self.memory_used / self.memory_bytes,
        }


def admits(node: NodeLoad, request: PlacementRequest) -> bool:
    """Admission check (the edge runs the same one before creating): the node is alive, serves
    the tier, has the disk, and stays within its caps on requested CPU, memory and count with
    this request added to its committed and in-flight totals."""
    return (
        not node.dead
        and node.cpu_requested + node.inflight_cpu + request.cpu <= node.cpu_cap
        and node.memory_requested + node.inflight_memory + request.memory_bytes <= node.memory_cap
        and node.sandboxes + node.inflight_sandboxes < node.max_sandboxes
        and request.disk_bytes <= node.disk_free_bytes
        and request.tier in node.tiers
    )


class Placer:
    """Chooses nodes for sandboxes. Not thread-safe: one placer per apiserver event loop.

    Args:
        nodes: the cluster's nodes (more can be added with :meth:`add_node`).
        k: candidates sampled per decision for ``power_of_k`` (2 = power of two choices);
            the other policies return at most k - 1 fallbacks.
        policy: ``power_of_k`` (sample k, pick the least loaded), ``random`` (first random
            node that admits), ``least_loaded`` (global minimum of the load score, from a
            lazy heap).
        overcommit: caps on requested totals.
        burst_threshold: regular-pool utilisation (0..1) from which burstable requests go to
            the burst pool.
        locality_bonus: score bonus (in load fraction) for a node holding all the layers.
        rng: random source (seed it for reproducible simulations).

    Example::

        placer = Placer([Node("n1", 192, 1536 << 30), Node("n2", 192, 1536 << 30)])
        req = PlacementRequest(cpu=0.5, memory_bytes=1 << 30, layers=("sha256:ab...",))
        decision = placer.place(req)
        placer.commit(placer.begin(decision.node_id, req))
    """

    def __init__(
        self,
        nodes: Iterable[Node],
        *,
        k: int = 2,
        policy: Policy = "power_of_k",
        overcommit: Overcommit | None = None,
        burst_threshold: float = 0.8,
        locality_bonus: float = 0.05,
        rng: random.Random | None = None,
    ) -> None:
        if k < 1:
            raise InvalidRequest("k must be >= 1", k=k)
        if policy not in ("power_of_k", "random", "least_loaded"):
            raise InvalidRequest(f"unknown placement policy {policy!r}", policy=policy)
        if not 0.0 <= burst_threshold <= 1.0:
            raise InvalidRequest("burst_threshold must be in [0, 1]", value=burst_threshold)
        self.k = k
        self.policy: Policy = policy
        self.overcommit = overcommit or Overcommit()
        self.burst_threshold = burst_threshold
        self.locality_bonus = locality_bonus
        self._rng = rng or random.Random()
        self._loads: list[NodeLoad] = []
        self._by_id: dict[str, NodeLoad] = {}
        # tier -> indices of live nodes serving it, per pool
        self._regular: dict[str, list[int]] = {}
        self._burst: dict[str, list[int]] = {}
        # layer digest -> indices of nodes holding it (may hold dead nodes; filtered on use)
        self._layer_nodes: dict[str, list[int]] = {}
        # regular-pool aggregates for the burst rule (incremental, O(1) per event)
        self._reg_cpu_cap = 0.0
        self._reg_mem_cap = 0.0
        self._reg_cpu_cores = 0.0
        self._reg_mem_bytes = 0.0
        self._reg_cpu_req = 0.0  # committed + in flight
        self._reg_mem_req = 0.0
        self._reg_cpu_used = 0.0
        self._reg_mem_used = 0.0
        # least_loaded only: lazy min-heap of (load_score, version, index); an entry is live
        # while its version equals _versions[index]. Every load change pushes a new entry.
        self._heap: list[tuple[float, int, int]] = []
        self._versions: list[int] = []
        self._track = policy == "least_loaded"
        self._last_score: float | None = None  # chosen node's score, set by _choose's fast path
        for node in nodes:
            self.add_node(node)

    # ----- membership -------------------------------------------------------------------

    def add_node(self, node: Node) -> None:
        """Add a node (or bring a dead one back with fresh, empty totals)."""
        old = self._by_id.get(node.node_id)
        if old is not None and not old.dead:
            raise InvalidRequest(f"node {node.node_id!r} already present", node=node.node_id)
        load = NodeLoad(node, self.overcommit, len(self._loads))
        self._loads.append(load)
        self._versions.append(0)
        self._by_id[node.node_id] = load
        for digest in load.layers:
            self._layer_nodes.setdefault(digest, []).append(load.index)
        if not load.burst:
            self._reg_cpu_cap += load.cpu_cores * self.overcommit.cpu
            self._reg_mem_cap += load.memory_bytes * self.overcommit.memory
            self._reg_cpu_cores += load.cpu_cores
            self._reg_mem_bytes += load.memory_bytes
        self._rebuild_pools()
        self._touch(load)

    def remove_node(self, node_id: str) -> None:
        """Forget a node (lost or drained): it is never chosen again; its totals leave the
        regular-pool aggregates. In-flight reservations on it can still be aborted. Idempotent.
        Its committed sandboxes are gone with it: do not ``release`` them."""
        load = self._load(node_id)
        if load.dead:
            return
        load.dead = True
        if not load.burst:
            self._reg_cpu_cap -= load.cpu_cores * self.overcommit.cpu
            self._reg_mem_cap -= load.memory_bytes * self.overcommit.memory
            self._reg_cpu_cores -= load.cpu_cores
            self._reg_mem_bytes -= load.memory_bytes
            self._reg_cpu_req -= load.cpu_requested + load.inflight_cpu
            self._reg_mem_req -= load.memory_requested + load.inflight_memory
            self._reg_cpu_used -= load.cpu_used
            self._reg_mem_used -= load.memory_used
        self._rebuild_pools()
        self._touch(load)

    def _rebuild_pools(self) -> None:
        self._regular = {}
        self._burst = {}
        for load in self._loads:
            if load.dead:
                continue
            pools = self._burst if load.burst else self._regular
            for tier in load.tiers:
                pools.setdefault(tier, []).append(load.index)

    def _touch(self, load: NodeLoad) -> None:
        """Record a load change in the least_loaded heap (no-op for the other policies)."""
        if not self._track:
            return
        version = self._versions[load.index] + 1
        self._versions[load.index] = version
        heap = self._heap
        heapq.heappush(heap, (load.load_score(), version, load.index))
        if len(heap) > 8 * len(self._loads) + 64:  # drop stale entries
            self._heap = [
                (x.load_score(), self._versions[x.index], x.index)
                for x in self._loads
                if not x.dead
            ]
            heapq.heapify(self._heap)

    def _load(self, node_id: str) -> NodeLoad:
        load = self._by_id.get(node_id)
        if load is None:
            raise NotFound(f"unknown node {node_id!r}", node=node_id)
        return load

    def node(self, node_id: str) -> NodeLoad:
        """The placer's view of one node (raises ``NotFound``)."""
        return self._load(node_id)

    @property
    def nodes(self) -> Sequence[NodeLoad]:
        """Every node's load, including removed ones (``dead=True``)."""
        return self._loads

    # ----- reports ----------------------------------------------------------------------

    def observe(self, node_id: str, usage: NodeUsage, layers: Iterable[str] = ()) -> None:
        """Record a usage report from ``node_id``'s edge. Requests placed before the report are
        now measured; only in-flight ones stay in the unmeasured estimate. ``layers`` adds
        digests the node now holds."""
        load = self._load(node_id)
        if not load.burst and not load.dead:
            self._reg_cpu_used += usage.cpu_used - load.cpu_used
            self._reg_mem_used += usage.memory_used - load.memory_used
        load.cpu_used = usage.cpu_used
        load.memory_used = usage.memory_used
        load.observed_sandboxes = usage.sandboxes
        if usage.disk_free_bytes is not None:
            load.disk_free_bytes = usage.disk_free_bytes
        load.unobserved_cpu = load.inflight_cpu
        load.unobserved_memory = load.inflight_memory
        for digest in layers:
            self._add_layer(load, digest)
        self._touch(load)

    def _add_layer(self, load: NodeLoad, digest: str) -> None:
        if digest not in load.layers:
            load.layers.add(digest)
            self._layer_nodes.setdefault(digest, []).append(load.index)

    @property
    def regular_utilisation(self) -> float:
        """Utilisation of the regular (non-burst) pool, 0..1: the largest of requested CPU and
        memory over their caps and used CPU and memory over the physical amounts."""
        if self._reg_cpu_cap <= 0:
            return 1.0
        return max(
            self._reg_cpu_req / self._reg_cpu_cap,
            self._reg_mem_req / self._reg_mem_cap,
            self._reg_cpu_used / self._reg_cpu_cores,
            self._reg_mem_used / self._reg_mem_bytes,
        )

    # ----- decisions --------------------------------------------------------------------

    def admits(self, node_id: str, request: PlacementRequest) -> bool:
        """Whether ``node_id`` admits ``request`` now (caps, tier, disk, alive)."""
        return admits(self._load(node_id), request)

    def place(self, request: PlacementRequest) -> Decision:
        """Choose a node and ordered fallbacks; nothing is reserved (call :meth:`begin`).

        Raises:
            TierUnavailable: no live node serves ``request.tier`` (in a pool it may use).
            QuotaExceeded: every such node is at one of its caps or out of disk.
        """
        self._last_score = None
        chosen, fallbacks = self._choose(request)
        score = self._last_score
        return Decision(
            node_id=chosen.node_id,
            fallbacks=tuple([f.node_id for f in fallbacks]),
            score=chosen.score(request, self.locality_bonus) if score is None else score,
            burst=chosen.burst,
        )

    def _pools(self, request: PlacementRequest) -> list[list[int]]:
        """Pools to try, in order. Burstable requests go to the burst pool first while the
        regular pool is at or above the threshold."""
        regular = self._regular.get(request.tier)
        if regular and not request.burstable:
            return [regular]
        burst = self._burst.get(request.tier) if request.burstable else None
        pools: list[list[int]] = []
        if burst and self.regular_utilisation >= self.burst_threshold:
            pools.append(burst)
        if regular:
            pools.append(regular)
        if not pools:
            if request.burstable and self._burst.get(request.tier):
                raise QuotaExceeded(
                    "the burst pool is closed: the regular pool is below the burst threshold "
                    "and has no node for this tier",
                    tier=request.tier,
                )
            raise TierUnavailable(f"no node serves tier {request.tier!r}", tier=request.tier)
        return pools

    def _choose(self, request: PlacementRequest) -> tuple[NodeLoad, list[NodeLoad]]:
        pools = self._pools(request)
        if self.policy == "least_loaded":
            return self._least_loaded(request, pools)
        loads = self._loads
        rand = self._rng.random
        k = self.k
        bonus = self.locality_bonus
        is_random = self.policy == "random"
        local = self._layer_nodes.get(request.layers[0]) if request.layers and bonus else None
        for pool in pools:
            n = len(pool)
            if is_random:  # the first admitting node of up to k x rounds random draws
                for _ in range(k * _SAMPLE_ROUNDS):
                    load = loads[pool[int(rand() * n)]]
                    if admits(load, request):
                        return load, self._random_fallbacks(request, pool, load)
            for _ in range(0 if is_random else _SAMPLE_ROUNDS):
                scored: list[tuple[float, int, NodeLoad]] = []
                for index in pool if n <= k else self._sample(pool, k):
                    load = loads[index]
                    if admits(load, request):
                        scored.append((load.score(request, bonus), index, load))
                if local:  # one extra candidate among the nodes holding the top layer
                    index = local[int(rand() * len(local))]
                    load = loads[index]
                    if (
                        load.burst == loads[pool[0]].burst
                        and admits(load, request)
                        and all(index != c[1] for c in scored)
                    ):
                        scored.append((load.score(request, bonus), index, load))
                if scored:
                    if len(scored) == 1:
                        self._last_score = scored[0][0]
                        return scored[0][2], []
                    scored.sort()
                    self._last_score = scored[0][0]
                    return scored[0][2], [c[2] for c in scored[1:]]
            # k x rounds samples all full: scan once to tell bad luck from a full pool
            free = [loads[i] for i in pool if admits(loads[i], request)]
            if free:
                if self.policy == "random":
                    pick = free[int(rand() * len(free))]
                    return pick, [f for f in free[: k + 1] if f is not pick][: k - 1]
                free.sort(key=lambda x: x.score(request, bonus))
                return free[0], free[1:k]
        raise QuotaExceeded(
            "every node serving this tier is at its overcommit caps",
            tier=request.tier,
            cpu=request.cpu,
            memory_bytes=request.memory_bytes,
        )

    def _sample(self, pool: list[int], k: int) -> list[int]:
        """k distinct random members of ``pool`` (``len(pool) > k``)."""
        rand = self._rng.random
        n = len(pool)
        first = pool[int(rand() * n)]
        if k == 1:
            return [first]
        second = pool[int(rand() * n)]
        while second == first:
            second = pool[int(rand() * n)]
        if k == 2:
            return [first, second]
        out = [first, second]
        while len(out) < k:
            index = pool[int(rand() * n)]
            if index not in out:
                out.append(index)
        return out

    def _random_fallbacks(
        self, request: PlacementRequest, pool: list[int], chosen: NodeLoad
    ) -> list[NodeLoad]:
        out: list[NodeLoad] = []
        rand = self._rng.random
        n = len(pool)
        for _ in range(self.k - 1):
            load = self._loads[pool[int(rand() * n)]]
            if load is not chosen and load not in out and admits(load, request):
                out.append(load)
        return out

    def _least_loaded(
        self, request: PlacementRequest, pools: list[list[int]]
    ) -> tuple[NodeLoad, list[NodeLoad]]:
        """The k admitting nodes of the first pool that has any, least ``load_score`` first
        (locality is ignored: this is the global-knowledge baseline). O(k log nodes) with the
        lazy heap, plus one pop per full node met."""
        loads = self._loads
        versions = self._versions
        heap = self._heap
        for pool in pools:
            burst = loads[pool[0]].burst
            found: list[NodeLoad] = []
            popped: list[tuple[float, int, int]] = []
            while heap and len(found) < self.k:
                entry = heapq.heappop(heap)
                _, version, index = entry
                load = loads[index]
                if version != versions[index] or load.dead:
                    continue  # stale entry: a newer one exists (or the node is gone)
                popped.append(entry)
                if load.burst == burst and admits(load, request):
                    found.append(load)
            for entry in popped:
                heapq.heappush(heap, entry)
            if found:
                return found[0], found[1:]
        raise QuotaExceeded(
            "every node serving this tier is at its overcommit caps",
            tier=request.tier,
            cpu=request.cpu,
            memory_bytes=request.memory_bytes,
        )

    # ----- in-flight overlay ------------------------------------------------------------

    def begin(self, node_id: str, request: PlacementRequest) -> Reservation:
        """Put ``request`` in flight on ``node_id``: it counts against caps and scores now.

        Raises:
            QuotaExceeded: the node does not admit the request (see :func:`admits`).
        """
        load = self._load(node_id)
        if not admits(load, request):
            raise QuotaExceeded(
                f"node {node_id!r} does not admit this request", node=node_id, tier=request.tier
            )
        self._begin(load, request)
        return Reservation(node_id, request, load=load)

    def _begin(self, load: NodeLoad, request: PlacementRequest) -> None:
        load.inflight_cpu += request.cpu
        load.inflight_memory += request.memory_bytes
        load.inflight_sandboxes += 1
        load.unobserved_cpu += request.cpu
        load.unobserved_memory += request.memory_bytes
        if not load.burst:
            self._reg_cpu_req += request.cpu
            self._reg_mem_req += request.memory_bytes
        if self._track:
            self._touch(load)

    def _end_inflight(self, reservation: Reservation) -> NodeLoad:
        if reservation.state != "in_flight":
            raise InvalidRequest(
                f"reservation already {reservation.state}", node=reservation.node_id
            )
        load = reservation.load or self._load(reservation.node_id)
        request = reservation.request
        load.inflight_cpu -= request.cpu
        load.inflight_memory -= request.memory_bytes
        load.inflight_sandboxes -= 1
        return load

    def commit(self, reservation: Reservation) -> None:
        """The edge admitted the sandbox: move it from in flight to the committed totals (the
        node now holds the request's layers).

        Raises:
            ServiceUnavailable: the node was removed while the sandbox was in flight (the
                reservation is dropped; place the sandbox again).
        """
        load = self._end_inflight(reservation)
        request = reservation.request
        if load.dead:
            reservation.state = "aborted"
            raise ServiceUnavailable(
                f"node {reservation.node_id!r} was lost while placing", node=reservation.node_id
            )
        reservation.state = "committed"
        load.cpu_requested += request.cpu
        load.memory_requested += request.memory_bytes
        load.sandboxes += 1
        for digest in request.layers:
            if digest not in load.layers:
                self._add_layer(load, digest)

    def abort(self, reservation: Reservation) -> None:
        """The edge rejected the sandbox (or creation failed): drop it from the overlay."""
        load = self._end_inflight(reservation)
        request = reservation.request
        reservation.state = "aborted"
        load.unobserved_cpu = max(0.0, load.unobserved_cpu - request.cpu)
        load.unobserved_memory = max(0, load.unobserved_memory - request.memory_bytes)
        if not load.burst and not load.dead:
            self._reg_cpu_req -= request.cpu
            self._reg_mem_req -= request.memory_bytes
        self._touch(load)

    def release(self, node_id: str, request: PlacementRequest) -> None:
        """A committed sandbox ended: remove its request from the node's totals. Its actual
        usage leaves the estimate with the node's next report."""
        load = self._load(node_id)
        if load.sandboxes <= 0:
            raise InvalidRequest(f"node {node_id!r} has no committed sandbox", node=node_id)
        load.cpu_requested -= request.cpu
        load.memory_requested -= request.memory_bytes
        load.sandboxes -= 1
        if not load.burst and not load.dead:
            self._reg_cpu_req -= request.cpu
            self._reg_mem_req -= request.memory_bytes
        self._touch(load)

    # ----- batches ----------------------------------------------------------------------

    def place_many(self, n: int, request: PlacementRequest) -> BatchPlacement:
        """Place ``n`` identical sandboxes, each put in flight as it is decided (so the batch
        spreads). Partial success is reported: ``placed`` holds the reservations (commit or
        abort each), ``failed`` one typed error per sandbox that found no node.

        Raises:
            InvalidRequest: ``n < 0``.
            TierUnavailable: no node serves the tier (nothing is reserved).
        """
        if n < 0:
            raise InvalidRequest("n must be >= 0", n=n)
        result = BatchPlacement()
        self._pools(request)  # TierUnavailable before anything is reserved
        choose = self._choose
        begin = self._begin
        placed = result.placed
        for i in range(n):
            try:
                load, _ = choose(request)
            except QuotaExceeded as exc:
                # identical requests: once none fits, none of the rest does either
                result.failed.extend(
                    QuotaExceeded(exc.message, index=j, **exc.details) for j in range(i, n)
                )
                break
            begin(load, request)
            placed.append(Reservation(load.node_id, request, load=load))
        return result
