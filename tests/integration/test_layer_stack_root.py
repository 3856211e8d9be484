"""Composable stacks on a real ``dsec serve``: ``image + layers=[...]`` is checked against the
layers' ``provides``/``requires`` at create time, before anything is mounted; a good stack
runs with every layer visible."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec import Client, Sandbox
from dsec.errors import InvalidRequest
from dsec.models import SYSTEM_OWNER
from dsec.privileged.mount import mount_points

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from dsec.server import BackgroundServer

    home = Path(f"/tmp/dsec-stack-{secrets.token_hex(3)}")
    try:
        with BackgroundServer(home, tiers=["container"]) as srv:
            srv.edge.layers.ensure_image_sync("busybox")
            yield srv
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _layer(srv: Any, tmp_path: Path, name: str, kind: str, meta: dict[str, Any]) -> str:
    tree = tmp_path / name
    tree.mkdir()
    (tree / f"{name}.txt").write_text(f"{name}\n")
    digest = srv.edge.layers.build_layer(tree, kind, name=name, meta=meta).digest
    srv.edge.layers.grant_layers(SYSTEM_OWNER, [digest])  # published by the operator
    return str(digest)


def test_good_stack_runs(server: Any, tmp_path: Path) -> None:
    tool = _layer(
        server, tmp_path, "tool", "toolkit", {"requires": ["busybox"], "provides": ["tool"]}
    )
    app = _layer(server, tmp_path, "app", "workspace", {"requires": ["tool"]})
    sb = Sandbox.create(
        tier="container",
        image="busybox",
        layers=[tool, app],
        url=server.url,
        api_key=server.api_key,
    )
    try:
        r = sb.commands.run("cat /tool.txt /app.txt")
        assert r.stdout == "tool\napp\n"
    finally:
        sb.kill()


@pytest.mark.parametrize(
    ("kind", "meta", "missing"),
    [
        ("toolkit", {}, "debian-12, glibc"),  # a toolkit needs a Debian base by default
        ("workspace", {"requires": ["python3"]}, "python3"),
    ],
    ids=["toolkit-on-busybox", "workspace-needs-python3"],
)
def test_bad_stack_is_refused_before_mounting(
    server: Any, tmp_path: Path, kind: str, meta: dict[str, Any], missing: str
) -> None:
    name = f"needy-{secrets.token_hex(2)}"
    digest = _layer(server, tmp_path, name, kind, meta)
    mounts_before = mount_points(server.home)
    with Client(url=server.url, api_key=server.api_key) as client:
        rows_before = len(client.list_sandboxes(include_stopped=True))
    with pytest.raises(InvalidRequest, match=f"{name} .*requires {missing}") as exc:
        Sandbox.create(
            tier="container",
            image="busybox",
            layers=[digest],
            url=server.url,
            api_key=server.api_key,
        )
    assert exc.value.details["layer"] == digest
    # nothing mounted for the refused request (the warm pool refills and other sandboxes of
    # this server come and go meanwhile: only mounts that appeared outside the pool count)
    made = set(mount_points(server.home)) - set(mounts_before)
    assert [m for m in made if not m.parent.name.startswith("wp-")] == []
    with Client(url=server.url, api_key=server.api_key) as client:
        assert len(client.list_sandboxes(include_stopped=True)) == rows_before  # no row made
