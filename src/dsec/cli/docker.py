"""``dsec docker`` / ``dsec-docker``: the part of the docker CLI that agent tools shell out to.

A "container" is a dsec sandbox of the caller's API key; its name is the sandbox label
``docker.name`` (names are per key). Supported::

    run  [-d] [--rm] [-i] [--name N] [-w DIR] [-e K=V|K]... [-l K=V]... [-u USER]
         [--cpus N] [-m SIZE] [--network none] [--runtime TIER] IMAGE [CMD [ARG...]]
    exec [-i] [-d] [-w DIR] [-e K=V|K]... [-u USER] CONTAINER CMD [ARG...]
    ps   [-a] [-q] [--no-trunc] [--format TEMPLATE]
    stop [-t SECONDS] CONTAINER...        rm [-f] CONTAINER...
    pull [-q] IMAGE                       cp [-q] SRC DEST   (one side CONTAINER:PATH, or -)

Exit codes as docker's: a command's own exit code (128+N when killed by signal N); 125
for a bad flag or argument (the message names it) and for ``run``'s daemon errors; 126 and
127 for a command that cannot be started (``run``: 127 not found, 126 not executable;
``exec``: 126, as dockerd answers); 1 for other daemon errors ("No such container").

What differs from docker (docs/integrations.md has the full table): a container lives
until ``stop``/``rm`` or its idle TTL, not until its command exits; ``run`` without
``-d`` kills the sandbox when the command ends (``ps -a`` lists it as Exited until the
server forgets it; ``rm`` of an exited container does nothing); names are unique among
live containers only; the images are dsec's (``busybox``, ``debian``, built or pulled
ones); output is text (invalid UTF-8 is replaced); ``-i`` sends all of stdin at once
(no interactive streaming, no ``-t``); there are no ports, volumes or logs.

Connection: ``$DSEC_URL`` and ``$DSEC_API_KEY`` / ``$DSEC_HOME/api_key`` (``dsec --url U
--api-key K docker ...`` too). ``$DSEC_DOCKER_TIER`` picks the default tier (``container``).
"""

from __future__ import annotations

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
from dsec.models import SandboxInfo

__all__ = ["EXIT_CANNOT_INVOKE", "EXIT_DAEMON", "EXIT_NOT_FOUND", "main"]

EXIT_DAEMON = 125
"""A docker (here: dsec) error, or a bad flag or argument."""
EXIT_CANNOT_INVOKE = 126
"""The command was found but cannot be run (``exec``: any start failure)."""
EXIT_NOT_FOUND = 127
"""The command was not found (``run``)."""

NAME_LABEL = "docker.name"
COMMAND_LABEL = "docker.command"
AUTOREMOVE_LABEL = "docker.autoremove"
"""Set by ``run --rm``: once stopped, the container is gone for ``ps -a``, ``rm``, ``cp``."""
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_MAX_S = 24 * 3600.0 - 60  # an exec lives at most 24 hours
_TIERS = ("container", "microvm", "vm", "fncall")

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


_SPECS: dict[str, _Spec] = {
    "run": _Spec(
        bools={
            "-d": "detach",
            "--detach": "detach",
            "--rm": "rm",
            "-i": "interactive",
            "--interactive": "interactive",
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
        },
        multi=frozenset({"env", "label"}),
        interspersed=False,
        refused={"-t": "no terminals", "--tty": "no terminals"},
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
    "ps": _Spec(
        bools={
            "-a": "all",
            "--all": "all",
            "-q": "quiet",
            "--quiet": "quiet",
            "--no-trunc": "no_trunc",
        },
        values={"--format": "format"},
    ),
    "stop": _Spec(
        bools={}, values={"-t": "time", "--time": "time", "-s": "signal", "--signal": "signal"}
    ),
    "rm": _Spec(bools={"-f": "force", "--force": "force"}, values={}),
    "pull": _Spec(bools={"-q": "quiet", "--quiet": "quiet"}, values={}),
    "cp": _Spec(bools={"-q": "quiet", "--quiet": "quiet"}, values={}),
}

_HELP = {
    "run": "Usage:  docker run [OPTIONS] IMAGE [COMMAND] [ARG...]",
    "exec": "Usage:  docker exec [OPTIONS] CONTAINER COMMAND [ARG...]",
    "ps": "Usage:  docker ps [OPTIONS]",
    "stop": "Usage:  docker stop [OPTIONS] CONTAINER [CONTAINER...]",
    "rm": "Usage:  docker rm [OPTIONS] CONTAINER [CONTAINER...]",
    "pull": "Usage:  docker pull [OPTIONS] NAME[:TAG]",
    "cp": "Usage:  docker cp [OPTIONS] CONTAINER:SRC_PATH DEST_PATH|-\n"
    "        docker cp [OPTIONS] SRC_PATH|- CONTAINER:DEST_PATH",
}

_TOP_HELP = (
    "Usage:  dsec docker COMMAND\n\nA docker-compatible subset on dsec sandboxes.\n\n"
    "Commands:\n  run     Create and run a new container from an image\n"
    "  exec    Execute a command in a running container\n  ps      List containers\n"
    "  stop    Stop one or more running containers\n  rm      Remove one or more containers\n"
    "  pull    Check that an image is available\n"
    "  cp      Copy files/folders between a container and the local filesystem\n"
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


def _resolve_image(client: Any, ref: str) -> str:
    name = _image_name(ref)
    candidates = [name] + ([name.removesuffix(":latest")] if name.endswith(":latest") else [])
    for candidate in candidates:
        try:
            return str(client.get_image(candidate).name)
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


def cmd_run(client: Any, args: list[str]) -> int:
    try:
        opts, pos = parse("run", args)
    except DockerError as e:
        raise DockerError(f"docker: {e.message}", e.code) from None
    if not pos:
        _usage("run", "docker: 'docker run' requires at least 1 argument.")
    image, command = pos[0], pos[1:] or ["/bin/sh"]
    network = opts["network"]
    if network not in (None, "none"):
        _usage(
            "run",
            f"docker: unsupported network {network!r} (dsec docker: only --network none; "
            "sandboxes have no network)",
        )
    tier = opts["runtime"] or os.environ.get("DSEC_DOCKER_TIER", "container")
    if tier not in _TIERS:
        _usage("run", f"docker: unknown runtime {tier!r} (dsec tiers: {', '.join(_TIERS)})")
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
    workdir = opts["workdir"] or "/"
    stdin = _read_stdin() if opts["interactive"] else None
    from dsec.sdk import Sandbox

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
            image_name = _resolve_image(client, image)
        except ImageNotFound:
            raise DockerError(
                f"Unable to find image '{image}' locally\ndocker: Error response from daemon: "
                f"pull access denied for {image}, repository does not exist or may require "
                "'docker login'.",
                EXIT_DAEMON,
            ) from None
        labels[NAME_LABEL] = name or f"dsec_{secrets.token_hex(4)}"
        labels[COMMAND_LABEL] = shlex.join(command)[:1024]
        if opts["rm"]:
            labels[AUTOREMOVE_LABEL] = "true"
        sb = Sandbox.create(
            tier=tier,
            image=image_name,
            cpu=cpu,
            memory_mb=memory_mb,
            env=env,
            labels=labels,
            user=opts["user"],
            workdir=workdir,
            client=client,
        )
    except DockerError:
        raise
    except DsecError as e:
        raise DockerError(
            f"docker: Error response from daemon: {e.message}.", EXIT_DAEMON
        ) from None
    try:
        if workdir != "/":
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
        if not opts["detach"]:
            try:
                sb.kill()
            except DsecError:
                pass


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
    labels = ",".join(f"{k}={v}" for k, v in sorted(info.labels.items()))
    return {
        "ID": info.id,
        "Image": info.image,
        "Command": shown,
        "CreatedAt": info.created_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S +0000 UTC"),
        "RunningFor": f"{_human(age)} ago",
        "Ports": "",
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
_FIELD = re.compile(r"\{\{\s*(?:(json)\s+)?\.(\w*)(?:\s+\"([^\"]*)\")?\s*\}\}")
_ANY_ACTION = re.compile(r"\{\{.*?\}\}")


def _render(template: str, row: dict[str, str], labels: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        as_json, name, arg = m.group(1), m.group(2), m.group(3)
        if name == "" and as_json:
            return json.dumps(row, sort_keys=True, ensure_ascii=False)
        if name == "Label" and arg is not None:
            return labels.get(arg, "")
        value = row[name]
        return json.dumps(value) if as_json else value

    return _FIELD.sub(one, template)


def _check_template(template: str) -> None:
    for action in _ANY_ACTION.findall(template):
        m = _FIELD.fullmatch(action)
        ok = m is not None and (
            (m.group(1) and m.group(2) == "" and m.group(3) is None)
            or (m.group(2) == "Label" and m.group(3) is not None)
            or (m.group(2) in _HEADERS and m.group(3) is None)
        )
        if not ok:
            raise DockerError(
                f"template parsing error: unsupported action {action} (dsec docker supports "
                '{{.Field}}, {{json .}}, {{json .Field}} and {{.Label "key"}} with the fields '
                f"{', '.join(_HEADERS)})",
                EXIT_DAEMON,
            )


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


def cmd_ps(client: Any, args: list[str]) -> int:
    opts, pos = parse("ps", args)
    if pos:
        _usage("ps", '"docker ps" accepts no arguments.')
    fmt = opts["format"]
    if fmt is not None:
        fmt = fmt.replace("\\t", "\t").replace("\\n", "\n")
        _check_template(fmt)
    sandboxes = [s for s in client.list_sandboxes(include_stopped=opts["all"]) if not _removed(s)]
    sandboxes.sort(key=lambda s: s.created_at, reverse=True)
    now = datetime.now(UTC)
    rows = [(_row(s, now, opts["no_trunc"]), s.labels) for s in sandboxes]
    if opts["quiet"]:
        sys.stdout.write("".join(f"{r['ID']}\n" for r, _ in rows))
        return 0
    if fmt is None or fmt == "table":
        fmt = "table {{.ID}}\t{{.Image}}\t{{.Command}}\t{{.RunningFor}}\t{{.Status}}\t{{.Ports}}\t{{.Names}}"
    if fmt.startswith("table"):
        body = fmt[len("table") :].lstrip(" ")
        header = _FIELD.sub(
            lambda m: (
                ""
                if m.group(2) == ""
                else (m.group(3).upper() if m.group(2) == "Label" else _HEADERS[m.group(2)])
            ),
            body,
        )
        lines = [header] + [_render(body, r, labels) for r, labels in rows]
        sys.stdout.write(_table([line.split("\t") for line in lines]))
        return 0
    sys.stdout.write("".join(_render(fmt, r, labels) + "\n" for r, labels in rows))
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
    code = 0
    for ref in pos:
        try:
            info = _find(client, ref)
            if info.state != "stopped":
                _kill(client, info.id)
            print(ref)
        except DockerError as e:
            sys.stderr.write(e.message + "\n")
            code = 1
    return code


def _kill(client: Any, sandbox_id: str) -> None:
    from dsec.sdk import Sandbox

    try:
        Sandbox.connect(sandbox_id, client=client).kill()
    except (SandboxNotFound, SandboxStopped):
        pass


def cmd_rm(client: Any, args: list[str]) -> int:
    opts, pos = parse("rm", args)
    if not pos:
        _usage("rm", "docker: 'docker rm' requires at least 1 argument.")
    code = 0
    for ref in pos:
        try:
            info = _find(client, ref)
            if info.state != "stopped":
                if not opts["force"]:
                    raise DockerError(
                        f'Error response from daemon: cannot remove container "/{_name_of(info)}": '
                        "container is running: stop the container before removing or force remove"
                    )
                _kill(client, info.id)
            print(ref)
        except DockerError as e:
            sys.stderr.write(e.message + "\n")
            code = 1
    return code


def cmd_pull(client: Any, args: list[str]) -> int:
    opts, pos = parse("pull", args)
    if len(pos) != 1:
        _usage("pull", "docker: 'docker pull' requires 1 argument.")
    ref = pos[0]
    try:
        name = _resolve_image(client, ref)
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


_VERBS: dict[str, Callable[[Any, list[str]], int]] = {
    "run": cmd_run,
    "exec": cmd_exec,
    "ps": cmd_ps,
    "stop": cmd_stop,
    "rm": cmd_rm,
    "pull": cmd_pull,
    "cp": cmd_cp,
}


def main(
    argv: Sequence[str] | None = None, *, url: str | None = None, api_key: str | None = None
) -> int:
    """Run one docker command (``argv`` without the program name); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_TOP_HELP)
        return 0
    if args[0].startswith("-"):
        sys.stderr.write(f"unknown flag: {args[0]}\nSee 'docker --help'.\n")
        return EXIT_DAEMON
    verb, rest = args[0], args[1:]
    if verb == "container" and rest:  # docker container run|exec|ls|stop|rm|cp
        verb, rest = ("ps" if rest[0] in ("ls", "list") else rest[0]), rest[1:]
    if verb not in _VERBS:
        sys.stderr.write(
            f"docker: '{verb}' is not a docker command (dsec docker supports "
            f"{', '.join(_VERBS)}).\nSee 'docker --help'\n"
        )
        return 1
    try:
        return _VERBS[verb](_client(url, api_key), rest)
    except _Help:
        sys.stdout.write(_HELP[verb] + "\n")
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
