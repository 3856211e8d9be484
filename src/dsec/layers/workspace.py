"""Composable layers: what a layer provides and requires, stack checks, workspace layers.

Glossary:
    stack: the layers of one sandbox, bottom first: its image's layers, then the extra
        ``layers=[...]`` of the create request (workspaces, toolkits).
    label: a short name of something a layer offers to the layers above it: ``glibc``,
        ``debian-12``, ``apt``, ``python3``, ``busybox``, ...
    provides / requires: lists of labels in a layer's metadata (``meta["provides"]``,
        ``meta["requires"]``). A layer's requirement is met when some layer *below* it
        provides the label.

Layers that carry no labels get defaults from what they are (:func:`layer_labels`):

* the built-in ``debian`` base provides ``glibc``, ``debian-<version>``, ``apt`` and the
  packages it includes (``python3``); the built-in ``busybox`` provides ``busybox``;
* a ``toolkit`` layer (Debian packages installed over a Debian base, see
  :mod:`dsec.runtimes.fncall.toolkits`) requires ``glibc`` and ``debian-12`` and provides its
  toolkit name and packages;
* a layer converted from an OCI image (``dsec image pull``) provides what its files show
  (:func:`detect_provides`): ``glibc`` or ``musl``, ``<os id>`` and ``<os id>-<version>``
  from os-release (``debian-12``), ``apt`` / ``apk``, ``busybox``, ``python3``;
* anything else provides and requires nothing (give it labels when you push it).

:func:`check_stack` refuses a stack with an unmet requirement, naming the layer and the
missing labels: the edge calls it at create time, before anything is mounted.

Workspace layers (:func:`build_workspace_layer`) come from a directory, a tarball or a git
checkout (``git archive`` of a commit of a local repository or ``file://`` URL: file times
are the commit's, so the same commit always gives the same layer digest; no network).

Example::

    ws = build_workspace_layer(store, "/srv/repos/app", git_ref="v1.2")
    check_stack([*store.resolve_layers(["debian"]), ws])
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from dsec.errors import InvalidRequest, SandboxError
from dsec.layers.tarball import extract_tarball
from dsec.models import LayerInfo

__all__ = [
    "BUILTIN_LABELS",
    "TOOLKIT_REQUIRES",
    "build_workspace_layer",
    "check_stack",
    "detect_provides",
    "layer_labels",
    "normalise_labels",
]

log = logging.getLogger(__name__)

_DEBIAN_VERSIONS = {"bookworm": "12", "trixie": "13", "bullseye": "11"}
BUILTIN_LABELS: dict[str, tuple[str, ...]] = {
    "busybox": ("busybox",),
    "debian": ("glibc", "apt"),  # + debian-<version> and the included packages
    # Debian bookworm with Jupyter (dsec.layers.code_interpreter): toolkits stack on it
    "code-interpreter": ("glibc", "apt", "debian-12", "python3"),
}
"""Labels the built-in images provide (see :func:`layer_labels` for the Debian extras)."""

TOOLKIT_REQUIRES: tuple[str, ...] = ("glibc", "debian-12")
"""What a toolkit layer needs below it when its metadata does not say."""

_LABEL_RE = re.compile(r"^[a-z0-9][a-z0-9._+-]{0,63}$")
_GIT_REF_RE = re.compile(r"^[A-Za-z0-9._/@{}^~-]{1,200}$")
_GIT_TIMEOUT_S = 120.0


def normalise_labels(labels: Iterable[str] | str | None, *, what: str = "labels") -> list[str]:
    """Labels as a sorted, de-duplicated list; a string is split on commas.

    Raises:
        InvalidRequest: a label that is not ``[a-z0-9][a-z0-9._+-]*`` (at most 64 chars).
    """
    if labels is None:
        return []
    items = labels.split(",") if isinstance(labels, str) else list(labels)
    out = set()
    for item in items:
        label = str(item).strip()
        if not label:
            continue
        if not _LABEL_RE.match(label):
            raise InvalidRequest(f"invalid {what} label {label!r}: [a-z0-9][a-z0-9._+-]*")
        out.add(label)
    return sorted(out)


_MARKERS: tuple[tuple[str, str], ...] = (
    ("glibc", "usr/lib/x86_64-linux-gnu/libc.so.6"),
    ("glibc", "lib/x86_64-linux-gnu/libc.so.6"),
    ("glibc", "lib64/ld-linux-x86-64.so.2"),
    ("musl", "lib/ld-musl-x86_64.so.1"),
    ("apt", "usr/bin/apt-get"),
    ("apk", "sbin/apk"),
    ("busybox", "bin/busybox"),
    ("python3", "usr/bin/python3"),
)
_OS_RELEASE = ("etc/os-release", "usr/lib/os-release")


def _inside(tree: Path, rel: str) -> Path | None:
    """``tree/rel`` if every directory on the way is a real directory of the tree (no
    symlinked directory: an absolute link such as ``lib -> /usr/lib`` would resolve on the
    host), else None. The last component may be a link (``libc.so.6`` usually is)."""
    parts = rel.split("/")
    cur = tree
    for part in parts[:-1]:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
    path = cur / parts[-1]
    return path if os.path.lexists(path) else None


def detect_provides(tree: Path) -> list[str]:
    """Labels a root filesystem tree provides, read from its files (see the module
    docstring); symlinks are never followed out of the tree. For the layers of images
    pulled from OCI registries, which carry no labels of their own."""
    found = {label for label, rel in _MARKERS if _inside(tree, rel) is not None}
    for rel in _OS_RELEASE:
        path = _inside(tree, rel)
        if path is None or not stat.S_ISREG(os.lstat(path).st_mode):
            continue
        try:
            text = path.read_text(errors="replace")[:8192]
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key.strip()] = value.strip().strip("\"'")
        os_id = fields.get("ID", "").lower()
        version = fields.get("VERSION_ID", "").lower()
        for label in (os_id, f"{os_id}-{version}" if os_id and version else ""):
            if label and _LABEL_RE.match(label):
                found.add(label)
        break
    return sorted(found)


def layer_labels(layer: LayerInfo) -> tuple[list[str], list[str]]:
    """``(provides, requires)`` of a layer: its metadata's lists when it has them, else the
    defaults described in the module docstring.

    Raises:
        InvalidRequest: malformed labels in the metadata.
    """
    meta: dict[str, Any] = layer.meta or {}
    provides = normalise_labels(meta.get("provides"), what="provides")
    requires = normalise_labels(meta.get("requires"), what="requires")
    if "provides" not in meta:
        provides = _default_provides(layer, meta)
    if "requires" not in meta and layer.kind == "toolkit":
        requires = normalise_labels(TOOLKIT_REQUIRES)
    return provides, requires


def _default_provides(layer: LayerInfo, meta: dict[str, Any]) -> list[str]:
    builtin = meta.get("builtin")
    if builtin == "debian":
        version = _DEBIAN_VERSIONS.get(str(meta.get("suite", "")), "")
        extra = [f"debian-{version}"] if version else []
        included = [p for p in meta.get("include") or [] if isinstance(p, str)]
        return normalise_labels([*BUILTIN_LABELS["debian"], *extra, *included])
    if isinstance(builtin, str) and builtin in BUILTIN_LABELS:
        return list(BUILTIN_LABELS[builtin])
    if layer.kind == "toolkit":
        names = [meta.get("toolkit"), *(meta.get("packages") or [])]
        return normalise_labels([n for n in names if isinstance(n, str) and _LABEL_RE.match(n)])
    return []


def check_stack(layers: list[LayerInfo]) -> None:
    """Refuse a stack (bottom first) in which a layer requires a label that no layer below
    it provides. Pure: reads only the layers' metadata, mounts nothing.

    Raises:
        InvalidRequest: ``details`` has ``layer`` (digest), ``name``, ``missing`` (labels)
            and ``available`` (what the layers below provide).
    """
    provided: set[str] = set()
    for position, layer in enumerate(layers):
        provides, requires = layer_labels(layer)
        missing = sorted(set(requires) - provided)
        if missing:
            label = layer.name or layer.digest
            below = ", ".join(sorted(provided)) or "nothing"
            raise InvalidRequest(
                f"layer {label} ({layer.kind}, position {position} from the bottom) requires "
                f"{', '.join(missing)}, which no layer below it provides (below: {below})",
                layer=layer.digest,
                name=layer.name,
                missing=missing,
                available=sorted(provided),
            )
        provided.update(provides)


# --- workspace layers -------------------------------------------------------------------


def _git(args: list[str], *, cwd: Path | None = None, stdout: Any = subprocess.PIPE) -> str:
    """Run ``git`` with every network transport disabled; stdout as text (unless redirected).

    Raises:
        InvalidRequest: git failed (its stderr in the message). SandboxError: no git binary.
    """
    env = {
        **os.environ,
        "GIT_ALLOW_PROTOCOL": "file",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    argv = ["git", "-c", "protocol.allow=never", "-c", "protocol.file.allow=always", *args]
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as e:
        raise SandboxError("git is not installed (apt-get install git)") from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"git {args[0]} took more than {_GIT_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()[-800:]
        raise InvalidRequest(f"git {' '.join(args[:3])} failed: {err}")
    return proc.stdout.decode(errors="replace") if stdout is subprocess.PIPE else ""


def _git_repo_path(source: Path | str) -> Path:
    """A local repository path from a path or a ``file://`` URL (anything else refused)."""
    if isinstance(source, str) and "://" in source:
        parsed = urlparse(source)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise InvalidRequest(
                f"git source {source!r}: only local paths and file:// URLs (no network)"
            )
        return Path(unquote(parsed.path))
    return Path(source)


def build_workspace_layer(
    store: Any, source: Path | str, *, git_ref: str | None = None, name: str | None = None
) -> LayerInfo:
    """Build a ``workspace`` layer from a directory, a tarball, or a git checkout.

    A git checkout is taken when ``git_ref`` is given or ``source`` is a ``file://`` URL:
    ``git archive`` of that commit (default ``HEAD``) of the local repository, so only
    committed files, with the commit's time as every file's mtime (same commit, same
    digest). Submodules are not included.

    Args:
        store: a :class:`dsec.layers.store.LayerStore`.
        source: a directory, a tarball (``.tar``, ``.tar.gz``, ...), or a git repository
            (path or ``file://`` URL).
        git_ref: a commit, branch or tag of that repository.
        name: the layer's label (default: the source's base name, plus ``@<ref>`` for git).

    Returns:
        The layer (``meta``: ``source`` and, for git, ``git_commit``/``git_ref``;
        ``provides``/``requires`` empty: a workspace stacks on anything).

    Raises:
        InvalidRequest: missing source, not a repository, unknown ref, remote git URL.
        SandboxError: git or mkfs.erofs failed to run.
    """
    use_git = git_ref is not None or (isinstance(source, str) and source.startswith("file://"))
    if not use_git:
        path = Path(source)
        if not path.exists():
            raise InvalidRequest(f"workspace source {path} does not exist", path=str(path))
        meta = {"source": str(path.resolve()), "provides": [], "requires": []}
        built: LayerInfo = store.build_layer(
            path, "workspace", name=name or path.name or "workspace", meta=meta
        )
        return built
    repo = _git_repo_path(source)
    if not repo.exists():
        raise InvalidRequest(f"git repository {repo} does not exist", path=str(repo))
    ref = git_ref or "HEAD"
    if not _GIT_REF_RE.match(ref) or ref.startswith("-"):
        raise InvalidRequest(f"invalid git ref {ref!r}")
    commit = _git(["rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}"], cwd=repo)
    commit = commit.strip()
    commit_time = int(_git(["show", "-s", "--format=%ct", commit], cwd=repo).strip() or 0)
    work = Path(store.scratch) / f"git-{os.getpid()}-{commit[:12]}-{os.urandom(4).hex()}"
    try:
        work.mkdir(parents=True)
        archive = work / "checkout.tar"
        with open(archive, "wb") as out:
            _git(["archive", "--format=tar", commit], cwd=repo, stdout=out)
        tree = work / "tree"
        extract_tarball(archive, tree)
        archive.unlink()
        # git archive has no entry for the root: give it the commit's time, like every file.
        os.utime(tree, (commit_time, commit_time))
        meta = {
            "source": "git",
            "git_repository": str(repo.resolve()),
            "git_ref": ref,
            "git_commit": commit,
            "provides": [],
            "requires": [],
        }
        label = name or f"{repo.resolve().name}@{ref}"
        layer: LayerInfo = store.build_layer(tree, "workspace", name=label[:256], meta=meta)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("workspace layer %s from %s@%s (%s)", layer.digest, repo, ref, commit[:12])
    return layer
