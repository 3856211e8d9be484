"""EROFS layers through loop devices (kernels before 6.12; forced here with
``DSEC_EROFS_MOUNT=loop``): binding and freeing devices without leaks, one device per layer
file, recognising loop-backed mounts after a restart, and the container and fncall tiers
running on them.

Leaks are counted as loop devices bound to this test's files
(``/sys/block/loop*/loop/backing_file``), never the machine's total: other tests run beside.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.config import Paths
from dsec.footprint import server_footprint
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.mounts import LayerMounts, mountinfo_entries
from dsec.models import ExecRequest
from dsec.privileged.loop import attach_loop, attached_loops, loop_backing_file
from dsec.privileged.mount import (
    EROFS_MOUNT_ENV,
    erofs_file_mount_supported,
    erofs_mount_mode,
    erofs_mount_reason,
    erofs_mount_sources,
    mount_erofs,
    mount_points,
    umount,
    umount_quiet,
)
from dsec.privileged.nodesetup import kernel_features

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, loop devices)"),
    pytest.mark.skipif(not os.path.exists("/dev/loop-control"), reason="no loop devices"),
]


def loops_of(files: set[str]) -> dict[str, str]:
    """Bound loop devices whose backing file is one of ``files`` (real paths)."""
    return {d: f for d, f in attached_loops().items() if f in files}


def real_paths(files: list[str] | list[Path]) -> set[str]:
    return {os.path.realpath(f) for f in files}


def loops_under(root: Path) -> dict[str, str]:
    prefix = f"{os.path.realpath(root)}/"
    return {d: f for d, f in attached_loops().items() if f.startswith(prefix)}


def mounted_elsewhere(dev: str) -> list[int]:
    """Pids of other mount namespaces in which loop device ``dev`` is mounted. A namespace
    made while one of our mounts existed (another test's ``unshare --mount`` build, a
    container before its pivot_root) holds a copy of it, so the device stays in use, and
    bound, until that namespace lets go: busy, not leaked."""
    try:
        majmin = Path(f"/sys/block/{os.path.basename(dev)}/dev").read_text().strip()
    except OSError:
        return []
    own = os.readlink("/proc/self/ns/mnt")
    seen, out = {own}, []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ns = os.readlink(p / "ns" / "mnt")
            if ns in seen:
                continue
            seen.add(ns)
            text = (p / "mountinfo").read_text()
        except OSError:
            continue
        if any(line.split(" ", 3)[2] == majmin for line in text.splitlines()):
            out.append(int(p.name))
    return out


def leaked_loops(pick: Callable[[], dict[str, str]], timeout_s: float = 5.0) -> dict[str, str]:
    """Loop devices of ``pick()`` still bound once the budget ends, or none as soon as there
    are none, less those mounted in other mount namespaces (see :func:`mounted_elsewhere`).
    AUTOCLEAR unbinds a device at its last unmount; a namespace going away may finish later."""
    deadline = time.monotonic() + budget(timeout_s)
    while True:
        left = pick()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return {d: f for d, f in left.items() if not mounted_elsewhere(d)}


def make_image(path: Path, files: dict[str, str]) -> Path:
    src = path.with_suffix(".src")
    src.mkdir(parents=True)
    for rel, text in files.items():
        (src / rel).write_text(text)
    mkfs_erofs(src, path, compress=None)
    shutil.rmtree(src)
    return path


@pytest.fixture
def loop_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EROFS_MOUNT_ENV, "loop")


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory on disk; checks that no mount and no loop device is left on it."""
    d = Path(f"/tmp/dsec-loop-{secrets.token_hex(3)}")
    d.mkdir()
    try:
        yield d
    finally:
        leaked = mount_points(d)
        for mp in sorted(leaked, key=lambda p: len(p.parts), reverse=True):
            umount_quiet(mp)
        loops = leaked_loops(lambda: loops_under(d))
        shutil.rmtree(d, ignore_errors=True)
        assert not leaked, f"mounts left under {d}: {leaked}"
        assert not loops, f"loop devices left bound to files under {d}: {loops}"


def test_mode_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EROFS_MOUNT_ENV, "loop")
    assert erofs_mount_mode() == "loop"
    assert EROFS_MOUNT_ENV in erofs_mount_reason()
    monkeypatch.setenv(EROFS_MOUNT_ENV, "file")
    assert erofs_mount_mode() == "file"
    monkeypatch.setenv(EROFS_MOUNT_ENV, "auto")
    supported = erofs_file_mount_supported()
    assert erofs_mount_mode() == ("file" if supported else "loop")
    assert erofs_mount_reason()  # a sentence for `dsec doctor`
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if release < (6, 12):
        assert not supported and "needs 6.12" in erofs_mount_reason()
    feats = kernel_features()
    assert feats["erofs_loop"] and feats["erofs_file_mount"] == supported


def test_mount_through_loop_and_free_on_unmount(work: Path, loop_mode: None) -> None:
    img = make_image(work / "a.erofs", {"hello": "hi\n"})
    mp = work / "mnt"
    mp.mkdir()
    source = mount_erofs(img, mp)
    assert source.startswith("/dev/loop")
    [entry] = [e for e in mountinfo_entries(mp) if e.mountpoint == mp]
    assert (entry.fstype, entry.source) == ("erofs", source)
    assert entry.source_file == str(img) == loop_backing_file(source)
    assert (mp / "hello").read_text() == "hi\n"
    with pytest.raises(OSError):
        (mp / "x").write_text("read-only")
    assert loops_under(work) == {source: str(img)}
    dio = Path(f"/sys/block/{source[5:]}/loop/dio").read_text().strip()
    assert dio in ("0", "1")  # direct I/O when the kernel takes it (ext4 here: 1)
    umount(mp)
    assert leaked_loops(lambda: loops_under(work)) == {}


def test_no_leak_over_many_cycles_and_failures(work: Path, loop_mode: None) -> None:
    img = make_image(work / "a.erofs", {"f": "1\n"})
    junk = work / "junk.erofs"
    junk.write_bytes(b"\0" * 65536)  # no EROFS superblock
    mp = work / "mnt"
    mp.mkdir()
    for _ in range(50):
        mount_erofs(img, mp)
        umount(mp)
        with pytest.raises(OSError) as e:
            mount_erofs(junk, mp)  # bound, mount refused, unbound again
        assert "junk.erofs" in str(e.value)
    with attach_loop(img) as dev:  # bound, never mounted: freed at close
        assert loops_under(work)[dev.path] == str(img)
    assert leaked_loops(lambda: loops_under(work)) == {}


def test_auto_falls_back_for_files_on_tmpfs(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs cannot back EROFS on any kernel (ENOTBLK): ``auto`` uses a loop device there."""
    monkeypatch.setenv(EROFS_MOUNT_ENV, "auto")
    shm = Path(f"/dev/shm/dsec-loop-{secrets.token_hex(3)}.erofs")
    shutil.copyfile(make_image(work / "a.erofs", {"f": "tmpfs\n"}), shm)
    mp = work / "mnt"
    mp.mkdir()
    try:
        source = mount_erofs(shm, mp)
        assert source.startswith("/dev/loop") and (mp / "f").read_text() == "tmpfs\n"
        umount(mp)
        with erofs_mount_sources([shm, work / "a.erofs"]) as sources:
            assert sources[0].startswith("/dev/loop")
            if erofs_file_mount_supported():  # a file on ext4: mounted as it is
                assert sources[1] == str(work / "a.erofs")
            else:
                assert sources[1].startswith("/dev/loop")
        assert leaked_loops(lambda: loops_of({str(shm)})) == {}
        monkeypatch.setenv(EROFS_MOUNT_ENV, "file")
        if erofs_file_mount_supported():
            with pytest.raises(OSError):
                mount_erofs(shm, mp)  # forced file mounts are not retried
    finally:
        umount_quiet(mp)
        shm.unlink()


def test_one_device_per_file_across_threads_and_processes(work: Path, loop_mode: None) -> None:
    img = make_image(work / "a.erofs", {"f": "shared\n"})
    targets = [work / f"m{i}" for i in range(4)]
    for t in targets:
        t.mkdir()
    sources: list[str] = []
    barrier = threading.Barrier(2)

    def mount_one(t: Path) -> None:
        barrier.wait()
        sources.append(mount_erofs(img, t))

    threads = [threading.Thread(target=mount_one, args=(t,)) for t in targets[:2]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # two more from other processes, at the same time (flock on the file)
    go = work / "go"
    code = (
        "import os, sys, time\n"
        "from dsec.privileged.mount import mount_erofs\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.001)\n"
        "print(mount_erofs(sys.argv[2], sys.argv[3]))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(go), str(img), str(t)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for t in targets[2:]
    ]
    go.touch()
    for p in procs:
        out, _ = p.communicate(timeout=budget(30))
        assert p.returncode == 0
        sources.append(out.strip())
    assert len(set(sources)) == 1, sources
    assert len(loops_under(work)) == 1
    for t in targets:
        assert (t / "f").read_text() == "shared\n"
    # every mount of one loop device is one superblock: one page cache per layer
    assert len({os.stat(t).st_dev for t in targets}) == 1
    for t in targets[:-1]:
        umount(t)
        assert len(loops_under(work)) == 1  # still held by the other mounts
    umount(targets[-1])
    assert leaked_loops(lambda: loops_under(work)) == {}


def _blob(work: Path, text: str) -> tuple[str, Path]:
    """A layer file named like a store blob (``<sha256>.erofs``) and its digest."""
    tmp = make_image(work / f"tmp-{secrets.token_hex(3)}.erofs", {"f": text})
    hex_ = hashlib.sha256(tmp.read_bytes()).hexdigest()
    blob = work / "blobs" / f"{hex_}.erofs"
    blob.parent.mkdir(exist_ok=True)
    tmp.rename(blob)
    return f"sha256:{hex_}", blob


def test_layer_mounts_share_one_device_and_recover(work: Path, loop_mode: None) -> None:
    digest, blob = _blob(work, "layer\n")
    mounts = LayerMounts(work / "m")
    results: list[Path] = []
    barrier = threading.Barrier(2)

    def acquire() -> None:
        barrier.wait()
        results.append(mounts.acquire(digest, blob))

    threads = [threading.Thread(target=acquire) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results[0] == results[1] and mounts.refcount(digest) == 2
    mp = results[0]
    [entry] = mountinfo_entries(mp)
    assert entry.source.startswith("/dev/loop") and entry.source_file == str(blob)
    assert loops_under(work) == {entry.source: str(blob)}
    fp = server_footprint(os.getpid(), work)
    assert fp.loop_devices == [f"{entry.source} {blob}"]

    # a restarted edge: a new object adopts the loop-backed mount, and reuses it
    again = LayerMounts(work / "m")
    again.adopt_existing()
    assert again.mounted() == {digest: mp} and again.refcount(digest) == 0
    fresh = LayerMounts(work / "m")  # without adopt_existing: acquire finds the mount
    assert fresh.acquire(digest, blob) == mp
    assert len(mountinfo_entries(mp)) == 1 and len(loops_under(work)) == 1
    fresh.close()  # in use: stays

    # a stray loop mount at a layer mountpoint (not a store blob) is unmounted on adoption
    stray_file = make_image(work / "stray.erofs", {"f": "stray\n"})
    stray = work / "m" / "0123456789abcdef"
    stray.mkdir()
    mount_erofs(stray_file, stray)
    again.adopt_existing()
    assert not mountinfo_entries(stray)
    assert leaked_loops(lambda: loops_of({str(stray_file)})) == {}

    assert again.unmount_unused() == 1
    assert not mountinfo_entries(mp)
    assert leaked_loops(lambda: loops_under(work)) == {}
    mounts.close()


# --- the tiers on loop devices -------------------------------------------------------------


@pytest.fixture
def home() -> Iterator[Paths]:
    h = Path(f"/tmp/dsec-lp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    paths = Paths(h)
    paths.ensure()
    yield paths
    mounts = LayerMounts(paths.layer_mounts)
    mounts.adopt_existing()
    mounts.unmount_unused()
    left = mount_points(h)
    shutil.rmtree(h, ignore_errors=True)
    assert not left, f"mounts left under {h}: {left}"


async def test_container_tier_on_loop_devices(home: Paths, loop_mode: None) -> None:
    from dsec.contract.runtime import SandboxSpec, capabilities_of
    from dsec.layers.store import LayerStore
    from dsec.runtimes.container.runtime import ContainerRuntime

    store = LayerStore(home.layers, home.scratch)
    image = store.ensure_image_sync("busybox")
    files = [str(store.layer_path(d)) for d in image.layers]
    ours = real_paths(files)
    rt = ContainerRuntime(home, LayerMounts(home.layer_mounts))
    await rt.start()
    try:
        assert capabilities_of(rt).available, capabilities_of(rt).reason
        spec = SandboxSpec(
            id=f"sb-t-{uuid.uuid4().hex[:10]}",
            tier="container",
            layer_paths=files,
            layer_digests=list(image.layers),
            cpu=1.0,
            memory_mb=256,
            disk_mb=64,
            pids=256,
            env={},
            user=None,
            workdir="/",
        )
        h = await rt.create(spec)
        try:
            r = await rt.exec(h, ExecRequest(cmd="echo hi"))
            assert (r.stdout, r.exit_code) == ("hi\n", 0), r
            # the overlay names its lowers by descriptor (no host path in mountinfo): the
            # sandbox's layer mounts are the node's
            lowers = [rt.layer_mounts.mounted()[d] for d in image.layers]
            for lower in lowers:
                [entry] = [e for e in mountinfo_entries(lower) if e.mountpoint == lower]
                assert entry.fstype == "erofs" and entry.source.startswith("/dev/loop"), entry
                assert real_paths([entry.source_file]) <= ours
            assert set(loops_of(ours).values()) == ours  # one device per layer file
            assert len(loops_of(ours)) == len(ours)
        finally:
            await rt.destroy(h)
    finally:
        await rt.close()
        mounts = LayerMounts(home.layer_mounts)
        mounts.adopt_existing()
        mounts.unmount_unused()
        store.close()
    assert leaked_loops(lambda: loops_of(ours)) == {}


@pytest.mark.debian
async def test_fncall_tier_on_loop_devices(home: Paths, loop_mode: None) -> None:
    from dsec.runtimes.fncall.pool import PoolConfig
    from dsec.runtimes.fncall.testkit import fncall_service, worker_spec

    async with fncall_service(home.home, pool=PoolConfig(min_ready=1, max_ready=2)) as svc:
        rt = svc.runtime
        files, digests = await rt.image_layers("debian")
        ours = real_paths(files)
        spec = worker_spec(files, digests, f"sb-t-{uuid.uuid4().hex[:10]}")
        h = await rt.create(spec)
        try:
            r = await rt.exec(h, ExecRequest(cmd="echo hi"))
            assert (r.stdout, r.exit_code) == ("hi\n", 0), r
            # the pool's root is stacked on loop devices bound to the image's layer files,
            # mounted in the pool's own namespace (an exclusive open says: in use)
            bound = loops_of(ours)
            assert set(bound.values()) == ours and len(bound) == len(ours), bound
            for dev in bound:
                with pytest.raises(OSError):
                    os.close(os.open(dev, os.O_RDONLY | os.O_EXCL))
        finally:
            await rt.destroy(h)
    # the pools' namespaces are gone with their zygotes: AUTOCLEAR freed the devices
    assert leaked_loops(lambda: loops_of(ours), timeout_s=10) == {}
