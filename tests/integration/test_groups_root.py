"""Shared forks and sandbox groups on a real node (root): children stacked on the parent's
frozen writable layer are independent of each other and of the parent, the frozen layer
goes when the last of them does, the parent modes, snapshots and exports of a forked child,
and another key's view of a group."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec import AsyncSandbox, Sandbox
from dsec.privileged.mount import mount_points

pytestmark = [pytest.mark.root]

SETUP = [
    "mkdir -p /data && echo parent > /data/who",
    "head -c 1048576 /dev/urandom > /data/blob && md5sum /data/blob > /data/blob.md5",
    "rm /bin/ls",  # a whiteout in the frozen layer: the image's file stays deleted
    "mkdir -p /srv/opaque && echo new > /srv/opaque/f",
    "echo 0123456789abcdef0123456789abcdef > /etc/machine-id",
]


@pytest.fixture(autouse=True)
def _container_tier(live_server: Any) -> None:
    """A node without the container tier (a host of the matrix that dsec refuses, e.g. v1
    without a v1 memory controller) is skipped with the tier's own reason, not failed on a
    missing runtime; the matrix counts such a skip as a failure."""
    if "container" not in live_server.edge.runtimes:
        why = live_server.edge.unavailable.get("container", "not enabled")
        pytest.skip(f"the container tier is unavailable on this node: {why}")


def _conn(live_server: Any) -> dict[str, str]:
    return {"url": live_server.url, "api_key": live_server.api_key}


def _runtime(live_server: Any) -> Any:
    return live_server.edge.runtimes["container"]


def _out(sb: Sandbox, cmd: str) -> str:
    r = sb.commands.run(cmd)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return str(r.stdout)


def _frozen_after_settle(live_server: Any) -> tuple[dict[str, int], list[Any]]:
    live_server.call(live_server.edge.settle())
    rt = _runtime(live_server)
    return rt.frozen_layers(), mount_points(rt._frozen_root())


def test_group_children_are_independent(live_server: Any) -> None:
    before = _frozen_after_settle(live_server)[0]
    with Sandbox.create_group(
        4, image="busybox", memory_mb=64, setup=SETUP, keep_parent=True, **_conn(live_server)
    ) as group:
        assert len(group) == 4 and group.method == "shared"
        parent = group.parent
        assert parent is not None
        ids = {sb.id for sb in group}
        assert len(ids) == 4 and parent.id not in ids
        for sb in group:  # the set-up as the parent left it, whiteouts included
            assert _out(sb, "cat /data/who") == "parent\n"
            assert _out(sb, "cd /data && md5sum -c blob.md5").strip().endswith("OK")
            assert sb.commands.run("test -e /bin/ls").exit_code == 1
            assert _out(sb, "cat /srv/opaque/f") == "new\n"
        # a write in one child is seen by no sibling nor the parent
        first, *others = list(group)
        _out(first, "echo child0 > /data/who && rm /data/blob && touch /data/only-0")
        for sb in [*others, parent]:
            assert _out(sb, "cat /data/who") == "parent\n"
            assert sb.commands.run("test -e /data/only-0").exit_code == 1
            assert sb.commands.run("test -e /data/blob").exit_code == 0
        assert _out(first, "cat /data/who") == "child0\n"
        # ... and a write in the (restarted) parent by no child
        _out(parent, "echo parent2 > /data/who")
        assert all(_out(sb, "cat /data/who") == "parent\n" for sb in others)
        # each child its own hostname, boot id and entropy
        hosts = [_out(sb, "hostname") for sb in group]
        boots = [_out(sb, "cat /proc/sys/kernel/random/boot_id") for sb in group]
        rand = [_out(sb, "head -c 16 /dev/urandom | od -An -tx1") for sb in group]
        ids_ = [_out(sb, "cat /etc/machine-id") for sb in group]  # the image has one now
        for values in (hosts, boots, rand, ids_):
            assert len(set(values)) == 4, values
        assert "0123456789abcdef0123456789abcdef\n" not in ids_
        assert _out(parent, "cat /etc/machine-id") == "0123456789abcdef0123456789abcdef\n"
        assert len(_frozen_after_settle(live_server)[0]) == len(before) + 1
    frozen, mounts = _frozen_after_settle(live_server)
    assert frozen == before and not mounts, (frozen, mounts)
    gone = {*ids, parent.id}
    assert not [p for p in mount_points(live_server.home / "sandboxes") if gone & set(p.parts)]
    assert not [d for d in gone if (live_server.home / "sandboxes" / d).exists()]


def test_frozen_layer_lives_until_the_last_child(live_server: Any) -> None:
    conn = _conn(live_server)
    before = _frozen_after_settle(live_server)[0]
    sb = Sandbox.create(image="busybox", memory_mb=64, **conn)
    _out(sb, "echo hello > /f")
    a, b = sb.fork(2, parent="pause")
    sb.kill()  # the parent goes first: the children still read its layer
    assert _out(a, "cat /f") == "hello\n"
    assert len(_frozen_after_settle(live_server)[0]) == len(before) + 1
    a.kill()
    assert _out(b, "cat /f") == "hello\n"
    b.kill()
    frozen, mounts = _frozen_after_settle(live_server)
    assert frozen == before and not mounts


def test_parent_modes(live_server: Any) -> None:
    conn = _conn(live_server)
    sb = Sandbox.create(image="busybox", memory_mb=64, **conn)
    try:
        _out(sb, "echo v1 > /f")
        boot = _out(sb, "cat /proc/sys/kernel/random/boot_id")
        # keep (default): a packed fork, the parent runs on with its processes
        _out(sb, "sleep 600 >/dev/null 2>&1 &")
        (kept,) = sb.fork(1)
        assert Sandbox.connect(sb.id, **conn).info.state == "running"
        assert "sleep" in _out(sb, "cat /proc/[0-9]*/comm") and _out(kept, "cat /f") == "v1\n"
        kept.kill()
        with pytest.raises(E.InvalidRequest):
            sb.fork(1, method="shared")  # a shared fork takes the parent's writable layer
        # pause: the parent is paused; its next request restarts it, files kept
        (child,) = sb.fork(1, parent="pause")
        assert Sandbox.connect(sb.id, **conn).info.state == "paused"
        assert _out(sb, "cat /f") == "v1\n"
        assert _out(sb, "cat /proc/sys/kernel/random/boot_id") != boot  # a new boot
        _out(sb, "echo v2 > /f")
        assert _out(child, "cat /f") == "v1\n"
        # continue: restarted at once, over both frozen layers
        (child2,) = sb.fork(1, parent="continue")
        assert Sandbox.connect(sb.id, **conn).info.state == "running"
        assert _out(sb, "cat /f") == "v2\n" and _out(child2, "cat /f") == "v2\n"
        _out(sb, "echo v3 > /f")
        assert (_out(child, "cat /f"), _out(child2, "cat /f")) == ("v1\n", "v2\n")
        # a fork of a fork stacks both layers; the pack method still works
        (grandchild,) = child2.fork(1, method="pack")
        assert _out(grandchild, "cat /f") == "v2\n"
        for s in (child, child2, grandchild):
            s.kill()
    finally:
        sb.kill()


def test_snapshot_and_export_of_a_forked_child(live_server: Any) -> None:
    conn = _conn(live_server)
    sb = Sandbox.create(image="busybox", memory_mb=64, **conn)
    restored: list[Any] = []
    try:
        for cmd in SETUP:
            _out(sb, cmd)
        (child,) = sb.fork(1, parent="pause")
        _out(child, "echo mine > /data/child && echo c > /data/who")
        layer = child.snapshot()
        new = Sandbox.create(image="busybox", layers=[layer.digest], memory_mb=64, **conn)
        restored.append(new)
        edge = live_server.edge
        owner = edge._live[child.id].row.owner
        export = live_server.call(edge.export_sandbox(child.id, owner))
        info = live_server.call(
            edge.import_sandbox(
                export["request"], owner, export["image_layers"], export["diff_layer"].digest
            )
        )
        moved = Sandbox.connect(info.id, **conn)
        restored.append(moved)
        # two generations of frozen layers: a fork of the child, which deletes and adds
        (grand,) = child.fork(1, parent="pause")
        _out(grand, "rm -r /srv/opaque && mkdir /srv/opaque && echo g > /srv/opaque/g")
        _out(grand, "rm /data/blob.md5 && echo g > /data/grand")
        grand_layer = grand.snapshot()
        third = Sandbox.create(image="busybox", layers=[grand_layer.digest], memory_mb=64, **conn)
        restored.append(third)
        for s in (new, moved):  # the frozen layer and the child's own, in one layer
            assert _out(s, "cat /data/child /data/who") == "mine\nc\n"
            assert _out(s, "cd /data && md5sum -c blob.md5").strip().endswith("OK")
            assert s.commands.run("test -e /bin/ls").exit_code == 1
            assert _out(s, "cat /srv/opaque/f") == "new\n"
        assert _out(third, "cat /data/child /data/who /data/grand") == "mine\nc\ng\n"
        assert _out(third, "ls /srv/opaque") == "g\n"
        assert third.commands.run("test -e /data/blob.md5 || test -e /bin/ls").exit_code == 1
        assert _out(third, "test -e /data/blob && echo yes") == "yes\n"
        for s in (grand, child):
            s.kill()
    finally:
        for s in restored:
            s.kill()
        sb.kill()


def test_bad_input_and_another_key(live_server: Any) -> None:
    conn = _conn(live_server)
    for n in (0, 257, -1):
        with pytest.raises(E.InvalidRequest):
            Sandbox.create_group(n, image="busybox", **conn)
    with pytest.raises(ValueError):
        Sandbox.create_group(0, image="busybox", **conn)
    with Sandbox.create_group(2, image="busybox", memory_mb=64, **conn) as group:
        sid = group[0].id
        h = {"authorization": f"Bearer {live_server.api_key}"}
        with httpx.Client(base_url=live_server.url, headers=h, timeout=60) as own:
            for body in ({"n": 0}, {"n": 1000}, {"n": 1, "method": "x"}, {"n": 1, "parent": "y"}):
                r = own.post(f"/v1/sandboxes/{sid}/fork", json=body)
                assert r.status_code == 400, r.text
            r = own.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1, "method": "shared",
                                                            "scrub": ["/tmp"]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        other = live_server.keys.create_key("groups-other")
        h = {"authorization": f"Bearer {other}"}
        with httpx.Client(base_url=live_server.url, headers=h, timeout=60) as bob:
            for sb in group:
                r = bob.post(f"/v1/sandboxes/{sb.id}/fork", json={"n": 1})
                assert r.status_code == 404, r.text
                assert bob.get(f"/v1/sandboxes/{sb.id}").status_code == 404
            assert bob.post(f"/v1/jobs/{group.job}/kill").json()["outcomes"] == {}
        with pytest.raises(E.SandboxNotFound):
            Sandbox.connect(sid, url=live_server.url, api_key=other)
        assert all(sb.commands.run("true").exit_code == 0 for sb in group)  # untouched


def test_group_is_a_job_and_async(live_server: Any) -> None:
    conn = _conn(live_server)

    async def setup(sb: AsyncSandbox) -> None:
        await sb.files.write("/set-up", b"by a function")

    async def main() -> None:
        async with await AsyncSandbox.create_group(
            3, image="busybox", memory_mb=64, setup=setup, **conn
        ) as group:
            assert len(group) == 3
            outs = await asyncio.gather(*(sb.files.read("/set-up") for sb in group))
            assert outs == [b"by a function"] * 3
            paused = await group.pause()
            assert paused.ok and len(paused.outcomes) == 3
            resumed = await group.resume()
            assert resumed.ok and len(resumed.outcomes) == 3
            r = await group[1].commands.run("cat /set-up")
            assert r.stdout == "by a function"

    asyncio.run(main())
    with pytest.raises(E.StartFailed) as failed:
        Sandbox.create_group(2, image="busybox", setup=["true", "exit 3"], **conn)
    assert failed.value.details["exit_code"] == 3
