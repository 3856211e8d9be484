"""Run by test_docker_cli_verifiers_root.py with the verifiers venv's Python: verifiers 0.4's
``DockerRuntime``, unmodified, whose ``docker`` (first on ``PATH``) is ``dsec-docker``.
Prints one JSON object of what each step gave; argv: IMAGE BORROWED_CONTAINER BUDGET_S.

Not a test module (no ``test_`` prefix): it imports verifiers, which the main venv lacks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from typing import Any

from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import SERVICE_PORT
from verifiers.v1.runtimes.docker import DockerConfig, DockerRuntime

PAYLOAD = "line one\nline two: ünïcode\n" * 64


def fetch(url: str, budget_s: float) -> str:
    """The body at ``url`` once the sandbox's server answers (it starts in the background)."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=budget_s) as r:
                return str(r.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def owned(image: str, budget_s: float) -> dict[str, Any]:
    """The runtime's own container: start (up to what a remote engine cannot do), exec,
    files, a server on the published service port, stop."""
    out: dict[str, Any] = {}
    rt = DockerRuntime(DockerConfig(image=image, cpu=1, memory=0.5))
    try:
        try:
            await rt.start()
            out["start"] = "ok"
        except SandboxError as e:
            out["start"] = str(e)
        out["id"] = rt.info.id
        out["container"] = rt._container  # its --name, to check what stop() left behind
        url = await rt.expose(SERVICE_PORT)
        out["service_url"] = url
        r = await rt.run(["sh", "-c", 'echo "$FOO"; pwd; id -u'], {"FOO": "bar"})
        out["run"] = [r.exit_code, r.stdout, r.stderr]
        r = await rt.run(["sh", "-c", "echo oops >&2; exit 3"], {})
        out["run_failing"] = [r.exit_code, r.stdout, r.stderr]
        await rt.write("/app/www/page.txt", PAYLOAD.encode())
        out["read_back"] = (await rt.read("/app/www/page.txt")).decode() == PAYLOAD
        await rt.run_background(
            ["python3", "-m", "http.server", str(SERVICE_PORT), "--directory", "/app/www"],
            {},
            "/tmp/server.log",
        )
        out["served"] = fetch(f"{url}/page.txt", budget_s) == PAYLOAD
        out["alive"] = await rt.alive()
    finally:
        await rt.stop()
    return out


async def borrowed(name: str) -> dict[str, Any]:
    """``DockerRuntime.attach``: a container someone else made (``docker inspect {{json
    .Config}}`` for its image, environment and working directory), never removed."""
    out: dict[str, Any] = {}
    async with DockerRuntime.attach(DockerConfig(image="unused"), name) as rt:
        out["image"] = rt.config.image
        out["workdir"] = rt.config.workdir
        out["image_env"] = rt._image_env
        r = await rt.run(["sh", "-c", 'echo "$GIVEN $EXTRA"; pwd'], {"EXTRA": "x"})
        out["run"] = [r.exit_code, r.stdout]
        await rt.write("/work/note.txt", b"borrowed\n")
        out["read"] = (await rt.read("/work/note.txt")).decode()
    return out


async def main() -> None:
    image, name, budget_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    report = {"owned": await owned(image, budget_s), "borrowed": await borrowed(name)}
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
