"""The Python of a client's venv of its own (``scripts/bootstrap.sh``'s ``side_venv``: clients
whose pins the server's exclude), or a skip saying why there is none."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from tests.timing import budget

ROOT = Path(__file__).resolve().parents[1]


def side_venv_python(venv: str, env: str, module: str) -> Path:
    """``$env`` if set, else ``<repo>/<venv>/bin/python``, checked to import ``module``."""
    given = os.environ.get(env)
    exe = Path(given) if given else ROOT / venv / "bin" / "python"
    if not exe.exists():
        pytest.skip(f"no {venv} at {exe} (scripts/bootstrap.sh makes it)")
    probe = subprocess.run(
        [str(exe), "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=budget(120),
    )
    if probe.returncode != 0:
        pytest.skip(f"{exe} cannot import {module}: {probe.stderr.strip()[-300:]}")
    return exe
