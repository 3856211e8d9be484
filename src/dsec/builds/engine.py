"""The build engine: :class:`ImageBuilder` turns a :class:`~dsec.builds.wire.BuildRequest`
and its context into an image of the building key, streaming events as it goes.

Wiring (the apiserver route and the edge verb are a few lines on top)::

    builder = ImageBuilder(edge, edge.layers, cache_db=paths.home / "build-cache.db")
    events = builder.build(owner, req, context)     # AsyncIterator[BuildEvent]
    first = await anext(events)   # refusals (bad request, unknown base, ...) raise here
    ...                           # then stream `first` and the rest (wire.ndjson_lines)

How a build runs:

1. **Prepare** (before the first event; errors are raised as :class:`~dsec.errors.DsecError`):
   the image name must be free for the key; the context is indexed (bounded by
   :class:`BuildLimits`); a Dockerfile is parsed; the base is resolved as the key sees it
   (a built-in is built first if needed); the steps are planned (:mod:`dsec.builds.plan`):
   a missing ``COPY`` source is a 400 before anything runs.
2. **Run**, step by step: a filesystem step whose key (its canonical form and the layers
   it runs on, :func:`~dsec.builds.cache.step_key`) the key's cache holds
   (:class:`~dsec.builds.cache.BuildCache`) reuses its layer and creates **no sandbox**.
   Otherwise: ``run`` / ``apt_install`` / ``pip_install`` / a ``workdir`` that must create
   its directory get a ``container`` sandbox of the image so far, created through the
   :class:`~dsec.contract.edge.EdgeAPI` as the building key, with only the network the step
   needs (``apt_install``: the ``debian`` preset; ``pip_install``: ``pypi``; ``run``: its own
   or the build's ``run_network``); the working directory is created, the command runs
   (its output streams as ``output`` events), and the sandbox's writable layer becomes the
   step's layer (``snapshot_sandbox``: pack_diff without the snapshot's default scrub, so a
   step keeps what it wrote, ``/tmp`` included, as Docker does; the sandbox's
   ``/etc/resolv.conf`` is never kept). A ``copy`` builds its layer straight
   from the context files (:mod:`dsec.builds.copy_layer`); its sandbox only answers
   ``stat`` and ``/etc/passwd`` questions about the image. Every sandbox is killed when its
   step ends, whatever happens (also when the caller stops reading).
3. **Finish**: the image (base layers + step layers) is stored as the key's
   (``LayerStore.put_image(..., owner=...)``) with ``meta["config"]`` (``Env``,
   ``WorkingDir``, ``User``, ``Cmd``, ``Entrypoint``, ``Labels``, ``ExposedPorts``) and
   ``meta["build"]`` (which step made which layer).

A failing step ends the stream with one ``error`` event (the step, its instruction, the
tail of its output); nothing of that step is stored or cached, no image is made, and the
layers of the steps before it stay cached. Concurrent builds of one key that reach the same
step key wait for each other, so the second one gets a cache hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import re
import secrets
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsec.builds.cache import BuildCache, step_key
from dsec.builds.context import BuildContext, DockerIgnore
from dsec.builds.copy_layer import (
    ImageFS,
    LayerTree,
    SourceEntry,
    context_entries,
    is_archive,
    lookup_ids,
    place_entries,
    tree_entries,
)
from dsec.builds.dockerfile import parse_dockerfile
from dsec.builds.plan import BuildPlan, PlannedStep, plan_steps
from dsec.builds.steps import (
    AptInstall,
    Copy,
    FromImage,
    FromRegistry,
    PipInstall,
    Run,
    Step,
    Workdir,
)
from dsec.builds.wire import (
    BuildDone,
    BuildError,
    BuildRequest,
    BuildStarted,
    StepCached,
    StepDone,
    StepOutput,
    StepStarted,
)
from dsec.contract.edge import EdgeAPI
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    FileNotFound,
    InvalidRequest,
    PayloadTooLarge,
    TierUnavailable,
    Unsupported,
    error_from_wire,
)
from dsec.images.config import ImageConfig, StartCommand
from dsec.layers.store import LayerStore
from dsec.models import (
    CreateSandboxRequest,
    ExecResult,
    FileInfo,
    ImageInfo,
    SandboxExecRequest,
    SandboxPathRequest,
    SandboxRef,
    SandboxSnapshotRequest,
)
from dsec.network.policy import NetworkPolicy

__all__ = ["BuildLimits", "ImageBuilder", "RegistryResolver"]

log = logging.getLogger(__name__)

RegistryResolver = Callable[[str, str], Awaitable[ImageInfo]]
"""``(owner, ref) -> image``: makes a registry reference usable by ``owner`` (pulling it if
needed). Given to :class:`ImageBuilder` by whoever implements registry references."""

_APT_SCRIPT = (
    "set -e; export DEBIAN_FRONTEND=noninteractive; "
    'apt-get update; apt-get install -y --no-install-recommends "$@"; '
    "rm -rf /var/lib/apt/lists/*"
)
_PIP_SCRIPT = (
    "py=$(command -v python3 || command -v python) || "
    '{ echo "pip_install: the image has no python3" >&2; exit 127; }; '
    'exec "$py" -m pip install --no-cache-dir "$@"'
)
_PIP_ENV = {
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "PIP_ROOT_USER_ACTION": "ignore",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_PROGRESS_BAR": "off",
}
_EXEC_USER = re.compile(r"^([a-z_][a-z0-9_-]{0,31}|[0-9]{1,10})(:[0-9]{1,10})?$")
"""Users the sandbox API takes as they are; others (``name:group``) are resolved here."""
_COPY_SANDBOX = {"cpu": 0.25, "memory_mb": 128, "disk_mb": 16}


@dataclass(frozen=True)
class BuildLimits:
    """Bounds of one build. Sizes in bytes.

    ``max_context_bytes``: the uploaded context archive; ``max_context_unpacked_bytes``: the
    file data it holds (also how far a compressed archive may inflate);
    ``max_context_entries``: its members; ``max_layers``: base + step layers of the image
    (a sandbox stacks at most 65); ``max_output_bytes``: output kept per stream and step;
    ``output_tail_chars``: how much output an ``error`` event carries; ``image_wait_s``:
    how long to wait for a built-in base image still being built, seconds."""

    max_context_bytes: int = 256 << 20
    max_context_unpacked_bytes: int = 4 << 30
    max_context_entries: int = 500_000
    max_layers: int = 65
    max_output_bytes: int = 8 << 20
    output_tail_chars: int = 4096
    image_wait_s: float = 20.0

    @classmethod
    def from_env(cls) -> BuildLimits:
        """Defaults, with ``DSEC_MAX_BUILD_CONTEXT_BYTES`` and ``DSEC_MAX_BUILD_BYTES`` (the
        operator settings the edge's own builds use) and ``DSEC_IMAGE_WAIT_S``."""
        env = os.environ
        kw: dict[str, Any] = {}
        try:
            if "DSEC_MAX_BUILD_CONTEXT_BYTES" in env:
                kw["max_context_bytes"] = int(env["DSEC_MAX_BUILD_CONTEXT_BYTES"])
            if "DSEC_MAX_BUILD_BYTES" in env:
                kw["max_context_unpacked_bytes"] = int(env["DSEC_MAX_BUILD_BYTES"])
            if "DSEC_IMAGE_WAIT_S" in env:
                kw["image_wait_s"] = float(env["DSEC_IMAGE_WAIT_S"])
        except ValueError as e:
            raise SystemExit(f"invalid build limit in the environment: {e}") from e
        return cls(**kw)


class _StepFailed(Exception):
    """A step's command did not succeed (``build_failed``)."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


@dataclass
class _Build:
    id: str
    owner: str
    req: BuildRequest
    base_name: str
    plan: BuildPlan
    context: BuildContext
    notes: list[str]
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Outcome:
    layer: str | None = None
    tail: str = ""


class ImageBuilder:
    """Builds images for API keys on one node (see the module docstring).

    Args:
        edge: the node's edge (sandboxes are created through it, as the building key).
        store: the node's layer store (base images, cache checks, copy layers, the image).
        cache_db: the cache index file; default ``<store root>/build-cache.db``.
        limits: bounds of a build; default :meth:`BuildLimits.from_env`.
        resolve_registry: makes ``from_registry`` references usable (None: such builds are
            refused with ``unsupported``).
    """

    def __init__(
        self,
        edge: EdgeAPI,
        store: LayerStore,
        *,
        cache_db: Path | None = None,
        limits: BuildLimits | None = None,
        resolve_registry: RegistryResolver | None = None,
    ) -> None:
        self.edge = edge
        self.store = store
        self.limits = limits or BuildLimits.from_env()
        self.cache = BuildCache(cache_db or store.root / "build-cache.db", store)
        self.resolve_registry = resolve_registry
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    def close(self) -> None:
        """Close the cache index (running builds must have ended)."""
        self.cache.close()

    async def build(
        self, owner: str, req: BuildRequest, context: bytes = b""
    ) -> AsyncGenerator[Any, None]:
        """Build ``req`` for ``owner``; yields :data:`~dsec.builds.wire.BuildEvent` s.

        ``context``: a tar archive (uncompressed, gzip, bzip2 or xz; empty: no files).
        Refusals before anything runs are raised from the first ``__anext__``:
        ``InvalidRequest`` (malformed Dockerfile or step, a missing copy source, too many
        layers), ``Conflict`` (a system image's name), ``ImageNotFound`` (the base),
        ``ImageNotReady``, ``PayloadTooLarge`` (the context), ``Unsupported`` (a registry
        base without a resolver), ``TierUnavailable`` / ``CapabilityNotSupported`` (no
        container tier, no network for a step that needs one). After that, failures are
        an ``error`` event and the iterator ends."""
        b = await self._prepare(owner, req, context)
        yield BuildStarted(
            build_id=b.id,
            name=req.name,
            base=b.base_name,
            steps=len(b.plan.steps),
            notes=b.notes,
        )
        # every nested iterator is closed with its caller, so that a caller that stops
        # reading (a client gone) kills the running step's sandbox at once, not at GC
        async with contextlib.aclosing(self._execute(b)) as events:
            async for event in events:
                yield event

    # --- prepare ---------------------------------------------------------------------------

    async def _prepare(self, owner: str, req: BuildRequest, context: bytes) -> _Build:
        lim = self.limits
        if len(context) > lim.max_context_bytes:
            raise PayloadTooLarge(
                f"the build context is larger than {lim.max_context_bytes} bytes",
                limit_bytes=lim.max_context_bytes,
            )
        self.store.check_name_free(req.name, owner)
        ctx = await asyncio.to_thread(
            BuildContext.from_tar,
            context,
            max_bytes=lim.max_context_unpacked_bytes,
            max_entries=lim.max_context_entries,
        )
        caps = {c.tier: c for c in (await self.edge.capabilities()).tiers}
        container = caps.get("container")
        if container is None or not container.available:
            raise TierUnavailable(
                "image builds need the container tier, which this node does not run"
                + (f": {container.reason}" if container is not None and container.reason else ""),
                tier="container",
            )
        notes: list[str] = []
        run_network = req.effective_run_network()
        if req.is_dockerfile:
            text = (
                req.dockerfile
                if req.dockerfile is not None
                else ctx.read_text(req.dockerfile_path or "Dockerfile")
            )
            df = parse_dockerfile(text)
            base_step: FromImage | FromRegistry = df.base_step(req.build_args)
            base = await self._resolve_base(owner, base_step)
            steps: list[Step] = df.steps(
                req.build_args, ImageConfig.from_meta(base.meta).env_dict()
            )
            ctx = ctx.without(self._dockerignore(ctx, req.dockerfile_path))
            if "run_network" not in req.model_fields_set and not container.network:
                run_network = None
                notes.append(
                    "this node gives sandboxes no network: RUN steps run without the "
                    "debian and pypi presets"
                )
        else:
            assert req.steps is not None
            steps = list(req.steps)
            first = steps[0] if steps else None
            if not isinstance(first, FromImage | FromRegistry):
                raise InvalidRequest("a build's first step is from_image or from_registry")
            base = await self._resolve_base(owner, first)
        base_config = ImageConfig.from_meta(base.meta)
        plan = plan_steps(
            steps,
            base_layers=list(base.layers),
            base_config=base_config,
            build_args=req.build_args,
            context=ctx,
            run_network=run_network,
            max_layers=lim.max_layers,
            base_start=StartCommand.from_meta(base.meta),
        )
        notes.extend(plan.notes)
        for ps in plan.steps:
            if ps.fs and ps.network is not None and not container.network:
                raise CapabilityNotSupported(
                    f"step {ps.index} ({ps.instruction}) needs a network, and this node gives "
                    "sandboxes none",
                    step=ps.index,
                )
        # the key may use the base (it resolved it): its layers become usable by digest,
        # as for a snapshot of a sandbox of that image
        missing = [d for d in base.layers if not self.store.layer_visible(d, owner)]
        if missing:
            self.store.grant_layers(owner, missing)
        build_id = "b-" + secrets.token_hex(6)
        log.info(
            "build %s: %s for %s, %d steps on %s",
            build_id,
            req.name,
            owner,
            len(plan.steps),
            base.name,
        )
        return _Build(build_id, owner, req, base.name, plan, ctx, notes)

    async def _resolve_base(self, owner: str, step: FromImage | FromRegistry) -> ImageInfo:
        if isinstance(step, FromImage):
            image = await self.store.ensure_image(
                step.image, owner, wait_s=self.limits.image_wait_s
            )
        else:
            if self.resolve_registry is None:
                raise Unsupported(
                    f"registry references ({step.ref}) are not resolved on this node yet: "
                    "pull the image (`dsec image pull`) and build from its dsec name",
                    ref=step.ref,
                )
            image = await self.resolve_registry(owner, step.ref)
        if not image.layers:
            raise InvalidRequest(f"the base image {image.name!r} has no layers", image=image.name)
        return image

    @staticmethod
    def _dockerignore(ctx: BuildContext, dockerfile_path: str | None) -> DockerIgnore | None:
        candidates = [f"{dockerfile_path}.dockerignore"] if dockerfile_path else []
        for path in [*candidates, ".dockerignore"]:
            entry = ctx.lookup(path)
            if entry is not None and entry.type == "file":
                return DockerIgnore.parse(ctx.read(entry).decode("utf-8", errors="replace"))
        return None

    # --- run -------------------------------------------------------------------------------

    def _lock_for(self, owner: str, key: str) -> asyncio.Lock:
        lock = self._locks.get((owner, key))
        if lock is None:
            lock = asyncio.Lock()
            self._locks[(owner, key)] = lock
        return lock

    async def _execute(self, b: _Build) -> AsyncGenerator[Any, None]:
        total = len(b.plan.steps)
        stack = list(b.plan.base_layers)
        cached = built = 0
        history: list[dict[str, Any]] = []
        for ps in b.plan.steps:
            yield StepStarted(step=ps.index, total=total, instruction=ps.instruction, line=ps.line)
            t0 = time.perf_counter()
            if not ps.fs:
                yield StepDone(step=ps.index, duration_ms=_ms(t0))
                continue
            assert ps.canonical is not None
            key = step_key(stack, ps.canonical)
            async with self._lock_for(b.owner, key):
                hit = None if b.req.no_cache else self.cache.lookup(b.owner, key)
                if hit is not None:
                    layer, from_cache = hit.layer, True
                    cached += 1
                    yield StepCached(step=ps.index, layer=layer)
                else:
                    outcome = _Outcome()
                    error: BuildError | None = None
                    try:
                        async with contextlib.aclosing(
                            self._run_step(b, ps, stack, outcome)
                        ) as step_events:
                            async for event in step_events:
                                yield event
                    except _StepFailed as e:
                        error = self._error(ps, "build_failed", e.message, outcome.tail, e.details)
                    except DsecError as e:
                        msg = f"step {ps.index}/{total} ({_short(ps.instruction)}): {e.message}"
                        error = self._error(ps, e.code, msg, outcome.tail, e.details)
                    except Exception as e:
                        log.exception("build %s: step %d failed unexpectedly", b.id, ps.index)
                        msg = f"step {ps.index}/{total} ({_short(ps.instruction)}): internal error: {e}"
                        error = self._error(ps, "internal", msg, outcome.tail, {})
                    if error is not None:
                        log.info("build %s failed at step %d: %s", b.id, ps.index, error.message)
                        yield error
                        return
                    layer, from_cache = outcome.layer, False
                    self.cache.record(b.owner, key, layer, ps.instruction)
                    built += 1
            if layer is not None:
                stack = [d for d in stack if d != layer] + [layer]
            history.append(
                {
                    "step": ps.index,
                    "instruction": _short(ps.instruction, 300),
                    "layer": layer,
                    "cached": from_cache,
                }
            )
            yield StepDone(step=ps.index, layer=layer, cached=from_cache, duration_ms=_ms(t0))
        meta: dict[str, Any] = {
            "config": b.plan.config.to_meta(),
            "source": "build",
            "base": b.base_name,
            "build": {"id": b.id, "steps": history, "cached_steps": cached, "built_steps": built},
        }
        if b.plan.start is not None:
            meta["start"] = b.plan.start.to_meta()
        try:
            image = await asyncio.to_thread(
                self.store.put_image, b.req.name, stack, meta=meta, owner=b.owner
            )
        except DsecError as e:
            yield BuildError(code=e.code, message=e.message, details=e.details)
            return
        duration = _ms(b.started)
        log.info(
            "build %s: %s done in %.0f ms (%d cached, %d built)",
            b.id,
            b.req.name,
            duration,
            cached,
            built,
        )
        yield BuildDone(image=image, cached_steps=cached, built_steps=built, duration_ms=duration)

    def _error(
        self, ps: PlannedStep, code: str, message: str, tail: str, details: dict[str, Any]
    ) -> BuildError:
        return BuildError(
            code=code,
            message=message,
            step=ps.index,
            instruction=ps.instruction,
            line=ps.line,
            output_tail=tail[-self.limits.output_tail_chars :],
            details={k: v for k, v in details.items() if k not in ("step", "instruction", "line")},
        )

    def _run_step(
        self, b: _Build, ps: PlannedStep, stack: list[str], outcome: _Outcome
    ) -> AsyncGenerator[Any, None]:
        step = ps.step
        if isinstance(step, Run | AptInstall | PipInstall):
            return self._run_command(b, ps, stack, outcome)
        if isinstance(step, Copy):
            return self._copy(b, ps, stack, outcome)
        if isinstance(step, Workdir):
            return self._make_workdir(b, ps, stack, outcome)
        raise AssertionError(f"not a filesystem step: {step!r}")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def _sandbox(
        self,
        b: _Build,
        ps: PlannedStep,
        stack: list[str],
        network: NetworkPolicy | None,
        *,
        env: dict[str, str] | None = None,
        small: bool = False,
    ) -> AsyncIterator[str]:
        """A sandbox of ``stack`` for step ``ps``, killed when the block ends (always)."""
        req = b.req
        sizes = (
            _COPY_SANDBOX
            if small
            else {"cpu": req.cpu, "memory_mb": req.memory_mb, "disk_mb": req.disk_mb}
        )
        try:
            create = CreateSandboxRequest(
                tier="container",
                image=stack[0],
                layers=stack[1:],
                env=env or {},
                pids=4096,
                ttl_s=req.step_timeout_s + 600,
                labels={"dsec.io/build": b.id, "dsec.io/build-step": str(ps.index)},
                network=network,
                **sizes,
            )
        except ValidationError as e:  # e.g. an environment larger than a sandbox takes
            msgs = "; ".join(
                str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors()
            )
            raise InvalidRequest(f"the step's sandbox cannot be made: {msgs}") from None
        info = await self.edge.create_sandbox(create, b.owner)
        try:
            yield info.id
        finally:
            with contextlib.suppress(DsecError):
                await asyncio.shield(
                    self.edge.kill_sandbox(SandboxRef(sandbox_id=info.id), b.owner)
                )

    async def _exec_user(self, sid: str, owner: str, user: str | None) -> str | None:
        if user is None or _EXEC_USER.match(user):
            return user
        passwd = await self._read_text(sid, owner, "/etc/passwd")
        group = await self._read_text(sid, owner, "/etc/group")
        uid, gid = lookup_ids(user, passwd, group)
        return f"{uid}:{gid}"

    async def _read_text(self, sid: str, owner: str, path: str) -> str | None:
        try:
            return (await self.edge.read_file(sid, owner, path)).decode("utf-8", errors="replace")
        except FileNotFound:
            return None

    async def _snapshot(self, sid: str, b: _Build, network: NetworkPolicy | None) -> str | None:
        scrub = ["/etc/resolv.conf"] if network is not None else []
        req = SandboxSnapshotRequest(
            sandbox_id=sid, scrub=scrub, compress=b.req.compress, default_scrub=False
        )
        layer = await self.edge.snapshot_sandbox(req, b.owner)
        stats = layer.meta.get("pack_diff") or {}
        changed = sum(
            int(stats.get(k, 0) or 0)
            for k in ("files", "dirs", "symlinks", "whiteouts", "opaque_dirs")
        )
        return layer.digest if changed or not stats else None

    async def _run_command(
        self, b: _Build, ps: PlannedStep, stack: list[str], outcome: _Outcome
    ) -> AsyncGenerator[Any, None]:
        step = ps.step
        total = len(b.plan.steps)
        user: str | None = None
        exec_env: dict[str, str] = {}
        if isinstance(step, Run):
            cmd: str | list[str] = step.cmd
        elif isinstance(step, AptInstall):
            cmd = ["/bin/sh", "-c", _APT_SCRIPT, "apt_install", *step.packages]
        else:
            cmd = ["/bin/sh", "-c", _PIP_SCRIPT, "pip_install", *step.packages]
            exec_env = dict(_PIP_ENV)
        async with self._sandbox(b, ps, stack, ps.network, env=ps.env) as sid:
            if ps.workdir != "/":
                await self.edge.make_dir(
                    SandboxPathRequest(sandbox_id=sid, path=ps.workdir), b.owner
                )
            if isinstance(step, Run):
                user = await self._exec_user(sid, b.owner, ps.user)
            req = SandboxExecRequest(
                sandbox_id=sid,
                cmd=cmd,
                cwd=ps.workdir,
                env=exec_env,
                user=user,
                timeout_s=b.req.step_timeout_s,
                max_output_bytes=self.limits.max_output_bytes,
            )
            result: ExecResult | None = None
            keep = self.limits.output_tail_chars
            stream = self.edge.exec_stream(req, b.owner)
            try:
                async for ev in stream:
                    if ev.type in ("stdout", "stderr") and ev.data:
                        outcome.tail = (outcome.tail + ev.data)[-keep:]
                        yield StepOutput(step=ps.index, stream=ev.type, data=ev.data)
                    elif ev.type == "exit":
                        result = ev.result
                    elif ev.type == "error":
                        raise error_from_wire(500, {"error": ev.error or {}})
            finally:
                if isinstance(stream, AsyncGenerator):  # stop the command with its reader
                    await stream.aclose()
            where = f"step {ps.index}/{total} ({_short(ps.instruction)})"
            if result is None:
                raise _StepFailed(f"{where}: the command ended without a result")
            if result.timed_out:
                raise _StepFailed(
                    f"{where} timed out after {b.req.step_timeout_s:g} s",
                    timeout_s=b.req.step_timeout_s,
                )
            if result.oom_killed:
                raise _StepFailed(
                    f"{where} ran out of memory (memory_mb={b.req.memory_mb})",
                    memory_mb=b.req.memory_mb,
                    exit_code=result.exit_code,
                )
            if result.exit_code != 0:
                how = (
                    f"was killed by signal {result.signal}"
                    if result.exit_code is None
                    else f"failed with exit code {result.exit_code}"
                )
                raise _StepFailed(
                    f"{where} {how}", exit_code=result.exit_code, signal=result.signal
                )
            outcome.layer = await self._snapshot(sid, b, ps.network)

    async def _make_workdir(
        self, b: _Build, ps: PlannedStep, stack: list[str], outcome: _Outcome
    ) -> AsyncGenerator[Any, None]:
        async with self._sandbox(b, ps, stack, None, small=True) as sid:
            await self.edge.make_dir(SandboxPathRequest(sandbox_id=sid, path=ps.workdir), b.owner)
            outcome.layer = await self._snapshot(sid, b, None)
        return
        yield  # an async generator with no events

    async def _copy(
        self, b: _Build, ps: PlannedStep, stack: list[str], outcome: _Outcome
    ) -> AsyncGenerator[Any, None]:
        step: Copy = ps.step
        with contextlib.ExitStack() as slots:
            work = self.store.scratch / f"layer-{slots.enter_context(self.store.build_slot())}"
            tree = LayerTree()
            async with self._sandbox(b, ps, stack, None, small=True) as sid:

                async def stat(path: str) -> FileInfo | None:
                    try:
                        return await self.edge.stat_file(
                            SandboxPathRequest(sandbox_id=sid, path=path), b.owner
                        )
                    except FileNotFound:
                        return None

                fs = ImageFS(stat)
                await fs.stat("/")
                ids = None
                if step.chown:
                    names = any(not part.isdigit() for part in step.chown.split(":"))
                    passwd = await self._read_text(sid, b.owner, "/etc/passwd") if names else None
                    group = await self._read_text(sid, b.owner, "/etc/group") if names else None
                    ids = lookup_ids(step.chown, passwd, group)
                sources: list[tuple[str, list[SourceEntry], bool]] = []
                for i, path in enumerate(ps.sources):
                    kind, entries = context_entries(b.context, path)
                    if step.add and kind == "file" and entries[0].data is not None:
                        data = entries[0].data()
                        if is_archive(data):
                            unpacked = await asyncio.to_thread(
                                _unpack, data, work / f"add-{i}", self.limits
                            )
                            sources.append(("dir", tree_entries(unpacked), True))
                            continue
                    sources.append((kind, entries, False))
                for f in step.inline:
                    inline = SourceEntry(
                        f.name, "file", 0o644, time.time(), data=_reader(f.content)
                    )
                    sources.append(("file", [inline], False))
                root_dirs: set[str] = set()
                if ps.pending_workdir is not None:  # as WORKDIR would have made it: root's
                    wd, _ = await fs.real_dir(ps.pending_workdir)
                    while wd != "/":
                        root_dirs.add(wd)
                        wd = posixpath.dirname(wd)
                dest = ps.dest.rstrip("/") or "/"
                into_dir = (
                    ps.dest.endswith("/")
                    or len(sources) > 1
                    or any(k == "dir" for k, _, _ in sources)
                )
                if not into_dir:
                    with contextlib.suppress(InvalidRequest):  # dest is a file: replaced
                        _, exists = await fs.real_dir(dest)
                        into_dir = exists
                for kind, entries, keep_owners in sources:
                    await place_entries(
                        fs,
                        tree,
                        dest,
                        entries,
                        into_dir=into_dir or kind == "dir",
                        owner=ids,
                        chmod=step.chmod,
                        keep_owners=keep_owners,
                        root_dirs=frozenset(root_dirs),
                    )
            # the sandbox is gone: write the tree and pack it
            meta = {"build": b.id, "step": ps.index, "instruction": _short(ps.instruction, 300)}
            compress = "lz4" if b.req.compress else None

            def pack() -> str:
                root = work / "tree"
                tree.write(root)
                return self.store.build_layer(
                    root, "workspace", meta=meta, compress=compress
                ).digest

            digest = await asyncio.to_thread(pack)
            self.store.grant_layers(b.owner, [digest])
            outcome.layer = digest
            await asyncio.to_thread(slots.close)
        return
        yield  # an async generator with no events


def _unpack(data: bytes, dest: Path, limits: BuildLimits) -> Path:
    """An ``ADD`` archive unpacked (safely: no escapes, devices dropped) into ``dest``."""
    from dsec.layers.tarball import extract_tarball

    dest.mkdir(parents=True)
    archive = dest.with_suffix(".archive")
    archive.write_bytes(data)
    try:
        extract_tarball(
            archive,
            dest,
            max_bytes=limits.max_context_unpacked_bytes,
            max_members=limits.max_context_entries,
        )
    finally:
        archive.unlink(missing_ok=True)
    return dest


def _reader(text: str) -> Callable[[], bytes]:
    data = text.encode()
    return lambda: data


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


def _short(text: str, n: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
