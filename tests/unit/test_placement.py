"""Placement engine: capability filter, caps, in-flight overlay, burst pool, policies (their
speed is measured by benchmarks/placement_sim.py)."""

from __future__ import annotations

import random
import sys

import pytest

from dsec.errors import (
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    ServiceUnavailable,
    TierUnavailable,
)
from dsec.placement import (
    Node,
    NodeUsage,
    Overcommit,
    PlacementRequest,
    Placer,
    admits,
)

GiB = 1 << 30


def nodes(n: int, *, cores: float = 8, mem: int = 16 * GiB, **kw: object) -> list[Node]:
    return [Node(f"n{i}", cores, mem, **kw) for i in range(n)]  # type: ignore[arg-type]


def fill(placer: Placer, request: PlacementRequest, n: int) -> list[str]:
    out = []
    for _ in range(n):
        d = placer.place(request)
        placer.commit(placer.begin(d.node_id, request))
        out.append(d.node_id)
    return out


def test_tier_filter_and_unknown_tier() -> None:
    placer = Placer(
        [Node("c", 8, 16 * GiB), Node("v", 8, 16 * GiB, tiers=frozenset({"vm", "container"}))],
        rng=random.Random(0),
    )
    for _ in range(20):
        assert placer.place(PlacementRequest(tier="vm")).node_id == "v"
    with pytest.raises(TierUnavailable):
        placer.place(PlacementRequest(tier="microvm"))
    with pytest.raises(TierUnavailable):
        placer.place_many(3, PlacementRequest(tier="microvm"))


def test_caps_on_requested_totals_then_quota_exceeded() -> None:
    # 2 nodes x 4 cores x 2.0 overcommit = 8 requested cores each -> 16 sandboxes of 1 core
    placer = Placer(
        nodes(2, cores=4, mem=64 * GiB),
        overcommit=Overcommit(cpu=2.0, memory=1.5),
        rng=random.Random(1),
    )
    req = PlacementRequest(cpu=1.0, memory_bytes=GiB)
    placed = fill(placer, req, 16)
    assert placed.count("n0") == 8 and placed.count("n1") == 8
    with pytest.raises(QuotaExceeded):
        placer.place(req)
    # a smaller request still fits nowhere on CPU, but releasing one frees a slot
    placer.release("n1", req)
    assert placer.place(req).node_id == "n1"


def test_memory_cap_and_max_sandboxes() -> None:
    placer = Placer(
        [Node("a", 100, 10 * GiB, max_sandboxes=3)],
        overcommit=Overcommit(cpu=10, memory=1.0),
        rng=random.Random(0),
    )
    fill(placer, PlacementRequest(cpu=0.1, memory_bytes=4 * GiB), 2)
    with pytest.raises(QuotaExceeded):  # 12 GiB > 10 GiB x 1.0
        placer.place(PlacementRequest(cpu=0.1, memory_bytes=4 * GiB))
    fill(placer, PlacementRequest(cpu=0.1, memory_bytes=GiB), 1)
    with pytest.raises(QuotaExceeded):  # count cap 3
        placer.place(PlacementRequest(cpu=0.1, memory_bytes=1 << 20))


def test_disk_filter_from_usage_report() -> None:
    placer = Placer(nodes(2), rng=random.Random(0))
    placer.observe("n0", NodeUsage(0.0, 0, 0, disk_free_bytes=GiB))
    req = PlacementRequest(cpu=0.1, disk_bytes=2 * GiB)
    assert {placer.place(req).node_id for _ in range(30)} == {"n1"}


def test_inflight_overlay_spreads_a_burst() -> None:
    """Without reports in between, in-flight placements must still spread evenly."""
    placer = Placer(nodes(10, cores=64, mem=512 * GiB), k=2, rng=random.Random(2))
    batch = placer.place_many(1000, PlacementRequest(cpu=0.5, memory_bytes=GiB))
    assert not batch.failed and len(batch.placed) == 1000
    counts = [placer.node(f"n{i}").inflight_sandboxes for i in range(10)]
    assert max(counts) - min(counts) <= 10, counts
    for r in batch.placed:
        placer.commit(r)
    assert sum(placer.node(f"n{i}").sandboxes for i in range(10)) == 1000
    assert all(placer.node(f"n{i}").inflight_sandboxes == 0 for i in range(10))


def test_begin_rejects_full_node_and_abort_frees_it() -> None:
    placer = Placer(
        nodes(1, cores=1), overcommit=Overcommit(cpu=1.0, memory=1.0), rng=random.Random(0)
    )
    req = PlacementRequest(cpu=1.0, memory_bytes=GiB)
    res = placer.begin("n0", req)
    assert not placer.admits("n0", req)
    with pytest.raises(QuotaExceeded):
        placer.begin("n0", req)
    placer.abort(res)
    assert placer.admits("n0", req)
    with pytest.raises(InvalidRequest):
        placer.commit(res)  # already aborted
    with pytest.raises(NotFound):
        placer.begin("nope", req)


def test_batch_partial_success_is_reported() -> None:
    placer = Placer(
        nodes(2, cores=2), overcommit=Overcommit(cpu=1.0, memory=10.0), rng=random.Random(0)
    )
    batch = placer.place_many(7, PlacementRequest(cpu=1.0, memory_bytes=GiB))
    assert len(batch.placed) == 4
    assert len(batch.failed) == 3 and all(isinstance(e, QuotaExceeded) for e in batch.failed)
    assert [e.details["index"] for e in batch.failed] == [4, 5, 6]
    for r in batch.placed:
        placer.abort(r)
    assert all(placer.node(n).inflight_sandboxes == 0 for n in ("n0", "n1"))


def test_scores_use_actual_usage_not_requests() -> None:
    placer = Placer(nodes(2, cores=10, mem=100 * GiB), k=2, rng=random.Random(0))
    req = PlacementRequest(cpu=1.0, memory_bytes=GiB)
    for _ in range(5):
        placer.commit(placer.begin("n0", req))  # n0: 5 cores requested
    placer.commit(placer.begin("n1", req))  # n1: 1 core requested
    # reports: n0's sandboxes idle, n1's one is busy
    placer.observe("n0", NodeUsage(cpu_used=0.1, memory_used=GiB, sandboxes=5))
    placer.observe("n1", NodeUsage(cpu_used=6.0, memory_used=GiB, sandboxes=1))
    assert placer.place(req).node_id == "n0"
    # before any report, unmeasured requests count in full
    fresh = Placer(nodes(2, cores=10, mem=100 * GiB), k=2, rng=random.Random(0))
    for _ in range(5):
        fresh.commit(fresh.begin("n0", req))
    assert fresh.place(req).node_id == "n1"


def test_layer_locality_bonus() -> None:
    placer = Placer(nodes(40, cores=64, mem=512 * GiB), k=2, rng=random.Random(3))
    img = PlacementRequest(cpu=0.5, memory_bytes=GiB, layers=("sha256:img",))
    placer.commit(placer.begin("n7", img))
    hits = sum(placer.place(img).node_id == "n7" for _ in range(100))
    assert hits >= 90  # the locality candidate is always considered and wins on near-equal load
    no_bonus = Placer(nodes(40, cores=64, mem=512 * GiB), locality_bonus=0.0, rng=random.Random(3))
    no_bonus.commit(no_bonus.begin("n7", img))
    assert sum(no_bonus.place(img).node_id == "n7" for _ in range(100)) <= 20


def test_burst_pool_only_for_burstable_and_only_above_threshold() -> None:
    pool = [*nodes(2, cores=4, mem=64 * GiB), Node("b0", 4, 64 * GiB, burst=True)]
    placer = Placer(
        pool, overcommit=Overcommit(cpu=1.0, memory=1.0), burst_threshold=0.75, rng=random.Random(0)
    )
    plain = PlacementRequest(cpu=1.0, memory_bytes=GiB)
    burstable = PlacementRequest(cpu=1.0, memory_bytes=GiB, burstable=True)
    # below threshold: burstable requests stay on the regular pool
    assert fill(placer, burstable, 5).count("b0") == 0
    assert placer.regular_utilisation == pytest.approx(5 / 8)
    fill(placer, plain, 1)  # 6/8 = 0.75: threshold reached
    assert fill(placer, burstable, 3) == ["b0"] * 3
    # the regular pool has room for 2 more; plain requests never reach the burst pool
    assert set(fill(placer, plain, 2)) <= {"n0", "n1"}
    with pytest.raises(QuotaExceeded):
        placer.place(plain)
    assert placer.place(burstable).node_id == "b0"
    # below the threshold again (releases), burstable requests return to the regular pool
    for _ in range(4):
        placer.release("n0", plain)
    assert placer.regular_utilisation < 0.75
    assert fill(placer, burstable, 2) == ["n0", "n0"]  # back to 6/8
    # a regular pool without this tier: the burst pool is closed below the threshold (typed)
    vm_burst = Node("bvm", 4, 64 * GiB, burst=True, tiers=frozenset({"vm"}))
    mixed = Placer([Node("r", 4, 64 * GiB), vm_burst], rng=random.Random(0))
    with pytest.raises(QuotaExceeded):
        mixed.place(PlacementRequest(tier="vm", burstable=True))
    with pytest.raises(TierUnavailable):
        mixed.place(PlacementRequest(tier="vm"))
    # no regular pool at all counts as full: burstable requests may use the burst nodes
    only_burst = Placer([Node("b", 4, 64 * GiB, burst=True)], rng=random.Random(0))
    assert only_burst.regular_utilisation == 1.0
    assert only_burst.place(burstable).node_id == "b"
    with pytest.raises(TierUnavailable):
        only_burst.place(plain)


@pytest.mark.parametrize("policy", ["power_of_k", "random", "least_loaded"])
def test_policies_fill_to_capacity_within_caps(policy: str) -> None:
    placer = Placer(
        nodes(8, cores=4, mem=64 * GiB),
        policy=policy,  # type: ignore[arg-type]
        k=3,
        overcommit=Overcommit(cpu=2.0, memory=1.5),
        rng=random.Random(4),
    )
    req = PlacementRequest(cpu=0.5, memory_bytes=GiB)
    fill(placer, req, 8 * 16)  # exactly full: 8 cores requested per node
    with pytest.raises(QuotaExceeded):
        placer.place(req)
    for load in placer.nodes:
        assert load.cpu_requested <= load.cpu_cap and load.sandboxes == 16
        assert admits(load, PlacementRequest(cpu=0.5, memory_bytes=GiB)) is False


def test_random_policy_is_not_biased_on_small_pools() -> None:
    placer = Placer(nodes(2), policy="random", k=2, rng=random.Random(6))
    picks = [placer.place(PlacementRequest(cpu=0.01)).node_id for _ in range(400)]
    assert 150 <= picks.count("n0") <= 250


def test_least_loaded_picks_global_minimum() -> None:
    placer = Placer(nodes(20, cores=10, mem=100 * GiB), policy="least_loaded", rng=random.Random(0))
    for i in range(20):
        placer.observe(f"n{i}", NodeUsage(cpu_used=9.0 - (i == 13) * 8, memory_used=0, sandboxes=0))
    d = placer.place(PlacementRequest(cpu=0.1))
    assert d.node_id == "n13" and len(d.fallbacks) == 1


def test_remove_node_and_add_back() -> None:
    placer = Placer(nodes(2), rng=random.Random(0))
    placer.remove_node("n0")
    assert {placer.place(PlacementRequest(cpu=0.1)).node_id for _ in range(20)} == {"n1"}
    placer.remove_node("n1")
    with pytest.raises(TierUnavailable):
        placer.place(PlacementRequest(cpu=0.1))
    placer.add_node(Node("n0", 8, 16 * GiB))
    assert placer.place(PlacementRequest(cpu=0.1)).node_id == "n0"
    with pytest.raises(InvalidRequest):
        placer.add_node(Node("n0", 8, 16 * GiB))


def test_node_lost_while_in_flight() -> None:
    placer = Placer(nodes(2), rng=random.Random(0))
    req = PlacementRequest(cpu=1.0)
    old = placer.begin("n0", req)
    placer.remove_node("n0")
    placer.remove_node("n0")  # idempotent
    with pytest.raises(ServiceUnavailable):
        placer.commit(old)
    assert old.state == "aborted"
    # a re-added node starts empty; a reservation from its old incarnation cannot touch it
    placer.add_node(Node("n0", 8, 16 * GiB))
    stale = placer.begin("n1", req)
    placer.remove_node("n1")
    placer.add_node(Node("n1", 8, 16 * GiB))
    placer.abort(stale)
    assert placer.node("n1").inflight_sandboxes == 0 and placer.node("n1").inflight_cpu == 0
    assert placer.regular_utilisation == 0.0


def test_bad_arguments_are_typed() -> None:
    with pytest.raises(InvalidRequest):
        Placer(nodes(1), k=0)
    with pytest.raises(InvalidRequest):
        Placer(nodes(1), policy="best")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        PlacementRequest(cpu=0)
    with pytest.raises(InvalidRequest):
        Overcommit(cpu=-1)
    with pytest.raises(InvalidRequest):
        Placer(nodes(1)).place_many(-1, PlacementRequest())


def test_twenty_thousand_decisions_on_160_nodes() -> None:
    """A batch of 20k decisions on 160 nodes places every one (its speed is measured by
    benchmarks/placement_sim.py, not asserted here)."""
    placer = Placer(
        [Node(f"n{i}", 192, 1500 * 10**9, max_sandboxes=4000) for i in range(160)],
        k=2,
        rng=random.Random(5),
    )
    req = PlacementRequest(cpu=0.5, memory_bytes=700 << 20, layers=("sha256:x",))
    batch = placer.place_many(20_000, req)
    assert len(batch.placed) == 20_000 and not batch.failed


def test_public_names_exported_and_documented() -> None:
    import dsec.placement

    for name in dsec.placement.__all__:
        obj = getattr(dsec.placement, name)
        if name != "Policy":  # a Literal alias
            assert obj.__doc__, name


def test_simulation_runs_small_and_keeps_caps() -> None:
    """The benchmark's simulator on a tiny cluster: it drives this engine and its own
    independent cap check finds no node over its caps."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "placement_sim.py"
    spec = importlib.util.spec_from_file_location("placement_sim", path)
    assert spec is not None and spec.loader is not None
    sim = importlib.util.module_from_spec(spec)
    sys.modules["placement_sim"] = sim  # dataclasses look their module up
    try:
        spec.loader.exec_module(sim)
    finally:
        del sys.modules["placement_sim"]
    cfg = sim.Config(
        nodes=4,
        cores=192,
        memory_bytes=1_500_000_000_000,
        max_sandboxes=4000,
        prefill=3000,
        burst=400,
        burst_at_s=5.0,
        duration_s=20.0,
        report_s=10.0,
        seed=1,
    )
    result = sim.run_policy("power-of-2", "power_of_k", 2, cfg, capacity=True)
    assert result["cap_violations"] == 0
    assert result["burst"]["placed"] == 400 and result["burst"]["nodes_used"] == 4
    assert result["peak_concurrent"] >= 3000
    full = result["fill_to_first_rejection"]["concurrent_at_first_rejection"]
    assert 4 * 2000 < full <= 4 * 4000  # memory cap binds well above the prefill
    assert result["max_node_fraction_of_cap"]["memory_requested"] <= 1.0
