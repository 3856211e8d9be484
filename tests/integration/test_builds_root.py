"""Image builds through a real node: ``ImageBuilder`` over an in-process ``EdgeAgent`` with
the container tier and networking (``dsec.server.embedded_edge``), root only.

Covers: a cold build then a fully cached one (no sandbox made), a changed middle step
(only what follows rebuilds), a failing RUN (step + output tail, nothing stored, no sandbox
left), a caller that stops reading (its sandbox is killed), a Dockerfile with COPY/ADD/ENV/
WORKDIR/USER/CMD whose image has the files, env and user, copies that must not break the
image's symlinks or directory modes, per-key caches, apt and pip through their presets, and
the SDK's ``Image.build`` through the real apiserver's ``POST /v1/builds``, and a start
command with a readiness check whose output is the sandbox's logs.
"""

from __future__ import annotations

import asyncio
import io
import secrets
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.isolation import subnet_host, worker_subnet
from tests.timing import budget

from dsec import AsyncClient, AsyncSandbox, BuildFailed, Image
from dsec.builds import BuildRequest, ImageConfig
from dsec.builds.engine import ImageBuilder
from dsec.builds.wire import BuildDone, BuildError
from dsec.errors import ImageNotFound, InvalidRequest, StartFailed
from dsec.models import (
    CreateSandboxRequest,
    KeyScope,
    ListSandboxesRequest,
    SandboxExecRequest,
    SandboxRef,
)
from dsec.privileged.mount import mount_points
from dsec.server import embedded_edge

pytestmark = [pytest.mark.root, pytest.mark.slow]

SUBNET = worker_subnet(229)  # a subnet of its own (tests/isolation.py)
GATEWAY = subnet_host(SUBNET, 1)


def _host_resolvers() -> list[str]:
    out = []
    for line in Path("/etc/resolv.conf").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver" and parts[1].count(".") == 3:
            out.append(parts[1])
    return out


@dataclass
class Node:
    edge: Any
    builder: ImageBuilder
    home: Path

    async def build(
        self, owner: str, req: BuildRequest | dict[str, Any], context: bytes = b""
    ) -> list[Any]:
        r = req if isinstance(req, BuildRequest) else BuildRequest.parse(req)
        return [ev async for ev in self.builder.build(owner, r, context)]

    async def made(self, owner: str) -> int:
        """Sandboxes ``owner`` ever had on this node (stopped ones included)."""
        req = ListSandboxesRequest(include_stopped=True)
        return len((await self.edge.list_sandboxes(req, owner)).sandboxes)

    async def live(self, owner: str) -> list[Any]:
        return list((await self.edge.list_sandboxes(ListSandboxesRequest(), owner)).sandboxes)

    async def sh(self, owner: str, image: str, cmd: str, **create: Any) -> str:
        sb = await self.edge.create_sandbox(CreateSandboxRequest(image=image, **create), owner)
        try:
            run = SandboxExecRequest(sandbox_id=sb.id, cmd=cmd, timeout_s=60)
            r = await self.edge.exec(run, owner)
        finally:
            await self.edge.kill_sandbox(SandboxRef(sandbox_id=sb.id), owner)
        assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
        return r.stdout


@pytest.fixture
async def node(tmp_path: Path, shared_layers: Path) -> AsyncIterator[Node]:
    home = tmp_path / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    options = {"subnet": SUBNET, "upstream_dns": _host_resolvers()}
    async with embedded_edge(home, tiers=["container"], network_options=options) as edge:
        yield Node(edge, edge.image_builder(), home)  # the edge's own: POST /v1/builds uses it
    assert mount_points(home / "sandboxes") == []


def owner_id() -> str:
    return "k" + secrets.token_hex(8)


def context(files: dict[str, bytes], mode: int = 0o644) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


RUN_ONE = "echo one > /one; cat /proc/sys/kernel/random/uuid > /nonce"
"""Its layer differs on every run (as most RUN layers do: new mtimes), for certain."""


def three_steps(name: str = "app") -> dict[str, Any]:
    return {
        "name": name,
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {"op": "run", "cmd": RUN_ONE},
            {"op": "copy", "src": ["app.txt"], "dest": "/app/"},
            {"op": "run", "cmd": "cat /app/app.txt > /two"},
        ],
    }


def done(events: list[Any]) -> BuildDone:
    last = events[-1]
    assert isinstance(last, BuildDone), last
    return last


def types(events: list[Any], step: int) -> list[str]:
    return [e.type for e in events if getattr(e, "step", None) == step]


async def test_cold_then_fully_cached_then_a_changed_middle_step(node: Node) -> None:
    owner = owner_id()
    cold = await node.build(owner, three_steps(), context({"app.txt": b"v1\n"}))
    d = done(cold)
    assert (d.built_steps, d.cached_steps) == (3, 0)
    assert await node.made(owner) == 3 and await node.live(owner) == []
    assert len(d.image.layers) == 4  # busybox + one layer per filesystem step
    assert await node.sh(owner, "app", "cat /one /two") == "one\nv1\n"

    warm = await node.build(owner, three_steps(), context({"app.txt": b"v1\n"}))
    w = done(warm)
    assert (w.built_steps, w.cached_steps) == (0, 3)
    assert await node.made(owner) == 4  # only the `sh` above: the build made no sandbox
    assert [types(warm, i) for i in (2, 3, 4)] == [["step", "cached", "step_done"]] * 3
    assert w.image.layers == d.image.layers

    changed = await node.build(owner, three_steps(), context({"app.txt": b"v2\n"}))
    c = done(changed)
    assert types(changed, 2) == ["step", "cached", "step_done"]
    assert "cached" not in types(changed, 3) and "cached" not in types(changed, 4)
    assert (c.built_steps, c.cached_steps) == (2, 1)
    assert await node.made(owner) == 4 + 2  # the copy's sandbox and the last run's
    assert c.image.layers[:2] == d.image.layers[:2] and c.image.layers[2:] != d.image.layers[2:]
    assert await node.sh(owner, "app", "cat /one /two") == "one\nv2\n"
    config = node.edge.layers.get_image("app", owner).meta
    assert config["build"]["cached_steps"] == 1 and config["source"] == "build"

    # the first RUN's entry goes stale: it rebuilds into a new layer, and the steps above it
    # (unchanged) must not reuse layers made on the old one
    for entry in node.builder.cache.entries(owner):
        if entry["step"] == f"RUN {RUN_ONE}":
            node.builder.cache.forget(owner, entry["key"])
    again = await node.build(owner, three_steps(), context({"app.txt": b"v2\n"}))
    a = done(again)
    assert (a.built_steps, a.cached_steps) == (3, 0)
    assert a.image.layers[1] != c.image.layers[1]
    assert await node.sh(owner, "app", "cat /one /two") == "one\nv2\n"


async def test_a_failing_run_names_its_step_keeps_its_output_and_stores_nothing(node: Node) -> None:
    owner = owner_id()
    layers_before = {x.digest for x in (await node.edge.list_layers(KeyScope(), owner)).layers}
    req = {
        "name": "broken",
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {"op": "env", "vars": {"WHO": "builder"}},
            {"op": "run", "cmd": "echo building as $WHO; echo oops >&2; exit 3"},
            {"op": "run", "cmd": "echo never"},
        ],
    }
    events = await node.build(owner, req)
    err = events[-1]
    assert isinstance(err, BuildError) and err.code == "build_failed"
    assert err.step == 3 and err.instruction == "RUN echo building as $WHO; echo oops >&2; exit 3"
    assert "building as builder" in err.output_tail and "oops" in err.output_tail
    assert err.details["exit_code"] == 3 and "exit code 3" in err.message
    assert not any(getattr(e, "step", None) == 4 for e in events)
    assert node.builder.cache.entries(owner) == []
    assert {
        x.digest for x in (await node.edge.list_layers(KeyScope(), owner)).layers
    } == layers_before
    with pytest.raises(ImageNotFound):
        node.edge.layers.get_image("broken", owner)
    assert await node.live(owner) == []


async def test_a_step_whose_sandbox_cannot_be_made_is_a_client_error(node: Node) -> None:
    owner = owner_id()
    req = {
        "name": "big-env",
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {"op": "env", "vars": {"BIG": "x" * 300_000}},  # more than a sandbox's 256 KiB
            {"op": "run", "cmd": "true"},
        ],
    }
    err = (await node.build(owner, req))[-1]
    assert isinstance(err, BuildError) and err.code == "invalid_request", err
    assert err.step == 3 and "environment" in err.message
    assert await node.made(owner) == 0


async def test_a_caller_that_stops_reading_leaves_no_sandbox(node: Node) -> None:
    owner = owner_id()
    req = BuildRequest.parse(
        {
            "name": "slow",
            "steps": [
                {"op": "from_image", "image": "busybox"},
                {"op": "run", "cmd": "echo started; sleep 60"},
            ],
        }
    )
    events = node.builder.build(owner, req)
    async for ev in events:
        if ev.type == "output":
            assert await node.live(owner) != []
            break
    await events.aclose()  # the client went away mid-step
    assert await node.live(owner) == []
    assert node.builder.cache.entries(owner) == []


DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM busybox
ARG GREETING=hello
ENV APP_HOME=/srv/app \\
    GREETING=${GREETING}
WORKDIR $APP_HOME
COPY --chown=sandbox:sandbox app/ ./
COPY --chmod=0755 run.sh /usr/local/bin/
ADD vendor.tar.gz /opt/vendor/
COPY <<EOF /etc/motd
welcome to $APP_HOME
EOF
USER sandbox
RUN echo "$GREETING from $(id -un) in $(pwd)" > $HOME/greeting.txt \
 && grep -c "nameserver @GATEWAY@" /etc/resolv.conf > $HOME/had-network
EXPOSE 8080
CMD ["/usr/local/bin/run.sh"]
""".replace("@GATEWAY@", GATEWAY)


def _dockerfile_context() -> bytes:
    vendor = io.BytesIO()
    with tarfile.open(fileobj=vendor, mode="w:gz") as tf:
        info = tarfile.TarInfo("lib/v.txt")
        info.size = 7
        tf.addfile(info, io.BytesIO(b"vendor\n"))
    buf = io.BytesIO()
    files = {
        "Dockerfile": (DOCKERFILE.encode(), 0o644),
        ".dockerignore": (b"app/secret.txt\n", 0o644),
        "app/main.py": (b"print('main')\n", 0o644),
        "app/secret.txt": (b"do not ship\n", 0o600),
        "run.sh": (b"#!/bin/sh\necho running in $(pwd) as $(id -un)\n", 0o644),
        "vendor.tar.gz": (vendor.getvalue(), 0o644),
    }
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_dockerfile_image_has_the_files_env_user_and_config(node: Node) -> None:
    owner = owner_id()
    req = BuildRequest.parse(
        {"name": "web:1", "dockerfile_path": "Dockerfile", "build_args": {"GREETING": "hi"}}
    )
    events = await node.build(owner, req, _dockerfile_context())
    image = done(events).image
    cfg = ImageConfig.from_meta(image.meta)
    assert cfg.env_dict() == {"APP_HOME": "/srv/app", "GREETING": "hi"}  # no ARG-only values
    assert (cfg.WorkingDir, cfg.User, cfg.Cmd) == ("/srv/app", "sandbox", ["/usr/local/bin/run.sh"])
    assert cfg.ExposedPorts == {"8080/tcp": {}}
    defaults = cfg.sandbox_defaults()
    out = await node.sh(
        owner,
        "web:1",
        "echo $APP_HOME $GREETING; id -un; pwd; cat /home/sandbox/greeting.txt; "
        "stat -c '%U:%G %a' /srv/app /srv/app/main.py /usr/local/bin/run.sh; "
        "cat /opt/vendor/lib/v.txt /etc/motd; test ! -e /srv/app/secret.txt && echo no-secret; "
        "/usr/local/bin/run.sh; cat /home/sandbox/had-network; "
        f"grep -c {GATEWAY} /etc/resolv.conf || true",
        **defaults,
    )
    assert out.splitlines() == [
        "/srv/app hi",
        "sandbox",
        "/srv/app",
        "hi from sandbox in /srv/app",
        "root:root 755",  # WORKDIR made it (root's), COPY --chown filled it
        "sandbox:sandbox 644",
        "root:root 755",
        "vendor",
        "welcome to /srv/app",
        "no-secret",
        "running in /srv/app as sandbox",
        "1",  # the Dockerfile's RUN had a network (the default debian + pypi presets) ...
        "0",  # ... and its sandbox's resolv.conf did not enter the image
    ]


async def test_a_sandbox_of_a_built_image_gets_its_config_by_itself(node: Node) -> None:
    owner = owner_id()
    req = {
        "name": "cfg",
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {"op": "env", "vars": {"FROM_IMAGE": "yes"}},
            {"op": "workdir", "path": "/home/sandbox"},
            {"op": "user", "user": "sandbox"},
        ],
    }
    done(await node.build(owner, req))
    out = await node.sh(owner, "cfg", "echo $FROM_IMAGE; pwd; id -un")
    assert out.splitlines() == ["yes", "/home/sandbox", "sandbox"]


async def test_copies_keep_the_image_symlinks_modes_and_tmp(node: Node) -> None:
    owner = owner_id()
    req = {
        "name": "links",
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {
                "op": "run",
                "cmd": "mkdir -p /opt/real && ln -s real /opt/link && chmod 1777 /opt/real "
                "&& echo app:x:1234:1234::/home/app:/bin/sh >> /etc/passwd "
                "&& mkdir -m 700 /home/app && chown 1234:1234 /home/app",
            },
            {"op": "copy", "src": ["f.txt"], "dest": "/opt/link/"},
            {"op": "copy", "src": ["f.txt"], "dest": "/tmp/kept.txt"},
            {"op": "copy", "src": ["f.txt"], "dest": "/home/app/f.txt", "chown": "app"},
            {"op": "run", "cmd": "cat /tmp/kept.txt /opt/real/f.txt > /both"},
        ],
    }
    done(await node.build(owner, req, context({"f.txt": b"data\n"})))
    out = await node.sh(
        owner,
        "links",
        "readlink /opt/link; stat -c '%a' /opt/real /tmp; cat /opt/real/f.txt /both; "
        "stat -c '%u:%g %U %a' /home/app /home/app/f.txt; stat -c %Y /tmp/kept.txt",
    )
    lines = out.splitlines()
    assert lines[:6] == ["real", "1777", "1777", "data", "data", "data"]
    assert lines[6] == "1234:1234 app 700"  # the image's home keeps its owner and mode
    assert lines[7] == "1234:1234 app 644"  # --chown=app: the user's uid, and it as the gid
    assert lines[8] == "1700000000"  # the context's mtime


async def test_another_key_neither_sees_nor_hits_the_first_keys_cache(node: Node) -> None:
    first, second = owner_id(), owner_id()
    done(await node.build(first, three_steps("shared-name"), context({"app.txt": b"x\n"})))
    keys = [e["key"] for e in node.builder.cache.entries(first)]
    assert len(keys) == 3
    assert all(node.builder.cache.lookup(second, k) is None for k in keys)
    assert node.builder.cache.entries(second) == []
    made = await node.made(second)
    events = await node.build(second, three_steps("shared-name"), context({"app.txt": b"x\n"}))
    d = done(events)
    assert (d.built_steps, d.cached_steps) == (3, 0) and not any(e.type == "cached" for e in events)
    assert await node.made(second) == made + 3
    assert node.edge.layers.get_image("shared-name", first).owner == first
    assert node.edge.layers.get_image("shared-name", second).owner == second
    # the first key's layers are still not the second key's to name by digest
    theirs = node.edge.layers.get_image("shared-name", first).layers[1]
    assert not node.edge.layers.layer_visible(theirs, second)


@pytest.mark.debian
async def test_apt_install_through_the_debian_preset(node: Node) -> None:
    owner = owner_id()
    image = Image.from_image("debian").apt_install("hello").run("hello > /greeting")
    events = await node.build(owner, image.request("hello:1"))
    out = [e.data for e in events if e.type == "output"]
    assert any("Setting up hello" in chunk for chunk in out), "".join(out)[-2000:]
    done(events)
    assert await node.sh(owner, "hello:1", "cat /greeting; hello") == "Hello, world!\n" * 2
    # the lists apt-get update fetched are not in the image
    assert (
        await node.sh(owner, "hello:1", "ls /var/lib/apt/lists | grep -c Packages || true") == "0\n"
    )


@pytest.mark.debian
async def test_pip_install_through_the_pypi_preset(node: Node) -> None:
    # This machine's egress intercepts TLS with its own CA, which the host trusts and a
    # Debian image does not: the image gets the host's bundle, as a user behind such a
    # proxy would do (plain-HTTP apt needs nothing of the kind).
    image = (
        Image.from_image("debian")
        .apt_install("python3-pip")
        .copy("/etc/ssl/certs/ca-certificates.crt", "/etc/host-ca.crt")
        .env(PIP_CERT="/etc/host-ca.crt")
        .pip_install("six==1.16.0")
        .run("python3 -c 'import six; print(six.__version__)' > /six")
    )
    events = await node.build(owner := owner_id(), image.request("pip:1"), image.context())
    assert isinstance(events[-1], BuildDone), events[-1]
    assert await node.sh(owner, "pip:1", "cat /six") == "1.16.0\n"


# --- the SDK through POST /v1/builds (the real apiserver app over the node) --------------


def api(node: Node) -> tuple[httpx.AsyncBaseTransport, str, str]:
    """(transport, key, owner id) of the real apiserver in front of ``node``'s edge."""
    from dsec.apiserver.app import create_app
    from dsec.apiserver.auth import StaticKeys

    key = "dsec_test_" + secrets.token_hex(8)
    keys = StaticKeys([key, OTHER_KEY])
    app = create_app(node.edge, keys)
    owner = keys.verify(key)
    assert owner is not None
    return httpx.ASGITransport(app=app), key, owner


OTHER_KEY = "dsec_test_other_" + secrets.token_hex(8)


async def test_sdk_image_build_through_the_wire(node: Node, tmp_path: Path) -> None:
    transport, key, owner = api(node)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print('from the sdk')\n")
    seen: list[str] = []
    async with AsyncClient("http://dsec.test", key, transport=transport) as client:
        image = (
            Image.from_image("busybox")
            .copy(tmp_path / "src", "/work/")
            .env(MODE="test")
            .workdir("/work")
            .run("ls > listing; echo $MODE >> listing")
        )
        info = await image.build_async(
            "sdk:1", client=client, on_event=lambda e: seen.append(e.type)
        )
        assert info.name == "sdk:1" and info.owner == owner
        assert seen[0] == "start" and seen[-1] == "done"
        again = await image.build_async("sdk:1", client=client)
        assert again.layers == info.layers
        with pytest.raises(BuildFailed) as failed:
            await (
                Image.from_image("busybox")
                .run("echo nope; exit 4")
                .build_async("sdk:bad", client=client)
            )
        assert failed.value.details["step"] == 2 and "nope" in failed.value.details["output_tail"]
        # a context of its own (tmp_path also holds the node's home, whose sandboxes change)
        (tmp_path / "df").mkdir()
        (tmp_path / "df" / "Dockerfile").write_text("FROM busybox\nVOLUME /data\n")
        with pytest.raises(InvalidRequest) as refused:
            await Image.from_dockerfile(tmp_path / "df" / "Dockerfile").build_async(
                "df", client=client
            )
        assert refused.value.details["line"] == 2
    # the key's builds are listed, newest first: the failed one, the cached rebuild, the first
    # (a refusal before the start is no build); another key sees none of them
    async with httpx.AsyncClient(transport=transport, base_url="http://dsec.test") as http:
        listed = (await http.get("/v1/builds", headers={"authorization": f"Bearer {key}"})).json()
        states = [(b["name"], b["state"]) for b in listed["builds"]]
        assert states == [("sdk:bad", "failed"), ("sdk:1", "done"), ("sdk:1", "done")]
        bad, cached, first = listed["builds"]
        assert bad["error"]["code"] == "build_failed" and bad["step"] == 2 and bad["log"] is None
        assert cached["built_steps"] == 0 and cached["cached_steps"] == first["built_steps"] == 2
        one = await http.get(
            f"/v1/builds/{bad['build_id']}", headers={"authorization": f"Bearer {key}"}
        )
        assert one.status_code == 200 and "nope\n" in one.json()["log"]
        other = {"authorization": f"Bearer {OTHER_KEY}"}
        assert (await http.get("/v1/builds", headers=other)).json() == {"builds": []}
        r = await http.get(f"/v1/builds/{bad['build_id']}", headers=other)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert await node.sh(owner, "sdk:1", "cat /work/listing") == "listing\nmain.py\ntest\n"
    assert await node.live(owner) == []


async def test_concurrent_builds_of_one_key_share_each_step(node: Node) -> None:
    owner = owner_id()
    results = await asyncio.gather(
        node.build(owner, three_steps("c1"), context({"app.txt": b"c\n"})),
        node.build(owner, three_steps("c2"), context({"app.txt": b"c\n"})),
    )
    built = sorted(done(r).built_steps for r in results)
    assert built == [0, 3]  # the second waited for each step and hit the cache
    assert done(results[0]).image.layers == done(results[1]).image.layers


async def test_a_start_command_runs_with_the_sandbox_and_its_output_is_the_logs(
    node: Node,
) -> None:
    """A built image's start command (a loop that says it is up, then prints on SIGUSR1)
    and readiness check: the creation returns once the check passes; its output is the
    sandbox's logs through the API; a command that fails fails the creation."""
    transport, key, owner = api(node)
    async with AsyncClient("http://dsec.test", key, transport=transport) as client:
        image = (
            Image.from_image("busybox")
            .workdir("/srv")
            .env(GREETING="hello")
            .start_cmd(
                'echo "$GREETING from $(pwd)"; echo warming >&2; sleep 0.5; '
                "echo $$ > /tmp/pid; mv /tmp/pid /tmp/up; "
                "trap 'echo ping' USR1; while :; do sleep 0.1; done",
                ready_cmd="test -f /tmp/up",
                ready_timeout=20,
            )
        )
        info = await image.build_async("srv:1", client=client)
        assert info.meta["start"]["ready_cmd"] == "test -f /tmp/up"
        sb = await AsyncSandbox.create(client=client, image="srv:1")
        try:
            assert (await sb.commands.run("test -f /tmp/up")).exit_code == 0  # ready already
            assert (await sb.commands.run("kill -USR1 $(cat /tmp/up)")).exit_code == 0
            async with asyncio.timeout(budget(5)):  # the trap's echo reaches the logs
                while "ping" not in (
                    text := "".join([x.data async for x in sb.logs() if x.stream == "stdout"])
                ):
                    await asyncio.sleep(0.05)
            assert text.startswith("hello from /srv\n")
            errs = [x.data async for x in sb.logs() if x.stream == "stderr"]
            assert "".join(errs) == "warming\n"
        finally:
            await sb.kill()
        bad = (
            await Image.from_image("busybox")
            .start_cmd("echo cannot start >&2; exit 9", ready_cmd="false", ready_timeout=20)
            .build_async("srv:bad", client=client)
        )
        assert bad.meta["start"]["cmd"] == "echo cannot start >&2; exit 9"
        with pytest.raises(StartFailed) as failed:
            await AsyncSandbox.create(client=client, image="srv:bad")
        assert failed.value.details["exit_code"] == 9
        assert "cannot start" in failed.value.details["logs_tail"]
    assert await node.live(owner) == []


async def test_a_run_step_keeps_what_it_wrote_in_tmp_as_docker_does(node: Node) -> None:
    """Build layers are snapshots without the default scrub: ``/tmp`` and ``/var/tmp``
    files of a RUN stay (a user's snapshot still leaves them out)."""
    owner = owner_id()
    req = {
        "name": "tmpkeep",
        "steps": [
            {"op": "from_image", "image": "busybox"},
            {"op": "run", "cmd": "echo t > /tmp/t && mkdir -p /var/tmp/d && echo v > /var/tmp/d/v"},
        ],
    }
    done(await node.build(owner, req))
    assert await node.sh(owner, "tmpkeep", "cat /tmp/t /var/tmp/d/v") == "t\nv\n"
