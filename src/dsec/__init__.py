"""dsec: sandbox infrastructure for agentic RL.

One SDK over four isolation tiers (``fncall``, ``container``, ``microvm``, ``vm``)::

    from dsec import Sandbox

    with Sandbox.create(tier="container", image="busybox") as sb:
        result = sb.commands.run("echo hello")
        assert result.ok and result.stdout == "hello\\n"

The async API is the same with ``await``: :class:`AsyncSandbox`, :class:`AsyncClient`.
Every error is a :class:`DsecError` (see :mod:`dsec.errors` for the tree).

Whole training jobs (every sandbox created with ``job="run-42"``) are paused, resumed,
killed or listed through :mod:`dsec.jobs`: ``from dsec import jobs; jobs.pause("run-42")``
(sync), or ``dsec.jobs.AsyncJobs`` (async).

Images are built from steps or a Dockerfile, cached step by step::

    from dsec import Image

    image = Image.from_image("debian").apt_install("git").pip_install("pytest").copy("./src", "/app")
    image.build("app:1")                          # then Sandbox.create(image="app:1")

Sandboxes have no network unless created with a :class:`NetworkPolicy`
(``Sandbox.create(network={"allow_domains": ["pypi.org"]})``); ``sb.network.update(...)``
changes it while the sandbox runs and ``sb.network.stats()`` reports what was allowed and
blocked.
"""

import sys
from typing import TYPE_CHECKING, Any

from dsec.errors import (
    AuthenticationError,
    BadGateway,
    BlobDigestMismatch,
    BuildFailed,
    CapabilityNotSupported,
    Conflict,
    CreationRateExceeded,
    DisplayNotRunning,
    DsecError,
    FileExists_,
    FileNotFound,
    ImageNotFound,
    ImageNotReady,
    InternalError,
    InvalidRequest,
    LayerNotFound,
    NodeBusy,
    NodeLost,
    NotFound,
    OutcomeUnknown,
    PathOutsideSandbox,
    PayloadTooLarge,
    PermissionDenied,
    PortNotListening,
    QuotaExceeded,
    RegistryUnauthorized,
    RegistryUnavailable,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    SandboxTimeout,
    SecretInSnapshot,
    SequenceConflict,
    SequenceGap,
    ServiceUnavailable,
    StartFailed,
    TierUnavailable,
    TooManyConnections,
    Unsupported,
)
from dsec.models import (
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ImageInfo,
    KeyInfo,
    KeyQuota,
    KeyUsage,
    LayerInfo,
    LogLine,
    NodeInfo,
    SandboxInfo,
    SandboxMetrics,
)
from dsec.network.policy import NetworkPolicy
from dsec.sdk import (
    AsyncClient,
    AsyncSandbox,
    Client,
    CommandResult,
    Sandbox,
    jobs,
)
from dsec.version import __version__

# `import dsec.jobs` and `from dsec.jobs import AsyncJobs` work like a real submodule.
sys.modules.setdefault("dsec.jobs", jobs)

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AuthenticationError",
    "BadGateway",
    "BlobDigestMismatch",
    "BuildFailed",
    "Capabilities",
    "CapabilityNotSupported",
    "Client",
    "CommandResult",
    "Conflict",
    "CreateSandboxRequest",
    "CreationRateExceeded",
    "DisplayNotRunning",
    "DsecError",
    "ExecEvent",
    "ExecRequest",
    "ExecResult",
    "FileExists_",
    "FileInfo",
    "FileNotFound",
    "Image",
    "ImageInfo",
    "ImageNotFound",
    "ImageNotReady",
    "InternalError",
    "InvalidRequest",
    "KeyInfo",
    "KeyQuota",
    "KeyUsage",
    "LayerInfo",
    "LayerNotFound",
    "LogLine",
    "NetworkPolicy",
    "NodeBusy",
    "NodeInfo",
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
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandboxMetrics",
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
    "__version__",
]

if TYPE_CHECKING:
    from dsec.sdk.image import Image


def __getattr__(name: str) -> Any:
    """``dsec.Image`` on first use (see :func:`dsec.sdk.__getattr__`)."""
    if name == "Image":
        from dsec.sdk.image import Image

        return Image
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
