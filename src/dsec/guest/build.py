"""Build the guest side of the VM tiers: kernel, initramfs and guest agent.

What gets built, once per (kernel package, agent source, init script), under
``$DSEC_HOME/bin/guest-<hash>/``:

``vmlinux``
    The Debian *cloud* kernel (``linux-image-cloud-amd64``'s dependency), taken from the
    ``.deb`` (``apt-get download``), with its compressed payload found by magic number and
    decompressed to the uncompressed ELF image (the logic of the kernel's
    ``scripts/extract-vmlinux``). QEMU boots an ELF ``-kernel`` through the PVH entry point,
    which skips the real-mode setup and the in-guest decompression: 1.3-1.9 s to a shell
    under TCG against 4.5-5.2 s for a bzImage (MACHINE.md).
``initramfs.cpio``
    An uncompressed cpio (newc) archive written here in Python: ``/init`` (init.sh, run by
    the host's static busybox), ``/bin/busybox``, ``/agent``, the guard of the sandbox's
    commands (``/dsec/guard.policy`` and ``/dsec/guard.bpf``, :mod:`dsec.guest.guard`) and
    the modules the guest needs
    (virtio-mmio/pci, virtio-blk, virtio-console, erofs, overlay and their dependencies from
    ``modules.dep``, e.g. libcrc32c) in load order (``/modules.order``). Uncompressed because
    decompression under TCG costs more than reading a few MB.
``bzImage``
    The compressed kernel as shipped. The ``vm`` tier boots it through the BIOS (slower than
    PVH) because only that path hands the kernel the VGA text console a display needs.
``agent``
    The guest agent (agent.c) compiled ``gcc -static``. The same binary also serves the host as
    the QEMU launcher (``agent --launch``).

Nothing is fetched over the network except the kernel package through apt. Every missing
tool raises :class:`~dsec.errors.TierUnavailable` naming the Debian package to install.

Example::

    art = ensure_guest_artifacts(Paths.from_env().bin)
    print(art.vmlinux, art.initramfs, art.kernel_release)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsec.errors import SandboxError, TierUnavailable
from dsec.guest.guard import guard_files

__all__ = [
    "GUEST_MODULES",
    "GuestArtifacts",
    "ensure_guest_artifacts",
    "extract_vmlinux",
    "host_tsc_khz",
    "write_cpio",
]

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
# the modules the guest needs; their dependencies are added from modules.dep
GUEST_MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "erofs",
    "overlay",
)
_BUILD_FORMAT = "5"  # bump when the layout of the artifacts changes
_SRC_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GuestArtifacts:
    """Paths of one built guest (kernel + initramfs + agent) and what it was built from."""

    dir: Path
    vmlinux: Path
    initramfs: Path
    agent: Path
    bzimage: Path
    kernel_release: str
    kernel_package: str

    @property
    def key(self) -> str:
        """Short content key (the directory name's hash): part of every template's key."""
        return self.dir.name.removeprefix("guest-")


def _run(argv: list[str], what: str, timeout_s: float = 300.0, cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    except FileNotFoundError as e:
        raise TierUnavailable(f"{what}: {argv[0]} is not installed", tool=argv[0]) from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"{what}: {argv[0]} took longer than {timeout_s:.0f} s") from e
    if out.returncode != 0:
        raise SandboxError(f"{what} failed: {out.stderr.strip()[-2000:]}", argv=argv)
    return out.stdout


def kernel_package() -> tuple[str, str]:
    """(package name, candidate version) of the Debian cloud kernel, from the local apt cache."""
    if shutil.which("apt-cache") is None:
        raise TierUnavailable(
            "the microvm tier builds its guest kernel from apt; apt-cache is missing"
        )
    deps = _run(["apt-cache", "depends", KERNEL_META_PACKAGE], "apt-cache depends")
    m = re.search(r"Depends:\s*(linux-image-[0-9][^\s]*-cloud-amd64)", deps)
    if not m:
        raise TierUnavailable(
            f"apt knows no {KERNEL_META_PACKAGE}; run apt-get update (Debian main)",
            package=KERNEL_META_PACKAGE,
        )
    name = m.group(1)
    policy = _run(["apt-cache", "policy", name], "apt-cache policy")
    v = re.search(r"Candidate:\s*(\S+)", policy)
    return name, (v.group(1) if v else "unknown")


_APT_STATE = (Path("/var/lib/apt/lists"), Path("/var/cache/apt/pkgcache.bin"))


def _cached_kernel_package(bin_dir: Path) -> tuple[str, str]:
    """:func:`kernel_package`, remembered in ``bin_dir`` until apt's package lists change
    (asking apt-cache costs 1-4 s on a busy node, on every runtime start)."""
    stamp = []
    for p in _APT_STATE:
        with contextlib.suppress(OSError):
            stamp.append(os.stat(p).st_mtime_ns)
    cache = bin_dir / ".kernel-package.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(cache.read_text())
        if data["apt_state"] == stamp and stamp:
            return str(data["package"]), str(data["version"])
    package, version = kernel_package()
    with contextlib.suppress(OSError):
        bin_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"apt_state": stamp, "package": package, "version": version}))
        os.rename(tmp, cache)
    return package, version


def _download_deb(package: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    _run(["apt-get", "download", package], f"apt-get download {package}", cwd=dest)
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise SandboxError(f"apt-get download {package} produced no .deb in {dest}")
    return debs[-1]


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """Open the data.tar.* member of a .deb (an ar archive) as a tarfile."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise SandboxError(f"{deb} is not a Debian package (ar archive)")
    off = 8
    while off + 60 <= len(raw):
        hdr = raw[off : off + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        body = raw[off + 60 : off + 60 + size]
        off += 60 + size + (size & 1)
        if not name.startswith("data.tar"):
            continue
        if name.endswith(".zst"):
            body = subprocess.run(
                ["zstd", "-dc"], input=body, capture_output=True, check=True
            ).stdout
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:")
        return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
    raise SandboxError(f"{deb} has no data.tar member")


# (magic, decompressor) as in linux/scripts/extract-vmlinux
_PAYLOAD_MAGICS: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b\x08", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
    (b"\x5d\x00\x00\x00", "lzma"),
    (b"\x89LZO", "lzop"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)


_missing_tools: set[str] = set()


def _decompress(kind: str, data: bytes) -> bytes:
    """Decompress a stream that may be followed by trailing bytes; returns what came out."""
    if kind == "xz" or kind == "lzma":
        d = lzma.LZMADecompressor(lzma.FORMAT_XZ if kind == "xz" else lzma.FORMAT_ALONE)
        try:
            return d.decompress(data)
        except lzma.LZMAError:
            return b""
    if kind == "gzip":
        import zlib

        try:
            return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
        except zlib.error:
            return b""
    if kind == "bzip2":
        import bz2

        try:
            return bz2.BZ2Decompressor().decompress(data)
        except OSError:
            return b""
    tool = {"lz4": ["lz4", "-dc"], "zstd": ["zstd", "-dc"], "lzop": ["lzop", "-dc"]}[kind]
    if shutil.which(tool[0]) is None:
        _missing_tools.add(tool[0])
        return b""
    # like extract-vmlinux: ignore the complaint about trailing garbage, keep the output
    out = subprocess.run(tool, input=data, capture_output=True, timeout=120)
    return out.stdout


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed ELF kernel inside a bzImage (extract-vmlinux, in Python).

    Tries every offset where a known compressor's magic appears and returns the first output
    that is an ELF file. Raises :class:`SandboxError` if none is.
    """
    if bzimage.startswith(b"\x7fELF"):
        return bzimage
    for magic, kind in _PAYLOAD_MAGICS:
        start = 0
        while (pos := bzimage.find(magic, start)) >= 0:
            start = pos + 1
            out = _decompress(kind, bzimage[pos:])
            if out.startswith(b"\x7fELF"):
                return out
    if _missing_tools:
        raise TierUnavailable(
            "no ELF kernel found in the bzImage; install the Debian packages "
            f"{sorted(_missing_tools)} to try the remaining decompressors"
        )
    raise SandboxError("no compressed ELF kernel found in the bzImage")


def _modinfo_depends(ko: bytes) -> list[str]:
    """Module names in the ``depends=`` field of a module's ``.modinfo`` strings."""
    m = re.search(rb"(?:^|\0)depends=([^\0]*)\0", ko)
    if not m or not m.group(1):
        return []
    return [d.decode().replace("-", "_") for d in m.group(1).split(b",") if d]


def _module_closure(modules: dict[str, bytes], wanted: tuple[str, ...]) -> list[str]:
    """Module names in load order (dependencies first), from each module's ``depends=``.

    ``modules`` maps the module name (``virtio_blk``) to its (uncompressed) ``.ko`` bytes.
    Names not in ``modules`` are built into the kernel and skipped. (The .deb ships no
    modules.dep: depmod writes it at install time.)
    """
    order: list[str] = []

    def visit(name: str, depth: int = 0) -> None:
        if name in order or name not in modules or depth > 32:
            return
        for dep in _modinfo_depends(modules[name]):
            visit(dep, depth + 1)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


def _uncompress_module(name: str, data: bytes) -> tuple[str, bytes]:
    """(module name, .ko bytes) for a module file that may be .ko.xz/.ko.zst/.ko.gz."""
    base = Path(name).name
    if base.endswith(".xz"):
        data = lzma.decompress(data)
    elif base.endswith(".zst"):
        data = subprocess.run(["zstd", "-dc"], input=data, capture_output=True, check=True).stdout
    elif base.endswith(".gz"):
        import gzip

        data = gzip.decompress(data)
    return base.split(".ko")[0].replace("-", "_"), data


def write_cpio(entries: list[tuple[str, int, bytes, int]], out: io.BufferedWriter) -> None:
    """Write a cpio ``newc`` archive.

    ``entries``: (path without leading slash, st_mode, data, rdev). For a device node pass
    ``data=b""`` and ``rdev=os.makedev(major, minor)``.
    """

    def pad(n: int) -> bytes:
        return b"\0" * ((4 - n % 4) % 4)

    ino = 1
    for name, mode, data, rdev in [*entries, ("TRAILER!!!", 0, b"", 0)]:
        nb = name.encode() + b"\0"
        hdr = (
            b"070701"
            + b"".join(
                f"{v:08x}".encode()
                for v in (
                    ino, mode, 0, 0, 1, 0, len(data), 0, 0,
                    os.major(rdev), os.minor(rdev), len(nb), 0,
                )
            )
        )  # fmt: skip
        out.write(hdr + nb + pad(len(hdr) + len(nb)))
        out.write(data + pad(len(data)))
        ino += 1


def _compile_agent(dest: Path) -> None:
    if shutil.which("gcc") is None:
        raise TierUnavailable("building the guest agent needs gcc (Debian: gcc, libc6-dev)")
    src = _SRC_DIR / "agent.c"
    _run(
        ["gcc", "-static", "-O2", "-Wall", "-o", str(dest), str(src)],
        "compiling the guest agent (needs libc6-dev for static glibc)",
    )


def host_tsc_khz() -> int | None:
    """The host TSC frequency in kHz (the guest's ``tsc_early_khz`` under TCG), or None.

    Read from the kernel log line ``tsc: Detected 2445.406 MHz processor`` (or the refined
    ``tsc: Refined TSC clocksource calibration``), falling back to ``cpu MHz`` in
    /proc/cpuinfo. Without it ~20% of TCG boots hang calibrating the TSC (MACHINE.md).
    """
    text = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    for pattern in (
        r"Refined TSC clocksource calibration: ([0-9.]+) MHz",
        r"tsc: Detected ([0-9.]+) MHz",
    ):
        m = re.search(pattern, text)
        if m:
            return int(float(m.group(1)) * 1000)
    with contextlib.suppress(OSError):
        m = re.search(r"cpu MHz\s*:\s*([0-9.]+)", Path("/proc/cpuinfo").read_text())
        if m:
            return int(float(m.group(1)) * 1000)
    return None


def _sources_hash(package: str, version: str) -> str:
    h = hashlib.sha256()
    h.update(f"{_BUILD_FORMAT}\0{package}\0{version}\0".encode())
    for name in ("agent.c", "init.sh"):
        h.update((_SRC_DIR / name).read_bytes())
    for name, data in sorted(guard_files().items()):  # the commands' guard (dsec.guest.guard)
        h.update(f"{name}\0{len(data)}\0".encode() + data)
    busybox = shutil.which("busybox") or "/bin/busybox"
    with contextlib.suppress(OSError):
        st = os.stat(busybox)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def ensure_guest_artifacts(bin_dir: Path, deb: Path | None = None) -> GuestArtifacts:
    """Build (once) and return the guest kernel, initramfs and agent under ``bin_dir``.

    Blocking (run it in a thread); the first build downloads ~27 MB through apt and takes a
    few seconds. ``deb`` (or ``$DSEC_VM_KERNEL_DEB``) uses a local kernel package instead.
    Safe against concurrent builders (a lock file per build directory).
    """
    deb = deb or (
        Path(os.environ["DSEC_VM_KERNEL_DEB"]) if os.environ.get("DSEC_VM_KERNEL_DEB") else None
    )
    if deb is not None:
        package, version = deb.name.split("_")[0], hashlib.sha256(deb.read_bytes()).hexdigest()[:12]
    else:
        package, version = _cached_kernel_package(bin_dir)
    out_dir = bin_dir / f"guest-{_sources_hash(package, version)}"
    meta_path = out_dir / "meta.json"
    bin_dir.mkdir(parents=True, exist_ok=True)
    with open(bin_dir / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            return _artifacts(out_dir, meta)
        busybox = shutil.which("busybox") or "/bin/busybox"
        if not Path(busybox).exists() or "statically linked" not in _file_kind(Path(busybox)):
            raise TierUnavailable(
                "the guest initramfs needs a static busybox (Debian: busybox-static)"
            )
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=bin_dir))
        try:
            if deb is None:
                deb = _download_deb(package, tmp / "deb")
            release = _build(deb, tmp, Path(busybox))
            meta = {"kernel_release": release, "kernel_package": f"{package}={version}"}
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.rmtree(tmp / "deb", ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return _artifacts(out_dir, meta)


def _file_kind(path: Path) -> str:
    """'statically linked' if the ELF has no PT_INTERP (what file(1) would say), else ''."""
    with open(path, "rb") as f:
        head = f.read(64)
        if not head.startswith(b"\x7fELF") or head[4] != 2:
            return ""
        phoff = int.from_bytes(head[32:40], "little")
        phentsize = int.from_bytes(head[54:56], "little")
        phnum = int.from_bytes(head[56:58], "little")
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        if int.from_bytes(table[i * phentsize : i * phentsize + 4], "little") == 3:  # PT_INTERP
            return "dynamically linked"
    return "statically linked"


def _artifacts(out_dir: Path, meta: dict[str, str]) -> GuestArtifacts:
    return GuestArtifacts(
        dir=out_dir,
        vmlinux=out_dir / "vmlinux",
        initramfs=out_dir / "initramfs.cpio",
        agent=out_dir / "agent",
        bzimage=out_dir / "bzImage",
        kernel_release=meta["kernel_release"],
        kernel_package=meta["kernel_package"],
    )


def _build(deb: Path, out: Path, busybox: Path) -> str:
    """Extract kernel + modules from ``deb`` and write vmlinux, agent, initramfs.cpio into ``out``."""
    files: dict[str, bytes] = {}
    modules: dict[str, bytes] = {}
    with _deb_data_tar(deb) as tar:
        for member in tar:
            if not member.isfile():
                continue
            name = member.name.removeprefix("./")
            if name.startswith("boot/vmlinuz-") or ("/kernel/" in name and ".ko" in name):
                f = tar.extractfile(member)
                if f is None:
                    continue
                if name.startswith("boot/"):
                    files[name] = f.read()
                else:
                    mod, data = _uncompress_module(name, f.read())
                    modules[mod] = data
    vmlinuz = [n for n in files if n.startswith("boot/vmlinuz-")]
    if not vmlinuz:
        raise SandboxError(f"{deb.name} has no boot/vmlinuz-*")
    release = vmlinuz[0].removeprefix("boot/vmlinuz-")
    (out / "vmlinux").write_bytes(extract_vmlinux(files[vmlinuz[0]]))
    (out / "bzImage").write_bytes(files[vmlinuz[0]])  # the vm tier boots it (VGA console)
    _compile_agent(out / "agent")

    order = _module_closure(modules, GUEST_MODULES)
    missing = [m for m in ("erofs", "overlay") if m not in order]
    if missing:
        raise SandboxError(f"{deb.name} lacks the modules {missing} (built in is not expected)")
    entries: list[tuple[str, int, bytes, int]] = []
    for d in ("bin", "dev", "proc", "sys", "newroot", "rw", "layers", "lib", "lib/modules", "dsec"):
        entries.append((d, stat.S_IFDIR | 0o755, b"", 0))
    for name, data in sorted(guard_files().items()):
        entries.append((name, stat.S_IFREG | 0o644, data, 0))
    entries.append(("dev/console", stat.S_IFCHR | 0o600, b"", os.makedev(5, 1)))
    entries.append(("init", stat.S_IFREG | 0o755, (_SRC_DIR / "init.sh").read_bytes(), 0))
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes(), 0))
    entries.append(("agent", stat.S_IFREG | 0o755, (out / "agent").read_bytes(), 0))
    names: list[str] = []
    for mod in order:
        entries.append((f"lib/modules/{mod}.ko", stat.S_IFREG | 0o644, modules[mod], 0))
        names.append(f"{mod}.ko")
    entries.append(("modules.order", stat.S_IFREG | 0o644, ("\n".join(names) + "\n").encode(), 0))
    with open(out / "initramfs.cpio", "wb") as f:
        write_cpio(entries, f)
    return release
