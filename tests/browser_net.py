"""A network of its own for a test's Chromium, so that the node's churn does not reach it.

Every networked sandbox puts a veth with an address in the node's network namespace, and
Chromium drops every request and WebSocket in flight (``net::ERR_NETWORK_CHANGED``) whenever an
address of its namespace comes or goes: on a node running other tests, a page of scripts
(noVNC) then loads half its modules and never connects. A viewer of a stream is never on the
node; this puts the test's browser where it would be, behind a namespace holding only ``lo``,
and relays the loopback ports it is told of to the node's loopback (the same port numbers, so
URLs do not change).

Example::

    with BrowserNet() as net:
        net.forward(server.tls_port)
        browser = p.chromium.launch(executable_path=net.executable("/usr/bin/chromium"))
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from pathlib import Path

from dsec.privileged.netns import RtNetlink, create_netns, delete_netns, in_netns

__all__ = ["BrowserNet"]


class BrowserNet:
    """A network namespace with ``lo`` up, loopback ports relayed to the node's, and a
    launcher that starts a program in it (needs root)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="dsec-test-browser-"))
        self.path = self._dir / "net"
        create_netns(self.path)
        in_netns(self.path, _loopback_up)
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()

    def forward(self, port: int) -> None:
        """Relay connections to ``127.0.0.1:port`` inside the namespace to the node's."""
        listener = in_netns(self.path, lambda: socket.create_server(("127.0.0.1", port)))
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def executable(self, program: str) -> str:
        """A launcher script that runs ``program`` (with its arguments) in the namespace."""
        launcher = self._dir / f"{Path(program).name}-in-netns"
        launcher.write_text(f'#!/bin/sh\nexec nsenter --net="{self.path}" "{program}" "$@"\n')
        launcher.chmod(0o755)
        return str(launcher)

    def _accept(self, listener: socket.socket, port: int) -> None:
        while not self._closed.is_set():
            try:
                inside, _ = listener.accept()
            except OSError:
                return
            try:
                outside = socket.create_connection(("127.0.0.1", port))
            except OSError:
                inside.close()
                continue
            for src, dst in ((inside, outside), (outside, inside)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for listener in self._listeners:
            listener.close()
        delete_netns(self.path)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> BrowserNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _loopback_up() -> None:
    with RtNetlink() as nl:
        nl.set_up(1)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends (then end ``dst``'s writing side) or either
    fails (then end both); the sockets close when both directions' threads let them go."""
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
