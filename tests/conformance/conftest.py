"""Wiring for the tier-agnostic conformance suite.

Every tier runs the same behaviour checks through the public SDK: every registered tier
(:mod:`dsec.tiers`), with the image its registration names for conformance tests. A new tier
needs no line here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tests.conftest import LiveServer

from dsec import Sandbox
from dsec.tiers import get_tier, tier_names

TIER_IMAGES: dict[str, str] = {
    t: reg.conformance_image for t in tier_names() if (reg := get_tier(t)) is not None
}


@pytest.fixture(params=list(TIER_IMAGES), ids=list(TIER_IMAGES))
def tier(request: pytest.FixtureRequest, sdk_env: LiveServer) -> str:
    t = str(request.param)
    if t not in sdk_env.tiers:
        pytest.skip(f"tier {t} is not enabled on this node")
    caps = {c.tier: c for c in sdk_env.call(sdk_env.edge.capabilities()).tiers}
    if not caps[t].available:
        pytest.skip(f"tier {t} unavailable: {caps[t].reason}")
    return t


@pytest.fixture
def caps(tier: str, sdk_env: LiveServer) -> Any:
    return {c.tier: c for c in sdk_env.call(sdk_env.edge.capabilities()).tiers}[tier]


@pytest.fixture
def make_sandbox(
    tier: str, sdk_env: LiveServer, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Sandbox]]:
    """Factory that creates sandboxes of the tier under test and kills them afterwards."""
    made: list[Sandbox] = []

    def make(**kw: Any) -> Sandbox:
        kw.setdefault("tier", tier)
        kw.setdefault("image", TIER_IMAGES[tier])
        kw.setdefault("memory_mb", 256)
        kw.setdefault("ttl_s", 600)
        sb = Sandbox.create(**kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass


@pytest.fixture
def sandbox(make_sandbox: Callable[..., Sandbox]) -> Sandbox:
    return make_sandbox()
