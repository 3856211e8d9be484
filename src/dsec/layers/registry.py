"""A client of the OCI distribution (Docker v2) API: image references, manifests and blobs.

Glossary:
    ref: ``[registry/]repository[:tag][@sha256:<hex>]``, Docker style. No registry part means
        Docker Hub (``registry-1.docker.io``, ``library/`` added to one-component names).
    manifest: JSON naming a config blob and the layer blobs, bottom first (OCI
        ``application/vnd.oci.image.manifest.v1+json`` or Docker
        ``application/vnd.docker.distribution.manifest.v2+json``).
    index: a list of manifests, one per platform (OCI image index or Docker manifest list);
        resolved to ``linux/amd64`` by :func:`select_platform`.
    blob: content-addressed bytes (``sha256:<hex>``): a config or a compressed layer tarball.

Authentication: anonymous, or ``credentials=(user, password)``; a ``401`` with
``WWW-Authenticate: Bearer realm=..,service=..,scope=..`` is answered by fetching a token from
the realm (with the credentials as HTTP Basic when given), a ``Basic`` challenge by sending the
credentials. Plain HTTP is used for loopback registries (``insecure_http=None``), or always
(``True``), or never (``False``).

What is done with an image lives elsewhere: :mod:`dsec.layers.oci` converts one into EROFS
layers, :mod:`dsec.layers.registry_store` reads dsec's own artifacts as a blob store.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from dsec.errors import (
    BlobDigestMismatch,
    ImageNotFound,
    InvalidRequest,
    RegistryUnauthorized,
    RegistryUnavailable,
    Unsupported,
)
from dsec.images.reference import DOCKER_HUB, ImageRef, default_image_name, parse_ref

__all__ = [
    "DOCKER_HUB",
    "MT_DOCKER_LIST",
    "MT_DOCKER_MANIFEST",
    "MT_OCI_INDEX",
    "MT_OCI_MANIFEST",
    "ImageRef",
    "RegistryClient",
    "default_image_name",
    "parse_challenge",
    "parse_ref",
    "select_platform",
]

MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
_INDEX_TYPES = (MT_OCI_INDEX, MT_DOCKER_LIST)
_MANIFEST_TYPES = (MT_OCI_MANIFEST, MT_DOCKER_MANIFEST)
_ACCEPT = ", ".join((*_INDEX_TYPES, *_MANIFEST_TYPES))

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_CHALLENGE_PARAM_RE = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"([^"]*)"|([^\s,]+))')
_MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_CHUNK_BYTES = 1 << 20


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """Split a ``WWW-Authenticate`` header into its scheme (lower-case) and parameters."""
    scheme, _, params = header.strip().partition(" ")
    found = {
        m.group(1).lower(): m.group(2) or m.group(3) or ""
        for m in _CHALLENGE_PARAM_RE.finditer(params)
    }
    return scheme.lower(), found


def _is_loopback(host: str) -> bool:
    hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    hostname = hostname.strip("[]")
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


# --- the registry client -------------------------------------------------------------------


class RegistryClient:
    """A pull-only client for the OCI distribution (Docker v2) API of one repository.

    Args:
        ref: the image reference (its registry and repository are used).
        credentials: ``(username, password)`` for Basic auth or for the token realm.
        insecure_http: plain HTTP for loopback registries when ``None``; ``True``/``False``
            force HTTP/HTTPS.
        timeout_s: connect/read timeout per request, seconds.
        retries: extra attempts after a transport error or 5xx (manifests and blobs).
        transport: an httpx transport (tests pass ``httpx.MockTransport``).
    """

    def __init__(
        self,
        ref: ImageRef,
        *,
        credentials: tuple[str, str] | None = None,
        insecure_http: bool | None = None,
        timeout_s: float = 30.0,
        retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.ref = ref
        plain = _is_loopback(ref.registry) if insecure_http is None else insecure_http
        self.base_url = f"{'http' if plain else 'https'}://{ref.registry}"
        self._credentials = credentials
        self._retries = max(0, retries)
        self._auth_header: str | None = None
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=True,
            transport=transport,
            headers={"User-Agent": "dsec-image-pull"},
        )

    @property
    def credentials(self) -> tuple[str, str] | None:
        """The (user, password) this session authenticates with, if any (to open another
        session to the same registry, e.g. a pull of a plain image found under a dsec ref)."""
        return self._credentials

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- auth ------------------------------------------------------------------------------

    def _authenticate(self, challenge_header: str) -> None:
        """Answer a 401 challenge by setting ``self._auth_header``.

        Raises:
            RegistryUnauthorized: no usable scheme, no credentials for Basic, token refused.
        """
        scheme, params = parse_challenge(challenge_header)
        if scheme == "basic":
            if self._credentials is None:
                raise RegistryUnauthorized(
                    f"registry {self.ref.registry} requires credentials", registry=self.ref.registry
                )
            user, password = self._credentials
            basic_b64 = base64.b64encode(f"{user}:{password}".encode()).decode()
            self._auth_header = f"Basic {basic_b64}"
            return
        if scheme != "bearer" or "realm" not in params:
            raise RegistryUnauthorized(
                f"registry {self.ref.registry} asks for unsupported auth {challenge_header!r}",
                registry=self.ref.registry,
            )
        realm = params["realm"]
        if not realm.startswith(("https://", "http://")):
            raise RegistryUnauthorized(f"token realm {realm!r} is not an HTTP(S) URL")
        query: dict[str, str] = {
            "scope": params.get("scope") or f"repository:{self.ref.repository}:pull"
        }
        if "service" in params:
            query["service"] = params["service"]
        auth: httpx.BasicAuth | None = None
        if self._credentials is not None:
            if realm.startswith("http://") and not _is_loopback(httpx.URL(realm).host):
                raise RegistryUnauthorized(f"refusing to send credentials to plain-HTTP {realm}")
            auth = httpx.BasicAuth(*self._credentials)
        try:
            resp = self._client.get(realm, params=query, auth=auth)
        except httpx.HTTPError as e:
            raise RegistryUnavailable(f"token service {realm} unreachable: {e}") from e
        if resp.status_code in (401, 403):
            raise RegistryUnauthorized(
                f"token service {realm} refused {'the credentials' if auth else 'anonymous access'}"
                f" for {self.ref.repository} (HTTP {resp.status_code})",
                registry=self.ref.registry,
                repository=self.ref.repository,
            )
        if resp.status_code != 200:
            raise RegistryUnavailable(f"token service {realm} answered HTTP {resp.status_code}")
        token: Any = None
        with contextlib.suppress(ValueError, AttributeError):
            body = resp.json()
            token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryUnavailable(f"token service {realm} sent no token")
        self._auth_header = f"Bearer {token}"

    @contextlib.contextmanager
    def _open(self, path: str, accept: str | None = None) -> Iterator[httpx.Response]:
        """GET ``/v2/<repo>/<path>`` streaming, answering one auth challenge and retrying
        transport errors and 5xx. Yields a 2xx response (body not yet read).

        Raises:
            ImageNotFound (404), RegistryUnauthorized (401/403), RegistryUnavailable.
        """
        url = f"{self.base_url}/v2/{self.ref.repository}/{path}"
        challenged = False
        attempt = 0
        while True:
            headers = {"Accept": accept} if accept else {}
            if self._auth_header:
                headers["Authorization"] = self._auth_header
            try:
                request = self._client.build_request("GET", url, headers=headers)
                resp = self._client.send(request, stream=True)
            except httpx.HTTPError as e:
                if attempt < self._retries:
                    attempt += 1
                    time.sleep(0.2 * attempt)
                    continue
                raise RegistryUnavailable(
                    f"registry {self.ref.registry} unreachable: {e}", registry=self.ref.registry
                ) from e
            try:
                status = resp.status_code
                if status == 401 and not challenged and "www-authenticate" in resp.headers:
                    challenged = True
                    self._authenticate(resp.headers["www-authenticate"])
                    continue
                if status in (401, 403):
                    raise RegistryUnauthorized(
                        f"registry {self.ref.registry} refused access to {self.ref.repository}"
                        f" (HTTP {status})",
                        registry=self.ref.registry,
                        repository=self.ref.repository,
                    )
                if status == 404:
                    raise ImageNotFound(
                        f"{self.ref}: {path} not found in registry", image=str(self.ref)
                    )
                if status >= 500 and attempt < self._retries:
                    attempt += 1
                    time.sleep(0.2 * attempt)
                    continue
                if not 200 <= status < 300:
                    raise RegistryUnavailable(
                        f"registry {self.ref.registry} answered HTTP {status} for {path}",
                        status=status,
                    )
                yield resp
                return
            finally:
                resp.close()

    # --- manifests and blobs -------------------------------------------------------------

    def get_manifest(self, reference: str) -> tuple[dict[str, Any], str, str]:
        """Fetch one manifest or index. Returns ``(json, media type, digest)``; a ``sha256:``
        reference is verified against the bytes.

        Raises:
            ImageNotFound, RegistryUnauthorized, RegistryUnavailable, BlobDigestMismatch,
            InvalidRequest (not JSON), Unsupported (schema 1).
        """
        with self._open(f"manifests/{reference}", accept=_ACCEPT) as resp:
            body = _read_limited(resp, _MAX_MANIFEST_BYTES, f"manifest {reference}")
            content_type = resp.headers.get("content-type", "").split(";")[0].strip()
        digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
        if reference.startswith("sha256:") and digest != reference:
            raise BlobDigestMismatch(
                f"manifest {reference} of {self.ref} hashes to {digest}",
                expected=reference,
                actual=digest,
            )
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise InvalidRequest(f"manifest {reference} of {self.ref} is not JSON: {e}") from e
        if not isinstance(doc, dict):
            raise InvalidRequest(f"manifest {reference} of {self.ref} is not a JSON object")
        if doc.get("schemaVersion") == 1:
            raise Unsupported(f"{self.ref}: Docker schema 1 manifests are not supported")
        media_type = doc.get("mediaType") or content_type
        if media_type not in (*_INDEX_TYPES, *_MANIFEST_TYPES):
            media_type = MT_OCI_INDEX if "manifests" in doc else MT_OCI_MANIFEST
        return doc, media_type, digest

    def get_blob_bytes(self, digest: str, max_bytes: int) -> bytes:
        """A small blob (a config) in memory, verified against ``digest``."""
        with self._open(f"blobs/{digest}") as resp:
            body = _read_limited(resp, max_bytes, f"blob {digest}")
        actual = f"sha256:{hashlib.sha256(body).hexdigest()}"
        if actual != digest:
            raise BlobDigestMismatch(
                f"blob {digest} of {self.ref} hashes to {actual}", expected=digest, actual=actual
            )
        return body

    def download_blob(self, digest: str, size: int | None, dest: Path) -> None:
        """Stream a blob to ``dest``, checking size and sha256. On any failure ``dest`` is
        removed. A broken connection restarts the download (``retries`` times).

        Raises:
            BlobDigestMismatch, RegistryUnavailable (truncated or broken), ImageNotFound,
            RegistryUnauthorized.
        """
        for attempt in range(self._retries + 1):
            try:
                self._download_once(digest, size, dest)
                return
            except RegistryUnavailable:
                dest.unlink(missing_ok=True)
                if attempt == self._retries:
                    raise
                time.sleep(0.2 * (attempt + 1))
            except BaseException:
                dest.unlink(missing_ok=True)
                raise

    def _download_once(self, digest: str, size: int | None, dest: Path) -> None:
        hasher = hashlib.sha256()
        written = 0
        with self._open(f"blobs/{digest}") as resp, open(dest, "wb") as out:
            try:
                for chunk in resp.iter_bytes(_CHUNK_BYTES):
                    written += len(chunk)
                    if size is not None and written > size:
                        raise BlobDigestMismatch(
                            f"blob {digest} of {self.ref} is larger than its {size} bytes",
                            expected_size=size,
                        )
                    hasher.update(chunk)
                    out.write(chunk)
            except httpx.HTTPError as e:
                raise RegistryUnavailable(
                    f"download of blob {digest} from {self.ref.registry} broke after "
                    f"{written} bytes: {e}",
                    digest=digest,
                    bytes=written,
                ) from e
        if size is not None and written < size:
            raise RegistryUnavailable(
                f"download of blob {digest} from {self.ref.registry} truncated: "
                f"{written} of {size} bytes",
                digest=digest,
                bytes=written,
            )
        actual = f"sha256:{hasher.hexdigest()}"
        if actual != digest:
            raise BlobDigestMismatch(
                f"blob {digest} of {self.ref} hashes to {actual}", expected=digest, actual=actual
            )


def _read_limited(resp: httpx.Response, limit: int, what: str) -> bytes:
    parts: list[bytes] = []
    total = 0
    try:
        for chunk in resp.iter_bytes(_CHUNK_BYTES):
            total += len(chunk)
            if total > limit:
                raise InvalidRequest(f"{what} is larger than {limit} bytes")
            parts.append(chunk)
    except httpx.HTTPError as e:
        raise RegistryUnavailable(f"reading {what} failed: {e}") from e
    return b"".join(parts)


# --- resolution ------------------------------------------------------------------------------


def select_platform(index: dict[str, Any], os_name: str = "linux", arch: str = "amd64") -> str:
    """The digest of the index entry for ``os_name/arch`` (first match; entries without a
    platform, e.g. attestations, are skipped).

    Raises:
        ImageNotFound: no entry for that platform (``details['platforms']`` lists them).
    """
    seen = []
    for entry in index.get("manifests") or []:
        platform = entry.get("platform") or {}
        seen.append(f"{platform.get('os')}/{platform.get('architecture')}")
        if platform.get("os") == os_name and platform.get("architecture") == arch:
            digest = entry.get("digest", "")
            if _DIGEST_RE.match(digest):
                return str(digest)
    raise ImageNotFound(
        f"the image has no {os_name}/{arch} manifest (has: {', '.join(seen) or 'none'})",
        platforms=seen,
    )
