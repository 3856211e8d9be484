"""Fixtures of the SDK tests: the real apiserver in front of a :class:`FakeEdge` (modules
with other needs define their own ``edge`` / ``conn``, which take precedence)."""

from __future__ import annotations

from typing import Any

import pytest

from dsec.testing import FakeEdge, app_transport


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def conn(edge: FakeEdge) -> dict[str, Any]:
    """SDK keyword arguments reaching ``edge``: ``transport`` and ``api_key``."""
    transport, key = app_transport(edge)
    return {"transport": transport, "api_key": key}
