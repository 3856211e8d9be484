"""``dsec serve``: the apiserver and this node's edge in one process.

Embedded mode: SQLite registry and a local layer store under ``DSEC_HOME``; the
apiserver calls the in-process :class:`~dsec.edge.agent.EdgeAgent` through the
:class:`~dsec.contract.edge.EdgeAPI` protocol. Stopping the server leaves the
sandboxes running; the next start recovers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dsec.config import Paths
from dsec.edge.agent import EdgeAgent, EdgeLimits
from dsec.node import _list_env, embedded_edge, tiers_from_env
from dsec.privileged.cgroups.supervisor import reserve as reserve_supervisor
from dsec.privileged.mountns import enter_node_namespace
from dsec.privileged.reaper import become_subreaper

if TYPE_CHECKING:
    from dsec.apiserver.tls import TlsFiles

log = logging.getLogger("dsec.server")


DEFAULT_PORTS_DOMAIN = "dsec.localhost"
"""The ports domain of a ``dsec serve`` without ``DSEC_PORTS_DOMAIN``: host routes are
``{port}-{id}.dsec.localhost:<TLS port>``, names that browsers (Chromium, Firefox), curl
and any resolver with ``nss-myhostname`` (Debian: ``libnss-myhostname``) resolve to the
machine itself (RFC 6761), so E2B's ``get_host()`` and e2b-desktop's stream URL work on the
node with no DNS set-up. Two labels, not ``localhost`` alone: a certificate for
``*.localhost`` is refused by OpenSSL and Chromium (a wildcard directly under a top-level
name), one for ``*.dsec.localhost`` is not."""
DEFAULT_TLS_PORT = 7443
"""The TLS listener's port when neither ``DSEC_PORTS_DOMAIN`` nor ``DSEC_PORTS_TLS_PORT``
is set (any free port when another program holds it; the ports domain names the one
taken)."""
_OFF = ("off", "none", "no", "0")


@dataclass
class PortsSettings:
    """How the port proxy is reached (``docs/network.md``, "Ports").

    Attributes:
        domain: host routes ``{port}-{sandbox_id}.<domain>`` (``DSEC_PORTS_DOMAIN``, e.g.
            ``ports.example.com``, or ``ports.test:8443`` when clients must name the TLS
            port); None: path routes only.
        tls_port: a second listener, with TLS, for host routes and everything else
            (``DSEC_PORTS_TLS_PORT``); None: none.
        tls: its certificate (the operator's, ``DSEC_PORTS_TLS_CERT``/``_KEY``, or the
            node's own from :func:`dsec.apiserver.tls.node_certificate`).
        home: where the port token secret lives (``$DSEC_HOME/ports_secret``).
        tls_socket: the TLS listener's socket when :meth:`from_env` bound it already (the
            default port, or a free one); None: the listener binds ``tls_port`` itself.
    """

    domain: str | None = None
    tls_port: int | None = None
    tls: TlsFiles | None = None
    home: Path | None = None
    tls_socket: socket.socket | None = None

    @classmethod
    def from_env(cls, home: Path, *, host: str = "127.0.0.1", port: int = 7070) -> PortsSettings:
        """From ``DSEC_PORTS_DOMAIN``, ``DSEC_PORTS_TLS_PORT``, ``DSEC_PORTS_TLS_CERT`` and
        ``DSEC_PORTS_TLS_KEY``; ``host`` and ``port`` are the server's own listener.

        With neither ``DSEC_PORTS_DOMAIN`` nor ``DSEC_PORTS_TLS_PORT`` set (a node nobody
        configured), the TLS listener is on: its socket is bound here, on ``host`` at
        :data:`DEFAULT_TLS_PORT` or, when that is taken, any free port, and the domain is
        :data:`DEFAULT_PORTS_DOMAIN` with that port (``dsec.localhost:7443``), certified by
        the node's own authority. ``DSEC_PORTS_DOMAIN=off`` turns host routes off,
        ``DSEC_PORTS_TLS_PORT=off`` the TLS listener (the default domain then names the
        plain port). An operator's ``DSEC_PORTS_DOMAIN`` gets a TLS listener only where
        ``DSEC_PORTS_TLS_PORT`` says so, as before."""
        from dsec.apiserver.ports import ports_domain_from_env
        from dsec.apiserver.tls import tls_files_from_env

        raw_domain = os.environ.get("DSEC_PORTS_DOMAIN", "").strip().lower()
        raw_tls = os.environ.get("DSEC_PORTS_TLS_PORT", "").strip().lower()
        tls_port: int | None = None
        tls_socket: socket.socket | None = None
        if raw_tls in _OFF:
            pass
        elif raw_tls:
            try:
                tls_port = int(raw_tls)
            except ValueError:
                raise SystemExit(
                    f"DSEC_PORTS_TLS_PORT must be a port number or 'off', not {raw_tls!r}"
                ) from None
        elif not raw_domain:  # nothing configured: E2B's URLs work on this node as they are
            tls_socket = _listen(host, DEFAULT_TLS_PORT)
            tls_port = int(tls_socket.getsockname()[1])
            if tls_port != DEFAULT_TLS_PORT:
                log.warning(
                    "port proxy: port %d is taken; the TLS listener is on %d instead (set "
                    "DSEC_PORTS_TLS_PORT to choose)",
                    DEFAULT_TLS_PORT,
                    tls_port,
                )
        domain: str | None
        if raw_domain in _OFF:
            domain = None
        elif raw_domain:
            domain = ports_domain_from_env()
        else:
            listener = tls_port if tls_port is not None else port
            domain = DEFAULT_PORTS_DOMAIN + ("" if listener == 443 else f":{listener}")
        try:
            tls = tls_files_from_env(home, domain or "localhost") if tls_port else None
        except BaseException:
            if tls_socket is not None:
                tls_socket.close()
            raise
        return cls(domain=domain, tls_port=tls_port, tls=tls, home=home, tls_socket=tls_socket)


def localhost_names_resolve(nsswitch: Path = Path("/etc/nsswitch.conf")) -> bool:
    """Whether programs using the system resolver (Python's httpx, anything on glibc's
    ``getaddrinfo``) find ``*.localhost`` names: the ``hosts:`` line of ``nsswitch``
    names ``myhostname`` or ``resolve`` (glibc alone does not; browsers and curl resolve
    them themselves)."""
    try:
        lines = nsswitch.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        key, _, sources = line.partition(":")
        if key.strip() == "hosts":
            return bool({"myhostname", "resolve"} & set(sources.split()))
    return False


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``: at ``port``, or any free port when it is taken."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        return socket.create_server((host, 0), family=family)


def build_app(edge: Any, keys: Any, ports: PortsSettings | None = None) -> Any:
    """The full HTTP surface of one server: the dsec API, the E2B-compatible API under
    ``/e2b`` (control plane) and ``/e2b/envd`` (in-sandbox API), ``/run_code``
    (SandboxFusion's) and ``/v1/run_code`` through the edge's
    :class:`~dsec.contract.edge.CodeRuns` when it has the fncall tier (a cluster edge:
    when a node has it, call by call), the port proxy
    (:mod:`dsec.apiserver.ports`) configured by ``ports``, and the dashboard under ``/ui``
    (sessions signed with ``ports.home/ui_secret``)."""
    from dsec.apiserver.app import create_app
    from dsec.apiserver.ports import PortTokens
    from dsec.ui.session import load_secret

    ports = ports or PortsSettings()
    tokens = PortTokens.from_home(ports.home)
    app = create_app(
        edge,
        keys,
        port_tokens=tokens,
        ports_domain=ports.domain,
        ports_scheme="https" if ports.tls_port else "http",
        ui_secret=load_secret(ports.home),
    )
    app.state.closers = []
    try:
        from dsec.e2b import make_e2b_app
    except ImportError as e:  # the e2b package is a dependency; say so if it is missing
        log.warning("E2B-compatible API disabled: %s", e)
    else:
        # E2B's default network is open; DSEC_E2B_NETWORK_DEFAULT=closed keeps dsec's (none)
        raw = os.environ.get("DSEC_E2B_NETWORK_DEFAULT", "open")
        if raw not in ("open", "closed"):
            raise SystemExit("DSEC_E2B_NETWORK_DEFAULT must be 'open' or 'closed'")
        # E2B's sandbox URLs are public by default (allow_public_traffic); dsec's own
        # API keeps private ports by default (public_ports=False)
        ports_default = os.environ.get("DSEC_E2B_PORTS_DEFAULT", "public")
        if ports_default not in ("public", "private"):
            raise SystemExit("DSEC_E2B_PORTS_DEFAULT must be 'public' or 'private'")
        home = getattr(getattr(edge, "paths", None), "home", None)
        e2b_app = make_e2b_app(
            edge,
            keys.verify,
            default_network="closed" if raw == "closed" else "open",
            default_public_ports=ports_default == "public",
            sandbox_domain=ports.domain,
            traffic_tokens=tokens,
            template_files_dir=Path(home) / "e2b-template-files" if home is not None else None,
        )
        app.mount("/e2b", e2b_app)
        # E2B-routed port requests (E2b-Sandbox-Port) may carry the envdAccessToken
        app.state.ports.envd_verify = e2b_app.state.e2b.control.tokens.verify
        # the E2B SDK builds signed file URLs (upload_url/download_url) on the server's root,
        # without the /e2b/envd prefix: serve /files there too (signature-checked, no key)
        app.router.routes.extend(e2b_app.state.e2b.envd.files_routes())
        app.state.closers.append(e2b_app.state.e2b.aclose)

    from dsec.contract.edge import CodeRuns

    # an embedded edge runs code with its fncall tier; a cluster edge (no runtimes of its
    # own) on a node that has one
    runtimes = getattr(edge, "runtimes", None)
    runs_code = isinstance(edge, CodeRuns) and (runtimes is None or "fncall" in runtimes)
    if runs_code:
        from dsec.apiserver.routes_runcode import make_runcode_router, request_api_key

        def authorize(request: Any) -> str | None:
            key = request_api_key(request)
            return keys.verify(key) if key else None

        # SandboxFusion clients send no key: an operator may accept them from chosen networks
        cidrs = [
            c.strip()
            for c in os.environ.get("DSEC_RUNCODE_KEYLESS_CIDRS", "").split(",")
            if c.strip()
        ]
        jupyter = None
        if "container" in getattr(edge, "runtimes", {}):
            from dsec.apiserver.jupyter import RunJupyterService

            jupyter = RunJupyterService(
                edge, pod_name=f"dsec-jupyter@{edge.node}", layer_store=edge.layers
            )
        app.include_router(
            make_runcode_router(
                lambda: edge,
                authorize,
                keyless_networks=cidrs,
                get_jupyter=(lambda: jupyter) if jupyter is not None else None,
            )
        )
    return app


async def close_app(app: Any) -> None:
    """Release what :func:`build_app` attached (background process tables, watchers)."""
    for close in getattr(app.state, "closers", []):
        with contextlib.suppress(Exception):
            await close()


def serve(
    host: str = "127.0.0.1",
    port: int = 7070,
    home: str | None = None,
    log_level: str = "info",
    *,
    cluster: str | None = None,
    database: str | None = None,
    node_root: str | None = None,
) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM.

    ``cluster``: a Ray address (``host:port`` or ``auto``): serve a Ray cluster through
    :class:`~dsec.cluster.edge.ClusterEdge` instead of an in-process edge (see
    :func:`serve_cluster`); ``database``: its PostgreSQL registry; ``node_root``: parent of
    each node's data dir."""

    from dsec.apiserver.auth import KeyStore
    from dsec.apiserver.middleware import access_log_mode, configure_access_log
    from dsec.errors import InvalidRequest

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # one line per request (DSEC_ACCESS_LOG=text|json|off), whatever the log level
        configure_access_log(access_log_mode())
    except InvalidRequest as e:
        raise SystemExit(f"dsec serve: {e.message}") from None
    if home:
        os.environ["DSEC_HOME"] = home
    if cluster:
        serve_cluster(
            cluster,
            database=database,
            node_root=node_root,
            host=host,
            port=port,
            log_level=log_level,
        )
        return
    if database:
        raise SystemExit("--database needs --cluster (embedded mode keeps its state in SQLite)")
    if os.geteuid() != 0:
        raise SystemExit("dsec serve must run as root (it mounts layers and manages cgroups)")
    paths = Paths.from_env()
    # before any thread: the node's mounts in its own namespace, none propagating to the host
    mount_ns = enter_node_namespace(paths.run)
    # orphans of our helpers (crun's monitor, container inits...) come back to this process,
    # whose reaper thread waits for them (dsec.privileged.reaper)
    become_subreaper()
    # dsec's own processes weighted above every sandbox (dsec.privileged.cgroups.supervisor)
    supervisor = reserve_supervisor()
    if supervisor is not None:
        log.info("%s", supervisor.note)

    tiers = tiers_from_env()

    remaining: list[int] = []  # sandboxes live when the server stopped (they outlive it)

    async def main() -> None:
        async with embedded_edge(paths.home, tiers=tiers) as edge:
            prebuild_images(edge.layers)
            keys = KeyStore(paths.home)
            settings = PortsSettings.from_env(paths.home, host=host, port=port)
            if (settings.domain or "").startswith(DEFAULT_PORTS_DOMAIN):
                if not localhost_names_resolve():
                    log.warning(
                        "port proxy: host routes are on *.%s, which browsers and curl "
                        "resolve to this machine but this system's resolver does not (Python "
                        "clients such as httpx): install libnss-myhostname, or set "
                        "DSEC_PORTS_DOMAIN",
                        settings.domain,
                    )
            app = build_app(edge, keys, settings)
            settle_heap()
            log.info(
                "dsec serve on http://%s:%d (home %s, node %s)", host, port, paths.home, edge.node
            )
            try:
                await _serve_http(app, host, port, log_level, settings)
            finally:
                remaining.append((await edge.node_info()).sandboxes)

    try:  # uvloop cuts the event loop's share of every request
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    if remaining == [0]:  # nothing for a restarted server to recover: the namespace goes
        mount_ns.release()
    if supervisor is not None:
        supervisor.release()


def prebuild_images(store: Any) -> None:
    """Start building the built-in images this node lacks, in the background, so that no
    request waits for a build (``debian`` takes minutes). ``DSEC_PREBUILD``: the names
    (comma-separated), ``all`` (default) or ``none``."""
    from dsec.layers import builtin

    wanted = os.environ.get("DSEC_PREBUILD", "all").strip()
    if wanted == "none" or not wanted:
        return
    names = list(builtin.BUILTIN_IMAGES) if wanted == "all" else _list_env("DSEC_PREBUILD")
    unknown = sorted(set(names) - set(builtin.BUILTIN_IMAGES))
    if unknown:
        raise SystemExit(
            f"DSEC_PREBUILD names unknown images {', '.join(unknown)}; built-in images are "
            f"{', '.join(builtin.BUILTIN_IMAGES)}"
        )
    if store.prebuild_builtins(names) is not None:
        log.info("building the built-in images %s in the background", ", ".join(names))


GC_THRESHOLD0 = 20_000
"""Allocations between two young garbage collections in ``dsec serve`` (Python's default:
700). See :func:`settle_heap`."""


def settle_heap() -> None:
    """Keep the cyclic garbage collector off what lives as long as the server: what the
    imports and the start made (the app, the routes, the models: ~100k objects) is moved to
    the permanent generation, never scanned again; young collections run every
    :data:`GC_THRESHOLD0` allocations, so a request's objects are freed by their reference
    counts before a collection can promote them towards the full collections that scan every
    object (at 3,000 live sandboxes the collector took 15% of the node's CPU samples)."""
    import gc

    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, gen1, gen2)


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    *,
    tls: TlsFiles | None = None,
    lifespan: Literal["on", "off"] = "on",
) -> Any:
    """The uvicorn settings of every dsec listener (plain, or TLS with ``tls``)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan=lifespan,
        timeout_keep_alive=75,
        access_log=False,  # uvicorn's would show raw paths (ids, /k/<key>/): dsec.access
        ws_per_message_deflate=False,  # the proxy relays WebSocket payloads as they are
        ws_max_size=64 << 20,
        ssl_certfile=str(tls.cert) if tls else None,
        ssl_keyfile=str(tls.key) if tls else None,
    )


async def _serve_http(
    app: Any, host: str, port: int, log_level: str, ports: PortsSettings | None = None
) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM (on ``port``, and with TLS on
    ``ports.tls_port`` when set), then release what the app holds."""
    import uvicorn

    servers = [uvicorn.Server(uvicorn_config(app, host, port, log_level))]
    sockets: list[list[socket.socket] | None] = [None]
    if ports is not None and ports.tls_port and ports.tls is not None:
        servers.append(
            uvicorn.Server(
                uvicorn_config(app, host, ports.tls_port, log_level, tls=ports.tls, lifespan="off")
            )
        )
        sockets.append([ports.tls_socket] if ports.tls_socket is not None else None)
        log.info(
            "port proxy: TLS on %s:%d for %s (certificate %s%s)",
            host,
            ports.tls_port,
            ports.domain or "path routes",
            ports.tls.cert,
            f", authority {ports.tls.ca}" if ports.tls.ca else "",
        )

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    for server in servers:
        # our handlers, not uvicorn's: it would re-raise the signal after shutdown and kill
        # the process before the edge closes its registry
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    try:
        tasks = [
            asyncio.create_task(server.serve(sockets=socks))
            for server, socks in zip(servers, sockets, strict=True)
        ]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop()  # one listener stopped (a signal, or it could not bind): stop the others
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            t.result()
    finally:
        await close_app(app)


def connect_ray(address: str, *, timeout_s: float = 15.0) -> None:
    """``ray.init(address)`` in namespace ``dsec``, or ``SystemExit`` with a clear message
    when the cluster does not answer within ``timeout_s`` seconds (or Ray is missing)."""
    import threading

    try:
        import ray
    except ImportError:
        raise SystemExit("cluster mode needs Ray: pip install 'dsec[cluster]'") from None
    outcome: list[BaseException | None] = []

    # which of this host's addresses the driver announces (default: Ray's choice)
    node_ip = os.environ.get("DSEC_RAY_NODE_IP") or None

    def init() -> None:
        try:
            ray.init(
                address=address,
                _node_ip_address=node_ip,
                namespace="dsec",
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
            )
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    # ray.init retries an unreachable address for a long time: bound it from outside
    thread = threading.Thread(target=init, name="dsec-ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        sys.stderr.write(
            f"dsec serve: cannot reach the Ray cluster at {address!r} within {timeout_s:.0f} s "
            "(is `ray start --head` running there?)\n"
        )
        sys.stderr.flush()
        os._exit(2)  # the init thread cannot be interrupted; leave now
    if outcome[0] is not None:
        raise SystemExit(
            f"dsec serve: cannot connect to the Ray cluster at {address!r}: {outcome[0]}"
        )


def serve_cluster(
    address: str,
    *,
    database: str | None = None,
    node_root: str | None = None,
    host: str = "127.0.0.1",
    port: int = 7070,
    log_level: str = "info",
) -> None:
    """``dsec serve --cluster``: an apiserver replica in front of a Ray cluster.

    Connects to Ray (``address``) and to PostgreSQL (``database``; each within ~15 s, else
    a clear message and a non-zero exit), starts or finds one edge actor per alive Ray
    node, and serves the HTTP API through :class:`~dsec.cluster.edge.ClusterEdge`. Any
    number of replicas can run against the same cluster and database.

    Settings from the environment: ``DSEC_CLUSTER_NODE_ROOT`` (each node's data dir is
    ``<root>/<node>``; default ``/var/lib/dsec/nodes``), ``DSEC_CLUSTER_SHARED_LAYERS`` (a
    layer directory every node sees), ``DSEC_TIERS``, ``DSEC_NETWORK=off``,
    ``DSEC_CLUSTER_EDGE_FACTORY`` / ``DSEC_CLUSTER_EDGES_PER_NODE`` (simulated nodes, see
    :class:`~dsec.cluster.actor.NodeConfig`), and the
    timings of :meth:`ClusterOptions.from_env <dsec.cluster.edge.ClusterOptions.from_env>`.
    """

    from dsec.apiserver.auth import KeyStore
    from dsec.cluster.actor import NodeConfig
    from dsec.cluster.edge import ClusterEdge, ClusterOptions
    from dsec.errors import DsecError
    from dsec.serverpaths import hide_server_path

    paths = Paths.from_env()
    paths.home.mkdir(parents=True, exist_ok=True)
    state: Any = None
    if database:
        from dsec.cluster.state import ClusterState

        try:
            state = ClusterState(database, connect_timeout_s=10)
        except DsecError as e:
            raise SystemExit(f"dsec serve: {e.message}") from None
    connect_ray(address)
    tiers = tiers_from_env() or []
    config = NodeConfig(
        node_root=node_root or os.environ.get("DSEC_CLUSTER_NODE_ROOT", "/var/lib/dsec/nodes"),
        shared_layers=os.environ.get("DSEC_CLUSTER_SHARED_LAYERS") or None,
        tiers=tuple(tiers) or None,
        network=os.environ.get("DSEC_NETWORK", "on") != "off",
        edge_factory=os.environ.get("DSEC_CLUSTER_EDGE_FACTORY") or None,
        edges_per_node=int(os.environ.get("DSEC_CLUSTER_EDGES_PER_NODE", "1") or 1),
    )
    hide_server_path(config.node_root, "$DSEC_NODE_ROOT")
    if config.shared_layers:
        hide_server_path(config.shared_layers, "$DSEC_SHARED_LAYERS")
    hide_server_path(paths.home, "$DSEC_HOME")
    try:
        options = ClusterOptions.from_env()
    except DsecError as e:
        raise SystemExit(f"dsec serve: {e.message}") from None

    async def main() -> None:
        edge = ClusterEdge(state, config, options)
        await edge.start()
        key_state: Any = None
        if state is not None:
            from dsec.cluster.state import ClusterState, PgKeyStore

            # its own connection: a key lookup on the event loop never waits behind the
            # cluster edge's queries (which run in threads on the other connection)
            key_state = ClusterState(state.dsn, connect_timeout_s=10)
            keys: Any = PgKeyStore(key_state, paths.home)
        else:
            keys = KeyStore(paths.home)
        settings = PortsSettings.from_env(paths.home, host=host, port=port)
        app = build_app(edge, keys, settings)
        log.info(
            "dsec serve on http://%s:%d: cluster %s, nodes %s",
            host,
            port,
            address,
            ", ".join(sorted(edge.nodes)),
        )
        try:
            await _serve_http(app, host, port, log_level, settings)
        finally:
            await edge.close()
            if key_state is not None:
                keys.close()
                key_state.close()
            if state is not None:
                state.close()

    asyncio.run(main())


class BackgroundServer:
    """A full ``dsec serve`` (apiserver + edge) on a loopback port in a background thread.

    For tests, benchmarks and notebooks::

        with BackgroundServer(home=Path("/tmp/dsec")) as srv:
            sb = Sandbox.create(url=srv.url, api_key=srv.api_key)

    ``network_options`` configure the node's network manager (see :func:`build_network`),
    e.g. ``{"subnet": "10.210.0.0/16", "static_records": {"mirror.test": ["198.19.0.2"]}}``.
    ``ports_domain`` turns on host routes of the port proxy; ``tls=True`` adds a TLS
    listener (:attr:`tls_port`) with the node's own certificate (its authority:
    :attr:`ca`).
    """

    def __init__(
        self,
        home: Path,
        *,
        port: int = 0,
        tiers: list[str] | None = None,
        limits: EdgeLimits | None = None,
        network_options: dict[str, Any] | None = None,
        ports_domain: str | None = None,
        tls: bool = False,
    ) -> None:
        self.home = home
        self._listen: dict[int, Any] = {}  # port -> its socket, bound until the server listens
        self.port = port or self._reserve_port()
        self.tls_port = self._reserve_port() if tls else None
        self.ports = PortsSettings(domain=ports_domain, tls_port=self.tls_port, home=home)
        self.ca: Path | None = None
        self.tiers = tiers
        self.limits = limits
        self.network_options = network_options
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = ""
        self.edge: EdgeAgent | None = None
        self.keys: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._servers: list[Any] = []
        self._thread: Any = None
        self._error: BaseException | None = None

    def _reserve_port(self) -> int:
        """A loopback port, bound now and kept until the server listens on it: a port only
        looked up here and bound at ``__enter__`` could be taken meanwhile (EADDRINUSE under
        a busy test run)."""
        import socket

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
        self._listen[port] = sock
        return port

    def call(self, coro: Any, timeout: float = 300) -> Any:
        """Run a coroutine on the server's event loop (to reach the edge directly)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> BackgroundServer:
        import threading

        import uvicorn

        from dsec.apiserver.auth import KeyStore

        # sandbox inits and crun's monitors outlive the OCI runtime process that started
        # them: make them come back to this process, whose reaper waits for them, not to the
        # machine's PID 1
        become_subreaper()
        ready = threading.Event()

        async def main() -> None:
            async with embedded_edge(
                self.home,
                tiers=self.tiers,
                limits=self.limits,
                network_options=self.network_options,
            ) as edge:
                self.edge = edge
                self.keys = KeyStore(self.home)
                if self.tls_port:
                    from dsec.apiserver.tls import node_certificate

                    self.ports.tls = node_certificate(self.home, self.ports.domain or "localhost")
                    self.ca = self.ports.tls.ca
                app = build_app(edge, self.keys, self.ports)
                server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, "warning"))
                servers = [server]
                if self.tls_port:
                    servers.append(
                        uvicorn.Server(
                            uvicorn_config(
                                app,
                                "127.0.0.1",
                                self.tls_port,
                                "warning",
                                tls=self.ports.tls,
                                lifespan="off",
                            )
                        )
                    )
                self._server = server
                self._servers = servers
                self.loop = asyncio.get_running_loop()
                bound = [self._listen.get(s.config.port) for s in servers]
                tasks = [
                    asyncio.create_task(s.serve(sockets=[sock] if sock is not None else None))
                    for s, sock in zip(servers, bound, strict=True)
                ]
                while not all(s.started for s in servers):
                    for task in tasks:
                        if task.done():
                            task.result()
                    await asyncio.sleep(0.01)
                ready.set()
                try:
                    await asyncio.gather(*tasks)
                finally:
                    await close_app(app)
                await edge.close(kill_sandboxes=True)

        def thread_main() -> None:
            try:
                asyncio.run(main())
            except BaseException as e:
                self._error = e
            finally:
                ready.set()

        self._thread = threading.Thread(
            target=thread_main, name="dsec-background-server", daemon=True
        )
        self._thread.start()
        ready.wait(900)
        if self._error is not None or self._server is None:
            raise RuntimeError(f"dsec server failed to start: {self._error!r}") from self._error
        self.api_key = (self.home / "api_key").read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            if server is not None:
                server.should_exit = True
        if self._thread is not None:
            self._thread.join(300)
        for sock in self._listen.values():  # closed by its server already, unless it never ran
            sock.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``dsec serve`` as a child process on a free loopback port with its own ``DSEC_HOME``:
    what benchmarks measure (an in-process server would share the GIL with the clients).

    ``layer_cache`` (default ``$DSEC_TEST_LAYER_CACHE``, else the home's own ``layers/``) is
    linked as the home's layer store when it exists (built-in images come from
    ``DSEC_BUILTIN_CACHE`` when that is set, built once per machine). ``env`` adds operator settings (``DSEC_TIERS`` defaults to ``container``,
    ``DSEC_NETWORK`` to ``off`` and ``DSEC_PREBUILD`` to ``none``).
    """

    def __init__(
        self,
        home: Path,
        *,
        env: dict[str, str] | None = None,
        layer_cache: Path | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.home = home
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = ""
        self.env = {
            "DSEC_TIERS": "container",
            "DSEC_NETWORK": "off",
            "DSEC_PREBUILD": "none",
            **(env or {}),
        }
        # a layer store to share (a symlink as the home's layers/): only when asked for; a
        # machine-wide default was shared by every test process at once and went stale
        # (built-in images come from DSEC_BUILTIN_CACHE instead)
        shared = layer_cache or os.environ.get("DSEC_TEST_LAYER_CACHE")
        self.layer_cache = Path(shared) if shared else self.home / "layers"
        self.start_timeout_s = start_timeout_s
        self.proc: Any = None

    def __enter__(self) -> ServeProcess:
        import subprocess
        import sys
        import time

        import httpx

        self.home.mkdir(parents=True, exist_ok=True)
        if (
            self.layer_cache != self.home / "layers"
            and self.layer_cache.is_dir()
            and not (self.home / "layers").exists()
        ):
            (self.home / "layers").symlink_to(self.layer_cache, target_is_directory=True)
        env = {**os.environ, "DSEC_HOME": str(self.home), **self.env}
        log_file = open(self.home / "serve.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsec.cli.main",
                "serve",
                "--port",
                str(self.port),
                "--home",
                str(self.home),
            ],
            env=env,
            stdout=log_file,
            stderr=log_file,
        )
        log_file.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsec serve exited; see {self.home / 'serve.log'}")
            time.sleep(0.1)
        else:
            self.__exit__()
            raise RuntimeError(f"dsec serve did not become healthy; see {self.home / 'serve.log'}")
        self.api_key = (self.home / "api_key").read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        import subprocess

        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
