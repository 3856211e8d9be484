"""Root filesystem images of the hosts: a stock Debian with its own kernel, built once per
machine and booted many times.

:func:`ensure_image` debootstraps a minimal Debian (``--variant=minbase``), installs with apt
what a dsec node needs (:data:`PACKAGES`, after ``scripts/bootstrap.sh``, without the VM and
desktop stacks) and the kernel package of the host's kernel suite, adds the host check's
entry (a systemd oneshot unit that mounts the second disk, runs ``inguest.py`` from it and
powers the guest off), then turns the tree into an ext4 image (``mkfs.ext4 -d``) beside the
kernel and initramfs taken out of its ``/boot``.

It also makes a venv, :data:`VENV`, with dsec's dependencies (from the wheelhouse of
:mod:`hosts.wheels`, built on the host: the guest has no network), so that a guest only has
to install the wheel of dsec itself (pip under TCG takes minutes for the dependencies).

Cache layout (machine-wide, ``$DSEC_HOSTS_CACHE``, default ``/var/cache/dsec-hosts``)::

    <suite>+<kernel suite>-<key>/      a finished image, never modified (guests boot a
        root.img vmlinuz initrd.img     qcow2 overlay of root.img)
        image.json                       kernel release, packages, build time
    <suite>+<kernel suite>-<key>.lock   flock held while a process builds it

``key`` digests the :class:`~hosts.spec.ImageSpec`, :data:`PACKAGES`, the wheelhouse, the
files put into the image and the source of the functions that build it (:data:`_RECIPE`), so a changed recipe
builds a new image and an unchanged one is reused. Two runs
that want the same image at once: the second waits for the first's lock and then finds the
image. A build happens in a ``.build-*`` directory beside the cache entries, renamed into
place when complete (one left by a killed build is removed by the next holder of the lock);
older images of the same spec are removed after a successful build.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hosts.cache import cache_dir, flocked
from hosts.spec import ImageSpec
from hosts.wheels import dependency_wheels, requirements

__all__ = ["PACKAGES", "VENV", "HostImage", "ensure_image", "image_key"]

log = logging.getLogger("hosts.image")

PACKAGES = (
    "systemd-sysv", "udev", "kmod", "procps", "python3", "python3-venv", "python3-dev",
    "gcc", "libc6-dev", "make", "libseccomp-dev", "crun", "runc", "erofs-utils",
    "busybox-static", "iproute2", "nftables", "fuse3", "libfuse3-dev", "pkg-config",
    "util-linux", "e2fsprogs", "ca-certificates",
)  # fmt: skip
"""What a dsec node running the container and fncall tiers needs (``scripts/bootstrap.sh``
without QEMU, the desktop, the code-interpreter stack and the build tools)."""

VENV = "/opt/dsec-venv"
"""The image's venv: dsec's dependencies (:func:`hosts.wheels.dependency_wheels`) installed;
a guest adds dsec itself."""

ROOT_SIZE = "6G"
"""The ext4 image's size (sparse): the tree (~1.3 GB) plus room for ``DSEC_HOME``."""

_MASKED_UNITS = (
    "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "e2scrub_reap.service",
    "fstrim.timer", "systemd-tmpfiles-clean.timer", "nftables.service",
)  # fmt: skip
"""Units that would only compete with the checks for the guest's (emulated) CPUs."""

ENTRY = """#!/bin/sh
# The host matrix's entry (dsec's hosts/image.py): run the check that the second disk carries
# (/dev/vdb: inguest.py and what it needs), then the unit powers the guest off at once
# (poweroff-immediate: the root disk is a throw-away overlay, the payload disk is synced).
echo "dsec-hostcheck: waiting for the payload disk"
i=0
while [ ! -b /dev/vdb ] && [ "$i" -lt 240 ]; do sleep 0.5; i=$((i + 1)); done
mkdir -p /mnt/payload
if ! mount -t ext4 /dev/vdb /mnt/payload; then
    echo "dsec-hostcheck: cannot mount the payload disk /dev/vdb"
    exit 1
fi
/usr/bin/python3 -u /mnt/payload/inguest.py /mnt/payload
rc=$?
sync
umount /mnt/payload 2>/dev/null || mount -o remount,ro /mnt/payload 2>/dev/null
sync
echo "dsec-hostcheck: done (exit $rc)"
exit $rc
"""

UNIT = """[Unit]
Description=dsec host check (the host matrix: hosts/ in the dsec checkout)
After=basic.target systemd-udev-settle.service
SuccessAction=poweroff-immediate
FailureAction=poweroff-immediate

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/dsec-hostcheck
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
"""

_CHROOT_DEVICES = {
    "null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9),
    "tty": (5, 0),
}  # fmt: skip

_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LC_ALL": "C",
    "DEBIAN_FRONTEND": "noninteractive",
    "HOME": "/root",
}


@dataclass(frozen=True)
class HostImage:
    """A finished image: the files a guest boots."""

    spec: ImageSpec
    dir: Path
    kernel_release: str

    @property
    def disk(self) -> Path:
        """The ext4 root filesystem (raw; boot a qcow2 overlay of it, never it)."""
        return self.dir / "root.img"

    @property
    def kernel(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"


def image_key(spec: ImageSpec, wheels: Path) -> str:
    """The digest of everything an image is built from: spec, packages, the wheelhouse of
    its venv (its directory name is its key), the builder."""
    h = hashlib.sha256()
    recipe = {
        "spec": asdict(spec),
        "wheels": wheels.name,
        "packages": PACKAGES,
        "masked": _MASKED_UNITS,
        "files": [ENTRY, UNIT, _IN_CHROOT],
        "size": ROOT_SIZE,
    }
    h.update(json.dumps(recipe, sort_keys=True).encode())
    for fn in _RECIPE:
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()[:20]


def _load(spec: ImageSpec, path: Path) -> HostImage | None:
    try:
        meta = json.loads((path / "image.json").read_text())
    except (OSError, ValueError):
        return None
    image = HostImage(spec, path, str(meta["kernel_release"]))
    if not all(p.is_file() for p in (image.disk, image.kernel, image.initrd)):
        return None
    return image


def ensure_image(spec: ImageSpec, cache: Path | None = None) -> tuple[HostImage, bool]:
    """The image of ``spec`` from the cache, built first if missing; (image, built now)."""
    if os.geteuid() != 0:
        raise SystemExit("building a host image needs root (debootstrap, chroot, mkfs)")
    cache = cache or cache_dir()
    wheels = dependency_wheels(spec.python)
    key = image_key(spec, wheels)
    final = cache / f"{spec.name}-{key}"
    found = _load(spec, final)
    if found is not None:
        return found, False
    with flocked(cache / f"{spec.name}-{key}.lock"):
        found = _load(spec, final)  # built by another run while we waited for its lock
        if found is not None:
            return found, False
        for stale in cache.glob(f".build-{spec.name}-{key}-*"):  # a killed build's
            shutil.rmtree(stale, ignore_errors=True)
        work = cache / f".build-{spec.name}-{key}-{os.getpid()}"
        work.mkdir(parents=True)
        try:
            release = _build(spec, work, wheels)
            (work / "image.json").write_text(
                json.dumps(
                    {
                        "spec": asdict(spec),
                        "key": key,
                        "kernel_release": release,
                        "packages": PACKAGES,
                        "built_at": time.time(),
                    },
                    indent=1,
                )
            )
            os.rename(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for old in cache.glob(f"{spec.name}-*"):  # earlier recipes' images
            if old != final and old.is_dir() and re.fullmatch(r"[0-9a-f]{20}", old.name[-20:]):
                shutil.rmtree(old, ignore_errors=True)
                old.with_name(old.name + ".lock").unlink(missing_ok=True)
        image = _load(spec, final)
        assert image is not None
        return image, True


def _run(argv: list[str], what: str, timeout_s: float = 1800) -> str:
    """Run ``argv`` (output captured); raise with the tail of its output when it fails."""
    log.info("%s", what)
    log.debug("%s: %s", what, argv)
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_ENV,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{what} timed out after {timeout_s:.0f} s") from e
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return out


_IN_CHROOT = """set -e
root=$1; shift
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount -t tmpfs -o mode=755 dev "$root/dev"
for spec in $DEVICES; do
    name=${spec%%:*}; nums=${spec#*:}
    mknod -m 666 "$root/dev/$name" c "${nums%:*}" "${nums#*:}"
done
mkdir -p "$root/dev/pts" "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
exec chroot "$root" "$@"
"""


def _chroot(root: Path, argv: list[str], what: str) -> str:
    """Run ``argv`` chrooted into ``root`` with ``/proc``, ``/sys`` and a minimal ``/dev``, in
    a private mount namespace: every mount vanishes with it, whatever happens."""
    devices = " ".join(f"{n}:{a}:{b}" for n, (a, b) in _CHROOT_DEVICES.items())
    return _run(
        [
            "unshare", "--mount", "--propagation", "private", "--",
            "env", f"DEVICES={devices}", "sh", "-c", _IN_CHROOT, "sh", os.fspath(root), *argv,
        ],
        what,
    )  # fmt: skip


def _mirror() -> str:
    """The Debian mirror apt uses on this machine (as dsec's own image builds do)."""
    from dsec.layers.builtin import debian_mirror

    return debian_mirror()


def _sources(spec: ImageSpec, mirror: str) -> str:
    suites = [spec.suite, f"{spec.suite}-updates"]
    if spec.kernel_suite not in suites:
        suites.append(spec.kernel_suite)
    security = "http://deb.debian.org/debian-security"
    return "".join(f"deb {mirror} {s} main\n" for s in suites) + (
        f"deb {security} {spec.suite}-security main\n"
    )


def _build(spec: ImageSpec, work: Path, wheels: Path) -> str:
    """Build the image of ``spec`` into ``work``; the kernel release it boots."""
    root = work / "rootfs"
    mirror = _mirror()
    t0 = time.monotonic()
    _run(
        [
            "unshare", "--mount", "--propagation", "private", "--",
            "debootstrap", "--variant=minbase", "--merged-usr", spec.suite, os.fspath(root),
            mirror,
        ],
        f"debootstrap {spec.suite}",
    )  # fmt: skip
    log.info("debootstrap %s: %.0f s", spec.suite, time.monotonic() - t0)
    (root / "etc/apt/sources.list").write_text(_sources(spec, mirror))
    resolv = root / "etc/resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")  # no service starts inside the build
    policy.chmod(0o755)
    apt = ["apt-get", "-o", "Acquire::Retries=3", "-o", "DPkg::Lock::Timeout=600"]
    _chroot(root, [*apt, "update", "-qq"], "apt-get update")
    t0 = time.monotonic()
    _chroot(
        root,
        [*apt, "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
        "apt-get install (packages)",
    )
    _chroot(
        root,
        [
            *apt, "install", "-y", "-qq", "--no-install-recommends",
            "-t", spec.kernel_suite, spec.kernel_package,
        ],
        f"apt-get install {spec.kernel_package} from {spec.kernel_suite}",
    )  # fmt: skip
    log.info("apt-get install: %.0f s", time.monotonic() - t0)
    _chroot(root, ["apt-get", "clean"], "apt-get clean")
    _install_venv(root, wheels)
    policy.unlink()
    resolv.unlink()
    resolv.write_text("")
    _configure(root)
    release = _take_kernel(root, work)
    for lists in (root / "var/lib/apt/lists").glob("*_*"):
        lists.unlink()
    t0 = time.monotonic()
    _run(
        ["mkfs.ext4", "-q", "-F", "-L", "dsec-host", "-d", os.fspath(root),
         os.fspath(work / "root.img"), ROOT_SIZE],
        "mkfs.ext4 -d",
    )  # fmt: skip
    log.info("mkfs.ext4 -d: %.0f s", time.monotonic() - t0)
    shutil.rmtree(root)
    return release


def _install_venv(root: Path, wheels: Path) -> None:
    """:data:`VENV` in the image with dsec's dependencies from ``wheels`` (offline)."""
    t0 = time.monotonic()
    inside = root / "tmp/wheels"
    shutil.copytree(wheels, inside)
    (inside / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    _chroot(root, ["python3", "-m", "venv", VENV], "python3 -m venv")
    _chroot(
        root,
        [
            f"{VENV}/bin/pip", "install", "-q", "--disable-pip-version-check", "--no-index",
            "--find-links", "/tmp/wheels", "-r", "/tmp/wheels/requirements.txt",
        ],
        "pip install (dsec's dependencies)",
    )  # fmt: skip
    shutil.rmtree(inside)
    log.info("venv: %.0f s", time.monotonic() - t0)


def _configure(root: Path) -> None:
    """The guest's identity, fstab, and the host check's unit (enabled) and entry."""
    (root / "etc/hostname").write_text("dsec-host\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost dsec-host\n::1\tlocalhost\n")
    (root / "etc/fstab").write_text("/dev/vda / ext4 rw,errors=remount-ro 0 1\n")
    _chroot(root, ["passwd", "-d", "root"], "passwd -d root")  # a console login, to debug
    entry = root / "usr/local/sbin/dsec-hostcheck"
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(ENTRY)
    entry.chmod(0o755)
    system = root / "etc/systemd/system"
    (system / "dsec-hostcheck.service").write_text(UNIT)
    wants = system / "multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "dsec-hostcheck.service").symlink_to("/etc/systemd/system/dsec-hostcheck.service")
    for unit in _MASKED_UNITS:
        masked = system / unit
        masked.unlink(missing_ok=True)
        masked.symlink_to("/dev/null")


def _take_kernel(root: Path, work: Path) -> str:
    """Copy the (only) kernel and its initramfs out of ``/boot``; its release."""
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise RuntimeError(f"expected one kernel in /boot, found {[k.name for k in kernels]}")
    release = kernels[0].name.removeprefix("vmlinuz-")
    initrd = root / "boot" / f"initrd.img-{release}"
    if not initrd.is_file():
        raise RuntimeError(f"the kernel package made no initramfs ({initrd.name} missing)")
    shutil.copyfile(kernels[0], work / "vmlinuz")
    shutil.copyfile(initrd, work / "initrd.img")
    return release


_RECIPE = (_sources, _build, _install_venv, _configure, _take_kernel, _chroot)
"""The functions whose source is part of an image's key."""


def describe(image: HostImage) -> dict[str, Any]:
    """What the matrix records about an image."""
    return {"dir": str(image.dir), "kernel_release": image.kernel_release}


def main() -> None:
    """``python -m hosts.image HOST``: build (or find) the image of one host."""
    from hosts.spec import HOSTS

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.monotonic()
    image, built = ensure_image(HOSTS[sys.argv[1]].image)
    what = "built" if built else "found"
    print(f"{what} {image.dir} (kernel {image.kernel_release}) in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
