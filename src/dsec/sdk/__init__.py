"""The dsec Python SDK: one async implementation and a sync wrapper generated from it."""

from dsec.sdk import jobs
from dsec.sdk.client import AsyncClient
from dsec.sdk.group import AsyncSandboxGroup
from dsec.sdk.image import Image
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
