"""``dsec.Image``: describe an image step by step, build it on the server, cached per step.

In the style of Modal's and Daytona's image builders: immutable and chainable (every
method returns a new :class:`Image`), ending in :meth:`Image.build`::

    from dsec import Image, Sandbox

    image = (
        Image.from_image("debian")
        .apt_install("git", "curl")
        .pip_install("pytest==8.3.3")
        .copy("./repo", "/work/repo")         # a local directory: its contents go there
        .env({"PYTHONUNBUFFERED": "1"})
        .workdir("/work/repo")
        .run("pip install -e .")
    )
    info = image.build("task-42:1")           # blocks; prints nothing (pass on_event=print)
    with Sandbox.create(image="task-42:1") as sb:
        ...

    # or a Dockerfile (its .dockerignore applies to the context directory):
    Image.from_dockerfile("Dockerfile", context=".").build("task-43:1")

The steps become a :class:`dsec.builds.BuildRequest` (:meth:`Image.request`), and the local
files ``copy`` names become the build context, a tar archive (:meth:`Image.context`); both
go to ``POST /v1/builds`` (wire format: :mod:`dsec.builds.wire`). The server runs each step
in a sandbox of the image so far (``apt_install`` with the ``debian`` network preset only,
``pip_install`` with ``pypi`` only, ``run`` with no network unless you give it one) and
keeps every step's layer in a per-key cache: building the same chain again creates no
sandbox, and changing a step rebuilds only it and what follows. A failing step raises
:class:`dsec.errors.BuildFailed` (``details``: ``step``, ``instruction``, ``output_tail``).
"""

from __future__ import annotations

import inspect
import io
import os
import tarfile
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsec.builds.context import DockerIgnore
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
    Label,
    PipInstall,
    Run,
    StartCmd,
    Step,
    User,
    Workdir,
)
from dsec.builds.wire import BuildRequest
from dsec.errors import InvalidRequest
from dsec.models import ImageInfo
from dsec.network.policy import NetworkPolicy

__all__ = ["BUILD_TIMEOUT_S", "Image"]

BUILD_TIMEOUT_S = 3600.0
"""Default wait for a whole build, seconds."""

EventCallback = Callable[[Any], Awaitable[None] | None]


def _step(cls: type[Any], **fields: Any) -> Any:
    try:
        return cls(**fields)
    except ValidationError as e:
        msgs = "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())
        raise InvalidRequest(f"invalid {cls.__name__.lower()} step: {msgs}") from None


def _flatten(items: Iterable[str | Iterable[str]]) -> list[str]:
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        else:
            out.extend(item)
    return out


@dataclass(frozen=True)
class _LocalCopy:
    index: int
    path: Path


@dataclass(frozen=True)
class _DockerfileSource:
    text: str
    context: Path | None


@dataclass(frozen=True)
class Image:
    """An image to build (see the module docstring). Construct with :meth:`from_image`,
    :meth:`from_registry` or :meth:`from_dockerfile`."""

    _steps: tuple[Any, ...] = ()
    _copies: tuple[_LocalCopy, ...] = ()
    _dockerfile: _DockerfileSource | None = None
    _build_args: tuple[tuple[str, str], ...] = ()

    # --- bases --------------------------------------------------------------------------------

    @staticmethod
    def from_image(name: str) -> Image:
        """Start from the dsec image ``name`` (``busybox``, ``debian``, one of this key's
        images, or a shared ``<owner id>/name``)."""
        return Image((_step(FromImage, image=name),))

    @staticmethod
    def from_registry(ref: str) -> Image:
        """Start from a registry reference (``python:3.12``, ``ghcr.io/org/img:tag``). Part
        of the spec now; a server that cannot resolve references yet answers
        ``Unsupported`` (pull it with ``dsec image pull`` and use :meth:`from_image`)."""
        return Image((_step(FromRegistry, ref=ref),))

    @staticmethod
    def from_dockerfile(
        path: str | os.PathLike[str],
        context: str | os.PathLike[str] | None = None,
        *,
        build_args: dict[str, str] | None = None,
    ) -> Image:
        """A local Dockerfile (read now), built with the local directory ``context`` (default:
        the Dockerfile's directory; its ``.dockerignore`` applies). ``build_args`` set its
        ``ARG`` s. Steps cannot be chained onto it: add them to the Dockerfile."""
        file = Path(path).expanduser()
        try:
            text = file.read_text()
        except OSError as e:
            raise InvalidRequest(f"cannot read the Dockerfile {file}: {e.strerror}") from None
        ctx = Path(context).expanduser() if context is not None else file.parent
        if not ctx.is_dir():
            raise InvalidRequest(f"the build context {ctx} is not a local directory")
        return Image(
            _dockerfile=_DockerfileSource(text, ctx.resolve()),
            _build_args=tuple(sorted((build_args or {}).items())),
        )

    # --- steps ----------------------------------------------------------------------------

    def _add(self, step: Any) -> Image:
        if self._dockerfile is not None:
            raise InvalidRequest("an image from a Dockerfile takes its steps from the Dockerfile")
        return replace(self, _steps=(*self._steps, step))

    def apt_install(self, *packages: str | Iterable[str]) -> Image:
        """``apt-get install`` Debian packages as root (``apt_install("git", "curl")`` or a
        list), with the ``debian`` network preset only."""
        return self._add(_step(AptInstall, packages=_flatten(packages)))

    def pip_install(self, *packages: str | Iterable[str]) -> Image:
        """``pip install`` requirements as root (``pip_install("numpy>=2", "pytest")``), with
        the ``pypi`` network preset only."""
        return self._add(_step(PipInstall, packages=_flatten(packages)))

    def run(
        self,
        *commands: str | list[str],
        network: NetworkPolicy | dict[str, Any] | None = None,
    ) -> Image:
        """Run commands (a string: ``/bin/sh -c``; a list: argv), one step each, as the
        current user in the working directory. ``network``: a policy for these steps
        (e.g. ``{"presets": ["github"]}``); default none."""
        policy = NetworkPolicy.parse(network) if network is not None else "default"
        image = self
        for cmd in commands:
            image = image._add(_step(Run, cmd=cmd, network=policy))
        return image

    def copy(
        self,
        local: str | os.PathLike[str],
        remote: str,
        *,
        chown: str | None = None,
        chmod: str | None = None,
    ) -> Image:
        """Copy a local file or directory into the image: a directory's contents go into
        ``remote``; a file goes to ``remote`` (into it if it ends with ``/`` or is a
        directory). ``chown`` / ``chmod`` as in a Dockerfile ``COPY``; files are root's
        otherwise. The files are read when the image is built."""
        path = Path(local).expanduser().resolve()
        if not path.exists():
            raise InvalidRequest(f"no local file or directory {local}", path=str(local))
        index = len(self._copies)
        name = path.name or "root"
        step = _step(Copy, src=[f"sdk/{index}/{name}"], dest=remote, chown=chown, chmod=chmod)
        image = self._add(step)
        return replace(image, _copies=(*image._copies, _LocalCopy(index, path)))

    def env(self, vars: dict[str, str] | None = None, **more: str) -> Image:
        """Set environment variables for later steps and the image (``env({"A": "1"})`` or
        ``env(A="1")``)."""
        return self._add(_step(Env, vars={**(vars or {}), **more}))

    def arg(self, name: str, default: str | None = None) -> Image:
        """A build argument (set with ``build(..., build_args={name: value})``): later steps
        see it in their environment; the image does not keep it."""
        return self._add(_step(Arg, name=name, default=default))

    def workdir(self, path: str) -> Image:
        """The working directory of later steps and of the image (created if missing)."""
        return self._add(_step(Workdir, path=path))

    def user(self, name: str) -> Image:
        """The user of later ``run`` steps and of the image (``name``, ``uid``, ``name:group``)."""
        return self._add(_step(User, user=name))

    def cmd(self, command: str | list[str]) -> Image:
        """The image's default command (a list, or a string run by ``/bin/sh -c``). As in
        Docker, entrypoint + cmd run when a sandbox of the image starts (its output is the
        sandbox's logs); see :meth:`start_cmd` for a readiness check."""
        return self._add(_step(Cmd, cmd=command))

    def entrypoint(self, command: str | list[str]) -> Image:
        """The image's entrypoint (a list, or a string run by ``/bin/sh -c``)."""
        return self._add(_step(Entrypoint, entrypoint=command))

    def start_cmd(
        self,
        command: str | list[str],
        ready_cmd: str | None = None,
        *,
        ready_timeout: float = 60.0,
    ) -> Image:
        """What runs when a sandbox of the image starts (a server, a desktop), and a shell
        command that exits 0 once it is up: ``Sandbox.create`` returns then (or fails after
        ``ready_timeout`` seconds). Wins over :meth:`cmd`/:meth:`entrypoint`."""
        return self._add(
            _step(StartCmd, cmd=command, ready_cmd=ready_cmd, ready_timeout_s=ready_timeout)
        )

    def label(self, labels: dict[str, str] | None = None, **more: str) -> Image:
        """Labels of the image config."""
        return self._add(_step(Label, labels={**(labels or {}), **more}))

    def expose(self, *ports: int | str) -> Image:
        """Ports recorded in the image config (``expose(8080, "53/udp")``)."""
        return self._add(_step(Expose, ports=[str(p) for p in ports]))

    # --- what goes over the wire ----------------------------------------------------------

    @property
    def steps(self) -> list[Step]:
        """The steps so far (empty for a Dockerfile image: the server parses it)."""
        return list(self._steps)

    def request(self, name: str, **options: Any) -> BuildRequest:
        """The typed build request for the image ``name``. ``options``: the other
        :class:`~dsec.builds.BuildRequest` fields (``no_cache``, ``build_args``,
        ``run_network``, ``cpu``, ``memory_mb``, ``disk_mb``, ``step_timeout_s``,
        ``compress``). Raises ``InvalidRequest``."""
        data: dict[str, Any] = dict(options)
        if self._dockerfile is not None:
            data["dockerfile"] = self._dockerfile.text
            data["build_args"] = {**dict(self._build_args), **(options.get("build_args") or {})}
        else:
            if not self._steps:
                raise InvalidRequest("start the image with Image.from_image(...)")
            data["steps"] = list(self._steps)
        if isinstance(data.get("run_network"), NetworkPolicy):
            data["run_network"] = data["run_network"].model_dump(mode="json")
        return BuildRequest.parse({"name": name, **data})

    def context(self) -> bytes:
        """The build context: the local files of the ``copy`` steps (or the Dockerfile's
        context directory minus ``.dockerignore``), as an uncompressed tar. Empty when there
        are none."""
        if self._dockerfile is not None:
            assert self._dockerfile.context is not None
            return pack_directory(self._dockerfile.context)
        if not self._copies:
            return b""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for c in self._copies:
                name = c.path.name or "root"
                _add_dir_entry(tar, f"sdk/{c.index}", None)
                if not c.path.exists():
                    raise InvalidRequest(f"{c.path} (copied into the image) no longer exists")
                _pack(tar, c.path, f"sdk/{c.index}/{name}")
        return buf.getvalue()

    # --- building -------------------------------------------------------------------------

    def build(
        self,
        name: str,
        *,
        client: Any = None,
        on_event: EventCallback | None = None,
        timeout: float = BUILD_TIMEOUT_S,
        **options: Any,
    ) -> ImageInfo:
        """Build the image ``name`` (it belongs to the client's key) and wait for it.

        Args:
            name: ``name[:tag]``.
            client: a :class:`dsec.Client` (default: one from ``DSEC_URL`` /
                ``DSEC_API_KEY``).
            on_event: called with every build event (:mod:`dsec.builds.wire`) as it comes:
                step starts, cache hits, output chunks, step results.
            timeout: longest wait for the whole build, seconds.
            options: :meth:`request` options (``no_cache=True``, ``build_args={...}``, ...).

        Raises:
            BuildFailed: a step's command failed (``details``: step, instruction,
                output_tail). InvalidRequest: a bad step or Dockerfile (with its line).
            ImageNotFound, Conflict, Unsupported: see ``dsec.builds.engine``.
        """
        from dsec.sdk.sync import SyncWrapper, runner

        impl = client._impl if isinstance(client, SyncWrapper) else client
        return runner.run(
            self.build_async(name, client=impl, on_event=on_event, timeout=timeout, **options)
        )

    async def build_async(
        self,
        name: str,
        *,
        client: Any = None,
        on_event: EventCallback | None = None,
        timeout: float = BUILD_TIMEOUT_S,
        **options: Any,
    ) -> ImageInfo:
        """:meth:`build` with ``await`` (``client``: a :class:`dsec.AsyncClient`)."""
        from dsec.sdk.client import AsyncClient

        own = client is None
        c = client if client is not None else AsyncClient()
        try:
            result: ImageInfo = await c.build(
                self, name, on_event=on_event, timeout=timeout, **options
            )
            return result
        finally:
            if own:
                await c.close()


async def call_back(fn: EventCallback | None, event: Any) -> None:
    """Call a sync or async ``on_event`` callback."""
    if fn is None:
        return
    result = fn(event)
    if inspect.isawaitable(result):
        await result


# --- packing local files -------------------------------------------------------------------


def _add_dir_entry(tar: tarfile.TarFile, arcname: str, src: Path | None) -> None:
    info = tarfile.TarInfo(arcname)
    info.type = tarfile.DIRTYPE
    if src is not None:
        st = src.stat()
        info.mode, info.mtime = st.st_mode & 0o7777, int(st.st_mtime)
    else:
        info.mode = 0o755
    tar.addfile(info)


def _tarinfo(tar: tarfile.TarFile, path: Path, arcname: str) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _included(root: Path, ignore: DockerIgnore | None, rel: str = "") -> list[str]:
    """Paths below ``root`` (relative, parents first) that ``ignore`` keeps. An excluded
    directory is walked only when a ``!`` line could re-include something in it, and is
    kept only if something in it is."""
    out: list[str] = []
    try:
        children = sorted(os.listdir(root / rel if rel else root))
    except (FileNotFoundError, NotADirectoryError):
        if not rel:
            raise
        return out  # removed while the context was walked: as if it had not been there
    for child in children:
        child_rel = f"{rel}/{child}" if rel else child
        full = root / child_rel
        excluded = ignore is not None and ignore.excluded(child_rel)
        if full.is_dir() and not full.is_symlink():
            if excluded and not (ignore is not None and ignore.has_exclusions):
                continue
            inside = _included(root, ignore, child_rel)
            if not excluded or inside:
                out.append(child_rel)
                out.extend(inside)
        elif not excluded:
            out.append(child_rel)
    return out


def _add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    """One file, symlink or directory (other file types are not copyable)."""
    if not (path.is_symlink() or path.is_file() or path.is_dir()):
        return
    info = _tarinfo(tar, path, arcname)
    if info.isreg():
        with open(path, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def _pack(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    """``path`` (a file, or a directory and everything in it) under ``arcname``."""
    _add(tar, path, arcname)
    if path.is_dir() and not path.is_symlink():
        for rel in _included(path, None):
            _add(tar, path / rel, f"{arcname}/{rel}")


def pack_directory(root: Path) -> bytes:
    """A Dockerfile build context: ``root``'s contents minus what its ``.dockerignore``
    excludes (``.dockerignore`` itself is always sent, so the server applies it too)."""
    ignore_file = root / ".dockerignore"
    ignore = DockerIgnore.parse(ignore_file.read_text()) if ignore_file.is_file() else None
    paths = _included(root, ignore)
    if ignore_file.is_file() and ".dockerignore" not in paths:
        paths.insert(0, ".dockerignore")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in paths:
            _add(tar, root / rel, rel)
    return buf.getvalue()
