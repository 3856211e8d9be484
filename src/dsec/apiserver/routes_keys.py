"""``/v1/key``: the calling key, its quota and what it holds (``dsec info``, the dashboard).

Only the caller's own key is ever shown; quotas are set by the operator on the node
(``dsec key create/set``), never through the API.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner
from dsec.contract.edge import KeyAccounting, KeyQuotas
from dsec.edge.quotas import UNLIMITED
from dsec.models import KeyInfo, KeyUsage

__all__ = ["router"]

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/key", response_model=KeyInfo, tags=["node"], summary="This key: quota and usage")
async def key_info(request: Request, edge: Edge, owner: Owner) -> KeyInfo:
    """The calling key's owner id, role, quota (:class:`~dsec.models.KeyQuota`: what the
    operator lets it hold; None: no limit but the node's) and usage (its live sandboxes
    and what they requested)."""
    keys = request.app.state.keys
    quota = keys.quota_of(owner) if isinstance(keys, KeyQuotas) else UNLIMITED
    usage = await edge.key_usage(owner) if isinstance(edge, KeyAccounting) else KeyUsage()
    role = "operator" if keys.is_operator(owner) else "user"
    return KeyInfo(owner=owner, role=role, quota=quota, usage=usage)
