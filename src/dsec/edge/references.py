"""Images by registry reference on one node: ``create(image="127.0.0.1:5000/debian:12")``.

When a creation (or a build's ``FROM``, or an E2B template) names an image the key does not
have and the name is a registry reference, :class:`ImageReferences` makes it one:

1. **Which registry.** A qualified reference (``host[:port]/...``, ``oci://``, a
   ``@sha256:`` digest) is pulled from where it says. An unqualified one (``python:3.12``,
   ``e2b/desktop``) comes from Docker Hub, or from ``DSEC_SHORT_NAME_REGISTRY`` (a mirror:
   ``127.0.0.1:5000`` serves ``library/python:3.12`` for ``python:3.12``; ``none``: short
   names are never pulled, an unknown one is simply not found).
2. **Once per node.** The node keeps one copy of each reference, owned by
   :data:`REGISTRY_OWNER` (no key): however many creations ask at the same moment, one pull
   runs (single flight, in a worker thread) and the others wait for it. A dsec artifact
   (``dsec image push``) is attached lazily: its layers are read on demand by range
   requests; any other image is converted layer by layer to EROFS.
3. **The key's image.** The key then gets its own image named by the reference's familiar
   form (``python:3.12``, ``127.0.0.1:5000/debian:12``; ``meta["reference"]``), pointing at
   the same layers: it is listed, deleted and shared like the key's other images, another
   key sees it only once it asked for the same reference itself. A local name the key has
   wins over a reference of the same spelling; an explicitly qualified reference only ever
   resolves to an image pulled from that reference.

While a pull runs, ``image ls`` shows it as ``pulling`` (how long, from where) to the keys
waiting for it; a creation waits at most ``wait_s`` and then answers ``ImageNotReady``
(503, retryable; the SDK retries). Failures: an unknown repository or tag is
``ImageNotFound`` naming the reference; a registry that is down is ``RegistryUnavailable``
(retryable) and nothing is stored; for an unqualified name the node could not look up,
``ImageNotFound`` (with the registry's error in ``details``), since it is most often a
local name mistyped. Credentials: ``DSEC_REGISTRY_AUTH``, as for ``dsec image pull``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any

from dsec.errors import DsecError, ImageNotFound, ImageNotReady, RegistryUnavailable
from dsec.images.reference import (
    DOCKER_HUB,
    ImageRef,
    familiar_name,
    is_qualified,
    parse_ref,
)
from dsec.layers.source import LayerSource, RegistryLayers
from dsec.models import ImageInfo

__all__ = ["REGISTRY_OWNER", "ImageReferences", "short_name_registry_from_env"]

log = logging.getLogger(__name__)

REGISTRY_OWNER = "registry"
"""The owner of the node's copies of images pulled by reference (no key is this owner)."""


def short_name_registry_from_env() -> str | None:
    """``DSEC_SHORT_NAME_REGISTRY``: where unqualified references are pulled from
    (default Docker Hub; ``none`` or empty: nowhere)."""
    raw = os.environ.get("DSEC_SHORT_NAME_REGISTRY", "docker.io").strip()
    if raw.lower() in ("", "none", "off"):
        return None
    return DOCKER_HUB if raw in ("docker.io", "index.docker.io", DOCKER_HUB) else raw


@dataclasses.dataclass
class _Pull:
    source: str
    started: float
    future: asyncio.Future[ImageInfo]
    waiting: set[str] = dataclasses.field(default_factory=set)


class ImageReferences:
    """See the module docstring.

    Args:
        layers: the node's layer store (it must be :class:`RegistryLayers` to pull).
        short_names: the registry of unqualified references (None: never pull them).
    """

    def __init__(self, layers: LayerSource, *, short_names: str | None = DOCKER_HUB) -> None:
        self.layers = layers
        self.short_names = short_names
        self._pulls: dict[str, _Pull] = {}
        self.pulls_started = 0
        """Pulls this node ran (a test and ``stats()`` read it)."""

    def wanted(self, text: str) -> tuple[str, ImageRef] | None:
        """``(familiar name, where to pull it from)`` if ``text`` is a reference this node
        would pull, else None (a short name with short names off). ``InvalidRequest`` for
        a malformed qualified reference."""
        if text.startswith("sha256:"):
            return None
        qualified = is_qualified(text)
        if not qualified and self.short_names is None:
            return None
        try:
            asked = parse_ref(text)
        except DsecError:
            if qualified:
                raise
            return None
        source = asked
        if not qualified and self.short_names != DOCKER_HUB:
            assert self.short_names is not None
            source = dataclasses.replace(asked, registry=self.short_names)
        return familiar_name(asked), source

    async def resolve(self, text: str, owner: str, *, wait_s: float | None) -> ImageInfo:
        """The key's image for the reference ``text``, pulling it first if the node has
        no copy (see the module docstring). Raises ``ImageNotFound`` if ``text`` is not
        a reference this node pulls."""
        wanted = self.wanted(text)
        if wanted is None:
            raise ImageNotFound(f"no image {text!r}", image=text)
        name, source = wanted
        qualified = is_qualified(text)
        try:
            mine = self.layers.get_image(name, owner)
            if not qualified or mine.meta.get("reference") == name:
                return mine
        except ImageNotFound:
            pass
        try:
            copy = self.layers.get_image(name, REGISTRY_OWNER)
            if copy.meta.get("reference") != name:
                raise ImageNotFound(f"no copy of {name}", image=name)
        except ImageNotFound:
            copy = await self._pull(name, source, owner, text, wait_s)
        meta = {**copy.meta, "reference": name}
        return self.layers.put_image(name, list(copy.layers), meta=meta, owner=owner)

    async def _pull(
        self, name: str, source: ImageRef, owner: str, text: str, wait_s: float | None
    ) -> ImageInfo:
        pull = self._pulls.get(name)
        if pull is None:
            layers = self.layers
            if not isinstance(layers, RegistryLayers):
                raise ImageNotFound(
                    f"no image {text!r} (this node does not pull from registries)", image=text
                )
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(None, self._pull_sync, layers, name, str(source))
            pull = _Pull(str(source), time.monotonic(), asyncio.ensure_future(future))
            self._pulls[name] = pull
            self.pulls_started += 1
            pull.future.add_done_callback(lambda _f: self._pulls.pop(name, None))
            pull.future.add_done_callback(_retrieve)
            log.info("pulling %s for %s from %s", name, owner, source)
        pull.waiting.add(owner)
        try:
            return await asyncio.wait_for(asyncio.shield(pull.future), wait_s)
        except TimeoutError:
            elapsed = time.monotonic() - pull.started
            raise ImageNotReady(
                f"image {name} is being pulled from {source.registry} ({elapsed:.0f} s so "
                "far); retry in a few seconds",
                image=name,
                phase="pulling",
                elapsed_s=round(elapsed, 1),
                retry_after_s=5,
            ) from None
        except RegistryUnavailable as e:
            if is_qualified(text):
                raise
            raise ImageNotFound(
                f"no image {text!r} here, and {source.registry} could not be asked for it "
                f"({e.message})",
                image=text,
                pull_error=e.message,
            ) from None
        except ImageNotFound as e:
            raise ImageNotFound(
                f"image {text!r} not found: not on this node, and {source.registry} has no "
                f"{source.repository}:{source.reference} ({e.message})",
                image=text,
                reference=str(source),
            ) from None
        finally:
            pull.waiting.discard(owner)

    @staticmethod
    def _pull_sync(layers: RegistryLayers, name: str, source: str) -> ImageInfo:
        image = layers.attach(source, name, True, REGISTRY_OWNER)
        if image.meta.get("reference") != name:  # mark the node's copy as that reference's
            assert isinstance(layers, LayerSource)
            meta: dict[str, Any] = {**image.meta, "reference": name}
            image = layers.put_image(name, list(image.layers), meta=meta, owner=REGISTRY_OWNER)
        return image

    def pending(self, owner: str) -> list[ImageInfo]:
        """The pulls ``owner`` is waiting for, as not-ready images (``status="pulling"``)."""
        from datetime import UTC, datetime

        out = []
        for name, pull in list(self._pulls.items()):
            if owner not in pull.waiting:
                continue
            elapsed = time.monotonic() - pull.started
            out.append(
                ImageInfo(
                    name=name,
                    layers=[],
                    size=0,
                    created_at=datetime.now(UTC),
                    owner=owner,
                    status="pulling",
                    progress=f"pulling from {pull.source} ({elapsed:.0f} s)",
                    meta={"reference": name},
                )
            )
        return out


def _retrieve(future: asyncio.Future[ImageInfo]) -> None:
    if not future.cancelled():
        future.exception()
