"""Images by registry reference on create (dsec.edge.references), over the test edge: the
real EdgeAgent with an in-memory registry (MemoryLayers(registry=...)). The same against a
real docker-registry on loopback is tests/integration/test_image_refs_root.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from tests.timing import budget

from dsec import AsyncSandbox, CreateSandboxRequest
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.edge.references import REGISTRY_OWNER
from dsec.errors import (
    ImageNotFound,
    ImageNotReady,
    InvalidRequest,
    RegistryUnavailable,
)
from dsec.images.reference import familiar_name, is_qualified, is_reference_name, parse_ref
from dsec.models import DeleteImageRequest, KeyScope
from dsec.testing import FAKE_BUSYBOX, FakeEdge, MemoryLayers

A = "k" + "a" * 16
B = "k" + "b" * 16
REF = "127.0.0.1:5000/team/app:1"


def _edge(registry: dict[str, dict[str, Any]], **kw: Any) -> FakeEdge:
    edge = FakeEdge(layers=MemoryLayers(registry=registry), **kw)
    edge.references.short_names = None
    return edge


def _req(image: str) -> CreateSandboxRequest:
    return CreateSandboxRequest(image=image)


def _stack(edge: FakeEdge, sandbox_id: str) -> list[str]:
    """The layer digests a sandbox was made of (its image's, bottom first)."""
    row = edge.registry.get(sandbox_id)
    assert row is not None
    return list(row.image_layers)


def test_reference_forms() -> None:
    assert familiar_name(parse_ref("docker.io/library/python:3.12")) == "python:3.12"
    assert familiar_name(parse_ref("python")) == "python:latest"
    assert familiar_name(parse_ref("e2b/desktop")) == "e2b/desktop:latest"
    assert familiar_name(parse_ref("oci://127.0.0.1:5000/x/y:2")) == "127.0.0.1:5000/x/y:2"
    digest = "sha256:" + "ab" * 32
    assert familiar_name(parse_ref(f"localhost/r@{digest}")) == f"localhost/r@{digest}"
    assert is_qualified("localhost/r") and is_qualified(f"r@{digest}") and not is_qualified("r:1")
    assert is_reference_name("127.0.0.1:5000/debian:12") and not is_reference_name(
        "docker.io/library/python:3.12"  # not the familiar form
    )
    assert not is_reference_name(A + "/app:1")  # another key's shared image, not a reference
    for bad in ("127.0.0.1:5000/UPPER:1", "host:5000/r:bad tag", "r@sha256:12"):
        with pytest.raises(InvalidRequest):
            parse_ref(bad)


async def test_a_reference_is_pulled_once_and_then_names_the_keys_image() -> None:
    edge = _edge({REF: {"config": {"WorkingDir": "/app", "Env": ["MODE=reg"]}}})
    sb = await edge.create_sandbox(_req(REF), A)
    assert sb.workdir == "/app"  # the pulled image's config applies
    mine = {im.name: im for im in (await edge.list_images(KeyScope(), A)).images}
    assert mine[REF].owner == A and mine[REF].meta["reference"] == REF
    assert REF not in {
        im.name for im in (await edge.list_images(KeyScope(), B)).images
    }  # another key: not yet
    again = await edge.create_sandbox(_req("oci://" + REF), A)
    other = await edge.create_sandbox(_req(REF), B)  # the node's copy: no second pull
    assert _stack(edge, again.id) == _stack(edge, other.id) == _stack(edge, sb.id) != []
    assert edge.memory_layers.pulls == {"127.0.0.1:5000/team/app:1": 1}
    assert REF in {im.name for im in (await edge.list_images(KeyScope(), B)).images}
    await edge.delete_image(
        DeleteImageRequest(name=REF), A
    )  # a key's own image: removable, the copy stays
    assert REF not in {im.name for im in (await edge.list_images(KeyScope(), A)).images}
    assert edge.memory_layers.get_image(REF, REGISTRY_OWNER).name == REF
    assert _stack(edge, (await edge.create_sandbox(_req(REF), A)).id) == _stack(edge, sb.id)
    assert edge.memory_layers.pulls[REF] == 1


async def test_fifty_creates_of_a_new_reference_pull_once(monkeypatch: pytest.MonkeyPatch) -> None:
    edge = _edge({REF: {}}, max_sandboxes=100)
    layers = edge.memory_layers
    real = layers.attach
    threads: set[int] = set()

    def slow_attach(*args: Any) -> Any:
        threads.add(threading.get_ident())
        time.sleep(0.3)  # the pull runs in a worker thread, not on the event loop
        return real(*args)

    monkeypatch.setattr(layers, "attach", slow_attach)
    t0 = time.monotonic()
    made = await asyncio.gather(*(edge.create_sandbox(_req(REF), A) for _ in range(50)))
    assert len({m.id for m in made}) == 50 and layers.pulls == {REF: 1}
    assert threading.get_ident() not in threads
    assert time.monotonic() - t0 < budget(5)  # the 49 others waited on the one 0.3 s pull


async def test_a_pull_in_progress_is_visible_and_a_create_past_its_wait_is_retryable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    edge = _edge({REF: {}})
    edge.limits.image_wait_s = 0.05
    release = threading.Event()
    real = edge.memory_layers.attach

    def gated(*args: Any) -> Any:
        assert release.wait(10)
        return real(*args)

    monkeypatch.setattr(edge.memory_layers, "attach", gated)
    with pytest.raises(ImageNotReady) as e:
        await edge.create_sandbox(_req(REF), A)
    assert e.value.details["phase"] == "pulling" and e.value.http_status == 503
    waiting = asyncio.ensure_future(edge.create_sandbox(_req(REF), A))
    await asyncio.sleep(0.01)
    listed = {im.name: im for im in (await edge.list_images(KeyScope(), A)).images}
    assert listed[REF].status == "pulling" and "127.0.0.1:5000" in (listed[REF].progress or "")
    assert REF not in {
        im.name for im in (await edge.list_images(KeyScope(), B)).images
    }  # only its waiters see it
    with pytest.raises(ImageNotReady):
        await waiting  # it waited its 0.05 s too; the pull goes on
    release.set()
    edge.limits.image_wait_s = budget(5)
    assert (await edge.create_sandbox(_req(REF), A)).state == "running"
    assert edge.memory_layers.pulls[REF] == 1


async def test_local_names_win_and_qualified_references_never_mean_local_images() -> None:
    edge = _edge({"registry-1.docker.io/library/python:3.12": {}})
    edge.references.short_names = "registry-1.docker.io"
    edge.memory_layers.put_image("python:3.12", [FAKE_BUSYBOX], owner=A, meta={"mine": True})
    local = await edge.create_sandbox(_req("python:3.12"), A)
    assert _stack(edge, local.id) == [FAKE_BUSYBOX] and edge.memory_layers.pulls == {}
    pulled = await edge.create_sandbox(_req("docker.io/library/python:3.12"), A)
    assert _stack(edge, pulled.id) != [FAKE_BUSYBOX] and edge.memory_layers.pulls != {}
    theirs = await edge.create_sandbox(_req("python:3.12"), B)
    assert _stack(edge, theirs.id) == _stack(edge, pulled.id)


async def test_short_names_come_from_the_configured_registry() -> None:
    edge = _edge({"127.0.0.1:5000/library/python:3.12": {}})
    edge.references.short_names = "127.0.0.1:5000"  # a mirror of Docker Hub on loopback
    sb = await edge.create_sandbox(_req("python:3.12"), A)
    assert sb.image == "python:3.12"
    assert edge.memory_layers.pulls == {"127.0.0.1:5000/library/python:3.12": 1}
    edge.references.short_names = None
    with pytest.raises(ImageNotFound) as e:
        await edge.create_sandbox(_req("ruby:3"), A)
    assert "ruby:3" in e.value.message


async def test_unknown_and_unreachable_references(monkeypatch: pytest.MonkeyPatch) -> None:
    edge = _edge({REF: {}})
    with pytest.raises(ImageNotFound) as e:
        await edge.create_sandbox(_req("127.0.0.1:5000/team/app:2"), A)
    assert "127.0.0.1:5000/team/app:2" in e.value.message and e.value.http_status == 404

    def down(*args: Any) -> Any:
        raise RegistryUnavailable("connection refused by 127.0.0.1:5000", retry_after_s=5)

    monkeypatch.setattr(edge.memory_layers, "attach", down)
    with pytest.raises(RegistryUnavailable):
        await edge.create_sandbox(_req(REF), A)
    assert REF not in {
        im.name for im in (await edge.list_images(KeyScope(), A)).images
    }  # nothing half-stored
    with pytest.raises(ImageNotFound):
        edge.memory_layers.get_image(REF, REGISTRY_OWNER)
    with pytest.raises(InvalidRequest):
        edge.references.wanted("127.0.0.1:5000/UPPER:1")
    with pytest.raises(ValueError):  # the API answers 400 before the edge is asked
        _req("127.0.0.1:5000/UPPER:1")


async def test_references_through_the_api_and_sdk() -> None:
    edge = _edge({REF: {"start": {"cmd": "serve"}}})
    edge.program("serve", stdout="up\n")
    keys = ["dsec_test_ref_" + "1" * 20, "dsec_test_ref_" + "2" * 20]
    transport = httpx.ASGITransport(app=create_app(edge, StaticKeys(keys)))
    sb = await AsyncSandbox.create(image=REF, url="http://t", api_key=keys[0], transport=transport)
    async with asyncio.timeout(budget(5)):  # the start command runs in the background
        while not (lines := [x.data async for x in sb.logs()]):
            await asyncio.sleep(0.01)
    assert lines[:1] == ["up\n"]  # a pulled image's start command
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"authorization": f"Bearer {keys[1]}"}
    ) as other:
        r = await other.get(f"/v1/images/{REF}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"
        r = await other.post("/v1/sandboxes", json={"image": "127.0.0.1:5000/nope:1"})
        assert r.status_code == 404 and "127.0.0.1:5000/nope:1" in r.json()["error"]["message"]
        r = await other.post("/v1/sandboxes", json={"image": "127.0.0.1:5000/Bad"})
        assert r.status_code == 400
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"authorization": f"Bearer {keys[0]}"}
    ) as mine:
        r = await mine.get(f"/v1/images/{REF}")
        assert r.status_code == 200 and r.json()["name"] == REF
        assert (await mine.delete(f"/v1/images/{REF}")).status_code == 204
