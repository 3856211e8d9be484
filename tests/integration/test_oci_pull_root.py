"""``pull_image`` against real registries on loopback, verified through mounted EROFS stacks.

Registries used:
* Debian's ``docker-registry`` (distribution 2.8) started as a subprocess on a free loopback
  port with a temp config and storage dir; the tests push images they build themselves
  (OCI layout written with Python: tar layers with files, a whiteout, an opaque dir, a zstd
  layer, an image index with two platforms) through its v2 upload API. Skipped when the
  binary is missing (``apt-get install docker-registry``).
* :class:`FakeRegistry`, a small ``http.server`` registry for what distribution cannot be
  made to do on cue: bearer-token auth with our own token service, a truncated blob, a
  registry that dies in the middle of a pull.

Each pulled image is mounted (``LayerMounts`` + ``assemble_rootfs``) and its tree compared
with the expected one: deleted files absent, opaque directory contents replaced.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.conftest import free_port
from tests.timing import budget

from dsec.errors import ImageNotFound, SandboxError
from dsec.layers import LayerMounts, LayerStore, assemble_rootfs, teardown_rootfs
from dsec.layers.oci import (
    BlobDigestMismatch,
    RegistryUnauthorized,
    RegistryUnavailable,
    pull_image,
)
from dsec.layers.publish import attach_image
from dsec.layers.registry import MT_OCI_INDEX, MT_OCI_MANIFEST
from dsec.privileged.mount import mount, mount_points, umount_quiet

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (whiteouts, mounts)"),
]

MTIME = 1_700_000_000
_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
_CONFIG = "application/vnd.oci.image.config.v1+json"


# --- building OCI images with Python ---------------------------------------------------------


def tar_layer(entries: list[tuple[str, str, str | bytes]]) -> bytes:
    """An uncompressed tar of ``(path, kind, data)``: kind ``file`` (data = content), ``dir``,
    ``symlink`` (data = target), ``exec`` (a 0755 file). Fixed mtimes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, kind, data in entries:
            info = tarfile.TarInfo(path)
            info.mtime = MTIME
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tf.addfile(info)
            else:
                raw = data.encode() if isinstance(data, str) else data
                info.size, info.mode = len(raw), 0o755 if kind == "exec" else 0o644
                tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class OciRepo:
    """Blobs and manifests of one repository, as a registry would serve them."""

    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # ref -> (type, body)

    def add_blob(self, data: bytes) -> dict[str, Any]:
        d = digest_of(data)
        self.blobs[d] = data
        return {"digest": d, "size": len(data)}

    def add_manifest(self, media_type: str, doc: dict[str, Any], tag: str | None = None) -> str:
        body = json.dumps(doc, sort_keys=True).encode()
        d = digest_of(body)
        self.manifests[d] = (media_type, body)
        if tag is not None:
            self.manifests[tag] = (media_type, body)
        return d

    def add_image(
        self, layers: list[tuple[bytes, str]], tag: str | None = None, arch: str = "amd64"
    ) -> str:
        """Add config + layers (``(tar, "gzip"|"zstd")``) + a manifest; returns its digest."""
        descs = []
        for tar, compression in layers:
            if compression == "zstd":
                import zstandard

                blob, mt = zstandard.ZstdCompressor().compress(tar), _LAYER_ZSTD
            else:
                blob, mt = gzip.compress(tar, mtime=0), _LAYER_GZIP
            descs.append({"mediaType": mt, **self.add_blob(blob)})
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/tool"]},
            "rootfs": {"type": "layers", "diff_ids": [digest_of(t) for t, _ in layers]},
        }
        cdesc = {"mediaType": _CONFIG, **self.add_blob(json.dumps(config).encode())}
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_OCI_MANIFEST,
            "config": cdesc,
            "layers": descs,
        }
        return self.add_manifest(MT_OCI_MANIFEST, manifest, tag)

    def add_index(self, entries: list[tuple[str, str]], tag: str) -> str:
        """An image index of ``(manifest digest, arch)`` entries, all linux."""
        manifests = []
        for d, arch in entries:
            mt, body = self.manifests[d]
            manifests.append(
                {
                    "mediaType": mt,
                    "digest": d,
                    "size": len(body),
                    "platform": {"os": "linux", "architecture": arch},
                }
            )
        doc = {"schemaVersion": 2, "mediaType": MT_OCI_INDEX, "manifests": manifests}
        return self.add_manifest(MT_OCI_INDEX, doc, tag)


BIG = secrets.token_bytes(48 * 1024)  # incompressible: makes layer 1 "large" for merging

LAYER1 = tar_layer(
    [
        ("etc/", "dir", ""),
        ("etc/app/", "dir", ""),
        ("etc/app/a.conf", "file", "a1\n"),
        ("etc/app/b.conf", "file", "b1\n"),
        ("opt/", "dir", ""),
        ("opt/data/", "dir", ""),
        ("opt/data/old1", "file", "old1\n"),
        ("opt/data/sub/", "dir", ""),
        ("opt/data/sub/old2", "file", "old2\n"),
        ("bin/", "dir", ""),
        ("bin/tool", "exec", "#!/bin/sh\necho tool\n"),
        ("keep.txt", "file", "keep1\n"),
        ("gone.txt", "file", "gone\n"),
        ("gonedir/", "dir", ""),
        ("gonedir/inside", "file", "x\n"),
        ("link", "symlink", "keep.txt"),
        ("big.bin", "file", BIG),
    ]
)
LAYER2 = tar_layer(  # zstd in the images below: deletes, an opaque dir, a change
    [
        (".wh.gone.txt", "file", ""),
        (".wh.gonedir", "file", ""),
        ("opt/data/", "dir", ""),
        ("opt/data/.wh..wh..opq", "file", ""),
        ("opt/data/new1", "file", "new1\n"),
        ("etc/app/.wh.b.conf", "file", ""),
        ("etc/app/c.conf", "file", "c2\n"),
        ("keep.txt", "file", "keep2\n"),
    ]
)
LAYER3 = tar_layer(
    [
        ("newdir/", "dir", ""),
        ("newdir/x", "file", "x3\n"),
        ("etc/app/a.conf", "file", "a3\n"),
        ("gonedir/", "dir", ""),
        ("gonedir/again", "file", "again3\n"),
    ]
)
EXPECTED_TREE = {
    "bin": "dir",
    "bin/tool": "#!/bin/sh\necho tool\n",
    "big.bin": hashlib.sha256(BIG).hexdigest(),
    "etc": "dir",
    "etc/app": "dir",
    "etc/app/a.conf": "a3\n",
    "etc/app/c.conf": "c2\n",
    "gonedir": "dir",
    "gonedir/again": "again3\n",
    "keep.txt": "keep2\n",
    "link": "-> keep.txt",
    "newdir": "dir",
    "newdir/x": "x3\n",
    "opt": "dir",
    "opt/data": "dir",
    "opt/data/new1": "new1\n",
}


def sample_repo() -> OciRepo:
    """amd64: the three layers (layer 2 zstd) behind an index that also has an arm64 image."""
    repo = OciRepo()
    amd64 = repo.add_image([(LAYER1, "gzip"), (LAYER2, "zstd"), (LAYER3, "gzip")], tag="amd64")
    arm64 = repo.add_image(
        [(tar_layer([("arch", "file", "arm64\n")]), "gzip")], tag="arm64", arch="arm64"
    )
    repo.add_index([(arm64, "arm64"), (amd64, "amd64")], tag="v1")
    return repo


def tree_of(root: Path) -> dict[str, str]:
    """``rel path -> "dir" | "-> target" | text (or sha256 hex for big.bin)``."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            elif n == "big.bin":
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = p.read_text()
    return out


# --- registries ---------------------------------------------------------------------------------


class DistributionRegistry:
    """Debian's ``docker-registry`` on a loopback port, with a temp config and storage."""

    def __init__(self, home: Path, *, auth_config: str = "", push_token: str | None = None) -> None:
        self.home = home
        self.push_headers = {"Authorization": f"Bearer {push_token}"} if push_token else {}
        self.storage = home / "data"
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = home / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n" + auth_config
        )
        self.log = open(home / "registry.log", "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + budget(10)
        while True:
            try:
                status = httpx.get(f"http://{self.host}/v2/", timeout=1).status_code
                if status == 200 or (auth_config and status == 401):
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start: {self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        return (self.home / "registry.log").read_text(errors="replace")[-2000:]

    def push(self, name: str, repo: OciRepo) -> None:
        """Upload every blob, then manifests (children before indexes, then tags)."""
        base = f"http://{self.host}/v2/{name}"
        with httpx.Client(timeout=10, headers=self.push_headers) as c:
            for d, data in repo.blobs.items():
                r = c.post(f"{base}/blobs/uploads/")
                assert r.status_code == 202, r.text
                loc = httpx.URL(f"http://{self.host}").join(r.headers["location"])
                r = c.put(loc.copy_add_param("digest", d), content=data)
                assert r.status_code == 201, r.text
            order = sorted(repo.manifests.items(), key=lambda kv: kv[1][0] == MT_OCI_INDEX)
            for ref, (mt, body) in order:
                r = c.put(f"{base}/manifests/{ref}", content=body, headers={"Content-Type": mt})
                assert r.status_code == 201, (ref, r.text)

    def blob_file(self, digest: str) -> Path:
        hex_ = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class TokenService:
    """A Docker token service for distribution's ``auth: token`` mode: an ``http.server`` on
    loopback issuing RS256 JWTs (``x5c`` header: a self-signed certificate made with the
    ``openssl`` CLI, which the registry trusts via ``rootcertbundle``) to ``user:secret``.
    Pull-only for the pulls; :meth:`jwt` mints push tokens for the test's own uploads."""

    SERVICE = "dsec-test-registry"
    ISSUER = "dsec-test-issuer"

    def __init__(self, home: Path) -> None:
        self.key = home / "token-key.pem"
        self.cert = home / "token-cert.pem"
        argv = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        argv += ["-subj", "/CN=dsec-test-token", "-keyout", str(self.key), "-out", str(self.cert)]
        subprocess.run(argv, check=True, capture_output=True)
        der = subprocess.run(
            ["openssl", "x509", "-in", str(self.cert), "-outform", "DER"],
            check=True,
            capture_output=True,
        ).stdout
        self.x5c = base64.b64encode(der).decode()
        self.issued: list[str] = []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                query = httpx.QueryParams(self.path.partition("?")[2])
                scope = query.get("scope", "")
                want = "Basic " + base64.b64encode(b"user:secret").decode()
                if self.headers.get("Authorization") != want:
                    status, body = 401, b'{"details":"bad credentials"}'
                elif query.get("service") != TokenService.SERVICE or scope.count(":") != 2:
                    status, body = 400, b'{"details":"bad service or scope"}'
                else:
                    service.issued.append(scope)
                    token = service.jwt(scope.split(":")[1], ["pull"])
                    status, body = 200, json.dumps({"token": token}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def auth_config(self) -> str:
        return (
            "auth:\n  token:\n"
            f"    realm: {self.realm}\n    service: {self.SERVICE}\n"
            f"    issuer: {self.ISSUER}\n    rootcertbundle: {self.cert}\n"
        )

    def jwt(self, repository: str, actions: list[str]) -> str:
        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": self.ISSUER,
            "sub": "user",
            "aud": self.SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": [{"type": "repository", "name": repository, "actions": actions}],
        }
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(),
            check=True,
            capture_output=True,
        ).stdout
        return f"{signing_input}.{b64(signature)}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeRegistry:
    """A v2 registry in a thread serving an :class:`OciRepo` (any repository name).

    Args:
        token_auth: require ``Bearer`` tokens from ``/token`` (Basic ``user:secret``).
        truncate_blob: send this blob's full ``Content-Length`` but only half its bytes.
        die_on_blob: after serving this many blob requests, stop answering (close sockets).
    """

    def __init__(
        self,
        repo: OciRepo,
        *,
        token_auth: bool = False,
        truncate_blob: str | None = None,
        die_on_blob: int | None = None,
    ) -> None:
        self.repo = repo
        self.token_auth = token_auth
        self.truncate_blob = truncate_blob
        self.die_on_blob = die_on_blob
        self.blob_requests = 0
        self.requests: list[str] = []
        self.token = secrets.token_hex(16)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        reg = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                reg.requests.append(self.path)
                path = self.path.split("?", 1)[0]
                if path == "/token":
                    want = "Basic " + base64.b64encode(b"user:secret").decode()
                    if self.headers.get("Authorization") != want:
                        self._send(401, b"{}", {})
                        return
                    self._send(200, json.dumps({"token": reg.token}).encode(), {})
                    return
                if reg.token_auth and self.headers.get("Authorization") != f"Bearer {reg.token}":
                    realm = f"http://{reg.host}/token"
                    challenge = f'Bearer realm="{realm}",service="fake",scope="repository:x:pull"'
                    self._send(401, b"{}", {"WWW-Authenticate": challenge})
                    return
                parts = path.split("/")
                if path == "/v2/":
                    self._send(200, b"{}", {})
                elif len(parts) >= 5 and parts[-2] == "manifests":
                    found = reg.repo.manifests.get(parts[-1])
                    if found is None:
                        self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', {})
                    else:
                        self._send(200, found[1], {"Content-Type": found[0]})
                elif len(parts) >= 5 and parts[-2] == "blobs":
                    reg.blob_requests += 1
                    if reg.die_on_blob is not None and reg.blob_requests > reg.die_on_blob:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    data = reg.repo.blobs.get(parts[-1])
                    if data is None:
                        self._send(404, b"{}", {})
                    elif parts[-1] == reg.truncate_blob:
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                    else:
                        self._send(200, data, {})
                else:
                    self._send(404, b"{}", {})

        return Handler

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- fixtures -----------------------------------------------------------------------------------


@dataclass
class Node:
    home: Path
    store: LayerStore
    mounts: LayerMounts

    def mounted_tree(self, layers: list[str]) -> dict[str, str]:
        """Mount the layers (bottom first) under an overlay and read the whole tree."""
        lowers = [self.mounts.acquire(d, self.store.layer_path(d)) for d in layers]
        sb = self.home / "sb" / secrets.token_hex(3)
        try:
            rootfs = assemble_rootfs(sb, lowers, disk_mb=8)
            try:
                return tree_of(rootfs)
            finally:
                teardown_rootfs(sb)
        finally:
            for d in layers:
                self.mounts.release(d)

    def leftovers(self) -> list[str]:
        """Scratch dirs and temp files a pull left behind (none may exist)."""
        out = [str(p) for p in (self.home / "images").iterdir()]
        out += [str(p) for p in (self.home / "layers" / "tmp").iterdir()]
        return out


@pytest.fixture
def node() -> Iterator[Node]:
    home = Path(f"/tmp/dsec-oci-{secrets.token_hex(3)}")
    home.mkdir()
    n = Node(home, LayerStore(home / "layers", home / "images"), LayerMounts(home / "m"))
    try:
        yield n
    finally:
        leaked = mount_points(home)
        for mp in sorted(leaked, key=lambda p: len(p.parts), reverse=True):
            umount_quiet(mp)
        n.store.close()
        shutil.rmtree(home, ignore_errors=True)
        assert not leaked, f"mounts leaked under {home}: {leaked}"


@pytest.fixture(scope="module")
def distribution() -> Iterator[DistributionRegistry]:
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry not installed (apt-get install docker-registry)")
    home = Path(f"/tmp/dsec-oci-reg-{secrets.token_hex(3)}")
    home.mkdir()
    reg = DistributionRegistry(home)
    try:
        reg.push("dsec/sample", sample_repo())
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def token_distribution() -> Iterator[tuple[DistributionRegistry, TokenService]]:
    """docker-registry in ``auth: token`` mode behind :class:`TokenService`."""
    if shutil.which("docker-registry") is None or shutil.which("openssl") is None:
        pytest.skip("needs docker-registry and openssl")
    home = Path(f"/tmp/dsec-oci-treg-{secrets.token_hex(3)}")
    home.mkdir()
    tokens = TokenService(home)
    reg = DistributionRegistry(
        home,
        auth_config=tokens.auth_config(),
        push_token=tokens.jwt("dsec/private", ["pull", "push"]),
    )
    try:
        reg.push("dsec/private", sample_repo())
        yield reg, tokens
    finally:
        reg.stop()
        tokens.stop()
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def fake_registry(repo: OciRepo, **kw: Any) -> Iterator[FakeRegistry]:
    reg = FakeRegistry(repo, **kw)
    try:
        yield reg
    finally:
        reg.stop()


# --- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "n_layers"),
    [(0, 3), (16 * 1024, 2), (64 * 1024 * 1024, 1)],
    ids=["one-per-layer", "small-merged", "all-merged"],
)
def test_pull_index_from_distribution_gives_expected_tree(
    node: Node, distribution: DistributionRegistry, threshold: int, n_layers: int
) -> None:
    ref = f"{distribution.host}/dsec/sample:v1"
    info = pull_image(node.store, ref, name="sample:v1", merge_threshold_bytes=threshold)
    assert len(info.layers) == n_layers
    assert info.meta["source"] == "oci"
    assert info.meta["index_digest"] is not None
    assert info.meta["config"]["Cmd"] == ["/bin/tool"]
    assert node.store.get_image("sample:v1").layers == info.layers
    for d in info.layers:  # inspected at conversion: nothing this sample's files would show
        assert node.store.get_layer(d).meta["provides"] == []
    tree = node.mounted_tree(info.layers)
    assert tree == EXPECTED_TREE
    assert node.leftovers() == []


def test_merged_and_stacked_layers_are_reproducible(
    node: Node, distribution: DistributionRegistry
) -> None:
    ref = f"{distribution.host}/dsec/sample:v1"
    first = pull_image(node.store, ref, merge_threshold_bytes=0)
    assert first.name == "dsec-sample:v1"
    # a second pull downloads nothing: every group is found by its blob digests
    again = pull_image(node.store, ref, name="copy", merge_threshold_bytes=0)
    assert again.layers == first.layers
    # the same bytes on another node (a fresh store) give the same layer digests
    other = LayerStore(node.home / "layers2", node.home / "images2")
    try:
        assert pull_image(other, ref, merge_threshold_bytes=0).layers == first.layers
    finally:
        other.close()


def test_pull_by_platform_manifest_digest(node: Node, distribution: DistributionRegistry) -> None:
    repo = sample_repo()
    arm_digest = digest_of(repo.manifests["arm64"][1])
    info = pull_image(node.store, f"{distribution.host}/dsec/sample@{arm_digest}")
    assert info.name == "dsec-sample:sha256-" + arm_digest[7:19]
    assert info.meta["index_digest"] is None
    assert node.mounted_tree(info.layers) == {"arch": "arm64\n"}


def test_missing_image_and_repository(node: Node, distribution: DistributionRegistry) -> None:
    with pytest.raises(ImageNotFound):
        pull_image(node.store, f"{distribution.host}/dsec/sample:nope")
    with pytest.raises(ImageNotFound):
        pull_image(node.store, f"{distribution.host}/dsec/absent:v1")
    assert node.store.list_images() == []


def test_corrupted_blob_is_refused(node: Node, distribution: DistributionRegistry) -> None:
    repo = OciRepo()
    layer = tar_layer([("f", "file", "good\n")])
    repo.add_image([(layer, "gzip")], tag="t")
    distribution.push("dsec/corrupt", repo)
    blob_digest = next(d for d, b in repo.blobs.items() if b == gzip.compress(layer, mtime=0))
    blob_file = distribution.blob_file(blob_digest)
    data = bytearray(blob_file.read_bytes())
    data[-10] ^= 0xFF  # same size, different bytes
    blob_file.write_bytes(bytes(data))
    with pytest.raises(BlobDigestMismatch):
        pull_image(node.store, f"{distribution.host}/dsec/corrupt:t", retries=0)
    assert node.store.list_layers() == []
    assert node.store.list_images() == []
    assert node.leftovers() == []


def test_token_auth(node: Node) -> None:
    with fake_registry(sample_repo(), token_auth=True) as reg:
        ref = f"{reg.host}/dsec/sample:v1"
        with pytest.raises(RegistryUnauthorized):
            pull_image(node.store, ref)
        with pytest.raises(RegistryUnauthorized):
            pull_image(node.store, ref, credentials=("user", "wrong"))
        info = pull_image(node.store, ref, credentials=("user", "secret"))
        # one token fetch answered every later request
        assert sum(r.startswith("/token") for r in reg.requests) == 3
    assert node.mounted_tree(info.layers) == EXPECTED_TREE


def test_truncated_download_leaves_nothing(node: Node) -> None:
    repo = sample_repo()
    amd64 = json.loads(repo.manifests["amd64"][1])
    big_blob = amd64["layers"][0]["digest"]
    with fake_registry(repo, truncate_blob=big_blob) as reg:
        with pytest.raises(RegistryUnavailable, match=r"truncated|broke"):
            pull_image(node.store, f"{reg.host}/dsec/sample:v1", retries=1)
        assert reg.blob_requests == 1 + 2  # config, then the layer twice (one retry)
    assert node.store.list_layers() == []
    assert node.store.list_images() == []
    assert node.leftovers() == []


def test_registry_dying_mid_pull(node: Node) -> None:
    with fake_registry(sample_repo(), die_on_blob=2) as reg:  # config + first layer only
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            pull_image(node.store, f"{reg.host}/dsec/sample:v1", merge_threshold_bytes=0, retries=1)
        assert time.monotonic() - started < budget(10)  # failed, did not hang on the dead one
    # the first layer was complete and is kept (content-addressed, reused by the next pull);
    # no image was recorded and no scratch file is left
    assert len(node.store.list_layers()) == 1
    assert node.store.list_images() == []
    assert node.leftovers() == []


def test_full_scratch_disk_is_a_clear_error(node: Node) -> None:
    """The scratch dir on a 32 KiB tmpfs: the 48 KiB layer cannot be downloaded."""
    scratch = node.home / "small"
    scratch.mkdir()
    mount("tmpfs", scratch, "tmpfs", 0, "size=32k,nr_inodes=64")
    try:
        store = LayerStore(node.home / "layers3", scratch)
        try:
            with fake_registry(sample_repo()) as reg:
                with pytest.raises(SandboxError, match="No space left"):
                    pull_image(store, f"{reg.host}/dsec/sample:v1")
            assert list(scratch.iterdir()) == []
            assert store.list_layers() == [] and store.list_images() == []
        finally:
            store.close()
    finally:
        umount_quiet(scratch)


def test_token_auth_with_distribution(
    node: Node, token_distribution: tuple[DistributionRegistry, TokenService]
) -> None:
    reg, tokens = token_distribution
    ref = f"{reg.host}/dsec/private:v1"
    with pytest.raises(RegistryUnauthorized):
        pull_image(node.store, ref)  # anonymous: the token service refuses
    with pytest.raises(RegistryUnauthorized):
        pull_image(node.store, ref, credentials=("user", "wrong"))
    before = len(tokens.issued)
    info = pull_image(node.store, ref, credentials=("user", "secret"), merge_threshold_bytes=0)
    assert tokens.issued[before:] == ["repository:dsec/private:pull"]  # one token, whole pull
    assert node.mounted_tree(info.layers) == EXPECTED_TREE


def test_attach_of_a_plain_image_pulls_it_with_the_same_credentials(node: Node) -> None:
    """``attach_image`` of a reference that is no dsec artifact pulls it as a container
    image, authenticated as the attach was (the session's public ``credentials``)."""
    with fake_registry(sample_repo(), token_auth=True) as reg:
        ref = f"{reg.host}/dsec/sample:v1"
        with pytest.raises(RegistryUnauthorized):
            attach_image(node.store, ref, name="plain", auth=("user", "wrong"))
        info = attach_image(node.store, ref, name="plain", auth=("user", "secret"))
    assert info.name == "plain"
    assert node.mounted_tree(info.layers) == EXPECTED_TREE
