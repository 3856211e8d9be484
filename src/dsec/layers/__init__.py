"""dsec layers: the node's content-addressed EROFS store, layer mounts (one per key by
default) and per-sandbox overlay root filesystems.

* :class:`LayerStore` (``store.py``): the node's store, the two parts below composed.
* :class:`ContentStore` (``content.py``): layers (EROFS files named by sha256), built from
  directories and tarballs in build slots, or remote and read on demand.
* :class:`ImageCatalogue` (``catalogue.py``): images (named layer lists) by owner, layer
  grants, built-in images; it builds on the content store, never the other way.
* :class:`LayerMounts` (``mounts.py``): each layer mounted from its file once per API key
  (its own page cache; ``DSEC_LAYER_SHARING=node``: once per node), reference-counted.
* :func:`assemble_rootfs` / :func:`teardown_rootfs` (``rootfs.py``): layers + a tmpfs upper
  of ``disk_mb`` MiB stacked by overlayfs.
* :func:`mkfs_erofs` (``erofs.py``), ``BUILTIN_IMAGES`` (``builtin.py``).

Design notes: ``docs/design/layers.md``.
"""

from dsec.layers.builtin import (
    BUILTIN_IMAGES,
    BuiltinImage,
    build_busybox_rootfs,
    build_debian_rootfs,
)
from dsec.layers.catalogue import ImageCatalogue
from dsec.layers.content import ContentStore
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import assemble_rootfs, rootfs_path, teardown_rootfs, upper_dir
from dsec.layers.store import LayerStore
from dsec.layers.tarball import extract_tarball

__all__ = [
    "BUILTIN_IMAGES",
    "BuiltinImage",
    "ContentStore",
    "ImageCatalogue",
    "LayerMounts",
    "LayerStore",
    "assemble_rootfs",
    "build_busybox_rootfs",
    "build_debian_rootfs",
    "extract_tarball",
    "mkfs_erofs",
    "rootfs_path",
    "teardown_rootfs",
    "upper_dir",
]
