"""Nothing leaks over time: hundreds of sandbox lifecycles through the SDK against a real
``dsec serve`` child process, then the server holds what it held before.

Each cycle creates a container sandbox, runs a command and kills it; some cycles add a
network policy (own namespace, veth, filter), a pause/resume, a background process left
running, commands still in flight at the kill, a command killed at its timeout, a
streamed command, connections through the port proxy (HTTP and a port forward); a few
cycles go through the unmodified E2B SDK (interactive processes).
Afterwards (``dsec.footprint``): no zombie child of the server (every cycle used to leave
one, crun's monitor, and every kill with a command in flight a stuck container init),
its process, thread and fd counts back to the baseline, and no mount, cgroup, network
namespace, host link, OCI state entry or sandbox directory left.

Slack: the baseline is taken after warm-up cycles of every kind. The server's thread
count may still grow by up to 8 (asyncio's default executor sizes itself on demand, up to
``min(32, cpus + 4)`` = 6 threads on this 2-core machine, plus short-lived per-call
threads such as the network namespace helper) and its fd count by up to 16 (HTTP
keep-alive connections of the clients, SQLite's WAL files). Both are fixed bounds, far
below one per cycle: a per-sandbox leak over 250 cycles cannot hide in them. Process
count: no slack.

~1-2 minutes on this 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.isolation import worker_subnet
from tests.timing import budget

from dsec import AsyncClient, AsyncSandbox
from dsec.errors import SandboxStopped
from dsec.footprint import ServerFootprint, server_footprint
from dsec.server import ServeProcess

pytestmark = [pytest.mark.root, pytest.mark.slow]

CYCLES = 250
E2B_CYCLES = 20
SUBNET = worker_subnet(219)
THREAD_SLACK, FD_SLACK = 8, 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = Path(tempfile.mkdtemp(prefix="dsec-leaks-", dir="/tmp")) / "home"
    env = {
        "DSEC_TIERS": "container",
        "DSEC_NETWORK": "on",
        "DSEC_NET_SUBNET": SUBNET,
        # the warm container pool is on (the default); a key unclaimed for 2 s is emptied,
        # so the baseline and the end are both taken with no warm container held
        "DSEC_CONTAINER_POOL_IDLE_S": "2",
    }
    with ServeProcess(home, env=env) as srv:
        yield srv
    shutil.rmtree(home.parent, ignore_errors=True)


async def cycle(client: AsyncClient, i: int) -> None:
    """One sandbox lifecycle; the kind of extra work depends on ``i``."""
    network = {"allow_domains": ["example.test"]} if i % 10 == 1 else None
    sb = await AsyncSandbox.create(
        image="busybox", cpu=0.1, memory_mb=64, network=network, client=client
    )
    killed = False
    try:
        r = await sb.commands.run(f"echo cycle-{i}")
        assert r.stdout == f"cycle-{i}\n", r
        kind = i % 10
        if kind == 2:
            await sb.pause()
            await sb.resume()
            assert (await sb.commands.run("echo back")).stdout == "back\n"
        elif kind == 3:  # a background process the sandbox's init inherits
            r = await sb.commands.run("sleep 600 >/dev/null 2>&1 & echo started")
            assert r.stdout == "started\n"
        elif kind == 4:  # commands still running when the sandbox is killed
            runs = [
                asyncio.create_task(sb.commands.run("sleep 60 & sleep 60", timeout=120))
                for _ in range(2)
            ]
            await asyncio.sleep(0.3)
            await sb.kill()
            killed = True
            for outcome in await asyncio.gather(*runs, return_exceptions=True):
                assert isinstance(outcome, SandboxStopped), outcome
        elif kind == 5:  # a command killed at its timeout, with a child of its own
            r = await sb.commands.run("sleep 30 & sleep 30", timeout=0.3)
            assert r.timed_out
        elif kind == 6 and i % 25 == 6:
            events = [e async for e in sb.commands.stream("echo a; echo b >&2")]
            assert events
        elif kind == 7:  # connections through the port proxy (one left open at the kill)
            await sb.commands.run("mkdir -p /w && echo up > /w/u && httpd -p 8000 -h /w")
            url = await sb.get_url(8000, "/u")
            async with httpx.AsyncClient(timeout=30) as http:
                for _ in range(3):
                    assert (await http.get(url)).text == "up\n"
            held = await sb.port_forward(8000)
            reader, writer = await asyncio.open_connection("127.0.0.1", held.local_port)
            writer.write(b"GET /u HTTP/1.0\r\n\r\n")
            await writer.drain()
            assert b"up" in await reader.read()
            writer.close()
            await held.close()
    finally:
        if not killed:
            await sb.kill()


def e2b_cycle(i: int) -> None:
    """One lifecycle through the unmodified E2B SDK (interactive process API)."""
    from e2b import Sandbox

    sbx = Sandbox.create("container/busybox", timeout=120)
    try:
        assert sbx.commands.run(f"echo e2b-{i}").stdout == f"e2b-{i}\n"
        sleeper = sbx.commands.run("sleep 30", background=True)
        if i % 2:
            assert sbx.commands.kill(sleeper.pid) is True
    finally:
        sbx.kill()  # with i even: a process still running


def describe(pid: int) -> list[str]:
    """The server's children (pid, name, state, process group), for failure messages."""
    from dsec.privileged.reaper import child_pids, proc_stat

    out = []
    for child in child_pids(pid):
        st = proc_stat(child)
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            name = "?"
        out.append(f"{child} {name} {st.state if st else '?'} pgrp={st.pgrp if st else '?'}")
    return out


_STEADY = (
    "descendants",
    "mounts",
    "cgroups",
    "netns",
    "links",
    "sandbox_dirs",
    "oci_state",
    "loop_devices",
)
"""What a server's pools change while they fill (threads, fds and the machine's tasks move
for reasons of their own)."""


def steady_footprint(srv: ServeProcess, quiet_s: float = 1.0, timeout_s: float = 20.0) -> Any:
    """The server's footprint once :data:`_STEADY` has not changed for ``quiet_s`` (its
    pools refilled), waiting at most ``budget(timeout_s)``."""
    deadline = time.monotonic() + budget(timeout_s)
    last = server_footprint(srv.proc.pid, srv.home)
    still_since = time.monotonic()
    while time.monotonic() - still_since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = server_footprint(srv.proc.pid, srv.home)
        if {k: now.counts()[k] for k in _STEADY} != {k: last.counts()[k] for k in _STEADY}:
            still_since = time.monotonic()
        last = now
    return last


def settle(srv: ServeProcess, baseline: ServerFootprint, timeout_s: float = 20.0) -> dict[str, Any]:
    """The growth over ``baseline``, once teardown (reaping, namespace removal) settled."""
    assert not baseline.zombies, f"the served baseline has zombies: {baseline.zombies}"
    deadline = time.monotonic() + budget(timeout_s)
    while True:
        grew = server_footprint(srv.proc.pid, srv.home).growth(
            baseline, threads=THREAD_SLACK, fds=FD_SLACK
        )
        if not grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.2)


def test_sandbox_cycles_leave_nothing_behind(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.api_key)
    try:
        import e2b  # noqa: F401

        e2b_cycles = E2B_CYCLES
    except ImportError:
        e2b_cycles = 0

    async def run(indices: range) -> list[int]:
        zombies_seen: list[int] = []
        async with AsyncClient(server.url, server.api_key) as client:
            for i in indices:
                await cycle(client, i)
                if i % 50 == 49:  # reaped as they come, not only at the end
                    deadline = time.monotonic() + budget(1.0)
                    while True:
                        await asyncio.sleep(0.1)
                        zombies = len(server_footprint(server.proc.pid, server.home).zombies)
                        if zombies <= 2 or time.monotonic() > deadline:
                            break
                    zombies_seen.append(zombies)
        return zombies_seen

    # warm-up: every kind of cycle once, so pools and caches exist before the baseline
    asyncio.run(run(range(10)))
    for i in range(min(2, e2b_cycles)):
        e2b_cycle(i)
    deadline = time.monotonic() + budget(15)
    while True:  # the last kill's zombies are reaped within a reaper pass (~50 ms), the
        # warm pool empties 2-3 s after the last claim
        baseline = server_footprint(server.proc.pid, server.home)
        if (not baseline.zombies and not baseline.descendants) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not baseline.zombies, f"zombies after the warm-up: {describe(server.proc.pid)}"

    zombies_seen = asyncio.run(run(range(CYCLES)))
    for i in range(e2b_cycles):
        e2b_cycle(i)

    grew = settle(server, baseline)
    end = server_footprint(server.proc.pid, server.home)
    assert not grew, (
        f"leaked over {CYCLES + e2b_cycles} cycles: {grew}\n{end.counts()}\n"
        f"children: {describe(server.proc.pid)}"
    )
    assert max(zombies_seen, default=0) <= 2, f"zombies piled up while running: {zombies_seen}"
    assert end.descendants == baseline.descendants == 0


@pytest.mark.debian
def test_fncall_workers_are_reaped_when_their_zygote_goes() -> None:
    """fncall: calls and sandboxes leave nothing; when a pool's zygote dies its workers are
    reaped (they come back to the server in the zygote's process group), and when the
    server stops, the zygotes reap their workers before exiting (they used to be left as
    zombies, of the server and then of PID 1)."""
    from dsec import Client, Sandbox
    from dsec.privileged.reaper import child_pids, proc_stat

    home = Path(tempfile.mkdtemp(prefix="dsec-leaks-fncall-", dir="/tmp")) / "home"
    workers: list[int] = []
    try:
        with ServeProcess(home, env={"DSEC_TIERS": "fncall"}) as srv:
            client = Client(srv.url, srv.api_key, timeout=120)

            def cycles(n: int) -> None:
                for i in range(n):
                    if i % 2:
                        r = client.run_code(f"print({i} * 2)", "python")
                        assert r.run.stdout == f"{i * 2}\n", r
                    else:
                        sb = Sandbox.create(tier="fncall", image="debian", client=client)
                        try:
                            assert sb.commands.run(f"echo {i}").stdout == f"{i}\n"
                        finally:
                            sb.kill()

            def zygotes() -> list[int]:
                out = []
                for p in child_pids(srv.proc.pid):
                    with contextlib.suppress(OSError):
                        if b"dsec_zygote" in Path(f"/proc/{p}/cmdline").read_bytes():
                            out.append(p)
                return out

            try:
                cycles(4)
                baseline = steady_footprint(srv)  # pools refilled
                cycles(30)
                grew = settle(srv, baseline)
                assert not grew, f"leaked: {grew}\nchildren: {describe(srv.proc.pid)}"

                # a zygote dies (here: killed) with its ready workers
                victim = zygotes()[0]
                orphans = child_pids(victim)
                assert orphans, "the pool had no ready workers"
                os.kill(victim, 9)
                deadline = time.monotonic() + budget(20)
                while time.monotonic() < deadline:
                    left = [p for p in orphans if (st := proc_stat(p)) and st.state == "Z"]
                    if not left and proc_stat(victim) is None:
                        break
                    time.sleep(0.1)
                assert not left, (
                    f"workers of a dead zygote stayed zombies: {describe(srv.proc.pid)}"
                )
                cycles(6)  # the tier recovers with a new pool
                workers = [w for z in zygotes() for w in child_pids(z)]
                assert workers
            finally:
                client.close()
        # the server stopped: its zygotes killed and reaped their workers on the way out
        deadline = time.monotonic() + budget(10)
        while time.monotonic() < deadline:
            zombies = [w for w in workers if (st := proc_stat(w)) and st.state == "Z"]
            if not zombies:
                break
            time.sleep(0.1)
        assert not zombies, f"workers left as zombies after the server stopped: {zombies}"
    finally:
        shutil.rmtree(home.parent, ignore_errors=True)
