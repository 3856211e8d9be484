"""Planning a build: what each step will run in, and what decides its result.

:func:`plan_steps` is pure: given the base (its layer digests and config), the steps, the
build arguments, the context and the default ``run`` network, it walks the steps once,
tracking the build state (environment, build arguments, working directory, user, the image
config), and gives each step a :class:`PlannedStep`: whether it changes the filesystem,
the exact environment/working directory/user/network its sandbox gets, and for filesystem
steps its canonical form, which with the layers below it makes its cache key
(:func:`dsec.builds.cache.step_key`). Errors a build can know in advance (a copy source
missing from the context, too many layers) are raised here, before any sandbox.

A ``workdir`` step creates its directory as part of the next ``run``-like step (every one
of them ensures the working directory exists); only a ``workdir`` that no such step
follows is a filesystem step of its own (a sandbox that makes the directory).
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from typing import Any

from dsec.builds.context import BuildContext
from dsec.builds.steps import (
    AptInstall,
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Expose,
    FromImage,
    FromRegistry,
    Label,
    PipInstall,
    Run,
    StartCmd,
    Step,
    User,
    Workdir,
    describe,
)
from dsec.errors import InvalidRequest
from dsec.images.config import ImageConfig, StartCommand
from dsec.network.policy import NetworkPolicy

__all__ = ["APT_NETWORK", "PIP_NETWORK", "BuildPlan", "PlannedStep", "plan_steps", "shell_argv"]

APT_NETWORK = NetworkPolicy(presets=["debian"])
"""The only network an ``apt_install`` step gets."""
PIP_NETWORK = NetworkPolicy(presets=["pypi"])
"""The only network a ``pip_install`` step gets."""
_RUN_LIKE = (Run, AptInstall, PipInstall)


def shell_argv(cmd: str | list[str]) -> list[str]:
    """A command as an argv: a string is ``/bin/sh -c STRING``."""
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


@dataclass
class PlannedStep:
    """One step with everything the engine needs to run or skip it."""

    index: int
    step: Any
    instruction: str
    line: int | None
    fs: bool = False
    canonical: dict[str, Any] | None = None
    """Filesystem steps: everything that decides the step's result besides the layers
    below it (see :mod:`dsec.builds.cache`); None for the others."""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None
    network: NetworkPolicy | None = None
    dest: str = ""
    sources: list[str] = field(default_factory=list)
    """``copy``: the context paths its source patterns matched, in order."""
    pending_workdir: str | None = None
    """``copy``: a working directory set since the last step that creates it; the copy makes
    it (and its missing parents) as that step would have: root's, mode 0755."""


@dataclass
class BuildPlan:
    """A planned build: the steps (``steps[0]`` is the base), the final image config and
    notes for the caller."""

    base_layers: list[str]
    steps: list[PlannedStep]
    config: ImageConfig
    notes: list[str] = field(default_factory=list)
    start: StartCommand | None = None
    """The image's start command: a ``start_cmd`` step of the build, else its own
    ``cmd``/``entrypoint`` (entrypoint + cmd), else the base image's."""

    @property
    def fs_steps(self) -> int:
        return sum(1 for s in self.steps if s.fs)


@dataclass
class _State:
    env: dict[str, str]
    args: dict[str, str]
    workdir: str
    user: str | None
    cmd: list[str] | None
    entrypoint: list[str] | None
    cmd_set: bool = False
    start: StartCommand | None = None
    start_step: bool = False  # a start_cmd step set ``start``
    start_from_config: bool = False  # this build set cmd or entrypoint
    labels: dict[str, str] = field(default_factory=dict)
    exposed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def run_env(self) -> dict[str, str]:
        return {**self.args, **self.env}


def _network_dump(policy: NetworkPolicy | None) -> Any:
    return None if policy is None else policy.model_dump(mode="json")


def _copy_dest(dest: str, workdir: str) -> str:
    """An absolute destination; a trailing ``/`` (a directory destination) is kept."""
    is_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith(("/.", "/.."))
    path = posixpath.normpath(posixpath.join(workdir, dest))
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return path + "/" if is_dir and path != "/" else path


def _error(ps: PlannedStep, message: str) -> InvalidRequest:
    where = f"step {ps.index} ({ps.instruction})"
    if ps.line is not None:
        where = f"Dockerfile line {ps.line}: {ps.instruction}"
    return InvalidRequest(
        f"{where}: {message}", step=ps.index, instruction=ps.instruction, line=ps.line
    )


def plan_steps(
    steps: list[Step],
    *,
    base_layers: list[str],
    base_config: ImageConfig,
    build_args: dict[str, str],
    context: BuildContext,
    run_network: NetworkPolicy | None,
    max_layers: int = 65,
    base_start: StartCommand | None = None,
) -> BuildPlan:
    """Plan ``steps`` (``steps[0]`` the ``from_image``/``from_registry`` already resolved
    to ``base_layers`` and ``base_config``). Raises ``InvalidRequest`` naming the step."""
    if not steps or not isinstance(steps[0], FromImage | FromRegistry):
        raise InvalidRequest("a build starts with from_image or from_registry")
    st = _State(
        env=base_config.env_dict(),
        args={},
        workdir=base_config.WorkingDir or "/",
        user=base_config.User or None,
        cmd=list(base_config.Cmd) if base_config.Cmd is not None else None,
        entrypoint=list(base_config.Entrypoint) if base_config.Entrypoint is not None else None,
        labels=dict(base_config.Labels or {}),
        exposed=dict(base_config.ExposedPorts or {}),
        start=base_start,
    )
    planned: list[PlannedStep] = []
    declared_args: set[str] = set()
    workdir_pending = False
    for i, step in enumerate(steps, start=1):
        ps = PlannedStep(i, step, describe(step), step.line)
        planned.append(ps)
        if i == 1:
            continue
        if isinstance(step, FromImage | FromRegistry):
            raise _error(ps, "a build has one base (multi-stage builds are not supported)")
        canonical: dict[str, Any] | None = None
        if isinstance(step, _RUN_LIKE):
            workdir_pending = False  # it creates the working directory first
        if isinstance(step, Run):
            ps.fs = True
            ps.env, ps.workdir, ps.user = st.run_env(), st.workdir, st.user
            ps.network = (
                run_network
                if step.network == "default"
                else None
                if step.network == "none"
                else step.network
            )
            canonical = {
                "op": "run",
                "cmd": shell_argv(step.cmd),
                "env": sorted(ps.env.items()),
                "workdir": ps.workdir,
                "user": ps.user,
                "network": _network_dump(ps.network),
            }
        elif isinstance(step, AptInstall | PipInstall):
            ps.fs = True
            ps.env, ps.workdir = st.run_env(), st.workdir
            ps.network = APT_NETWORK if isinstance(step, AptInstall) else PIP_NETWORK
            canonical = {
                "op": step.op,
                "packages": list(step.packages),
                "env": sorted(ps.env.items()),
                "workdir": ps.workdir,
                "network": _network_dump(ps.network),
            }
        elif isinstance(step, Copy):
            ps.fs = True
            ps.workdir = st.workdir
            ps.dest = _copy_dest(step.dest, st.workdir)
            ps.pending_workdir = st.workdir if workdir_pending else None
            for pattern in step.src:
                try:
                    matched = context.match(pattern)
                except InvalidRequest as e:
                    raise _error(ps, e.message) from None
                if not matched:
                    raise _error(ps, f"{pattern!r}: no such file or directory in the build context")
                for m in matched:
                    if context.resolve(m) is None:
                        raise _error(ps, f"{m!r} is a symlink that leads out of the build context")
                ps.sources.extend(matched)
            n_sources = len(ps.sources) + len(step.inline)
            if n_sources == 0:
                raise _error(ps, "nothing to copy")
            if n_sources > 1 and not ps.dest.endswith("/"):
                raise _error(
                    ps,
                    f"copying several sources needs a directory destination ending in '/' (got {step.dest!r})",
                )
            canonical = {
                "op": "copy",
                "src": list(step.src),
                "dest": ps.dest,
                "chown": step.chown,
                "chmod": step.chmod,
                "add": step.add,
                "pending_workdir": ps.pending_workdir,
                "content": context.content_digest(ps.sources),
                "inline": [
                    [f.name, hashlib.sha256(f.content.encode()).hexdigest()] for f in step.inline
                ],
            }
        elif isinstance(step, Env):
            st.env.update(step.vars)
        elif isinstance(step, Arg):
            declared_args.add(step.name)
            value = build_args.get(step.name, step.default)
            if value is not None:
                st.args[step.name] = value
        elif isinstance(step, Workdir):
            st.workdir = posixpath.normpath(posixpath.join(st.workdir, step.path))
            if st.workdir.startswith("//"):
                st.workdir = "/" + st.workdir.lstrip("/")
            ps.workdir = st.workdir
            workdir_pending = st.workdir != "/"
            if st.workdir != "/" and not _followed_by_run(steps, i):
                ps.fs = True
                workdir_pending = False
                canonical = {"op": "workdir", "path": st.workdir}
        elif isinstance(step, User):
            st.user = step.user
        elif isinstance(step, Cmd):
            st.cmd = shell_argv(step.cmd) if step.cmd else None
            st.cmd_set = st.start_from_config = True
        elif isinstance(step, Entrypoint):
            st.entrypoint = shell_argv(step.entrypoint) if step.entrypoint else None
            st.start_from_config = True
            if not st.cmd_set:
                st.cmd = None  # Docker: ENTRYPOINT clears a CMD inherited from the base
        elif isinstance(step, StartCmd):
            st.start = StartCommand(
                cmd=step.cmd, ready_cmd=step.ready_cmd, ready_timeout_s=step.ready_timeout_s
            )
            st.start_step = True
        elif isinstance(step, Label):
            st.labels.update(step.labels)
        elif isinstance(step, Expose):
            for p in step.ports:
                st.exposed[p if "/" in p else p + "/tcp"] = {}
        ps.canonical = canonical
    plan = BuildPlan(
        list(base_layers), planned, _config(st, bool(base_config.WorkingDir)), start=_start(st)
    )
    if len(base_layers) + plan.fs_steps > max_layers:
        raise InvalidRequest(
            f"the build would stack {len(base_layers)} base layers and {plan.fs_steps} of its "
            f"own; at most {max_layers} layers (join RUN steps with &&)",
            limit=max_layers,
        )
    unused = sorted(set(build_args) - declared_args)
    if unused:
        plan.notes.append(f"build arguments not declared by any ARG: {', '.join(unused)}")
    return plan


def _followed_by_run(steps: list[Step], i: int) -> bool:
    """Whether a run-like step comes after step ``i`` (1-based) before the next workdir."""
    for later in steps[i:]:
        if isinstance(later, Workdir):
            return False
        if isinstance(later, _RUN_LIKE):
            return True
    return False


def _start(st: _State) -> StartCommand | None:
    if st.start_step or not st.start_from_config:
        return st.start
    argv = [*(st.entrypoint or []), *(st.cmd or [])]
    return StartCommand(cmd=argv) if argv else None


def _config(st: _State, base_had_workdir: bool) -> ImageConfig:
    return ImageConfig(
        Env=[f"{k}={v}" for k, v in st.env.items()] or None,
        Entrypoint=st.entrypoint,
        Cmd=st.cmd,
        WorkingDir=st.workdir if st.workdir != "/" or base_had_workdir else None,
        User=st.user,
        Labels=st.labels or None,
        ExposedPorts=st.exposed or None,
    )
