"""Pause and resume: the primitives every verb's auto-resume and the reaper use, and the verbs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dsec.contract.runtime import FilesystemPause, MemoryStateful, Pausable, UpperForkable
from dsec.edge.core import EdgeCore, LiveSandbox
from dsec.errors import CapabilityNotSupported, DsecError
from dsec.models import PauseReport, PauseRequest, SandboxInfo, SandboxRef

log = logging.getLogger("dsec.edge")


class PauseVerbs(EdgeCore):
    """Pause and resume: the primitives every verb's auto-resume and the reaper use, and the verbs."""

    def _pausable(self, lv: LiveSandbox) -> Pausable:
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Pausable):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot pause sandboxes", tier=lv.row.tier
            )
        return rt

    async def _pause(self, lv: LiveSandbox, mode: str = "auto") -> None:
        """Pause ``lv``: ``auto``/``freeze`` the tier's pause, ``suspend`` memory to a file
        (VM tiers; a frozen sandbox can be suspended too), ``filesystem`` drop every process
        and keep the files (a paused sandbox can be paused so too: it then boots afresh)."""
        rt = self._pausable(lv)
        if mode == "suspend" and not isinstance(rt, MemoryStateful):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} cannot suspend sandboxes to a file (use mode=freeze)",
                tier=lv.row.tier,
            )
        if mode == "filesystem" and not isinstance(rt, FilesystemPause):
            raise CapabilityNotSupported(
                f"tier {lv.row.tier} has no filesystem-only pause (use mode=freeze)",
                tier=lv.row.tier,
            )
        async with lv.lock:
            if mode == "filesystem" and isinstance(rt, FilesystemPause):
                if lv.row.state not in ("running", "paused"):
                    return
                report = _pause_report(await rt.pause_filesystem(lv.handle))
            elif mode == "suspend" and isinstance(rt, MemoryStateful):
                if lv.row.state not in ("running", "paused") or rt.is_suspended(lv.handle):
                    return
                report = _pause_report(await rt.suspend(lv.handle))
            else:
                if lv.row.state != "running":
                    return
                report = _pause_report(await rt.pause(lv.handle))
            now = time.time()
            lv.row.state = "paused"
            lv.row.paused_at = now
            lv.last_pause = report
            self.registry.set_paused(lv.row.id, now)
            self.metrics.pauses.labels(lv.row.tier).inc()

    async def _resume(self, lv: LiveSandbox) -> None:
        rt = self._pausable(lv)
        if isinstance(rt, UpperForkable) and rt.upper_frozen(lv.handle):
            await self._restart_frozen(lv, rt)  # its layer is its children's: never thawed
            return
        async with lv.lock:
            if lv.row.state != "paused":
                return
            await rt.resume(lv.handle)
            lv.row.state = "running"
            lv.row.paused_at = None
            lv.row.last_active = time.time()
            self.registry.set_paused(lv.row.id, None)
            self.metrics.resumes.labels(lv.row.tier).inc()

    async def _restart_frozen(self, lv: LiveSandbox, rt: UpperForkable) -> None:
        """Start a sandbox whose writable layer a shared fork froze again, on a fresh one
        (:meth:`UpperForkable.restart_on_frozen`); it is stopped if that fails."""
        try:
            async with lv.lock:
                if lv.row.state != "paused" or not rt.upper_frozen(lv.handle):
                    return  # restarted by a request that came first, or gone
                row = lv.row
                paths = await asyncio.to_thread(
                    lambda: [str(self.layers.layer_path(d)) for d in row.image_layers]
                )
                spec = self._spec(
                    row.id,
                    row.request,
                    row.owner,
                    list(row.image_layers),
                    paths,
                    forked=row.forked_from is not None,
                )
                lv.handle = await rt.restart_on_frozen(lv.handle, spec)
                row.state = "running"
                row.paused_at = None
                row.last_active = time.time()
                self.registry.set_state(
                    row.id, "running", handle=lv.handle.state, last_active=row.last_active
                )
                self.registry.set_paused(row.id, None)
                self.metrics.resumes.labels(row.tier).inc()
        except DsecError as e:
            await self._destroy(lv, f"restart after a fork failed: {e}"[:500])
            raise

    async def pause_sandbox(self, req: PauseRequest, owner: str) -> SandboxInfo:
        """Pause with ``auto``/``freeze``/``suspend``/``filesystem`` (a mode the tier lacks:
        ``CapabilityNotSupported``)."""
        lv = self._live_for(req.sandbox_id, owner)
        await self._pause(lv, req.mode)
        return self._info(lv.row)

    async def resume_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo:
        lv = self._live_for(req.sandbox_id, owner)
        await self._resume(lv)
        return self._info(lv.row)


def _pause_report(raw: dict[str, Any]) -> PauseReport:
    """A runtime's pause report as the API model: known fields kept, the rest as notes (each
    tier reports what it has: cgroup memory for containers, vCPU state for VMs)."""
    fields = PauseReport.model_fields
    known = {k: v for k, v in raw.items() if k in fields}
    extra = [f"{k}={v}" for k, v in raw.items() if k not in fields]
    if "method" not in known and "mode" in raw:
        known["method"] = str(raw["mode"])
    if extra:
        known["notes"] = [*known.get("notes", []), *extra]
    return PauseReport.model_validate(known)
