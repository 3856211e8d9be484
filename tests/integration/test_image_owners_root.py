"""Images, layers and snapshots belong to API keys, tried as an attacker with a second key
against a real server (root): no host files through the image API, no replacing another
owner's or the system's images, nothing of another key's reachable by name or digest, and
built-in images that are still being built answer a retryable error instead of holding the
request (nothing is left behind when the client leaves).
"""

from __future__ import annotations

import gzip
import io
import secrets
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.timing import budget

from dsec.apiserver.auth import owner_id
from dsec.edge.agent import EdgeLimits
from dsec.layers import BUILTIN_IMAGES, BuiltinImage
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.slow]


@dataclass
class Server:
    url: str
    operator: httpx.Client  # the node's own key ($DSEC_HOME/api_key)
    alice: httpx.Client
    bob: httpx.Client
    alice_owner: str
    bg: BackgroundServer
    gated_image: str  # a built-in whose build waits for RELEASE
    slow_image: str  # a built-in whose build takes a second


def _client(url: str, key: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=timeout)


RELEASE = threading.Event()


def _gated_rootfs(dest: Path) -> None:
    """A built-in image whose build waits for the test (a `debian` build on a fresh node)."""
    from dsec.layers.builtin import build_busybox_rootfs

    assert RELEASE.wait(120)
    build_busybox_rootfs(dest)


def _slow_rootfs(dest: Path) -> None:
    from dsec.layers.builtin import build_busybox_rootfs

    time.sleep(1.0)
    build_busybox_rootfs(dest)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, shared_layers: Path) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("owners")
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    limits = EdgeLimits(max_build_bytes=16 << 20, image_wait_s=3.0)
    gated, slow = f"gated{secrets.token_hex(3)}", f"slow{secrets.token_hex(3)}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BUILTIN_IMAGES, gated, BuiltinImage(name=gated, build_rootfs=_gated_rootfs))
        mp.setitem(BUILTIN_IMAGES, slow, BuiltinImage(name=slow, build_rootfs=_slow_rootfs))
        with BackgroundServer(home, tiers=["container"], limits=limits) as bg:
            alice_key = bg.keys.create_key("alice")
            bob_key = bg.keys.create_key("bob")
            operator, alice, bob = (_client(bg.url, k) for k in (bg.api_key, alice_key, bob_key))
            try:
                yield Server(bg.url, operator, alice, bob, owner_id(alice_key), bg, gated, slow)
            finally:
                for c in (operator, alice, bob):
                    for sb in c.get("/v1/sandboxes").json().get("sandboxes", []):
                        c.delete(f"/v1/sandboxes/{sb['id']}")
                    c.close()
                RELEASE.set()


def _tar(files: dict[str, bytes], *, links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _build(c: httpx.Client, name: str, context: bytes, **params: Any) -> httpx.Response:
    return c.post(
        "/v1/images/build",
        params={"name": name, **params},
        content=context,
        headers={"content-type": "application/x-tar"},
    )


def _create(c: httpx.Client, **body: Any) -> httpx.Response:
    return c.post("/v1/sandboxes", json={"tier": "container", "cpu": 0.1, **body})


def _run(c: httpx.Client, sid: str, cmd: str) -> dict[str, Any]:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", cmd], "timeout_s": 30})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


def test_the_api_never_reads_a_server_path(server: Server) -> None:
    for body in ({"name": "hostetc", "path": "/etc"}, {"name": "hostsys", "path": "/sys"}):
        r = server.alice.post("/v1/images/build", json=body)
        assert r.status_code == 400 and "server path" in r.json()["error"]["message"], r.text
    names = {i["name"] for i in server.alice.get("/v1/images").json()["images"]}
    assert not {"hostetc", "hostsys"} & names
    # an archive cannot climb out of its build directory either
    r = _build(server.alice, "escape", _tar({"../../etc/evil": b"x"}))
    assert r.status_code == 400 and _code(r) == "invalid_request", r.text
    # a symlink in the context resolves inside the new layer, never on the host
    tag = secrets.token_hex(4)
    r = _build(
        server.alice,
        f"links{tag}",
        _tar(
            {f"h/host-{tag}/file": b"inside\n", f"up/up-{tag}": b"inside\n"},
            links={"h": "/etc", "up": "../../../../../etc"},
        ),
        base="busybox",
    )
    assert r.status_code == 201, r.text
    assert not Path(f"/etc/host-{tag}").exists() and not Path(f"/etc/up-{tag}").exists()
    sid = _create(server.alice, image=f"links{tag}").json()["id"]
    out = _run(server.alice, sid, f"cat /etc/host-{tag}/file /etc/up-{tag}")
    assert out["stdout"] == "inside\ninside\n"


def test_uploaded_contexts_are_bounded(server: Server) -> None:
    scratch = server.bg.home / "images"
    before = set(scratch.iterdir())
    bomb = gzip.compress(_tar({"zeros": bytes(64 << 20)}), compresslevel=1)
    r = server.alice.post(
        "/v1/images/build",
        params={"name": "bomb"},
        content=bomb,
        headers={"content-type": "application/gzip"},
    )
    assert r.status_code == 413 and _code(r) == "payload_too_large", r.text
    assert set(scratch.iterdir()) == before  # nothing of the failed build stays
    assert r.status_code == 413


def test_a_second_key_sees_nothing_of_the_first(server: Server) -> None:
    alice, bob = server.alice, server.bob
    name = f"private{secrets.token_hex(3)}"
    r = _build(alice, name, _tar({"secret.txt": b"alice's data\n"}), base="busybox")
    assert r.status_code == 201, r.text
    image = r.json()
    assert image["owner"] == server.alice_owner
    digest = image["layers"][-1]

    r = _create(alice, image=name)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert _run(alice, sid, "cat /secret.txt")["stdout"] == "alice's data\n"

    # bob: every way of naming it is "not found", as for something that does not exist
    assert bob.get(f"/v1/images/{name}").status_code == 404
    assert name not in {i["name"] for i in bob.get("/v1/images").json()["images"]}
    assert digest not in {x["digest"] for x in bob.get("/v1/layers").json()["layers"]}
    r = _create(bob, image=name)
    assert r.status_code == 404 and _code(r) == "image_not_found"
    r = _create(bob, image=digest)
    assert r.status_code == 404 and _code(r) == "image_not_found"
    r = _create(bob, image="busybox", layers=[digest])
    assert r.status_code == 404 and _code(r) == "layer_not_found", r.text
    r = _create(bob, image="busybox", layers=[name])
    assert r.status_code == 404 and _code(r) == "image_not_found"
    assert bob.delete(f"/v1/images/{name}").status_code == 404
    assert bob.patch(f"/v1/images/{name}", json={"shared": True}).status_code == 404
    r = bob.post(f"/v1/images/{name}/push", json={"target": "oci://127.0.0.1:1/x:y"})
    assert r.status_code == 404, r.text

    # bob's own image of the same name is his, alice's stays hers
    r = _build(bob, name, _tar({"secret.txt": b"bob's\n"}), base="busybox")
    assert r.status_code == 201, r.text
    assert _run(alice, sid, "cat /secret.txt")["stdout"] == "alice's data\n"
    r = _create(alice, image=name)
    assert _run(alice, r.json()["id"], "cat /secret.txt")["stdout"] == "alice's data\n"

    # snapshots: a named one is an image of its owner only; its layer is hers only
    _run(alice, sid, "echo changed > /changed")
    r = alice.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": f"{name}-snap"})
    assert r.status_code == 201, r.text
    snap_layer = r.json()["digest"]
    assert bob.get(f"/v1/images/{name}-snap").status_code == 404
    r = _create(bob, image="busybox", layers=[snap_layer])
    assert r.status_code == 404 and _code(r) == "layer_not_found"
    assert _create(alice, image=f"{name}-snap").status_code == 201

    # another key's sandbox, trajectory and job: not found
    assert bob.get(f"/v1/sandboxes/{sid}").status_code == 404
    assert bob.get(f"/v1/sandboxes/{sid}/trajectory").status_code == 404
    assert bob.post(f"/v1/sandboxes/{sid}/snapshot", json={}).status_code == 404
    assert bob.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1}).status_code == 404

    # sharing on purpose: bob uses it as <owner>/<name>, never under the bare name
    r = alice.patch(f"/v1/images/{name}", json={"shared": True})
    assert r.status_code == 200 and r.json()["shared"], r.text
    r = _create(bob, image=f"{server.alice_owner}/{name}")
    assert r.status_code == 201, r.text
    assert _run(bob, r.json()["id"], "cat /secret.txt")["stdout"] == "alice's data\n"
    alice.patch(f"/v1/images/{name}", json={"shared": False})
    assert _create(bob, image=f"{server.alice_owner}/{name}").status_code == 404


def test_keys_cannot_replace_system_images(server: Server) -> None:
    trojan = _tar({"bin/sh": b"#!/nothing\n", "bin/busybox": b"gone\n"})
    for name in ("busybox", "debian"):
        r = _build(server.bob, name, trojan)
        assert r.status_code == 409 and _code(r) == "conflict", r.text
        r = server.bob.post("/v1/images/pull", json={"ref": "127.0.0.1:1/x:y", "name": name})
        assert r.status_code == 409, r.text  # refused before anything is downloaded
    r = server.bob.delete("/v1/images/busybox")
    assert r.status_code == 409, r.text
    r = _build(server.bob, "mine", trojan, system="true")
    assert r.status_code == 403 and _code(r) == "permission_denied", r.text
    # alice's next busybox sandbox is untouched
    r = _create(server.alice, image="busybox")
    assert r.status_code == 201, r.text
    assert _run(server.alice, r.json()["id"], "echo ok")["stdout"] == "ok\n"
    # the operator's key publishes for everyone; keys only read it
    tools = f"tools{secrets.token_hex(3)}"
    r = _build(server.operator, tools, _tar({"tool.txt": b"v1\n"}), base="busybox", system="true")
    assert r.status_code == 201 and r.json()["owner"] == "system", r.text
    r = _create(server.bob, image=tools)
    assert _run(server.bob, r.json()["id"], "cat /tool.txt")["stdout"] == "v1\n"
    assert _build(server.bob, tools, trojan).status_code == 409
    assert (
        server.operator.delete(f"/v1/images/{tools}", params={"system": "true"}).status_code == 204
    )


def test_e2b_templates_are_owned_too(server: Server) -> None:
    name = f"tpl{secrets.token_hex(3)}"
    assert _build(server.alice, name, _tar({"t": b"1"}), base="busybox").status_code == 201
    keys = {"alice": server.alice.headers["authorization"].split()[1]}
    keys["bob"] = server.bob.headers["authorization"].split()[1]
    with httpx.Client(base_url=f"{server.url}/e2b", timeout=60) as e2b:
        r = e2b.post("/sandboxes", json={"templateID": name}, headers={"X-API-Key": keys["bob"]})
        assert r.status_code == 404 and "template" in r.json()["message"], r.text
        r = e2b.post("/sandboxes", json={"templateID": name}, headers={"X-API-Key": keys["alice"]})
        assert r.status_code == 201, r.text
        e2b.delete(f"/sandboxes/{r.json()['sandboxID']}", headers={"X-API-Key": keys["alice"]})


def test_an_image_being_built_answers_retry(server: Server) -> None:
    gated = server.gated_image
    listed = {i["name"]: i for i in server.alice.get("/v1/images").json()["images"]}
    assert listed[gated]["status"] == "queued" and listed[gated]["layers"] == []

    started = time.monotonic()
    r = _create(server.alice, image=gated)
    assert r.status_code == 503 and _code(r) == "image_not_ready", r.text
    assert time.monotonic() - started < budget(30)  # bounded by image_wait_s, not by the build
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["details"]["phase"] and err["details"]["image"] == gated
    listed = {i["name"]: i for i in server.alice.get("/v1/images").json()["images"]}
    assert listed[gated]["status"] == "building" and listed[gated]["progress"]
    assert not [
        s for s in server.alice.get("/v1/sandboxes").json()["sandboxes"] if s["image"] == gated
    ]

    RELEASE.set()
    deadline = time.monotonic() + budget(60)
    while time.monotonic() < deadline:
        r = _create(server.alice, image=gated)
        if r.status_code != 503:
            break
        time.sleep(0.2)
    assert r.status_code == 201, r.text


def test_a_create_whose_client_left_leaves_no_sandbox(server: Server) -> None:
    key = server.alice.headers["authorization"].split()[1]
    with _client(server.url, key, timeout=0.3) as impatient:
        with pytest.raises(httpx.TimeoutException):
            _create(impatient, image=server.slow_image)  # the build takes ~1 s
    deadline = time.monotonic() + budget(30)
    while time.monotonic() < deadline:  # the server finishes the create, then undoes it
        everything = server.alice.get("/v1/sandboxes", params={"include_stopped": "true"})
        made = [s for s in everything.json()["sandboxes"] if s["image"] == server.slow_image]
        if made and all(s["state"] == "stopped" for s in made):
            break
        time.sleep(0.2)
    assert made and all(s["state"] == "stopped" for s in made), made
    r = _create(server.alice, image=server.slow_image)  # the image itself was kept
    assert r.status_code == 201, r.text
