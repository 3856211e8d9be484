"""Image references: ``[registry[:port]/]repository[:tag][@sha256:<hex>]``, Docker's rules.

A reference names an image in an OCI registry. No registry part means Docker Hub
(``registry-1.docker.io``; one-component repositories get ``library/``). :func:`parse_ref`
parses one; :func:`familiar_name` gives the short form Docker shows (``python:3.12-slim``,
``e2b/desktop:latest``, ``127.0.0.1:5000/debian:bookworm-slim``), which is also the name a
pulled image has in dsec: afterwards the reference itself names the image.

Local image names (``debian``, ``task:1``) are references too by these rules; a name the
node knows wins (see docs/design/images.md): only an unknown name is looked up in a registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsec.errors import InvalidRequest

__all__ = [
    "DOCKER_HUB",
    "ImageRef",
    "default_image_name",
    "familiar_name",
    "is_qualified",
    "is_reference_name",
    "parse_ref",
]

DOCKER_HUB = "registry-1.docker.io"
_DOCKER_HUB_ALIASES = ("docker.io", "index.docker.io", DOCKER_HUB)
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.?)+(?::[0-9]{1,5})?$")
_OWNER_ID_RE = re.compile(r"^k[0-9a-f]{16}$")
_MAX_REFERENCE = 512


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference. ``reference`` is the digest if given, else the tag."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What goes in ``/v2/<repo>/manifests/<reference>``."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def _split_registry(rest: str) -> tuple[str | None, str]:
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first, remainder
    return None, rest


def parse_ref(ref: str) -> ImageRef:
    """Parse ``[registry[:port]/]repo[:tag][@sha256:hex]`` (Docker rules; default tag
    ``latest``; a first component with ``.`` or ``:``, or ``localhost``, is a registry).
    ``oci://`` in front is allowed.

    Raises:
        InvalidRequest: malformed reference.
    """
    rest = ref.strip().removeprefix("oci://")
    if len(rest) > _MAX_REFERENCE:
        raise InvalidRequest(f"image reference longer than {_MAX_REFERENCE} characters")
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise InvalidRequest(f"invalid digest in image reference {ref!r}", ref=ref)
    host, rest = _split_registry(rest)
    registry = DOCKER_HUB if host is None or host in _DOCKER_HUB_ALIASES else host
    if host is not None and not _HOST_RE.match(host):
        raise InvalidRequest(f"invalid registry in image reference {ref!r}", ref=ref)
    tag = None
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise InvalidRequest(f"invalid tag in image reference {ref!r}", ref=ref)
    if registry == DOCKER_HUB and "/" not in rest:
        rest = f"library/{rest}"
    if not rest or not _REPO_RE.match(rest):
        raise InvalidRequest(f"invalid repository in image reference {ref!r}", ref=ref)
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry=registry, repository=rest, tag=tag, digest=digest)


def familiar_name(ref: ImageRef) -> str:
    """The short form of ``ref`` (Docker's): no Docker Hub registry, no ``library/``;
    ``host[:port]/`` kept for other registries; the tag and digest as given."""
    repo = ref.repository
    if ref.registry == DOCKER_HUB:
        repo = repo.removeprefix("library/")
        out = repo
    else:
        out = f"{ref.registry}/{repo}"
    if ref.tag:
        out += f":{ref.tag}"
    if ref.digest:
        out += f"@{ref.digest}"
    return out


def is_qualified(text: str) -> bool:
    """Whether ``text`` can only be a registry reference, never a local name: ``oci://``,
    an explicit registry (``host.name/...``, ``host:port/...``, ``localhost/...``), or a
    ``@sha256:`` digest."""
    t = text.strip()
    if t.startswith("oci://") or "@" in t:
        return True
    return _split_registry(t)[0] is not None


def is_reference_name(name: str) -> bool:
    """Whether ``name`` is a valid image name in reference form (what a pulled image is
    called): parses as a reference, is already in its familiar form, and does not begin
    with an owner id (``<owner id>/<name>`` names another key's shared image)."""
    first = name.split("/", 1)[0]
    if "/" in name and _OWNER_ID_RE.match(first):
        return False
    try:
        return familiar_name(parse_ref(name)) in (name, f"{name}:latest")
    except InvalidRequest:
        return False


def default_image_name(ref: ImageRef) -> str:
    """The name ``dsec image pull --name`` used before references named images: the
    repository (``library/`` dropped, ``/`` -> ``-``) and the tag, or ``sha256-<12 hex>``
    when pulled by digest only."""
    repo = ref.repository.removeprefix("library/").replace("/", "-").replace("__", "_")
    tag = ref.tag if ref.tag else f"sha256-{(ref.digest or '')[7:19]}"
    return f"{repo[:128]}:{tag}"
