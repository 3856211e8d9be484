"""Checks of ``dsec.integrations.harbor.DsecEnvironment`` through Harbor's own classes, run
by ``test_harbor_root.py`` with the Harbor venv's Python (>= 3.12): ``python THIS TASK_DIR
WORK_DIR``. Prints one JSON object with what it saw; the test asserts on it."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from dsec.integrations.harbor import DsecEnvironment


async def main(task: Path, work: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    paths = TrialPaths(work / "trial")
    paths.mkdir() if hasattr(paths, "mkdir") else None
    env = DsecEnvironment(
        environment_dir=task / "environment",
        environment_name="checks",
        session_id="checks__1",
        trial_paths=paths,
        task_env_config=EnvironmentConfig(cpus=1, memory_mb=256),
        network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
        tier="container",
        reuse_snapshot="false",
    )
    out["capabilities"] = env.capabilities.model_dump()
    await env.start(force_build=False)
    try:
        r = await env.exec("pwd; echo $A; id -un", cwd="/tmp", env={"A": "from-env"})
        out["exec"] = [r.return_code, r.stdout]
        r = await env.exec("id -un", user="nobody")
        out["user"] = r.stdout
        r = await env.exec("exit 7")
        out["exit"] = r.return_code
        try:
            await env.exec("sleep 30", timeout_sec=1)
            out["timeout"] = "no error"
        except RuntimeError as e:
            out["timeout"] = str(e)
        local = work / "up"
        (local / "d").mkdir(parents=True)
        (local / "d" / "f.txt").write_text("deep")
        (local / "top.txt").write_text("top")
        await env.upload_dir(local, "/data/in")
        await env.upload_file(local / "top.txt", "/data/single.txt")
        out["uploaded"] = (
            await env.exec("cat /data/in/d/f.txt /data/in/top.txt /data/single.txt")
        ).stdout
        await env.exec(
            "mkdir -p /data/out/sub && echo o1 > /data/out/a && echo o2 > /data/out/sub/b"
        )
        await env.download_dir("/data/out", work / "down")
        await env.download_file("/data/single.txt", work / "single" / "s.txt")
        down = work / "down"
        files = sorted(str(p.relative_to(down)) for p in down.rglob("*") if p.is_file())
        out["downloaded"] = [*files, (work / "single" / "s.txt").read_text()]
        out["is_dir"] = [await env.is_dir("/data/out"), await env.is_dir("/data/out/a")]
        out["is_file"] = [await env.is_file("/data/out/a"), await env.is_file("/nope")]
        r = await env.exec("wget -q -T 2 -O- http://1.1.1.1/ >/dev/null 2>&1; echo $?")
        out["no_network"] = r.stdout
    finally:
        await env.stop(delete=True)
    return out


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
    print("RESULT " + json.dumps(result))
