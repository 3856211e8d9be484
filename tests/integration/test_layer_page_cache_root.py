"""The page cache of shared image layers between API keys (root, real kernel): a sandbox of
one key cannot tell from its page cache what a sandbox of another key read from the same
image, while one key's sandboxes still share theirs; ``DSEC_LAYER_SHARING=node`` keeps the
node-wide sharing (a known channel, ``docs/design/tenancy.md``).

The probe is the attack of issue 32: evict a file of the image with
``fadvise(POSIX_FADV_DONTNEED)`` from one sandbox, let another read it, then count the
file's resident pages with ``mincore()`` (python's ctypes, inside the ``debian`` image).
The same probe runs on the host against :class:`LayerMounts` mountpoints (first: no server
is up then to see the ``DSEC_EROFS_MOUNT`` they set), through files and through loop devices,
with scoped mounts adopted after a restart and nothing left.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integration.test_erofs_loop_root import make_image, work  # noqa: F401

from dsec.privileged.mount import EROFS_MOUNT_ENV, mount_points

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, containers)"),
]

PROBE = r"""
import ctypes, glob, mmap, os, sys
action, pattern = sys.argv[1], sys.argv[2]
path = sorted(glob.glob(pattern))[0]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
if action == "evict":
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
elif action == "read":
    while os.read(fd, 1 << 20):
        pass
addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
vec = ctypes.create_string_buffer(pages)
assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
libc.munmap(ctypes.c_void_p(addr), size)
print(sum(b & 1 for b in vec.raw), pages)
"""
"""``python3 -c PROBE ACTION GLOB``: ``evict``, ``read`` (the whole file) or ``count``, then
prints how many of the file's pages are resident in this mount's page cache, and of how many.
``mmap`` and ``mincore`` read no data: counting does not change the count."""

TARGET = "/usr/lib/python3*/pydoc_data/topics.py"  # ~0.5-0.8 MB of the debian image


def host_probe(action: str, path: Path) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, action, str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


# --- LayerMounts on the real kernel: files and loop devices ----------------------------------


def layer_blob(work: Path) -> tuple[str, Path]:  # noqa: F811
    """A layer of one 1 MiB file, ``data``, named like a store blob (``<sha256>.erofs``),
    and its digest."""
    tmp = make_image(work / "tmp.erofs", {"data": secrets.token_hex(1 << 19)})
    hex_ = hashlib.sha256(tmp.read_bytes()).hexdigest()
    blob = work / "blobs" / f"{hex_}.erofs"
    blob.parent.mkdir()
    tmp.rename(blob)
    return f"sha256:{hex_}", blob


def super_options(mountpoint: Path) -> list[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(mountpoint):
            return fields[-1].split(",")
    raise AssertionError(f"{mountpoint} is not mounted")


@pytest.mark.parametrize("erofs_mount", ["file", "loop"])
@pytest.mark.parametrize("sharing", ["key", "node"])
def test_layer_mounts_per_scope(
    work: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    erofs_mount: str,
    sharing: Any,
) -> None:
    from dsec.layers.mounts import LayerMounts, mountinfo_entries
    from dsec.privileged.loop import attach_loop
    from dsec.privileged.mount import erofs_directio_supported

    monkeypatch.setenv(EROFS_MOUNT_ENV, erofs_mount)
    digest, blob = layer_blob(work)
    mounts = LayerMounts(work / "m", sharing=sharing)
    sa, sb = mounts.scope_of("kalice"), mounts.scope_of("kbob")
    a = mounts.acquire(digest, blob, sa)
    b = mounts.acquire(digest, blob, sb)
    assert mounts.acquire(digest, blob, sb) == b
    if sharing == "node":
        assert a == b and sa == sb == "" and mounts.refcount(digest) == 3
    else:
        assert mounts.refcount(digest, sa) == 1 and mounts.refcount(digest, sb) == 2
        assert a != b and {a.name, b.name} == {f"{s}-{digest[7:23]}" for s in (sa, sb)}
        assert os.stat(a).st_dev != os.stat(b).st_dev  # two superblocks
        [ea], [eb] = mountinfo_entries(a), mountinfo_entries(b)
        assert ea.source_file == eb.source_file == str(blob)
        if erofs_mount == "loop":  # a loop device each: one device is one superblock
            assert ea.source != eb.source and ea.source.startswith("/dev/loop")
            with attach_loop(blob) as shared:  # what the fncall tier asks for: never a key's
                assert shared.path not in (ea.source, eb.source) and not shared.shared
    if erofs_mount == "file" and erofs_directio_supported():
        assert "directio" in super_options(a)
    assert host_probe("evict", a / "data")[0] == 0
    assert host_probe("read", b / "data") == (256, 256)
    seen = host_probe("count", a / "data")[0]
    assert seen == (256 if sharing == "node" else 0), seen

    # a restarted edge adopts every scope's mounts, re-acquires in its sandboxes' scope,
    # and unmounts the rest
    again = LayerMounts(work / "m", sharing=sharing)
    again.adopt_existing()
    assert again.mounted(sa) == {digest: a} and again.mounted(sb) == {digest: b}
    assert again.refcount(digest, sb) == 0
    assert again.acquire(digest, blob, sb) == b
    assert again.unmount_unused() == (0 if sharing == "node" else 1)  # alice's
    assert mount_points(work / "m") == [b]
    again.release(digest, sb)
    assert mount_points(work / "m") == [] and list((work / "m").iterdir()) == []
    mounts.close()  # the old instance must not trip over what is already gone


# --- through the API: two keys, one image ----------------------------------------------------


@dataclass
class Server:
    sharing: str
    home: Path
    alice: httpx.Client
    bob: httpx.Client


@pytest.fixture(scope="module", params=["key", "node"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, shared_layers: Path
) -> Iterator[Server]:
    from dsec.server import BackgroundServer

    sharing = str(request.param)
    home = tmp_path_factory.mktemp(f"pc-{sharing}")
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSEC_LAYER_SHARING", sharing)  # read when the node's layer mounts are made
        mp.delenv(EROFS_MOUNT_ENV, raising=False)
        with BackgroundServer(home, tiers=["container"]) as bg:
            alice, bob = (
                httpx.Client(
                    base_url=bg.url, headers={"authorization": f"Bearer {key}"}, timeout=120
                )
                for key in (bg.keys.create_key("alice"), bg.keys.create_key("bob"))
            )
            try:
                yield Server(sharing, home, alice, bob)
            finally:
                for c in (alice, bob):
                    for sb in c.get("/v1/sandboxes").json().get("sandboxes", []):
                        c.delete(f"/v1/sandboxes/{sb['id']}")
                    c.close()
    # the server is gone (its warm containers too): every layer mount of every scope with it
    assert mount_points(home / "mnt" / "layers") == []


def create(c: httpx.Client) -> str:
    r = c.post("/v1/sandboxes", json={"tier": "container", "image": "debian", "cpu": 0.2})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def probe(c: httpx.Client, sid: str, action: str) -> tuple[int, int]:
    r = c.post(
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": ["python3", "-c", PROBE, action, TARGET], "timeout_s": 60},
    )
    assert r.status_code == 200, r.text
    res: dict[str, Any] = r.json()
    assert res["exit_code"] == 0, res
    resident, pages = res["stdout"].split()
    return int(resident), int(pages)


def test_a_key_cannot_see_what_another_key_read(server: Server) -> None:
    a, b1 = create(server.alice), create(server.bob)
    resident, pages = probe(server.alice, a, "evict")
    assert pages > 20 and resident == 0, (resident, pages)
    assert probe(server.bob, b1, "read") == (pages, pages)
    seen_by_alice, _ = probe(server.alice, a, "count")
    # a second sandbox of bob's shares bob's page cache: what b1 read is resident for it
    b2 = create(server.bob)
    seen_by_bob, _ = probe(server.bob, b2, "count")
    assert seen_by_bob >= pages * 9 // 10, (seen_by_bob, pages)
    if server.sharing == "key":
        assert seen_by_alice <= pages // 20, f"alice saw {seen_by_alice} of {pages} pages"
    else:  # DSEC_LAYER_SHARING=node: the node's one page cache, the known channel
        assert seen_by_alice >= pages * 9 // 10, (seen_by_alice, pages)
