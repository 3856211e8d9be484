"""The ``dsec`` command line: run a server, run commands in sandboxes, inspect a node.

Commands::

    dsec serve [--host 127.0.0.1] [--port 7070] [--home DIR]
    dsec run [--image I] [--tier T] [--keep] [--timeout S] [--env K=V]... -- CMD...
    dsec exec ID -- CMD...
    dsec ps [--all]
    dsec kill ID...
    dsec image ls
    dsec image build PATH --name N [--kind K] [--base B]
    dsec info
    dsec key create|ls|revoke        (local key store in $DSEC_HOME, no server needed)

``CMD`` given as one argument runs under ``/bin/sh -c``; several arguments are exec'd as
an argv. ``run`` and ``exec`` exit with the command's exit code (124 on timeout,
128+N when killed by signal N). Errors print one red line and exit 1.

Connection: ``--url`` / ``$DSEC_URL`` and ``--api-key`` / ``$DSEC_API_KEY`` /
``$DSEC_HOME/api_key``, as in the SDK.

Test hook: set the module attribute :data:`transport_factory` to a callable returning an
``httpx.AsyncBaseTransport`` (e.g. ``dsec.testing.app_transport(edge)[0]``) and every
command talks to that in-process app instead of the network. There is deliberately no
environment variable for this.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dsec.errors import DsecError, InvalidRequest
from dsec.models import ExecResult, SandboxInfo
from dsec.sdk import Client, Sandbox

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
app.add_typer(image_app, name="image")
app.add_typer(key_app, name="key")

stdout = Console(highlight=False, soft_wrap=False)
stderr = Console(stderr=True, highlight=False)

_connection: dict[str, str | None] = {"url": None, "api_key": None}

F = TypeVar("F", bound=Callable[..., Any])

_CMD_SETTINGS = {"allow_interspersed_args": False, "ignore_unknown_options": True}


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


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidRequest(f"--env wants KEY=VALUE, got {pair!r}")
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


# --- commands ----------------------------------------------------------------
@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 7070,
    home: Annotated[Path | None, typer.Option(help="state directory (default $DSEC_HOME)")] = None,
) -> None:
    """Run the apiserver and this node's edge in one process."""
    try:
        from dsec.server import serve as run_server
    except ImportError as exc:
        raise _fail(f"the server is not available in this installation: {exc}") from None
    handle_errors(run_server)(host=host, port=port, home=str(home) if home else None)


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
) -> None:
    """Create a sandbox, run CMD in it, print its output and exit with its exit code."""
    command = _command(cmd)
    env_vars = _parse_env(env)
    client = make_client()
    try:
        sb = Sandbox.create(tier=tier, image=image, cpu=cpu, memory_mb=memory_mb, client=client)
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


def _sandbox_table(sandboxes: list[SandboxInfo]) -> Table:
    table = Table(box=None, header_style="bold")
    table.add_column("ID", no_wrap=True)
    for name in ("TIER", "IMAGE", "STATE", "AGE", "CPU", "MEM", "JOB", "LABELS"):
        table.add_column(name)
    for s in sandboxes:
        state_style = {"running": "green", "paused": "yellow", "stopped": "dim"}.get(s.state, "")
        table.add_row(
            s.id,
            s.tier,
            s.image,
            f"[{state_style}]{s.state}[/]" if state_style else s.state,
            _age(s.created_at),
            f"{s.cpu:g}",
            f"{s.memory_mb} MiB",
            s.job or "",
            ",".join(f"{k}={v}" for k, v in s.labels.items()),
        )
    return table


@app.command()
@handle_errors
def ps(
    all_: Annotated[bool, typer.Option("--all", "-a", help="include stopped sandboxes")] = False,
) -> None:
    """List your sandboxes."""
    client = make_client()
    try:
        sandboxes = client.list_sandboxes(include_stopped=all_)
    finally:
        client.close()
    if not sandboxes:
        stdout.print("no sandboxes")
        return
    stdout.print(_sandbox_table(sandboxes))


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


@image_app.command("ls")
@handle_errors
def image_ls() -> None:
    """List images."""
    client = make_client()
    try:
        images = client.list_images()
    finally:
        client.close()
    table = Table(box=None, header_style="bold")
    table.add_column("NAME", no_wrap=True)
    table.add_column("LAYERS")
    table.add_column("SIZE")
    table.add_column("AGE")
    for im in images:
        table.add_row(im.name, str(len(im.layers)), _size(im.size), _age(im.created_at))
    stdout.print(table)


@image_app.command("build")
@handle_errors
def image_build(
    path: Annotated[
        str, typer.Argument(help="directory or tarball on the server", show_default=False)
    ],
    name: Annotated[str, typer.Option(help="image name[:tag]", show_default=False)],
    kind: Annotated[str, typer.Option(help="base | workspace | toolkit")] = "workspace",
    base: Annotated[str | None, typer.Option(help="image to stack on")] = None,
) -> None:
    """Build an image from a directory or tarball on the server's filesystem."""
    server_path = os.path.abspath(path) if not path.startswith("/") else path
    client = make_client()
    try:
        with stderr.status(f"building {name} from {server_path} ..."):
            image = client.build_image(server_path, name, kind, base)
    finally:
        client.close()
    stdout.print(f"built {image.name}: {len(image.layers)} layers, {_size(image.size)}")


@app.command()
@handle_errors
def info() -> None:
    """Show the node and what each tier can do."""
    client = make_client()
    try:
        node = client.node_info()
    finally:
        client.close()
    stdout.print(
        f"[bold]node[/] {node.node}  [bold]version[/] {node.version}  "
        f"[bold]sandboxes[/] {node.sandboxes}  [bold]cpus[/] {node.cpus}  "
        f"[bold]memory[/] {node.memory_mb} MiB"
    )
    table = Table(box=None, header_style="bold")
    table.add_column("TIER", no_wrap=True)
    table.add_column("AVAILABLE")
    for flag in ("exec", "files", "streaming", "pause", "snapshot", "fork", "network", "tty"):
        table.add_column(flag.upper())
    table.add_column("NOTE")
    for cap in node.tiers:
        flags = [
            "yes" if getattr(cap, f) else "-"
            for f in ("exec", "files", "streaming", "pause", "snapshot", "fork", "network", "tty")
        ]
        table.add_row(
            cap.tier,
            "[green]yes[/]" if cap.available else "[red]no[/]",
            *flags,
            cap.reason or "",
        )
    stdout.print(table)


# --- keys (local, offline) -------------------------------------------------------
def _key_store(home: Path | None) -> Any:
    from dsec.apiserver.auth import KeyStore
    from dsec.config import dsec_home

    return KeyStore(home or dsec_home())


HomeOption = Annotated[Path | None, typer.Option(help="state directory (default $DSEC_HOME)")]


@key_app.command("create")
@handle_errors
def key_create(
    name: Annotated[str, typer.Option(help="a label for the key")] = "",
    home: HomeOption = None,
) -> None:
    """Create an API key and print it (it is not stored: keep it)."""
    stdout.print(_key_store(home).create_key(name), soft_wrap=True)


@key_app.command("ls")
@handle_errors
def key_ls(home: HomeOption = None) -> None:
    """List key owner ids (never the keys)."""
    table = Table(box=None, header_style="bold")
    table.add_column("OWNER", no_wrap=True)
    table.add_column("NAME")
    table.add_column("CREATED")
    for rec in _key_store(home).list():
        created = datetime.fromtimestamp(rec.created_at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(rec.owner, rec.name, created)
    stdout.print(table)


@key_app.command("revoke")
@handle_errors
def key_revoke(
    key_or_owner: Annotated[
        str, typer.Argument(help="the key or its owner id", show_default=False)
    ],
    home: HomeOption = None,
) -> None:
    """Revoke a key (running servers notice within one request)."""
    if not _key_store(home).revoke(key_or_owner):
        raise _fail("no such key")
    stdout.print("revoked")


if __name__ == "__main__":  # pragma: no cover
    app()
