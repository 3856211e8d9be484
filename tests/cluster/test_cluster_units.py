"""Hermetic checks of the cluster pieces that need no Ray, database or root: sandbox-id
routing, the NodeLost wire shape, migration refused on a single-node server, simulated
node names and the edge's change feed for the registry."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.cluster import NodeLost, node_of_sandbox
from dsec.errors import SandboxNotFound, error_from_wire
from dsec.models import (
    BatchCreateRequest,
    CreateSandboxRequest,
    MigrateRequest,
    PauseRequest,
    SandboxRef,
)
from dsec.testing import FakeEdge

pytestmark = pytest.mark.cluster


def test_node_of_sandbox() -> None:
    assert node_of_sandbox("sb-w1-0123456789ab") == "w1"
    for bad in ("sb-w1", "xx-w1-01", "sb--01", "sb-a-b-c"):
        with pytest.raises(SandboxNotFound):
            node_of_sandbox(bad)


def test_node_lost_is_its_own_typed_error_and_a_sandbox_not_found() -> None:
    err = NodeLost("gone", sandbox_id="sb-w1-00", node="w1")
    wire = err.to_wire()
    assert wire["error"]["code"] == "node_lost" and err.http_status == 404
    back = error_from_wire(404, wire)
    assert isinstance(back, NodeLost) and isinstance(back, SandboxNotFound)
    assert back.details == {"sandbox_id": "sb-w1-00", "node": "w1"}


def test_migrate_request_validates_node_names() -> None:
    assert MigrateRequest(sandbox_id="sb-a-1", node=None).node is None
    with pytest.raises(ValueError):
        MigrateRequest(sandbox_id="sb-a-1", node="Bad Name")


async def test_migrate_on_a_single_node_server_is_refused() -> None:
    edge = FakeEdge()
    app = create_app(edge, StaticKeys(["dsec_key"]))
    owner = owner_id("dsec_key")
    info = await edge.create_sandbox(CreateSandboxRequest(), owner)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post(
            f"/v1/sandboxes/{info.id}/migrate",
            json={"node": "w2"},
            headers={"authorization": "Bearer dsec_key"},
        )
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "capability_not_supported"
        r = await c.post(
            "/v1/sandboxes/sb-nonode-000000000000/migrate",
            json={},
            headers={"authorization": "Bearer dsec_key"},
        )
        assert r.status_code == 404


def test_the_cluster_edge_relays_the_whole_contract() -> None:
    from dsec.cluster.actor import _CALLABLE, _STREAMING, NodeConfig
    from dsec.cluster.edge import _NODE_SIDE_VERBS, ClusterEdge, ClusterOptions
    from dsec.contract.edge import (
        SANDBOX_VERBS,
        DisplayEdge,
        EdgeAPI,
        ImageBuilds,
        ImagePublisher,
        InteractiveExec,
        edge_verbs,
    )

    edge = ClusterEdge(None, NodeConfig(), ClusterOptions())
    for ability in (EdgeAPI, DisplayEdge, ImageBuilds, ImagePublisher):
        assert isinstance(edge, ability), ability
    # an interactive process is a live object of its node: E2B falls back to exec streams
    assert not isinstance(edge, InteractiveExec)
    relayed = SANDBOX_VERBS - _NODE_SIDE_VERBS
    assert all(callable(getattr(edge, verb, None)) for verb in relayed)
    # an edge actor accepts exactly the contract's verbs: streams through its stream method
    assert _CALLABLE | _STREAMING == edge_verbs() and not _CALLABLE & _STREAMING
    assert {"exec_stream", "sandbox_logs", "build"} <= _STREAMING


def test_simulated_nodes_are_named_per_ray_node() -> None:
    from dsec.cluster.actor import NodeConfig, edge_names_of

    rn = {"NodeID": "ab" * 28, "Labels": {"dsec.io/node": "rack1-node7"}}
    assert edge_names_of(rn, NodeConfig()) == ["rack1node7"]
    names = edge_names_of(rn, NodeConfig(edges_per_node=3))
    assert names == ["rack1nod" + f"e{i}" for i in range(3)]
    assert all(node_of_sandbox(f"sb-{n}-0123456789ab") == n for n in names)


async def test_a_node_reports_only_what_changed_since_a_cursor(tmp_path: Any) -> None:
    """``EdgeActor.sandbox_changes`` (the registry sync of every report) over an in-memory
    edge: the whole list first, then only new, changed and gone sandboxes; a cursor of
    another incarnation of the actor gets the whole list again."""
    from dsec.cluster.actor import EdgeActor, NodeConfig
    from dsec.testing import memory_node_edge

    config = NodeConfig(node_root=str(tmp_path), edge_factory="dsec.testing:memory_node_edge")
    actor = EdgeActor("m1", config)
    actor.agent = memory_node_edge(tmp_path / "m1", "m1", config)
    await actor.agent.start()
    try:
        owner = owner_id("dsec_key")
        a = await actor.agent.create_sandbox(CreateSandboxRequest(cpu=0.01), owner)
        b = await actor.agent.create_sandbox(CreateSandboxRequest(cpu=0.01), owner)
        first = await actor.sandbox_changes(None)
        assert first["full"] and {i.id for _, i in first["changed"]} == {a.id, b.id}
        quiet = await actor.sandbox_changes(first["cursor"])
        assert not quiet["full"] and quiet["changed"] == [] and quiet["gone"] == []
        await actor.agent.pause_sandbox(PauseRequest(sandbox_id=a.id), owner)
        await actor.agent.kill_sandbox(SandboxRef(sandbox_id=b.id), owner)
        c = await actor.agent.create_sandbox(CreateSandboxRequest(cpu=0.01), owner)
        later = await actor.sandbox_changes(quiet["cursor"])
        assert not later["full"] and later["gone"] == [b.id]
        assert {(i.id, i.state) for _, i in later["changed"]} == {
            (a.id, "paused"),
            (c.id, "running"),
        }
        again = await actor.sandbox_changes(later["cursor"], True)  # the reconcile's ids
        assert again["changed"] == [] and sorted(again["live"]) == sorted([a.id, c.id])
        other = EdgeActor("m1", config)  # a restarted actor: its cursors are new
        other.agent = actor.agent
        assert (await other.sandbox_changes(later["cursor"]))["full"]
    finally:
        await actor.agent.close(kill_sandboxes=True)


class _FakeActor:
    """A Ray actor handle over an in-process :class:`EdgeActor` (``actor.method.remote(...)``
    answers an awaitable), recording every method called. ``dies`` lists methods that fail
    as Ray fails a call to an actor whose node died (``ActorDiedError``)."""

    def __init__(
        self, actor: Any, dies: frozenset[str] = frozenset(), slow: frozenset[str] = frozenset()
    ) -> None:
        self.actor = actor
        self.dies = dies
        self.slow = slow  # methods that answer only after an hour (a busy edge)
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        import asyncio
        from types import SimpleNamespace

        from ray.exceptions import ActorDiedError

        def remote(*args: Any) -> Any:
            self.calls.append(name if name != "call" else f"call:{args[0]}")

            async def run() -> Any:
                if name in self.dies:
                    raise ActorDiedError()
                if name in self.slow:
                    await asyncio.sleep(3600)
                return await getattr(self.actor, name)(*args)

            return asyncio.ensure_future(run())

        return SimpleNamespace(remote=remote)


async def _cluster_of(
    tmp_path: Any,
    names: list[str],
    dies: dict[str, frozenset[str]],
    slow: dict[str, frozenset[str]] | None = None,
    options: Any = None,
) -> Any:
    """A :class:`ClusterEdge` (no Ray, no registry) over in-memory edges ``names``."""
    from dsec.cluster.actor import EdgeActor, NodeConfig
    from dsec.cluster.edge import ClusterEdge, ClusterOptions
    from dsec.cluster.relay import NodeHandle
    from dsec.testing import memory_node_edge

    config = NodeConfig(node_root=str(tmp_path), edge_factory="dsec.testing:memory_node_edge")
    options = options or ClusterOptions(lost_after_s=5.0, report_interval_s=0.1)
    edge = ClusterEdge(None, config, options)
    for name in names:
        actor = EdgeActor(name, config)
        actor.agent = memory_node_edge(tmp_path / name, name, config)
        await actor.agent.start()
        fake = _FakeActor(actor, dies.get(name, frozenset()), (slow or {}).get(name, frozenset()))
        h = NodeHandle(name=name, ray_node_id=name * 8, actor=fake)
        h.report = await actor.report()
        edge.nodes[name] = h
    edge.placement.rebuild(edge._alive())
    return edge


async def _close(edge: Any) -> None:
    for h in edge.nodes.values():
        await h.actor.actor.agent.close(kill_sandboxes=True)


def _created(edge: Any) -> int:
    return sum(
        c in ("create_each", "call:create_sandbox", "call:create_sandboxes")
        for h in edge.nodes.values()
        for c in h.actor.calls
    )


async def test_concurrent_single_creations_share_actor_calls(tmp_path: Any) -> None:
    """Single creations arriving while others are in flight go to the edges together (one
    call per node for each group), each keeping its own answer: one asking for an image
    nobody has fails alone."""
    import asyncio

    from dsec.errors import ImageNotFound

    edge = await _cluster_of(tmp_path, ["m1", "m2", "m3"], {})
    try:
        owner = owner_id("dsec_key")
        reqs = [CreateSandboxRequest(cpu=0.01) for _ in range(40)]
        reqs[17] = CreateSandboxRequest(cpu=0.01, image="nosuchimage")
        outs = await asyncio.gather(
            *(edge.create_sandbox(r, owner) for r in reqs), return_exceptions=True
        )
        assert isinstance(outs[17], ImageNotFound)
        made = [o for i, o in enumerate(outs) if i != 17]
        assert all(not isinstance(o, BaseException) for o in made), made
        assert len({o.id for o in made}) == 39  # type: ignore[union-attr]
        assert _created(edge) <= 10  # 40 one by one before
        live = sum(h.actor.actor.agent.usage().sandboxes for h in edge.nodes.values())
        assert live == 39
        lone = await edge.create_sandbox(CreateSandboxRequest(cpu=0.01), owner)  # not delayed
        assert lone.state == "running"
    finally:
        await _close(edge)


async def _dies_soon(edge: Any, name: str) -> None:
    """What the monitor does when Ray's node table says ``name`` is dead."""
    import asyncio

    await asyncio.sleep(0.3)
    h = edge.nodes[name]
    h.ray_dead = True
    await edge._mark_lost(h, "node lost (Ray reported the node dead)")


async def test_a_batch_placed_on_a_node_that_dies_is_placed_again(tmp_path: Any) -> None:
    """A node dies with a batch's call in flight (Ray fails the call, then reports the node
    dead): its items are created on the remaining nodes, the client sees no error, and
    nothing is made twice."""
    import asyncio

    dead = frozenset({"call", "create_each", "ping"})
    edge = await _cluster_of(tmp_path, ["m1", "m2", "m3"], {"m3": dead})
    try:
        owner = owner_id("dsec_key")
        death = asyncio.create_task(_dies_soon(edge, "m3"))
        res = await edge.create_sandboxes(
            BatchCreateRequest(n=60, sandbox=CreateSandboxRequest(cpu=0.01)), owner
        )
        await death
        assert res.errors == [] and len(res.sandboxes) == 60
        assert {node_of_sandbox(i.id) for i in res.sandboxes} == {"m1", "m2"}
        assert "call:create_sandboxes" in edge.nodes["m3"].actor.calls  # it was tried there
        live = sum(edge.nodes[n].actor.actor.agent.usage().sandboxes for n in ("m1", "m2"))
        assert live == 60 and len({i.id for i in res.sandboxes}) == 60
        singles = await asyncio.gather(
            *(edge.create_sandbox(CreateSandboxRequest(cpu=0.01), owner) for _ in range(10))
        )
        assert all(node_of_sandbox(i.id) != "m3" for i in singles)
    finally:
        await _close(edge)


async def test_single_creations_on_a_node_that_dies_are_placed_again(tmp_path: Any) -> None:
    import asyncio

    from dsec.placement import NodeUsage

    dead = frozenset({"call", "create_each", "ping"})
    edge = await _cluster_of(tmp_path, ["m1", "m3"], {"m3": dead})
    try:
        edge.placer.observe("m1", NodeUsage(cpu_used=250.0, memory_used=0, sandboxes=0))
        owner = owner_id("dsec_key")
        death = asyncio.create_task(_dies_soon(edge, "m3"))
        made = await asyncio.gather(
            *(edge.create_sandbox(CreateSandboxRequest(cpu=0.01), owner) for _ in range(12))
        )
        await death
        assert edge.nodes["m3"].actor.calls  # tried there first
        assert {node_of_sandbox(i.id) for i in made} == {"m1"}
        assert edge.nodes["m1"].actor.actor.agent.usage().sandboxes == 12
    finally:
        await _close(edge)


async def test_a_call_to_a_restarting_edge_is_not_placed_again(tmp_path: Any) -> None:
    """A call Ray failed on a node whose edge then answers (a restarted edge may have made
    the sandboxes): its items fail with the retryable ``unavailable``, never made twice."""
    edge = await _cluster_of(tmp_path, ["m1", "m3"], {"m3": frozenset({"call"})})
    try:
        owner = owner_id("dsec_key")
        res = await edge.create_sandboxes(
            BatchCreateRequest(n=40, sandbox=CreateSandboxRequest(cpu=0.01)), owner
        )
        on_m3 = 40 - len(res.sandboxes)
        assert on_m3 > 0 and {e.code for e in res.errors} == {"unavailable"}
        assert edge.nodes["m1"].actor.actor.agent.usage().sandboxes == len(res.sandboxes)
    finally:
        await _close(edge)


async def test_a_busy_edge_is_not_lost_and_a_failing_one_is(tmp_path: Any) -> None:
    """An edge whose reports go unanswered while Ray has its node alive is busy, not lost
    (losing it kills its actor and every sandbox there: the N=64 cell's job lost ~13,000
    so): it leaves placement and keeps its sandboxes. One whose reports fail is lost after
    ``lost_after_s``."""
    import asyncio
    import time

    from dsec.cluster.edge import ClusterOptions

    options = ClusterOptions(probe_timeout_s=0.05, lost_after_s=0.2, hung_after_s=60.0)
    edge = await _cluster_of(
        tmp_path,
        ["m1", "m2", "m3"],
        {"m3": frozenset({"report"})},
        slow={"m2": frozenset({"report"})},
        options=options,
    )
    try:
        owner = owner_id("dsec_key")
        on_m2 = await edge.nodes["m2"].actor.actor.agent.create_sandbox(
            CreateSandboxRequest(cpu=0.01), owner
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.6:
            await asyncio.gather(*(edge._collect(h) for h in edge._alive()))
        assert edge.nodes["m2"].state == "alive" and edge.nodes["m3"].state == "lost"
        edge.placement.rebuild(edge._alive())
        assert [x.node_id for x in edge.placer.nodes if not x.dead] == ["m1"]
        made = await edge.create_sandboxes(
            BatchCreateRequest(n=10, sandbox=CreateSandboxRequest(cpu=0.01)), owner
        )
        assert {node_of_sandbox(i.id) for i in made.sandboxes} == {"m1"}
        info = await edge.get_sandbox(
            SandboxRef(sandbox_id=on_m2.id), owner
        )  # its sandboxes still answer
        assert info.state == "running"
    finally:
        await _close(edge)


class _Registry:
    """The registry's writes a replica makes (``ClusterState``'s, in memory): rows by id."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str, str | None]] = {}  # id -> node, state, reason

    def record_sandboxes(self, items: list[tuple[str, Any]]) -> None:
        for _owner, info in items:
            self.rows[info.id] = (info.node, info.state, info.stopped_reason)

    def mark_node_lost(self, name: str, reason: str) -> int:
        live = [k for k, (n, st, _) in self.rows.items() if n == name and st != "stopped"]
        for k in live:
            self.rows[k] = (name, "stopped", reason)
        return len(live)


async def test_a_creation_answered_by_a_node_lost_before_its_write_is_written_stopped(
    tmp_path: Any,
) -> None:
    """m2 answers its part of a batch, then dies with m3 while the batch waits to learn
    m3's fate: m2's sandboxes reach the registry after the loss stopped m2's rows, and
    are written stopped (written running, they outlived their node in the registry: the
    N=16 fault run's 59 rows)."""
    import asyncio

    dead = frozenset({"call", "create_each", "ping"})
    edge = await _cluster_of(tmp_path, ["m1", "m2", "m3"], {"m3": dead})
    edge.state = registry = _Registry()
    edge.relay.state = None  # unknown nodes: no registry lookup

    async def both_die() -> None:
        await asyncio.sleep(0.3)
        for name in ("m2", "m3"):
            h = edge.nodes[name]
            h.ray_dead = True
            await edge._mark_lost(h, "node lost (Ray reported the node dead)")

    try:
        owner = owner_id("dsec_key")
        death = asyncio.create_task(both_die())
        res = await edge.create_sandboxes(
            BatchCreateRequest(n=60, sandbox=CreateSandboxRequest(cpu=0.01)), owner
        )
        await death
        on_m2 = [i.id for i in res.sandboxes if node_of_sandbox(i.id) == "m2"]
        assert on_m2 and not res.errors
        assert {registry.rows[i][1] for i in on_m2} == {"stopped"}
        assert all((registry.rows[i][2] or "").startswith("node lost") for i in on_m2)
        others = [i.id for i in res.sandboxes if node_of_sandbox(i.id) == "m1"]
        assert {registry.rows[i][1] for i in others} == {"running"}
    finally:
        await _close(edge)


async def test_coalesced_creations_a_node_refuses_go_elsewhere(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coalesced creations the chosen node's edge refuses (its own caps: here it admits
    nothing) are created on another node, each once; the refusals are counted."""
    import asyncio

    monkeypatch.setenv("DSEC_MAX_SANDBOXES", "0")  # the edges built now: m2 below
    edge = await _cluster_of(tmp_path, ["m2"], {})
    monkeypatch.delenv("DSEC_MAX_SANDBOXES")
    other = await _cluster_of(tmp_path, ["m1"], {})
    edge.nodes["m1"] = other.nodes["m1"]
    edge.nodes["m2"].report["max_sandboxes"] = 1000  # the placer believes it has room
    edge.placement.rebuild(edge._alive())
    try:
        owner = owner_id("dsec_key")
        made = await asyncio.gather(
            *(edge.create_sandbox(CreateSandboxRequest(cpu=0.01), owner) for _ in range(30))
        )
        assert {node_of_sandbox(i.id) for i in made} == {"m1"} and len({i.id for i in made}) == 30
        assert edge.nodes["m1"].actor.actor.agent.usage().sandboxes == 30
        assert "create_each" in edge.nodes["m2"].actor.calls and edge.rejections_retried > 0
    finally:
        await _close(edge)


async def test_a_coalesced_call_that_breaks_answers_every_creation(tmp_path: Any) -> None:
    """A coalesced call whose answer cannot be read fails each of its creations with an
    internal error: none waits forever."""
    import asyncio

    from dsec.errors import InternalError

    edge = await _cluster_of(tmp_path, ["m1"], {})
    actor = edge.nodes["m1"].actor.actor

    async def garbled(items: list[Any]) -> Any:
        return ("ok", "not a list of answers")

    actor.create_each = garbled
    try:
        owner = owner_id("dsec_key")
        outs = await asyncio.wait_for(
            asyncio.gather(
                *(edge.create_sandbox(CreateSandboxRequest(cpu=0.01), owner) for _ in range(6)),
                return_exceptions=True,
            ),
            10,
        )
        assert all(isinstance(o, InternalError) for o in outs), outs
    finally:
        await _close(edge)


async def test_image_and_network_verbs_of_the_table_through_the_cluster(tmp_path: Any) -> None:
    """The table's image verbs answer from one node or act on every node, its network verbs
    are relayed to the sandbox's node by their requests; another key's image or sandbox is
    not found, and a sandbox without a network answers only ``{"enabled": false}``."""
    edge = await _cluster_of(tmp_path, ["m1", "m2"], {})
    keys = ["dsec_key_a", "dsec_key_b"]
    app = create_app(edge, StaticKeys(keys))
    owner = owner_id(keys[0])
    stores = [h.actor.actor.agent.layers for h in edge.nodes.values()]
    for store in stores:
        store.put_image("app:1", store.get_image("busybox").layers, owner=owner)
    transport = httpx.ASGITransport(app=app)

    def client(key: str) -> httpx.AsyncClient:
        auth = {"authorization": f"Bearer {key}"}
        return httpx.AsyncClient(transport=transport, base_url="http://d", headers=auth)

    async with client(keys[0]) as a, client(keys[1]) as b:
        try:
            assert (await a.get("/v1/images/app:1")).json()["owner"] == owner
            assert (await b.get("/v1/images/app:1")).status_code == 404
            assert "app:1" in {i["name"] for i in (await a.get("/v1/images")).json()["images"]}
            assert (await a.get("/v1/layers")).json()["layers"]
            r = await a.patch("/v1/images/app:1", json={"shared": True})
            assert r.status_code == 200 and r.json()["shared"], r.text
            assert all(s.get_image("app:1", owner).shared for s in stores)  # every node
            assert (await b.delete("/v1/images/app:1")).status_code == 404
            assert (await a.delete("/v1/images/app:1")).status_code == 204
            assert (await a.get("/v1/images/app:1")).status_code == 404

            r = await a.post("/v1/sandboxes", json={"image": "busybox"})
            bare = r.json()["id"]
            r = await a.post(
                "/v1/sandboxes", json={"image": "busybox", "network": {"presets": ["npm"]}}
            )
            netted = r.json()["id"]
            assert (await a.get(f"/v1/sandboxes/{bare}/network")).json() == {"enabled": False}
            r = await a.post(f"/v1/sandboxes/{netted}/network", json={"presets": ["pypi"]})
            assert r.status_code == 200 and r.json()["network"]["presets"] == ["pypi"], r.text
            stats = (await a.get(f"/v1/sandboxes/{netted}/network")).json()
            assert stats["enabled"] is True and stats["policy"]["presets"] == ["pypi"]
            for sid in (bare, netted):
                assert (await b.get(f"/v1/sandboxes/{sid}/network")).status_code == 404
                r = await b.post(f"/v1/sandboxes/{sid}/network", json={"presets": ["pypi"]})
                assert r.status_code == 404
        finally:
            await _close(edge)
