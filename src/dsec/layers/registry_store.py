"""The ``oci://`` blob store: layer blobs kept as OCI blobs in one registry repository.

Glossary:
    store URL: ``oci://HOST[:PORT]/REPOSITORY`` (e.g. ``oci://127.0.0.1:5000/dsec/layers``).
        Blobs are ``/v2/<REPOSITORY>/blobs/sha256:<hex>`` of that registry.
    blob: content-addressed bytes (``sha256:<64 hex>``); for dsec, an EROFS layer image.

What each :class:`~dsec.layers.blobstore.BlobStore` call does on the wire:

* ``stat``       ``HEAD /v2/<repo>/blobs/<digest>`` -> ``Content-Length``.
* ``read_range`` ``GET`` with ``Range: bytes=a-b``; a ``206`` body must match ``Content-Range``.
  A registry that ignores ``Range`` and answers ``200`` is read and sliced (logged once per
  store: it costs the whole blob per read).
* ``fetch``      streaming ``GET`` into ``<dest>.<random>.part`` next to ``dest``, sha256 and size
  checked while streaming, fsynced, then renamed onto ``dest``. A mismatch raises
  :class:`~dsec.errors.BlobDigestMismatch` and ``dest`` is never created.
* ``put``        (unless ``HEAD`` finds the blob) ``POST /v2/<repo>/blobs/uploads/`` then one
  ``PUT <location>?digest=`` with the body (monolithic) or, for blobs larger than
  ``chunk_bytes``, ``PATCH`` chunks with ``Content-Range`` and a final empty ``PUT``.
  The file is hashed first: a file whose bytes do not match ``digest`` is refused locally.
* ``has``        ``HEAD`` -> 200 or 404.

Transport errors, ``429``, ``5xx`` and short bodies are retried (``retries`` extra attempts,
default 2, backoff 0.25 s, 0.5 s), then :class:`~dsec.errors.RegistryUnavailable`. A range
read or fetch is retried as a whole (its single requests are not retried again inside), so
with the default 5 s connect/read timeout a hung registry surfaces after ~16 s at most and a
refused connection after ~1 s: a FUSE read gets an I/O error, never a hang. ``push_image`` and
``attach_image`` open their stores with 30 s (big uploads).
``401`` answers a ``WWW-Authenticate`` challenge once per request (Bearer token from the
realm, or Basic), reusing :class:`dsec.layers.oci.RegistryClient`'s auth; still refused:
:class:`~dsec.errors.RegistryUnauthorized`. ``404`` on a blob:
:class:`~dsec.errors.LayerNotFound`. Plain HTTP is used for loopback registries, as in
:mod:`dsec.layers.oci` (``insecure_http`` overrides).

Credentials: ``auth=(user, password)``, else ``DSEC_REGISTRY_AUTH`` (JSON
``{"host:port": ["user", "password"]}``, the variable the edge's pull reads).

One HTTP connection pool (an ``httpx.Client``) per store, shared by all threads: the store is
thread-safe (FUSE worker threads call it concurrently).

Example::

    store = RegistryBlobStore("oci://127.0.0.1:5000/dsec/layers")
    store.put(Path("layer.erofs"), "sha256:...")
    head = store.read_range("sha256:...", 0, 4096)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from dsec.errors import (
    BlobDigestMismatch,
    InvalidRequest,
    LayerNotFound,
    RegistryUnauthorized,
    RegistryUnavailable,
)
from dsec.layers.registry import ImageRef, RegistryClient

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "RegistryBlobStore",
    "StoreLocation",
    "parse_store_url",
    "registry_credentials",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Blobs larger than this (bytes) are uploaded in ``PATCH`` chunks of this size."""

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^\[[0-9a-fA-F:]+\](:[0-9]{1,5})?$")
_REPO_RE = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_IO_BYTES = 1 << 20
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class StoreLocation:
    """A parsed ``oci://HOST[:PORT]/REPOSITORY[:TAG]``: ``registry`` (``host:port``),
    ``repository`` and the optional ``tag`` (only push targets and attach refs have one)."""

    __slots__ = ("registry", "repository", "tag")

    def __init__(self, registry: str, repository: str, tag: str | None) -> None:
        self.registry = registry
        self.repository = repository
        self.tag = tag

    @property
    def store_url(self) -> str:
        """The blob store URL (no tag): ``oci://registry/repository``."""
        return f"oci://{self.registry}/{self.repository}"

    def __repr__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        return f"StoreLocation({self.store_url}{tag})"


def parse_store_url(url: str, *, allow_tag: bool = False) -> StoreLocation:
    """Parse ``oci://HOST[:PORT]/REPO`` (and ``:TAG`` after the repository when
    ``allow_tag``; a ``@sha256:...`` suffix is kept as the tag too).

    Raises:
        InvalidRequest: not an ``oci://`` URL, no repository, malformed host/repo/tag.
    """
    if not url.startswith("oci://"):
        raise InvalidRequest(f"not an oci:// URL: {url!r}", url=url)
    rest = url[len("oci://") :]
    host, sep, path = rest.partition("/")
    if not sep or not path or not _HOST_RE.match(host):
        raise InvalidRequest(f"{url!r}: expected oci://HOST[:PORT]/REPOSITORY", url=url)
    tag: str | None = None
    if "@" in path:
        path, digest = path.split("@", 1)
        if not allow_tag or not _DIGEST_RE.match(digest):
            raise InvalidRequest(f"{url!r}: unexpected or malformed @digest", url=url)
        tag = digest
    elif ":" in path.rsplit("/", 1)[-1]:
        if not allow_tag:
            raise InvalidRequest(f"{url!r}: a blob store URL has no :tag", url=url)
        path, tag = path.rsplit(":", 1)
        if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$", tag):
            raise InvalidRequest(f"{url!r}: malformed tag {tag!r}", url=url)
    if not _REPO_RE.match(path):
        raise InvalidRequest(f"{url!r}: malformed repository {path!r}", url=url)
    return StoreLocation(host, path, tag)


def registry_credentials(registry: str) -> tuple[str, str] | None:
    """Credentials for ``registry`` (``host:port``) from ``DSEC_REGISTRY_AUTH`` (JSON
    ``{"host:port": ["user", "password"]}``), or None.

    Raises:
        InvalidRequest: the variable is set but is not such a JSON object.
    """
    raw = os.environ.get("DSEC_REGISTRY_AUTH")
    if not raw:
        return None
    try:
        table = json.loads(raw)
        entry = table.get(registry)
    except (ValueError, AttributeError) as e:
        raise InvalidRequest(f"DSEC_REGISTRY_AUTH is not a JSON object: {e}") from e
    if entry is None:
        return None
    if not (
        isinstance(entry, list | tuple)
        and len(entry) == 2
        and all(isinstance(x, str) for x in entry)
    ):
        raise InvalidRequest(f"DSEC_REGISTRY_AUTH[{registry!r}] must be [user, password]")
    return (entry[0], entry[1])


def _with_digest(location: str, digest: str) -> str:
    """An upload location with ``digest=`` added (its own query, e.g. ``_state``, kept)."""
    return str(httpx.URL(location).copy_add_param("digest", digest))


def _check_digest(digest: str) -> None:
    if not _DIGEST_RE.match(digest):
        raise InvalidRequest(f"invalid blob digest {digest!r}: expected sha256:<64 hex>")


class _Session(RegistryClient):
    """:class:`RegistryClient` (its connection pool, auth and HTTP/HTTPS choice) plus
    requests of any method with the same challenge handling and bounded retries."""

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        content: bytes | Iterator[bytes] | None = None,
        stream: bool = False,
        what: str,
        retry: bool = True,
    ) -> httpx.Response:
        """Send a request (``url`` absolute, or a path under ``/v2/<repo>/``), answering one
        auth challenge and retrying transport errors, 429 and 5xx. Returns the response with
        its status as is for anything else (the caller closes a streamed response).

        Raises:
            RegistryUnavailable: retries exhausted. RegistryUnauthorized: challenge refused.
        """
        if not url.startswith(("http://", "https://")):
            url = f"{self.base_url}/v2/{self.ref.repository}/{url}"
        challenged = False
        attempt = 0
        while True:
            hdrs = dict(headers or {})
            auth_header = self._auth_header
            if auth_header:
                hdrs["Authorization"] = auth_header
            try:
                req = self._client.build_request(
                    method, url, headers=hdrs, params=params, content=content
                )
                resp = self._client.send(req, stream=stream)
            except httpx.HTTPError as e:
                if attempt < self._retries and retry:
                    attempt += 1
                    time.sleep(0.25 * attempt)
                    continue
                raise RegistryUnavailable(
                    f"registry {self.ref.registry} unreachable ({what}): {e}",
                    registry=self.ref.registry,
                ) from e
            status = resp.status_code
            if status == 401 and "www-authenticate" in resp.headers:
                # A new challenge (e.g. push scope after a pull token) is answered once.
                resp.close()
                if challenged:
                    raise RegistryUnauthorized(
                        f"registry {self.ref.registry} refused access to "
                        f"{self.ref.repository} ({what}, HTTP 401)",
                        registry=self.ref.registry,
                        repository=self.ref.repository,
                    )
                challenged = True
                self._authenticate(resp.headers["www-authenticate"])
                continue
            if status in _RETRY_STATUSES and attempt < self._retries and retry:
                resp.close()
                attempt += 1
                time.sleep(0.25 * attempt)
                continue
            return resp


def _raise_for(resp: httpx.Response, registry: str, repository: str, what: str) -> None:
    """Map a non-2xx status to the error tree (the caller handled the statuses it expects)."""
    status = resp.status_code
    if status in (401, 403):
        raise RegistryUnauthorized(
            f"registry {registry} refused access to {repository} ({what}, HTTP {status})",
            registry=registry,
            repository=repository,
        )
    body = ""
    with contextlib.suppress(Exception):
        body = resp.read()[:300].decode(errors="replace")
    raise RegistryUnavailable(
        f"registry {registry} answered HTTP {status} ({what}): {body}",
        registry=registry,
        status=status,
    )


class RegistryBlobStore:
    """Blobs in an OCI registry repository (see the module docstring for the wire protocol).

    Args:
        url: ``oci://HOST[:PORT]/REPOSITORY``.
        auth: ``(user, password)`` for Basic auth or the token realm; default from
            ``DSEC_REGISTRY_AUTH``.
        insecure_http: plain HTTP for loopback registries when ``None``; ``True``/``False``
            force HTTP/HTTPS.
        timeout_s: connect/read/write timeout per request (per socket operation), seconds.
        retries: extra attempts after a transport error, 429 or 5xx (default 2: 3 tries).
        chunk_bytes: uploads larger than this go in ``PATCH`` chunks of this size (bytes).
        transport: an httpx transport (tests pass ``httpx.MockTransport``).

    Raises:
        InvalidRequest: malformed URL or ``DSEC_REGISTRY_AUTH``.
    """

    def __init__(
        self,
        url: str,
        auth: tuple[str, str] | None = None,
        *,
        insecure_http: bool | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        loc = parse_store_url(url)
        self.url = loc.store_url
        self.registry = loc.registry
        self.repository = loc.repository
        if chunk_bytes <= 0:
            raise InvalidRequest("chunk_bytes must be > 0")
        self._chunk_bytes = chunk_bytes
        self._session = _Session(
            ImageRef(registry=loc.registry, repository=loc.repository, tag=None, digest=None),
            credentials=auth if auth is not None else registry_credentials(loc.registry),
            insecure_http=insecure_http,
            timeout_s=timeout_s,
            retries=retries,
            transport=transport,
        )
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._warned_ignored_range = False

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._session.close()

    def __enter__(self) -> RegistryBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RegistryBlobStore({self.url!r})"

    @property
    def session(self) -> RegistryClient:
        """The underlying registry client (manifests: see :mod:`dsec.layers.publish`)."""
        return self._session

    def _request(self, method: str, url: str, *, what: str, **kw: Any) -> httpx.Response:
        return self._session.request(method, url, what=what, **kw)

    def _fail(self, resp: httpx.Response, what: str) -> None:
        _raise_for(resp, self.registry, self.repository, what)

    # --- reading -----------------------------------------------------------------------

    def stat(self, digest: str) -> int:
        """The blob's size in bytes (``HEAD``; cached per store: blobs never change).

        Raises:
            LayerNotFound, RegistryUnauthorized, RegistryUnavailable, InvalidRequest.
        """
        _check_digest(digest)
        with self._lock:
            if digest in self._sizes:
                return self._sizes[digest]
        resp = self._request("HEAD", f"blobs/{digest}", what=f"HEAD {digest}")
        resp.close()
        if resp.status_code == 404:
            raise LayerNotFound(f"no blob {digest} in {self.url}", digest=digest, store=self.url)
        if resp.status_code != 200:
            self._fail(resp, f"HEAD {digest}")
        try:
            size = int(resp.headers["content-length"])
        except (KeyError, ValueError) as e:
            raise RegistryUnavailable(
                f"registry {self.registry} sent no Content-Length for blob {digest}"
            ) from e
        with self._lock:
            self._sizes[digest] = size
        return size

    def has(self, digest: str) -> bool:
        """Whether the repository has the blob (``HEAD``)."""
        try:
            self.stat(digest)
        except LayerNotFound:
            return False
        return True

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """Exactly ``min(length, size - offset)`` bytes of the blob from ``offset`` (bytes).

        Raises:
            InvalidRequest: negative offset/length or ``offset > size``.
            LayerNotFound, RegistryUnauthorized, RegistryUnavailable (after retries, also for
            a short or mismatched range answer).
        """
        _check_digest(digest)
        if offset < 0 or length < 0:
            raise InvalidRequest(f"bad range offset={offset} length={length}")
        if length == 0:
            return b""
        last_error: RegistryUnavailable | None = None
        for attempt in range(self._session._retries + 1):
            if attempt:
                time.sleep(0.25 * attempt)
            try:
                return self._read_range_once(digest, offset, length)
            except RegistryUnavailable as e:
                last_error = e
        assert last_error is not None
        raise last_error

    def _read_range_once(self, digest: str, offset: int, length: int) -> bytes:
        what = f"GET {digest} bytes {offset}+{length}"
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        resp = self._request(
            "GET", f"blobs/{digest}", headers=headers, stream=True, what=what, retry=False
        )
        try:
            status = resp.status_code
            if status == 404:
                raise LayerNotFound(
                    f"no blob {digest} in {self.url}", digest=digest, store=self.url
                )
            if status == 416:
                size = self.stat(digest)
                if offset >= size:
                    if offset == size:
                        return b""
                    raise InvalidRequest(
                        f"offset {offset} is past the end of blob {digest} ({size} bytes)"
                    )
                raise RegistryUnavailable(f"registry {self.registry} refused range ({what})")
            if status == 206:
                return self._read_partial(resp, digest, offset, length, what)
            if status == 200:
                return self._read_sliced(resp, digest, offset, length, what)
            self._fail(resp, what)
            raise AssertionError("unreachable")
        except httpx.HTTPError as e:
            raise RegistryUnavailable(f"registry {self.registry}: {what} broke: {e}") from e
        finally:
            resp.close()

    def _read_partial(
        self, resp: httpx.Response, digest: str, offset: int, length: int, what: str
    ) -> bytes:
        m = _CONTENT_RANGE_RE.match(resp.headers.get("content-range", "").strip())
        if m is None or int(m.group(1)) != offset:
            raise RegistryUnavailable(
                f"registry {self.registry}: bad Content-Range "
                f"{resp.headers.get('content-range')!r} ({what})"
            )
        expected = int(m.group(2)) - offset + 1
        if m.group(3) != "*":
            total = int(m.group(3))
            with self._lock:
                self._sizes.setdefault(digest, total)
            if expected != min(length, total - offset):
                raise RegistryUnavailable(
                    f"registry {self.registry}: range answer of {expected} bytes ({what})"
                )
        elif expected > length:
            raise RegistryUnavailable(f"registry {self.registry}: oversized range ({what})")
        data = resp.read()
        if len(data) != expected:
            raise RegistryUnavailable(
                f"registry {self.registry}: range answer truncated: {len(data)} of "
                f"{expected} bytes ({what})"
            )
        return data

    def _read_sliced(
        self, resp: httpx.Response, digest: str, offset: int, length: int, what: str
    ) -> bytes:
        """A ``200`` to a range request: skip to ``offset``, keep ``length`` bytes."""
        if not self._warned_ignored_range:
            self._warned_ignored_range = True
            log.warning(
                "registry %s ignores Range requests: every chunk read of %s downloads the "
                "blob from its start",
                self.registry,
                self.url,
            )
        total = resp.headers.get("content-length")
        if total is not None and total.isdigit():
            with self._lock:
                self._sizes.setdefault(digest, int(total))
            if offset > int(total):
                raise InvalidRequest(
                    f"offset {offset} is past the end of blob {digest} ({total} bytes)"
                )
        parts: list[bytes] = []
        pos = 0
        kept = 0
        end = offset + length
        for chunk in resp.iter_bytes(_IO_BYTES):
            lo, hi = max(offset - pos, 0), min(end - pos, len(chunk))
            if lo < hi:
                parts.append(chunk[lo:hi])
                kept += hi - lo
            pos += len(chunk)
            if pos >= end:
                break
        if total is not None and total.isdigit() and pos < min(end, int(total)):
            raise RegistryUnavailable(
                f"registry {self.registry}: body truncated at {pos} of {total} bytes ({what})"
            )
        return b"".join(parts)

    def fetch(self, digest: str, dest: Path) -> int:
        """Download the whole blob to ``dest`` atomically (temp file + fsync + rename),
        checking size and sha256 while streaming; a broken transfer restarts (bounded).

        Returns:
            Bytes written.

        Raises:
            BlobDigestMismatch (``dest`` not created), LayerNotFound, RegistryUnauthorized,
            RegistryUnavailable (retries exhausted, truncated).
        """
        _check_digest(digest)
        dest = Path(dest)
        last_error: RegistryUnavailable | None = None
        for attempt in range(self._session._retries + 1):
            if attempt:
                time.sleep(0.25 * attempt)
            try:
                return self._fetch_once(digest, dest)
            except RegistryUnavailable as e:
                last_error = e
        assert last_error is not None
        raise last_error

    def _fetch_once(self, digest: str, dest: Path) -> int:
        what = f"GET {digest}"
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.part")
        hasher = hashlib.sha256()
        written = 0
        try:
            resp = self._request("GET", f"blobs/{digest}", stream=True, what=what, retry=False)
            try:
                if resp.status_code == 404:
                    raise LayerNotFound(
                        f"no blob {digest} in {self.url}", digest=digest, store=self.url
                    )
                if resp.status_code != 200:
                    self._fail(resp, what)
                declared = resp.headers.get("content-length")
                expected = int(declared) if declared and declared.isdigit() else None
                with open(tmp, "wb") as out:
                    try:
                        for chunk in resp.iter_bytes(_IO_BYTES):
                            hasher.update(chunk)
                            out.write(chunk)
                            written += len(chunk)
                    except httpx.HTTPError as e:
                        raise RegistryUnavailable(
                            f"download of {digest} from {self.registry} broke after "
                            f"{written} bytes: {e}",
                            digest=digest,
                            bytes=written,
                        ) from e
                    if expected is not None and written != expected:
                        raise RegistryUnavailable(
                            f"download of {digest} from {self.registry} truncated: {written} "
                            f"of {expected} bytes",
                            digest=digest,
                            bytes=written,
                        )
                    actual = f"sha256:{hasher.hexdigest()}"
                    if actual != digest:
                        raise BlobDigestMismatch(
                            f"blob {digest} from {self.url} hashes to {actual}",
                            expected=digest,
                            actual=actual,
                        )
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                resp.close()
            os.rename(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._sizes[digest] = written
        return written

    # --- writing -----------------------------------------------------------------------

    def put(self, path: Path, digest: str) -> None:
        """Upload the file ``path`` as blob ``digest``; a no-op if the registry has it.

        Raises:
            BlobDigestMismatch: the file's bytes hash to something else (nothing uploaded).
            InvalidRequest: ``path`` is not a readable file.
            RegistryUnauthorized, RegistryUnavailable.
        """
        _check_digest(digest)
        path = Path(path)
        if self.has(digest):
            return
        try:
            with open(path, "rb") as f:
                actual = f"sha256:{hashlib.file_digest(f, 'sha256').hexdigest()}"
            size = path.stat().st_size
        except OSError as e:
            raise InvalidRequest(f"cannot read {path}: {e}", path=str(path)) from e
        if actual != digest:
            raise BlobDigestMismatch(
                f"{path} hashes to {actual}, not {digest}: not uploaded",
                expected=digest,
                actual=actual,
            )
        last_error: RegistryUnavailable | None = None
        for attempt in range(self._session._retries + 1):
            if attempt:
                time.sleep(0.25 * attempt)
            try:
                self._upload_once(path, digest, size)
                break
            except RegistryUnavailable as e:
                last_error = e
        else:
            assert last_error is not None
            raise last_error
        with self._lock:
            self._sizes[digest] = size
        log.info("uploaded %s (%d bytes) to %s", digest, size, self.url)

    def _start_upload(self, what: str) -> str:
        resp = self._request("POST", "blobs/uploads/", what=what)
        resp.close()
        if resp.status_code != 202 or "location" not in resp.headers:
            self._fail(resp, what)
        return str(httpx.URL(self._session.base_url).join(resp.headers["location"]))

    def _upload_once(self, path: Path, digest: str, size: int) -> None:
        what = f"upload {digest}"
        location = self._start_upload(what)
        if size <= self._chunk_bytes:
            body = path.read_bytes()
            resp = self._request(
                "PUT",
                _with_digest(location, digest),
                content=body,
                headers={"Content-Type": "application/octet-stream"},
                what=what,
                retry=False,
            )
            resp.close()
            if resp.status_code != 201:
                self._fail(resp, what)
            return
        with open(path, "rb") as f:
            offset = 0
            while offset < size:
                chunk = f.read(self._chunk_bytes)
                headers = {
                    "Content-Type": "application/octet-stream",
                    "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
                }
                resp = self._request(
                    "PATCH", location, content=chunk, headers=headers, what=what, retry=False
                )
                resp.close()
                if resp.status_code != 202 or "location" not in resp.headers:
                    self._fail(resp, f"{what} chunk at {offset}")
                location = str(httpx.URL(self._session.base_url).join(resp.headers["location"]))
                offset += len(chunk)
        resp = self._request(
            "PUT", _with_digest(location, digest), content=b"", what=what, retry=False
        )
        resp.close()
        if resp.status_code != 201:
            self._fail(resp, what)

    # --- manifests (used by publish) ---------------------------------------------------

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> str:
        """``PUT /v2/<repo>/manifests/<reference>`` (a tag or a digest); returns the
        manifest's digest (sha256 of ``body``).

        Raises:
            InvalidRequest: the registry refused the manifest (400: e.g. a missing blob).
            RegistryUnauthorized, RegistryUnavailable.
        """
        what = f"PUT manifest {reference}"
        resp = self._request(
            "PUT",
            f"manifests/{reference}",
            content=body,
            headers={"Content-Type": media_type},
            what=what,
        )
        resp.close()
        if resp.status_code == 400:
            raise InvalidRequest(
                f"registry {self.registry} refused the manifest for {reference}: "
                f"{resp.read()[:500].decode(errors='replace')}"
            )
        if resp.status_code not in (200, 201):
            self._fail(resp, what)
        return f"sha256:{hashlib.sha256(body).hexdigest()}"

    def put_bytes(self, data: bytes, digest: str) -> None:
        """Upload a small in-memory blob (a config) as ``digest`` (no-op if present).

        Raises:
            BlobDigestMismatch, RegistryUnauthorized, RegistryUnavailable.
        """
        actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if actual != digest:
            raise BlobDigestMismatch(f"data hashes to {actual}, not {digest}")
        if self.has(digest):
            return
        what = f"upload {digest}"
        location = self._start_upload(what)
        resp = self._request(
            "PUT",
            _with_digest(location, digest),
            content=data,
            headers={"Content-Type": "application/octet-stream"},
            what=what,
            retry=False,
        )
        resp.close()
        if resp.status_code != 201:
            self._fail(resp, what)
