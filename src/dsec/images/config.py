"""An image's runtime config, in the shape OCI image configs (and ``dsec image pull``) use,
and its start command.

Stored in ``ImageInfo.meta["config"]``: ``Env`` (``["K=V", ...]``), ``Entrypoint`` and
``Cmd`` (argv lists), ``WorkingDir``, ``User``, ``Labels`` and ``ExposedPorts``
(``{"80/tcp": {}}``); absent keys are unset. Builds start from their base image's config and
record what their ``env``/``workdir``/``user``/``cmd``/``entrypoint``/``label``/``expose``
steps set.

:meth:`ImageConfig.sandbox_defaults` is what a sandbox created from the image should get
unless the create request says otherwise (``env``, ``workdir``, ``user``).

:class:`StartCommand` (``ImageInfo.meta["start"]``) is what runs when a sandbox of the image
starts: set by a build's own ``CMD``/``ENTRYPOINT`` or ``start_cmd`` step, by an E2B
template's start command, or by a built-in recipe (the desktop, the code interpreter), and
inherited by builds on top of such an image. A registry image's ``Cmd`` is *not* a start
command (``bash`` or ``python3`` would run and exit on every create): build on it with
``CMD`` to make one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ImageConfig", "StartCommand"]


class ImageConfig(BaseModel):
    """OCI-style image config (see the module docstring). Unknown keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    Env: list[str] | None = None
    Entrypoint: list[str] | None = None
    Cmd: list[str] | None = None
    WorkingDir: str | None = None
    User: str | None = None
    Labels: dict[str, str] | None = None
    ExposedPorts: dict[str, dict[str, Any]] | None = None

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> ImageConfig:
        """The config recorded in an image's ``meta`` (empty if it has none)."""
        raw = (meta or {}).get("config")
        return cls.model_validate(raw) if isinstance(raw, dict) else cls()

    def env_dict(self) -> dict[str, str]:
        """``Env`` as a mapping (a later ``K=`` wins; entries without ``=`` are dropped)."""
        out: dict[str, str] = {}
        for item in self.Env or []:
            key, eq, value = item.partition("=")
            if eq and key:
                out[key] = value
        return out

    def to_meta(self) -> dict[str, Any]:
        """The ``meta["config"]`` dict: only the keys that are set."""
        return self.model_dump(exclude_none=True)

    def sandbox_defaults(self) -> dict[str, Any]:
        """``CreateSandboxRequest`` fields a sandbox of this image should default to:
        ``env`` (the image's ``Env``), ``workdir`` (``WorkingDir``) and ``user`` (``User``),
        each only when the image sets it."""
        out: dict[str, Any] = {}
        env = self.env_dict()
        if env:
            out["env"] = env
        if self.WorkingDir:
            out["workdir"] = self.WorkingDir
        if self.User:
            out["user"] = self.User
        return out


class StartCommand(BaseModel):
    """What runs when a sandbox of the image starts, and how the edge knows it is ready.

    ``cmd``: an argv list, or a string for ``/bin/sh -c``; it runs as the sandbox's default
    user, in its working directory, with its environment, stdin ``/dev/null``; its output is
    the sandbox's logs. ``ready_cmd``: a shell command the edge runs every 0.2 s after the
    start until it exits 0; the creation returns then, and fails (the sandbox is killed) when
    ``ready_timeout_s`` seconds pass first, or when the start command exits non-zero first.
    Without ``ready_cmd`` the creation returns as soon as the command is started."""

    model_config = ConfigDict(extra="ignore")

    cmd: str | list[str] = Field(min_length=1)
    ready_cmd: str | None = Field(None, min_length=1, max_length=65536)
    ready_timeout_s: float = Field(60.0, gt=0, le=3600)

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> StartCommand | None:
        """The start command recorded in an image's ``meta`` (None if it has none)."""
        raw = (meta or {}).get("start")
        return cls.model_validate(raw) if isinstance(raw, dict) else None

    def to_meta(self) -> dict[str, Any]:
        """The ``meta["start"]`` dict."""
        return self.model_dump(exclude_none=True)
