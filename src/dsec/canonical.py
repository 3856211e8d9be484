"""The canonical digest of a request: how the trajectory log recognises a repeat.

A state-changing call carries a sequence number; a repeat of a recorded number must carry
the same request, which the edge checks by this digest. The SDK computes it too (to tell a
fast-forwarded call from a conflicting one before it sends anything), so it lives here,
apart from the edge, and needs nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["canonical_digest", "json_default"]


def json_default(value: Any) -> Any:
    """JSON form of what ``json`` cannot encode: bytes by their digest and size, sets and
    tuples as lists, pydantic models dumped, dates in ISO 8601."""
    if isinstance(value, bytes | bytearray | memoryview):
        b = bytes(value)
        return {"$sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"cannot record a {type(value).__name__} in the trajectory log")


def canonical_digest(request: Mapping[str, Any]) -> str:
    """sha256 hex of ``request`` as canonical JSON; ``bytes`` values count by their content."""
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), default=json_default)
    return hashlib.sha256(text.encode()).hexdigest()
