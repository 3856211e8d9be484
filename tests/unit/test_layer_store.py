"""Unit tests of the layer store: EROFS builds, metadata, tarball safety, built-in images.

No mounts here (see tests/integration/test_layers_root.py). Needs mkfs.erofs (erofs-utils);
ownership checks only run as root.
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
import struct
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.errors import ImageNotFound, InvalidRequest, LayerNotFound, SandboxError, Unsupported
from dsec.layers import BUILTIN_IMAGES, BuiltinImage, LayerStore, extract_tarball, mkfs_erofs
from dsec.layers.builtin import build_busybox_rootfs, debian_mirror
from dsec.layers.erofs import _crc32c_raw, is_erofs_file, superblock_uuid

IS_ROOT = os.geteuid() == 0
FIXED_MTIME = 1_600_000_000


def _make_tree(root: Path, *, variant: str = "a") -> Path:
    """A small tree with a subdir, a symlink, an executable and fixed whole-second mtimes."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/motd").write_text(f"hello {variant}\n")
    (root / "bin").mkdir()
    (root / "bin/tool").write_text("#!/bin/sh\necho tool\n")
    os.chmod(root / "bin/tool", 0o755)
    os.symlink("tool", root / "bin/alias")
    (root / "empty").mkdir()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.utime(os.path.join(dirpath, name), (FIXED_MTIME, FIXED_MTIME), follow_symlinks=False)
    os.utime(root, (FIXED_MTIME, FIXED_MTIME))
    return root


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    s = LayerStore(tmp_path / "layers", tmp_path / "images")
    yield s
    s.close()


def _blob_files(store: LayerStore) -> list[Path]:
    return sorted((store.root / "blobs/sha256").iterdir())


# --- mkfs_erofs ------------------------------------------------------------------------


def test_mkfs_is_reproducible_and_uuid_depends_on_content(tmp_path: Path) -> None:
    tree_a = _make_tree(tmp_path / "a")
    tree_b = _make_tree(tmp_path / "b", variant="b")
    mkfs_erofs(tree_a, tmp_path / "a1.erofs")
    time.sleep(1.1)  # a different build second must not matter
    mkfs_erofs(tree_a, tmp_path / "a2.erofs")
    mkfs_erofs(tree_b, tmp_path / "b.erofs")
    assert (tmp_path / "a1.erofs").read_bytes() == (tmp_path / "a2.erofs").read_bytes()
    assert superblock_uuid(tmp_path / "a1.erofs") != superblock_uuid(tmp_path / "b.erofs")
    assert superblock_uuid(tmp_path / "a1.erofs").int != 0
    assert is_erofs_file(tmp_path / "a1.erofs")
    assert not is_erofs_file(tree_a / "etc/motd")


def test_mkfs_superblock_checksum_is_valid(tmp_path: Path) -> None:
    mkfs_erofs(_make_tree(tmp_path / "t"), tmp_path / "t.erofs")
    block = bytearray((tmp_path / "t.erofs").read_bytes()[:4096])
    stored = struct.unpack_from("<I", block, 1024 + 4)[0]
    assert struct.unpack_from("<Q", block, 1024 + 24)[0] == 0  # build time normalised
    struct.pack_into("<I", block, 1024 + 4, 0)
    assert _crc32c_raw(bytes(block[1024:4096])) == stored
    fsck = subprocess.run(["fsck.erofs", str(tmp_path / "t.erofs")], capture_output=True, text=True)
    assert fsck.returncode == 0
    assert "chksum" not in fsck.stderr and "<E>" not in fsck.stderr


def test_mkfs_uncompressed_and_errors(tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    mkfs_erofs(tree, tmp_path / "plain.erofs", compress=None)
    assert is_erofs_file(tmp_path / "plain.erofs")
    with pytest.raises(InvalidRequest):
        mkfs_erofs(tree, tmp_path / "x.erofs", compress="lz4; rm -rf /")
    with pytest.raises(InvalidRequest):
        mkfs_erofs(tmp_path / "missing", tmp_path / "x.erofs")
    with pytest.raises(SandboxError) as err:
        mkfs_erofs(tree, tmp_path / "no-such-dir" / "x.erofs")
    assert err.value.details["exit_code"] != 0
    with pytest.raises(SandboxError, match=r"mkfs\.erofs failed"):
        mkfs_erofs(tree, tmp_path / "x.erofs", compress="nosuchcompressor")


# --- layers ----------------------------------------------------------------------------


def test_build_layer_from_dir_is_content_addressed(store: LayerStore, tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    info = store.build_layer(tree, "workspace", name="app", meta={"k": 1})
    assert info.digest.startswith("sha256:") and len(info.digest) == 71
    assert info.kind == "workspace" and info.name == "app" and info.meta == {"k": 1}
    path = store.layer_path(info.digest)
    assert path.name == info.digest[7:] + ".erofs"
    assert info.size == path.stat().st_size > 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    again = store.build_layer(tree, "workspace", name="other")
    assert again.digest == info.digest
    assert again.name == "app"  # the first name sticks
    assert len(_blob_files(store)) == 1
    assert [layer.digest for layer in store.list_layers()] == [info.digest]
    assert store.get_layer(info.digest) == info
    assert list((store.root / "tmp").iterdir()) == []
    assert list(store.scratch.iterdir()) == []


def test_different_content_different_digest(store: LayerStore, tmp_path: Path) -> None:
    a = store.build_layer(_make_tree(tmp_path / "a"), "base")
    b = store.build_layer(_make_tree(tmp_path / "b", variant="b"), "base")
    assert a.digest != b.digest
    assert len(_blob_files(store)) == 2


def _tar_of(tree: Path, dest: Path, mode: str) -> Path:
    with tarfile.open(dest, mode, format=tarfile.PAX_FORMAT) as tf:
        tf.add(tree, arcname=".")
    return dest


def test_tarball_layer_equals_directory_layer(store: LayerStore, tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    from_dir = store.build_layer(tree, "base")
    from_tar = store.build_layer(_tar_of(tree, tmp_path / "t.tar", "w"), "base")
    from_tgz = store.build_layer(_tar_of(tree, tmp_path / "t.tgz", "w:gz"), "base")
    assert from_dir.digest == from_tar.digest == from_tgz.digest
    assert len(_blob_files(store)) == 1
    assert list(store.scratch.iterdir()) == []


def test_build_layer_rejects_bad_input(store: LayerStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        store.build_layer(tmp_path / "missing", "base")
    (tmp_path / "junk.tar").write_bytes(b"this is not a tarball" * 100)
    with pytest.raises(InvalidRequest):
        store.build_layer(tmp_path / "junk.tar", "base")
    with pytest.raises(InvalidRequest):
        store.build_layer(_make_tree(tmp_path / "t"), "nonsense")  # type: ignore[arg-type]
    assert _blob_files(store) == []
    assert list(store.scratch.iterdir()) == []


def test_import_layer_file_moves_it(store: LayerStore, tmp_path: Path) -> None:
    built = tmp_path / "built.erofs"
    mkfs_erofs(_make_tree(tmp_path / "t"), built)
    expected = built.read_bytes()
    info = store.import_layer_file(built, "toolkit", name="tk")
    assert not built.exists()
    assert store.layer_path(info.digest).read_bytes() == expected
    not_erofs = tmp_path / "x.erofs"
    not_erofs.write_bytes(b"\0" * 8192)
    with pytest.raises(InvalidRequest, match="not an EROFS"):
        store.import_layer_file(not_erofs, "base")
    assert not_erofs.exists()


def test_layer_lookup_errors(store: LayerStore) -> None:
    with pytest.raises(LayerNotFound):
        store.get_layer("sha256:" + "0" * 64)
    with pytest.raises(LayerNotFound):
        store.layer_path("sha256:" + "0" * 64)
    with pytest.raises(InvalidRequest):
        store.get_layer("sha256:xyz")
    with pytest.raises(InvalidRequest):
        store.layer_path("../../etc/passwd")


def test_concurrent_builds_of_same_content(store: LayerStore, tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "t")
    results: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(store.build_layer(tree, "base").digest)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1 and len(results) == 6
    assert len(_blob_files(store)) == 1
    assert len(store.list_layers()) == 1


# --- images ----------------------------------------------------------------------------


def test_images_put_get_list_remove_resolve(store: LayerStore, tmp_path: Path) -> None:
    a = store.build_layer(_make_tree(tmp_path / "a"), "base")
    b = store.build_layer(_make_tree(tmp_path / "b", variant="b"), "workspace")
    img = store.put_image("app:v1", [a.digest, b.digest], meta={"by": "test"})
    assert img.layers == [a.digest, b.digest] and img.size == a.size + b.size
    assert store.get_image("app:v1").layers == [a.digest, b.digest]
    assert store.get_image("app:v1").meta == {"by": "test"}
    assert [i.name for i in store.list_images()] == ["app:v1"]
    single = store.get_image(a.digest)
    assert single.layers == [a.digest]
    resolved = store.resolve_layers(["app:v1", a.digest])
    assert [layer.digest for layer in resolved] == [b.digest, a.digest]  # topmost copy kept
    assert [layer.digest for layer in store.resolve_layers([b.digest, "app:v1"])] == [
        a.digest,
        b.digest,
    ]
    store.put_image("app:v1", [b.digest])  # replace
    assert store.get_image("app:v1").layers == [b.digest]
    store.remove_image("app:v1")
    with pytest.raises(ImageNotFound):
        store.get_image("app:v1")
    with pytest.raises(ImageNotFound):
        store.remove_image("app:v1")
    store.get_layer(a.digest)  # layers survive their image


def test_image_errors(store: LayerStore, tmp_path: Path) -> None:
    a = store.build_layer(_make_tree(tmp_path / "a"), "base")
    with pytest.raises(LayerNotFound):
        store.put_image("x", [a.digest, "sha256:" + "1" * 64])
    with pytest.raises(InvalidRequest):
        store.put_image("Bad Name", [a.digest])
    with pytest.raises(InvalidRequest):
        store.put_image("sha256:" + "a" * 64, [a.digest])
    with pytest.raises(InvalidRequest):
        store.put_image("empty", [])
    with pytest.raises(ImageNotFound):
        store.resolve_layers(["nope"])
    with pytest.raises(LayerNotFound):
        store.resolve_layers(["sha256:" + "2" * 64])
    with pytest.raises(ImageNotFound):
        store.get_image("sha256:" + "3" * 64)


def test_metadata_persists_across_reopen(tmp_path: Path) -> None:
    s1 = LayerStore(tmp_path / "layers", tmp_path / "images")
    a = s1.build_layer(_make_tree(tmp_path / "a"), "toolkit", name="tk", meta={"v": [1, 2]})
    s1.put_image("tk", [a.digest])
    s1.close()
    s2 = LayerStore(tmp_path / "layers", tmp_path / "images")
    try:
        assert s2.get_layer(a.digest).meta == {"v": [1, 2]}
        assert s2.get_image("tk").layers == [a.digest]
        assert (s2.root / "layers.db").exists()
    finally:
        s2.close()


def test_crash_leftovers_are_cleaned_on_open(tmp_path: Path) -> None:
    s1 = LayerStore(tmp_path / "layers", tmp_path / "images")
    kept = s1.build_layer(_make_tree(tmp_path / "a"), "base")
    gone = s1.build_layer(_make_tree(tmp_path / "b", variant="b"), "base")
    s1.close()
    root = tmp_path / "layers"
    # a build that died: temp image + stale lock + scratch dir
    (root / "tmp/99-dead.erofs").write_bytes(b"partial")
    (root / "tmp/99-dead.lock").write_bytes(b"")
    (tmp_path / "images/layer-99-dead/rootfs/etc").mkdir(parents=True)
    # a build that is still running in "another process": its lock is held
    live_fd = os.open(root / "tmp/98-live.lock", os.O_RDWR | os.O_CREAT)
    import fcntl

    fcntl.flock(live_fd, fcntl.LOCK_EX)
    (root / "tmp/98-live.erofs").write_bytes(b"in progress")
    # a blob published without its row, and a row whose blob vanished
    (root / "blobs/sha256" / ("f" * 64 + ".erofs")).write_bytes(b"orphan")
    (root / "blobs/sha256" / (gone.digest[7:] + ".erofs")).unlink()
    s2 = LayerStore(root, tmp_path / "images")
    try:
        assert not (root / "tmp/99-dead.erofs").exists()
        assert not (root / "tmp/99-dead.lock").exists()
        assert not (tmp_path / "images/layer-99-dead").exists()
        assert (root / "tmp/98-live.erofs").exists()
        assert not (root / "blobs/sha256" / ("f" * 64 + ".erofs")).exists()
        assert [layer.digest for layer in s2.list_layers()] == [kept.digest]
        with pytest.raises(LayerNotFound):
            s2.get_layer(gone.digest)
    finally:
        s2.close()
        os.close(live_fd)


# --- tarball safety ----------------------------------------------------------------------


def _add(tf: tarfile.TarFile, name: str, *, data: bytes = b"", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = FIXED_MTIME
    for k, v in attrs.items():
        setattr(info, k, v)
    tf.addfile(info, io.BytesIO(data) if info.isreg() else None)


def _tarball(path: Path, build: object) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        build(tf)  # type: ignore[operator]
    return path


def test_tar_rejects_dotdot(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tar = _tarball(tmp_path / "evil.tar", lambda tf: _add(tf, "../outside/pwned", data=b"x"))
    with pytest.raises(InvalidRequest, match="escaping"):
        extract_tarball(tar, tmp_path / "root")
    assert list(outside.iterdir()) == []


def test_tar_symlink_escapes_stay_inside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"

    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "/abs/file", data=b"abs")  # leading slash stripped
        _add(tf, "up", type=tarfile.SYMTYPE, linkname="../../../" + str(outside))
        _add(tf, "up/through-relative", data=b"r")
        _add(tf, "rootlink", type=tarfile.SYMTYPE, linkname=str(outside))
        _add(tf, "rootlink/through-absolute", data=b"a")
        _add(tf, "dirlink", type=tarfile.SYMTYPE, linkname="/")
        _add(tf, "dirlink/at-root", data=b"d")

    extract_tarball(_tarball(tmp_path / "sym.tar", build), root)
    assert list(outside.iterdir()) == []
    assert (root / "abs/file").read_bytes() == b"abs"
    # '..' in a symlink target stops at the extraction root; absolute targets restart there
    assert (root / str(outside).lstrip("/") / "through-relative").read_bytes() == b"r"
    assert (root / str(outside).lstrip("/") / "through-absolute").read_bytes() == b"a"
    assert (root / "at-root").read_bytes() == b"d"
    assert os.readlink(root / "dirlink") == "/"  # symlinks kept verbatim


def test_tar_hardlinks_cannot_escape(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    tar = _tarball(
        tmp_path / "hl.tar",
        lambda tf: _add(tf, "stolen", type=tarfile.LNKTYPE, linkname=str(secret)),
    )
    with pytest.raises(InvalidRequest, match="not in the archive"):
        extract_tarball(tar, tmp_path / "root")
    tar2 = _tarball(
        tmp_path / "hl2.tar",
        lambda tf: _add(tf, "stolen", type=tarfile.LNKTYPE, linkname="../secret"),
    )
    with pytest.raises(InvalidRequest):
        extract_tarball(tar2, tmp_path / "root2")
    assert secret.stat().st_nlink == 1


def test_tar_preserves_modes_links_and_owners(tmp_path: Path) -> None:
    root = tmp_path / "root"

    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "./", type=tarfile.DIRTYPE, mode=0o755)
        _add(tf, "tmp", type=tarfile.DIRTYPE, mode=0o1777)
        _add(tf, "ro", type=tarfile.DIRTYPE, mode=0o555)
        _add(tf, "ro/inside", data=b"i", mode=0o644)
        _add(tf, "usr/bin/su", data=b"\x7fELF", mode=0o4755, uid=0, gid=0)
        _add(tf, "home/sandbox/.profile", data=b"p", mode=0o600, uid=1000, gid=1000)
        _add(tf, "usr/bin/su2", type=tarfile.LNKTYPE, linkname="usr/bin/su")
        _add(tf, "bin", type=tarfile.SYMTYPE, linkname="usr/bin")
        _add(tf, "bin/via-symlink", data=b"v", mode=0o700)
        _add(tf, "dev/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
        _add(tf, "dev/sda", type=tarfile.BLKTYPE, devmajor=8, devminor=0, mode=0o660)
        _add(tf, "pipe", type=tarfile.FIFOTYPE, mode=0o644)
        _add(tf, "later", data=b"first")
        _add(tf, "later", data=b"second")
        if IS_ROOT:
            _add(tf, "whiteout", type=tarfile.CHRTYPE, devmajor=0, devminor=0)

    counts = extract_tarball(_tarball(tmp_path / "modes.tar", build), root)
    assert counts["skipped_devices"] == 2
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(root / "ro").st_mode) == 0o555
    assert (root / "ro/inside").read_bytes() == b"i"
    assert stat.S_IMODE(os.stat(root / "usr/bin/su").st_mode) == 0o4755
    assert os.stat(root / "usr/bin/su").st_ino == os.stat(root / "usr/bin/su2").st_ino
    assert os.readlink(root / "bin") == "usr/bin"
    assert (root / "usr/bin/via-symlink").read_bytes() == b"v"
    assert not (root / "dev/null").exists() and not (root / "dev/sda").exists()
    assert stat.S_ISFIFO(os.lstat(root / "pipe").st_mode)
    assert (root / "later").read_bytes() == b"second"
    assert os.stat(root / "ro/inside").st_mtime == FIXED_MTIME
    assert os.stat(root / "ro").st_mtime == FIXED_MTIME
    if IS_ROOT:
        st = os.stat(root / "home/sandbox/.profile")
        assert (st.st_uid, st.st_gid) == (1000, 1000)
        wh = os.lstat(root / "whiteout")
        assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)


def test_tar_xattrs_restored(tmp_path: Path) -> None:
    def build(tf: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("f")
        info.size = 1
        info.pax_headers = {"SCHILY.xattr.user.dsec": "yes"}
        tf.addfile(info, io.BytesIO(b"x"))

    extract_tarball(_tarball(tmp_path / "x.tar", build), tmp_path / "root")
    try:
        assert os.getxattr(tmp_path / "root/f", "user.dsec") == b"yes"
    except OSError as e:  # filesystems without user xattrs
        pytest.skip(f"no user xattrs here: {e}")


# --- built-in images -------------------------------------------------------------------


def test_busybox_rootfs_is_complete_and_deterministic(tmp_path: Path) -> None:
    build_busybox_rootfs(tmp_path / "bb")
    root = tmp_path / "bb"
    assert os.readlink(root / "bin/sh") == "/bin/busybox"
    assert (root / "usr/bin/awk").is_symlink()
    passwd = (root / "etc/passwd").read_text()
    assert (
        "root:x:0:0:" in passwd and "sandbox:x:1000:1000:" in passwd and "nobody:x:65534" in passwd
    )
    assert "sandbox:x:1000:" in (root / "etc/group").read_text()
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o1777
    assert (root / "etc/resolv.conf").read_text() == ""
    for d in ("proc", "sys", "dev", "root", "home/sandbox"):
        assert (root / d).is_dir()
    if IS_ROOT:
        assert os.stat(root / "home/sandbox").st_uid == 1000
    build_busybox_rootfs(tmp_path / "bb2")
    mkfs_erofs(root, tmp_path / "1.erofs")
    mkfs_erofs(tmp_path / "bb2", tmp_path / "2.erofs")
    assert (tmp_path / "1.erofs").read_bytes() == (tmp_path / "2.erofs").read_bytes()


def test_debian_mirror_parsing(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert debian_mirror(apt) == "http://deb.debian.org/debian"
    (apt / "sources.list").write_text(
        "# comment\ndeb [signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
    )
    assert debian_mirror(apt) == "http://mirror.example/debian"
    (apt / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://deb822.example/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert debian_mirror(apt) == "http://deb822.example/debian"


class _CountingBuilder:
    """A fake built-in recipe: writes a tiny rootfs after ``delay_s``; counts its runs."""

    def __init__(self, delay_s: float = 0.3, fail: bool = False) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self, dest: Path) -> None:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail:
            raise SandboxError("fake build failed")
        (dest / "etc").mkdir()
        (dest / "etc/fake").write_text("fake image\n")


async def test_ensure_image_single_flight(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = 0
    ticks_during_build: list[int] = []  # the ticker's count as the build starts and ends

    def build(dest: Path) -> None:
        ticks_during_build.append(ticks)
        _CountingBuilder.__call__(builder, dest)
        ticks_during_build.append(ticks)

    builder = _CountingBuilder(delay_s=0.4)
    monkeypatch.setitem(BUILTIN_IMAGES, "fake", BuiltinImage(name="fake", build_rootfs=build))
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    tick_task = asyncio.create_task(ticker())
    waiters = [asyncio.create_task(store.ensure_image("fake")) for _ in range(8)]
    async with asyncio.timeout(budget(10)):  # the build is under way
        while builder.calls == 0:
            await asyncio.sleep(0.01)
    waiters[0].cancel()  # a cancelled waiter must not cancel the build for the others
    results = await asyncio.gather(*waiters[1:])
    stop.set()
    await tick_task
    assert builder.calls == 1
    assert all(threading.main_thread().name not in t for t in builder.threads)
    assert len({tuple(r.layers) for r in results}) == 1
    start, end = ticks_during_build
    assert end > start, "the event loop was blocked during the build"
    assert waiters[0].cancelled()
    image = await store.ensure_image("fake")  # now stored: no new build
    assert builder.calls == 1
    assert image.meta["builtin"] == "fake"
    assert store.get_layer(image.layers[0]).kind == "base"
    assert store.ensure_image_sync("fake").layers == image.layers


async def test_ensure_image_failure_is_shared_then_retried(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = _CountingBuilder(delay_s=0.2, fail=True)
    monkeypatch.setitem(BUILTIN_IMAGES, "flaky", BuiltinImage(name="flaky", build_rootfs=builder))
    results = await asyncio.gather(
        *(store.ensure_image("flaky") for _ in range(4)), return_exceptions=True
    )
    # the node's tools failed: the callers are told this node cannot give the image (422)
    assert all(isinstance(r, Unsupported) for r in results)
    assert results[0].details == {"image": "flaky", "cause": "fake build failed"}
    assert "cannot build the built-in image 'flaky'" in str(results[0])
    assert store.builtin_status("flaky") == ("failed", str(results[0]), 0.0)
    assert builder.calls == 1
    builder.fail = False
    image = await store.ensure_image("flaky")
    assert builder.calls == 2 and image.layers
    assert list(store.scratch.iterdir()) == []


async def test_ensure_image_unknown_lists_known(store: LayerStore) -> None:
    with pytest.raises(ImageNotFound) as err:
        await store.ensure_image("no-such-image")
    assert "busybox" in err.value.details["known"] and "debian" in err.value.details["known"]
    assert "busybox" in str(err.value)


async def test_ensure_busybox_builds_once(store: LayerStore) -> None:
    first, second = await asyncio.gather(
        store.ensure_image("busybox"), store.ensure_image("busybox")
    )
    assert first.layers == second.layers and len(first.layers) == 1
    assert store.get_layer(first.layers[0]).size < 4 << 20


def test_build_image_on_base(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = _CountingBuilder(delay_s=0.0)
    monkeypatch.setitem(BUILTIN_IMAGES, "basey", BuiltinImage(name="basey", build_rootfs=builder))
    image = store.build_image(_make_tree(tmp_path / "ws"), "ws", kind="workspace", base="basey")
    base = store.get_image("basey")
    assert image.layers[:-1] == base.layers and len(image.layers) == 2
    assert store.get_layer(image.layers[-1]).kind == "workspace"
    alone = store.build_image(_make_tree(tmp_path / "ws2", variant="2"), "ws2")
    assert len(alone.layers) == 1
    with pytest.raises(ImageNotFound):
        store.build_image(tmp_path / "ws", "ws3", base="missing-base")
    with pytest.raises(InvalidRequest):
        store.build_image(tmp_path / "ws", "Not Valid")
