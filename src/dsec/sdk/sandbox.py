"""``AsyncSandbox``: the async facade over one sandbox (E2B-like), with ``commands`` and ``files``.

Example (all sizes in MiB, times in seconds)::

    import asyncio
    from dsec import AsyncSandbox

    async def main() -> None:
        async with await AsyncSandbox.create(image="busybox", memory_mb=256) as sb:
            result = await sb.commands.run("echo hello")
            print(result.stdout, result.exit_code)
            await sb.files.write("/tmp/x.txt", "data")
            print(await sb.files.read_text("/tmp/x.txt"))

    asyncio.run(main())

Networking is off unless asked for (``network=None``): pass a :class:`dsec.NetworkPolicy`
(or its dict form) to :meth:`AsyncSandbox.create`, change it while the sandbox runs with
``await sb.network.update(...)`` and read its counters with ``await sb.network.stats()``::

    sb = await AsyncSandbox.create(network={"allow_domains": ["pypi.org"], "ports": [443]})
    await sb.network.update({"presets": ["pypi", "github"]})

The sync :class:`dsec.Sandbox` is generated from this class (:mod:`dsec.sdk.sync`).

Trajectory sequence numbers: every state-changing call of one sandbox object (``commands.run``
and ``stream``, ``files.write/remove/make_dir/rename/upload_dir``, ``snapshot``) carries the
next number of the object's counter in ``X-Dsec-Seq``. The edge records request and result
durably; a repeated number with the same request returns the recorded result without running
anything (``CommandResult.replayed`` is True). The counter starts at 1 after :meth:`create`;
:meth:`connect` continues at the server's ``next_seq`` (so attaching from a CLI never repeats
anything), and ``connect(id, replay=True)`` starts again at 1: a restarted trainer that
repeats its steps in the same order fast-forwards through the recorded ones, then continues
live. A number is taken when a call starts (calls from one object may run concurrently; the
edge accepts them slightly out of order). When a call fails, the SDK checks whether the edge
recorded its number (the log is dense: it did iff the server's ``next_seq`` is past it) and,
if not (connection refused, body too large, request validation, a sandbox that did not
start the call), hands the number to the next call, so numbering never leaves a gap. Two objects that
drive the same sandbox at once must not both number their calls: one of them gets
``SequenceConflict``. Errors: ``SequenceGap`` (a number was skipped), ``SequenceConflict``
(a number reused for a different request), ``OutcomeUnknown`` (a call was begun before an edge
crash and never recorded: it is not re-run).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import heapq
import inspect
import io
import json
import os
import posixpath
import re
import secrets
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from dsec.canonical import canonical_digest  # the edge's request digest, to match it
from dsec.contract.verbs import REPLAYED_HEADER, Envelope
from dsec.errors import (
    CreationRateExceeded,
    DsecError,
    FileNotFound,
    ImageNotReady,
    InvalidRequest,
    NodeBusy,
    OutcomeUnknown,
    SandboxNotFound,
    SandboxStopped,
    SandboxTimeout,
    SequenceConflict,
    ServiceUnavailable,
    StartFailed,
    error_from_wire,
)
from dsec.models import (
    MAX_FORK,
    AuditEntry,
    AuditReport,
    BatchCreateRequest,
    BatchCreateResult,
    BatchItemError,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    FileList,
    ForkRequest,
    ForkResult,
    LayerInfo,
    ListFilesRequest,
    LogLine,
    MigrateRequest,
    MigrateResult,
    NetworkPolicyRequest,
    NetworkStats,
    OnTimeout,
    PauseRequest,
    PortAccess,
    RemoveFileRequest,
    RenameRequest,
    SandboxExecRequest,
    SandboxInfo,
    SandboxMetrics,
    SandboxPathRequest,
    SandboxRef,
    SandboxSnapshotRequest,
    SandboxUptime,
    SetTTLRequest,
)
from dsec.network.policy import NetworkPolicy
from dsec.sdk._http import IDEMPOTENCY_HEADER, SEQ_HEADER, not_delivered
from dsec.sdk._tar import tar_directory
from dsec.sdk.client import AsyncClient
from dsec.wire import ANSWER, validated

if TYPE_CHECKING:
    from dsec.sdk.display import AsyncDisplay
    from dsec.sdk.group import AsyncSandboxGroup
    from dsec.sdk.ports import AsyncPortForward

__all__ = [
    "IDEMPOTENCY_HEADER",
    "REPLAYED_HEADER",
    "SEQ_HEADER",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncNetwork",
    "AsyncSandbox",
    "CommandResult",
    "ForkMethod",
    "ForkParent",
    "GroupSetup",
    "NetworkPolicyLike",
    "OutputCallback",
]

CommandResult = ExecResult
"""The result of ``commands.run``: ``stdout``, ``stderr``, ``exit_code``, ``.ok``,
``.truncated``, and ``replayed`` (True when the edge answered from the trajectory log
without running the command)."""

ForkMethod = Literal["auto", "shared", "pack"]
ForkParent = Literal["keep", "pause", "continue"]
GroupSetup = str | Sequence[str] | Callable[[Any], Awaitable[None] | None]
"""A group's set-up: commands, or a function of the set-up sandbox (see create_group)."""
FORK_TIMEOUT_S = 600.0
"""Default wait for a fork (one snapshot plus n creations), seconds."""

SNAPSHOT_TIMEOUT_S = 600.0
"""Default wait for a snapshot (pack_diff of the writable layer), seconds."""

_PATH_MAX = 4096

OutputCallback = Callable[[str], Any]
T = TypeVar("T")
"""Called with each output chunk (str); may be a plain function or a coroutine function."""

CREATE_TIMEOUT_S = 120.0
"""Default wait for a sandbox to be created, seconds."""

EXEC_GRACE_S = 30.0
"""Extra seconds the client waits beyond a command's own timeout before giving up."""

FOLLOW_TIMEOUT_S = 24 * 3600.0
"""How long ``logs(follow=True)`` may run by default, seconds."""

TRANSFER_TIMEOUT_S = 600.0
"""Default wait for a file or tar transfer, seconds."""

NetworkPolicyLike = NetworkPolicy | Mapping[str, Any]
"""A :class:`dsec.NetworkPolicy` or its dict form (``{"allow_domains": [...], ...}``)."""

_SANDBOX_ID = re.compile(r"^sb-[a-z0-9-]{1,64}$")


async def _call(callback: OutputCallback | None, data: str) -> None:
    if callback is not None:
        out = callback(data)
        if inspect.isawaitable(out):
            await out


_NOT_YET = "sb-pending-0"
"""The sandbox id in a request checked before its sandbox exists (replaced before sending)."""


class AsyncCommands:
    """Run commands in one sandbox: ``sb.commands``."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _request(
        self,
        cmd: str | builtins.list[str],
        cwd: str | None,
        env: dict[str, str] | None,
        timeout: float,
        stdin: str | bytes | None,
        user: str | None,
        max_output_bytes: int,
    ) -> ExecRequest:
        fields: dict[str, Any] = {
            "cmd": cmd,
            "cwd": cwd,
            "env": env or {},
            "timeout_s": timeout,
            "user": user,
            "max_output_bytes": max_output_bytes,
        }
        if isinstance(stdin, bytes):
            fields["stdin_b64"] = base64.b64encode(stdin).decode()
        else:
            fields["stdin"] = stdin
        # what is None is left unset: the server's defaults apply, and the body says no more
        req: ExecRequest = validated(
            ExecRequest, **{k: v for k, v in fields.items() if v is not None}
        )
        return req

    async def run(
        self,
        cmd: str | builtins.list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        stdin: str | bytes | None = None,
        user: str | None = None,
        max_output_bytes: int = 1 << 20,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Run ``cmd`` and wait for it.

        Args:
            cmd: a string (run by ``/bin/sh -c``) or an argv list (exec'd as is).
            cwd: working directory; default the sandbox's workdir.
            env: extra environment variables.
            timeout: wall-clock limit of the command, seconds; on expiry it is killed and
                the result has ``timed_out=True`` (no exception).
            stdin: text or bytes fed to the command's stdin.
            user: run as this user (name, uid or uid:gid).
            max_output_bytes: cap per stream, bytes; the rest is dropped (``.truncated``).
            on_stdout, on_stderr: called with each chunk as it arrives (then the result's
                stdout/stderr are the concatenated chunks).

        Returns:
            The :data:`CommandResult`. A non-zero exit is not an exception: check ``.ok``.
        """
        req = self._request(cmd, cwd, env, timeout, stdin, user, max_output_bytes)
        sb = self._sandbox
        if on_stdout is None and on_stderr is None:
            if sb._replay_pending or sb._replay_log is not None:
                # the request as the edge records it (defaults left out)
                seen = req.model_dump(mode="json", exclude_defaults=True)
                recorded = await sb._local_replay("exec", seen)
                if recorded is not None:
                    answer = CommandResult.model_validate(recorded, context=ANSWER)
                    answer.replayed = True
                    return answer
            # ``replayed`` in the answer, as its X-Dsec-Replayed header says
            ran: CommandResult = await sb._sequenced_call(
                "exec", SandboxExecRequest.of(sb.id, req), timeout=timeout + EXEC_GRACE_S
            )
            return ran
        stdout: builtins.list[str] = []
        stderr: builtins.list[str] = []
        result: ExecResult | None = None
        async for event in self._events(req):
            if event.type == "stdout" and event.data is not None:
                stdout.append(event.data)
                await _call(on_stdout, event.data)
            elif event.type == "stderr" and event.data is not None:
                stderr.append(event.data)
                await _call(on_stderr, event.data)
            elif event.type == "exit":
                result = event.result
        assert result is not None  # _events guarantees an exit event or raises
        # what the result carries but never came as a chunk (a command that could not
        # start: the edge's message is in the result only) goes to the callbacks too
        if not stdout and result.stdout:
            stdout.append(result.stdout)
            await _call(on_stdout, result.stdout)
        if not stderr and result.stderr:
            stderr.append(result.stderr)
            await _call(on_stderr, result.stderr)
        return CommandResult.model_validate(
            {**result.model_dump(), "stdout": "".join(stdout), "stderr": "".join(stderr)}
        )

    async def stream(
        self,
        cmd: str | builtins.list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        stdin: str | bytes | None = None,
        user: str | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> AsyncIterator[ExecEvent]:
        """Run ``cmd`` and yield its events as they come: ``stdout``/``stderr`` chunks, then
        exactly one ``exit`` event carrying the :class:`ExecResult`. An ``error`` event from
        the server is raised as its :class:`dsec.errors.DsecError`. Arguments as :meth:`run`.
        """
        req = self._request(cmd, cwd, env, timeout, stdin, user, max_output_bytes)
        async for event in self._events(req):
            yield event

    async def _events(self, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        sb = self._sandbox
        seq = sb._take_seq()
        opened = False
        try:
            async with sb._client._http.stream(
                "POST",
                sb._path("/exec/stream"),
                json=_dump(req),
                headers={SEQ_HEADER: str(seq)},
                timeout=req.timeout_s + EXEC_GRACE_S,
            ) as response:
                opened = True
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = ExecEvent.model_validate_json(line, context=ANSWER)
                    if event.type == "error":
                        raise error_from_wire(500, {"error": event.error or {}})
                    if event.type not in ("stdout", "stderr", "exit"):
                        continue  # an event a newer server sends that this SDK does not know
                    yield event
                    if event.type == "exit":
                        return
        except DsecError as err:
            if not opened:
                await sb._settle_seq(seq, err)
            raise
        raise error_from_wire(
            500, {"error": {"code": "internal", "message": "exec stream ended without exit"}}
        )


class AsyncFiles:
    """Files of one sandbox: ``sb.files``. Paths are absolute paths inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def _req(self, method: str, suffix: str, **kw: Any) -> httpx.Response:
        sb = self._sandbox
        return await sb._client._http.request(method, sb._path(suffix), **kw)

    async def _changing(self, method: str, suffix: str, **kw: Any) -> httpx.Response:
        return await self._sandbox._sequenced(method, suffix, **kw)

    async def read(self, path: str, *, timeout: float = TRANSFER_TIMEOUT_S) -> bytes:
        """The contents of the file at ``path``. Raises ``FileNotFound``."""
        r = await self._req("GET", "/files", params={"path": path}, timeout=timeout)
        return r.content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file at ``path`` decoded as text (errors replaced)."""
        return (await self.read(path)).decode(encoding, "replace")

    async def write(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        timeout: float = TRANSFER_TIMEOUT_S,
    ) -> FileInfo:
        """Write ``data`` (str is UTF-8 encoded) to ``path``, creating parent directories.

        Args:
            mode: permission bits, e.g. ``0o755``.
        """
        body = data.encode() if isinstance(data, str) else bytes(data)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"mode must be within 0..0o7777, got {mode:#o}", mode=mode)
        _check_path(path)
        r = await self._changing(
            "PUT",
            "/files",
            params={"path": path, "mode": format(mode, "o")},
            content=body,
            headers={"content-type": "application/octet-stream"},
            timeout=timeout,
        )
        return FileInfo.model_validate(r.json(), context=ANSWER)

    async def list(self, path: str = "/", *, depth: int = 1) -> builtins.list[FileInfo]:
        """Entries under the directory ``path``, ``depth`` levels deep (1 = direct children)."""
        sb = self._sandbox
        req = validated(ListFilesRequest, sandbox_id=sb.id, path=path, depth=depth)
        listed: FileList = await sb._client._http.call("list_files", req)
        return listed.entries

    async def stat(self, path: str) -> FileInfo:
        """Metadata of ``path`` (not following a final symlink). Raises ``FileNotFound``."""
        sb = self._sandbox
        req = validated(SandboxPathRequest, sandbox_id=sb.id, path=path)
        info: FileInfo = await sb._client._http.call("stat_file", req)
        return info

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        try:
            await self.stat(path)
        except FileNotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory (non-empty only with ``recursive=True``)."""
        _check_path(path)
        sb = self._sandbox
        req = validated(RemoveFileRequest, sandbox_id=sb.id, path=path, recursive=recursive)
        await sb._sequenced_call("remove_file", req)

    async def make_dir(self, path: str) -> FileInfo:
        """Create directory ``path`` and its parents (no error if it exists)."""
        _check_path(path)
        sb = self._sandbox
        req = validated(SandboxPathRequest, sandbox_id=sb.id, path=path)
        info: FileInfo = await sb._sequenced_call("make_dir", req)
        return info

    async def rename(self, src: str, dst: str) -> FileInfo:
        """Rename ``src`` to ``dst``."""
        _check_path(src)
        _check_path(dst)
        sb = self._sandbox
        req = validated(RenameRequest, sandbox_id=sb.id, src=src, dst=dst)
        info: FileInfo = await sb._sequenced_call("rename_file", req)
        return info

    async def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        remote_path: str,
        *,
        timeout: float = TRANSFER_TIMEOUT_S,
    ) -> int:
        """Copy the local directory's contents into ``remote_path`` (one tar upload).

        Regular files, directories and symlinks are sent; other file types are skipped.
        Returns the number of entries the server wrote.
        """
        _check_path(remote_path)
        data = await asyncio.to_thread(tar_directory, Path(local_dir))
        r = await self._changing(
            "PUT",
            "/files/tar",
            params={"path": remote_path},
            content=data,
            headers={"content-type": "application/x-tar"},
            timeout=timeout,
        )
        return int(r.json()["files"])

    async def download_dir(
        self,
        remote_path: str,
        local_dir: str | os.PathLike[str],
        *,
        timeout: float = TRANSFER_TIMEOUT_S,
    ) -> builtins.list[str]:
        """Copy ``remote_path`` (a directory or file) into ``local_dir`` (created if missing).

        Extraction is safe: members with absolute paths, ``..``, links pointing outside
        ``local_dir``, devices and FIFOs are refused (``InvalidRequest``) before anything is
        written; set-uid/set-gid bits are dropped. Returns the relative paths written.
        """
        r = await self._req("GET", "/files/tar", params={"path": remote_path}, timeout=timeout)
        return await asyncio.to_thread(_safe_extract, r.content, Path(local_dir))


def _policy(policy: NetworkPolicyLike) -> NetworkPolicy:
    """Validate a policy client-side (``InvalidRequest`` naming the field and value)."""
    if isinstance(policy, NetworkPolicy):
        return policy
    if not isinstance(policy, Mapping):
        raise InvalidRequest(
            f"network policy must be a NetworkPolicy or a dict, got {type(policy).__name__}"
        )
    return NetworkPolicy.parse(policy)


class AsyncNetwork:
    """The network policy of one sandbox: ``sb.network``.

    A sandbox created with ``network=None`` (the default) has no network at all and none
    can be added later (``CapabilityNotSupported``); one created with a policy can have it
    replaced at any time. Policy format and presets: ``docs/network.md``.
    """

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    @property
    def policy(self) -> NetworkPolicy | None:
        """The policy as the server last reported it (None: no network)."""
        return self._sandbox.info.network

    async def update(self, policy: NetworkPolicyLike) -> SandboxInfo:
        """Replace the sandbox's policy. New connections see it at once; established ones
        continue. DNS admissions the new policy no longer allows are revoked.

        Raises ``InvalidRequest`` (bad policy, unknown preset), ``CapabilityNotSupported``
        (the sandbox was created without a network), ``SandboxStopped`` (it is dead).
        Returns the sandbox's updated info (``info.network`` is the new policy).
        """
        sb = self._sandbox
        req = validated(NetworkPolicyRequest, sandbox_id=sb.id, policy=_policy(policy))
        sb._info = await sb._client._http.call("update_network", req)
        return sb._info

    async def stats(self) -> dict[str, Any]:
        """Counters of the sandbox's network, as a dict:

        * ``enabled``: False for a sandbox without a network (then nothing else);
        * ``allowed``: new connections by destination, ``[{"destination", "protocol",
          "port", "connections", "names"}]`` (``names``: the DNS names that admitted it);
        * ``blocked``: dropped packets by destination, ``[{"destination", "protocol",
          "port", "packets"}]`` (a retried SYN counts again);
        * ``allowed_total``, ``blocked_total``; ``admitted``: addresses admitted by DNS
          answers with the names and seconds until they expire;
        * ``dns``: resolver counters (``queries``, ``answered``, ``refused``,
          ``rate_limited``, ..., ``refused_names``); ``policy``: the policy in force.
        """
        sb = self._sandbox
        req = validated(SandboxRef, sandbox_id=sb.id)
        stats: NetworkStats = await sb._client._http.call("network_stats", req)
        return stats.model_dump(mode="json", exclude_unset=True)


class AsyncSandbox:
    """One sandbox on a dsec server. Build it with :meth:`create` or :meth:`connect`.

    ``async with`` kills the sandbox on exit. Attributes: ``id``, ``info`` (as last seen;
    :meth:`refresh` updates it), ``commands``, ``files``, ``network``, ``next_seq``. See
    the module docstring for how state-changing calls are numbered.
    """

    def __init__(
        self, info: SandboxInfo, client: AsyncClient, *, owns_client: bool, next_seq: int = 1
    ) -> None:
        self._info = info
        self._client = client
        self._owns_client = owns_client
        self._next_seq = next_seq
        self._free_seqs: builtins.list[int] = []  # heap of numbers handed back, reused first
        self._replay_pending = False
        self._replay_log: dict[int, dict[str, Any]] | None = None
        self._port_access: PortAccess | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, tier={self._info.tier!r}, state={self._info.state!r})"

    # --- construction -------------------------------------------------------
    @staticmethod
    def _client_for(
        client: AsyncClient | None,
        url: str | None,
        api_key: str | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> tuple[AsyncClient, bool]:
        if client is not None:
            return client, False
        return AsyncClient(url, api_key, transport=transport), True

    @classmethod
    async def create(
        cls,
        tier: str = "container",
        image: str = "busybox",
        layers: builtins.list[str] | None = None,
        *,
        cpu: float = 1.0,
        memory_mb: int = 512,
        disk_mb: int = 1024,
        pids: int = 1024,
        env: dict[str, str] | None = None,
        ttl_s: float | None = 3600.0,
        labels: dict[str, str] | None = None,
        user: str | None = None,
        job: str | None = None,
        workdir: str | None = None,
        on_timeout: OnTimeout = "kill",
        paused_ttl_s: float | None = 24 * 3600.0,
        network: NetworkPolicyLike | None = None,
        full_guest: bool = False,
        start: bool = True,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = CREATE_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and wait until it runs.

        Args:
            tier: ``fncall``, ``container``, ``microvm`` or ``vm``.
            image: image name or ``sha256:<digest>``.
            layers: extra layers stacked above the image (workspaces, toolkits).
            cpu: CPU cores. memory_mb: memory limit, MiB. disk_mb: writable layer, MiB.
            pids: max processes. env: environment of every command.
            ttl_s: idle seconds before ``on_timeout`` applies (None: no idle limit).
            labels: free-form key/values to filter on. user: default exec user (default:
                the image's ``User``, else root).
            job: training-job id: groups sandboxes for :mod:`dsec.jobs` (pause, resume or
                kill the whole job at once). workdir: default cwd (default: the image's
                ``WorkingDir``, else ``/``). The image's ``Env`` is under ``env``.
            on_timeout: ``"kill"`` or ``"pause"`` (free its memory, keep its state) when
                ``ttl_s`` passes without activity; any request resumes a paused sandbox.
            paused_ttl_s: seconds a paused sandbox lives before it is killed (None: no limit).
            network: None (default): no network at all. Else a :class:`dsec.NetworkPolicy`
                or its dict form: allowed domains (``*.`` wildcards), CIDRs, ports,
                protocols, deny rules and operator presets, enforced outside the
                sandbox; :attr:`network` changes it later. Validated here
                (``InvalidRequest``).
            full_guest: ``microvm`` and ``vm`` only (else ``InvalidRequest``): commands get
                the whole guest (every capability, device, ``/proc`` file and syscall: kernel
                work, penetration testing) instead of the container tier's protections. The
                guest agent still lives outside the commands' PID namespace.
            start: run the image's start command (a server, a desktop: see
                :meth:`dsec.Image.start_cmd`); its output is :meth:`logs`. When the image
                has a readiness check, the creation returns once it passes.
            url, api_key, transport: connection (ignored when ``client`` is given).
            timeout: how long to wait for creation, seconds.
            client: a shared :class:`AsyncClient` (its connection pool is reused).
            idempotency_key: sent as ``Idempotency-Key`` (default: a new random one per
                call). The request is repeated under it after a broken connection or a
                503 (the server restarting, a node unreachable) until ``timeout``: the
                server makes at most one sandbox per key, so a repeat never makes a
                second. Pass your own to make a create safe to repeat across processes
                (e.g. a trainer restarted from a checkpoint): the same key answers the
                sandbox made the first time, the same key with other arguments is a
                ``SequenceConflict``.
        """
        req = cls._request(
            tier=tier,
            image=image,
            layers=layers,
            cpu=cpu,
            memory_mb=memory_mb,
            disk_mb=disk_mb,
            pids=pids,
            env=env,
            ttl_s=ttl_s,
            labels=labels,
            user=user,
            job=job,
            workdir=workdir,
            on_timeout=on_timeout,
            paused_ttl_s=paused_ttl_s,
            network=network,
            full_guest=full_guest,
            start=start,
        )
        conn, owned = cls._client_for(client, url, api_key, transport)
        key = idempotency_key if idempotency_key is not None else secrets.token_hex(16)
        info = await _create_waiting_for_image(conn, req, timeout, key)
        return cls(info, conn, owns_client=owned)

    @staticmethod
    def _request(**fields: Any) -> CreateSandboxRequest:
        """The validated creation request from :meth:`create`'s keyword arguments
        (``InvalidRequest`` on a bad or unknown field)."""
        for name in ("layers", "env", "labels"):
            if fields.get(name) is None:
                fields.pop(name, None)
        if fields.get("network") is not None:
            fields["network"] = _policy(fields["network"])
        req: CreateSandboxRequest = validated(CreateSandboxRequest, **fields)
        return req

    @classmethod
    async def create_many(
        cls,
        n: int,
        *,
        all_or_nothing: bool = False,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = CREATE_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
        **sandbox: Any,
    ) -> AsyncSandboxBatch:
        """Create ``n`` sandboxes in one API call (one placement pass on the server).

        Args:
            n: how many (1..1024; larger jobs send several batches).
            all_or_nothing: if any creation fails, kill the ones made and raise that error
                (typed, e.g. ``QuotaExceeded``). Default: partial success is returned and
                every failure is listed in :attr:`AsyncSandboxBatch.errors`.
            timeout: seconds to wait for the whole batch (default scales with ``n``).
            sandbox: the same keyword arguments as :meth:`create` (``tier``, ``image``,
                ``cpu``, ``labels``, ``job``...), applied to every sandbox.

        Returns:
            an :class:`AsyncSandboxBatch` (``async with`` kills them all on exit).
        """
        req = cls._request(**sandbox)
        batch = validated(BatchCreateRequest, n=n, sandbox=req, all_or_nothing=all_or_nothing)
        conn, owned = cls._client_for(client, url, api_key, transport)
        try:
            result: BatchCreateResult = await conn._http.call(
                "create_sandboxes", batch, timeout=timeout + 0.5 * n
            )
        except BaseException:
            if owned:
                await conn.close()
            raise
        sandboxes = [cls(info, conn, owns_client=False) for info in result.sandboxes]
        return AsyncSandboxBatch(result.requested, sandboxes, result.errors, conn, owned)

    @classmethod
    async def create_group(
        cls,
        n: int,
        *,
        setup: GroupSetup | None = None,
        keep_parent: bool = False,
        method: ForkMethod = "auto",
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = CREATE_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
        **sandbox: Any,
    ) -> AsyncSandboxGroup:
        """Set an environment up once and fork it ``n`` ways: create one sandbox, run
        ``setup`` in it, fork it ``n`` ways (:meth:`fork`, ``method``) and return the
        group. The set-up is paid once; on a tier that can (``fork_shared``) the fork costs
        the same whatever the set-up wrote.

        Args:
            n: how many sandboxes (1..256; else ``InvalidRequest``, a ``ValueError``).
            setup: shell commands run in order (the first that exits non-zero stops the
                group: ``StartFailed`` with ``exit_code`` and ``output_tail``), or a
                function of the set-up sandbox: a coroutine function gets the
                :class:`AsyncSandbox`; a plain function (for the sync API,
                ``Sandbox.create_group``) gets the sync :class:`dsec.Sandbox`, in a worker
                thread.
            keep_parent: keep the set-up sandbox (paused, in the group's job) instead of
                killing it once the group exists.
            method: the fork's method (see :meth:`fork`).
            timeout: how long to wait for the set-up sandbox's creation, seconds.
            sandbox: the same keyword arguments as :meth:`create` (``tier``, ``image``,
                ``cpu``, ``env``, ``job``...). The group's job is ``job`` if given, else a
                new ``grp-...`` id.

        Returns:
            an :class:`AsyncSandboxGroup` (``async with`` kills every sandbox of it).
        """
        from dsec.sdk.group import AsyncSandboxGroup

        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORK:
            raise InvalidRequest(f"a group has 1..{MAX_FORK} sandboxes, not {n!r}", n=str(n))
        job = sandbox.pop("job", None) or f"grp-{secrets.token_hex(6)}"
        # every argument checked before anything is made
        cls._request(job=job, **sandbox)
        # the parent's id is set once it exists
        fork = validated(ForkRequest, sandbox_id=_NOT_YET, n=n, method=method, parent="pause")
        conn, owned = cls._client_for(client, url, api_key, transport)
        try:
            parent = await cls.create(job=job, client=conn, timeout=timeout, **sandbox)
            try:
                await _run_setup(parent, setup)
                used, children = await parent._fork(fork, FORK_TIMEOUT_S)
            except BaseException:
                with contextlib.suppress(Exception):
                    await parent.kill()
                raise
        except BaseException:
            if owned:
                await conn.close()
            raise
        if not keep_parent:  # the children hold its frozen layer, not the parent itself
            with contextlib.suppress(SandboxNotFound, SandboxStopped):
                await parent.kill()
        return AsyncSandboxGroup(
            job, children, parent if keep_parent else None, conn, owned, method=used
        )

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        replay: bool = False,
        url: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """Attach to an existing sandbox by id. Raises ``SandboxNotFound``.

        Args:
            replay: number this object's calls from 1 again, so a restarted trainer that
                repeats its calls in the same order gets the recorded results of those
                that already ran (nothing runs twice; ``CommandResult.replayed``) and then
                continues live. Without it, numbering continues at the server's
                ``next_seq`` (every call is new).
        """
        if not isinstance(sandbox_id, str) or not _SANDBOX_ID.match(sandbox_id):
            raise InvalidRequest(f"not a sandbox id: {sandbox_id!r}", sandbox_id=str(sandbox_id))
        conn, owned = cls._client_for(client, url, api_key, transport)
        info: SandboxInfo = await conn._http.call("get_sandbox", SandboxRef(sandbox_id=sandbox_id))
        sb = cls(info, conn, owns_client=owned, next_seq=1 if replay else info.next_seq)
        # fast-forward: the first numbered call fetches the trajectory once; repeats of
        # recorded commands are then answered from it without a round trip each
        sb._replay_pending = replay and info.next_seq > 1
        return sb

    @classmethod
    async def list(
        cls,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
        url: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        client: AsyncClient | None = None,
    ) -> builtins.list[SandboxInfo]:
        """This key's sandboxes (running and paused; add ``include_stopped=True`` for all)."""
        conn, owned = cls._client_for(client, url, api_key, transport)
        try:
            return await conn.list_sandboxes(
                state=state, labels=labels, job=job, include_stopped=include_stopped
            )
        finally:
            if owned:
                await conn.close()

    # --- accessors ------------------------------------------------------------
    @property
    def id(self) -> str:
        """The sandbox id, ``sb-<node>-<random>``."""
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """What the server said about this sandbox last (see :meth:`refresh`)."""
        return self._info

    @property
    def commands(self) -> AsyncCommands:
        """Run commands: ``run``, ``stream``."""
        return AsyncCommands(self)

    @property
    def files(self) -> AsyncFiles:
        """File access: ``read``, ``write``, ``list``, ``upload_dir``, ..."""
        return AsyncFiles(self)

    @property
    def network(self) -> AsyncNetwork:
        """Network policy: ``update``, ``stats``, ``policy``."""
        return AsyncNetwork(self)

    @property
    def display(self) -> AsyncDisplay:
        """Screen, keyboard and pointer: a desktop image's X desktop (any tier), the vm
        tier's console (:mod:`dsec.sdk.display`)."""
        from dsec.sdk.display import AsyncDisplay

        return AsyncDisplay(self)

    # --- ports (the server's port proxy; dsec.sdk.ports) ----------------------
    async def port_access(self) -> PortAccess:
        """The sandbox's access token and the server's host-route domain (asked once,
        then remembered): what :meth:`get_url` and :meth:`get_host` build on."""
        if self._port_access is None:
            r = await self._client._http.request("GET", self._path("/ports"))
            self._port_access = PortAccess.model_validate(r.json(), context=ANSWER)
        return self._port_access

    async def get_url(
        self, port: int, path: str = "/", *, signed: bool = True, host: bool = False
    ) -> str:
        """The URL of ``path`` on TCP ``port`` inside the sandbox, through the server's port
        proxy (HTTP, server-sent events and WebSockets: use ``ws://``/``wss://`` for the
        latter). Works for a sandbox without any network.

        Args:
            port: the port a server listens on inside the sandbox (1..65535).
            path: the path (and query) on that server.
            signed: put the sandbox's access token in the URL, so it works with no header
                (any HTTP client, a browser, a harness that appends paths to a base URL);
                False: the caller sends ``Authorization: Bearer <key>`` or
                ``X-Dsec-Port-Token`` itself. A sandbox with ``public_ports`` needs none.
            host: the host route ``https://{port}-{id}.<domain>/...`` (web apps with
                absolute links; needs DNS for the server's ports domain) instead of the
                path route on the API's own address.

        Example::

            sb.commands.run("python3 -m http.server 8000 >/dev/null 2>&1 &")
            httpx.get(sb.get_url(8000, "/index.html")).text
        """
        from dsec.sdk.ports import port_url

        return port_url(
            self._client.url, await self.port_access(), port, path, signed=signed, host=host
        )

    async def get_host(self, port: int) -> str:
        """``{port}-{id}.<domain>``: the host of ``port``'s host route (E2B's
        ``get_host``); ``CapabilityNotSupported`` when the server has no ports domain.
        Requests to it need a credential (see :meth:`get_url`) unless the sandbox was
        created with ``public_ports``."""
        from dsec.sdk.ports import port_url

        url = port_url(self._client.url, await self.port_access(), port, signed=False, host=True)
        return url.split("://", 1)[1].split("/", 1)[0]

    async def port_forward(
        self, port: int, local_port: int = 0, *, local_host: str = "127.0.0.1"
    ) -> AsyncPortForward:
        """Listen on ``local_host:local_port`` (0: any free port, see ``.local_port``) and
        carry each connection to TCP ``port`` inside the sandbox (raw bytes: any protocol).
        Use as ``async with await sb.port_forward(5432) as fwd:`` (sync: ``with
        sb.port_forward(5432) as fwd:``) or call ``close()``. Needs ``websockets``."""
        from dsec.sdk.ports import AsyncPortForward

        http = self._client._http
        ws_url = http.url.replace("http", "ws", 1).rstrip("/") + self._path(f"/tcp/{int(port)}")
        fwd = AsyncPortForward(ws_url, {"authorization": f"Bearer {http.api_key}"}, int(port))
        await fwd.start(local_port, local_host)
        return fwd

    @property
    def next_seq(self) -> int:
        """The sequence number this object's next state-changing call will carry."""
        return self._free_seqs[0] if self._free_seqs else self._next_seq

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{quote(self._info.id, safe='')}{suffix}"

    @property
    def _ref(self) -> SandboxRef:
        """The request of a verb about this sandbox that says nothing more."""
        return validated(SandboxRef, sandbox_id=self.id)

    def _take_seq(self) -> int:
        if self._free_seqs:
            return heapq.heappop(self._free_seqs)
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _give_back_seq(self, seq: int) -> None:
        heapq.heappush(self._free_seqs, seq)

    async def _sequenced(
        self, method: str, suffix: str, *, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        """Send one state-changing request under the next sequence number."""
        return await self._under_seq(
            lambda seq: self._client._http.request(
                method, self._path(suffix), headers={**(headers or {}), SEQ_HEADER: str(seq)}, **kw
            )
        )

    async def _sequenced_call(
        self, verb: str, req: BaseModel, *, timeout: float | None = None
    ) -> Any:
        """Send one state-changing verb of the table under the next sequence number."""
        return await self._under_seq(
            lambda seq: self._client._http.call(
                verb, req, envelope=Envelope(seq=seq), timeout=timeout
            )
        )

    async def _under_seq(self, send: Callable[[int], Awaitable[T]]) -> T:
        """``send(seq)`` under the next sequence number, which a failure hands back unless
        the edge recorded it."""
        seq = self._take_seq()
        try:
            return await send(seq)
        except DsecError as err:
            await self._settle_seq(seq, err)
            raise

    async def _local_replay(self, op: str, request: dict[str, Any]) -> dict[str, Any] | None:
        """After ``connect(replay=True)``: the recorded result of the next numbered call if
        it is a repeat of what the log holds under that number (same operation, same request
        digest, result recorded in full), taking that number; else None (the call goes to
        the server, which replays or runs it). The log is fetched once, on first use."""
        if self._replay_log is None:
            if not self._replay_pending:
                return None
            self._replay_pending = False
            log: dict[int, dict[str, Any]] = {}
            for line in (await self.trajectory()).splitlines():
                entry = json.loads(line)
                if entry.get("type") == "entry" and entry.get("status") == "ok":
                    log[int(entry["seq"])] = entry
            self._replay_log = log
        if self._free_seqs:
            return None
        seq = self._next_seq
        entry = self._replay_log.get(seq)
        if entry is None:
            if seq > max(self._replay_log, default=0):
                self._replay_log = None  # past the recorded log: every call is live now
            return None
        result = entry.get("result")
        if (
            entry.get("op") != op
            or entry.get("request_digest") != canonical_digest(request)
            or not isinstance(result, dict)
            or any(isinstance(v, dict) and "$sha256" in v for v in result.values())
        ):
            return None
        self._next_seq = seq + 1
        return result

    async def _settle_seq(self, seq: int, err: DsecError) -> None:
        """After a sequenced call failed: hand ``seq`` back unless the edge recorded it."""
        if not_delivered(err):
            self._give_back_seq(seq)
            return
        if isinstance(err, SandboxTimeout | SequenceConflict | OutcomeUnknown):
            return  # it may still be running / it is recorded under another request
        try:
            info = await self.refresh()
        except DsecError:
            return  # cannot tell: keep it used (the next call may see SequenceGap)
        if info.next_seq <= seq:
            self._give_back_seq(seq)

    # --- lifecycle --------------------------------------------------------------
    async def refresh(self) -> SandboxInfo:
        """Fetch the current state from the server and return it."""
        self._info = await self._client._http.call("get_sandbox", self._ref)
        return self._info

    async def set_ttl(self, ttl_s: float) -> SandboxInfo:
        """Kill the sandbox after ``ttl_s`` idle seconds from now."""
        req = validated(SetTTLRequest, sandbox_id=self.id, ttl_s=ttl_s)
        self._info = await self._client._http.call("set_ttl", req)
        return self._info

    async def pause(self, mode: str = "auto") -> SandboxInfo:
        """Pause: freeze every process and give back what memory can be given back.

        Idempotent. ``info.last_pause`` reports memory before and after (bytes) and how
        long it took (ms). Any later request (a command, a file read...) resumes the
        sandbox transparently; :meth:`resume` does it explicitly.

        Args:
            mode: ``"auto"`` (the tier's pause), ``"freeze"`` (the same, explicitly) or
                ``"suspend"``: memory and device state to a file, the VM process exits and
                its host memory is freed (tiers whose capabilities say ``suspend``, else
                ``CapabilityNotSupported``).
        """
        req = validated(PauseRequest, sandbox_id=self.id, mode=mode)
        self._info = await self._client._http.call("pause_sandbox", req)
        return self._info

    async def resume(self) -> SandboxInfo:
        """Resume a paused sandbox (idempotent; a running one is left as is)."""
        self._info = await self._client._http.call("resume_sandbox", self._ref)
        return self._info

    async def snapshot(
        self,
        name: str | None = None,
        scrub: builtins.list[str] | None = None,
        secret_values: builtins.list[str] | None = None,
        *,
        compress: bool = False,
        timeout: float = SNAPSHOT_TIMEOUT_S,
    ) -> LayerInfo:
        """Capture the sandbox's writable layer as a new content-addressed workspace layer
        (``pack_diff``); restore it with ``Sandbox.create(image, layers=[layer.digest])``.

        Args:
            name: also tag an image of this name (the sandbox's layers plus the snapshot).
            scrub: absolute paths or globs left out, on top of the defaults (shell
                histories, package caches, ``/tmp``).
            secret_values: the builder's secrets; a file containing any of them refuses the
                snapshot with ``SecretInSnapshot`` and nothing is stored.
            compress: lz4-compress the layer (smaller; slower to pack).
            timeout: how long to wait, seconds.

        A state-changing call: it is sequenced and recorded in the trajectory log.
        """
        req = validated(
            SandboxSnapshotRequest,
            sandbox_id=self.id,
            name=name,
            scrub=scrub or [],
            secret_values=secret_values or [],
            compress=compress,
        )
        layer: LayerInfo = await self._sequenced_call("snapshot_sandbox", req, timeout=timeout)
        return layer

    async def fork(
        self,
        n: int,
        *,
        labels: dict[str, str] | None = None,
        scrub: builtins.list[str] | None = None,
        memory: bool = False,
        method: ForkMethod = "auto",
        parent: ForkParent = "keep",
        timeout: float = FORK_TIMEOUT_S,
    ) -> builtins.list[AsyncSandbox]:
        """Make ``n`` new sandboxes from this one's files (same image, limits, job;
        ``labels`` merged over this one's), created concurrently.

        The server admits all ``n`` first (``QuotaExceeded``: nothing is created; if one
        creation fails, none is left). The new sandboxes share this object's connection
        pool and number their calls from 1. Each has its own id, hostname, boot id, entropy
        and network identity.

        Args:
            n: how many (1..256).
            labels: labels added to (or overriding) this sandbox's.
            scrub: extra paths left out (``pack`` forks, see :meth:`snapshot`).
            memory: VM tiers: fork from a memory snapshot instead (running processes carry
                over; each new sandbox gets its own copy-on-write disk, RNG seed and clock).
            method: ``"shared"``: the new sandboxes stack on this one's frozen writable
                layer, nothing is copied (the cost does not grow with what this sandbox
                wrote; tiers whose capabilities say ``fork_shared``); ``"pack"``: the layer
                is packed first (``pack_diff``, ~4 ms per MiB; scrubbed like a snapshot);
                ``"auto"``: ``shared`` where the tier can, ``parent`` is not ``"keep"``
                and no ``scrub`` is given.
            parent: ``"keep"`` (default): this sandbox runs on as it was, its processes
                too (the fork packs its writable layer). ``"pause"`` / ``"continue"``: its
                writable layer becomes the new ones' (a shared fork: O(1) in what it
                wrote); it stays paused, and its next request restarts it on a fresh
                writable layer over the frozen one (files kept, processes gone), or it is
                restarted so at once.
            timeout: how long to wait for the snapshot and every creation, seconds.
        """
        req = validated(
            ForkRequest,
            sandbox_id=self.id,
            n=n,
            labels=labels or {},
            scrub=scrub or [],
            memory=memory,
            method=method,
            parent=parent,
        )
        return (await self._fork(req, timeout))[1]

    async def _fork(
        self, req: ForkRequest, timeout: float
    ) -> tuple[str, builtins.list[AsyncSandbox]]:
        """POST the fork; (the method the server used, the new sandboxes)."""
        req = req.model_copy(update={"sandbox_id": self.id})
        result: ForkResult = await self._client._http.call("fork_sandbox", req, timeout=timeout)
        new = [type(self)(info, self._client, owns_client=False) for info in result.sandboxes]
        return result.method, new

    async def migrate(
        self, node: str | None = None, *, timeout: float = SNAPSHOT_TIMEOUT_S
    ) -> MigrateResult:
        """Move the sandbox to another node of a cluster (``node``, or one the server
        picks). VM tiers move their memory state (``method="memory_snapshot"``: running
        processes, memory and files carry over); other tiers move their writable layer as a
        ``pack_diff`` layer (files carry over, running processes do not);
        ``result.processes_carried`` says which. This object then
        refers to the new sandbox (a new id on the target node, numbering its calls from 1).

        Raises ``CapabilityNotSupported`` on a single-node server, ``NotFound`` for an
        unknown node, ``QuotaExceeded`` when the target is full (the sandbox stays where it
        was). ``timeout``: how long to wait, seconds.
        """
        req = validated(MigrateRequest, sandbox_id=self.id, node=node)
        result: MigrateResult = await self._client._http.call(
            "migrate_sandbox", req, timeout=timeout
        )
        self._info = result.sandbox
        self._next_seq = result.sandbox.next_seq or 1
        self._free_seqs = []
        self._replay_pending = False
        self._replay_log = None
        return result

    async def trajectory(self) -> str:
        """The sandbox's trajectory log as JSONL text: a header line (format and the
        create request), then one line per state-changing call in sequence order with
        request, result, timings, exit code and digests of large values. ``dsec replay``
        and :func:`dsec.replay.replay_lines` read it."""
        r = await self._client._http.request("GET", self._path("/trajectory"))
        return r.text

    async def logs(
        self, *, follow: bool = False, timeout: float | None = None
    ) -> AsyncIterator[LogLine]:
        """The output of the image's start command (:meth:`dsec.Image.start_cmd`), as
        :class:`~dsec.models.LogLine` chunks (``stream`` ``stdout``/``stderr``, then one
        ``dsec`` line once the command ended). ``follow``: keep yielding new output until
        the command ends. ``timeout``: seconds for the whole call (default: the client's;
        following, a day). Empty for an image without a start command."""
        async with self._client._http.stream(
            "GET",
            self._path("/logs?follow=true" if follow else "/logs"),
            timeout=timeout if timeout is not None else (FOLLOW_TIMEOUT_S if follow else None),
        ) as response:
            async for line in response.aiter_lines():
                if line.strip():
                    yield LogLine.model_validate_json(line, context=ANSWER)

    async def uptime(self) -> SandboxUptime:
        """How long the sandbox has lived (``uptime_s``), how long it has been idle
        (``idle_s``, what its TTL counts from) and when its TTL ends it (``expires_in_s``).
        Asking neither resumes a paused sandbox nor counts as activity."""
        uptime: SandboxUptime = await self._client._http.call("sandbox_uptime", self._ref)
        return uptime

    async def metrics(self) -> SandboxMetrics:
        """One sample of the sandbox's resource usage: CPU (``usage_s`` cumulative seconds,
        ``used_cores`` / ``used_pct`` since the previous sample), memory (working set, cache
        and limit, bytes), disk (its writable layer, bytes), network (bytes and packets; None
        without a network) and processes. Reading it neither resumes a paused sandbox nor
        extends its TTL. ``CapabilityNotSupported`` on a tier that cannot measure."""
        metrics: SandboxMetrics = await self._client._http.call("sandbox_metrics", self._ref)
        return metrics

    async def audit(self, *, after: int = 0) -> AuditReport:
        """The refusals the platform made on this sandbox's behalf: its evidence of cheating
        (``report.evidence``: any refusal of a boundary; ``report.counts``: exact counts by
        ``category.kind``; ``report.entries``: the kept details, numbered, with time,
        process and what was refused; ``after``: only entries numbered above it). Works
        after the sandbox stopped while the node remembers it. See ``docs/cheating.md``."""
        r = await self._client._http.request(
            "GET", self._path("/audit"), params={"after": str(int(after))}
        )
        return AuditReport.model_validate(r.json(), context=ANSWER)

    async def follow_audit(
        self, *, after: int = 0, timeout: float | None = None
    ) -> AsyncIterator[AuditEntry]:
        """The audit entries numbered above ``after`` as they are recorded, until the
        sandbox stops. ``timeout``: seconds for the whole call (default a day)."""
        async with self._client._http.stream(
            "GET",
            self._path(f"/audit?follow=true&after={int(after)}"),
            timeout=timeout if timeout is not None else FOLLOW_TIMEOUT_S,
        ) as response:
            async for line in response.aiter_lines():
                if line.strip():
                    yield AuditEntry.model_validate_json(line, context=ANSWER)

    async def kill(self) -> SandboxInfo:
        """Kill the sandbox (idempotent) and release this object's connections."""
        try:
            self._info = await self._client._http.call("kill_sandbox", self._ref)
        finally:
            if self._owns_client:
                await self._client.close()
        return self._info

    async def close(self) -> None:
        """Release connections without killing the sandbox (it lives until its TTL)."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.kill()
        except SandboxNotFound:
            pass  # already gone (expired and purged): nothing to clean up


class AsyncSandboxBatch:
    """What :meth:`AsyncSandbox.create_many` made: the created ``sandboxes`` (request order)
    and the ``errors`` of those that were not (``index``, ``code``, ``message``).
    ``async with`` kills every created sandbox on exit."""

    def __init__(
        self,
        requested: int,
        sandboxes: builtins.list[AsyncSandbox],
        errors: builtins.list[BatchItemError],
        client: AsyncClient,
        owns_client: bool,
    ) -> None:
        self._requested = requested
        self._sandboxes = sandboxes
        self._errors = errors
        self._client = client
        self._owns_client = owns_client

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(requested={self._requested}, "
            f"created={len(self._sandboxes)}, failed={len(self._errors)})"
        )

    @property
    def requested(self) -> int:
        """How many sandboxes the call asked for."""
        return self._requested

    @property
    def sandboxes(self) -> builtins.list[AsyncSandbox]:
        """The sandboxes created, in request order."""
        return builtins.list(self._sandboxes)

    @property
    def errors(self) -> builtins.list[BatchItemError]:
        """One entry per sandbox not created: ``index`` (0-based), ``code``, ``message``."""
        return builtins.list(self._errors)

    @property
    def ok(self) -> bool:
        """True when every requested sandbox was created."""
        return not self._errors

    def raise_on_error(self) -> None:
        """Raise the first failure as its typed error (``QuotaExceeded``...) if any failed;
        the created sandboxes stay (kill them with :meth:`kill_all`)."""
        if self._errors:
            first = self._errors[0]
            message = (
                f"{len(self._errors)} of {self._requested} sandboxes were not created; "
                f"first (index {first.index}): {first.message}"
            )
            details = {"failed": len(self._errors), "created": len(self._sandboxes)}
            raise error_from_wire(
                500, {"error": {"code": first.code, "message": message, "details": details}}
            )

    async def kill_all(self) -> int:
        """Kill every created sandbox (those already gone are skipped). Returns how many
        this call killed."""

        async def one(sb: AsyncSandbox) -> int:
            try:
                await sb.kill()
            except (SandboxNotFound, SandboxStopped):
                return 0
            return 1

        try:
            return sum(await asyncio.gather(*(one(sb) for sb in self._owned())))
        finally:
            await self.close()

    def _owned(self) -> builtins.list[AsyncSandbox]:
        """What :meth:`kill_all` kills."""
        return self._sandboxes

    async def close(self) -> None:
        """Release connections without killing the sandboxes."""
        if self._owns_client:
            self._owns_client = False
            await self._client.close()

    async def __aenter__(self) -> AsyncSandboxBatch:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill_all()


async def _run_setup(sb: AsyncSandbox, setup: GroupSetup | None) -> None:
    """Run a group's set-up in ``sb`` (see :meth:`AsyncSandbox.create_group`)."""
    if setup is None:
        return
    if callable(setup):
        if inspect.iscoroutinefunction(setup):
            await setup(sb)
        else:
            from dsec.sdk.sync import _wrap

            await asyncio.to_thread(setup, _wrap(sb))
        return
    for cmd in [setup] if isinstance(setup, str) else setup:
        r = await sb.commands.run(cmd)
        if r.exit_code != 0:
            tail = (r.stdout + r.stderr)[-2000:]
            raise StartFailed(
                f"group set-up command {cmd!r} exited with {r.exit_code}: {tail[-300:]}",
                sandbox_id=sb.id,
                exit_code=r.exit_code,
                output_tail=tail,
            )


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json", exclude_none=True)


async def _create_waiting_for_image(
    conn: AsyncClient, req: CreateSandboxRequest, timeout: float, key: str
) -> SandboxInfo:
    """Send a creation under the idempotency ``key``, and while the server answers that it
    created nothing *yet*
    (``ImageNotReady``: a built-in image still being built on a node that just started;
    ``NodeBusy``: the node's admission queue is full or the kernel was too slow;
    ``CreationRateExceeded``: the key's creations-a-second quota) retry after the delay it
    asks for, until ``timeout`` seconds have passed in all; then the last such error is
    raised. Under an idempotency ``key`` any 503 and a connection that broke without an
    answer are retried too (the key makes a repeat safe), after 0.5 s, doubling to 5 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    envelope = Envelope(idem_key=key)
    backoff = 0.5
    while True:
        left = deadline - loop.time()
        try:
            info: SandboxInfo = await conn._http.call(
                "create_sandbox", req, envelope=envelope, timeout=max(left, 1.0)
            )
            return info
        except (ImageNotReady, NodeBusy, CreationRateExceeded) as e:
            err: DsecError = e
            delay = float(e.details.get("retry_after_s") or 5)
        except ServiceUnavailable as e:
            err, delay = e, float(e.details.get("retry_after_s") or backoff)
            backoff = min(backoff * 2, 5.0)
        if loop.time() + delay >= deadline:
            raise err
        await asyncio.sleep(delay)


def _check_path(path: str) -> None:
    """The apiserver's path rule, checked before a sequence number is taken."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be an absolute path without NUL: {path!r}", path=path)
    if len(path) > _PATH_MAX:
        raise InvalidRequest(f"path is longer than {_PATH_MAX} characters", path=path[:64])


_PATH_MAX = 4096  # bytes of a path the kernel accepts, with its NUL
_NAME_MAX = 255  # bytes of one path component


def _check_member(member: tarfile.TarInfo, dest: Path) -> Path | None:
    """Where ``member`` would land under ``dest``; raises on anything unsafe; None to skip."""
    name = member.name
    if name in ("", "."):
        return None
    if name.startswith("/") or "\0" in name:
        raise InvalidRequest(f"unsafe tar member (absolute path): {name!r}", member=name)
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../"):
        raise InvalidRequest(f"unsafe tar member (escapes the target): {name!r}", member=name)
    target = dest / norm
    # checked before anything is written: the kernel refuses longer paths and names anyway,
    # but only after the members before it were extracted (one at a time, slowly, if deep)
    if len(os.fsencode(str(target))) >= _PATH_MAX or any(
        len(os.fsencode(part)) > _NAME_MAX for part in norm.split("/")
    ):
        raise InvalidRequest(
            f"tar member {name[:80]!r}... is too long to extract under {str(dest)!r} "
            f"(paths up to {_PATH_MAX - 1} bytes, names up to {_NAME_MAX})",
            member=name[:4096],
        )
    if member.issym() or member.islnk():
        link = member.linkname
        base = target.parent if member.issym() else dest
        resolved = posixpath.normpath(posixpath.join(str(base), link))
        if link.startswith("/") or not (resolved + "/").startswith(str(dest) + "/"):
            raise InvalidRequest(f"unsafe tar link {name!r} -> {link!r}", member=name)
    elif not (member.isfile() or member.isdir()):
        raise InvalidRequest(f"refusing special file in tar: {name!r}", member=name)
    return target


def _safe_extract(data: bytes, dest: Path) -> builtins.list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    dest = dest.resolve()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = tar.getmembers()
            written: builtins.list[str] = []
            for member in members:  # check everything before writing anything
                if _check_member(member, dest) is not None:
                    written.append(posixpath.normpath(member.name))
                member.mode &= 0o777  # no set-uid/set-gid/sticky
            safe = [m for m in members if m.name not in ("", ".")]
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=safe, filter="data")
            else:  # Python < 3.11.4: members were validated above
                tar.extractall(dest, members=safe)
    except tarfile.TarError as exc:
        raise InvalidRequest(f"the server sent an invalid tar archive: {exc}") from exc
    return written
