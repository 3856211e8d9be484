"""SandboxFusion's ``/run_jupyter``: cells run in order on a real Jupyter kernel.

Each call gets a fresh ``container`` sandbox of the built-in ``code-interpreter`` image (the
one behind E2B's code interpreter: Debian's ipykernel driven by dsec's kernel server,
:mod:`dsec.guest.codeinterp`, on port 49999) with the ``python-runtime`` toolkit layer
(SandboxFusion's Python libraries, :mod:`dsec.runtimes.fncall.toolkits`, built over that
image once per node) stacked on it, owned by the caller, without network. The
server reaches the kernel server through the edge's
:class:`~dsec.contract.edge.PortForwarding` (a TCP connection made inside the sandbox),
sends each cell as one ``POST /execute`` with ``mime_bundles`` (results as the kernel's own
MIME bundles), and kills the sandbox when the call ends, whatever happens::

    RunJupyterRequest  {cells, cell_timeout=0, total_timeout=45, memory_limit_MB=-1,
                        kernel="python3", files={path: base64}, fetch_files=[path]}
    RunJupyterResponse {status: Success|Failed|SandboxError, message, driver, cells:
                        [{stdout, stderr, display: [mime bundle], error: [{ename, evalue,
                        traceback}]}], executor_pod_name, files={path: base64}}

As in SandboxFusion, a cell that raises does not stop the next ones; ``total_timeout``
passing answers ``Failed`` with the driver ``TimeLimitExceeded`` and no cells. Relative
paths of ``files`` and ``fetch_files`` are under the kernel's working directory
(``/home/user``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import posixpath
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpcore

from dsec.contract.edge import EdgeAPI, PortForwarding, PortStream
from dsec.errors import DsecError, InvalidRequest, SandboxError
from dsec.models import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    CreateSandboxRequest,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
    SandboxRef,
)

log = logging.getLogger("dsec.apiserver.jupyter")

__all__ = ["JupyterLimits", "RunJupyterService"]

IMAGE = "code-interpreter"
PORT = 49999
WORKDIR = "/home/user"


@dataclass
class JupyterLimits:
    """Caps of one ``/run_jupyter`` call. Times in seconds, sizes in MiB/bytes."""

    max_total_timeout_s: float = 300.0
    max_cells: int = 256
    default_memory_mb: int = 1024
    min_memory_mb: int = 128
    max_memory_mb: int = 8192
    max_files: int = 512
    max_files_bytes: int = 64 << 20
    max_fetch_bytes: int = 64 << 20
    cpu: float = 1.0


class _PortNetworkStream(httpcore.AsyncNetworkStream):
    """httpcore's view of one :class:`PortStream` (plain HTTP, no TLS)."""

    def __init__(self, stream: PortStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await asyncio.wait_for(self._stream.read(max_bytes), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            await asyncio.wait_for(self._stream.write(buffer), timeout)

    async def aclose(self) -> None:
        await self._stream.close()

    def get_extra_info(self, info: str) -> Any:
        return None


class _PortBackend(httpcore.AsyncNetworkBackend):
    """Every connection httpcore opens goes to ``port`` inside one sandbox."""

    def __init__(self, edge: PortForwarding, sandbox_id: str, owner: str, port: int) -> None:
        self._edge, self._sid, self._owner, self._port = edge, sandbox_id, owner, port

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await asyncio.wait_for(
            self._edge.open_port(self._sid, self._owner, self._port), timeout
        )
        return _PortNetworkStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        raise SandboxError("unix sockets are not forwarded")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _sandbox_path(path: str, what: str) -> str:
    """``path`` as an absolute path in the sandbox (relative ones under :data:`WORKDIR`)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidRequest(f"{what} {path!r} is not a valid path")
    full = posixpath.normpath(posixpath.join(WORKDIR, path))
    if full == "/":
        raise InvalidRequest(f"{what} {path!r} names the root directory, not a file")
    return full


class RunJupyterService:
    """Runs ``/run_jupyter`` calls on ``edge`` (which must forward ports)."""

    def __init__(
        self,
        edge: EdgeAPI,
        limits: JupyterLimits | None = None,
        pod_name: str = "",
        *,
        layer_store: Any = None,
        toolkits: tuple[str, ...] = ("python-runtime",),
    ) -> None:
        """``layer_store`` (a :class:`dsec.layers.LayerStore`) builds the ``toolkits``
        layers over :data:`IMAGE` on first use; without one the image runs alone."""
        self.edge = edge
        self.limits = limits or JupyterLimits()
        self.pod_name = pod_name or "dsec-jupyter"
        self.layer_store = layer_store
        self.toolkits = toolkits if layer_store is not None else ()
        self._layers: list[str] | None = None
        self._layers_lock = asyncio.Lock()

    async def extra_layers(self) -> list[str]:
        """Digests of the toolkit layers stacked on :data:`IMAGE` (built once, then cached)."""
        if self._layers is not None:
            return self._layers
        async with self._layers_lock:
            if self._layers is None:
                from dsec.runtimes.fncall.toolkits import build_toolkit_image

                store = self.layer_store
                base = await asyncio.to_thread(store.ensure_image_sync, IMAGE)
                image = IMAGE
                for toolkit in self.toolkits:
                    info = await asyncio.to_thread(build_toolkit_image, store, image, toolkit)
                    image = info.name
                top = store.get_image(image) if self.toolkits else base
                self._layers = list(top.layers[len(base.layers) :])
        return self._layers

    def _check(self, req: RunJupyterRequest) -> tuple[int, list[tuple[str, bytes]]]:
        lim = self.limits
        if req.kernel != "python3":
            raise InvalidRequest(f"kernel {req.kernel!r} is not available; only 'python3'")
        if len(req.cells) > lim.max_cells:
            raise InvalidRequest(f"{len(req.cells)} cells; at most {lim.max_cells}")
        if not (0 < req.total_timeout <= lim.max_total_timeout_s):
            raise InvalidRequest(
                f"total_timeout must be in (0, {lim.max_total_timeout_s}] s"
                f" (got {req.total_timeout})"
            )
        if req.cell_timeout < 0:
            raise InvalidRequest(f"cell_timeout must be >= 0 s (got {req.cell_timeout})")
        memory = req.memory_limit_MB if req.memory_limit_MB > 0 else lim.default_memory_mb
        if not (lim.min_memory_mb <= memory <= lim.max_memory_mb):
            raise InvalidRequest(
                f"memory limit must be in [{lim.min_memory_mb}, {lim.max_memory_mb}] MiB"
                f" (got {memory})"
            )
        if len(req.files) > lim.max_files:
            raise InvalidRequest(f"{len(req.files)} files; at most {lim.max_files}")
        files = []
        total = 0
        for path, b64 in req.files.items():
            full = _sandbox_path(path, "files: path")
            try:
                data = base64.b64decode(b64)
            except (binascii.Error, ValueError) as e:
                raise InvalidRequest(f"files[{path!r}] is not valid base64: {e}") from None
            total += len(data)
            if total > lim.max_files_bytes:
                raise InvalidRequest(f"files total more than {lim.max_files_bytes} bytes")
            files.append((full, data))
        for i, path in enumerate(req.fetch_files):
            _sandbox_path(path, f"fetch_files[{i}]")
        return memory, files

    async def run_jupyter(self, req: RunJupyterRequest, owner: str) -> RunJupyterResponse:
        """SandboxFusion semantics: errors come back as ``status=SandboxError`` (never raised)."""
        try:
            memory, files = self._check(req)
            if not isinstance(self.edge, PortForwarding):
                raise SandboxError("this server's edge does not forward ports to sandboxes")
            return await self._run(req, owner, memory, files)
        except DsecError as e:
            return RunJupyterResponse(
                status=RunStatus.SandboxError,
                message=e.public_message,
                executor_pod_name=self.pod_name,
            )
        except Exception as e:  # a bug: still answer in the client's shape
            log.exception("run_jupyter failed")
            return RunJupyterResponse(
                status=RunStatus.SandboxError,
                message=f"internal error: {type(e).__name__}",
                executor_pod_name=self.pod_name,
            )

    async def _run(
        self,
        req: RunJupyterRequest,
        owner: str,
        memory: int,
        files: list[tuple[str, bytes]],
    ) -> RunJupyterResponse:
        t0 = time.monotonic()
        layers = await self.extra_layers()
        info = await self.edge.create_sandbox(
            CreateSandboxRequest(
                tier="container",
                image=IMAGE,
                layers=layers,
                cpu=self.limits.cpu,
                memory_mb=memory,
                ttl_s=req.total_timeout + 120.0,  # a backstop: the call kills it itself
                labels={"dsec.sandboxfusion": "run_jupyter"},
                # SandboxFusion's kernels run as root (the image's own user is E2B's `user`)
                user="root",
            ),
            owner,
        )
        sid = info.id
        pod = f"{sid}@{info.node}" if getattr(info, "node", None) else sid
        try:
            for path, data in files:
                await self.edge.write_file(sid, owner, path, data)
            assert isinstance(self.edge, PortForwarding)
            pool = httpcore.AsyncConnectionPool(
                network_backend=_PortBackend(self.edge, sid, owner, PORT), max_connections=1
            )
            cells: list[CellRunResult] = []
            try:
                async with asyncio.timeout(req.total_timeout):
                    for code in req.cells:
                        cells.append(await self._cell(pool, code, req.cell_timeout))
            except TimeoutError:
                return RunJupyterResponse(
                    status=RunStatus.Failed,
                    message=f"the cells did not finish within total_timeout ({req.total_timeout} s)",
                    driver=CommandRunResult(
                        status=CommandRunStatus.TimeLimitExceeded,
                        execution_time=time.monotonic() - t0,
                    ),
                    executor_pod_name=pod,
                )
            finally:
                await pool.aclose()
            fetched, notes = await self._fetch(sid, owner, req.fetch_files)
            return RunJupyterResponse(
                status=RunStatus.Success,
                message="; ".join(notes),
                driver=CommandRunResult(
                    status=CommandRunStatus.Finished,
                    execution_time=time.monotonic() - t0,
                    return_code=0,
                    stdout="",
                    stderr="",
                ),
                cells=cells,
                executor_pod_name=pod,
                files=fetched,
            )
        finally:
            try:
                await self.edge.kill_sandbox(SandboxRef(sandbox_id=sid), owner)
            except DsecError as e:
                log.warning("run_jupyter: killing %s failed: %s", sid, e)

    async def _cell(
        self, pool: httpcore.AsyncConnectionPool, code: str, cell_timeout: float
    ) -> CellRunResult:
        cell = CellRunResult()
        body = json.dumps({"code": code, "language": "python", "mime_bundles": True}).encode()

        async def consume() -> None:
            async for obj in _ndjson(pool, body):
                kind = obj.get("type")
                if kind == "stdout":
                    cell.stdout += str(obj.get("text", ""))
                elif kind == "stderr":
                    cell.stderr += str(obj.get("text", ""))
                elif kind == "result":
                    cell.display.append(dict(obj.get("bundle") or {}))
                elif kind == "error":
                    cell.error.append(
                        {
                            "ename": obj.get("name", ""),
                            "evalue": obj.get("value", ""),
                            "traceback": str(obj.get("traceback", "")).split("\n"),
                        }
                    )

        if cell_timeout > 0:
            try:
                await asyncio.wait_for(consume(), cell_timeout)
            except TimeoutError:
                # closing the connection makes the kernel server interrupt the cell
                cell.error.append(
                    {
                        "ename": "TimeoutError",
                        "evalue": f"the cell did not finish within cell_timeout ({cell_timeout} s)",
                        "traceback": [],
                    }
                )
        else:
            await consume()
        return cell

    async def _fetch(
        self, sid: str, owner: str, paths: list[str]
    ) -> tuple[dict[str, str], list[str]]:
        out: dict[str, str] = {}
        notes: list[str] = []
        total = 0
        for path in paths:
            try:
                data = await self.edge.read_file(sid, owner, _sandbox_path(path, "fetch_files"))
            except DsecError as e:
                notes.append(f"fetch {path}: {e.public_message}")
                continue
            total += len(data)
            if total > self.limits.max_fetch_bytes:
                notes.append(
                    f"fetch {path}: fetched files exceed {self.limits.max_fetch_bytes} bytes"
                )
                continue
            out[path] = base64.b64encode(data).decode()
        return out, notes


async def _ndjson(pool: httpcore.AsyncConnectionPool, body: bytes) -> AsyncIterator[dict[str, Any]]:
    """The output lines of one ``POST /execute`` on the kernel server."""
    headers = [
        (b"Host", b"sandbox"),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
    ]
    async with pool.stream(
        "POST", f"http://sandbox:{PORT}/execute", headers=headers, content=body
    ) as resp:
        if resp.status != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            raise SandboxError(f"the kernel server answered {resp.status}: {text[:500]}")
        buf = b""
        async for chunk in resp.aiter_stream():
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    yield json.loads(line)
