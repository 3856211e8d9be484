"""Creations whose client went away: nothing is left behind.

A client that gives up on a create (its timeout, a killed trainer) closes its connection,
but the server keeps working on the request: without care the sandbox is made anyway and
idles until its TTL, holding a slot nobody will use. :func:`unless_departed` runs the work
while watching the connection and undoes the result (kills the sandbox) when the client has
gone by the time it is ready. The work itself is not cancelled: a creation half-way through
its runtime's steps is safest finished and then destroyed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

__all__ = ["unless_departed"]

log = logging.getLogger("dsec.apiserver")

T = TypeVar("T")


async def _departed(request: Request) -> None:
    """Return when the client's connection is gone (the server's ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_departed(
    request: Request, work: Awaitable[T], undo: Callable[[T], Awaitable[None]]
) -> T:
    """``await work``; if the client disconnected before it finished, ``await undo(result)``
    (its errors are logged, not raised) and return the result anyway (nobody reads it).
    The request body must have been read already (the route's parameters have)."""
    watcher = asyncio.ensure_future(_departed(request))
    try:
        result = await work
    finally:
        gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if gone:
        log.info(
            "%s %s: the client left before the answer; undoing", request.method, request.url.path
        )
        try:
            await undo(result)
        except Exception as e:
            log.warning("undoing %s for a departed client failed: %s", request.url.path, e)
    return result
