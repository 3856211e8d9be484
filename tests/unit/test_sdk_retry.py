"""The SDK repeats a request whose connection broke before any answer only when repeating
cannot do the work twice (idempotent method, sequence number or idempotency key)."""

from __future__ import annotations

import httpx
import pytest

import dsec.errors as E
from dsec import AsyncSandbox, ImageNotReady
from dsec.sdk._http import HttpClient, _retry_safe
from dsec.testing import FakeEdge, app_transport


class FlakyTransport(httpx.AsyncBaseTransport):
    """Breaks the first ``breaks`` requests (as a server closing a reused keep-alive
    connection does), then forwards to ``inner``."""

    def __init__(self, inner: httpx.AsyncBaseTransport, breaks: int, exc: type[Exception]):
        self.inner, self.breaks, self.exc, self.seen = inner, breaks, exc, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.breaks > 0:
            self.breaks -= 1
            raise self.exc("Server disconnected without sending a response.")
        return await self.inner.handle_async_request(request)


def test_retry_safety_rule() -> None:
    assert _retry_safe("GET", None) and _retry_safe("delete", {})
    assert not _retry_safe("POST", {"Content-Type": "application/json"})
    assert _retry_safe("POST", {"X-Dsec-Seq": "4"})
    assert _retry_safe("POST", {"idempotency-key": "k1"})


@pytest.mark.parametrize("exc", [httpx.RemoteProtocolError, httpx.ReadError])
async def test_get_is_repeated_once_after_a_broken_connection(exc: type[Exception]) -> None:
    inner, key = app_transport(FakeEdge())
    flaky = FlakyTransport(inner, breaks=1, exc=exc)
    http = HttpClient("http://t", key, transport=flaky)
    r = await http.request("GET", "/v1/sandboxes")
    assert r.status_code == 200 and flaky.seen == 2
    await http.aclose()


async def test_unnumbered_post_is_not_repeated() -> None:
    edge = FakeEdge()
    inner, key = app_transport(edge)
    flaky = FlakyTransport(inner, breaks=1, exc=httpx.RemoteProtocolError)
    http = HttpClient("http://t", key, transport=flaky)
    with pytest.raises(E.ServiceUnavailable):
        await http.request("POST", "/v1/sandboxes", json={"image": "busybox"})
    assert flaky.seen == 1 and not edge.calls_to("create_sandbox")
    await http.aclose()


async def test_numbered_post_is_repeated_and_runs_once() -> None:
    edge = FakeEdge()
    inner, key = app_transport(edge)
    http = HttpClient("http://t", key, transport=inner)
    sid = (await http.request("POST", "/v1/sandboxes", json={})).json()["id"]
    flaky = FlakyTransport(inner, breaks=1, exc=httpx.ReadError)
    http2 = HttpClient("http://t", key, transport=flaky)
    r = await http2.request(
        "POST",
        f"/v1/sandboxes/{sid}/exec",
        json={"cmd": ["echo", "once"]},
        headers={"X-Dsec-Seq": "1"},
    )
    assert r.json()["stdout"] == "once\n" and flaky.seen == 2
    assert edge.executed.get("exec", 0) == 1
    with pytest.raises(E.ServiceUnavailable):  # a second break is not retried again
        flaky.breaks = 2
        await http2.request("GET", f"/v1/sandboxes/{sid}")
    await http.aclose()
    await http2.aclose()


async def test_create_waits_while_its_image_is_being_built() -> None:
    edge = FakeEdge()
    transport, key = app_transport(edge)
    for _ in range(2):  # the node answers "still building" twice, then the image is there
        edge.inject_error("create_sandbox", ImageNotReady("building", retry_after_s=0.01))
    sb = await AsyncSandbox.create(api_key=key, transport=transport, timeout=10)
    assert len(edge.calls_to("create_sandbox")) == 3
    await sb.kill()
    # past its timeout the create gives up with the server's retryable error
    for _ in range(3):
        edge.inject_error("create_sandbox", ImageNotReady("building", retry_after_s=0.4))
    with pytest.raises(ImageNotReady):
        await AsyncSandbox.create(api_key=key, transport=transport, timeout=0.5)
