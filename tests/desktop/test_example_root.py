"""``examples/computer_use_episode.py`` on the container tier: the page changes after the
first click and counts every click of the episode (the button moves each time, so each
step has to find it in a new screenshot)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "computer_use_episode.py"


def test_computer_use_episode(server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("computer_use_episode", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    rc = mod.main(["--steps", "50", "--url", server.url, "--api-key", server.api_key])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "episode PASSED" in out and "the page counted 50 of 50 clicks" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 50
    # the button moved: the clicks were not all at one place
    assert len({line.split("click (")[1].split(")")[0] for line in steps}) > 10
