"""E2B's URLs on a ``dsec serve`` nobody configured (no ``DSEC_PORTS_*``): ``sbx.get_host(port)``
is ``<port>-<id>.dsec.localhost:<TLS port>``, a name this machine resolves to itself
(``libnss-myhostname``, which ``scripts/bootstrap.sh`` installs), served by the TLS listener
``dsec serve`` opens by default with the node's own authority, and public as E2B's are by
default, so plain ``httpx`` fetches it; ``allow_public_traffic=False`` makes it private.
Another key reaches neither sandbox's ports."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.timing import budget

from dsec.apiserver.auth import KeyStore
from dsec.server import DEFAULT_PORTS_DOMAIN, ServeProcess
from e2b import Sandbox

pytestmark = [pytest.mark.root, pytest.mark.slow]

PAGE = "hello from a dsec sandbox\n"


class Plain:
    """A ``dsec serve`` child with no operator settings for ports, and two keys."""

    def __init__(self, srv: ServeProcess, other_key: str) -> None:
        self.srv = srv
        self.other_key = other_key
        self.ca = srv.home / "ports-tls" / "ca.pem"
        self.trust = ssl.create_default_context(cafile=str(self.ca))  # the node's authority
        self.e2b = {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd"}


@pytest.fixture(scope="module")
def plain() -> Iterator[Plain]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    set_ = [k for k in os.environ if k.startswith("DSEC_PORTS_")]
    if set_:
        pytest.skip(f"this test is about a server without port settings; {set_} are set")
    try:
        socket.getaddrinfo(f"probe.{DEFAULT_PORTS_DOMAIN}", 443, type=socket.SOCK_STREAM)
    except socket.gaierror:
        pytest.skip(
            f"*.{DEFAULT_PORTS_DOMAIN} does not resolve here (glibc alone does not resolve "
            "*.localhost: scripts/bootstrap.sh installs libnss-myhostname)"
        )
    home = Path(tempfile.mkdtemp(prefix="dsec-e2b-defaults-", dir="/tmp")) / "home"
    with ServeProcess(home) as srv:  # DSEC_TIERS=container, no network, nothing else
        yield Plain(srv, KeyStore(home).create_key("e2b-defaults-other"))
    shutil.rmtree(home.parent, ignore_errors=True)


def _serving(sbx: Sandbox) -> str:
    """Start busybox's httpd on port 8000 in ``sbx``; the page it serves."""
    sbx.files.write("/tmp/www/index.html", PAGE)
    sbx.commands.run("busybox httpd -p 8000 -h /tmp/www")  # it detaches itself
    return PAGE


def _get(url: str, plain: Plain, **kw: Any) -> httpx.Response:
    """GET ``url`` until the sandbox's server answers (it was just started)."""
    deadline = time.monotonic() + budget(20)
    while True:
        r = httpx.get(url, verify=plain.trust, timeout=budget(30), **kw)
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_get_host_is_fetched_by_httpx_with_no_settings(plain: Plain) -> None:
    sbx = Sandbox.create("container/busybox", api_key=plain.srv.api_key, timeout=300, **plain.e2b)
    try:
        page = _serving(sbx)
        host = sbx.get_host(8000)
        name, _, port = host.rpartition(":")
        assert name == f"8000-{sbx.sandbox_id}.{DEFAULT_PORTS_DOMAIN}" and int(port) > 0
        assert sbx.traffic_access_token is None  # public, as E2B's sandboxes by default
        url = f"https://{host}/index.html"
        r = _get(url, plain)  # the node's authority; its certificate names the host
        assert r.status_code == 200 and r.text == page
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url, timeout=budget(30))  # httpx's own store does not know the node
        # another key's credential opens nothing of it (it names another owner)
        r = _get(url, plain, headers={"authorization": f"Bearer {plain.other_key}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    finally:
        sbx.kill()


def test_allow_public_traffic_false_is_private(plain: Plain) -> None:
    sbx = Sandbox.create(
        "container/busybox",
        api_key=plain.srv.api_key,
        timeout=300,
        network={"allow_public_traffic": False},
        **plain.e2b,
    )
    theirs = Sandbox.create(
        "container/busybox",
        api_key=plain.other_key,
        timeout=300,
        network={"allow_public_traffic": False},
        **plain.e2b,
    )
    try:
        page = _serving(sbx)
        url = f"https://{sbx.get_host(8000)}/index.html"
        token = sbx.traffic_access_token
        assert token
        r = _get(url, plain, headers={"e2b-traffic-access-token": token})
        assert r.status_code == 200 and r.text == page
        r = _get(url, plain)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        # the other key's own sandbox's token, and its key: nothing
        r = _get(url, plain, headers={"e2b-traffic-access-token": theirs.traffic_access_token})
        assert r.status_code == 403
        r = _get(url, plain, headers={"authorization": f"Bearer {plain.other_key}"})
        assert r.status_code == 404
    finally:
        sbx.kill()
        theirs.kill()
