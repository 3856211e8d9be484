"""Edge lifecycle on a real node: mass create/kill leaves nothing behind, and a restarted
server reconciles its registry with what actually runs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from tests.timing import budget

from dsec import AsyncSandbox, Sandbox
from dsec.apiserver.auth import KeyStore, owner_id
from dsec.errors import SandboxStopped
from dsec.layers.mounts import scope_name
from dsec.privileged.mount import mount_points

pytestmark = [pytest.mark.root]


def _cgroup_label(path: str) -> str:
    """The sandbox a cgroup belongs to by its label (a claimed warm container's cgroups keep
    the warm id as their name), or ''."""
    try:
        return os.getxattr(path, "trusted.dsec.sandbox").decode()
    except OSError:
        return ""


def _cgroup_dirs_mentioning(ids: set[str]) -> list[str]:
    found = []
    for ctrl in ("memory", "pids", "cpu", "freezer"):
        root = Path("/sys/fs/cgroup") / ctrl
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                path = os.path.join(dirpath, d)
                if any(i in d for i in ids) or _cgroup_label(path) in ids:
                    found.append(path)
    return found


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (neither gone nor a zombie)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.append(pid)
    return running


def _processes_mentioning(ids: set[str]) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cgroups = (p / "cgroup").read_text()
            text = cgroups + (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        memory = [ln.split(":", 2)[2] for ln in cgroups.splitlines() if ":memory:" in ln]
        label = _cgroup_label(f"/sys/fs/cgroup/memory{memory[0]}") if memory else ""
        if any(i in text for i in ids) or label in ids:
            out.append(int(p.name))
    return out


async def _refills_done(pool) -> None:  # type: ignore[no-untyped-def]
    """Wait until no key of the warm pool has a refill in flight."""
    while tasks := [k.task for k in pool._keys.values() if k.task and not k.task.done()]:
        await asyncio.gather(*tasks, return_exceptions=True)


def drain_warm_pool(live_server) -> None:  # type: ignore[no-untyped-def]
    """Make the container tier's warm pool give back every warm container it holds (as it
    does for an idle key or under memory pressure)."""
    rt = live_server.edge.runtimes.get("container")
    if rt is None:
        return
    idle_s = rt.pool.config.idle_s
    rt.pool.config.idle_s = -1.0  # every key counts as idle
    try:
        live_server.call(rt.pool.trim())
    finally:
        rt.pool.config.idle_s = idle_s


@pytest.mark.slow
def test_500_sandboxes_leave_nothing_behind(live_server) -> None:  # type: ignore[no-untyped-def]
    home = live_server.home
    kw = {
        "tier": "container",
        "image": "busybox",
        "memory_mb": 64,
        "url": live_server.url,
        "api_key": live_server.api_key,
    }
    drain_warm_pool(live_server)  # warm containers are not leaks: counted with none held
    mounts_before = len(mount_points(home))
    ids: set[str] = set()

    async def churn() -> None:
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem:
                sb = await AsyncSandbox.create(**kw)
                ids.add(sb.id)
                if i % 10 == 0:  # some of them run something first
                    r = await sb.commands.run("echo x > /tmp/x; cat /tmp/x")
                    assert r.stdout == "x\n"
                await sb.kill()

        await asyncio.gather(*(one(i) for i in range(500)))

    t0 = time.monotonic()
    asyncio.run(churn())
    took = time.monotonic() - t0
    assert len(ids) == 500
    live_server.call(live_server.edge.settle())  # kills answer before their teardown ends
    rt = live_server.edge.runtimes.get("container")
    if rt is not None:  # the pool's refills in flight finish (the drain below takes them)
        live_server.call(_refills_done(rt.pool), timeout=budget(120))
    drain_warm_pool(live_server)
    # below the sandboxes' own tmpfs (mounted while the server runs)
    leaked_mounts = [m for m in mount_points(home / "sandboxes") if m != home / "sandboxes"]
    assert leaked_mounts == [], leaked_mounts[:5]
    assert len(mount_points(home)) <= mounts_before + 0, "layer mounts should be released too"
    leftover_dirs = [d for d in (home / "sandboxes").iterdir() if d.name in ids]
    assert leftover_dirs == []
    assert _cgroup_dirs_mentioning(ids) == []
    assert _processes_mentioning(ids) == []
    print(f"500 create+kill cycles in {took:.1f} s ({500 / took:.0f}/s)")


def test_restart_reconcile_real_process(tmp_path: Path, shared_layers: Path) -> None:
    """Run `dsec serve` as a real process, SIGKILL it, restart it: live sandboxes stay usable,
    a sandbox whose processes died meanwhile is reported stopped and cleaned up, and so are
    the layer mounts only it used (those of its key, which has no other sandbox)."""
    import subprocess
    import sys

    from tests.conftest import free_port, wait_until

    home = tmp_path / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DSEC_HOME": str(home)}

    def start() -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsec.cli.main",
                "serve",
                "--port",
                str(port),
                "--home",
                str(home),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(home / "serve.log", "ab"),
        )
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return p
            except httpx.HTTPError:
                pass
            if p.poll() is not None:
                raise AssertionError((home / "serve.log").read_text()[-3000:])
            time.sleep(0.1)
        raise AssertionError("server did not start")

    server = start()
    try:
        key = (home / "api_key").read_text().strip()
        kw = {"tier": "container", "image": "busybox", "url": url, "api_key": key}
        alive = Sandbox.create(**kw)
        other = KeyStore(home).create_key("restart-other")
        doomed = Sandbox.create(**{**kw, "api_key": other})
        # with layer mounts per key (the default), the doomed key's own
        scope = scope_name(owner_id(other))
        assert list((home / "mnt" / "layers").glob(f"{scope}-*"))
        alive.files.write("/tmp/state.txt", "survives restart")
        # by its cgroups (named by its id, or labelled with it when it came from the pool)
        doomed_pids = _processes_mentioning({doomed.id})
        assert doomed_pids, "the sandbox's processes should be findable by its cgroup"
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        for pid in doomed_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_until(lambda: not _alive(doomed_pids), timeout_s=10)  # dead before restart
        server = start()
        again = Sandbox.connect(alive.id, url=url, api_key=key)
        assert again.info.state == "running"
        assert again.files.read("/tmp/state.txt") == b"survives restart"
        assert again.commands.run("echo after-restart").stdout == "after-restart\n"
        gone = Sandbox.connect(doomed.id, url=url, api_key=other)
        assert gone.info.state == "stopped"
        with pytest.raises(SandboxStopped):
            gone.commands.run("true")
        assert not (home / "sandboxes" / doomed.id).exists()
        assert list((home / "mnt" / "layers").glob(f"{scope}-*")) == []  # unmounted, removed
        again.kill()  # answers before its teardown (cgroups, mounts) has finished
        assert wait_until(lambda: _cgroup_dirs_mentioning({alive.id, doomed.id}) == [])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        # leave nothing behind even if asserts failed: kill leftovers via a fresh edge
        _cleanup_home(home)


def _cleanup_home(home: Path) -> None:
    async def go() -> None:
        from dsec.server import embedded_edge

        async with embedded_edge(home, tiers=["container"]) as edge:
            await edge.close(kill_sandboxes=True)

    try:
        asyncio.run(go())
    except Exception:
        pass
