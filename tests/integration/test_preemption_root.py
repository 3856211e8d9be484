"""Preemption end to end on a real node: a trainer SIGKILLed midway restarts, reconnects with
``AsyncSandbox.connect(id, replay=True)``, fast-forwards through the trajectory log and
finishes with the rewards of an uninterrupted run; no command runs twice.

Runs ``examples/preemptible_rollouts.py`` (32 rollouts of 4 steps, busybox, 64 MiB each)
against a ``dsec serve`` in this process (its own DSEC_HOME), trainers as subprocesses.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preemptible_rollouts.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("preemptible_rollouts", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return _load_example()


@pytest.fixture(scope="module")
def server(shared_layers: Path) -> Iterator[BackgroundServer]:
    home = Path(f"/tmp/dsec-rl-api-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)  # cached busybox
    saved = {k: os.environ.get(k) for k in ("DSEC_URL", "DSEC_API_KEY")}
    try:
        with BackgroundServer(home, tiers=["container"]) as srv:  # kills its sandboxes on exit
            os.environ["DSEC_URL"], os.environ["DSEC_API_KEY"] = srv.url, srv.api_key
            yield srv
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


def _assert_preemption_summary(example: ModuleType, summary: dict[str, Any]) -> None:
    assert summary["crash_rc"] == -signal.SIGKILL, "the trainer should have been SIGKILLed"
    # zero commands ran twice: each sandbox's non-idempotent files list every step once,
    # and its trajectory log holds each call exactly once, all committed
    assert summary["check"]["problems"] == [], summary["check"]["problems"][:5]
    assert summary["clean_check"]["problems"] == [], summary["clean_check"]["problems"][:5]
    assert summary["check"]["entries"] == example.ROLLOUTS * example.CALLS_PER_ROLLOUT
    # rewards equal those of the uninterrupted run (and what the policy deserves)
    assert summary["rewards"] == summary["clean_rewards"] == summary["expected_rewards"]
    # the restart really fast-forwarded: the commands of the first half came from the log
    restart = summary["restart"]
    assert restart["restarted"] is True
    done_before_crash = summary["crash_after"] * 2  # two commands per step
    assert restart["replayed"] >= done_before_crash, restart
    assert restart["replayed"] + restart["live"] == example.ROLLOUTS * example.STEPS * 2


def test_preempted_trainer_fast_forwards(
    server: BackgroundServer, example: ModuleType, tmp_path: Path
) -> None:
    summary = asyncio.run(example.demo(tmp_path, pause_job=False, crash_after=64))
    print({k: summary[k] for k in ("clean_s", "preempted_s", "restart")})
    _assert_preemption_summary(example, summary)


def test_preempted_job_is_paused_then_resumed(
    server: BackgroundServer, example: ModuleType, tmp_path: Path
) -> None:
    summary = asyncio.run(example.demo(tmp_path, pause_job=True, crash_after=48))
    print({k: summary[k] for k in ("clean_s", "preempted_s", "restart", "paused_states")})
    assert summary["paused_ok"] == example.ROLLOUTS
    assert summary["paused_states"] == ["paused"]
    _assert_preemption_summary(example, summary)
