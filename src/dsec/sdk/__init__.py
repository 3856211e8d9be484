"""The dsec Python SDK: one async implementation and a sync wrapper generated from it."""

from dsec.sdk import jobs
from dsec.sdk.client import AsyncClient
from dsec.sdk.jobs import AsyncJobs, Jobs
from dsec.sdk.sandbox import AsyncCommands, AsyncFiles, AsyncSandbox, CommandResult
from dsec.sdk.sync_api import Client, Commands, Files, Sandbox

__all__ = [
    "AsyncClient",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncJobs",
    "AsyncSandbox",
    "Client",
    "CommandResult",
    "Commands",
    "Files",
    "Jobs",
    "Sandbox",
    "jobs",
]
