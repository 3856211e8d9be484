"""``dsec docker run -p``: ports of this machine carried to ports inside a sandbox.

docker's daemon publishes a container port with a proxy on the daemon's host. A dsec
sandbox runs on the server, so ``run -p [IP:][HOST_PORT:]PORT[/tcp]`` binds the host side
here, on the machine that ran the command (before the sandbox is made: a port in use
fails the ``run`` as docker's does), and hands the listening sockets to a forwarder
process of its own: ``python -m dsec.cli.docker_ports``, in a session of its own, with
no standard streams (a caller waiting for ``run``'s output is not held by it). Each
connection accepted there is carried through the server's port proxy
(``/v1/sandboxes/{id}/tcp/{port}``, as ``dsec port-forward``) to ``127.0.0.1:PORT``
inside the sandbox; nothing has to listen there yet when the port is published.

The forwarder ends with its sandbox: ``docker stop``/``rm``/``kill`` of the container
stop it at once (through its pid file) and wait for it, so the host port is free when
they return; otherwise it asks the server every :data:`WATCH_S` seconds whether the
sandbox still runs (an idle TTL, a kill from elsewhere). Its pid file and its log are in
:func:`state_dir`.

A host IP left out binds ``127.0.0.1`` (docker: every address); say ``0.0.0.0`` to
publish on every address. TCP only; no port ranges.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "WATCH_S",
    "PortBinding",
    "PublishError",
    "bind",
    "parse_publish",
    "start_forwarder",
    "state_dir",
    "stop_forwarder",
]

WATCH_S = 2.0
"""How often the forwarder asks the server whether its sandbox still runs, seconds."""
_GIVE_UP_S = 300.0
"""The forwarder ends after the server has not answered for this long, seconds."""
_STOP_WAIT_S = 10.0
"""How long ``stop``/``rm`` wait for a stopped forwarder to exit, seconds."""
DEFAULT_HOST_IP = "127.0.0.1"


class PublishError(ValueError):
    """A ``-p`` value that does not parse or cannot be bound; ``str()`` is docker's text."""


@dataclass(frozen=True)
class PortBinding:
    """One ``-p``: ``host_ip:host_port`` here to ``container_port``/tcp in the sandbox
    (``host_port`` 0: any free port, known once bound)."""

    host_ip: str
    host_port: int
    container_port: int

    @property
    def key(self) -> str:
        """docker's name of the container side: ``8000/tcp``."""
        return f"{self.container_port}/tcp"


def _port(raw: str, what: str, spec: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) <= 65535:
        if re.fullmatch(r"\d+-\d+", raw):
            raise PublishError(f"port ranges are not supported by dsec docker: {spec}")
        raise PublishError(f"invalid {what}: {raw}")
    return int(raw)


def parse_publish(spec: str) -> PortBinding:
    """A ``-p`` value: ``PORT``, ``HOST_PORT:PORT``, ``IP:HOST_PORT:PORT``, ``IP::PORT``
    (``[IPv6]`` in brackets), each with an optional ``/tcp``."""
    rest, slash, proto = spec.partition("/")
    if slash and proto.lower() != "tcp":
        raise PublishError(
            f"invalid proto: {proto} (dsec docker publishes TCP ports only: the server's "
            "port proxy carries TCP)"
            if proto.lower() in ("udp", "sctp")
            else f"invalid proto: {proto}"
        )
    host_ip = ""
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or not rest[close + 1 :].startswith(":"):
            raise PublishError(f"invalid IP address: {rest}")
        host_ip, rest = rest[1:close], rest[close + 2 :]
        parts = [host_ip, *rest.split(":")]
    else:
        parts = rest.split(":")
    if len(parts) == 1:
        host_port, container = "", parts[0]
    elif len(parts) == 2:
        host_port, container = parts
    elif len(parts) == 3:
        host_ip, host_port, container = parts
    else:
        raise PublishError(f"invalid port format: {spec}")
    if host_ip:
        try:
            ipaddress.ip_address(host_ip)
        except ValueError:
            raise PublishError(f"invalid IP address: {host_ip}") from None
    return PortBinding(
        host_ip=host_ip or DEFAULT_HOST_IP,
        host_port=_port(host_port, "hostPort", spec) if host_port else 0,
        container_port=_port(container, "containerPort", spec),
    )


def bind(bindings: list[PortBinding]) -> list[tuple[PortBinding, socket.socket]]:
    """Listening sockets for ``bindings`` (the bound port filled in), or
    :class:`PublishError` with docker's message (nothing left open)."""
    out: list[tuple[PortBinding, socket.socket]] = []
    try:
        for b in bindings:
            family = socket.AF_INET6 if ":" in b.host_ip else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((b.host_ip, b.host_port))
                s.listen(128)
            except OSError as e:
                s.close()
                where = f"[{b.host_ip}]" if family == socket.AF_INET6 else b.host_ip
                if e.errno == errno.EADDRINUSE:
                    raise PublishError(
                        f"Bind for {where}:{b.host_port} failed: port is already allocated"
                    ) from None
                raise PublishError(
                    f"listen tcp {where}:{b.host_port}: bind: {os.strerror(e.errno or 0).lower()}"
                ) from None
            port = int(s.getsockname()[1])
            out.append((PortBinding(b.host_ip, port, b.container_port), s))
    except PublishError:
        for _, s in out:
            s.close()
        raise
    return out


def _state_path() -> Path:
    given = os.environ.get("DSEC_DOCKER_STATE")
    if given:
        return Path(given)
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "dsec-docker"
    return Path(f"/tmp/dsec-docker-{os.getuid()}")


def state_dir() -> Path:
    """Where forwarders keep their pid files and logs (``$DSEC_DOCKER_STATE``, else
    ``$XDG_RUNTIME_DIR/dsec-docker``, else ``/tmp/dsec-docker-<uid>``; made with mode
    0700, refused when another user could write there)."""
    path = _state_path()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PublishError(f"{path} must be a directory of this user only (mode 0700)")
    return path


def start_forwarder(
    sandbox_id: str, url: str, api_key: str, bound: list[tuple[PortBinding, socket.socket]]
) -> int:
    """Start the forwarder of ``sandbox_id`` on ``bound`` (closed here once handed over);
    returns its pid. The key goes in its environment, never in its command line."""
    argv = [sys.executable, "-m", "dsec.cli.docker_ports", "--sandbox", sandbox_id, "--url", url]
    for b, s in bound:
        argv += ["--listen", f"{s.fileno()}:{b.container_port}"]
    log = state_dir() / f"{sandbox_id}.log"
    env = {**os.environ, "DSEC_API_KEY": api_key}
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            argv,
            pass_fds=[s.fileno() for _, s in bound],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=env,
        )
    for _, s in bound:
        s.close()
    (state_dir() / f"{sandbox_id}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def _forwarder_pid(sandbox_id: str) -> int | None:
    """The pid of ``sandbox_id``'s forwarder if it still runs (its command line names the
    sandbox: a reused pid is not taken for it)."""
    if not _state_path().is_dir():
        return None  # no forwarder ever started here
    try:
        pid = int((state_dir() / f"{sandbox_id}.pid").read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, PublishError):
        return None
    if b"dsec.cli.docker_ports" in argv and sandbox_id.encode() in argv:
        return pid
    return None


def stop_forwarder(sandbox_id: str) -> None:
    """End ``sandbox_id``'s forwarder, if one runs here, and wait until it has exited."""
    pid = _forwarder_pid(sandbox_id)
    if pid is None and not _state_path().is_dir():
        return
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_WAIT_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _forget(sandbox_id, None)


def _forget(sandbox_id: str, pid: int | None) -> None:
    """Remove the forwarder's pid file (only if it names ``pid``, when given) and its log
    if empty (a log with something in it stays, as evidence)."""
    path = _state_path()
    with contextlib.suppress(OSError, ValueError):
        pidfile = path / f"{sandbox_id}.pid"
        if pid is None or int(pidfile.read_text()) == pid:
            pidfile.unlink()
    with contextlib.suppress(OSError):
        log = path / f"{sandbox_id}.log"
        if log.stat().st_size == 0:
            log.unlink()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, already exited, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# -- the forwarder process ---------------------------------------------------------------


async def _serve(sandbox_id: str, url: str, api_key: str, listens: list[tuple[int, int]]) -> None:
    from dsec.errors import SandboxNotFound
    from dsec.sdk import AsyncClient, AsyncSandbox
    from dsec.sdk.ports import AsyncPortForward

    class _Published(AsyncPortForward):
        async def serve_on(self, sock: socket.socket) -> None:
            """Serve connections accepted on ``sock`` (already listening), without
            :meth:`start`'s first connection: nothing need listen in the sandbox yet."""
            self._server = await asyncio.start_server(self._serve, sock=sock)
            self._local_host, self._local_port = sock.getsockname()[:2]

    client = AsyncClient(url, api_key)
    ws_base = client.url.replace("http", "ws", 1).rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"}
    forwards = []
    for fd, port in listens:
        fwd = _Published(f"{ws_base}/v1/sandboxes/{sandbox_id}/tcp/{port}", headers, port)
        await fwd.serve_on(socket.socket(fileno=fd))
        forwards.append(fwd)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    unanswered_since: float | None = None
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_S)
            if stop.is_set():
                break
            try:
                sb = await AsyncSandbox.connect(sandbox_id, client=client)
                if sb.info.state == "stopped":
                    break
                unanswered_since = None
            except SandboxNotFound:
                break
            except Exception as e:  # the server may be restarting: keep serving for a while
                now = time.monotonic()
                unanswered_since = unanswered_since or now
                if now - unanswered_since > _GIVE_UP_S:
                    print(f"dsec docker: no answer from the server: {e}; ending", file=sys.stderr)
                    break
    finally:
        for fwd in forwards:
            await fwd.close()
        await client.close()


def main(argv: list[str] | None = None) -> int:
    """The forwarder process (started by :func:`start_forwarder`)."""
    p = argparse.ArgumentParser(prog="python -m dsec.cli.docker_ports")
    p.add_argument("--sandbox", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--listen", action="append", default=[], help="FD:CONTAINER_PORT")
    args = p.parse_args(argv)
    listens = [tuple(int(x) for x in item.split(":", 1)) for item in args.listen]
    key = os.environ.get("DSEC_API_KEY", "")
    try:
        asyncio.run(_serve(args.sandbox, args.url, key, [(fd, port) for fd, port in listens]))
    finally:
        _forget(args.sandbox, os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
