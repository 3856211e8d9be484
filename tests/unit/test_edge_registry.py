"""The edge's registry stores each sandbox's request as a typed model (issue 33 step 3): rows
an older dsec wrote (its JSON, fields missing or unknown) still load, and a sandbox's info is
built from the typed request."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dsec.edge.registry import Registry, ResolvedRequest, SandboxRow
from dsec.models import CreateSandboxRequest, SandboxRef
from dsec.network.policy import NetworkPolicy
from dsec.testing import FakeEdge

OLD_REQUEST = {  # as an older dsec stored it: fewer fields, one this one no longer has
    "tier": "container",
    "image": "debian",
    "cpu": 0.5,
    "memory_mb": 256,
    "env": {"A": "1"},
    "workdir": None,
    "retired_field": 3,
}


def _old_row(db: Registry, sid: str, state: str = "stopped") -> None:
    now = time.time()
    with db._lock:
        db._db.execute(
            "INSERT INTO sandboxes (id, owner, tier, state, request, image_layers, created_at, "
            "updated_at, last_active) VALUES (?,?,?,?,?,?,?,?,?)",
            (sid, "k1", "container", state, json.dumps(OLD_REQUEST), "[]", now, now, now),
        )


def test_a_row_written_by_an_older_dsec_loads_with_defaults(tmp_path: Path) -> None:
    db = Registry(tmp_path / "state.db")
    _old_row(db, "sb-old-1")
    row = db.get("sb-old-1")
    assert row is not None and isinstance(row.request, ResolvedRequest)
    req, default = row.request, CreateSandboxRequest()
    assert (req.image, req.cpu, req.memory_mb, req.env) == ("debian", 0.5, 256, {"A": "1"})
    assert (req.disk_mb, req.pids, req.on_timeout) == (default.disk_mb, default.pids, "kill")
    assert req.workdir == "/"  # stored as null by a dsec that did not resolve it
    db.close()


def test_the_typed_request_is_stored_as_it_is(tmp_path: Path) -> None:
    db = Registry(tmp_path / "state.db")
    req = ResolvedRequest(
        image="debian",
        workdir="/work",
        user="1000",
        network=NetworkPolicy(allow_domains=["pypi.org"]),
        on_timeout="pause",
    )
    db.insert(SandboxRow("sb-new-1", "k1", "container", "running", req, ["sha256:" + "a" * 64]))
    row = db.get("sb-new-1")
    assert row is not None and row.request == req
    db.close()


async def test_info_of_an_old_row_comes_from_the_typed_request() -> None:
    edge = FakeEdge()
    _old_row(edge.registry, "sb-fake-old")
    info = await edge.get_sandbox(SandboxRef(sandbox_id="sb-fake-old"), "k1")
    default = CreateSandboxRequest()
    assert (info.image, info.cpu, info.memory_mb, info.workdir) == ("debian", 0.5, 256, "/")
    assert (info.disk_mb, info.pids, info.paused_ttl_s) == (
        default.disk_mb,
        default.pids,
        default.paused_ttl_s,
    )
    assert info.state == "stopped" and info.network is None and not info.public_ports
    await edge.close()


async def test_a_created_sandbox_row_holds_the_resolved_request() -> None:
    edge = FakeEdge()
    info = await edge.create_sandbox(CreateSandboxRequest(image="busybox", cpu=0.25), "k1")
    row = edge.registry.get(info.id)
    assert row is not None and isinstance(row.request, ResolvedRequest)
    assert row.request.cpu == 0.25 and row.request.workdir == info.workdir
    await edge.close()
