"""Preemptible RL rollouts: a trainer is SIGKILLed midway, restarts and fast-forwards.

A trainer runs 32 multi-step rollouts, one sandbox each. A scripted policy edits files,
runs the tests and reads the result; the reward is the fraction of tests passing at the
end. Two of its commands per step are *not* idempotent (they append to files), so a step
that ran twice would change the reward and show up twice in ``/work/ran.log``.

The trainer checkpoints only its sandbox ids. When it is killed and restarted it
reconnects with ``AsyncSandbox.connect(id, replay=True)`` and simply runs its rollouts again
from the start: every call carries a per-sandbox sequence number, so the edge answers the
calls it already ran from its trajectory log (nothing runs again; ``result.replayed``) and
runs only the new ones. A call that was still running when the trainer died is waited for,
not repeated.

Run against a server (``dsec serve``; ``$DSEC_URL`` and ``$DSEC_API_KEY`` or
``$DSEC_HOME/api_key`` select it)::

    python examples/preemptible_rollouts.py demo            # clean vs preempted run
    python examples/preemptible_rollouts.py demo --pause    # the scheduler pauses the job

``demo`` runs the trainer once without interruption, then again with ``--crash-after``
(it SIGKILLs itself after half the steps), restarts it, and checks that every ``ran.log``
lists each step exactly once, that each sandbox's trajectory log holds every call exactly
once, and that the rewards equal those of the uninterrupted run. With ``--pause`` the
preempted job is paused (``dsec.jobs``) while no trainer runs, and the restarted trainer
resumes it first. ``tests/integration/test_preemption_root.py`` runs both variants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec import AsyncClient, AsyncSandbox
from dsec.sdk.jobs import AsyncJobs

ROLLOUTS = 32
"""Rollouts (and sandboxes) per training run."""

STEPS = 4
"""Policy steps per rollout."""

CALLS_PER_ROLLOUT = 2 + 3 * STEPS
"""State-changing calls per rollout: mkdir + test script, then per step one file write and
two commands. Each one is one trajectory entry on the edge."""

TEST_SCRIPT = """#!/bin/sh
# the "environment": a task is solved by each line "ok" in /work/solution.txt
solved=$(grep -c '^ok$' /work/solution.txt 2>/dev/null)
echo "passed=${solved:-0}"
"""


def policy(rollout: int, step: int) -> str:
    """The scripted policy: deterministic per (rollout, step), sometimes wrong."""
    return "ok" if (rollout * 7 + step * 3) % 5 else "bad"


def expected_reward(rollout: int) -> float:
    """What an honest run scores: the share of steps whose action was right."""
    return sum(policy(rollout, s) == "ok" for s in range(STEPS)) / STEPS


@dataclass
class Progress:
    """Steps done by this trainer process, and how many commands the edge replayed."""

    crash_after: int | None = None
    steps: int = 0
    replayed: int = 0
    live: int = 0
    log: list[str] = field(default_factory=list)

    def step_done(self) -> None:
        self.steps += 1
        if self.crash_after is not None and self.steps >= self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)  # preempted: no cleanup at all


async def rollout(sb: AsyncSandbox, rollout_id: int, progress: Progress) -> float:
    """Run one rollout (or fast-forward through what already ran). Returns its reward.

    After a restart this is called again from the top: the calls must be the same, in the
    same order, as in the first attempt (they are: the policy is deterministic).
    """
    await sb.files.make_dir("/work")
    await sb.files.write("/work/run_tests.sh", TEST_SCRIPT, mode=0o755)
    passed = 0
    for step in range(STEPS):
        action = policy(rollout_id, step)
        await sb.files.write(f"/work/edit{step}.txt", action + "\n")  # edit a file
        edit = await sb.commands.run(f"cat /work/edit{step}.txt >> /work/solution.txt")
        test = await sb.commands.run(f"echo step{step} >> /work/ran.log && /work/run_tests.sh")
        for result in (edit, test):
            if result.replayed:
                progress.replayed += 1
            else:
                progress.live += 1
        if not test.ok:
            raise RuntimeError(f"rollout {rollout_id} step {step}: {test.stderr.strip()}")
        passed = int(test.stdout.strip().split("=")[1])
        progress.step_done()
    return passed / STEPS


def load_json(path: Path) -> dict[str, Any]:
    """A small JSON checkpoint ({} if missing)."""
    return dict(json.loads(path.read_text())) if path.exists() else {}


def save_json(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` atomically (a kill mid-write leaves the old file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


async def trainer(state: Path, job: str, crash_after: int | None) -> dict[str, Any]:
    """One trainer process: create (or reconnect to) the sandboxes, run every rollout."""
    progress = Progress(crash_after=crash_after)
    ids: dict[str, str] = {k: str(v) for k, v in load_json(state).items()}
    restarted = bool(ids)
    async with AsyncClient() as client:
        if restarted:
            # the scheduler may have paused the job while we were gone: resume it (any
            # request would also resume a sandbox transparently)
            resumed = await AsyncJobs(client).resume(job)
            failed = {sid: o.error for sid, o in resumed.outcomes.items() if not o.ok}
            if failed:
                raise RuntimeError(f"could not resume job {job}: {failed}")
            sandboxes = {
                int(r): await AsyncSandbox.connect(sid, replay=True, client=client)
                for r, sid in ids.items()
            }
        else:
            gate = asyncio.Semaphore(8)

            async def create(r: int) -> AsyncSandbox:
                async with gate:
                    return await AsyncSandbox.create(
                        image="busybox", memory_mb=64, cpu=0.25, job=job, ttl_s=900, client=client
                    )

            made = await asyncio.gather(*(create(r) for r in range(ROLLOUTS)))
            sandboxes = dict(enumerate(made))
            save_json(state, {str(r): sb.id for r, sb in sandboxes.items()})  # the checkpoint
        t0 = time.monotonic()
        rewards = await asyncio.gather(
            *(rollout(sandboxes[r], r, progress) for r in range(ROLLOUTS))
        )
    return {
        "rewards": {str(r): rew for r, rew in enumerate(rewards)},
        "restarted": restarted,
        "replayed": progress.replayed,
        "live": progress.live,
        "rollout_s": round(time.monotonic() - t0, 3),
    }


async def check_sandboxes(ids: dict[str, str]) -> dict[str, Any]:
    """Read each sandbox's ``ran.log``, ``solution.txt`` and trajectory log; kill it."""
    problems: list[str] = []
    entries = 0
    async with AsyncClient() as client:
        for r, sid in sorted(ids.items(), key=lambda kv: int(kv[0])):
            sb = await AsyncSandbox.connect(sid, client=client)
            ran = (await sb.files.read_text("/work/ran.log")).splitlines()
            if ran != [f"step{s}" for s in range(STEPS)]:
                problems.append(f"rollout {r}: ran.log is {ran}")
            solution = (await sb.files.read_text("/work/solution.txt")).splitlines()
            if solution != [policy(int(r), s) for s in range(STEPS)]:
                problems.append(f"rollout {r}: solution.txt is {solution}")
            log = [json.loads(line) for line in (await sb.trajectory()).splitlines()[1:]]
            entries += len(log)
            seqs = [e["seq"] for e in log]
            if seqs != list(range(1, CALLS_PER_ROLLOUT + 1)):
                problems.append(f"rollout {r}: trajectory seqs {seqs}")
            if any(e["status"] != "ok" for e in log):
                problems.append(f"rollout {r}: not every entry ok: {[e['status'] for e in log]}")
            commands = [e["request"]["cmd"] for e in log if e["op"] == "exec"]
            if len(commands) != len(set(commands)) or len(commands) != 2 * STEPS:
                problems.append(f"rollout {r}: commands in the log {commands}")
            await sb.kill()
    return {"problems": problems, "entries": entries}


def run_trainer(state: Path, job: str, out: Path, crash_after: int | None = None) -> int:
    """Run one trainer process; returns its exit status (-9 when it was SIGKILLed)."""
    argv = [sys.executable, __file__, "train", "--state", str(state), "--job", job]
    argv += ["--out", str(out)]
    if crash_after is not None:
        argv += ["--crash-after", str(crash_after)]
    return subprocess.run(argv, check=False).returncode


async def demo(workdir: Path, pause_job: bool, crash_after: int) -> dict[str, Any]:
    """An uninterrupted run and a preempted one; returns what the checks found."""
    tag = f"{os.getpid()}-{int(time.time())}"
    clean_job, pre_job = f"rollouts-clean-{tag}", f"rollouts-pre-{tag}"
    clean_state, pre_state = workdir / "clean-state.json", workdir / "pre-state.json"
    for p in (clean_state, pre_state):
        p.unlink(missing_ok=True)
    summary: dict[str, Any] = {"pause_job": pause_job, "crash_after": crash_after}

    t0 = time.monotonic()
    rc = run_trainer(clean_state, clean_job, workdir / "clean.json")
    if rc != 0:
        raise RuntimeError(f"the uninterrupted trainer failed (exit {rc})")
    summary["clean_s"] = round(time.monotonic() - t0, 2)
    summary["clean_check"] = await check_sandboxes(load_json(clean_state))  # and kill them

    t0 = time.monotonic()
    summary["crash_rc"] = run_trainer(pre_state, pre_job, workdir / "unused.json", crash_after)
    if pause_job:  # what a scheduler does on preemption: free the node's memory meanwhile
        async with AsyncJobs() as jobs_api:
            paused = await jobs_api.pause(pre_job)
            summary["paused_ok"] = sum(o.ok for o in paused.outcomes.values())
            summary["paused_states"] = sorted({s.state for s in await jobs_api.list(pre_job)})
    rc = run_trainer(pre_state, pre_job, workdir / "pre.json")
    if rc != 0:
        raise RuntimeError(f"the restarted trainer failed (exit {rc})")
    summary["preempted_s"] = round(time.monotonic() - t0, 2)

    clean, pre = load_json(workdir / "clean.json"), load_json(workdir / "pre.json")
    summary["clean_rewards"] = clean["rewards"]
    summary["rewards"] = pre["rewards"]
    summary["restart"] = {k: pre[k] for k in ("restarted", "replayed", "live", "rollout_s")}
    summary["expected_rewards"] = {str(r): expected_reward(r) for r in range(ROLLOUTS)}
    summary["check"] = await check_sandboxes(load_json(pre_state))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="one trainer process")
    t.add_argument("--state", type=Path, required=True, help="checkpoint: the sandbox ids")
    t.add_argument("--job", required=True, help="job id of the run's sandboxes")
    t.add_argument("--out", type=Path, required=True, help="where the rewards go (JSON)")
    t.add_argument("--crash-after", type=int, default=None, help="SIGKILL after N steps")
    d = sub.add_parser("demo", help="uninterrupted vs preempted run, with checks")
    d.add_argument("--pause", action="store_true", help="pause the whole job on preemption")
    d.add_argument("--workdir", type=Path, default=Path("/tmp/dsec-preemptible-demo"))
    d.add_argument("--crash-after", type=int, default=ROLLOUTS * STEPS // 2)
    args = ap.parse_args()
    if args.cmd == "train":
        save_json(args.out, asyncio.run(trainer(args.state, args.job, args.crash_after)))
        return
    summary = asyncio.run(demo(args.workdir, args.pause, args.crash_after))
    print(json.dumps(summary, indent=2, sort_keys=True))
    ok = (
        summary["crash_rc"] == -signal.SIGKILL
        and summary["rewards"] == summary["clean_rewards"] == summary["expected_rewards"]
        and not summary["check"]["problems"]
        and not summary["clean_check"]["problems"]
    )
    print("ok: rewards equal, every step ran exactly once" if ok else "FAILED", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
