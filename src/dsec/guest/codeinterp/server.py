"""The HTTP server on port 49999 (tornado): E2B's code-interpreter routes.

===========================  ======================================================
route                        answer
===========================  ======================================================
``GET /health``              ``200 "OK"`` once the default Python context runs, else
                             ``503``
``POST /execute``            ``200`` NDJSON stream (see :mod:`.protocol`); ``404``
                             unknown ``context_id``; ``400`` both ``context_id`` and
                             ``language``, an unavailable language, bad env vars;
                             ``422`` malformed body
``POST /contexts``           ``200`` ``{"id", "language", "cwd"}``; ``400`` unknown
                             language or missing ``cwd``
``GET /contexts``            ``200`` list of contexts
``POST /contexts/{id}/restart``  ``200 null``; ``404``
``DELETE /contexts/{id}``    ``200 null``; ``404``
===========================  ======================================================

Error bodies are plain text, as E2B's server sends them (its client puts the text into the
exception). Every request header is ignored (``E2b-Sandbox-Id``, ``E2b-Sandbox-Port``,
``X-Access-Token``, ``E2B-Traffic-Access-Token``): authentication belongs to whatever
routes traffic to this port.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import tornado.httpserver
import tornado.web
from tornado.iostream import StreamClosedError

from . import protocol
from .contexts import CodeContext, ContextRegistry
from .protocol import RequestError

__all__ = ["make_app", "serve"]

log = logging.getLogger("dsec_codeinterp")

MAX_BODY_BYTES = 32 << 20
_COUNT_LINE = b'{"type":"number_of_executions"'


class _Base(tornado.web.RequestHandler):
    registry: ContextRegistry

    def initialize(self, registry: ContextRegistry) -> None:
        self.registry = registry

    def set_default_headers(self) -> None:
        self.set_header("Server", "dsec-codeinterp")

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(message)

    def reply_json(self, obj: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(self._reason)

    def check_xsrf_cookie(self) -> None:  # an API, not a browser form
        return None


class Health(_Base):
    def get(self) -> None:
        if self.registry.ready.is_set():
            self.reply_json("OK")
        else:
            self.fail(503, "starting: the default Python context is not up yet")


class Execute(_Base):
    _gone = False

    def on_connection_close(self) -> None:
        self._gone = True

    async def post(self) -> None:
        try:
            req = protocol.parse_execute(self.request.body)
            ctx = await self._context(req)
        except RequestError as e:
            self.fail(e.status, e.message)
            return
        except Exception as e:  # a kernel that cannot start
            log.exception("execute: no context")
            self.fail(500, f"could not start the context: {e}")
            return
        async with ctx.lock:
            if self._gone:  # the client left while this request waited for the context
                return
            self.set_header("Content-Type", "application/x-ndjson")
            try:
                await ctx.ensure_running()
                protocol.check_env_names(ctx.language, req.env_vars)
            except RequestError as e:
                self.fail(e.status, e.message)
                return
            except Exception as e:
                self.fail(500, f"could not start the context: {e}")
                return
            try:
                async for line in ctx.execute(req.code, req.env_vars, lambda: self._gone):
                    # the execution count goes out with the next line (one write less per
                    # execution; the client only keeps the number)
                    await self._send(line, flush=not line.startswith(_COUNT_LINE))
            except Exception as e:
                log.exception("context %s: execution failed", ctx.id)
                await self._send(
                    protocol.output_line(
                        {"type": "error", "name": "ServerError", "value": str(e), "traceback": ""}
                    )
                )
            if not self._gone:
                self.write(protocol.output_line({"type": "end_of_execution"}))
                try:
                    await self.finish()
                except StreamClosedError:
                    self._gone = True

    async def _send(self, line: bytes, flush: bool = True) -> None:
        if self._gone:
            return
        self.write(line)
        if not flush:
            return
        try:
            await self.flush()
        except StreamClosedError:
            self._gone = True

    async def _context(self, req: protocol.ExecuteRequest) -> CodeContext:
        if req.context_id:
            return self.registry.get(req.context_id)
        return await self.registry.default(protocol.normalize_language(req.language))


class Contexts(_Base):
    async def get(self) -> None:
        self.reply_json([c.describe() for c in self.registry.list()])

    async def post(self) -> None:
        try:
            language, cwd = protocol.parse_create_context(self.request.body)
            ctx = await self.registry.create(language, cwd)
        except RequestError as e:
            self.fail(e.status, e.message)
            return
        except Exception as e:
            log.exception("create context")
            self.fail(500, f"could not start the context: {e}")
            return
        self.reply_json(ctx.describe())


class ContextItem(_Base):
    async def delete(self, context_id: str) -> None:
        try:
            await self.registry.remove(context_id)
        except RequestError as e:
            self.fail(e.status, e.message)
            return
        self.reply_json(None)


class ContextRestart(_Base):
    async def post(self, context_id: str) -> None:
        try:
            ctx = self.registry.get(context_id)
            await ctx.restart()
        except RequestError as e:
            self.fail(e.status, e.message)
            return
        except Exception as e:
            log.exception("restart context")
            self.fail(500, f"could not restart the context: {e}")
            return
        self.reply_json(None)


def make_app(registry: ContextRegistry) -> tornado.web.Application:
    """The tornado application serving ``registry``."""
    args = {"registry": registry}
    return tornado.web.Application(
        [
            (r"/health", Health, args),
            (r"/execute", Execute, args),
            (r"/contexts", Contexts, args),
            (r"/contexts/([^/]+)/restart", ContextRestart, args),
            (r"/contexts/([^/]+)", ContextItem, args),
        ],
        compress_response=False,
        log_function=lambda handler: None,
    )


async def serve(registry: ContextRegistry, host: str, port: int, stop: asyncio.Event) -> None:
    """Listen on ``host:port``, start the default Python context, serve until ``stop``."""
    server = tornado.httpserver.HTTPServer(
        make_app(registry),
        max_body_size=MAX_BODY_BYTES,
        idle_connection_timeout=640,
        xheaders=False,
    )
    server.listen(port, address=host)
    log.info("dsec code interpreter listening on %s:%d", host, port)

    async def warm() -> None:
        try:
            await registry.default("python")
            registry.ready.set()
            log.info("default Python context ready")
        except Exception:
            log.exception("the default Python context did not start")

    warm_task = asyncio.ensure_future(warm())
    try:
        await stop.wait()
    finally:
        warm_task.cancel()
        server.stop()
        await registry.close_all()
