"""Unit tests of the OCI importer: references, challenges, planning, the registry protocol
over ``httpx.MockTransport`` (a fake registry that records every request), and layer-tree
conversion. Kernel-free; the tests that make whiteouts need root and are marked."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.errors import ImageNotFound, InvalidRequest, Unsupported
from dsec.layers import LayerStore
from dsec.layers.oci import (
    BlobDigestMismatch,
    RegistryUnauthorized,
    RegistryUnavailable,
    apply_oci_whiteouts,
    merge_layer_tree,
    plan_groups,
    pull_image,
    strip_overlay_markers,
)
from dsec.layers.registry import (
    DOCKER_HUB,
    ImageRef,
    RegistryClient,
    default_image_name,
    parse_challenge,
    parse_ref,
    select_platform,
)

Handler = Callable[[httpx.Request], httpx.Response]
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def tar_layer(entries: list[tuple[str, str, str]]) -> bytes:
    """An uncompressed tar of ``(path, "dir" | "file", content)`` with fixed mtimes.
    (tests/integration/test_oci_pull_root.py has the full builder.)"""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, kind, text in entries:
            info = tarfile.TarInfo(path)
            info.mtime = 1_700_000_000
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            else:
                info.size, info.mode = len(text.encode()), 0o644
                tf.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class OciRepo:
    """Blobs and manifests of one repository, as a registry serves them."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    def add_blob(self, data: bytes) -> dict[str, Any]:
        self.blobs[digest_of(data)] = data
        return {"digest": digest_of(data), "size": len(data)}

    def add_manifest(self, media_type: str, doc: dict[str, Any], tag: str | None = None) -> str:
        body = json.dumps(doc).encode()
        self.manifests[digest_of(body)] = (media_type, body)
        if tag is not None:
            self.manifests[tag] = (media_type, body)
        return digest_of(body)

    def add_image(self, layers: list[tuple[bytes, str]], tag: str) -> str:
        descs = [self.add_blob(gzip.compress(tar, mtime=0)) for tar, _ in layers]
        config = {"rootfs": {"type": "layers", "diff_ids": [digest_of(t) for t, _ in layers]}}
        doc = {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": self.add_blob(json.dumps(config).encode()),
            "layers": descs,
        }
        return self.add_manifest(MT_MANIFEST, doc, tag)


def registry_handler(
    repo: OciRepo, seen: list[httpx.Request], *, basic: str | None = None
) -> Handler:
    """A v2 registry over MockTransport; ``basic`` = required ``user:password``."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if basic is not None:
            import base64

            want = "Basic " + base64.b64encode(basic.encode()).decode()
            if request.headers.get("authorization") != want:
                return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        parts = request.url.path.split("/")
        if parts[-2] == "manifests" and parts[-1] in repo.manifests:
            mt, body = repo.manifests[parts[-1]]
            return httpx.Response(200, content=body, headers={"Content-Type": mt})
        if parts[-2] == "blobs" and parts[-1] in repo.blobs:
            return httpx.Response(200, content=repo.blobs[parts[-1]])
        return httpx.Response(404, json={"errors": [{"code": "NOT_FOUND"}]})

    return handle


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    s = LayerStore(tmp_path / "layers", tmp_path / "images")
    try:
        yield s
    finally:
        s.close()


def _leftovers(store: LayerStore) -> list[Path]:
    return [*store.scratch.iterdir(), *(store.root / "tmp").iterdir()]


# --- references and parsing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("busybox", ImageRef(DOCKER_HUB, "library/busybox", "latest", None)),
        ("docker.io/foo/bar:1.0", ImageRef(DOCKER_HUB, "foo/bar", "1.0", None)),
        ("127.0.0.1:5000/a/b", ImageRef("127.0.0.1:5000", "a/b", "latest", None)),
        ("localhost/x:y", ImageRef("localhost", "x", "y", None)),
        ("ghcr.io/o/r@sha256:" + "a" * 64, ImageRef("ghcr.io", "o/r", None, "sha256:" + "a" * 64)),
        (
            "r.io:443/o/r:t@sha256:" + "b" * 64,
            ImageRef("r.io:443", "o/r", "t", "sha256:" + "b" * 64),
        ),
    ],
)
def test_parse_ref(ref: str, expected: ImageRef) -> None:
    assert parse_ref(ref) == expected


@pytest.mark.parametrize("bad", ["", "UPPER/case", "a/b:", "a@sha256:12", "a/b:bad tag", "a//b"])
def test_parse_ref_rejects(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_ref(bad)


def test_default_image_name() -> None:
    assert default_image_name(parse_ref("busybox")) == "busybox:latest"
    assert default_image_name(parse_ref("127.0.0.1:1/a/b:v2")) == "a-b:v2"
    assert default_image_name(parse_ref("x@sha256:" + "c" * 64)) == "x:sha256-cccccccccccc"


def test_parse_challenge() -> None:
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:a/b:pull,push"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:pull,push",
    }
    assert parse_challenge('Basic realm="x"') == ("basic", {"realm": "x"})


def test_plan_groups() -> None:
    layers = [{"digest": f"sha256:{i:064x}", "size": s} for i, s in enumerate([5, 3, 100, 1, 1])]
    assert [g.indexes for g in plan_groups(layers, 0)] == [(0,), (1,), (2,), (3,), (4,)]
    assert [g.indexes for g in plan_groups(layers, 10)] == [(0, 1), (2,), (3, 4)]
    assert [g.indexes for g in plan_groups(layers, 1000)] == [(0, 1, 2, 3, 4)]
    assert plan_groups(layers, 10)[0].compressed_bytes == 8


def test_select_platform() -> None:
    index = {
        "manifests": [
            {"digest": "sha256:" + "1" * 64, "platform": {"os": "linux", "architecture": "arm64"}},
            {"digest": "sha256:" + "2" * 64},
            {"digest": "sha256:" + "3" * 64, "platform": {"os": "linux", "architecture": "amd64"}},
        ]
    }
    assert select_platform(index) == "sha256:" + "3" * 64
    with pytest.raises(ImageNotFound) as e:
        select_platform(index, arch="s390x")
    assert "linux/arm64" in e.value.details["platforms"]


# --- the wire -----------------------------------------------------------------------------


def simple_repo(content: str = "hello\n") -> OciRepo:
    repo = OciRepo()
    repo.add_image([(tar_layer([("etc/", "dir", ""), ("etc/f", "file", content)]), "gzip")], "t")
    return repo


def test_pull_over_mock_transport_records_requests(store: LayerStore) -> None:
    repo = simple_repo()
    seen: list[httpx.Request] = []
    info = pull_image(
        store,
        "reg.example/team/app:t",
        transport=httpx.MockTransport(registry_handler(repo, seen)),
    )
    assert info.name == "team-app:t"
    assert len(info.layers) == 1
    assert info.meta["ref"] == "reg.example/team/app:t"
    # https for a non-loopback registry; manifest asked with every supported media type
    assert all(r.url.scheme == "https" for r in seen)
    accept = seen[0].headers["accept"]
    for mt in ("oci.image.index", "manifest.list.v2", "oci.image.manifest", "manifest.v2+json"):
        assert mt in accept
    assert [r.url.path.split("/")[-2] for r in seen] == ["manifests", "blobs", "blobs"]
    layer = store.get_layer(info.layers[0])
    assert layer.kind == "base"
    assert layer.meta["oci_blobs"] == info.meta["blobs"]
    assert _leftovers(store) == []


def test_basic_auth(store: LayerStore) -> None:
    repo = simple_repo()
    seen: list[httpx.Request] = []
    transport = httpx.MockTransport(registry_handler(repo, seen, basic="u:p"))
    with pytest.raises(RegistryUnauthorized):
        pull_image(store, "reg.example/a:t", transport=transport)
    with pytest.raises(RegistryUnauthorized):
        pull_image(store, "reg.example/a:t", transport=transport, credentials=("u", "bad"))
    info = pull_image(store, "reg.example/a:t", transport=transport, credentials=("u", "p"))
    assert info.layers


def test_bearer_token_flow() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/token":
            assert request.url.params["scope"] == "repository:a/b:pull"
            assert request.url.params["service"] == "svc"
            return httpx.Response(200, json={"access_token": "tok"})
        if request.headers.get("authorization") != "Bearer tok":
            challenge = 'Bearer realm="https://auth.example/token",service="svc"'
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        return httpx.Response(404)

    client = RegistryClient(parse_ref("reg.example/a/b:t"), transport=httpx.MockTransport(handle))
    with client, pytest.raises(ImageNotFound):
        client.get_manifest("t")
    assert [r.url.host for r in seen] == ["reg.example", "auth.example", "reg.example"]


def test_missing_image_and_non_json(store: LayerStore) -> None:
    repo = simple_repo()
    repo.manifests["junk"] = ("application/vnd.oci.image.manifest.v1+json", b"not json")
    transport = httpx.MockTransport(registry_handler(repo, []))
    with pytest.raises(ImageNotFound):
        pull_image(store, "reg.example/a:nope", transport=transport)
    with pytest.raises(InvalidRequest):
        pull_image(store, "reg.example/a:junk", transport=transport)


def test_schema1_unsupported(store: LayerStore) -> None:
    repo = OciRepo()
    repo.manifests["old"] = ("application/json", json.dumps({"schemaVersion": 1}).encode())
    with pytest.raises(Unsupported):
        pull_image(
            store, "reg.example/a:old", transport=httpx.MockTransport(registry_handler(repo, []))
        )


def test_manifest_by_digest_is_verified() -> None:
    repo = simple_repo()
    good = next(k for k in repo.manifests if k.startswith("sha256:"))
    repo.manifests[good] = (repo.manifests[good][0], repo.manifests[good][1] + b" ")
    client = RegistryClient(
        parse_ref(f"reg.example/a@{good}"),
        transport=httpx.MockTransport(registry_handler(repo, [])),
    )
    with client, pytest.raises(BlobDigestMismatch):
        client.get_manifest(good)


def test_corrupt_layer_blob_is_refused(store: LayerStore) -> None:
    repo = simple_repo()
    manifest = json.loads(repo.manifests["t"][1])
    layer_digest = manifest["layers"][0]["digest"]
    blob = bytearray(repo.blobs[layer_digest])
    blob[-5] ^= 0x55
    repo.blobs[layer_digest] = bytes(blob)
    transport = httpx.MockTransport(registry_handler(repo, []))
    with pytest.raises(BlobDigestMismatch):
        pull_image(store, "reg.example/a:t", transport=transport, retries=0)
    assert store.list_layers() == [] and store.list_images() == []
    assert _leftovers(store) == []


def test_diff_id_mismatch_is_refused(store: LayerStore) -> None:
    """The blob matches its digest but does not decompress to the config's diff_id."""
    repo = OciRepo()
    tar = tar_layer([("f", "file", "x\n")])
    blob = repo.add_blob(gzip.compress(tar, mtime=0))
    config = {"rootfs": {"type": "layers", "diff_ids": [digest_of(tar + b"\0")]}}
    cdesc = repo.add_blob(json.dumps(config).encode())
    repo.add_manifest(
        "application/vnd.oci.image.manifest.v1+json",
        {"schemaVersion": 2, "config": cdesc, "layers": [blob]},
        tag="t",
    )
    with pytest.raises(BlobDigestMismatch, match="diff_id"):
        pull_image(
            store, "reg.example/a:t", transport=httpx.MockTransport(registry_handler(repo, []))
        )
    assert _leftovers(store) == []


def test_corrupt_gzip_is_invalid(store: LayerStore) -> None:
    repo = OciRepo()
    blob = repo.add_blob(b"\x1f\x8b\x08\x00" + secrets.token_bytes(64))
    cdesc = repo.add_blob(b"{}")
    repo.add_manifest(
        "application/vnd.oci.image.manifest.v1+json",
        {"schemaVersion": 2, "config": cdesc, "layers": [blob]},
        tag="t",
    )
    with pytest.raises(InvalidRequest):
        pull_image(
            store, "reg.example/a:t", transport=httpx.MockTransport(registry_handler(repo, []))
        )
    assert _leftovers(store) == []


def test_server_errors_are_retried_then_unavailable(store: LayerStore) -> None:
    calls: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503)

    with pytest.raises(RegistryUnavailable):
        pull_image(store, "reg.example/a:t", transport=httpx.MockTransport(handle), retries=2)
    assert len(calls) == 3


def test_connection_refused_is_unavailable(store: LayerStore) -> None:
    with pytest.raises(RegistryUnavailable):
        pull_image(store, "127.0.0.1:1/a:t", retries=0, timeout_s=2)


def test_uses_plain_http_only_for_loopback() -> None:
    cases = [
        ("127.0.0.1:5000/a", None, "http://127.0.0.1:5000"),
        ("localhost:5000/a", None, "http://localhost:5000"),
        ("r.example/a", None, "https://r.example"),
        ("r.example/a", True, "http://r.example"),
        ("127.0.0.1/a", False, "https://127.0.0.1"),
    ]
    for ref, insecure, url in cases:
        with RegistryClient(parse_ref(ref), insecure_http=insecure) as client:
            assert client.base_url == url


# --- layer trees ----------------------------------------------------------------------------


def _write(root: Path, rel: str, text: str) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the non-root error")
def test_whiteouts_without_root_are_unsupported(tmp_path: Path) -> None:
    _write(tmp_path, "d/.wh.x", "")
    with pytest.raises(Unsupported):
        apply_oci_whiteouts(tmp_path)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mknod and trusted.* xattrs need root")
def test_whiteout_conversion_and_merge(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    for rel in ("keep", "gone", "d/a", "d/b", "op/x", "f2d", "wd/in"):
        _write(lower, rel, "L")
    for rel in (".wh.gone", "d/.wh.a", "d/c", "op/.wh..wh..opq", "op/y", "f2d/z", ".wh.wd"):
        _write(upper, rel, "U")
    assert apply_oci_whiteouts(upper) == {"whiteouts": 3, "opaque_dirs": 1}
    assert stat.S_ISCHR(os.lstat(upper / "gone").st_mode)
    assert os.lstat(upper / "gone").st_rdev == 0
    assert os.getxattr(upper / "op", "trusted.overlay.opaque") == b"y"
    assert not any(p.name.startswith(".wh.") for p in upper.rglob("*"))
    os.unlink(lower / "f2d")
    _write(lower, "f2d", "file")  # a file replaced by a directory in the upper
    merge_layer_tree(upper, lower)
    names = sorted(str(p.relative_to(lower)) for p in lower.rglob("*"))
    assert names == ["d", "d/a", "d/b", "d/c", "f2d", "f2d/z", "gone", "keep", "op", "op/y", "wd"]
    assert stat.S_ISCHR(os.lstat(lower / "d/a").st_mode)  # whiteouts stay for lower groups
    assert os.getxattr(lower / "op", "trusted.overlay.opaque") == b"y"
    assert os.getxattr(lower / "f2d", "trusted.overlay.opaque") == b"y"  # dir over a file
    strip_overlay_markers(lower)
    names = sorted(str(p.relative_to(lower)) for p in lower.rglob("*"))
    assert names == ["d", "d/b", "d/c", "f2d", "f2d/z", "keep", "op", "op/y"]
    with pytest.raises(OSError):
        os.getxattr(lower / "op", "trusted.overlay.opaque")
    assert (lower / "keep").read_text() == "L"
    assert (lower / "d/c").read_text() == "U"
