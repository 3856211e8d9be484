"""A throttled HTTP range server for a ``dir://`` blob store: other nodes (or the tests and
benchmarks) read its blobs as an ``http://`` store (:class:`dsec.layers.blobstore.HttpBlobStore`).

:class:`BlobHTTPServer` serves ``<root>/sha256/<hex>`` with Range support on loopback (or
any address given), under one bandwidth limit shared by all connections
(:class:`TokenBucket`), counting bytes and requests; :func:`copy_into_dir_store` links a
verified file into a store without hashing it again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.server
import os
import re
import secrets
import shutil
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

from dsec.layers.blobstore import LocalDirStore

__all__ = ["BlobHTTPServer", "TokenBucket", "copy_into_dir_store"]

_COPY_BUFFER = 1 << 20  # bytes per read while streaming a blob


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
