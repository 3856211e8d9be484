"""Drive a dsec sandbox through openai-agents' E2B sandbox client, unmodified (run by the
Python of ``.venv-openai-agents``: openai-agents[e2b] pins e2b 2.31; see
``test_openai_agents_root.py``). Configured only as E2B's documentation says: ``E2B_API_KEY``
(here the dsec key in its E2B form), ``E2B_API_URL`` and ``E2B_SANDBOX_URL``. Prints one JSON
object with what it saw."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path


async def main(template: str) -> dict[str, object]:
    from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
    from agents.sandbox.manifest import Manifest

    client = E2BSandboxClient()
    options = E2BSandboxClientOptions(sandbox_type="e2b", template=template, timeout=300)
    session = await client.create(manifest=Manifest(root="/home/user/workspace"), options=options)
    seen: dict[str, object] = {"sandbox_id": session.state.sandbox_id}  # type: ignore[attr-defined]
    async with session:
        r = await session.exec("id -un; pwd; echo $((6 * 7)) > answer.txt; cat answer.txt")
        seen["exec"] = {"stdout": r.stdout.decode(), "exit_code": r.exit_code}
        await session.write(Path("notes/hello.txt"), io.BytesIO(b"from openai-agents\n"))
        seen["read"] = (await session.read(Path("notes/hello.txt"))).read().decode()
        failed = await session.exec("exit 3")
        seen["failed_exit_code"] = failed.exit_code
        seen["running"] = await session.running()
    await client.delete(session)
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "base"))))
