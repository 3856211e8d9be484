"""The dsec error tree: one hierarchy for the SDK, the apiserver and the edge.

Every error a client can see is a :class:`DsecError`. Each class has a stable
wire ``code`` and the HTTP status the apiserver answers with; the SDK maps a
JSON error body (``{"error": {"code", "message", "details"}}``) back to the
same class, so an exception raised on the edge arrives intact in the trainer.
Where an error resembles a builtin it also subclasses it, so ``except
TimeoutError`` or ``except LookupError`` work as expected::

    DsecError
    ├── InvalidRequest (ValueError)              400 invalid_request
    │   ├── PathOutsideSandbox                   400 path_outside_sandbox
    │   └── SecretInSnapshot                     400 secret_in_snapshot
    ├── AuthenticationError (PermissionError)    401 unauthenticated
    ├── NotFound (LookupError)                   404 not_found
    │   ├── SandboxNotFound                      404 sandbox_not_found
    │   ├── ImageNotFound                        404 image_not_found
    │   ├── LayerNotFound                        404 layer_not_found
    │   └── FileNotFound (FileNotFoundError)     404 file_not_found
    ├── SandboxTimeout (TimeoutError)            408 timeout
    ├── Conflict                                 409 conflict
    │   ├── SandboxStopped                       409 sandbox_stopped
    │   ├── FileExists_ (FileExistsError)        409 file_exists
    │   ├── SequenceGap                          409 sequence_gap
    │   ├── SequenceConflict                     409 sequence_conflict
    │   ├── OutcomeUnknown                       409 outcome_unknown
    │   └── DisplayNotRunning                    409 display_not_running
    ├── PayloadTooLarge                          413 payload_too_large
    ├── BuildFailed                              422 build_failed
    ├── StartFailed                              422 start_failed
    ├── Unsupported                              422 unsupported
    │   ├── TierUnavailable                      422 tier_unavailable
    │   └── CapabilityNotSupported               422 capability_not_supported
    ├── QuotaExceeded                            429 quota_exceeded
    │   └── TooManyConnections                   429 too_many_connections
    ├── BadGateway                               502 bad_gateway
    │   └── PortNotListening (ConnectionRefusedError) 502 port_not_listening
    ├── SandboxError                             500 sandbox_error
    │   │ (the runtime failed to do what was asked, e.g. the OCI runtime crashed)
    │   └── BlobDigestMismatch                   502 blob_digest_mismatch
    ├── RegistryUnauthorized (PermissionError)   403 registry_unauthorized
    ├── PermissionDenied (PermissionError)       403 permission_denied
    ├── ServiceUnavailable (ConnectionError)     503 unavailable
    │   ├── RegistryUnavailable                  503 registry_unavailable
    │   ├── ImageNotReady                        503 image_not_ready
    │   └── NodeBusy                             503 node_busy
    └── InternalError                            500 internal

``Unsupported`` means a tier cannot do something at all (and its capability
flag says so); ``SandboxError`` means it should have worked and did not.

Server paths never reach a client: a server registers its state directories with
:func:`dsec.serverpaths.hide_server_path` (``dsec serve`` registers ``$DSEC_HOME``), and every wire form
of an error (:meth:`DsecError.to_wire`, :attr:`DsecError.public_message`) shows them as
their placeholder (``$DSEC_HOME/sandboxes/sb-.../rootfs``). The exception itself keeps the
real path for the server's log.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dsec.serverpaths import scrub_server_paths

__all__ = [
    "AuthenticationError",
    "BadGateway",
    "BlobDigestMismatch",
    "BuildFailed",
    "CapabilityNotSupported",
    "Conflict",
    "CreationRateExceeded",
    "DisplayNotRunning",
    "DsecError",
    "FileExists_",
    "FileNotFound",
    "ImageNotFound",
    "ImageNotReady",
    "InternalError",
    "InvalidRequest",
    "LayerNotFound",
    "NodeBusy",
    "NodeLost",
    "NotFound",
    "OutcomeUnknown",
    "PathOutsideSandbox",
    "PayloadTooLarge",
    "PermissionDenied",
    "PortNotListening",
    "QuotaExceeded",
    "RegistryUnauthorized",
    "RegistryUnavailable",
    "SandboxError",
    "SandboxNotFound",
    "SandboxStopped",
    "SandboxTimeout",
    "SecretInSnapshot",
    "SequenceConflict",
    "SequenceGap",
    "ServiceUnavailable",
    "StartFailed",
    "TierUnavailable",
    "TooManyConnections",
    "Unsupported",
    "error_from_wire",
]


class DsecError(Exception):
    """Base of every dsec error.

    Attributes:
        message: human-readable explanation.
        details: machine-readable extra fields (ids, limits, paths).
    """

    code: ClassVar[str] = "error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details: dict[str, Any] = details

    @property
    def public_message(self) -> str:
        """``message`` as a client may see it (server paths hidden, see the module doc)."""
        text: str = scrub_server_paths(self.message)
        return text

    def to_wire(self) -> dict[str, Any]:
        """The JSON body the apiserver sends for this error (server paths hidden)."""
        return {
            "error": {
                "code": self.code,
                "message": self.public_message,
                "details": scrub_server_paths(self.details),
            }
        }

    def __reduce__(self) -> tuple[Any, ...]:  # survives pickling (Ray, multiprocessing)
        return (_rebuild, (type(self), self.message, self.details))


def _rebuild(cls: type[DsecError], message: str, details: dict[str, Any]) -> DsecError:
    return cls(message, **details)


class InvalidRequest(DsecError, ValueError):
    """The request is malformed or asks for something impossible (bad limits, bad path)."""

    code = "invalid_request"
    http_status = 400


class PathOutsideSandbox(InvalidRequest):
    """A file path resolves outside the sandbox's root (``..``, absolute symlinks)."""

    code = "path_outside_sandbox"


class SecretInSnapshot(InvalidRequest):
    """A file that would enter a snapshot contains one of the builder's secret values."""

    code = "secret_in_snapshot"


class AuthenticationError(DsecError, PermissionError):
    """Missing or invalid API key."""

    code = "unauthenticated"
    http_status = 401


class NotFound(DsecError, LookupError):
    """A named object does not exist (or belongs to another API key)."""

    code = "not_found"
    http_status = 404


class SandboxNotFound(NotFound):
    """No sandbox with this id is visible to this key."""

    code = "sandbox_not_found"


class NodeLost(SandboxNotFound):
    """The node holding this sandbox was lost (cluster mode: Ray reported it dead, or its
    edge stopped answering): the sandbox is gone. ``details.node`` names the node."""

    code = "node_lost"


class ImageNotFound(NotFound):
    """No image with this name or digest exists in the layer store."""

    code = "image_not_found"


class LayerNotFound(NotFound):
    """No layer with this digest exists in the layer store."""

    code = "layer_not_found"


class FileNotFound(NotFound, FileNotFoundError):
    """The path does not exist inside the sandbox."""

    code = "file_not_found"


class SandboxTimeout(DsecError, TimeoutError):
    """A request did not finish in time (creation, a file transfer, a wait)."""

    code = "timeout"
    http_status = 408


class Conflict(DsecError):
    """The request is valid but not in the object's current state."""

    code = "conflict"
    http_status = 409


class SandboxStopped(Conflict):
    """The sandbox was killed, expired or died; it can no longer run anything."""

    code = "sandbox_stopped"


class FileExists_(Conflict, FileExistsError):
    """The path already exists and the request asked not to overwrite it."""

    code = "file_exists"


class SequenceGap(Conflict):
    """A trajectory sequence number skips ahead of the next expected one (a request was lost).
    ``details['expected_seq']`` is the number the edge expects next."""

    code = "sequence_gap"


class SequenceConflict(Conflict):
    """A sequence number (or idempotency key) was reused for a different request."""

    code = "sequence_conflict"


class OutcomeUnknown(Conflict):
    """The request was begun but its result was never recorded (the edge crashed while it
    ran). It is not re-run: the caller must inspect the sandbox."""

    code = "outcome_unknown"


class DisplayNotRunning(Conflict):
    """The sandbox runs but its desktop does not: no X server answers on the display (it
    died, or its start command ended). ``sb.display.restart()`` starts it again.
    ``details``: ``sandbox_id``, ``display``."""

    code = "display_not_running"


class PayloadTooLarge(DsecError):
    """An upload, a file write or a request body exceeds the configured limit."""

    code = "payload_too_large"
    http_status = 413


class BuildFailed(DsecError):
    """An image build stopped because a step's command failed (a non-zero exit, a signal,
    its timeout, out of memory). ``details``: ``step`` (1 is the ``FROM``), ``instruction``,
    ``line`` (Dockerfile builds), ``output_tail`` (the end of the step's output) and
    ``exit_code``. Nothing of that step was stored and no image was made."""

    code = "build_failed"
    http_status = 422


class StartFailed(DsecError):
    """A sandbox's image start command failed: it exited non-zero before its readiness
    check passed, or the check did not pass in time. The sandbox was killed. ``details``:
    ``sandbox_id``, ``exit_code`` (when it exited), ``logs_tail`` (the end of its output)."""

    code = "start_failed"
    http_status = 422


class Unsupported(DsecError):
    """The tier or the node cannot do this at all (see the tier's capability table)."""

    code = "unsupported"
    http_status = 422


class TierUnavailable(Unsupported):
    """The requested tier is not built or not enabled on this node."""

    code = "tier_unavailable"


class CapabilityNotSupported(Unsupported):
    """The tier exists but lacks this ability (e.g. a TTY on ``fncall``)."""

    code = "capability_not_supported"


class QuotaExceeded(DsecError):
    """A per-key or per-node limit (sandbox count, CPU, memory) would be exceeded."""

    code = "quota_exceeded"
    http_status = 429


class CreationRateExceeded(QuotaExceeded):
    """The key created sandboxes faster than its ``creations_per_s`` quota allows. Nothing
    was created; retry after ``details["retry_after_s"]`` seconds (the SDK does, until its
    time-out)."""

    code = "creation_rate_exceeded"


class TooManyConnections(QuotaExceeded):
    """A sandbox already has as many proxied connections to its ports open as its node
    allows (``DSEC_MAX_PORT_CONNECTIONS``); retry when some are closed."""

    code = "too_many_connections"


class BadGateway(DsecError):
    """A server inside a sandbox, reached through the port proxy, did not answer as the
    protocol requires (it closed without answering, or sent something that is not HTTP)."""

    code = "bad_gateway"
    http_status = 502


class PortNotListening(BadGateway, ConnectionRefusedError):
    """Nothing inside the sandbox accepts TCP connections on the port asked for (the
    connection was refused or reset before it was established). The proxy answers 502."""

    code = "port_not_listening"
    http_status = 502


class SandboxError(DsecError):
    """The runtime failed to carry out a valid request (e.g. the OCI runtime crashed)."""

    code = "sandbox_error"
    http_status = 500


class ServiceUnavailable(DsecError, ConnectionError):
    """The apiserver or the edge cannot be reached or is shutting down."""

    code = "unavailable"
    http_status = 503


class BlobDigestMismatch(SandboxError):
    """A blob or manifest from a registry does not hash to its digest (or has the wrong size,
    or its content does not match the image config). It is refused and nothing is stored."""

    code = "blob_digest_mismatch"
    http_status = 502


class RegistryUnauthorized(DsecError, PermissionError):
    """An image registry refused the credentials (or anonymous access) for a repository.
    Not about the dsec API key: that is ``AuthenticationError``."""

    code = "registry_unauthorized"
    http_status = 403


class RegistryUnavailable(ServiceUnavailable):
    """An image registry could not be reached, broke a connection, sent a truncated body or
    answered with a server error. Nothing was stored."""

    code = "registry_unavailable"


class ImageNotReady(ServiceUnavailable):
    """The image is still being built (a built-in image right after the node started) and
    did not finish within the request's wait. Retry after ``details["retry_after_s"]``
    seconds; ``details`` also say what the build is doing (``phase``, ``elapsed_s``).
    Nothing was created."""

    code = "image_not_ready"


class NodeBusy(ServiceUnavailable):
    """The node could not start the creation now: its admission queue is full, the creation
    waited too long for a slot, or the kernel did not finish starting the container in time;
    or a ``run_code`` worker did not answer within the call's time limits and a grace (a
    saturated node). Nothing was created or is left; retry after
    ``details["retry_after_s"]`` seconds (the SDK does, for creations, until its time-out)."""

    code = "node_busy"


class PermissionDenied(DsecError, PermissionError):
    """The key is valid but may not do this (e.g. publish a system image: only the
    operator's key may)."""

    code = "permission_denied"
    http_status = 403


class InternalError(DsecError):
    """A bug in dsec. Reported with a request id; never expected."""

    code = "internal"
    http_status = 500


def _all_subclasses(cls: type[DsecError]) -> list[type[DsecError]]:
    out: list[type[DsecError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[DsecError]] = {c.code: c for c in _all_subclasses(DsecError)}
_BY_STATUS: dict[int, type[DsecError]] = {
    400: InvalidRequest,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFound,
    408: SandboxTimeout,
    409: Conflict,
    413: PayloadTooLarge,
    422: Unsupported,
    429: QuotaExceeded,
    503: ServiceUnavailable,
    504: SandboxTimeout,
}


def error_from_wire(status: int, body: Any) -> DsecError:
    """Rebuild the most specific :class:`DsecError` from an HTTP status and JSON body."""
    code, message = None, ""
    details: dict[str, Any] = {}
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = err.get("code")
        message = str(err.get("message", ""))
        details = err.get("details") or {}
    elif isinstance(body, dict) and "detail" in body:  # FastAPI default shape
        message = str(body["detail"])
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status) or InternalError
    if not isinstance(details, dict):
        details = {"details": details}
    err_obj = cls(message or f"HTTP {status}", **details)
    return err_obj
