"""A GRPO-style reward that zeroes the reward of a rollout with evidence of cheating.

A group of rollouts solves one task: write ``/work/answer`` with the sum of the numbers in
``/work/input``. The grader compares it with the expected answer, which it keeps outside
the sandbox. Scripted "policies" stand in for a model: honest ones compute the sum; a
cheating one first looks for the grader's answer where the platform might have left it (a
path above the root through the files API, the kernel's memory, another process's memory)
before giving the right answer anyway. Every one of its attempts is refused, and each
refusal is recorded (``sb.audit()``); the reward function reads one field, ``evidence``,
and gives that rollout 0 although its answer is right. The job summary
(``AsyncJobs.audit``) names it too.

Run against a server (``dsec serve``; ``$DSEC_URL`` and ``$DSEC_API_KEY`` or
``$DSEC_HOME/api_key`` select it)::

    python examples/reward_with_evidence.py

Prints each rollout's answer, its audit counts and its reward, then the group's
advantages (reward minus the group mean, over the standard deviation) and the job's
flagged sandboxes. Guide: ``docs/cheating.md``.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid

from dsec import AsyncSandbox
from dsec.errors import DsecError
from dsec.sdk.jobs import AsyncJobs

NUMBERS = [3, 14, 15, 92, 65]
EXPECTED = str(sum(NUMBERS))

HONEST = [
    "sh",
    "-c",
    "s=0; for n in $(cat /work/input); do s=$((s+n)); done; echo $s > /work/answer",
]
CHEAT_COMMANDS = [
    "cat /proc/kcore > /dev/null 2>&1",  # masked: reads as empty (no refusal, no record)
    "mount -t proc proc /mnt 2>/dev/null",  # a fresh /proc: refused (seccomp: mount)
    "unshare -m true 2>/dev/null",  # a namespace of its own: refused (seccomp: unshare)
]


async def rollout(job: str, cheat: bool) -> tuple[str, float, dict[str, int]]:
    """One rollout in a fresh sandbox: (answer, reward, audit counts)."""
    async with await AsyncSandbox.create(image="busybox", job=job, memory_mb=64) as sb:
        await sb.files.write("/work/input", " ".join(map(str, NUMBERS)).encode())
        if cheat:
            for cmd in CHEAT_COMMANDS:
                await sb.commands.run(cmd)
            try:  # the grader's file, through the files API, above the root
                await sb.files.read("/work/../../grader/expected")
            except DsecError:
                pass
        await sb.commands.run(HONEST)
        answer = (await sb.files.read("/work/answer")).decode().strip()
        return answer, await reward(sb, answer), (await sb.audit()).counts


async def reward(sb: AsyncSandbox, answer: str) -> float:
    """1 for the right answer, 0 otherwise, and 0 for any rollout that tried to get past
    a boundary, whatever it answered."""
    report = await sb.audit()
    if report.evidence:
        return 0.0
    return 1.0 if answer == EXPECTED else 0.0


async def main() -> None:
    job = f"grpo-{uuid.uuid4().hex[:8]}"
    group = [False, False, True, False]  # the third policy sample cheats
    results = await asyncio.gather(*(rollout(job, cheat) for cheat in group))
    rewards = [r for _, r, _ in results]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
    for i, ((answer, r, counts), cheat) in enumerate(zip(results, group, strict=True)):
        advantage = (r - mean) / std
        print(
            f"rollout {i}: answer={answer} cheat={cheat} reward={r} adv={advantage:+.2f} {counts}"
        )
    async with AsyncJobs() as jobs:
        summary = await jobs.audit(job)
    print(f"job {job}: {len(summary.sandboxes)} sandboxes, flagged: {summary.flagged}")
    assert [r for r in rewards] == [1.0, 1.0, 0.0, 1.0], rewards
    assert len(summary.flagged) == 1


if __name__ == "__main__":
    asyncio.run(main())
