"""Image builds: one engine behind the SDK builder, Dockerfiles and the HTTP API.

Modules (each one thing):

* :mod:`dsec.builds.steps`: the step model (``from_image``, ``run``, ``apt_install``,
  ``pip_install``, ``copy``, ``env``, ``arg``, ``workdir``, ``user``, ``cmd``, ...);
* :mod:`dsec.builds.dockerfile`: single-stage Dockerfiles parsed into those steps;
* :mod:`dsec.builds.context`: the uploaded build context, indexed, and ``.dockerignore``;
* :mod:`dsec.builds.plan`: build state and cache keys of every step, before anything runs;
* :mod:`dsec.builds.cache`: the per-owner step cache (SQLite) and how keys are made;
* :mod:`dsec.builds.copy_layer`: ``copy`` layers built straight from the context files;
* :mod:`dsec.builds.engine`: :class:`ImageBuilder`, which runs builds through an edge;
* :mod:`dsec.builds.wire`: the request, the streamed events and ``POST /v1/builds`` framing;
* :mod:`dsec.images.config`: the OCI-shaped image config builds record.

The SDK side is :class:`dsec.Image` (``dsec.sdk.image``). Design: ``docs/design/builds.md``.
Importing this package does not import the engine (nor the layer store): the SDK uses the
step and wire models without the server's modules.
"""

from typing import TYPE_CHECKING, Any

from dsec.builds.dockerfile import Dockerfile, parse_dockerfile
from dsec.builds.steps import (
    AptInstall,
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Expose,
    FromImage,
    FromRegistry,
    InlineFile,
    Label,
    PipInstall,
    Run,
    StartCmd,
    Step,
    User,
    Workdir,
)
from dsec.builds.wire import (
    BuildDone,
    BuildError,
    BuildEvent,
    BuildRequest,
    BuildStarted,
    StepCached,
    StepDone,
    StepOutput,
    StepStarted,
    decode_build_upload,
    encode_build_upload,
    ndjson_lines,
    parse_event,
)
from dsec.images.config import ImageConfig, StartCommand

if TYPE_CHECKING:
    from dsec.builds.cache import BuildCache
    from dsec.builds.engine import BuildLimits, ImageBuilder

__all__ = [
    "AptInstall",
    "Arg",
    "BuildCache",
    "BuildDone",
    "BuildError",
    "BuildEvent",
    "BuildLimits",
    "BuildRequest",
    "BuildStarted",
    "Cmd",
    "Copy",
    "Dockerfile",
    "Entrypoint",
    "Env",
    "Expose",
    "FromImage",
    "FromRegistry",
    "ImageBuilder",
    "ImageConfig",
    "InlineFile",
    "Label",
    "PipInstall",
    "Run",
    "StartCmd",
    "StartCommand",
    "Step",
    "StepCached",
    "StepDone",
    "StepOutput",
    "StepStarted",
    "User",
    "Workdir",
    "decode_build_upload",
    "encode_build_upload",
    "ndjson_lines",
    "parse_dockerfile",
    "parse_event",
]

_LAZY = {
    "BuildCache": "dsec.builds.cache",
    "BuildLimits": "dsec.builds.engine",
    "ImageBuilder": "dsec.builds.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec.builds' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
