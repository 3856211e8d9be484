"""The ``dsec`` command line: run a server, run commands in sandboxes, inspect a node.

Commands::

    dsec serve [--host 127.0.0.1] [--port 7070] [--home DIR]
               [--cluster RAY_ADDRESS [--database postgresql://...] [--node-root DIR]]
    dsec run [--image I] [--tier T] [--keep] [--timeout S] [--env K=V]...
             [--allow-domain D]... [--allow-cidr C]... [--port P]... [--preset NAME]... -- CMD...
    dsec exec ID -- CMD...
    dsec network ID show [--json]
    dsec network ID update [--allow-domain D]... [--allow-cidr C]... [--deny-domain D]...
                           [--deny-cidr C]... [--port P]... [--protocol tcp|udp|icmp]...
                           [--preset NAME]... | --file POLICY.json
    dsec ps [--all] [-o table|wide|json]
    dsec kill ID...
    dsec pause ID... | dsec resume ID...
    dsec snapshot ID [--name N] [--scrub PATH]...
    dsec fork ID -n N [--label K=V]...
    dsec job pause|resume|kill|ls JOB
    dsec trajectory ID [-o FILE]
    dsec logs ID [-f] [-o json]
    dsec metrics ID [-o json]
    dsec replay LOG.jsonl [--image I] [--keep]
    dsec image ls
    dsec image build PATH --name N [--kind K] [--base B] [--system]
    dsec image build -f Dockerfile CONTEXT --name N [--build-arg K=V]... [--no-cache]
                     [--run-network default|none]
    dsec image rm NAME | dsec image share NAME [--stop]
    dsec image push NAME oci://HOST[:PORT]/REPO[:TAG]
    dsec image pull [--lazy] REF
    dsec port-forward ID [LOCAL:]PORT... [--address A]   (local ports to ports in a sandbox)
    dsec info
    dsec doctor [--json] [--tiers T,...]   (this host's kernel, cgroups and tiers; no server)
    dsec docker run|exec|ps|inspect|port|... (a docker CLI subset: dsec/cli/docker.py)
    dsec key create [--name N] [--operator] [--max-sandboxes N] [--max-cpu C]
                    [--max-memory-mb M] [--creations-per-s R] [--cpu-weight W] [--e2b]
    dsec key set OWNER [--max-sandboxes N|none] [...]   (change a key's quota)
    dsec key ls | dsec key revoke KEY_OR_OWNER | dsec key e2b [KEY]   (its e2b_<hex> form)
                       (the key store in $DSEC_HOME, or a cluster's with --database; no server)

Sandboxes have no network unless a network option is given (``--allow-domain``,
``--allow-cidr`` or ``--preset``; see docs/network.md for the policy format).

``CMD`` given as one argument runs under ``/bin/sh -c``; several arguments are exec'd as
an argv. ``run`` and ``exec`` exit with the command's exit code (124 on timeout,
128+N when killed by signal N). Errors print one red line and exit 1; so do ``job``
actions where any sandbox failed, and ``replay`` when the replay diverged.

Connection: ``--url`` / ``$DSEC_URL`` and ``--api-key`` / ``$DSEC_API_KEY`` /
``$DSEC_HOME/api_key``, as in the SDK.

Test hook: set the module attribute :data:`transport_factory` to a callable returning an
``httpx.AsyncBaseTransport`` (e.g. ``dsec.testing.app_transport(edge)[0]``) and every
command talks to that in-process app instead of the network. There is deliberately no
environment variable for this.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec.cli.doctor import doctor
from dsec.cli.tables import Column, OutputFormat, fit_table, print_json, print_table
from dsec.errors import DsecError, InvalidRequest, NotFound
from dsec.models import ExecResult, JobActionResult, PauseReport, SandboxInfo, SandboxMetrics
from dsec.network.policy import NetworkPolicy
from dsec.sdk import AsyncSandbox, Client, Jobs, Sandbox
from dsec.sdk.sync import runner

__all__ = ["app", "make_client", "transport_factory"]

transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None
"""Test hook (see the module docstring). None: use the network."""

app = typer.Typer(
    name="dsec",
    help="Sandboxes for agentic RL: one SDK, four isolation tiers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
image_app = typer.Typer(help="Images and layers.", no_args_is_help=True)
key_app = typer.Typer(help="API keys of the local node ($DSEC_HOME).", no_args_is_help=True)
job_app = typer.Typer(help="Act on every sandbox of a training job at once.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(key_app, name="key")
app.add_typer(job_app, name="job")
app.command("doctor")(doctor)


@app.command(
    "docker",
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": [],
    },
    add_help_option=False,
)
def docker(ctx: typer.Context) -> None:
    """A docker-compatible subset on sandboxes: run, exec, ps, stop, kill, rm, pull, cp,
    inspect, port, images, rmi, version, info (``dsec docker --help``;
    docs/integrations.md). Same as the ``dsec-docker`` command."""
    from dsec.cli.docker import main as docker_main

    raise typer.Exit(docker_main(ctx.args, url=_connection["url"], api_key=_connection["api_key"]))


stdout = Console(highlight=False, soft_wrap=False)
stderr = Console(stderr=True, highlight=False)

_connection: dict[str, str | None] = {"url": None, "api_key": None}

F = TypeVar("F", bound=Callable[..., Any])

_CMD_SETTINGS = {"allow_interspersed_args": False, "ignore_unknown_options": True}

OutputOption = Annotated[
    OutputFormat,
    typer.Option("--output", "-o", help="table (fits the terminal), wide (every column) or json"),
]


def make_client() -> Client:
    """The sync client every command uses (honours ``--url``, ``--api-key`` and the hook)."""
    transport = transport_factory() if transport_factory is not None else None
    return Client(_connection["url"], _connection["api_key"], transport=transport)


def _fail(message: str, code: int = 1) -> typer.Exit:
    stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Print a DsecError as one red line and exit 1, instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DsecError as err:
            raise _fail(f"{err.message} [{err.code}]") from None
        except KeyboardInterrupt:
            raise _fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def main(
    url: Annotated[
        str | None,
        typer.Option("--url", help="server URL (default $DSEC_URL or http://127.0.0.1:7070)"),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="API key (default $DSEC_API_KEY or $DSEC_HOME/api_key)"),
    ] = None,
) -> None:
    """dsec command line."""
    _connection["url"] = url
    _connection["api_key"] = api_key


# --- helpers -----------------------------------------------------------------
def _command(cmd: list[str]) -> str | list[str]:
    if cmd and cmd[0] == "--":  # `dsec exec ID -- CMD`: click keeps the -- after a positional
        cmd = cmd[1:]
    if not cmd:
        raise InvalidRequest("no command given: put it after --, e.g. `dsec run -- echo hi`")
    return cmd[0] if len(cmd) == 1 else list(cmd)


def _parse_env(pairs: list[str], option: str = "--env") -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidRequest(f"{option} wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _write(stream: Any) -> Callable[[str], None]:
    def write(chunk: str) -> None:
        stream.write(chunk)
        stream.flush()

    return write


def _exit_code(result: ExecResult) -> int:
    if result.timed_out:
        return 124
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None:
        return 128 + result.signal
    return 1


def _run_streaming(sb: Any, cmd: str | list[str], timeout: float, env: dict[str, str]) -> int:
    result = sb.commands.run(
        cmd,
        timeout=timeout,
        env=env,
        on_stdout=_write(sys.stdout),
        on_stderr=_write(sys.stderr),
    )
    if result.timed_out:
        stderr.print(f"[yellow]command timed out after {timeout:g} s[/]")
    elif result.exit_code is None and result.signal is not None:
        stderr.print(f"[yellow]command killed by signal {result.signal}[/]")
    if result.truncated:
        stderr.print("[yellow]output was truncated[/]")
    return _exit_code(result)


def _age(ts: datetime) -> str:
    seconds = max(0, int((datetime.now(UTC) - ts).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


# --- network policy options (shared by `run` and `network update`) -------------------
AllowDomainOption = Annotated[
    list[str],
    typer.Option("--allow-domain", help="allow a domain (exact, or *.example.com); repeatable"),
]
AllowCidrOption = Annotated[
    list[str], typer.Option("--allow-cidr", help="allow an IPv4 address/network; repeatable")
]
DenyDomainOption = Annotated[
    list[str], typer.Option("--deny-domain", help="deny a domain (wins over allows); repeatable")
]
DenyCidrOption = Annotated[
    list[str], typer.Option("--deny-cidr", help="deny an IPv4 network (wins); repeatable")
]
PortOption = Annotated[
    list[str],
    typer.Option("--port", help="destination port or lo-hi range; repeatable (default: all)"),
]
ProtocolOption = Annotated[
    list[str], typer.Option("--protocol", help="tcp, udp or icmp; repeatable (default: tcp)")
]
PresetOption = Annotated[
    list[str],
    typer.Option("--preset", help="operator preset (pypi, npm, debian, github...); repeatable"),
]


def _policy_from_options(
    allow_domain: list[str],
    allow_cidr: list[str],
    deny_domain: list[str],
    deny_cidr: list[str],
    port: list[str],
    protocol: list[str],
    preset: list[str],
) -> NetworkPolicy | None:
    """The policy the network options describe; None when none was given."""
    if not (allow_domain or allow_cidr or preset):
        if deny_domain or deny_cidr or port or protocol:
            raise InvalidRequest(
                "--deny-domain, --deny-cidr, --port and --protocol restrict a network: "
                "also name what to allow (--allow-domain, --allow-cidr or --preset)"
            )
        return None
    fields: dict[str, Any] = {
        "allow_domains": allow_domain,
        "allow_cidrs": allow_cidr,
        "deny_domains": deny_domain,
        "deny_cidrs": deny_cidr,
        "presets": preset,
    }
    if port:
        fields["ports"] = port
    if protocol:
        fields["protocols"] = protocol
    return NetworkPolicy(**fields)


def _describe_policy(policy: NetworkPolicy | dict[str, Any] | None) -> str:
    if policy is None:
        return "none (no network)"
    p = NetworkPolicy.parse(policy)
    parts = [
        f"{name}={','.join(str(v) for v in values)}"
        for name, values in (
            ("allow_domains", p.allow_domains),
            ("allow_cidrs", p.allow_cidrs),
            ("presets", p.presets),
            ("deny_domains", p.deny_domains),
            ("deny_cidrs", p.deny_cidrs),
        )
        if values
    ]
    parts.append("ports=" + (",".join(str(v) for v in p.ports) if p.ports else "all"))
    parts.append("protocols=" + ",".join(p.protocols))
    return " ".join(parts)


# --- commands ----------------------------------------------------------------
@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 7070,
    home: Annotated[Path | None, typer.Option(help="state directory (default $DSEC_HOME)")] = None,
    cluster: Annotated[
        str | None,
        typer.Option(help="Ray cluster address (host:port): serve a cluster, one edge per node"),
    ] = None,
    database: Annotated[
        str | None,
        typer.Option(help="PostgreSQL URL of the cluster registry (with --cluster)"),
    ] = None,
    node_root: Annotated[
        str | None,
        typer.Option(help="parent of each node's data dir (with --cluster)"),
    ] = None,
) -> None:
    """Run the apiserver and this node's edge in one process (with --cluster: an apiserver
    replica in front of a Ray cluster)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise _fail(
            f"`dsec serve` needs the server extra ({', '.join(missing)} missing): "
            "pip install 'dsec[server]'"
        )
    from dsec.server import serve as run_server

    handle_errors(run_server)(
        host=host,
        port=port,
        home=str(home) if home else None,
        cluster=cluster,
        database=database,
        node_root=node_root,
    )


@app.command(context_settings=_CMD_SETTINGS)
@handle_errors
def run(
    cmd: Annotated[list[str], typer.Argument(help="command (after --)", show_default=False)],
    image: Annotated[str, typer.Option(help="image name")] = "busybox",
    tier: Annotated[str, typer.Option(help="fncall | container | microvm | vm")] = "container",
    keep: Annotated[
        bool, typer.Option("--keep", help="do not kill the sandbox afterwards")
    ] = False,
    timeout: Annotated[float, typer.Option(help="command timeout, seconds")] = 600.0,
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE; repeatable")] = [],  # noqa: B006
    cpu: Annotated[float, typer.Option(help="CPU cores")] = 1.0,
    memory_mb: Annotated[int, typer.Option(help="memory limit, MiB")] = 512,
    job: Annotated[str | None, typer.Option(help="the training job it belongs to")] = None,
    allow_domain: AllowDomainOption = [],  # noqa: B006
    allow_cidr: AllowCidrOption = [],  # noqa: B006
    deny_domain: DenyDomainOption = [],  # noqa: B006
    deny_cidr: DenyCidrOption = [],  # noqa: B006
    port: PortOption = [],  # noqa: B006
    protocol: ProtocolOption = [],  # noqa: B006
    preset: PresetOption = [],  # noqa: B006
) -> None:
    """Create a sandbox, run CMD in it, print its output and exit with its exit code.

    No network unless --allow-domain, --allow-cidr or --preset is given."""
    command = _command(cmd)
    env_vars = _parse_env(env)
    policy = _policy_from_options(
        allow_domain, allow_cidr, deny_domain, deny_cidr, port, protocol, preset
    )
    client = make_client()
    try:
        sb = Sandbox.create(
            tier=tier,
            image=image,
            cpu=cpu,
            memory_mb=memory_mb,
            job=job,
            network=policy,
            client=client,
        )
        try:
            code = _run_streaming(sb, command, timeout, env_vars)
        finally:
            if keep:
                stderr.print(f"sandbox kept: {sb.id}")
            else:
                sb.kill()
    finally:
        client.close()
    raise typer.Exit(code)


@app.command("exec", context_settings=_CMD_SETTINGS)
@handle_errors
def exec_(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    cmd: Annotated[list[str], typer.Argument(help="command (after --)", show_default=False)],
    timeout: Annotated[float, typer.Option(help="command timeout, seconds")] = 600.0,
    env: Annotated[list[str], typer.Option("--env", "-e", help="KEY=VALUE; repeatable")] = [],  # noqa: B006
) -> None:
    """Run CMD in an existing sandbox and exit with its exit code."""
    command = _command(cmd)
    env_vars = _parse_env(env)
    client = make_client()
    try:
        sb = Sandbox.connect(sandbox_id, client=client)
        code = _run_streaming(sb, command, timeout, env_vars)
    finally:
        client.close()
    raise typer.Exit(code)


class NetworkAction(StrEnum):
    """What ``dsec network ID ACTION`` does."""

    show = "show"
    update = "update"


def _network_tables(stats: dict[str, Any], wide: bool = False) -> list[Table]:
    def port(row: dict[str, Any]) -> str:
        return "" if row.get("port") is None else str(row["port"])

    allowed = [
        [
            str(r.get("destination", "")),
            str(r.get("protocol", "")),
            port(r),
            str(r.get("connections", 0)),
            escape(",".join(r.get("names", []))),
        ]
        for r in stats.get("allowed", [])
    ]
    blocked = [
        [
            str(r.get("destination", "")),
            str(r.get("protocol", "")),
            port(r),
            str(r.get("packets", 0)),
        ]
        for r in stats.get("blocked", [])
    ]
    head = (Column("DESTINATION", is_id=True), Column("PROTO"), Column("PORT", justify="right"))
    return [
        fit_table(
            (*head, Column("CONNECTIONS", justify="right"), Column("NAMES", 1, folds_to=16)),
            allowed,
            wide=wide,
            title="allowed (new connections)",
        ),
        fit_table(
            (*head, Column("PACKETS", justify="right")),
            blocked,
            wide=wide,
            title="blocked (dropped packets)",
        ),
    ]


@app.command()
@handle_errors
def network(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    action: Annotated[NetworkAction, typer.Argument(help="show | update", show_default=False)],
    allow_domain: AllowDomainOption = [],  # noqa: B006
    allow_cidr: AllowCidrOption = [],  # noqa: B006
    deny_domain: DenyDomainOption = [],  # noqa: B006
    deny_cidr: DenyCidrOption = [],  # noqa: B006
    port: PortOption = [],  # noqa: B006
    protocol: ProtocolOption = [],  # noqa: B006
    preset: PresetOption = [],  # noqa: B006
    file: Annotated[
        str | None,
        typer.Option("--file", "-f", help="update: the policy as a JSON file ('-': stdin)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="show: print the raw JSON")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Show a sandbox's network policy and counters, or replace its policy (update).

    `update` replaces the whole policy (it does not merge): name everything to allow."""
    client = make_client()
    try:
        sb = Sandbox.connect(sandbox_id, client=client)
        if action is NetworkAction.show:
            stats = sb.network.stats()
            if as_json or output is OutputFormat.json:
                print_json(stats)
                return
            if not stats.get("enabled"):
                stdout.print(f"{sandbox_id}: no network (created with network=None)")
                return
            stdout.print(escape(f"{sandbox_id}: address {stats.get('ip', '?')}"))
            stdout.print(escape(f"policy: {_describe_policy(stats.get('policy'))}"))
            for table in _network_tables(stats, output is OutputFormat.wide):
                print_table(stdout, table, wide=output is OutputFormat.wide)
            dns = stats.get("dns", {})
            counters = " ".join(
                f"{k}={dns.get(k, 0)}" for k in ("queries", "answered", "refused", "rate_limited")
            )
            refused = ", ".join(f"{n} ({c})" for n, c in dns.get("refused_names", {}).items())
            stdout.print(escape(f"dns: {counters}" + (f"; refused: {refused}" if refused else "")))
            return
        policy = _policy_from_options(
            allow_domain, allow_cidr, deny_domain, deny_cidr, port, protocol, preset
        )
        if file is not None:
            if policy is not None:
                raise InvalidRequest("give the policy either as options or with --file, not both")
            try:
                text = sys.stdin.read() if file == "-" else Path(file).read_text()
                data = json.loads(text)
            except (OSError, ValueError) as exc:
                raise InvalidRequest(f"cannot read a JSON policy from {file}: {exc}") from None
            policy = NetworkPolicy.parse(data)
        if policy is None:
            raise InvalidRequest(
                "update needs a policy: --allow-domain, --allow-cidr, --preset or --file"
            )
        info = sb.network.update(policy)
    finally:
        client.close()
    stdout.print(escape(f"{info.id}: policy {_describe_policy(info.network)}"))


_SANDBOX_COLUMNS = (
    Column("ID", is_id=True),
    Column("TIER", 1),
    Column("STATE"),
    Column("AGE", 2, justify="right"),
    Column("IMAGE", 3),
    Column("JOB", 4),
    Column("CPU", 5, justify="right"),
    Column("MEM", 5, justify="right"),
    Column("PAUSED", 6, justify="right"),
    Column("LABELS", 7, folds_to=16),
)


def _mib(n: int) -> str:
    return f"{n / 1024:g}G" if n >= 1024 and n % 1024 == 0 else f"{n}M"


def _sandbox_rows(sandboxes: list[SandboxInfo]) -> list[list[str]]:
    rows = []
    for s in sandboxes:
        state_style = {"running": "green", "paused": "yellow", "stopped": "dim"}.get(s.state, "")
        rows.append(
            [
                s.id,
                s.tier,
                f"[{state_style}]{s.state}[/]" if state_style else s.state,
                _age(s.created_at),
                escape(s.image),
                escape(s.job or ""),
                f"{s.cpu:g}",
                _mib(s.memory_mb),
                f"{_age(s.paused_at)} ago" if s.paused_at is not None else "",
                escape(",".join(f"{k}={v}" for k, v in s.labels.items())),
            ]
        )
    return rows


def _print_sandboxes(sandboxes: list[SandboxInfo], output: OutputFormat, empty: str) -> None:
    if output is OutputFormat.json:
        print_json(sandboxes)
        return
    if not sandboxes:
        stdout.print(empty)
        return
    wide = output is OutputFormat.wide
    table = fit_table(_SANDBOX_COLUMNS, _sandbox_rows(sandboxes), wide=wide)
    print_table(stdout, table, wide=wide)


@app.command()
@handle_errors
def ps(
    all_: Annotated[bool, typer.Option("--all", "-a", help="include stopped sandboxes")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """List your sandboxes."""
    client = make_client()
    try:
        sandboxes = client.list_sandboxes(include_stopped=all_)
    finally:
        client.close()
    _print_sandboxes(sandboxes, output, "no sandboxes")


def _metrics_rows(m: SandboxMetrics) -> list[list[str]]:
    mem = m.memory
    limit = f" / {_size(mem.limit_bytes)}" if mem.limit_bytes else ""
    rows = [
        ["state", m.state],
        [
            "cpu",
            f"{m.cpu.used_cores:.2f} of {m.cpu.limit_cores:g} cores ({m.cpu.used_pct:.0f}%), "
            f"{m.cpu.usage_s:.2f} s in all",
        ],
        ["memory", f"{_size(mem.used_bytes)}{limit}, cache {_size(mem.cache_bytes)}"],
    ]
    if mem.host_bytes is not None:
        rows.append(["host memory", _size(mem.host_bytes)])
    d = m.disk
    if d.total_bytes is not None or d.used_bytes is not None:
        used = "?" if d.used_bytes is None else _size(d.used_bytes)
        total = "?" if d.total_bytes is None else _size(d.total_bytes)
        rows.append(["disk", f"{used} / {total}"])
    n = m.network
    rows.append(
        [
            "network",
            "none"
            if n is None
            else f"rx {_size(n.rx_bytes)} ({n.rx_packets} packets), "
            f"tx {_size(n.tx_bytes)} ({n.tx_packets} packets)",
        ]
    )
    if m.pids is not None:
        rows.append(["processes", str(m.pids)])
    rows.append(["source", f"{m.source} (rates over {m.interval_s:g} s)"])
    return rows


@app.command()
@handle_errors
def metrics(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    output: OutputOption = OutputFormat.table,
) -> None:
    """Show a sandbox's CPU, memory, disk, network and processes (a paused one stays paused)."""
    client = make_client()
    try:
        m = Sandbox.connect(sandbox_id, client=client).metrics()
    finally:
        client.close()
    if output is OutputFormat.json:
        print_json(m)
        return
    table = fit_table(
        (Column(m.sandbox_id, is_id=True), Column(m.tier)), _metrics_rows(m), wide=True
    )
    print_table(stdout, table, wide=output is OutputFormat.wide)


FOLLOW_TIMEOUT_S = 24 * 3600.0
"""How long ``dsec logs -f`` follows at most, seconds."""


async def _log_lines(client: Client, sandbox_id: str, follow: bool) -> Any:
    """The NDJSON lines of ``GET /v1/sandboxes/{id}/logs`` as dicts (``ts``, ``stream``,
    ``data``); lines this version cannot parse are skipped."""
    from urllib.parse import quote

    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/logs" + ("?follow=true" if follow else "")
    http = client.async_client._http
    async with http.stream("GET", path, timeout=FOLLOW_TIMEOUT_S if follow else None) as r:
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and isinstance(item.get("data"), str):
                yield item


@app.command()
@handle_errors
def logs(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new output until it ends")
    ] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """Print what the sandbox's start command wrote (stdout to stdout, stderr to stderr);
    -o json: the NDJSON lines as they come (ts, stream, data)."""
    client = make_client()

    async def go() -> None:
        async for item in _log_lines(client, sandbox_id, follow):
            stream = item.get("stream")
            if output is OutputFormat.json:
                sys.stdout.write(json.dumps(item, sort_keys=True) + "\n")
                sys.stdout.flush()
            elif stream == "stderr":
                sys.stderr.write(item["data"])
                sys.stderr.flush()
            elif stream == "stdout":
                sys.stdout.write(item["data"])
                sys.stdout.flush()
            else:  # the edge's own note (how the command ended)
                stderr.print(f"[dim]{escape(item['data'].rstrip())}[/]", soft_wrap=True)

    try:
        _run(go())
    finally:
        client.close()


@app.command("port-forward")
@handle_errors
def port_forward(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    ports: Annotated[
        list[str],
        typer.Argument(
            help="[LOCAL:]PORT pairs: listen on LOCAL (0 or omitted: the same number as "
            "PORT; 0: any free port) and carry each connection to PORT in the sandbox",
            show_default=False,
        ),
    ],
    address: Annotated[str, typer.Option(help="local address to listen on")] = "127.0.0.1",
) -> None:
    """Forward local TCP ports to ports inside a sandbox (like kubectl port-forward), until
    Ctrl-C. Works for a sandbox without any network: the connection is made inside it."""
    pairs: list[tuple[int, int]] = []
    for spec in ports:
        local_s, sep, remote_s = spec.rpartition(":")
        try:
            remote = int(remote_s)
            local = int(local_s) if sep else remote
        except ValueError:
            raise _fail(f"bad port spec {spec!r}: use PORT or LOCAL:PORT") from None
        if not 1 <= remote <= 65535 or not 0 <= local <= 65535:
            raise _fail(f"bad port spec {spec!r}: ports are 1..65535 (LOCAL 0: any free port)")
        pairs.append((local, remote))
    client = make_client()
    forwards: list[Any] = []
    try:
        sb = Sandbox.connect(sandbox_id, client=client)
        for local, remote in pairs:
            fwd = sb.port_forward(remote, local, local_host=address)
            forwards.append(fwd)
            stdout.print(
                f"Forwarding from {fwd.local_host}:{fwd.local_port} -> {sandbox_id}:{remote}"
            )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    finally:
        for fwd in forwards:
            with contextlib.suppress(Exception):
                fwd.close()
        client.close()


@app.command()
@handle_errors
def kill(
    sandbox_ids: Annotated[list[str], typer.Argument(help="sandbox ids", show_default=False)],
) -> None:
    """Kill sandboxes. Exits 1 if any could not be killed."""
    failed = 0
    client = make_client()
    try:
        for sandbox_id in sandbox_ids:
            try:
                Sandbox.connect(sandbox_id, client=client).kill()
                stdout.print(f"killed {sandbox_id}")
            except DsecError as err:
                failed += 1
                stderr.print(
                    f"[bold red]error:[/] {escape(f'{sandbox_id}: {err.message} [{err.code}]')}"
                )
    finally:
        client.close()
    if failed:
        raise typer.Exit(1)


def _pause_line(report: PauseReport | None) -> str:
    if report is None:
        return ""
    before, after = report.memory_before_bytes, report.memory_after_bytes
    held = f" ({after / before:.0%} held)" if before else ""
    return (
        f"memory {_size(before)} -> {_size(after)}{held} in {report.duration_ms:.1f} ms"
        f" [{report.method or 'pause'}]"
    )


def _for_each_id(sandbox_ids: list[str], verb: str, act: Callable[[Any], SandboxInfo]) -> None:
    failed = 0
    client = make_client()
    try:
        for sandbox_id in sandbox_ids:
            try:
                info = act(Sandbox.connect(sandbox_id, client=client))
            except DsecError as err:
                failed += 1
                stderr.print(
                    f"[bold red]error:[/] {escape(f'{sandbox_id}: {err.message} [{err.code}]')}"
                )
                continue
            line = f"{verb} {info.id}: {info.state}"
            if verb == "paused" and info.last_pause is not None:
                line += f", {_pause_line(info.last_pause)}"
            stdout.print(escape(line))
    finally:
        client.close()
    if failed:
        raise typer.Exit(1)


@app.command()
@handle_errors
def pause(
    sandbox_ids: Annotated[list[str], typer.Argument(help="sandbox ids", show_default=False)],
    mode: Annotated[
        str,
        typer.Option(
            help="auto (the tier's pause), freeze, or suspend (VM tiers: memory to a file, "
            "the VM process exits)"
        ),
    ] = "auto",
) -> None:
    """Pause sandboxes: freeze them and reclaim memory (any request resumes them)."""
    _for_each_id(sandbox_ids, "paused", lambda sb: sb.pause(mode=mode))


@app.command()
@handle_errors
def resume(
    sandbox_ids: Annotated[list[str], typer.Argument(help="sandbox ids", show_default=False)],
) -> None:
    """Resume paused sandboxes."""
    _for_each_id(sandbox_ids, "resumed", lambda sb: sb.resume())


@app.command()
@handle_errors
def snapshot(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    name: Annotated[str | None, typer.Option(help="also tag an image of this name[:tag]")] = None,
    scrub: Annotated[
        list[str], typer.Option("--scrub", help="absolute path or glob to leave out; repeatable")
    ] = [],  # noqa: B006
) -> None:
    """Snapshot a sandbox's writable layer as a new workspace layer (pack_diff)."""
    client = make_client()
    try:
        layer = Sandbox.connect(sandbox_id, client=client).snapshot(name=name, scrub=scrub)
    finally:
        client.close()
    stdout.print(layer.digest, soft_wrap=True)
    named = f" as {layer.name}" if layer.name else ""
    stderr.print(f"snapshot of {sandbox_id}{named}: {_size(layer.size)}")


@app.command()
@handle_errors
def fork(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    n: Annotated[int, typer.Option("-n", "--count", help="how many new sandboxes")] = 1,
    label: Annotated[
        list[str], typer.Option("--label", "-l", help="KEY=VALUE added to the forks; repeatable")
    ] = [],  # noqa: B006
) -> None:
    """Make N new sandboxes from a snapshot of this one; prints their ids."""
    labels = _parse_env(label, option="--label")
    client = make_client()
    try:
        forks = Sandbox.connect(sandbox_id, client=client).fork(n, labels=labels)
    finally:
        client.close()
    for sb in forks:
        stdout.print(sb.id)


@app.command()
@handle_errors
def trajectory(
    sandbox_id: Annotated[str, typer.Argument(help="sandbox id", show_default=False)],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write to this file (default stdout)")
    ] = None,
) -> None:
    """Export a sandbox's trajectory log as JSONL."""
    client = make_client()
    try:
        text = Sandbox.connect(sandbox_id, client=client).trajectory()
    finally:
        client.close()
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        output.write_text(text)
        stderr.print(f"wrote {max(0, text.count(chr(10)) - 1)} entries to {output}")


@app.command()
@handle_errors
def replay(
    log_file: Annotated[Path, typer.Argument(help="a trajectory log (JSONL)", show_default=False)],
    image: Annotated[
        str | None, typer.Option(help="image of the fresh sandbox (default: the logged one)")
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="do not kill the replay sandbox afterwards")
    ] = False,
) -> None:
    """Replay a trajectory log on a fresh sandbox and report every divergence (exit 1 if any)."""
    from dsec.replay import create_kwargs, read_header, replay_lines

    try:
        lines = log_file.read_text().splitlines(keepends=True)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {log_file}: {exc.strerror or exc}") from None
    kwargs = create_kwargs(read_header(lines))
    if image is not None:
        kwargs["image"] = image
    client = make_client()

    async def go() -> Any:
        sb = await AsyncSandbox.create(**kwargs, client=client.async_client)
        try:
            stderr.print(f"replaying {log_file} on {sb.id}")
            return await replay_lines(lines, sb)
        finally:
            if keep:
                stderr.print(f"sandbox kept: {sb.id}")
            else:
                await sb.kill()

    try:
        report = _run(go())
    finally:
        client.close()
    stdout.print(escape(report.format_text()))
    if not report.ok:
        raise typer.Exit(1)


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an async SDK call on the sync API's loop (the client's connections live there)."""
    return runner.run(coro)


_JOB_COLUMNS = (
    Column("SANDBOX", is_id=True),
    Column("OK"),
    Column("STATE", 1),
    Column("ERROR", 2, folds_to=20),
)


def _job_rows(result: JobActionResult) -> list[list[str]]:
    rows = []
    for sandbox_id, outcome in result.outcomes.items():
        err = outcome.error or {}
        rows.append(
            [
                sandbox_id,
                "[green]yes[/]" if outcome.ok else "[red]no[/]",
                outcome.state or "",
                escape(f"{err.get('message', '')} [{err.get('code', '')}]") if err else "",
            ]
        )
    return rows


def _job_action(job: str, action: str, output: OutputFormat) -> None:
    client = make_client()
    try:
        api = Jobs(client)
        result = getattr(api, action)(job)
    finally:
        client.close()
    failed = sum(1 for o in result.outcomes.values() if not o.ok)
    if output is OutputFormat.json:
        print_json(result)
    elif not result.outcomes:
        stdout.print(f"job {job}: no sandboxes")
        return
    else:
        wide = output is OutputFormat.wide
        print_table(stdout, fit_table(_JOB_COLUMNS, _job_rows(result), wide=wide), wide=wide)
        stderr.print(f"{action}: {len(result.outcomes) - failed} ok, {failed} failed")
    if failed:
        raise typer.Exit(1)


JobArgument = Annotated[str, typer.Argument(help="job id (given at creation)", show_default=False)]


@job_app.command("pause")
@handle_errors
def job_pause(job: JobArgument, output: OutputOption = OutputFormat.table) -> None:
    """Pause every sandbox of JOB (e.g. when the trainer is preempted)."""
    _job_action(job, "pause", output)


@job_app.command("resume")
@handle_errors
def job_resume(job: JobArgument, output: OutputOption = OutputFormat.table) -> None:
    """Resume every sandbox of JOB."""
    _job_action(job, "resume", output)


@job_app.command("kill")
@handle_errors
def job_kill(job: JobArgument, output: OutputOption = OutputFormat.table) -> None:
    """Kill every sandbox of JOB."""
    _job_action(job, "kill", output)


@job_app.command("ls")
@handle_errors
def job_ls(
    job: JobArgument,
    all_: Annotated[bool, typer.Option("--all", "-a", help="include stopped sandboxes")] = False,
    output: OutputOption = OutputFormat.table,
) -> None:
    """List the sandboxes of JOB."""
    client = make_client()
    try:
        sandboxes = Jobs(client).list(job, include_stopped=all_)
    finally:
        client.close()
    _print_sandboxes(sandboxes, output, f"job {job}: no sandboxes")


_IMAGE_COLUMNS = (
    Column("NAME", is_id=True),
    Column("OWNER", 3),
    Column("LAYERS", 2, justify="right"),
    Column("SIZE", 1, justify="right"),
    Column("CACHED", 2, justify="right"),
    Column("AGE"),
)


@image_app.command("ls")
@handle_errors
def image_ls(output: OutputOption = OutputFormat.table) -> None:
    """List this key's images and the system's (built-in images show their build status)."""
    client = make_client()
    try:
        images = client.list_images()
    finally:
        client.close()
    if output is OutputFormat.json:
        print_json(images)
        return
    rows = []
    for im in images:
        owner = (im.owner or "system") + (" (shared)" if im.shared else "")
        if im.status != "ready":
            rows.append(
                [im.name, owner, "-", "-", "-", escape(f"{im.status}: {im.progress or ''}")]
            )
            continue
        cached = "-" if im.cached_fraction is None else f"{im.cached_fraction:.0%}"
        rows.append(
            [im.name, owner, str(len(im.layers)), _size(im.size), cached, _age(im.created_at)]
        )
    wide = output is OutputFormat.wide
    print_table(stdout, fit_table(_IMAGE_COLUMNS, rows, wide=wide), wide=wide)


@image_app.command("rm")
@handle_errors
def image_rm(
    name: Annotated[str, typer.Argument(help="image name[:tag]", show_default=False)],
    system: Annotated[bool, typer.Option("--system", help="a system image (operator)")] = False,
) -> None:
    """Forget one of this key's images (its layers stay while sandboxes use them)."""
    client = make_client()
    try:
        client.delete_image(name, system=system)
    finally:
        client.close()
    stdout.print(f"removed {name}")


@image_app.command("share")
@handle_errors
def image_share(
    name: Annotated[str, typer.Argument(help="image name[:tag]", show_default=False)],
    stop: Annotated[bool, typer.Option("--stop", help="stop sharing it")] = False,
) -> None:
    """Let every key use one of this key's images, as OWNER/NAME."""
    client = make_client()
    try:
        image = client.share_image(name, not stop)
    finally:
        client.close()
    if image.shared:
        stdout.print(f"shared: other keys use it as {image.owner}/{image.name}")
    else:
        stdout.print(f"{image.name} is no longer shared")


@image_app.command("pull")
@handle_errors
def image_pull(
    ref: Annotated[
        str, typer.Argument(help="[registry/]repo[:tag][@sha256:...]", show_default=False)
    ],
    name: Annotated[str | None, typer.Option(help="image name[:tag] in the store")] = None,
    lazy: Annotated[
        bool, typer.Option("--lazy", help="pushed dsec images: fetch layer data on first read")
    ] = False,
    system: Annotated[
        bool, typer.Option("--system", help="store as a system image for every key (operator)")
    ] = False,
) -> None:
    """Pull an image from an OCI / Docker v2 registry into the node's layer store."""
    client = make_client()
    try:
        with stderr.status(f"pulling {ref} ..."):
            image = client.pull_image(ref, name, lazy=lazy, system=system)
    finally:
        client.close()
    stdout.print(f"pulled {image.name}: {len(image.layers)} layers, {_size(image.size)}")


@image_app.command("push")
@handle_errors
def image_push(
    name: Annotated[str, typer.Argument(help="image name[:tag]", show_default=False)],
    target: Annotated[
        str, typer.Argument(help="oci://HOST[:PORT]/REPOSITORY[:TAG]", show_default=False)
    ],
) -> None:
    """Publish an image's EROFS layers to an OCI registry (pull it elsewhere with --lazy)."""
    client = make_client()
    try:
        with stderr.status(f"pushing {name} to {target} ..."):
            result = client.push_image(name, target)
    finally:
        client.close()
    stdout.print(f"pushed {result.image} to {result.target}: {result.manifest_digest}")


@image_app.command("build")
@handle_errors
def image_build(
    path: Annotated[
        str,
        typer.Argument(help="local directory or tar archive (with -f: the context directory)"),
    ],
    name: Annotated[str, typer.Option(help="image name[:tag]", show_default=False)],
    file: Annotated[
        str | None,
        typer.Option("--file", "-f", help="build this Dockerfile, with PATH as its context"),
    ] = None,
    build_arg: Annotated[
        list[str] | None, typer.Option("--build-arg", help="K=V for the Dockerfile's ARG")
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="rebuild every step")] = False,
    run_network: Annotated[
        str,
        typer.Option(help="network of RUN steps: default (debian + pypi presets) or none"),
    ] = "default",
    kind: Annotated[
        str, typer.Option(help="base | workspace | toolkit (without -f)")
    ] = "workspace",
    base: Annotated[str | None, typer.Option(help="image to stack on (without -f)")] = None,
    system: Annotated[
        bool,
        typer.Option("--system", help="publish as a system image for every key (operator key)"),
    ] = False,
) -> None:
    """Build an image: from a Dockerfile (-f: every instruction a cached step, its output
    streamed here), or from a local directory or tar archive that becomes one layer."""
    if file is None:
        if build_arg or no_cache or run_network != "default":
            raise _fail("--build-arg, --no-cache and --run-network need -f DOCKERFILE")
        client = make_client()
        try:
            with stderr.status(f"building {name} from {path} ..."):
                image = client.build_image(path, name, kind, base, system=system)
        finally:
            client.close()
        stdout.print(f"built {image.name}: {len(image.layers)} layers, {_size(image.size)}")
        return
    if system or base is not None or kind != "workspace":
        raise _fail("--kind, --base and --system do not apply to Dockerfile builds")
    if run_network not in ("default", "none"):
        raise _fail("--run-network is default or none")
    from dsec.sdk.image import Image

    args = dict(_key_values(build_arg or [], "--build-arg"))
    dockerfile_image = Image.from_dockerfile(file, path, build_args=args)
    options: dict[str, Any] = {"no_cache": no_cache}
    if run_network == "none":
        options["run_network"] = None
    client = make_client()
    done: Any = None
    try:
        for event in client.build_events(dockerfile_image, name, **options):
            _print_build_event(event)
            if event.type == "done":
                done = event
    finally:
        client.close()
    if done is not None:
        im = done.image
        stdout.print(
            f"built {im.name}: {len(im.layers)} layers, {_size(im.size)} "
            f"({done.built_steps} steps built, {done.cached_steps} cached, "
            f"{done.duration_ms / 1000:.1f} s)"
        )


def _key_values(items: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise _fail(f"{what} takes KEY=VALUE, got {item!r}")
        out.append((key, value))
    return out


def _print_build_event(event: Any) -> None:
    """Build progress on stderr: one line per step, the steps' output as it comes."""
    kind = event.type
    if kind == "start":
        for note in event.notes:
            stderr.print(f"[yellow]note:[/] {escape(note)}")
    elif kind == "step":
        stderr.print(f"[bold][{event.step}/{event.total}][/] {escape(event.instruction)}")
    elif kind == "cached":
        stderr.print("  [dim]cached[/]")
    elif kind == "output":
        sys.stderr.write(event.data)
        sys.stderr.flush()
    elif kind == "step_done" and event.layer and not event.cached:
        stderr.print(f"  [dim]{event.layer[:19]} ({event.duration_ms / 1000:.1f} s)[/]")


_ABILITIES = (
    "exec", "files", "streaming", "pause", "snapshot", "fork", "network", "tty", "display",
    "suspend", "memory_fork", "metrics",
)  # fmt: skip


@app.command()
@handle_errors
def info(output: OutputOption = OutputFormat.table) -> None:
    """Show the node and what each tier can do."""
    client = make_client()
    try:
        node = client.node_info()
        try:
            key: Any = client.key_info()
        except NotFound:  # a server older than GET /v1/key
            key = None
    finally:
        client.close()
    if output is OutputFormat.json:
        print_json(
            {**node.model_dump(mode="json"), "key": key.model_dump(mode="json") if key else None}
        )
        return
    stdout.print(
        f"[bold]node[/] {escape(node.node)}  [bold]version[/] {node.version}  "
        f"[bold]sandboxes[/] {node.sandboxes}  [bold]cpus[/] {node.cpus}  "
        f"[bold]memory[/] {_mib(node.memory_mb)}",
        soft_wrap=True,
    )
    if key is not None:
        u = key.usage
        stdout.print(
            f"[bold]key[/] {key.owner} ({key.role})  [bold]sandboxes[/] {u.sandboxes}  "
            f"[bold]cpu[/] {u.cpu:g}  [bold]memory[/] {_mib(u.memory_mb)}",
            soft_wrap=True,
        )
        stdout.print(f"[bold]quota[/] {escape(_quota_text(key.quota))}")
    rows = [
        [
            cap.tier,
            "[green]yes[/]" if cap.available else "[red]no[/]",
            " ".join(f for f in _ABILITIES if getattr(cap, f, False)) or "-",
            escape(cap.reason or ""),
        ]
        for cap in node.tiers
    ]
    columns = (
        Column("TIER", is_id=True),
        Column("AVAILABLE"),
        Column("CAN", folds_to=24),
        Column("NOTE", 1, folds_to=16),
    )
    wide = output is OutputFormat.wide
    print_table(stdout, fit_table(columns, rows, wide=wide), wide=wide)
    if node.host is not None:  # the host in short (dsec doctor on the node: all of it)
        from dsec.hostreport import render

        stdout.print(escape(render(node.host, short=True)), soft_wrap=True)


# --- keys (offline: the node's key store, or a cluster's database) --------------------
@contextlib.contextmanager
def _key_store(home: Path | None, database: str | None) -> Iterator[Any]:
    from dsec.apiserver.auth import KeyStore
    from dsec.config import dsec_home

    if not database:
        yield KeyStore(home or dsec_home())
        return
    from dsec.cluster.state import ClusterState, PgKeyStore

    state = ClusterState(database, connect_timeout_s=10)
    keys = PgKeyStore(state, home or dsec_home())
    try:
        yield keys
    finally:
        keys.close()
        state.close()


HomeOption = Annotated[Path | None, typer.Option(help="state directory (default $DSEC_HOME)")]
DatabaseOption = Annotated[
    str | None,
    typer.Option(help="a cluster's PostgreSQL URL (its keys instead of $DSEC_HOME's)"),
]
# a quota option: a number, or "none" for no limit (on ``key set``; absent: unchanged)
QuotaOption = Annotated[str | None, typer.Option(show_default=False, metavar="N|none")]
_QUOTA_FIELDS = ("max_sandboxes", "max_cpu", "max_memory_mb", "creations_per_s", "cpu_weight")


def _quota_from_options(base: Any, options: dict[str, str | None]) -> Any:
    """``base`` (a KeyQuota) with the options given replaced: ``none`` clears a limit."""
    from pydantic import ValidationError

    from dsec.models import KeyQuota

    data = base.model_dump()
    for name, raw in options.items():
        if raw is None:
            continue
        text = raw.strip().lower()
        if text in ("none", "unlimited", ""):
            data[name] = 100 if name == "cpu_weight" else None
        else:
            data[name] = raw
    try:
        return KeyQuota.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = str(err["loc"][0]).replace("_", "-") if err["loc"] else "quota"
        raise _fail(f"--{where}: {err['msg']}") from None


def _quota_text(quota: Any) -> str:
    parts = [
        f"{name}={getattr(quota, name):g}"
        if isinstance(getattr(quota, name), float)
        else f"{name}={getattr(quota, name)}"
        for name in _QUOTA_FIELDS
        if getattr(quota, name) is not None
        and not (name == "cpu_weight" and quota.cpu_weight == 100)
    ]
    return " ".join(parts) or "-"


@key_app.command("create")
@handle_errors
def key_create(
    name: Annotated[str, typer.Option(help="a label for the key")] = "",
    operator: Annotated[
        bool, typer.Option("--operator", help="may publish and remove system images")
    ] = False,
    max_sandboxes: QuotaOption = None,
    max_cpu: QuotaOption = None,
    max_memory_mb: QuotaOption = None,
    creations_per_s: QuotaOption = None,
    cpu_weight: QuotaOption = None,
    e2b: Annotated[
        bool,
        typer.Option(
            "--e2b", help="print it in its E2B form, e2b_<hex> (the same key; `dsec key e2b`)"
        ),
    ] = False,
    home: HomeOption = None,
    database: DatabaseOption = None,
) -> None:
    """Create an API key and print it (it is not stored: keep it). The quota options limit
    what its sandboxes may hold (live sandboxes, requested cores and MiB), how fast it may
    create them, and its share of contended CPU against other keys (default 100)."""
    from dsec.edge.quotas import UNLIMITED

    given = (max_sandboxes, max_cpu, max_memory_mb, creations_per_s, cpu_weight)
    quota = _quota_from_options(UNLIMITED, dict(zip(_QUOTA_FIELDS, given, strict=True)))
    with _key_store(home, database) as keys:
        if database:
            if operator:
                raise _fail("a cluster's operator is the key in $DSEC_HOME/api_key")
            key = keys.create_key(name, quota=quota)
        else:
            key = keys.create_key(name, operator=operator, quota=quota)
    if e2b:
        from dsec.apiserver.auth import e2b_form

        key = e2b_form(key)
    stdout.print(key, soft_wrap=True)


@key_app.command("e2b")
@handle_errors
def key_e2b(
    key: Annotated[
        str | None,
        typer.Argument(
            help="the key; '-' reads it from stdin (default: --api-key, $DSEC_API_KEY or "
            "$DSEC_HOME/api_key)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Print a key in its E2B form, e2b_<hex of the key>: the same key (same owner, quota
    and role; revoking one revokes both), for E2B clients that refuse an E2B_API_KEY not
    shaped e2b_<hex> (e2b 2.31, pinned by openai-agents[e2b]). Example: export
    E2B_API_KEY=$(dsec key e2b)."""
    from dsec.apiserver.auth import canonical_key, e2b_form
    from dsec.sdk._http import resolve_api_key

    if key == "-":
        key = sys.stdin.read().strip()
    key = key or resolve_api_key(_connection["api_key"])
    if not key:
        raise _fail("no key: give one, or set --api-key or $DSEC_API_KEY")
    stdout.print(e2b_form(canonical_key(key)), soft_wrap=True)


@key_app.command("set")
@handle_errors
def key_set(
    key_or_owner: Annotated[
        str, typer.Argument(help="the key or its owner id", show_default=False)
    ],
    max_sandboxes: QuotaOption = None,
    max_cpu: QuotaOption = None,
    max_memory_mb: QuotaOption = None,
    creations_per_s: QuotaOption = None,
    cpu_weight: QuotaOption = None,
    home: HomeOption = None,
    database: DatabaseOption = None,
) -> None:
    """Change a key's quota (options not given stay as they are; ``none`` removes a
    limit). Running servers apply it to the key's next creation; sandboxes it already
    holds are not stopped."""
    given = (max_sandboxes, max_cpu, max_memory_mb, creations_per_s, cpu_weight)
    options = dict(zip(_QUOTA_FIELDS, given, strict=True))
    with _key_store(home, database) as keys:
        if key_or_owner.startswith(("dsec_", "e2b_")):
            from dsec.apiserver.auth import owner_id

            key_or_owner = owner_id(key_or_owner)
        quota = _quota_from_options(keys.quota_of(key_or_owner), options)
        try:
            keys.set_quota(key_or_owner, quota)
        except KeyError:
            raise _fail("no such key") from None
    stdout.print(f"{key_or_owner}: {_quota_text(quota)}", soft_wrap=True)


@key_app.command("ls")
@handle_errors
def key_ls(
    home: HomeOption = None,
    database: DatabaseOption = None,
    output: OutputOption = OutputFormat.table,
) -> None:
    """List key owner ids (never the keys) with their quotas."""
    with _key_store(home, database) as keys:
        records = [(r.owner, r.name, r.role, r.created_at, r.key_quota()) for r in keys.list()]
    if output is OutputFormat.json:
        print_json(
            [
                {
                    "owner": owner,
                    "name": name,
                    "role": role,
                    "created_at": created,
                    "quota": quota.model_dump(mode="json"),
                }
                for owner, name, role, created, quota in records
            ]
        )
        return
    rows = [
        [
            owner,
            role,
            datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%d %H:%M"),
            escape(name),
            escape(_quota_text(quota)),
        ]
        for owner, name, role, created, quota in records
    ]
    columns = (
        Column("OWNER", is_id=True),
        Column("ROLE"),
        Column("CREATED", 1),
        Column("NAME", 2, folds_to=12),
        Column("QUOTA", 3, folds_to=16),
    )
    wide = output is OutputFormat.wide
    print_table(stdout, fit_table(columns, rows, wide=wide), wide=wide)


@key_app.command("revoke")
@handle_errors
def key_revoke(
    key_or_owner: Annotated[
        str, typer.Argument(help="the key or its owner id", show_default=False)
    ],
    home: HomeOption = None,
    database: DatabaseOption = None,
) -> None:
    """Revoke a key (running servers notice within one request)."""
    with _key_store(home, database) as keys:
        if not keys.revoke(key_or_owner):
            raise _fail("no such key")
    stdout.print("revoked")


if __name__ == "__main__":  # pragma: no cover
    app()
