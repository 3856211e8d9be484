"""The generated sync API has typed stubs: user code is type-checked against
``Sandbox.create(...)`` and friends, and the checked-in stub matches the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dsec.sdk.stubs import render_sync_stubs

STUB = Path(__file__).resolve().parents[2] / "src" / "dsec" / "sdk" / "sync_api.pyi"


def test_checked_in_stub_is_current() -> None:
    assert STUB.read_text() == render_sync_stubs(), (
        "src/dsec/sdk/sync_api.pyi is stale: run .venv/bin/python scripts/gen_sync_stubs.py"
    )


USER_CODE = """
from dsec import Client, Sandbox

with Sandbox.create(image="busybox", cpu=0.5, labels={"task": "a"}) as sb:
    reveal_type(sb)
    result = sb.commands.run("echo hi", timeout=30)
    reveal_type(result)
    reveal_type(result.stdout)
    for event in sb.commands.stream("ls"):
        reveal_type(event)
    reveal_type(sb.files.read("/etc/hostname"))
    reveal_type(sb.fork(2))
    reveal_type(sb.display.screenshot())
client = Client()
reveal_type(client.list_images())
reveal_type(client.jobs.pause("run-1"))
Sandbox.create(imagee="busybox")
sb2 = Sandbox.connect(42)
sb2.commands.run("x").nope
"""


def test_user_code_is_checked_against_the_sync_api(tmp_path: Path) -> None:
    user = tmp_path / "user_code.py"
    user.write_text(USER_CODE)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "c"),
            str(user),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    revealed = [
        line.split('Revealed type is "', 1)[1].rstrip('"')
        for line in out.splitlines()
        if "Revealed type" in line
    ]
    assert revealed == [
        "dsec.sdk.sync_api.Sandbox",
        "dsec.models.ExecResult",  # CommandResult is the SDK's name for it
        "str",
        "dsec.models.ExecEvent",
        "bytes",
        "list[dsec.sdk.sync_api.Sandbox]",
        "bytes",
        "list[dsec.models.ImageInfo]",
        "dsec.models.JobActionResult",
    ], out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert any('Unexpected keyword argument "imagee"' in e for e in errors), out
    assert any('incompatible type "int"' in e for e in errors), out
    assert any('has no attribute "nope"' in e for e in errors), out
    assert len(errors) == 3, out
