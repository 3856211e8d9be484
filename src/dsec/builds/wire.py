"""The build wire format: the request, the events streamed back, and the upload framing.

``POST /v1/builds`` (with ``Authorization: Bearer <key>``; the image belongs to that key):

* request body: an uncompressed tar archive (``Content-Type: application/x-tar``) whose
  **first member** is :data:`REQUEST_MEMBER` (``.dsec-build.json``): the
  :class:`BuildRequest` as JSON. Every member after it is the build context (the files
  ``copy`` steps and Dockerfile ``COPY``/``ADD`` name), at its path relative to the
  context root. A client makes it with :func:`encode_build_upload`; by hand::

      tar -cf - .dsec-build.json -C ./context . | curl --data-binary @- \\
          -H 'content-type: application/x-tar' -H "authorization: Bearer $KEY" \\
          http://127.0.0.1:7070/v1/builds

* answer: ``200`` with ``Content-Type: application/x-ndjson``, one :data:`BuildEvent` per
  line (``{"type": "start", ...}``, then per step ``step`` -> (``cached`` | ``output``...)
  -> ``step_done``), ending with exactly one ``done`` (the image) or ``error``.
  A request refused before anything ran (malformed request or Dockerfile, an unknown base
  image, a missing COPY source, a name the key may not use, an oversized context) is a
  plain JSON error answer instead (``4xx``, the usual ``{"error": {...}}`` body): the
  server reads the first event before it answers.

Forward compatibility: results are parsed leniently (unknown fields ignored; an event of
an unknown ``type`` is skipped by :func:`parse_event`); requests are strict (an unknown
field is a 400 that names it).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.builds.steps import ENV_NAME, Step
from dsec.errors import InvalidRequest
from dsec.models import ImageInfo
from dsec.network.policy import NetworkPolicy

__all__ = [
    "DOCKERFILE_RUN_NETWORK",
    "REQUEST_MEMBER",
    "BuildDone",
    "BuildError",
    "BuildEvent",
    "BuildRequest",
    "BuildStarted",
    "StepCached",
    "StepDone",
    "StepOutput",
    "StepStarted",
    "decode_build_upload",
    "encode_build_upload",
    "ndjson_lines",
    "parse_event",
    "request_json",
]

REQUEST_MEMBER = ".dsec-build.json"
"""Name of the upload's first tar member: the :class:`BuildRequest` as JSON."""

DOCKERFILE_RUN_NETWORK = NetworkPolicy(presets=["debian", "pypi"])
"""The network of Dockerfile ``RUN`` steps unless the request sets ``run_network``."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")


def _format(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


class BuildRequest(BaseModel):
    """Build the image ``name`` (it belongs to the building key) from either ``steps``
    (the first one ``from_image`` or ``from_registry``), a ``dockerfile`` given as text, or
    ``dockerfile_path``, a Dockerfile in the context (``.dockerignore`` next to the context
    root applies to Dockerfile builds).

    Sandboxes of the build get ``cpu`` cores, ``memory_mb`` and ``disk_mb`` MiB (the
    writable layer is memory-backed: a step writing more than ``memory_mb`` fails), and each
    step at most ``step_timeout_s`` seconds. ``run_network``: the network of ``run`` steps
    that do not name their own; not given, spec builds run without a network and
    Dockerfile builds with the ``debian`` and ``pypi`` presets (:data:`DOCKERFILE_RUN_NETWORK`);
    ``null`` means none. ``no_cache`` rebuilds every step (and refreshes the cache);
    ``compress`` lz4-compresses the layers (smaller, slower to pack)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the image to make: name[:tag]")
    steps: list[Step] | None = Field(None, max_length=1024)
    dockerfile: str | None = Field(None, max_length=1 << 20, description="Dockerfile text")
    dockerfile_path: str | None = Field(
        None, max_length=4096, description="a Dockerfile of the context (e.g. 'Dockerfile')"
    )
    build_args: dict[str, str] = Field(default_factory=dict, max_length=1024)
    run_network: NetworkPolicy | None = None
    no_cache: bool = False
    compress: bool = True
    cpu: float = Field(1.0, ge=0.01, le=64, description="CPU cores per build sandbox")
    memory_mb: int = Field(4096, ge=64, le=1024 * 1024, description="MiB per build sandbox")
    disk_mb: int = Field(4096, ge=16, le=1024 * 1024, description="writable layer, MiB")
    step_timeout_s: float = Field(1800.0, gt=0, le=24 * 3600, description="per step, seconds")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                f"invalid image name {v!r}: [a-z0-9][a-z0-9._-]* with an optional :tag"
            )
        return v

    @field_validator("build_args")
    @classmethod
    def _build_args(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not ENV_NAME.match(k):
                raise ValueError(f"invalid build argument name {k!r}")
            if "\0" in val:
                raise ValueError(f"build argument {k!r} contains a NUL byte")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> BuildRequest:
        given = [
            f for f in ("steps", "dockerfile", "dockerfile_path") if getattr(self, f) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of steps, dockerfile (its text) or dockerfile_path"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    @property
    def is_dockerfile(self) -> bool:
        return self.steps is None

    def effective_run_network(self) -> NetworkPolicy | None:
        """``run_network`` as given, else the default of the build's kind."""
        if "run_network" in self.model_fields_set:
            return self.run_network
        return DOCKERFILE_RUN_NETWORK if self.is_dockerfile else None

    @classmethod
    def parse(cls, data: Any) -> BuildRequest:
        """Validate JSON-like ``data``; errors are ``InvalidRequest`` naming the fields."""
        try:
            if isinstance(data, str | bytes):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidRequest(f"invalid build request: {_format(e)}") from None


# --- events -------------------------------------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")


class BuildStarted(_Event):
    """The build was accepted: ``steps`` steps (the ``FROM`` included) on ``base``.
    ``notes``: what the builder decided for you (e.g. unused build arguments)."""

    type: Literal["start"] = "start"
    build_id: str
    name: str
    base: str
    steps: int
    notes: list[str] = Field(default_factory=list)


class StepStarted(_Event):
    """Step ``step`` of ``total`` (1 is the ``FROM``) begins."""

    type: Literal["step"] = "step"
    step: int
    total: int
    instruction: str
    line: int | None = None


class StepCached(_Event):
    """Step ``step`` is a cache hit: ``layer`` (None: the step changed nothing) is reused
    and no sandbox runs."""

    type: Literal["cached"] = "cached"
    step: int
    layer: str | None = None


class StepOutput(_Event):
    """A chunk of a running step's output (UTF-8, invalid bytes replaced)."""

    type: Literal["output"] = "output"
    step: int
    stream: Literal["stdout", "stderr"]
    data: str


class StepDone(_Event):
    """Step ``step`` finished: ``layer`` is the layer it added (None: it changed only the
    build state, or nothing), ``cached`` whether it came from the cache, ``duration_ms``
    its wall time, milliseconds."""

    type: Literal["step_done"] = "step_done"
    step: int
    layer: str | None = None
    cached: bool = False
    duration_ms: float = 0.0


class BuildDone(_Event):
    """The image is stored (it belongs to the building key). ``cached_steps`` /
    ``built_steps`` count the filesystem steps; ``duration_ms`` is the build's wall time."""

    type: Literal["done"] = "done"
    image: ImageInfo
    cached_steps: int = 0
    built_steps: int = 0
    duration_ms: float = 0.0

    @field_validator("image", mode="before")
    @classmethod
    def _lenient_image(cls, v: Any) -> Any:
        if isinstance(v, dict):  # a newer server's extra fields must not break this client
            return {k: val for k, val in v.items() if k in ImageInfo.model_fields}
        return v


class BuildError(_Event):
    """The build failed; nothing of the failing step was stored, its sandbox is gone, and
    no image was made. ``code`` is the wire code of the error (``build_failed``: a step's
    command failed; otherwise the error that stopped it, e.g. ``quota_exceeded``),
    ``step`` / ``instruction`` / ``line`` say where, ``output_tail`` the end of the step's
    output."""

    type: Literal["error"] = "error"
    code: str
    message: str
    step: int | None = None
    instruction: str | None = None
    line: int | None = None
    output_tail: str = ""
    details: dict[str, Any] = Field(default_factory=dict)

    def to_wire_error(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` body this event stands for (``details`` carry where)."""
        details = {
            **self.details,
            "step": self.step,
            "instruction": self.instruction,
            "line": self.line,
            "output_tail": self.output_tail,
        }
        return {"error": {"code": self.code, "message": self.message, "details": details}}


BuildEvent = Annotated[
    BuildStarted | StepStarted | StepCached | StepOutput | StepDone | BuildDone | BuildError,
    Field(discriminator="type"),
]
"""One line of a build's event stream (a tagged union on ``type``)."""

_EVENT_TYPES: dict[str, type[_Event]] = {
    "start": BuildStarted,
    "step": StepStarted,
    "cached": StepCached,
    "output": StepOutput,
    "step_done": StepDone,
    "done": BuildDone,
    "error": BuildError,
}


def parse_event(line: str | bytes) -> _Event | None:
    """One NDJSON line as its event; None for an event type this client does not know (a
    newer server's) and for blank lines. Raises ``InvalidRequest`` for a malformed line."""
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except ValueError as e:
        raise InvalidRequest(f"malformed build event: {e}") from None
    cls = _EVENT_TYPES.get(str(data.get("type"))) if isinstance(data, dict) else None
    if cls is None:
        return None
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise InvalidRequest(f"malformed {data.get('type')} build event: {_format(e)}") from None


async def ndjson_lines(first: _Event, rest: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The response body of ``POST /v1/builds``: ``first`` (already taken from the build's
    iterator, so that errors before it became an HTTP error) and then the rest, one JSON
    line each."""
    yield first.model_dump_json().encode() + b"\n"
    async for event in rest:
        yield event.model_dump_json().encode() + b"\n"


# --- upload framing -------------------------------------------------------------------------

_BLOCK = 512


def request_json(req: BuildRequest) -> dict[str, Any]:
    """``req`` as JSON data: the fields that were set (so that an unset ``run_network`` keeps
    its default meaning), every step in full (its ``op`` included)."""
    data = req.model_dump(mode="json", exclude_unset=True)
    if req.steps is not None:
        data["steps"] = [s.model_dump(mode="json", exclude_none=True) for s in req.steps]
    return data


def encode_build_upload(req: BuildRequest, context: bytes = b"") -> bytes:
    """The ``POST /v1/builds`` body: a tar member :data:`REQUEST_MEMBER` holding ``req``,
    followed by the members of ``context`` (an uncompressed tar, or empty)."""
    body = json.dumps(request_json(req), separators=(",", ":")).encode()
    info = tarfile.TarInfo(REQUEST_MEMBER)
    info.size = len(body)
    info.mode = 0o644
    header = info.tobuf(format=tarfile.PAX_FORMAT)
    padding = b"\0" * (-len(body) % _BLOCK)
    if context and not _is_plain_tar(context):
        raise InvalidRequest("the build context must be an uncompressed tar archive")
    tail = context if context else b"\0" * (2 * _BLOCK)
    return header + body + padding + tail


def _is_plain_tar(data: bytes) -> bool:
    return len(data) >= 2 * _BLOCK and (
        data[257:262] == b"ustar" or data[:_BLOCK] == b"\0" * _BLOCK
    )


def decode_build_upload(body: bytes) -> tuple[BuildRequest, bytes]:
    """Split a ``POST /v1/builds`` body into the request and the context (a tar of the
    members after the first; empty bytes when there are none). Raises ``InvalidRequest``."""
    try:
        tf = tarfile.open(fileobj=io.BytesIO(body), mode="r:")
        first = tf.next()
    except (tarfile.TarError, EOFError) as e:
        raise InvalidRequest(
            f"the build upload is not a tar archive starting with {REQUEST_MEMBER}: {e}"
        ) from None
    if first is None or first.name.removeprefix("./") != REQUEST_MEMBER or not first.isreg():
        raise InvalidRequest(
            f"the build upload's first tar member must be {REQUEST_MEMBER} (the build request)"
        )
    if first.size > 4 << 20:
        raise InvalidRequest(f"{REQUEST_MEMBER} is larger than 4 MiB")
    raw = body[first.offset_data : first.offset_data + first.size]
    req = BuildRequest.parse(raw)
    rest = body[tf.offset :]
    if not rest.strip(b"\0"):
        return req, b""
    return req, rest
