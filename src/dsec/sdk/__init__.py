"""The dsec Python SDK: one async implementation and a sync wrapper generated from it."""

from dsec.sdk.client import AsyncClient
from dsec.sdk.sandbox import AsyncCommands, AsyncFiles, AsyncSandbox, CommandResult
from dsec.sdk.sync_api import Client, Commands, Files, Sandbox

__all__ = [
    "AsyncClient",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncSandbox",
    "Client",
    "CommandResult",
    "Commands",
    "Files",
    "Sandbox",
]
