"""The interface between the apiserver and an edge (one per node).

The apiserver only parses HTTP into typed calls on :class:`EdgeAPI`; it never
touches runtimes, mounts or the registry. Embedded mode gives it the in-process
:class:`~dsec.edge.agent.EdgeAgent`; cluster mode gives it a remote transport
(a Ray actor handle wrapper) implementing the same protocol.

Every method is keyed by ``owner`` (the API key id that created the sandbox):
a sandbox of another owner is reported as ``SandboxNotFound``, never leaked.
All errors raised are :mod:`dsec.errors` classes.

Trajectory log: every state-changing call (exec, file writes, uploads, mkdir, rename,
remove, snapshot) takes ``seq`` (the per-sandbox sequence number the client assigns: 1, 2,
3...) and/or ``idem_key``. A repeat of a recorded ``seq`` with the same request returns the
recorded result without running anything; a different request under a used ``seq`` raises
``SequenceConflict``; a ``seq`` that skips ahead waits briefly for the missing ones (requests
of one client may arrive out of order) and then raises ``SequenceGap``. Calls without either
are logged under the next number.

Paused sandboxes: any call that needs the sandbox running resumes it transparently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from dsec.models import (
    BatchCreateResult,
    BuildImageRequest,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ForkRequest,
    ForkResult,
    ImageInfo,
    JobAction,
    JobActionResult,
    LayerInfo,
    MigrateResult,
    NodeInfo,
    PushImageResult,
    SandboxInfo,
    SnapshotRequest,
)


@runtime_checkable
class EdgeAPI(Protocol):
    # --- sandboxes -------------------------------------------------------
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo: ...
    async def create_sandboxes(
        self, req: CreateSandboxRequest, n: int, owner: str, *, all_or_nothing: bool = False
    ) -> BatchCreateResult:
        """``n`` sandboxes like ``req``; per-sandbox results (partial success is reported)."""
        ...

    async def get_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo: ...
    async def list_sandboxes(
        self,
        owner: str,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> list[SandboxInfo]: ...
    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo: ...
    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo: ...

    # --- exec ------------------------------------------------------------
    async def exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> ExecResult: ...
    def exec_stream(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> AsyncIterator[ExecEvent]: ...

    # --- files (paths are absolute paths inside the sandbox) --------------
    async def read_file(self, sandbox_id: str, owner: str, path: str) -> bytes: ...
    async def write_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo: ...
    async def list_files(
        self, sandbox_id: str, owner: str, path: str, depth: int = 1
    ) -> list[FileInfo]: ...
    async def stat_file(self, sandbox_id: str, owner: str, path: str) -> FileInfo: ...
    async def remove_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        recursive: bool = False,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> None: ...
    async def make_dir(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo: ...
    async def rename_file(
        self,
        sandbox_id: str,
        owner: str,
        src: str,
        dst: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo: ...
    async def upload_tar(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> int: ...
    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes: ...

    # --- RL lifecycle: pause, snapshots, fork, jobs, trajectory ------------
    async def pause_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo: ...
    async def resume_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo: ...
    async def snapshot_sandbox(
        self,
        sandbox_id: str,
        owner: str,
        req: SnapshotRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> LayerInfo: ...
    async def fork_sandbox(self, sandbox_id: str, owner: str, req: ForkRequest) -> ForkResult: ...
    async def migrate_sandbox(
        self, sandbox_id: str, owner: str, node: str | None = None
    ) -> MigrateResult:
        """Move the sandbox to ``node`` (None: the placer chooses); a single-node edge
        raises ``CapabilityNotSupported``."""
        ...

    async def job_action(self, owner: str, job: str, action: JobAction) -> JobActionResult: ...
    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        """The sandbox's trajectory log as JSONL text (a header line, then one entry per line)."""
        ...

    # --- network (policy is a dsec.network.NetworkPolicy) ---------------------
    async def update_network(self, sandbox_id: str, owner: str, policy: Any) -> SandboxInfo: ...
    async def network_stats(self, sandbox_id: str, owner: str) -> dict[str, Any]: ...

    # --- images and layers (owned: see dsec.layers.store; SYSTEM_OWNER is the system's) --
    async def list_images(self, owner: str) -> list[ImageInfo]:
        """``owner``'s images and the system's (built-ins not built yet with their status)."""
        ...

    async def get_image(self, name: str, owner: str) -> ImageInfo: ...
    async def delete_image(self, name: str, owner: str) -> None: ...
    async def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        """Let every key use ``owner``'s image as ``<owner>/<name>`` (``shared=False``: stop)."""
        ...

    async def list_layers(self, owner: str) -> list[LayerInfo]:
        """The layers ``owner`` may name by digest."""
        ...

    async def pull_image(self, ref: str, owner: str, name: str | None = None) -> ImageInfo: ...
    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """``owner``'s image ``req.name`` from an uploaded build context (tar archive); never
        from a path on the server."""
        ...

    # --- node ------------------------------------------------------------
    async def node_info(self) -> NodeInfo: ...
    async def capabilities(self) -> list[Capabilities]: ...
    def metrics_text(self) -> bytes: ...
    async def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class PauseModes(Protocol):
    """Optional ability of an edge: ``POST /v1/sandboxes/{id}/pause`` with a body
    ``{"mode": "freeze"|"suspend"}`` (``auto``, the default, is ``pause_sandbox``). The
    apiserver answers ``capability_not_supported`` for an edge without it."""

    async def pause_sandbox_mode(self, sandbox_id: str, owner: str, mode: str) -> SandboxInfo:
        """Pause with ``mode``: ``freeze`` the tier's pause, ``suspend`` memory to a file."""
        ...


@runtime_checkable
class ImagePublisher(Protocol):
    """Optional ability of an edge: images as dsec artifacts in an OCI registry
    (``dsec image push``: ``POST /v1/images/{name}/push``; ``dsec image pull --lazy``:
    ``POST /v1/images/pull`` with ``lazy``). The apiserver answers ``unsupported`` for an
    edge without it."""

    async def push_image(self, name: str, target: str, owner: str) -> PushImageResult:
        """Push ``owner``'s image ``name`` to ``target`` (``oci://HOST[:PORT]/REPO[:TAG]``)."""
        ...

    async def attach_image(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Register a pushed image as ``owner``'s; ``lazy``: its layers stay remote, read on
        demand."""
        ...
