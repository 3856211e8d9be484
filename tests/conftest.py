"""Shared fixtures: a real in-process `dsec serve` (apiserver + edge) on a loopback port.

The server runs in a background thread with its own event loop, on a private
DSEC_HOME, so tests drive it exactly as users do: through the SDK over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests import warm_images
from tests.isolation import worker_subnet
from tests.timing import ENV as SLOWNESS_ENV
from tests.timing import budget, measure, slowness

# Tests never reach Docker Hub: an unknown image name is not looked up there (a test that
# wants short names pulled points DSEC_SHORT_NAME_REGISTRY at a registry on loopback).
os.environ.setdefault("DSEC_SHORT_NAME_REGISTRY", "none")
# Built-in images (debian, desktop, code-interpreter, ...) are built once per machine, not
# once per test home or run: every store of every test process takes them from this cache.
os.environ.setdefault("DSEC_BUILTIN_CACHE", warm_images.DEFAULT_CACHE)
# Each xdist worker's default servers get a subnet of their own (tests/isolation.py).
os.environ["DSEC_NET_SUBNET"] = worker_subnet(203)

HEAVY_FIRST = (
    # the longest modules start first, so that no worker is left with one at the end
    "tests/integration/test_sandboxfusion_parity_root.py",
    "tests/conformance/test_conformance.py",
    "tests/integration/test_no_leaks_root.py",
    "tests/integration/test_api_fuzz_root.py",
    "tests/vm/test_desktop_vm.py",
    "tests/cluster/",
    "tests/integrations/test_docker_cli_root.py",
    "tests/desktop/",
    "tests/integration/test_network_sandbox_root.py",
    "tests/security/test_vm_escape.py",
    "tests/integrations/test_harbor_root.py",
    "tests/vm/",
    "tests/integration/test_builds_root.py",
    "tests/integration/test_edge_lifecycle_root.py",
    "tests/codeinterp/",
)
"""Root modules that take the longest, longest first (per-module totals of a full run's
junit report, 2026-12-06)."""

SHARED_GROUPS = {
    # modules that must share one worker: one Ray cluster and PostgreSQL at a time
    "tests/cluster/test_cluster.py": "cluster",
    "tests/cluster/test_conformance_cluster.py": "cluster",
    "tests/cluster/test_vm_migration.py": "cluster",
}


def _work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a module (its module-scoped servers start
    once), or a group of modules of :data:`SHARED_GROUPS`."""
    path = nodeid.split("::", 1)[0]
    return next((g for prefix, g in SHARED_GROUPS.items() if path.startswith(prefix)), path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n`` with a load distribution: xdist's scope scheduler over our work units
    (``--dist loadgroup``'s nodeid suffixes are lost with pytest 9, so groups are told
    from the path here)."""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    # keep the collection's order (root-free tests first, the longest modules next) rather
    # than xdist's largest-module-first
    config.option.loadscopereorder = False

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return WorkUnitScheduling(config, log)


def _is_root() -> bool:
    return os.geteuid() == 0


def _workers(config: pytest.Config) -> int:
    n = getattr(config.option, "numprocesses", None)
    return int(n) if isinstance(n, int) and n > 0 else 1


def pytest_configure(config: pytest.Config) -> None:
    """In the main process (not an xdist worker): measure how slow the machine is now, once,
    for every worker (tests/timing.py), and start building the images the root tests need in
    the background while the root-free tests run (tests/warm_images.py)."""
    if hasattr(config, "workerinput"):
        return
    if not os.environ.get(SLOWNESS_ENV):
        os.environ[SLOWNESS_ENV] = str(measure(_workers(config)))
    if _is_root() and not config.option.collectonly:
        warm_images.start_in_background()


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"dsec: time budgets x{slowness()} ({SLOWNESS_ENV}); images from {warm_images.cache_dir()}"
    )


def _rel(item: pytest.Item) -> str:
    return (
        Path(str(item.path))
        .resolve()
        .relative_to(Path(__file__).resolve().parent.parent)
        .as_posix()
    )


def _order(item: pytest.Item) -> tuple[int, int]:
    if "root" not in item.keywords:
        return (0, 0)  # root-free tests first: they run while the images are built
    rel = _rel(item)
    for i, prefix in enumerate(HEAVY_FIRST):
        if rel.startswith(prefix):
            return (1, i)
    return (2, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scale = slowness()
    default_timeout = float(config.getini("timeout") or 0)
    for item in items:
        # pytest-timeout's limit, stretched for this machine (tests/timing.py)
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker is not None and marker.args else default_timeout
        if limit > 0:
            item.add_marker(pytest.mark.timeout(limit * scale), append=False)
    items.sort(key=_order)  # stable: a module's tests keep their order
    if _is_root():
        return
    skip = pytest.mark.skip(reason="needs root (runs in CI, which is root)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A root test starts once the background image build is done: the wait is not
    charged to its time-out (this wrapper runs outside pytest-timeout's)."""
    if "root" in item.keywords and _is_root():
        warm_images.wait_until_built()
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    line = warm_images.summary()
    if line is not None and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.write_line(f"dsec test {line}")


def wait_until(cond: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Poll ``cond()`` until it is true or ``timeout_s`` (stretched by tests/timing.py's
    factor: on a slow machine it takes longer) passed; its last value. For what a server
    finishes after answering (a kill's teardown runs after its reply)."""
    deadline = time.monotonic() + budget(timeout_s)
    while not (ok := bool(cond())) and time.monotonic() < deadline:
        time.sleep(interval_s)
    return ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    api_key: str
    home: Path
    edge: Any
    keys: Any
    loop: asyncio.AbstractEventLoop
    tiers: list[str] = field(default_factory=list)

    def call(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop (to reach the edge directly)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def run_live_server(home: Path, tiers: list[str] | None = None) -> Iterator[LiveServer]:
    from dsec.server import BackgroundServer

    with BackgroundServer(home, tiers=tiers) as bg:
        assert bg.edge is not None and bg.loop is not None
        yield LiveServer(
            url=bg.url,
            api_key=bg.api_key,
            home=home,
            edge=bg.edge,
            keys=bg.keys,
            loop=bg.loop,
            tiers=sorted(bg.edge.runtimes),
        )


@pytest.fixture(scope="session")
def dsec_home_root() -> Iterator[Path]:
    keep = "DSEC_TEST_HOME" in os.environ
    base = Path(os.environ.get("DSEC_TEST_HOME", f"/tmp/dsec-test-{os.getpid()}"))
    base.mkdir(parents=True, exist_ok=True)
    yield base
    _release_test_homes(base, remove=not keep)


def _free_node_resources(base: Path) -> None:
    """Free what the servers whose home was under ``base`` keep outside it: their VM
    template RAM on /dev/shm (host memory) and their lazy layer servers."""
    for tpl in Path("/dev/shm").glob("dsec-tpl-*"):
        with contextlib.suppress(OSError):
            if Path((tpl / "home").read_text()).is_relative_to(base):
                shutil.rmtree(tpl, ignore_errors=True)
    _stop_lazy_servers(base)


@pytest.fixture(scope="session", autouse=True)
def _free_tmp_path_homes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Homes made under pytest's ``tmp_path`` (kept for inspection) still must not hold
    host memory after the session."""
    yield
    _free_node_resources(tmp_path_factory.getbasetemp())


def _stop_lazy_servers(base: Path) -> None:
    """Stop the lazy layer servers whose state directory is under ``base``: they run in their
    own session and outlive the process that started them (a killed ``dsec serve``)."""
    from dsec.layers.lazy import LazyServer

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsec.layers.lazy" not in argv or b"--state" not in argv:
            continue
        state = Path(os.fsdecode(argv[argv.index(b"--state") + 1]))
        if state.resolve().is_relative_to(base.resolve()):
            with contextlib.suppress(Exception):
                LazyServer(state).shutdown()


def _release_test_homes(base: Path, *, remove: bool) -> None:
    """After the session: free the VM template RAM (on /dev/shm, i.e. host memory) of the
    servers whose home was under ``base``, and delete ``base`` unless something is still
    mounted below it (never recurse into a mount)."""
    _free_node_resources(base)
    if not remove:
        return
    prefix = str(base.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        if any(line.split()[4].startswith(prefix) for line in f):
            return  # a leak the session's own checks report; keep the evidence
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_layers(dsec_home_root: Path) -> Path:
    """A layer store shared by the test servers of one session (one xdist worker), removed
    with it. Built-in images come into it from the machine-wide cache (``warm_images``)."""
    p = Path(os.environ.get("DSEC_TEST_LAYER_CACHE") or dsec_home_root / "layers")
    p.mkdir(parents=True, exist_ok=True)
    return p


@pytest.fixture
def short_home(dsec_home_root: Path) -> Iterator[Path]:
    """A new, empty ``DSEC_HOME`` with a short path: the VM tiers put unix sockets under
    it (at most 107 bytes), and pytest's ``tmp_path`` is longer in an xdist worker. Removed
    afterwards unless something is still mounted below it (the session's checks say so)."""
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="h-", dir=dsec_home_root))
    yield home
    prefix = str(home.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        if not any(line.split()[4].startswith(prefix) for line in f):
            shutil.rmtree(home, ignore_errors=True)


def _seed_layers(home: Path, cache: Path) -> None:
    """Share built images across test homes: point layers/ at the session cache."""
    layers = home / "layers"
    if not layers.exists():
        home.mkdir(parents=True, exist_ok=True)
        layers.symlink_to(cache, target_is_directory=True)


@contextlib.contextmanager
def container_server(home: Path, cache: Path, image: str, **options: Any) -> Iterator[Any]:
    """A :class:`dsec.server.BackgroundServer` at ``home`` (layers from ``cache``) with the
    container tier and ``image`` ready; ``options`` go to the server (``network_options``);
    a skip when this node has no container tier. The home is removed afterwards."""
    from dsec.server import BackgroundServer

    _seed_layers(home, cache)
    with BackgroundServer(home, tiers=["container"], **options) as bg:
        assert bg.edge is not None
        if "container" not in bg.edge.runtimes:
            pytest.skip("the container tier is not available on this node")
        bg.call(bg.edge.layers.ensure_image(image), timeout=3600)
        yield bg
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def live_server(dsec_home_root: Path, shared_layers: Path) -> Iterator[LiveServer]:
    if not _is_root():
        pytest.skip("needs root")
    home = dsec_home_root / "server"
    _seed_layers(home, shared_layers)
    with run_live_server(home) as srv:
        yield srv
    _assert_no_leaks(home)
    shutil.rmtree(home, ignore_errors=True)


def _assert_no_leaks(home: Path) -> None:
    from dsec.privileged.mount import mount_points

    deadline = time.monotonic() + 10
    while True:
        leaked = [p for p in mount_points(home / "sandboxes")]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leaked, f"leaked sandbox mounts: {leaked[:5]}"


@pytest.fixture
def sdk_env(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> LiveServer:
    monkeypatch.setenv("DSEC_URL", live_server.url)
    monkeypatch.setenv("DSEC_API_KEY", live_server.api_key)
    return live_server
