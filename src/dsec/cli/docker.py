"""``dsec docker`` / ``dsec-docker``: the part of the docker CLI that agent tools shell out to.

A "container" is a dsec sandbox of the caller's API key; its name is the sandbox label
``docker.name`` (names are per key). Supported::

    run  [-d] [--rm] [-i] [--name N] [-w DIR] [-e K=V|K]... [-l K=V]... [-u USER]
         [--cpus N] [-m SIZE] [--network none|bridge] [--runtime TIER] [--entrypoint CMD]
         [-p [IP:][HOST_PORT:]PORT[/tcp]]... [--cap-add C]... [--cap-drop C]...
         [--security-opt OPT]... [--sysctl K=V]... IMAGE [CMD [ARG...]]
    exec [-i] [-d] [-w DIR] [-e K=V|K]... [-u USER] CONTAINER CMD [ARG...]
    ps   [-a] [-q] [--no-trunc] [--format TEMPLATE]
    stop [-t SECONDS] CONTAINER...        rm [-f] CONTAINER...        kill CONTAINER...
    pull [-q] IMAGE                       cp [-q] SRC DEST   (one side CONTAINER:PATH, or -)
    version [-f FORMAT]                   info [-f FORMAT]
    inspect [-f FORMAT] [--type container|image] NAME...
    port CONTAINER [PORT[/tcp]]           images [-a] [-q] [--no-trunc] [--format F] [REPO]
    rmi [-f] IMAGE...                     image inspect|ls|rm|pull ...   container VERB ...

``--format`` takes Go templates (:mod:`dsec.cli.gotemplate`) or ``json``.

Exit codes as docker's: a command's own exit code (128+N when killed by signal N); 125
for a bad flag or argument (the message names it) and for ``run``'s daemon errors; 126 and
127 for a command that cannot be started (``run``: 127 not found, 126 not executable;
``exec``: 126, as dockerd answers); 1 for other daemon errors ("No such container",
"Error: No such object").

What differs from docker (docs/integrations.md has the full table): a container lives
until ``stop``/``rm`` or its idle TTL, not until its command exits; ``run`` without
``-d`` kills the sandbox when the command ends (``ps -a`` lists it as Exited until the
server forgets it; ``rm`` of an exited container does nothing); names are unique among
live containers only; the images are dsec's (``busybox``, ``debian``, built or pulled
ones); output is text (invalid UTF-8 is replaced); ``-i`` sends all of stdin at once
(no interactive streaming, no ``-t``); no volumes or logs; ``-p`` binds on this machine
and carries connections through the server's port proxy (:mod:`dsec.cli.docker_ports`);
``--network bridge`` is dsec's open network policy (every public IPv4 address), no
``--network`` is no network at all; capability and security options are accepted where
dsec's sandboxes are already at least as confined, refused otherwise.

Connection: ``$DSEC_URL`` and ``$DSEC_API_KEY`` / ``$DSEC_HOME/api_key`` (``dsec --url U
--api-key K docker ...`` too). ``$DSEC_DOCKER_TIER`` picks the default tier (``container``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import re
import secrets
import shlex
import signal
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import httpx

from dsec.cli import docker_ports
from dsec.cli.docker_inspect import (
    AUTOREMOVE_LABEL,
    COMMAND_LABEL,
    CONFIG_LABEL,
    DOCKER_VERSION,
    NAME_LABEL,
    container_document,
    get_config,
    image_document,
    image_id,
    info_document,
    info_text,
    put_config,
    repo_tag,
    version_document,
    version_text,
)
from dsec.cli.gotemplate import GoStruct, Template, TemplateError
from dsec.errors import (
    DsecError,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    NotFound,
    SandboxNotFound,
    SandboxStopped,
    ServiceUnavailable,
)
from dsec.images.config import ImageConfig
from dsec.models import ImageInfo, SandboxInfo
from dsec.tiers import get_tier, tier_names

__all__ = ["EXIT_CANNOT_INVOKE", "EXIT_DAEMON", "EXIT_NOT_FOUND", "main"]

EXIT_DAEMON = 125
"""A docker (here: dsec) error, or a bad flag or argument."""
EXIT_CANNOT_INVOKE = 126
"""The command was found but cannot be run (``exec``: any start failure)."""
EXIT_NOT_FOUND = 127
"""The command was not found (``run``)."""

_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_MAX_S = 24 * 3600.0 - 60  # an exec lives at most 24 hours

transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None
"""Test hook, as :data:`dsec.cli.main.transport_factory`: every call goes to this transport."""


class DockerError(Exception):
    """Ends the command: ``message`` to stderr, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _usage(verb: str, message: str) -> NoReturn:
    raise DockerError(f"{message}\nSee 'docker {verb} --help'.", EXIT_DAEMON)


# -- argument parsing (docker's pflag rules) -------------------------------------------


@dataclass
class _Spec:
    bools: dict[str, str]  # flag -> dest
    values: dict[str, str]
    multi: frozenset[str] = frozenset()  # dests that repeat
    interspersed: bool = True  # flags after positional arguments (not for run/exec)
    refused: dict[str, str] = field(default_factory=dict)  # flag -> why


_NO_MOUNTS = (
    "no bind mounts or volumes: the container runs on the dsec server, which cannot see "
    "this machine's files; copy them in and out with 'docker cp'"
)
_NO_SHARING = "a sandbox never shares a namespace with the host or another container"

_LISTING_BOOLS = {
    "-a": "all",
    "--all": "all",
    "-q": "quiet",
    "--quiet": "quiet",
    "--no-trunc": "no_trunc",
}

_SPECS: dict[str, _Spec] = {
    "run": _Spec(
        bools={
            "-d": "detach",
            "--detach": "detach",
            "--rm": "rm",
            "-i": "interactive",
            "--interactive": "interactive",
            "--privileged": "privileged",
        },
        values={
            "--name": "name",
            "-w": "workdir",
            "--workdir": "workdir",
            "-e": "env",
            "--env": "env",
            "-l": "label",
            "--label": "label",
            "-u": "user",
            "--user": "user",
            "--cpus": "cpus",
            "-m": "memory",
            "--memory": "memory",
            "--network": "network",
            "--net": "network",
            "--runtime": "runtime",
            "--entrypoint": "entrypoint",
            "-p": "publish",
            "--publish": "publish",
            "--cap-add": "cap_add",
            "--cap-drop": "cap_drop",
            "--security-opt": "security_opt",
            "--sysctl": "sysctl",
        },
        multi=frozenset(
            {"env", "label", "publish", "cap_add", "cap_drop", "security_opt", "sysctl"}
        ),
        interspersed=False,
        refused={
            "-t": "no terminals",
            "--tty": "no terminals",
            "-v": _NO_MOUNTS,
            "--volume": _NO_MOUNTS,
            "--mount": _NO_MOUNTS,
            "--volumes-from": _NO_MOUNTS,
            "--gpus": "no GPUs or host devices in dsec sandboxes",
            "--device": "no GPUs or host devices in dsec sandboxes",
            "--add-host": "no host entries: a sandbox cannot reach this machine (-p reaches "
            "the sandbox from here)",
            "-P": "name each port to publish with -p",
            "--publish-all": "name each port to publish with -p",
            "--pid": _NO_SHARING,
            "--ipc": _NO_SHARING,
            "--uts": _NO_SHARING,
            "--userns": _NO_SHARING,
            "--cgroupns": _NO_SHARING,
        },
    ),
    "exec": _Spec(
        bools={
            "-i": "interactive",
            "--interactive": "interactive",
            "-d": "detach",
            "--detach": "detach",
        },
        values={
            "-w": "workdir",
            "--workdir": "workdir",
            "-e": "env",
            "--env": "env",
            "-u": "user",
            "--user": "user",
        },
        multi=frozenset({"env"}),
        interspersed=False,
        refused={"-t": "no terminals", "--tty": "no terminals"},
    ),
    "ps": _Spec(bools=_LISTING_BOOLS, values={"--format": "format"}),
    "stop": _Spec(
        bools={}, values={"-t": "time", "--time": "time", "-s": "signal", "--signal": "signal"}
    ),
    "rm": _Spec(bools={"-f": "force", "--force": "force"}, values={}),
    "pull": _Spec(bools={"-q": "quiet", "--quiet": "quiet"}, values={}),
    "cp": _Spec(bools={"-q": "quiet", "--quiet": "quiet"}, values={}),
    "kill": _Spec(bools={}, values={"-s": "signal", "--signal": "signal"}),
    "version": _Spec(bools={}, values={"-f": "format", "--format": "format"}),
    "info": _Spec(bools={}, values={"-f": "format", "--format": "format"}),
    "inspect": _Spec(
        bools={"-s": "size", "--size": "size"},
        values={"-f": "format", "--format": "format", "--type": "type"},
    ),
    "port": _Spec(bools={}, values={}),
    "images": _Spec(
        bools={**_LISTING_BOOLS, "--digests": "digests"}, values={"--format": "format"}
    ),
    "rmi": _Spec(bools={"-f": "force", "--force": "force", "--no-prune": "no_prune"}, values={}),
}

_HELP = {
    "run": "Usage:  docker run [OPTIONS] IMAGE [COMMAND] [ARG...]",
    "exec": "Usage:  docker exec [OPTIONS] CONTAINER COMMAND [ARG...]",
    "ps": "Usage:  docker ps [OPTIONS]",
    "stop": "Usage:  docker stop [OPTIONS] CONTAINER [CONTAINER...]",
    "rm": "Usage:  docker rm [OPTIONS] CONTAINER [CONTAINER...]",
    "kill": "Usage:  docker kill [OPTIONS] CONTAINER [CONTAINER...]",
    "pull": "Usage:  docker pull [OPTIONS] NAME[:TAG]",
    "cp": "Usage:  docker cp [OPTIONS] CONTAINER:SRC_PATH DEST_PATH|-\n"
    "        docker cp [OPTIONS] SRC_PATH|- CONTAINER:DEST_PATH",
    "version": "Usage:  docker version [OPTIONS]",
    "info": "Usage:  docker info [OPTIONS]",
    "inspect": "Usage:  docker inspect [OPTIONS] NAME|ID [NAME|ID...]",
    "port": "Usage:  docker port CONTAINER [PRIVATE_PORT[/PROTO]]",
    "images": "Usage:  docker images [OPTIONS] [REPOSITORY[:TAG]]",
    "rmi": "Usage:  docker rmi [OPTIONS] IMAGE [IMAGE...]",
}

_TOP_HELP = (
    "Usage:  dsec docker COMMAND\n\nA docker-compatible subset on dsec sandboxes.\n\n"
    "Commands:\n  run     Create and run a new container from an image\n"
    "  exec    Execute a command in a running container\n  ps      List containers\n"
    "  stop    Stop one or more running containers\n  rm      Remove one or more containers\n"
    "  kill    Kill one or more running containers\n"
    "  pull    Check that an image is available\n"
    "  cp      Copy files/folders between a container and the local filesystem\n"
    "  inspect Return low-level information on containers and images\n"
    "  port    List port mappings or a specific mapping for the container\n"
    "  images  List images\n  rmi     Remove one or more images\n"
    "  version Show the docker and dsec version information\n"
    "  info    Display system-wide information\n"
    "  image   inspect|ls|rm|pull   container  run|exec|ls|inspect|port|stop|kill|rm|cp\n"
)


class _Help(Exception):
    pass


def parse(verb: str, args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Parse ``args`` of ``verb`` as docker does: returns (options, positionals).

    Raises :class:`DockerError` (exit 125) naming an unknown, unsupported or malformed flag.
    """
    spec = _SPECS[verb]
    opts: dict[str, Any] = {d: False for d in spec.bools.values()}
    opts.update({d: ([] if d in spec.multi else None) for d in spec.values.values()})
    pos: list[str] = []
    i = 0
    args = list(args)

    def set_value(flag: str, value: str) -> None:
        dest = spec.values[flag]
        if dest in spec.multi:
            opts[dest].append(value)
        else:
            opts[dest] = value

    def set_bool(flag: str, raw: str | None) -> None:
        if raw is None or raw.lower() in ("true", "1"):
            opts[spec.bools[flag]] = True
        elif raw.lower() in ("false", "0"):
            opts[spec.bools[flag]] = False
        else:
            _usage(
                verb,
                f'invalid argument "{raw}" for "{flag}" flag: strconv.ParseBool: parsing "{raw}": invalid syntax',
            )

    def known(flag: str) -> None:
        if flag in spec.refused:
            _usage(verb, f"unsupported flag: {flag} (dsec docker: {spec.refused[flag]})")
        if flag not in spec.bools and flag not in spec.values:
            if flag in ("-h", "--help"):
                raise _Help
            kind = "flag" if flag.startswith("--") else "shorthand flag"
            name = flag if flag.startswith("--") else f"'{flag[1:]}' in {flag}"
            _usage(verb, f"unknown {kind}: {name}")

    while i < len(args):
        a = args[i]
        i += 1
        if a == "--":
            pos.extend(args[i:])
            break
        if a.startswith("--") and len(a) > 2:
            flag, eq, value = a.partition("=")
            known(flag)
            if flag in spec.bools:
                set_bool(flag, value if eq else None)
            elif eq:
                set_value(flag, value)
            elif i < len(args):
                set_value(flag, args[i])
                i += 1
            else:
                _usage(verb, f"flag needs an argument: {flag}")
        elif a.startswith("-") and len(a) > 1:
            j = 1
            while j < len(a):
                flag = "-" + a[j]
                known(flag)
                if flag in spec.bools:
                    set_bool(flag, None)
                    j += 1
                    continue
                rest = a[j + 1 :]
                if rest:
                    set_value(flag, rest[1:] if rest.startswith("=") else rest)
                elif i < len(args):
                    set_value(flag, args[i])
                    i += 1
                else:
                    _usage(verb, f"flag needs an argument: '{a[j]}' in {flag}")
                break
        else:
            pos.append(a)
            if not spec.interspersed:
                pos.extend(args[i:])
                break
    return opts, pos


# -- helpers ---------------------------------------------------------------------------


def _client(url: str | None, api_key: str | None) -> Any:
    from dsec.sdk import Client

    transport = transport_factory() if transport_factory is not None else None
    return Client(url, api_key, transport=transport)


def _env_pairs(items: list[str], verb: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key:
            _usage(
                verb,
                f'invalid argument "{item}" for "-e, --env" flag: invalid environment variable: {item}',
            )
        if eq:
            env[key] = value
        elif key in os.environ:  # -e NAME: the host's value, if it has one
            env[key] = os.environ[key]
    return env


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _memory_mb(raw: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmg]?)b?", raw.strip().lower())
    if not m:
        _usage("run", f'invalid argument "{raw}" for "-m, --memory" flag: invalid size: \'{raw}\'')
    return max(16, int(float(m.group(1)) * _UNITS[m.group(2)]) >> 20)


def _image_name(ref: str) -> str:
    """A docker reference as a dsec image name: ``docker.io/library/`` and a ``:latest``
    tag the store does not know are dropped."""
    for prefix in ("docker.io/library/", "index.docker.io/library/", "library/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
    return ref


def _resolve_image(client: Any, ref: str) -> ImageInfo:
    """The image ``ref`` names (a docker reference or a dsec name); ``ImageNotFound``."""
    name = _image_name(ref)
    candidates = [name] + ([name.removesuffix(":latest")] if name.endswith(":latest") else [])
    for candidate in candidates:
        try:
            image: ImageInfo = client.get_image(candidate)
            return image
        except (NotFound, InvalidRequest):  # NotFound: also a name no route matches
            continue
    raise ImageNotFound(f"image {ref!r} not found")


def _removed(info: SandboxInfo) -> bool:
    """A stopped ``--rm`` container: docker would have removed it."""
    return info.state == "stopped" and info.labels.get(AUTOREMOVE_LABEL) == "true"


def _name_of(info: SandboxInfo) -> str:
    return info.labels.get(NAME_LABEL) or info.id


def _find(client: Any, ref: str, *, live_only: bool = False) -> SandboxInfo:
    """The container ``ref`` names: an id, a name, or a unique id prefix; live ones first."""
    sandboxes = [s for s in client.list_sandboxes(include_stopped=not live_only) if not _removed(s)]
    live = [s for s in sandboxes if s.state != "stopped"]
    for pool in (live, sandboxes):
        exact = [s for s in pool if s.id == ref or s.labels.get(NAME_LABEL) == ref]
        if exact:
            return max(exact, key=lambda s: s.created_at)
    prefixed = [s for s in sandboxes if s.id.startswith(ref)] if len(ref) >= 3 else []
    if len({s.id for s in prefixed}) == 1:
        return prefixed[0]
    if len(prefixed) > 1:
        raise DockerError(
            f"Error response from daemon: Multiple IDs found with provided prefix: {ref}"
        )
    raise DockerError(f"Error response from daemon: No such container: {ref}")


def _exit_code(result: Any) -> int:
    if result.timed_out:
        return 124
    if result.exit_code is not None:
        return int(result.exit_code)
    return 128 + int(result.signal or signal.SIGKILL)


def _start_failure(result: Any, argv: list[str]) -> tuple[int, str] | None:
    """(code, reason) when ``result`` says ``argv[0]`` could not be started."""
    if result.exit_code not in (126, 127) or result.stdout:
        return None
    m = re.fullmatch(rf"dsec: {re.escape(argv[0])}: (.+)\n?", result.stderr)
    if not m:
        return None
    if result.exit_code == 127:
        if "/" in argv[0]:
            return 127, f'exec: "{argv[0]}": stat {argv[0]}: no such file or directory'
        return 127, f'exec: "{argv[0]}": executable file not found in $PATH'
    return 126, f'exec: "{argv[0]}": permission denied'


def _stream(sb: Any, argv: list[str], **kw: Any) -> Any:
    """Run ``argv``, writing its output to our stdout/stderr as it comes; returns the
    command's :class:`~dsec.models.ExecResult` with the output that was written."""
    out: list[str] = []
    err: list[str] = []
    result: Any = None
    for event in sb.commands.stream(argv, **kw):
        if event.type == "stdout" and event.data:
            out.append(event.data)
            sys.stdout.write(event.data)
            sys.stdout.flush()
        elif event.type == "stderr" and event.data:
            err.append(event.data)
            sys.stderr.write(event.data)
            sys.stderr.flush()
        elif event.type == "exit":
            result = event.result
    assert result is not None  # stream() ends with an exit event or raises
    if not out and result.stdout:
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
    # a command that could not be started streams nothing: its message is in the result
    # (the callers print docker's message for it, or the result's stderr)
    unstreamed = "" if err else result.stderr
    return result.model_copy(
        update={"stdout": "".join(out) or result.stdout, "stderr": "".join(err) or unstreamed}
    ), unstreamed


def _print_unstreamed(text: str) -> None:
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()


def _read_stdin() -> bytes:
    try:
        return sys.stdin.buffer.read()
    except (OSError, ValueError):
        return b""


# -- verbs -----------------------------------------------------------------------------


# Linux capabilities by docker's names (linux/capability.h, without CAP_)
_CAPABILITIES = frozenset(
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
    "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
    "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
    "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
    "CHECKPOINT_RESTORE".split()
)
SANDBOX_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
)
"""What a root command in a container sandbox holds (and under the VM tiers' guard):
``dsec.runtimes.container.bundle.CAPABILITIES``; a non-root command holds none."""
OPEN_NETWORK: dict[str, Any] = {"allow_cidrs": ["0.0.0.0/0"], "protocols": ["tcp", "udp", "icmp"]}
"""``--network bridge``: every public IPv4 address, DNS for every name (dsec's resolver);
never the node, other sandboxes, link-local or the operator's protected networks."""
_IPV6_OFF = ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6")


def _refuse(message: str) -> NoReturn:
    """A ``run`` option dsec does not serve, as the daemon's refusal (exit 125)."""
    raise DockerError(f"docker: Error response from daemon: {message}.", EXIT_DAEMON)


def _network_policy(mode: str | None) -> tuple[str, dict[str, Any] | None]:
    """``--network`` as (docker's mode name, dsec network policy or None: no network)."""
    if mode in (None, "none"):
        return "none", None
    if mode in ("bridge", "default"):
        return "bridge", OPEN_NETWORK
    if mode == "host":
        _refuse(
            "network mode host is not supported by dsec: a sandbox never shares the host's "
            "network namespace (--network bridge reaches the internet, -p publishes ports)"
        )
    if mode.startswith("container:"):
        _refuse(f"network mode {mode} is not supported by dsec: {_NO_SHARING}")
    _refuse(f"network {mode} not found")


def _cap_name(raw: str, which: str) -> str:
    name = raw.strip().upper().removeprefix("CAP_")
    if name != "ALL" and name not in _CAPABILITIES:
        _refuse(f'invalid {which}: unknown capability: "CAP_{name}"')
    return name


def _capabilities(adds: list[str], drops: list[str]) -> tuple[list[str], list[str]]:
    """``--cap-add``/``--cap-drop`` checked against what sandboxes hold: adding one they
    hold and dropping one they lack change nothing and are accepted; the rest is refused."""
    held = ", ".join(SANDBOX_CAPABILITIES)
    add = [_cap_name(c, "CapAdd") for c in adds]
    drop = [_cap_name(c, "CapDrop") for c in drops]
    for cap in add:
        if cap not in SANDBOX_CAPABILITIES:
            _refuse(
                f"--cap-add {cap} is not supported by dsec: a sandbox's root commands hold "
                f"at most {held} (adding one of those is accepted: it changes nothing)"
            )
    for cap in drop:
        if cap == "ALL" or cap in SANDBOX_CAPABILITIES:
            _refuse(
                f"--cap-drop {cap} is not supported by dsec: a sandbox's root commands hold "
                f"{held} and dsec cannot drop them per container (a non-root --user holds "
                "none; dropping any other capability is accepted: sandboxes lack it)"
            )
    return add, drop


def _security_options(options: list[str]) -> list[str]:
    """``--security-opt`` values dsec already meets; the others are refused."""
    for raw in options:
        m = re.fullmatch(r"([^=:]*)(?:[=:](.*))?", raw, re.S)
        key, value = (m.group(1), m.group(2) or "") if m else (raw, "")
        if key == "no-new-privileges" and value in ("", "true", "false"):
            continue  # dsec sets no_new_privs on every command, whatever is asked
        if (key, value) in (("apparmor", "unconfined"), ("label", "disable")):
            continue  # dsec nodes use no AppArmor or SELinux: that is what is asked
        if key == "seccomp":
            _refuse(
                f"--security-opt {raw} is not supported by dsec: every sandbox runs under "
                "dsec's own seccomp filter"
            )
        if key in ("apparmor", "label"):
            _refuse(
                f"--security-opt {raw} is not supported by dsec: its nodes use no AppArmor "
                "or SELinux (sandboxes are confined by namespaces, seccomp and Landlock)"
            )
        if key == "systempaths":
            _refuse(f"--security-opt {raw} is not supported by dsec: /proc and /sys stay masked")
        _refuse(f'invalid --security-opt: "{raw}"')
    return list(options)


def _check_sysctls(items: list[str]) -> None:
    for item in items:
        key, _, value = item.partition("=")
        if key in _IPV6_OFF and value == "1":
            continue  # sandboxes are IPv4-only: IPv6 is off in their namespace
        _refuse(
            f"sysctl {item!r} is not supported by dsec (sandboxes are IPv4-only: only "
            f"{_IPV6_OFF[0]}=1 is accepted)"
        )


def _credentials(client: Any) -> tuple[str, str]:
    """The server URL and API key ``client`` uses (for the ``-p`` forwarder)."""
    http = client.async_client._http
    return str(client.url), str(http.api_key or "")


def _publish(specs: list[str]) -> list[docker_ports.PortBinding]:
    out = []
    for spec in specs:
        try:
            out.append(docker_ports.parse_publish(spec))
        except docker_ports.PublishError as e:
            _usage("run", f'docker: invalid argument "{spec}" for "-p, --publish" flag: {e}')
    return out


def _port_map(bound: list[docker_ports.PortBinding]) -> dict[str, list[dict[str, str]]]:
    ports: dict[str, list[dict[str, str]]] = {}
    for b in bound:
        ports.setdefault(b.key, []).append(
            {"HostIp": b.host_ip, "HostPort": str(b.host_port) if b.host_port else ""}
        )
    return ports


def cmd_run(client: Any, args: list[str]) -> int:
    try:
        opts, pos = parse("run", args)
    except DockerError as e:
        raise DockerError(f"docker: {e.message}", e.code) from None
    if not pos:
        _usage("run", "docker: 'docker run' requires at least 1 argument.")
    image, args_given = pos[0], pos[1:]
    network_mode, policy = _network_policy(opts["network"])
    if opts["privileged"]:
        _refuse(
            "--privileged is not supported by dsec: a sandbox never gets the host's devices "
            "or every capability (a whole VM of its own: dsec's microvm tier with full_guest)"
        )
    cap_add, cap_drop = _capabilities(opts["cap_add"], opts["cap_drop"])
    security_opt = _security_options(opts["security_opt"])
    _check_sysctls(opts["sysctl"])
    bindings = _publish(opts["publish"])
    tier = opts["runtime"] or os.environ.get("DSEC_DOCKER_TIER", "container")
    if get_tier(tier) is None:
        _usage("run", f"docker: unknown runtime {tier!r} (dsec tiers: {', '.join(tier_names())})")
    name = opts["name"]
    if name is not None and not _NAME.match(name):
        raise DockerError(
            f"docker: Error response from daemon: Invalid container name ({name}), only "
            "[a-zA-Z0-9][a-zA-Z0-9_.-] are allowed.",
            EXIT_DAEMON,
        )
    labels: dict[str, str] = {}
    for item in opts["label"]:
        key, _, value = item.partition("=")
        labels[key] = value
    cpu = 1.0
    if opts["cpus"] is not None:
        try:
            cpu = float(opts["cpus"])
        except ValueError:
            _usage(
                "run",
                f'docker: invalid argument "{opts["cpus"]}" for "--cpus" flag: failed to parse {opts["cpus"]} as a rational number',
            )
    memory_mb = _memory_mb(opts["memory"]) if opts["memory"] is not None else 512
    env = _env_pairs(opts["env"], "run")
    workdir = opts["workdir"]
    stdin = _read_stdin() if opts["interactive"] else None
    from dsec.sdk import Sandbox

    bound: list[tuple[docker_ports.PortBinding, Any]] = []
    try:
        if name is not None and any(
            s.labels.get(NAME_LABEL) == name for s in client.list_sandboxes()
        ):
            other = _find(client, name, live_only=True)
            raise DockerError(
                f'docker: Error response from daemon: Conflict. The container name "/{name}" is '
                f'already in use by container "{other.id}". You have to remove (or rename) that '
                "container to be able to reuse that name.",
                EXIT_DAEMON,
            )
        try:
            image_info = _resolve_image(client, image)
        except ImageNotFound:
            raise DockerError(
                f"Unable to find image '{image}' locally\ndocker: Error response from daemon: "
                f"pull access denied for {image}, repository does not exist or may require "
                "'docker login'.",
                EXIT_DAEMON,
            ) from None
        image_cfg = ImageConfig.from_meta(image_info.meta)
        if opts["entrypoint"] is not None:  # docker: a new entrypoint drops the image's Cmd
            entrypoint = [opts["entrypoint"]] if opts["entrypoint"] else []
            cmd = args_given
        else:
            entrypoint = image_cfg.Entrypoint or []
            cmd = args_given or image_cfg.Cmd or []
        command = [*entrypoint, *cmd] or ["/bin/sh"]
        labels[NAME_LABEL] = name or f"dsec_{secrets.token_hex(4)}"
        labels[COMMAND_LABEL] = shlex.join(command)[:1024]
        if opts["rm"]:
            labels[AUTOREMOVE_LABEL] = "true"
        try:
            bound = docker_ports.bind(bindings)
        except docker_ports.PublishError as e:
            _refuse(
                "driver failed programming external connectivity on endpoint "
                f"{labels[NAME_LABEL]}: {e}"
            )
        put_config(
            labels,
            {
                "Image": image,
                "Entrypoint": entrypoint or None,
                "Cmd": cmd or None,
                "Env": [f"{k}={v}" for k, v in env.items()],
                "NetworkMode": network_mode,
                "PortBindings": _port_map(bindings),
                "Ports": _port_map([b for b, _ in bound]),
                "CapAdd": cap_add or None,
                "CapDrop": cap_drop or None,
                "SecurityOpt": security_opt or None,
            },
        )
        sb = Sandbox.create(
            tier=tier,
            image=image_info.name,
            cpu=cpu,
            memory_mb=memory_mb,
            env=env,
            labels=labels,
            user=opts["user"],
            workdir=workdir,
            network=policy,
            client=client,
        )
    except DockerError:
        _close(bound)
        raise
    except DsecError as e:
        _close(bound)
        raise DockerError(
            f"docker: Error response from daemon: {e.message}.", EXIT_DAEMON
        ) from None
    started = False
    try:
        if bound:
            url, key = _credentials(client)
            try:
                docker_ports.start_forwarder(sb.id, url, key, bound)
            except (OSError, docker_ports.PublishError) as e:
                _refuse(f"cannot start the port forwarder of {sb.id}: {e}")
        if workdir is not None and workdir != "/":
            sb.files.make_dir(workdir)  # docker creates the working directory
        if opts["detach"]:
            # the command in the background, outliving this exec (own process group)
            r = sb.commands.run(
                ["/bin/sh", "-c", 'set -m; "$@" </dev/null >/dev/null 2>&1 &', "sh", *command],
                cwd=workdir,
                timeout=60,
            )
            if r.exit_code != 0:
                raise DockerError(
                    f"docker: Error response from daemon: {r.stderr.strip()}.", EXIT_DAEMON
                )
            print(sb.id)
            started = True
            return 0
        result, unstreamed = _stream(
            sb, command, cwd=workdir, stdin=stdin, timeout=_MAX_S, max_output_bytes=64 << 20
        )
        failed = _start_failure(result, command)
        if failed is not None:
            code, reason = failed
            sys.stderr.write(
                "docker: Error response from daemon: failed to create task for container: "
                f"unable to start container process: {reason}: unknown.\n"
            )
            return code
        _print_unstreamed(unstreamed)
        return _exit_code(result)
    except DsecError as e:
        raise DockerError(
            f"docker: Error response from daemon: {e.message}.", EXIT_DAEMON
        ) from None
    finally:
        if not started:  # ended (foreground), or a detached start failed: nothing stays
            with contextlib.suppress(DsecError):
                sb.kill()
            if bound:
                docker_ports.stop_forwarder(sb.id)


def _close(bound: list[tuple[docker_ports.PortBinding, Any]]) -> None:
    for _, sock in bound:
        sock.close()


def cmd_exec(client: Any, args: list[str]) -> int:
    opts, pos = parse("exec", args)
    if len(pos) < 2:
        _usage("exec", "docker: 'docker exec' requires at least 2 arguments.")
    ref, command = pos[0], pos[1:]
    env = _env_pairs(opts["env"], "exec")
    info = _find(client, ref)
    if info.state == "stopped":
        raise DockerError(f"Error response from daemon: container {info.id} is not running")
    from dsec.sdk import Sandbox

    stdin = _read_stdin() if opts["interactive"] else None
    try:
        sb = Sandbox.connect(info.id, client=client)
        if opts["detach"]:
            r = sb.commands.run(
                ["/bin/sh", "-c", 'set -m; "$@" </dev/null >/dev/null 2>&1 &', "sh", *command],
                cwd=opts["workdir"],
                env=env,
                user=opts["user"],
                timeout=60,
            )
            return 0 if r.exit_code == 0 else EXIT_CANNOT_INVOKE
        result, unstreamed = _stream(
            sb,
            command,
            cwd=opts["workdir"],
            env=env,
            user=opts["user"],
            stdin=stdin,
            timeout=_MAX_S,
            max_output_bytes=64 << 20,
        )
    except InvalidRequest as e:
        if "cwd" in e.details:
            sys.stderr.write(
                "OCI runtime exec failed: exec failed: unable to start container process: "
                f'chdir to cwd ("{opts["workdir"]}") set in config.json failed: no such file '
                "or directory: unknown\n"
            )
            return EXIT_CANNOT_INVOKE
        raise
    failed = _start_failure(result, command)
    if failed is not None:
        sys.stderr.write(
            "OCI runtime exec failed: exec failed: unable to start container process: "
            f"{failed[1]}: unknown\n"
        )
        return EXIT_CANNOT_INVOKE
    _print_unstreamed(unstreamed)
    return _exit_code(result)


def _human(seconds: float) -> str:
    """go-units ``HumanDuration``, as docker prints ages."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    m = s // 60
    if m == 1:
        return "About a minute"
    if m < 60:
        return f"{m} minutes"
    h = round(s / 3600)
    if h == 1:
        return "About an hour"
    if h < 48:
        return f"{h} hours"
    if h < 24 * 7 * 2:
        return f"{h // 24} days"
    if h < 24 * 30 * 2:
        return f"{h // 24 // 7} weeks"
    if h < 24 * 365 * 2:
        return f"{h // 24 // 30} months"
    return f"{h // 24 // 365} years"


def _row(info: SandboxInfo, now: datetime, no_trunc: bool) -> dict[str, str]:
    age = (now - info.created_at).total_seconds()
    if info.state == "stopped":
        status = f"Exited {_human((now - info.updated_at).total_seconds())} ago"
        state = "exited"
    elif info.state == "paused":
        status, state = f"Up {_human(age)} (Paused)", "paused"
    elif info.state == "creating":
        status, state = "Created", "created"
    else:
        status, state = f"Up {_human(age)}", "running"
    command = info.labels.get(COMMAND_LABEL, "")
    shown = f'"{command}"'
    if not no_trunc and len(command) > 20:
        shown = f'"{command[:19]}…"'
    labels = ",".join(
        f"{k}={v}" for k, v in sorted(info.labels.items()) if not k.startswith(CONFIG_LABEL + ".")
    )
    ports = ", ".join(
        f"{b['HostIp']}:{b['HostPort']}->{key}"
        for key, binds in (get_config(info.labels).get("Ports") or {}).items()
        for b in binds
        if state in ("running", "paused")
    )
    return {
        "ID": info.id,
        "Image": info.image,
        "Command": shown,
        "CreatedAt": info.created_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S +0000 UTC"),
        "RunningFor": f"{_human(age)} ago",
        "Ports": ports,
        "State": state,
        "Status": status,
        "Size": "0B",
        "Names": _name_of(info),
        "Labels": labels,
        "Mounts": "",
        "Networks": "",
        "LocalVolumes": "0",
    }


_HEADERS = {
    "ID": "CONTAINER ID",
    "Image": "IMAGE",
    "Command": "COMMAND",
    "CreatedAt": "CREATED AT",
    "RunningFor": "CREATED",
    "Ports": "PORTS",
    "State": "STATE",
    "Status": "STATUS",
    "Size": "SIZE",
    "Names": "NAMES",
    "Labels": "LABELS",
    "Mounts": "MOUNTS",
    "Networks": "NETWORKS",
    "LocalVolumes": "LOCAL VOLUMES",
}


def _template(text: str) -> Template:
    """``--format`` as a Go template (``json``: the whole object as JSON)."""
    if text == "json":
        text = "{{json .}}"
    try:
        return Template(text.replace("\\t", "\t").replace("\\n", "\n"))
    except TemplateError as e:
        raise DockerError(f"template parsing error: {e}", EXIT_DAEMON) from None


def _listing(fmt: str | None, default: str, rows: list[GoStruct], header: GoStruct) -> str:
    """``ps``/``images`` output: ``fmt`` (a template, ``table TEMPLATE`` or ``json``) per
    row, or docker's table; a template error exits 125 with Go's message."""
    if fmt in (None, "", "table"):
        fmt = default
    assert fmt is not None
    table = fmt.startswith("table")
    tmpl = _template(fmt[len("table") :].lstrip(" ") if table else fmt)
    try:
        if table:
            lines = [tmpl.execute(header, strict=False)] + [tmpl.execute(r) for r in rows]
            return _table([line.split("\t") for line in lines])
        return "".join(tmpl.execute(r) + "\n" for r in rows)
    except TemplateError as e:
        raise DockerError(str(e), EXIT_DAEMON) from None


def _table(rows: list[list[str]]) -> str:
    """docker's tabwriter (minwidth 10, padding 3): aligned columns, last one unpadded."""
    if not rows:
        return ""
    widths = [max(10, max(len(r[i]) for r in rows) + 3) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(widths[i]) for i, c in enumerate(r[:-1])] + [r[-1]]
        lines.append("".join(cells).rstrip() if not r[-1] else "".join(cells))
    return "\n".join(lines) + "\n"


_PS_TYPE = "*formatter.ContainerContext"


def cmd_ps(client: Any, args: list[str]) -> int:
    opts, pos = parse("ps", args)
    if pos:
        _usage("ps", '"docker ps" accepts no arguments.')
    if opts["format"] not in (None, "", "table", "json"):
        _template(opts["format"])  # a bad template fails before the server is asked
    sandboxes = [s for s in client.list_sandboxes(include_stopped=opts["all"]) if not _removed(s)]
    sandboxes.sort(key=lambda s: s.created_at, reverse=True)
    now = datetime.now(UTC)
    rows = [
        GoStruct(
            _PS_TYPE,
            _row(s, now, opts["no_trunc"]),
            {"Label": lambda key, labels=s.labels: labels.get(key, "")},
        )
        for s in sandboxes
    ]
    if opts["quiet"]:
        sys.stdout.write("".join(f"{r.fields['ID']}\n" for r in rows))
        return 0
    header = GoStruct(_PS_TYPE, dict(_HEADERS), {"Label": lambda key: key.upper()})
    sys.stdout.write(
        _listing(
            opts["format"],
            "table {{.ID}}\t{{.Image}}\t{{.Command}}\t{{.RunningFor}}\t{{.Status}}\t"
            "{{.Ports}}\t{{.Names}}",
            rows,
            header,
        )
    )
    return 0


def cmd_stop(client: Any, args: list[str]) -> int:
    opts, pos = parse("stop", args)
    if not pos:
        _usage("stop", "docker: 'docker stop' requires at least 1 argument.")
    if opts["time"] is not None and not re.fullmatch(r"-?\d+", opts["time"]):
        _usage(
            "stop",
            f'invalid argument "{opts["time"]}" for "-t, --time" flag: strconv.ParseInt: parsing "{opts["time"]}": invalid syntax',
        )
    return _each(pos, lambda ref: _kill(client, _find(client, ref)))


def _each(refs: list[str], act: Callable[[str], None]) -> int:
    """``act`` on every reference, printing each done; docker's errors on stderr, exit 1."""
    code = 0
    for ref in refs:
        try:
            act(ref)
            print(ref)
        except DockerError as e:
            sys.stderr.write(e.message + "\n")
            code = 1
    return code


def _kill(client: Any, info: SandboxInfo) -> None:
    """Kill the sandbox (if it runs) and end its ``-p`` forwarder: the host ports are free
    once this returns."""
    from dsec.sdk import Sandbox

    if info.state != "stopped":
        try:
            Sandbox.connect(info.id, client=client).kill()
        except (SandboxNotFound, SandboxStopped):
            pass
    docker_ports.stop_forwarder(info.id)


def cmd_kill(client: Any, args: list[str]) -> int:
    opts, pos = parse("kill", args)
    if not pos:
        _usage("kill", "docker: 'docker kill' requires at least 1 argument.")
    sig = (opts["signal"] or "KILL").upper().removeprefix("SIG")
    if sig not in ("KILL", "9"):
        _usage("kill", f"dsec docker kill: only SIGKILL can be sent (not {opts['signal']})")

    def kill(ref: str) -> None:
        info = _find(client, ref)
        if info.state == "stopped":
            raise DockerError(
                f"Error response from daemon: cannot kill container: {ref}: container "
                f"{info.id} is not running"
            )
        _kill(client, info)

    return _each(pos, kill)


def cmd_rm(client: Any, args: list[str]) -> int:
    opts, pos = parse("rm", args)
    if not pos:
        _usage("rm", "docker: 'docker rm' requires at least 1 argument.")

    def remove(ref: str) -> None:
        info = _find(client, ref)
        if info.state != "stopped" and not opts["force"]:
            raise DockerError(
                f'Error response from daemon: cannot remove container "/{_name_of(info)}": '
                "container is running: stop the container before removing or force remove"
            )
        _kill(client, info)

    return _each(pos, remove)


def cmd_pull(client: Any, args: list[str]) -> int:
    opts, pos = parse("pull", args)
    if len(pos) != 1:
        _usage("pull", "docker: 'docker pull' requires 1 argument.")
    ref = pos[0]
    try:
        name = _resolve_image(client, ref).name
    except ImageNotFound:
        first, slash, _ = ref.partition("/")
        registry = ref.startswith("oci://") or (
            bool(slash) and ("." in first or ":" in first or first == "localhost")
        )
        if not registry:
            raise DockerError(
                f"Error response from daemon: pull access denied for {ref}, repository does not "
                "exist or may require 'docker login'"
            ) from None
        try:  # a registry reference: the server pulls it (OCI / Docker v2)
            name = str(client.pull_image(ref).name)
        except DsecError as e:
            raise DockerError(f"Error response from daemon: {e.message}") from None
    if opts["quiet"]:
        print(name)
    else:
        print(f"Using image {name}\nStatus: Image is up to date for {name}\n{name}")
    return 0


def _split_cp(arg: str) -> tuple[str | None, str]:
    """(container, path) of a cp argument; container None for a local path."""
    if arg == "-" or arg.startswith(("/", ".")):
        return None, arg
    ref, colon, path = arg.partition(":")
    if not colon:
        return None, arg
    return ref, path


def _size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n}B"


def cmd_cp(client: Any, args: list[str]) -> int:
    opts, pos = parse("cp", args)
    if len(pos) != 2:
        _usage("cp", "docker: 'docker cp' requires 2 arguments.")
    (src_ref, src), (dst_ref, dst) = _split_cp(pos[0]), _split_cp(pos[1])
    if (src_ref is None) == (dst_ref is None):
        _usage(
            "cp",
            "must specify at least one container source"
            if src_ref is None
            else "copying between containers is not supported",
        )
    if (src_ref is not None and not src) or (dst_ref is not None and not dst):
        raise DockerError("Error response from daemon: path cannot be empty", 1)
    from dsec.sdk import Sandbox

    ref = src_ref or dst_ref
    assert ref is not None
    info = _find(client, ref)
    if info.state == "stopped":
        raise DockerError(
            f"Error response from daemon: container {info.id} is not running (dsec "
            "keeps no files of a stopped sandbox)"
        )
    sb = Sandbox.connect(info.id, client=client)
    workdir = info.workdir or "/"
    if src_ref is not None:
        copied = _cp_from(sb, posixpath.join(workdir, src), dst, ref)
    else:
        copied = _cp_to(sb, src, posixpath.join(workdir, dst), ref)
    if not opts["quiet"] and dst != "-":
        sys.stderr.write(f"Successfully copied {_size_text(copied)} to {pos[1]}\n")
    return 0


def _cp_from(sb: Any, src: str, dst: str, ref: str) -> int:
    contents_only = src.endswith("/.")
    src_path = posixpath.normpath(src)
    try:
        st = sb.files.stat(src_path)
    except FileNotFound:
        raise DockerError(
            f"Error response from daemon: Could not find the file {src} in container {ref}"
        ) from None
    if dst == "-":  # a tar stream of the path on stdout, as docker does
        with tempfile.TemporaryDirectory() as tmp:
            written = sb.files.download_dir(src_path, tmp)
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                base = posixpath.basename(src_path) or "."
                root = Path(tmp)
                if st.type == "dir":
                    tar.add(root, arcname=base)
                else:
                    tar.add(root / written[0], arcname=base)
            sys.stdout.buffer.write(buf.getvalue())
            sys.stdout.flush()
            return len(buf.getvalue())
    target = Path(dst)
    if st.type != "dir":
        if dst.endswith("/") and not target.is_dir():
            raise DockerError(f"Error response from daemon: destination directory {dst} must exist")
        if target.is_dir():
            target = target / posixpath.basename(src_path)
        data = sb.files.read(src_path)
        target.write_bytes(data)
        if st.mode:
            os.chmod(target, st.mode & 0o777)
        return len(data)
    if target.exists() and not target.is_dir():
        raise DockerError("Error response from daemon: cannot copy a directory to a file")
    if target.is_dir() and not contents_only:
        target = target / posixpath.basename(src_path)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        written = sb.files.download_dir(src_path, tmp)
        total = 0
        for rel in written:
            p = Path(tmp) / rel
            if p.is_file():
                total += p.stat().st_size
        for child in Path(tmp).iterdir():
            dest = target / child.name
            if dest.is_dir() and child.is_dir():
                _merge(child, dest)
            else:
                os.replace(child, dest)
    return total


def _merge(src: Path, dst: Path) -> None:
    for child in src.iterdir():
        dest = dst / child.name
        if dest.is_dir() and child.is_dir():
            _merge(child, dest)
        else:
            os.replace(child, dest)


def _cp_to(sb: Any, src: str, dst: str, ref: str) -> int:
    dst_path = posixpath.normpath(dst)
    try:
        dst_stat = sb.files.stat(dst_path)
    except FileNotFound:
        dst_stat = None
    if src == "-":  # a tar archive on stdin, extracted into the directory dst
        if dst_stat is None or dst_stat.type != "dir":
            raise DockerError(
                f"Error response from daemon: Could not find the file {dst} in container {ref}"
            )
        data = _read_stdin()
        with tempfile.TemporaryDirectory() as tmp:
            # the SDK's checked extraction: no absolute or escaping paths, links or devices
            from dsec.sdk.sandbox import _safe_extract

            try:
                _safe_extract(data, Path(tmp))
            except InvalidRequest as e:
                raise DockerError(f"Error response from daemon: {e.message}") from None
            sb.files.upload_dir(tmp, dst_path)
        return len(data)
    local = Path(src)
    if not local.exists():
        raise DockerError(f"lstat {local.absolute()}: no such file or directory")
    contents_only = src.endswith("/.")
    if local.is_dir():
        if dst_stat is not None and dst_stat.type != "dir":
            raise DockerError("Error response from daemon: cannot copy a directory to a file")
        target = dst_path
        if dst_stat is not None and not contents_only:
            target = posixpath.join(dst_path, local.resolve().name)
        sb.files.upload_dir(local, target)
        return sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    if dst.endswith("/") and (dst_stat is None or dst_stat.type != "dir"):
        raise DockerError(
            f"Error response from daemon: Could not find the file {dst} in container {ref}"
        )
    target = (
        posixpath.join(dst_path, local.name)
        if dst_stat is not None and dst_stat.type == "dir"
        else dst_path
    )
    data = local.read_bytes()
    sb.files.write(target, data, mode=local.stat().st_mode & 0o777)
    return len(data)


def _format_or_none(text: str | None, parse_code: int) -> Template | None:
    if not text:
        return None
    try:
        return _template(text)
    except DockerError as e:
        raise DockerError(e.message, parse_code) from None


def _execute(tmpl: Template, doc: Any) -> str:
    """One object through ``--format``; an execution error ends the command (exit 1)."""
    try:
        return tmpl.execute(doc) + "\n"
    except TemplateError as e:
        raise DockerError(str(e), 1) from None


def cmd_version(client: Any, args: list[str]) -> int:
    opts, pos = parse("version", args)
    if pos:
        _usage("version", '"docker version" accepts no arguments.')
    tmpl = _format_or_none(opts["format"], 64)  # docker: a bad template exits 64
    node, failed = None, None
    try:
        node = client.node_info()
    except DsecError as e:
        failed = e
    doc = version_document(node, str(client.url))
    try:
        sys.stdout.write(version_text(doc) if tmpl is None else _execute(tmpl, doc))
    except DockerError:
        if failed is None:
            raise
    if failed is not None:
        raise failed
    return 0


def cmd_info(client: Any, args: list[str]) -> int:
    opts, pos = parse("info", args)
    if pos:
        _usage("info", '"docker info" accepts no arguments.')
    tmpl = _format_or_none(opts["format"], 64)
    node = client.node_info()
    sandboxes = [s for s in client.list_sandboxes(include_stopped=True) if not _removed(s)]
    images = sum(1 for i in client.list_images() if i.status == "ready")
    doc = info_document(node, sandboxes, images, str(client.url))
    sys.stdout.write(info_text(doc) if tmpl is None else _execute(tmpl, doc))
    return 0


def _image_of(client: Any, name: str) -> ImageInfo | None:
    try:
        image: ImageInfo = client.get_image(name)
        return image
    except DsecError:  # gone, or not this key's any more
        return None


def cmd_inspect(client: Any, args: list[str], kind: str | None = None) -> int:
    opts, pos = parse("inspect", args)
    if not pos:
        _usage("inspect", "docker: 'docker inspect' requires at least 1 argument.")
    kind = kind or opts["type"]
    if kind not in (None, "container", "image"):
        _usage(
            "inspect", f'"{kind}" is not a valid value for --type (dsec docker: container, image)'
        )
    tmpl = _format_or_none(opts["format"], 1)
    machine: list[str] = []
    docs: list[dict[str, Any]] = []
    code = 0
    for ref in pos:
        doc = None
        if kind in (None, "container"):
            try:
                info = _find(client, ref)
                doc = container_document(info, _image_of(client, info.image))
            except DockerError as e:
                if "No such container" not in e.message:
                    raise
        if doc is None and kind in (None, "image"):
            try:
                image = _resolve_image(client, ref)
                if not machine:
                    host = client.node_info().host
                    machine.append(host.architecture if host else "")
                doc = image_document(image, machine[0])
            except ImageNotFound:
                pass
        if doc is None:
            sys.stderr.write(f"Error: No such {kind or 'object'}: {ref}\n")
            code = 1
            continue
        docs.append(doc)
    if tmpl is None:
        sys.stdout.write(json.dumps(docs, indent=4, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write("".join(_execute(tmpl, doc) for doc in docs))
    return code


def _host_port(binding: dict[str, str]) -> str:
    ip = binding.get("HostIp", "")
    return (
        f"[{ip}]:{binding.get('HostPort', '')}"
        if ":" in ip
        else f"{ip}:{binding.get('HostPort', '')}"
    )


def cmd_port(client: Any, args: list[str]) -> int:
    opts, pos = parse("port", args)
    del opts
    if not 1 <= len(pos) <= 2:
        _usage("port", '"docker port" requires at least 1 and at most 2 arguments.')
    info = _find(client, pos[0])
    ports: dict[str, list[dict[str, str]]] = {}
    if info.state in ("running", "paused"):
        ports = get_config(info.labels).get("Ports") or {}
    if len(pos) == 2:
        port, _, proto = pos[1].partition("/")
        key = f"{port}/{proto or 'tcp'}"
        if not ports.get(key):
            raise DockerError(f"Error: No public port '{key}' published for {pos[0]}")
        sys.stdout.write("".join(_host_port(b) + "\n" for b in ports[key]))
        return 0
    for key in sorted(ports, key=lambda k: int(k.partition("/")[0])):
        sys.stdout.write("".join(f"{key} -> {_host_port(b)}\n" for b in ports[key]))
    return 0


_IMAGE_HEADERS = {
    "ID": "IMAGE ID",
    "Repository": "REPOSITORY",
    "Tag": "TAG",
    "Digest": "DIGEST",
    "CreatedSince": "CREATED",
    "CreatedAt": "CREATED AT",
    "Size": "SIZE",
    "Containers": "CONTAINERS",
    "SharedSize": "SHARED SIZE",
    "UniqueSize": "UNIQUE SIZE",
    "VirtualSize": "VIRTUAL SIZE",
}
_IMAGES_TYPE = "*formatter.imageContext"


def cmd_images(client: Any, args: list[str]) -> int:
    opts, pos = parse("images", args)
    if len(pos) > 1:
        _usage("images", '"docker images" requires at most 1 argument.')
    if opts["format"] not in (None, "", "table", "json"):
        _template(opts["format"])
    now = datetime.now(UTC)
    rows: list[GoStruct] = []
    for image in sorted(client.list_images(), key=lambda i: i.created_at, reverse=True):
        if image.status != "ready" and not opts["all"]:
            continue
        repo, tag = repo_tag(image.name)
        if pos and pos[0] not in (repo, f"{repo}:{tag}", image.name):
            continue
        full = image_id(image.layers)
        rows.append(
            GoStruct(
                _IMAGES_TYPE,
                {
                    "ID": full if opts["no_trunc"] else full.removeprefix("sha256:")[:12],
                    "Repository": repo,
                    "Tag": tag,
                    "Digest": "<none>",
                    "CreatedSince": f"{_human((now - image.created_at).total_seconds())} ago",
                    "CreatedAt": image.created_at.astimezone(UTC).strftime(
                        "%Y-%m-%d %H:%M:%S +0000 UTC"
                    ),
                    "Size": _size_text(image.size),
                    "Containers": "N/A",
                    "SharedSize": "N/A",
                    "UniqueSize": "N/A",
                    "VirtualSize": _size_text(image.size),
                },
            )
        )
    if opts["quiet"]:
        ids = dict.fromkeys(r.fields["ID"] for r in rows)
        sys.stdout.write("".join(f"{i}\n" for i in ids))
        return 0
    header = GoStruct(_IMAGES_TYPE, dict(_IMAGE_HEADERS))
    default = "table {{.Repository}}\t{{.Tag}}\t{{.ID}}\t{{.CreatedSince}}\t{{.Size}}"
    sys.stdout.write(_listing(opts["format"], default, rows, header))
    return 0


def cmd_rmi(client: Any, args: list[str]) -> int:
    opts, pos = parse("rmi", args)
    del opts  # -f: dsec keeps an image's layers while sandboxes use them
    if not pos:
        _usage("rmi", "docker: 'docker rmi' requires at least 1 argument.")
    code = 0
    for ref in pos:
        try:
            image = _resolve_image(client, ref)
            client.delete_image(image.name)
        except ImageNotFound:
            sys.stderr.write(f"Error response from daemon: No such image: {ref}\n")
            code = 1
            continue
        except DsecError as e:
            sys.stderr.write(f"Error response from daemon: {e.message}\n")
            code = 1
            continue
        repo, tag = repo_tag(image.name)
        print(f"Untagged: {repo}:{tag}\nDeleted: {image_id(image.layers)}")
    return code


_VERBS: dict[str, Callable[[Any, list[str]], int]] = {
    "run": cmd_run,
    "exec": cmd_exec,
    "ps": cmd_ps,
    "stop": cmd_stop,
    "rm": cmd_rm,
    "kill": cmd_kill,
    "pull": cmd_pull,
    "cp": cmd_cp,
    "version": cmd_version,
    "info": cmd_info,
    "inspect": cmd_inspect,
    "port": cmd_port,
    "images": cmd_images,
    "rmi": cmd_rmi,
    "container-inspect": lambda client, args: cmd_inspect(client, args, "container"),
    "image-inspect": lambda client, args: cmd_inspect(client, args, "image"),
}
# docker container VERB / docker image VERB: the verb they stand for
_GROUPS: dict[str, dict[str, str]] = {
    "container": {
        **{v: v for v in ("run", "exec", "stop", "rm", "kill", "cp", "port")},
        "ls": "ps",
        "list": "ps",
        "ps": "ps",
        "inspect": "container-inspect",
    },
    "image": {
        "inspect": "image-inspect",
        "ls": "images",
        "list": "images",
        "rm": "rmi",
        "remove": "rmi",
        "pull": "pull",
    },
}


def main(
    argv: Sequence[str] | None = None, *, url: str | None = None, api_key: str | None = None
) -> int:
    """Run one docker command (``argv`` without the program name); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_TOP_HELP)
        return 0
    if args[0] in ("-v", "--version"):
        sys.stdout.write(f"Docker version {DOCKER_VERSION}, build dsec\n")
        return 0
    if args[0].startswith("-"):
        sys.stderr.write(f"unknown flag: {args[0]}\nSee 'docker --help'.\n")
        return EXIT_DAEMON
    verb, rest = args[0], args[1:]
    hidden = "-" in verb  # container-inspect etc.: reached as "container inspect" only
    if verb in _GROUPS:
        group = _GROUPS[verb]
        if not rest or rest[0] in ("-h", "--help"):
            sys.stdout.write(f"Usage:  docker {verb} COMMAND\n\nCommands: {', '.join(group)}\n")
            return 0
        if rest[0] not in group:
            sys.stderr.write(
                f"docker: '{verb} {rest[0]}' is not a docker command (dsec docker supports "
                f"{verb} {', '.join(group)}).\nSee 'docker {verb} --help'\n"
            )
            return 1
        verb, rest = group[rest[0]], rest[1:]
    if verb not in _VERBS or hidden:
        sys.stderr.write(
            f"docker: '{verb}' is not a docker command (dsec docker supports "
            f"{', '.join(v for v in [*_VERBS, *_GROUPS] if '-' not in v)}).\n"
            "See 'docker --help'\n"
        )
        return 1
    try:
        return _VERBS[verb](_client(url, api_key), rest)
    except _Help:
        sys.stdout.write(_HELP[verb.rpartition("-")[2]] + "\n")
        return 0
    except DockerError as e:
        sys.stderr.write(e.message.rstrip("\n") + "\n")
        return e.code
    except ServiceUnavailable as e:
        sys.stderr.write(
            f"Cannot connect to the dsec server: {e.message}. Is `dsec serve` running?\n"
        )
        return EXIT_DAEMON if verb == "run" else 1
    except DsecError as e:
        sys.stderr.write(f"Error response from daemon: {e.message}\n")
        return EXIT_DAEMON if verb == "run" else 1
    except KeyboardInterrupt:
        return 130


def entrypoint() -> None:
    """The ``dsec-docker`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
