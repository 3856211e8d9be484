"""SWE-ReX's own remote runtime through the port proxy: ``swerex-remote`` (the real
swe-rex 1.4 server) runs inside a debian sandbox, and the unmodified ``RemoteDeployment``
talks to it at ``sb.get_url(8000)`` (the token travels in the URL's path, since SWE-ReX
appends its paths to the base URL and sends only its own ``X-API-Key``).

The server's packages are the test venv's own installed distributions of swe-rex and its
requirements (same Python minor version as the image's python3), uploaded into the
sandbox: no network needed in the sandbox."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import secrets
import shutil
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from swerex.deployment.remote import RemoteDeployment
from swerex.runtime.abstract import (
    BashAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from tests.conftest import LiveServer
from tests.timing import budget

from dsec import AsyncSandbox

pytestmark = [pytest.mark.root, pytest.mark.debian, pytest.mark.slow]


def _closure(name: str) -> list[md.Distribution]:
    """``name`` and every installed distribution it requires (extras left out)."""
    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    return list(seen.values())


def _stage(dest: Path) -> None:
    """Copy swe-rex and its requirements (their site-packages files) into ``dest``."""
    for dist in _closure("swe-rex"):
        base = Path(str(dist.locate_file("")))
        for f in dist.files or []:
            if str(f).startswith("..") or "__pycache__" in str(f):
                continue
            src = base / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)


async def test_remote_deployment_through_get_url(sdk_env: LiveServer, tmp_path: Path) -> None:
    stage = tmp_path / "swerex-site"
    _stage(stage)
    token = secrets.token_hex(16)  # token_urlsafe may start with "-", an option to argparse
    async with await AsyncSandbox.create(image="debian", memory_mb=512, disk_mb=1024) as sb:
        py = (await sb.commands.run("python3 -c 'import sys; print(sys.version_info[:2])'")).stdout
        if py.strip() != str(sys.version_info[:2]):
            pytest.skip(
                f"the image's python3 is {py.strip()}, the test venv's {sys.version_info[:2]}"
            )
        await sb.files.upload_dir(stage, "/opt/swerex")
        r = await sb.commands.run(
            f"PYTHONPATH=/opt/swerex nohup python3 -m swerex.server --host 127.0.0.1 "
            f"--port 8000 --auth-token {token} >/tmp/swerex.log 2>&1 & echo started"
        )
        assert r.stdout == "started\n"
        url = await sb.get_url(8000, "/")
        deployment = RemoteDeployment(host=url.rstrip("/"), auth_token=token, timeout=30)
        await deployment.start()
        try:
            deadline = asyncio.get_running_loop().time() + budget(30)
            while True:
                try:
                    if await deployment.is_alive():
                        break
                except Exception:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    log = (await sb.commands.run("cat /tmp/swerex.log")).stdout
                    raise AssertionError(f"swerex-remote did not come up:\n{log}")
                await asyncio.sleep(0.2)
            runtime = deployment.runtime
            await runtime.create_session(CreateBashSessionRequest())
            out = await runtime.run_in_session(BashAction(command="cd /tmp && echo $((6 * 7))"))
            assert out.output.strip() == "42" and out.exit_code == 0
            out = await runtime.run_in_session(BashAction(command="pwd"))
            assert out.output.strip() == "/tmp"  # the session keeps its state
            res = await runtime.execute(Command(command=["python3", "-c", "print('hi')"]))
            assert res.stdout == "hi\n" and res.exit_code == 0
            await runtime.write_file(WriteFileRequest(path="/tmp/w.txt", content="written"))
            assert (
                await runtime.read_file(ReadFileRequest(path="/tmp/w.txt"))
            ).content == "written"
            assert (await sb.files.read_text("/tmp/w.txt")) == "written"
            # multipart upload through the proxy
            local = tmp_path / "up.txt"
            local.write_text("uploaded through the proxy")
            await runtime.upload(UploadRequest(source_path=str(local), target_path="/tmp/up.txt"))
            assert (await sb.files.read_text("/tmp/up.txt")) == "uploaded through the proxy"
            # without the sandbox's token the proxy refuses (before swerex sees anything)
            bare = await sb.get_url(8000, "/", signed=False)
            wrong = RemoteDeployment(host=bare.rstrip("/"), auth_token=token, timeout=5)
            await wrong.start()
            assert not await wrong.is_alive()
            with pytest.raises(Exception, match="401"):  # its close() is refused as well
                await wrong.stop()
        finally:
            await deployment.stop()
