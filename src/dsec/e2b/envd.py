"""The in-sandbox API ("envd") as one ASGI app: Connect-RPC services and ``/files``.

Routing is by the ``E2b-Sandbox-Id`` header the SDK sends with every
in-sandbox request when ``E2B_SANDBOX_URL`` is set; access is checked with the
``X-Access-Token`` the control plane issued (see :mod:`dsec.e2b.access`).

Routes (relative to where the app is mounted, e.g. ``/e2b/envd``):

* ``POST /process.Process/<Method>``        Connect, :mod:`dsec.e2b.process`
* ``POST /filesystem.Filesystem/<Method>``  Connect, :mod:`dsec.e2b.filesystem`
* ``GET /files?path=``   download one file (bytes)
* ``POST /files?path=``  upload: ``multipart/form-data`` (one or more ``file``
  parts named by their path) or ``application/octet-stream`` (optionally
  ``Content-Encoding: gzip``); answers ``[{"name", "type", "path"}]``.
  Instead of the headers, a signed URL (``download_url``/``upload_url``:
  ``signature``, ``signature_expiration``, ``username`` query parameters) may
  name the sandbox (:meth:`~dsec.e2b.access.AccessTokens.find_signed`)
* ``GET /health``        204 while the sandbox runs, 502 while it is paused and
  ("... was not found") after
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import posixpath
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dsec.apiserver.middleware import ROUTE_SCOPE_KEY
from dsec.contract.edge import EdgeAPI, FileXattrs
from dsec.e2b.access import AccessTokens
from dsec.e2b.control import AUTO_RESUME_LABEL
from dsec.e2b.errors import (
    E2BError,
    e2b_http_exception_handlers,
    envd_http_status,
    sandbox_gone_message,
    sandbox_ref,
    to_connect_error,
)
from dsec.e2b.filesystem import METADATA_XATTR_PREFIX, FilesystemService
from dsec.e2b.process import ProcessRegistry, ProcessService
from dsec.errors import CapabilityNotSupported, DsecError, FileNotFound, PayloadTooLarge
from dsec.models import SandboxExecRequest

__all__ = ["DEFAULT_MAX_UPLOAD_BYTES", "EnvdApp", "route_path"]

log = logging.getLogger("dsec.e2b")

DEFAULT_MAX_UPLOAD_BYTES = 100 << 20
"""Largest ``/files`` upload body (after gzip decoding), bytes."""
RPC_READ_MAX_BYTES = 16 << 20
"""Largest Connect request message (stdin chunks, paths), bytes."""
_RPC_METHOD = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")


def route_path(scope: Scope) -> str:
    """The request path below the app's mount point (``root_path`` stripped)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


class _Shield:
    """Connect interceptor: dsec errors become Connect errors; a bug is INTERNAL, never a raw 500."""

    @staticmethod
    def _convert(e: Exception, ctx: RequestContext) -> ConnectError:
        if isinstance(e, ConnectError):
            return e
        if isinstance(e, DsecError):
            return to_connect_error(e, ctx.request_headers.get("e2b-sandbox-id", ""))
        log.exception("e2b envd: unexpected error in %s", ctx.method.name, exc_info=e)
        return ConnectError(Code.INTERNAL, f"internal error: {type(e).__name__}")

    async def intercept_unary(
        self,
        call_next: Callable[[Any, RequestContext], Awaitable[Any]],
        request: Any,
        ctx: RequestContext,
    ) -> Any:
        try:
            return await call_next(request, ctx)
        except ConnectError:
            raise
        except Exception as e:
            raise self._convert(e, ctx) from None

    async def intercept_client_stream(
        self,
        call_next: Callable[[Any, RequestContext], Awaitable[Any]],
        request: Any,
        ctx: RequestContext,
    ) -> Any:
        try:
            return await call_next(request, ctx)
        except ConnectError:
            raise
        except Exception as e:
            raise self._convert(e, ctx) from None

    async def intercept_server_stream(
        self,
        call_next: Callable[[Any, RequestContext], AsyncIterator[Any]],
        request: Any,
        ctx: RequestContext,
    ) -> AsyncIterator[Any]:
        stream = call_next(request, ctx)
        try:
            async for item in stream:
                yield item
        except ConnectError:
            raise
        except Exception as e:
            raise self._convert(e, ctx) from None
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


class _StrictCodec:
    """A Connect codec whose decode failures are ``INVALID_ARGUMENT``, not an unhandled 500."""

    def __init__(self, inner: Codec) -> None:
        self._inner = inner

    def name(self) -> str:
        return str(self._inner.name())

    def encode(self, message: Any) -> bytes:
        return bytes(self._inner.encode(message))

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as e:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"cannot decode {message_class.__name__}: {e}"
            ) from None


CODECS = [_StrictCodec(proto_binary_codec()), _StrictCodec(proto_json_codec())]
"""Binary and JSON protobuf, as connectrpc's defaults, with decode errors made INVALID_ARGUMENT."""


_FILENAME = re.compile(r'filename\*?="((?:[^"\\]|\\.)*)"|filename=([^;\s]+)', re.IGNORECASE)


def _split_multipart(body: bytes, content_type: str) -> list[tuple[str | None, bytes]]:
    """``(filename, data)`` of each part of a ``multipart/form-data`` body."""
    m = re.search(r'boundary="?([^";]+)"?', content_type)
    if not m:
        raise E2BError(400, "multipart body without a boundary")
    delim = b"--" + m.group(1).encode("latin-1")
    pieces = body.split(delim)
    if len(pieces) < 3:
        raise E2BError(400, "malformed multipart body")
    out: list[tuple[str | None, bytes]] = []
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            break
        if piece.startswith(b"\r\n"):
            piece = piece[2:]
        head, sep, data = piece.partition(b"\r\n\r\n")
        if not sep:
            raise E2BError(400, "malformed multipart part")
        if data.endswith(b"\r\n"):
            data = data[:-2]
        filename = None
        for line in head.decode("utf-8", "replace").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-disposition":
                fm = _FILENAME.search(value)
                if fm:
                    raw = fm.group(1) if fm.group(1) is not None else fm.group(2)
                    filename = raw.replace("%22", '"').replace('\\"', '"').replace("\\\\", "\\")
        out.append((filename, data))
    return out


KERNEL_MOUNTS = frozenset({"proc", "sys", "dev"})
"""Top-level directories that are kernel mounts in a sandbox: downloads from them are read
by a command inside the sandbox (:meth:`EnvdApp._read_in_sandbox`)."""
KERNEL_READ_MAX_BYTES = 8 << 20
_METADATA_HEADER = "x-metadata-"
_METADATA_KEY = re.compile(r"[a-z0-9!#$%&'*+\-.^_`|~]{1,200}")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]{0,4096}")
MAX_METADATA_KEYS = 32


def _upload_metadata(request: Request) -> dict[str, str]:
    """The ``X-Metadata-<key>: <value>`` headers of an upload, keys lowercased (as envd);
    400 for a key or value envd would refuse."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        if not name.lower().startswith(_METADATA_HEADER):
            continue
        key = name[len(_METADATA_HEADER) :].lower()
        if not _METADATA_KEY.fullmatch(key):
            raise E2BError(400, f"invalid metadata key {key!r}")
        if not _METADATA_VALUE.fullmatch(value):
            raise E2BError(400, f"invalid metadata value for key {key!r}")
        out[key] = value
    if len(out) > MAX_METADATA_KEYS:
        raise E2BError(400, f"at most {MAX_METADATA_KEYS} metadata keys per file")
    return out


class EnvdApp:
    """ASGI app serving envd for every sandbox (see the module docstring).

    Args:
        edge: the edge the sandboxes live on.
        tokens: verifies ``X-Access-Token`` against ``E2b-Sandbox-Id``.
        registry: the process table shared with the control plane (kill drops it).
        max_upload_bytes: largest upload body, bytes (``PayloadTooLarge`` -> 413).
        watch_poll_interval_s: seconds between two listings of a watched directory.
    """

    def __init__(
        self,
        edge: EdgeAPI,
        tokens: AccessTokens,
        registry: ProcessRegistry,
        *,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        watch_poll_interval_s: float = 0.25,
    ) -> None:
        self.edge = edge
        self.tokens = tokens
        self.registry = registry
        self.max_upload_bytes = max_upload_bytes
        self._no_auto_resume: OrderedDict[str, bool] = OrderedDict()
        """sandbox id -> created with auto_resume=False (read once from its labels)"""
        self.filesystem = FilesystemService(
            edge,
            self._authorize_rpc,
            users=registry.users,
            poll_interval_s=watch_poll_interval_s,
        )
        self.process = ProcessService(registry, self._authorize_rpc)
        shield = [_Shield()]
        self._process_app = ProcessASGIApplication(
            self.process,
            interceptors=shield,
            read_max_bytes=RPC_READ_MAX_BYTES,
            codecs=CODECS,
        )
        self._fs_app = FilesystemASGIApplication(
            self.filesystem,
            interceptors=shield,
            read_max_bytes=RPC_READ_MAX_BYTES,
            codecs=CODECS,
        )
        self._http = Starlette(
            routes=[*self.files_routes(), Route("/health", self._health, methods=["GET"])],
            exception_handlers=e2b_http_exception_handlers(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)
            rpc: ASGIApp | None = None
            if path.startswith("/process.Process/"):
                rpc = self._process_app
            elif path.startswith("/filesystem.Filesystem/"):
                rpc = self._fs_app
            if rpc is not None:
                self._note_rpc(scope, path)
                await rpc(scope, receive, send)
                return
        await self._http(scope, receive, send)

    def _note_rpc(self, scope: Scope, path: str) -> None:
        """Name the RPC and its caller for the access log (``scope["dsec.route"]``,
        ``scope["state"]["owner"]``); the RPC itself checks access again."""
        service, _, method = path[1:].partition("/")
        name = method if _RPC_METHOD.fullmatch(method) else "{method}"
        scope[ROUTE_SCOPE_KEY] = f"{scope.get('root_path', '')}/{service}/{name}"
        headers = dict(scope.get("headers") or [])
        sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
        token = headers.get(b"x-access-token", b"").decode("latin-1")
        owner = self.tokens.verify(sandbox_id, token) if sandbox_id and token else None
        if owner is not None:
            scope.setdefault("state", {})["owner"] = owner

    # --- access -----------------------------------------------------------
    def _check(self, sandbox_id: str | None, token: str | None) -> tuple[str, str]:
        """``(sandbox_id, owner)``; raises ``E2BError`` (400/401/502) otherwise."""
        if not sandbox_id:
            raise E2BError(
                400, "missing E2b-Sandbox-Id header: set E2B_SANDBOX_URL to dsec's envd URL"
            )
        if not token:
            raise E2BError(401, "missing access token or file signature")  # envd's words
        owner = self.tokens.verify(sandbox_id, token)
        if owner is None:
            # A token for another sandbox (or another owner): the sandbox does not exist for it.
            raise E2BError(502, sandbox_gone_message(sandbox_id))
        return sandbox_id, owner

    async def _check_awake(self, sandbox_id: str, owner: str) -> None:
        """Refuse (502) a request to a paused sandbox created with ``auto_resume=False``
        (E2B: only ``connect()`` wakes it); any other sandbox resumes on the request."""
        off = self._no_auto_resume.get(sandbox_id)
        if off is False:
            return
        try:
            info = await self.edge.get_sandbox(sandbox_ref(sandbox_id), owner)
        except DsecError:
            return  # the request itself reports what is wrong
        if off is None:
            off = info.labels.get(AUTO_RESUME_LABEL) == "off"
            self._no_auto_resume[sandbox_id] = off
            while len(self._no_auto_resume) > 100_000:
                self._no_auto_resume.popitem(last=False)
        if off and info.state == "paused":
            raise E2BError(
                502,
                f"sandbox {sandbox_id} is paused and its auto_resume is off: "
                "Sandbox.connect() resumes it",
            )

    async def _authorize_rpc(self, ctx: RequestContext) -> tuple[str, str]:
        headers = ctx.request_headers
        try:
            sandbox_id, owner = self._check(
                headers.get("e2b-sandbox-id"), headers.get("x-access-token")
            )
            await self._check_awake(sandbox_id, owner)
            return sandbox_id, owner
        except E2BError as e:
            code = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED}.get(
                e.status, Code.UNAVAILABLE
            )
            raise ConnectError(code, e.message) from None

    # --- HTTP routes ------------------------------------------------------
    @staticmethod
    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status)

    async def _http_target(self, request: Request) -> tuple[str, str]:
        signature = request.query_params.get("signature")
        if signature and not request.headers.get("x-access-token"):
            # may try every remembered token (milliseconds): off the event loop
            found = await asyncio.to_thread(self._check_signed, request, signature)
        else:
            found = self._check(
                request.headers.get("e2b-sandbox-id"), request.headers.get("x-access-token")
            )
        await self._check_awake(*found)
        return found

    def _check_signed(self, request: Request, signature: str) -> tuple[str, str]:
        """``(sandbox_id, owner)`` of a signed ``/files`` URL (``download_url``/``upload_url``)."""
        raw_exp = request.query_params.get("signature_expiration")
        try:
            expiration = int(raw_exp) if raw_exp else None
        except ValueError:
            raise E2BError(400, "signature_expiration must be an integer") from None
        found = self.tokens.find_signed(
            request.query_params.get("path", ""),
            "read" if request.method == "GET" else "write",
            request.query_params.get("username") or "",
            signature,
            expiration,
            sandbox_id=request.headers.get("e2b-sandbox-id") or None,
        )
        if found is None:
            raise E2BError(401, "invalid signature")  # envd's words
        if expiration is not None and expiration < time.time():
            raise E2BError(401, "signature is already expired")
        return found

    def files_routes(self) -> list[Route]:
        """``GET``/``POST /files`` on their own, for the server to serve at its root too: the
        SDK builds ``download_url``/``upload_url`` as ``urljoin(E2B_SANDBOX_URL, "/files")``,
        which drops the ``/e2b/envd`` prefix (see docs/e2b.md)."""
        return [
            Route("/files", self._download, methods=["GET"]),
            Route("/files", self._upload, methods=["POST"]),
        ]

    async def _abs_path(self, sandbox_id: str, owner: str, path: str, request: Request) -> str:
        """``path`` made absolute: a relative one against the home of the ``username`` the
        request names (else the sandbox's default user), as envd does."""
        if not path or "\0" in path:
            raise E2BError(400, "a non-empty path is required")
        user = request.query_params.get("username") or None
        return await self.registry.users.resolve(sandbox_id, owner, path, user)

    async def _guard(
        self, request: Request, handler: Callable[[str, str], Awaitable[Response]]
    ) -> Response:
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        try:
            sid, owner = await self._http_target(request)
            request.scope.setdefault("state", {})["owner"] = owner  # for the access log
            return await handler(sid, owner)
        except E2BError as e:
            return self._error(e.status, e.message)
        except DsecError as e:
            status = envd_http_status(e)
            message = sandbox_gone_message(sandbox_id) if status == 502 else e.public_message
            return self._error(status, message)

    async def _health(self, request: Request) -> Response:
        async def handler(sandbox_id: str, owner: str) -> Response:
            info = await self.edge.get_sandbox(sandbox_ref(sandbox_id), owner)
            if info.state == "stopped":
                return self._error(502, sandbox_gone_message(sandbox_id))
            if info.state == "paused":  # as E2B: a paused sandbox's envd does not answer
                return self._error(502, f"sandbox {sandbox_id} is paused")
            return Response(status_code=204)

        return await self._guard(request, handler)

    async def _download(self, request: Request) -> Response:
        async def handler(sandbox_id: str, owner: str) -> Response:
            path = await self._abs_path(
                sandbox_id, owner, request.query_params.get("path", ""), request
            )
            if path.split("/", 2)[1] in KERNEL_MOUNTS:
                user = request.query_params.get("username") or None
                data = await self._read_in_sandbox(sandbox_id, owner, path, user)
            else:
                data = await self.edge.read_file(sandbox_id, owner, path)
            name = posixpath.basename(path).replace('"', "")
            return Response(
                data,
                media_type="application/octet-stream",
                headers={"Content-Disposition": f'attachment; filename="{name}"'},
            )

        return await self._guard(request, handler)

    async def _read_in_sandbox(
        self, sandbox_id: str, owner: str, path: str, user: str | None
    ) -> bytes:
        """A file under ``/proc``, ``/sys`` or ``/dev`` (kernel mounts the files API does not
        reach), read as envd reads it: from inside the sandbox, by a command run as the
        request's user (its output as base64, so any bytes survive)."""
        req = SandboxExecRequest(
            sandbox_id=sandbox_id,
            cmd=["/bin/sh", "-c", 'exec base64 < "$1"', "sh", path],
            user=user,
            timeout_s=30.0,
            max_output_bytes=KERNEL_READ_MAX_BYTES * 4 // 3 + 4096,
        )
        res = await self.edge.exec(req, owner)
        if res.exit_code != 0 or res.stdout_truncated:
            err = res.stderr.strip().splitlines()[-1:] or [f"exit {res.exit_code}"]
            if "No such file" in err[0] or "not found" in err[0]:
                raise FileNotFound(f"no such file or directory: {path}", path=path)
            if res.stdout_truncated:
                raise PayloadTooLarge(f"{path} is larger than {KERNEL_READ_MAX_BYTES} bytes")
            raise E2BError(400, f"cannot read {path}: {err[0]}")
        try:
            return base64.b64decode(res.stdout)
        except (binascii.Error, ValueError):
            raise E2BError(400, f"cannot read {path}: the sandbox has no working base64") from None

    async def _set_metadata(
        self, sandbox_id: str, owner: str, path: str, metadata: dict[str, str]
    ) -> None:
        """Make ``metadata`` the file's whole metadata (envd: an upload without metadata
        clears what an earlier one stored)."""
        if not isinstance(self.edge, FileXattrs):
            return
        values = {METADATA_XATTR_PREFIX + k: v for k, v in metadata.items()}
        try:
            await self.edge.set_xattrs(
                sandbox_id, owner, path, values, clear_prefix=METADATA_XATTR_PREFIX
            )
        except CapabilityNotSupported:
            if metadata:
                raise

    async def _read_body(self, request: Request) -> bytes:
        chunks: list[bytes] = []
        total = 0
        limit = self.max_upload_bytes + (64 << 10)  # multipart framing
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"upload is larger than {self.max_upload_bytes} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding == "gzip":
            inflater = zlib.decompressobj(wbits=31)
            try:
                body = inflater.decompress(body, self.max_upload_bytes + 1)
            except zlib.error as e:
                raise E2BError(400, f"bad gzip body: {e}") from None
            if len(body) > self.max_upload_bytes or inflater.unconsumed_tail:
                raise PayloadTooLarge(f"upload is larger than {self.max_upload_bytes} bytes")
        elif encoding not in ("identity", ""):
            raise E2BError(400, f"unsupported Content-Encoding {encoding!r}")
        return body

    async def _upload(self, request: Request) -> Response:
        async def handler(sandbox_id: str, owner: str) -> Response:
            # read the body before any refusal: answering mid-upload makes the client see a
            # reset connection instead of the error
            body = await self._read_body(request)
            metadata = _upload_metadata(request)
            query_path = request.query_params.get("path")
            content_type = request.headers.get("content-type", "")
            files: list[tuple[str, bytes]] = []
            if content_type.lower().startswith("multipart/form-data"):
                parts = _split_multipart(body, content_type)
                for filename, data in parts:
                    target = query_path if (len(parts) == 1 and query_path) else filename
                    if not target:
                        raise E2BError(
                            400, "a multipart part has no file name and no path was given"
                        )
                    files.append((target, data))
            else:
                if not query_path:
                    raise E2BError(400, "the path query parameter is required")
                files.append((query_path, body))
            if any(len(data) > self.max_upload_bytes for _, data in files):
                raise PayloadTooLarge(f"a file is larger than {self.max_upload_bytes} bytes")
            if metadata and not isinstance(self.edge, FileXattrs):
                raise E2BError(422, "this server's edge keeps no file metadata")
            written: list[dict[str, Any]] = []
            for target, data in files:
                path = await self._abs_path(sandbox_id, owner, target, request)
                await self.edge.write_file(sandbox_id, owner, path, data)
                await self._set_metadata(sandbox_id, owner, path, metadata)
                entry: dict[str, Any] = {
                    "name": posixpath.basename(path),
                    "type": "file",
                    "path": path,
                }
                if metadata:
                    entry["metadata"] = metadata
                written.append(entry)
            return JSONResponse(written)

        return await self._guard(request, handler)
