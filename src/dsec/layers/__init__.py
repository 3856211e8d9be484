"""dsec layers: the node's content-addressed EROFS store, layer mounts (one per key by
default) and per-sandbox overlay root filesystems.

* :class:`LayerStore` (``store.py``): layers (EROFS files named by sha256) and images (named
  layer lists); builds layers from directories and tarballs; builds built-in images.
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
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import assemble_rootfs, rootfs_path, teardown_rootfs, upper_dir
from dsec.layers.store import LayerStore
from dsec.layers.tarball import extract_tarball

__all__ = [
    "BUILTIN_IMAGES",
    "BuiltinImage",
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
