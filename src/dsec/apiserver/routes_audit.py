"""The refusals made on a sandbox's behalf, its evidence of cheating (:mod:`dsec.edge.audit`).

``GET /v1/sandboxes/{id}/audit``: exact counts by ``category.kind`` and the kept entries
(time, process, what was refused); ``?follow=true`` streams entries as NDJSON until the
sandbox stops. ``GET /v1/jobs/{job}/audit``: the summary of every sandbox of a job. Another
key's sandbox is ``not_found``, as everywhere.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, current_owner
from dsec.apiserver.routes_sandboxes import ndjson_of, ndjson_response
from dsec.apiserver.schemas import JOB_PATTERN, SANDBOX_ID_PATTERN
from dsec.contract.edge import SandboxAudits
from dsec.errors import CapabilityNotSupported
from dsec.models import AuditEntry, AuditReport, SandboxRef

__all__ = ["router"]

router = APIRouter(
    prefix="/v1",
    tags=["audit"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

SandboxIdParam = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>")]
JobParam = Annotated[str, Path(pattern=JOB_PATTERN, description="the job id given at creation")]
AfterQuery = Annotated[
    int, Query(ge=0, le=2**53, description="only entries numbered above this one")
]


@router.get(
    "/sandboxes/{sandbox_id}/audit",
    response_model=AuditReport,
    summary="The refusals made on the sandbox's behalf (evidence of cheating)",
    description="Exact counts by ``category.kind`` (syscall, files, network, dns, guard, "
    "limits), ``evidence`` (any refusal of a boundary), and the kept entries: the first "
    "half of the node's cap, then the newest (``dropped`` says how many were not kept). "
    "Answers for a stopped sandbox while the node remembers it; never resumes a paused "
    "one. ``follow=true``: NDJSON, one AuditEntry per line as they are recorded, until the "
    "sandbox stops.",
    responses={
        200: {
            "description": "AuditReport; with follow=true NDJSON AuditEntry lines",
            "content": {"application/x-ndjson": ndjson_of(AuditEntry)},
        }
    },
)
async def sandbox_audit(
    sandbox_id: SandboxIdParam,
    edge: Edge,
    owner: Owner,
    after: AfterQuery = 0,
    follow: Annotated[bool, Query(description="stream entries as they come")] = False,
) -> Any:
    if not isinstance(edge, SandboxAudits):
        await edge.get_sandbox(
            SandboxRef(sandbox_id=sandbox_id), owner
        )  # another key's: not found, as everywhere
        raise CapabilityNotSupported("this server's edge records no audit")
    if not follow:
        return await edge.sandbox_audit(sandbox_id, owner, after)
    await edge.get_sandbox(
        SandboxRef(sandbox_id=sandbox_id), owner
    )  # refusals before the first byte
    return ndjson_response(edge.follow_audit(sandbox_id, owner, after))
