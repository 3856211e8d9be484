"""What one eval batch made on dsec, and how it is cleaned up.

inspect_ai opens a *sandbox lifecycle scope* per eval batch (``SandboxManager``): every
task and sample of the batch sees the same :class:`Run` through it. A run holds one
:class:`~dsec.AsyncClient` per server URL (one connection pool for all its samples), the
sandboxes created and not yet killed, and the images it built. Every sandbox carries the
labels below, so what a crashed eval left behind is found again by label, on the server,
among the sandboxes of the caller's key only (a key never sees another key's sandboxes):
``task_cleanup`` kills the run's (its ``inspect.run`` label), ``inspect sandbox cleanup
dsec`` every one this provider made for the key.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

import anyio
import httpx
from inspect_ai.util._sandbox.lifecycle import sandbox_lifecycle_state

from dsec.errors import DsecError, SandboxNotFound
from dsec.models import SandboxInfo
from dsec.sdk.client import AsyncClient
from dsec.sdk.sandbox import AsyncSandbox

__all__ = [
    "LABEL_EPOCH",
    "LABEL_NAME",
    "LABEL_PROVIDER",
    "LABEL_RUN",
    "LABEL_SAMPLE",
    "LABEL_TASK",
    "PROVIDER",
    "Run",
    "client_for",
    "current_run",
    "kill_listed",
    "kill_quietly",
    "transport_factory",
]

PROVIDER = "dsec"
LABEL_PROVIDER = "inspect.provider"
"""``dsec`` on every sandbox this provider makes: what ``inspect sandbox cleanup dsec``
looks for."""
LABEL_RUN = "inspect.run"
"""The :class:`Run` (one eval batch) that made the sandbox."""
LABEL_TASK = "inspect.task"
LABEL_SAMPLE = "inspect.sample"
LABEL_EPOCH = "inspect.epoch"
LABEL_NAME = "inspect.sandbox"
"""The sandbox's name in its sample (``default``, or a key of ``sandboxes``)."""

transport_factory: Callable[[], httpx.AsyncBaseTransport] | None = None
"""Test hook, as :data:`dsec.cli.docker.transport_factory`: every client this provider makes
sends its requests to this transport (e.g. :func:`dsec.testing.app_transport`'s)."""

log = logging.getLogger("dsec.integrations.inspect")


def client_for(url: str | None) -> AsyncClient:
    """A client of the server at ``url`` (default ``$DSEC_URL``), keyed by ``$DSEC_API_KEY``
    or ``$DSEC_HOME/api_key``."""
    transport = transport_factory() if transport_factory is not None else None
    return AsyncClient(url, transport=transport)


@dataclass
class Run:
    """The sandboxes, clients and images of one eval batch (see the module docstring)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    clients: dict[str | None, AsyncClient] = field(default_factory=dict)
    live: dict[str, AsyncSandbox] = field(default_factory=dict)
    """Sandboxes created and not yet killed, by id."""
    images: set[str] = field(default_factory=set)
    """Images built by this run (built once per run, whatever the number of samples)."""
    build_locks: dict[str, anyio.Lock] = field(default_factory=dict)
    closed: bool = False
    """``task_cleanup`` ran: a later ``task_init`` outside a lifecycle scope starts afresh."""

    def client(self, url: str | None) -> AsyncClient:
        """The run's client of ``url`` (made on first use)."""
        if url not in self.clients:
            self.clients[url] = client_for(url)
        return self.clients[url]

    def labels(self) -> dict[str, str]:
        return {LABEL_PROVIDER: PROVIDER, LABEL_RUN: self.id}

    async def kill(self, sandboxes: Iterable[AsyncSandbox]) -> list[tuple[str, Exception]]:
        """Kill ``sandboxes`` at once (already gone counts as killed); those that could not be
        killed stay in :attr:`live` and come back with their error."""
        failed: list[tuple[str, Exception]] = []

        async def one(sb: AsyncSandbox) -> None:
            error = await kill_quietly(sb)
            if error is None:
                self.live.pop(sb.id, None)
            else:
                failed.append((sb.id, error))

        async with anyio.create_task_group() as tg:
            for sb in list(sandboxes):
                tg.start_soon(one, sb)
        return failed

    async def close(self) -> None:
        """Release the clients' connections (they reconnect if used again)."""
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self.closed = True


_ownerless: ContextVar[Run | None] = ContextVar("dsec_inspect_run", default=None)
"""The run of a provider driven without inspect's lifecycle scope (tests, scripts calling
``task_init``/``sample_init`` themselves): bound in the context of the first call."""


def current_run(*, fresh: bool = False) -> Run:
    """The run of the enclosing lifecycle scope (made on first use), or outside any scope
    the one bound to this context (``fresh``: a new one if that one was cleaned up)."""
    scope = sandbox_lifecycle_state()
    if scope is not None:
        return scope.get(Run)
    run = _ownerless.get()
    if run is None or (fresh and run.closed):
        run = Run()
        _ownerless.set(run)
    return run


async def kill_quietly(sb: AsyncSandbox) -> Exception | None:
    """Kill ``sb``; None when it is gone (also when it already was), else the error."""
    try:
        await sb.kill()
    except SandboxNotFound:
        return None
    except (DsecError, OSError, httpx.HTTPError) as e:
        return e
    return None


async def kill_listed(client: AsyncClient, labels: dict[str, str]) -> list[SandboxInfo]:
    """Kill every running or paused sandbox of the client's key carrying ``labels``;
    returns those it found (each with its state after the kill)."""
    found = await client.list_sandboxes(labels=labels)
    killed: list[SandboxInfo] = []

    async def one(info: SandboxInfo) -> None:
        sb = AsyncSandbox(info, client, owns_client=False)
        error = await kill_quietly(sb)
        if error is not None:
            log.warning("dsec: could not kill sandbox %s: %s", info.id, error)
        killed.append(sb.info)

    async with anyio.create_task_group() as tg:
        for info in found:
            tg.start_soon(one, info)
    return killed
