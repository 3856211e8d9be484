"""Harbor backend: a dsec sandbox as a Harbor environment (``harbor`` 0.25, Python >= 3.12).

Import path for Harbor's ``--env``: ``dsec.integrations.harbor:DsecEnvironment``::

    DSEC_URL=http://127.0.0.1:7070 DSEC_API_KEY=... \\
        harbor run -p ./my-task -a oracle --env dsec.integrations.harbor:DsecEnvironment \\
        --ek tier=container

What it does (Harbor's ``BaseEnvironment``):

* ``start(force_build)``: builds the task's ``environment/Dockerfile`` with dsec's image
  builds (``POST /v1/builds``: every step a cached layer of the key, so an unchanged task
  rebuilds nothing; ``force_build`` rebuilds without the cache), or uses the task's
  ``docker_image``, then creates a sandbox of it on the tier ``tier`` with the task's CPUs,
  memory and storage. A Dockerfile that does not build raises Harbor's
  ``SandboxBuildFailedError`` naming the failing step (and the tail of its output, or the
  Dockerfile line dsec refuses); nothing keeps running.
* Snapshot reuse: the first trial of a task in a process snapshots its started environment
  (the sandbox's writable layer, after Harbor's directories are made and the environment
  directory is uploaded); later trials of the same task (same environment content, tier
  and server) start from the image plus that layer without building or setting up again
  (``reuse_snapshot=false`` turns it off; ``force_build`` makes a new one).
* ``stop(delete)``: kills the sandbox (dsec sandboxes are disposable; ``delete=False`` is
  logged and ignored, as Harbor's e2b environment does).
* ``exec(command, cwd, env, timeout_sec, user)``: ``/bin/sh -c`` through dsec's exec, the
  environment's persistent env merged; a timeout raises ``RuntimeError`` as Harbor's docker
  environment does. ``user=None``: the image's ``USER`` (else root).
* Files: ``upload_file``/``download_file`` (dsec's file API), ``upload_dir``/``download_dir``
  (one tar each way, extracted safely).
* Network (Harbor's ``network_mode``): ``no-network`` is no network at all (or, when a later
  phase needs one, a network that reaches nothing, changeable at run time); ``allowlist``
  is exactly the listed hosts (names, ``*.`` wildcards, IPv4 addresses and networks);
  ``public`` is every public IPv4 address, with DNS answered for the ``network_presets``
  (default ``debian,pypi``): dsec's resolver never answers arbitrary names.

Environment kwargs (``--ek key=value``): ``tier`` (``container``, ``microvm``, ``vm``;
default ``container``), ``url`` / ``api_key`` (default ``DSEC_URL`` / ``DSEC_API_KEY``),
``reuse_snapshot`` (default true), ``network_presets`` (comma-separated), ``ttl_s``
(default 86400), ``disk_mb`` (default: the task's storage, else 4096).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import SNAPSHOT_HASH_LEN
from harbor.models.task.config import NetworkMode
from harbor.models.task.config import NetworkPolicy as HarborNetworkPolicy

from dsec.errors import BuildFailed, DsecError, FileNotFound, InvalidRequest
from dsec.network.policy import NetworkPolicy
from dsec.sdk.client import AsyncClient
from dsec.sdk.image import Image
from dsec.sdk.sandbox import AsyncSandbox
from dsec.tiers import tier_has, tiers_with

__all__ = ["DsecEnvironment"]

log = logging.getLogger(__name__)

MAX_EXEC_S = 24 * 3600.0
"""Longest command (dsec's exec bound), seconds; Harbor's ``timeout_sec=None``."""
_ALL = "0.0.0.0/0"
_BLOCK_ALL = NetworkPolicy(allow_cidrs=[_ALL], deny_cidrs=[_ALL])
_IMAGE_CHARS = re.compile(r"[^a-z0-9._-]+")


@dataclass
class _Started:
    """A started environment of one task, snapshotted: its image and top layer."""

    image: str
    layer: str


_snapshots: dict[tuple[str, str, str, str], _Started] = {}
_locks: dict[tuple[str, str, str, str], asyncio.Lock] = {}


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


class DsecEnvironment(BaseEnvironment):
    """Harbor's environment on a dsec sandbox (see the module docstring)."""

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        tier: str = "container",
        url: str | None = None,
        api_key: str | None = None,
        reuse_snapshot: Any = True,
        network_presets: str = "debian,pypi",
        ttl_s: Any = 86400,
        disk_mb: Any = None,
        **kwargs: Any,
    ) -> None:
        if not tier_has(tier, lambda t: t.persistent):  # a task's shell outlives one command
            tiers = tiers_with(lambda t: t.persistent)
            raise ValueError(f"tier must be one of {', '.join(tiers)}, not {tier!r}")
        self._tier = tier
        self._url = url
        self._api_key = api_key
        self._reuse = _truthy(reuse_snapshot)
        self._presets = [p.strip() for p in str(network_presets).split(",") if p.strip()]
        self._ttl_s = float(ttl_s)
        self._disk_mb = int(disk_mb) if disk_mb not in (None, "") else None
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            **kwargs,
        )

    # --- what it is ---------------------------------------------------------------------------
    @staticmethod
    def type() -> str:
        return "dsec"

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True,
        )

    def _validate_definition(self) -> None:
        dockerfile = self.environment_dir / "Dockerfile"
        if not self.task_env_config.docker_image and not dockerfile.is_file():
            raise FileNotFoundError(
                f"{dockerfile} not found (and the task names no docker_image): dsec builds "
                "the task's environment/Dockerfile"
            )

    # --- helpers -------------------------------------------------------------------------------
    def _connection(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self._url, self._api_key)
        return self._client

    def _image_name(self) -> str:
        base = _IMAGE_CHARS.sub("-", self.environment_name.lower()).strip("-._")[:80] or "task"
        return f"harbor-{base}-{self.environment_id[:SNAPSHOT_HASH_LEN]}"

    def _key(self) -> tuple[str, str, str, str]:
        c = self._connection()
        key = self._api_key or os.environ.get("DSEC_API_KEY", "")
        return (c.url, hashlib.sha256(key.encode()).hexdigest(), self.environment_id, self._tier)

    def _policy(self, hp: HarborNetworkPolicy | None = None) -> NetworkPolicy | None:
        """The dsec policy of a Harbor policy (None: no network at all)."""
        hp = hp or self.network_policy
        if hp.network_mode == NetworkMode.NO_NETWORK:
            later = [
                p for p in self._phase_network_policies if p.network_mode != NetworkMode.NO_NETWORK
            ]
            return _BLOCK_ALL if later else None
        if hp.network_mode == NetworkMode.PUBLIC:
            return NetworkPolicy(allow_cidrs=[_ALL], presets=self._presets)
        domains: list[str] = []
        cidrs: list[str] = []
        for host in hp.allowed_hosts:
            (cidrs if host[:1].isdigit() else domains).append(
                host if "/" in host or not host[:1].isdigit() else f"{host}/32"
            )
        if not domains and not cidrs:
            return _BLOCK_ALL
        return NetworkPolicy(allow_domains=domains, allow_cidrs=cidrs)

    async def _build(self, force_build: bool) -> str:
        """The task's image (built, or from the cache): its dsec name."""
        name = self._image_name()
        if self.task_env_config.docker_image:
            ref = self.task_env_config.docker_image
            image = (
                Image.from_registry(ref)
                if "/" in ref or "." in ref.split(":")[0]
                else (Image.from_image(ref))
            )
        else:
            image = Image.from_dockerfile(self.environment_dir / "Dockerfile", self.environment_dir)
        try:
            await image.build_async(
                name,
                client=self._connection(),
                no_cache=force_build,
                on_event=self._on_build_event,
            )
        except BuildFailed as e:
            d = e.details or {}
            tail = str(d.get("output_tail") or "").strip()
            raise SandboxBuildFailedError(
                f"{self.environment_name}: {e.message}"
                + (f"\n--- output ---\n{tail[-2000:]}" if tail else "")
            ) from e
        except InvalidRequest as e:  # a Dockerfile line or step dsec refuses
            raise SandboxBuildFailedError(f"{self.environment_name}: {e.message}") from e
        return name

    def _on_build_event(self, event: Any) -> None:
        kind = getattr(event, "type", "")
        if kind == "step":
            self.logger.debug(f"dsec build {event.step}/{event.total}: {event.instruction}")

    def _sizes(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        cpus = self._effective_cpus
        if cpus is not None:
            out["cpu"] = float(cpus)
        memory = self._effective_memory_mb
        if memory is not None:
            out["memory_mb"] = int(memory)
        disk = self._disk_mb or self._effective_storage_mb
        out["disk_mb"] = int(disk) if disk else 4096
        return out

    async def _create(self, image: str, layers: list[str]) -> AsyncSandbox:
        return await AsyncSandbox.create(
            tier=self._tier,
            image=image,
            layers=layers,
            env=self._startup_env(),
            ttl_s=self._ttl_s,
            labels={
                "harbor.environment": self.environment_name[:200],
                "harbor.session": self.session_id[:200],
            },
            network=self._policy(),
            client=self._connection(),
            **self._sizes(),
        )

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self, force_build: bool) -> None:
        key = self._key()
        if self._reuse and not force_build and key in _snapshots:
            started = _snapshots[key]
            try:
                self._sandbox = await self._create(started.image, [started.layer])
                return
            except DsecError as e:  # the layer or image is gone: start afresh
                self.logger.debug(f"dsec: snapshot of {self.environment_name} unusable: {e}")
                _snapshots.pop(key, None)
        lock = _locks.setdefault(key, asyncio.Lock())
        async with lock:  # concurrent first trials of one task build once
            if self._reuse and not force_build and key in _snapshots:
                started = _snapshots[key]
                self._sandbox = await self._create(started.image, [started.layer])
                return
            image = await self._build(force_build)
            self._sandbox = await self._create(image, [])
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
            if self._reuse:
                layer = await self._sandbox.snapshot()
                _snapshots[key] = _Started(image, layer.digest)

    async def stop(self, delete: bool) -> None:
        if not delete:
            self.logger.debug("dsec sandboxes are disposable: stopped and removed anyway")
        sb, self._sandbox = self._sandbox, None
        try:
            if sb is not None:
                with contextlib.suppress(DsecError):
                    await sb.kill()
        finally:
            if self._client is not None:
                client, self._client = self._client, None
                await client.close()

    def _sb(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("the environment is not started")
        return self._sandbox

    async def _apply_network_policy(self, network_policy: HarborNetworkPolicy) -> None:
        policy = self._policy(network_policy)
        await self._sb().network.update(policy if policy is not None else _BLOCK_ALL)

    # --- commands ------------------------------------------------------------------------------
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        who = self._resolve_user(user)
        callback = self._output_callback()

        def relay(stream: str) -> Any:
            if callback is None:
                return None

            async def on_chunk(chunk: str) -> None:
                await callback(chunk, stream)

            return on_chunk

        timeout = float(timeout_sec) if timeout_sec else MAX_EXEC_S
        r = await self._sb().commands.run(
            command,
            cwd=cwd or self.task_env_config.workdir or None,
            env=self._merge_env(env),
            timeout=timeout,
            user=str(who) if who is not None else None,
            max_output_bytes=32 << 20,
            on_stdout=relay("stdout"),
            on_stderr=relay("stderr"),
        )
        if r.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        code = r.exit_code if r.exit_code is not None else 128 + int(r.signal or 9)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=code)

    # --- files ---------------------------------------------------------------------------------
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        data = await asyncio.to_thread(src.read_bytes)
        mode = (await asyncio.to_thread(src.stat)).st_mode & 0o777
        await self._sb().files.write(target_path, data, mode=mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._sb().files.upload_dir(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._sb().files.read(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await asyncio.to_thread(Path(target_dir).mkdir, parents=True, exist_ok=True)
        await self._sb().files.download_dir(source_dir, target_dir)

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        try:
            return (await self._sb().files.stat(path)).type == "dir"
        except FileNotFound:
            return False

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        try:
            return (await self._sb().files.stat(path)).type == "file"
        except FileNotFound:
            return False
