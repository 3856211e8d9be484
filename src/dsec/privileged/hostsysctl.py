"""A host-wide sysctl that several processes need set at once, restored by the last to leave.

``net.ipv4.ip_forward`` is one value for the whole host, but a host may run several dsec
nodes (two ``dsec serve`` homes, a test run's servers side by side, the network testbed).
Each one that needs forwarding *holds* the value: the first holder records what it found,
and the value goes back only when the last holder releases it. Before, each node kept its
own note of the old value, so a node that found forwarding off restored it at its exit while
another node's sandboxes were still routing through the host: their connections hung.

Holders are files under ``/run/dsec/sysctl/<key>/`` named by pid, the process's start
time and the holder's owner (several nodes may live in one process; a node restarted in
the same process, after a close that kept its hold for sandboxes still running, is the
same holder); a holder whose process is gone
(killed, crashed) is dropped by the next one that looks, so a crash never pins the value
for ever (the value it found stays recorded until the last holder restores it), and a reboot (``/run`` is a tmpfs) forgets everything with the kernel. All
changes happen under an ``flock`` of the key's directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from dsec.privileged.netns import write_sysctl

ROOT = Path("/run/dsec/sysctl")
ORIGINAL = "original"
"""The file holding the value found by the first holder (absent: it was already right)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class HeldSysctl:
    """Hold ``key`` at ``value`` while this object is held (see the module's doc)."""

    def __init__(self, key: str, value: str, owner: str, root: Path = ROOT) -> None:
        """``owner`` names the holder within its process (a node's state directory): a
        node restarted in the same process takes over its earlier self's hold."""
        self.key = key
        self.value = value
        self.owner = hashlib.sha256(owner.encode()).hexdigest()[:12]
        self.dir = root / key
        self._name: str | None = None

    @property
    def held(self) -> bool:
        return self._name is not None

    def _read(self) -> str:
        with open("/proc/sys/" + self.key.replace(".", "/")) as f:
            return f.read().strip()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _live_holders(self) -> list[str]:
        """Holder files of living processes; those of dead ones are removed."""
        live = []
        for entry in os.listdir(self.dir):
            if entry == ORIGINAL:
                continue
            pid, _, rest = entry.partition("-")
            started = rest.partition("-")[0]
            if pid.isdigit() and _start_time(int(pid)) == started:
                live.append(entry)
            else:
                (self.dir / entry).unlink(missing_ok=True)
        return live

    def hold(self, found_before: str | None = None) -> None:
        """Register as a holder and set the value. ``found_before`` is a value an older
        record says was there before dsec changed it (kept only if no holder recorded one)."""
        if self._name is not None:
            return
        with self._locked():
            holders = self._live_holders()
            original = self.dir / ORIGINAL
            current = self._read()
            if not holders and not original.exists():
                # (an "original" with no live holder is a crashed holder's: still the truth)
                before = found_before if found_before is not None else current
                if before != self.value:
                    original.write_text(before)
            if current != self.value:
                write_sysctl(self.key, self.value)
            name = f"{os.getpid()}-{_start_time(os.getpid())}-{self.owner}"
            (self.dir / name).touch()
            self._name = name

    def release(self) -> None:
        """Stop holding; the last holder puts back the value the first one found."""
        if self._name is None:
            return
        with self._locked():
            (self.dir / self._name).unlink(missing_ok=True)
            self._name = None
            if self._live_holders():
                return
            original = self.dir / ORIGINAL
            if original.exists():
                with contextlib.suppress(OSError):
                    write_sysctl(self.key, original.read_text().strip() or "0")
                original.unlink(missing_ok=True)
