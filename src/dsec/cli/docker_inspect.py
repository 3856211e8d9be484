"""What ``dsec docker version``, ``info`` and ``inspect`` show, in docker's JSON shapes.

The fields tools read are filled from the server (``GET /v1/node``, the sandbox, the
image and its config); the rest has docker's zero values. Container settings the server
does not keep (the ``run`` command's entrypoint and arguments, its ``-e`` environment, the
network mode, published ports, capability and security options as asked) are kept in the
container's own labels: :data:`CONFIG_LABEL` holds them as JSON, cut in pieces of
:data:`_PIECE` characters (``docker.config.0``, ``docker.config.1``, ...; a label value
holds at most 1024). Those labels belong to the caller's API key, as the container does,
and ``ps``/``inspect`` do not list them.

``Client.Version`` and ``Server.Version`` are the docker release whose CLI this follows
(:data:`DOCKER_VERSION`: tools compare it with the version they need); dsec's own version
is the ``Server.Platform.Name`` and the ``dsec`` component of ``Server.Components``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shlex
from datetime import UTC, datetime
from typing import Any

from dsec.images.config import ImageConfig
from dsec.models import ImageInfo, NodeInfo, SandboxInfo

__all__ = [
    "API_VERSION",
    "AUTOREMOVE_LABEL",
    "COMMAND_LABEL",
    "CONFIG_LABEL",
    "DOCKER_VERSION",
    "NAME_LABEL",
    "container_document",
    "get_config",
    "image_document",
    "image_id",
    "info_document",
    "info_text",
    "put_config",
    "repo_tag",
    "rfc3339",
    "user_labels",
    "version_document",
    "version_text",
]

DOCKER_VERSION = "27.5.1"
"""The docker release whose CLI ``dsec docker`` follows."""
API_VERSION = "1.47"
"""That release's Engine API version."""

NAME_LABEL = "docker.name"
COMMAND_LABEL = "docker.command"
AUTOREMOVE_LABEL = "docker.autoremove"
"""Set by ``run --rm``: once stopped, the container is gone for ``ps -a``, ``rm``, ``cp``."""
CONFIG_LABEL = "docker.config"
_PIECE = 1000
_ZERO_TIME = "0001-01-01T00:00:00Z"


def _internal(key: str) -> bool:
    """A label of this CLI's own bookkeeping, not shown as the container's labels."""
    return key in (NAME_LABEL, COMMAND_LABEL, AUTOREMOVE_LABEL) or key.startswith(
        CONFIG_LABEL + "."
    )


def user_labels(labels: dict[str, str]) -> dict[str, str]:
    """The labels a user gave (``-l``), without this CLI's bookkeeping."""
    return {k: v for k, v in labels.items() if not _internal(k)}


def put_config(labels: dict[str, str], config: dict[str, Any]) -> None:
    """Store ``config`` (JSON) in ``labels`` as :data:`CONFIG_LABEL` pieces."""
    text = json.dumps(config, separators=(",", ":"), ensure_ascii=False)
    for i in range(0, max(len(text), 1), _PIECE):
        labels[f"{CONFIG_LABEL}.{i // _PIECE}"] = text[i : i + _PIECE]


def get_config(labels: dict[str, str]) -> dict[str, Any]:
    """The config :func:`put_config` stored (``{}`` for a sandbox not made by ``run``)."""
    pieces: list[str] = []
    while f"{CONFIG_LABEL}.{len(pieces)}" in labels:
        pieces.append(labels[f"{CONFIG_LABEL}.{len(pieces)}"])
    try:
        value = json.loads("".join(pieces)) if pieces else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def rfc3339(t: datetime | None) -> str:
    """Go's RFC 3339 with nanoseconds, as docker prints times (``...:05.123456Z``)."""
    if t is None:
        return _ZERO_TIME
    t = t.astimezone(UTC)
    frac = f"{t.microsecond:06d}".rstrip("0")
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{frac}" if frac else "") + "Z"


def image_id(layers: list[str]) -> str:
    """An image's id: the SHA-256 of its layer digests, bottom first (dsec images have no
    config blob of their own to hash, as docker's ids are)."""
    return "sha256:" + hashlib.sha256("\n".join(layers).encode()).hexdigest()


def repo_tag(name: str) -> tuple[str, str]:
    """``(repository, tag)`` of an image name: ``busybox`` is ``busybox:latest``."""
    repo, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:
        return name, "latest"
    return repo, tag


def _goarch(machine: str) -> str:
    return {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "armv7l": "arm"}.get(
        machine, machine
    )


def _env_list(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def container_document(info: SandboxInfo, image: ImageInfo | None) -> dict[str, Any]:
    """``docker inspect`` of a container (a sandbox of the caller's key)."""
    cfg = get_config(info.labels)
    image_cfg = ImageConfig.from_meta(image.meta if image else None)
    env = {**image_cfg.env_dict(), **dict(_pairs(cfg.get("Env") or []))}
    if "Cmd" in cfg or "Entrypoint" in cfg:
        entrypoint, cmd = cfg.get("Entrypoint"), cfg.get("Cmd")
    else:  # not made by ``run``: what ps shows as its command, if anything
        entrypoint = None
        try:
            cmd = shlex.split(info.labels.get(COMMAND_LABEL, "")) or None
        except ValueError:
            cmd = None
    argv = [*(entrypoint or []), *(cmd or [])]
    state = info.state
    running = state in ("running", "paused")
    status = {"running": "running", "paused": "paused", "creating": "created"}.get(state, "exited")
    ports = cfg.get("Ports") or {}
    network = cfg.get("NetworkMode") or ("bridge" if info.network is not None else "none")
    labels = {**(image_cfg.Labels or {}), **user_labels(info.labels)}
    exposed = {**(image_cfg.ExposedPorts or {}), **{k: {} for k in ports}}
    return {
        "Id": info.id,
        "Created": rfc3339(info.created_at),
        "Path": argv[0] if argv else "",
        "Args": argv[1:],
        "State": {
            "Status": status,
            "Running": running,
            "Paused": state == "paused",
            "Restarting": False,
            "OOMKilled": "oom" in (info.stopped_reason or "").lower(),
            "Dead": False,
            "Pid": 0,
            "ExitCode": 0,
            "Error": "",
            "StartedAt": rfc3339(info.created_at),
            "FinishedAt": rfc3339(info.updated_at) if state == "stopped" else _ZERO_TIME,
        },
        "Image": image_id(image.layers) if image is not None else "",
        "Name": "/" + (info.labels.get(NAME_LABEL) or info.id),
        "RestartCount": 0,
        "Driver": "dsec",
        "Platform": "linux",
        "MountLabel": "",
        "ProcessLabel": "",
        "AppArmorProfile": "",
        "HostConfig": {
            "NetworkMode": network,
            "PortBindings": cfg.get("PortBindings") or {},
            "AutoRemove": info.labels.get(AUTOREMOVE_LABEL) == "true",
            "Privileged": False,
            "CapAdd": cfg.get("CapAdd"),
            "CapDrop": cfg.get("CapDrop"),
            "SecurityOpt": cfg.get("SecurityOpt"),
            "Runtime": info.tier,
            "NanoCpus": int(info.cpu * 1e9),
            "Memory": info.memory_mb << 20,
            "PidsLimit": info.pids,
            "ReadonlyRootfs": False,
            "Binds": None,
        },
        "Mounts": [],
        "Config": {
            "Hostname": "",
            "User": info.user or "",
            "Tty": False,
            "OpenStdin": False,
            "ExposedPorts": exposed or None,
            "Env": _env_list(env) or None,
            "Cmd": cmd,
            "Image": cfg.get("Image") or info.image,
            "WorkingDir": info.workdir or "",
            "Entrypoint": entrypoint,
            "Labels": labels,
        },
        "NetworkSettings": {
            "Ports": ports if running else {},
            "IPAddress": "",
            "Gateway": "",
            "MacAddress": "",
            "Networks": {network: {"NetworkID": "", "IPAddress": "", "Gateway": ""}},
        },
        "Dsec": {
            "SandboxId": info.id,
            "Tier": info.tier,
            "Node": info.node,
            "Image": info.image,
            "Layers": info.layers,
            "ExpiresAt": rfc3339(info.expires_at) if info.expires_at else None,
        },
    }


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, _, value = item.partition("=")
        out.append((key, value))
    return out


def image_document(image: ImageInfo, machine: str) -> dict[str, Any]:
    """``docker image inspect`` of a dsec image (``machine``: the node's ``uname -m``)."""
    cfg = ImageConfig.from_meta(image.meta)
    repo, tag = repo_tag(image.name)
    return {
        "Id": image_id(image.layers),
        "RepoTags": [f"{repo}:{tag}"],
        "RepoDigests": [],
        "Parent": "",
        "Comment": "",
        "Created": rfc3339(image.created_at),
        "DockerVersion": "",
        "Author": "",
        "Config": {
            "Env": cfg.Env,
            "Cmd": cfg.Cmd,
            "Entrypoint": cfg.Entrypoint,
            "WorkingDir": cfg.WorkingDir or "",
            "User": cfg.User or "",
            "Labels": cfg.Labels,
            "ExposedPorts": cfg.ExposedPorts,
        },
        "Architecture": _goarch(machine),
        "Os": "linux",
        "Size": image.size,
        "RootFS": {"Type": "layers", "Layers": list(image.layers)},
        "Metadata": {"LastTagTime": _ZERO_TIME},
        "Dsec": {
            "Name": image.name,
            "Owner": image.owner,
            "Shared": image.shared,
            "Status": image.status,
        },
    }


def _client_part() -> dict[str, Any]:
    return {
        "Platform": {"Name": "dsec docker"},
        "Version": DOCKER_VERSION,
        "ApiVersion": API_VERSION,
        "DefaultAPIVersion": API_VERSION,
        "GitCommit": "dsec",
        "GoVersion": f"python{platform.python_version()}",
        "Os": "linux",
        "Arch": _goarch(platform.machine()),
        "BuildTime": "",
        "Context": "dsec",
    }


def version_document(node: NodeInfo | None, url: str) -> dict[str, Any]:
    """``docker version``: ``Server`` is None when the server did not answer."""
    server = None
    if node is not None:
        machine = node.host.architecture if node.host else platform.machine()
        kernel = node.host.kernel if node.host else ""
        details = {
            "ApiVersion": API_VERSION,
            "MinAPIVersion": "1.24",
            "GitCommit": "",
            "GoVersion": "",
            "Os": "linux",
            "Arch": _goarch(machine),
            "KernelVersion": kernel,
            "Experimental": "false",
            "BuildTime": "",
        }
        server = {
            "Platform": {"Name": f"dsec {node.version}"},
            "Components": [
                {"Name": "Engine", "Version": DOCKER_VERSION, "Details": details},
                {
                    "Name": "dsec",
                    "Version": node.version,
                    "Details": {
                        "Node": node.node,
                        "Url": url,
                        "Tiers": ",".join(t.tier for t in node.tiers if t.available),
                    },
                },
            ],
            "Version": DOCKER_VERSION,
            **{k: v for k, v in details.items() if k != "Experimental"},
        }
    return {"Client": _client_part(), "Server": server}


def version_text(doc: dict[str, Any]) -> str:
    """``docker version``'s text (the Client part alone when there is no server)."""
    c = doc["Client"]
    lines = [
        f"Client: {c['Platform']['Name']}",
        f" Version:           {c['Version']}",
        f" API version:       {c['ApiVersion']}",
        f" Go version:        {c['GoVersion']}",
        f" Git commit:        {c['GitCommit']}",
        f" Built:             {c['BuildTime']}",
        f" OS/Arch:           {c['Os']}/{c['Arch']}",
        f" Context:           {c['Context']}",
    ]
    s = doc["Server"]
    if s is not None:
        lines += ["", f"Server: {s['Platform']['Name']}"]
        for comp in s["Components"]:
            lines.append(f" {comp['Name']}:")
            lines.append(f"  Version:          {comp['Version']}")
            for key, value in comp["Details"].items():
                lines.append(f"  {key + ':':<18}{value}")
    return "\n".join(lines) + "\n"


def info_document(
    node: NodeInfo, sandboxes: list[SandboxInfo], images: int, url: str
) -> dict[str, Any]:
    """``docker info``: the node and what the caller's key holds on it."""
    host = node.host
    live = [s for s in sandboxes if s.state != "stopped"]
    tiers = [t.tier for t in node.tiers if t.available]
    cgroup = host.cgroups.mode if host else ""
    return {
        "ID": node.node,
        "Containers": len(sandboxes),
        "ContainersRunning": sum(1 for s in live if s.state == "running"),
        "ContainersPaused": sum(1 for s in live if s.state == "paused"),
        "ContainersStopped": len(sandboxes) - len(live),
        "Images": images,
        "Driver": "dsec (EROFS layers + overlay)",
        "DriverStatus": [],
        "MemoryLimit": True,
        "SwapLimit": False,
        "CpuCfsPeriod": True,
        "CpuCfsQuota": True,
        "PidsLimit": True,
        "IPv4Forwarding": True,
        "Debug": False,
        "SystemTime": rfc3339(datetime.now(UTC)),
        "LoggingDriver": "",
        "CgroupDriver": "cgroupfs",
        "CgroupVersion": "2" if cgroup == "v2" else "1" if cgroup == "v1" else "",
        "KernelVersion": host.kernel if host else "",
        "OperatingSystem": host.distribution if host else "",
        "OSType": "linux",
        "Architecture": host.architecture if host else platform.machine(),
        "NCPU": node.cpus,
        "MemTotal": node.memory_mb << 20,
        "Name": node.node,
        "Labels": [],
        "ExperimentalBuild": False,
        "ServerVersion": DOCKER_VERSION,
        "Runtimes": {t: {"path": f"dsec:{t}"} for t in tiers},
        "DefaultRuntime": "container" if "container" in tiers else (tiers or [""])[0],
        "Swarm": {"LocalNodeState": "inactive"},
        "LiveRestoreEnabled": False,
        "SecurityOptions": ["name=seccomp,profile=dsec", "name=no-new-privileges", "name=cgroupns"],
        "Warnings": None,
        "Dsec": {"Version": node.version, "Url": url, "Sandboxes": node.sandboxes},
    }


def info_text(doc: dict[str, Any]) -> str:
    """``docker info``'s text: the server part, in docker's order."""
    rows = [
        ("Containers", doc["Containers"]),
        (" Running", doc["ContainersRunning"]),
        (" Paused", doc["ContainersPaused"]),
        (" Stopped", doc["ContainersStopped"]),
        ("Images", doc["Images"]),
        ("Server Version", doc["ServerVersion"]),
        ("Storage Driver", doc["Driver"]),
        ("Cgroup Driver", doc["CgroupDriver"]),
        ("Cgroup Version", doc["CgroupVersion"]),
        ("Runtimes", " ".join(doc["Runtimes"])),
        ("Default Runtime", doc["DefaultRuntime"]),
        ("Security Options", " ".join(o.split(",")[0][5:] for o in doc["SecurityOptions"])),
        ("Kernel Version", doc["KernelVersion"]),
        ("Operating System", doc["OperatingSystem"]),
        ("OSType", doc["OSType"]),
        ("Architecture", doc["Architecture"]),
        ("CPUs", doc["NCPU"]),
        ("Total Memory", f"{doc['MemTotal'] / (1 << 30):.4g}GiB"),
        ("Name", doc["Name"]),
        ("ID", doc["ID"]),
        ("dsec", f"{doc['Dsec']['Version']} at {doc['Dsec']['Url']}"),
    ]
    return "Server:\n" + "".join(f" {k}: {v}\n" for k, v in rows)
