"""The display API end to end: SDK -> HTTP -> edge -> vm runtime (QMP screendump / input)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec import Sandbox
from dsec.errors import CapabilityNotSupported
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow]


def test_display_through_sdk(short_home: Path, shared_layers: Path) -> None:
    home = short_home
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with BackgroundServer(home, tiers=["vm", "container"]) as srv:
        kw = {"url": srv.url, "api_key": srv.api_key, "image": "busybox", "memory_mb": 256}
        with Sandbox.create(tier="vm", **kw) as sb:
            png = sb.display.screenshot()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
            width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
            assert width >= 320 and height >= 200
            sb.display.type("echo hi")
            sb.display.key("ret")
            sb.display.click(10, 10)
        with Sandbox.create(tier="container", **kw) as sb:
            with pytest.raises(CapabilityNotSupported):
                sb.display.screenshot()
