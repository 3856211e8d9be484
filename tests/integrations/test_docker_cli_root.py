"""``dsec-docker`` (and ``dsec docker``) against a real server: every verb, docker's exit
codes and output formats, bad input, and names scoped to the API key; ``-p`` host ports
carried to a server in the sandbox, ``--network``, capability and security options as a
sandbox really runs them."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import LiveServer
from tests.timing import budget

from dsec import Sandbox

pytestmark = [pytest.mark.root]


class Docker:
    def __init__(self, exe: Path, env: dict[str, str]) -> None:
        self.exe = exe
        self.env = env

    def __call__(
        self, *args: str, input: bytes | str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        data = input.encode() if isinstance(input, str) else input
        p = subprocess.run(
            [str(self.exe), *args],
            input=data,
            capture_output=True,
            timeout=180,
            env={**self.env, **(env or {})},
        )
        return subprocess.CompletedProcess(
            p.args,
            p.returncode,
            p.stdout.decode(errors="replace"),
            p.stderr.decode(errors="replace"),
        )

    def raw(self, *args: str) -> bytes:
        return subprocess.run(
            [str(self.exe), *args], capture_output=True, timeout=180, env=self.env, check=True
        ).stdout


@pytest.fixture
def docker(docker_exe: Path, child_env: dict[str, str]) -> Docker:
    return Docker(docker_exe, child_env)


@pytest.fixture
def container(docker: Docker) -> Iterator[str]:
    name = f"c-{uuid.uuid4().hex[:8]}"
    r = docker(
        "run", "-d", "--name", name, "-w", "/work", "-e", "BASE=1", "busybox", "sleep", "600"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("sb-")
    yield name
    docker("rm", "-f", name)


def test_run_foreground(docker: Docker) -> None:
    r = docker("run", "--rm", "busybox", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
    r = docker(
        "run",
        "--rm",
        "-e",
        "A=1",
        "-e",
        "HOSTV",
        "-w",
        "/made/here",
        "busybox",
        "sh",
        "-c",
        "echo $A $HOSTV; pwd",
        env={"HOSTV": "from-host"},
    )
    assert (r.returncode, r.stdout) == (0, "1 from-host\n/made/here\n")
    r = docker("run", "--rm", "-i", "busybox", "sh", "-c", "wc -c; cat", input="hello\n")
    assert r.stdout.split() == ["6"]
    r = docker("run", "--rm", "-i", "busybox", "cat", input="piped through\n")
    assert r.stdout == "piped through\n"
    r = docker("run", "--rm", "busybox", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137


def test_run_errors(docker: Docker) -> None:
    r = docker("run", "--rm", "busybox", "no-such-command")
    assert r.returncode == 127 and "executable file not found in $PATH" in r.stderr
    r = docker("run", "--rm", "busybox", "/etc/passwd")
    assert r.returncode == 126 and "permission denied" in r.stderr
    r = docker("run", "--rm", "no-such-image", "true")
    assert r.returncode == 125 and "Unable to find image 'no-such-image'" in r.stderr
    r = docker("run", "-v", "/tmp:/tmp", "busybox", "true")
    assert r.returncode == 125 and "unsupported flag: -v" in r.stderr
    r = docker("run", "-t", "busybox", "true")
    assert r.returncode == 125 and "-t" in r.stderr
    r = docker("run", "-x", "busybox")
    assert r.returncode == 125 and "'x' in -x" in r.stderr
    r = docker("run")
    assert r.returncode == 125 and "requires at least 1 argument" in r.stderr
    r = docker("run", "--name", "bad/name", "busybox", "true")
    assert r.returncode == 125 and "Invalid container name" in r.stderr
    r = docker("run", "--network", "host", "busybox", "true")
    assert r.returncode == 125 and "network" in r.stderr
    r = docker("run", "--cpus", "lots", "busybox", "true")
    assert r.returncode == 125 and "--cpus" in r.stderr
    r = docker("frobnicate")
    assert r.returncode == 1 and "is not a docker command" in r.stderr


def test_name_conflict_and_resources(docker: Docker, container: str, sdk_env: LiveServer) -> None:
    r = docker("run", "-d", "--name", container, "busybox", "sleep", "1")
    assert r.returncode == 125 and "is already in use" in r.stderr
    name = f"res-{uuid.uuid4().hex[:8]}"
    r = docker(
        "run",
        "-d",
        "--name",
        name,
        "--cpus",
        "0.5",
        "-m",
        "64m",
        "--runtime",
        "container",
        "-l",
        "team=rl",
        "busybox",
        "sleep",
        "60",
    )
    assert r.returncode == 0, r.stderr
    [info] = Sandbox.list(labels={"docker.name": name})
    assert (info.cpu, info.memory_mb, info.tier, info.labels["team"]) == (
        0.5,
        64,
        "container",
        "rl",
    )
    assert docker("rm", "-f", name).returncode == 0


def test_exec(docker: Docker, container: str) -> None:
    r = docker("exec", container, "sh", "-c", "pwd; echo $BASE")
    assert (r.returncode, r.stdout) == (0, "/work\n1\n")
    r = docker("exec", "-w", "/tmp", "-e", "X=2", container, "sh", "-c", "pwd; echo $X; exit 4")
    assert (r.returncode, r.stdout) == (4, "/tmp\n2\n")
    r = docker(
        "exec", "-i", container, "sh", "-c", "cat > /work/in.txt; wc -c < /work/in.txt", input="abc"
    )
    assert r.stdout.strip() == "3"
    r = docker("exec", container, "cat", "/work/in.txt")
    assert r.stdout == "abc"
    r = docker("exec", container, "cat")  # no -i: empty stdin
    assert (r.returncode, r.stdout) == (0, "")
    r = docker("exec", container, "no-such-command")
    assert r.returncode == 126 and "executable file not found" in r.stderr
    r = docker("exec", "-w", "/no/such/dir", container, "pwd")
    assert r.returncode == 126 and "chdir" in r.stderr
    r = docker("exec", "no-such-container", "true")
    assert r.returncode == 1 and "No such container: no-such-container" in r.stderr
    r = docker("exec", container)
    assert r.returncode == 125 and "requires at least 2 arguments" in r.stderr
    r = docker("exec", "-d", container, "sh", "-c", "sleep 1; echo done > /work/bg.txt")
    assert r.returncode == 0
    polls = int(budget(10) / 0.05)  # the detached command goes on after its answer
    wait = f"n=0; until [ -s /work/bg.txt ] || [ $n -gt {polls} ]; do sleep 0.05; n=$((n+1)); done"
    r = docker("exec", container, "sh", "-c", f"{wait}; cat /work/bg.txt")
    assert r.stdout == "done\n"
    # the container's id works too, and a unique prefix of it
    cid = docker("ps", "--format", "{{.ID}} {{.Names}}").stdout
    full = next(line.split()[0] for line in cid.splitlines() if line.endswith(container))
    assert docker("exec", full, "true").returncode == 0
    assert docker("exec", full[:-2], "true").returncode == 0


def test_ps_formats(docker: Docker, container: str) -> None:
    r = docker("ps")
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "CONTAINER",
        "ID",
        "IMAGE",
        "COMMAND",
        "CREATED",
        "STATUS",
        "PORTS",
        "NAMES",
    ]
    mine = next(line for line in lines if line.endswith(container))
    assert '"sleep 600"' in mine and " Up " in mine and "busybox" in mine
    # columns are aligned: each header starts where its cells start
    assert mine.index("busybox") == lines[0].index("IMAGE")
    ids = docker("ps", "-q").stdout.split()
    assert all(i.startswith("sb-") for i in ids) and len(ids) == len(lines) - 1
    r = docker("ps", "--format", '{{.Names}}|{{.Image}}|{{.State}}|{{.Label "docker.name"}}')
    assert f"{container}|busybox|running|{container}" in r.stdout.splitlines()
    rows = [json.loads(line) for line in docker("ps", "--format", "{{json .}}").stdout.splitlines()]
    row = next(x for x in rows if x["Names"] == container)
    assert row["Status"].startswith("Up") and row["Command"] == '"sleep 600"'
    r = docker("ps", "--format", "table {{.Names}}\\t{{.Status}}")
    assert r.stdout.splitlines()[0].split() == ["NAMES", "STATUS"]
    r = docker("ps", "--format", "{{.Nope}}")
    assert r.returncode == 125 and "<.Nope>: can't evaluate field Nope" in r.stderr
    r = docker("ps", "--filter", "name=x")
    assert r.returncode == 125 and "--filter" in r.stderr


def test_stop_and_rm(docker: Docker) -> None:
    name = f"s-{uuid.uuid4().hex[:8]}"
    assert docker("run", "-d", "--name", name, "busybox", "sleep", "600").returncode == 0
    r = docker("rm", name)
    assert r.returncode == 1 and "container is running" in r.stderr
    r = docker("stop", name)
    assert (r.returncode, r.stdout) == (0, f"{name}\n")
    assert name not in docker("ps").stdout
    exited = next(line for line in docker("ps", "-a").stdout.splitlines() if line.endswith(name))
    assert "Exited" in exited
    assert (
        docker("ps", "-a", "--format", "{{.State}} {{.Names}}").stdout.count(f"exited {name}") == 1
    )
    assert docker("rm", name).returncode == 0
    r = docker("stop", "no-such-container")
    assert r.returncode == 1 and "No such container" in r.stderr
    r = docker("rm", "-f", "no-such-container")
    assert r.returncode == 1 and "No such container" in r.stderr
    # --rm: once stopped the container is gone, as docker removes it
    name2 = f"r-{uuid.uuid4().hex[:8]}"
    assert docker("run", "-d", "--rm", "--name", name2, "busybox", "sleep", "600").returncode == 0
    r = docker("rm", "-f", name2)
    assert (r.returncode, r.stdout) == (0, f"{name2}\n")
    assert name2 not in docker("ps", "-a").stdout
    r = docker("rm", name2)
    assert r.returncode == 1 and "No such container" in r.stderr
    assert docker("stop").returncode == 125


def test_pull(docker: Docker) -> None:
    r = docker("pull", "busybox")
    assert r.returncode == 0 and r.stdout.strip().endswith("busybox")
    assert docker("pull", "-q", "busybox:latest").stdout == "busybox\n"
    assert docker("pull", "docker.io/library/busybox").returncode == 0
    r = docker("pull", "no-such-image")
    assert r.returncode == 1 and "pull access denied" in r.stderr
    assert docker("pull").returncode == 125


def test_cp_both_ways(docker: Docker, container: str, tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_bytes(b"\x00binary\xff")
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.txt").write_text("b")
    # host -> container: a file to a path, into a directory, a tree, a tree's contents
    assert docker("cp", str(tmp_path / "f.txt"), f"{container}:/work/copy.bin").returncode == 0
    assert docker("cp", str(tmp_path / "f.txt"), f"{container}:/tmp").returncode == 0
    assert docker("cp", str(src), f"{container}:/work/newtree").returncode == 0
    assert docker("exec", container, "mkdir", "-p", "/work/exists").returncode == 0
    assert docker("cp", str(src), f"{container}:/work/exists").returncode == 0
    assert docker("cp", f"{src}/.", f"{container}:/work/exists").returncode == 0
    r = docker(
        "exec",
        container,
        "sh",
        "-c",
        "cat /work/newtree/a.txt /work/newtree/sub/b.txt /work/exists/tree/a.txt "
        "/work/exists/a.txt; echo; wc -c < /work/copy.bin; wc -c < /tmp/f.txt",
    )
    assert r.stdout.split() == ["abaa", "8", "8"]
    # container -> host
    out = tmp_path / "out"
    out.mkdir()
    assert docker("cp", f"{container}:/work/copy.bin", str(out / "back.bin")).returncode == 0
    assert (out / "back.bin").read_bytes() == b"\x00binary\xff"
    assert docker("cp", f"{container}:/work/copy.bin", str(out)).returncode == 0
    assert (out / "copy.bin").read_bytes() == b"\x00binary\xff"
    assert docker("cp", f"{container}:/work/newtree", str(out)).returncode == 0
    assert (out / "newtree" / "sub" / "b.txt").read_text() == "b"
    assert docker("cp", f"{container}:/work/newtree", str(out / "fresh")).returncode == 0
    assert (out / "fresh" / "a.txt").read_text() == "a"
    # tar streams: - as destination (to stdout) and as source (from stdin)
    data = docker.raw("cp", f"{container}:/work/newtree", "-")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert "newtree/sub/b.txt" in tar.getnames()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("from-stdin.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"tar"))
    assert docker("cp", "-", f"{container}:/work", input=buf.getvalue()).returncode == 0
    assert docker("exec", container, "cat", "/work/from-stdin.txt").stdout == "tar"
    # errors
    r = docker("cp", f"{container}:/no/such/file", str(out))
    assert r.returncode == 1 and "Could not find the file /no/such/file" in r.stderr
    r = docker("cp", str(tmp_path / "missing"), f"{container}:/work")
    assert r.returncode == 1 and "no such file or directory" in r.stderr
    r = docker("cp", str(tmp_path / "f.txt"), str(out))
    assert r.returncode == 125 and "must specify at least one container" in r.stderr
    r = docker("cp", str(src), f"{container}:/work/copy.bin")
    assert r.returncode == 1 and "cannot copy a directory to a file" in r.stderr
    r = docker("cp", "-a", str(src), f"{container}:/work")
    assert r.returncode == 125 and "-a" in r.stderr


def test_names_belong_to_the_api_key(docker: Docker, container: str, sdk_env: LiveServer) -> None:
    other = {"DSEC_API_KEY": sdk_env.keys.create_key("docker-cli-test")}
    assert container not in docker("ps", "-a", env=other).stdout
    r = docker("exec", container, "true", env=other)
    assert r.returncode == 1 and "No such container" in r.stderr
    # the other key may use the same name for its own container
    r = docker("run", "--rm", "--name", container, "busybox", "echo", "mine", env=other)
    assert (r.returncode, r.stdout) == (0, "mine\n")


def test_dsec_docker_subcommand(child_env: dict[str, str], container: str) -> None:
    """The same CLI mounted in the ``dsec`` command (``dsec docker ...``)."""
    r = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "docker", "exec", "-w", "/tmp", container, "pwd"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    assert (r.returncode, r.stdout) == (0, "/tmp\n")
    r = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "docker", "run", "--bogus", "busybox"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    assert r.returncode == 125 and "--bogus" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "docker", "exec", "--help"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=120,
    )
    assert r.returncode == 0 and "docker exec" in r.stdout


def _fetch(url: str) -> str:
    """The body at ``url`` once the sandbox's server answers (started in the background)."""
    deadline = time.monotonic() + budget(30)
    while True:
        try:
            with urllib.request.urlopen(url, timeout=budget(10)) as r:
                return str(r.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def published(docker: Docker, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A debian container serving /srv on 8000, published at 127.0.0.1:<any>."""
    docker.env["DSEC_DOCKER_STATE"] = str(tmp_path / "state")
    name = f"web-{uuid.uuid4().hex[:8]}"
    r = docker(
        "run", "-d", "--name", name, "-p", "127.0.0.1::8000", "--entrypoint", "sh", "debian",
        "-c", "mkdir -p /srv && echo served > /srv/i.txt && exec python3 -m http.server -d /srv 8000",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = docker("port", name, "8000/tcp")
    assert r.returncode == 0, r.stderr
    host, _, port = r.stdout.strip().partition(":")
    assert host == "127.0.0.1" and port.isdigit()
    yield name, int(port)
    docker("rm", "-f", name)


def test_publish_port_and_inspect(docker: Docker, published: tuple[str, int]) -> None:
    name, port = published
    assert _fetch(f"http://127.0.0.1:{port}/i.txt") == "served\n"
    assert docker("port", name).stdout == f"8000/tcp -> 127.0.0.1:{port}\n"
    r = docker("port", name, "9000")
    assert r.returncode == 1 and f"No public port '9000/tcp' published for {name}" in r.stderr
    fmt = '{{(index (index .NetworkSettings.Ports "8000/tcp") 0).HostPort}} {{.State.Running}} {{.Path}}'
    assert docker("inspect", "-f", fmt, name).stdout == f"{port} true sh\n"
    assert f"127.0.0.1:{port}->8000/tcp" in docker("ps", "--format", "{{.Ports}}").stdout
    # the host port is taken: a second run asking for it fails as docker's, makes nothing
    other = f"busy-{uuid.uuid4().hex[:8]}"
    r = docker("run", "-d", "--name", other, "-p", f"127.0.0.1:{port}:80", "busybox", "sleep", "60")
    assert r.returncode == 125 and "port is already allocated" in r.stderr
    assert other not in docker("ps", "-a", "--format", "{{.Names}}").stdout
    # rm: the sandbox and its forwarder end, the port is free when rm returns
    assert docker("rm", "-f", name).returncode == 0
    assert _closed(port)
    assert not list(Path(docker.env["DSEC_DOCKER_STATE"]).iterdir())  # pid file, empty log
    assert docker("port", name).stdout == ""  # an exited container publishes nothing
    assert docker("port", name, "8000").returncode == 1


def test_published_port_ends_with_a_sandbox_killed_elsewhere(
    docker: Docker, published: tuple[str, int]
) -> None:
    """Killed by the SDK (or a TTL): the forwarder sees the sandbox stopped and exits."""
    name, port = published
    [info] = Sandbox.list(labels={"docker.name": name})
    Sandbox.connect(info.id).kill()
    deadline = time.monotonic() + budget(30)
    while not _closed(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _closed(port)


def test_run_network_capabilities_and_entrypoint(docker: Docker, sdk_env: LiveServer) -> None:
    name = f"n-{uuid.uuid4().hex[:8]}"
    r = docker(
        "run", "--rm", "--name", name, "--network", "bridge", "--cap-drop", "NET_RAW",
        "--cap-add", "CHOWN", "--security-opt", "no-new-privileges", "--sysctl",
        "net.ipv6.conf.all.disable_ipv6=1", "--entrypoint", "sh", "busybox", "-c",
        "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; ip -o link | grep -c eth0",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    caps = dict(line.split(":\t") for line in r.stdout.splitlines()[:2])
    held = int(caps["CapEff"], 16)
    assert held and not held & (1 << 13)  # CAP_NET_RAW (13) absent, as asked
    assert held & (1 << 0)  # CAP_CHOWN held, as asked
    assert caps["NoNewPrivs"].strip() == "1"
    assert r.stdout.splitlines()[2] == "1"  # bridge: a network interface of its own
    r = docker("run", "--rm", "--entrypoint", "sh", "busybox", "-c", "ip -o link | grep -c eth0")
    assert r.stdout.strip() == "0"  # no --network: no network at all (dsec's default)
    # what sandboxes do not give is refused (every case: test_docker_cli_units.py)
    r = docker("run", "--rm", "--network", "host", "--cap-add", "SYS_ADMIN", "busybox", "true")
    assert r.returncode == 125 and "network mode host is not supported by dsec" in r.stderr
    r = docker("run", "--rm", "--privileged", "busybox", "true")
    assert r.returncode == 125 and "--privileged is not supported by dsec" in r.stderr


def test_version_info_images(docker: Docker) -> None:
    r = docker("version", "--format", "{{.Server.Version}} {{.Client.Version}}")
    assert r.returncode == 0 and r.stdout.split() == ["27.5.1", "27.5.1"]
    doc = json.loads(docker("version", "--format", "json").stdout)
    assert doc["Server"]["Components"][1]["Name"] == "dsec"
    r = docker("info", "--format", "{{.ServerVersion}} {{.OSType}} {{.NCPU}}")
    assert r.returncode == 0 and r.stdout.startswith("27.5.1 linux ")
    assert docker("pull", "-q", "busybox").returncode == 0
    assert "busybox" in docker("images", "--format", "{{.Repository}}").stdout.split()
    r = docker("image", "inspect", "-f", "{{index .RepoTags 0}} {{.Os}}", "busybox")
    assert (r.returncode, r.stdout) == (0, "busybox:latest linux\n")
    r = docker("image", "inspect", "no-such-image")
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "[]\n",
        "Error: No such image: no-such-image\n",
    )
    r = docker("rmi", "busybox")  # a built-in image: read-only to keys
    assert r.returncode == 1 and "Error response from daemon" in r.stderr


def test_new_verbs_see_only_the_keys_containers(
    docker: Docker, container: str, sdk_env: LiveServer
) -> None:
    other = {"DSEC_API_KEY": sdk_env.keys.create_key("docker-cli-inspect-test")}
    assert docker("inspect", "-f", "{{.State.Running}}", container).stdout == "true\n"
    for args in (
        ("inspect", container),
        ("container", "inspect", container),
        ("port", container),
        ("kill", container),
    ):
        r = docker(*args, env=other)
        assert r.returncode == 1, args
        assert (
            f"No such object: {container}" in r.stderr
            or f"No such container: {container}" in r.stderr
        )
    assert docker("info", "--format", "{{.Containers}}", env=other).stdout == "0\n"
    assert docker("inspect", "-f", "{{.State.Running}}", container).stdout == "true\n"
    assert docker("kill", container).stdout == f"{container}\n"
    assert docker("inspect", "-f", "{{.State.Status}}", container).stdout == "exited\n"
