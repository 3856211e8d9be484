"""The node's layer store: its content store and its image catalogue, composed.

Two parts with a one-way dependency (containerd keeps its content store and its metadata
store apart the same way):

* :class:`~dsec.layers.content.ContentStore` (``content.py``), the *content store*: layer
  files named by the sha256 of their bytes (``blobs/``), their metadata (kind, name, size),
  build slots (``tmp/``, ``scratch/layer-<id>``), crash repair, and remote layers read on
  demand through the lazy FUSE server. It knows no image names and no owners.
* :class:`~dsec.layers.catalogue.ImageCatalogue` (``catalogue.py``), the *image
  catalogue*: image names as ordered lists of digests, their owners and sharing, the grants
  that let an owner name a layer by digest, and the built-in images (built into the content
  store on first use). It calls the content store; the content store never calls it.

:class:`LayerStore` is the catalogue with its content store's verbs as well, so that the
node, the edge, builds, runtimes and the CLI keep one object: each content verb below hands
the call to :attr:`LayerStore.content`. Taking an image from a registry (:meth:`attach`,
:mod:`dsec.layers.publish` and :mod:`dsec.layers.oci`) uses both parts, so it sits above
them, here. Ownership rules, glossary and layout on disk: the two modules' docstrings and
``docs/design/layers.md``.

Example::

    store = LayerStore(paths.layers, paths.scratch)
    info = store.build_layer(Path("./app"), "workspace", name="app")       # content
    store.put_image("app", [*store.get_image("busybox").layers, info.digest])  # catalogue
    layers = store.resolve_layers(["app", "sha256:..."])   # bottom first
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from dsec.layers.catalogue import SYSTEM, ImageCatalogue
from dsec.layers.content import DIGEST_RE, ContentStore, parse_digest
from dsec.layers.lazy import LazyServer
from dsec.layers.tarball import extract_tarball
from dsec.models import ImageInfo

__all__ = ["DIGEST_RE", "SYSTEM", "LayerStore", "extract_tarball", "parse_digest"]
# DIGEST_RE and parse_digest live in dsec.layers.content, SYSTEM in dsec.layers.catalogue,
# extract_tarball in dsec.layers.tarball; they stay importable from here


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _content_verb(
    verb: Callable[Concatenate[ContentStore, _P], _R],
) -> Callable[Concatenate[LayerStore, _P], _R]:
    """A method of :class:`LayerStore` that calls ``verb`` on its content store (same
    signature and docstring, so type checkers and ``help()`` see the content store's)."""

    @functools.wraps(verb)
    def call(self: LayerStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return verb(self.content, *args, **kwargs)

    return call


class LayerStore(ImageCatalogue):
    """The node's images and layers: an :class:`ImageCatalogue` over its own
    :class:`ContentStore` (:attr:`content`), which it opens and closes.

    Args:
        root: the store directory (``$DSEC_HOME/layers``); created if missing.
        scratch: where tarballs are extracted and built-in rootfs are assembled
            (``$DSEC_HOME/images``); created if missing.
        lazy_chunk_size, lazy_cache_bytes: the lazy FUSE server's chunk size and chunk cache
            bound, bytes (default ``DSEC_LAZY_CHUNK_SIZE`` / ``DSEC_LAZY_CACHE_BYTES``).
    """

    def __init__(
        self,
        root: Path,
        scratch: Path,
        *,
        lazy_chunk_size: int | None = None,
        lazy_cache_bytes: int | None = None,
    ) -> None:
        content = ContentStore(
            root, scratch, lazy_chunk_size=lazy_chunk_size, lazy_cache_bytes=lazy_cache_bytes
        )
        try:
            super().__init__(content)
        except BaseException:
            content.close()
            raise
        self.root = content.root
        self.scratch = content.scratch

    def close(self) -> None:
        """Close the catalogue, then the content store (which stops the lazy FUSE server).
        The store is unusable afterwards. Unmount EROFS mounts of remote layers first."""
        super().close()
        self.content.close()

    def attach(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Take the image at ``ref`` from its registry as ``owner``'s image:
        :func:`dsec.layers.publish.attach_image`."""
        from dsec.layers.publish import attach_image  # the registry client, on first use

        return attach_image(self, ref, name, lazy, owner)

    # --- the content store's verbs, handed on to it ------------------------------------

    build_slot = _content_verb(ContentStore.build_slot)
    build_layer = _content_verb(ContentStore.build_layer)
    import_layer_file = _content_verb(ContentStore.import_layer_file)
    adopt_cached_layer = _content_verb(ContentStore.adopt_cached_layer)
    layer_path = _content_verb(ContentStore.layer_path)
    get_layer = _content_verb(ContentStore.get_layer)
    has_layer = _content_verb(ContentStore.has_layer)
    list_layers = _content_verb(ContentStore.list_layers)
    add_remote_layer = _content_verb(ContentStore.add_remote_layer)
    remote_source = _content_verb(ContentStore.remote_source)
    is_local = _content_verb(ContentStore.is_local)
    fetch_layer = _content_verb(ContentStore.fetch_layer)
    cached_fraction = _content_verb(ContentStore.cached_fraction)
    prestart_lazy = _content_verb(ContentStore.prestart_lazy)
    lazy_stats = _content_verb(ContentStore.lazy_stats)

    @property
    def lazy(self) -> LazyServer:
        """:attr:`ContentStore.lazy`."""
        return self.content.lazy
