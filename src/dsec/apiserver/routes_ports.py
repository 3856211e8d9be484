"""``GET /v1/sandboxes/{sandbox_id}/ports``: how to reach a sandbox's ports (its access
token, the host-route domain). The proxying itself is :mod:`dsec.apiserver.ports`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, current_owner
from dsec.apiserver.schemas import SANDBOX_ID_PATTERN
from dsec.errors import SandboxStopped
from dsec.models import PortAccess, SandboxRef

__all__ = ["router"]

router = APIRouter(
    prefix="/v1/sandboxes/{sandbox_id}",
    tags=["ports"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

SandboxIdParam = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>")]


@router.get(
    "/ports",
    response_model=PortAccess,
    summary="The access token and addresses of the sandbox's ports (port proxy)",
)
async def port_access(
    sandbox_id: SandboxIdParam, request: Request, edge: Edge, owner: Owner
) -> PortAccess:
    info = await edge.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)
    if info.state == "stopped":
        raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
    proxy = request.app.state.ports
    return PortAccess(
        sandbox_id=sandbox_id,
        token=proxy.tokens.issue(sandbox_id, owner),
        public=info.public_ports,
        domain=proxy.domain,
        scheme=proxy.host_scheme,
    )
