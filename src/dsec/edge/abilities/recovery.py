"""After a (re)start and over time: reconcile the registry with what runs, expire and pause idle sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from dsec.contract.runtime import Handle, MemoryStateful, Pausable
from dsec.edge.abilities.pausing import PauseVerbs
from dsec.edge.core import LiveSandbox
from dsec.errors import DsecError

log = logging.getLogger("dsec.edge")


class RecoveryVerbs(PauseVerbs):
    """After a (re)start and over time: reconcile the registry with what runs, expire and pause idle sandboxes."""

    async def reconcile(self) -> dict[str, int]:
        """Match the registry with reality after a (re)start. Returns counts for the log."""
        recovered = lost = orphans = 0
        for row in self.registry.select(states=("creating", "running", "paused")):
            rt = self.runtimes.get(row.tier)
            handle = Handle(row.id, row.handle)
            ok = False
            if rt is not None and row.state != "creating":
                try:
                    # a VM suspended to a file stays suspended: the next request restores it
                    suspended = isinstance(rt, MemoryStateful) and rt.is_suspended(handle)
                    if row.state == "paused" and isinstance(rt, Pausable) and not suspended:
                        # thaw before the exec path re-attaches (a frozen cgroup would freeze it);
                        # the TTL policy pauses it again if it stays idle
                        with contextlib.suppress(Exception):
                            await rt.resume(handle)
                        row.state = "running"
                        row.paused_at = None
                        self.registry.set_paused(row.id, None)
                    ok = await rt.recover(handle)
                except Exception as e:  # a broken sandbox must not stop the edge
                    log.warning("recover %s failed: %s", row.id, e)
            if ok:
                row.handle = handle.state
                self.registry.set_state(row.id, row.state, handle=handle.state)
                self._add_live(LiveSandbox(row, handle))
                # a store migrated from before owners grants loose layers to nobody: a live
                # sandbox's layers stay its owner's (for forks and snapshots of it)
                with contextlib.suppress(DsecError):
                    self.layers.grant_layers(row.owner, list(row.image_layers))
                recovered += 1
            else:
                if rt is not None:
                    with contextlib.suppress(Exception):
                        await rt.destroy(handle)
                reason = (
                    "creation interrupted by edge restart"
                    if row.state == "creating"
                    else "lost while the edge was down"
                )
                self.registry.set_state(row.id, "stopped", reason=reason)
                self.metrics.kills.labels(row.tier, "lost").inc()
                lost += 1
        known = set(self._live)
        for rt in self.runtimes.values():
            try:
                for sid in await rt.list_orphans(known):
                    with contextlib.suppress(Exception):
                        await rt.destroy_orphan(sid)
                        orphans += 1
            except Exception as e:
                log.warning("orphan scan of %s failed: %s", rt.tier, e)
        if recovered or lost or orphans:
            log.info(
                "reconcile: %d recovered, %d lost, %d orphans removed", recovered, lost, orphans
            )
        return {"recovered": recovered, "lost": lost, "orphans": orphans}

    async def _reap_loop(self) -> None:
        last_purge = 0.0
        while not self._closing:
            await asyncio.sleep(self.limits.reap_interval_s)
            now = time.time()
            try:
                for lv in self._live.values():
                    if lv.inflight or lv.lock.locked():
                        continue
                    row = lv.row
                    if row.state == "paused":
                        pttl = row.request.paused_ttl_s
                        if (
                            pttl is not None
                            and row.paused_at is not None
                            and row.paused_at + pttl < now
                        ):
                            await self._destroy(lv, "paused ttl expired", wait=False)
                        continue
                    exp = row.expires_at
                    if exp is None or exp >= now or row.state != "running":
                        continue
                    rt = self.runtimes.get(row.tier)
                    if row.request.on_timeout == "pause" and isinstance(rt, Pausable):
                        try:
                            # VM tiers: suspend to a file (host memory freed), others: freeze;
                            # timeout_pause=filesystem: only the files are kept
                            if row.request.timeout_pause == "filesystem":
                                mode = "filesystem"
                            else:
                                mode = "suspend" if isinstance(rt, MemoryStateful) else "auto"
                            await self._pause(lv, mode)
                        except Exception as e:
                            log.warning("ttl pause of %s failed (%s); killing it", row.id, e)
                            await self._destroy(lv, "ttl expired", wait=False)
                    else:
                        await self._destroy(lv, "ttl expired", wait=False)
                if now - last_purge > 60:
                    for sid in self.registry.purge_stopped(now - self.limits.stopped_retention_s):
                        self.trajectory.purge(sid)
                        self.audit.recorder.forget((sid,))
                    last_purge = now
            except Exception:
                log.exception("reaper iteration failed")
