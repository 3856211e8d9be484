"""``AsyncClient``: the node-level API (images, layers, node info, listing sandboxes).

Sandboxes themselves are driven through :class:`dsec.AsyncSandbox`; pass one client to
many sandboxes (``AsyncSandbox.create(client=c)``) to share a connection pool::

    async with AsyncClient() as client:
        print((await client.node_info()).tiers)
        sandboxes = [await AsyncSandbox.create(client=client) for _ in range(8)]
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from dsec.models import (
    NODE_QUERY,
    BuildImageRequest,
    Capabilities,
    CapabilityList,
    CodeRunRequest,
    CodeRunResult,
    DeleteImageRequest,
    ImageInfo,
    ImageList,
    ImageRef,
    KeyInfo,
    KeyScope,
    LayerInfo,
    LayerList,
    ListSandboxesRequest,
    NodeInfo,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
    SandboxInfo,
    SandboxList,
    ShareImageRequest,
)
from dsec.sdk._http import DEFAULT_TIMEOUT_S, HttpClient
from dsec.sdk._tar import build_context
from dsec.wire import ANSWER, validated

if TYPE_CHECKING:
    from dsec.sdk.jobs import AsyncJobs

if TYPE_CHECKING:
    from dsec.sdk.image import EventCallback, Image

__all__ = ["AsyncClient"]


BUILD_TIMEOUT_S = 1800.0
"""Default wait for an image build, seconds."""


class AsyncClient:
    """A connection to one dsec server.

    Args:
        url: server URL; default ``$DSEC_URL`` or ``http://127.0.0.1:7070``.
        api_key: default ``$DSEC_API_KEY`` or the contents of ``$DSEC_HOME/api_key``.
        timeout: default per-request timeout, seconds.
        transport: an httpx async transport, e.g. ``httpx.ASGITransport(app)`` in tests
            (see :func:`dsec.testing.app_transport`).
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._http = HttpClient(url, api_key, timeout=timeout, transport=transport)

    @property
    def url(self) -> str:
        """The server URL this client talks to."""
        return self._http.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    async def node_info(self) -> NodeInfo:
        """The node's name, version, load and per-tier capabilities."""
        node: NodeInfo = await self._http.call("node_info", NODE_QUERY)
        return node

    async def key_info(self) -> KeyInfo:
        """This key: its owner id, role, quota (what the operator lets it hold and how fast
        it may create) and what it holds now."""
        r = await self._http.request("GET", "/v1/key")
        return KeyInfo.model_validate(r.json(), context=ANSWER)

    async def capabilities(self) -> builtins.list[Capabilities]:
        """What each tier can do on this node."""
        listed: CapabilityList = await self._http.call("capabilities", NODE_QUERY)
        return listed.tiers

    async def list_images(self) -> builtins.list[ImageInfo]:
        """This key's images and the system's (built-in images not built yet show their
        ``status``: ``queued``, ``building`` or ``failed``)."""
        images: ImageList = await self._http.call("list_images", KeyScope())
        return images.images

    async def get_image(self, name: str) -> ImageInfo:
        """One image by ``name[:tag]`` or ``sha256:<digest>``; raises ``ImageNotFound``."""
        req = validated(ImageRef, name=name)
        image: ImageInfo = await self._http.call("get_image", req)
        return image

    async def delete_image(self, name: str, *, system: bool = False) -> None:
        """Forget one of this key's images (``system``: a system image; the operator's key
        only). Its layers stay while sandboxes use them. Raises ``ImageNotFound``."""
        req = validated(DeleteImageRequest, name=name, system=system)
        await self._http.call("delete_image", req)

    async def share_image(self, name: str, shared: bool = True) -> ImageInfo:
        """Let every key use this key's image ``name`` as ``<owner>/<name>``
        (``shared=False`` takes it back); the answer's ``owner`` is the prefix to use."""
        req = validated(ShareImageRequest, name=name, shared=shared)
        image: ImageInfo = await self._http.call("share_image", req)
        return image

    async def list_layers(self) -> builtins.list[LayerInfo]:
        """The layers this key may name by digest (its images', snapshots', builds' and the
        system's)."""
        layers: LayerList = await self._http.call("list_layers", KeyScope())
        return layers.layers

    async def build_image(
        self,
        path: str | os.PathLike[str],
        name: str,
        kind: str = "workspace",
        base: str | None = None,
        *,
        system: bool = False,
        timeout: float = BUILD_TIMEOUT_S,
    ) -> ImageInfo:
        """Build an image from a *local* directory or tar archive: ``path`` is packed here
        and uploaded as the build context; its files become one layer on top of ``base``.

        Args:
            path: a directory or a tar archive (plain, gzip, bzip2 or xz) on this machine.
            name: image name (``name[:tag]``); it belongs to this key.
            kind: ``base``, ``workspace`` or ``toolkit``.
            base: image to stack the new layer on.
            system: publish as a system image, visible to every key (the operator's key
                only; ``PermissionDenied`` otherwise).
            timeout: how long to wait, seconds.
        """
        req = validated(BuildImageRequest, name=name, kind=kind, base=base, system=system)
        context = await asyncio.to_thread(build_context, Path(path))
        params = {k: v for k, v in req.model_dump(mode="json").items() if v is not None}
        r = await self._http.request(
            "POST",
            "/v1/images/build",
            params=params,
            content=context,
            headers={"content-type": "application/x-tar"},
            timeout=timeout,
        )
        return ImageInfo.model_validate(r.json(), context=ANSWER)

    async def build(
        self,
        image: Image,
        name: str,
        *,
        on_event: EventCallback | None = None,
        timeout: float = 3600.0,
        **options: Any,
    ) -> ImageInfo:
        """Build ``image`` (a :class:`dsec.Image`) as this key's image ``name`` and return it
        when it is stored. ``on_event`` (sync or async) sees every build event as it comes;
        ``options`` are :meth:`dsec.Image.request` options. Raises ``BuildFailed`` when a
        step's command fails (``details``: step, instruction, output_tail)."""
        from dsec.builds.wire import BuildDone
        from dsec.errors import ServiceUnavailable
        from dsec.sdk.image import call_back

        async for event in self.build_events(image, name, timeout=timeout, **options):
            await call_back(on_event, event)
            if isinstance(event, BuildDone):
                return event.image
        raise ServiceUnavailable(  # pragma: no cover - build_events raises first
            "the build stream ended without a result"
        )

    async def build_events(
        self, image: Image, name: str, *, timeout: float = 3600.0, **options: Any
    ) -> AsyncIterator[Any]:
        """Build ``image`` as ``name``, yielding the server's build events
        (:mod:`dsec.builds.wire`: ``start``, ``step``, ``cached``, ``output``, ``step_done``,
        ``done``). An ``error`` event is raised as its :class:`~dsec.errors.DsecError`
        (``BuildFailed`` for a failed command); events of types this SDK does not know are
        skipped. ``POST /v1/builds``; ``timeout``: the whole build, seconds."""
        from dsec.builds.wire import BuildDone, BuildError, encode_build_upload, parse_event
        from dsec.errors import ServiceUnavailable, error_from_wire

        req = image.request(name, **options)
        context = await asyncio.to_thread(image.context)
        body = encode_build_upload(req, context)
        async with self._http.stream(
            "POST",
            "/v1/builds",
            content=body,
            headers={"content-type": "application/x-tar"},
            timeout=timeout,
        ) as response:
            async for line in response.aiter_lines():
                event = parse_event(line)
                if event is None:
                    continue
                if isinstance(event, BuildError):
                    raise error_from_wire(422, event.to_wire_error())
                yield event
                if isinstance(event, BuildDone):
                    return
        raise ServiceUnavailable(
            f"the build stream of {name} ended before the build did (the server went away?)",
            delivered=True,
        )

    async def pull_image(
        self,
        ref: str,
        name: str | None = None,
        *,
        lazy: bool = False,
        system: bool = False,
        timeout: float = BUILD_TIMEOUT_S,
    ) -> ImageInfo:
        """Pull ``ref`` (``[registry/]repo[:tag][@sha256:...]`` or ``oci://HOST/REPO:TAG``)
        from an OCI / Docker v2 registry into the server's layer store; returns the new image,
        which belongs to this key (``system``: a system image, the operator's key only).

        Args:
            ref: the image reference.
            name: name[:tag] in the store (default: derived from the reference).
            lazy: for an image pushed with :meth:`push_image`: record its layers as remote
                and fetch their data on first read (the first start reads only what it needs).
            system: store it as a system image (operator only).
            timeout: how long to wait, seconds.
        """
        req = validated(PullImageRequest, ref=ref, name=name, lazy=lazy, system=system)
        image: ImageInfo = await self._http.call("pull_image", req, timeout=timeout)
        return image

    async def push_image(
        self, name: str, target: str, *, timeout: float = BUILD_TIMEOUT_S
    ) -> PushImageResult:
        """Publish the server's image ``name`` to an OCI registry as a dsec artifact.

        Args:
            name: the image (name[:tag]).
            target: ``oci://HOST[:PORT]/REPOSITORY[:TAG]``.
            timeout: how long to wait, seconds.

        Returns:
            The pushed manifest's digest, with the image and target.
        """
        req = validated(PushImageRequest, name=name, target=target)
        result: PushImageResult = await self._http.call("push_image", req, timeout=timeout)
        return result

    async def run_code(
        self,
        code: str,
        language: str = "python",
        *,
        stdin: str | None = None,
        files: dict[str, bytes] | None = None,
        fetch_files: list[str] | None = None,
        timeout: float = 10.0,
        compile_timeout: float = 30.0,
        memory_mb: int | None = None,
        env: dict[str, str] | None = None,
    ) -> CodeRunResult:
        """Run one snippet in a fresh ``fncall`` worker and return its
        :class:`~dsec.models.CodeRunResult` (``outcome`` is ok,
        compile_error, runtime_error, timeout, compile_timeout or oom).

        Args:
            code: the program text.
            language: python, bash, c, cpp (node, go, java where the node has the toolkit).
            stdin: text fed to the program.
            files: path under /work -> content, written before the run.
            fetch_files: paths under /work to return (base64) after the run.
            timeout: run wall-clock limit, seconds.
            compile_timeout: compile limit for compiled languages, seconds.
            memory_mb: memory limit, MiB (default: the pool's).
            env: extra environment variables.
        """
        import base64

        req = CodeRunRequest(
            code=code,
            language=language,
            stdin=stdin,
            files={k: base64.b64encode(v).decode() for k, v in (files or {}).items()},
            fetch_files=list(fetch_files or []),
            timeout_s=timeout,
            compile_timeout_s=compile_timeout,
            memory_mb=memory_mb,
            env=dict(env or {}),
        )
        r = await self._http.request(
            "POST",
            "/v1/run_code",
            json=req.model_dump(mode="json"),
            # the call's own limits plus time to get a worker, and never less than the
            # client's timeout (a node under load may take a while to start a pool)
            timeout=max(self._http.timeout or 0.0, timeout + compile_timeout + 30),
        )
        return CodeRunResult.model_validate(r.json(), context=ANSWER)

    async def list_sandboxes(
        self,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> builtins.list[SandboxInfo]:
        """This key's sandboxes, filtered by state, labels (all must match) and job."""
        req = ListSandboxesRequest.of(labels, state=state, job=job, include_stopped=include_stopped)
        listed: SandboxList = await self._http.call("list_sandboxes", req)
        return listed.sandboxes

    @property
    def jobs(self) -> AsyncJobs:
        """The job API over this client's connections: an :class:`~dsec.jobs.AsyncJobs`
        (``await client.jobs.pause("run-42")``)."""
        from dsec.sdk.jobs import AsyncJobs

        return AsyncJobs(self)

    async def close(self) -> None:
        """Close pooled connections. The client stays usable (it reconnects on demand)."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
