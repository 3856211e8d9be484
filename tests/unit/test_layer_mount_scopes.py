"""Layer mounts per key (dsec.layers.mounts): scope names, the mountpoint names a restarted
edge parses back, the ``DSEC_LAYER_SHARING`` setting, and the owner reaching the runtime's
spec. The mounts themselves: tests/integration/test_layer_page_cache_root.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.layers.mounts import (
    LAYER_SHARING_ENV,
    LayerMounts,
    layer_sharing_setting,
    mount_name,
    parse_mount_name,
    scope_name,
)
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge

DIGEST = "sha256:" + "0123456789abcdef" + "f" * 48


def test_scope_names_are_short_fixed_and_per_owner() -> None:
    a, b = scope_name("k0123456789abcdef"), scope_name("k0123456789abcdee")
    assert len(a) == len(b) == 12 and a != b
    assert a == scope_name("k0123456789abcdef")  # the same after a restart
    assert set(a) <= set("0123456789abcdef")
    assert scope_name("") == ""  # no owner: the shared scope


def test_mount_names_round_trip() -> None:
    assert mount_name(DIGEST) == "0123456789abcdef"  # the shared scope: as before scopes
    assert parse_mount_name("0123456789abcdef") == ("", "0123456789abcdef")
    scope = scope_name("kalice")
    name = mount_name(DIGEST, scope)
    assert name == f"{scope}-0123456789abcdef"
    assert parse_mount_name(name) == (scope, "0123456789abcdef")


@pytest.mark.parametrize(
    "name",
    [
        "stray",
        "0123456789abcde",  # 15 hex
        "0123456789abcdef0",  # 17 hex
        "0123456789ABCDEF",
        "abc-0123456789abcdef",  # scope too short
        "0123456789ab-0123456789abcdef-x",
        "-0123456789abcdef",
    ],
)
def test_other_names_are_not_layer_mounts(name: str) -> None:
    assert parse_mount_name(name) is None


def test_bad_digest_or_scope_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        mount_name("sha256:xyz")
    with pytest.raises(InvalidRequest):
        mount_name(DIGEST, "../../etc")
    with pytest.raises(InvalidRequest):
        mount_name(DIGEST, "abc")


def test_sharing_setting(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(LAYER_SHARING_ENV, raising=False)
    assert layer_sharing_setting() == "key"
    monkeypatch.setenv(LAYER_SHARING_ENV, " Node ")
    assert layer_sharing_setting() == "node"
    monkeypatch.setenv(LAYER_SHARING_ENV, "per-tenant")
    with caplog.at_level(logging.WARNING):
        assert layer_sharing_setting() == "key"
    assert "per-tenant" in caplog.text


def test_scope_of_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    per_key = LayerMounts(tmp_path / "k", sharing="key")
    assert per_key.scope_of("kalice") == scope_name("kalice") != per_key.scope_of("kbob")
    assert per_key.scope_of("") == ""
    node = LayerMounts(tmp_path / "n", sharing="node")
    assert node.scope_of("kalice") == node.scope_of("kbob") == ""
    monkeypatch.setenv(LAYER_SHARING_ENV, "node")
    assert LayerMounts(tmp_path / "e").sharing == "node"  # read when made


async def test_the_edge_hands_the_owner_to_the_runtime() -> None:
    edge = FakeEdge()
    info = await edge.create_sandbox(CreateSandboxRequest(tier="container"), "kalice")
    spec = edge.runtimes["container"].sandboxes[info.id].spec  # type: ignore[attr-defined]
    assert spec.owner == "kalice"
