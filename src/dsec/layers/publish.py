"""``dsec image push`` and lazy/full attach of a pushed image: dsec images as OCI artifacts.

Glossary:
    target / ref: ``oci://HOST[:PORT]/REPOSITORY[:TAG]`` (``[@sha256:...]`` for a ref); a
        ref may also be Docker style ``HOST[:PORT]/REPOSITORY[:TAG]``.
    dsec artifact: an OCI image manifest (``application/vnd.oci.image.manifest.v1+json``)
        whose ``artifactType`` is :data:`ARTIFACT_TYPE`, whose config blob
        (:data:`CONFIG_MEDIA_TYPE`) is the image's name and metadata, and whose layers are the
        image's EROFS layer files as they are in the store (:data:`LAYER_MEDIA_TYPE`, bottom
        first), so a layer's blob digest *is* its dsec layer digest.

Layer annotations (all strings, as OCI requires):

==================================  =====================================================
``dev.dsec.layer.kind``             ``base`` / ``workspace`` / ``toolkit``
``dev.dsec.layer.size``             the EROFS file's size in bytes
``org.opencontainers.image.title``  the layer's label (name) in the store, if any
``dev.dsec.layer.provides``         comma-separated labels (see :mod:`.workspace`)
``dev.dsec.layer.requires``         comma-separated labels
``dev.dsec.layer.meta``             the layer's metadata as JSON (omitted above 16 KiB)
==================================  =====================================================

Push: each layer blob is uploaded unless the repository has it (``HEAD`` first), with the
layer's chunk table (:mod:`dsec.layers.chunktable`: per-64 KiB SHA-256 digests, named by the
layer metadata's ``chunk_table`` and listed after the layers as
:data:`CHUNK_TABLE_MEDIA_TYPE` entries so that registries keep them), then the config, then
the manifest under the tag. A lazy attach fetches and checks every named table before it
records anything, and the on-demand loader checks each fetched chunk against it. Attach: the manifest is read; ``lazy=True`` records
each layer as remote (``LayerStore.add_remote_layer``: mounted through the on-demand FUSE
loader), ``lazy=False`` downloads each blob (sha256 checked while streaming) into the store's
scratch and imports it (a failure leaves nothing: the scratch slot is removed). A manifest
that is not a dsec artifact is an ordinary container image: attach falls back to
:func:`dsec.layers.oci.pull_image` (tar layers converted to EROFS).

Example::

    digest = push_image(store, "busybox", "oci://127.0.0.1:5000/dsec/busybox:v1")
    info = attach_image(other_store, "oci://127.0.0.1:5000/dsec/busybox:v1", lazy=False)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, get_args

from dsec.errors import (
    BlobDigestMismatch,
    ImageNotFound,
    InvalidRequest,
    LayerNotFound,
    Unsupported,
)
from dsec.layers.chunktable import MEDIA_TYPE as CHUNK_TABLE_MT
from dsec.layers.chunktable import fetch_chunk_table, publish_chunk_table
from dsec.layers.oci import pull_image
from dsec.layers.registry import MT_OCI_MANIFEST, default_image_name, parse_ref
from dsec.layers.registry_store import RegistryBlobStore, parse_store_url
from dsec.layers.workspace import layer_labels, normalise_labels
from dsec.models import SYSTEM_OWNER, ImageInfo, LayerInfo, LayerKind

__all__ = [
    "ARTIFACT_TYPE",
    "CHUNK_TABLE_MEDIA_TYPE",
    "CONFIG_MEDIA_TYPE",
    "LAYER_MEDIA_TYPE",
    "PublishedLayer",
    "attach_image",
    "build_manifest",
    "parse_dsec_manifest",
    "push_image",
]

log = logging.getLogger(__name__)

ARTIFACT_TYPE = "application/vnd.dsec.image.v1"
LAYER_MEDIA_TYPE = "application/vnd.dsec.layer.v1.erofs"
CONFIG_MEDIA_TYPE = "application/vnd.dsec.image.config.v1+json"

ANN_KIND = "dev.dsec.layer.kind"
ANN_SIZE = "dev.dsec.layer.size"
ANN_TITLE = "org.opencontainers.image.title"
ANN_PROVIDES = "dev.dsec.layer.provides"
ANN_REQUIRES = "dev.dsec.layer.requires"
ANN_META = "dev.dsec.layer.meta"
CHUNK_TABLE_MEDIA_TYPE = CHUNK_TABLE_MT
_MAX_META_JSON = 16 * 1024
_MAX_CONFIG_BYTES = 4 * 1024 * 1024
_TIMEOUT_S = 30.0  # per request (push PUTs of up to 64 MiB)
_LAYER_KINDS: tuple[str, ...] = get_args(LayerKind)
# Layer metadata keys that describe where a blob lives on one node: not published.
_LOCAL_META_KEYS = frozenset({"blob_store", "remote", "attached_from"})


@dataclass(frozen=True)
class PublishedLayer:
    """One layer of a dsec artifact manifest, as :func:`parse_dsec_manifest` reads it."""

    digest: str
    size: int
    kind: LayerKind
    name: str | None
    provides: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def _json_bytes(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def _digest_of(data: bytes) -> str:
    import hashlib

    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def build_config(image: ImageInfo) -> bytes:
    """The config blob of a pushed image: its name, layer digests and metadata (JSON)."""
    return _json_bytes(
        {
            "dsec": 1,
            "name": image.name,
            "layers": list(image.layers),
            "meta": image.meta,
        }
    )


def _layer_descriptor(layer: LayerInfo, chunk_table: str | None = None) -> dict[str, Any]:
    provides, requires = layer_labels(layer)
    annotations = {
        ANN_KIND: layer.kind,
        ANN_SIZE: str(layer.size),
        ANN_PROVIDES: ",".join(provides),
        ANN_REQUIRES: ",".join(requires),
    }
    if layer.name:
        annotations[ANN_TITLE] = layer.name
    meta = {k: v for k, v in (layer.meta or {}).items() if k not in _LOCAL_META_KEYS}
    meta.pop("chunk_table", None)
    if chunk_table is not None:
        meta["chunk_table"] = chunk_table
    meta_json = json.dumps(meta, sort_keys=True, separators=(",", ":"), default=str)
    if len(meta_json) <= _MAX_META_JSON:
        annotations[ANN_META] = meta_json
    return {
        "mediaType": LAYER_MEDIA_TYPE,
        "digest": layer.digest,
        "size": layer.size,
        "annotations": annotations,
    }


def build_manifest(
    image: ImageInfo,
    layers: list[LayerInfo],
    config: bytes,
    chunk_tables: dict[str, tuple[str, int]] | None = None,
) -> bytes:
    """The OCI image manifest (bytes, canonical JSON) of a dsec artifact: ``layers`` are the
    image's layers bottom first, ``config`` the bytes of :func:`build_config`,
    ``chunk_tables`` maps a layer digest to its chunk table's (digest, size): named in the
    layer's metadata and listed after the layers (so that registries keep the blobs)."""
    tables = chunk_tables or {}
    doc = {
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {
            "mediaType": CONFIG_MEDIA_TYPE,
            "digest": _digest_of(config),
            "size": len(config),
        },
        "layers": [
            *(_layer_descriptor(x, tables.get(x.digest, (None, 0))[0]) for x in layers),
            *(
                {"mediaType": CHUNK_TABLE_MEDIA_TYPE, "digest": d, "size": n}
                for d, n in dict.fromkeys(tables[x.digest] for x in layers if x.digest in tables)
            ),
        ],
        "annotations": {"org.opencontainers.image.ref.name": image.name},
    }
    return _json_bytes(doc)


def is_dsec_manifest(doc: dict[str, Any]) -> bool:
    """Whether a manifest is a dsec artifact (by ``artifactType`` or config media type)."""
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    return doc.get("artifactType") == ARTIFACT_TYPE or (
        isinstance(config, dict) and config.get("mediaType") == CONFIG_MEDIA_TYPE
    )


def parse_dsec_manifest(doc: dict[str, Any]) -> list[PublishedLayer]:
    """The layers (bottom first) of a dsec artifact manifest.

    Raises:
        InvalidRequest: not a dsec artifact, no layers, a layer of another media type, a bad
            digest/size/kind/label, or size annotation disagreeing with the descriptor.
    """
    if not is_dsec_manifest(doc):
        raise InvalidRequest(
            "not a dsec image manifest (artifactType is not " + ARTIFACT_TYPE + ")"
        )
    descs = doc.get("layers")
    if not isinstance(descs, list) or not descs:
        raise InvalidRequest("dsec image manifest has no layers")
    out: list[PublishedLayer] = []
    for i, desc in enumerate(descs):
        if isinstance(desc, dict) and desc.get("mediaType") == CHUNK_TABLE_MEDIA_TYPE:
            continue  # named by a layer's metadata
        if not isinstance(desc, dict) or desc.get("mediaType") != LAYER_MEDIA_TYPE:
            raise InvalidRequest(f"dsec manifest layer {i} is not a {LAYER_MEDIA_TYPE}")
        digest = str(desc.get("digest", ""))
        size = desc.get("size")
        if (
            not digest.startswith("sha256:")
            or len(digest) != 71
            or not isinstance(size, int)
            or size <= 0
        ):
            raise InvalidRequest(f"dsec manifest layer {i} has a bad digest or size: {desc!r}")
        ann = desc.get("annotations") or {}
        if not isinstance(ann, dict):
            raise InvalidRequest(f"dsec manifest layer {i}: annotations are not an object")
        kind = ann.get(ANN_KIND, "base")
        if kind not in _LAYER_KINDS:
            raise InvalidRequest(f"dsec manifest layer {i}: unknown kind {kind!r}")
        if ANN_SIZE in ann and str(ann[ANN_SIZE]) != str(size):
            raise InvalidRequest(
                f"dsec manifest layer {i}: size annotation {ann[ANN_SIZE]} != descriptor {size}"
            )
        meta: dict[str, Any] = {}
        raw_meta = ann.get(ANN_META)
        if raw_meta:
            try:
                parsed = json.loads(raw_meta)
            except ValueError as e:
                raise InvalidRequest(f"dsec manifest layer {i}: bad {ANN_META}: {e}") from e
            if isinstance(parsed, dict):
                meta = parsed
        name = ann.get(ANN_TITLE)
        out.append(
            PublishedLayer(
                digest=digest,
                size=size,
                kind=kind,
                name=str(name)[:256] if name else None,
                provides=normalise_labels(ann.get(ANN_PROVIDES, ""), what="provides"),
                requires=normalise_labels(ann.get(ANN_REQUIRES, ""), what="requires"),
                meta=meta,
            )
        )
    return out


# --- push ----------------------------------------------------------------------------------


def push_image(
    store: Any,
    image: str,
    target: str,
    owner: str = SYSTEM_OWNER,
    *,
    auth: tuple[str, str] | None = None,
    blob_store: RegistryBlobStore | None = None,
) -> str:
    """Publish the image ``image`` of ``store`` to ``target`` as a dsec artifact.

    Args:
        store: a :class:`dsec.layers.store.LayerStore` (built-in images are built first).
        image: the image name (or ``sha256:...`` of one layer), as ``owner`` sees it.
        owner: whose image (default: the system's).
        target: ``oci://HOST[:PORT]/REPO[:TAG]`` (tag default: the image's tag, or ``latest``).
        auth: registry credentials (default ``DSEC_REGISTRY_AUTH``).
        blob_store: a store to use instead of opening one (tests pass a mocked transport).

    Returns:
        The manifest digest (``sha256:...``).

    Raises:
        InvalidRequest: bad target or image name; the registry refused the manifest.
        ImageNotFound, LayerNotFound: not in the store (a remote layer is pushed only if
            the target already has its blob). RegistryUnauthorized, RegistryUnavailable.
    """
    loc = parse_store_url(target, allow_tag=True)
    if loc.tag is not None and loc.tag.startswith("sha256:"):
        raise InvalidRequest(f"push target {target!r}: give a tag, not a digest")
    info: ImageInfo = store.ensure_image_sync(image, owner)
    tag = loc.tag or (
        info.name.split(":", 1)[1]
        if ":" in info.name and not info.name.startswith("sha256:")
        else "latest"
    )
    layers: list[LayerInfo] = [store.get_layer(d) for d in info.layers]
    started = time.monotonic()
    uploaded = 0
    owned = blob_store is None
    remote = blob_store or RegistryBlobStore(loc.store_url, auth, timeout_s=_TIMEOUT_S)
    tables: dict[str, tuple[str, int]] = {}
    try:
        for layer in layers:
            if store.is_local(layer.digest):
                path = store.layer_path(layer.digest)
                # the chunk table lets lazy readers check each range they fetch
                tables[layer.digest] = publish_chunk_table(remote, path)
            else:
                table = (layer.meta or {}).get("chunk_table")
                if isinstance(table, str) and remote.has(table):
                    tables[layer.digest] = (table, remote.stat(table))
            if remote.has(layer.digest):
                continue
            path = store.layer_path(layer.digest)  # LayerNotFound for a remote-only layer
            remote.put(path, layer.digest)
            uploaded += layer.size
        config = build_config(info)
        remote.put_bytes(config, _digest_of(config))
        manifest = build_manifest(info, layers, config, tables)
        digest = remote.put_manifest(tag, manifest, MT_OCI_MANIFEST)
    finally:
        if owned:
            remote.close()
    log.info(
        "pushed %s to %s:%s (%s): %d layers, %d bytes uploaded, %.2f s",
        info.name,
        loc.store_url,
        tag,
        digest,
        len(layers),
        uploaded,
        time.monotonic() - started,
    )
    return digest


# --- attach --------------------------------------------------------------------------------


def _parse_attach_ref(ref: str) -> tuple[str, str, str]:
    """``(store_url, reference, docker_ref)`` of an ``oci://`` or Docker-style ref."""
    if ref.startswith("oci://"):
        loc = parse_store_url(ref, allow_tag=True)
        reference = loc.tag or "latest"
        sep = "@" if reference.startswith("sha256:") else ":"
        return loc.store_url, reference, f"{loc.registry}/{loc.repository}{sep}{reference}"
    parsed = parse_ref(ref)
    return f"oci://{parsed.registry}/{parsed.repository}", parsed.reference, str(parsed)


def attach_image(
    store: Any,
    ref: str,
    name: str | None = None,
    lazy: bool = True,
    owner: str = SYSTEM_OWNER,
    *,
    auth: tuple[str, str] | None = None,
    blob_store: RegistryBlobStore | None = None,
) -> ImageInfo:
    """Make a pushed image usable on this node: read its manifest, then record every layer
    as remote (``lazy``) or download it into the store, and register the image.

    Args:
        store: a :class:`dsec.layers.store.LayerStore`.
        ref: ``oci://HOST[:PORT]/REPO[:TAG|@sha256:...]`` or ``HOST[:PORT]/REPO[:TAG]``.
        name: the image name in the store (default from the ref, as ``dsec image pull``).
        lazy: fetch layer data on first read (needs ``LayerStore.add_remote_layer``).
        owner: whose image it becomes (default: the system's).
        auth: registry credentials (default ``DSEC_REGISTRY_AUTH``).
        blob_store: a store to use instead of opening one (tests).

    Returns:
        The image (``meta``: ``source="oci-dsec"``, ``ref``, ``manifest_digest``,
        ``blob_store``, ``lazy``, ``published`` = the metadata it was pushed with).

    Raises:
        ImageNotFound: no such tag/manifest. LayerNotFound: a layer blob is missing.
        BlobDigestMismatch: a blob's bytes do not match its digest (nothing stored).
        InvalidRequest: malformed manifest, or a blob that is not an EROFS image.
        Unsupported: ``lazy`` but this store cannot record remote layers.
        RegistryUnauthorized, RegistryUnavailable.
    """
    store_url, reference, docker_ref = _parse_attach_ref(ref)
    owned = blob_store is None
    remote = blob_store or RegistryBlobStore(store_url, auth, timeout_s=_TIMEOUT_S)
    try:
        doc, _media_type, manifest_digest = remote.session.get_manifest(reference)
        if not is_dsec_manifest(doc):
            log.info("%s is not a dsec artifact: pulling it as a container image", ref)
            return pull_image(
                store,
                docker_ref,
                name=name,
                credentials=remote.session.credentials,
                owner=owner,
            )
        published = parse_dsec_manifest(doc)
        config = _read_config(remote, doc)
        image_name = name or default_image_name(parse_ref(docker_ref))
        if lazy:  # every named chunk table is there and fits its layer, before any is recorded
            for layer in published:
                table = layer.meta.get("chunk_table")
                if table is not None and not _have_local(store, layer.digest):
                    if not isinstance(table, str):
                        raise InvalidRequest(f"layer {layer.digest}: bad chunk_table {table!r}")
                    fetch_chunk_table(remote, table, layer.size)
        started = time.monotonic()
        digests: list[str] = []
        fetched = 0
        for layer in published:
            meta = {
                **layer.meta,
                "provides": layer.provides,
                "requires": layer.requires,
                "blob_store": store_url,
                "attached_from": docker_ref,
            }
            if _have_local(store, layer.digest):
                digests.append(layer.digest)
                continue
            if lazy:
                digests.append(_add_remote(store, layer, store_url, meta))
            else:
                fetched += _fetch_into_store(store, remote, layer, meta)
                digests.append(layer.digest)
        published_meta = config.get("meta")
        if not isinstance(published_meta, dict):
            published_meta = {}
        image_meta: dict[str, Any] = {
            "source": "oci-dsec",
            "ref": docker_ref,
            "manifest_digest": manifest_digest,
            "blob_store": store_url,
            "lazy": lazy,
            "published": published_meta,
        }
        for key in ("config", "start"):  # Env/WorkingDir/...; the start command
            value = published_meta.get(key)
            if isinstance(value, dict):
                image_meta[key] = value
        info: ImageInfo = store.put_image(image_name, digests, meta=image_meta, owner=owner)
    finally:
        if owned:
            remote.close()
    log.info(
        "attached %s as %s (%s): %d layers, %d bytes fetched, %.2f s",
        docker_ref,
        image_name,
        "lazy" if lazy else "full",
        len(digests),
        fetched,
        time.monotonic() - started,
    )
    return info


def _read_config(remote: RegistryBlobStore, doc: dict[str, Any]) -> dict[str, Any]:
    desc = doc.get("config") or {}
    digest = str(desc.get("digest", ""))
    try:
        raw = remote.session.get_blob_bytes(digest, _MAX_CONFIG_BYTES)
    except ImageNotFound as e:
        raise LayerNotFound(f"config blob {digest} missing from {remote.url}") from e
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"dsec image config {digest} is not JSON: {e}") from e
    return config if isinstance(config, dict) else {}


def _have_local(store: Any, digest: str) -> bool:
    """Whether the store already holds the layer's file on this node's disk."""
    try:
        store.get_layer(digest)
    except LayerNotFound:
        return False
    is_local = getattr(store, "is_local", None)
    if is_local is not None:
        return bool(is_local(digest))
    try:
        store.layer_path(digest)
    except LayerNotFound:
        return False
    return True


def _add_remote(store: Any, layer: PublishedLayer, store_url: str, meta: dict[str, Any]) -> str:
    add = getattr(store, "add_remote_layer", None)
    if add is None:
        raise Unsupported(
            "lazy attach needs LayerStore.add_remote_layer (on-demand loading); "
            "attach with lazy=False to download the layers"
        )
    info: LayerInfo = add(
        layer.digest, layer.size, store_url, meta, kind=layer.kind, name=layer.name
    )
    if info.digest != layer.digest:
        raise BlobDigestMismatch(
            f"remote layer recorded as {info.digest}, expected {layer.digest}",
            expected=layer.digest,
            actual=info.digest,
        )
    return info.digest


def _fetch_into_store(
    store: Any, remote: RegistryBlobStore, layer: PublishedLayer, meta: dict[str, Any]
) -> int:
    """Download one layer blob into the store's scratch and import it; returns bytes."""
    with store.build_slot() as build_id:  # scratch/layer-<id> is removed on exit or crash
        work = store.scratch / f"layer-{build_id}"
        work.mkdir(parents=True)
        blob = work / "layer.erofs"
        size = remote.fetch(layer.digest, blob)
        if size != layer.size:
            blob.unlink(missing_ok=True)
            raise BlobDigestMismatch(
                f"layer {layer.digest}: {size} bytes, the manifest says {layer.size}",
                expected_size=layer.size,
                actual_size=size,
            )
        info: LayerInfo = store.import_layer_file(blob, layer.kind, name=layer.name, meta=meta)
    if info.digest != layer.digest:  # impossible after fetch's sha256 check; kept as a guard
        # (the file stays in the content store under the digest it has: content-addressed,
        # it names nothing and nobody refers to it)
        raise BlobDigestMismatch(
            f"imported layer hashes to {info.digest}, expected {layer.digest}",
            expected=layer.digest,
            actual=info.digest,
        )
    return size
