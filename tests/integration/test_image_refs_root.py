"""Images by registry reference on create, against Debian's ``docker-registry`` on loopback
and a real ``dsec serve`` (container tier): a plain OCI image converted on first use, a
dsec artifact attached lazily, one pull for many concurrent creates, the reference as the
image's name afterwards, E2B's ``templateID`` as a reference, and the errors."""

from __future__ import annotations

import gzip
import io
import json
import os
import secrets
import shutil
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests.integration.test_oci_pull_root import (
    _CONFIG,
    _LAYER_GZIP,
    DistributionRegistry,
    OciRepo,
    digest_of,
)

from dsec import Client, Sandbox
from dsec.errors import ImageNotFound, RegistryUnavailable
from dsec.layers.builtin import build_busybox_rootfs
from dsec.layers.registry import MT_OCI_MANIFEST
from dsec.models import ImageRef
from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("docker-registry") is None, reason="needs docker-registry"),
]


def _busybox_tar(tmp: Path, extra: dict[str, bytes]) -> bytes:
    """A tar of the static busybox tree plus ``extra`` files."""
    root = tmp / f"tree-{secrets.token_hex(3)}"
    root.mkdir()
    build_busybox_rootfs(root)
    for path, data in extra.items():
        f = root / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(root, arcname=".")
    shutil.rmtree(root)
    return buf.getvalue()


def _image(repo: OciRepo, layer_tar: bytes, tag: str, config: dict[str, object]) -> None:
    blob = gzip.compress(layer_tar, mtime=0)
    layer = {"mediaType": _LAYER_GZIP, **repo.add_blob(blob)}
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [digest_of(layer_tar)]},
    }
    cdesc = {"mediaType": _CONFIG, **repo.add_blob(json.dumps(cfg).encode())}
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "config": cdesc,
        "layers": [layer],
    }
    repo.add_manifest(MT_OCI_MANIFEST, manifest, tag)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistributionRegistry]:
    home = tmp_path_factory.mktemp("refs-registry")
    reg = DistributionRegistry(home)
    try:
        repo = OciRepo()
        tar = _busybox_tar(home, {"/etc/app-release": b"team app 1\n"})
        _image(
            repo,
            tar,
            "1",
            {"Env": ["APP_MODE=from-config", "PATH=/bin:/sbin"], "WorkingDir": "/etc"},
        )
        reg.push("team/app", repo)
        mirror = OciRepo()  # what a Docker Hub mirror serves for the short name `tool:2`
        _image(mirror, _busybox_tar(home, {"/etc/tool": b"tool 2\n"}), "2", {"Env": ["PATH=/bin"]})
        reg.push("library/tool", mirror)
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, registry: DistributionRegistry
) -> Iterator[BackgroundServer]:
    home = tmp_path_factory.mktemp("refs-node") / "home"
    home.mkdir()
    os.environ["DSEC_SHORT_NAME_REGISTRY"] = registry.host  # the mirror for short names
    try:
        with BackgroundServer(home, tiers=["container"]) as srv:
            yield srv
    finally:
        os.environ["DSEC_SHORT_NAME_REGISTRY"] = "none"


def test_a_registry_image_by_reference_on_create(
    server: BackgroundServer, registry: DistributionRegistry
) -> None:
    ref = f"{registry.host}/team/app:1"
    assert server.edge is not None
    before = server.edge.references.pulls_started

    def make(_: int) -> Sandbox:
        return Sandbox.create(image=ref, url=server.url, api_key=server.api_key, ttl_s=300)

    with ThreadPoolExecutor(8) as pool:  # 8 creates of a new reference at the same moment
        made = list(pool.map(make, range(8)))
    try:
        assert server.edge.references.pulls_started == before + 1  # exactly one pull
        sb = made[0]
        r = sb.commands.run("cat app-release; echo $APP_MODE; pwd")
        assert r.stdout == "team app 1\nfrom-config\n/etc\n", r
        assert sb.info.image == ref
        with Client(server.url, server.api_key) as client:
            listed = {im.name: im for im in client.list_images()}
            assert listed[ref].meta["reference"] == ref  # the reference names the image
    finally:
        for sb in made:
            sb.kill()


def test_short_names_come_from_the_configured_mirror(server: BackgroundServer) -> None:
    with Sandbox.create(image="tool:2", url=server.url, api_key=server.api_key) as sb:
        assert sb.commands.run("cat /etc/tool").stdout == "tool 2\n"
        assert sb.info.image == "tool:2"


def test_a_dsec_artifact_by_reference_is_attached_lazily(
    server: BackgroundServer, registry: DistributionRegistry
) -> None:
    with Client(server.url, server.api_key) as client:
        base = Sandbox.create(image="busybox", url=server.url, api_key=server.api_key)
        try:
            base.files.write("/srv/data.txt", b"pushed as a dsec artifact\n")
            base.snapshot(name="art:1")
        finally:
            base.kill()
        target = f"oci://{registry.host}/dsec/art:v1"
        client.push_image("art:1", target)
    assert server.edge is not None
    ref = f"{registry.host}/dsec/art:v1"
    with Sandbox.create(image=ref, url=server.url, api_key=server.api_key) as sb:
        assert sb.commands.run("cat /srv/data.txt").stdout == "pushed as a dsec artifact\n"
        image = server.call(server.edge.get_image(ImageRef(name=ref), _owner(server)))
        assert image.meta["source"] == "oci-dsec" and image.meta["lazy"] is True


def test_e2b_template_id_may_be_a_reference(
    server: BackgroundServer, registry: DistributionRegistry
) -> None:
    ref = f"{registry.host}/team/app:1"
    r = httpx.post(
        f"{server.url}/e2b/sandboxes",
        json={"templateID": ref, "timeout": 60},
        headers={"X-API-Key": server.api_key},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    killed = httpx.delete(
        f"{server.url}/e2b/sandboxes/{sid}", headers={"X-API-Key": server.api_key}, timeout=60
    )
    assert killed.status_code == 204, killed.text
    missing = httpx.post(
        f"{server.url}/e2b/sandboxes",
        json={"templateID": f"{registry.host}/team/nope:1"},
        headers={"X-API-Key": server.api_key},
        timeout=60,
    )
    assert missing.status_code == 404 and "team/nope:1" in missing.json()["message"]


def test_unknown_references_and_a_registry_that_is_down(
    server: BackgroundServer, registry: DistributionRegistry
) -> None:
    with pytest.raises(ImageNotFound) as e:
        Sandbox.create(
            image=f"{registry.host}/team/app:404", url=server.url, api_key=server.api_key
        )
    assert f"{registry.host}/team/app:404" in e.value.message
    down = "127.0.0.1:9/team/app:1"  # port 9 (discard): nothing listens
    with pytest.raises(RegistryUnavailable):
        Sandbox.create(image=down, url=server.url, api_key=server.api_key, timeout=60)
    with Client(server.url, server.api_key) as client:
        assert down not in {im.name for im in client.list_images()}  # nothing half-stored


def _owner(server: BackgroundServer) -> str:
    owner = server.keys.verify(server.api_key)
    assert isinstance(owner, str)
    return owner
