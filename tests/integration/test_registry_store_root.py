"""The ``oci://`` blob store, ``push_image`` and ``attach_image`` against Debian's
``docker-registry`` (distribution 2.8) on loopback, and sandboxes started from what was
attached.

The source node is a plain :class:`LayerStore` in a temp home holding ``app:v1`` = the
built-in busybox layer + a workspace layer built from a git commit. It is pushed as a dsec
artifact; a fresh ``dsec serve`` (another home) pulls it through the SDK, fully and lazily,
and runs container sandboxes on it. Bad input: a corrupted blob, a missing blob, an
anonymous client and a pull-only token against a token-auth registry: typed errors, and
nothing left in the receiving store.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.integration.test_oci_pull_root import DistributionRegistry, TokenService, sample_repo

from dsec import Client, Sandbox
from dsec.errors import (
    BlobDigestMismatch,
    LayerNotFound,
    RegistryUnauthorized,
)
from dsec.layers import LayerStore
from dsec.layers.publish import attach_image, push_image
from dsec.layers.registry_store import RegistryBlobStore
from dsec.layers.workspace import build_workspace_layer
from dsec.privileged.mount import mount_points, umount_quiet

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


@dataclass
class SourceNode:
    home: Path
    store: LayerStore
    image: str
    workspace_digest: str


def _git(repo: Path, *args: str) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    }
    argv = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    subprocess.run(argv, check=True, capture_output=True, env=env)


@pytest.fixture(scope="module")
def registry() -> Iterator[DistributionRegistry]:
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry not installed (apt-get install docker-registry)")
    home = Path(f"/tmp/dsec-regstore-reg-{secrets.token_hex(3)}")
    home.mkdir()
    reg = DistributionRegistry(home)
    try:
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def source() -> Iterator[SourceNode]:
    home = Path(f"/tmp/dsec-regstore-src-{secrets.token_hex(3)}")
    repo = home / "repo"
    repo.mkdir(parents=True)
    (repo / "hello.txt").write_text("hello from git\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "hello.txt")
    _git(repo, "commit", "-q", "-m", "one")
    store = LayerStore(home / "layers", home / "images")
    try:
        base = store.ensure_image_sync("busybox")
        ws = build_workspace_layer(store, f"file://{repo}", name="hello")
        store.put_image("app:v1", [*base.layers, ws.digest], meta={"note": "pushed"})
        yield SourceNode(home, store, "app:v1", ws.digest)
    finally:
        store.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def fresh_store() -> Iterator[LayerStore]:
    home = Path(f"/tmp/dsec-regstore-dst-{secrets.token_hex(3)}")
    store = LayerStore(home / "layers", home / "images")
    try:
        yield store
    finally:
        store.close()
        leaked = mount_points(home)
        for mp in sorted(leaked, key=lambda p: len(p.parts), reverse=True):
            umount_quiet(mp)
        shutil.rmtree(home, ignore_errors=True)
        assert not leaked, f"mounts leaked under {home}: {leaked}"


def _nothing_stored(store: LayerStore) -> None:
    assert store.list_layers() == [] and store.list_images() == []
    assert list(store.scratch.iterdir()) == []
    assert list((store.root / "tmp").iterdir()) == []
    assert list((store.root / "blobs" / "sha256").iterdir()) == []


def test_blob_store_against_distribution(
    registry: DistributionRegistry, source: SourceNode, tmp_path: Path
) -> None:
    """put (chunked), stat, has, range reads incl. the last bytes, fetch."""
    digest = source.store.get_image(source.image).layers[0]
    local = source.store.layer_path(digest)
    data = local.read_bytes()
    with RegistryBlobStore(f"oci://{registry.host}/dsec/raw", chunk_bytes=256 * 1024) as store:
        assert not store.has(digest)
        store.put(local, digest)
        assert store.has(digest) and store.stat(digest) == len(data)
        for offset, length in [(0, 4096), (1024, 300_000), (len(data) - 100, 4096)]:
            assert store.read_range(digest, offset, length) == data[offset : offset + length]
        assert store.read_range(digest, len(data), 1) == b""
        assert store.fetch(digest, tmp_path / "copy") == len(data)
        assert (tmp_path / "copy").read_bytes() == data
    assert registry.blob_file(digest).read_bytes() == data


def test_push_then_pull_full_and_lazy_and_run(
    registry: DistributionRegistry, source: SourceNode, tmp_path: Path
) -> None:
    from dsec.server import BackgroundServer

    target = f"oci://{registry.host}/dsec/app:v1"
    digest = push_image(source.store, source.image, target)
    assert push_image(source.store, source.image, target) == digest  # idempotent
    home = Path(f"/tmp/dsec-regstore-srv-{secrets.token_hex(3)}")
    try:
        with BackgroundServer(home, tiers=["container"]) as srv:
            kw = {"url": srv.url, "api_key": srv.api_key}
            with Client(**kw) as client:
                full = client.pull_image(target, "app:full")
                assert full.layers == source.store.get_image(source.image).layers
                assert full.meta["manifest_digest"] == digest
                assert full.meta["lazy"] is False
                sb = Sandbox.create(tier="container", image="app:full", **kw)
                try:
                    r = sb.commands.run("cat /hello.txt && busybox true && echo ok")
                    assert r.stdout == "hello from git\nok\n", r
                finally:
                    sb.kill()
                # the server re-publishes what it attached: same layers, same blobs
                pushed = client.push_image("app:full", f"oci://{registry.host}/dsec/copy:v2")
                assert pushed.manifest_digest.startswith("sha256:")
            if not hasattr(LayerStore, "add_remote_layer"):
                pytest.skip("LayerStore.add_remote_layer (lazy loading) is not available")
        # lazy: a second server with an empty store
        home2 = Path(f"/tmp/dsec-regstore-srv-{secrets.token_hex(3)}")
        try:
            with BackgroundServer(home2, tiers=["container"]) as srv:
                kw = {"url": srv.url, "api_key": srv.api_key}
                with Client(**kw) as client:
                    lazy = client.pull_image(target, "app:lazy", lazy=True)
                assert lazy.meta["lazy"] is True
                for d in lazy.layers:
                    assert srv.edge.layers.remote_source(d) == f"oci://{registry.host}/dsec/app"
                    assert not srv.edge.layers.is_local(d)
                sb = Sandbox.create(tier="container", image="app:lazy", **kw)
                try:
                    r = sb.commands.run("cat /hello.txt")
                    assert r.stdout == "hello from git\n", r
                finally:
                    sb.kill()
        finally:
            shutil.rmtree(home2, ignore_errors=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_corrupted_and_missing_blobs_store_nothing(
    registry: DistributionRegistry, source: SourceNode, fresh_store: LayerStore
) -> None:
    ref = f"oci://{registry.host}/dsec/corrupt:v1"
    push_image(source.store, source.image, ref)
    blob = registry.blob_file(source.workspace_digest)
    good = blob.read_bytes()
    blob.write_bytes(bytes(len(good)))  # same size, other bytes
    try:
        with pytest.raises(BlobDigestMismatch):
            attach_image(fresh_store, ref, lazy=False)
    finally:
        blob.write_bytes(good)
    # the busybox layer before it may have been stored; the corrupt one never is, nor the image
    assert source.workspace_digest not in {x.digest for x in fresh_store.list_layers()}
    assert fresh_store.list_images() == []
    assert list(fresh_store.scratch.iterdir()) == []
    assert list((fresh_store.root / "tmp").iterdir()) == []
    blob.unlink()
    with pytest.raises(LayerNotFound):
        attach_image(fresh_store, ref, lazy=False)
    assert fresh_store.list_images() == []


def test_ordinary_image_falls_back_to_oci_pull(
    registry: DistributionRegistry, fresh_store: LayerStore
) -> None:
    """``dsec image pull --lazy`` of a container image (tar layers) converts it as usual."""
    registry.push("dsec/plain", sample_repo())
    info = attach_image(fresh_store, f"oci://{registry.host}/dsec/plain:v1", lazy=True)
    assert info.meta["source"] == "oci" and info.name == "dsec-plain:v1"
    assert all(fresh_store.is_local(d) for d in info.layers)


def test_unauthorised_registry(source: SourceNode, fresh_store: LayerStore) -> None:
    if shutil.which("docker-registry") is None or shutil.which("openssl") is None:
        pytest.skip("needs docker-registry and openssl")
    home = Path(f"/tmp/dsec-regstore-treg-{secrets.token_hex(3)}")
    home.mkdir()
    tokens = TokenService(home)  # issues pull-only tokens to user:secret
    reg = DistributionRegistry(home, auth_config=tokens.auth_config())
    try:
        ref = f"oci://{reg.host}/dsec/private:v1"
        with pytest.raises(RegistryUnauthorized):
            push_image(source.store, source.image, ref)  # anonymous
        with pytest.raises(RegistryUnauthorized):
            push_image(source.store, source.image, ref, auth=("user", "secret"))  # pull-only
        with pytest.raises(RegistryUnauthorized):
            push_image(source.store, source.image, ref, auth=("user", "wrong"))
        # publish with a push token, then: anonymous attach refused, credentials accepted
        with RegistryBlobStore(f"oci://{reg.host}/dsec/private") as store:
            store.session._auth_header = "Bearer " + tokens.jwt("dsec/private", ["pull", "push"])
            push_image(source.store, source.image, ref, blob_store=store)
        with pytest.raises(RegistryUnauthorized):
            attach_image(fresh_store, ref, lazy=False)
        _nothing_stored(fresh_store)
        info = attach_image(fresh_store, ref, lazy=False, auth=("user", "secret"))
        assert info.layers == source.store.get_image(source.image).layers
    finally:
        reg.stop()
        tokens.stop()
        shutil.rmtree(home, ignore_errors=True)
