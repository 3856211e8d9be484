"""A key's E2B form, ``e2b_<hex of the key>`` (dsec.apiserver.auth.e2b_form): the same key
on every surface that takes one (the key store, ``/v1``, the E2B control plane, the port
proxy, the CLI), never a second key, and nothing shorter or easier than the key itself."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from typer.testing import CliRunner

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import KeyStore, StaticKeys, canonical_key, e2b_form, owner_id
from dsec.cli import main as cli
from dsec.testing import FakeEdge

E2B_SHAPE = re.compile(r"\Ae2b_[0-9a-f]+\Z")
"""What e2b 2.31's client accepts (``e2b.api._API_KEY_PATTERN``)."""


def test_the_e2b_form_is_the_same_key(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    key = store.create_key("agents")
    other = store.create_key("other")
    form = e2b_form(key)
    assert E2B_SHAPE.match(form) and form == "e2b_" + key.encode().hex()
    assert canonical_key(form) == key and canonical_key(key) == key
    assert store.verify(form) == store.verify(key) == owner_id(key) == owner_id(form)
    assert store.verify(e2b_form(other)) == owner_id(other) != owner_id(key)
    # nothing near it is a key: a cut, a changed digit, upper case, a form of a form
    assert store.verify(form[:-2]) is None
    assert store.verify(form[:-1] + ("0" if form[-1] != "0" else "1")) is None
    assert store.verify(form.upper()) is None
    assert store.verify("e2b_" + form.encode().hex()) is None
    assert store.verify("e2b_") is None and store.verify("e2b_zz") is None
    assert store.verify("e2b_" + "ab" * 10_000) is None
    # revoking the E2B form revokes the key (one key, two spellings)
    assert store.revoke(form) is True
    assert store.verify(key) is None and store.verify(form) is None
    assert store.verify(e2b_form(other)) == owner_id(other)


def test_a_provisioned_e2b_key_stays_what_it_is(tmp_path: Path) -> None:
    """A key an operator provisioned in E2B's own shape (hex that is no UTF-8 text) is
    its own text, as before."""
    provisioned = "e2b_" + "ff" * 20
    tmp_path.joinpath("api_key").write_text(provisioned + "\n")
    store = KeyStore(tmp_path)
    assert canonical_key(provisioned) == provisioned
    assert store.verify(provisioned) == owner_id(provisioned)


async def test_v1_and_the_port_proxy_take_the_e2b_form() -> None:
    key, other = "dsec_" + "k" * 43, "dsec_" + "o" * 43
    edge = FakeEdge()
    app = create_app(edge, StaticKeys([key, other]), access_log="off")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
        mine = {"authorization": f"Bearer {e2b_form(key)}"}
        theirs = {"authorization": f"Bearer {e2b_form(other)}"}
        r = await c.post("/v1/sandboxes", json={"tier": "container"}, headers=mine)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert (await c.get(f"/v1/sandboxes/{sid}", headers=mine)).status_code == 200
        assert (await c.get("/v1/key", headers=mine)).json()["owner"] == owner_id(key)
        # another key, in either form, sees nothing of it
        assert (await c.get(f"/v1/sandboxes/{sid}", headers=theirs)).status_code == 404
        r = await c.get(f"/v1/sandboxes/{sid}/ports/8000/", headers=theirs)
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        bad = {"authorization": f"Bearer {e2b_form(key)[:-2]}"}
        assert (await c.get(f"/v1/sandboxes/{sid}", headers=bad)).status_code == 401


def test_cli_prints_the_e2b_form(tmp_path: Path) -> None:
    runner = CliRunner()
    home = ["--home", str(tmp_path)]
    created = runner.invoke(cli.app, ["key", "create", "--name", "agents", "--e2b", *home])
    assert created.exit_code == 0, created.output
    form = created.stdout.strip()
    assert E2B_SHAPE.match(form)
    store = KeyStore(tmp_path)
    assert store.verify(form) is not None
    key = canonical_key(form)
    assert key.startswith("dsec_")
    for argv, stdin in ((["key", "e2b", key], None), (["key", "e2b", "-"], key + "\n")):
        shown = runner.invoke(cli.app, argv, input=stdin)
        assert shown.exit_code == 0 and shown.stdout.strip() == form, shown.output
    shown = runner.invoke(cli.app, ["--api-key", key, "key", "e2b"])
    assert shown.stdout.strip() == form
    assert runner.invoke(cli.app, ["key", "e2b", form]).stdout.strip() == form  # idempotent
    assert runner.invoke(cli.app, ["key", "revoke", form, *home]).exit_code == 0
    assert store.verify(key) is None
