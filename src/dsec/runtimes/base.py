"""The backend contract every tier implements.

A *runtime* turns a :class:`SandboxSpec` into a running sandbox on this node and
serves exec and file requests for it. The edge owns lifecycle bookkeeping
(registry, TTL, metrics, reconcile); a runtime only does the mechanics.

State machine seen by a runtime (the edge never calls out of order)::

    create() ──> [running] ──exec()/files──> [running]
                     │  pause()/resume() (Pausable only)
                     └─ destroy() ──> gone (idempotent; safe on half-created)

``recover()`` is called on edge start for every sandbox the registry says is
alive; it returns False if the sandbox is gone so the edge can clean up.

Optional abilities are separate protocols (``Pausable``...), advertised in
:class:`~dsec.models.Capabilities`; the edge checks them and raises
``CapabilityNotSupported`` otherwise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dsec.models import Capabilities, ExecRequest, ExecResult, FileInfo, LayerInfo, SnapshotRequest

# Called with ("stdout"|"stderr", chunk) while a command runs.
OutputSink = Callable[[str, bytes], Awaitable[None]]


@dataclass
class SandboxSpec:
    """Everything a runtime needs to create one sandbox (already validated and resolved)."""

    id: str
    tier: str
    layer_paths: list[str]  # EROFS files, bottom first
    layer_digests: list[str]
    cpu: float
    memory_mb: int
    disk_mb: int
    pids: int
    env: dict[str, str]
    user: str | None
    workdir: str
    hostname: str = "sandbox"
    labels: dict[str, str] = field(default_factory=dict)
    network: Any = None  # a dsec.network.NetworkPolicy, or None: loopback only
    # VM tiers: commands get the whole guest instead of the container tier's protections
    full_guest: bool = False


@dataclass
class Handle:
    """A runtime's record of one sandbox. ``state`` must be JSON-serialisable: the edge
    stores it in the registry and gives it back to ``recover()`` after a restart."""

    id: str
    state: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class SandboxFiles(Protocol):
    """File access inside one sandbox. Paths are absolute sandbox paths; anything that
    resolves outside the sandbox root raises ``PathOutsideSandbox``."""

    async def read(self, path: str, max_bytes: int) -> bytes: ...
    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo: ...
    async def list(self, path: str, depth: int = 1) -> list[FileInfo]: ...
    async def stat(self, path: str) -> FileInfo: ...
    async def remove(self, path: str, recursive: bool = False) -> None: ...
    async def mkdir(self, path: str, parents: bool = True) -> FileInfo: ...
    async def rename(self, src: str, dst: str) -> FileInfo: ...
    async def upload_tar(self, path: str, data: bytes) -> int: ...
    async def download_tar(self, path: str, max_bytes: int) -> bytes: ...


@runtime_checkable
class Runtime(Protocol):
    """One tier's backend on one node."""

    tier: str

    def capabilities(self) -> Capabilities: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def create(self, spec: SandboxSpec) -> Handle: ...
    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult: ...
    def files(self, handle: Handle) -> SandboxFiles: ...
    async def destroy(self, handle: Handle) -> None: ...
    async def recover(self, handle: Handle) -> bool: ...
    async def alive(self, handle: Handle) -> bool: ...
    async def list_orphans(self, known: set[str]) -> list[str]: ...
    async def destroy_orphan(self, sandbox_id: str) -> None: ...


@runtime_checkable
class Pausable(Protocol):
    """Freeze a sandbox and give back what memory can be given back; resume undoes it.
    ``pause`` returns :class:`dsec.models.PauseReport` fields."""

    async def pause(self, handle: Handle) -> dict[str, Any]: ...
    async def resume(self, handle: Handle) -> None: ...


@runtime_checkable
class Networked(Protocol):
    """Per-sandbox network policy that can change while the sandbox runs."""

    async def network_update(self, handle: Handle, policy: Any) -> None: ...
    async def network_stats(self, handle: Handle) -> dict[str, Any]: ...


@runtime_checkable
class Snapshottable(Protocol):
    """Capture the sandbox's writable layer as a new layer in ``store`` (``pack_diff``).
    ``meta`` goes into the layer's metadata (the edge passes the parent layers)."""

    async def snapshot(
        self, handle: Handle, store: Any, req: SnapshotRequest, meta: dict[str, Any]
    ) -> LayerInfo: ...


@runtime_checkable
class MemoryStateful(Protocol):
    """VM tiers: a sandbox's RAM and device state written to a file.

    ``suspend`` writes it and ends the sandbox's VM process (host memory freed); the sandbox
    stays ``paused`` and ``resume`` (or any exec/file call) restores it, also after an edge
    restart. ``memory_snapshot`` captures a running sandbox once (it keeps running);
    ``create_from_memory`` starts a new sandbox from that capture (call it n times), with
    its own copy-on-write disk and a fresh identity (clock, RNG seed, hostname);
    ``drop_memory_snapshot`` deletes the capture. ``portable=True`` captures every page
    (not a difference from this node's template RAM), so another node can load it (cluster
    migration). ``suspend`` returns
    :class:`dsec.models.PauseReport` fields."""

    def is_suspended(self, handle: Handle) -> bool: ...
    async def suspend(self, handle: Handle) -> dict[str, Any]: ...
    async def memory_snapshot(self, handle: Handle, *, portable: bool = False) -> Any: ...
    async def create_from_memory(self, snapshot: Any, spec: SandboxSpec) -> Handle: ...
    async def drop_memory_snapshot(self, snapshot: Any) -> None: ...
