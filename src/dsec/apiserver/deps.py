"""FastAPI dependencies shared by the route modules: the edge and the caller's owner id,
and :data:`ERROR_RESPONSES`, the error statuses every ``/v1`` route documents (each
:mod:`dsec.errors` class answers its ``http_status``; routes add their own with
``responses=``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dsec.apiserver.schemas import (
    IDEMPOTENCY_HEADER,
    IDEMPOTENCY_KEY_PATTERN,
    SEQ_HEADER,
    ErrorBody,
)
from dsec.contract.edge import EdgeAPI
from dsec.contract.verbs import Envelope
from dsec.errors import AuthenticationError, PermissionDenied
from dsec.models import SYSTEM_OWNER

__all__ = [
    "ERROR_RESPONSES",
    "MAX_SEQ",
    "CreateKey",
    "Edge",
    "Owner",
    "Seq",
    "acting_owner",
    "bearer_scheme",
    "create_key",
    "current_owner",
    "envelope",
    "get_edge",
]

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="`Authorization: Bearer dsec_...`; the server's first key is in $DSEC_HOME/api_key",
)


async def current_owner(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)],
) -> str:
    """The owner id the auth middleware attached to this request."""
    owner = request.scope.get("state", {}).get("owner")
    if not owner:  # the middleware guards every /v1 path; this is belt and braces
        raise AuthenticationError("missing API key")
    return str(owner)


async def get_edge(request: Request) -> EdgeAPI:
    """The edge this app was created with."""
    edge: EdgeAPI = request.app.state.edge
    return edge


def acting_owner(request: Request, owner: str, system: bool, what: str) -> str:
    """The owner an image operation acts as: the caller, or the system for ``system=true``,
    which only the operator's key may ask for (``PermissionDenied`` for any other key)."""
    if not system:
        return owner
    if not request.app.state.keys.is_operator(owner):
        raise PermissionDenied(
            f"only the operator's key may {what} system images (they are read-only to keys)"
        )
    return SYSTEM_OWNER


Owner = Annotated[str, Depends(current_owner)]
Edge = Annotated[EdgeAPI, Depends(get_edge)]

_ERR: dict[str, Any] = {"model": ErrorBody}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERR, "description": "invalid_request (field errors in details.errors)"},
    401: {**_ERR, "description": "unauthenticated"},
    404: {**_ERR, "description": "not found (or another key's)"},
    408: {**_ERR, "description": "timeout: the sandbox did not answer in time"},
    409: {
        **_ERR,
        "description": "conflict: sandbox_stopped, file_exists, sequence_gap, "
        "sequence_conflict, outcome_unknown",
    },
    413: {**_ERR, "description": "payload_too_large"},
    422: {**_ERR, "description": "unsupported by this tier or node"},
    429: {**_ERR, "description": "quota_exceeded: a per-key or per-node limit"},
    500: {**_ERR, "description": "sandbox_error or internal"},
    503: {**_ERR, "description": "unavailable: the edge is unreachable or shutting down"},
}


MAX_SEQ = (1 << 63) - 1
"""Largest sequence number (SQLite's INTEGER range)."""


async def envelope(
    seq: Annotated[
        int | None,
        Header(
            alias=SEQ_HEADER,
            ge=1,
            le=MAX_SEQ,
            description="per-sandbox trajectory sequence number of this call (1, 2, 3, ...)",
        ),
    ] = None,
    idem_key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_HEADER,
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="client-chosen key; a repeat returns the recorded result",
        ),
    ] = None,
) -> Envelope:
    """Parse ``X-Dsec-Seq`` and ``Idempotency-Key`` (malformed: 400 before the edge)."""
    return Envelope(seq=seq, idem_key=idem_key)


Seq = Annotated[Envelope, Depends(envelope)]
"""The trajectory envelope of a state-changing request."""


async def create_key(
    idem_key: Annotated[
        str | None,
        Header(
            alias=IDEMPOTENCY_HEADER,
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="client-chosen key: a repeat of this creation makes no second "
            "sandbox (answers the first one's)",
        ),
    ] = None,
) -> Envelope:
    """The ``Idempotency-Key`` of a creation (malformed: 400 before the edge)."""
    return Envelope(idem_key=idem_key)


CreateKey = Annotated[Envelope, Depends(create_key)]
"""The idempotency key of a creation (no sequence number: the sandbox does not exist yet)."""
