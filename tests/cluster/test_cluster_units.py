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
from dsec.models import CreateSandboxRequest, MigrateRequest
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
    assert MigrateRequest(node=None).node is None
    with pytest.raises(ValueError):
        MigrateRequest(node="Bad Name")


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
    from dsec.edge.interface import (
        SANDBOX_VERBS,
        DisplayEdge,
        EdgeAPI,
        ImageBuilds,
        ImagePublisher,
        InteractiveExec,
        PauseModes,
        edge_verbs,
    )

    edge = ClusterEdge(None, NodeConfig(), ClusterOptions())
    for ability in (EdgeAPI, PauseModes, DisplayEdge, ImageBuilds, ImagePublisher):
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
        await actor.agent.pause_sandbox(a.id, owner)
        await actor.agent.kill_sandbox(b.id, owner)
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
