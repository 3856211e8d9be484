"""The ``vm`` tier: a full QEMU machine (q35, BIOS boot) with a writable qcow2 disk and a display.

Differences from :mod:`dsec.runtimes.microvm` (which this subclasses; same guest agent, same
init, same exec/files/pause/recover/orphans):

* machine ``q35`` with SeaBIOS, booting the *compressed* Debian cloud kernel (``bzImage``)
  through the BIOS so the kernel gets the VGA text console (a PVH boot leaves it on the dummy
  console: nothing to see). Virtio devices on PCI.
* writable layer: a qcow2 overlay per machine (``upper.qcow2``) over a node-wide, empty ext4
  base image of ``disk_mb`` (``$DSEC_HOME/bin/vm-upper-<MiB>M.ext4``, made once with
  ``mkfs.ext4``); the guest mounts it as the overlay upper. ``disk_mb`` is a real disk size.
* templates and clones as in the microvm tier, with the disk cloned along with the RAM: the
  template keeps its own ``upper.qcow2`` (the disk exactly as the snapshotted guest left it,
  flushed when the migration completed) and each clone's ``upper.qcow2`` is a qcow2 overlay
  over it. The template key includes ``disk_mb``. A cold boot (~6.5 s under TCG) happens once
  per (image, memory, vCPUs, disk size); clones restore in a fraction of a second.
* display: ``-device VGA`` plus a USB tablet (absolute pointer) on ``qemu-xhci``; an
  interactive shell on tty1 (``dsec.tty=1``). The ``console`` screen of the display API:
  :meth:`screenshot` (QMP ``screendump`` PNG), :meth:`screen_act` (QMP ``input-send-event``
  / ``send-key``). A desktop image's X desktop runs in the guest and is driven through
  ``exec`` like on the container tier (:mod:`dsec.edge.desktop`).
  A guest desktop needs its own input drivers (``usbhid``) to act on clicks; the text console
  receives keyboard input through the i8042 PS/2 keyboard that q35 always has.

Example::

    rt = VMRuntime(Paths.from_env())
    await rt.start()
    h = await rt.create(spec)
    await rt.screen_act(h, Type(text="echo hello\\n"))
    png = await rt.screenshot(h)
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

from dsec.config import Paths
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.display import Button, Click, DisplayAction, Drag, Key, Move, Scroll, Type, key_tokens
from dsec.errors import CapabilityNotSupported, InvalidRequest, SandboxError, TierUnavailable
from dsec.runtimes.microvm.runtime import MicroVMConfig, MicroVMRuntime, Template
from dsec.runtimes.microvm.state import MicrovmState

__all__ = ["KEY_ALIASES", "VMRuntime", "char_to_keys"]

# characters -> (qcode, shift) for a US keyboard layout
_PLAIN = {c: c for c in "abcdefghijklmnopqrstuvwxyz0123456789"}
_PLAIN.update({
    " ": "spc", "\n": "ret", "\t": "tab", "-": "minus", "=": "equal", "[": "bracket_left",
    "]": "bracket_right", ";": "semicolon", "'": "apostrophe", "`": "grave_accent",
    "\\": "backslash", ",": "comma", ".": "dot", "/": "slash",
})  # fmt: skip
_SHIFTED = {
    "!": "1", "@": "2", "#": "3", "$": "4", "%": "5", "^": "6", "&": "7", "*": "8", "(": "9",
    ")": "0", "_": "minus", "+": "equal", "{": "bracket_left", "}": "bracket_right",
    ":": "semicolon", '"': "apostrophe", "~": "grave_accent", "|": "backslash", "<": "comma",
    ">": "dot", "?": "slash",
}  # fmt: skip
KEY_ALIASES = {
    "enter": "ret", "return": "ret", "escape": "esc", "backspace": "backspace", "space": "spc",
    "control": "ctrl", "super": "meta_l", "win": "meta_l", "pageup": "pgup", "pagedown": "pgdn",
    "del": "delete", "tab": "tab", "pgup": "pgup", "pgdn": "pgdn",
    "page_up": "pgup", "page_down": "pgdn", "ins": "insert", "meta": "meta_l", "cmd": "meta_l",
    "windows": "meta_l", "alt_l": "alt", "alt_r": "alt_r", "ctrl_l": "ctrl", "ctrl_r": "ctrl_r",
    "shift_l": "shift", "shift_r": "shift_r", "bksp": "backspace",
}  # fmt: skip
_BUTTONS = {"left": "left", "right": "right", "middle": "middle"}


def char_to_keys(ch: str) -> list[str]:
    """QEMU qcodes pressed together to type ``ch`` (US layout). Raises InvalidRequest."""
    if ch in _PLAIN:
        return [_PLAIN[ch]]
    if ch.isalpha() and ch.lower() in _PLAIN and ch.isascii():
        return ["shift", ch.lower()]
    if ch in _SHIFTED:
        return ["shift", _SHIFTED[ch]]
    raise InvalidRequest(f"cannot type {ch!r} on a US keyboard")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SandboxError("screendump did not produce a PNG")
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


class VMRuntime(MicroVMRuntime):
    """:class:`dsec.contract.runtime.Runtime` (and ``Pausable``) for the ``vm`` tier, with a display."""

    tier = "vm"
    machine = "q35"
    _virtio_bus = "pci"

    def __init__(self, paths: Paths | None = None, config: MicroVMConfig | None = None) -> None:
        super().__init__(paths, config)
        self._screen: dict[str, tuple[int, int]] = {}
        self._pointer: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ machine

    def _kernel_image(self) -> Path:
        assert self.artifacts is not None
        return self.artifacts.bzimage

    def _machine_args(self) -> list[str]:
        return ["-M", "q35,memory-backend=mem", *self._accel_args()]

    def _kernel_args(self, n_layers: int, disk_mb: int) -> str:
        return super()._kernel_args(n_layers, disk_mb) + " dsec.tty=1"

    def _setup_disk_mb(self, spec: SandboxSpec) -> int:
        return 0  # the writable layer is a real disk of disk_mb, nothing to resize

    def _template_key_extra(self, spec: SandboxSpec) -> list[Any]:
        return [spec.disk_mb]

    def _template_complete(self, t: Template) -> bool:
        return super()._template_complete(t) and (t.dir / "upper.qcow2").exists()

    async def _sandbox_devices(self, d: Path, spec: SandboxSpec, tpl: Template | None) -> list[str]:
        """The writable disk (over the template's disk for a clone, else over the empty
        base), the VGA display and the USB tablet."""
        overlay = self._disk_path(d)
        overlay.parent.mkdir(mode=0o700, exist_ok=True)
        if tpl is not None:
            backing, fmt = tpl.dir / "upper.qcow2", "qcow2"
        else:
            backing, fmt = await asyncio.to_thread(self._upper_base, spec.disk_mb), "raw"
        await asyncio.to_thread(
            _run,
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-F",
                fmt,
                "-b",
                str(backing),
                str(overlay),
            ],
        )
        return self._device_args(overlay)

    def _device_args(self, disk: Path) -> list[str]:
        """The writable disk ``disk``, the VGA display and the USB tablet."""
        return [
            "-drive", f"file={disk},if=none,id=upper,format=qcow2,cache=unsafe",
            "-device", "virtio-blk-pci,drive=upper,serial=upper",
            "-device", "VGA", "-device", "qemu-xhci", "-device", "usb-tablet",
        ]  # fmt: skip

    async def _restore_devices(self, d: Path, name: str) -> list[str]:
        """The machine's existing disk (suspend) or its fork copy, and the display."""
        disk = self.root / "disks" / f"{name}.qcow2"
        if not await asyncio.to_thread(disk.exists):
            raise SandboxError(f"the writable disk {disk} of {name} is gone")
        return self._device_args(disk)

    async def _freeze_disk(self, handle: Handle, dest_dir: Path) -> None:
        """Copy the stopped VM's qcow2 overlay (its writes since the template; the backing
        chain is shared read-only) to ``dest_dir/disk.qcow2``. QEMU flushed and released the
        image when the state migration completed."""
        await asyncio.to_thread(shutil.copyfile, self.disk_of(handle), dest_dir / "disk.qcow2")

    async def _adopt_disk(self, src_dir: Path, name: str) -> None:
        disks = self.root / "disks"
        disks.mkdir(mode=0o700, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, src_dir / "disk.qcow2", disks / f"{name}.qcow2")

    def _disk_path(self, d: Path) -> Path:
        """The writable disk of the machine whose directory is ``d``.

        A template's disk lives in its directory. A sandbox's lives in ``vm/disks/<name>.qcow2``
        (``name``: the name QEMU was started with), not in the sandbox directory: a pooled QEMU's
        directory is renamed to the sandbox id when it is taken, and QEMU reopens the image by
        path when it activates it at the end of the incoming migration."""
        if d.parent == self.template_root:
            return d / "upper.qcow2"
        return self.root / "disks" / f"{d.name}.qcow2"

    def disk_of(self, handle: Handle) -> Path:
        """The sandbox's writable disk (a qcow2 overlay)."""
        return self.root / "disks" / f"{handle.typed(MicrovmState).qemu_name or handle.id}.qcow2"

    def _disk_usage(self, handle: Handle) -> tuple[int | None, int | None]:
        """The writable disk: bytes its qcow2 overlay has allocated on the host (what the
        guest wrote, plus qcow2 metadata) out of ``disk_mb``."""
        total = handle.typed(MicrovmState).disk_mb << 20
        try:
            used = self.disk_of(handle).stat().st_blocks * 512
        except OSError:
            return None, total
        return min(used, total) if total else used, total

    def _discard_files(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / "disks" / f"{name}.qcow2").unlink()

    def _stale_pool_names(self, adopted: set[Any]) -> list[str]:
        disks = self.root / "disks"
        if not disks.is_dir():
            return []
        return [p.stem for p in disks.glob("pool-*.qcow2") if p.stem not in adopted]

    def _upper_base(self, disk_mb: int) -> Path:
        """The node's empty ext4 image of ``disk_mb`` MiB (sparse), made once."""
        base = self.paths.bin / f"vm-upper-{disk_mb}M.ext4"
        if base.exists():
            return base
        if shutil.which("mkfs.ext4") is None:
            raise TierUnavailable("the vm tier needs mkfs.ext4 (Debian: e2fsprogs)")
        with open(self.paths.bin / ".vm-upper.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if base.exists():
                return base
            tmp = base.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(disk_mb << 20)
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1",
                  "-L", "dsec-upper", str(tmp)])  # fmt: skip
            os.chmod(tmp, 0o444)  # a backing file: never written
            os.rename(tmp, base)
        return base

    # ------------------------------------------------------------------ display

    async def _qmp(self, handle: Handle) -> Any:
        vm = await self._vm(handle)
        assert vm.qmp is not None
        return vm.qmp

    async def screenshot(self, handle: Handle) -> bytes:
        """The guest display as PNG bytes (QMP ``screendump``)."""
        qmp = await self._qmp(handle)
        path = self._sandbox_dir(handle) / f"screen-{os.getpid()}.png"
        try:
            await qmp.execute("screendump", filename=str(path), format="png")
            data = await asyncio.to_thread(path.read_bytes)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._screen[handle.id] = png_size(data)
        return data

    async def screen_size(self, handle: Handle) -> tuple[int, int]:
        """(width, height) of the console: the last screenshot's (taken now if none was)."""
        if handle.id not in self._screen:
            await self.screenshot(handle)
        return self._screen[handle.id]

    def pointer(self, handle: Handle) -> tuple[int, int] | None:
        return self._pointer.get(handle.id)

    async def _check_point(self, handle: Handle, x: int, y: int) -> tuple[int, int]:
        w, h = await self.screen_size(handle)
        if not (0 <= x < w and 0 <= y < h):
            raise InvalidRequest(f"({x}, {y}) is outside the {w}x{h} screen", width=w, height=h)
        return w, h

    async def _move(self, handle: Handle, x: int, y: int) -> None:
        w, h = await self._check_point(handle, x, y)
        qmp = await self._qmp(handle)
        ax, ay = x * 0x7FFF // max(1, w - 1), y * 0x7FFF // max(1, h - 1)
        move = [
            {"type": "abs", "data": {"axis": "x", "value": ax}},
            {"type": "abs", "data": {"axis": "y", "value": ay}},
        ]
        await qmp.execute("input-send-event", events=move)
        self._pointer[handle.id] = (x, y)

    async def _button(self, handle: Handle, button: str, down: bool) -> None:
        qmp = await self._qmp(handle)
        await qmp.execute(
            "input-send-event", events=[{"type": "btn", "data": {"down": down, "button": button}}]
        )

    async def screen_act(self, handle: Handle, action: DisplayAction) -> None:
        """One input action through QMP: the USB tablet's absolute pointer and buttons
        (``input-send-event``), the keyboard (``send-key``)."""
        if isinstance(action, Move):
            await self._move(handle, action.x, action.y)
        elif isinstance(action, Click):
            if action.x is not None and action.y is not None:
                await self._move(handle, action.x, action.y)
            for _ in range(2 if action.double else 1):
                await self._button(handle, _BUTTONS[action.button], True)
                await self._button(handle, _BUTTONS[action.button], False)
        elif isinstance(action, Drag):
            await self._check_point(handle, action.to_x, action.to_y)
            await self._move(handle, action.from_x, action.from_y)
            await self._button(handle, _BUTTONS[action.button], True)
            for i in (1, 2, 3):
                await self._move(
                    handle,
                    action.from_x + (action.to_x - action.from_x) * i // 3,
                    action.from_y + (action.to_y - action.from_y) * i // 3,
                )
            await self._button(handle, _BUTTONS[action.button], False)
        elif isinstance(action, Scroll):
            if action.x is not None and action.y is not None:
                await self._move(handle, action.x, action.y)
            for _ in range(action.amount):
                await self._button(handle, f"wheel-{action.direction}", True)
                await self._button(handle, f"wheel-{action.direction}", False)
        elif isinstance(action, Button):
            await self._button(handle, _BUTTONS[action.button], action.down)
        elif isinstance(action, Type):
            await self._type(handle, action.text)
        elif isinstance(action, Key):
            await self._key(handle, action.name)
        else:
            raise CapabilityNotSupported(
                f"the vm console has no applications to {action.action}", screen="console"
            )

    async def _type(self, handle: Handle, text: str) -> None:
        """Type ``text`` on the keyboard (US layout; ``\\n`` is Enter)."""
        if len(text) > 10_000:
            raise InvalidRequest("at most 10,000 characters per call")
        keys = [char_to_keys(c) for c in text]
        qmp = await self._qmp(handle)
        for combo in keys:
            await qmp.execute(
                "send-key", keys=[{"type": "qcode", "data": k} for k in combo], **{"hold-time": 5}
            )

    async def _key(self, handle: Handle, name: str) -> None:
        """Press a key or a chord: ``"enter"``, ``"esc"``, ``"ctrl-c"``, ``"alt+f4"``, ``"f1"``."""
        try:
            tokens = key_tokens(name)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        parts = [KEY_ALIASES.get(p.strip().lower(), p.strip().lower()) for p in tokens]
        qmp = await self._qmp(handle)
        try:
            await qmp.execute(
                "send-key", keys=[{"type": "qcode", "data": k} for k in parts], **{"hold-time": 20}
            )
        except SandboxError as e:
            raise InvalidRequest(f"unknown key {name!r}: {e.message}") from e


def _run(argv: list[str]) -> None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        raise TierUnavailable(f"{argv[0]} is not installed (Debian: qemu-utils / e2fsprogs)") from e
    if out.returncode != 0:
        raise SandboxError(f"{argv[0]} failed: {out.stderr.strip()[-500:]}")
