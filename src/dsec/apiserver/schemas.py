"""Wire-only models of the HTTP API (envelopes and small request bodies).

The domain models live in :mod:`dsec.models`; these only wrap lists in objects (so the
API can add fields later) and describe the error body for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from dsec.contract.verbs import IDEMPOTENCY_KEY_PATTERN, REPLAYED_HEADER
from dsec.models import IMAGE_REF_PATTERN, CapabilityList, ImageList, LayerList, SandboxList

__all__ = [
    "IDEMPOTENCY_HEADER",
    "IDEMPOTENCY_KEY_PATTERN",
    "IMAGE_REF_PATTERN",
    "JOB_PATTERN",
    "REPLAYED_HEADER",
    "SANDBOX_ID_PATTERN",
    "SANDBOX_PATH_PATTERN",
    "SEQ_HEADER",
    "CapabilityList",
    "ErrorBody",
    "ErrorDetail",
    "ImageList",
    "LayerList",
    "SandboxList",
    "SandboxPath",
    "TarUploadResult",
]

SANDBOX_ID_PATTERN = r"^sb-[a-z0-9-]{1,64}$"
"""Sandbox ids: ``sb-<node>-<random>``, lowercase, at most 67 characters."""

SANDBOX_PATH_PATTERN = r"^/[^\x00]{0,4095}$"
"""Paths inside a sandbox: absolute, no NUL byte, at most 4096 characters."""

IMAGE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$"
"""Names an image can be given: ``name[:tag]``."""

JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""Job ids (``CreateSandboxRequest.job``): letters, digits, ``._:-``, at most 128 characters."""

"""Idempotency keys: 1..256 printable ASCII characters, no spaces."""

SEQ_HEADER = "X-Dsec-Seq"
"""Request header: the per-sandbox trajectory sequence number of a state-changing call."""

IDEMPOTENCY_HEADER = "Idempotency-Key"
"""Request header: a client-chosen key; a repeat returns the recorded result."""

SandboxPath = Annotated[str, Field(pattern=SANDBOX_PATH_PATTERN, description="absolute path")]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Wire):
    code: str = Field(description="stable error code, e.g. 'sandbox_not_found'")
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(_Wire):
    """Every non-2xx response has this body."""

    error: ErrorDetail


class TarUploadResult(_Wire):
    files: int = Field(description="number of archive members written")


class Health(_Wire):
    status: str
    version: str
