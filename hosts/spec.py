"""The hosts of the matrix: what a user's machine is, as far as dsec can tell.

A :class:`HostSpec` is a Debian release (the root filesystem: systemd, Python, crun, ...),
a stock Debian kernel (the suite its package comes from) and a cgroup layout (a kernel
command line switch read by systemd). Hosts that differ only in the cgroup layout boot the
same image (:attr:`HostSpec.image`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_HOSTS", "HOSTS", "HostSpec", "ImageSpec", "resolve_hosts"]

CgroupLayout = Literal["v2", "v1"]

KERNEL_PACKAGE = "linux-image-cloud-amd64"
"""Debian's kernel for virtual machines: virtio built in or in the initramfs, no firmware."""


@dataclass(frozen=True)
class ImageSpec:
    """What goes into a root filesystem image (the part of a host spec an image is keyed by).

    Attributes:
        suite: Debian suite of the root filesystem (``bookworm``, ``trixie``).
        kernel_suite: the suite the kernel package is installed from (``bookworm`` for
            Debian 12's own 6.1, ``bookworm-backports`` for 6.12).
        python: the version of the suite's ``python3`` (the guest's venv runs on it).
        kernel_package: the kernel's Debian package.
    """

    suite: str
    kernel_suite: str
    python: str
    kernel_package: str = KERNEL_PACKAGE

    @property
    def name(self) -> str:
        """A file-name-safe label (``bookworm+bookworm-backports``)."""
        return f"{self.suite}+{self.kernel_suite}"


@dataclass(frozen=True)
class HostSpec:
    """One host of the matrix.

    Attributes:
        name: ``debian12-6.1-v2``: release, kernel series, cgroup layout.
        image: the root filesystem and kernel it boots.
        cgroup: ``v2`` boots with ``systemd.unified_cgroup_hierarchy=1``; ``v1`` with ``=0``
            and ``systemd.legacy_systemd_cgroup_controller=1`` (every hierarchy on cgroup
            v1, systemd's own included). What the guest actually mounted is measured there
            (a kernel without a v1 controller gives a partial layout).
        note: what to expect, for the reader of the table.
    """

    name: str
    image: ImageSpec
    cgroup: CgroupLayout
    note: str = ""

    @property
    def cmdline(self) -> str:
        """The kernel command line words that pick the cgroup layout."""
        if self.cgroup == "v2":
            return "systemd.unified_cgroup_hierarchy=1"
        return "systemd.unified_cgroup_hierarchy=0 systemd.legacy_systemd_cgroup_controller=1"


BOOKWORM = ImageSpec("bookworm", "bookworm", "3.11")
BOOKWORM_BACKPORTS = ImageSpec("bookworm", "bookworm-backports", "3.11")
TRIXIE = ImageSpec("trixie", "trixie", "3.13")

HOSTS: dict[str, HostSpec] = {
    h.name: h
    for h in (
        HostSpec("debian12-6.1-v2", BOOKWORM, "v2", "Debian 12 as installed"),
        HostSpec("debian12-6.12-v2", BOOKWORM_BACKPORTS, "v2", "Debian 12, backports kernel"),
        HostSpec("debian12-6.1-v1", BOOKWORM, "v1", "Debian 12 booted on legacy cgroup v1"),
        HostSpec(
            "debian12-6.12-v1",
            BOOKWORM_BACKPORTS,
            "v1",
            "Debian's 6.12 lacks CONFIG_MEMCG_V1: no v1 memory controller",
        ),
        HostSpec("debian13-6.12-v2", TRIXIE, "v2", "Debian 13 as installed"),
    )
}
"""Every host the matrix knows, in the order it boots them."""

DEFAULT_HOSTS = ("debian12-6.1-v2", "debian12-6.12-v2", "debian12-6.1-v1", "debian12-6.12-v1")


def resolve_hosts(names: str | None) -> list[HostSpec]:
    """The hosts named in ``names`` (comma-separated; ``all``; None: the default set)."""
    if not names:
        return [HOSTS[n] for n in DEFAULT_HOSTS]
    if names.strip() == "all":
        return list(HOSTS.values())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in HOSTS]
    if unknown:
        raise SystemExit(f"unknown host(s) {', '.join(unknown)}; known: {', '.join(HOSTS)}")
    return [HOSTS[n] for n in wanted]
