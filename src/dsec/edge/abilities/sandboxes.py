"""Create, list, inspect, expire and kill sandboxes; job-wide actions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from dsec.contract.runtime import Handle, SandboxSpec, capabilities_of
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.edge.abilities.pausing import PauseVerbs
from dsec.edge.core import LiveSandbox
from dsec.edge.desktop import desktop_spec
from dsec.edge.jobs import create_batch, for_each_sandbox
from dsec.edge.registry import SandboxRow
from dsec.edge.start import start_command_of, with_image_defaults
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    ImageNotFound,
    InvalidRequest,
    QuotaExceeded,
    SandboxError,
)
from dsec.layers.workspace import check_stack
from dsec.models import (
    BatchCreateRequest,
    BatchCreateResult,
    CreateSandboxRequest,
    ImageInfo,
    JobActionRequest,
    JobActionResult,
    JobOutcome,
    LayerInfo,
    ListSandboxesRequest,
    PauseRequest,
    SandboxInfo,
    SandboxList,
    SandboxRef,
    SetTTLRequest,
)

log = logging.getLogger("dsec.edge")


class SandboxVerbs(PauseVerbs):
    """Create, list, inspect, expire and kill sandboxes; job-wide actions."""

    # ------------------------------------------------------------------ sandboxes
    async def create_sandbox(
        self,
        req: CreateSandboxRequest,
        owner: str,
        env: Envelope = NO_ENVELOPE,
        *,
        maker: Callable[[SandboxSpec], Awaitable[Handle]] | None = None,
        forked_from: str | None = None,
    ) -> SandboxInfo:
        """Create a sandbox; ``env.idem_key``: once per key (:mod:`dsec.edge.createkeys`);
        ``maker`` (memory forks) replaces ``runtime.create``; ``forked_from``: the sandbox a
        fork comes from (shown in its info)."""
        if env.idem_key is not None:
            return await self.creates.create_once(
                self,
                req,
                owner,
                env.idem_key,
                lambda: self.create_sandbox(req, owner, maker=maker, forked_from=forked_from),
            )
        t0 = time.perf_counter()
        tier = req.tier
        try:
            rt = self._runtime(tier)
            caps = capabilities_of(rt)
            if req.timeout_pause == "filesystem" and not caps.pause_filesystem:
                raise CapabilityNotSupported(
                    f"the {tier} tier on node {self.node} has no filesystem-only pause "
                    "(timeout_pause='filesystem')",
                    tier=tier,
                )
            if req.network is not None and not caps.network:
                raise CapabilityNotSupported(
                    f"the {tier} tier on node {self.node} cannot give sandboxes a network "
                    "(create with network=None, or use a tier whose capabilities say network)",
                    tier=tier,
                )
            self._check_admission(req, caps, owner, rate=True)
            image = await self._image(req.image, owner, self.limits.image_wait_s)
            resolved = with_image_defaults(req, image)
            extra: list[LayerInfo] = (
                self.layers.resolve_layers(resolved.layers, owner) if resolved.layers else []
            )
            digests = list(image.layers) + [x.digest for x in extra]
            check_stack([self.layers.get_layer(d) for d in digests])  # before any mount
            if all(self.layers.is_local(d) for d in digests):
                layer_paths = [str(self.layers.layer_path(d)) for d in digests]
            else:  # a lazy layer may start the node's FUSE server (~1 s): not on the loop
                layer_paths = await asyncio.to_thread(
                    lambda: [str(self.layers.layer_path(d)) for d in digests]
                )
        except DsecError as e:
            self.metrics.creations.labels(tier, "rejected").inc()
            self.metrics.errors.labels(e.code).inc()
            raise
        # a sandbox with public ports: its id is the secret of its URLs (96 random bits)
        sid = f"sb-{self.node}-{secrets.token_hex(12 if resolved.public_ports else 6)}"
        now = time.time()
        row = SandboxRow(
            id=sid,
            owner=owner,
            tier=tier,
            state="creating",
            request=resolved,
            image_layers=digests,
            job=resolved.job,
            labels=dict(resolved.labels),
            created_at=now,
            updated_at=now,
            last_active=now,
            ttl_s=resolved.ttl_s,
            forked_from=forked_from,
        )
        try:  # re-checked now: other creations may have been admitted during the awaits above
            self._check_admission(resolved, caps, owner)
        except DsecError as e:
            self.metrics.creations.labels(tier, "rejected").inc()
            self.metrics.errors.labels(e.code).inc()
            raise
        self.registry.insert(row)
        lv = LiveSandbox(row, Handle(sid), desktop=desktop_spec(image), desktop_known=True)
        self._add_live(lv)
        spec = self._spec(
            sid, resolved, owner, digests, layer_paths, forked=forked_from is not None
        )
        t_admitted = time.perf_counter()
        try:
            async with lv.lock, self.creations.slot(owner):
                t_slot = time.perf_counter()
                handle = await (maker(spec) if maker is not None else rt.create(spec))
                lv.handle = handle
                self.audit.bind(sid, rt, handle)
                row.state = "running"
                row.last_active = time.time()
                # one commit: the state, the handle and the activity time
                self.registry.set_state(
                    sid, "running", handle=handle.state, last_active=row.last_active
                )
            t_made = time.perf_counter()
        except BaseException as e:
            self._live.pop(sid)
            self.audit.discard(sid)
            with contextlib.suppress(Exception):
                await rt.destroy(lv.handle)
            reason = f"creation failed: {e}"[:500]
            self.registry.set_state(sid, "stopped", reason=reason)
            self.metrics.creations.labels(tier, "failed").inc()
            if isinstance(e, DsecError):
                self.metrics.errors.labels(e.code).inc()
                raise
            if isinstance(e, asyncio.CancelledError):
                raise
            log.exception("create %s failed", sid)
            raise SandboxError(f"could not create sandbox: {e}", sandbox_id=sid) from e
        start = start_command_of(image) if maker is None and resolved.start else None
        if start is not None:
            try:
                await self._start(lv, rt, start, rt.facts().sink_sees_all_output)
            except BaseException as e:
                await self._destroy(lv, "start command failed")
                self.metrics.creations.labels(tier, "failed").inc()
                if isinstance(e, DsecError):
                    self.metrics.errors.labels(e.code).inc()
                raise
        self.metrics.creations.labels(tier, "ok").inc()
        t_end = time.perf_counter()
        self.metrics.create_seconds.labels(tier).observe(t_end - t0)
        phases = self.metrics.create_phase_seconds
        phases.labels(tier, "admit").observe(t_admitted - t0)
        phases.labels(tier, "queue").observe(t_slot - t_admitted)
        phases.labels(tier, "runtime").observe(t_made - t_slot)
        phases.labels(tier, "start").observe(t_end - t_made)
        return self._info(row)

    async def _image(self, name: str, owner: str, wait_s: float | None) -> ImageInfo:
        """The image ``owner`` means by ``name``: its own, a system one (a built-in is built
        on first use), or a registry reference pulled on first use
        (:mod:`dsec.edge.references`)."""
        try:
            return await self.layers.ensure_image(name, owner, wait_s=wait_s)
        except ImageNotFound as missing:
            try:
                wanted = self.references.wanted(name)
            except DsecError:
                raise missing from None
            if wanted is None:
                raise
        return await self.references.resolve(name, owner, wait_s=wait_s)

    async def create_sandboxes(self, req: BatchCreateRequest, owner: str) -> BatchCreateResult:
        """Create ``req.n`` sandboxes like ``req.sandbox`` (see
        :func:`dsec.edge.jobs.create_batch`).

        A batch that can never fit this node (``n`` above its sandbox limit), or with
        ``all_or_nothing`` one that does not fit now, is refused up front (QuotaExceeded)."""
        each, n = req.sandbox, req.n
        caps = capabilities_of(self._runtime(each.tier))
        if n > self.limits.max_sandboxes:
            raise QuotaExceeded(
                f"a batch of {n} is more than node {self.node} can ever hold "
                f"({self.limits.max_sandboxes} sandboxes)",
                batch_size=n,
            )
        if req.all_or_nothing:
            self._check_admission(each, caps, owner, count=n)
        return await create_batch(
            n,
            lambda _i: self.create_sandbox(each, owner),
            lambda sid: self.kill_sandbox(SandboxRef(sandbox_id=sid), owner),
            all_or_nothing=req.all_or_nothing,
            concurrency=self.limits.create_concurrency,
        )

    async def get_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo:
        return self._info(self._lookup_row(req.sandbox_id, owner))

    async def list_sandboxes(self, req: ListSandboxesRequest, owner: str) -> SandboxList:
        state, labels = req.state, req.labels
        if state is not None:
            states: tuple[str, ...] | None = (state,)
        elif req.include_stopped:
            states = None
        else:
            states = ("creating", "running", "paused")
        rows = []
        for r in self.registry.select(owner=owner, states=states, job=req.job):
            lv = self._live.get(r.id)
            row = lv.row if lv is not None else r
            if labels and any(row.labels.get(k) != v for k, v in labels.items()):
                continue
            rows.append(row)
        seqs = self.trajectory.next_seqs([r.id for r in rows])  # one query, not one per row
        return SandboxList(sandboxes=[self._info(row, seqs[row.id]) for row in rows])

    async def abandon_sandbox(
        self, sandbox_id: str, owner: str, env: Envelope = NO_ENVELOPE
    ) -> None:
        """The client of this creation left before its answer: kill the sandbox, unless a
        retry under the same idempotency key took it."""
        await self.creates.take_back(self, sandbox_id, owner, env)

    async def kill_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo:
        sandbox_id = req.sandbox_id
        row = self._lookup_row(sandbox_id, owner)
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self._destroy(lv, "killed by request", wait=False)
            row = lv.row
        info = self._info(self.registry.get(sandbox_id) or row)
        if self.audit.enabled:
            info.audit = self.audit.recorder.summary(sandbox_id, row.tier, row.job)
        return info

    async def set_ttl(self, req: SetTTLRequest, owner: str) -> SandboxInfo:
        """Set the idle timeout to ``req.ttl_s`` seconds from now (the request model bounds
        it: 0 < ``ttl_s`` <= 30 days, as ``CreateSandboxRequest`` does)."""
        sandbox_id, ttl_s = req.sandbox_id, req.ttl_s
        lv = self._live_for(sandbox_id, owner)
        self.registry.set_ttl(sandbox_id, ttl_s)
        lv.row.ttl_s = ttl_s
        lv.row.last_active = time.time()
        return self._info(lv.row)

    async def job_action(self, req: JobActionRequest, owner: str) -> JobActionResult:
        job, action = req.job, req.action
        rows = self.registry.select(owner=owner, states=("creating", "running", "paused"), job=job)
        fns: dict[str, Callable[[str, str], Awaitable[SandboxInfo]]] = {
            "pause": lambda sid, owner: self.pause_sandbox(PauseRequest(sandbox_id=sid), owner),
            "resume": lambda sid, owner: self.resume_sandbox(SandboxRef(sandbox_id=sid), owner),
            "kill": lambda sid, owner: self.kill_sandbox(SandboxRef(sandbox_id=sid), owner),
        }
        if action not in fns:
            raise InvalidRequest(f"unknown job action {action!r}; use pause, resume or kill")
        fn = fns[action]
        outcomes = await for_each_sandbox(
            [r.id for r in rows],
            lambda sid: fn(sid, owner),
            concurrency=self.limits.job_concurrency,
        )
        return JobActionResult(
            job=job,
            action=action,
            outcomes={sid: JobOutcome.model_validate(o) for sid, o in outcomes.items()},
        )
