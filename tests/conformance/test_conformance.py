"""Behaviour every tier must show through the SDK (containerd-style conformance suite).

Run against a real server; each test is parametrized over the tiers this node has.
A capability a tier lacks must raise CapabilityNotSupported, never silently no-op.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget

from dsec import Sandbox
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    PathOutsideSandbox,
    SandboxNotFound,
    SandboxStopped,
)

pytestmark = pytest.mark.root


def test_create_reports_running(sandbox: Sandbox, tier: str) -> None:
    info = sandbox.refresh()
    assert info.state == "running"
    assert info.tier == tier
    assert sandbox.id.startswith("sb-")


def test_exec_stdout_and_exit_code(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo hello")
    assert r.stdout == "hello\n"
    assert r.exit_code == 0
    assert r.ok


def test_exec_nonzero_exit_and_stderr(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo oops >&2; exit 7")
    assert r.exit_code == 7
    assert r.stderr == "oops\n"
    assert r.stdout == ""
    assert not r.ok


def test_exec_argv_form_is_not_shell_parsed(sandbox: Sandbox) -> None:
    r = sandbox.commands.run(["echo", "$HOME", "a b"])
    assert r.stdout == "$HOME a b\n"


def test_exec_env_and_cwd(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo $FOO; pwd", env={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "bar baz\n/tmp\n"


def test_sandbox_env_applies_to_every_command(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(env={"DSEC_CONF": "one"})
    assert sb.commands.run("echo $DSEC_CONF").stdout == "one\n"
    assert sb.commands.run("echo $DSEC_CONF", env={"DSEC_CONF": "two"}).stdout == "two\n"


def test_exec_stdin(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("cat", stdin="line1\nline2\n")
    assert r.stdout == "line1\nline2\n"


def test_exec_missing_cwd_is_an_error_not_a_hang(sandbox: Sandbox) -> None:
    try:
        r = sandbox.commands.run("pwd", cwd="/does/not/exist")
    except InvalidRequest:
        return
    assert r.exit_code != 0


def test_exec_timeout_kills_command(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.commands.run("sleep 30; echo never", timeout=1)
    took = time.monotonic() - t0
    assert r.timed_out
    assert "never" not in r.stdout
    assert took < budget(10)  # the 1 s time-out, not the 30 s sleep
    # the sandbox is still usable afterwards
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_exec_timeout_kills_background_children(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("sleep 300 & sleep 300 & wait", timeout=1)
    assert r.timed_out
    ps = sandbox.commands.run("ps -o pid,args 2>/dev/null || ps")
    assert "sleep 300" not in ps.stdout


def test_output_is_capped_and_flagged(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("yes | head -c 5000000", max_output_bytes=100_000)
    assert r.stdout_truncated
    assert len(r.stdout.encode()) <= 100_000
    assert r.exit_code == 0


def test_output_flood_with_timeout_survives(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("yes", timeout=2, max_output_bytes=10_000)
    assert r.timed_out
    assert r.stdout_truncated
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


def test_streaming_delivers_output_before_exit(sandbox: Sandbox) -> None:
    """'two' is printed only once the client has seen 'one' (and said so by writing
    /tmp/ack): were output delivered at the exit, the command would wait in vain."""
    events = []
    polls = int(budget(10) / 0.05)
    cmd = (
        "echo one; n=0; until [ -e /tmp/ack ]; do n=$((n+1));"
        f" [ $n -gt {polls} ] && {{ echo no-ack; break; }}; sleep 0.05; done; echo two"
    )
    for ev in sandbox.commands.stream(cmd):
        events.append(ev)
        if ev.type == "stdout" and (ev.data or "").startswith("one"):
            sandbox.files.write("/tmp/ack", b"")
    kinds = [e.type for e in events]
    assert kinds[-1] == "exit"
    assert events[-1].result is not None and events[-1].result.exit_code == 0
    out = "".join(e.data or "" for e in events if e.type == "stdout")
    assert out == "one\ntwo\n"


def test_run_with_callbacks(sandbox: Sandbox) -> None:
    got: list[str] = []
    r = sandbox.commands.run("echo a; echo b >&2", on_stdout=got.append, on_stderr=got.append)
    assert r.exit_code == 0
    assert "".join(got).count("a") == 1 and "b" in "".join(got)


def test_concurrent_execs(sandbox: Sandbox) -> None:
    results: dict[int, Any] = {}

    def go(i: int) -> None:
        results[i] = sandbox.commands.run(f"sleep 0.3; echo {i}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout.strip() for i, r in results.items()} == {i: str(i) for i in range(6)}
    assert time.monotonic() - t0 < budget(1.5 * 6 * 0.3 + 3)  # none waited on a stuck one


def test_files_roundtrip_binary(sandbox: Sandbox) -> None:
    data = bytes(range(256)) * 100
    sandbox.files.write("/tmp/blob.bin", data)
    assert sandbox.files.read("/tmp/blob.bin") == data
    r = sandbox.commands.run("wc -c < /tmp/blob.bin")
    assert r.stdout.strip() == str(len(data))


def test_files_written_by_command_are_readable(sandbox: Sandbox) -> None:
    sandbox.commands.run("mkdir -p /tmp/w && echo made-inside > /tmp/w/out.txt")
    assert sandbox.files.read("/tmp/w/out.txt") == b"made-inside\n"


def test_files_list_stat_remove_mkdir_rename(sandbox: Sandbox) -> None:
    sandbox.files.make_dir("/tmp/data/sub")
    sandbox.files.write("/tmp/data/a.txt", "A")
    sandbox.files.write("/tmp/data/sub/b.txt", "BB")
    names = {e.name for e in sandbox.files.list("/tmp/data")}
    assert names == {"a.txt", "sub"}
    deep = {e.path for e in sandbox.files.list("/tmp/data", depth=2)}
    assert "/tmp/data/sub/b.txt" in deep
    st = sandbox.files.stat("/tmp/data/sub/b.txt")
    assert st.type == "file" and st.size == 2
    assert sandbox.files.stat("/tmp/data/sub").type == "dir"
    sandbox.files.rename("/tmp/data/a.txt", "/tmp/data/c.txt")
    assert sandbox.files.exists("/tmp/data/c.txt")
    assert not sandbox.files.exists("/tmp/data/a.txt")
    sandbox.files.remove("/tmp/data", recursive=True)
    assert not sandbox.files.exists("/tmp/data")


def test_file_mode_is_applied(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.files.stat("/tmp/run.sh").mode & 0o777 == 0o755
    assert sandbox.commands.run("/tmp/run.sh").stdout == "ran\n"


def test_missing_file_is_typed(sandbox: Sandbox) -> None:
    with pytest.raises(FileNotFound):
        sandbox.files.read("/no/such/file")
    with pytest.raises(FileNotFoundError):  # also the builtin it resembles
        sandbox.files.stat("/no/such/file")


@pytest.mark.parametrize(
    "path", ["/../../etc/shadow", "/tmp/../../../etc/passwd-host", "relative/path"]
)
def test_path_escape_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises((PathOutsideSandbox, InvalidRequest, FileNotFound)):
        sandbox.files.read(path)


def test_symlink_escape_is_confined(sandbox: Sandbox, tmp_path: Path) -> None:
    marker = Path("/tmp") / f"dsec-host-marker-{sandbox.id}"
    marker.write_text("host secret")
    try:
        sandbox.commands.run(f"ln -s {marker} /tmp/link; ln -s ../../../../../../{marker} /tmp/rel")
        for p in ("/tmp/link", "/tmp/rel"):
            try:
                data = sandbox.files.read(p)
            except (PathOutsideSandbox, FileNotFound, InvalidRequest):
                continue
            assert data != b"host secret"
        # writing through the link may fail or land inside the sandbox: never on the host
        try:
            sandbox.files.write("/tmp/link", "overwrite")
        except DsecError:
            pass
        assert marker.read_text() == "host secret"
    finally:
        marker.unlink()


def test_upload_and_download_dir(sandbox: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.txt").write_text("module")
    (src / "top.txt").write_text("top")
    sandbox.files.upload_dir(src, "/tmp/proj")
    assert sandbox.commands.run("cat /tmp/proj/pkg/mod.txt /tmp/proj/top.txt").stdout == "moduletop"
    sandbox.commands.run("echo built > /tmp/proj/out.txt")
    dst = tmp_path / "dst"
    sandbox.files.download_dir("/tmp/proj", dst)
    assert (dst / "out.txt").read_text() == "built\n"
    assert (dst / "pkg" / "mod.txt").read_text() == "module"


def test_upload_tar_with_escaping_member_is_refused(sandbox: Sandbox, sdk_env: Any) -> None:
    import httpx

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("../../escape.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"bad"))
    r = httpx.put(
        f"{sdk_env.url}/v1/sandboxes/{sandbox.id}/files/tar",
        params={"path": "/tmp"},
        content=buf.getvalue(),
        headers={"Authorization": f"Bearer {sdk_env.api_key}", "Content-Type": "application/x-tar"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] in ("path_outside_sandbox", "invalid_request")


def _tar_of(*members: tuple[str, bytes, str]) -> bytes:
    """A tar of (name, type, link target) members; files hold their own name."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, link in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname, ti.mode = kind, link, 0o755 if kind == tarfile.DIRTYPE else 0o644
            data = name.encode() if kind == tarfile.REGTYPE else b""
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data else None)
    return buf.getvalue()


def test_upload_tar_follows_its_own_symlinks_inside_the_sandbox(
    sandbox: Sandbox, sdk_env: Any
) -> None:
    """A member through a symlink of the same archive lands where the link points (inside
    the sandbox, as every path does); one through a link to a file or to nothing is the
    client's error (issue 32, item 7: the VM tiers answered 500 sandbox_error)."""
    import httpx

    def put(path: str, data: bytes) -> httpx.Response:
        return httpx.put(
            f"{sdk_env.url}/v1/sandboxes/{sandbox.id}/files/tar",
            params={"path": path},
            content=data,
            headers={
                "Authorization": f"Bearer {sdk_env.api_key}",
                "Content-Type": "application/x-tar",
            },
        )

    sym, reg, dir_ = tarfile.SYMTYPE, tarfile.REGTYPE, tarfile.DIRTYPE
    r = put("/tmp/up", _tar_of(("dst", dir_, ""), ("l", sym, "dst"), ("l/x", reg, "")))
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/tmp/up/dst/x") == b"l/x"
    r = put("/tmp/up2", _tar_of(("l", sym, "/tmp/up"), ("l/y", reg, "")))
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/tmp/up/y") == b"l/y"
    r = put("/tmp/up3", _tar_of(("f", reg, ""), ("l", sym, "f"), ("l/z", reg, "")))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    r = put("/tmp/up4", _tar_of(("l", sym, "/tmp/nowhere"), ("l/z", reg, "")))
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "file_not_found"


def test_mount_table_shows_no_path_of_the_node(sandbox: Sandbox, sdk_env: Any) -> None:
    """A sandbox's mount table names no path of the node: no DSEC_HOME in the root
    overlay's options nor in a bind mount's source (issue 32, item 7)."""
    r = sandbox.commands.run("cat /proc/self/mountinfo /proc/mounts")
    assert r.exit_code == 0, r.stderr
    node_paths = {str(sdk_env.home.parent), str(sdk_env.home.resolve().parent)}
    shown = [line for line in r.stdout.splitlines() if any(p in line for p in node_paths)]
    assert not shown, shown


def test_files_move_and_link_across_directories(sandbox: Sandbox) -> None:
    """A command renames and hard-links files from one directory to another, as apt, pip
    and git do (a Landlock domain refuses it with EXDEV unless it grants REFER)."""
    r = sandbox.commands.run(
        "mkdir -p /tmp/a/x /tmp/b && echo hi > /tmp/a/f && mv /tmp/a/f /tmp/b/f "
        "&& ln /tmp/b/f /tmp/a/g && mv /tmp/a/x /tmp/b/x && cat /tmp/b/f /tmp/a/g"
    )
    assert r.exit_code == 0 and r.stdout == "hi\nhi\n", (r.exit_code, r.stdout, r.stderr)


def test_isolation_between_sandboxes(make_sandbox: Callable[..., Sandbox]) -> None:
    a, b = make_sandbox(), make_sandbox()
    a.files.write("/tmp/secret", "only-a")
    a.commands.run("echo also > /tmp/made-by-a")
    with pytest.raises(FileNotFound):
        b.files.read("/tmp/secret")
    assert b.commands.run("cat /tmp/made-by-a").exit_code != 0


def test_writes_do_not_reach_the_image(make_sandbox: Callable[..., Sandbox]) -> None:
    a = make_sandbox()
    a.commands.run("echo tampered > /bin/tampered-marker; rm -f /etc/hostname")
    b = make_sandbox()
    assert b.commands.run("test -e /bin/tampered-marker").exit_code != 0


def test_run_as_user(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(user="1000")
    assert sb.commands.run("id -u").stdout.strip() == "1000"
    try:
        r = sb.commands.run("id -u", user="0")
    except CapabilityNotSupported:  # a tier that never runs code as root says so
        return
    assert r.stdout.strip() == "0"


def test_kill_then_use_is_typed(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    sb.kill()
    with pytest.raises(SandboxStopped):
        sb.commands.run("echo hi")
    with pytest.raises(SandboxStopped):
        sb.files.read("/etc/passwd")
    assert Sandbox.connect(sb.id).info.state == "stopped"
    sb.kill()  # idempotent


def test_connect_and_list(make_sandbox: Callable[..., Sandbox], tier: str) -> None:
    sb = make_sandbox(labels={"suite": "conformance", "tier": tier})
    again = Sandbox.connect(sb.id)
    assert again.commands.run("echo via-connect").stdout == "via-connect\n"
    ids = {s.id for s in Sandbox.list(labels={"suite": "conformance", "tier": tier})}
    assert sb.id in ids


def test_unknown_sandbox_and_image(tier: str, sdk_env: Any) -> None:
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sb-nonode-000000000000")
    with pytest.raises(ImageNotFound):
        Sandbox.create(tier=tier, image="no-such-image")


def test_other_keys_cannot_see_sandbox(sandbox: Sandbox, sdk_env: Any) -> None:
    other_key = sdk_env.keys.create_key()
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sandbox.id, api_key=other_key)
    assert sandbox.id not in {s.id for s in Sandbox.list(api_key=other_key)}


def test_ttl_expiry_stops_sandbox(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(ttl_s=1)
    deadline = time.monotonic() + budget(15)
    while time.monotonic() < deadline:
        if sb.refresh().state == "stopped":
            break
        time.sleep(0.3)
    assert sb.info.state == "stopped"
    with pytest.raises(SandboxStopped):
        sb.commands.run("echo late")


def test_set_ttl_extends(make_sandbox: Callable[..., Sandbox]) -> None:
    ttl_s = budget(2)  # long enough for the set_ttl below to come first
    sb = make_sandbox(ttl_s=ttl_s)
    sb.set_ttl(600)
    time.sleep(ttl_s + 1)  # past the first TTL
    assert sb.commands.run("echo still").stdout == "still\n"


def test_context_manager_kills(tier: str, sdk_env: Any) -> None:
    from tests.conformance.conftest import TIER_IMAGES

    from dsec.models import CreateSandboxRequest  # noqa: F401 - documents the request shape

    with Sandbox.create(tier=tier, image=TIER_IMAGES[tier], memory_mb=256) as sb:
        sid = sb.id
        assert sb.commands.run("true").exit_code == 0
    assert Sandbox.connect(sid).info.state == "stopped"


def test_memory_hog_is_contained(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(memory_mb=64)
    # a string that doubles until something stops it
    r = sb.commands.run("awk 'BEGIN{s=\"x\"; while(1) s=s s}'", timeout=120)
    assert r.exit_code != 0 or r.signal is not None
    assert sb.commands.run("echo survived").stdout == "survived\n"


def test_fork_bomb_is_capped(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(pids=64)
    r = sb.commands.run(
        "i=0; while [ $i -lt 300 ]; do sleep 5 & i=$((i+1)); done; wait", timeout=60
    )
    assert r.exit_code != 0 or "fork" in r.stderr.lower() or "resource" in r.stderr.lower()
    sb.commands.run("kill -9 -1 2>/dev/null; true", timeout=10)
    assert sb.commands.run("echo survived", timeout=20).stdout == "survived\n"


def test_a_command_cannot_open_another_commands_memory(sandbox: Sandbox) -> None:
    """What one command leaves running cannot open /proc/<pid>/mem of a process another
    command started (docs/design/tenancy.md); within one command it can."""
    pid = int(sandbox.commands.run("sleep 300 >/dev/null 2>&1 & echo $!").stdout)
    polls = int(budget(10) / 0.05)
    sandbox.commands.run(
        f"n=0; until grep -q '^sleep' /proc/{pid}/cmdline || [ $n -ge {polls} ];"
        " do sleep 0.05; n=$((n+1)); done"
    )
    opens = "if (: 3<>/proc/{pid}/mem) 2>/dev/null; then echo opened; else echo refused; fi"
    assert sandbox.commands.run(opens.format(pid=pid)).stdout == "refused\n"
    r = sandbox.commands.run("sleep 300 & p=$!; " + opens.format(pid="$p") + "; kill $p")
    assert r.stdout == "opened\n", r


def test_pause_resume_or_typed_refusal(sandbox: Sandbox, caps: Any) -> None:
    sandbox.commands.run("echo before > /tmp/paused.txt")
    if not caps.pause:
        with pytest.raises(CapabilityNotSupported):
            sandbox.pause()
        return
    info = sandbox.pause()
    assert info.state == "paused" and info.paused_at is not None
    assert info.last_pause is not None
    # any request resumes a paused sandbox transparently
    assert sandbox.commands.run("cat /tmp/paused.txt").stdout == "before\n"
    assert sandbox.refresh().state == "running"
    sandbox.pause()
    assert sandbox.resume().state == "running"


def test_kill_of_a_paused_sandbox_is_prompt(
    caps: Any, make_sandbox: Callable[..., Sandbox]
) -> None:
    if not caps.pause:
        pytest.skip("this tier cannot pause (its capability table says so)")
    sb = make_sandbox()
    sb.commands.run("sleep 1000 >/dev/null 2>&1 &")  # a process that must die with it
    sb.pause()
    t0 = time.monotonic()
    assert sb.kill().state == "stopped"
    assert time.monotonic() - t0 < budget(15), "killing a paused sandbox must not wait on it"


def test_snapshot_restores_or_typed_refusal(
    sandbox: Sandbox, caps: Any, make_sandbox: Callable[..., Sandbox]
) -> None:
    sandbox.commands.run("mkdir -p /srv/app && echo built > /srv/app/out.txt")
    if not caps.snapshot:
        with pytest.raises(CapabilityNotSupported):
            sandbox.snapshot()
        return
    layer = sandbox.snapshot()
    assert layer.digest.startswith("sha256:")
    restored = make_sandbox(layers=[layer.digest])
    assert restored.files.read("/srv/app/out.txt") == b"built\n"


def test_idle_ttl_pauses_when_asked(caps: Any, make_sandbox: Callable[..., Sandbox]) -> None:
    if not caps.pause:
        pytest.skip("this tier cannot pause (its capability table says so)")
    sb = make_sandbox(ttl_s=1, on_timeout="pause", paused_ttl_s=600)
    sb.commands.run("echo kept > /tmp/ttl.txt")
    deadline = time.monotonic() + budget(20)
    while time.monotonic() < deadline and sb.refresh().state != "paused":
        time.sleep(0.3)
    assert sb.info.state == "paused"
    assert sb.info.expires_at is not None  # now the paused TTL
    assert sb.commands.run("cat /tmp/ttl.txt").stdout == "kept\n"  # resumed by the request
    sb.set_ttl(600)
    assert sb.refresh().state == "running"
