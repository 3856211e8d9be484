"""The ``dsec`` sandbox's configuration: one sandbox, or several named ones per sample.

A task names it as ``sandbox=("dsec", CONFIG)``, where ``CONFIG`` is a
:class:`DsecSandboxConfig`, the path of a YAML or JSON file holding one, or the path of a
Dockerfile (the sandbox's image is built from it). ``sandbox="dsec"`` alone looks for
``dsec.yaml``, ``dsec.yml`` or ``dsec.json`` beside the task, else uses the defaults (one
``debian`` sandbox on the container tier). Sizes in MiB, times in seconds::

    # dsec.yaml
    tier: container          # the default of every sandbox below
    memory_mb: 2048
    sandboxes:
      default: {dockerfile: Dockerfile, network: {presets: [pypi]}}
      victim: {image: "127.0.0.1:5000/webapp:1", tier: microvm}

Each entry of ``sandboxes`` takes the top-level fields as defaults. The default sandbox
(what ``sandbox()`` returns) is the one named ``default`` or the one with ``default:
true``, as inspect's Docker Compose services (``x-default``). Relative ``dockerfile`` and
``context`` paths are relative to the config file (the working directory for a config
object). The server and the key come from ``DSEC_URL`` and ``DSEC_API_KEY`` (or
``$DSEC_HOME/api_key``) as for the SDK: a config never holds a key (it is written into the
eval log).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from dsec.integrations._fields import SandboxFields
from dsec.sdk.sandbox import CREATE_TIMEOUT_S

__all__ = [
    "CONFIG_FILES",
    "DEFAULT_IMAGE",
    "DsecSandboxConfig",
    "DsecSandboxSpec",
    "load_config",
]

DEFAULT_IMAGE = "debian"
CONFIG_FILES = ["dsec.yaml", "dsec.yml", "dsec.json"]
"""Looked for beside the task when it names ``sandbox="dsec"`` without a config."""

_SPEC_PATHS = ("dockerfile", "context")


class DsecSandboxSpec(SandboxFields):
    """One sandbox of a sample (``tier``, sizes, ``network``, ``labels``:
    :class:`~dsec.integrations._fields.SandboxFields`; the ``inspect.*`` labels are the
    provider's own). Sizes in MiB, times in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = None
    """A dsec image (``debian``, ``busybox``, one built with ``dsec image build``) or a
    registry reference (``python:3.12``, ``127.0.0.1:5000/repo:tag``); default ``debian``."""
    dockerfile: str | None = None
    """A Dockerfile to build the image from, with dsec's image builds (each step a cached
    layer of the key: an unchanged Dockerfile builds nothing). Exclusive with ``image``."""
    context: str | None = None
    """The Dockerfile's build context directory (default: the Dockerfile's directory)."""
    build_args: dict[str, str] = {}
    """The Dockerfile's ``ARG`` values."""
    env: dict[str, str] = {}
    """Environment of every command (over the image's)."""
    user: str | None = None
    """Default user of commands (default: the image's ``USER``, else root)."""
    workdir: str | None = None
    """Working directory: of commands, and what relative paths are relative to (default:
    the image's ``WORKDIR``, else ``/``); made if missing."""
    full_guest: bool = False
    """``microvm``/``vm``: commands get the whole guest (dsec's ``full_guest``)."""
    default: bool = False
    """This is the sample's default sandbox (``sandbox()``)."""

    @model_validator(mode="after")
    def _one_source(self) -> DsecSandboxSpec:
        if self.image is not None and self.dockerfile is not None:
            raise ValueError("give image or dockerfile, not both")
        return self

    def build_key(self) -> str:
        """What the built image depends on: the Dockerfile's text, its context directory and
        the build arguments (hex digest). Reads the Dockerfile: call it in a thread."""
        assert self.dockerfile is not None
        h = hashlib.sha256(Path(self.dockerfile).read_bytes())
        h.update(json.dumps([self.build_context(), sorted(self.build_args.items())]).encode())
        return h.hexdigest()

    def build_context(self) -> str:
        assert self.dockerfile is not None
        return self.context or str(Path(self.dockerfile).parent)


class DsecSandboxConfig(DsecSandboxSpec):
    """The ``dsec`` sandboxes of each sample: this spec alone (one sandbox, ``default``),
    or the named ``sandboxes``, each taking this spec's fields as its defaults."""

    sandboxes: dict[str, DsecSandboxSpec] = {}
    """Several sandboxes per sample, by name (the default one first: see the module)."""
    ttl_s: float | None = 3600.0
    """Idle seconds before a sandbox is killed: the safety net when the eval process dies
    before it cleans up (``inspect sandbox cleanup dsec`` is the other)."""
    job: str | None = None
    """dsec training-job id of every sandbox (``dsec job kill JOB``)."""
    url: str | None = None
    """The dsec server (default ``$DSEC_URL``, else ``http://127.0.0.1:7070``)."""
    startup_timeout: float = CREATE_TIMEOUT_S
    """How long a sandbox's creation may take, seconds."""
    build_timeout: float = 3600.0
    """How long an image build may take, seconds."""

    def __hash__(self) -> int:  # inspect keeps sandbox specs in sets
        return hash(self.model_dump_json())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DsecSandboxConfig):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    def specs(self) -> dict[str, DsecSandboxSpec]:
        """The sandboxes of one sample by name, the default first.

        Raises:
            ValueError: no default among several, or more than one marked ``default``.
        """
        spec_fields = set(DsecSandboxSpec.model_fields) - {"default"}
        base = self.model_dump(include=spec_fields, exclude_unset=True)
        if not self.sandboxes:
            return {"default": DsecSandboxSpec.model_validate(base)}
        named: dict[str, DsecSandboxSpec] = {}
        for name, spec in self.sandboxes.items():
            own = spec.model_dump(exclude_unset=True)
            inherited = dict(base)
            if "image" in own or "dockerfile" in own:  # the entry picks its own source
                for key in ("image", "dockerfile", "context", "build_args"):
                    inherited.pop(key, None)
            named[name] = DsecSandboxSpec.model_validate({**inherited, **own})
        marked = [name for name, spec in named.items() if spec.default]
        if len(marked) > 1:
            raise ValueError(f"more than one dsec sandbox is marked default: {marked}")
        first = marked[0] if marked else "default" if "default" in named else None
        if first is None:
            raise ValueError(
                "no default dsec sandbox: name one of `sandboxes` 'default' or give one "
                f"`default: true` (sandboxes: {list(named)})"
            )
        return {first: named[first]} | {k: v for k, v in named.items() if k != first}

    def with_paths_from(self, base: Path) -> DsecSandboxConfig:
        """This config with relative ``dockerfile``/``context`` paths made absolute against
        ``base`` (a directory)."""

        def absolute(fields: dict[str, Any]) -> dict[str, Any]:
            out = dict(fields)
            for key in _SPEC_PATHS:
                if out.get(key) is not None:
                    out[key] = str((base / os.path.expanduser(out[key])).resolve())
            return out

        data = self.model_dump(exclude_unset=True)
        data = absolute(data)
        if "sandboxes" in data:
            data["sandboxes"] = {k: absolute(v) for k, v in data["sandboxes"].items()}
        return DsecSandboxConfig.model_validate(data)


def _is_dockerfile(path: Path) -> bool:
    name = path.name
    return name == "Dockerfile" or name.endswith(".Dockerfile") or name.startswith("Dockerfile.")


def load_config(config: BaseModel | str | None) -> DsecSandboxConfig:
    """The config a task gave (see the module docstring), with absolute paths. Reads a
    file: call it in a thread.

    Raises:
        ValueError: a file of another kind, unreadable, or not a valid config.
        TypeError: a config object of another provider.
    """
    if config is None:
        return DsecSandboxConfig().with_paths_from(Path.cwd())
    if isinstance(config, DsecSandboxConfig):
        return config.with_paths_from(Path.cwd())
    if isinstance(config, BaseModel):
        raise TypeError(f"not a dsec sandbox config: {type(config).__name__}")
    path = Path(config).expanduser()
    if _is_dockerfile(path):
        if not path.is_file():
            raise ValueError(f"dsec sandbox: no Dockerfile at {path}")
        return DsecSandboxConfig(dockerfile=str(path.resolve()))
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(
            f"dsec sandbox config {path}: expected a .yaml, .yml or .json file or a Dockerfile"
        )
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        parsed = DsecSandboxConfig.model_validate(data or {})
    except OSError as e:
        raise ValueError(f"dsec sandbox config {path}: {e.strerror}") from None
    except (ValidationError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"dsec sandbox config {path}: {e}") from None
    return parsed.with_paths_from(path.resolve().parent)
