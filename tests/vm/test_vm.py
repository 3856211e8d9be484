"""The vm tier: a q35 machine with a qcow2 writable disk, restored from templates like the
microvm tier, and a display driven over QMP, through the HTTP display API and the SDK."""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from tests.timing import budget, vm_boot_budgets

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.apiserver.routes_display import DisplayEdge
from dsec.config import Paths
from dsec.contract.runtime import Handle, Pausable, Runtime, capabilities_of
from dsec.display import DisplayState, Screen, WindowInfo
from dsec.edge.desktop import ConsoleScreen
from dsec.errors import (
    CapabilityNotSupported,
    FileNotFound,
    InvalidRequest,
    SandboxNotFound,
)
from dsec.models import DisplayActRequest, ExecRequest, SandboxInfo, SandboxRef, ScreenRequest
from dsec.runtimes.microvm import MicroVMConfig
from dsec.runtimes.microvm.qemu import pid_alive
from dsec.runtimes.vm import VMRuntime
from dsec.sdk.client import AsyncClient
from dsec.sdk.display import AsyncDisplay
from dsec.sdk.sandbox import AsyncSandbox

from .conftest import BusyboxImage, new_spec
from .screen_text import cell_bitmap, decode_png, learn_glyphs, read_screen

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(180)]

CHARSET = string.ascii_letters + string.digits + string.punctuation
API_KEY = "dsec_vm_display_test_key"


class RuntimeDisplayEdge:
    """A :class:`DisplayEdge` over one VMRuntime and a fixed set of sandboxes of one owner:
    what the edge does (ownership check, then the runtime), without the rest of the edge."""

    def __init__(self, rt: VMRuntime, handles: list[Handle]) -> None:
        self.rt = rt
        self.handles = {h.id: h for h in handles}
        self.owner = owner_id(API_KEY)

    def _handle(self, sandbox_id: str, owner: str) -> Handle:
        if owner != self.owner or sandbox_id not in self.handles:
            raise SandboxNotFound(f"no sandbox {sandbox_id}")
        return self.handles[sandbox_id]

    def _console(self, sandbox_id: str, owner: str) -> ConsoleScreen:
        return ConsoleScreen(self.rt, self._handle(sandbox_id, owner))

    async def display_screenshot(
        self, sandbox_id: str, owner: str, screen: Screen = "auto", pointer: bool = False
    ) -> bytes:
        return await self._console(sandbox_id, owner).screenshot(pointer=pointer)

    async def display_act(self, req: DisplayActRequest, owner: str) -> None:
        await self._console(req.sandbox_id, owner).act(req.action)

    async def display_state(self, req: ScreenRequest, owner: str) -> DisplayState:
        return await self._console(req.sandbox_id, owner).state()

    async def display_windows(self, req: SandboxRef, owner: str) -> list[WindowInfo]:
        raise CapabilityNotSupported("the console has no windows")

    async def display_restart(self, req: SandboxRef, owner: str) -> DisplayState:
        raise CapabilityNotSupported("the console has no desktop to restart")


def _display(edge: object, sandbox_id: str) -> tuple[AsyncDisplay, AsyncClient]:
    """``sb.display`` of a sandbox served by an apiserver in front of ``edge`` (in-process ASGI)."""
    app = create_app(edge, StaticKeys([API_KEY]))  # type: ignore[arg-type]
    client = AsyncClient("http://dsec.test", API_KEY, transport=httpx.ASGITransport(app=app))
    now = datetime.now(UTC)
    info = SandboxInfo(
        id=sandbox_id, tier="vm", image="busybox", state="running", cpu=1.0, memory_mb=256,
        disk_mb=96, node="test", created_at=now, updated_at=now,
    )  # fmt: skip
    return AsyncDisplay(AsyncSandbox(info, client, owns_client=False)), client


@pytest.fixture
async def vm_runtime(vm_home: Path) -> AsyncIterator[VMRuntime]:
    rt = VMRuntime(
        Paths(vm_home),
        MicroVMConfig(
            exec_grace_s=budget(3.0), pool_size=1, keep_templates=True, **vm_boot_budgets()
        ),
    )
    await rt.start()
    assert capabilities_of(rt).available, capabilities_of(rt).reason
    yield rt
    await rt.close()


@pytest.fixture
async def vm_sandbox(
    vm_runtime: VMRuntime, busybox_image: BusyboxImage
) -> AsyncIterator[tuple[VMRuntime, Handle]]:
    rt = vm_runtime
    h = await rt.create(new_spec(busybox_image, tier="vm", disk_mb=96))
    try:
        yield rt, h
    finally:
        await rt.destroy(h)
    assert not pid_alive(h.state["pid"])
    assert not rt.disk_of(h).exists()


async def _screen_lines(display: AsyncDisplay, glyphs: dict[tuple[bool, ...], str]) -> list[str]:
    px = await asyncio.to_thread(decode_png, await display.screenshot())
    return await asyncio.to_thread(read_screen, px, glyphs)


async def test_vm_templates_disk_and_display(
    vm_sandbox: tuple[VMRuntime, Handle], busybox_image: BusyboxImage
) -> None:
    rt, h = vm_sandbox
    assert isinstance(rt, Runtime) and isinstance(rt, Pausable)
    assert capabilities_of(rt).display
    assert rt.last_create["restored"] == 1.0  # cold boot once (the template), then a clone
    assert isinstance(RuntimeDisplayEdge(rt, []), DisplayEdge)
    # same agent as microvm; the writable layer is the qcow2 disk of disk_mb
    r = await rt.exec(h, ExecRequest(cmd="df -m / | tail -1"))
    assert 80 <= int(r.stdout.split()[1]) <= 96
    assert rt.disk_of(h).exists()
    await rt.files(h).write("/persist.txt", b"kept")
    await rt.pause(h)
    await rt.resume(h)
    assert await rt.files(h).read("/persist.txt", 10) == b"kept"

    # a second sandbox is a clone too (from the pool): its own disk over the template's
    await rt.pool_settled()
    t0 = time.monotonic()
    h2 = await rt.create(new_spec(busybox_image, tier="vm", disk_mb=96))
    try:
        assert rt.last_create["pooled"] == 1.0 and time.monotonic() - t0 < budget(3)  # no boot
        with pytest.raises(FileNotFound):
            await rt.files(h2).read("/persist.txt", 10)
        r = await rt.exec(h2, ExecRequest(cmd="echo clone > /c.txt; cat /c.txt; hostname"))
        assert r.stdout.split("\n")[0] == "clone"
    finally:
        await rt.destroy(h2)
    assert not rt.disk_of(h2).exists()
    with pytest.raises(FileNotFound):
        await rt.files(h).read("/c.txt", 10)

    display, client = _display(RuntimeDisplayEdge(rt, [h]), h.id)
    try:
        # learn the console font from known text the agent writes to tty1
        await rt.exec(
            h,
            ExecRequest(
                cmd=f"printf '\\033[H\\033[J%s' '{CHARSET.replace(chr(39), '')}' > /dev/tty1"
            ),
        )
        last = len(CHARSET.replace("'", "")) - 1  # the text's last cell
        deadline = time.monotonic() + budget(10)
        while True:  # until the screen shows the text to its end
            png = await display.screenshot()
            assert png.startswith(b"\x89PNG")
            px = await asyncio.to_thread(decode_png, png)
            if any(cell_bitmap(px, last // 80, last % 80)) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert (len(px[0]), len(px)) == (720, 400)
        glyphs = await asyncio.to_thread(learn_glyphs, px, CHARSET.replace("'", ""))
        glyphs[tuple(False for _ in range(9 * 16))] = " "

        # type on the keyboard into the shell on tty1 and read the result off the screen
        await rt.exec(h, ExecRequest(cmd="printf '\\033[H\\033[J' > /dev/tty1"))
        await display.type("echo dsec-$((6*7))-ok\n")
        lines: list[str] = []
        deadline = time.monotonic() + budget(10)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            lines = await _screen_lines(display, glyphs)
            if any(line.strip() == "dsec-42-ok" for line in lines):
                break
        assert any("echo dsec-$((6*7))-ok" in line for line in lines), lines
        assert any(line.strip() == "dsec-42-ok" for line in lines), lines

        await display.key("ctrl-c")
        await display.click(100, 200)
        assert await display.cursor_position() == (100, 200)
        await display.click(719, 399, button="right", double=True)
        await display.drag(10, 10, 300, 200)
        await display.scroll("down", 2, 30, 40)
        assert await display.cursor_position() == (30, 40)
        assert await display.screen_size() == (720, 400)
        with pytest.raises(InvalidRequest) as off:
            await display.click(5000, 5000)  # off the 720x400 screen
        assert (off.value.details["width"], off.value.details["height"]) == (720, 400)
        with pytest.raises(CapabilityNotSupported):
            await display.open("/etc/hostname")  # a console has no applications
        with pytest.raises(InvalidRequest):
            await display.click(-1, 3)  # refused by the route's schema
        with pytest.raises(InvalidRequest):
            await display.key("no-such-key-name")
        with pytest.raises(InvalidRequest):
            await display.type("\u00e9")  # not on a US keyboard
    finally:
        await client.close()

    # another owner's (or an unknown) sandbox is not found; an edge without displays says so
    other, client = _display(RuntimeDisplayEdge(rt, []), h.id)
    try:
        with pytest.raises(SandboxNotFound):
            await other.screenshot()
    finally:
        await client.close()
    plain, client = _display(object(), h.id)
    try:
        with pytest.raises(CapabilityNotSupported):
            await plain.key("enter")
    finally:
        await client.close()
