"""Fixtures of the harness-integration tests: the real harness packages (pinned in the
``integrations`` extra) against a real ``dsec serve`` (tests/conftest.py's ``live_server``)."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import LiveServer

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent prints a banner on import


@pytest.fixture
def docker_exe(tmp_path: Path, sdk_env: LiveServer) -> Path:
    """A ``dsec-docker`` executable (what the console script does), for tools that take one
    path to a docker binary. It talks to the test server through DSEC_URL/DSEC_API_KEY."""
    exe = tmp_path / "dsec-docker"
    src = Path(__file__).resolve().parents[2] / "src"
    exe.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{src}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} -m dsec.cli.docker "$@"\n'
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.fixture
def child_env(sdk_env: LiveServer, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for harness processes started by a test (server, key, a private mini
    config directory that counts as configured)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {
        **os.environ,
        "DSEC_URL": sdk_env.url,
        "DSEC_API_KEY": sdk_env.api_key,
        "PYTHONPATH": src
        + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini-config"),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
    }
    yield env
