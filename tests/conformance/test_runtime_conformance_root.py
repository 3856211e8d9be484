"""The runtime conformance suite (runtime_suite.py) on every registered tier, as root: each
tier's runtime made by its registered factory (:mod:`dsec.tiers`) as a node makes it, over a
private ``DSEC_HOME`` whose layers are the session's, its sandboxes on the image its
registration names for conformance tests. A tier this host rules out, or whose runtime says
it is unavailable, is skipped with why; the VM tiers are marked ``vm``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.conformance.runtime_suite import RuntimeConformance, RuntimeHarness, spec_factory
from tests.conftest import _seed_layers

from dsec.config import Paths
from dsec.contract.runtime import capabilities_of
from dsec.layers.mounts import LayerMounts
from dsec.layers.store import LayerStore
from dsec.node import build_runtimes, prepare_host
from dsec.privileged.mount import mount_points
from dsec.tiers import get_tier, require_tier, tier_names

pytestmark = pytest.mark.root


def _tier_params() -> list[object]:
    return [
        pytest.param(
            t, id=t, marks=[pytest.mark.vm, pytest.mark.slow] if reg.traits.guest_kernel else []
        )
        for t in tier_names()
        if (reg := get_tier(t)) is not None
    ]


@pytest.fixture(scope="module", params=_tier_params())
def node(
    request: pytest.FixtureRequest, dsec_home_root: Path, shared_layers: Path
) -> Iterator[tuple[str, Paths, LayerStore, list[str], list[str]]]:
    """One tier's node parts: its home, layer store and conformance image's layers."""
    tier = str(request.param)
    blocked = prepare_host([tier])
    if tier in blocked:
        pytest.skip(f"tier {tier} unavailable on this host: {blocked[tier]}")
    home = Path(dsec_home_root) / f"rc-{tier}"
    _seed_layers(home, shared_layers)
    paths = Paths(home)
    paths.ensure()
    store = LayerStore(paths.layers, paths.scratch)
    image = store.ensure_image_sync(require_tier(tier).conformance_image)
    layer_paths = [str(store.layer_path(d)) for d in image.layers]
    yield tier, paths, store, layer_paths, list(image.layers)
    store.close()
    mounts = LayerMounts(paths.layer_mounts)
    mounts.adopt_existing()  # what the runtimes of the tests left mounted
    mounts.unmount_unused()
    assert not mount_points(home), f"mounts left under {home}"


class TestRegisteredTier(RuntimeConformance):
    @pytest.fixture
    async def harness(
        self, node: tuple[str, Paths, LayerStore, list[str], list[str]]
    ) -> AsyncIterator[RuntimeHarness]:
        tier, paths, store, layer_paths, digests = node
        rt = build_runtimes(paths, store, [tier]).get(tier)
        if rt is None:
            pytest.skip(f"tier {tier} is not built on this node (see the log)")
        await rt.start()
        try:
            caps = capabilities_of(rt)
            if not caps.available:
                pytest.skip(f"tier {tier} unavailable: {caps.reason}")
            yield RuntimeHarness(
                rt, spec_factory(tier, layer_paths, digests), traits=require_tier(tier).traits
            )
        finally:
            await rt.close()
