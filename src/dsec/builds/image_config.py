"""An image's runtime config, in the shape OCI image configs (and ``dsec image pull``) use.

Stored in ``ImageInfo.meta["config"]``: ``Env`` (``["K=V", ...]``), ``Entrypoint`` and
``Cmd`` (argv lists), ``WorkingDir``, ``User``, ``Labels`` and ``ExposedPorts``
(``{"80/tcp": {}}``); absent keys are unset. Builds start from their base image's config and
record what their ``env``/``workdir``/``user``/``cmd``/``entrypoint``/``label``/``expose``
steps set.

:meth:`ImageConfig.sandbox_defaults` is what a sandbox created from the image should get
unless the create request says otherwise (``env``, ``workdir``, ``user``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ImageConfig"]


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
