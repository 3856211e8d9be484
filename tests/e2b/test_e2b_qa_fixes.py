"""Regression tests for the bugs an external QA found (scripts in the QA report).

Each test drives the unmodified ``e2b`` SDK (or raw HTTP, for bodies the SDK would
never send) against dsec's E2B API over the fake edge.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.timing import budget

from conftest import E2BServer, pause_during_stream
from dsec.models import SetTTLRequest
from dsec.wire import validated
from e2b import (
    CommandExitException,
    FilesystemEventType,
    InvalidArgumentException,
    Sandbox,
    SandboxException,
    SandboxQuery,
)

API_KEY = {"X-API-Key": "key-alice"}
MAX_TIMEOUT_S = 30 * 24 * 3600


@pytest.fixture
def sbx(e2b_server: E2BServer) -> Iterator[Sandbox]:
    s = Sandbox.create("base", metadata={"suite": "qa-fixes"}, timeout=300)
    yield s
    s.kill()


def _post(e2b_server: E2BServer, path: str, body: Any = None, raw: bytes | None = None) -> Any:
    headers = {**API_KEY, "Content-Type": "application/json"}
    if raw is not None:
        return httpx.post(e2b_server.api_url + path, content=raw, headers=headers, timeout=30)
    return httpx.post(e2b_server.api_url + path, json=body, headers=headers, timeout=30)


def _assert_json_400(r: httpx.Response) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["code"] == 400 and r.json()["message"]


# --- 1: huge timeouts --------------------------------------------------------------
def test_out_of_range_timeouts_are_400_and_the_sandbox_stays_usable(
    e2b_server: E2BServer, sbx: Sandbox
) -> None:
    sid = sbx.sandbox_id
    for body in (
        {"timeout": 10**12},
        {"timeout": 1e300},
        {"timeout": MAX_TIMEOUT_S + 1},
        {"timeout": 0},
        {"timeout": -1},
        {"timeout": "x"},
        {"timeout": True},
    ):
        if body != {"timeout": 0}:  # set_timeout(0) is E2B's "time is up now"
            _assert_json_400(_post(e2b_server, f"/sandboxes/{sid}/timeout", body))
        _assert_json_400(_post(e2b_server, f"/sandboxes/{sid}/connect", body))
        _assert_json_400(_post(e2b_server, f"/sandboxes/{sid}/fork", body))
    for raw in (b'{"timeout": Infinity}', b'{"timeout": NaN}', b'{"timeout": 1e999}'):
        _assert_json_400(_post(e2b_server, f"/sandboxes/{sid}/timeout", raw=raw))
    _assert_json_400(_post(e2b_server, f"/sandboxes/{sid}/refreshes", {"duration": 10**12}))
    _assert_json_400(_post(e2b_server, "/sandboxes", {"templateID": "base", "timeout": 10**12}))
    # through the SDK
    with pytest.raises(SandboxException):
        sbx.set_timeout(10**12)
    with pytest.raises(SandboxException):
        Sandbox.connect(sid, timeout=10**12)
    # the edge's request itself refuses it for every caller (E2B, dsec API, SDK build it)
    from dsec.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        validated(SetTTLRequest, sandbox_id=sid, ttl_s=1e12)
    # nothing was stored: info, list and the 30-day maximum still work
    sbx.set_timeout(MAX_TIMEOUT_S)
    info = sbx.get_info()
    assert MAX_TIMEOUT_S - 60 < (info.end_at - info.started_at).total_seconds() <= MAX_TIMEOUT_S + 5
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "qa-fixes"})).next_items()
    assert sid in [x.sandbox_id for x in listed]
    assert sbx.commands.run("echo ok").stdout == "ok\n"


# --- 2: wrong types ----------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        {"templateID": 5},
        {},
        {"templateID": ""},
        {"templateID": "base", "timeout": "x"},
        {"templateID": "base", "timeout": True},
        {"templateID": "base", "autoPause": "yes"},
        {"templateID": "base", "metadata": {"a": 1}},
        {"templateID": "base", "metadata": [1]},
        {"templateID": "base", "envVars": {"A": None}},
        {"templateID": "base", "allow_internet_access": "no"},
        {"templateID": "base", "autoResume": {"enabled": "yes"}},
        {"templateID": "base", "autoResume": 3},
        {"templateID": "base", "network": {"allowOut": "pypi.org"}},
        {"templateID": "base", "network": {"denyOut": [1]}},
        {"templateID": "base", "network": []},
    ],
)
def test_wrong_types_in_create_are_400(e2b_server: E2BServer, body: dict[str, Any]) -> None:
    _assert_json_400(_post(e2b_server, "/sandboxes", body))


def test_wrong_types_in_other_control_routes_are_400(e2b_server: E2BServer, sbx: Sandbox) -> None:
    sid = sbx.sandbox_id
    for path, body in (
        (f"/sandboxes/{sid}/connect", {"memory": "no"}),
        (f"/sandboxes/{sid}/snapshots", {"name": 5}),
        (f"/sandboxes/{sid}/snapshots", {"memory": "yes"}),
        (f"/sandboxes/{sid}/fork", {"count": "2"}),
        (f"/sandboxes/{sid}/refreshes", {"duration": "60"}),
        (f"/sandboxes/{sid}/resume", {"timeout": "60"}),
    ):
        _assert_json_400(_post(e2b_server, path, body))
    r = httpx.put(
        e2b_server.api_url + f"/sandboxes/{sid}/network",
        json={"allowOut": "pypi.org"},
        headers=API_KEY,
        timeout=30,
    )
    _assert_json_400(r)
    assert sbx.get_info().state.value == "running"


# --- 3: backpressure instead of dropping ------------------------------------------
def test_foreground_output_larger_than_the_stream_buffer_arrives_whole(sbx: Sandbox) -> None:
    result = sbx.commands.run("head -c 30000000 /dev/zero | tr '\\0' a", timeout=60)
    assert len(result.stdout) == 30_000_000 and set(result.stdout) == {"a"}


def test_unread_stream_pauses_the_process_until_it_is_dropped(sbx: Sandbox) -> None:
    # 48 MB to a handle nobody reads: the server buffers a bounded amount, then the
    # process blocks; dropping the stream lets it finish.
    handle = sbx.commands.run(
        "head -c 48000000 /dev/zero | tr '\\0' x; echo done > /tmp/chatty-done", background=True
    )
    time.sleep(3)
    assert not sbx.files.exists("/tmp/chatty-done")
    assert [p.pid for p in sbx.commands.list()] == [handle.pid]
    handle.disconnect()
    deadline = time.monotonic() + budget(30)
    while not sbx.files.exists("/tmp/chatty-done") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sbx.files.read("/tmp/chatty-done") == "done\n"
    while sbx.commands.list() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sbx.commands.list() == []


# --- 4: sync watcher records between polls ------------------------------------------
def test_sync_watcher_keeps_events_between_polls(sbx: Sandbox) -> None:
    sbx.files.make_dir("/tmp/w")
    watcher = sbx.files.watch_dir("/tmp/w")
    try:
        sbx.files.write("/tmp/w/short-lived", "a")
        time.sleep(0.5)  # several background polls (0.05 s in tests)
        sbx.files.remove("/tmp/w/short-lived")
        events: list[tuple[str, FilesystemEventType]] = []
        deadline = time.monotonic() + budget(5)
        while ("short-lived", FilesystemEventType.REMOVE) not in events:  # a poll saw it
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
            events += [(e.name, e.type) for e in watcher.get_new_events()]
        assert ("short-lived", FilesystemEventType.CREATE) in events
        assert ("short-lived", FilesystemEventType.REMOVE) in events
        assert events.index(("short-lived", FilesystemEventType.CREATE)) < events.index(
            ("short-lived", FilesystemEventType.REMOVE)
        )
        assert watcher.get_new_events() == []  # drained
    finally:
        watcher.stop()


# --- 5: pause ends open streams ------------------------------------------------------
def test_pause_ends_a_streaming_command_with_an_error(sbx: Sandbox) -> None:
    blocked, outcome = pause_during_stream(sbx, budget(10))
    assert not blocked, "the command's stream stayed open after pause"
    assert "paused" in str(outcome.get("error")), outcome
    assert sbx.is_running() is False  # envd /health fails for a paused sandbox
    assert sbx.get_info().state.value == "paused"
    Sandbox.connect(sbx.sandbox_id)  # resumes
    assert sbx.is_running() is True


# --- 6: smaller fidelity fixes ------------------------------------------------------
def test_exit_error_strings_match_envd(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("exit 3")
    assert exc.value.exit_code == 3 and exc.value.error == "exit status 3"
    handle = sbx.commands.run("sleep 30", background=True)
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as exc:
        handle.wait()
    assert exc.value.error == "signal: killed"
    assert sbx.commands.run("true").error is None


def test_make_dir_on_a_file_is_invalid_argument(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/plain", "x")
    with pytest.raises(InvalidArgumentException):
        sbx.files.make_dir("/tmp/plain")
    assert sbx.files.make_dir("/tmp/newdir") is True
    assert sbx.files.make_dir("/tmp/newdir") is False


def test_refresh_only_extends_and_lifecycle_is_reported(
    e2b_server: E2BServer, sbx: Sandbox
) -> None:
    before = sbx.get_info().end_at
    r = _post(e2b_server, f"/sandboxes/{sbx.sandbox_id}/refreshes", {"duration": 10})
    assert r.status_code == 204
    assert sbx.get_info().end_at == before  # 10 s would have shortened 300 s
    r = _post(e2b_server, f"/sandboxes/{sbx.sandbox_id}/refreshes", {"duration": 3000})
    assert r.status_code == 204 and sbx.get_info().end_at > before
    lifecycle = sbx.get_info().lifecycle
    assert lifecycle is not None and lifecycle["on_timeout"] == "kill"
    paused = Sandbox.create("base", timeout=60, lifecycle={"on_timeout": "pause"})
    try:
        lifecycle = paused.get_info().lifecycle
        assert lifecycle is not None and lifecycle["on_timeout"] == "pause"
        assert lifecycle["auto_resume"] is True
    finally:
        paused.kill()


def test_signed_file_urls_work(e2b_server: E2BServer, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/signed.txt", "signed-content")
    url = sbx.download_url("/tmp/signed.txt")
    assert "signature=" in url
    r = httpx.get(url, timeout=30)  # no headers at all: the signature names the sandbox
    assert r.status_code == 200 and r.content == b"signed-content", r.text
    # the same URL under the envd prefix works as well
    prefixed = url.replace(e2b_server.api_url.rsplit("/e2b", 1)[0], e2b_server.sandbox_url, 1)
    assert httpx.get(prefixed, timeout=30).content == b"signed-content"
    r = httpx.post(
        sbx.upload_url("/tmp/uploaded.txt"),
        files={"file": ("uploaded.txt", b"up")},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/uploaded.txt") == "up"
    # a signature for another path, a read URL used to write, an expired URL: 401
    other = sbx.download_url("/tmp/other.txt").split("signature=", 1)[1]
    forged = url.split("signature=", 1)[0] + "signature=" + other
    assert httpx.get(forged, timeout=30).status_code == 401
    assert httpx.post(url, content=b"x", timeout=30).status_code == 401
    expired = sbx.download_url("/tmp/signed.txt", use_signature_expiration=-10)
    assert httpx.get(expired, timeout=30).status_code == 401


def test_get_host_never_names_e2b_app(sbx: Sandbox) -> None:
    host = sbx.get_host(8080)
    assert host == f"8080-{sbx.sandbox_id}.dsec.invalid"
    assert "e2b.app" not in host


def test_automatic_pause_at_timeout_ends_a_quiet_stream(e2b_server: E2BServer) -> None:
    s = Sandbox.create("base", timeout=3, lifecycle={"on_timeout": "pause"})
    try:
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = s.commands.run("sleep 60; echo late")
            except Exception as e:
                outcome["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(budget(12))  # TTL 3 s + a 2 s state check
        assert not thread.is_alive(), "the stream stayed open after the automatic pause"
        assert "paused" in str(outcome.get("error")), outcome
        assert s.get_info().state.value == "paused"
    finally:
        s.kill()
