"""The unmodified ``e2b`` SDK on every tier of a real ``dsec serve``.

The container tier has its full suite in ``test_e2b_real_root.py``; here each other tier
(fncall, microvm, vm) runs the core of the E2B surface through template ``<tier>/<image>``:
create with metadata and envs, info, list by metadata, foreground commands with streaming
callbacks, envs, cwd and timeouts, the filesystem calls, and kill. What a tier cannot do
(a PTY, stdin after start) is covered by the capability table in docs/e2b.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import _seed_layers

from dsec.contract.runtime import capabilities_of
from e2b import CommandExitException, FileType, Sandbox, SandboxQuery

pytestmark = [pytest.mark.root, pytest.mark.slow]

TIER_TEMPLATES = {"fncall": "fncall/debian", "microvm": "microvm/busybox", "vm": "vm/busybox"}


@pytest.fixture(scope="module")
def server(dsec_home_root: Path, shared_layers: Path) -> Iterator[Any]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from dsec.server import BackgroundServer

    home = dsec_home_root / "e2b-tiers"
    _seed_layers(home, shared_layers)
    with BackgroundServer(home, tiers=list(TIER_TEMPLATES)) as bg:
        env = {
            "E2B_API_URL": f"{bg.url}/e2b",
            "E2B_SANDBOX_URL": f"{bg.url}/e2b/envd",
            "E2B_API_KEY": bg.api_key,
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield bg
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.mark.parametrize("tier", list(TIER_TEMPLATES))
def test_core_e2b_surface_on_tier(server: Any, tier: str) -> None:
    assert server.edge is not None
    if (
        tier not in server.edge.runtimes
        or not capabilities_of(server.edge.runtimes[tier]).available
    ):
        pytest.skip(f"tier {tier} is not available on this node")
    sbx = Sandbox.create(
        template=TIER_TEMPLATES[tier],
        metadata={"suite": "e2b-tiers", "tier": tier},
        envs={"GREETING": "hello"},
        timeout=300,
    )
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id and info.metadata["tier"] == tier
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-tiers", "tier": tier}))
        assert sbx.sandbox_id in {s.sandbox_id for s in listed.next_items()}

        out: list[str] = []
        r = sbx.commands.run("echo $GREETING; echo oops >&2", on_stdout=out.append)
        assert r.exit_code == 0 and r.stdout == "hello\n" and r.stderr == "oops\n"
        assert "".join(out) == "hello\n"
        r = sbx.commands.run("pwd", cwd="/tmp", envs={"X": "1"})
        assert r.stdout.strip() == "/tmp"
        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("exit 3")
        assert ei.value.exit_code == 3

        sbx.files.make_dir("/tmp/e2b-dir")
        sbx.files.write("/tmp/e2b-dir/a.txt", "alpha")
        assert sbx.files.read("/tmp/e2b-dir/a.txt") == "alpha"
        assert sbx.files.exists("/tmp/e2b-dir/a.txt")
        entries = sbx.files.list("/tmp/e2b-dir")
        assert [(e.name, e.type) for e in entries] == [("a.txt", FileType.FILE)]
        sbx.files.rename("/tmp/e2b-dir/a.txt", "/tmp/e2b-dir/b.txt")
        assert sbx.files.get_info("/tmp/e2b-dir/b.txt").size == 5
        sbx.files.remove("/tmp/e2b-dir/b.txt")
        assert not sbx.files.exists("/tmp/e2b-dir/b.txt")

        sleeper = sbx.commands.run("sleep 60", background=True)
        assert sleeper.pid in {p.pid for p in sbx.commands.list()}
        assert sbx.commands.kill(sleeper.pid) is True

        caps = capabilities_of(server.edge.runtimes[tier])
        if caps.pause:  # pause, then any request resumes it (E2B's auto-resume)
            assert sbx.pause() is True
            assert sbx.get_info().state.value == "paused"
            again = Sandbox.connect(sbx.sandbox_id)
            assert again.commands.run("echo back").stdout == "back\n"
    finally:
        sbx.kill()
