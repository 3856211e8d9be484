"""Booting a host: one QEMU guest of a :class:`~hosts.image.HostImage`, run to its end.

:func:`run_host` makes the run's payload (:mod:`hosts.payload`), boots the image's kernel
with the host's cgroup switch over a qcow2 overlay of the cached root image (the image is
never written) with the payload as a second disk, waits for the guest to power itself off
(the image's ``dsec-hostcheck`` unit does, whatever the checks came to) or for the time-out,
then reads the guest's results back from the payload disk. No network device is given to
the guest. The serial console goes to ``console.log`` in the run directory, which is kept.

Accelerator: KVM when ``-accel kvm`` boots a kernel here (probed once per host boot, cached
in ``$DSEC_HOSTS_CACHE/accel.json``; ``DSEC_HOSTS_ACCEL=kvm|tcg`` decides instead), else TCG.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hosts.cache import cache_dir
from hosts.image import HostImage, ensure_image
from hosts.payload import build_payload, make_disk, read_back
from hosts.spec import HostSpec

__all__ = ["GuestRun", "RunOptions", "choose_accel", "run_host"]

log = logging.getLogger("hosts.guest")

QEMU = "qemu-system-x86_64"
TCG_CPU = "max,-cx16"
"""The guest CPU under TCG. Without CMPXCHG16B: QEMU 7.2's TCG (Debian 12's) corrupts EFLAGS
on a ``cmpxchg16b`` with a segment prefix, which Linux 6.12's SLUB issues on every per-CPU
allocation (a double fault or a corrupted user space in the first seconds of boot); without
it the kernel takes its locked fallback. KVM guests get the host's CPU."""
RESULTS_BEGIN = "DSEC-HOSTCHECK-RESULTS-BEGIN"
RESULTS_END = "DSEC-HOSTCHECK-RESULTS-END"


@dataclass
class RunOptions:
    """How one host is checked.

    Attributes:
        mode: ``full`` (every check, latency, the conformance suite) or ``smoke`` (create,
            exec, files, a memory limit, pause/resume, kill, leftovers).
        tiers: the tiers ``dsec serve`` runs with (``DSEC_TIERS``) and the checks cover.
        images: the image each tier's sandboxes use.
        conformance: run the conformance suite in full mode.
        tests: pytest paths of the checkout (``tests/integration/test_groups_root.py``,
            a directory or a node id) run in the guest after the checks, in any mode.
        timeout_s: the whole guest, boot to power-off (TCG guests are ~10x slower).
        memory_mb, cpus: the guest's.
        nice: QEMU's niceness (a guest run beside other work, e.g. CI's smoke beside the
            suite's own VM tests, yields the CPU to it).
    """

    mode: str = "full"
    tiers: tuple[str, ...] = ("container", "fncall")
    images: dict[str, str] = field(
        default_factory=lambda: {"container": "debian", "fncall": "debian"}
    )
    conformance: bool = True
    tests: tuple[str, ...] = ()
    timeout_s: float = 5400
    memory_mb: int = 4096
    cpus: int = 2
    nice: int = 0


@dataclass
class GuestRun:
    """What came of one host: its results (the guest's ``results.json``, or an ``error``)
    and where the evidence is."""

    host: HostSpec
    results: dict[str, Any]
    run_dir: Path
    phases: dict[str, float] = field(default_factory=dict)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def choose_accel(kernel: Path) -> tuple[str, str]:
    """``("kvm"|"tcg", why)``: KVM if a probe boot of ``kernel`` reaches its panic under
    ``-accel kvm`` within 30 s (a kernel without a root file system panics at once)."""
    forced = os.environ.get("DSEC_HOSTS_ACCEL", "").strip()
    if forced in ("kvm", "tcg"):
        return forced, "forced by DSEC_HOSTS_ACCEL"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "no usable /dev/kvm"
    cached = cache_dir() / "accel.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        data = json.loads(cached.read_text())
        if data["boot_id"] == _boot_id():
            return str(data["accel"]), str(data["why"])
    console = cache_dir() / f".accel-probe-{os.getpid()}.log"
    argv = [
        QEMU, "-accel", "kvm", "-cpu", "host", "-m", "256", "-smp", "1", "-nodefaults",
        "-no-user-config", "-display", "none", "-no-reboot", "-kernel", os.fspath(kernel),
        "-append", "console=ttyS0 panic=-1", "-serial", f"file:{console}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        text = console.read_text(errors="replace") if console.exists() else ""
        if "Kernel panic" in text or "VFS:" in text:
            accel, why = "kvm", "KVM probe boot reached the kernel's panic"
        else:
            err = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            accel, why = "tcg", f"KVM probe failed: {err[0]}"
    except subprocess.TimeoutExpired:
        accel, why = "tcg", "KVM probe boot did not finish in 30 s"
    finally:
        console.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        cached.write_text(json.dumps({"boot_id": _boot_id(), "accel": accel, "why": why}))
    return accel, why


def _qemu_argv(
    host: HostSpec, image: HostImage, overlay: Path, payload: Path, console: Path,
    accel: str, options: RunOptions,
) -> list[str]:  # fmt: skip
    append = f"root=/dev/vda rw console=ttyS0 panic=-1 {host.cmdline}"
    return [
        QEMU, "-accel", accel, "-cpu", "host" if accel == "kvm" else TCG_CPU,
        "-m", str(options.memory_mb), "-smp", str(options.cpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", os.fspath(image.kernel), "-initrd", os.fspath(image.initrd),
        "-append", append,
        "-drive", f"file={overlay},format=qcow2,if=virtio,cache=unsafe,discard=unmap",
        "-drive", f"file={payload},format=raw,if=virtio,cache=writeback",
        "-device", "virtio-rng-pci",
        "-serial", f"file:{console}",
    ]  # fmt: skip


def _die_with_parent() -> None:
    """In the QEMU child before exec: SIGKILL when the process that started it dies
    (``prctl(PR_SET_PDEATHSIG)``), so a killed matrix leaves no guest running."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _results_from_console(console: Path) -> dict[str, Any] | None:
    """The results the guest printed on its console (journal lines: a prefix, then the
    JSON), when the payload disk has none."""
    text = console.read_text(errors="replace") if console.exists() else ""
    begin = text.rfind(RESULTS_BEGIN)
    end = text.find(RESULTS_END, begin)
    if begin < 0 or end < 0:
        return None
    for line in text[begin + len(RESULTS_BEGIN) : end].splitlines():
        if "{" in line:
            with contextlib.suppress(ValueError):
                return dict(json.loads(line[line.index("{") :]))
    return None


def _console_verdict(console: Path) -> str:
    """Why a guest that wrote no results ended, from its console (a kernel panic's line)."""
    text = console.read_text(errors="replace") if console.exists() else ""
    found = [at for m in ("Kernel panic", "Oops:", "BUG:") if (at := text.find(m)) >= 0]
    if found:  # the first sign of it
        line = text[min(found) :].splitlines()[0].strip()
        return f"the guest's kernel failed: {line} (console.log)"
    return "the guest wrote no results (console.log)"


def _console_tail(console: Path, lines: int = 30) -> str:
    text = console.read_text(errors="replace") if console.exists() else ""
    return "\n".join(text.replace("\r", "").strip().splitlines()[-lines:])


def run_host(host: HostSpec, run_dir: Path, options: RunOptions) -> GuestRun:
    """Check ``host``: image (cached), payload, boot, results. Never raises for what the
    guest did; the results say it (``error``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    image, built = ensure_image(host.image)
    phases["image_build_s" if built else "image_found_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    tree = run_dir / "payload"
    shutil.rmtree(tree, ignore_errors=True)
    config = {
        "host": {
            "name": host.name,
            "suite": host.image.suite,
            "kernel_suite": host.image.kernel_suite,
            "kernel_package": host.image.kernel_package,
            "cgroup": host.cgroup,
            "cmdline": host.cmdline,
            "kernel_release": image.kernel_release,
        },
        "mode": options.mode,
        "tiers": list(options.tiers),
        "images": options.images,
        "tests": list(options.tests),
        # the guest's own budget ends before the host's time-out, so it can report
        "budget_s": max(300.0, options.timeout_s - 240),
    }
    build_payload(tree, config, conformance=options.conformance and options.mode == "full")
    payload = run_dir / "payload.img"
    make_disk(tree, payload)
    shutil.rmtree(tree, ignore_errors=True)
    overlay = run_dir / "root.qcow2"
    overlay.unlink(missing_ok=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", os.fspath(image.disk),
         os.fspath(overlay)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    phases["payload_s"] = round(time.monotonic() - t0, 1)
    accel, why = choose_accel(image.kernel)
    console = run_dir / "console.log"
    console.unlink(missing_ok=True)
    argv = _qemu_argv(host, image, overlay, payload, console, accel, options)
    (run_dir / "qemu.argv").write_text(json.dumps(argv))
    log.info("%s: booting %s (%s: %s)", host.name, image.kernel_release, accel, why)
    t0 = time.monotonic()
    error = None
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    if options.nice:
        with contextlib.suppress(OSError):  # it may have exited already
            os.setpriority(os.PRIO_PROCESS, proc.pid, options.nice)
    try:
        qemu_out, _ = proc.communicate(timeout=options.timeout_s)
        if proc.returncode != 0:
            text = qemu_out.decode(errors="replace")[-500:]
            error = f"qemu exited with code {proc.returncode}: {text}"
    except subprocess.TimeoutExpired:
        error = f"the guest did not power off within {options.timeout_s:.0f} s (killed)"
    finally:  # also on an exception here (a test's time-out, ^C): no guest outlives its run
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    phases["guest_s"] = round(time.monotonic() - t0, 1)
    results: dict[str, Any] | None = None
    try:
        read_back(payload, run_dir)
        results = json.loads((run_dir / "out" / "results.json").read_text())
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("%s: no results.json on the payload disk (%s)", host.name, e)
        results = _results_from_console(console)
    if results is None:
        results = {
            "error": error or _console_verdict(console),
            "console_tail": _console_tail(console),
        }
    elif error is not None:
        results["error"] = f"{error}; {results['error']}" if results.get("error") else error
    results["accel"] = f"{accel} ({why})"
    if not os.environ.get("DSEC_HOSTS_KEEP_DISKS"):
        overlay.unlink(missing_ok=True)
        payload.unlink(missing_ok=True)
    return GuestRun(host, results, run_dir, phases)
