"""Built-in images: root filesystems dsec can build on a node without any registry.

``BUILTIN_IMAGES`` maps an image name to a :class:`BuiltinImage` recipe. The layer store
(:meth:`dsec.layers.store.LayerStore.ensure_image`) builds a recipe the first time its name is
asked for and stores the result as an ordinary one-layer image; the layer itself is the cache,
so nothing else is kept.

* ``busybox``: ``/bin/busybox`` from Debian's ``busybox-static`` plus one symlink per applet,
  minimal ``/etc``. ~2 MB, built in well under a second.
* ``debian``: ``debootstrap --variant=minbase --include=python3 bookworm`` from the mirror
  apt already uses. ~200 MB unpacked, 30-60 s.
* ``code-interpreter``: ``debian`` plus Jupyter kernels and E2B's code-interpreter server
  on port 49999 (:mod:`dsec.layers.code_interpreter`; its metadata names the start
  command, ``start_cmd``). ~700 MB unpacked, a few minutes.
* ``e2b-base``: what E2B's ``base`` template looks like to code written for it (the E2B API's
  ``base`` template): the same Debian with ``python3`` (also as ``python``), ``pip``,
  ``venv``, ``curl``, ``git``, ``sudo``, ``procps`` and CA certificates, and the user
  ``user`` (1000, home ``/home/user``, shell bash, passwordless ``sudo``) as the image's
  default user and working directory (``meta["config"]``: ``User``, ``WorkingDir``).
  ~330 MB unpacked, 60-120 s.
* ``desktop``: two layers, ``debian``'s and a desktop toolkit layer on it (Xvfb, Xfce,
  xdotool, scrot, x11vnc/noVNC, Chromium; :mod:`dsec.layers.desktop`), whose start command
  runs the desktop. ~1.2 GB on top of ``debian``, a few minutes.

``busybox`` and ``debian`` have the users ``root`` (0), ``sandbox`` (1000, home
``/home/sandbox``) and ``nobody`` (65534); ``e2b-base`` and ``desktop`` have E2B's ``user``
(1000, home ``/home/user``) instead of ``sandbox``.

Adding a recipe (tests use this hook to count builds)::

    BUILTIN_IMAGES["tiny"] = BuiltinImage(name="tiny", build_rootfs=my_builder)
    # or, in pytest: monkeypatch.setitem(BUILTIN_IMAGES, "tiny", BuiltinImage(...))

``build_rootfs(dest)`` must fill the (existing, empty) directory ``dest``; it runs in a worker
thread and may block.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import SandboxError
from dsec.models import LayerKind
from dsec.privileged.mount import mount_points, umount_quiet

__all__ = [
    "BUILTIN_EPOCH",
    "BUILTIN_IMAGES",
    "DEBIAN_SUITE",
    "E2B_BASE_PACKAGES",
    "E2B_HOME",
    "E2B_USER",
    "SANDBOX_GID",
    "SANDBOX_UID",
    "BuiltinImage",
    "apt_install_into",
    "build_busybox_rootfs",
    "build_code_interpreter_rootfs",
    "build_debian_rootfs",
    "build_desktop_layer",
    "build_e2b_base_rootfs",
    "debian_mirror",
]

log = logging.getLogger(__name__)

SANDBOX_UID = 1000
SANDBOX_GID = 1000
BUILTIN_EPOCH = 1_704_067_200
"""mtime (seconds since the epoch, 2024-01-01) given to every file of the busybox rootfs, so
the same busybox binary yields the same layer digest on every node."""

DEBIAN_SUITE = "bookworm"
E2B_USER = "user"
"""The default user of E2B sandboxes (uid :data:`SANDBOX_UID`), as in E2B's templates."""
E2B_HOME = "/home/user"
E2B_BASE_PACKAGES = (
    "python3",
    "python3-pip",
    "python3-venv",
    "python-is-python3",
    "curl",
    "ca-certificates",
    "git",
    "sudo",
    "procps",
)
"""Debian packages of the ``e2b-base`` image (E2B's base template: python, pip, curl, git,
sudo; its compilers and Node.js are left out: install them with apt in a sandbox that has
the ``debian`` network preset, or build an image)."""
DEBIAN_FALLBACK_MIRROR = "http://deb.debian.org/debian"
_DEBOOTSTRAP_TIMEOUT_S = 1800.0

_PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:/home/sandbox:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


@dataclass(frozen=True)
class BuiltinImage:
    """A recipe for an image dsec can build locally.

    Attributes:
        name: the image name users ask for (``create(image=name)``).
        build_rootfs: fills an empty directory with the root filesystem; may block for minutes.
        kind: the kind recorded for the resulting layer.
        meta: metadata recorded on the layer and the image (suite, variant, ...).
        description: one line for listings and error messages.
    """

    name: str
    build_rootfs: Callable[[Path], None]
    kind: LayerKind = "base"
    meta: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    base: str | None = None
    """A built-in image this one is layered on. Then ``build_rootfs`` gets the base's tree
    (an overlay over its layers, :func:`dsec.layers.overlay_build.build_over`; it must be a
    module-level function) and what it changes becomes one layer on top: the image is the
    base's layers + that layer, and is rebuilt when the base's layers change."""


def _is_static_elf(path: Path) -> bool:
    """True if ``path`` is a 64-bit little-endian ELF without a PT_INTERP (dynamic loader)."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return False
        e_phoff = struct.unpack_from("<Q", ident, 32)[0]
        e_phentsize, e_phnum = struct.unpack_from("<HH", ident, 54)
        f.seek(e_phoff)
        table = f.read(e_phentsize * e_phnum)
    for i in range(e_phnum):
        (p_type,) = struct.unpack_from("<I", table, i * e_phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def _find_static_busybox() -> Path:
    for candidate in ("/bin/busybox", "/usr/bin/busybox", "/usr/sbin/busybox"):
        p = Path(candidate)
        if p.is_file() and _is_static_elf(p):
            return p
    raise SandboxError(
        "no statically linked busybox found (looked in /bin, /usr/bin, /usr/sbin): "
        "install the busybox-static package"
    )


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def _set_tree_mtime(root: Path, mtime_s: int) -> None:
    """Set atime and mtime of every entry under ``root`` (symlinks themselves, not targets)."""
    ns = mtime_s * 1_000_000_000
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), ns=(ns, ns), follow_symlinks=False)
    os.utime(root, ns=(ns, ns), follow_symlinks=False)


def build_busybox_rootfs(dest: Path) -> None:
    """Fill ``dest`` with a busybox root filesystem (about 2 MB; well under 0.5 s).

    Layout: ``/bin/busybox`` (static) and a symlink to it for every applet at the path
    ``busybox --list-full`` names (``/bin/sh``, ``/usr/bin/awk``, ...); ``/etc/passwd`` and
    ``/etc/group`` with root (0), sandbox (1000) and nobody (65534); ``/tmp`` mode 1777;
    ``/root`` 0700; ``/home/sandbox`` owned by 1000; empty ``/proc``, ``/sys``, ``/dev``;
    ``/etc/hostname`` ("sandbox"), ``/etc/hosts`` and an empty ``/etc/resolv.conf``. Every
    mtime is :data:`BUILTIN_EPOCH`, so the layer digest depends only on the busybox binary.

    Raises:
        SandboxError: no static busybox on this host, or ``dest`` is not empty.
    """
    busybox = _find_static_busybox()
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise SandboxError(f"{dest} is not empty", path=str(dest))
    os.chmod(dest, 0o755)
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "var", "run"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(busybox, dest / "bin/busybox")
    os.chmod(dest / "bin/busybox", 0o755)
    proc = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=False, timeout=30
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SandboxError(f"busybox --list-full failed: {proc.stderr.strip()}")
    for line in proc.stdout.split():
        rel = line.strip().lstrip("/")
        if not rel or ".." in rel.split("/") or rel == "bin/busybox":
            continue
        link = dest / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(link):
            os.symlink("/bin/busybox", link)
    etc = dest / "etc"
    _write(etc / "passwd", _PASSWD)
    _write(etc / "group", _GROUP)
    _write(etc / "hostname", "sandbox\n")
    _write(etc / "hosts", _HOSTS)
    _write(etc / "resolv.conf", "")
    tmp = dest / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    (dest / "var/tmp").mkdir()
    os.chmod(dest / "var/tmp", 0o1777)
    (dest / "root").mkdir(mode=0o700)
    os.chmod(dest / "root", 0o700)
    home = dest / "home/sandbox"
    home.mkdir(parents=True)
    os.chmod(home, 0o755)
    if os.geteuid() == 0:
        os.chown(home, SANDBOX_UID, SANDBOX_GID)
    _set_tree_mtime(dest, BUILTIN_EPOCH)


def _mirror_from_deb822(text: str) -> str | None:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        types = fields.get("types", "").split()
        suites = fields.get("suites", "").split()
        uris = fields.get("uris", "").split()
        enabled = fields.get("enabled", "yes").lower() != "no"
        if enabled and "deb" in types and uris and any("-security" not in s for s in suites):
            return uris[0]
    return None


def _mirror_from_one_line(text: str) -> str | None:
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = [w for w in words[1:] if not w.startswith("[")]  # drop "[signed-by=...]" options
        if len(words) >= 2 and "-security" not in words[1] and "debian" in words[0]:
            return words[0]
    return None


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror apt uses on this host (``debian.sources`` or ``sources.list``).

    Falls back to ``http://deb.debian.org/debian``. The security archive is never chosen
    (it has no ``bookworm`` suite, only ``bookworm-security``).
    """
    sources_d = apt_dir / "sources.list.d"
    candidates = [sources_d / "debian.sources"]
    if sources_d.is_dir():
        candidates += sorted(p for p in sources_d.glob("*.sources") if p.name != "debian.sources")
    for path in candidates:
        if path.is_file():
            found = _mirror_from_deb822(path.read_text(errors="replace"))
            if found and "debian" in found:
                return found.rstrip("/")
    one_line = [apt_dir / "sources.list"]
    if sources_d.is_dir():
        one_line += sorted(sources_d.glob("*.list"))
    for path in one_line:
        if path.is_file():
            found = _mirror_from_one_line(path.read_text(errors="replace"))
            if found:
                return found.rstrip("/")
    return DEBIAN_FALLBACK_MIRROR


def _unmount_under(path: Path, *, include_self: bool = True) -> None:
    """Unmount everything mounted at or below ``path`` (only below it, without
    ``include_self``: ``path`` may itself be a build's overlay), deepest first (debootstrap
    and maintainer-script leftovers)."""
    top = Path(os.path.abspath(path))
    for _ in range(64):
        mps = [m for m in mount_points(path) if include_self or m != top]
        if not mps:
            return
        umount_quiet(max(mps, key=lambda p: len(p.parts)))
    raise SandboxError(f"could not unmount everything under {path}", path=str(path))


def _append_line(path: Path, line: str, key: str) -> None:
    text = path.read_text() if path.exists() else ""
    if any(existing.split(":", 1)[0] == key for existing in text.splitlines()):
        return
    if text and not text.endswith("\n"):
        text += "\n"
    path.write_text(text + line + "\n")


def _add_user(root: Path, name: str, home_dir: str, groups: tuple[str, ...] = ()) -> None:
    """Add ``name`` (uid/gid :data:`SANDBOX_UID`, shell bash, home ``home_dir`` from
    ``/etc/skel``, owned by it) to the rootfs at ``root``, and to the existing ``groups``."""
    etc = root / "etc"
    _append_line(
        etc / "passwd",
        f"{name}:x:{SANDBOX_UID}:{SANDBOX_GID}:{name}:{home_dir}:/bin/bash",
        name,
    )
    _append_line(etc / "group", f"{name}:x:{SANDBOX_GID}:", name)
    if (etc / "shadow").exists():
        _append_line(etc / "shadow", f"{name}:*:19700:0:99999:7:::", name)
        os.chmod(etc / "shadow", 0o640)
    if (etc / "gshadow").exists():
        _append_line(etc / "gshadow", f"{name}:*::", name)
        os.chmod(etc / "gshadow", 0o640)
    for group in groups:
        _add_group_member(etc / "group", group, name)
    home = root / home_dir.lstrip("/")
    if not home.exists():
        skel = root / "etc/skel"
        if skel.is_dir():
            shutil.copytree(skel, home, symlinks=True)
        else:
            home.mkdir(parents=True)
    os.chmod(home, 0o755)
    for dirpath, dirnames, filenames in os.walk(home):
        for entry in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, entry), SANDBOX_UID, SANDBOX_GID, follow_symlinks=False)
    os.chown(home, SANDBOX_UID, SANDBOX_GID)


def _add_group_member(group_file: Path, group: str, member: str) -> None:
    """Add ``member`` to the member list of ``group`` in ``/etc/group`` (must exist)."""
    lines = group_file.read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if len(fields) == 4 and fields[0] == group:
            members = [m for m in fields[3].split(",") if m]
            if member not in members:
                fields[3] = ",".join([*members, member])
            lines[i] = ":".join(fields)
            group_file.write_text("\n".join(lines) + "\n")
            return
    raise SandboxError(f"group {group!r} is missing from the image's /etc/group")


def _add_sandbox_user(root: Path) -> None:
    _add_user(root, "sandbox", "/home/sandbox")


def _empty_dir(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _strip_debian(root: Path) -> None:
    lists = root / "var/lib/apt/lists"
    if lists.is_dir():
        for child in lists.iterdir():
            if child.is_file() or child.is_symlink():
                child.unlink()
    cache = root / "var/cache/apt"
    if cache.is_dir():
        for child in cache.glob("*.bin"):
            child.unlink()
        archives = cache / "archives"
        if archives.is_dir():
            for deb in archives.glob("*.deb"):
                deb.unlink()
    _empty_dir(root / "dev")  # the runtime provides /dev; device nodes in a layer are a hazard
    _empty_dir(root / "run")
    _empty_dir(root / "tmp")
    for log_file in ("var/log/bootstrap.log",):
        (root / log_file).unlink(missing_ok=True)
    shutil.rmtree(root / "debootstrap", ignore_errors=True)
    (root / "etc/hostname").write_text("sandbox\n")
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("")
    (root / "etc/hosts").write_text(_HOSTS)
    os.chmod(root / "tmp", 0o1777)


def _debootstrap(dest: Path, include: tuple[str, ...]) -> None:
    """``debootstrap --variant=minbase --include=<include> bookworm`` into ``dest``, then
    emptied of apt lists and caches, ``/dev``, ``/run`` and ``/tmp`` (:func:`_strip_debian`)."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SandboxError("debootstrap not found: install the debootstrap package")
    if os.geteuid() != 0:
        raise SandboxError("building a debian image needs root (debootstrap)")
    dest.mkdir(parents=True, exist_ok=True)
    mirror = debian_mirror()
    argv = [
        debootstrap,
        "--variant=minbase",
        f"--include={','.join(include)}",
        "--merged-usr",
        DEBIAN_SUITE,
        os.fspath(dest),
        mirror,
    ]
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "LC_ALL": "C",
        "DEBIAN_FRONTEND": "noninteractive",
    }
    log.info("debootstrap %s (+%s) from %s into %s", DEBIAN_SUITE, ",".join(include), mirror, dest)
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=_DEBOOTSTRAP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"debootstrap timed out after {_DEBOOTSTRAP_TIMEOUT_S:.0f} s") from e
    finally:
        _unmount_under(dest)
    if proc.returncode != 0:
        out = proc.stdout.decode(errors="replace")
        debootstrap_log = dest / "debootstrap/debootstrap.log"
        if debootstrap_log.is_file():
            out += "\n" + debootstrap_log.read_text(errors="replace")
        tail = "\n".join(out.strip().splitlines()[-20:])
        raise SandboxError(
            f"debootstrap failed (exit {proc.returncode}) using mirror {mirror}:\n{tail}",
            mirror=mirror,
            exit_code=proc.returncode,
        )
    _strip_debian(dest)
    if not (dest / "usr/bin/python3").exists():
        raise SandboxError("debootstrap finished but /usr/bin/python3 is missing")
    st = os.lstat(dest / "tmp")
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError("debootstrap produced no /tmp directory")


def build_debian_rootfs(dest: Path, include: tuple[str, ...] = ("python3",)) -> None:
    """Fill ``dest`` with ``debootstrap --variant=minbase --include=python3 bookworm``.

    ``include`` names the packages debootstrap adds (with their dependencies); it must
    contain ``python3``.

    Uses the mirror from :func:`debian_mirror`. Adds the ``sandbox`` user (uid/gid 1000, home
    ``/home/sandbox``, shell bash), empties apt lists, apt caches, ``/dev``, ``/run`` and
    ``/tmp``, writes ``/etc/hostname``, ``/etc/hosts`` and an empty ``/etc/resolv.conf``.
    Takes 30-60 s on this machine (network-bound) and ~200 MB of disk.

    Raises:
        SandboxError: debootstrap is missing or failed (the tail of its log is in the message).
    """
    _debootstrap(dest, include)
    _add_sandbox_user(dest)


def build_e2b_base_rootfs(dest: Path) -> None:
    """Fill ``dest`` with E2B's ``base`` template as Debian packages: the ``debian`` image's
    debootstrap plus :data:`E2B_BASE_PACKAGES`, and E2B's user set-up: ``user`` (uid/gid
    1000, home ``/home/user`` from ``/etc/skel``, shell bash) in the ``sudo`` group with
    passwordless ``sudo`` (``/etc/sudoers.d/e2b-user``, 0440), ``/usr/local`` writable by
    everyone and an empty ``/code`` (mode 1777), as E2B's template finalisation does; the
    hostname ``sandbox`` is in ``/etc/hosts`` (sudo resolves it).
    Passwordless sudo needs sandboxes created with ``setuid=True`` (the E2B API does so).
    60-120 s on this machine, ~330 MB.

    Raises:
        SandboxError: debootstrap is missing or failed.
    """
    _debootstrap(dest, E2B_BASE_PACKAGES)
    if not (dest / "usr/bin/sudo").exists():
        raise SandboxError("debootstrap finished but /usr/bin/sudo is missing")
    # sudo looks its host up: the sandbox's hostname (``sandbox``) resolves locally
    (dest / "etc/hosts").write_text(_HOSTS + "127.0.1.1\tsandbox\n")
    _add_user(dest, E2B_USER, E2B_HOME, groups=("sudo",))
    sudoers = dest / "etc/sudoers.d/e2b-user"
    sudoers.write_text(f"{E2B_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(sudoers, 0o440)
    for dirpath, dirnames, filenames in os.walk(dest / "usr/local"):
        for entry in [*dirnames, *filenames]:
            path = os.path.join(dirpath, entry)
            if not os.path.islink(path):
                os.chmod(path, 0o777)
    os.chmod(dest / "usr/local", 0o777)
    code = dest / "code"
    code.mkdir(exist_ok=True)
    os.chmod(code, 0o1777)


_APT_TIMEOUT_S = 1800.0


def _run_in_chroot(root: Path, argv: list[str], what: str) -> None:
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "LC_ALL": "C",
        "DEBIAN_FRONTEND": "noninteractive",
        "HOME": "/root",
    }
    try:
        proc = subprocess.run(
            ["chroot", os.fspath(root), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=_APT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"{what} timed out after {_APT_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.decode(errors="replace").strip().splitlines()[-20:])
        raise SandboxError(
            f"{what} failed (exit {proc.returncode}):\n{tail}", exit_code=proc.returncode
        )


_BUILD_DEVICES = {"null": (1, 3), "zero": (1, 5), "random": (1, 8), "urandom": (1, 9)}


def _make_build_devices(dev: Path) -> None:
    """Character devices a package install needs (removed again by :func:`_strip_debian`:
    device nodes do not belong in a layer)."""
    dev.mkdir(exist_ok=True)
    for name, (major, minor) in _BUILD_DEVICES.items():
        node = dev / name
        if not os.path.lexists(node):
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(node, 0o666)


def apt_install_into(root: Path, packages: tuple[str, ...]) -> None:
    """``apt-get install --no-install-recommends PACKAGES`` inside the Debian tree ``root``
    (chroot; the host's resolver for the download), then the caches are emptied again.

    apt, not ``debootstrap --include``: debootstrap's resolver picks arbitrary providers of
    virtual packages (compilers, ``-dev`` packages) and fails on some dependency orders.
    """
    if os.geteuid() != 0:
        raise SandboxError("installing packages into an image needs root (chroot)")
    resolv = root / "etc/resolv.conf"
    host_resolv = Path("/etc/resolv.conf")
    policy = root / "usr/sbin/policy-rc.d"
    try:
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        resolv.write_text(host_resolv.read_text() if host_resolv.is_file() else "")
        _write(policy, "#!/bin/sh\nexit 101\n", 0o755)  # no service starts in a build
        _make_build_devices(root / "dev")  # apt and maintainer scripts need /dev/null
        _run_in_chroot(
            root,
            ["apt-get", "-o", "Acquire::Retries=3", "update", "-qq"],
            "apt-get update in the image",
        )
        _run_in_chroot(
            root,
            [
                "apt-get",
                "-o",
                "Acquire::Retries=3",
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                *packages,
            ],
            "apt-get install " + " ".join(packages),
        )
        _run_in_chroot(root, ["apt-get", "clean"], "apt-get clean in the image")
    finally:
        policy.unlink(missing_ok=True)
        _unmount_under(root, include_self=False)
    _strip_debian(root)


def build_code_interpreter_rootfs(dest: Path) -> None:
    """Fill ``dest`` with the ``code-interpreter`` image (:mod:`dsec.layers.code_interpreter`):
    the ``debian`` tree, its Debian packages (:func:`apt_install_into`), then its steps (the
    server package, ``/home/user``).

    A few minutes on this machine (network-bound); see the module for the size.

    Raises:
        SandboxError: debootstrap or apt failed, or the tree lacks a part the server needs.
    """
    from dsec.layers import code_interpreter as ci

    # apt in the tree checks the archive's signature: minbase lacks gpgv
    build_debian_rootfs(dest, include=("python3", "gpgv", "debian-archive-keyring"))
    apt_install_into(dest, ci.APT_PACKAGES)
    ci.apply_steps(dest)
    # the start command's imports, checked in the tree (a package off sys.path fails here)
    _run_in_chroot(
        dest,
        [
            "/usr/bin/python3",
            "-c",
            "import dsec_codeinterp.server, dsec_codeinterp.contexts, "
            "matplotlib_inline.backend_inline, pexpect",
        ],
        "the code-interpreter server's imports in the image",
    )
    if not (dest / "usr/bin/node").exists():
        raise SandboxError("the code-interpreter image lacks /usr/bin/node")


def build_desktop_layer(root: Path) -> None:
    """Turn the ``debian`` tree at ``root`` (the merged view of a build over its layer) into
    the ``desktop`` image (:mod:`dsec.layers.desktop`): its Debian packages
    (:func:`apt_install_into`), then its files, symlinks and user, then its chroot commands
    (fontconfig's caches). A few minutes on this
    machine (network-bound); ~1.2 GB of changes.

    Raises:
        SandboxError: apt failed, or the tree lacks a program the desktop needs.
    """
    from dsec.layers import desktop

    apt_install_into(root, desktop.APT_PACKAGES)
    desktop.apply_steps(root)
    for argv in desktop.CHROOT_COMMANDS:
        _run_in_chroot(root, list(argv), " ".join(argv) + " in the image")
    for old in (root / "var/cache/debconf").glob("*-old"):  # debconf's backups
        old.unlink()
    missing = [
        p
        for p in (
            "usr/bin/Xvfb",
            "usr/bin/xdotool",
            "usr/bin/scrot",
            "usr/bin/wmctrl",
            "usr/bin/xdg-open",
            "usr/bin/gtk-launch",
            "usr/bin/x11vnc",
            "usr/bin/websockify",
            "usr/bin/chromium",
            "usr/bin/xfce4-session",
            "usr/share/novnc/utils/novnc_proxy",
            "usr/local/bin/dsec-desktop",
        )
        if not (root / p).exists()
    ]
    if missing:
        raise SandboxError(f"the desktop image lacks {', '.join(missing)}", missing=missing)


def _desktop_meta() -> dict[str, Any]:
    from dsec.layers import desktop

    return {"builtin": desktop.IMAGE_NAME, **desktop.image_meta()}


def _code_interpreter_meta() -> dict[str, Any]:
    from dsec.layers import code_interpreter as ci

    return {"builtin": ci.IMAGE_NAME, **ci.image_meta()}


BUILTIN_IMAGES: dict[str, BuiltinImage] = {
    "busybox": BuiltinImage(
        name="busybox",
        build_rootfs=build_busybox_rootfs,
        kind="base",
        meta={"builtin": "busybox", "source": "busybox-static"},
        description="static busybox with applet symlinks (~2 MB)",
    ),
    "debian": BuiltinImage(
        name="debian",
        build_rootfs=build_debian_rootfs,
        kind="base",
        meta={
            "builtin": "debian",
            "suite": DEBIAN_SUITE,
            "variant": "minbase",
            "include": ["python3"],
        },
        description=f"Debian {DEBIAN_SUITE} minbase with python3 (~200 MB)",
    ),
    "e2b-base": BuiltinImage(
        name="e2b-base",
        build_rootfs=build_e2b_base_rootfs,
        kind="base",
        meta={
            "builtin": "e2b-base",
            "suite": DEBIAN_SUITE,
            "variant": "minbase",
            "include": list(E2B_BASE_PACKAGES),
            "config": {"User": E2B_USER, "WorkingDir": E2B_HOME},
        },
        description=f"E2B's base template: Debian {DEBIAN_SUITE} with python3, pip, curl, git, "
        "sudo and the user `user` (~330 MB)",
    ),
    "code-interpreter": BuiltinImage(
        name="code-interpreter",
        build_rootfs=build_code_interpreter_rootfs,
        kind="base",
        meta=_code_interpreter_meta(),
        description=(
            f"Debian {DEBIAN_SUITE} with Jupyter kernels (Python, bash, JavaScript) and "
            "E2B's code-interpreter API on port 49999 (~700 MB)"
        ),
    ),
    "desktop": BuiltinImage(
        name="desktop",
        build_rootfs=build_desktop_layer,
        kind="toolkit",
        base="debian",
        meta=_desktop_meta(),
        description=(
            "debian + an Xfce desktop on Xvfb (:0, 1024x768), xdotool, scrot, x11vnc/noVNC "
            "and Chromium, started with the sandbox (~1.2 GB on top of debian)"
        ),
    ),
}
"""Recipes :meth:`LayerStore.ensure_image` knows, by image name. Add entries to teach it more
(tests register fake builders here with ``monkeypatch.setitem``)."""
