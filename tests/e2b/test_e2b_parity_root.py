"""E2B parity (issue 19) on a real ``dsec serve``: the container tier, the ``e2b-base`` image
(E2B's ``base`` template) and a node with networking, through the unmodified ``e2b`` SDK.

The rows of the parity table that depend on the tier itself: the home/user layout with
``curl``, ``git`` and passwordless ``sudo``; E2B's open network default (and
``allow_internet_access=False``); file metadata as real ``user.e2b.*`` xattrs on the
sandbox's overlay; ``watch_dir`` from inotify inside the sandbox (changes made by its own
commands); pause with ``keep_memory=False`` (processes dropped, files kept, a new boot id);
snapshots listed and deleted per key. The same rows over the fake edge:
``test_e2b_parity.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import container_server
from tests.isolation import worker_subnet
from tests.timing import budget

from dsec.models import SandboxRef
from e2b import CommandExitException, FilesystemEventType, Sandbox, SandboxState

pytestmark = [pytest.mark.root, pytest.mark.slow]

SUBNET = worker_subnet(246)
"""This module's sandbox subnet (distinct from other root tests' servers)."""
OPEN_NAME, OPEN_ADDR = "any-name.e2b-parity.test", "198.51.100.7"
"""A name the node's resolver knows (a static record): an open sandbox resolves any name."""


class Real:
    def __init__(self, bg: Any, other_key: str) -> None:
        self.bg = bg
        self.other_key = other_key


@pytest.fixture(scope="module")
def real(dsec_home_root: Path, shared_layers: Path) -> Iterator[Real]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = dsec_home_root / "e2b-parity"
    network = {"subnet": SUBNET, "static_records": {OPEN_NAME: [OPEN_ADDR]}}
    with container_server(home, shared_layers, "e2b-base", network_options=network) as bg:
        env = {
            "E2B_API_URL": f"{bg.url}/e2b",
            "E2B_SANDBOX_URL": f"{bg.url}/e2b/envd",
            "E2B_API_KEY": bg.api_key,
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield Real(bg, bg.keys.create_key("e2b-parity-other"))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture
def sbx(real: Real) -> Iterator[Sandbox]:
    s = Sandbox.create("base", metadata={"suite": "parity-root"}, timeout=300)
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_base_template_has_the_e2b_user_curl_git_and_sudo(sbx: Sandbox) -> None:
    r = sbx.commands.run("whoami; pwd; echo $HOME; id -u")
    assert r.stdout == "user\n/home/user\n/home/user\n1000\n"
    assert sbx.commands.run("sudo -n whoami").stdout == "root\n"  # passwordless, setuid works
    assert sbx.commands.run("sudo -n touch /etc/by-sudo && stat -c %U /etc/by-sudo").stdout == (
        "root\n"
    )
    assert sbx.commands.run("curl --version").stdout.startswith("curl ")
    assert sbx.commands.run("git --version").stdout.startswith("git version ")
    # E2B's git helpers work in the home directory
    sbx.git.init("repo", initial_branch="main")
    assert sbx.commands.run("git -C /home/user/repo rev-parse --is-inside-work-tree").stdout == (
        "true\n"
    )
    assert sbx.files.write("rel.txt", "x").path == "/home/user/rel.txt"
    info = sbx.files.get_info("rel.txt")
    assert (info.owner, info.group) == ("user", "user")
    assert sbx.commands.run("pwd", cwd="repo").stdout == "/home/user/repo\n"


def test_sudo_stays_inside_the_sandbox(sbx: Sandbox) -> None:
    # root through sudo has the container's capabilities, not the node's
    r = sbx.commands.run("sudo -n cat /proc/self/status | grep ^CapEff")
    eff = int(r.stdout.split()[1], 16)
    assert not eff & (1 << 21), "CAP_SYS_ADMIN must stay out of sudo's reach"
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("sudo -n mount -t tmpfs none /mnt", timeout=30)
    assert "permission denied" in exc.value.stderr


def test_network_default_is_open_on_the_e2b_api(real: Real, sbx: Sandbox) -> None:
    assert sbx.get_info().allow_internet_access is True
    owner = real.bg.keys.verify(real.bg.api_key)
    edge_info = real.bg.call(real.bg.edge.get_sandbox(SandboxRef(sandbox_id=sbx.sandbox_id), owner))
    assert edge_info.network is not None
    # open as E2B's: names resolve without being listed (dsec's resolver, static record)
    assert sbx.commands.run(f"getent hosts {OPEN_NAME}").stdout.split()[0] == OPEN_ADDR
    closed = Sandbox.create("base", allow_internet_access=False)
    try:
        assert closed.get_info().allow_internet_access is False
    finally:
        closed.kill()


def test_file_metadata_is_a_real_xattr(sbx: Sandbox) -> None:
    sbx.files.write("meta.txt", "m", metadata={"author": "ana", "kind": "note"})
    assert sbx.files.get_info("meta.txt").metadata == {"author": "ana", "kind": "note"}
    r = sbx.commands.run(
        "python3 -c \"import os; print(os.getxattr('meta.txt', 'user.e2b.author').decode())\""
    )
    assert r.stdout == "ana\n"
    # set by a program in the sandbox: the SDK sees it too
    sbx.commands.run(
        "python3 -c \"import os; os.setxattr('meta.txt', 'user.e2b.kind', b'changed')\""
    )
    assert sbx.files.get_info("meta.txt").metadata["kind"] == "changed"
    listed = {e.name: e.metadata for e in sbx.files.list(".")}
    assert listed["meta.txt"] == {"author": "ana", "kind": "changed"}


def test_watch_dir_sees_the_sandboxs_own_changes_from_inotify(sbx: Sandbox) -> None:
    sbx.files.make_dir("w")
    handle = sbx.files.watch_dir("w")
    sbx.commands.run("echo 1 > /home/user/w/a; mv /home/user/w/a /home/user/w/b; rm /home/user/w/b")
    deadline = time.monotonic() + budget(5)
    events: list[tuple[str, FilesystemEventType]] = []
    while time.monotonic() < deadline:
        events += [(e.name, e.type) for e in handle.get_new_events()]
        if ("b", FilesystemEventType.REMOVE) in events:
            break
        time.sleep(0.05)
    assert events == [
        ("a", FilesystemEventType.CREATE),
        ("a", FilesystemEventType.WRITE),
        ("a", FilesystemEventType.RENAME),
        ("b", FilesystemEventType.CREATE),
        ("b", FilesystemEventType.REMOVE),
    ]
    # a file written through the SDK: envd's three events (created, written, given to the user)
    sbx.files.write("w/sdk.txt", "x")
    assert [(e.name, e.type) for e in handle.get_new_events()] == [
        ("sdk.txt", FilesystemEventType.CREATE),
        ("sdk.txt", FilesystemEventType.WRITE),
        ("sdk.txt", FilesystemEventType.CHMOD),
    ]
    handle.stop()


def test_pause_keep_memory_false_keeps_files_and_boots_afresh(sbx: Sandbox) -> None:
    sbx.files.write("kept.txt", "files stay")
    boot = sbx.files.read("/proc/sys/kernel/random/boot_id")
    sbx.commands.run("sleep 600", background=True)
    # started, not yet exec'd on a busy machine: wait until it has
    wait = "i=0; until pgrep -x sleep; do i=$((i+1)); [ $i -gt 400 ] && exit 1; sleep 0.05; done"
    assert sbx.commands.run(wait).exit_code == 0
    sbx.pause(keep_memory=False)
    assert sbx.get_info().state == SandboxState.PAUSED
    sbx.connect()
    assert sbx.files.read("kept.txt") == "files stay"
    assert sbx.files.read("/proc/sys/kernel/random/boot_id") != boot
    r = sbx.commands.run("pgrep -x sleep || echo none")
    assert r.stdout.strip() == "none"
    assert sbx.commands.run("whoami").stdout == "user\n"


def test_snapshots_are_listed_and_deleted_per_key(real: Real, sbx: Sandbox) -> None:
    sbx.files.write("snap.txt", "in the snapshot")
    snap = sbx.create_snapshot()
    try:
        mine = [
            s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        ]
        assert mine == [snap.snapshot_id]
        others = Sandbox.list_snapshots(api_key=real.other_key).next_items()
        assert snap.snapshot_id not in [s.snapshot_id for s in others]
        assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=real.other_key) is False
        child = Sandbox.create(snap.snapshot_id)
        try:
            assert child.files.read("snap.txt") == "in the snapshot"
        finally:
            child.kill()
    finally:
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


def test_timeout_pause_filesystem_mode_keeps_only_the_files(real: Real) -> None:
    s = Sandbox.create(
        "base", timeout=2, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}}
    )
    try:
        s.files.write("kept.txt", "after the timeout")
        boot = s.files.read("/proc/sys/kernel/random/boot_id")
        s.commands.run("sleep 600", background=True)
        deadline = time.monotonic() + budget(20)
        while s.get_info().state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "the timeout did not pause the sandbox"
            time.sleep(0.3)
        s.connect()
        assert s.files.read("kept.txt") == "after the timeout"
        assert s.files.read("/proc/sys/kernel/random/boot_id") != boot
        assert s.commands.run("pgrep -x sleep || echo none").stdout.strip() == "none"
    finally:
        s.kill()
