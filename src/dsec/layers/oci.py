"""``dsec image pull REF``: import an image from an OCI / Docker v2 registry as EROFS layers.

Glossary:
    ref: ``[registry/]repository[:tag][@sha256:<hex>]``, Docker style. No registry part means
        Docker Hub (``registry-1.docker.io``, ``library/`` added to one-component names).
    manifest: JSON naming a config blob and the layer blobs, bottom first (OCI
        ``application/vnd.oci.image.manifest.v1+json`` or Docker
        ``application/vnd.docker.distribution.manifest.v2+json``).
    index: a list of manifests, one per platform (OCI image index or Docker manifest list);
        resolved to ``linux/amd64``.
    blob: content-addressed bytes (``sha256:<hex>``): a config or a compressed layer tarball.
    group: consecutive layers merged into one EROFS layer (see ``merge_threshold_bytes``).

How a pull goes:

1. Fetch the manifest (an index is resolved to ``linux/amd64``); every manifest fetched by
   digest is checked against that digest. Then the config blob (checked).
2. Plan groups: consecutive layers whose compressed sizes add up to at most
   ``merge_threshold_bytes`` become one group; a layer at least that large stands alone.
   The plan depends only on the manifest, so every node makes the same EROFS layers.
3. Per group, unless the store already holds a layer built from exactly those blobs: download
   each blob into the store's scratch dir (size and sha256 checked while streaming; a
   mismatch raises :class:`BlobDigestMismatch` and nothing is stored), decompress it (gzip or
   zstd, detected by magic bytes; the uncompressed sha256 is checked against the config's
   ``diff_ids``), extract it with :func:`dsec.layers.tarball.extract_tarball`, convert OCI
   whiteouts to overlay form, and merge it into the group tree with overlay semantics.
4. Build each group tree into an EROFS layer in the content store
   (``ContentStore.build_layer``, kind ``base``) and record the image in the catalogue with
   ``ImageCatalogue.put_image`` (meta: source ref, manifest, config and
   blob digests, the image config's ``Env``/``Entrypoint``/``Cmd``/``WorkingDir``/``User``).

Whiteouts: an OCI ``.wh.<name>`` entry becomes a 0:0 character device ``<name>`` and
``.wh..wh..opq`` in a directory sets ``trusted.overlay.opaque=y`` on it: what overlayfs uses
in its layers, and what ``mkfs.erofs`` keeps (as :mod:`dsec.layers.snapshot` relies on). Both
need root (``CAP_MKNOD``, ``CAP_SYS_ADMIN`` for ``trusted.*``): without it a layer that has a
whiteout raises :class:`~dsec.errors.Unsupported`.

All scratch files of a pull live under ``scratch/layer-<build id>`` in a build slot of the
content store (``ContentStore.build_slot``): they are removed when the pull ends (success or
failure), and by the next open of the store if the process crashed. A half-written layer is never published.

References, manifests, blobs and registry authentication: :mod:`dsec.layers.registry`.

Example::

    store = LayerStore(paths.layers, paths.scratch)
    info = pull_image(store, "127.0.0.1:5000/tools/python:3.12", name="python:3.12")
    info.layers        # EROFS layer digests, bottom first
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from dsec.errors import (
    BlobDigestMismatch,
    DsecError,
    InvalidRequest,
    RegistryUnauthorized,
    RegistryUnavailable,
    SandboxError,
    Unsupported,
)
from dsec.images.reference import is_reference_name
from dsec.layers.catalogue import ImageCatalogue
from dsec.layers.content import ContentStore
from dsec.layers.registry import (
    _CHUNK_BYTES,
    _DIGEST_RE,
    _INDEX_TYPES,
    ImageRef,
    RegistryClient,
    default_image_name,
    parse_ref,
    select_platform,
)
from dsec.layers.tarball import extract_tarball
from dsec.layers.workspace import detect_provides
from dsec.models import SYSTEM_OWNER, ImageInfo, LayerInfo

__all__ = [
    "DEFAULT_MERGE_THRESHOLD_BYTES",
    "BlobDigestMismatch",
    "LayerGroup",
    "RegistryUnauthorized",
    "RegistryUnavailable",
    "apply_oci_whiteouts",
    "merge_layer_tree",
    "plan_groups",
    "pull_image",
    "strip_overlay_markers",
]

log = logging.getLogger(__name__)

DEFAULT_MERGE_THRESHOLD_BYTES = 64 * 1024 * 1024
"""Consecutive layers are merged while their compressed sizes add up to at most this (bytes)."""

_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
_MAX_CONFIG_BYTES = 8 * 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_WH_PREFIX = ".wh."
_WH_OPAQUE = ".wh..wh..opq"
_OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass(frozen=True)
class LayerGroup:
    """Consecutive manifest layers (indexes into the manifest's ``layers``) built into one
    EROFS layer; ``blobs`` are their digests, bottom first."""

    indexes: tuple[int, ...]
    blobs: tuple[str, ...]
    compressed_bytes: int


def plan_groups(layers: list[dict[str, Any]], merge_threshold_bytes: int) -> list[LayerGroup]:
    """Merge consecutive layers while their compressed sizes sum to at most
    ``merge_threshold_bytes``; ``0`` keeps one EROFS layer per OCI layer. Deterministic."""
    groups: list[LayerGroup] = []
    current: list[int] = []
    current_bytes = 0
    for i, desc in enumerate(layers):
        size = int(desc.get("size") or 0)
        if current and current_bytes + size > merge_threshold_bytes:
            groups.append(_group(layers, current, current_bytes))
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        groups.append(_group(layers, current, current_bytes))
    return groups


def _group(layers: list[dict[str, Any]], idx: list[int], size: int) -> LayerGroup:
    return LayerGroup(tuple(idx), tuple(str(layers[i]["digest"]) for i in idx), size)


# --- layer trees -----------------------------------------------------------------------------


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, _OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _set_opaque(path: Path) -> None:
    try:
        os.setxattr(path, _OPAQUE_XATTR, b"y", follow_symlinks=False)
    except PermissionError as e:
        raise Unsupported(
            "an OCI layer has an opaque directory: setting trusted.overlay.opaque needs root"
        ) from e


def _make_whiteout(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    except PermissionError as e:
        raise Unsupported("an OCI layer has a whiteout: making a 0:0 device needs root") from e


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def apply_oci_whiteouts(tree: Path) -> dict[str, int]:
    """Convert OCI whiteouts in an extracted layer to overlay form, in place.

    ``.wh..wh..opq`` is removed and its directory marked ``trusted.overlay.opaque=y``;
    ``.wh.<name>`` is replaced by a 0:0 character device ``<name>`` (unless the same layer
    also has ``<name>``, which then wins). Returns counts ``whiteouts``, ``opaque_dirs``.

    Raises:
        Unsupported: not root (whiteouts need ``CAP_MKNOD``, opaque dirs ``CAP_SYS_ADMIN``).
    """
    counts = {"whiteouts": 0, "opaque_dirs": 0}
    for dirpath, dirnames, filenames in os.walk(tree):
        directory = Path(dirpath)
        for fname in [*filenames, *dirnames]:
            if not fname.startswith(_WH_PREFIX):
                continue
            entry = directory / fname
            dir_mtime = os.lstat(directory).st_mtime_ns
            if fname == _WH_OPAQUE:
                _remove(entry)
                _set_opaque(directory)
                counts["opaque_dirs"] += 1
            else:
                wh_mtime = os.lstat(entry).st_mtime_ns  # the device keeps the entry's time
                _remove(entry)
                victim = directory / fname[len(_WH_PREFIX) :]
                if not os.path.lexists(victim):
                    _make_whiteout(victim)
                    os.utime(victim, ns=(wh_mtime, wh_mtime), follow_symlinks=False)
                    counts["whiteouts"] += 1
            os.utime(directory, ns=(dir_mtime, dir_mtime), follow_symlinks=False)
        dirnames[:] = [d for d in dirnames if not d.startswith(_WH_PREFIX)]
    return counts


def strip_overlay_markers(tree: Path) -> None:
    """Remove whiteouts and opaque marks from a tree that will be an image's bottom layer:
    there is nothing below it to hide, and overlayfs would list a whiteout in a directory
    that no other layer has as a 0:0 character device."""
    for dirpath, dirnames, filenames in os.walk(tree):
        directory = Path(dirpath)
        if _is_opaque(directory):
            os.removexattr(directory, _OPAQUE_XATTR, follow_symlinks=False)
        removed = False
        dir_mtime = os.lstat(directory).st_mtime_ns
        for fname in filenames:
            entry = directory / fname
            if _is_whiteout(os.lstat(entry)):
                os.unlink(entry)
                removed = True
        if removed:
            os.utime(directory, ns=(dir_mtime, dir_mtime), follow_symlinks=False)
        dirnames.sort()


def _zero_implicit_dir_times(tree: Path, extract_started_ns: int) -> None:
    """Set mtime 0 on directories the tar did not describe (the root, usually, and parents
    missing from the archive): they got the extraction time, which would make the layer's
    digest differ from node to node. Recognised by an mtime no older than 1 s before the
    extraction started (the kernel's file-time clock is coarse)."""
    cutoff = extract_started_ns - 1_000_000_000
    for dirpath, _dirnames, _filenames in os.walk(tree):
        if os.lstat(dirpath).st_mtime_ns >= cutoff:
            os.utime(dirpath, ns=(0, 0), follow_symlinks=False)


def _copy_dir_meta(src: Path, dst: Path) -> None:
    """Give ``dst`` the owner, mode, mtime and xattrs of ``src`` (an opaque mark on ``dst``
    is kept: it hides layers below the group and stays true)."""
    st = os.lstat(src)
    if os.geteuid() == 0:
        os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    with contextlib.suppress(OSError):
        for attr in os.listxattr(src, follow_symlinks=False):
            os.setxattr(dst, attr, os.getxattr(src, attr, follow_symlinks=False))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def merge_layer_tree(upper: Path, group: Path) -> None:
    """Merge the converted layer tree ``upper`` into ``group`` (the layers below it in the
    same group), moving entries, so that ``group`` alone shows what overlay(upper over group)
    would. Entries of ``upper`` are consumed.

    Rules, per entry of ``upper`` at path P:
    * whiteout: whatever ``group`` has at P is removed and the whiteout kept (it still hides
      P in the layers below the group);
    * opaque directory: replaces P entirely (keeps its opaque mark);
    * directory over a directory: merged recursively, then takes the upper's metadata;
    * directory over a whiteout or non-directory: replaces it and is marked opaque (in the
      overlay the group's entry stopped the lookup, so nothing below may show through);
    * anything else: replaces P.
    """
    for entry in list(os.scandir(upper)):
        src = Path(entry.path)
        dst = group / entry.name
        src_st = os.lstat(src)
        try:
            dst_st: os.stat_result | None = os.lstat(dst)
        except FileNotFoundError:
            dst_st = None
        if stat.S_ISDIR(src_st.st_mode) and not _is_opaque(src):
            if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
                merge_layer_tree(src, dst)
                _copy_dir_meta(src, dst)
                continue
            if dst_st is not None:
                _remove(dst)
                os.rename(src, dst)
                _set_opaque(dst)
                continue
        elif dst_st is not None:
            _remove(dst)
        os.rename(src, dst)


# --- decompression -------------------------------------------------------------------------


def _open_decompressed(blob: Path, raw: IO[bytes]) -> IO[bytes]:
    """A reader of the uncompressed tar stream of a layer blob (gzip, zstd or plain tar,
    detected from the first bytes)."""
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(_GZIP_MAGIC):
        gz: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
        return gz
    if head == _ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError as e:
            raise Unsupported(
                f"layer {blob.name} is zstd-compressed: install the python 'zstandard' package"
            ) from e
        reader: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return reader
    return raw


def _decompress_layer(blob: Path, tar_out: Path, diff_id: str | None, blob_digest: str) -> None:
    """Decompress ``blob`` into ``tar_out``, checking the uncompressed sha256 against
    ``diff_id`` when the config gives one.

    Raises:
        InvalidRequest: corrupt compressed data. BlobDigestMismatch: wrong ``diff_id``.
    """
    hasher = hashlib.sha256()
    with open(blob, "rb") as raw, _open_decompressed(blob, raw) as src, open(tar_out, "wb") as out:
        while True:
            try:
                chunk = src.read(_CHUNK_BYTES)
            except (OSError, EOFError, zlib.error) as e:
                raise InvalidRequest(
                    f"layer {blob_digest}: corrupt compressed data: {e}", digest=blob_digest
                ) from e
            except Exception as e:  # zstandard.ZstdError does not subclass OSError
                if type(e).__module__.startswith("zstandard"):
                    raise InvalidRequest(
                        f"layer {blob_digest}: corrupt zstd data: {e}", digest=blob_digest
                    ) from e
                raise
            if not chunk:
                break
            hasher.update(chunk)
            out.write(chunk)  # a full disk raises OSError here: pull_image maps it
    actual = f"sha256:{hasher.hexdigest()}"
    if diff_id is not None and actual != diff_id:
        raise BlobDigestMismatch(
            f"layer {blob_digest}: uncompressed content hashes to {actual}, "
            f"the config's diff_id is {diff_id}",
            expected=diff_id,
            actual=actual,
        )


# --- the pull --------------------------------------------------------------------------------


def _find_built_group(content: ContentStore, blobs: tuple[str, ...], *, bottom: bool) -> str | None:
    """The digest of a stored layer built from exactly these OCI blobs (at the same
    position: bottom or not), if any."""
    for layer in content.list_layers():
        meta = layer.meta
        if (
            meta.get("source") == "oci"
            and meta.get("oci_blobs") == list(blobs)
            and meta.get("bottom") == bottom
        ):
            return layer.digest
    return None


def _resolve_manifest(
    client: RegistryClient, ref: ImageRef
) -> tuple[dict[str, Any], str, str | None]:
    """The image manifest for linux/amd64, its digest and the index digest (if any)."""
    doc, media_type, digest = client.get_manifest(ref.reference)
    index_digest = None
    if media_type in _INDEX_TYPES:
        index_digest = digest
        doc, media_type, digest = client.get_manifest(select_platform(doc))
        if media_type in _INDEX_TYPES:
            raise InvalidRequest(f"{ref}: an index entry points to another index")
    layers = doc.get("layers")
    config = doc.get("config")
    if not isinstance(layers, list) or not layers or not isinstance(config, dict):
        raise InvalidRequest(f"{ref}: manifest {digest} has no config or no layers")
    for desc in [config, *layers]:
        if (
            not isinstance(desc, dict)
            or not _DIGEST_RE.match(str(desc.get("digest", "")))
            or not isinstance(desc.get("size", 0), int)
            or desc.get("size", 0) < 0
        ):
            raise InvalidRequest(f"{ref}: manifest {digest} has a bad descriptor {desc!r}")
    return doc, digest, index_digest


def pull_image(
    store: ImageCatalogue,
    ref: str,
    *,
    name: str | None = None,
    credentials: tuple[str, str] | None = None,
    insecure_http: bool | None = None,
    merge_threshold_bytes: int = DEFAULT_MERGE_THRESHOLD_BYTES,
    timeout_s: float = 30.0,
    retries: int = 2,
    transport: httpx.BaseTransport | None = None,
    owner: str = SYSTEM_OWNER,
) -> ImageInfo:
    """Pull ``ref`` from its registry into ``store`` as EROFS layers and record the image
    as ``owner``'s (default: a system image).

    Args:
        store: the node's image catalogue (a :class:`dsec.layers.store.LayerStore`): the
            layers go to its content store (scratch files under ``content.scratch``), the
            image to the catalogue.
        ref: ``[registry/]repo[:tag][@sha256:...]``.
        name: the image name in the store (default :func:`default_image_name`).
        credentials: ``(user, password)`` for Basic auth or the token service.
        insecure_http: see :class:`RegistryClient` (default: plain HTTP only on loopback).
        merge_threshold_bytes: merge consecutive layers up to this many compressed bytes
            (0: one EROFS layer per OCI layer).
        timeout_s, retries, transport: see :class:`RegistryClient`.

    Returns:
        The stored image (layers bottom first; ``meta`` has ``source="oci"``, ``ref``,
        ``manifest_digest``, ``index_digest``, ``config_digest``, ``blobs``, ``config``).

    Raises:
        InvalidRequest: bad ref or name, malformed manifest, corrupt tar or compression.
        ImageNotFound: no such repository/tag/digest, or no linux/amd64 manifest.
        RegistryUnauthorized: access refused. RegistryUnavailable: network or server failure,
        truncated download. BlobDigestMismatch: corrupted content.
        Unsupported: whiteouts without root, zstd without ``zstandard``, schema 1.
        SandboxError: mkfs.erofs failed.
    """
    parsed = parse_ref(ref)
    image_name = name or default_image_name(parsed)
    if not (_IMAGE_NAME_RE.match(image_name) or is_reference_name(image_name)):
        raise InvalidRequest(f"invalid image name {image_name!r}", name=image_name)
    if merge_threshold_bytes < 0:
        raise InvalidRequest("merge_threshold_bytes must be >= 0")
    content = store.content
    started = time.monotonic()
    with RegistryClient(
        parsed,
        credentials=credentials,
        insecure_http=insecure_http,
        timeout_s=timeout_s,
        retries=retries,
        transport=transport,
    ) as client:
        manifest, manifest_digest, index_digest = _resolve_manifest(client, parsed)
        config_digest = str(manifest["config"]["digest"])
        try:
            config = json.loads(client.get_blob_bytes(config_digest, _MAX_CONFIG_BYTES))
        except ValueError as e:
            raise InvalidRequest(f"{parsed}: config {config_digest} is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise InvalidRequest(f"{parsed}: config {config_digest} is not a JSON object")
        layers: list[dict[str, Any]] = manifest["layers"]
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if diff_ids and len(diff_ids) != len(layers):
            raise InvalidRequest(
                f"{parsed}: config lists {len(diff_ids)} diff_ids for {len(layers)} layers"
            )
        digests: list[str] = []
        fetched = 0
        for group in plan_groups(layers, merge_threshold_bytes):
            bottom = group.indexes[0] == 0
            built = _find_built_group(content, group.blobs, bottom=bottom)
            if built is not None:
                digests.append(built)
                continue
            try:
                layer = _build_group(
                    content, client, parsed, layers, diff_ids, group, bottom=bottom
                )
            except DsecError:
                raise
            except OSError as e:  # a full disk, a permission problem in the scratch dir
                log.error("pull of %s failed writing under %s: %s", parsed, content.scratch, e)
                raise SandboxError(
                    f"pull of {parsed} failed writing to the node's disk: {e.strerror}",
                    errno=e.errno,
                ) from e
            digests.append(layer.digest)
            fetched += group.compressed_bytes
    image_config = config.get("config") or {}
    meta: dict[str, Any] = {
        "source": "oci",
        "ref": str(parsed),
        "manifest_digest": manifest_digest,
        "index_digest": index_digest,
        "config_digest": config_digest,
        "blobs": [str(d["digest"]) for d in layers],
        "platform": "linux/amd64",
        "merge_threshold_bytes": merge_threshold_bytes,
        "config": {
            k: image_config[k]
            for k in ("Env", "Entrypoint", "Cmd", "WorkingDir", "User")
            if image_config.get(k) is not None
        },
    }
    info = store.put_image(image_name, digests, meta=meta, owner=owner)
    log.info(
        "pulled %s as %s: %d OCI layers -> %d EROFS layers, %d bytes fetched, %.2f s",
        parsed,
        image_name,
        len(layers),
        len(digests),
        fetched,
        time.monotonic() - started,
    )
    return info


def _build_group(
    content: ContentStore,
    client: RegistryClient,
    ref: ImageRef,
    layers: list[dict[str, Any]],
    diff_ids: list[str],
    group: LayerGroup,
    *,
    bottom: bool,
) -> LayerInfo:
    """Download, convert and merge one group's layers, then build its EROFS layer."""
    # The store's build slot: scratch/layer-<id> is removed on exit and after a crash.
    with content.build_slot() as build_id:
        work = content.scratch / f"layer-{build_id}"
        tree = work / "tree"
        tree.mkdir(parents=True)
        counts = {"whiteouts": 0, "opaque_dirs": 0}
        for i in group.indexes:
            desc = layers[i]
            digest = str(desc["digest"])
            blob = work / "blob"
            tar = work / "layer.tar"
            client.download_blob(digest, int(desc["size"]) if "size" in desc else None, blob)
            _decompress_layer(blob, tar, str(diff_ids[i]) if diff_ids else None, digest)
            blob.unlink()
            layer_tree = work / f"l{i}"
            extract_started_ns = time.time_ns()
            extract_tarball(tar, layer_tree)
            tar.unlink()
            _zero_implicit_dir_times(layer_tree, extract_started_ns)
            for key, n in apply_oci_whiteouts(layer_tree).items():
                counts[key] += n
            if i == group.indexes[0]:
                os.rmdir(tree)
                os.rename(layer_tree, tree)
            else:
                merge_layer_tree(layer_tree, tree)
                shutil.rmtree(layer_tree)
        if bottom:
            strip_overlay_markers(tree)
        meta = {
            "source": "oci",
            "ref": str(ref),
            "bottom": bottom,
            "oci_blobs": list(group.blobs),
            "diff_ids": [diff_ids[i] for i in group.indexes] if diff_ids else [],
            "compressed_bytes": group.compressed_bytes,
            # what the files show (glibc, debian-12, apt, ...): lets toolkit layers stack
            # on images that carry no labels of their own
            "provides": detect_provides(tree),
            **counts,
        }
        return content.build_layer(
            tree, "base", name=f"{ref.repository}@{group.blobs[-1][7:19]}", meta=meta
        )
