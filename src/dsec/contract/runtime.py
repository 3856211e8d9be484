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

Optional abilities are separate protocols: ``Pausable`` (freeze and give memory back),
``FilesystemPause`` (a pause that keeps only the files), ``Networked`` (a policy that
changes while it runs), ``Snapshottable`` (``pack_diff`` of the
writable layer), ``UpperForkable`` (forks that share the frozen writable layer instead of
packing it), ``MemoryStateful`` (RAM and device state to a file: suspend, memory forks,
migration with processes), ``Interactive`` (processes whose stdin stays open, terminals),
``Display`` (screen, pointer, keyboard), ``PortConnectable`` (TCP connections to ports
inside the sandbox, for the port proxy), ``Measurable`` (resource usage counters),
``ExitReporting`` (sandboxes that can end by themselves, reported when they do) and
``Reconciling`` (node state to drop once the edge has matched its registry after a start). The
edge checks them with ``isinstance`` and raises
``CapabilityNotSupported`` for a tier without one; the capability table a node publishes is
derived from them by :func:`capabilities_of`, so it cannot disagree with what the code can
do. A runtime itself reports only what changes at run time (:class:`RuntimeFacts`: whether it
is available, why not, its limits, whether networking is up).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from dsec.models import Capabilities, ExecRequest, ExecResult, FileInfo, LayerInfo, SnapshotRequest

if TYPE_CHECKING:
    from dsec.contract.streams import DirectoryWatcher, InteractiveProcess, PortStream, PtySize
    from dsec.display import DisplayAction
    from dsec.privileged.seccomp_log import GuardLog
    from dsec.runtimes.usage import SandboxUsage

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
    # container tier: commands run without no_new_privs (setuid programs such as sudo work)
    allow_setuid: bool = False
    # the CPU share group (the owning key): a tier that can puts the group's sandboxes under
    # one cgroup of this relative weight (100 = a default cgroup's), so that a key's 500
    # busy sandboxes share what one key gets next to another key's busy ones
    cpu_group: str = ""
    cpu_group_weight: int = 100
    # the owning API key's owner id ("" for none: embedded and internal use): a tier that
    # can keeps what one key's sandboxes share (the container tier's layer mounts, and with
    # them their page cache) apart from other keys'
    owner: str = ""

    @classmethod
    def of_request(cls, req: BaseModel, **node: Any) -> SandboxSpec:
        """The spec of a create request: every field the spec shares with ``req`` (by
        name: tier, sizes, env, user, workdir, labels, network, ...) is the request's (its
        dicts and lists copied), and ``node`` gives what the node decides (``id``, layers,
        hostname, the CPU group, the owner)."""
        shared = _request_fields(type(req))
        taken = {name: copy.copy(getattr(req, name)) for name in shared if name not in node}
        return cls(**taken, **node)


@functools.cache
def _request_fields(request: type[BaseModel]) -> tuple[str, ...]:
    """The fields a :class:`SandboxSpec` takes from a request of this model."""
    return tuple(f.name for f in dataclasses.fields(SandboxSpec) if f.name in request.model_fields)


class TierState(BaseModel):
    """A tier's record of one sandbox, typed: the base of each tier's model of what its
    :class:`Handle` keeps (its fields have defaults, so a record an older dsec wrote, with
    fewer fields, still parses; a field this dsec does not know is kept as it is)."""

    model_config = ConfigDict(extra="allow")

    def dump(self) -> dict[str, Any]:
        """The JSON form (:attr:`Handle.state`): unset fields (None) are left out."""
        return self.model_dump(mode="json", exclude_none=True)


S = TypeVar("S", bound=TierState)


@dataclass
class Handle:
    """A runtime's record of one sandbox. ``state`` must be JSON-serialisable: the edge
    stores it in the registry and gives it back to ``recover()`` after a restart. A tier
    reads it as its own :class:`TierState` model (:meth:`typed`: parsed once per handle)
    and gives a changed or new one back with :meth:`keep` (or :meth:`of`)."""

    id: str
    state: dict[str, Any] = field(default_factory=dict)
    _typed: tuple[dict[str, Any], TierState] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, sandbox_id: str, state: TierState) -> Handle:
        """A handle of ``sandbox_id`` whose state is the tier's model ``state``."""
        handle = cls(sandbox_id)
        handle.keep(state)
        return handle

    def typed(self, model: type[S]) -> S:
        """:attr:`state` as the tier's model ``model``: parsed at the first call, the same
        object after that (until :attr:`state` is replaced). A change to the model is the
        edge's to store only once given back with :meth:`keep`; a change made to
        :attr:`state` in place is not seen by a model already parsed."""
        cached = self._typed
        if cached is not None and cached[0] is self.state and isinstance(cached[1], model):
            return cached[1]
        typed = model.model_validate(self.state)
        self._typed = (self.state, typed)
        return typed

    def keep(self, state: TierState) -> None:
        """Make the tier's model ``state`` (changed or new) this handle's: :attr:`state`
        becomes its JSON form, what the edge stores."""
        self.state = state.dump()
        self._typed = (self.state, state)


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
class WatchableFiles(Protocol):
    """Optional ability of a tier's :class:`SandboxFiles`: directory watches pushed by the
    kernel (see :class:`dsec.contract.edge.DirectoryWatch`)."""

    async def watch(self, path: str, recursive: bool) -> DirectoryWatcher: ...


@runtime_checkable
class XattrFiles(Protocol):
    """Optional ability of a tier's :class:`SandboxFiles`: ``user.*`` extended attributes
    (see :class:`dsec.contract.edge.FileXattrs` for the semantics)."""

    async def get_xattrs(self, paths: list[str], prefix: str) -> list[dict[str, str]]: ...
    async def set_xattrs(
        self, path: str, values: dict[str, str], clear_prefix: str | None
    ) -> None: ...


@dataclass(frozen=True)
class RuntimeFacts:
    """What a runtime knows about itself at run time (the abilities are its protocols).

    Attributes:
        available: it can create sandboxes now.
        reason: why not, or a note on how it runs (``QEMU q35, TCG (...)``).
        max_cpu: most cores one sandbox may ask for (None: no limit of its own).
        max_memory_mb: most memory one sandbox may ask for, MiB.
        persistent: a sandbox outlives one call (``fncall``: no, each call is a new worker).
        network_ready: for a ``Networked`` runtime, its node's networking is up.
        sink_sees_all_output: an exec's ``sink`` gets all of its output, whatever its
            ``max_output_bytes`` (which then bounds only the result); else the cap bounds
            both (the VM tiers' guest agents cap in the guest).
        teardown_in_background: the edge may answer a kill before :meth:`Runtime.destroy`
            has finished: the teardown ends the sandbox's processes first thing, and what
            follows (reaping, cgroups, unmounts, layer references) owns no state another
            sandbox could see.
    """

    available: bool
    reason: str | None = None
    max_cpu: float | None = None
    max_memory_mb: int | None = None
    persistent: bool = True
    network_ready: bool = False
    sink_sees_all_output: bool = False
    teardown_in_background: bool = False


@runtime_checkable
class Runtime(Protocol):
    """One tier's backend on one node."""

    tier: str

    def facts(self) -> RuntimeFacts: ...
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
class FilesystemPause(Protocol):
    """Optional ability of a ``Pausable`` tier: a filesystem-only pause (E2B's
    ``keep_memory=False``): every process is dropped and the sandbox gets a new boot id;
    only its files are kept, and the next request finds a freshly booted sandbox."""

    async def pause_filesystem(self, handle: Handle) -> dict[str, Any]: ...


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
class UpperForkable(Protocol):
    """Forks in O(1) of the size of the change: the parent's writable layer is *frozen*
    (its processes stopped, the layer never written again) and shared read-only, as a lower
    layer, by every child; nothing is copied or packed.

    Vocabulary: a **frozen layer** is a former writable layer of a sandbox on this node,
    kept (refcounted) while a sandbox stacks on it or still has it as its writable layer;
    its id names it in the runtime's state only (it is not a content-addressed layer).

    States of the parent: ``freeze_upper`` leaves it paused with its writable layer frozen
    (:meth:`upper_frozen` is True). From there it must never resume in place (its writes
    would show in the children): :meth:`restart_on_frozen` gives it a fresh writable layer
    over the frozen one and starts it again (same id, hostname and network policy; its
    processes are gone). ``create_forked(parent, spec)`` makes a child over the parent's
    frozen layer (legal while the parent's layer is frozen). ``snapshot`` of a sandbox that
    stacks on frozen layers packs them with its own writable layer into one layer, so a
    snapshot stays a single portable layer on top of the image's."""

    def upper_frozen(self, handle: Handle) -> bool: ...
    async def freeze_upper(self, handle: Handle) -> None: ...
    async def create_forked(self, parent: Handle, spec: SandboxSpec) -> Handle: ...
    async def restart_on_frozen(self, handle: Handle, spec: SandboxSpec) -> Handle: ...


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

    accel: str
    """The accelerator the guests run under (``kvm``, ``tcg``): a memory state loads only
    under the one it was made with."""

    def guest_ram_mb(self, memory_mb: int) -> int:
        """The RAM a guest of a sandbox asking for ``memory_mb`` MiB gets, MiB."""
        ...

    def is_suspended(self, handle: Handle) -> bool: ...
    async def suspend(self, handle: Handle) -> dict[str, Any]: ...
    async def memory_snapshot(self, handle: Handle, *, portable: bool = False) -> Any: ...
    async def create_from_memory(self, snapshot: Any, spec: SandboxSpec) -> Handle: ...
    async def drop_memory_snapshot(self, snapshot: Any) -> None: ...


@runtime_checkable
class Interactive(Protocol):
    """Processes that keep running after the call that started them: stdin open for writes,
    signals, an optional terminal (``pty``). What E2B's process API needs; see
    :class:`dsec.contract.edge.InteractiveExec` for the semantics."""

    async def start_process(
        self,
        handle: Handle,
        req: ExecRequest,
        *,
        stdin: bool = False,
        pty: PtySize | None = None,
    ) -> InteractiveProcess: ...


@runtime_checkable
class Display(Protocol):
    """The tier's own screen and input devices (the vm tier's VGA console), for the
    ``console`` screen of :mod:`dsec.display`: a PNG screenshot, input actions
    (:data:`dsec.display.DisplayAction`; pixel coordinates of the screenshot, text on a US
    layout, keys and chords), the screen's size and the last pointer position it was sent
    to. A desktop *image* is driven through ``exec`` instead (:mod:`dsec.edge.desktop`)."""

    async def screenshot(self, handle: Handle) -> bytes: ...
    async def screen_act(self, handle: Handle, action: DisplayAction) -> None:
        """Carry out ``action``; ``InvalidRequest`` for a point off the screen or a key or
        character the console cannot send; ``CapabilityNotSupported`` for what a console
        has no notion of (applications)."""
        ...

    async def screen_size(self, handle: Handle) -> tuple[int, int]:
        """(width, height) of the screen, pixels."""
        ...

    def pointer(self, handle: Handle) -> tuple[int, int] | None:
        """Where the last pointer action left the pointer (None: none was sent yet)."""
        ...


@runtime_checkable
class PortConnectable(Protocol):
    """TCP connections to ``127.0.0.1:<port>`` inside a sandbox, made from inside it (the
    container's network namespace, a VM's guest agent), so they need neither a network
    policy nor an address the node can reach. Raises ``PortNotListening`` when the
    connection is refused."""

    async def connect_port(self, handle: Handle, port: int) -> PortStream: ...


@runtime_checkable
class Measurable(Protocol):
    """Resource usage of a sandbox (:class:`dsec.runtimes.usage.SandboxUsage`: cumulative CPU
    time, memory, disk, network, processes), read from the kernel or the guest. Reading it
    must not resume a paused sandbox nor count as activity: a dashboard that polls every
    second would otherwise keep every sandbox awake. A paused or suspended sandbox reports
    what can be read without running it."""

    async def usage(self, handle: Handle) -> SandboxUsage: ...


@runtime_checkable
class Audited(Protocol):
    """What a tier can tell the edge's audit of refusals (:mod:`dsec.edge.audit`) beyond what
    the edge sees itself: the audit id its sandbox's processes carry in the kernel's seccomp
    records, and the cumulative counters of limits its sandbox hit. Cheap reads; a sandbox
    that is gone reports zeros."""

    log_denials: bool
    """Its sandboxes' refused system calls reach the kernel's audit stream
    (``SECCOMP_FILTER_FLAG_LOG``; ``DSEC_AUDIT``)."""
    log_landlock: bool
    """Its sandboxes' Landlock refusals reach it too (Linux 6.15+)."""

    def audit_id(self, handle: Handle) -> int | None:
        """The loginuid every process of the sandbox inherits (None: not set)."""

    def limit_counters(self, handle: Handle) -> dict[str, int]:
        """Cumulative ``kind -> count`` of limits hit: ``oom_kill``, ``pids_max``,
        ``disk_full`` (where the tier can tell). Cheap and non-blocking (read on the event
        loop, also at each kill)."""


@runtime_checkable
class GuardAudited(Protocol):
    """A tier whose commands a guard inside a guest confines (the VM tiers): what the guard
    refused, as the guest kept it (:class:`~dsec.privileged.seccomp_log.GuardLog`: exact
    counts, the newest records in detail), read by the edge's audit when it samples. Must
    not resume a paused sandbox nor count as activity."""

    async def guard_log(self, handle: Handle, after: int) -> GuardLog | None:
        """The guard's refusals with the records numbered above ``after``; None when the
        guest cannot say now (paused, stopped, an agent without the op)."""


@runtime_checkable
class ExitReporting(Protocol):
    """A tier whose sandboxes can end by themselves (a VM whose guest kernel panicked or
    powered off: its QEMU exits) and that says so when it happens, not at the next call.
    The edge registers one listener before ``start()`` and stops the sandbox with the
    reason (``sandbox died: <why>``). Ends the runtime makes itself (``destroy``, a suspend
    to a file) are not reported."""

    def on_exit(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(sandbox_id, why)``, on the runtime's event loop, for each such end;
        a later call replaces the listener."""


@runtime_checkable
class Reconciling(Protocol):
    """A tier that holds node state shared by its sandboxes (layer mounts) which outlives
    the edge: after a restart the edge calls :meth:`reconciled` once, when every sandbox it
    recovered has been recovered and every orphan destroyed, so that what no sandbox uses
    any more (sandboxes lost while the edge was down) is released."""

    async def reconciled(self) -> None: ...


def capabilities_of(rt: Runtime) -> Capabilities:
    """The capability table row of ``rt``'s tier: its abilities are the protocols its class
    implements (checked once per class: a runtime-checkable protocol's ``isinstance`` walks
    every member, ~12 checks a creation), the rest comes from its :meth:`Runtime.facts`."""
    f = rt.facts()
    a = _abilities(rt)
    return Capabilities(
        tier=rt.tier,
        available=f.available,
        reason=f.reason,
        exec=True,
        files=True,
        streaming=True,
        network=a["network"] and f.network_ready,
        persistent=f.persistent,
        max_cpu=f.max_cpu,
        max_memory_mb=f.max_memory_mb,
        **{k: v for k, v in a.items() if k != "network"},
    )


_ABILITIES_BY_CLASS: dict[type, dict[str, bool]] = {}


def _abilities(rt: Runtime) -> dict[str, bool]:
    """The optional abilities of ``rt``'s class (checked on the first instance seen)."""
    known = _ABILITIES_BY_CLASS.get(type(rt))
    if known is not None:
        return known
    snapshots = isinstance(rt, Snapshottable)
    memory = isinstance(rt, MemoryStateful)
    known = {
        "pause": isinstance(rt, Pausable),
        "pause_filesystem": isinstance(rt, Pausable) and isinstance(rt, FilesystemPause),
        "snapshot": snapshots,
        "fork": snapshots,
        "network": isinstance(rt, Networked),
        "tty": isinstance(rt, Interactive),
        "display": isinstance(rt, Display),
        "metrics": isinstance(rt, Measurable),
        "suspend": memory,
        "memory_fork": memory,
        "fork_shared": snapshots and isinstance(rt, UpperForkable),
        "ports": isinstance(rt, PortConnectable),
    }
    _ABILITIES_BY_CLASS[type(rt)] = known
    return known
