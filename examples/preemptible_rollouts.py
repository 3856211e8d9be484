"""Preemptible RL rollouts: a trainer that is SIGKILLed midway, restarts and fast-forwards.

DRAFT against the SDK surface proposed in docs/design/rl.md (sequence numbers set by the SDK,
``AsyncSandbox.connect`` restarting its sequence at 1, ``dsec.jobs``, ``sb.trajectory()``).

A trainer runs 32 multi-step rollouts. Each step of the scripted policy edits a file, runs
the tests and reads the result; one command per step also appends to ``/work/ran.log``,
which is *not* idempotent, so a step that ran twice would show up there. The trainer
checkpoints only its sandbox ids (``--state``). Run::

    python examples/preemptible_rollouts.py demo           # uninterrupted vs preempted run
    python examples/preemptible_rollouts.py demo --pause   # preemption pauses the whole job

``demo`` runs the trainer once without interruption, then again with ``--crash-after 40``
(it SIGKILLs itself after 40 steps), restarts it with the same ``--state`` so it reconnects
to its sandboxes with ``Sandbox.connect`` and replays its steps from the start: the edge
answers every step it already ran from the trajectory log, without running anything, and
runs only the new ones. It then checks that every ``ran.log`` has exactly one line per step
(zero commands ran twice) and that the rewards equal those of the uninterrupted run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import dsec
from dsec import AsyncSandbox

ROLLOUTS = 32
STEPS = 4
JOB = "preemptible-demo"

TEST_SCRIPT = """#!/bin/sh
# the "environment": count solved tasks in /work/solution.txt
solved=$(grep -c '^ok' /work/solution.txt 2>/dev/null || echo 0)
echo "passed=$solved"
"""


def policy(rollout: int, step: int) -> str:
    """A scripted policy: deterministic per (rollout, step), sometimes wrong."""
    return "ok" if (rollout * 7 + step * 3) % 5 else "bad"


async def rollout(
    sb: AsyncSandbox, rollout_id: int, counter: list[int], crash_after: int | None
) -> float:
    """Run (or fast-forward through) one rollout; returns its reward."""
    await sb.files.write("/work/run_tests.sh", TEST_SCRIPT, mode=0o755)
    passed = 0
    for step in range(STEPS):
        action = policy(rollout_id, step)
        # edit a file (state-changing, sequenced)
        await sb.commands.run(f"echo {action} >> /work/solution.txt")
        # run the tests and read the result; also append to a non-idempotent log
        res = await sb.commands.run(f"echo step{step} >> /work/ran.log && /work/run_tests.sh")
        passed = int(res.stdout.strip().split("=")[1])
        counter[0] += 1
        if crash_after is not None and counter[0] >= crash_after:
            os.kill(os.getpid(), signal.SIGKILL)  # preempted, no cleanup at all
    return passed / STEPS


def load_json(path: Path, default: dict[str, object] | None = None) -> dict[str, object]:
    """A small JSON checkpoint (sync on purpose: tiny files)."""
    return json.loads(path.read_text()) if path.exists() else dict(default or {})


def save_json(path: Path, obj: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


async def trainer(state: Path, crash_after: int | None) -> dict[str, float]:
    ids = {k: str(v) for k, v in load_json(state).items()}
    sandboxes: dict[int, AsyncSandbox] = {}
    for r in range(ROLLOUTS):
        if str(r) in ids:
            # fast-forward: the SDK numbers this object's calls from 1 again, so every step
            # already logged on the edge is answered from the log without running
            sandboxes[r] = await AsyncSandbox.connect(ids[str(r)])
        else:
            sb = await AsyncSandbox.create(image="busybox", job=JOB, ttl_s=600)
            await sb.files.make_dir("/work")
            sandboxes[r] = sb
            ids[str(r)] = sb.id
            save_json(state, dict(ids))  # checkpoint: only the ids
    counter = [0]
    rewards = await asyncio.gather(
        *(rollout(sandboxes[r], r, counter, crash_after) for r in range(ROLLOUTS))
    )
    return {str(r): rew for r, rew in enumerate(rewards)}


async def verify_and_clean(state: Path) -> list[int]:
    ids = load_json(state)
    lines = []
    for sid in ids.values():
        async with await AsyncSandbox.connect(str(sid)) as sb:
            ran = (await sb.files.read_text("/work/ran.log")).splitlines()
            lines.append(len(ran))
            log = await sb.trajectory()  # JSONL: request, result, timings, digests
            assert all(json.loads(x)["status"] != "unknown" for x in log[1:])
            await sb.kill()
    return lines


def run_trainer(state: Path, crash_after: int | None, out: Path) -> int:
    argv = [sys.executable, __file__, "train", "--state", str(state), "--out", str(out)]
    if crash_after is not None:
        argv += ["--crash-after", str(crash_after)]
    return subprocess.run(argv, check=False).returncode


async def demo(pause_job: bool, workdir: Path) -> None:
    clean_state, pre_state = workdir / "clean.json", workdir / "pre.json"
    for p in (clean_state, pre_state):
        save_json(p, {})
    assert run_trainer(clean_state, None, workdir / "clean-rewards.json") == 0
    rc = run_trainer(pre_state, 40, workdir / "unused.json")
    assert rc == -signal.SIGKILL, f"trainer should have been killed, rc={rc}"
    if pause_job:  # what a scheduler does on preemption: free the node while we wait
        outcomes = await dsec.jobs.pause(JOB)
        assert all(o["ok"] for o in outcomes.values()), outcomes
        await dsec.jobs.resume(JOB)  # (any request would also resume transparently)
    assert run_trainer(pre_state, None, workdir / "pre-rewards.json") == 0
    clean = load_json(workdir / "clean-rewards.json")
    pre = load_json(workdir / "pre-rewards.json")
    assert clean == pre, "rewards differ after preemption"
    counts = await verify_and_clean(pre_state)
    assert all(c == STEPS for c in counts), f"some command ran twice (or not at all): {counts}"
    await verify_and_clean(clean_state)
    print(f"ok: {ROLLOUTS} rollouts, rewards equal, every step ran exactly once")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--state", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--crash-after", type=int, default=None)
    d = sub.add_parser("demo")
    d.add_argument("--pause", action="store_true", help="pause the whole job on preemption")
    d.add_argument("--workdir", type=Path, default=Path("/tmp/dsec-preemptible-demo"))
    args = ap.parse_args()
    if args.cmd == "train":
        rewards = asyncio.run(trainer(args.state, args.crash_after))
        args.out.write_text(json.dumps(rewards))
    else:
        asyncio.run(demo(args.pause, args.workdir))


if __name__ == "__main__":
    main()
