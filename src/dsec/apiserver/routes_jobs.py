"""``/v1/jobs``: act on every sandbox of a training job at once.

A job is the ``job`` field given at creation (``Sandbox.create(..., job="run-42")``). On
trainer preemption one call pauses the whole job; the edge runs the action on every
sandbox in parallel and reports each one's outcome (one failure never stops the others).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, current_owner
from dsec.apiserver.schemas import JOB_PATTERN, SandboxList
from dsec.models import JobAction, JobActionResult

__all__ = ["router"]

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

JobParam = Annotated[str, Path(pattern=JOB_PATTERN, description="the job id given at creation")]


@router.get("/{job}", response_model=SandboxList, summary="List a job's sandboxes")
async def list_job(
    job: JobParam, edge: Edge, owner: Owner, include_stopped: bool = False
) -> SandboxList:
    sandboxes = await edge.list_sandboxes(owner, job=job, include_stopped=include_stopped)
    return SandboxList(sandboxes=sandboxes)


@router.post(
    "/{job}/{action}",
    response_model=JobActionResult,
    summary="Pause, resume or kill every sandbox of a job",
    description="Runs in parallel on the edge. The answer maps each sandbox id to its "
    "outcome (``ok``, ``state``, wire ``error``); it is 200 even when some failed. A job "
    "without sandboxes answers with empty ``outcomes``.",
)
async def job_action(
    job: JobParam,
    action: Annotated[JobAction, Path(description="pause | resume | kill")],
    edge: Edge,
    owner: Owner,
) -> JobActionResult:
    return await edge.job_action(owner, job, action)
