"""Batch creation on a real node: ``Sandbox.create_many`` makes real container sandboxes in
one call, a full node reports the ones that did not fit, and all_or_nothing leaves nothing."""

from __future__ import annotations

import pytest

import dsec.errors as E
from dsec import Sandbox

pytestmark = [pytest.mark.root]


def _alive(live_server) -> set[str]:  # type: ignore[no-untyped-def]
    return {s.id for s in Sandbox.list(url=live_server.url, api_key=live_server.api_key)}


def test_create_many_real_containers(live_server) -> None:  # type: ignore[no-untyped-def]
    conn = {"url": live_server.url, "api_key": live_server.api_key}
    before = _alive(live_server)
    with Sandbox.create_many(6, image="busybox", memory_mb=64, labels={"b": "1"}, **conn) as b:
        assert b.ok, b.errors
        assert len({sb.id for sb in b}) == 6
        for i, sb in enumerate(b):
            sb.files.write("/tmp/i", str(i))
            assert sb.commands.run("cat /tmp/i").stdout == str(i)  # each its own rootfs
    assert _alive(live_server) == before


def test_full_node_partial_and_all_or_nothing(live_server) -> None:  # type: ignore[no-untyped-def]
    conn = {"url": live_server.url, "api_key": live_server.api_key}
    limits = live_server.edge.limits
    saved = limits.max_sandboxes
    before = _alive(live_server)
    holders = Sandbox.create_many(2, image="busybox", memory_mb=64, **conn)
    assert holders.ok
    # room for 3 more; a batch of 5 fits the node's limit but not its free room
    limits.max_sandboxes = len(live_server.edge._live) + 3
    try:
        b = Sandbox.create_many(5, image="busybox", memory_mb=64, **conn)
        try:
            assert len(b.sandboxes) == 3 and len(b.errors) == 2
            assert {e.code for e in b.errors} == {"quota_exceeded"}
            assert all(sb.commands.run("echo ok").stdout == "ok\n" for sb in b)
        finally:
            assert b.kill_all() == 3
        with pytest.raises(E.QuotaExceeded):
            Sandbox.create_many(5, image="busybox", all_or_nothing=True, **conn)
        with pytest.raises(E.QuotaExceeded, match="can ever hold"):
            Sandbox.create_many(limits.max_sandboxes + 1, image="busybox", **conn)
        holders.kill_all()
        assert _alive(live_server) == before
    finally:
        limits.max_sandboxes = saved
