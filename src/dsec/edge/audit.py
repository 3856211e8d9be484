"""Evidence of cheating: every refusal the platform makes on a sandbox's behalf, per sandbox.

A sandbox that tries to read ``/proc/kcore``, ``ptrace`` a neighbour, follow a symlink out
of its root through the files API or reach an address its policy does not allow is refused;
this module makes sure the refusal also leaves a record the trainer can read
(``sb.audit()``, ``GET /v1/sandboxes/{id}/audit``, ``dsec.jobs.audit(job)``), so that a
reward function can zero the reward of a rollout that tried.

Glossary:
    entry: one refusal with its time, category (:data:`dsec.models.AUDIT_CATEGORIES`), kind,
        what was refused and, where the mechanism reports it, the process (pid inside the
        sandbox, name, command line). Numbered per sandbox from 1.
    count: the exact number of events of one ``category.kind``. Counts are never sampled.
    cap: how many entries' details a sandbox keeps (``DSEC_AUDIT_ENTRIES``, default 64): the
        first half of the cap (the first attempts are the telling ones), then a ring of the
        newest. ``dropped`` counts the details not kept. A sandbox that floods refusals
        costs the node a fixed amount of memory: O(cap) entries, O(kinds) counters (kinds are
        a closed set per source; network destinations are bounded by the filter's own table).
    sampled counter: a source that only keeps cumulative counters (nftables drops per
        destination, the resolver's refusals, the cgroup's OOM kills) is read when the audit
        is asked for and when the sandbox stops; the increase since the last read becomes
        one entry whose ``count`` says how many events it stands for, timed at the read.

Lifetime: a sandbox's record opens when the edge adds it and closes when it stops; a closed
record (counts and kept entries) stays for the job summary, the newest
``DSEC_AUDIT_STOPPED_KEPT`` (default 4096) of them, until the registry forgets the sandbox.

Switch: ``DSEC_AUDIT=off`` turns recording off on the node (no kernel logging flags, no
reader, nothing kept; ``enabled: false`` in every answer), for A/B measurements.

All methods run on the edge's event loop; a source in another thread hands records over
with ``loop.call_soon_threadsafe(recorder.record, ...)``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import ipaddress
import json
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsec.config import env_choice
from dsec.contract.runtime import Audited, GuardAudited, Handle, Networked, Runtime
from dsec.errors import DsecError, PathOutsideSandbox
from dsec.models import (
    EVIDENCE_CATEGORIES,
    AuditEntry,
    AuditReport,
    AuditSummary,
    ExecResult,
)
from dsec.privileged.landlock import landlock_abi
from dsec.privileged.seccomp_log import (
    GUARD_OTHER_NR,
    GuardLog,
    LandlockDenial,
    SeccompDenial,
    SeccompRecords,
    audit_on,
    enable_kernel_audit,
    process_facts,
    syscall_name,
)

__all__ = [
    "AuditRecorder",
    "AuditSettings",
    "EdgeAudit",
    "interleave_audit",
    "place_entries",
    "place_record",
]

log = logging.getLogger("dsec.audit")

_TEXT_MAX = 256  # characters kept of a detail or command line

Call = tuple[int, float, float | None]
"""One trajectory call for placement: ``(seq, begun_at, committed_at or None)``."""


def _clip(text: str | None) -> str | None:
    if text is None:
        return None
    return text if len(text) <= _TEXT_MAX else text[: _TEXT_MAX - 3] + "..."


@dataclass(frozen=True)
class AuditSettings:
    """The node's audit settings: ``DSEC_AUDIT`` (on/off), ``DSEC_AUDIT_ENTRIES`` (details
    kept per sandbox), ``DSEC_AUDIT_STOPPED_KEPT`` (stopped sandboxes remembered)."""

    enabled: bool = True
    entries_cap: int = 64
    stopped_kept: int = 4096

    @classmethod
    def from_env(cls) -> AuditSettings:
        env = os.environ
        try:
            cap = int(env.get("DSEC_AUDIT_ENTRIES", "64"))
            kept = int(env.get("DSEC_AUDIT_STOPPED_KEPT", "4096"))
        except ValueError as e:
            raise SystemExit(f"invalid audit setting in the environment: {e}") from e
        return cls(
            enabled=audit_on(),
            entries_cap=max(2, min(cap, 100_000)),
            stopped_kept=max(0, kept),
        )


@dataclass
class _SandboxAudit:
    sandbox_id: str
    owner: str
    tier: str
    job: str | None
    cap: int
    counts: Counter[str] = field(default_factory=Counter)
    head: list[AuditEntry] = field(default_factory=list)
    tail: deque[AuditEntry] = field(default_factory=deque)
    next_id: int = 1
    stopped: bool = False
    # cumulative counters last read, per "category.kind|key" (sampled sources)
    baselines: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event | None = None

    def add(self, entry: AuditEntry) -> None:
        if len(self.head) < self.cap // 2:
            self.head.append(entry)
            return
        if self.tail.maxlen is None:
            self.tail = deque(maxlen=self.cap - self.cap // 2)
        self.tail.append(entry)

    def entries(self, after: int = 0) -> list[AuditEntry]:
        return [e for e in (*self.head, *self.tail) if e.id > after]

    @property
    def kept(self) -> int:
        return len(self.head) + len(self.tail)

    def summary(self) -> AuditSummary:
        total = sum(self.counts.values())
        return AuditSummary(
            sandbox_id=self.sandbox_id,
            tier=self.tier,
            job=self.job,
            enabled=True,
            evidence=any(
                n and k.split(".", 1)[0] in EVIDENCE_CATEGORIES for k, n in self.counts.items()
            ),
            total=total,
            counts=dict(sorted(self.counts.items())),
            dropped=self.next_id - 1 - self.kept,
            stopped=self.stopped,
        )


class AuditRecorder:
    """The refusals of every sandbox of one node (see the module docstring)."""

    def __init__(self, settings: AuditSettings | None = None) -> None:
        self.settings = settings or AuditSettings.from_env()
        self._live: dict[str, _SandboxAudit] = {}
        self._stopped: OrderedDict[str, _SandboxAudit] = OrderedDict()
        self.unattributed = 0
        """Refusals a source saw but could not map to a sandbox of this node."""

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # ---------------------------------------------------------------- lifetime
    def open(self, sandbox_id: str, owner: str, tier: str, job: str | None = None) -> None:
        """Start recording for ``sandbox_id`` (idempotent)."""
        if not self.enabled or sandbox_id in self._live:
            return
        self._live[sandbox_id] = _SandboxAudit(
            sandbox_id, owner, tier, job, self.settings.entries_cap
        )

    def close(self, sandbox_id: str) -> AuditSummary | None:
        """The sandbox stopped: keep its record for the job summary (bounded) and end its
        followers. Returns its summary (None if it had no record)."""
        rec = self._live.pop(sandbox_id, None)
        if rec is None:
            return None
        rec.stopped = True
        if rec.changed is not None:
            rec.changed.set()
        if self.settings.stopped_kept > 0:
            self._stopped[sandbox_id] = rec
            while len(self._stopped) > self.settings.stopped_kept:
                self._stopped.popitem(last=False)
        return rec.summary()

    def forget(self, sandbox_ids: Iterable[str]) -> None:
        """Drop what is kept of sandboxes the registry purged."""
        for sid in sandbox_ids:
            self._stopped.pop(sid, None)

    def _get(self, sandbox_id: str) -> _SandboxAudit | None:
        return self._live.get(sandbox_id) or self._stopped.get(sandbox_id)

    def is_live(self, sandbox_id: str) -> bool:
        return sandbox_id in self._live

    # ---------------------------------------------------------------- recording
    def record(
        self,
        sandbox_id: str,
        category: str,
        kind: str,
        detail: str = "",
        *,
        pid: int | None = None,
        comm: str | None = None,
        cmdline: str | None = None,
        exe: str | None = None,
        count: int = 1,
        ts: float | None = None,
    ) -> AuditEntry | None:
        """Count ``count`` events of ``category.kind`` for a live sandbox and keep one entry
        (within the cap; returned). A sandbox this node does not record is counted as
        unattributed."""
        rec = self._live.get(sandbox_id)
        if rec is None:
            if self.enabled:
                self.unattributed += count
            return None
        if count <= 0:
            return None
        rec.counts[f"{category}.{kind}"] += count
        entry = AuditEntry(
            id=rec.next_id,
            ts=time.time() if ts is None else ts,
            category=category,
            kind=kind,
            detail=_clip(detail) or "",
            pid=pid,
            comm=_clip(comm),
            cmdline=_clip(cmdline),
            exe=_clip(exe),
            count=count,
        )
        rec.next_id += 1
        rec.add(entry)
        if rec.changed is not None:
            rec.changed.set()
        return entry

    def sample(
        self,
        sandbox_id: str,
        category: str,
        kind: str,
        key: str,
        value: int,
        detail: str,
    ) -> None:
        """A cumulative counter of a sampled source read now (``key`` tells its instances
        apart, e.g. a destination): its increase since the last read is recorded as one
        entry. A counter that went down (its source restarted) counts from zero again."""
        rec = self._live.get(sandbox_id)
        if rec is None:
            return
        slot = f"{category}.{kind}|{key}"
        before = rec.baselines.get(slot, 0)
        rec.baselines[slot] = value
        delta = value - before if value >= before else value
        if delta > 0:
            self.record(sandbox_id, category, kind, detail, count=delta)

    # ---------------------------------------------------------------- reading
    def summary(self, sandbox_id: str, tier: str = "", job: str | None = None) -> AuditSummary:
        """The counts of one sandbox (an empty summary if nothing was recorded for it)."""
        rec = self._get(sandbox_id)
        if rec is None:
            return AuditSummary(sandbox_id=sandbox_id, tier=tier, job=job, enabled=self.enabled)
        return rec.summary()

    def report(
        self, sandbox_id: str, tier: str = "", job: str | None = None, *, after: int = 0
    ) -> AuditReport:
        """Counts and the kept entries numbered above ``after``."""
        rec = self._get(sandbox_id)
        summary = self.summary(sandbox_id, tier, job)
        return AuditReport(
            **summary.model_dump(),
            entries=rec.entries(after) if rec is not None else [],
            cap=self.settings.entries_cap if self.enabled else 0,
        )

    async def follow(self, sandbox_id: str, after: int = 0) -> AsyncIterator[AuditEntry]:
        """Entries numbered above ``after`` as they come, until the sandbox stops. Entries
        that the cap dropped before they were read are skipped (the counts keep them)."""
        last = after
        while True:
            rec = self._get(sandbox_id)
            if rec is None:
                return
            if rec.changed is None:
                rec.changed = asyncio.Event()
            rec.changed.clear()
            for e in rec.entries(last):
                last = e.id
                yield e
            if rec.stopped:
                return
            # one event for every follower: a bounded wait covers a wake-up another
            # follower's clear() took away
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.changed.wait(), 1.0)


# ----------------------------------------------------------------------------- the edge's side
def _files_kind(err: DsecError) -> str:
    text = err.message
    if "tar " in text:
        return "tar_member"
    if "mount boundary" in text:
        return "mount_boundary"
    if "'..'" in text:
        return "dotdot"
    return "outside_root"


class EdgeAudit:
    """What the edge runs for the audit: the recorder, the seccomp listener
    (:mod:`dsec.privileged.seccomp_log`) and the reads of the sampled sources (a tier's
    limit counters, the network filter's drops and the resolver's refusals).

    The edge calls :meth:`sandbox_added` when it adds a live sandbox (created or recovered),
    :meth:`sandbox_stopping` before it tears one down, :meth:`refusal` for a refusal it
    raises itself and :meth:`exec_result` for each command's result."""

    def __init__(self, settings: AuditSettings | None = None) -> None:
        self.recorder = AuditRecorder(settings)
        self._by_auid: dict[int, str] = {}
        self._auid_of: dict[str, int] = {}
        self._seccomp: SeccompRecords | None = None
        self.calls: Callable[[str], list[Call]] | None = None
        """The last calls of a sandbox's trajectory (set by the edge): a kernel record is
        placed among them when it arrives."""
        self.fallbacks = 0
        """Refusals of :data:`FALLBACK_SYSCALLS` seen (not recorded: no evidence)."""
        self.seccomp_status = "off" if not self.recorder.enabled else "not started"
        """``listening`` or why the node gets no seccomp records."""
        self._guard_seen: dict[str, int] = {}
        """Per sandbox of a guarded tier: the number of the last guard record read."""
        self.landlock_status = "off" if not self.recorder.enabled else "not started"
        """``listening`` or why the node gets no Landlock records."""
        self._domains: OrderedDict[int, str] = OrderedDict()
        """Landlock domain id -> the sandbox whose process made it (newest 4096)."""
        self._unplaced: deque[LandlockDenial] = deque(maxlen=256)
        """Landlock refusals whose domain's record has not come yet."""

    @property
    def enabled(self) -> bool:
        return self.recorder.enabled

    def start(self, wants_seccomp: bool, landlock: bool = False) -> None:
        """Start the seccomp listener if a tier logs its refusals (``wants_seccomp``), and
        with ``landlock`` (a tier whose Landlock domains log theirs) take Landlock's records
        too where the kernel has them (6.15+), enabling the kernel's audit if it is not
        (:func:`~dsec.privileged.seccomp_log.enable_kernel_audit`; ``DSEC_AUDIT_LANDLOCK=off``
        leaves the kernel's audit as it is and records none)."""
        if not self.enabled or not wants_seccomp or self._seccomp is not None:
            return
        reader = SeccompRecords(self._on_seccomp, self._on_landlock)
        why = reader.start()
        if why is not None:
            self.seccomp_status = self.landlock_status = why
            log.warning("seccomp refusals will not be recorded: %s", why)
            return
        self._seccomp = reader
        self.seccomp_status = "listening"
        if not landlock:
            self.landlock_status = "no tier logs Landlock refusals"
        elif env_choice("DSEC_AUDIT_LANDLOCK", ("on", "off")) == "off":
            self.landlock_status = "off (DSEC_AUDIT_LANDLOCK)"
        elif landlock_abi() < 7:
            self.landlock_status = "the kernel has no Landlock audit (Linux 6.15+, ABI 7)"
        else:
            why = enable_kernel_audit()
            self.landlock_status = "listening" if why is None else why
        if self.landlock_status != "listening" and landlock:
            log.warning("Landlock refusals will not be recorded: %s", self.landlock_status)

    def close(self) -> None:
        if self._seccomp is not None:
            self._seccomp.close()
            self._seccomp = None

    # ---------------------------------------------------------------- lifetime
    def sandbox_added(
        self,
        sandbox_id: str,
        owner: str,
        tier: str,
        job: str | None,
        rt: Runtime | None,
        handle: Handle,
    ) -> None:
        if not self.enabled:
            return
        self.recorder.open(sandbox_id, owner, tier, job)
        if handle.state:
            self.bind(sandbox_id, rt, handle)

    def bind(self, sandbox_id: str, rt: Runtime | None, handle: Handle) -> None:
        """Map the audit id the tier gave the sandbox's processes to it (once it is made)."""
        if not self.enabled or not isinstance(rt, Audited):
            return
        try:
            auid = rt.audit_id(handle)
        except Exception:  # a sandbox without state: nothing to map
            auid = None
        if auid is not None:
            self._by_auid[auid] = sandbox_id
            self._auid_of[sandbox_id] = auid

    def _unbind(self, sandbox_id: str) -> None:
        self._guard_seen.pop(sandbox_id, None)
        auid = self._auid_of.pop(sandbox_id, None)
        if auid is not None and self._by_auid.get(auid) == sandbox_id:
            del self._by_auid[auid]

    def discard(self, sandbox_id: str) -> None:
        """A creation that failed: nothing is kept of it."""
        self._unbind(sandbox_id)
        self.recorder.close(sandbox_id)
        self.recorder.forget((sandbox_id,))

    async def sandbox_stopping(
        self,
        sandbox_id: str,
        rt: Runtime | None,
        handle: Handle,
        *,
        reason: str = "",
    ) -> AuditSummary | None:
        """Read the sampled sources a last time (before the teardown removes them), then
        close the record. Returns the sandbox's summary."""
        if not self.recorder.is_live(sandbox_id):
            return None
        with contextlib.suppress(Exception):
            await self.sample(sandbox_id, rt, handle)
        self._unbind(sandbox_id)
        return self.recorder.close(sandbox_id)

    # ---------------------------------------------------------------- sources
    def refusal(self, sandbox_id: str, owner: str, err: DsecError) -> None:
        """A refusal the edge or a tier's files API raised for ``owner``'s sandbox."""
        rec = self.recorder._live.get(sandbox_id)
        if rec is None or rec.owner != owner:
            return
        if isinstance(err, PathOutsideSandbox):
            self.recorder.record(sandbox_id, "files", _files_kind(err), err.message)

    def exec_result(
        self,
        sandbox_id: str,
        res: ExecResult,
        cmd: list[str] | str,
        *,
        oom_from_result: bool = False,
    ) -> None:
        """Limits a command hit: its time-out, its output cap and, with ``oom_from_result``
        (a tier that is not :class:`~dsec.contract.runtime.Audited`, whose OOM kills no counter
        of the sandbox shows: the VM tiers, where the guest's agent tells per command), an
        OOM kill."""
        if not self.enabled or res.replayed:
            return
        argv = cmd if isinstance(cmd, str) else " ".join(cmd)
        if oom_from_result and res.oom_killed:
            self.recorder.record(
                sandbox_id,
                "limits",
                "oom_kill",
                _LIMIT_TEXT["oom_kill"],
                cmdline=argv,
            )
        if res.timed_out:
            self.recorder.record(
                sandbox_id,
                "limits",
                "exec_timeout",
                "the command ran past its timeout_s",
                cmdline=argv,
            )
        if res.truncated:
            self.recorder.record(
                sandbox_id,
                "limits",
                "output_cap",
                "the command's output was cut at the cap",
                cmdline=argv,
            )

    async def sample(
        self, sandbox_id: str, rt: Runtime | None, handle: Handle, *, network: bool = True
    ) -> None:
        """Read the sampled sources of a live sandbox now (limit counters and, with
        ``network``, the packet filter's drops and the resolver's refusals); increases
        become entries."""
        if not self.recorder.is_live(sandbox_id) or rt is None:
            return
        if isinstance(rt, Audited):
            try:  # two small cgroup files: read here, a worker thread's hop cost more (a
                # job kill of 5,000 took twice as long with the hop on each sandbox's kill)
                limits = rt.limit_counters(handle)
            except Exception:
                limits = {}
            for kind, value in limits.items():
                self.recorder.sample(
                    sandbox_id, "limits", kind, "", value, _LIMIT_TEXT.get(kind, kind)
                )
        if isinstance(rt, GuardAudited):
            try:
                guard = await rt.guard_log(handle, self._guard_seen.get(sandbox_id, 0))
            except Exception:
                guard = None
            if guard is not None:
                self._record_guard(sandbox_id, guard)
        if network and isinstance(rt, Networked):
            try:
                stats = await rt.network_stats(handle)
            except Exception:
                stats = {}
            self._sample_network(sandbox_id, stats)

    def _sample_network(self, sandbox_id: str, stats: dict[str, Any]) -> None:
        if not stats.get("enabled"):
            return
        gateway = str(stats.get("gateway") or "")
        for b in stats.get("blocked") or []:
            dest = str(b.get("destination", "?"))
            proto = str(b.get("protocol", ""))
            port = b.get("port")
            where = f"{dest}:{port}/{proto}" if port is not None else f"{dest}/{proto}"
            kind = _destination_kind(dest, gateway)
            self.recorder.sample(
                sandbox_id,
                "network",
                kind,
                where,
                int(b.get("packets", 0)),
                f"packets to {where} dropped by the network policy",
            )
        dns = stats.get("dns") or {}
        if not isinstance(dns, dict):
            return
        names = dns.get("refused_names") or {}
        if isinstance(names, dict) and names:
            for name, n in names.items():
                self.recorder.sample(
                    sandbox_id,
                    "dns",
                    "refused",
                    str(name),
                    int(n),
                    f"DNS name {name} refused by the resolver (not allowed)",
                )
        elif isinstance(dns.get("refused"), int):
            self.recorder.sample(
                sandbox_id, "dns", "refused", "", dns["refused"], "DNS names refused"
            )
        if isinstance(dns.get("rate_limited"), int):
            self.recorder.sample(
                sandbox_id,
                "dns",
                "rate_limited",
                "",
                dns["rate_limited"],
                "DNS queries dropped by the sandbox's rate limit",
            )

    def _record_guard(self, sandbox_id: str, guard: GuardLog) -> None:
        """A VM guard's refusals read from the guest: each system call's count is a sampled
        counter (its increase is recorded exactly); the new records the guest kept give
        that increase its processes (one entry per process and call), the rest of it is
        one entry without one (a flood outran the guest's ring of details)."""
        rec = self.recorder._live.get(sandbox_id)
        if rec is None:
            return
        self._guard_seen[sandbox_id] = max(self._guard_seen.get(sandbox_id, 0), guard.next - 1)
        shown: dict[int, Counter[tuple[int, str, str]]] = {}
        first: dict[tuple[int, int, str, str], SeccompDenial] = {}
        for _, d in guard.records:
            nr = d.syscall if d.arch == _AUDIT_ARCH_X86_64 else GUARD_OTHER_NR
            who = (d.pid, d.comm, d.exe)
            shown.setdefault(nr, Counter())[who] += 1
            first.setdefault((nr, *who), d)
        for nr, total in sorted(guard.counts.items()):
            slot = f"guard.{nr}"
            before = rec.baselines.get(slot, 0)
            rec.baselines[slot] = total
            delta = total - before if total >= before else total
            if delta <= 0:
                continue
            name = "foreign_arch" if nr == GUARD_OTHER_NR else syscall_name(_AUDIT_ARCH_X86_64, nr)
            if name in FALLBACK_SYSCALLS:
                self.fallbacks += delta
                continue
            why = f"{name}() refused by the guest's guard (its seccomp filter)"
            for (pid, comm, exe), n in (shown.get(nr) or Counter()).items():
                n = min(n, delta)
                if n <= 0:
                    break
                d = first[(nr, pid, comm, exe)]
                detail = f"{why}, guest pid {pid}"
                self.recorder.record(
                    sandbox_id, "guard", name, detail, comm=comm or None, exe=exe or None,
                    count=n, ts=d.ts,
                )  # fmt: skip
                delta -= n
            if delta > 0:
                self.recorder.record(
                    sandbox_id, "guard", name, f"{why}; the guest kept no details", count=delta
                )

    def _on_landlock(self, batch: list[LandlockDenial]) -> None:
        """Landlock's records: a domain's record names the process that made it (a worker's
        agent, alive while its sandbox is), whose loginuid names the sandbox; a refusal
        names only its domain. Refusals whose domain is not known yet wait (bounded)."""
        for d in batch:
            if d.kind != "domain":
                continue
            try:
                with open(f"/proc/{d.pid}/loginuid", "rb") as f:
                    sid = self._by_auid.get(int(f.read() or b"-1"))
            except (OSError, ValueError):
                sid = None
            if sid is not None:
                self._domains[d.domain] = sid
                while len(self._domains) > 4096:
                    self._domains.popitem(last=False)
        pending = [*self._unplaced, *(d for d in batch if d.kind == "access")]
        self._unplaced.clear()
        for d in pending:
            sid = self._domains.get(d.domain)
            if sid is None:
                self._unplaced.append(d)
                continue
            where = f": {d.object}" if d.object else ""
            self.recorder.record(
                sid, "landlock", d.blockers, f"{d.blockers} refused by Landlock{where}", ts=d.ts
            )

    def _on_seccomp(self, batch: list[SeccompDenial]) -> None:
        for d in batch:
            sid = self._by_auid.get(d.auid)
            if sid is None:
                self.recorder.unattributed += d.count
                continue
            name = syscall_name(d.arch, d.syscall)
            if name in FALLBACK_SYSCALLS:
                self.fallbacks += d.count
                continue
            pid, cmdline = process_facts(d.pid, d.auid)
            why = errno.errorcode.get(d.errno, str(d.errno)) if d.errno else "refused"
            entry = self.recorder.record(
                sid,
                "syscall",
                name,
                f"{name}() refused by the seccomp filter ({why})",
                pid=pid,
                comm=d.comm or None,
                cmdline=cmdline,
                exe=d.exe or None,
                count=d.count,
                ts=d.ts,
            )
            if entry is not None and self.calls is not None:
                with contextlib.suppress(Exception):
                    entry.seq = place_record(d.ts, time.time(), self.calls(sid))

    def sources(self, rt: Runtime | None) -> dict[str, str]:
        """Per category, what the tier of ``rt`` records it from ('' : it cannot)."""
        if not self.enabled:
            return {}
        seccomp = (
            "kernel seccomp records (audit netlink)"
            if isinstance(rt, Audited) and self.seccomp_status == "listening"
            else ""
        )
        landlock = (
            "kernel Landlock records (audit netlink)"
            if isinstance(rt, Audited) and rt.log_landlock and self.landlock_status == "listening"
            else ""
        )
        return {
            "syscall": seccomp,
            "landlock": landlock,
            "files": "the files API's refusals",
            "network": "policy drops per destination (sampled)"
            if isinstance(rt, Networked)
            else "",
            "dns": "the resolver's refusals (sampled)" if isinstance(rt, Networked) else "",
            "guard": "the guest's seccomp records (sampled)"
            if isinstance(rt, GuardAudited)
            else "",
            "limits": "exec time-outs and output caps"
            + (", cgroup OOM kills and pids limit (sampled)" if isinstance(rt, Audited) else ""),
        }


_AUDIT_ARCH_X86_64 = 0xC000003E

FALLBACK_SYSCALLS: frozenset[str] = frozenset({"clone3"})
"""Refused on purpose so that the C library falls back to a call the filter can inspect
(``clone3`` fails with ENOSYS: glibc's ``posix_spawn``, Python's ``subprocess``, Go and Rust
runtimes try it first and use ``clone``): every ordinary program makes them, so they are no
evidence and are not recorded (:attr:`EdgeAudit.fallbacks` counts them)."""


_LIMIT_TEXT = {
    "oom_kill": "a process was killed for exceeding the memory limit",
    "pids_max": "a fork was refused at the pids limit",
    "disk_full": "the writable layer was full (its disk_mb)",
}


_node_addresses: tuple[float, frozenset[str]] = (0.0, frozenset())


def node_addresses(max_age_s: float = 60.0) -> frozenset[str]:
    """The node's own IPv4 addresses (the kernel's LOCAL routes), read at most once a
    ``max_age_s``."""
    global _node_addresses
    at, known = _node_addresses
    if time.monotonic() - at < max_age_s:
        return known
    found: set[str] = set()
    try:
        with open("/proc/net/fib_trie") as f:
            last = ""
            for line in f:
                text = line.strip()
                if text.startswith("|-- "):
                    last = text[4:]
                elif text.startswith("/32 host LOCAL") and last:
                    found.add(last)
    except OSError:
        pass
    _node_addresses = (time.monotonic(), frozenset(found))
    return _node_addresses[1]


def _destination_kind(dest: str, gateway: str) -> str:
    """``node`` (an address of the node itself: the sandbox's gateway, loopback, any local
    address), ``metadata`` (link-local: cloud metadata services), ``private`` (RFC 1918 and
    other non-public ranges: other sandboxes, internal services), ``blocked`` else."""
    try:
        ip = ipaddress.ip_address(dest)
    except ValueError:
        return "blocked"
    if (gateway and dest == gateway) or ip.is_loopback or dest in node_addresses():
        return "node"
    if ip.is_link_local:
        return "metadata"
    if ip.is_private:
        return "private"
    return "blocked"


# ----------------------------------------------------------------------------- the trajectory
KERNEL_CLOCK_SLACK_S = 0.005
"""How far a kernel record's time may lag the event: the audit clock is the coarse real-time
clock, which advances once a tick (4 ms at HZ=250)."""


def place_record(lower: float, upper: float, calls: list[Call]) -> int | None:
    """The call a kernel record happened after (None: before the first), its event known to
    lie between ``lower`` (its stamp: the coarse clock, which lags) and ``upper`` (when it
    arrived, or the stamp plus :data:`KERNEL_CLOCK_SLACK_S`, whichever is earlier). When it
    could be the previous call's (still running at ``lower``) or the next one's (begun
    before ``upper``), the larger share of the interval decides."""
    upper = max(lower, min(upper, lower + KERNEL_CLOCK_SLACK_S))
    ordered = sorted(calls, key=lambda c: c[1])
    i = bisect.bisect_right([c[1] for c in ordered], upper) - 1
    if i < 0:
        return None
    begun = ordered[i][1]
    if i > 0 and begun > lower:
        committed = ordered[i - 1][2]
        if committed is None or committed >= lower:
            prev_share = (upper if committed is None else min(committed, upper)) - lower
            if prev_share >= upper - begun:
                return ordered[i - 1][0]
    return ordered[i][0]


def place_entries(entries: list[AuditEntry], calls: list[Call]) -> None:
    """Set each entry's ``seq``: the call it happened after (None: before the first).

    That is the last call begun before the entry's time; a kernel record (category
    ``syscall``) may lag its event by :data:`KERNEL_CLOCK_SLACK_S`, so a call begun within
    that slack after it counts as begun before it, unless the call before it was still
    running at the record's time (then the event was that call's)."""
    ordered = sorted(calls, key=lambda c: c[1])
    begins = [c[1] for c in ordered]
    for e in entries:
        if e.seq is not None:  # placed when it was recorded
            continue
        slack = KERNEL_CLOCK_SLACK_S if e.category == "syscall" else 0.0
        i = bisect.bisect_right(begins, e.ts + slack) - 1
        while i > 0 and ordered[i][1] > e.ts:
            committed = ordered[i - 1][2]
            if committed is not None and committed < e.ts:
                break
            i -= 1
        e.seq = ordered[i][0] if i >= 0 else None


def interleave_audit(lines: Iterable[str], entries: list[AuditEntry]) -> Iterator[str]:
    """A trajectory export (header, then entry lines in seq order) with each audit entry as
    a ``{"type": "audit", ...}`` line after the call it happened after (its ``seq``, see
    :func:`place_entries`)."""
    parsed: list[tuple[str, dict[str, Any]]] = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            obj = {}
        parsed.append((line, obj if isinstance(obj, dict) else {}))
    calls: list[Call] = [
        (int(o["seq"]), float(o.get("begun_at") or 0), o.get("committed_at"))
        for _, o in parsed
        if o.get("type") == "entry" and o.get("seq") is not None
    ]
    place_entries(entries, calls)
    after: dict[int | None, list[AuditEntry]] = {}
    for e in sorted(entries, key=lambda e: (e.ts, e.id)):
        after.setdefault(e.seq, []).append(e)
    placed = {c[0] for c in calls}
    for line, obj in parsed:
        if obj.get("type") == "entry":
            yield from (_audit_line(e) for e in after.pop(None, []))
        yield line
        if obj.get("type") == "entry" and obj.get("seq") in placed:
            yield from (_audit_line(e) for e in after.pop(obj["seq"], []))
    for rest in after.values():
        yield from (_audit_line(e) for e in rest)


def _audit_line(e: AuditEntry) -> str:
    return json.dumps({"type": "audit", **e.model_dump(mode="json")}, separators=(",", ":")) + "\n"
