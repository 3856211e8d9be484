"""``full_guest``: the opt-in of VM-tier sandboxes to the whole guest. Refused (a typed 400)
on every other tier, carried to the edge on the VM tiers; the guest's guard policy is the
container tier's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError

from dsec import AsyncSandbox
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.contract.isolation import CAPABILITIES, MASKED_PATHS, READONLY_PATHS, RULES
from dsec.errors import InvalidRequest
from dsec.guest.guard import guard_policy_text, seccomp_bpf
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge

KEY = "dsec_full_guest_test"


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge(available_tiers=("container", "fncall", "microvm", "vm"))


@pytest.fixture
async def client(edge: FakeEdge) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(edge, StaticKeys([KEY]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://dsec", headers={"authorization": f"Bearer {KEY}"}
    ) as c:
        yield c


def test_model_refuses_full_guest_outside_the_vm_tiers() -> None:
    assert CreateSandboxRequest().full_guest is False
    for tier in ("microvm", "vm"):
        assert CreateSandboxRequest(tier=tier, full_guest=True).full_guest is True
    for tier in ("container", "fncall"):
        with pytest.raises(ValidationError, match="full_guest is for the microvm and vm"):
            CreateSandboxRequest(tier=tier, full_guest=True)
        assert CreateSandboxRequest(tier=tier, full_guest=False).full_guest is False


async def test_api_refuses_with_400_and_carries_it_on_vm_tiers(
    client: httpx.AsyncClient, edge: FakeEdge
) -> None:
    r = await client.post("/v1/sandboxes", json={"tier": "container", "full_guest": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert "full_guest" in r.json()["error"]["message"]
    assert edge.calls_to("create_sandbox") == []
    r = await client.post("/v1/sandboxes", json={"tier": "microvm", "full_guest": True})
    assert r.status_code == 201, r.text
    assert edge.calls_to("create_sandbox")[0]["req"].full_guest is True


async def test_sdk_refuses_before_sending(client: httpx.AsyncClient, edge: FakeEdge) -> None:
    with pytest.raises(InvalidRequest, match="full_guest"):
        await AsyncSandbox.create(tier="container", full_guest=True, url="http://dsec", api_key=KEY)
    assert edge.calls == []


def test_guard_policy_is_the_container_tiers() -> None:
    lines = set(guard_policy_text().splitlines())
    assert {f"cap {n}" for n in CAPABILITIES.values()} <= lines
    assert len([x for x in lines if x.startswith("cap ")]) == len(CAPABILITIES)
    assert {f"mask {p}" for p in MASKED_PATHS} <= lines
    assert {f"readonly {p}" for p in READONLY_PATHS} <= lines
    # the compiled filter is a sock_filter array, stable (part of the guest's build hash), and
    # changes with the rules
    prog = seccomp_bpf()
    assert prog and len(prog) % 8 == 0 and prog == seccomp_bpf()
    assert seccomp_bpf(RULES[:-1]) != prog
