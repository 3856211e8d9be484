"""The interface between the apiserver and an edge (one per node).

The apiserver only parses HTTP into typed calls on :class:`EdgeAPI`; it never
touches runtimes, mounts or the registry. Embedded mode gives it the in-process
:class:`~dsec.edge.agent.EdgeAgent`; cluster mode gives it a remote transport
(a Ray actor handle wrapper) implementing the same protocol.

Every method is keyed by ``owner`` (the API key id that created the sandbox):
a sandbox of another owner is reported as ``SandboxNotFound``, never leaked.
All errors raised are :mod:`dsec.errors` classes.

Trajectory log: every state-changing call (exec, file writes, uploads, mkdir, rename,
remove, snapshot) takes an :class:`~dsec.contract.verbs.Envelope`, ``env``, holding ``seq``
(the per-sandbox sequence number the client assigns: 1, 2, 3...) and/or ``idem_key``. A repeat of a recorded ``seq`` with the same request returns the
recorded result without running anything; a different request under a used ``seq`` raises
``SequenceConflict``; a ``seq`` that skips ahead waits briefly for the missing ones (requests
of one client may arrive out of order) and then raises ``SequenceGap``. Calls without either
are logged under the next number.

Paused sandboxes: any call that needs the sandbox running resumes it transparently.

Optional abilities, each a protocol of its own (an edge has them or not; the apiserver checks
with ``isinstance`` and answers ``unsupported`` / ``capability_not_supported`` otherwise):
:class:`ImageBuilds`, :class:`ImagePublisher`, :class:`InteractiveExec`,
:class:`DisplayEdge`, :class:`MetricsEdge`, :class:`SandboxMigration`,
:class:`MemoryMigration`, :class:`PortForwarding`, :class:`FileXattrs`,
:class:`DirectoryWatch`, :class:`CodeRuns`, :class:`SandboxAudits` and
:class:`NodeReports`. Every verb is declared here once; :func:`edge_verbs`,
:data:`SANDBOX_VERBS` and :data:`STREAM_VERBS` derive from these classes what a remote edge
(a cluster node) may be asked, which calls route by sandbox id and which answer with a
stream. The verbs that take one request model and answer one model also have a row in
:data:`VERBS` (:mod:`dsec.contract.verbs`), which their HTTP route, cluster forwarder and SDK
call are generated from.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel

from dsec.builds.records import BuildList, BuildRecord
from dsec.contract.streams import (
    DirectoryWatcher,
    FileEvent,
    FileEventKind,
    InteractiveProcess,
    OutputChunk,
    PortStream,
    PtySize,
    StreamName,
)
from dsec.contract.verbs import NO_ENVELOPE, REPLAYED_HEADER, Envelope, Verb, VerbTable
from dsec.display import (
    Button,
    Click,
    DisplayState,
    Drag,
    Key,
    Launch,
    Move,
    Open,
    Scroll,
    Type,
    WindowInfo,
)
from dsec.errors import DsecError
from dsec.models import (
    NODE_QUERY,
    AuditEntry,
    AuditReport,
    BatchCreateRequest,
    BatchCreateResult,
    BuildImageRequest,
    BuildRef,
    CapabilityList,
    CodeRunRequest,
    CodeRunResult,
    CreateSandboxRequest,
    DeleteImageRequest,
    DisplayActRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    FileList,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImageList,
    ImageRef,
    JobActionRequest,
    JobActionResult,
    JobAudit,
    JobRef,
    KeyQuota,
    KeyScope,
    KeyUsage,
    LayerInfo,
    LayerList,
    ListFilesRequest,
    ListSandboxesRequest,
    LogLine,
    MigrateRequest,
    MigrateResult,
    NetworkPolicyRequest,
    NetworkStats,
    NodeInfo,
    NodeQuery,
    PauseRequest,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
    RemoveFileRequest,
    RenameRequest,
    RunCodeRequest,
    RunCodeResponse,
    SandboxExecRequest,
    SandboxInfo,
    SandboxList,
    SandboxMetrics,
    SandboxPathRequest,
    SandboxRef,
    SandboxSnapshotRequest,
    SandboxUptime,
    ScreenRequest,
    SetTTLRequest,
    ShareImageRequest,
)

if TYPE_CHECKING:
    from dsec.builds.wire import BuildRequest
    from dsec.display import Screen

__all__ = [
    "SANDBOX_VERBS",
    "STREAM_VERBS",
    "VERBS",
    "CodeRuns",
    "DirectoryWatch",
    "DirectoryWatcher",
    "DisplayEdge",
    "EdgeAPI",
    "FileEvent",
    "FileEventKind",
    "FileXattrs",
    "ImageBuilds",
    "ImagePublisher",
    "InteractiveExec",
    "InteractiveProcess",
    "KeyAccounting",
    "KeyQuotas",
    "MemoryMigration",
    "MetricsEdge",
    "NodeReports",
    "NodeUsage",
    "OutputChunk",
    "PortForwarding",
    "PortStream",
    "PortTicket",
    "PtySize",
    "QuotaSlot",
    "SandboxAudits",
    "SandboxMigration",
    "StreamName",
    "edge_verbs",
]


@runtime_checkable
class EdgeAPI(Protocol):
    # --- sandboxes -------------------------------------------------------
    async def create_sandbox(
        self, req: CreateSandboxRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> SandboxInfo:
        """Make a sandbox. ``env.idem_key``: at most one per key and owner; a repeat answers
        the sandbox the first made (or waits for it), a key reused for another request is
        ``SequenceConflict`` (``dsec.edge.createkeys``)."""
        ...

    async def abandon_sandbox(
        self, sandbox_id: str, owner: str, env: Envelope = NO_ENVELOPE
    ) -> None:
        """The client of a creation left before its answer: kill the sandbox, unless a
        retry under its idempotency key (``env.idem_key``) took it."""
        ...

    async def create_sandboxes(self, req: BatchCreateRequest, owner: str) -> BatchCreateResult:
        """``req.n`` sandboxes like ``req.sandbox``; per-sandbox results (partial success is
        reported, unless ``req.all_or_nothing``)."""
        ...

    async def get_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo: ...
    async def list_sandboxes(self, req: ListSandboxesRequest, owner: str) -> SandboxList: ...
    async def kill_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo:
        """Kill the sandbox (idempotent: a stopped one answers as it is)."""
        ...

    async def sandbox_uptime(self, req: SandboxRef, owner: str) -> SandboxUptime:
        """How long the sandbox has lived and been idle (read without resuming it or
        counting as activity)."""
        ...

    async def set_ttl(self, req: SetTTLRequest, owner: str) -> SandboxInfo: ...

    # --- exec ------------------------------------------------------------
    async def exec(
        self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> ExecResult:
        """Run ``req``'s command in its sandbox and wait for it (``ExecResult.replayed``: a
        repeat answered from the trajectory log, nothing ran)."""
        ...

    def exec_stream(
        self, req: SandboxExecRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> AsyncIterator[ExecEvent]:
        """:meth:`exec` with its output as it comes: ``stdout``/``stderr`` events, then one
        ``exit`` (or ``error``) event."""
        ...

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
        env: Envelope = NO_ENVELOPE,
    ) -> FileInfo: ...
    async def list_files(self, req: ListFilesRequest, owner: str) -> FileList: ...
    async def stat_file(self, req: SandboxPathRequest, owner: str) -> FileInfo: ...
    async def remove_file(
        self, req: RemoveFileRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> None: ...
    async def make_dir(
        self, req: SandboxPathRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> FileInfo: ...
    async def rename_file(
        self, req: RenameRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> FileInfo: ...
    async def upload_tar(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        *,
        env: Envelope = NO_ENVELOPE,
    ) -> int: ...
    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes: ...

    # --- RL lifecycle: pause, snapshots, fork, jobs, trajectory ------------
    async def pause_sandbox(self, req: PauseRequest, owner: str) -> SandboxInfo:
        """Pause with ``req.mode``: ``auto``/``freeze`` the tier's pause, ``suspend`` memory
        to a file, ``filesystem`` keep only the files (the sandbox resumes as a fresh boot);
        a mode the sandbox's tier lacks is ``CapabilityNotSupported``."""
        ...

    async def resume_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo: ...
    async def snapshot_sandbox(
        self, req: SandboxSnapshotRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> LayerInfo: ...
    async def fork_sandbox(self, req: ForkRequest, owner: str) -> ForkResult: ...
    async def migrate_sandbox(self, req: MigrateRequest, owner: str) -> MigrateResult:
        """Move the sandbox to ``req.node`` (None: the placer chooses); a single-node edge
        raises ``CapabilityNotSupported``."""
        ...

    async def job_action(self, req: JobActionRequest, owner: str) -> JobActionResult: ...
    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        """The sandbox's trajectory log as JSONL text (a header line, then one entry per line)."""
        ...

    def sandbox_logs(
        self, sandbox_id: str, owner: str, *, follow: bool = False
    ) -> AsyncGenerator[LogLine, None]:
        """The output of the sandbox's image start command (empty without one); with
        ``follow``, new output until the command ends."""
        ...

    # --- network ----------------------------------------------------------
    async def update_network(self, req: NetworkPolicyRequest, owner: str) -> SandboxInfo:
        """Replace the sandbox's :class:`~dsec.network.NetworkPolicy` (``req.policy``)."""
        ...

    async def network_stats(self, req: SandboxRef, owner: str) -> NetworkStats:
        """The sandbox's network counters; only ``enabled=False`` set for a sandbox without
        a network."""
        ...

    # --- images and layers (owned: see dsec.layers.store; SYSTEM_OWNER is the system's) --
    async def list_images(self, req: KeyScope, owner: str) -> ImageList:
        """``owner``'s images and the system's (built-ins not built yet with their status)."""
        ...

    async def get_image(self, req: ImageRef, owner: str) -> ImageInfo: ...
    async def delete_image(self, req: DeleteImageRequest, owner: str) -> None: ...
    async def share_image(self, req: ShareImageRequest, owner: str) -> ImageInfo:
        """Let every key use ``owner``'s image as ``<owner>/<name>`` (``shared=False``: stop)."""
        ...

    async def list_layers(self, req: KeyScope, owner: str) -> LayerList:
        """The layers ``owner`` may name by digest."""
        ...

    async def pull_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """``req.ref`` pulled as ``owner``'s image (``req.lazy``: attached with its layers
        left remote, as :meth:`ImagePublisher.attach_image`; ``req.system`` is the caller's
        concern: the owner is then ``SYSTEM_OWNER``)."""
        ...

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        """``owner``'s image ``req.name`` from an uploaded build context (tar archive); never
        from a path on the server."""
        ...

    # --- node ------------------------------------------------------------
    async def node_info(self, req: NodeQuery = NODE_QUERY) -> NodeInfo: ...
    async def capabilities(self, req: NodeQuery = NODE_QUERY) -> CapabilityList: ...
    def metrics_text(self) -> bytes: ...
    async def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class ImageBuilds(Protocol):
    """Optional ability of an edge: image builds (``POST /v1/builds``; the engine is
    :mod:`dsec.builds`). The apiserver answers ``capability_not_supported`` without it."""

    def build(
        self, owner: str, req: BuildRequest, context: bytes = b""
    ) -> AsyncGenerator[Any, None]:
        """Build ``req`` as ``owner``'s image from ``context`` (a tar archive): refusals
        raise from the first ``__anext__``, then :data:`dsec.builds.wire.BuildEvent` s
        until ``done`` or ``error``."""
        ...

    async def list_builds(self, req: KeyScope, owner: str) -> BuildList:
        """``owner``'s build records, newest first (:mod:`dsec.builds.records`)."""
        ...

    async def get_build(self, req: BuildRef, owner: str) -> BuildRecord:
        """``owner``'s build ``req.build_id`` with its log; another owner's is ``NotFound``."""
        ...


@runtime_checkable
class ImagePublisher(Protocol):
    """Optional ability of an edge: images as dsec artifacts in an OCI registry
    (``dsec image push``: ``POST /v1/images/{name}/push``; ``dsec image pull --lazy``:
    ``POST /v1/images/pull`` with ``lazy``). The apiserver answers
    ``capability_not_supported`` for an edge without it."""

    async def push_image(self, req: PushImageRequest, owner: str) -> PushImageResult:
        """Push ``owner``'s image ``req.name`` to ``req.target``
        (``oci://HOST[:PORT]/REPO[:TAG]``)."""
        ...

    async def attach_image(self, req: PullImageRequest, owner: str) -> ImageInfo:
        """Register the pushed image ``req.ref`` as ``owner``'s; ``req.lazy``: its layers
        stay remote, read on demand. No route of its own: ``pull_image`` of a lazy request
        (``POST /v1/images/pull``) is this."""
        ...


@runtime_checkable
class InteractiveExec(Protocol):
    """Optional edge ability: start a process whose stdin stays open.

    ``req.timeout_s`` is the wall-clock limit after which the edge kills the
    process (``ExecResult.timed_out``); ``req.stdin``/``stdin_b64`` are ignored
    (use :meth:`InteractiveProcess.write_stdin`). When ``stdin`` is False the
    process gets an empty stdin (``/dev/null``). ``pty`` asks for a terminal of
    that size: stdout and stderr then arrive merged as ``pty`` chunks; a tier
    without a TTY raises ``CapabilityNotSupported``. Ownership is checked like
    every ``EdgeAPI`` call (another owner's sandbox: ``SandboxNotFound``).
    """

    async def start_process(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: PtySize | None = None,
    ) -> InteractiveProcess: ...


@runtime_checkable
class DisplayEdge(Protocol):
    """Optional edge ability: the screens of sandboxes (vocabulary and semantics:
    :mod:`dsec.display`). ``screen`` picks the desktop of a desktop image, the tier's own
    console, or (``auto``) the desktop if there is one, else the console. Each call checks
    that ``owner`` owns the sandbox (``SandboxNotFound`` otherwise) and resumes it if
    paused; a sandbox without the screen asked for raises ``CapabilityNotSupported`` naming
    its image and tier; a desktop whose X server does not answer raises
    ``DisplayNotRunning`` (``display_restart`` brings it back)."""

    async def display_screenshot(
        self, sandbox_id: str, owner: str, screen: Screen = "auto", pointer: bool = False
    ) -> bytes:
        """The screen as PNG bytes (``pointer``: the mouse pointer drawn, on a desktop)."""
        ...

    async def display_act(self, req: DisplayActRequest, owner: str) -> None:
        """One input action (move, click, drag, scroll, button, type, key, open, launch) on
        ``req.screen``; a point off the screen is ``InvalidRequest`` with
        ``width``/``height``."""
        ...

    async def display_state(self, req: ScreenRequest, owner: str) -> DisplayState:
        """The screen's size and the pointer's position."""
        ...

    async def display_windows(self, req: SandboxRef, owner: str) -> list[WindowInfo]:
        """The desktop's top-level windows (id, title, class, pid, geometry, focus)."""
        ...

    async def display_restart(self, req: SandboxRef, owner: str) -> DisplayState:
        """Kill what is left of the sandbox's desktop and run its image's start command
        again; returns the new desktop's state once it is ready (``StartFailed`` if it
        does not come up)."""
        ...


@runtime_checkable
class DirectoryWatch(Protocol):
    """Optional edge ability: watch a directory of a sandbox for changes, pushed by the
    kernel (inotify on the container tier) rather than found by listing it again and
    again. A tier that cannot raises ``CapabilityNotSupported`` (callers then poll). The
    watcher is a live object of the sandbox's node (not relayed by a cluster) and does not
    count as activity: it neither resumes a paused sandbox nor keeps one alive."""

    async def watch_directory(
        self, sandbox_id: str, owner: str, path: str, *, recursive: bool = False
    ) -> DirectoryWatcher:
        """Watch ``path`` (and everything below it when ``recursive``). Raises
        ``FileNotFound``, ``InvalidRequest`` (not a directory), ``QuotaExceeded`` (too many
        directories below it)."""
        ...


@runtime_checkable
class FileXattrs(Protocol):
    """Optional edge ability: user extended attributes of files in a sandbox (``user.*``
    xattrs; E2B keeps file metadata as ``user.e2b.<key>``). Names are full names
    (``user.e2b.author``), values text. A tier whose files cannot carry them raises
    ``CapabilityNotSupported``; ownership is checked as for every file call."""

    async def get_xattrs(
        self, sandbox_id: str, owner: str, paths: list[str], prefix: str = "user."
    ) -> list[dict[str, str]]:
        """For each of ``paths`` (at most 100 000), its attributes whose names start with
        ``prefix`` (which starts with ``user.``); ``{}`` for a missing path or a symlink."""
        ...

    async def set_xattrs(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        values: dict[str, str],
        *,
        clear_prefix: str | None = None,
        env: Envelope = NO_ENVELOPE,
    ) -> None:
        """Set ``values`` on the file or directory ``path``, after removing its attributes
        whose names start with ``clear_prefix`` (None: none removed). Names start with
        ``user.``; at most 64 of them, 255 bytes per name and 4 KiB per value."""
        ...


@runtime_checkable
class CodeRuns(Protocol):
    """Optional edge ability: ``run_code``, one program in a fresh ``fncall`` worker that
    is gone when the call returns (``POST /v1/run_code``; SandboxFusion's ``/run_code``).

    A call is admitted like a sandbox creation of ``owner``: it counts against the key's
    quota as one live sandbox for as long as it runs (the fncall worker's core and the
    call's memory limit, :func:`dsec.edge.quotas.code_run_size`) and spends one creation of
    its rate, and its worker is claimed under the node's creation gate
    (:mod:`dsec.edge.admission`). Refusals are raised, in both shapes: ``QuotaExceeded``,
    ``CreationRateExceeded`` (the key), ``NodeBusy`` (the node), ``TierUnavailable`` (no
    fncall tier). A cluster runs the call on a node that has the fncall tier. What the
    program did, and a request the worker cannot run, is the answer (SandboxFusion's shape:
    ``status: SandboxError`` with a message; dsec's: ``InvalidRequest`` and the like)."""

    async def run_code(self, req: CodeRunRequest, owner: str) -> CodeRunResult:
        """dsec's shape: ``req`` run as ``owner``'s; request and dsec errors are raised."""
        ...

    async def run_code_sandboxfusion(self, req: RunCodeRequest, owner: str) -> RunCodeResponse:
        """SandboxFusion's shape, answered as SandboxFusion does, run as ``owner``'s."""
        ...


@runtime_checkable
class MetricsEdge(Protocol):
    """Optional edge ability: a sandbox's resource usage (``GET /v1/sandboxes/{id}/metrics``,
    ``sb.metrics()``, E2B's ``get_metrics``). Checks that ``owner`` owns the sandbox
    (``SandboxNotFound`` otherwise); never resumes a paused sandbox nor extends its TTL;
    ``SandboxStopped`` for a stopped one, ``CapabilityNotSupported`` for a tier that cannot
    measure (``Capabilities.metrics``)."""

    async def sandbox_metrics(self, req: SandboxRef, owner: str) -> SandboxMetrics:
        """One sample: CPU (cumulative seconds and the rate since the previous sample),
        memory, disk, network and process counts."""
        ...


@runtime_checkable
class SandboxAudits(Protocol):
    """Optional edge ability: the refusals made on a sandbox's behalf, its evidence of
    cheating (:mod:`dsec.edge.audit`; ``GET /v1/sandboxes/{id}/audit``, ``sb.audit()``,
    ``GET /v1/jobs/{job}/audit``). Checks that ``owner`` owns the sandbox
    (``SandboxNotFound`` otherwise); answers for a stopped sandbox while the node remembers
    it; never resumes a paused sandbox nor extends its TTL."""

    async def sandbox_audit(self, sandbox_id: str, owner: str, after: int = 0) -> AuditReport:
        """Exact counts and the kept entries numbered above ``after``."""
        ...

    def follow_audit(
        self, sandbox_id: str, owner: str, after: int = 0
    ) -> AsyncGenerator[AuditEntry, None]:
        """Entries numbered above ``after`` as they are recorded, until the sandbox stops."""
        ...

    async def job_audit(self, req: JobRef, owner: str) -> JobAudit:
        """The audit summary of every sandbox of ``owner``'s ``job``."""
        ...


@runtime_checkable
class SandboxMigration(Protocol):
    """Optional edge ability: move a sandbox's files to another node (``pack_diff``). Its
    processes are not kept; see :class:`MemoryMigration` for VM tiers."""

    async def export_sandbox(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """The create request, image layers and a ``pack_diff`` layer of the sandbox (which
        keeps running): ``{"request", "image_layers", "diff_layer", "method"}``."""
        ...

    async def import_sandbox(
        self, request: dict[str, Any], owner: str, image_layers: list[str], diff_layer: str
    ) -> SandboxInfo:
        """A new sandbox from another node's export (its layers already in this node's store)."""
        ...


@runtime_checkable
class MemoryMigration(Protocol):
    """Optional edge ability of VM tiers: move a sandbox with its processes (a portable
    memory snapshot written here, staged there, resumed there)."""

    async def export_memory(self, sandbox_id: str, owner: str) -> dict[str, Any]: ...
    async def drop_memory_export(self, tier: str, snapshot: Any) -> None: ...
    async def check_memory_import(self, export: dict[str, Any]) -> None: ...
    async def import_memory(
        self, export: dict[str, Any], owner: str, staged: str
    ) -> SandboxInfo: ...


@dataclass(frozen=True)
class PortTicket:
    """A connection opened on a node and waiting to be picked up over the node network
    (cluster mode; see :mod:`dsec.edge.ports`): connect to ``host:port``, send
    ``DSEC-PORT1 <ticket>\\n``, read one line (``OK`` or a JSON error), then the bytes of
    the sandbox connection follow. A ticket is good for one pick-up within
    ``expires_in_s`` seconds."""

    host: str
    port: int
    ticket: str
    expires_in_s: float


@runtime_checkable
class PortForwarding(Protocol):
    """Optional edge ability: TCP connections to ports inside sandboxes (what the
    apiserver's port proxy, :mod:`dsec.apiserver.ports`, relays HTTP, WebSocket and raw TCP
    over). The connection is made from inside the sandbox (its network namespace, or the
    guest agent of a VM), to ``127.0.0.1:<port>`` there, so it works for a sandbox without
    any network policy and needs no address reachable from the node.

    Both calls check ``owner`` (another owner's sandbox: ``SandboxNotFound``), resume a
    paused sandbox, count as activity for its TTL and raise: ``InvalidRequest`` for a port
    outside 1..65535, ``CapabilityNotSupported`` for a tier without ports (``fncall``),
    ``PortNotListening`` (502) when nothing accepts on the port, ``TooManyConnections``
    (429) past the node's per-sandbox bound (``DSEC_MAX_PORT_CONNECTIONS``)."""

    async def open_port(self, sandbox_id: str, owner: str, port: int) -> PortStream:
        """A new connection to ``port`` in the sandbox (a live object of this process)."""
        ...

    async def port_ticket(self, sandbox_id: str, owner: str, port: int) -> PortTicket:
        """The same connection, opened here and handed over through this node's port
        gateway (:class:`dsec.edge.ports.PortGateway`): what a cluster's apiserver asks
        for, since a live connection cannot cross Ray. ``CapabilityNotSupported`` on an
        edge without a gateway (embedded mode, where :meth:`open_port` is used)."""
        ...

    async def public_port_owner(self, sandbox_id: str) -> str:
        """The owner of ``sandbox_id`` when it was created with ``public_ports=True`` (its
        ports need no credential); ``SandboxNotFound`` otherwise, exactly as for a sandbox
        that does not exist."""
        ...


@dataclass(frozen=True)
class NodeUsage:
    """What a node's edge admits against and holds, for a placer (``dsec.placement``).
    Sizes in MiB, cores as floats."""

    node: str
    cpus: int
    memory_mb: int
    sandboxes: int
    requested_cpu: float
    requested_memory_mb: int
    max_sandboxes: int
    cpu_overcommit: float
    memory_overcommit: float


@runtime_checkable
class KeyQuotas(Protocol):
    """Optional ability of a key store: each owner's quota (``KeyQuota()``, unlimited, for an
    owner it does not know or that has none). Called on every creation: answer from memory."""

    def quota_of(self, owner: str) -> KeyQuota: ...


class QuotaSlot(Protocol):
    """Where an edge's quota check reads quotas from: the server sets ``source`` to its key
    store (:class:`dsec.edge.quotas.QuotaGuard` is the edge's)."""

    source: KeyQuotas | None


@runtime_checkable
class KeyAccounting(Protocol):
    """Optional edge ability: per-key quotas checked on every creation
    (:mod:`dsec.edge.quotas`: the server sets ``key_quotas.source`` to its key store), and
    what a key holds (``GET /v1/key``)."""

    key_quotas: QuotaSlot

    async def key_usage(self, owner: str) -> KeyUsage:
        """``owner``'s live sandboxes and what they requested."""
        ...


@runtime_checkable
class NodeReports(Protocol):
    """Optional edge ability: reports for the cluster's control plane."""

    def usage(self) -> NodeUsage:
        """Totals of the sandboxes this edge holds now (running totals: O(1))."""
        ...

    def owned_sandboxes(self) -> list[tuple[str, SandboxInfo]]:
        """``(owner, info)`` of every live sandbox (for the cluster registry)."""
        ...


_ABILITIES: tuple[type, ...] = (
    EdgeAPI,
    ImageBuilds,
    ImagePublisher,
    InteractiveExec,
    DisplayEdge,
    MetricsEdge,
    SandboxMigration,
    MemoryMigration,
    PortForwarding,
    FileXattrs,
    DirectoryWatch,
    CodeRuns,
    SandboxAudits,
)


def _methods(proto: type) -> dict[str, Any]:
    return {
        name: fn for name, fn in vars(proto).items() if not name.startswith("_") and callable(fn)
    }


def edge_verbs() -> frozenset[str]:
    """Every method of :class:`EdgeAPI` and its optional abilities: what a remote edge may be
    asked to run (the cluster's edge actors accept exactly these)."""
    return frozenset(name for proto in _ABILITIES for name in _methods(proto))


def _routes_by_sandbox(fn: Any) -> bool:
    """Whether ``fn`` is about one sandbox: its first argument is the sandbox id, or a
    request that holds it (a :class:`SandboxRef`)."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        return False
    first = params[1]
    request = globals().get(first.annotation) if isinstance(first.annotation, str) else None
    return first.name == "sandbox_id" or (
        isinstance(request, type) and issubclass(request, SandboxRef)
    )


def _streams(fn: Any) -> bool:
    return str(inspect.signature(fn).return_annotation).startswith(
        ("AsyncIterator", "AsyncGenerator")
    )


STREAM_VERBS: frozenset[str] = frozenset(
    name for proto in _ABILITIES for name, fn in _methods(proto).items() if _streams(fn)
)
"""The verbs that return an async iterator (a stream of events or lines): a cluster relays
them as streams (refusals raise from the first item)."""


def _replayed_header(result: ExecResult) -> dict[str, str]:
    return {REPLAYED_HEADER: "1"} if result.replayed else {}


def _command_timeout(req: ExecRequest) -> float:
    return req.timeout_s


async def _abandon_created(edge: EdgeAPI, info: SandboxInfo, owner: str, env: Envelope) -> None:
    """Take back a creation nobody will read: its sandbox is killed, unless a retry under
    its idempotency key took it (``EdgeAPI.abandon_sandbox``)."""
    await edge.abandon_sandbox(info.id, owner, env)


async def _kill_batch(
    edge: EdgeAPI, result: BatchCreateResult, owner: str, env: Envelope = NO_ENVELOPE
) -> None:
    """Take back a batch nobody will read: each of its sandboxes is killed (one that
    fails does not keep the others)."""
    for info in result.sandboxes:
        with contextlib.suppress(DsecError):
            await edge.kill_sandbox(SandboxRef(sandbox_id=info.id), owner)


_DISPLAY_ACTIONS: tuple[tuple[type[BaseModel], str], ...] = (
    (Move, "Move the pointer"),
    (Click, "Click (at a pixel, or where the pointer is)"),
    (Drag, "Drag with a button held"),
    (Scroll, "Turn the mouse wheel"),
    (Button, "Press or release a mouse button"),
    (Type, "Type text on the keyboard"),
    (Key, "Press a key or a chord (ctrl+c)"),
    (Open, "Open a URL or a file with its application"),
    (Launch, "Start an application"),
)
"""The display actions (:mod:`dsec.display`), each a route of ``display_act``: ``POST
.../display/<kind>`` with the action as its body."""


def _display_act(action: type[BaseModel], summary: str) -> Verb:
    """The row of one kind of display action: ``display_<kind>``, calling ``display_act``."""
    kind = action.model_fields["action"].default
    return Verb(
        f"display_{kind}",
        DisplayActRequest,
        None,
        "POST",
        f"/sandboxes/{{sandbox_id}}/display/{kind}",
        DisplayEdge,
        summary,
        status=204,
        tag="display",
        call="display_act",
        body="action",
        body_type=action,
        query=("screen",),
    )


VERBS = VerbTable(
    Verb(
        "list_files",
        ListFilesRequest,
        FileList,
        "GET",
        "/sandboxes/{sandbox_id}/files/list",
        EdgeAPI,
        "List a directory",
    ),
    Verb(
        "stat_file",
        SandboxPathRequest,
        FileInfo,
        "GET",
        "/sandboxes/{sandbox_id}/files/stat",
        EdgeAPI,
        "Stat a path",
    ),
    Verb(
        "remove_file",
        RemoveFileRequest,
        None,
        "DELETE",
        "/sandboxes/{sandbox_id}/files",
        EdgeAPI,
        "Remove a path",
        status=204,
        sequenced=True,
    ),
    Verb(
        "make_dir",
        SandboxPathRequest,
        FileInfo,
        "POST",
        "/sandboxes/{sandbox_id}/files/mkdir",
        EdgeAPI,
        "Make a directory",
        sequenced=True,
    ),
    Verb(
        "rename_file",
        RenameRequest,
        FileInfo,
        "POST",
        "/sandboxes/{sandbox_id}/files/rename",
        EdgeAPI,
        "Rename a path",
        sequenced=True,
    ),
    Verb(
        "set_ttl",
        SetTTLRequest,
        SandboxInfo,
        "POST",
        "/sandboxes/{sandbox_id}/ttl",
        EdgeAPI,
        "Set the idle TTL",
    ),
    Verb(
        "exec",
        SandboxExecRequest,
        ExecResult,
        "POST",
        "/sandboxes/{sandbox_id}/exec",
        EdgeAPI,
        "Run a command",
        sequenced=True,
        body_model=ExecRequest,
        route_name="exec_command",
        headers=_replayed_header,
        timeout=_command_timeout,
    ),
    Verb(
        "pause_sandbox",
        PauseRequest,
        SandboxInfo,
        "POST",
        "/sandboxes/{sandbox_id}/pause",
        EdgeAPI,
        "Pause: freeze the sandbox and reclaim its memory",
        "Idempotent. ``last_pause`` in the answer reports memory before and after. Any later "
        'request to the sandbox resumes it transparently. Optional body ``{"mode": '
        '"auto"|"freeze"|"suspend"|"filesystem"}``: ``suspend`` (tiers whose capabilities '
        "say ``suspend``) writes memory and device state to a file and frees the host "
        "memory; ``filesystem`` (capability ``pause_filesystem``) drops every process and "
        "keeps the files: the sandbox resumes as a fresh boot. Elsewhere they are a 422 "
        "``capability_not_supported``.",
    ),
    Verb(
        "resume_sandbox",
        SandboxRef,
        SandboxInfo,
        "POST",
        "/sandboxes/{sandbox_id}/resume",
        EdgeAPI,
        "Resume a paused sandbox (idempotent)",
    ),
    Verb(
        "snapshot_sandbox",
        SandboxSnapshotRequest,
        LayerInfo,
        "POST",
        "/sandboxes/{sandbox_id}/snapshot",
        EdgeAPI,
        "Snapshot the writable layer as a new workspace layer (pack_diff)",
        "Restore it with ``layers=[digest]`` at creation. Scrubbed paths and the default "
        "scrub list never enter the layer; a file holding one of ``secret_values`` refuses "
        "the snapshot (400 ``secret_in_snapshot``, nothing stored).",
        status=201,
        sequenced=True,
    ),
    Verb(
        "fork_sandbox",
        ForkRequest,
        ForkResult,
        "POST",
        "/sandboxes/{sandbox_id}/fork",
        EdgeAPI,
        "Make n new sandboxes from this one",
        "``method``: ``shared`` (the children stack on this sandbox's frozen writable layer: "
        "nothing copied), ``pack`` (a snapshot layer first) or ``auto``. Admission covers "
        "all n first (429 ``quota_exceeded``, nothing created); if any child fails, none is "
        "left.",
        status=201,
    ),
    Verb(
        "job_audit",
        JobRef,
        JobAudit,
        "GET",
        "/jobs/{job}/audit",
        SandboxAudits,
        "The audit summary of every sandbox of a job",
        "Each sandbox of the job (live, and stopped ones the nodes remember) with its exact "
        "counts and ``evidence``; ``flagged`` in the SDK lists those with evidence.",
        tag="audit",
    ),
    Verb(
        "display_state",
        ScreenRequest,
        DisplayState,
        "GET",
        "/sandboxes/{sandbox_id}/display",
        DisplayEdge,
        "The screen's size and the pointer",
        tag="display",
    ),
    Verb(
        "display_windows",
        SandboxRef,
        list[WindowInfo],
        "GET",
        "/sandboxes/{sandbox_id}/display/windows",
        DisplayEdge,
        "The desktop's windows",
        tag="display",
    ),
    Verb(
        "display_restart",
        SandboxRef,
        DisplayState,
        "POST",
        "/sandboxes/{sandbox_id}/display/restart",
        DisplayEdge,
        "Start the desktop again",
        tag="display",
    ),
    *(_display_act(action, summary) for action, summary in _DISPLAY_ACTIONS),
    Verb(
        "job_action",
        JobActionRequest,
        JobActionResult,
        "POST",
        "/jobs/{job}/{action}",
        EdgeAPI,
        "Pause, resume or kill every sandbox of a job",
        "Runs in parallel on the edge. The answer maps each sandbox id to its outcome "
        "(``ok``, ``state``, wire ``error``); it is 200 even when some failed. A job without "
        "sandboxes answers with empty ``outcomes``.",
        tag="jobs",
    ),
    Verb(
        "migrate_sandbox",
        MigrateRequest,
        MigrateResult,
        "POST",
        "/sandboxes/{sandbox_id}/migrate",
        EdgeAPI,
        "Move a sandbox to another node of the cluster",
        "Cluster mode only (422 ``capability_not_supported`` on a single-node server). VM "
        "tiers (microvm, vm) move their RAM and device state (``method: memory_snapshot``, "
        "``processes_carried: true``); other tiers move their writable layer as a "
        "``pack_diff`` layer and the same spec is recreated (``processes_carried: false``). "
        "The new sandbox has a new id on the target; the source is killed only once the "
        "target runs. Unknown or lost target: 404 ``not_found``; full target: 429 "
        "``quota_exceeded``; nothing half-created.",
    ),
    Verb(
        "sandbox_uptime",
        SandboxRef,
        SandboxUptime,
        "GET",
        "/sandboxes/{sandbox_id}/uptime",
        EdgeAPI,
        "How long the sandbox has lived and been idle",
        "Read without resuming a paused sandbox or extending its TTL; answers for a stopped "
        "sandbox while the node remembers it.",
    ),
    Verb(
        "sandbox_metrics",
        SandboxRef,
        SandboxMetrics,
        "GET",
        "/sandboxes/{sandbox_id}/metrics",
        MetricsEdge,
        "Resource usage: CPU, memory, disk, network, processes",
        "One sample, read without resuming a paused sandbox or extending its TTL. "
        "``cpu.used_cores`` averages over ``interval_s`` (since the previous sample of this "
        "sandbox, or since its creation). A stopped sandbox is a 409 ``sandbox_stopped``; a "
        "tier whose capabilities lack ``metrics`` a 422 ``capability_not_supported``.",
    ),
    # --- sandbox lifecycle and node queries (issue 33, h45) ---------------------------
    Verb(
        "get_sandbox",
        SandboxRef,
        SandboxInfo,
        "GET",
        "/sandboxes/{sandbox_id}",
        EdgeAPI,
        "Describe a sandbox",
    ),
    Verb(
        "kill_sandbox",
        SandboxRef,
        SandboxInfo,
        "DELETE",
        "/sandboxes/{sandbox_id}",
        EdgeAPI,
        "Kill a sandbox",
    ),
    Verb(
        "list_sandboxes",
        ListSandboxesRequest,
        SandboxList,
        "GET",
        "/sandboxes",
        EdgeAPI,
        "List this key's sandboxes",
    ),
    Verb(
        "create_sandbox",
        CreateSandboxRequest,
        SandboxInfo,
        "POST",
        "/sandboxes",
        EdgeAPI,
        "Create a sandbox",
        "A client that disconnects before the sandbox is ready leaves no sandbox behind. An "
        "image still being built (a built-in right after the node started) answers 503 "
        "``image_not_ready`` with ``Retry-After``: nothing was created, retry. A busy node lets "
        "a creation wait for one of its creation slots (first come first served within a key, "
        "keys in turn) and answers 503 ``node_busy`` with ``Retry-After`` only when its queue is "
        "full or the wait was too long: nothing was created, retry.\n\n"
        "With an ``Idempotency-Key`` header, repeating the request (after a broken connection "
        "or a time-out) makes no second sandbox: the repeat answers the sandbox the first made, "
        "or waits for it while it is being made; the same key with a different body is a 409 "
        "``sequence_conflict``. Keys are per API key and kept for a day.",
        status=201,
        undo=_abandon_created,
        keyed=True,
    ),
    Verb(
        "create_sandboxes",
        BatchCreateRequest,
        BatchCreateResult,
        "POST",
        "/sandboxes/batch",
        EdgeAPI,
        "Create n sandboxes in one call",
        "Answers 200 with one outcome per sandbox: ``sandboxes`` (created, in request order) "
        "and ``errors`` (index, code, message of each one that was not). With "
        "``all_or_nothing`` a failure kills what was made and answers that failure's error.",
        undo=_kill_batch,
    ),
    Verb(
        "node_info",
        NodeQuery,
        NodeInfo,
        "GET",
        "/node",
        EdgeAPI,
        "Describe this node",
        tag="node",
        owned=False,
    ),
    Verb(
        "capabilities",
        NodeQuery,
        CapabilityList,
        "GET",
        "/capabilities",
        EdgeAPI,
        "What each tier can do",
        tag="node",
        owned=False,
    ),
    # --- images, layers, builds and networks ---------------------------------
    Verb(
        "list_images",
        KeyScope,
        ImageList,
        "GET",
        "/images",
        EdgeAPI,
        "List images",
        "This key's images and the system's (built-in images not built yet show their build "
        "status); other keys' images are never listed.",
        tag="images",
    ),
    Verb(
        "get_image",
        ImageRef,
        ImageInfo,
        "GET",
        "/images/{name:path}",
        EdgeAPI,
        "Describe an image",
        tag="images",
    ),
    Verb(
        "delete_image",
        DeleteImageRequest,
        None,
        "DELETE",
        "/images/{name:path}",
        EdgeAPI,
        "Forget one of this key's images (its layers stay while sandboxes use them)",
        status=204,
        tag="images",
        operator_may="remove",
    ),
    Verb(
        "share_image",
        ShareImageRequest,
        ImageInfo,
        "PATCH",
        "/images/{name:path}",
        EdgeAPI,
        "Share one of this key's images with every key (as <owner>/<name>), or stop",
        tag="images",
    ),
    Verb(
        "pull_image",
        PullImageRequest,
        ImageInfo,
        "POST",
        "/images/pull",
        EdgeAPI,
        "Pull an image from an OCI / Docker v2 registry",
        status=201,
        tag="images",
        operator_may="publish",
    ),
    Verb(
        "push_image",
        PushImageRequest,
        PushImageResult,
        "POST",
        "/images/{name:path}/push",
        ImagePublisher,
        "Publish an image's EROFS layers to an OCI registry",
        tag="images",
    ),
    Verb(
        "list_layers",
        KeyScope,
        LayerList,
        "GET",
        "/layers",
        EdgeAPI,
        "List layers",
        "The layers this key may name by digest: those of its images, snapshots and builds, "
        "and the system's.",
        tag="images",
    ),
    Verb(
        "list_builds",
        KeyScope,
        BuildList,
        "GET",
        "/builds",
        ImageBuilds,
        "This key's image builds, newest first (running ones included)",
        "State, step, cache hits and the image made or the error, of this key's recent "
        "builds (``dsec.builds.records``: bounded per key, kept by the server process).",
        tag="images",
    ),
    Verb(
        "get_build",
        BuildRef,
        BuildRecord,
        "GET",
        "/builds/{build_id}",
        ImageBuilds,
        "One build of this key, with its log",
        tag="images",
    ),
    Verb(
        "update_network",
        NetworkPolicyRequest,
        SandboxInfo,
        "POST",
        "/sandboxes/{sandbox_id}/network",
        EdgeAPI,
        "Replace the network policy of a running sandbox",
        "The body is a NetworkPolicy. New connections see the new policy at once; "
        "established ones continue; DNS admissions it no longer allows are revoked. A bad "
        "policy or an unknown preset is a 400 ``invalid_request``; a sandbox created without "
        "a network is a 422 ``capability_not_supported``; a dead one is a 409 "
        "``sandbox_stopped``.",
        body="policy",
    ),
    Verb(
        "network_stats",
        SandboxRef,
        NetworkStats,
        "GET",
        "/sandboxes/{sandbox_id}/network",
        EdgeAPI,
        "Network counters: allowed and blocked attempts by destination",
        sparse=True,
    ),
)
"""The verbs that take one request model and answer one model (:mod:`dsec.contract.verbs`):
their routes, cluster forwarders and SDK transport calls are generated from these rows. A
row calls a method of its ability protocol above (``call``: its own name, unless several rows
share one method, as the display actions do), declared with ``(req, owner)``."""

SANDBOX_VERBS: frozenset[str] = frozenset(
    name for proto in _ABILITIES for name, fn in _methods(proto).items() if _routes_by_sandbox(fn)
) | frozenset(v.call for v in VERBS if v.sandbox_scoped)
"""The verbs about one sandbox: a cluster routes them to the node that the id names
(``sb-<node>-<random>``): the first argument of a verb outside the table, the request's
``sandbox_id`` of a table verb."""
