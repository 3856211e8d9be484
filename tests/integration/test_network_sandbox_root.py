"""Network policy end to end: a real ``dsec serve`` (container tier, busybox sandboxes)
driven through the SDK, against loopback-only infrastructure built here.

* "web": a network namespace of ours (198.19.<k>.0/24, RFC 2544 benchmarking range, never
  routed) with two addresses, ``.2`` = ``allowed.example.test`` and ``.3`` =
  ``sibling.example.test``, each serving HTTP on port 8080;
* the server's NetworkManager answers those names from ``static_records`` (no upstream);
* a "host service" listening on 0.0.0.0 of the host stands in for any node port (the
  apiserver itself listens on 127.0.0.1; it is probed too).

Probes run inside the sandboxes with busybox ``wget`` (several at once, each bounded by
``timeout``). No traffic leaves this node.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.isolation import subnet_host, worker_subnet
from tests.timing import budget

import dsec.errors as E
from dsec import NetworkPolicy, Sandbox
from dsec.privileged.netns import RtNetlink, create_netns, delete_netns, in_netns
from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,  # ~15 s: a server start and probes that wait out dropped SYNs
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables, crun)"),
]

SUBNET = worker_subnet(217)  # not the default servers' nor test_network's
GATEWAY = subnet_host(SUBNET, 1)
INSIDE = f"{subnet_host(SUBNET, 9 * 256)}/24"  # a network inside the sandbox subnet
WEB_PORT = 8080
PROBE_TIMEOUT_S = math.ceil(budget(2))
"""Seconds a dropped SYN waits (an allowed request takes milliseconds on an idle machine)."""


@dataclass
class Web:
    """The fake internet: addresses of the web namespace and the host's side of its link."""

    host: str  # the host's address on the web link (a node address)
    allowed: str  # allowed.example.test
    sibling: str  # sibling.example.test
    netns: Path
    host_service_port: int  # a listener on 0.0.0.0 of the host (stands in for node ports)


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from {self.connection.getsockname()[0]}\n".encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _serve_http(sock: socket.socket) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("0.0.0.0", 0), _Hello, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _listener(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    return s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    root = tmp_path_factory.mktemp("web")
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:6]
    link = f"dnw{tag}"
    k = 100 + os.getpid() % 100  # 198.19.<k>.0/24: two runs at once do not share a subnet
    w = Web(
        host=f"198.19.{k}.1",
        allowed=f"198.19.{k}.2",
        sibling=f"198.19.{k}.3",
        netns=root / "ns-web",
        host_service_port=_free_port(),
    )
    host_mac, web_mac = bytes([2, 0xDA, 0, 0, 0, 1]), bytes([2, 0xDA, 0, 0, 0, 2])
    servers: list[ThreadingHTTPServer] = []
    try:
        create_netns(w.netns)
        with RtNetlink() as host:
            index = host.add_veth(link, "eth0", w.netns, address=host_mac, peer_address=web_mac)
            host.add_address(index, w.host, 24)
            host.set_up(index)
            for address in (w.allowed, w.sibling):
                host.add_neighbor(index, address, web_mac)

        def inside() -> None:
            with RtNetlink() as nl:
                nl.set_up(1)
                eth = nl.link_index("eth0")
                nl.add_address(eth, w.allowed, 24)
                nl.add_address(eth, w.sibling, 24)
                nl.set_up(eth)
                nl.add_route("0.0.0.0/0", oif=eth, gateway=w.host)
                nl.add_neighbor(eth, w.host, host_mac)

        in_netns(w.netns, inside)
        servers.append(_serve_http(in_netns(w.netns, lambda: _listener(WEB_PORT))))
        servers.append(_serve_http(_listener(w.host_service_port)))
        yield w
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        with RtNetlink() as host:
            host.delete_link(link)
        delete_netns(w.netns)


@pytest.fixture(scope="module")
def server(web: Web, shared_layers: Path) -> Iterator[BackgroundServer]:
    home = Path(f"/tmp/dsec-netapi-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)  # cached busybox
    options = {
        "subnet": SUBNET,
        "static_records": {
            "allowed.example.test": [web.allowed],
            "sibling.example.test": [web.sibling],
        },
    }
    try:
        with BackgroundServer(home, tiers=["container"], network_options=options) as srv:
            assert srv.edge is not None and srv.edge.network.started, "networking did not start"
            manager = srv.edge.network
            yield srv
        # the server killed its sandboxes on exit: nothing of the network may remain
        assert _links(manager.iface_prefix) == []
        assert list(manager.netns_dir.iterdir()) == []
        assert list(manager.records_dir.iterdir()) == []
        if shutil.which("nft"):
            listed = subprocess.run(
                ["nft", "list", "table", "inet", manager.table], capture_output=True, text=True
            )
            assert listed.returncode != 0, "the filter table outlived the last sandbox"
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _links(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(prefix))


def _create(srv: BackgroundServer, network: Any = None) -> Any:
    return Sandbox.create(
        image="busybox", memory_mb=64, network=network, url=srv.url, api_key=srv.api_key
    )


@dataclass
class Reply:
    """One probe's outcome: wget's exit status and its output (body, or error message)."""

    rc: int
    text: str

    @property
    def body(self) -> str | None:
        """The body when the request succeeded, else None."""
        return self.text if self.rc == 0 else None


def probe(sb: Any, urls: dict[str, str]) -> dict[str, Reply]:
    """GET every URL from inside the sandbox at once (busybox wget, each bounded by
    ``PROBE_TIMEOUT_S``); output is folded onto one line per probe."""
    lines = [
        f'(r=$(timeout {PROBE_TIMEOUT_S} wget -q -O - "{url}" 2>&1); rc=$?; '
        f'echo "{key} $rc $(echo $r)") &'
        for key, url in urls.items()
    ]
    result = sb.commands.run("\n".join([*lines, "wait"]), timeout=PROBE_TIMEOUT_S + 20)
    assert result.exit_code == 0, result
    out: dict[str, Reply] = {}
    for line in result.stdout.splitlines():
        key, rc, *rest = line.split(" ", 2)
        out[key] = Reply(int(rc), rest[0] if rest else "")
    assert set(out) == set(urls), result.stdout
    return out


def _url(address: str, port: int = WEB_PORT) -> str:
    return f"http://{address}:{port}/"


def test_default_sandbox_has_no_network(server: BackgroundServer, web: Web) -> None:
    with _create(server) as sb:
        assert sb.network.policy is None
        links = sb.commands.run("cat /proc/net/dev").stdout
        assert "eth0" not in links and "lo:" in links
        got = probe(sb, {"ip": _url(web.allowed), "name": "http://allowed.example.test:8080/"})
        assert got["ip"].body is None and got["name"].body is None, got
        assert sb.network.stats() == {"enabled": False}
        with pytest.raises(E.CapabilityNotSupported):
            sb.network.update({"allow_domains": ["allowed.example.test"]})


def test_allowlist_and_runtime_updates_flip_access(server: BackgroundServer, web: Web) -> None:
    allowed_name = "http://allowed.example.test:8080/"
    sibling_name = "http://sibling.example.test:8080/"
    with _create(server, NetworkPolicy(allow_domains=["allowed.example.test"])) as sb:
        assert sb.commands.run("cat /etc/resolv.conf").stdout.startswith(f"nameserver {GATEWAY}")
        got = probe(
            sb, {"name": allowed_name, "sibling": sibling_name, "sibling_ip": _url(web.sibling)}
        )
        assert got["name"].body == f"hello from {web.allowed}", got
        assert got["sibling"].body is None and "bad address" in got["sibling"].text, got
        assert got["sibling_ip"].body is None, got  # no DNS answer, no admission: dropped

        stats = sb.network.stats()
        allowed = {(r["destination"], r["port"]): r for r in stats["allowed"]}
        assert allowed[(web.allowed, WEB_PORT)]["names"] == ["allowed.example.test"]
        assert allowed[(web.allowed, WEB_PORT)]["connections"] >= 1
        blocked = {(r["destination"], r["port"]): r["packets"] for r in stats["blocked"]}
        assert blocked.get((web.sibling, WEB_PORT), 0) >= 1
        assert stats["dns"]["refused_names"].get("sibling.example.test", 0) >= 1
        assert web.allowed in stats["admitted"]

        # stage 2: only the sibling; the old admission is revoked at once
        info = sb.network.update({"allow_domains": ["sibling.example.test"]})
        assert info.network.allow_domains == ["sibling.example.test"]
        got = probe(
            sb, {"sibling": sibling_name, "name": allowed_name, "allowed_ip": _url(web.allowed)}
        )
        assert got["sibling"].body == f"hello from {web.sibling}", got
        assert got["name"].body is None and "bad address" in got["name"].text, got
        assert got["allowed_ip"].body is None, got
        revoked = {(r["destination"], r["port"]) for r in sb.network.stats()["blocked"]}
        assert (web.allowed, WEB_PORT) in revoked

        # and back
        sb.network.update(NetworkPolicy(allow_domains=["allowed.example.test"]))
        got = probe(sb, {"name": allowed_name, "sibling_ip": _url(web.sibling)})
        assert got["name"].body == f"hello from {web.allowed}", got
        assert got["sibling_ip"].body is None, got


def test_a_networked_sandbox_can_be_a_warm_container(server: BackgroundServer, web: Web) -> None:
    """A create with a policy claims a warm container (made without a network) and wires
    the container's own namespace: veth, address, routes, filter, resolver, resolv.conf;
    nothing of another sandbox, and its namespace is unpinned at the kill."""
    assert server.edge is not None
    policy = NetworkPolicy(allow_domains=["allowed.example.test"])
    _create(server, policy).kill()  # the key's first create: the pool fills after it
    rt = server.edge.runtimes["container"]
    deadline = time.monotonic() + budget(30)
    while rt.pool.ready_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    with _create(server, policy) as sb:
        state = server.edge._live[sb.id].handle.state
        assert state.get("warm_id") and state.get("network"), state
        assert "network" in state["create_ms"], state["create_ms"]
        links = sb.commands.run("cat /proc/net/dev").stdout
        assert "eth0" in links and "lo:" in links
        assert sb.commands.run("cat /etc/resolv.conf").stdout.startswith(f"nameserver {GATEWAY}")
        got = probe(sb, {"name": "http://allowed.example.test:8080/", "ip": _url(web.sibling)})
        assert got["name"].body == f"hello from {web.allowed}", got
        assert got["ip"].body is None, got
        netns = server.edge.network.netns_dir / sb.id
        assert netns.exists()
        # the pinned namespace is the container's own (the init's), not a new one
        assert os.stat(netns).st_ino == os.stat(f"/proc/{state['init_pid']}/ns/net").st_ino
    server.call(server.edge.settle())
    assert not netns.exists()


def test_node_and_other_sandboxes_are_never_reachable(server: BackgroundServer, web: Web) -> None:
    api_port = int(server.url.rsplit(":", 1)[1])
    service = web.host_service_port
    # control: the host service answers on the web link (from the web namespace)
    with in_netns(web.netns, lambda: socket.create_connection((web.host, service), 2)) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        answer = b"".join(iter(lambda: s.recv(4096), b""))
        assert b"hello from" in answer

    # a policy that opens the whole web subnet, which holds the node's address .1
    policy = {"allow_cidrs": [f"{web.host.rsplit('.', 1)[0]}.0/24"], "ports": ["1-65535"]}
    with _create(server, policy) as other, _create(server, policy) as sb:
        other_ip = other.network.stats()["ip"]
        other.commands.run("mkdir -p /www && echo other > /www/index.html && httpd -p 8000 -h /www")
        assert probe(other, {"self": "http://127.0.0.1:8000/"})["self"].body == "other"
        got = probe(
            sb,
            {
                "web": _url(web.allowed),
                "svc_gw": _url(GATEWAY, service),
                "svc_link": _url(web.host, service),
                "api_gw": _url(GATEWAY, api_port) + "v1/health",
                "api_link": _url(web.host, api_port) + "v1/health",
                "api_lo": _url("127.0.0.1", api_port) + "v1/health",
                "other": _url(other_ip, 8000),
                "metadata": "http://169.254.169.254/",
            },
        )
        assert got.pop("web").body == f"hello from {web.allowed}"  # the subnet is open
        assert all(reply.body is None for reply in got.values()), got
        blocked = {r["destination"] for r in sb.network.stats()["blocked"]}
        assert {GATEWAY, web.host, other_ip} <= blocked, blocked


def test_open_and_block_all_policies(server: BackgroundServer, web: Web) -> None:
    """The two shapes the E2B layer produces: every public address minus denied networks
    ("open internet"), and a network that reaches nothing but can be opened later."""
    from dsec.e2b.network import BLOCK_ALL, policy_from_e2b

    open_policy = policy_from_e2b(True, None)
    assert open_policy is not None
    with _create(
        server, open_policy.model_copy(update={"deny_cidrs": [f"{web.sibling}/32"]})
    ) as sb:
        got = probe(
            sb,
            {
                "allowed_ip": _url(web.allowed),
                "sibling_ip": _url(web.sibling),
                "name": "http://allowed.example.test:8080/",
            },
        )
        assert got["allowed_ip"].body == f"hello from {web.allowed}", got  # no DNS needed
        # unprivileged ICMP (ping) sockets are allowed in the sandbox's network namespace
        ping_groups = sb.commands.run("cat /proc/sys/net/ipv4/ping_group_range").stdout
        assert ping_groups.split() == ["0", "2147483647"], ping_groups
        assert got["sibling_ip"].body is None, got  # the deny wins
        # names resolve too (an open internet asks the resolver nothing it could refuse)
        assert got["name"].body == f"hello from {web.allowed}", got

        sb.network.update(BLOCK_ALL)
        assert probe(sb, {"allowed_ip": _url(web.allowed)})["allowed_ip"].body is None
        sb.network.update({"allow_domains": ["allowed.example.test"]})
        got = probe(sb, {"name": "http://allowed.example.test:8080/"})
        assert got["name"].body == f"hello from {web.allowed}", got


def test_bad_policies_dead_sandboxes_and_teardown(server: BackgroundServer) -> None:
    manager = server.edge.network  # type: ignore[union-attr]
    headers = {"authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        server.call(server.edge.settle())  # earlier tests' kills: teardowns done
        before = set(os.listdir(manager.netns_dir))
        for body in (
            {"presets": ["no-such-preset"]},  # known only to the node
            {"allow_cidrs": [INSIDE]},  # inside the sandbox subnet
            {"allow_domains": ["bad..name"]},
            {"allow_domains": ["x.test"], "ports": [0]},
        ):
            r = http.post("/v1/sandboxes", json={"image": "busybox", "network": body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request"
        assert set(os.listdir(manager.netns_dir)) == before  # nothing half-made

        sb = _create(server, {"allow_domains": ["allowed.example.test"]})
        ifname = manager.network(sb.id).host_ifname
        assert (manager.netns_dir / sb.id).exists() and ifname in _links(manager.iface_prefix)
        for body in ({"presets": ["no-such-preset"]}, {"allow_cidrs": [INSIDE]}, {}):
            r = http.post(f"/v1/sandboxes/{sb.id}/network", json=body)
            assert r.status_code == 400, r.text
        assert sb.refresh().network.allow_domains == ["allowed.example.test"]  # unchanged

        sb.kill()  # answers before the teardown
        server.call(server.edge.settle())
        assert ifname not in _links(manager.iface_prefix)
        assert not (manager.netns_dir / sb.id).exists()
        assert not (manager.records_dir / f"{sb.id}.json").exists()
        r = http.post(f"/v1/sandboxes/{sb.id}/network", json={"allow_domains": ["a.test"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "sandbox_stopped"
