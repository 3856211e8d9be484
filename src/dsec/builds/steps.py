"""The build step model: one typed step per instruction, a build is a list of them.

A build starts from an image and applies steps in order; the SDK builder
(:class:`dsec.Image`) and the Dockerfile parser (:mod:`dsec.builds.dockerfile`) both produce
these, and the engine (:mod:`dsec.builds.engine`) only ever sees them.

==================  ===========================  ==================================================
step (``op``)       Dockerfile                   what it does
==================  ===========================  ==================================================
``from_image``      ``FROM name``                the base: a dsec image of the key (or the system's)
``from_registry``   ``FROM host/repo:tag``       the base from a registry reference (resolved by
                                                 the node's registry resolver, when it has one)
``run``             ``RUN``                      a command in a sandbox; its changes become a layer
``apt_install``     --                           ``apt-get install`` as root (``debian`` network)
``pip_install``     --                           ``pip install`` as root (``pypi`` network)
``copy``            ``COPY`` / ``ADD``           context files into the image, as one layer
``env``             ``ENV``                      environment of later steps and of the image
``arg``             ``ARG``                      a build argument: environment of later steps only
``workdir``         ``WORKDIR``                  working directory of later steps and of the image
``user``            ``USER``                     user of later ``run`` steps and of the image
``cmd``             ``CMD``                      the image's default command (config only)
``entrypoint``      ``ENTRYPOINT``               the image's entrypoint (config only)
``label``           ``LABEL``                    labels (config only)
``expose``          ``EXPOSE``                   exposed ports (config only)
==================  ===========================  ==================================================

``run``, ``apt_install``, ``pip_install`` and ``copy`` change the filesystem (one
content-addressed layer each, or none when nothing changed); the others change only the
build state and the image config. Every step may carry ``source`` (the instruction as
written, shown in build events and errors) and ``line`` (its Dockerfile line); neither is
part of the step's cache key.

Example::

    steps = [FromImage(image="debian"), AptInstall(packages=["curl"]), Run(cmd="curl --version")]
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.network.policy import NetworkPolicy

__all__ = [
    "FS_OPS",
    "AptInstall",
    "Arg",
    "Cmd",
    "Copy",
    "Entrypoint",
    "Env",
    "Expose",
    "FromImage",
    "FromRegistry",
    "InlineFile",
    "Label",
    "PipInstall",
    "Run",
    "StartCmd",
    "Step",
    "User",
    "Workdir",
    "describe",
]

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
"""Environment variable names a sandbox accepts (and so ENV and ARG names of a build)."""
IMAGE_REF = re.compile(r"^(k[0-9a-f]{16}/)?[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
"""A dsec image as a key names it: ``name[:tag]`` or a shared ``<owner id>/name[:tag]``."""
_APT_PACKAGE = re.compile(
    r"^[a-z0-9][a-z0-9+.\-]{0,127}(:[a-z0-9][a-z0-9-]{0,31})?"
    r"(=[A-Za-z0-9.+~:\-]{1,128}|/[a-z0-9][a-z0-9.\-]{0,63})?$"
)
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.\-]{0,31})?$")
_CHMOD = re.compile(r"^([0-7]{3,4}|[ugoa]*[+=-][rwxXst]*(,[ugoa]*[+=-][rwxXst]*)*)$")
_PORT = re.compile(r"^[0-9]{1,5}(-[0-9]{1,5})?(/(tcp|udp|sctp))?$")
_MAX_TEXT = 1 << 20


def _check_text(v: str, what: str) -> str:
    if "\0" in v:
        raise ValueError(f"{what} contains a NUL byte")
    if len(v) > _MAX_TEXT:
        raise ValueError(f"{what} is longer than 1 MiB")
    return v


def _check_command(v: str | list[str], what: str) -> str | list[str]:
    if isinstance(v, str):
        if not v.strip():
            raise ValueError(f"{what} is empty")
        return _check_text(v, what)
    if not v:
        raise ValueError(f"{what} is empty")
    for a in v:
        _check_text(a, what)
    return v


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | None = Field(
        None, max_length=65536, description="the instruction as written (events, errors)"
    )
    line: int | None = Field(None, ge=1, description="its Dockerfile line, when it has one")


class FromImage(_Step):
    """Start from ``image``: the key's own image, a system image, or a shared
    ``<owner id>/name``, as the key sees it at build time."""

    op: Literal["from_image"] = "from_image"
    image: str

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not IMAGE_REF.match(v):
            raise ValueError(f"invalid image name {v!r}: name[:tag] or <owner id>/name[:tag]")
        return v


class FromRegistry(_Step):
    """Start from a registry reference (``docker.io/library/python:3.12``). Accepted in
    every spec; a node without a registry resolver refuses it with ``unsupported``."""

    op: Literal["from_registry"] = "from_registry"
    ref: str = Field(min_length=1, max_length=1024)


class Run(_Step):
    """Run ``cmd`` (a string: under ``/bin/sh -c``; a list: exec'd as is) in a sandbox of the
    image so far, as the current user in the current working directory, with the build's
    ``env`` and ``arg`` values. ``network``: ``"default"`` is the build's ``run_network``
    (none for spec builds, the ``debian`` and ``pypi`` presets for Dockerfiles), ``"none"``
    no network, or a policy of its own."""

    op: Literal["run"] = "run"
    cmd: str | list[str]
    network: NetworkPolicy | Literal["default", "none"] = "default"

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        return _check_command(v, "run cmd")


class AptInstall(_Step):
    """``apt-get update && apt-get install -y --no-install-recommends PACKAGES`` as root, with
    the ``debian`` network preset only (package lists are not kept in the layer)."""

    op: Literal["apt_install"] = "apt_install"
    packages: list[str] = Field(min_length=1, max_length=512)

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for p in v:
            if not _APT_PACKAGE.match(p):
                raise ValueError(f"invalid Debian package name {p!r}")
        return v


class PipInstall(_Step):
    """``python3 -m pip install --no-cache-dir PACKAGES`` as root, with the ``pypi`` network
    preset only. Requirement specifiers (``numpy>=2``, ``requests[socks]``) are passed as
    arguments, never through a shell; options (``-r``, ``--index-url``) are refused."""

    op: Literal["pip_install"] = "pip_install"
    packages: list[str] = Field(min_length=1, max_length=512)

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.strip() or p.startswith("-") or any(c in p for c in "\0\n\r"):
                raise ValueError(f"invalid pip requirement {p!r}")
            if len(p) > 4096:
                raise ValueError("a pip requirement is longer than 4096 characters")
        return v


class InlineFile(BaseModel):
    """A file given inline (a Dockerfile heredoc: ``COPY <<EOF /etc/app.conf``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=255)
    content: str = Field(max_length=_MAX_TEXT)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if "/" in v or "\0" in v or v in (".", ".."):
            raise ValueError(f"invalid inline file name {v!r}")
        return v


class Copy(_Step):
    """Copy ``src`` paths of the build context (globs allowed: ``*.py``) to ``dest`` in the
    image, Dockerfile ``COPY`` semantics: a directory's contents go into ``dest``; a single
    file goes to ``dest`` itself unless ``dest`` ends with ``/`` or is a directory; several
    sources need a directory ``dest``. A relative ``dest`` is under the working directory.

    ``chown`` (``user``, ``uid``, ``user:group``, ``uid:gid``; names are looked up in the
    image's ``/etc/passwd`` and ``/etc/group``; a user alone also gives its number as the
    group) and ``chmod`` (octal, or symbolic like ``u+x``) apply to everything copied;
    otherwise files keep their context mode and belong to root. ``add``: ``ADD`` semantics,
    a local tar archive (plain, gzip, bzip2, xz) is unpacked into ``dest``. ``inline``:
    files given in the request itself."""

    op: Literal["copy"] = "copy"
    src: list[str] = Field(default_factory=list, max_length=4096)
    dest: str = Field(min_length=1, max_length=4096)
    chown: str | None = None
    chmod: str | None = None
    add: bool = False
    inline: list[InlineFile] = Field(default_factory=list, max_length=256)

    @field_validator("src")
    @classmethod
    def _src(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s or "\0" in s or len(s) > 4096:
                raise ValueError(f"invalid copy source {s!r}")
        return v

    @field_validator("dest")
    @classmethod
    def _dest(cls, v: str) -> str:
        return _check_text(v, "copy dest")

    @field_validator("chown")
    @classmethod
    def _chown(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError(f"invalid chown {v!r}: user, uid, user:group or uid:gid")
        return v

    @field_validator("chmod")
    @classmethod
    def _chmod(cls, v: str | None) -> str | None:
        if v is not None and not _CHMOD.match(v):
            raise ValueError(f"invalid chmod {v!r}: octal (0755) or symbolic (u+x,g-w)")
        return v


class Env(_Step):
    """Set environment variables for later steps; recorded in the image config (``Env``)."""

    op: Literal["env"] = "env"
    vars: dict[str, str] = Field(min_length=1, max_length=1024)

    @field_validator("vars")
    @classmethod
    def _vars(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not ENV_NAME.match(k):
                raise ValueError(f"invalid environment variable name {k!r}")
            _check_text(val, f"environment variable {k!r}")
        return v


class Arg(_Step):
    """A build argument: its value is the build's ``build_args[name]``, else ``default``;
    later steps see it in their environment (an ``env`` of the same name wins). Not
    recorded in the image."""

    op: Literal["arg"] = "arg"
    name: str
    default: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not ENV_NAME.match(v):
            raise ValueError(f"invalid build argument name {v!r}")
        return v


class Workdir(_Step):
    """Working directory of later steps and of the image (``WorkingDir``); a relative path
    is under the previous one. The directory is created (root, 0755) if it does not exist."""

    op: Literal["workdir"] = "workdir"
    path: str = Field(min_length=1, max_length=4096)

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _check_text(v, "workdir")


class User(_Step):
    """User (``name``, ``uid``, ``name:group``, ``uid:gid``) of later ``run`` steps and of the
    image (``User``). ``apt_install``, ``pip_install`` and ``copy`` run as root regardless."""

    op: Literal["user"] = "user"
    user: str

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER.match(v):
            raise ValueError(f"invalid user {v!r}: name, uid, name:group or uid:gid")
        return v


class Cmd(_Step):
    """The image's default command (``Cmd``): a list, or a string meaning ``/bin/sh -c``."""

    op: Literal["cmd"] = "cmd"
    cmd: str | list[str]

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            return v  # CMD [] clears it
        return _check_command(v, "cmd")


class Entrypoint(_Step):
    """The image's entrypoint (``Entrypoint``): a list, or a string meaning ``/bin/sh -c``.
    As in Docker, it clears a ``Cmd`` inherited from the base image (not one set by the
    build)."""

    op: Literal["entrypoint"] = "entrypoint"
    entrypoint: str | list[str]

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            return v
        return _check_command(v, "entrypoint")


class StartCmd(_Step):
    """The image's start command (:class:`~dsec.images.config.StartCommand`): runs
    when a sandbox of the image starts, its output the sandbox's logs. ``ready_cmd``, a shell
    command, tells when it is up: the creation waits until it exits 0 (at most
    ``ready_timeout_s`` seconds). Wins over a ``cmd``/``entrypoint`` of the same build."""

    op: Literal["start_cmd"] = "start_cmd"
    cmd: str | list[str]
    ready_cmd: str | None = None
    ready_timeout_s: float = Field(60.0, gt=0, le=3600)

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        return _check_command(v, "start_cmd")

    @field_validator("ready_cmd")
    @classmethod
    def _ready(cls, v: str | None) -> str | None:
        if v is None:
            return v
        checked = _check_command(v, "ready_cmd")
        assert isinstance(checked, str)
        return checked


class Label(_Step):
    """Labels recorded in the image config (``Labels``)."""

    op: Literal["label"] = "label"
    labels: dict[str, str] = Field(min_length=1, max_length=1024)


class Expose(_Step):
    """Ports recorded in the image config (``ExposedPorts``: ``{"80/tcp": {}}``); nothing is
    opened (a sandbox's network is its policy)."""

    op: Literal["expose"] = "expose"
    ports: list[str] = Field(min_length=1, max_length=1024)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[str]) -> list[str]:
        for p in v:
            if not _PORT.match(p):
                raise ValueError(f"invalid port {p!r}: PORT, PORT/tcp, PORT/udp or LO-HI")
        return v


Step = Annotated[
    FromImage
    | FromRegistry
    | Run
    | AptInstall
    | PipInstall
    | Copy
    | Env
    | Arg
    | Workdir
    | User
    | Cmd
    | Entrypoint
    | StartCmd
    | Label
    | Expose,
    Field(discriminator="op"),
]
"""One build step (a tagged union on ``op``)."""

FS_OPS = frozenset({"run", "apt_install", "pip_install", "copy"})
"""The steps that change the filesystem (each becomes at most one layer)."""


def _words(v: str | list[str]) -> str:
    import json

    return v if isinstance(v, str) else json.dumps(v)


def describe(step: _Step) -> str:
    """The instruction text shown for ``step``: its ``source`` if it has one, else a
    Dockerfile-like rendering (``RUN make``, ``APT_INSTALL curl git``)."""
    if step.source:
        return step.source
    if isinstance(step, FromImage):
        return f"FROM {step.image}"
    if isinstance(step, FromRegistry):
        return f"FROM {step.ref}"
    if isinstance(step, Run):
        return f"RUN {_words(step.cmd)}"
    if isinstance(step, AptInstall):
        return "APT_INSTALL " + " ".join(step.packages)
    if isinstance(step, PipInstall):
        return "PIP_INSTALL " + " ".join(step.packages)
    if isinstance(step, Copy):
        flags = "".join(
            f" --{k}={v}" for k, v in (("chown", step.chown), ("chmod", step.chmod)) if v
        )
        srcs = [*step.src, *(f"<<{f.name}" for f in step.inline)]
        return f"{'ADD' if step.add else 'COPY'}{flags} {' '.join(srcs)} {step.dest}"
    if isinstance(step, Env):
        return "ENV " + " ".join(f"{k}={v}" for k, v in step.vars.items())
    if isinstance(step, Arg):
        return f"ARG {step.name}" + (f"={step.default}" if step.default is not None else "")
    if isinstance(step, Workdir):
        return f"WORKDIR {step.path}"
    if isinstance(step, User):
        return f"USER {step.user}"
    if isinstance(step, Cmd):
        return f"CMD {_words(step.cmd)}"
    if isinstance(step, Entrypoint):
        return f"ENTRYPOINT {_words(step.entrypoint)}"
    if isinstance(step, StartCmd):
        ready = f" READY {step.ready_cmd}" if step.ready_cmd else ""
        return f"START_CMD {_words(step.cmd)}{ready}"
    if isinstance(step, Label):
        return "LABEL " + " ".join(f"{k}={v}" for k, v in step.labels.items())
    if isinstance(step, Expose):
        return "EXPOSE " + " ".join(step.ports)
    return type(step).__name__  # pragma: no cover - every step type is listed above
