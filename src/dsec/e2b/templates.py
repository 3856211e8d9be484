"""E2B's template API (``e2b.Template.build``) over dsec's image builds.

What a template is here
    An E2B template of a key *is* that key's dsec images named after it: the build tagged
    ``default`` is the image ``<name>``, a build tagged ``t`` the image ``<name>:t``. So a
    template survives a server restart, is listed by ``dsec image ls``, works as
    ``Sandbox.create(image="<name>")`` in dsec's SDK, and belongs to the key (another key
    gets 404, as E2B answers for a template that does not exist). Its ``templateID`` is a
    stable 20-character id derived from (key, name); a template's images carry image-config
    labels with its E2B build id and sandbox size (:data:`LABEL_BUILD`, :data:`LABEL_CPU`,
    :data:`LABEL_MEMORY`). Builds in progress (status and logs) live in this process.

The flow the SDK drives (``Template.build(template, "name")``)
    1. ``POST /v3/templates`` ``{name, tags, cpuCount, memoryMB}`` -> 202 with the template
       id and a new build id (``waiting``).
    2. For each ``COPY``: ``GET /templates/{id}/files/{hash}`` -> ``{present, url}``; the
       SDK ``PUT``s a tar(.gz) of the copied paths to ``url``, a signed URL of this app
       (no key on it: the signature names the key, the template and the hash, and expires).
       Files are kept per key by hash (a rebuild with unchanged files uploads nothing).
    3. ``POST /v2/templates/{id}/builds/{build}`` with the steps -> the steps are translated
       (:func:`translate_template`) to dsec build steps and the build is prepared through the
       edge's build verb (:class:`~dsec.contract.edge.ImageBuilds`): refusals (an unknown
       base template, a bad step, files never uploaded, a context over the limit) are HTTP
       errors here; then it runs in the background and this answers 202.
    4. ``GET /templates/{id}/builds/{build}/status?logsOffset=N`` -> status (``building``,
       ``ready``, ``error``), at most 100 log entries from ``N``, and on failure a reason
       with the failing step's number (the SDK points at the template line that made it)
       and the tail of its output. A failing step stores nothing.

Step translation (E2B's build semantics, from its template manager)
    * ``fromImage``: a dsec image of the key (or the system's) by that name, else a registry
      reference; ``e2bdev/base`` and E2B's public names go through the template alias map.
      ``fromTemplate``: a template of the key (name, ``name:tag`` or id).
    * An image base is provisioned as E2B does: steps run as ``root``, then the default user
      ``user`` is created if the image lacks it (``useradd``/busybox ``adduser``, with a
      sudoers entry when ``/etc/sudoers.d`` exists), becomes the current user, and its home
      ``/home/user`` the working directory. A template base keeps its own user and directory.
    * ``RUN [cmd, user?]``: a ``run`` step as the current user (or ``user`` for that step),
      with the Debian and PyPI network presets (E2B builds have the internet; dsec gives what
      package installs need) when this node has networking.
    * ``COPY [src, dest, owner?, mode?]``: a ``copy`` of the uploaded files, owned by
      ``owner`` or else the current user (E2B's default), ``mode`` applied to everything
      copied; a glob copies what it matched into ``dest``.
    * ``ENV [k, v, ...]``: ``env``, values expanded (``$VAR``, ``${VAR}``, ``${VAR:-x}``)
      against the environment so far, as E2B's shell does. They stay in the image's
      environment (Docker's rule; E2B's SDK documents them as build-time only).
    * ``WORKDIR p``: created as the current user (E2B runs ``mkdir -p`` as that user), then
      the working directory. ``USER u [sudo]``: created if missing, then the current user.
    * ``startCmd`` / ``readyCmd``: the image's start command and readiness check, with E2B's
      5-minute ready timeout. E2B runs the check once, at build time, and snapshots the
      running sandbox; dsec has no build-time memory snapshot, so the check runs on every
      create (a ``wait_for_port`` or ``wait_for_url`` check costs what the service needs to
      come up). A *time-only* check (``sleep N``: ``wait_for_timeout``, and what the SDK
      puts after a Dockerfile ``CMD``) says nothing about the service; E2B pays it once per
      build, and dsec does not make every create sleep N seconds for it: the start command
      is started and the create returns (documented in ``docs/e2b.md``). A ready command
      without a start command runs once as the last build step.
    * ``force`` (template or any step): the whole build runs without the cache.
    * ``fromImageRegistry`` credentials are refused (422): set ``DSEC_REGISTRY_AUTH`` on
      the server instead.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import posixpath
import re
import secrets
import tarfile
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from e2b.api.client.models import (
    AssignedTemplateTags,
    BuildLogEntry,
    BuildStatusReason,
    LogLevel,
    Template,
    TemplateAliasResponse,
    TemplateBuild,
    TemplateBuildFileUpload,
    TemplateBuildInfo,
    TemplateBuildStatus,
    TemplateRequestResponseV3,
    TemplateTag,
    TemplateWithBuilds,
)
from e2b.api.client.types import UNSET as _UNSET
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsec.builds.steps import (
    ENV_NAME,
    IMAGE_REF,
    Copy,
    Env,
    FromImage,
    FromRegistry,
    Label,
    Run,
    StartCmd,
    Step,
    User,
    Workdir,
)
from dsec.builds.wire import (
    DOCKERFILE_RUN_NETWORK,
    BuildDone,
    BuildError,
    BuildRequest,
    BuildStarted,
    StepCached,
    StepDone,
    StepOutput,
    StepStarted,
)
from dsec.contract.edge import EdgeAPI, ImageBuilds
from dsec.e2b.access import TemplateMap, TemplateTarget, image_ref
from dsec.e2b.errors import E2BError, control_status
from dsec.e2b.version import ENVD_VERSION
from dsec.errors import DsecError, ImageNotFound
from dsec.images.config import ImageConfig
from dsec.models import DeleteImageRequest, ImageInfo, KeyScope

__all__ = [
    "DEFAULT_TAG",
    "LABEL_BUILD",
    "LABEL_CPU",
    "LABEL_MEMORY",
    "TemplateAPI",
    "TemplateFiles",
    "TranslatedBuild",
    "template_id_of",
    "translate_template",
]

log = logging.getLogger(__name__)

DEFAULT_TAG = "default"
"""E2B's tag of a build made without one; its image is ``<name>`` (no dsec tag)."""
LABEL_BUILD = "dsec.e2b.build-id"
LABEL_CPU = "dsec.e2b.cpu-count"
LABEL_MEMORY = "dsec.e2b.memory-mb"
DEFAULT_USER = "user"
"""The user E2B provisions in every template built from an image."""
READY_TIMEOUT_S = 300.0
"""E2B's ready-command timeout (5 minutes), seconds."""
FILES_PREFIX = ".e2b-files"
"""Where each COPY's upload sits in the build context: ``.e2b-files/<hash>/...``."""
LOGS_PAGE = 100
"""Log entries per status answer (E2B's limit)."""
MAX_LOG_ENTRIES = 5_000
"""Log entries kept per build (the oldest are dropped first)."""
MAX_BUILDS = 256
"""Builds remembered (status and logs) by this process: past it, finished ones and builds
never started within :data:`UPLOAD_URL_TTL_S` are forgotten, oldest first."""
UPLOAD_URL_TTL_S = 3600.0
"""How long a file upload URL is valid, seconds (the SDK's upload timeout)."""
DEFAULT_FILES_BYTES_PER_KEY = 4 << 30
"""Uploaded COPY files kept per key, bytes (least recently used dropped first)."""
_ALIAS = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
_TEMPLATE_ID = re.compile(r"^[a-z2-7]{20}$")
_TIME_READY = re.compile(r"^\s*sleep\s+[0-9]+(\.[0-9]+)?\s*$")
_GLOB = re.compile(r"[*?\[{]")
_NUMERIC_USER = re.compile(r"^[0-9]+(:[0-9]+)?$")
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENSURE_USER = """set -e
u="$1"
if ! grep -q "^$u:" /etc/passwd 2>/dev/null; then
  if command -v useradd >/dev/null 2>&1; then
    useradd -m -s "$(command -v bash || echo /bin/sh)" "$u"
  elif command -v busybox >/dev/null 2>&1 && busybox adduser -D -g "" "$u" 2>/dev/null; then
    :
  else
    uid=1000
    while grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd 2>/dev/null; do uid=$((uid + 1)); done
    echo "$u:x:$uid:$uid::/home/$u:/bin/sh" >> /etc/passwd
    grep -q "^$u:" /etc/group 2>/dev/null || echo "$u:x:$uid:" >> /etc/group
    mkdir -p "/home/$u"
    chown "$uid:$uid" "/home/$u"
  fi
fi
if [ "$2" = true ] && [ -d /etc/sudoers.d ]; then
  echo "$u ALL=(ALL:ALL) NOPASSWD: ALL" > "/etc/sudoers.d/90-e2b-$u"
  chmod 0440 "/etc/sudoers.d/90-e2b-$u"
fi
"""
"""Create user ``$1`` if the image lacks it (``useradd``, else busybox's ``adduser``, else
by hand in ``/etc/passwd``); ``$2 = true`` also gives it password-less sudo."""


def _now() -> datetime:
    return datetime.now(UTC)


def template_id_of(owner: str, alias: str) -> str:
    """The E2B template id of ``owner``'s template ``alias``: 20 characters of
    ``[a-z2-7]``, stable across restarts and replicas."""
    digest = hashlib.sha256(f"e2b-template\0{owner}\0{alias}".encode()).digest()
    return base64.b32encode(digest).decode().lower()[:20]


def image_name(alias: str, tag: str) -> str:
    """The dsec image of ``alias``'s build tagged ``tag``."""
    return alias if tag == DEFAULT_TAG else f"{alias}:{tag}"


def split_image_name(name: str) -> tuple[str, str]:
    """``(alias, tag)`` of a dsec image name (no tag: :data:`DEFAULT_TAG`)."""
    alias, sep, tag = name.partition(":")
    return alias, tag if sep else DEFAULT_TAG


def parse_name(name: str) -> tuple[str, str | None]:
    """``name`` or ``name:tag`` as E2B takes it; 400 for what dsec cannot name."""
    if not isinstance(name, str) or not name:
        raise E2BError(400, "the template name is missing")
    alias, sep, tag = name.partition(":")
    if not _ALIAS.match(alias):
        raise E2BError(
            400,
            f"invalid template name {alias!r}: lowercase letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit)",
        )
    if sep and not _TAG.match(tag):
        raise E2BError(400, f"invalid tag {tag!r}: letters, digits, '.', '_' and '-'")
    return alias, (tag if sep else None)


# --- step translation ------------------------------------------------------------------------


@dataclass
class TranslatedBuild:
    """E2B's template steps as dsec build steps. ``origins[i]`` is the E2B step that
    ``steps[i]`` comes from, as E2B numbers them in a failure's ``reason.step``: ``base``
    (the base and its provisioning), ``"1"`` ... (the template's steps, 1-based) or
    ``finalize`` (start command, labels). ``hashes``: the uploads the copies read."""

    steps: list[Step]
    origins: list[str]
    hashes: list[str] = field(default_factory=list)
    no_cache: bool = False


def _expand(value: str, env: dict[str, str]) -> str:
    """``$VAR``, ``${VAR}`` and ``${VAR:-default}`` / ``${VAR-default}`` in ``value``
    from ``env`` (unset: empty; ``PATH`` defaults to the usual one); ``\\$`` is a ``$``."""

    def lookup(name: str) -> str | None:
        if name in env:
            return env[name]
        return _DEFAULT_PATH if name == "PATH" else None

    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if c == "\\" and i + 1 < n and value[i + 1] in '$\\"`':
            out.append(value[i + 1])
            i += 2
            continue
        if c != "$" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        if value[i + 1] == "{":
            end = value.find("}", i + 2)
            if end < 0:
                out.append(value[i:])
                break
            body = value[i + 2 : end]
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(:?-(.*))?$", body, re.S)
            if m is None:
                out.append(value[i : end + 1])
            else:
                got = lookup(m.group(1))
                if m.group(2) is not None and (
                    got is None or (m.group(2).startswith(":") and got == "")
                ):
                    got = m.group(3)
                out.append(got or "")
            i = end + 1
            continue
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", value[i + 1 :])
        if m is None:
            out.append(c)
            i += 1
            continue
        out.append(lookup(m.group(0)) or "")
        i += 1 + m.end()
    return "".join(out)


def _home(user: str) -> str:
    return "/root" if user in ("root", "0") else f"/home/{user.partition(':')[0]}"


def _copy_source(src: str, files_hash: str) -> str:
    """The context path a COPY of ``src`` reads: the upload's copy of ``src`` itself, or for
    a glob the directory part before it (the upload holds only what the glob matched, and
    E2B copies what is under that directory into the destination)."""
    parts = [p for p in src.split("/") if p not in ("", ".")]
    for i, p in enumerate(parts):
        if _GLOB.search(p):
            parts = parts[:i]
            break
    return posixpath.join(FILES_PREFIX, files_hash, *parts)


def translate_template(
    body: dict[str, Any],
    *,
    base: FromImage | FromRegistry,
    base_env: dict[str, str],
    from_template: bool,
    labels: dict[str, str],
) -> TranslatedBuild:
    """E2B's ``TemplateBuildStartV2`` (as JSON) into dsec steps (see the module docstring).
    ``base`` is the resolved base; ``from_template``: it is a template (no provisioning).
    Raises ``E2BError(400)`` naming the step for a step dsec cannot take."""
    steps: list[Step] = [base]
    origins = ["base"]
    hashes: list[str] = []
    env = dict(base_env)
    no_cache = body.get("force") is True

    def add(step: Step, origin: str) -> None:
        steps.append(step)
        origins.append(origin)

    def ensure_user(name: str, sudo: bool, origin: str, current: str) -> None:
        if _NUMERIC_USER.match(name) or ":" in name:
            return  # an id or name:group: E2B's adduser would not make it either
        if current != "root":
            add(User(user="root"), origin)
        add(
            Run(
                cmd=["/bin/sh", "-c", _ENSURE_USER, "e2b-user", name, "true" if sudo else "false"],
                network="none",
                source=f"USER {name} (create it if the image lacks it)",
            ),
            origin,
        )

    user = "root"
    if not from_template:
        add(User(user="root"), "base")
        ensure_user(DEFAULT_USER, True, "base", "root")
        add(User(user=DEFAULT_USER), "base")
        add(Workdir(path=_home(DEFAULT_USER)), "base")
        user = DEFAULT_USER
    else:
        user = ""  # the template's own user (unknown here: only named when it changes)

    raw_steps = body.get("steps") or []
    if not isinstance(raw_steps, list):
        raise E2BError(400, "steps must be a list")
    for k, raw in enumerate(raw_steps, start=1):
        origin = str(k)
        if not isinstance(raw, dict):
            raise E2BError(400, f"step {k}: not an object")
        kind = raw.get("type")
        args = raw.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise E2BError(400, f"step {k} ({kind}): args must be a list of strings")
        if raw.get("force") is True:
            no_cache = True
        where = f"step {k} ({kind} {' '.join(args)[:200]})"
        try:
            if kind == "RUN":
                if not args or not args[0].strip():
                    raise E2BError(400, f"{where}: RUN needs a command")
                run_as = args[1] if len(args) > 1 and args[1] else None
                if run_as is not None and run_as != user:
                    add(User(user=run_as), origin)
                    add(Run(cmd=args[0], source=f"RUN {args[0]}"), origin)
                    if user:
                        add(User(user=user), origin)
                else:
                    add(Run(cmd=args[0], source=f"RUN {args[0]}"), origin)
            elif kind == "COPY":
                if len(args) < 2:
                    raise E2BError(400, f"{where}: COPY needs a source and a destination")
                files_hash = raw.get("filesHash")
                if not isinstance(files_hash, str) or not _HASH.match(files_hash):
                    raise E2BError(400, f"{where}: COPY needs filesHash (64 hex digits)")
                owner = args[2] if len(args) > 2 and args[2] else (user or None)
                mode = args[3] if len(args) > 3 and args[3] else None
                if files_hash not in hashes:
                    hashes.append(files_hash)
                add(
                    Copy(
                        src=[_copy_source(args[0], files_hash)],
                        dest=args[1],
                        chown=None if owner in (None, "root", "root:root") else owner,
                        chmod=mode,
                        source=f"COPY {args[0]} {args[1]}",
                    ),
                    origin,
                )
            elif kind == "ENV":
                if not args or len(args) % 2:
                    raise E2BError(400, f"{where}: ENV needs key and value pairs")
                values: dict[str, str] = {}
                for name, value in zip(args[::2], args[1::2], strict=True):
                    if not ENV_NAME.match(name):
                        raise E2BError(400, f"{where}: invalid variable name {name!r}")
                    values[name] = _expand(value, env)
                    env[name] = values[name]
                add(
                    Env(
                        vars=values, source="ENV " + " ".join(f"{k}={v}" for k, v in values.items())
                    ),
                    origin,
                )
            elif kind == "WORKDIR":
                if len(args) != 1 or not args[0]:
                    raise E2BError(400, f"{where}: WORKDIR needs one path")
                if user and user not in ("root", "0"):
                    add(
                        Run(
                            cmd=["mkdir", "-p", args[0]],
                            network="none",
                            source=f"WORKDIR {args[0]} (made as {user})",
                        ),
                        origin,
                    )
                add(Workdir(path=args[0], source=f"WORKDIR {args[0]}"), origin)
            elif kind == "USER":
                if not args or not args[0]:
                    raise E2BError(400, f"{where}: USER needs a name")
                ensure_user(args[0], len(args) > 1 and args[1] == "true", origin, user or "")
                add(User(user=args[0], source=f"USER {args[0]}"), origin)
                user = args[0]
            else:
                raise E2BError(
                    400,
                    f"step {k}: unknown step type {kind!r} (dsec takes RUN, COPY, ENV, "
                    "WORKDIR and USER)",
                )
        except ValidationError as e:
            msg = "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())
            raise E2BError(400, f"{where}: {msg}") from None

    start = body.get("startCmd")
    ready = body.get("readyCmd")
    for name, value in (("startCmd", start), ("readyCmd", ready)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise E2BError(400, f"{name} must be a non-empty string")
    try:
        if start:
            time_only = ready is None or bool(_TIME_READY.match(ready))
            add(
                StartCmd(
                    cmd=start,
                    ready_cmd=None if time_only else ready,
                    ready_timeout_s=READY_TIMEOUT_S,
                ),
                "finalize",
            )
        elif ready and not _TIME_READY.match(ready):
            add(Run(cmd=ready, source=f"READY {ready}"), "finalize")
        add(Label(labels=labels), "finalize")
    except ValidationError as e:
        msg = "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())
        raise E2BError(400, f"start or ready command: {msg}") from None
    return TranslatedBuild(steps, origins, hashes, no_cache)


# --- uploaded files ----------------------------------------------------------------------------


class TemplateFiles:
    """The COPY uploads of each key, by content hash (what the SDK computed), on disk under
    ``root/<owner>/<hash>``, at most ``max_bytes_per_key`` per key (the least recently used
    are dropped first) and ``max_file_bytes`` each."""

    def __init__(
        self,
        root: Path,
        *,
        max_file_bytes: int,
        max_bytes_per_key: int = DEFAULT_FILES_BYTES_PER_KEY,
    ) -> None:
        self.root = root
        self.max_file_bytes = max_file_bytes
        self.max_bytes_per_key = max_bytes_per_key

    def _dir(self, owner: str) -> Path:
        safe = hashlib.sha256(owner.encode()).hexdigest()[:32]
        return self.root / safe

    def path(self, owner: str, files_hash: str) -> Path:
        if not _HASH.match(files_hash):
            raise E2BError(400, f"invalid files hash {files_hash!r}: 64 hex digits")
        return self._dir(owner) / files_hash

    def present(self, owner: str, files_hash: str) -> bool:
        p = self.path(owner, files_hash)
        if p.is_file():
            with contextlib.suppress(OSError):
                os.utime(p)  # recently used
            return True
        return False

    async def store(self, owner: str, files_hash: str, request: Request) -> int:
        """Write the request body as ``owner``'s upload ``files_hash``; 413 past the limit.
        Returns its size in bytes."""
        target = self.path(owner, files_hash)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise E2BError(
                            413,
                            f"the upload is larger than {self.max_file_bytes} bytes "
                            "(DSEC_MAX_BUILD_CONTEXT_BYTES)",
                        )
                    f.write(chunk)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        await asyncio.to_thread(self._trim, target.parent, keep=target)
        return size

    def _trim(self, directory: Path, keep: Path) -> None:
        files = []
        for p in directory.iterdir():
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes_per_key:
                break
            if p == keep:
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                total -= size

    def context(self, owner: str, hashes: list[str], max_bytes: int) -> bytes:
        """One uncompressed tar: each upload's members under ``.e2b-files/<hash>/``; 413
        past ``max_bytes``, 400 for an upload that is not a tar archive."""
        out = io.BytesIO()
        total = 0
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
            for h in hashes:
                p = self.path(owner, h)
                prefix = f"{FILES_PREFIX}/{h}"
                root = tarfile.TarInfo(prefix)
                root.type, root.mode = tarfile.DIRTYPE, 0o755
                dst.addfile(root)
                try:
                    src = tarfile.open(p, mode="r:*")
                except (OSError, tarfile.TarError) as e:
                    raise E2BError(400, f"the upload {h} is not a tar archive: {e}") from None
                with src:
                    try:
                        for m in src:
                            name = m.name.lstrip("/")
                            if name in ("", "."):
                                continue
                            if m.islnk():
                                m.linkname = f"{prefix}/{m.linkname.lstrip('/')}"
                            m.name = f"{prefix}/{name}"
                            data = src.extractfile(m) if m.isreg() else None
                            total += m.size if m.isreg() else 0
                            if total > max_bytes:
                                raise E2BError(
                                    413,
                                    f"the template's files are larger than {max_bytes} bytes "
                                    "(DSEC_MAX_BUILD_CONTEXT_BYTES)",
                                )
                            dst.addfile(m, data)
                    except (tarfile.TarError, EOFError, OSError) as e:
                        raise E2BError(400, f"the upload {h} is not a readable tar: {e}") from None
        return out.getvalue()


# --- builds ------------------------------------------------------------------------------------


@dataclass
class _Build:
    build_id: str
    owner: str
    template_id: str
    alias: str
    tags: list[str]
    cpu_count: int | None
    memory_mb: int | None
    status: str = "waiting"
    entries: list[tuple[datetime, str, str, str | None]] = field(default_factory=list)
    dropped: int = 0
    reason: dict[str, Any] | None = None
    created_at: datetime = field(default_factory=_now)
    finished_at: datetime | None = None
    task: asyncio.Task[None] | None = None

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        self.entries.append((_now(), level, message, step))
        if len(self.entries) > MAX_LOG_ENTRIES:
            cut = len(self.entries) - MAX_LOG_ENTRIES
            del self.entries[:cut]
            self.dropped += cut


@dataclass(frozen=True)
class _Template:
    """A template as the key's images show it."""

    template_id: str
    alias: str
    images: list[ImageInfo]

    def by_tag(self) -> dict[str, ImageInfo]:
        return {split_image_name(i.name)[1]: i for i in self.images}

    def main(self) -> ImageInfo:
        tags = self.by_tag()
        if DEFAULT_TAG in tags:
            return tags[DEFAULT_TAG]
        return max(self.images, key=lambda i: i.created_at)


def _labels(image: ImageInfo) -> dict[str, str]:
    with contextlib.suppress(ValidationError):
        return dict(ImageConfig.from_meta(image.meta).Labels or {})
    return {}


def _build_uuid(image: ImageInfo) -> str:
    """The E2B build id of an image: its label, else one derived from its dsec build."""
    got = _labels(image).get(LABEL_BUILD)
    if got:
        with contextlib.suppress(ValueError):
            return str(uuid.UUID(got))
    seed = json.dumps([image.owner, image.name, str(image.created_at)])
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "dsec-image:" + seed))


def _int_label(image: ImageInfo, name: str, default: int) -> int:
    try:
        return int(_labels(image).get(name, default))
    except ValueError:
        return default


Guard = Callable[
    [Callable[[Request, str], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]
]


class TemplateAPI:
    """The template routes and the template side of sandbox creation (see the module
    docstring).

    Args:
        edge: the edge; builds need its :class:`~dsec.contract.edge.ImageBuilds` ability
            (without it the build routes answer 501).
        templates: the template alias map of the control plane.
        files: where uploads are kept.
        secret: HMAC key of the upload URLs (share it between replicas).
        max_context_bytes: largest upload, and largest set of files one build copies.
    """

    def __init__(
        self,
        edge: EdgeAPI,
        templates: TemplateMap,
        files: TemplateFiles,
        *,
        secret: bytes | None = None,
        max_context_bytes: int = 256 << 20,
    ) -> None:
        self.edge = edge
        self.templates = templates
        self.files = files
        self.max_context_bytes = max_context_bytes
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._builds: dict[str, _Build] = {}

    # --- plumbing ---------------------------------------------------------------------------
    def routes(self, guard: Guard) -> list[Route]:
        """Routes relative to the control plane (``E2B_API_URL``); ``guard`` checks the key."""
        g = guard
        return [
            Route("/v3/templates", g(self.request_build), methods=["POST"]),
            Route("/templates", g(self.list_templates), methods=["GET"]),
            Route("/templates/aliases/{alias}", g(self.get_alias), methods=["GET"]),
            Route("/templates/tags", g(self.assign_tags), methods=["POST"]),
            Route("/templates/tags", g(self.remove_tags), methods=["DELETE"]),
            Route("/templates/{template_id}/tags", g(self.list_tags), methods=["GET"]),
            Route("/templates/{template_id}/files/{hash}", g(self.file_link), methods=["GET"]),
            Route("/templates/{template_id}/files/{hash}", self.upload, methods=["PUT"]),
            Route(
                "/v2/templates/{template_id}/builds/{build_id}",
                g(self.start_build),
                methods=["POST"],
            ),
            Route(
                "/templates/{template_id}/builds/{build_id}/status",
                g(self.build_status),
                methods=["GET"],
            ),
            Route("/templates/{template_id}", g(self.get_template), methods=["GET"]),
            Route("/templates/{template_id}", g(self.delete_template), methods=["DELETE"]),
        ]

    async def aclose(self) -> None:
        """Stop the builds still running (their sandboxes are killed)."""
        tasks = [b.task for b in self._builds.values() if b.task is not None and not b.task.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    @staticmethod
    async def _json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise E2BError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise E2BError(400, "request body must be a JSON object")
        return body

    # --- what a key has -----------------------------------------------------------------------
    async def _templates(self, owner: str) -> dict[str, _Template]:
        """The key's templates by alias (its own images, grouped by name)."""
        groups: dict[str, list[ImageInfo]] = {}
        for img in (await self.edge.list_images(KeyScope(), owner)).images:
            if img.owner != owner or img.status != "ready" or img.meta.get("reference"):
                continue  # others', not built, or a registry reference's copy
            alias, _ = split_image_name(img.name)
            if not _ALIAS.match(alias):
                continue  # a name in reference form (host:port/repo:tag) is no template
            groups.setdefault(alias, []).append(img)
        return {a: _Template(template_id_of(owner, a), a, imgs) for a, imgs in groups.items()}

    async def _find(self, owner: str, ref: str) -> _Template | None:
        """The key's template that ``ref`` (alias, ``alias:tag`` or id) names."""
        alias = ref.partition(":")[0]
        found = await self._templates(owner)
        if alias in found:
            return found[alias]
        if _TEMPLATE_ID.match(ref):
            for t in found.values():
                if t.template_id == ref:
                    return t
        return None

    def _pending(self, owner: str, template_id: str) -> _Build | None:
        for b in reversed(list(self._builds.values())):
            if b.owner == owner and b.template_id == template_id:
                return b
        return None

    async def _alias_of(self, owner: str, template_id: str) -> str:
        """The alias of the key's template ``template_id`` (id or alias); 404 otherwise."""
        t = await self._find(owner, template_id)
        if t is not None:
            return t.alias
        b = self._pending(owner, template_id)
        if b is not None:
            return b.alias
        for b in self._builds.values():
            if b.owner == owner and b.alias == template_id:
                return b.alias
        raise E2BError(404, f"template '{template_id}' not found")

    async def sandbox_target(
        self, owner: str, template: str, target: TemplateTarget
    ) -> tuple[TemplateTarget, dict[str, Any]]:
        """What a sandbox of ``template`` is: ``target`` with a template id or ``name:default``
        turned into the key's image, and the template's size (``cpu``, ``memory_mb``) when
        its image records one."""
        image = target.image
        if image.endswith(":" + DEFAULT_TAG):
            image = image.removesuffix(":" + DEFAULT_TAG)
        if _TEMPLATE_ID.match(image):
            t = await self._find(owner, image)
            if t is not None:
                image = t.main().name
        out = TemplateTarget(tier=target.tier, image=image)
        sizes: dict[str, Any] = {}
        try:
            info = await self.edge.get_image(image_ref(image), owner)
        except DsecError:
            return out, sizes  # the create says what is wrong with it
        labels = _labels(info)
        with contextlib.suppress(ValueError):
            if LABEL_CPU in labels:
                sizes["cpu"] = float(labels[LABEL_CPU])
            if LABEL_MEMORY in labels:
                sizes["memory_mb"] = int(labels[LABEL_MEMORY])
        return out, sizes

    # --- rendering ---------------------------------------------------------------------------
    def _template_model(self, t: _Template, cls: Any = Template, **extra: Any) -> dict[str, Any]:
        main = t.main()
        created = min(i.created_at for i in t.images)
        updated = max(i.created_at for i in t.images)
        return cls(
            template_id=t.template_id,
            build_id=_build_uuid(main),
            cpu_count=_int_label(main, LABEL_CPU, 1),
            memory_mb=_int_label(main, LABEL_MEMORY, 512),
            disk_size_mb=max(1, main.size >> 20),
            public=False,
            aliases=[t.alias],
            names=[t.alias],
            created_at=created,
            updated_at=updated,
            created_by=None,
            last_spawned_at=None,
            spawn_count=0,
            build_count=len({_build_uuid(i) for i in t.images}),
            envd_version=ENVD_VERSION,
            build_status=TemplateBuildStatus.READY,
            **extra,
        ).to_dict()

    # --- routes: templates --------------------------------------------------------------------
    async def request_build(self, request: Request, owner: str) -> Response:
        """``POST /v3/templates``: a new build (``waiting``) of the template ``name``."""
        body = await self._json(request)
        name = body.get("name") if body.get("name") is not None else body.get("alias")
        alias, tag = parse_name(name)  # type: ignore[arg-type]
        raw_tags = body.get("tags")
        if raw_tags is not None and (
            not isinstance(raw_tags, list) or not all(isinstance(t, str) for t in raw_tags)
        ):
            raise E2BError(400, "tags must be a list of strings")
        tags = list(dict.fromkeys(([tag] if tag else []) + list(raw_tags or [])))
        for t in tags:
            if not _TAG.match(t):
                raise E2BError(400, f"invalid tag {t!r}: letters, digits, '.', '_' and '-'")
        tags = tags or [DEFAULT_TAG]
        sizes: dict[str, int | None] = {}
        for key, field_name, low, high in (
            ("cpuCount", "cpu_count", 1, 64),
            ("memoryMB", "memory_mb", 64, 1024 * 1024),
        ):
            value = body.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
            ):
                raise E2BError(400, f"{key} must be an integer between {low} and {high}")
            sizes[field_name] = value
        if alias in self.templates.aliases:
            raise E2BError(409, f"the template name {alias!r} is taken (a public template)")
        with contextlib.suppress(ImageNotFound):
            existing = await self.edge.get_image(image_ref(alias), owner)
            if existing.owner != owner:
                raise E2BError(409, f"the template name {alias!r} is taken (a system image)")
        b = _Build(
            build_id=str(uuid.uuid4()),
            owner=owner,
            template_id=template_id_of(owner, alias),
            alias=alias,
            tags=tags,
            cpu_count=sizes["cpu_count"],
            memory_mb=sizes["memory_mb"],
        )
        self._remember(b)
        resp = TemplateRequestResponseV3(
            template_id=b.template_id,
            build_id=b.build_id,
            public=False,
            names=[alias],
            tags=tags,
            aliases=[alias],
        )
        return JSONResponse(resp.to_dict(), status_code=202)

    def _remember(self, b: _Build) -> None:
        self._builds[b.build_id] = b
        if len(self._builds) <= MAX_BUILDS:
            return
        stale = _now().timestamp() - UPLOAD_URL_TTL_S
        for bid, old in list(self._builds.items()):
            if len(self._builds) <= MAX_BUILDS:
                break
            abandoned = old.status == "waiting" and old.created_at.timestamp() < stale
            if old.status in ("ready", "error") or abandoned:
                del self._builds[bid]

    async def list_templates(self, request: Request, owner: str) -> Response:
        found = await self._templates(owner)
        return JSONResponse([self._template_model(t) for _, t in sorted(found.items())])

    async def get_template(self, request: Request, owner: str) -> Response:
        t = await self._find(owner, request.path_params["template_id"])
        if t is None:
            raise E2BError(404, f"template '{request.path_params['template_id']}' not found")
        builds = []
        for img in sorted(t.images, key=lambda i: i.created_at, reverse=True):
            builds.append(
                TemplateBuild(
                    build_id=uuid.UUID(_build_uuid(img)),
                    status=TemplateBuildStatus.READY,
                    created_at=img.created_at,
                    updated_at=img.created_at,
                    cpu_count=_int_label(img, LABEL_CPU, 1),
                    memory_mb=_int_label(img, LABEL_MEMORY, 512),
                    finished_at=img.created_at,
                )
            )
        return JSONResponse(self._template_model(t, TemplateWithBuilds, builds=builds))

    async def get_alias(self, request: Request, owner: str) -> Response:
        alias = request.path_params["alias"]
        t = await self._find(owner, alias)
        if (t is None or t.alias != alias.partition(":")[0]) and alias in self.templates.aliases:
            # E2B's public templates (``base``, ``code-interpreter-v1`` ...): every key's
            return JSONResponse(TemplateAliasResponse(template_id=alias, public=True).to_dict())
        if t is None or t.alias != alias.partition(":")[0]:
            raise E2BError(404, f"template '{alias}' not found")
        return JSONResponse(
            TemplateAliasResponse(template_id=t.template_id, public=False).to_dict()
        )

    async def delete_template(self, request: Request, owner: str) -> Response:
        """Delete the template (every image of it) and stop its running builds; a
        snapshot (``Sandbox.delete_snapshot``) is a template like any other."""
        ref = request.path_params["template_id"]
        t = await self._find(owner, ref)
        running = [
            b
            for b in self._builds.values()
            if b.owner == owner and ref in (b.template_id, b.alias) and b.task is not None
        ]
        if t is None and not running:
            raise E2BError(404, f"template '{ref}' not found")
        for b in running:
            if b.task is not None and not b.task.done():
                b.task.cancel()
        for img in t.images if t is not None else []:
            with contextlib.suppress(ImageNotFound):
                await self.edge.delete_image(DeleteImageRequest(name=img.name), owner)
        return Response(status_code=204)

    # --- routes: tags ----------------------------------------------------------------------------
    async def list_tags(self, request: Request, owner: str) -> Response:
        t = await self._find(owner, request.path_params["template_id"])
        if t is None:
            raise E2BError(404, f"template '{request.path_params['template_id']}' not found")
        out = [
            TemplateTag(tag=tag, build_id=uuid.UUID(_build_uuid(img)), created_at=img.created_at)
            for tag, img in sorted(t.by_tag().items())
        ]
        return JSONResponse([x.to_dict() for x in out])

    async def assign_tags(self, request: Request, owner: str) -> Response:
        """``POST /templates/tags`` ``{target: "name:tag", tags}``: the target build gets more
        tags (each an image of the same layers, start command and labels: no sandbox runs)."""
        body = await self._json(request)
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list) or not tags:
            raise E2BError(400, "give target ('name:tag') and tags (a non-empty list)")
        alias, tag = parse_name(target)
        src_name = image_name(alias, tag or DEFAULT_TAG)
        t = await self._find(owner, alias)
        source = t.by_tag().get(tag or DEFAULT_TAG) if t is not None else None
        if source is None:
            raise E2BError(404, f"template '{target}' not found")
        for new in tags:
            if not isinstance(new, str) or not _TAG.match(new):
                raise E2BError(400, f"invalid tag {new!r}: letters, digits, '.', '_' and '-'")
        for new in tags:
            if new != (tag or DEFAULT_TAG):
                await self._retag(owner, src_name, image_name(alias, new))
        resp = AssignedTemplateTags(tags=list(tags), build_id=uuid.UUID(_build_uuid(source)))
        return JSONResponse(resp.to_dict(), status_code=201)

    async def _retag(self, owner: str, source: str, name: str) -> None:
        if not isinstance(self.edge, ImageBuilds):
            raise E2BError(501, "this server does not build images")
        req = BuildRequest(name=name, steps=[FromImage(image=source)])
        events = self.edge.build(owner, req, b"")
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, BuildError):
                    raise E2BError(500, f"tagging {source} as {name} failed: {ev.message}")

    async def remove_tags(self, request: Request, owner: str) -> Response:
        body = await self._json(request)
        name, tags = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(tags, list) or not tags:
            raise E2BError(400, "give name and tags (a non-empty list)")
        alias, _ = parse_name(name)
        t = await self._find(owner, alias)
        have = t.by_tag() if t is not None else {}
        missing = [x for x in tags if x not in have]
        if t is None or missing:
            raise E2BError(404, f"template '{alias}' has no tag {', '.join(map(str, missing))}")
        for x in tags:
            await self.edge.delete_image(DeleteImageRequest(name=have[x].name), owner)
        return Response(status_code=204)

    # --- routes: files ---------------------------------------------------------------------------
    def _token(self, owner: str, template_id: str, files_hash: str, expires: int) -> str:
        msg = f"e2b-upload\0{owner}\0{template_id}\0{files_hash}\0{expires}".encode()
        mac = hmac.new(self._secret, msg, hashlib.sha256).hexdigest()
        who = base64.urlsafe_b64encode(owner.encode()).decode().rstrip("=")
        return f"{who}.{expires}.{mac}"

    def _check_token(self, token: str, template_id: str, files_hash: str) -> str | None:
        who, _, rest = token.partition(".")
        expires_s, _, mac = rest.partition(".")
        try:
            owner = base64.urlsafe_b64decode(who + "=" * (-len(who) % 4)).decode()
            expires = int(expires_s)
        except (ValueError, UnicodeDecodeError):
            return None
        if expires < time.time():
            return None
        want = self._token(owner, template_id, files_hash, expires).rpartition(".")[2]
        return owner if hmac.compare_digest(want, mac) else None

    async def file_link(self, request: Request, owner: str) -> Response:
        """``GET /templates/{id}/files/{hash}``: whether the key has the upload, and a signed
        URL to ``PUT`` it to (this same path)."""
        template_id = request.path_params["template_id"]
        files_hash = request.path_params["hash"]
        await self._alias_of(owner, template_id)
        present = self.files.present(owner, files_hash)
        expires = int(time.time() + UPLOAD_URL_TTL_S)
        token = self._token(owner, template_id, files_hash, expires)
        url = str(request.url.replace(query=f"token={token}"))
        out = TemplateBuildFileUpload(present=present, url=url)
        return JSONResponse(out.to_dict(), status_code=201)

    async def upload(self, request: Request) -> Response:
        """``PUT`` of a signed upload URL: the tar(.gz) of one COPY's files."""
        template_id = request.path_params["template_id"]
        files_hash = request.path_params["hash"]
        try:
            owner = self._check_token(
                request.query_params.get("token", ""), template_id, files_hash
            )
            if owner is None:
                raise E2BError(403, "invalid or expired upload URL (ask for a new one)")
            request.scope.setdefault("state", {})["owner"] = owner
            size = await self.files.store(owner, files_hash, request)
        except E2BError as e:
            return JSONResponse({"code": e.status, "message": e.message}, status_code=e.status)
        log.debug("e2b upload %s for %s: %d bytes", files_hash, owner, size)
        return Response(status_code=200)

    # --- routes: builds --------------------------------------------------------------------------
    def _build_of(self, owner: str, template_id: str, build_id: str) -> _Build:
        b = self._builds.get(build_id)
        if b is None or b.owner != owner or template_id not in (b.template_id, b.alias):
            raise E2BError(404, f"build '{build_id}' of template '{template_id}' not found")
        return b

    async def _base(
        self, owner: str, body: dict[str, Any]
    ) -> tuple[FromImage | FromRegistry, dict[str, str], bool]:
        from_image, from_template = body.get("fromImage"), body.get("fromTemplate")
        if body.get("fromImageRegistry") is not None:
            raise E2BError(
                422,
                "registry credentials in a template are not supported by dsec: the server "
                "reads them from DSEC_REGISTRY_AUTH",
            )
        given = [x for x in (from_image, from_template) if x]
        if len(given) != 1 or not all(isinstance(x, str) for x in given):
            raise E2BError(400, "give exactly one of fromImage and fromTemplate")
        if from_template:
            assert isinstance(from_template, str)
            t = await self._find(owner, from_template)
            if t is not None:
                _, tag = split_image_name(from_template) if ":" in from_template else ("", None)
                img = t.by_tag().get(tag) if tag else t.main()
                if img is None:
                    raise E2BError(404, f"template '{from_template}' not found")
            else:
                target = self.templates.resolve(from_template)
                try:
                    img = await self.edge.get_image(image_ref(target.image), owner)
                except ImageNotFound:
                    raise E2BError(404, f"template '{from_template}' not found") from None
            env = _env_of(img)
            return FromImage(image=img.name, source=f"FROM TEMPLATE {from_template}"), env, True
        assert isinstance(from_image, str)
        name = self.templates.aliases.get(from_image, from_image)
        if IMAGE_REF.match(name):
            try:
                img = await self.edge.get_image(image_ref(name), owner)
            except ImageNotFound:
                img = None
            if img is not None or name != from_image:
                return FromImage(image=name, source=f"FROM {from_image}"), _env_of(img), False
        try:
            return FromRegistry(ref=from_image, source=f"FROM {from_image}"), {}, False
        except ValidationError:
            raise E2BError(400, f"invalid fromImage {from_image!r}") from None

    async def start_build(self, request: Request, owner: str) -> Response:
        """``POST /v2/templates/{id}/builds/{build}``: translate, prepare (refusals are
        answered here), then run in the background (202)."""
        if not isinstance(self.edge, ImageBuilds):
            raise E2BError(501, "this server does not build images")
        b = self._build_of(
            owner, request.path_params["template_id"], request.path_params["build_id"]
        )
        if b.status != "waiting":
            raise E2BError(400, f"build '{b.build_id}' was started already ({b.status})")
        body = await self._json(request)
        base, base_env, from_template = await self._base(owner, body)
        labels = {LABEL_BUILD: b.build_id}
        if b.cpu_count is not None:
            labels[LABEL_CPU] = str(b.cpu_count)
        if b.memory_mb is not None:
            labels[LABEL_MEMORY] = str(b.memory_mb)
        plan = translate_template(
            body, base=base, base_env=base_env, from_template=from_template, labels=labels
        )
        missing = [h for h in plan.hashes if not self.files.present(owner, h)]
        if missing:
            raise E2BError(
                400,
                f"the files of a COPY step were not uploaded (hash {missing[0]}): "
                "GET /templates/{id}/files/{hash} gives the upload URL",
            )
        context = await asyncio.to_thread(
            self.files.context, owner, plan.hashes, self.max_context_bytes
        )
        caps = {c.tier: c for c in (await self.edge.capabilities()).tiers}
        container = caps.get("container")
        networked = container is not None and container.available and container.network
        sizes: dict[str, Any] = {}
        if b.cpu_count is not None:
            sizes["cpu"] = float(b.cpu_count)
        if b.memory_mb is not None:
            sizes["memory_mb"] = max(256, b.memory_mb)
        try:
            req = BuildRequest(
                name=image_name(b.alias, b.tags[0]),
                steps=plan.steps,
                run_network=DOCKERFILE_RUN_NETWORK if networked else None,
                no_cache=plan.no_cache,
                **sizes,
            )
        except ValidationError as e:
            msg = "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())
            raise E2BError(400, f"invalid template build: {msg}") from None
        events = self.edge.build(owner, req, context)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise E2BError(500, "the build ended before it started") from None
        except DsecError as e:
            await events.aclose()
            status = control_status(e)
            step = e.details.get("step") if isinstance(e.details, dict) else None
            where = ""
            if isinstance(step, int) and 1 <= step <= len(plan.origins):
                origin = plan.origins[step - 1]
                where = f"template step {origin}: " if origin.isdigit() else f"{origin}: "
            if isinstance(e, ImageNotFound):
                raise E2BError(404, f"{where}base image not found: {e.public_message}") from None
            raise E2BError(status, where + e.public_message) from None
        b.status = "building"
        b.log(f"Building template {b.alias} ({', '.join(b.tags)})", step="base")
        self._on_event(b, first, plan)
        b.task = asyncio.create_task(self._run(b, events, plan), name=f"e2b build {b.build_id}")
        return Response(status_code=202)

    def _on_event(self, b: _Build, ev: Any, plan: TranslatedBuild) -> None:
        def origin(step: int | None) -> str | None:
            if step is None or not 1 <= step <= len(plan.origins):
                return None
            return plan.origins[step - 1]

        if isinstance(ev, BuildStarted):
            b.log(f"{ev.steps} dsec build steps on {ev.base}", step="base")
            for note in ev.notes:
                b.log(note, "warn")
        elif isinstance(ev, StepStarted):
            b.log(f"[{origin(ev.step)}] {ev.instruction}", step=origin(ev.step))
        elif isinstance(ev, StepCached):
            b.log(f"[{origin(ev.step)}] CACHED", step=origin(ev.step))
        elif isinstance(ev, StepOutput):
            for line in ev.data.splitlines():
                b.log(line, "error" if ev.stream == "stderr" else "info", step=origin(ev.step))
        elif isinstance(ev, StepDone):
            if ev.duration_ms >= 1000:
                b.log(f"[{origin(ev.step)}] done in {ev.duration_ms / 1000:.1f} s")

    async def _run(self, b: _Build, events: Any, plan: TranslatedBuild) -> None:
        error: BuildError | None = None
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    self._on_event(b, ev, plan)
                    if isinstance(ev, BuildError):
                        error = ev
                    elif isinstance(ev, BuildDone):
                        b.log(
                            f"Image {ev.image.name}: {ev.built_steps} steps built, "
                            f"{ev.cached_steps} cached, {ev.duration_ms / 1000:.1f} s"
                        )
            if error is None:
                for tag in b.tags[1:]:
                    await self._retag(
                        owner=b.owner,
                        source=image_name(b.alias, b.tags[0]),
                        name=image_name(b.alias, tag),
                    )
        except asyncio.CancelledError:
            self._fail(
                b, "the build was cancelled (the template was deleted or the server stopped)"
            )
            raise
        except E2BError as e:
            self._fail(b, e.message)
            return
        except DsecError as e:
            self._fail(b, e.public_message)
            return
        except Exception as e:
            log.exception("e2b build %s failed", b.build_id)
            self._fail(b, f"internal error: {e}")
            return
        if error is not None:
            step = None
            if error.step is not None and 1 <= error.step <= len(plan.origins):
                step = plan.origins[error.step - 1]
            message = error.message
            if step is not None and step.isdigit():
                message = f"template step {step}: {message}"
            self._fail(b, message, step=step, tail=error.output_tail)
            return
        b.status = "ready"
        b.finished_at = _now()
        b.log("Template is ready")

    def _fail(self, b: _Build, message: str, *, step: str | None = None, tail: str = "") -> None:
        b.status = "error"
        b.finished_at = _now()
        b.log(message, "error", step=step)
        reason: dict[str, Any] = {"message": message}
        if step is not None:
            reason["step"] = step
        lines = [ln for ln in tail.splitlines() if ln.strip()][-50:]
        if lines:
            reason["log_entries"] = [(_now(), "error", ln, step) for ln in lines]
        b.reason = reason

    async def build_status(self, request: Request, owner: str) -> Response:
        b = self._build_of(
            owner, request.path_params["template_id"], request.path_params["build_id"]
        )
        q = request.query_params
        try:
            offset = int(q.get("logsOffset", 0))
            limit = int(q.get("limit", LOGS_PAGE))
        except ValueError:
            raise E2BError(400, "logsOffset and limit must be integers") from None
        if offset < 0 or not 0 <= limit <= LOGS_PAGE:
            raise E2BError(400, f"logsOffset must be >= 0 and limit between 0 and {LOGS_PAGE}")
        levels = ["debug", "info", "warn", "error"]
        min_level = q.get("level")
        start = max(0, offset - b.dropped)
        page: list[BuildLogEntry] = []
        for when, level, message, step in b.entries[start:]:
            if len(page) >= limit:
                break
            if min_level in levels and levels.index(level) < levels.index(min_level):
                continue
            page.append(_entry(when, level, message, step))
        reason: Any = None
        if b.reason is not None:
            reason = BuildStatusReason(
                message=b.reason["message"],
                step=b.reason.get("step") or _UNSET,
                log_entries=[_entry(*e) for e in b.reason.get("log_entries", [])] or _UNSET,
            )
        info = TemplateBuildInfo(
            logs=[],
            log_entries=page,
            template_id=b.template_id,
            build_id=b.build_id,
            status=TemplateBuildStatus(b.status),
            reason=reason if reason is not None else _UNSET,
        )
        return JSONResponse(info.to_dict())


def _entry(when: datetime, level: str, message: str, step: str | None) -> BuildLogEntry:
    return BuildLogEntry(
        timestamp=when, message=message, level=LogLevel(level), step=step if step else _UNSET
    )


def _env_of(image: ImageInfo | None) -> dict[str, str]:
    if image is None:
        return {}
    with contextlib.suppress(ValidationError):
        return ImageConfig.from_meta(image.meta).env_dict()
    return {}
