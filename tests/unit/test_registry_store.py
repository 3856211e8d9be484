"""The ``oci://`` blob store, dsec artifact manifests, push/attach and stack checks, against
:class:`FakeOciRegistry`: an in-process v2 registry on ``httpx.MockTransport`` that speaks
the wire protocol (HEAD/GET with Range, POST/PATCH/PUT uploads, manifests, Bearer auth) and
records every request, so tests assert on what the registry received."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.timing import budget

from dsec.errors import (
    BlobDigestMismatch,
    InvalidRequest,
    LayerNotFound,
    RegistryUnauthorized,
    RegistryUnavailable,
)
from dsec.layers.chunktable import fetch_chunk_table
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.publish import (
    ANN_KIND,
    ANN_PROVIDES,
    ANN_REQUIRES,
    ARTIFACT_TYPE,
    CHUNK_TABLE_MEDIA_TYPE,
    LAYER_MEDIA_TYPE,
    attach_image,
    build_config,
    build_manifest,
    parse_dsec_manifest,
    push_image,
)
from dsec.layers.registry_store import RegistryBlobStore, parse_store_url, registry_credentials
from dsec.layers.store import LayerStore
from dsec.layers.workspace import build_workspace_layer, check_stack, layer_labels
from dsec.models import ImageInfo, LayerInfo

HOST = "127.0.0.1:5999"
URL = f"oci://{HOST}/dsec/layers"


def sha(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class FakeOciRegistry:
    """A registry behind ``httpx.MockTransport``.

    Args:
        ignore_range: answer range GETs with 200 and the whole blob.
        fail_next: answer this many requests with 503 first.
        token: require ``Bearer <token>`` (issued by ``/token`` to anyone).
        deny: answer every /v2/ request with 403.
    """

    ignore_range: bool = False
    fail_next: int = 0
    token: str | None = None
    deny: bool = False
    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    uploads: dict[str, bytearray] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def methods(self) -> list[str]:
        return [f"{m} {p}" for m, p, _ in self.requests]

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path, dict(request.headers)))
        if path == "/token":
            return httpx.Response(200, json={"token": self.token})
        if self.fail_next > 0:
            self.fail_next -= 1
            return httpx.Response(503, text="busy")
        if self.deny:
            return httpx.Response(403, json={"errors": [{"code": "DENIED"}]})
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            challenge = (
                f'Bearer realm="http://{HOST}/token",service="fake",'
                'scope="repository:dsec/layers:pull,push"'
            )
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        m = re.match(r"^/v2/(.+)/(blobs|manifests)/(uploads/)?([^/]*)$", path)
        if m is None:
            return httpx.Response(404)
        kind, is_upload, ref = m.group(2), m.group(3), m.group(4)
        if kind == "blobs" and is_upload:
            return self._upload(request, m.group(1), ref)
        if kind == "manifests":
            if request.method == "PUT":
                body = request.read()
                doc = json.loads(body)
                for desc in [doc["config"], *doc["layers"]]:
                    if desc["digest"] not in self.blobs:
                        return httpx.Response(400, json={"errors": [{"code": "BLOB_UNKNOWN"}]})
                entry = (request.headers["content-type"], body)
                self.manifests[ref] = entry
                self.manifests[sha(body)] = entry
                return httpx.Response(201)
            if ref not in self.manifests:
                return httpx.Response(404)
            mt, body = self.manifests[ref]
            return httpx.Response(200, content=body, headers={"Content-Type": mt})
        data = self.blobs.get(ref)
        if data is None:
            return httpx.Response(404)
        if request.method == "HEAD":
            return httpx.Response(200, headers={"Content-Length": str(len(data))})
        rng = request.headers.get("range")
        if rng and not self.ignore_range:
            a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            if a >= len(data):
                return httpx.Response(416)
            b = min(b, len(data) - 1)
            return httpx.Response(
                206,
                content=data[a : b + 1],
                headers={"Content-Range": f"bytes {a}-{b}/{len(data)}"},
            )
        return httpx.Response(200, content=data)

    def _upload(self, request: httpx.Request, repo: str, uid: str) -> httpx.Response:
        if request.method == "POST":
            uid = str(uuid.uuid4())
            self.uploads[uid] = bytearray()
            loc = f"/v2/{repo}/blobs/uploads/{uid}?_state=abc"
            return httpx.Response(202, headers={"Location": loc})
        if uid not in self.uploads or request.url.params.get("_state") != "abc":
            return httpx.Response(404, json={"errors": [{"code": "BLOB_UPLOAD_INVALID"}]})
        self.uploads[uid] += request.read()
        if request.method == "PATCH":
            loc = f"/v2/{repo}/blobs/uploads/{uid}?_state=abc"
            return httpx.Response(202, headers={"Location": loc})
        data = bytes(self.uploads.pop(uid))
        digest = request.url.params.get("digest")
        if digest != sha(data):
            return httpx.Response(400, json={"errors": [{"code": "DIGEST_INVALID"}]})
        self.blobs[digest] = data
        return httpx.Response(201)


def blob_store(reg: FakeOciRegistry, **kw: Any) -> RegistryBlobStore:
    return RegistryBlobStore(URL, transport=reg.transport(), **kw)


# --- URLs and credentials ---------------------------------------------------------------


def test_parse_store_url() -> None:
    loc = parse_store_url("oci://127.0.0.1:5000/dsec/layers")
    assert (loc.registry, loc.repository, loc.tag) == ("127.0.0.1:5000", "dsec/layers", None)
    loc = parse_store_url("oci://reg.example:443/a/b:v1", allow_tag=True)
    assert (loc.repository, loc.tag, loc.store_url) == ("a/b", "v1", "oci://reg.example:443/a/b")
    digest = "sha256:" + "a" * 64
    assert parse_store_url(f"oci://h/r@{digest}", allow_tag=True).tag == digest
    for bad in ("http://h/r", "oci://h", "oci://h/", "oci://h/UPPER", "oci://h/r:t", "oci://h/r@x"):
        with pytest.raises(InvalidRequest):
            parse_store_url(bad)


def test_registry_credentials_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_REGISTRY_AUTH", json.dumps({HOST: ["u", "p"]}))
    assert registry_credentials(HOST) == ("u", "p")
    assert registry_credentials("other:1") is None
    monkeypatch.setenv("DSEC_REGISTRY_AUTH", "{nope")
    with pytest.raises(InvalidRequest):
        registry_credentials(HOST)


# --- reading -----------------------------------------------------------------------------


def test_stat_has_and_missing_blob() -> None:
    data = b"x" * 1000
    reg = FakeOciRegistry(blobs={sha(data): data})
    with blob_store(reg) as store:
        assert store.stat(sha(data)) == 1000
        assert store.stat(sha(data)) == 1000  # cached: one HEAD
        assert store.has(sha(data)) and not store.has(sha(b"other"))
        with pytest.raises(LayerNotFound):
            store.stat(sha(b"other"))
        with pytest.raises(InvalidRequest):
            store.stat("sha256:nothex")
    assert reg.methods().count(f"HEAD /v2/dsec/layers/blobs/{sha(data)}") == 1


@pytest.mark.parametrize("ignore_range", [False, True], ids=["206", "200-ignores-range"])
def test_read_range(ignore_range: bool, caplog: pytest.LogCaptureFixture) -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    d = sha(data)
    reg = FakeOciRegistry(blobs={d: data}, ignore_range=ignore_range)
    caplog.set_level(logging.WARNING, logger="dsec.layers.registry_store")
    with blob_store(reg) as store:
        assert store.read_range(d, 0, 4096) == data[:4096]
        assert store.read_range(d, 5000, 3000) == data[5000:8000]
        assert store.read_range(d, 10000, 4096) == data[10000:]  # clipped at the end
        assert store.read_range(d, 10240, 10) == b""
        assert store.read_range(d, 7, 0) == b""
        with pytest.raises(InvalidRequest):
            store.read_range(d, 20000, 10)
        with pytest.raises(LayerNotFound):
            store.read_range(sha(b"missing"), 0, 10)
    ranges = [h.get("range") for m, _p, h in reg.requests if m == "GET"]
    assert "bytes=5000-7999" in ranges
    warnings = [r for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(warnings) == (1 if ignore_range else 0)


def test_short_range_answer_is_an_error() -> None:
    data = b"y" * 100
    d = sha(data)

    def handler(request: httpx.Request) -> httpx.Response:  # claims 50 bytes, sends 10
        return httpx.Response(206, content=data[:10], headers={"Content-Range": "bytes 0-49/100"})

    store = RegistryBlobStore(URL, transport=httpx.MockTransport(handler), retries=1)
    with pytest.raises(RegistryUnavailable, match="truncated"):
        store.read_range(d, 0, 50)


def test_fetch_verifies_and_is_atomic(tmp_path: Path) -> None:
    data = b"layer bytes" * 1000
    d = sha(data)
    reg = FakeOciRegistry(blobs={d: data})
    with blob_store(reg) as store:
        dest = tmp_path / "out.erofs"
        assert store.fetch(d, dest) == len(data)
        assert dest.read_bytes() == data
        reg.blobs[d] = b"corrupted" + data[9:]  # same size, other bytes
        dest2 = tmp_path / "corrupt.erofs"
        with pytest.raises(BlobDigestMismatch):
            store.fetch(d, dest2)
        with pytest.raises(LayerNotFound):
            store.fetch(sha(b"absent"), tmp_path / "absent")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.erofs"]  # no temp files


def test_transient_errors_are_retried_then_give_up() -> None:
    data = b"z" * 10
    d = sha(data)
    reg = FakeOciRegistry(blobs={d: data}, fail_next=2)
    with blob_store(reg, retries=2) as store:
        assert store.read_range(d, 0, 10) == data
    reg = FakeOciRegistry(blobs={d: data}, fail_next=100)
    with blob_store(reg, retries=2) as store, pytest.raises(RegistryUnavailable):
        store.stat(d)
    assert len(reg.requests) == 3  # bounded: 1 try + 2 retries

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    store = RegistryBlobStore(URL, transport=httpx.MockTransport(refuse), retries=1)
    with pytest.raises(RegistryUnavailable, match="unreachable"):
        store.has(d)


def test_hung_registry_fails_in_bounded_time() -> None:
    """A registry that accepts connections and never answers: RegistryUnavailable after
    3 tries of ``timeout_s``, not a hang (what a FUSE read relies on)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # never accepted: connects succeed, reads time out
        port = listener.getsockname()[1]
        store = RegistryBlobStore(f"oci://127.0.0.1:{port}/dsec/layers", timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            store.read_range("sha256:" + "a" * 64, 0, 4096)
        took = time.monotonic() - started
        store.close()
    # 3 x 0.3 s + 0.75 s of backoff: >= 0.9 s proves the tries waited; below the bound, none hung
    assert 0.9 <= took < budget(5.0), took


def test_bearer_token_auth_and_refusal() -> None:
    data = b"secret layer"
    d = sha(data)
    reg = FakeOciRegistry(blobs={d: data}, token="tok123")
    with blob_store(reg) as store:
        assert store.read_range(d, 0, 6) == b"secret"
        assert store.read_range(d, 7, 5) == b"layer"
    token_calls = [p for m, p, _ in reg.requests if p == "/token"]
    assert len(token_calls) == 1  # the token is reused
    reg = FakeOciRegistry(blobs={d: data}, deny=True)
    with blob_store(reg) as store, pytest.raises(RegistryUnauthorized):
        store.fetch(d, Path("/nonexistent/never-written"))


# --- writing -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1000], ids=["monolithic", "chunked"])
def test_put_uploads_once(tmp_path: Path, chunk_bytes: int) -> None:
    data = bytes(range(256)) * 20  # 5120 bytes
    src = tmp_path / "blob"
    src.write_bytes(data)
    reg = FakeOciRegistry()
    with blob_store(reg, chunk_bytes=chunk_bytes) as store:
        store.put(src, sha(data))
        assert reg.blobs[sha(data)] == data
        n = len(reg.requests)
        store.put(src, sha(data))  # idempotent: known from the upload, no request
        assert reg.requests[n:] == []
    with blob_store(reg, chunk_bytes=chunk_bytes) as store:
        store.put(src, sha(data))  # another store: one HEAD finds it
        assert [m for m, _p, _h in reg.requests[n:]] == ["HEAD"]
    patches = [m for m, _p, _h in reg.requests if m == "PATCH"]
    assert len(patches) == (0 if chunk_bytes > len(data) else 6)


def test_put_refuses_wrong_digest(tmp_path: Path) -> None:
    src = tmp_path / "blob"
    src.write_bytes(b"abc")
    reg = FakeOciRegistry()
    with blob_store(reg) as store, pytest.raises(BlobDigestMismatch):
        store.put(src, sha(b"not abc"))
    assert not reg.blobs and not [m for m, _p, _h in reg.requests if m in ("POST", "PUT")]


# --- manifests -------------------------------------------------------------------------------


def _layer(kind: str, name: str, meta: dict[str, Any], body: bytes = b"") -> LayerInfo:
    return LayerInfo(
        digest=sha(name.encode() + body),
        kind=kind,  # type: ignore[arg-type]
        name=name,
        size=4096,
        created_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
        meta=meta,
    )


def test_manifest_round_trip() -> None:
    base = _layer(
        "base", "debian", {"builtin": "debian", "suite": "bookworm", "include": ["python3"]}
    )
    tk = _layer("toolkit", "nodejs", {"toolkit": "nodejs", "packages": ["nodejs"]})
    image = ImageInfo(
        name="node:1",
        layers=[base.digest, tk.digest],
        size=8192,
        created_at="2026-01-01T00:00:00Z",
        meta={"x": 1},  # type: ignore[arg-type]
    )
    config = build_config(image)
    body = build_manifest(image, [base, tk], config)
    doc = json.loads(body)
    assert doc["artifactType"] == ARTIFACT_TYPE
    assert doc["config"]["digest"] == sha(config)
    assert [x["mediaType"] for x in doc["layers"]] == [LAYER_MEDIA_TYPE] * 2
    ann = doc["layers"][1]["annotations"]
    assert ann[ANN_KIND] == "toolkit" and ann[ANN_REQUIRES] == "debian-12,glibc"
    assert doc["layers"][0]["annotations"][ANN_PROVIDES] == "apt,debian-12,glibc,python3"
    parsed = parse_dsec_manifest(doc)
    assert [p.digest for p in parsed] == [base.digest, tk.digest]
    assert parsed[0].provides == ["apt", "debian-12", "glibc", "python3"]
    assert parsed[1].requires == ["debian-12", "glibc"] and parsed[1].kind == "toolkit"
    assert parsed[1].meta["toolkit"] == "nodejs"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("artifactType"),
        lambda d: d["layers"][0].update(mediaType="application/vnd.oci.image.layer.v1.tar"),
        lambda d: d["layers"][0].update(size=-1),
        lambda d: d["layers"][0]["annotations"].update({ANN_KIND: "weird"}),
        lambda d: d["layers"][0]["annotations"].update({"dev.dsec.layer.size": "1"}),
        lambda d: d["layers"][0]["annotations"].update({ANN_PROVIDES: "Bad Label"}),
        lambda d: d.update(layers=[]),
    ],
    ids=["not-dsec", "media-type", "size", "kind", "size-annotation", "label", "no-layers"],
)
def test_bad_manifests_are_refused(mutate: Any) -> None:
    layer = _layer("base", "b", {})
    image = ImageInfo(
        name="b",
        layers=[layer.digest],
        size=4096,
        created_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
    )
    doc = json.loads(build_manifest(image, [layer], build_config(image)))
    doc["config"]["mediaType"] = "application/json"  # only artifactType marks it
    mutate(doc)
    with pytest.raises(InvalidRequest):
        parse_dsec_manifest(doc)


# --- push and attach over the fake registry -----------------------------------------------


@pytest.fixture
def layer_store(tmp_path: Path) -> LayerStore:
    store = LayerStore(tmp_path / "layers", tmp_path / "images")
    yield store  # type: ignore[misc]
    store.close()


def _erofs_layer(store: LayerStore, tmp_path: Path, text: str, **kw: Any) -> LayerInfo:
    tree = tmp_path / f"tree-{text}"
    tree.mkdir()
    (tree / "hello.txt").write_text(text)
    out = tmp_path / f"{text}.erofs"
    mkfs_erofs(tree, out)
    return store.import_layer_file(out, **kw)


def test_push_then_attach_full(layer_store: LayerStore, tmp_path: Path) -> None:
    base = _erofs_layer(
        layer_store, tmp_path, "base", kind="base", name="b", meta={"provides": ["glibc"]}
    )
    ws = _erofs_layer(
        layer_store, tmp_path, "ws", kind="workspace", name="w", meta={"requires": ["glibc"]}
    )
    layer_store.put_image("app:v1", [base.digest, ws.digest], meta={"config": {"Env": ["A=1"]}})
    reg = FakeOciRegistry(token="t")
    digest = push_image(layer_store, "app:v1", f"{URL}:v1", blob_store=blob_store(reg))
    assert reg.manifests["v1"][1] == reg.manifests[digest][1]
    n_puts = len([m for m, _p, _h in reg.requests if m == "PUT"])
    push_image(layer_store, "app:v1", f"{URL}:v1", blob_store=blob_store(reg))  # blobs skipped
    assert len([m for m, _p, _h in reg.requests if m == "PUT"]) == n_puts + 1  # manifest only

    other = LayerStore(tmp_path / "o" / "layers", tmp_path / "o" / "images")
    try:
        info = attach_image(
            other, f"{URL}:v1", name="app:copy", lazy=False, blob_store=blob_store(reg)
        )
        assert info.layers == [base.digest, ws.digest]
        assert info.meta["manifest_digest"] == digest and info.meta["config"] == {"Env": ["A=1"]}
        for d in info.layers:
            assert other.layer_path(d).read_bytes() == layer_store.layer_path(d).read_bytes()
        check_stack(other.resolve_layers(["app:copy"]))  # labels travelled with the layers
        assert layer_labels(other.get_layer(ws.digest)) == ([], ["glibc"])
    finally:
        other.close()


def test_attach_corrupted_blob_stores_nothing(layer_store: LayerStore, tmp_path: Path) -> None:
    base = _erofs_layer(layer_store, tmp_path, "base", kind="base", name="b")
    layer_store.put_image("app:v1", [base.digest])
    reg = FakeOciRegistry()
    push_image(layer_store, "app:v1", f"{URL}:v1", blob_store=blob_store(reg))
    reg.blobs[base.digest] = b"\0" * len(reg.blobs[base.digest])
    other = LayerStore(tmp_path / "o" / "layers", tmp_path / "o" / "images")
    try:
        with pytest.raises(BlobDigestMismatch):
            attach_image(other, f"{URL}:v1", lazy=False, blob_store=blob_store(reg))
        assert other.list_layers() == [] and other.list_images() == []
        assert list((tmp_path / "o" / "images").iterdir()) == []
        assert list((tmp_path / "o" / "layers" / "tmp").iterdir()) == []
        del reg.blobs[base.digest]
        with pytest.raises(LayerNotFound):
            attach_image(other, f"{URL}:v1", lazy=False, blob_store=blob_store(reg))
    finally:
        other.close()


def test_push_publishes_chunk_tables_and_lazy_attach_registers_them(
    layer_store: LayerStore, tmp_path: Path
) -> None:
    """Each pushed layer gets a chunk table: listed in the manifest (so registries keep it),
    named by the layer's metadata; a lazy attach checks the tables first and hands them to
    the lazy server with the layers; a corrupted table is refused before anything is
    recorded."""
    base = _erofs_layer(layer_store, tmp_path, "base", kind="base", name="b")
    ws = _erofs_layer(layer_store, tmp_path, "ws", kind="workspace", name="w")
    layer_store.put_image("app:v1", [base.digest, ws.digest])
    reg = FakeOciRegistry()
    digest = push_image(layer_store, "app:v1", f"{URL}:v1", blob_store=blob_store(reg))
    doc = json.loads(reg.manifests[digest][1])
    tables = [d for d in doc["layers"] if d["mediaType"] == CHUNK_TABLE_MEDIA_TYPE]
    assert len(tables) == 2 and all(d["digest"] in reg.blobs for d in tables)
    published = parse_dsec_manifest(doc)  # the table entries are not layers
    assert [x.digest for x in published] == [base.digest, ws.digest]
    named = {x.digest: x.meta["chunk_table"] for x in published}
    assert sorted(named.values()) == sorted(d["digest"] for d in tables)
    for layer in (base, ws):
        fetch_chunk_table(blob_store(reg), named[layer.digest], layer.size).verify(
            0, layer_store.layer_path(layer.digest).read_bytes()
        )

    other = LayerStore(tmp_path / "o" / "layers", tmp_path / "o" / "images")
    try:
        info = attach_image(other, f"{URL}:v1", name="app:lazy", blob_store=blob_store(reg))
        assert info.layers == [base.digest, ws.digest]
        for d in info.layers:
            reg_file = tmp_path / "o" / "layers" / "lazy" / "layers" / f"{d[7:]}.json"
            assert json.loads(reg_file.read_text())["chunk_table"] == named[d]
            assert other.get_layer(d).meta["chunk_table"] == named[d]
    finally:
        other.close()

    reg.blobs[named[ws.digest]] = b"\0" * len(reg.blobs[named[ws.digest]])
    third = LayerStore(tmp_path / "t" / "layers", tmp_path / "t" / "images")
    try:
        with pytest.raises(BlobDigestMismatch):
            attach_image(third, f"{URL}:v1", blob_store=blob_store(reg))
        assert third.list_layers() == [] and third.list_images() == []
    finally:
        third.close()


# --- stacks ----------------------------------------------------------------------------------


def test_check_stack() -> None:
    debian = _layer(
        "base", "debian", {"builtin": "debian", "suite": "bookworm", "include": ["python3"]}
    )
    busybox = _layer("base", "busybox", {"builtin": "busybox"})
    toolkit = _layer("toolkit", "nodejs", {"toolkit": "nodejs", "packages": ["nodejs"]})
    ws = _layer("workspace", "ws", {})
    needs_node = _layer("workspace", "app", {"requires": ["nodejs"]})
    check_stack([debian, toolkit, ws])
    check_stack([debian, toolkit, needs_node])
    check_stack([busybox, ws])
    check_stack([])
    with pytest.raises(InvalidRequest, match=r"nodejs .*requires debian-12, glibc") as exc:
        check_stack([busybox, toolkit])
    assert exc.value.details["missing"] == ["debian-12", "glibc"]
    assert exc.value.details["layer"] == toolkit.digest
    with pytest.raises(InvalidRequest, match="app"):
        check_stack([debian, needs_node, toolkit])  # the provider must be *below*
    explicit = _layer("toolkit", "t2", {"requires": ["debian-13"]})
    with pytest.raises(InvalidRequest, match="debian-13"):
        check_stack([debian, explicit])


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    base = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    out = subprocess.run([*base, *args], check=True, capture_output=True, env=env, text=True)
    return out.stdout.strip()


def test_workspace_layers(layer_store: LayerStore, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("one")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "1")
    _git(repo, "tag", "v1")
    (repo / "a.txt").write_text("two")
    _git(repo, "commit", "-q", "-am", "2")
    (repo / "untracked.txt").write_text("not committed")
    v1 = build_workspace_layer(layer_store, repo, git_ref="v1")
    head = build_workspace_layer(layer_store, f"file://{repo}")
    again = build_workspace_layer(layer_store, str(repo), git_ref="main")
    assert v1.digest != head.digest and head.digest == again.digest  # reproducible
    assert v1.kind == "workspace" and v1.meta["git_commit"] == _git(repo, "rev-parse", "v1")
    assert layer_labels(v1) == ([], [])
    with pytest.raises(InvalidRequest):
        build_workspace_layer(layer_store, repo, git_ref="no-such-ref")
    with pytest.raises(InvalidRequest, match="no network"):
        build_workspace_layer(layer_store, "https://example.com/x.git", git_ref="main")
    d = build_workspace_layer(layer_store, repo)  # a plain directory (untracked file included)
    tar = tmp_path / "ws.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(repo / "a.txt", arcname="a.txt")
    t = build_workspace_layer(layer_store, tar)
    assert len({d.digest, t.digest, head.digest}) == 3
    with pytest.raises(InvalidRequest):
        build_workspace_layer(layer_store, tmp_path / "absent")
    assert list((tmp_path / "images").iterdir()) == []  # git archives removed


def test_attach_refuses_a_blob_that_is_not_erofs(layer_store: LayerStore) -> None:
    junk = b"not an erofs image" * 300
    layer = LayerInfo(
        digest=sha(junk),
        kind="base",
        name="junk",
        size=len(junk),
        created_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
    )
    image = ImageInfo(
        name="junk:v1",
        layers=[layer.digest],
        size=len(junk),
        created_at="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
    )
    config = build_config(image)
    reg = FakeOciRegistry(blobs={layer.digest: junk, sha(config): config})
    manifest = build_manifest(image, [layer], config)
    reg.manifests["v1"] = ("application/vnd.oci.image.manifest.v1+json", manifest)
    with pytest.raises(InvalidRequest, match="not an EROFS image"):
        attach_image(layer_store, f"{URL}:v1", lazy=False, blob_store=blob_store(reg))
    assert layer_store.list_layers() == [] and layer_store.list_images() == []
    assert list(layer_store.scratch.iterdir()) == []
