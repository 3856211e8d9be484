"""Root tests of layer mounts and overlay root filesystems on the real kernel.

Every test gets its own DSEC_HOME-like directory under /tmp and asserts at the end that
nothing is left mounted below it (and unmounts leftovers so a failure cannot leak).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest, SandboxError
from dsec.layers import LayerMounts, LayerStore, assemble_rootfs, teardown_rootfs, upper_dir
from dsec.layers.mounts import mountinfo_entries
from dsec.layers.rootfs import rootfs_path
from dsec.privileged.mount import erofs_mount_mode, mount, mount_points, umount_quiet

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts)"),
]


def _attached_loops() -> set[str]:
    """Loop devices with a backing file (attached), as the kernel reports them."""
    out = set()
    for path in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            out.add(Path(path).read_text().strip())
        except OSError:
            pass
    return out


def _mount_count(home: Path) -> int:
    """Mounts whose mountpoint or source lies under ``home`` (other engineers' and other
    tests' mounts come and go in parallel, so a global count would be flaky)."""
    return sum(
        1
        for e in mountinfo_entries()
        if str(e.mountpoint).startswith(f"{home}/") or e.source.startswith(f"{home}/")
    )


def _loops_backed_under(home: Path) -> set[str]:
    return {f for f in _attached_loops() if f.startswith(f"{home}/")}


class Node:
    """A throwaway node home: a store, layer mounts and a sandboxes dir."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.store = LayerStore(home / "layers", home / "images")
        self.mounts = LayerMounts(home / "m")
        self.sandboxes = home / "sb"
        self.sandboxes.mkdir()

    def layer(self, name: str, files: dict[str, str], *, dirs: tuple[str, ...] = ()) -> str:
        src = self.home / "src" / name
        for d in dirs:
            (src / d).mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
        src.mkdir(parents=True, exist_ok=True)
        return self.store.build_layer(src, "workspace", name=name).digest

    def lowers(self, digests: list[str]) -> list[Path]:
        return [self.mounts.acquire(d, self.store.layer_path(d)) for d in digests]

    def release(self, digests: list[str]) -> None:
        for d in digests:
            self.mounts.release(d)


@pytest.fixture
def node() -> Iterator[Node]:
    home = Path(f"/tmp/dsec-lt-{secrets.token_hex(3)}")  # short: overlay options fit a page
    home.mkdir()
    n = Node(home)
    try:
        yield n
    finally:
        leaked = mount_points(home)
        for mp in sorted(leaked, key=lambda p: len(p.parts), reverse=True):
            umount_quiet(mp)
        n.store.close()
        shutil.rmtree(home, ignore_errors=True)
        assert not leaked, f"mounts leaked under {home}: {leaked}"
        if erofs_mount_mode() == "file":  # else: tests/integration/test_erofs_loop_root.py
            assert _loops_backed_under(home) == set(), "a loop device was attached to our files"


async def test_busybox_image_runs_in_stacked_rootfs(node: Node) -> None:
    image = await node.store.ensure_image("busybox")
    tool = node.layer("tool", {"opt/tool/version": "1\n", "etc/motd": "tool motd\n"})
    app = node.layer(
        "app",
        {"opt/tool/version": "2\n", "srv/app.txt": "app\n", "srv/old.txt": "old\n"},
        dirs=("srv/cache",),
    )
    layers = [layer.digest for layer in node.store.resolve_layers(["busybox", tool, app])]
    assert layers == [*image.layers, tool, app]
    sb = node.sandboxes / "sb-1"
    rootfs = assemble_rootfs(sb, node.lowers(layers), disk_mb=16)
    try:
        assert rootfs == rootfs_path(sb)
        # the top layer wins, lower layers show through
        assert (rootfs / "opt/tool/version").read_text() == "2\n"
        assert (rootfs / "etc/motd").read_text() == "tool motd\n"
        assert (rootfs / "etc/passwd").exists()
        # programs run as the sandbox user inside it
        out = subprocess.run(
            [
                "chroot",
                "--userspec=1000:1000",
                str(rootfs),
                "/bin/sh",
                "-c",
                "id -u; echo hi > /tmp/new; cat /tmp/new; echo no > /etc/motd || echo denied",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["1000", "hi", "denied"]
        # root changes a lower file and deletes a lower dir
        (rootfs / "etc/motd").write_text("changed\n")
        shutil.rmtree(rootfs / "srv/cache")
        (rootfs / "srv/old.txt").unlink(missing_ok=True)
        upper = upper_dir(sb)
        assert (upper / "tmp/new").read_text() == "hi\n"
        assert (upper / "etc/motd").read_text() == "changed\n"
        for deleted in ("srv/old.txt", "srv/cache"):
            st = os.lstat(upper / deleted)
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, f"{deleted} is not a whiteout"
        assert not (rootfs / "srv/old.txt").exists()
        # lowers are untouched
        assert (node.mounts.mounted()[app] / "srv/old.txt").exists()
        # xino: one st_dev for files from every layer and the upper
        devs = {
            os.lstat(rootfs / p).st_dev
            for p in ("bin/busybox", "etc/motd", "srv/app.txt", "tmp/new")
        }
        assert len(devs) == 1
    finally:
        teardown_rootfs(sb)
        node.release(layers)
    assert not sb.exists()
    assert mount_points(node.home) == []
    assert list((node.home / "m").iterdir()) == []


def test_overlay_is_nodev_by_default(node: Node) -> None:
    base = node.layer("base", {"f": "1\n"})
    lowers = node.lowers([base])
    for nodev, sb in ((True, node.sandboxes / "sb-nodev"), (False, node.sandboxes / "sb-dev")):
        rootfs = assemble_rootfs(sb, lowers, disk_mb=2, nodev=nodev)
        try:
            os.mknod(rootfs / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
            if nodev:
                with pytest.raises(PermissionError):
                    open(rootfs / "null", "rb").close()
            else:
                with open(rootfs / "null", "rb") as f:
                    assert f.read(1) == b""
        finally:
            teardown_rootfs(sb)
    node.release([base])


def test_upper_size_is_capped(node: Node) -> None:
    base = node.layer("base", {"etc/os": "x\n"})
    sb = node.sandboxes / "sb-cap"
    rootfs = assemble_rootfs(sb, node.lowers([base]), disk_mb=2)
    try:
        with pytest.raises(OSError) as err, open(rootfs / "big", "wb") as f:
            for _ in range(4):
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert err.value.errno == 28  # ENOSPC
    finally:
        teardown_rootfs(sb)
        node.release([base])


def test_refcounting_and_no_loop_devices(node: Node) -> None:
    digest = node.layer("rc", {"f": "1\n"})
    path = node.store.layer_path(digest)
    mp1 = node.mounts.acquire(digest, path)
    mp2 = node.mounts.acquire(digest, path)
    assert mp1 == mp2 and node.mounts.refcount(digest) == 2
    assert mp1.name == digest[7:23]
    assert [p for p in mount_points(node.home / "m")] == [mp1]
    [entry] = mountinfo_entries(mp1)
    if erofs_mount_mode() == "file":  # kernel 6.12+ (else loop devices, test_erofs_loop_root)
        assert _loops_backed_under(node.home) == set()
        assert (entry.fstype, entry.source) == ("erofs", str(path))  # the file, not /dev/loopN
    assert entry.source_file == str(path)
    assert (mp1 / "f").read_text() == "1\n"
    with pytest.raises(OSError):
        (mp1 / "g").write_text("read-only")
    node.mounts.release(digest)
    assert node.mounts.refcount(digest) == 1 and mount_points(mp1) == [mp1]
    node.mounts.release(digest)
    assert node.mounts.refcount(digest) == 0
    assert mount_points(node.home / "m") == [] and not mp1.exists()
    node.mounts.release(digest)  # unknown: logged, no error
    with pytest.raises(SandboxError):
        node.mounts.acquire("sha256:" + "e" * 64, node.home / "layers/layers.db")  # not EROFS
    assert mount_points(node.home / "m") == []


def test_adopt_existing_after_restart(node: Node) -> None:
    a = node.layer("a", {"a": "a\n"})
    b = node.layer("b", {"b": "b\n"})
    node.mounts.acquire(a, node.store.layer_path(a))
    node.mounts.acquire(b, node.store.layer_path(b))
    (node.home / "m" / "stale-empty-dir").mkdir()
    (node.home / "m" / "stray").mkdir()
    mount("dsec-stray", node.home / "m" / "stray", "tmpfs", 0, "size=1m")
    # the edge "restarts": a fresh LayerMounts over the same root
    restarted = LayerMounts(node.home / "m")
    restarted.adopt_existing()
    assert set(restarted.mounted()) == {a, b}
    assert restarted.refcount(a) == 0
    assert not (node.home / "m" / "stale-empty-dir").exists()
    assert mount_points(node.home / "m" / "stray") == []  # not a layer: unmounted
    before = _mount_count(node.home)
    mp = restarted.acquire(a, node.store.layer_path(a))  # re-acquired, not mounted again
    assert _mount_count(node.home) == before and restarted.refcount(a) == 1
    assert restarted.unmount_unused() == 1  # b
    assert set(restarted.mounted()) == {a}
    assert (mp / "a").read_text() == "a\n"
    restarted.release(a)
    assert mount_points(node.home / "m") == []
    node.mounts.close()  # the old instance must not trip over what is already gone


def test_acquire_without_adopt_reuses_matching_mount(node: Node) -> None:
    a = node.layer("a", {"a": "a\n"})
    node.mounts.acquire(a, node.store.layer_path(a))
    other = LayerMounts(node.home / "m")
    before = _mount_count(node.home)
    other.acquire(a, node.store.layer_path(a))
    assert _mount_count(node.home) == before
    other.close(force=True)
    node.mounts.close()
    assert mount_points(node.home / "m") == []


def test_overlay_survives_layer_unmount(node: Node) -> None:
    base = node.layer("base", {"keep": "still here\n"})
    sb = node.sandboxes / "sb-x"
    rootfs = assemble_rootfs(sb, node.lowers([base]), disk_mb=4)
    try:
        node.mounts.release(base)  # refcount 0: the node-wide mount goes away
        assert mount_points(node.home / "m") == []
        assert (rootfs / "keep").read_text() == "still here\n"
    finally:
        teardown_rootfs(sb)


def test_assemble_failure_undoes_mounts(node: Node) -> None:
    base = node.layer("base", {"f": "1\n"})
    lowers = node.lowers([base])
    sb = node.sandboxes / "sb-bad"
    # a lower that resolves to the upperdir once the tmpfs is mounted: overlay refuses it
    (sb / "upper" / "data").mkdir(parents=True)
    before = _mount_count(node.home)
    with pytest.raises(SandboxError, match="cannot assemble"):
        assemble_rootfs(sb, [*lowers, sb / "upper" / "data"], disk_mb=4)
    assert _mount_count(node.home) == before
    assert mount_points(sb) == []
    with pytest.raises(InvalidRequest):
        assemble_rootfs(sb, [], disk_mb=4)
    with pytest.raises(InvalidRequest):
        assemble_rootfs(sb, lowers, disk_mb=0)
    aliases = []
    for i in range(200):  # layers named by descriptor (~22 bytes each): > 4096 bytes
        alias = node.home / f"a{i:03d}"
        alias.symlink_to(lowers[0])
        aliases.append(alias)
    with pytest.raises(InvalidRequest, match="page"):
        assemble_rootfs(sb, aliases, disk_mb=4)
    # a layer listed twice is stacked once (overlayfs refuses duplicates)
    other = node.layer("other", {"f": "2\n"})
    lowers2 = [*lowers, *node.lowers([other]), lowers[0]]
    rootfs = assemble_rootfs(sb, lowers2, disk_mb=4)
    assert (rootfs / "f").read_text() == "1\n"  # the topmost copy of base wins
    teardown_rootfs(sb)
    node.release([other])
    assert mount_points(sb) == []
    teardown_rootfs(sb)
    node.release([base])


def test_assemble_twice_is_refused_and_teardown_is_idempotent(node: Node) -> None:
    base = node.layer("base", {"f": "1\n"})
    lowers = node.lowers([base])
    sb = node.sandboxes / "sb-2"
    assemble_rootfs(sb, lowers, disk_mb=4)
    with pytest.raises(SandboxError, match="already"):
        assemble_rootfs(sb, lowers, disk_mb=4)
    # a runtime left a bind mount inside the rootfs: teardown removes it too
    (rootfs_path(sb) / "mnt-inside").mkdir()
    mount(str(node.home / "src"), rootfs_path(sb) / "mnt-inside", None, 0x1000)  # MS_BIND
    teardown_rootfs(sb)
    teardown_rootfs(sb)
    assert not sb.exists()
    # half-assembled: only the tmpfs upper got mounted
    half = node.sandboxes / "sb-half"
    (half / "upper").mkdir(parents=True)
    mount("dsec-upper", half / "upper", "tmpfs", 0, "size=1m")
    teardown_rootfs(half)
    assert not half.exists()
    node.release([base])
    assert mount_points(node.home) == []


def test_200_assemble_teardown_cycles_leak_nothing(node: Node) -> None:
    digests = [node.layer(f"l{i}", {f"file{i}": f"{i}\n"}) for i in range(3)]
    mounts_before = _mount_count(node.home)
    t0 = time.perf_counter()
    for i in range(200):
        lowers = node.lowers(digests)
        sb = node.sandboxes / f"c{i}"
        rootfs = assemble_rootfs(sb, lowers, disk_mb=8)
        (rootfs / "w").write_text(str(i))
        os.unlink(rootfs / "file0")
        teardown_rootfs(sb)
        node.release(digests)
    elapsed = time.perf_counter() - t0
    print(
        f"200 cycles (3 layer mounts + tmpfs + overlay, write, teardown): {elapsed:.3f} s, "
        f"{elapsed / 200 * 1000:.2f} ms/cycle"
    )
    assert _mount_count(node.home) == mounts_before == 0
    if erofs_mount_mode() == "file":
        assert _loops_backed_under(node.home) == set()
    assert list(node.sandboxes.iterdir()) == []
    assert list((node.home / "m").iterdir()) == []
    assert all(node.mounts.refcount(d) == 0 for d in digests)


def test_tarball_layer_with_whiteout_hides_lower_file(node: Node) -> None:
    import io
    import tarfile

    base = node.layer("base", {"etc/secret": "s\n", "etc/keep": "k\n"})
    tar_path = node.home / "diff.tar"
    with tarfile.open(tar_path, "w") as tf:
        wh = tarfile.TarInfo("etc/secret")
        wh.type = tarfile.CHRTYPE
        wh.devmajor = wh.devminor = 0
        tf.addfile(wh)
        new = tarfile.TarInfo("etc/added")
        new.size = 2
        tf.addfile(new, io.BytesIO(b"a\n"))
    diff = node.store.build_layer(tar_path, "workspace").digest
    sb = node.sandboxes / "sb-wh"
    rootfs = assemble_rootfs(sb, node.lowers([base, diff]), disk_mb=4)
    try:
        assert not (rootfs / "etc/secret").exists()
        assert (rootfs / "etc/keep").read_text() == "k\n"
        assert (rootfs / "etc/added").read_text() == "a\n"
    finally:
        teardown_rootfs(sb)
        node.release([base, diff])


@pytest.mark.slow
@pytest.mark.debian
async def test_debian_image_builds_and_runs_python(node: Node, shared_layers: Path) -> None:
    # the session's shared layer cache: debootstrap runs once per machine, not once per test
    node.store.close()
    node.store = LayerStore(shared_layers, node.home / "images")
    t0 = time.perf_counter()
    image = await node.store.ensure_image("debian")
    elapsed = time.perf_counter() - t0
    layer = node.store.get_layer(image.layers[0])
    print(f"debian image: {elapsed:.1f} s, layer {layer.size / 1e6:.1f} MB")
    assert layer.meta["suite"] == "bookworm"
    sb = node.sandboxes / "sb-deb"
    rootfs = assemble_rootfs(sb, node.lowers(image.layers), disk_mb=64)
    try:
        out = subprocess.run(
            [
                "chroot",
                "--userspec=1000:1000",
                str(rootfs),
                "/usr/bin/python3",
                "-c",
                "import os, pwd; print(pwd.getpwuid(os.getuid()).pw_name, os.getcwd())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "sandbox"
        assert not list((rootfs / "var/lib/apt/lists").glob("*_Packages"))
        assert (rootfs / "etc/resolv.conf").read_text() == ""
        assert os.stat(rootfs / "home/sandbox").st_uid == 1000
    finally:
        teardown_rootfs(sb)
        node.release(image.layers)


def test_sandbox_root_is_a_tmpfs_mounted_once_and_released_when_empty(node: Node) -> None:
    from dsec.layers.rootfs import mount_sandbox_root, release_sandbox_root

    root = node.home / "sandboxes"

    def ours() -> list[str]:
        return [e.fstype for e in mountinfo_entries(root) if e.mountpoint == root]

    assert mount_sandbox_root(root) is True
    assert ours() == ["tmpfs"]
    assert mount_sandbox_root(root) is True  # a second start uses it: nothing stacked
    assert ours() == ["tmpfs"]
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    (root / "sb-1").mkdir()
    release_sandbox_root(root)  # a sandbox left: kept for the next start
    assert ours() == ["tmpfs"]
    (root / "sb-1").rmdir()
    release_sandbox_root(root)
    assert ours() == []
    release_sandbox_root(root)  # idempotent


def test_sandbox_root_with_old_sandboxes_stays_on_its_filesystem(node: Node) -> None:
    from dsec.layers.rootfs import mount_sandbox_root, release_sandbox_root

    root = node.home / "sandboxes"
    (root / "sb-old").mkdir(parents=True)  # a sandbox of a dsec that predates the tmpfs
    assert mount_sandbox_root(root) is False
    assert mount_points(root) == []
    assert (root / "sb-old").is_dir()
    release_sandbox_root(root)  # not ours: never unmounted, never removed
    assert (root / "sb-old").is_dir()
