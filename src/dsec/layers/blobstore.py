"""Content-addressed blob stores: where layer files live when they are not on this node.

A *blob* is the bytes of one layer (an EROFS image file), named by its digest
``sha256:<64 hex>``. A :class:`BlobStore` answers five questions about blobs: how big is one
(:meth:`~BlobStore.stat`), give me a byte range of it (:meth:`~BlobStore.read_range`, what the
lazy FUSE server calls for each chunk), give me all of it, verified (:meth:`~BlobStore.fetch`,
the "full pull"), store one (:meth:`~BlobStore.put`) and do you have it (:meth:`~BlobStore.has`).
Implementations are synchronous and thread-safe: FUSE worker threads call them directly.

Backends, registered by URL scheme (:func:`register_blob_store`; other packages add theirs
under the ``dsec.blob_stores`` entry-point group) and opened by :func:`open_blob_store`:

    dir:///abs/path          LocalDirStore: a local directory (the embedded default)
    fs:///mnt/shared/dsec    SharedFsStore: the same layout on a mounted shared filesystem
                             (3FS, CephFS, NFS); safe for many writers (temp + fsync + rename)
    http://host:port/prefix  HttpBlobStore: any HTTP server serving ``<prefix>/sha256/<hex>``
                             with Range support (e.g. :mod:`dsec.layers.blobserver`)
    oci://host:port/repo     RegistryBlobStore (dsec.layers.registry_store, imported lazily):
                             layers as OCI artifacts, read with HTTP range requests

On-disk layout of ``dir://`` and ``fs://`` stores::

    <root>/sha256/<hex>        the blob, mode 0444, never modified once renamed into place
    <root>/tmp/<random>.part   an upload or download in progress

Errors (from :mod:`dsec.errors`): ``LayerNotFound`` (no such blob), ``RegistryUnavailable``
(the store cannot be reached, broke a connection or sent fewer bytes than asked, after
bounded retries), ``BlobDigestMismatch`` (bytes do not hash to the digest: nothing is stored),
``InvalidRequest`` (malformed digest or URL).

Example::

    store = open_blob_store("dir:///srv/blobs")
    store.put(Path("layer.erofs"), digest)
    head = store.read_range(digest, 0, 4096)
    store.fetch(digest, Path("/tmp/copy.erofs"))
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

import httpx

from dsec.errors import (
    BlobDigestMismatch,
    InvalidRequest,
    LayerNotFound,
    RegistryUnauthorized,
    RegistryUnavailable,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BlobStore",
    "BlobStoreFactory",
    "HttpBlobStore",
    "LocalDirStore",
    "SharedFsStore",
    "blob_store_schemes",
    "open_blob_store",
    "register_blob_store",
]

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_COPY_BUFFER = 1 << 20  # bytes per read while streaming a blob
_RETRY_DELAYS = (0.2, 0.8, 2.0)  # seconds between the tries of a transient failure
_T = TypeVar("_T")


def _hex_of(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidRequest(f"invalid blob digest {digest!r}: expected sha256:<64 hex>")
    return m.group(1)


@runtime_checkable
class BlobStore(Protocol):
    """Content-addressed blobs (``"sha256:<hex>"``). Thread-safe, synchronous (FUSE threads
    call it).

    Attributes:
        url: canonical locator: ``"dir:///abs/path"``, ``"fs:///mnt/shared/dsec"``,
            ``"http://127.0.0.1:8080/blobs"``, ``"oci://127.0.0.1:5000/dsec/layers"``.
    """

    url: str

    def stat(self, digest: str) -> int:
        """Size of the blob in bytes. Raises LayerNotFound if absent."""
        ...

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """Exactly ``min(length, size - offset)`` bytes from ``offset`` or raises. Transient
        failures are retried (about 3 tries with backoff, <= ~10 s in all), then
        RegistryUnavailable."""
        ...

    def fetch(self, digest: str, dest: Path) -> int:
        """The whole blob to ``dest`` atomically (temp file + rename), sha256 verified while
        streaming; BlobDigestMismatch on mismatch (``dest`` never created). Returns bytes
        written."""
        ...

    def put(self, path: Path, digest: str) -> None:
        """Upload ``path`` under ``digest`` (verified first). Idempotent: a no-op if present."""
        ...

    def has(self, digest: str) -> bool:
        """True if the store holds the blob."""
        ...


def _with_retries(what: str, attempt: Callable[[], _T]) -> _T:
    """Run ``attempt``; retry OSError/httpx transport errors with backoff; then raise
    RegistryUnavailable. Typed dsec errors other than RegistryUnavailable pass through."""
    last: BaseException | None = None
    for delay in (*_RETRY_DELAYS, None):
        try:
            return attempt()
        except (LayerNotFound, BlobDigestMismatch, InvalidRequest, RegistryUnauthorized):
            raise
        except (OSError, httpx.TransportError, RegistryUnavailable) as e:
            last = e
            log.debug("%s failed (%s); %s", what, e, "retrying" if delay else "giving up")
            if delay is not None:
                time.sleep(delay)
    raise RegistryUnavailable(f"{what}: {last}", error=str(last))


def _fetch_stream_atomic(
    digest: str, dest: Path, chunks: Callable[[], Iterator[bytes]], expected_size: int | None
) -> int:
    """Write an iterator of byte chunks to ``dest`` through a temp file in the same
    directory, verifying sha256 (and size) before the rename. Returns bytes written."""
    hex_ = _hex_of(digest)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.part"
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out:
            for piece in chunks():
                h.update(piece)
                out.write(piece)
                written += len(piece)
            out.flush()
            os.fsync(out.fileno())
        if expected_size is not None and written != expected_size:
            raise RegistryUnavailable(
                f"blob {digest}: truncated transfer, {written} of {expected_size} bytes",
                digest=digest,
            )
        if h.hexdigest() != hex_:
            raise BlobDigestMismatch(
                f"blob {digest} hashes to sha256:{h.hexdigest()}: refused",
                digest=digest,
                actual=f"sha256:{h.hexdigest()}",
            )
        os.rename(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


class LocalDirStore:
    """Blobs in a local directory: ``<root>/sha256/<hex>``.

    Args:
        root: the store directory; created if missing.
    """

    scheme = "dir"

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self._blobs = self.root / "sha256"
        self._tmp = self.root / "tmp"
        for d in (self._blobs, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.url = f"{self.scheme}://{self.root}"

    def blob_path(self, digest: str) -> Path:
        """Where the blob lives (whether or not it exists)."""
        return self._blobs / _hex_of(digest)

    def stat(self, digest: str) -> int:
        """Size in bytes. Raises LayerNotFound."""
        try:
            return os.stat(self.blob_path(digest)).st_size
        except FileNotFoundError:
            raise LayerNotFound(f"blob {digest} is not in {self.url}", digest=digest) from None

    def has(self, digest: str) -> bool:
        """True if the blob exists."""
        return self.blob_path(digest).is_file()

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """``min(length, size - offset)`` bytes at ``offset``. Raises LayerNotFound,
        InvalidRequest (negative offset/length or offset past the end), RegistryUnavailable
        (I/O errors after retries, or a short read)."""
        path = self.blob_path(digest)
        if offset < 0 or length < 0:
            raise InvalidRequest(f"bad range offset={offset} length={length}")

        def attempt() -> bytes:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise LayerNotFound(f"blob {digest} is not in {self.url}", digest=digest) from None
            try:
                size = os.fstat(fd).st_size
                if offset > size:
                    raise InvalidRequest(f"offset {offset} past the end of {digest} ({size} B)")
                want = min(length, size - offset)
                data = os.pread(fd, want, offset)
                while len(data) < want:
                    more = os.pread(fd, want - len(data), offset + len(data))
                    if not more:
                        raise RegistryUnavailable(
                            f"blob {digest}: short read {len(data)} of {want} bytes"
                        )
                    data += more
                return data
            finally:
                os.close(fd)

        return _with_retries(f"read {digest}[{offset}:+{length}] from {self.url}", attempt)

    def fetch(self, digest: str, dest: Path) -> int:
        """Copy the blob to ``dest`` atomically, verifying sha256. Returns bytes written."""
        size = self.stat(digest)
        path = self.blob_path(digest)

        def pieces() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(_COPY_BUFFER):
                    yield piece

        return _fetch_stream_atomic(digest, dest, pieces, size)

    def put(self, path: Path, digest: str) -> None:
        """Store ``path`` under ``digest`` (hash verified first; BlobDigestMismatch if not).
        Temp file + fsync + rename: concurrent writers of the same blob are safe."""
        if self.has(digest):
            return
        tmp = self._tmp / f"{secrets.token_hex(8)}.part"

        def pieces() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(_COPY_BUFFER):
                    yield piece

        try:
            _fetch_stream_atomic(digest, tmp, pieces, None)
            os.chmod(tmp, 0o444)
            os.rename(tmp, self.blob_path(digest))
            dfd = os.open(self._blobs, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        finally:
            tmp.unlink(missing_ok=True)


class SharedFsStore(LocalDirStore):
    """The :class:`LocalDirStore` layout on a mounted shared filesystem (3FS, CephFS, NFS).

    Many nodes may write at once: uploads go to a uniquely named temp file, are fsynced and
    renamed (atomic on POSIX filesystems; the loser of a race renames identical bytes over
    identical bytes). Readers never see a partial blob. I/O errors of a flaky mount are
    retried as for a remote store.
    """

    scheme = "fs"


class HttpBlobStore:
    """Blobs behind a plain HTTP server: ``GET <base>/sha256/<hex>`` with ``Range``
    requests, ``HEAD`` for the size, ``PUT`` to upload (optional on the server side).

    Args:
        base_url: ``http://host:port[/prefix]``.
        timeout: seconds per request (connect and each read); a stalled server fails the
            attempt after this long and the attempt is retried (3 tries in all).
    """

    def __init__(self, base_url: str, *, timeout: float = 3.0) -> None:
        self.url = base_url.rstrip("/")
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def _blob_url(self, digest: str) -> str:
        return f"{self.url}/sha256/{_hex_of(digest)}"

    def _check(self, r: httpx.Response, digest: str) -> None:
        if r.status_code == 404:
            raise LayerNotFound(f"blob {digest} is not in {self.url}", digest=digest)
        if r.status_code in (401, 403):
            raise RegistryUnauthorized(f"{self.url} refused access to {digest}", digest=digest)
        if r.status_code >= 500:
            raise RegistryUnavailable(f"{self.url}: HTTP {r.status_code} for {digest}")
        if r.status_code >= 400:
            raise InvalidRequest(f"{self.url}: HTTP {r.status_code} for {digest}")

    def stat(self, digest: str) -> int:
        """Size in bytes (HEAD). Raises LayerNotFound, RegistryUnavailable."""

        def attempt() -> int:
            r = self._client.head(self._blob_url(digest))
            self._check(r, digest)
            return int(r.headers["content-length"])

        return _with_retries(f"HEAD {digest} at {self.url}", attempt)

    def has(self, digest: str) -> bool:
        """True if the server has the blob."""
        try:
            self.stat(digest)
        except LayerNotFound:
            return False
        return True

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """``min(length, size - offset)`` bytes at ``offset`` (one ranged GET). A truncated
        body or a dead server is retried, then RegistryUnavailable."""
        if offset < 0 or length < 0:
            raise InvalidRequest(f"bad range offset={offset} length={length}")
        if length == 0:
            return b""

        def attempt() -> bytes:
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            r = self._client.get(self._blob_url(digest), headers=headers)
            if r.status_code == 416:
                raise InvalidRequest(f"range {offset}+{length} outside {digest}")
            self._check(r, digest)
            body = r.content
            if r.status_code == 200:  # server ignored Range
                body = body[offset : offset + length]
                return body
            want = length
            cr = r.headers.get("content-range", "")
            if "/" in cr and cr.rsplit("/", 1)[1].isdigit():
                want = min(length, int(cr.rsplit("/", 1)[1]) - offset)
            if len(body) != want:
                raise RegistryUnavailable(
                    f"blob {digest}: truncated range, {len(body)} of {want} bytes"
                )
            return body

        return _with_retries(f"read {digest}[{offset}:+{length}] from {self.url}", attempt)

    def fetch(self, digest: str, dest: Path) -> int:
        """Stream the blob to ``dest`` atomically, sha256 verified. Retries a broken transfer
        from the start (bounded). Returns bytes written."""
        size = self.stat(digest)

        def attempt() -> int:
            def pieces() -> Iterator[bytes]:
                with self._client.stream("GET", self._blob_url(digest)) as r:
                    self._check(r, digest)
                    yield from r.iter_bytes(_COPY_BUFFER)

            return _fetch_stream_atomic(digest, dest, pieces, size)

        return _with_retries(f"fetch {digest} from {self.url}", attempt)

    def put(self, path: Path, digest: str) -> None:
        """PUT the blob (hash verified first). No-op if the server already has it."""
        if self.has(digest):
            return
        with open(path, "rb") as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if f"sha256:{actual}" != digest:
            raise BlobDigestMismatch(f"{path} hashes to sha256:{actual}, not {digest}")

        def attempt() -> None:
            def body() -> Iterator[bytes]:
                with open(path, "rb") as f:
                    while piece := f.read(_COPY_BUFFER):
                        yield piece

            size = os.stat(path).st_size
            r = self._client.put(
                self._blob_url(digest), content=body(), headers={"Content-Length": str(size)}
            )
            self._check(r, digest)

        _with_retries(f"PUT {digest} to {self.url}", attempt)


BlobStoreFactory = Callable[[str], BlobStore]
"""Opens the store of a URL of its scheme (raises ``InvalidRequest`` for a malformed one)."""

ENTRY_POINT_GROUP = "dsec.blob_stores"
"""Packages add blob stores under this entry-point group: name = the URL scheme, value = a
:data:`BlobStoreFactory` (``module:callable``), loaded the first time the scheme is used."""

_FACTORIES: dict[str, BlobStoreFactory] = {}


def register_blob_store(scheme: str, factory: BlobStoreFactory) -> None:
    """Make :func:`open_blob_store` open ``scheme://`` URLs with ``factory`` (a later
    registration of the same scheme replaces the earlier one)."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"not a URL scheme: {scheme!r}")
    _FACTORIES[scheme] = factory


def blob_store_schemes() -> list[str]:
    """The schemes registered so far (built-in ones and plugins already loaded)."""
    return sorted(_FACTORIES)


def _plugin_factory(scheme: str) -> BlobStoreFactory | None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            factory: BlobStoreFactory = ep.load()
            _FACTORIES[scheme] = factory
            return factory
    return None


def open_blob_store(url: str) -> BlobStore:
    """The store behind ``url``, opened by the factory registered for its scheme
    (:func:`register_blob_store`, or a package's ``dsec.blob_stores`` entry point). Built in:
    ``dir://`` LocalDirStore, ``fs://`` SharedFsStore, ``http(s)://`` HttpBlobStore,
    ``oci://`` RegistryBlobStore. Raises InvalidRequest for any other scheme."""
    scheme = urlsplit(url).scheme
    factory = _FACTORIES.get(scheme) or (_plugin_factory(scheme) if scheme else None)
    if factory is None:
        known = ", ".join(f"{s}://" for s in blob_store_schemes())
        raise InvalidRequest(f"unknown blob store URL {url!r}: expected {known}", url=url)
    return factory(url)


def _local_path(url: str) -> Path:
    parts = urlsplit(url)
    path = (parts.netloc + parts.path) if parts.netloc else parts.path
    if not path.startswith("/"):
        raise InvalidRequest(f"blob store URL {url!r} needs an absolute path")
    return Path(path)


def _open_registry(url: str) -> BlobStore:
    from dsec.layers.registry_store import RegistryBlobStore  # its client loads on use

    store: BlobStore = RegistryBlobStore(url, auth=None)
    return store


register_blob_store("dir", lambda url: LocalDirStore(_local_path(url)))
register_blob_store("fs", lambda url: SharedFsStore(_local_path(url)))
register_blob_store("http", HttpBlobStore)
register_blob_store("https", HttpBlobStore)
register_blob_store("oci", _open_registry)
