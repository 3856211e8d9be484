"""Red-team cases against the container tier's host side, on real busybox containers:
sparse files in snapshots, tar bombs, very deep trees, and the kernel mounts (/proc, /sys,
/dev) through the files API. Each must end in a typed error or a bounded success, never a
500, a full disk or a memory spike on the node."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import time
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec, capabilities_of
from dsec.errors import Conflict, DsecError, InvalidRequest, QuotaExceeded
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import upper_dir
from dsec.layers.store import LayerStore
from dsec.models import ExecRequest, ExecResult, SnapshotRequest
from dsec.privileged.mount import mount_points
from dsec.runtimes.container.files import RootedFiles, _walk_tree
from dsec.runtimes.container.runtime import ContainerRuntime

pytestmark = pytest.mark.root

MiB = 1 << 20
Factory = Callable[..., Awaitable[Handle]]


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Paths, LayerStore, list[str], list[str]]]:
    """A private DSEC_HOME (under /tmp/dsec-cfix-*) with the busybox image built."""
    home = Path(f"/tmp/dsec-cfix-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    paths = Paths(home)
    paths.ensure()
    store = LayerStore(paths.layers, paths.scratch)
    image = store.ensure_image_sync("busybox")
    yield paths, store, [str(store.layer_path(d)) for d in image.layers], list(image.layers)
    store.close()
    mounts = LayerMounts(paths.layer_mounts)
    mounts.adopt_existing()
    mounts.unmount_unused()
    assert not mount_points(home), f"mounts left under {home}"
    shutil.rmtree(home)


@pytest.fixture
async def runtime(
    node: tuple[Paths, LayerStore, list[str], list[str]],
) -> AsyncIterator[ContainerRuntime]:
    rt = ContainerRuntime(node[0], LayerMounts(node[0].layer_mounts))
    await rt.start()
    assert capabilities_of(rt).available, capabilities_of(rt).reason
    yield rt
    await rt.close()


@pytest.fixture
async def make(
    runtime: ContainerRuntime, node: tuple[Paths, LayerStore, list[str], list[str]]
) -> AsyncIterator[Factory]:
    made: list[Handle] = []

    async def factory(**kw: object) -> Handle:
        args: dict = dict(
            id=f"sb-cfix-{uuid.uuid4().hex[:10]}",
            tier="container",
            layer_paths=node[2],
            layer_digests=node[3],
            cpu=1.0,
            memory_mb=256,
            disk_mb=64,
            pids=256,
            env={},
            user=None,
            workdir="/",
        )
        args.update(kw)
        handle = await runtime.create(SandboxSpec(**args))
        made.append(handle)
        return handle

    yield factory
    for h in made:
        await runtime.destroy(h)
        assert not (runtime.paths.sandboxes / h.id).exists()


async def run(rt: ContainerRuntime, h: Handle, cmd: str) -> ExecResult:
    r = await rt.exec(h, ExecRequest(cmd=cmd, timeout_s=60))
    assert r.ok, (cmd, r)
    return r


# -- 1. sparse files in snapshots ------------------------------------------------------


async def test_sparse_file_snapshot_is_refused_then_packs_small(
    runtime: ContainerRuntime, make: Factory, node: tuple[Paths, LayerStore, list, list]
) -> None:
    store = node[1]
    h = await make(disk_mb=64)
    await run(runtime, h, "truncate -s 8G /root/sparse && du -k /root/sparse")
    t0 = time.perf_counter()
    read0 = _bytes_read()
    with pytest.raises(QuotaExceeded) as exc:
        await runtime.snapshot(h, store, SnapshotRequest(), {})
    read = _bytes_read() - read0
    refuse_ms = (time.perf_counter() - t0) * 1000
    print(
        f"8 GiB sparse file refused in {refuse_ms:.0f} ms, {read} bytes read: {exc.value.message}"
    )
    assert exc.value.details["limit"] == 64 * MiB  # the sandbox's disk_mb, from its upper
    assert exc.value.details["path"] == "/root/sparse"
    assert read < 64 * MiB  # refused from its size: the file was not read (not even to the cap)
    assert not any(store.scratch.glob("pack-*")), "a partial layer was left"
    await run(runtime, h, "echo still running")  # thawed after the refusal

    # under the cap: holes stay holes in an uncompressed snapshot (chunk-based image)
    await run(
        runtime,
        h,
        "rm /root/sparse && truncate -s 48M /root/sparse && "
        "echo MIDDLE | dd of=/root/sparse bs=1 seek=25165824 conv=notrunc 2>/dev/null",
    )
    expected = hashlib.sha256(await _read_all(upper_dir(runtime.paths.sandboxes / h.id))).digest()
    t0 = time.perf_counter()
    layer = await runtime.snapshot(h, store, SnapshotRequest(compress=False), {})
    pack_ms = (time.perf_counter() - t0) * 1000
    stats = layer.meta["pack_diff"]
    print(
        f"48 MiB sparse: layer {layer.size} bytes in {pack_ms:.0f} ms, chunked={stats['chunked']}"
    )
    assert stats["chunked"] and layer.size < 2 * MiB
    mounts = LayerMounts(node[0].layer_mounts)
    mnt = mounts.acquire(layer.digest, store.layer_path(layer.digest))
    try:
        assert hashlib.sha256(await _read_all(mnt)).digest() == expected
    finally:
        mounts.release(layer.digest)


async def _read_all(root: Path) -> bytes:
    with open(root / "root/sparse", "rb") as f:
        return f.read()


# -- 2. tar bombs -----------------------------------------------------------------------


def _bytes_read() -> int:
    """Bytes this process (and its reaped children) got from read-like calls: /proc/self/io
    ``rchar``."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _gz_tar_of_zeros(name: str, size: int) -> bytes:
    """A .tar.gz holding one member of ``size`` zero bytes (built in bounded memory)."""
    ti = tarfile.TarInfo(name)
    ti.size = size
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=1) as gz:
        gz.write(ti.tobuf(tarfile.PAX_FORMAT))
        chunk = bytes(MiB)
        for off in range(0, size, MiB):
            gz.write(chunk[: min(MiB, size - off)])
        gz.write(bytes(-size % 512 + 1024))  # padding, then the two end-of-archive blocks
    return buf.getvalue()


async def test_tar_bomb_is_streamed_and_refused(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make(disk_mb=64)
    files = runtime.files(h)
    bomb = _gz_tar_of_zeros("zeros", 256 * MiB)
    print(f"tar.gz of a 256 MiB member: {len(bomb)} bytes")
    tracemalloc.start()
    try:
        with pytest.raises(QuotaExceeded) as exc:
            await files.upload_tar("/up", bomb)
        _, peak_refused = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        ok = _gz_tar_of_zeros("fits", 24 * MiB)
        tracemalloc.reset_peak()
        assert await files.upload_tar("/up", ok) == 1
        _, peak_ok = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(
        f"python heap peak: refused {peak_refused / MiB:.1f} MiB, 24 MiB upload {peak_ok / MiB:.1f} MiB"
    )
    assert "free disk space" in exc.value.message
    assert peak_refused < 16 * MiB and peak_ok < 16 * MiB  # the old code held the member
    assert [i.name for i in await files.list("/up")] == ["fits"]  # no partial file
    assert (await files.stat("/up/fits")).size == 24 * MiB

    # a cap below the free space: the second member passes it and leaves nothing behind
    capped = RootedFiles(files.root, max_upload_bytes=3 * MiB)  # type: ignore[attr-defined]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("a", "b"):
            ti = tarfile.TarInfo(name)
            ti.size = 2 * MiB
            tar.addfile(ti, io.BytesIO(bytes(2 * MiB)))
    with pytest.raises(QuotaExceeded):
        await capped.upload_tar("/capped", buf.getvalue())
    assert [i.name for i in await files.list("/capped")] == ["a"]
    r = await run(runtime, h, "ls -a /up /capped")
    assert ".dsec-upload" not in r.stdout


# -- 3. very deep trees --------------------------------------------------------------------


async def test_deep_tree_list_download_snapshot_remove(
    runtime: ContainerRuntime, make: Factory, node: tuple[Paths, LayerStore, list, list]
) -> None:
    h = await make()
    depth = 5000
    t0 = time.perf_counter()
    # built 1000 levels at a time (the shell's cd and mkdir -p stop at PATH_MAX): each new
    # 999-level chain gets the previous tree moved to its bottom as one more level "d"
    await run(
        runtime,
        h,
        "cd /root && p= && i=0 && while [ $i -lt 999 ]; do p=$p/d; i=$((i+1)); done && "
        "mkdir -p x0$p/d && echo x > x0$p/d/leaf && k=1 && while [ $k -lt 5 ]; do "
        "mkdir -p x$k$p && mv x$((k-1)) x$k$p/d && k=$((k+1)); done && mv x4 deep",
    )
    print(f"made {depth} levels in {time.perf_counter() - t0:.1f} s")
    files = runtime.files(h)
    t0 = time.perf_counter()
    listing = await files.list("/root/deep", depth=10_000)
    list_s = time.perf_counter() - t0
    assert len(listing) == depth + 1 and listing[-1].name == "leaf"
    assert listing[-1].path == "/root/deep" + "/d" * depth + "/leaf"
    t0 = time.perf_counter()
    archive = await files.download_tar("/root/deep", 256 * MiB)
    tar_s = time.perf_counter() - t0
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
    assert len(names) == depth + 1 and names[-1] == "d/" * depth + "leaf"
    with pytest.raises(InvalidRequest) as exc:
        await runtime.snapshot(h, node[1], SnapshotRequest(), {})
    assert "remove or scrub" in exc.value.message
    t0 = time.perf_counter()
    await files.remove("/root/deep", recursive=True)
    rm_s = time.perf_counter() - t0
    print(f"list {list_s:.2f} s, tar {tar_s:.2f} s ({len(archive)} bytes), remove {rm_s:.2f} s")
    r = await runtime.exec(h, ExecRequest(cmd="test -e /root/deep"))
    assert r.exit_code == 1
    layer = await runtime.snapshot(h, node[1], SnapshotRequest(), {})  # packs again
    assert layer.meta["pack_diff"]["dirs"] >= 1


def test_walk_detects_a_tree_moved_under_it(tmp_path: Path) -> None:
    """``..`` must lead back where the walk came from, or the walk stops (Conflict)."""
    (tmp_path / "top/a/b/c").mkdir(parents=True)
    (tmp_path / "top/a/b/c/f").write_text("x")
    (tmp_path / "top/elsewhere").mkdir()
    fd = os.open(tmp_path / "top", os.O_RDONLY | os.O_DIRECTORY)
    try:
        steps = _walk_tree(fd, lambda rel, level: True)
        with pytest.raises(Conflict):
            for step in steps:
                if step.rel == "a/b/c/f":  # inside a/b/c: move b away from a
                    os.rename(tmp_path / "top/a/b", tmp_path / "top/elsewhere/b")
    finally:
        os.close(fd)


# -- 4. kernel mounts ------------------------------------------------------------------------


async def test_kernel_mounts_are_refused(runtime: ContainerRuntime, make: Factory) -> None:
    h = await make()
    files = runtime.files(h)
    await run(runtime, h, "ln -s /dev/shm /shm-link && ln -s ../proc /etc/proc-link")
    # images such as debootstrap's ship /dev/shm as a directory: the host sees that one
    rootfs = runtime.paths.sandboxes / h.id / "rootfs"
    (rootfs / "dev/shm").mkdir(parents=True, exist_ok=True)
    before = {top: sorted(os.listdir(rootfs / top)) for top in ("dev", "proc", "sys")}
    one = io.BytesIO()
    with tarfile.open(fileobj=one, mode="w") as tar:
        ti = tarfile.TarInfo("x")
        ti.size = 1
        tar.addfile(ti, io.BytesIO(b"x"))
    attempts: dict[str, Callable[[], Awaitable[object]]] = {
        "write /dev/shm/x": lambda: files.write("/dev/shm/x", b"x"),
        "write /proc/version": lambda: files.write("/proc/version", b"x"),
        "write /sys/x": lambda: files.write("/sys/x", b"x"),
        "write /dev/null": lambda: files.write("/dev/null", b"x"),
        "write via ..": lambda: files.write("/etc/../dev/shm/y", b"x"),
        "write via symlink": lambda: files.write("/shm-link/x", b"x"),
        "read via symlink": lambda: files.read("/etc/proc-link/version", 100),
        "read /proc/version": lambda: files.read("/proc/version", 100),
        "list /sys": lambda: files.list("/sys"),
        "list /dev/shm": lambda: files.list("/dev/shm"),
        "stat /dev": lambda: files.stat("/dev"),
        "stat /proc/1": lambda: files.stat("/proc/1"),
        "mkdir /dev/x": lambda: files.mkdir("/dev/x"),
        "mkdir via symlink": lambda: files.mkdir("/shm-link/sub/dir"),
        "remove /proc": lambda: files.remove("/proc", recursive=True),
        "remove /dev/shm": lambda: files.remove("/dev/shm"),
        "rename into /dev": lambda: files.rename("/etc/hostname", "/dev/hostname"),
        "rename /sys away": lambda: files.rename("/sys", "/sys2"),
        "upload_tar /dev/shm": lambda: files.upload_tar("/dev/shm", one.getvalue()),
        "upload_tar via symlink": lambda: files.upload_tar("/shm-link", one.getvalue()),
        "download_tar /proc": lambda: files.download_tar("/proc", MiB),
    }
    for what, attempt in attempts.items():
        with pytest.raises(InvalidRequest) as exc:
            await attempt()
        assert "kernel/device mount" in exc.value.message, (what, exc.value)
    # a tar at / that reaches into /sys by member name
    at_root = io.BytesIO()
    with tarfile.open(fileobj=at_root, mode="w") as tar:
        ti = tarfile.TarInfo("sys/kernel/x")
        ti.size = 1
        tar.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(InvalidRequest):
        await files.upload_tar("/", at_root.getvalue())
    # nothing landed in the overlay under the mount points
    assert {top: sorted(os.listdir(rootfs / top)) for top in before} == before
    assert not os.listdir(rootfs / "dev/shm")
    # listing / still shows them; a tar of / leaves them out
    names = {i.name for i in await files.list("/", depth=2)}
    assert {"proc", "sys", "dev", "etc"} <= names
    for root_alias in ("/", "/etc/..", "/./"):
        paths = [i.path for i in await files.list(root_alias, depth=3)]
        assert "/dev" in paths and "/etc/hostname" in paths, root_alias
        assert not [p for p in paths if p.startswith(("/proc/", "/sys/", "/dev/"))], root_alias
    for root_alias in ("/", "/./"):
        archive = await files.download_tar(root_alias, 64 * MiB)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tops = {n.split("/")[0] for n in tar.getnames()}
        assert "etc" in tops and not tops & {"proc", "sys", "dev"}, root_alias
    # ordinary paths still work, and the sandbox sees the real /proc
    assert (await files.write("/root/ok", b"ok")).size == 2
    assert (await run(runtime, h, "cat /proc/version")).stdout.startswith("Linux")


async def test_refusals_are_typed_errors(runtime: ContainerRuntime, make: Factory) -> None:
    """No raw OSError escapes: every refusal above maps to a DsecError subclass."""
    h = await make()
    files = runtime.files(h)
    for attempt in (
        files.read("/" + "a" * 5000, 10),
        files.list("/nonexistent"),
        files.remove("/dev"),
    ):
        with pytest.raises(DsecError):
            await attempt
