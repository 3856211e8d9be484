"""``/v1/jobs``: act on every sandbox of a training job at once.

A job is the ``job`` field given at creation (``Sandbox.create(..., job="run-42")``). On
trainer preemption one call pauses the whole job; the edge runs the action on every
sandbox in parallel and reports each one's outcome (one failure never stops the others).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, current_owner
from dsec.apiserver.schemas import JOB_PATTERN
from dsec.models import ListSandboxesRequest, SandboxList

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
    req = ListSandboxesRequest(job=job, include_stopped=include_stopped)
    return await edge.list_sandboxes(req, owner)
