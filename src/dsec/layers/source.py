"""What the edge needs from a node's layer store: the :class:`LayerSource` protocol.

:class:`~dsec.layers.store.LayerStore` is the node's real store (EROFS files, SQLite, lazy
layers, built-in images); :class:`dsec.testing.MemoryLayers` is the in-memory one the
test edge runs on. Both follow the same ownership rules (docs/design/tenancy.md), and the
same behaviour checks run against both (tests/unit/test_layer_sources.py).

Glossary: a *layer* is a read-only root filesystem piece named by the sha256 of its bytes; an
*image* is a name for an ordered list of layers (bottom first) that belongs to an *owner*
(an API key's owner id, or :data:`~dsec.models.SYSTEM_OWNER` for the system's images).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dsec.models import SYSTEM_OWNER, ImageInfo, LayerInfo, LayerKind

__all__ = ["LayerSource", "LazyLayers", "RegistryLayers"]


@runtime_checkable
class LayerSource(Protocol):
    """Images and layers as the edge uses them. Every lookup is as ``owner`` sees it: its own
    image first, then the system's; a layer by digest only where granted. Raises
    ``ImageNotFound`` / ``LayerNotFound`` (the same for what exists elsewhere and what does
    not exist), ``Conflict`` when a key names a system image, ``InvalidRequest`` for a
    malformed name."""

    scratch: Path
    """A directory of this node for temporary build files."""

    # --- layers
    def get_layer(self, digest: str) -> LayerInfo:
        """A layer's metadata, whoever owns it (the node's own view)."""
        ...

    def list_owned_layers(self, owner: str) -> list[LayerInfo]: ...
    def grant_layers(self, owner: str, digests: list[str]) -> None: ...
    def resolve_layers(self, refs: list[str], owner: str = SYSTEM_OWNER) -> list[LayerInfo]:
        """Image names and digests, expanded to layers bottom first (a repeat kept on top)."""
        ...

    def layer_path(self, digest: str) -> Path:
        """The file a runtime mounts for the layer (may start a lazy loader: can block)."""
        ...

    def is_local(self, digest: str) -> bool: ...
    def cached_fraction(self, digest: str) -> float: ...
    def remote_source(self, digest: str) -> str | None: ...
    def import_layer_file(
        self,
        erofs_file: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> LayerInfo:
        """Adopt a built layer file (moved into the store): snapshots end here."""
        ...

    # --- images
    async def ensure_image(
        self, name: str, owner: str = SYSTEM_OWNER, *, wait_s: float | None = None
    ) -> ImageInfo:
        """The image, building a built-in one on first use (``ImageNotReady`` past
        ``wait_s`` seconds)."""
        ...

    def get_image(self, ref: str, owner: str = SYSTEM_OWNER) -> ImageInfo: ...
    def list_images(self, owner: str | None = None) -> list[ImageInfo]: ...
    def put_image(
        self,
        name: str,
        layers: list[str],
        *,
        meta: dict[str, Any] | None = None,
        owner: str = SYSTEM_OWNER,
    ) -> ImageInfo: ...
    def remove_image(self, name: str, owner: str = SYSTEM_OWNER) -> None: ...
    def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo: ...
    def check_name_free(self, name: str, owner: str) -> None: ...
    def builtin_status(self, name: str) -> tuple[str, str, float] | None:
        """``(status, phase, seconds)`` of a built-in image not stored yet, else None."""
        ...

    def build_image(
        self,
        source: Path,
        name: str,
        kind: LayerKind = "workspace",
        base: str | None = None,
        *,
        owner: str = SYSTEM_OWNER,
        meta: dict[str, Any] | None = None,
    ) -> ImageInfo:
        """``owner``'s image ``name``: ``base``'s layers plus one layer of the directory
        ``source`` (a path of this node; the API's builds unpack their upload first)."""
        ...


@runtime_checkable
class LazyLayers(Protocol):
    """A store whose layers may be read on demand over the network: its loader's counters
    feed the node's metrics."""

    def lazy_stats(self) -> dict[str, Any]: ...


@runtime_checkable
class RegistryLayers(Protocol):
    """A store that can take images from an OCI / Docker v2 registry."""

    def attach(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Make the image at ``ref`` ``owner``'s image ``name`` (default from the ref): a
        dsec artifact's layers are recorded as remote (``lazy``) or downloaded; any other
        image is converted from its tar layers. Blocks on the network."""
        ...
