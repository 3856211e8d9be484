"""Typed request and result models shared by the SDK, the apiserver and the edge.

Glossary:
    sandbox: one isolated, disposable environment. Its id (``sb-<node>-<random>``)
        encodes the node that runs it, so routing needs no lookup.
    tier: the isolation mechanism: ``fncall`` (warm locked-down process),
        ``container`` (OCI runtime), ``microvm`` and ``vm`` (QEMU).
    image: a named, ordered list of layers (bottom first) that forms a root filesystem.
    layer: a read-only EROFS file named by its sha256, with a kind (``base``,
        ``workspace``, ``toolkit``).
    upper: the sandbox's private writable layer, size-capped by ``disk_mb``.

States: ``creating -> running <-> paused -> stopped``. ``stopped`` is final.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from dsec.display import DisplayAction, Screen
from dsec.errors import InvalidRequest
from dsec.images.reference import parse_ref
from dsec.network.policy import NetworkPolicy
from dsec.serverpaths import scrub_server_paths
from dsec.tiers import BUILTIN_TIERS, TIER_NAME, tier_traits, tiers_with
from dsec.wire import WireModel, validated

TIERS: tuple[str, ...] = BUILTIN_TIERS
"""The built-in tiers; every registered one: :func:`dsec.tiers.tier_names`. On the wire a tier
is a string: a server may offer tiers an older SDK does not know (other packages register
theirs, :mod:`dsec.tiers`); the server refuses unknown ones."""
_TIER_RE = TIER_NAME.pattern
SandboxState = Literal["creating", "running", "paused", "stopped"]
LayerKind = Literal["base", "workspace", "toolkit"]
OnTimeout = Literal["kill", "pause"]
TimeoutPause = Literal["auto", "filesystem"]
JobAction = Literal["pause", "resume", "kill"]

JobId = Annotated[
    str,
    Field(
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
        description="the job id given at creation",
    ),
]

_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
_IMAGE_REF = re.compile(r"^(k[0-9a-f]{16}/)?[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
"""An image as a key names it: its own or a system image (``name[:tag]``), or another key's
shared image (``<owner id>/name[:tag]``)."""


def _image_ref_ok(v: str) -> bool:
    """A local or shared image name, or an image reference a registry could serve."""
    if _IMAGE_REF.match(v):
        return True
    try:
        parse_ref(v)
    except InvalidRequest:
        return False
    return True


_USER = re.compile(r"^([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:[0-9]{1,10})?$")

MAX_ENV_BYTES = 256 * 1024

SYSTEM_OWNER = ""
"""The owner of built-in images and of what the operator published: visible to every key,
writable by none. Keys' owner ids are ``k<16 hex>``, so no key has this one."""


class _Model(WireModel):
    """Strict when a server reads it, lenient when a client reads an answer (see
    :mod:`dsec.wire`)."""


SandboxId = Annotated[str, Field(pattern=r"^sb-[a-z0-9-]{1,64}$", description="sb-<node>-<random>")]


class SandboxRef(_Model):
    """The request of a verb about one sandbox (:mod:`dsec.contract.verbs`): its id, which
    travels in the URL; verbs with more to say extend it."""

    sandbox_id: SandboxId


def _check_env(env: dict[str, str]) -> dict[str, str]:
    total = 0
    for k, v in env.items():
        if not _ENV_KEY.match(k):
            raise ValueError(f"invalid environment variable name {k!r}")
        if "\0" in v:
            raise ValueError(f"environment variable {k!r} contains a NUL byte")
        total += len(k) + len(v) + 2
    if total > MAX_ENV_BYTES:
        raise ValueError(f"environment is {total} bytes; at most {MAX_ENV_BYTES}")
    return env


class CreateSandboxRequest(_Model):
    """Create a sandbox. Units: ``cpu`` in cores, sizes in MiB, times in seconds."""

    tier: str = Field(
        "container",
        pattern=_TIER_RE,
        description="fncall | container | microvm | vm (the server refuses a tier it lacks)",
    )
    image: str = Field("busybox", description="image name (e.g. 'debian') or 'sha256:<digest>'")
    layers: list[str] = Field(
        default_factory=list, max_length=64, description="extra layers stacked above the image"
    )
    cpu: float = Field(
        1.0, ge=0.01, le=256, description="CPU cores (CFS quota; 0.01, 1 ms per 100 ms, at least)"
    )
    memory_mb: int = Field(512, ge=16, le=1024 * 1024, description="memory limit, MiB")
    disk_mb: int = Field(1024, ge=1, le=1024 * 1024, description="writable layer size, MiB")
    pids: int = Field(1024, ge=8, le=1_000_000, description="max processes/threads")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment of every command, over the image's Env"
    )
    ttl_s: float | None = Field(
        3600, gt=0, le=30 * 24 * 3600, description="idle seconds before the sandbox is killed"
    )
    user: str | None = Field(
        None,
        description="default user for exec: name, uid or uid:gid (default: the image's User, "
        "else root)",
    )
    labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    workdir: str | None = Field(
        None,
        max_length=4096,
        description="default cwd of commands (default: the image's WorkingDir, else /)",
    )
    on_timeout: OnTimeout = Field(
        "kill", description="what happens when ttl_s passes without activity: kill or pause"
    )
    timeout_pause: TimeoutPause = Field(
        "auto",
        description="how on_timeout='pause' pauses: auto (freeze; VM tiers suspend to a file) "
        "or filesystem (processes dropped, files kept: the sandbox boots afresh on resume; "
        "tiers whose capabilities say pause_filesystem)",
    )
    paused_ttl_s: float | None = Field(
        24 * 3600,
        gt=0,
        le=30 * 24 * 3600,
        description="seconds a paused sandbox lives before it is killed",
    )
    network: NetworkPolicy | None = Field(
        None, description="None (default): no network at all; else the allowlist policy"
    )
    start: bool = Field(
        True,
        description="run the image's start command, if it has one (a server, a desktop); "
        "its output is the sandbox's logs",
    )
    public_ports: bool = Field(
        False,
        description="the sandbox's ports answer through the port proxy without any "
        "credential (its id then carries 96 random bits: anyone with a URL reaches them)",
    )
    full_guest: bool = Field(
        False,
        description="microvm and vm tiers only: give commands the whole guest (every "
        "capability, device, /proc file, syscall: kernel work, penetration testing) instead "
        "of the container tier's protections",
    )

    allow_setuid: bool = Field(
        False,
        description="container tier only: commands run without no_new_privs, so setuid "
        "programs (sudo, su) raise privileges, up to the capabilities a command run as root "
        "has (e.g. E2B's passwordless sudo; the E2B API sets it)",
    )

    @model_validator(mode="after")
    def _full_guest(self) -> CreateSandboxRequest:
        # the tier's traits (dsec.tiers); a tier this process does not know: the server checks
        traits = tier_traits(self.tier) if self.full_guest or self.allow_setuid else None
        if traits is not None and self.full_guest and not traits.guest_kernel:
            vms = " and ".join(tiers_with(lambda t: t.guest_kernel))
            raise ValueError(f"full_guest is for the {vms} tiers, not {self.tier}")
        if traits is not None and self.allow_setuid and not traits.allow_setuid:
            setuid = " and ".join(tiers_with(lambda t: t.allow_setuid))
            vms = " and ".join(tiers_with(lambda t: t.guest_kernel))
            raise ValueError(
                f"allow_setuid is for the {setuid} tier, not {self.tier} (the {vms} tiers "
                "have full_guest)"
            )
        return self

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if v.startswith("sha256:"):
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", v):
                raise ValueError("digest must be sha256:<64 hex>")
            return v
        if not _image_ref_ok(v):
            raise ValueError(
                f"invalid image {v!r}: a name (debian, task:1), another key's shared image "
                "(<owner id>/name) or a registry reference (host:port/repo:tag, "
                "repo@sha256:<hex>, python:3.12-slim)"
            )
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[str]) -> list[str]:
        for name in v:
            if not (re.fullmatch(r"sha256:[0-9a-f]{64}", name) or _image_ref_ok(name)):
                raise ValueError(f"invalid layer reference {name!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        for k, val in v.items():
            if not _LABEL_KEY.match(k):
                raise ValueError(f"invalid label key {k!r}")
            if len(val) > 1024:
                raise ValueError(f"label {k!r} is longer than 1024 characters")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError(f"invalid user {v!r}: a name, a uid or uid:gid")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError("workdir must be an absolute path")
        return v


# --- audit: the refusals the platform made on a sandbox's behalf (dsec.edge.audit) ------
AUDIT_CATEGORIES: tuple[str, ...] = (
    "syscall",
    "landlock",
    "files",
    "network",
    "dns",
    "guard",
    "limits",
)
"""What an audit entry can be about: ``syscall`` (a seccomp filter refused a system call),
``landlock`` (Landlock refused a path or an IPC scope: the fncall tier, Linux 6.15+),
``files`` (the files API refused a path: a symlink out of the root, a protected path),
``network`` (packets the policy dropped, by destination), ``dns`` (names the resolver refused
or queries it rate-limited), ``guard`` (the VM tiers' in-guest guard refused a request),
``limits`` (a resource limit was hit: OOM kill, pids limit, full disk, output cap, time-out).
Every category but ``limits`` is an attempt to get past a boundary (see ``evidence``)."""

EVIDENCE_CATEGORIES: frozenset[str] = frozenset(
    {"syscall", "landlock", "files", "network", "dns", "guard"}
)


class AuditEntry(_Model):
    """One refusal (``GET /v1/sandboxes/{id}/audit``): when, by which process where the
    mechanism says, and what was refused. Entries are numbered per sandbox (``id``: 1, 2,
    3...); an entry can stand for several events of one sampled counter (``count``)."""

    id: int = Field(description="per-sandbox entry number, from 1 (follow with after=)")
    ts: float = Field(description="when it happened (or was sampled), Unix seconds")
    category: str = Field(description="syscall | landlock | files | network | dns | guard | limits")
    kind: str = Field(description="what within the category, e.g. ptrace, outside_root")
    detail: str = Field("", description="what was refused, in words")
    pid: int | None = Field(None, description="the process id inside the sandbox, if known")
    comm: str | None = Field(None, description="the process's name, if known")
    cmdline: str | None = Field(None, description="its command line, if it was still running")
    exe: str | None = Field(None, description="the program file, if the mechanism says")
    seq: int | None = Field(
        None, description="the trajectory seq of the last call before it (its place in the log)"
    )
    count: int = Field(1, description="events this entry stands for (sampled counters)")


class AuditSummary(_Model):
    """A sandbox's refusals in numbers (exact, whatever the detail cap dropped)."""

    sandbox_id: str
    tier: str = ""
    job: str | None = None
    enabled: bool = Field(True, description="False: the node records no audit")
    evidence: bool = Field(
        False, description="any refusal of a boundary (every category but limits)"
    )
    total: int = Field(0, description="events counted, all categories")
    counts: dict[str, int] = Field(
        default_factory=dict, description="exact counts by 'category.kind'"
    )
    dropped: int = Field(0, description="entries counted but whose details were not kept")
    stopped: bool = False

    def category(self, name: str) -> int:
        """Events of one category (``syscall``, ``files``, ...)."""
        return sum(n for k, n in self.counts.items() if k.split(".", 1)[0] == name)


class AuditReport(AuditSummary):
    """``GET /v1/sandboxes/{id}/audit``: the counts and the kept details of a sandbox's
    refusals. Details are capped per sandbox (``cap``: the first half of it kept, then the
    newest); counts stay exact (``dropped`` says how many details were not kept)."""

    entries: list[AuditEntry] = Field(default_factory=list)
    cap: int = Field(0, description="details kept per sandbox at most")
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="per category, what this tier records it from ('' : it cannot)",
    )


class JobAudit(_Model):
    """``GET /v1/jobs/{job}/audit``: every sandbox of a job (live and stopped ones the node
    still remembers) with its audit summary."""

    job: str
    sandboxes: dict[str, AuditSummary] = Field(default_factory=dict)

    @property
    def flagged(self) -> list[str]:
        """The ids of the sandboxes with evidence."""
        return sorted(s for s, a in self.sandboxes.items() if a.evidence)


class SandboxInfo(_Model):
    """What the edge knows about one sandbox."""

    id: str
    tier: str = Field(description="fncall | container | microvm | vm (or a newer tier)")
    image: str
    layers: list[str] = Field(default_factory=list)
    state: str = Field(description="creating | running | paused | stopped")
    cpu: float
    memory_mb: int
    disk_mb: int
    pids: int = 1024
    labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = None
    user: str | None = None
    workdir: str = "/"
    node: str
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None = None
    ttl_s: float | None = None
    stopped_reason: str | None = None
    on_timeout: str = Field("kill", description="kill | pause")
    paused_ttl_s: float | None = None
    paused_at: datetime | None = None
    last_pause: PauseReport | None = None
    next_seq: int = Field(1, description="the trajectory sequence number the edge expects next")
    network: NetworkPolicy | None = None
    forked_from: str | None = Field(None, description="the sandbox this one was forked from")
    public_ports: bool = Field(False, description="its ports need no credential")
    audit: AuditSummary | None = Field(
        None, description="its refusals in numbers (in the answer to a kill; dsec.edge.audit)"
    )

    @field_serializer("stopped_reason")
    def _public_reason(self, reason: str | None) -> str | None:
        """A failed creation's reason can name server paths: shown as ``$DSEC_HOME/...``."""
        return scrub_server_paths(reason)


class PauseReport(_Model):
    """What a pause did. Sizes in bytes, times in milliseconds."""

    memory_before_bytes: int = 0
    memory_after_bytes: int = 0
    duration_ms: float = 0.0
    method: str = ""
    notes: list[str] = Field(default_factory=list)


class SnapshotRequest(_Model):
    """Capture the sandbox's writable layer as a new content-addressed workspace layer
    (``pack_diff``). ``scrub`` paths (globs, absolute) are left out on top of the defaults
    (shell histories, package caches, /tmp; ``default_scrub=False``: none); ``secret_values``
    are the builder's secrets:
    a file containing any of them refuses the snapshot (nothing is stored)."""

    name: str | None = Field(None, description="also tag an image of this name (base + snapshot)")
    scrub: list[str] = Field(default_factory=list, max_length=256)
    compress: bool = Field(
        False,
        description="lz4-compress the layer: smaller, but packing incompressible data costs "
        "~30 ms per MB here; snapshots are uncompressed by default (fast pack_diff)",
    )
    secret_values: list[str] = Field(default_factory=list, max_length=64)
    default_scrub: bool = Field(
        True,
        description="also leave out the default build leftovers (shell histories, package "
        "caches, /tmp, /var/tmp); false keeps them (image builds: a RUN step's files as "
        "Docker keeps them)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"invalid image name {v!r}")
        return v

    @field_validator("scrub")
    @classmethod
    def _scrub(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or "\0" in p or len(p) > 4096:
                raise ValueError(f"scrub path {p!r} must be an absolute path")
        return v


MAX_FORK = 256
"""Most sandboxes one fork may make."""


class SandboxSnapshotRequest(SnapshotRequest, SandboxRef):
    """``POST /v1/sandboxes/{id}/snapshot``: :class:`SnapshotRequest` of one sandbox."""


class ForkRequest(SandboxRef):
    """Make ``n`` new sandboxes from this one's files (same limits, plus overrides).

    How (``method``): ``shared`` freezes this sandbox's writable layer and stacks every new
    sandbox on it read-only (nothing is copied: the cost does not grow with the size of the
    change; tiers whose capabilities say ``fork_shared``); ``pack`` packs the writable layer
    into a content-addressed layer first (``pack_diff``, ~4 ms per MiB) and applies
    ``scrub`` and the default scrub; ``auto`` (default) is ``shared`` where the tier can, the
    parent gives up its writable layer (``parent`` not ``keep``) and no ``scrub`` is asked
    for, else ``pack``.

    ``parent``: what this sandbox becomes. ``keep`` (default): it runs on as it was, its
    processes too (its writable layer stays its own, so the fork packs it). Else it gives
    its writable layer to the children (``shared``): ``pause`` leaves it paused, and its next
    request (resume, exec, files...) restarts it on a fresh writable layer over the frozen
    one: files kept, processes gone; ``continue`` restarts it so at once (beside the
    children's creation)."""

    n: int = Field(ge=1, le=MAX_FORK, description=f"how many sandboxes (1..{MAX_FORK})")
    labels: dict[str, str] = Field(default_factory=dict)
    scrub: list[str] = Field(default_factory=list, max_length=256)
    method: Literal["auto", "shared", "pack"] = Field(
        "auto", description="shared: O(1) stack on the frozen layer; pack: pack_diff first"
    )
    parent: Literal["keep", "pause", "continue"] = Field(
        "keep",
        description="keep: the parent runs on with its processes (the fork packs its layer); "
        "pause / continue: it gives its writable layer to the children (a shared fork) and "
        "stays paused until its next request, or restarts at once, in both cases on a fresh "
        "writable layer over the frozen one, its processes gone",
    )
    memory: bool = Field(
        False,
        description="VM tiers: the new sandboxes resume this one's memory and device state "
        "(running processes carry over), each with its own copy-on-write disk, a new RNG "
        "seed and clock; no layer is made. Other tiers: capability_not_supported.",
    )


class ForkResult(_Model):
    layer: LayerInfo | None = Field(
        None, description="the packed layer (pack forks; None: shared and memory forks)"
    )
    sandboxes: list[SandboxInfo]
    method: str = Field("pack", description="how the fork was made: shared, pack or memory")


# --- batch creation ----------------------------------------------------------------

MAX_BATCH = 1024
"""Most sandboxes one batch call may ask for (larger jobs send several batches)."""


class BatchCreateRequest(_Model):
    """Create ``n`` sandboxes from one request. By default partial success is returned as
    is (each failure reported by index); ``all_or_nothing`` kills what was made if any fails."""

    n: int = Field(ge=1, le=MAX_BATCH, description=f"how many sandboxes (1..{MAX_BATCH})")
    sandbox: CreateSandboxRequest = Field(default_factory=CreateSandboxRequest)
    all_or_nothing: bool = False


class BatchItemError(_Model):
    """Why sandbox ``index`` (0-based, in request order) of a batch was not created."""

    index: int
    code: str = Field(description="the error's wire code, e.g. quota_exceeded")
    message: str

    @field_serializer("message")
    def _public_message(self, message: str) -> str:
        """Copied from the error, which can name server paths: shown as ``$DSEC_HOME/...``."""
        return scrub_server_paths(message)


class BatchCreateResult(_Model):
    """Per-sandbox outcome of a batch: ``len(sandboxes) + len(errors) == requested``."""

    requested: int
    sandboxes: list[SandboxInfo] = Field(default_factory=list)
    errors: list[BatchItemError] = Field(default_factory=list)


class JobOutcome(_Model):
    ok: bool
    state: str | None = None
    error: dict[str, Any] | None = None


class JobActionRequest(_Model):
    """``POST /v1/jobs/{job}/{action}``: pause, resume or kill every sandbox of a job."""

    job: JobId
    action: JobAction


class JobActionResult(_Model):
    job: str
    action: str
    outcomes: dict[str, JobOutcome]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes.values())


class ExecRequest(_Model):
    """Run one command. ``cmd`` as a string runs under ``/bin/sh -c``; a list is exec'd as is."""

    cmd: str | list[str]
    cwd: str | None = Field(None, max_length=4096, description="default: the sandbox workdir")
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(60.0, gt=0, le=24 * 3600, description="wall-clock limit, seconds")
    stdin: str | None = Field(None, description="data written to the command's stdin (UTF-8)")
    stdin_b64: str | None = Field(None, description="binary stdin, base64; exclusive with stdin")
    user: str | None = None
    max_output_bytes: int = Field(
        1 << 20, ge=0, le=64 << 20, description="cap per stream; the rest is dropped"
    )

    @field_validator("stdin_b64")
    @classmethod
    def _stdin_b64(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"stdin_b64 is not valid base64: {e}") from None
        return v

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("cmd is empty")
            if "\0" in v:
                raise ValueError("cmd contains a NUL byte")
            if len(v) > 1 << 20:
                raise ValueError("cmd is longer than 1 MiB")
        else:
            if not v:
                raise ValueError("cmd is empty")
            if any("\0" in a for a in v):
                raise ValueError("cmd contains a NUL byte")
            if sum(len(a) for a in v) > 1 << 20:
                raise ValueError("cmd is longer than 1 MiB")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError("cwd must be an absolute path")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError(f"invalid user {v!r}: a name, a uid or uid:gid")
        return v

    def argv(self) -> list[str]:
        return ["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else list(self.cmd)


class SandboxExecRequest(ExecRequest, SandboxRef):
    """``POST /v1/sandboxes/{id}/exec`` (and ``.../exec/stream``): an :class:`ExecRequest`
    run in one sandbox. The id travels in the URL; the JSON body is the ExecRequest."""

    @classmethod
    def of(cls, sandbox_id: str, command: ExecRequest) -> SandboxExecRequest:
        """``command`` in the sandbox ``sandbox_id`` (the fields it left unset stay unset)."""
        return cls.model_validate(
            {"sandbox_id": sandbox_id, **command.model_dump(exclude_unset=True)}
        )

    @property
    def command(self) -> ExecRequest:
        """The command alone, without the sandbox id: what a runtime runs and the trajectory
        records (a replay into another sandbox asks the same)."""
        values = {name: getattr(self, name) for name in ExecRequest.model_fields}
        return ExecRequest.model_construct(self.model_fields_set - {"sandbox_id"}, **values)


class ExecResult(_Model):
    """The outcome of one command. Output is UTF-8 decoded with replacement characters."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = Field(None, description="None when killed by a signal")
    signal: int | None = None
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: float = 0.0
    oom_killed: bool = False
    replayed: bool = Field(
        False, description="true when the edge answered from the trajectory log without running"
    )

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class ExecEvent(_Model):
    """One line of a streamed exec (NDJSON): output chunks, then exactly one ``exit``."""

    type: str = Field(description="stdout | stderr | exit | error (clients skip others)")
    data: str | None = None
    result: ExecResult | None = None
    error: dict[str, Any] | None = None


class LogLine(_Model):
    """A piece of a sandbox's logs (NDJSON on ``GET /v1/sandboxes/{id}/logs``): output of
    its image's start command, as it came (a chunk may hold several lines, or part of one)."""

    ts: float = Field(description="when the edge read it, Unix seconds")
    stream: str = Field(
        description="stdout | stderr | dsec (the edge's own note: how the command ended)"
    )
    data: str


FileType = Literal["file", "dir", "symlink", "other"]


class FileInfo(_Model):
    path: str
    name: str
    type: FileType
    size: int
    mode: int = Field(description="permission bits, e.g. 0o644")
    mtime: float
    uid: int = 0
    gid: int = 0
    target: str | None = Field(None, description="symlink target")


class FileList(_Model):
    entries: list[FileInfo]


class LayerInfo(_Model):
    digest: str = Field(description="sha256:<hex> of the EROFS file")
    kind: str = Field(description="base | workspace | toolkit")
    name: str | None = None
    size: int
    created_at: datetime
    meta: dict[str, Any] = Field(default_factory=dict)
    remote: str | None = Field(
        None, description="blob store the layer's data is read from on demand (None: local)"
    )
    cached_fraction: float | None = Field(
        None, description="share (0..1) of the layer's bytes on this node's disk"
    )


class ImageInfo(_Model):
    name: str
    layers: list[str] = Field(description="layer digests, bottom first")
    size: int
    created_at: datetime
    meta: dict[str, Any] = Field(default_factory=dict)
    cached_fraction: float | None = Field(
        None, description="share (0..1) of the image's bytes on this node's disk (by size)"
    )
    owner: str = Field(
        "system",
        description="`system` (built-in or published by the operator: read-only to keys) "
        "or the owner id of the key the image belongs to",
    )
    shared: bool = Field(
        False, description="usable by every key as `<owner>/<name>` (set by its owner)"
    )
    status: str = Field(
        "ready",
        description="`ready`, or for a built-in image not built yet: `building`, `queued` "
        "or `failed`, or for a registry reference being pulled: `pulling` (`progress` says "
        "more; `layers` is empty until it is ready)",
    )
    progress: str | None = Field(None, description="what a build is doing, or why it failed")


class BuildImageRequest(_Model):
    """Build an image from an uploaded build context (a tar archive, optionally gzip, bzip2
    or xz compressed): its files become one layer, stacked on ``base``. The API never reads
    a path on the server; ``dsec image build PATH`` packs PATH on the client."""

    name: str
    kind: LayerKind = "workspace"
    base: str | None = Field(None, description="image to stack on (for workspace/toolkit)")
    system: bool = Field(
        False,
        description="publish as a system image, visible to every key and read-only to them "
        "(the operator's key only)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"invalid image name {v!r}")
        return v


class PullImageRequest(_Model):
    """Pull an image from an OCI / Docker v2 registry into the node's layer store.
    Registry credentials are server-side configuration, never sent over this API."""

    ref: str = Field(
        min_length=1, max_length=1024, description="[registry/]repo[:tag][@sha256:...]"
    )
    name: str | None = Field(None, description="name[:tag] in the store (default: from the ref)")
    lazy: bool = Field(
        False,
        description="an image pushed with `dsec image push`: record its layers as remote and "
        "fetch their data on first read instead of downloading them now",
    )
    system: bool = Field(
        False,
        description="store as a system image, visible to every key and read-only to them "
        "(the operator's key only)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"invalid image name {v!r}")
        return v


# --- the verb table's requests and answers of images, layers, builds and networks -------
IMAGE_REF_PATTERN = (
    r"^(sha256:[0-9a-f]{64}|[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?"
    r"|[A-Za-z0-9][A-Za-z0-9._/:-]{0,511}(@sha256:[0-9a-f]{64})?)$"
)
"""Images: ``name[:tag]``, ``sha256:<64 hex>``, or a registry reference's familiar form
(``127.0.0.1:5000/team/app:1``; the edge checks it in full)."""

BUILD_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""Build ids (:mod:`dsec.builds.records`; at most 64 characters)."""


class KeyScope(_Model):
    """A verb about what the caller's key may see (its images, layers, builds): it has
    nothing to say but the key, which the call's owner is."""


class ImageRef(_Model):
    """A verb about one image the caller's key may name; ``name`` travels in the URL
    (``/`` and ``:`` included)."""

    name: str = Field(
        pattern=IMAGE_REF_PATTERN,
        description="name[:tag], sha256:<hex>, or a pulled reference (host:port/repo:tag)",
    )


class DeleteImageRequest(ImageRef):
    """Forget one of the key's images (``system``: a system image, the operator's key only)."""

    system: bool = Field(False, description="a system image (operator only)")


class ShareImageRequest(ImageRef):
    """Share one of the key's images with every key, or stop."""

    shared: bool = Field(
        description="true: every key may use it as `<owner>/<name>`; false: this key only"
    )


class PushImageRequest(ImageRef):
    """Publish an image's EROFS layers to an OCI registry as a dsec artifact. Registry
    credentials are server-side configuration (``DSEC_REGISTRY_AUTH``)."""

    target: str = Field(
        min_length=8,
        max_length=1024,
        pattern=r"^oci://[^/\s]+/[^\s]+$",
        description="oci://HOST[:PORT]/REPOSITORY[:TAG] (tag default: the image's, or latest)",
    )


class BuildRef(_Model):
    """A verb about one image build of the caller's key."""

    build_id: str = Field(min_length=1, max_length=64, pattern=BUILD_ID_PATTERN)


class NetworkPolicyRequest(SandboxRef):
    """Replace a sandbox's network policy; the HTTP body is the policy itself."""

    policy: NetworkPolicy = Field(description="the new NetworkPolicy")


class ImageList(_Model):
    """The images a key may use."""

    images: list[ImageInfo]


class LayerList(_Model):
    """The layers a key may name by digest."""

    layers: list[LayerInfo]


_PATH_SCHEMA: dict[str, Any] = {"pattern": r"^/[^\x00]{0,4095}$"}
"""What a sandbox path looks like, documented; the edge checks it (and more: no ``..``) for
every caller alike, and records a path that climbs out in the sandbox's audit."""


class ScreenRequest(SandboxRef):
    """A question about one sandbox's screen."""

    screen: Screen = Field(
        "auto", description="desktop (a desktop image's), console (the tier's), auto: desktop first"
    )


class DisplayActRequest(ScreenRequest):
    """One input action on one sandbox's screen (``display_act``; the actions:
    :mod:`dsec.display`). Its route is the action's kind (``POST .../display/click``), the
    action its body, the screen in the query."""

    action: DisplayAction


class JobRef(_Model):
    """A verb about every sandbox of one job of the caller's key."""

    job: JobId


class SandboxPathRequest(SandboxRef):
    """A verb about one path inside a sandbox (``stat_file``, ``make_dir``). The edge checks
    the path (absolute, no ``..``, no NUL, at most 4096 bytes), so every caller gets the
    same refusal and a path that climbs out is recorded in the sandbox's audit."""

    path: str = Field(
        description="absolute path inside the sandbox", json_schema_extra=_PATH_SCHEMA
    )


class ListFilesRequest(SandboxPathRequest):
    depth: int = Field(1, ge=1, le=32, description="levels below path")


class RemoveFileRequest(SandboxPathRequest):
    recursive: bool = Field(False, description="remove a directory with what it holds")


class RenameRequest(SandboxRef):
    src: str = Field(description="absolute path inside the sandbox", json_schema_extra=_PATH_SCHEMA)
    dst: str = Field(description="absolute path inside the sandbox", json_schema_extra=_PATH_SCHEMA)


class SetTTLRequest(SandboxRef):
    """Kill the sandbox after ``ttl_s`` idle seconds from now."""

    ttl_s: float = Field(gt=0, le=30 * 24 * 3600)


class Capabilities(_Model):
    """What a tier can do. Calls outside this set raise ``CapabilityNotSupported``."""

    tier: str
    available: bool
    reason: str | None = None
    exec: bool = True
    files: bool = True
    streaming: bool = True
    pause: bool = False
    snapshot: bool = False
    fork: bool = False
    network: bool = False
    tty: bool = False
    display: bool = False
    persistent: bool = True
    suspend: bool = Field(False, description="pause mode=suspend: memory to a file, process exits")
    pause_filesystem: bool = Field(
        False,
        description="pause mode=filesystem: processes dropped, files kept, a new boot on resume",
    )
    memory_fork: bool = Field(False, description="fork with memory=True (running processes)")
    fork_shared: bool = Field(
        False, description="fork method=shared: children stack on the frozen writable layer"
    )
    ports: bool = Field(
        False, description="TCP ports inside the sandbox reachable through the port proxy"
    )
    metrics: bool = Field(False, description="GET /v1/sandboxes/{id}/metrics: resource usage")
    max_cpu: float | None = None
    max_memory_mb: int | None = None

    @field_serializer("reason")
    def _public_reason(self, reason: str | None) -> str | None:
        """Why a tier is unavailable can name server paths: shown as ``$DSEC_HOME/...``."""
        return scrub_server_paths(reason)


class PortAccess(_Model):
    """How to reach a sandbox's ports through the port proxy (``GET
    /v1/sandboxes/{id}/ports``). URLs: ``{api}/v1/sandboxes/{sandbox_id}/ports/{port}/...``
    (path route) and, when the server has a ports domain,
    ``{scheme}://{port}-{sandbox_id}.{domain}/...`` (host route). Either takes ``token``
    (header ``X-Dsec-Port-Token``, cookie, ``?dsec_token=`` or a ``/_dsec_token/<token>``
    first path segment) instead of the API key."""

    sandbox_id: str
    token: str = Field(description="the sandbox's access token (all its ports, its whole life)")
    public: bool = Field(False, description="created with public_ports: no credential needed")
    domain: str | None = Field(
        None, description="host routes: '{port}-{sandbox_id}.' + this ('name[:port]')"
    )
    scheme: str = Field("https", description="the scheme of host routes (https or http)")


class HostFeature(_Model):
    """One kernel or host feature dsec uses, as found on the node (``dsec doctor``)."""

    name: str = Field(description="e.g. 'EROFS', 'overlayfs', 'Landlock', 'cgroup.kill'")
    available: bool | None = Field(description="None: it could not be probed (e.g. not root)")
    value: str = Field(description="what was found: 'file-backed mounts', 'ABI 6', 'crun 1.8.1'")
    note: str | None = Field(None, description="why it is missing, or what it means for dsec")

    @field_serializer("value", "note")
    def _public_text(self, text: str | None) -> str | None:
        return scrub_server_paths(text)


class HostCgroups(_Model):
    """The node's cgroup layout as dsec uses it (``dsec.privileged.cgroups.CgroupLayout``)."""

    mode: str = Field(description="v2, v1 (the hybrid layout included) or unsupported")
    description: str = Field(description="one line, e.g. 'v2 (unified), base /dsec.service'")
    usable: bool = Field(description="dsec can confine sandboxes with it")
    base: str = Field("", description="v2: dsec's base cgroup below the mount ('' = root)")
    delegated: bool = Field(False, description="v2: the base was delegated by systemd")
    controllers: list[str] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list, description="controllers dsec lacks")
    reason: str | None = Field(None, description="what to change when it is not usable")
    features: list[HostFeature] = Field(default_factory=list)


class HostTier(_Model):
    """Whether a tier can run on the node, and why not."""

    tier: str
    available: bool
    reason: str | None = None
    wanted: bool = Field(True, description="the operator asked for it (DSEC_TIERS, or unset)")

    @field_serializer("reason")
    def _public_reason(self, reason: str | None) -> str | None:
        return scrub_server_paths(reason)


class HostReport(_Model):
    """What a node's host gives dsec: ``dsec doctor``, the ``host`` of ``GET /v1/node``."""

    kernel: str = Field(description="the kernel release (uname -r)")
    distribution: str = Field(description="/etc/os-release's PRETTY_NAME")
    architecture: str
    root: bool = Field(description="the probing process ran as root")
    cgroups: HostCgroups
    features: list[HostFeature] = Field(default_factory=list)
    tiers: list[HostTier] = Field(default_factory=list)


class NodeInfo(_Model):
    node: str
    version: str
    tiers: list[Capabilities]
    sandboxes: int
    cpus: int
    memory_mb: int
    host: HostReport | None = Field(
        None, description="the node's kernel, cgroups and kernel features (None: not known)"
    )


# --- sandbox lists and node queries of the verb table (issue 33) ---------------------------
_LABEL_FILTER = re.compile(rf"^({_LABEL_KEY.pattern[1:-1]})=(.{{0,1024}})$", re.DOTALL)


class ListSandboxesRequest(_Model):
    """``GET /v1/sandboxes``: the caller's sandboxes; every filter given must match. Without
    ``state``, stopped ones only with ``include_stopped``."""

    state: Literal["creating", "running", "paused", "stopped"] | None = None
    job: str | None = Field(None, max_length=128)
    label: list[str] = Field(
        default_factory=list, description="key=value; repeatable; all must match"
    )
    include_stopped: bool = False

    @field_validator("label")
    @classmethod
    def _label(cls, v: list[str]) -> list[str]:
        for item in v:
            if not _LABEL_FILTER.match(item):
                raise ValueError(f"label filter must be key=value, got {item!r}")
        return v

    @property
    def labels(self) -> dict[str, str]:
        """The label filters as a mapping (a key given twice: the last value)."""
        return {k: v for k, _, v in (item.partition("=") for item in self.label)}

    @classmethod
    def of(cls, labels: dict[str, str] | None = None, **fields: Any) -> ListSandboxesRequest:
        """The request from a mapping of labels (what the SDK's callers and E2B hold); a
        malformed filter is ``InvalidRequest``. Fields at their defaults stay unset: they
        are not sent (the server's defaults apply)."""
        known = cls.model_fields
        given = {k: v for k, v in fields.items() if k not in known or v != known[k].default}
        if labels:
            given["label"] = [f"{k}={v}" for k, v in labels.items()]
        return validated(cls, **given)


class SandboxList(_Model):
    sandboxes: list[SandboxInfo]


class NodeQuery(_Model):
    """The request of a node-wide query that takes no arguments (``GET /v1/node``,
    ``GET /v1/capabilities``): every key gets the same answer."""


NODE_QUERY = NodeQuery()
"""The one :class:`NodeQuery` (a call without arguments)."""


class CapabilityList(_Model):
    tiers: list[Capabilities]


class KeyQuota(_Model):
    """What the operator lets one API key use (``dsec key create/set --max-sandboxes ...``).
    None: no limit of that kind beyond the node's own. ``cpu_weight`` is the key's share of
    contended CPU against other keys (all its sandboxes share it; 100 is every key's default,
    as ``cpu.weight`` is every cgroup's)."""

    max_sandboxes: int | None = Field(None, ge=0, description="live sandboxes at once")
    max_cpu: float | None = Field(None, ge=0, description="cores requested by live sandboxes")
    max_memory_mb: int | None = Field(
        None, ge=0, description="memory (MiB) requested by live sandboxes"
    )
    creations_per_s: float | None = Field(
        None, gt=0, description="sandbox creations a second (bursts of one second's worth)"
    )
    cpu_weight: int = Field(
        100, ge=1, le=10000, description="share of contended CPU against other keys"
    )


class KeyUsage(_Model):
    """What one key holds now (live sandboxes and what they requested)."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0


class KeyInfo(_Model):
    """The calling key: ``GET /v1/key`` (``dsec info``). Another key's is never shown."""

    owner: str = Field(description="the key's owner id (k + 16 hex digits of its hash)")
    role: str = Field("user", description="``operator`` or ``user``")
    quota: KeyQuota = Field(default_factory=KeyQuota)
    usage: KeyUsage = Field(default_factory=KeyUsage)


class CpuMetrics(_Model):
    """CPU of one sandbox. ``usage_s`` is cumulative; the rates cover ``interval_s`` of the
    :class:`SandboxMetrics` they belong to."""

    usage_s: float = Field(description="CPU time consumed since the sandbox started, seconds")
    used_cores: float = Field(description="cores busy on average over the interval")
    used_pct: float = Field(description="used_cores as a percentage of limit_cores")
    limit_cores: float = Field(description="the cores the sandbox asked for (its quota)")


class MemoryMetrics(_Model):
    """Memory of one sandbox, bytes. ``used`` is the working set (charged memory minus
    inactive file cache); ``cache`` the page cache charged to it (its tmpfs files too)."""

    used_bytes: int
    cache_bytes: int = 0
    limit_bytes: int | None = Field(None, description="its memory limit (None: none known)")
    peak_bytes: int | None = Field(None, description="highest charge seen, where kept")
    host_bytes: int | None = Field(None, description="VM tiers: what QEMU holds on the host")


class DiskMetrics(_Model):
    """The sandbox's writable layer, bytes (``used_bytes`` None: not measurable on this tier)."""

    used_bytes: int | None = None
    total_bytes: int | None = None


class NetworkMetrics(_Model):
    """Traffic as the sandbox sees it (``rx``: arrived, ``tx``: sent), cumulative."""

    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_packets: int = 0
    tx_packets: int = 0


class SandboxUptime(_Model):
    """How long a sandbox has lived and how long it has been idle, seconds (wall clock).
    ``idle_s`` counts from its last request that counted as activity (what its TTL counts
    from); ``expires_in_s``: seconds until that TTL ends it (None: no TTL, or not running).
    A stopped sandbox's ``uptime_s`` ends when it stopped."""

    sandbox_id: str
    state: str
    created_at: datetime
    uptime_s: float
    idle_s: float
    expires_in_s: float | None = None


class SandboxMetrics(_Model):
    """``GET /v1/sandboxes/{id}/metrics``: one sample of a sandbox's resource usage.

    Reading it neither resumes a paused sandbox nor counts as activity (its TTL is not
    extended). Rates (``cpu.used_cores``) cover ``interval_s``: the time since the previous
    sample anyone took of this sandbox, or since it was created for the first one.
    """

    sandbox_id: str
    tier: str
    state: str
    timestamp: datetime
    interval_s: float = Field(description="seconds the rates average over")
    cpu: CpuMetrics
    memory: MemoryMetrics
    disk: DiskMetrics = Field(default_factory=DiskMetrics)
    network: NetworkMetrics | None = Field(None, description="None: the sandbox has no network")
    pids: int | None = Field(None, description="processes (threads) in the sandbox now")
    source: str = Field("", description="where the numbers come from, e.g. 'cgroup v1'")
    audit: AuditSummary | None = Field(
        None, description="its refusals so far in numbers (None: the node records none)"
    )


class RemoveRequest(_Model):
    path: str
    recursive: bool = False


# --- pause modes (issue 5: suspend to file on the VM tiers) -------------------------
class PauseRequest(SandboxRef):
    """``POST /v1/sandboxes/{id}/pause`` (the body is optional).

    ``auto``: the tier's default pause (containers: freezer + reclaim; VMs: vCPUs stopped).
    ``freeze``: the same, spelled out. ``suspend`` (tiers whose capabilities say
    ``suspend``): RAM and device state are written to a file in the sandbox directory and
    the VM process exits, so the host memory is freed; any later request restores it.
    ``filesystem`` (tiers whose capabilities say ``pause_filesystem``): every process is
    dropped and only the files are kept; the sandbox resumes as a fresh boot (new boot id)."""

    mode: Literal["auto", "freeze", "suspend", "filesystem"] = "auto"


# --- cluster migration (issue 8: POST /v1/sandboxes/{id}/migrate) --------------------
class MigrateRequest(SandboxRef):
    """Move a sandbox to another node of a cluster. ``node``: the target node's name
    (``None``: the placer chooses any other node that admits it)."""

    node: str | None = Field(None, max_length=64, pattern=r"^[a-z0-9]{1,64}$")


class MigrateResult(_Model):
    """Where a sandbox went. ``sandbox`` is the new sandbox (a new id on ``to_node``); the
    old one was killed only after the new one was up. ``method``: ``pack_diff`` (the
    writable layer moved as a layer; processes are not carried, ``processes_carried`` is
    false) or ``memory_snapshot`` (VM memory and devices carried, ``state_bytes`` moved).
    ``duration_ms``: wall-clock time of the whole move, milliseconds."""

    sandbox: SandboxInfo
    from_id: str
    from_node: str
    to_node: str
    method: Literal["pack_diff", "memory_snapshot"]
    processes_carried: bool
    layer_bytes: int = Field(0, description="bytes of layer files moved between nodes")
    state_bytes: int = Field(
        0,
        description="bytes of VM memory state (and the vm tier's disk) moved between nodes "
        "(memory_snapshot)",
    )
    duration_ms: float


# --- image publishing (issue 4: POST /v1/images/{name}/push) -------------------------
class PushImageResult(_Model):
    """What was pushed: ``manifest_digest`` names the artifact manifest (``sha256:...``)."""

    image: str
    target: str
    manifest_digest: str


SandboxInfo.model_rebuild()
ForkResult.model_rebuild()


# --- run_code: SandboxFusion's shapes (``/run_code``) and dsec's (``/v1/run_code``) ---------


class CommandRunStatus(StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunStatus(StrEnum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunResult(BaseModel):
    """One step (compile or run). ``execution_time``/``cpu_time`` in seconds."""

    status: CommandRunStatus
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``/run_code`` body. Unknown fields are ignored, as SandboxFusion does."""

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(BaseModel):
    """SandboxFusion's ``/run_jupyter`` body: cells run in order on one Python kernel.
    Times in seconds (``cell_timeout`` 0: none of its own). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = 0
    total_timeout: float = 45
    memory_limit_MB: int = -1
    kernel: str = "python3"
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    """One cell as SandboxFusion reports it: the kernel's stream text, its display and
    execute results (MIME bundles: ``{"text/plain": ..., "image/png": <base64>}``) and its
    errors (``{"ename", "evalue", "traceback"}``)."""

    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, Any]] = Field(default_factory=list)
    error: list[dict[str, Any]] = Field(default_factory=list)


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


# --- dsec shapes --------------------------------------------------------------------------


class CodeRunRequest(_Model):
    """dsec's ``/v1/run_code``. Times in seconds, sizes in MiB/bytes; files are base64."""

    code: str
    language: str
    stdin: str | None = None
    stdin_b64: str | None = None
    files: dict[str, str] = Field(
        default_factory=dict, description="path under /work -> base64 content"
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        description="files to return: relative to /work, or absolute paths in the sandbox",
    )
    timeout_s: float = Field(10.0, gt=0, description="run wall-clock limit")
    compile_timeout_s: float = Field(30.0, gt=0)
    memory_mb: int | None = Field(None, ge=16, description="memory limit; default: the pool's")
    max_output_bytes: int = Field(1 << 20, ge=0, description="cap per stream")
    env: dict[str, str] = Field(default_factory=dict)


Outcome = Literal["ok", "compile_error", "runtime_error", "timeout", "compile_timeout", "oom"]
"""What a dsec ``run_code`` came to (answers keep it a string: a newer server may add some)."""


class CodeRunResult(_Model):
    """dsec's ``/v1/run_code`` answer; ``compile``/``run`` are the steps' results."""

    outcome: str = Field(
        description="ok | compile_error | runtime_error | timeout | compile_timeout | oom"
    )
    compile: ExecResult | None = None
    run: ExecResult | None = None
    files: dict[str, str] = Field(default_factory=dict, description="fetched files, base64")
    file_errors: dict[str, str] = Field(default_factory=dict)
    cpu_time_s: float | None = None
    worker: str = ""
    duration_ms: float = 0.0


# --- network counters (GET /v1/sandboxes/{id}/network) ------------------------------
class _Open(_Model):
    """A report whose fields grow with the node's features: extra fields kept."""

    model_config = ConfigDict(extra="allow")


class AllowedDestination(_Open):
    """New connections a sandbox made to one destination (first packets counted)."""

    destination: str = Field(description="IPv4 address")
    protocol: str = Field(description="tcp, udp or icmp")
    port: int | None = Field(None, description="destination port (None for icmp)")
    connections: int = 0
    names: list[str] = Field(default_factory=list, description="DNS names that admitted it")


class BlockedDestination(_Open):
    """Packets dropped on their way to one destination (a retried SYN counts again)."""

    destination: str = Field(description="IPv4 address")
    protocol: str = Field(description="tcp, udp or icmp")
    port: int | None = Field(None, description="destination port (None for icmp)")
    packets: int = 0


class NetworkStats(_Open):
    """``GET /v1/sandboxes/{id}/network``. A sandbox without a network answers only
    ``{"enabled": false}``. Counters of a destination age out after an hour idle."""

    enabled: bool
    sandbox_id: str | None = None
    ip: str | None = Field(None, description="the sandbox's address on the node")
    policy: dict[str, Any] | None = Field(None, description="the NetworkPolicy in force")
    allowed: list[AllowedDestination] = Field(default_factory=list)
    blocked: list[BlockedDestination] = Field(default_factory=list)
    allowed_total: int = Field(0, description="new connections allowed, all destinations")
    blocked_total: int = Field(0, description="packets dropped, all destinations")
    admitted: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="address -> {names, expires_in_s}: what DNS answers admitted",
    )
    dns: dict[str, Any] = Field(
        default_factory=dict,
        description="resolver counters: queries, answered, refused, rate_limited, ..., "
        "refused_names",
    )
