"""E2B parity: dsec behaves as envd and E2B's API do where E2B's own SDK tests found it
differ (issue 19). The unmodified ``e2b`` SDK over the fake edge (real commands under
bubblewrap); each test names the row of the parity table it covers. The same rows on a
real server (container tier, the ``e2b-base`` image): ``test_e2b_parity_root.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b.sandbox.filesystem.filesystem import WriteEntry
from tests.timing import budget

from conftest import E2BServer, _bwrap_edge, serve_e2b
from dsec.models import ImageRef, SandboxRef
from e2b import (
    FilesystemEventType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

ALICE = {"X-API-Key": "key-alice"}
BOB = {"X-API-Key": "key-bob"}


@pytest.fixture
def sbx(e2b_server: E2BServer) -> Iterator[Sandbox]:
    s = Sandbox.create("base", metadata={"suite": "parity"}, timeout=300)
    yield s
    with contextlib.suppress(Exception):
        s.kill()


def _envd_headers(sbx: Sandbox) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}


# --- E2B home/user layout -------------------------------------------------------------
def test_commands_and_files_default_to_user_in_home(e2b_server: E2BServer, sbx: Sandbox) -> None:
    r = sbx.commands.run("pwd; whoami; echo $HOME")
    assert r.stdout == "/home/user\nuser\n/home/user\n"
    info = sbx.files.write("test_write.txt", "hi")
    assert info.path == "/home/user/test_write.txt"
    assert sbx.commands.run("cat /home/user/test_write.txt").stdout == "hi"
    st = sbx.files.get_info("test_write.txt")
    assert st.path == "/home/user/test_write.txt" and (st.owner, st.group) == ("user", "user")
    listed = sbx.files.list(".")
    assert "/home/user/test_write.txt" in [e.path for e in listed]
    assert sbx.files.make_dir("sub") and sbx.files.get_info("/home/user/sub").type.value == "dir"
    assert sbx.files.rename("test_write.txt", "sub/moved.txt").path == "/home/user/sub/moved.txt"
    # the image's user is the sandbox's default user for the edge too
    info_edge = e2b_server.call(
        e2b_server.edge.get_sandbox(SandboxRef(sandbox_id=sbx.sandbox_id), "alice")
    )
    assert (info_edge.user, info_edge.workdir) == ("user", "/home/user")


def test_root_and_relative_cwd_resolve_against_that_users_home(sbx: Sandbox) -> None:
    # a command starts in the template's workdir whoever runs it (envd's default workdir)
    assert sbx.commands.run("pwd; whoami", user="root").stdout == "/home/user\nroot\n"
    assert sbx.commands.run("pwd", user="root", cwd="x/..").stdout == "/root\n"
    assert sbx.files.write("as-root.txt", "r", user="root").path == "/root/as-root.txt"
    assert sbx.files.read("/root/as-root.txt") == "r"
    sbx.files.make_dir("/home/user/proj/src")
    assert sbx.commands.run("pwd", cwd="proj/src").stdout == "/home/user/proj/src\n"
    assert sbx.commands.run("pwd", cwd="../user", user="user").stdout == "/home/user\n"
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("true", user="nobody-here")


def test_a_template_without_the_e2b_user_keeps_its_own_default(e2b_server: E2BServer) -> None:
    s = Sandbox.create("debian")  # a dsec image with no config: the tier's user, its workdir
    try:
        assert s.commands.run("whoami; pwd").stdout == "root\n/\n"
        assert s.files.write("x.txt", "1").path == "/x.txt"
        assert s.commands.run("pwd", user="root").stdout == "/root\n"  # a named user: its home
    finally:
        s.kill()


def test_a_symlink_shows_what_it_leads_to(sbx: Sandbox) -> None:
    sbx.files.make_dir("ln")
    sbx.files.write("ln/t.txt", "12345")
    sbx.commands.run("ln -s t.txt l1; ln -s l1 l2; ln -s nowhere dangling", cwd="ln")
    for name in ("l1", "l2"):  # envd: the target's type and size; the SDK marks it a link
        info = sbx.files.get_info(f"ln/{name}")
        assert info.type.value == "symlink" and info.size == 5
        assert info.symlink_target == "/home/user/ln/t.txt"
    dangling = sbx.files.get_info("ln/dangling")
    assert dangling.type.value == "symlink" and dangling.symlink_target == "/home/user/ln/nowhere"
    listed = {e.name: e.symlink_target for e in sbx.files.list("ln")}
    assert listed["t.txt"] is None and listed["l2"] == "/home/user/ln/t.txt"


def test_public_template_aliases_exist_for_every_key(e2b_server: E2BServer) -> None:
    from e2b import Template

    for alias in ("base", "code-interpreter-v1"):  # E2B's public templates, as in its cloud
        assert Template.exists(alias) is True
        assert Template.exists(alias, api_key="key-bob") is True
    assert Template.exists("no-such-template-here") is False


# --- files.remove of a missing path ------------------------------------------------------
def test_remove_of_a_missing_path_is_a_no_op(sbx: Sandbox) -> None:
    sbx.files.remove("non_existing_file.txt")
    sbx.files.remove("/home/user/no/such/dir")
    sbx.files.write("gone.txt", "x")
    sbx.files.remove("gone.txt")
    assert not sbx.files.exists("gone.txt")


# --- list(): newest first, E2B's pagination ---------------------------------------------
def test_list_is_newest_first_and_pages_with_a_token(e2b_server: E2BServer) -> None:
    made = [Sandbox.create("base", metadata={"batch": "order"}) for _ in range(3)]
    try:
        query = SandboxQuery(metadata={"batch": "order"})
        pager = Sandbox.list(query=query, limit=2)
        first = pager.next_items()
        assert [s.sandbox_id for s in first] == [made[2].sandbox_id, made[1].sandbox_id]
        assert pager.has_next
        assert [s.sandbox_id for s in pager.next_items()] == [made[0].sandbox_id]
        assert not pager.has_next
        made[1].pause()
        paused = Sandbox.list(
            query=SandboxQuery(metadata={"batch": "order"}, state=[SandboxState.PAUSED])
        )
        assert [s.sandbox_id for s in paused.next_items()] == [made[1].sandbox_id]
        old_first = httpx.get(
            e2b_server.api_url + "/v2/sandboxes", params={"order": "asc"}, headers=ALICE
        ).json()
        ids = [s["sandboxID"] for s in old_first if s["sandboxID"] in {m.sandbox_id for m in made}]
        assert ids == [m.sandbox_id for m in made]
    finally:
        for s in made:
            s.kill()


# --- snapshots: list and delete, per key ----------------------------------------------------
def test_snapshots_list_filter_delete_per_key(e2b_server: E2BServer, sbx: Sandbox) -> None:
    sbx.files.write("note.txt", "from the original")
    named = sbx.create_snapshot(name="parity-snap")
    anon = sbx.create_snapshot()
    assert named.snapshot_id == "parity-snap" and named.names == ["parity-snap"]
    try:
        mine = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert mine[:2] == [anon.snapshot_id, "parity-snap"]  # newest first
        by_sbx = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert {s.snapshot_id for s in by_sbx} == {anon.snapshot_id, "parity-snap"}
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name="parity-snap").next_items()] == [
            "parity-snap"
        ]
        assert Sandbox.list_snapshots(name="parity-snap-nope").next_items() == []
        pager = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
        assert len(pager.next_items()) == 1 and pager.has_next
        assert len(pager.next_items()) == 1 and not pager.has_next
        # a sandbox from the snapshot: its files, E2B's user and home
        child = Sandbox.create("parity-snap")
        try:
            assert child.files.read("note.txt") == "from the original"
            assert child.commands.run("whoami; pwd").stdout == "user\n/home/user\n"
        finally:
            child.kill()
        # another key sees none of them and cannot delete them
        assert Sandbox.list_snapshots(api_key="key-bob").next_items() == []
        assert Sandbox.delete_snapshot("parity-snap", api_key="key-bob") is False
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(named.snapshot_id) is False
        with pytest.raises(SandboxException):
            Sandbox.create("parity-snap")  # gone
    finally:
        Sandbox.delete_snapshot(anon.snapshot_id)
        Sandbox.delete_snapshot(named.snapshot_id)
    assert anon.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]


def test_snapshot_routes_refuse_bad_input_with_json_4xx(e2b_server: E2BServer) -> None:
    base = e2b_server.api_url
    for params in ({"limit": "x"}, {"limit": "0"}, {"limit": "101"}, {"nextToken": "%%%"}):
        r = httpx.get(base + "/snapshots", params=params, headers=ALICE)
        assert r.status_code == 400 and r.json()["code"] == 400, (params, r.text)
    r = httpx.get(base + "/snapshots", headers={"X-API-Key": "nope"})
    assert r.status_code == 401 and r.json()["code"] == 401
    for name in ("debian", "e2b-base", "busybox"):  # system images: no key's template
        r = httpx.delete(base + f"/templates/{name}", headers=ALICE)
        assert r.status_code == 404 and r.json()["code"] == 404
        assert (
            e2b_server.call(e2b_server.edge.get_image(ImageRef(name=name), "alice")).name == name
        )  # kept
    for name in ("no-such-snapshot", "x" * 300, "%00"):
        r = httpx.delete(base + f"/templates/{name}", headers=ALICE)
        assert r.status_code == 404 and r.json()["code"] == 404, (name, r.text)


# --- file metadata (user.e2b.* xattrs) -----------------------------------------------------
def test_file_metadata_is_kept_as_user_e2b_xattrs(e2b_server: E2BServer, sbx: Sandbox) -> None:
    info = sbx.files.write("m.txt", "x", metadata={"Author": "mish", "purpose": "upload"})
    assert info.metadata == {"author": "mish", "purpose": "upload"}  # keys lowercased
    assert sbx.files.get_info("m.txt").metadata == {"author": "mish", "purpose": "upload"}
    raw = e2b_server.call(
        e2b_server.edge.get_xattrs(sbx.sandbox_id, "alice", ["/home/user/m.txt"], "user.")
    )
    assert raw == [{"user.e2b.author": "mish", "user.e2b.purpose": "upload"}]
    octet = sbx.files.write("o.txt", "x", metadata={"k": "v"}, use_octet_stream=True)
    assert octet.metadata == {"k": "v"} and sbx.files.get_info("o.txt").metadata == {"k": "v"}
    many = sbx.files.write_files(
        [WriteEntry(path="a.txt", data="1"), WriteEntry(path="b.txt", data="2")],
        metadata={"src": "suite"},
    )
    assert [m.metadata for m in many] == [{"src": "suite"}] * 2
    sbx.files.make_dir("d")
    sbx.files.write("d/l.txt", "x", metadata={"tag": "listed"})
    assert [e.metadata for e in sbx.files.list("d")] == [{"tag": "listed"}]
    assert sbx.files.rename("d/l.txt", "d/r.txt").metadata == {"tag": "listed"}
    # overwriting without metadata clears it; a file without any shows None
    assert sbx.files.write("m.txt", "y").metadata is None
    assert sbx.files.get_info("m.txt").metadata is None
    assert sbx.files.get_info("b.txt").metadata == {"src": "suite"}
    # set out of band (inside the sandbox): surfaced too
    e2b_server.call(
        e2b_server.edge.set_xattrs(sbx.sandbox_id, "alice", "/home/user/m.txt", {"user.e2b.k": "v"})
    )
    assert sbx.files.get_info("m.txt").metadata == {"k": "v"}


def test_bad_metadata_and_xattrs_are_refused(e2b_server: E2BServer, sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("bad.txt", "x", metadata={"bad key": "v"})
    assert not sbx.files.exists("bad.txt")
    # raw headers the SDK would never send: a JSON 400, nothing written
    r = httpx.post(
        e2b_server.sandbox_url + "/files",
        params={"path": "/home/user/raw.txt"},
        content=b"x",
        headers=[
            *_envd_headers(sbx).items(),
            ("Content-Type", "application/octet-stream"),
            ("X-Metadata-ok", "caf\xe9".encode("latin-1")),  # not printable ASCII
        ],
    )
    assert r.status_code == 400 and r.json()["code"] == 400
    assert not sbx.files.exists("raw.txt")
    from dsec.errors import InvalidRequest

    for values in ({"trusted.x": "1"}, {"user.": "1"}, {"user.big": "v" * 5000}):
        with pytest.raises(InvalidRequest):
            e2b_server.call(
                e2b_server.edge.set_xattrs(sbx.sandbox_id, "alice", "/home/user", values)
            )
    with pytest.raises(InvalidRequest):
        e2b_server.call(e2b_server.edge.get_xattrs(sbx.sandbox_id, "alice", ["/"], "trusted."))


def test_metadata_of_another_keys_sandbox_is_not_found(e2b_server: E2BServer, sbx: Sandbox) -> None:
    from dsec.errors import SandboxNotFound

    sbx.files.write("secret.txt", "x", metadata={"k": "v"})
    with pytest.raises(SandboxNotFound):
        e2b_server.call(
            e2b_server.edge.get_xattrs(sbx.sandbox_id, "bob", ["/home/user/secret.txt"], "user.")
        )
    with pytest.raises(SandboxNotFound):
        e2b_server.call(
            e2b_server.edge.set_xattrs(sbx.sandbox_id, "bob", "/home/user/secret.txt", {})
        )
    with pytest.raises(SandboxNotFound):
        e2b_server.call(e2b_server.edge.watch_directory(sbx.sandbox_id, "bob", "/home/user"))


# --- pause keep_memory=False where the tier has no filesystem-only pause -------------------
def test_keep_memory_false_is_refused_by_a_tier_without_it(e2b_server: E2BServer) -> None:
    s = Sandbox.create("base")  # the fake tier has no filesystem pause: a typed 422, nothing paused
    try:
        with pytest.raises(SandboxException) as exc:
            s.pause(keep_memory=False)
        assert "422" in str(exc.value) and "filesystem-only pause" in str(exc.value)
        assert s.get_info().state == SandboxState.RUNNING
        with pytest.raises(SandboxException) as exc:
            Sandbox.create(
                "base", lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
            )
        assert "filesystem" in str(exc.value)
    finally:
        s.kill()


# --- lifecycle auto_resume=False ------------------------------------------------------------
def test_auto_resume_false_keeps_a_paused_sandbox_asleep_until_connect(
    e2b_server: E2BServer,
) -> None:
    s = Sandbox.create("base", lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        info = s.get_info()
        assert info.lifecycle["auto_resume"] is False and info.lifecycle["on_timeout"] == "pause"
        assert info.metadata == {}  # the E2B API's own label is not metadata
        s.files.write("kept.txt", "k")
        assert s.pause()
        with pytest.raises(SandboxException):
            s.commands.run("echo woke")  # refused, not resumed
        with pytest.raises(SandboxException):
            s.files.read("kept.txt")
        assert not s.is_running()
        assert s.get_info().state == SandboxState.PAUSED
        s.connect()
        assert s.get_info().state == SandboxState.RUNNING and s.is_running()
        assert s.files.read("kept.txt") == "k"
    finally:
        s.kill()
    plain = Sandbox.create("base", lifecycle={"on_timeout": "pause"})
    try:
        assert plain.get_info().lifecycle["auto_resume"] is True
        plain.pause()
        assert plain.commands.run("echo woke").stdout == "woke\n"  # any request resumes it
    finally:
        plain.kill()


def test_set_timeout_zero_ends_the_sandbox_now(e2b_server: E2BServer) -> None:
    s = Sandbox.create("base", lifecycle={"on_timeout": "pause"})
    try:
        s.set_timeout(0)
        deadline = time.monotonic() + budget(15)
        while s.get_info().state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "set_timeout(0) did not pause the sandbox"
            time.sleep(0.2)
    finally:
        s.kill()


# --- error texts like envd's ---------------------------------------------------------------
def test_a_command_of_a_killed_sandbox_ends_as_envds_does(sbx: Sandbox) -> None:
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(TimeoutException) as exc:
        cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(exc.value)


async def test_async_command_of_a_killed_sandbox_ends_as_envds_does(e2b_server: E2BServer) -> None:
    from e2b import AsyncSandbox

    s = await AsyncSandbox.create("base")
    cmd = await s.commands.run("sleep 60", background=True)  # its stream is read at once
    await s.kill()
    with pytest.raises(TimeoutException) as exc:
        await cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(exc.value)


def test_signed_url_errors_say_what_envd_says(sbx: Sandbox) -> None:
    sbx.files.write("signed.txt", "s")
    expired = sbx.download_url("signed.txt", "user", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(expired)
    assert exc.value.code == 401
    import json

    assert json.loads(exc.value.read()) == {"code": 401, "message": "signature is already expired"}
    forged = sbx.download_url("signed.txt", "user").replace("signature=v1_", "signature=v1_x")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(forged)
    assert json.loads(exc.value.read()) == {"code": 401, "message": "invalid signature"}


# --- MCP gateway -----------------------------------------------------------------------------
def test_mcp_fails_as_e2b_for_a_template_without_a_gateway(e2b_server: E2BServer) -> None:
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create("base", metadata={"mcp": "parity"}, mcp={"some_server": {}})
    assert Sandbox.list(query=SandboxQuery(metadata={"mcp": "parity"})).next_items() == []


# --- network: E2B's default is open (where the node has networking) -------------------------
def test_network_default_follows_the_node(e2b_server: E2BServer, sbx: Sandbox) -> None:
    # the fake node has no networking: the default-open E2B sandbox gets none, as before
    assert sbx.get_info().allow_internet_access is False
    edge_info = e2b_server.call(
        e2b_server.edge.get_sandbox(SandboxRef(sandbox_id=sbx.sandbox_id), "alice")
    )
    assert edge_info.network is None


# --- kernel files read from inside the sandbox -----------------------------------------------
def test_proc_files_are_read_inside_the_sandbox(sbx: Sandbox) -> None:
    status = sbx.files.read("/proc/self/status")
    assert "Pid:" in status
    with pytest.raises(Exception) as exc:
        sbx.files.read("/proc/no-such-file")
    assert "no such file" in str(exc.value).lower()


# --- watch_dir: inotify, events not merged ---------------------------------------------------
def test_watch_reports_each_change_with_renames(sbx: Sandbox) -> None:
    sbx.files.make_dir("w")
    handle = sbx.files.watch_dir("w", allow_network_mounts=True)  # envd 0.6.4's flag
    sbx.files.write("w/f.txt", "1")
    assert next(e.type for e in handle.get_new_events()) == FilesystemEventType.CREATE
    sbx.commands.run("mv /home/user/w/f.txt /home/user/w/g.txt")
    events = [(e.name, e.type) for e in handle.get_new_events()]
    assert events == [("f.txt", FilesystemEventType.RENAME), ("g.txt", FilesystemEventType.CREATE)]
    for _ in range(2):  # each write its own event (the kernel merges only unread twins)
        sbx.commands.run("echo a >> /home/user/w/g.txt")
        assert [(e.name, e.type) for e in handle.get_new_events()] == [
            ("g.txt", FilesystemEventType.WRITE)
        ]
    sbx.commands.run("rm /home/user/w/g.txt")
    assert [(e.name, e.type) for e in handle.get_new_events()] == [
        ("g.txt", FilesystemEventType.REMOVE)
    ]
    handle.stop()


def test_recursive_watch_follows_new_directories(sbx: Sandbox) -> None:
    sbx.files.make_dir("r")
    handle = sbx.files.watch_dir("r", recursive=True)
    sbx.files.make_dir("r/new")
    sbx.files.write("r/new/x.txt", "1")
    events = [(e.name, e.type) for e in handle.get_new_events()]
    assert ("new", FilesystemEventType.CREATE) in events
    assert ("new/x.txt", FilesystemEventType.WRITE) in events
    sbx.files.remove("r")
    with pytest.raises(Exception) as exc:
        for _ in range(20):
            handle.get_new_events()
    assert "removed" in str(exc.value)


async def test_async_watch_streams_kernel_events(e2b_server: E2BServer) -> None:
    from e2b import AsyncSandbox

    s = await AsyncSandbox.create("base")
    try:
        await s.files.make_dir("aw")
        seen: list[Any] = []
        handle = await s.files.watch_dir("aw", lambda e: seen.append((e.name, e.type)))
        await s.commands.run("touch /home/user/aw/t; mv /home/user/aw/t /home/user/aw/u")
        deadline = time.monotonic() + budget(5)
        while ("u", FilesystemEventType.CREATE) not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert seen == [  # touch: created, then its times set; mv: a rename, then a create
            ("t", FilesystemEventType.CREATE),
            ("t", FilesystemEventType.CHMOD),
            ("t", FilesystemEventType.RENAME),
            ("u", FilesystemEventType.CREATE),
        ]
        await handle.stop()
    finally:
        await s.kill()


class _NoWatchEdge:
    """The fake edge without :class:`~dsec.contract.edge.DirectoryWatch`: E2B polls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "watch_directory":
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def polling_server() -> Iterator[E2BServer]:
    with _bwrap_edge() as edge, serve_e2b(_NoWatchEdge(edge)) as (root, app, loop):
        yield E2BServer(api_url=root, sandbox_url=f"{root}/envd", edge=edge, loop=loop, app=app)


def test_an_edge_without_kernel_watches_is_polled(polling_server: E2BServer) -> None:
    urls = {"api_key": "key-alice", "api_url": polling_server.api_url}
    s = Sandbox.create("base", sandbox_url=polling_server.sandbox_url, **urls)
    try:
        s.files.make_dir("p")
        handle = s.files.watch_dir("p")
        s.files.write("p/n.txt", "1")
        deadline = time.monotonic() + budget(5)
        events: list[Any] = []
        while not events and time.monotonic() < deadline:
            events = handle.get_new_events()
            time.sleep(0.05)
        assert ("n.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]
        handle.stop()
    finally:
        s.kill()
