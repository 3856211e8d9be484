"""pack_diff on a real overlay: deletions, opaque dirs, scrubbing, secrets, restore (root)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import InvalidRequest, Unsupported
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import assemble_rootfs, teardown_rootfs, upper_dir
from dsec.layers.snapshot import SecretInSnapshot, pack_diff, scrub_regex
from dsec.layers.store import LayerStore

pytestmark = pytest.mark.root


def _tree(root: Path) -> dict[str, Any]:
    """Everything observable about a tree: type, mode, owner, content, target, user xattrs."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = "/" + str(p.relative_to(root))
            st = p.lstat()
            xattrs = {
                k: os.getxattr(p, k, follow_symlinks=False)
                for k in os.listxattr(p, follow_symlinks=False)
                if k.startswith("user.")
            }
            if stat.S_ISREG(st.st_mode):
                body: Any = p.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            else:
                body = None
            out[rel] = (
                stat.S_IFMT(st.st_mode),
                st.st_mode & 0o7777,
                st.st_uid,
                st.st_gid,
                body,
                xattrs,
            )
    return out


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    store = LayerStore(tmp_path / "layers", tmp_path / "scratch")
    mounts = LayerMounts(tmp_path / "mnt")
    base = tmp_path / "base"
    for d in (
        "etc",
        "root",
        "tmp",
        "home/sandbox",
        "srv/old/deep",
        "srv/keep",
        "var/lib/apt/lists",
    ):
        (base / d).mkdir(parents=True)
    (base / "etc/config").write_text("original\n")
    (base / "etc/remove-me").write_text("x\n")
    (base / "srv/old/deep/file").write_text("old tree\n")
    (base / "srv/keep/a").write_text("a\n")
    (base / "root/.bash_history").write_text("base history\n")
    (base / "var/lib/apt/lists/base-list").write_text("list\n")
    os.chown(base / "home/sandbox", 1000, 1000)
    lower = store.build_layer(base, "base", name="rl-test-base")
    acquired: list[str] = []
    sandboxes: list[Path] = []

    def stack(sandbox: str, digests: list[str]) -> Path:
        lowers = []
        for d in digests:
            lowers.append(mounts.acquire(d, store.layer_path(d)))
            acquired.append(d)
        sdir = tmp_path / "sb" / sandbox
        sandboxes.append(sdir)
        return assemble_rootfs(sdir, lowers, disk_mb=256)

    try:
        yield {"store": store, "lower": lower, "stack": stack, "tmp": tmp_path}
    finally:
        for sdir in sandboxes:
            teardown_rootfs(sdir)
        for d in acquired:
            mounts.release(d)
        store.close()


def _write(p: Path, data: str | bytes, uid: int = 0) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chown(p, uid, uid)


def test_pack_diff_reproduces_the_view_and_scrubs(env: dict[str, Any]) -> None:
    store, lower, stack = env["store"], env["lower"], env["stack"]
    root = stack("src", [lower.digest])
    sdir = env["tmp"] / "sb" / "src"
    # changes a build agent makes
    _write(root / "etc/config", "changed\n")
    (root / "etc/remove-me").unlink()  # whiteout
    import shutil

    shutil.rmtree(root / "srv/old")  # delete a lower dir...
    (root / "srv/old").mkdir()  # ...and re-create it: opaque
    _write(root / "srv/old/new", "fresh\n")
    _write(root / "home/sandbox/app/main.py", "print('hi')\n", uid=1000)
    os.chmod(root / "home/sandbox/app/main.py", 0o750)
    os.setxattr(root / "home/sandbox/app/main.py", "user.origin", b"agent")
    os.symlink("app/main.py", root / "home/sandbox/link")
    (root / "srv/keep/a").unlink()
    # leftovers and secrets
    _write(root / "root/.bash_history", "curl -H 'token: s3cr3t-t0ken' ...\n")
    _write(root / "home/sandbox/.bash_history", "ls\n", uid=1000)
    _write(root / "home/sandbox/.cache/pip/wheels/x.whl", "wheel")
    _write(root / "tmp/build.log", "log")
    _write(root / "root/.netrc", "machine x login y password s3cr3t-t0ken\n")
    _write(root / "var/lib/apt/lists/new-list", "list")
    _write(root / "srv/private/notes", "drop me")
    before = _tree(root)
    assert stat.S_ISCHR((upper_dir(sdir) / "etc/remove-me").lstat().st_mode)
    assert os.getxattr(upper_dir(sdir) / "srv/old", "trusted.overlay.opaque") == b"y"

    t0 = time.perf_counter()
    layer = pack_diff(
        upper_dir(sdir),
        store,
        name="rl-test-snap",
        scrub=["/srv/private"],
        meta={"parents": [lower.digest]},
        secret_values=["s3cr3t-t0ken"],
    )
    print(f"pack_diff: {(time.perf_counter() - t0) * 1000:.1f} ms", layer.meta["pack_diff"])
    assert layer.kind == "workspace" and layer.name == "rl-test-snap"
    assert store.get_layer(layer.digest).meta["parents"] == [lower.digest]
    stats = layer.meta["pack_diff"]
    assert stats["whiteouts"] == 2 and stats["opaque_dirs"] == 1
    assert stats["scrubbed"] >= 6

    restored = stack("restored", [lower.digest, layer.digest])
    after = _tree(restored)
    expected = dict(before)
    # scrubbed paths revert to the lower layers' state
    for rel in list(expected):
        if rel.startswith(
            ("/home/sandbox/.bash_history", "/home/sandbox/.cache/", "/tmp/", "/root/.netrc",
             "/srv/private", "/var/lib/apt/lists/new-list")
        ):  # fmt: skip
            del expected[rel]
    expected["/root/.bash_history"] = _tree(env["tmp"] / "base")["/root/.bash_history"]
    expected.pop("/srv/private", None)
    assert after == expected
    assert not (restored / "etc/remove-me").exists()
    assert not (restored / "srv/old/deep").exists()
    assert (restored / "srv/old/new").read_text() == "fresh\n"
    assert (restored / "home/sandbox/.cache").is_dir()  # the dir stays, the pip cache is gone
    assert not (restored / "home/sandbox/.cache/pip").exists()
    assert (restored / "tmp").is_dir() and not any((restored / "tmp").iterdir())
    # the same diff packed again is the same layer
    again = pack_diff(upper_dir(sdir), store, scrub=["/srv/private"])
    assert again.digest == layer.digest


def test_secret_value_refuses_the_snapshot_and_leaves_nothing(env: dict[str, Any]) -> None:
    store, lower, stack = env["store"], env["lower"], env["stack"]
    root = stack("leaky", [lower.digest])
    _write(root / "srv/config.yaml", "api_key: AKIA-very-secret\n")
    n_layers = len(store.list_layers())
    with pytest.raises(SecretInSnapshot) as ei:
        pack_diff(upper_dir(env["tmp"] / "sb/leaky"), store, secret_values=[b"AKIA-very-secret"])
    assert ei.value.details["paths"] == ["/srv/config.yaml"]
    assert "AKIA" not in ei.value.message
    assert len(store.list_layers()) == n_layers
    assert not list(store.scratch.glob("pack-*"))
    # scrubbing the file makes it acceptable
    ok = pack_diff(
        upper_dir(env["tmp"] / "sb/leaky"),
        store,
        scrub=["/srv/config.yaml"],
        secret_values=[b"AKIA-very-secret"],
    )
    assert ok.meta["pack_diff"]["files"] == 0


def test_bad_input(env: dict[str, Any], tmp_path: Path) -> None:
    store = env["store"]
    with pytest.raises(InvalidRequest):
        pack_diff(tmp_path / "nope", store)
    up = tmp_path / "fake-upper"
    up.mkdir()
    for bad in ("relative/path", "/", "/a/../b", "/a\nb"):
        with pytest.raises(InvalidRequest):
            pack_diff(up, store, scrub=[bad])
    with pytest.raises(InvalidRequest):
        pack_diff(up, store, secret_values=["ab"])
    (up / "f").write_text("")
    os.setxattr(up / "f", "trusted.overlay.metacopy", b"")
    with pytest.raises(Unsupported):
        pack_diff(up, store)
    assert not list(store.scratch.glob("pack-*"))


def test_scrub_regex() -> None:
    import re

    r = re.compile(scrub_regex("/home/*/.cache/pip"))
    assert r.match("home/u/.cache/pip") and r.match("home/u/.cache/pip/x/y")
    assert not r.match("home/u/v/.cache/pip") and not r.match("home/u/.cache/pipx")
    t = re.compile(scrub_regex("/tmp/*"))
    assert t.match("tmp/a") and t.match("tmp/a/b") and not t.match("tmp")
    d = re.compile(scrub_regex("/opt/**/secret.txt"))
    assert d.match("opt/a/b/secret.txt") and not d.match("opt/secret.txt.bak")
    assert scrub_regex("/a.b(c)") == r"^a\.b\(c\)(/.*)?$"
