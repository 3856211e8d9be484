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

# Tests never reach Docker Hub: an unknown image name is not looked up there (a test that
# wants short names pulled points DSEC_SHORT_NAME_REGISTRY at a registry on loopback).
os.environ.setdefault("DSEC_SHORT_NAME_REGISTRY", "none")


def _is_root() -> bool:
    return os.geteuid() == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _is_root():
        return
    skip = pytest.mark.skip(reason="needs root (runs in CI, which is root)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def wait_until(cond: Any, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Poll ``cond()`` until it is true or ``timeout_s`` passed; its last value. For what a
    server finishes after answering (a kill's teardown runs after its reply)."""
    deadline = time.monotonic() + timeout_s
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
    """A layer cache shared by the test servers of one session (busybox, debian)."""
    p = Path(os.environ.get("DSEC_TEST_LAYER_CACHE", "/var/cache/dsec-test-layers"))
    p.mkdir(parents=True, exist_ok=True)
    return p


def _seed_layers(home: Path, cache: Path) -> None:
    """Share built images across test homes: point layers/ at the session cache."""
    layers = home / "layers"
    if not layers.exists():
        home.mkdir(parents=True, exist_ok=True)
        layers.symlink_to(cache, target_is_directory=True)


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
