"""Images and builds: list, pull, push, share, build."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from dsec.builds.records import BuildList, BuildRecord
from dsec.edge.core import EdgeCore, utc_datetime
from dsec.errors import CapabilityNotSupported, DsecError, ImageNotFound, PayloadTooLarge
from dsec.layers.source import RegistryLayers
from dsec.models import (
    SYSTEM_OWNER,
    BuildImageRequest,
    BuildRef,
    DeleteImageRequest,
    ImageInfo,
    ImageList,
    ImageRef,
    KeyScope,
    LayerInfo,
    LayerList,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
    ShareImageRequest,
)

if TYPE_CHECKING:
    from dsec.builds.engine import ImageBuilder
    from dsec.builds.wire import BuildEvent, BuildRequest
    from dsec.contract.edge import EdgeAPI

log = logging.getLogger("dsec.edge")


class ImageVerbs(EdgeCore):
    """Images and builds: list, pull, push, share, build."""

    # ------------------------------------------------------------------ builds
    def image_builder(self) -> ImageBuilder:
        """The node's build engine, made on first use (its cache index opens then)."""
        if self._builder is None:
            from dsec.builds.engine import BuildLimits, ImageBuilder
            from dsec.layers.store import LayerStore

            if not isinstance(self.layers, LayerStore):
                raise CapabilityNotSupported(
                    "this node's layer store cannot build images (it makes no layer files)"
                )
            self._builder = ImageBuilder(
                cast("EdgeAPI", self),  # the composed edge, dsec.edge.agent.EdgeAgent
                self.layers,
                cache_db=self.paths.home / "build-cache.db",
                limits=BuildLimits.from_env(),
                resolve_registry=self.image_by_reference,
            )
        return self._builder

    async def image_by_reference(self, owner: str, ref: str) -> ImageInfo:
        """``owner``'s image of the registry reference ``ref``, pulled if this node has no
        copy (for builds ``FROM`` a registry image: they wait for the pull)."""
        return await self.references.resolve(ref, owner, wait_s=None)

    async def build(
        self, owner: str, req: BuildRequest, context: bytes = b""
    ) -> AsyncGenerator[BuildEvent, None]:
        """Build ``req`` as ``owner``'s image (:class:`dsec.builds.engine.ImageBuilder`):
        refusals raise from the first ``__anext__``, then events until ``done`` or
        ``error``. ``context``: the build context, a tar archive (may be compressed)."""
        builder = self.image_builder()
        recorded = self.build_records.record(owner, builder.build(owner, req, context))
        async with contextlib.aclosing(recorded) as events:
            async for event in events:
                yield event

    async def list_builds(self, req: KeyScope, owner: str) -> BuildList:
        return self.build_records.list(owner)

    async def get_build(self, req: BuildRef, owner: str) -> BuildRecord:
        return self.build_records.get(req.build_id, owner)

    # ------------------------------------------------------------------ images
    def _layer_cache_info(self, layer: LayerInfo) -> LayerInfo:
        """``layer`` with ``remote`` and ``cached_fraction`` filled in (lazy layers)."""
        try:
            frac = self.layers.cached_fraction(layer.digest)
            remote = self.layers.remote_source(layer.digest)
        except DsecError:
            return layer
        return layer.model_copy(update={"remote": remote, "cached_fraction": frac})

    def _image_cache_info(self, image: ImageInfo) -> ImageInfo:
        """``image`` with ``cached_fraction``: the size-weighted share of its layers' bytes
        present on this node (1.0 when every layer is local)."""
        total = present = 0.0
        for digest in image.layers:
            try:
                layer = self._layer_cache_info(self.layers.get_layer(digest))
            except DsecError:
                continue
            total += layer.size
            present += layer.size * (
                layer.cached_fraction if layer.cached_fraction is not None else 1.0
            )
        frac = present / total if total else 1.0
        return image.model_copy(update={"cached_fraction": round(frac, 4)})

    def _pending_builtins(self, owner: str, known: set[str]) -> list[ImageInfo]:
        """Built-in images not stored yet, as ``image ls`` shows them (queued, building with
        the phase, or failed with the reason)."""
        from dsec.layers import builtin

        out = []
        for name in builtin.BUILTIN_IMAGES:
            status = self.layers.builtin_status(name)
            if name in known or status is None:
                continue
            state, phase, seconds = status
            progress = f"{phase} ({seconds:.0f} s)" if state == "building" else phase
            out.append(
                ImageInfo(
                    name=name,
                    layers=[],
                    size=0,
                    created_at=utc_datetime(time.time()),
                    meta={"builtin": name},
                    status=state,
                    progress=progress,
                )
            )
        return out

    async def list_images(self, req: KeyScope, owner: str) -> ImageList:
        """The images ``owner`` can use: its own and the system's (built-in images not built
        yet included, with their build status)."""
        images = [self._image_cache_info(im) for im in self.layers.list_images(owner)]
        known = {im.name for im in images}
        pending = self._pending_builtins(owner, known)
        pulling = [im for im in self.references.pending(owner) if im.name not in known]
        return ImageList(images=sorted([*images, *pending, *pulling], key=lambda im: im.name))

    async def get_image(self, req: ImageRef, owner: str) -> ImageInfo:
        """``owner``'s (or the system's) image ``req.name``; a built-in image not built yet
        as ``image ls`` shows it (queued, building or failed, with no layers): it is usable,
        and is built on first use."""
        name = req.name
        try:
            return self._image_cache_info(self.layers.get_image(name, owner))
        except ImageNotFound:
            pending = [im for im in self._pending_builtins(owner, set()) if im.name == name]
            if pending:
                return pending[0]
            raise

    async def delete_image(self, req: DeleteImageRequest, owner: str) -> None:
        """Forget ``owner``'s image ``req.name`` (its layers stay while anything uses them).
        ``ImageNotFound`` for a name it does not own; ``Conflict`` for a system image."""
        self.layers.remove_image(req.name, owner)

    async def share_image(self, req: ShareImageRequest, owner: str) -> ImageInfo:
        """Let every key use ``owner``'s image ``req.name`` as ``<owner>/<name>`` (or stop)."""
        return self._image_cache_info(self.layers.share_image(req.name, owner, req.shared))

    async def pull_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """Pull ``ref`` (``oci://HOST/REPO:TAG`` or ``[registry/]repo[:tag]``) as ``owner``'s
        image: an image pushed with ``dsec image push`` gets its EROFS layers downloaded;
        any other image is converted from its tar layers. Credentials from
        ``DSEC_REGISTRY_AUTH`` (JSON ``{"host:port": ["user", "password"]}``). Without
        ``name`` the image is named by the reference (``127.0.0.1:5000/debian:12``) and the
        node's copy of that reference is shared with other keys that ask for it
        (:mod:`dsec.edge.references`); with ``name``, it is pulled as that image.
        ``req.lazy``: :meth:`attach_image`."""
        if req.lazy:
            return await self.attach_image(req, owner)
        if req.name is None:
            return await self.references.resolve(req.ref, owner, wait_s=None)
        return await self.attach_image(req, owner)

    async def attach_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """Register a pushed image as ``owner``'s (``req.lazy``: layers stay remote and are
        fetched on first read; other images fall back to a full pull):
        :func:`dsec.layers.publish.attach_image`."""
        layers = self.layers
        if not isinstance(layers, RegistryLayers):
            raise CapabilityNotSupported("this node's layer store cannot pull from registries")
        if req.name is not None and owner != SYSTEM_OWNER:
            layers.check_name_free(req.name, owner)  # before anything is downloaded
        return await asyncio.to_thread(layers.attach, req.ref, req.name, req.lazy, owner)

    async def push_image(self, req: PushImageRequest, owner: str) -> PushImageResult:
        """Publish ``owner``'s image ``req.name`` to ``req.target``
        (``oci://HOST[:PORT]/REPO[:TAG]``) as a dsec artifact (credentials from
        ``DSEC_REGISTRY_AUTH``)."""
        from dsec.layers.publish import push_image

        name, target = req.name, req.target
        await self.layers.ensure_image(name, owner)
        digest = await asyncio.to_thread(push_image, self.layers, name, target, owner)
        return PushImageResult(image=name, target=target, manifest_digest=digest)

    async def list_layers(self, req: KeyScope, owner: str) -> LayerList:
        """The layers ``owner`` may use by digest."""
        owned = self.layers.list_owned_layers(owner)
        return LayerList(layers=[self._layer_cache_info(layer) for layer in owned])

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """Build ``owner``'s image ``req.name`` from an uploaded build ``context`` (a tar
        archive, optionally compressed): its files become one layer on top of ``req.base``.
        The archive is unpacked with the store's safe extraction (no member escapes, devices
        dropped) under the limits of :class:`EdgeLimits` (``PayloadTooLarge`` past them);
        nothing of a failed build is kept. The caller decides the owner (``SYSTEM_OWNER``
        for the operator's system images)."""
        import tempfile

        from dsec.layers.tarball import extract_tarball

        if len(context) > self.limits.max_build_context_bytes:
            raise PayloadTooLarge(
                f"the build context is larger than {self.limits.max_build_context_bytes} bytes",
                limit_bytes=self.limits.max_build_context_bytes,
            )
        self.layers.check_name_free(req.name, owner)  # before any byte is unpacked
        if req.base is not None:
            await self.layers.ensure_image(req.base, owner, wait_s=self.limits.image_wait_s)

        def build() -> ImageInfo:
            with tempfile.TemporaryDirectory(dir=self.paths.scratch, prefix="build-") as tmp:
                archive = Path(tmp) / "context.tar"
                archive.write_bytes(context)
                tree = Path(tmp) / "rootfs"
                extract_tarball(
                    archive,
                    tree,
                    max_bytes=self.limits.max_build_bytes,
                    max_members=self.limits.max_build_entries,
                )
                archive.unlink()
                return self.layers.build_image(
                    tree, req.name, req.kind, req.base, owner=owner, meta={"source": "upload"}
                )

        return await asyncio.to_thread(build)
