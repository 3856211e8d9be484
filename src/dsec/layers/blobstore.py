"""Content-addressed blob stores: where layer files live when they are not on this node.

A *blob* is the bytes of one layer (an EROFS image file), named by its digest
``sha256:<64 hex>``. A :class:`BlobStore` answers five questions about blobs: how big is one
(:meth:`~BlobStore.stat`), give me a byte range of it (:meth:`~BlobStore.read_range`, what the
lazy FUSE server calls for each chunk), give me all of it, verified (:meth:`~BlobStore.fetch`,
the "full pull"), store one (:meth:`~BlobStore.put`) and do you have it (:meth:`~BlobStore.has`).
Implementations are synchronous and thread-safe: FUSE worker threads call them directly.

Backends, chosen by URL scheme in :func:`open_blob_store`:

    dir:///abs/path          LocalDirStore: a local directory (the embedded default)
    fs:///mnt/shared/dsec    SharedFsStore: the same layout on a mounted shared filesystem
                             (3FS, CephFS, NFS); safe for many writers (temp + fsync + rename)
    http://host:port/prefix  HttpBlobStore: any HTTP server serving ``<prefix>/sha256/<hex>``
                             with Range support (e.g. :class:`BlobHTTPServer`)
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

import contextlib
import errno
import hashlib
import http.server
import logging
import os
import re
import secrets
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
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
    "BlobHTTPServer",
    "BlobStore",
    "HttpBlobStore",
    "LocalDirStore",
    "SharedFsStore",
    "TokenBucket",
    "open_blob_store",
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


def open_blob_store(url: str) -> BlobStore:
    """The store behind ``url``: ``dir://`` LocalDirStore, ``fs://`` SharedFsStore,
    ``http(s)://`` HttpBlobStore, ``oci://`` RegistryBlobStore (imported lazily from
    :mod:`dsec.layers.registry_store`). Raises InvalidRequest for any other scheme."""
    parts = urlsplit(url)
    if parts.scheme in ("dir", "fs"):
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path.startswith("/"):
            raise InvalidRequest(f"blob store URL {url!r} needs an absolute path")
        return LocalDirStore(Path(path)) if parts.scheme == "dir" else SharedFsStore(Path(path))
    if parts.scheme in ("http", "https"):
        return HttpBlobStore(url)
    if parts.scheme == "oci":
        from dsec.layers.registry_store import RegistryBlobStore

        store: BlobStore = RegistryBlobStore(url, auth=None)
        return store
    raise InvalidRequest(
        f"unknown blob store URL {url!r}: expected dir://, fs://, http(s):// or oci://", url=url
    )


# --- a throttled HTTP range server (tests, benchmarks, a simple blob server) ---------------


class TokenBucket:
    """Bandwidth limiter shared by all connections: ``take(n)`` blocks until ``n`` bytes of
    budget are available. ``rate`` in bytes/s (0 = unlimited); the burst is 1/10 s of rate."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self._capacity = max(self.rate / 10.0, 1.0)
        self._tokens = self._capacity
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Consume ``n`` bytes of budget, sleeping as needed."""
        if self.rate <= 0:
            return
        while n > 0:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self._capacity, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                grant = min(n, self._tokens) if self._tokens >= 1 else 0
                self._tokens -= grant
                wait = 0.0 if grant else (min(n, self._capacity) - self._tokens) / self.rate
            n -= int(grant)
            if wait:
                time.sleep(wait)


class _ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """Threaded HTTP server that can also cut its open keep-alive connections."""

    daemon_threads = True
    allow_reuse_address = True
    live: set[socket.socket]

    def process_request(self, request: Any, client_address: Any) -> None:
        self.live.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.live.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        for conn in list(self.live):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class BlobHTTPServer:
    """Serve a :class:`LocalDirStore` over HTTP on loopback with Range support and a shared
    bandwidth limit (token bucket). Counts bytes sent and requests. Runs in a thread.

    Args:
        root: the store directory (``<root>/sha256/<hex>``).
        rate: bandwidth limit in bytes/s over all connections (0 = unlimited).
        host, port: where to listen (port 0 = any free port; see :attr:`url`).

    Example::

        with BlobHTTPServer(Path("/srv/blobs"), rate=100e6) as srv:
            store = open_blob_store(srv.url)
    """

    def __init__(self, root: Path, *, rate: float = 0, host: str = "127.0.0.1", port: int = 0):
        self.root = Path(root)
        self.bucket = TokenBucket(rate)
        self.bytes_sent = 0
        self.requests = 0
        self.fail_after_bytes: int | None = None  # test hook: cut connections after N bytes
        self._stats_lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return

            def _blob(self) -> Path | None:
                m = re.fullmatch(r"/(?:.*/)?sha256/([0-9a-f]{64})", self.path)
                return outer.root / "sha256" / m.group(1) if m else None

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                with outer._stats_lock:
                    outer.requests += 1
                path = self._blob()
                if path is None or not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = path.stat().st_size
                start, end = 0, size - 1
                rng = self.headers.get("Range")
                status = 200
                if rng:
                    m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                    if m is None or int(m.group(1)) >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                    status = 206
                length = end - start + 1
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if not body:
                    return
                with open(path, "rb") as f:
                    f.seek(start)
                    left = length
                    while left > 0:
                        piece = f.read(min(left, 256 * 1024))
                        if not piece:
                            break
                        outer.bucket.take(len(piece))
                        with outer._stats_lock:
                            cut = outer.fail_after_bytes is not None and (
                                outer.bytes_sent + len(piece) > outer.fail_after_bytes
                            )
                            if not cut:
                                outer.bytes_sent += len(piece)
                        if cut:
                            self.close_connection = True
                            with contextlib.suppress(OSError):
                                self.connection.shutdown(2)
                            return
                        try:
                            self.wfile.write(piece)
                        except OSError as e:
                            if e.errno in (errno.EPIPE, errno.ECONNRESET):
                                return
                            raise
                        left -= len(piece)

            def do_PUT(self) -> None:
                path = self._blob()
                left = int(self.headers.get("Content-Length", "0"))
                tmp = outer.root / "sha256" / f".put.{secrets.token_hex(6)}"
                h = hashlib.sha256()
                with open(tmp, "wb") as out:  # streamed and hashed, never held in memory
                    while left > 0:
                        piece = self.rfile.read(min(left, _COPY_BUFFER))
                        if not piece:
                            break
                        h.update(piece)
                        out.write(piece)
                        left -= len(piece)
                if path is None or left or h.hexdigest() != path.name:
                    tmp.unlink(missing_ok=True)
                    self.send_response(400)
                else:
                    os.rename(tmp, path)
                    self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

        (self.root / "sha256").mkdir(parents=True, exist_ok=True)
        self._server = _ThreadingServer((host, port), Handler)
        self._server.live = set()
        self.port = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="dsec-blob-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        self._thread.join(timeout=5)

    def __enter__(self) -> BlobHTTPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_into_dir_store(store: LocalDirStore, path: Path, digest: str) -> None:
    """Hard-link (or copy) a verified file into a dir store without re-hashing (the caller
    vouches for the digest, e.g. a LayerStore blob). Used by benchmarks and tests."""
    dest = store.blob_path(digest)
    if dest.exists():
        return
    try:
        os.link(path, dest)
    except OSError:
        tmp = dest.parent / f".{dest.name}.{secrets.token_hex(4)}"
        shutil.copyfile(path, tmp)
        os.rename(tmp, dest)
