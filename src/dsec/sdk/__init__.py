"""The dsec Python SDK: one async implementation and a sync wrapper generated from it."""

from typing import TYPE_CHECKING, Any

from dsec.sdk import jobs
from dsec.sdk.client import AsyncClient
from dsec.sdk.group import AsyncSandboxGroup
from dsec.sdk.jobs import AsyncJobs
from dsec.sdk.sandbox import (
    AsyncCommands,
    AsyncFiles,
    AsyncNetwork,
    AsyncSandbox,
    AsyncSandboxBatch,
    CommandResult,
)
from dsec.sdk.sync_api import (
    Client,
    Commands,
    Files,
    Jobs,
    Network,
    Sandbox,
    SandboxBatch,
    SandboxGroup,
)

__all__ = [
    "AsyncClient",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncJobs",
    "AsyncNetwork",
    "AsyncSandbox",
    "AsyncSandboxBatch",
    "AsyncSandboxGroup",
    "Client",
    "CommandResult",
    "Commands",
    "Files",
    "Image",
    "Jobs",
    "Network",
    "Sandbox",
    "SandboxBatch",
    "SandboxGroup",
    "jobs",
]

if TYPE_CHECKING:
    from dsec.sdk.image import Image


def __getattr__(name: str) -> Any:
    """``Image`` on first use: the image builder's modules (Dockerfile parsing, the build
    wire) are a sixth of ``import dsec`` and most programs never build an image."""
    if name == "Image":
        from dsec.sdk.image import Image

        return Image
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
