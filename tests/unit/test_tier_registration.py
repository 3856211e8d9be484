"""Tiers by registration (:mod:`dsec.tiers`): a new tier is its package plus one registration.

The tier here is this module (its "package": a factory over :class:`~dsec.testing.MemoryRuntime`)
and one :func:`~dsec.tiers.register_tier` call; nothing else in dsec is edited for it. The node
builds its runtime from the registration (:func:`dsec.node.build_runtimes`), the edge lists
it, admits sandboxes on it and refuses a tier no one registered, and the SDK creates, runs
commands in and kills a sandbox of it through the real apiserver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from tests.conformance.runtime_suite import RuntimeConformance, RuntimeHarness, spec_factory

from dsec import AsyncSandbox
from dsec.config import Paths
from dsec.contract.runtime import Runtime, capabilities_of
from dsec.edge.agent import EdgeAgent
from dsec.errors import InvalidRequest
from dsec.models import CreateSandboxRequest, ExecRequest, ExecResult
from dsec.node import build_runtimes
from dsec.testing import (
    FAKE_BUSYBOX,
    FakeEdge,
    MemoryLayers,
    MemoryPortRuntime,
    MemoryRuntime,
    _interpret,
    app_transport,
)
from dsec.tiers import (
    BUILTIN_TIERS,
    TierContext,
    TierRegistration,
    TierTraits,
    get_tier,
    load_factory,
    register_tier,
    require_tier,
    tier_has,
    tier_names,
    unregister_tier,
)

TIER = "scratch"


# --- the new tier's package: a factory ---------------------------------------------------------


async def _answer(sandbox_id: str, req: ExecRequest) -> ExecResult:
    """The scratch tier's commands: the fakes' interpreter (``echo``, ``cat``, ``true``...)."""
    return _interpret(req)


def node_runtime(ctx: TierContext) -> Runtime:
    """The scratch tier's factory (:data:`dsec.tiers.TierFactory`)."""
    return MemoryRuntime(TIER, ctx.layer_store, _answer)


# --- the registration ------------------------------------------------------------------------


@pytest.fixture
def scratch_tier() -> Iterator[TierRegistration]:
    reg = register_tier(
        TierRegistration(
            TIER,
            f"{__name__}:node_runtime",  # imported when a node builds it, as the built-ins are
            TierTraits(guest_kernel=True, ports=False, cgroups=False),
            conformance_image="busybox",
        )
    )
    yield reg
    unregister_tier(TIER)


@pytest.fixture
async def edge(scratch_tier: TierRegistration, tmp_path: Path) -> AsyncIterator[EdgeAgent]:
    """A node with the scratch tier only, built as ``dsec serve`` builds one."""
    paths = Paths(tmp_path / "home")
    paths.ensure()
    layers = MemoryLayers()
    agent = EdgeAgent(paths, build_runtimes(paths, layers, tiers=[TIER]), layers, cpus=8)
    await agent.start()
    yield agent
    await agent.close(kill_sandboxes=True)


async def test_a_registered_tier_runs_sandboxes_through_the_edge(edge: EdgeAgent) -> None:
    assert list(edge.runtimes) == [TIER]
    caps = {c.tier: c for c in (await edge.capabilities()).tiers}
    assert caps[TIER].available and caps[TIER].pause  # its abilities: MemoryRuntime's
    assert not caps["container"].available  # the built-ins are still listed, not on this node

    transport, key = app_transport(edge)
    sb = await AsyncSandbox.create(tier=TIER, image="busybox", api_key=key, transport=transport)
    try:
        assert sb.info.tier == TIER
        result = await sb.commands.run("echo hello from scratch")
        assert result.stdout == "hello from scratch\n" and result.exit_code == 0
    finally:
        await sb.kill()
    runtime = edge.runtimes[TIER]
    assert isinstance(runtime, MemoryRuntime) and sb.id not in runtime.sandboxes  # destroyed


async def test_an_unknown_tier_is_a_clear_400(edge: EdgeAgent) -> None:
    transport, key = app_transport(edge)
    with pytest.raises(InvalidRequest, match=r"unknown tier 'nope'; tiers are .*scratch"):
        await AsyncSandbox.create(tier="nope", api_key=key, transport=transport)


def test_the_registry_lists_builtins_first_and_reads_traits(
    scratch_tier: TierRegistration,
) -> None:
    assert (
        tier_names()[: len(BUILTIN_TIERS)]
        == BUILTIN_TIERS
        == (
            "fncall",
            "container",
            "microvm",
            "vm",
        )
    )
    assert tier_names()[-1] == TIER and get_tier(TIER) is scratch_tier
    assert tier_has(TIER, lambda t: t.guest_kernel) and not tier_has("nope", lambda t: True)
    # the create request reads the traits: full_guest on a tier with a guest kernel
    assert CreateSandboxRequest(tier=TIER, full_guest=True).full_guest
    with pytest.raises(ValueError, match="allow_setuid is for the container tier"):
        CreateSandboxRequest(tier=TIER, allow_setuid=True)
    # a tier this process does not know: left to the server (forward-compatible)
    assert CreateSandboxRequest(tier="newer-tier", full_guest=True).tier == "newer-tier"
    with pytest.raises(InvalidRequest, match="unknown tier 'newer-tier'"):
        require_tier("newer-tier")


def test_the_fake_edge_reads_the_traits(scratch_tier: TierRegistration) -> None:
    edge = FakeEdge(available_tiers=(TIER, "container"))
    assert not capabilities_of(edge.runtimes[TIER]).ports  # its traits say no ports
    assert isinstance(edge.runtimes["container"], MemoryPortRuntime)


def test_build_runtimes_leaves_out_unregistered_names(tmp_path: Path) -> None:
    paths = Paths(tmp_path)
    paths.ensure()
    assert build_runtimes(paths, MemoryLayers(), tiers=["nope"]) == {}


def test_register_tier_checks_the_name() -> None:
    with pytest.raises(ValueError, match="invalid tier name"):
        register_tier(TierRegistration("Bad Name", node_runtime))


class TestScratchTierConformance(RuntimeConformance):
    """The runtime conformance suite on the new tier: a few lines of wiring."""

    @pytest.fixture
    async def harness(
        self, scratch_tier: TierRegistration, tmp_path: Path
    ) -> AsyncIterator[RuntimeHarness]:
        ctx = TierContext(Paths(tmp_path), None, MemoryLayers())
        rt = load_factory(scratch_tier)(ctx)
        await rt.start()
        spec = spec_factory(TIER, [], [FAKE_BUSYBOX])
        yield RuntimeHarness(rt, spec, traits=scratch_tier.traits, real_commands=False)
        await rt.close()


def test_a_package_registers_a_tier_by_entry_point(tmp_path: Path) -> None:
    """A package's ``dsec.tiers`` entry point (a dist-info on the path, as pip installs one):
    read on the first lookup, not by ``import dsec``; the factory's module only when a node
    builds the tier."""
    site = tmp_path / "site"
    info = site / "dsec_plug-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-plug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dsec.tiers]\nplug = dsec_plug:TIER\n")
    (site / "dsec_plug.py").write_text(
        "from dsec.tiers import TierRegistration, TierTraits\n"
        "TIER = TierRegistration('plug', 'dsec_plug_runtime:node_runtime', TierTraits())\n"
    )
    (site / "dsec_plug_runtime.py").write_text(
        "from dsec.testing import MemoryRuntime\n"
        "async def _answer(sid, req): ...\n"
        "def node_runtime(ctx):\n"
        "    return MemoryRuntime('plug', ctx.layer_store, _answer)\n"
    )
    child = f"""
import sys
import dsec
assert "dsec_plug" not in sys.modules, "import dsec read the entry points"
from dsec.tiers import tier_names
assert tier_names()[-1] == "plug", tier_names()
assert "dsec_plug_runtime" not in sys.modules, "the factory was imported before use"
from pathlib import Path
from dsec.config import Paths
from dsec.node import build_runtimes
from dsec.testing import MemoryLayers
paths = Paths(Path({str(tmp_path / "home")!r}))
paths.ensure()
print(sorted(build_runtimes(paths, MemoryLayers(), ["plug"])))
"""
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": f"{site}:{src}"}
    out = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['plug']"
