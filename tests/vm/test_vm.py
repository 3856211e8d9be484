"""The vm tier: a q35 machine with a qcow2 writable disk and a display driven over QMP."""

from __future__ import annotations

import asyncio
import string
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.config import Paths
from dsec.errors import InvalidRequest
from dsec.models import ExecRequest
from dsec.runtimes.base import Handle, Pausable, Runtime
from dsec.runtimes.microvm import MicroVMConfig
from dsec.runtimes.microvm.qemu import pid_alive
from dsec.runtimes.vm import VMRuntime

from .conftest import BusyboxImage, new_spec
from .screen_text import decode_png, learn_glyphs, read_screen

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(180)]

CHARSET = string.ascii_letters + string.digits + string.punctuation


@pytest.fixture
async def vm_sandbox(
    vm_home: Path, busybox_image: BusyboxImage
) -> AsyncIterator[tuple[VMRuntime, Handle]]:
    rt = VMRuntime(Paths(vm_home), MicroVMConfig(exec_grace_s=3.0))
    await rt.start()
    assert rt.capabilities().available, rt.capabilities().reason
    h = await rt.create(new_spec(busybox_image, tier="vm", disk_mb=96))
    try:
        yield rt, h
    finally:
        await rt.destroy(h)
        await rt.close()
    assert not pid_alive(h.state["pid"])


async def _screen_lines(rt: VMRuntime, h: Handle, glyphs: dict[tuple[bool, ...], str]) -> list[str]:
    px = await asyncio.to_thread(decode_png, await rt.screenshot(h))
    return await asyncio.to_thread(read_screen, px, glyphs)


async def test_vm_exec_disk_and_display(vm_sandbox: tuple[VMRuntime, Handle]) -> None:
    rt, h = vm_sandbox
    assert isinstance(rt, Runtime) and isinstance(rt, Pausable)
    assert rt.capabilities().display
    # same agent as microvm; the writable layer is the qcow2 disk of disk_mb
    r = await rt.exec(h, ExecRequest(cmd="df -m / | tail -1; grep -c ' /rw ' /proc/mounts || true"))
    assert 80 <= int(r.stdout.split()[1]) <= 96
    assert (Path(h.state["dir"]) / "upper.qcow2").exists()
    await rt.files(h).write("/persist.txt", b"kept")
    await rt.pause(h)
    await rt.resume(h)
    assert await rt.files(h).read("/persist.txt", 10) == b"kept"

    # learn the console font from known text the agent writes to tty1
    await rt.exec(
        h,
        ExecRequest(cmd=f"printf '\\033[H\\033[J%s' '{CHARSET.replace(chr(39), '')}' > /dev/tty1"),
    )
    await asyncio.sleep(0.5)
    png = await rt.screenshot(h)
    assert png.startswith(b"\x89PNG")
    px = await asyncio.to_thread(decode_png, png)
    assert (len(px[0]), len(px)) == (720, 400)
    glyphs = await asyncio.to_thread(learn_glyphs, px, CHARSET.replace("'", ""))
    space = tuple(False for _ in range(9 * 16))
    glyphs[space] = " "

    # type on the keyboard into the shell on tty1 and read the result off the screen
    await rt.exec(h, ExecRequest(cmd="printf '\\033[H\\033[J' > /dev/tty1"))
    await rt.type(h, "echo dsec-$((6*7))-ok\n")
    lines: list[str] = []
    for _ in range(40):
        await asyncio.sleep(0.25)
        lines = await _screen_lines(rt, h, glyphs)
        if any(line.strip() == "dsec-42-ok" for line in lines):
            break
    assert any("echo dsec-$((6*7))-ok" in line for line in lines), lines
    assert any(line.strip() == "dsec-42-ok" for line in lines), lines

    await rt.key(h, "ctrl-c")
    await rt.click(h, 100, 200)
    with pytest.raises(InvalidRequest):
        await rt.click(h, 5000, 5000)
    with pytest.raises(InvalidRequest):
        await rt.key(h, "no-such-key-name")
