"""TCP ports of VM sandboxes: connections to the guest's loopback carried by the guest
agent (TCP_OPEN/DATA/ACK/EOF/SHUT/CLOSE over virtio-serial), with flow control both ways.
The guest has no network device: nothing but the agent channel reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from tests.timing import budget

from dsec.contract.edge import PortStream
from dsec.contract.runtime import Handle, PortConnectable, capabilities_of
from dsec.errors import PortNotListening
from dsec.models import ExecRequest
from dsec.runtimes.microvm import MicroVMRuntime

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(240)]

MakeVM = Callable[..., Awaitable[Handle]]


async def sh(rt: MicroVMRuntime, h: Handle, cmd: str, timeout: float = 60) -> str:
    r = await rt.exec(h, ExecRequest(cmd=cmd, timeout_s=timeout))
    assert r.exit_code == 0, (cmd, r)
    return r.stdout


async def connect_when_listening(rt: MicroVMRuntime, h: Handle, port: int) -> PortStream:
    """``connect_port`` once something listens on ``port`` (a server started in the
    background: waited for, at most ``budget(10)``)."""
    deadline = asyncio.get_running_loop().time() + budget(10)
    while True:
        try:
            return await rt.connect_port(h, port)
        except PortNotListening:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def read_all(stream: object) -> bytes:
    data = b""
    while chunk := await stream.read(1 << 20):  # type: ignore[attr-defined]
        data += chunk
    return data


async def test_http_through_the_guest_agent(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    assert isinstance(microvm, PortConnectable) and capabilities_of(microvm).ports
    h = await make_vm()
    await sh(
        microvm, h, "mkdir -p /www && echo in-the-guest > /www/i && httpd -p 127.0.0.1:8000 -h /www"
    )
    s = await microvm.connect_port(h, 8000)
    await s.write(b"GET /i HTTP/1.0\r\nHost: x\r\n\r\n")
    answer = await read_all(s)
    await s.close()
    assert answer.startswith(b"HTTP/1.") and answer.endswith(b"in-the-guest\n"), answer
    with pytest.raises(PortNotListening):
        await microvm.connect_port(h, 8001)
    # many connections one after another: slots are released
    for _ in range(20):
        s = await microvm.connect_port(h, 8000)
        await s.write(b"GET /i HTTP/1.0\r\n\r\n")
        assert (await read_all(s)).endswith(b"in-the-guest\n")
        await s.close()


async def test_bulk_both_ways_with_flow_control(microvm: MicroVMRuntime, make_vm: MakeVM) -> None:
    """More than a window each way: guest -> host 6 MiB read slowly (the guest waits for
    acknowledgements), host -> guest 3 MiB (the host waits for the guest's)."""
    h = await make_vm(memory_mb=384)
    await sh(
        microvm,
        h,
        "dd if=/dev/urandom of=/tmp/blob bs=1M count=6 2>/dev/null; md5sum /tmp/blob > /tmp/blob.md5",
    )
    await sh(microvm, h, "(nc -l -p 9000 < /tmp/blob &) ; (nc -l -p 9001 > /tmp/up &)")
    down = await connect_when_listening(microvm, h, 9000)
    got = bytearray()
    while chunk := await down.read(256 * 1024):
        got += chunk
        if len(got) < 2 << 20:
            await asyncio.sleep(0.01)  # a slow reader first
    await down.close()
    assert len(got) == 6 << 20
    import hashlib

    want = (await sh(microvm, h, "cat /tmp/blob.md5")).split()[0]
    assert hashlib.md5(got).hexdigest() == want
    up = await connect_when_listening(microvm, h, 9001)
    payload = bytes(range(256)) * (3 * 4096)  # 3 MiB
    await up.write(payload)
    await up.write_eof()
    assert await up.read() == b""  # nc exits once it read EOF
    await up.close()
    deadline = asyncio.get_running_loop().time() + budget(5)
    while asyncio.get_running_loop().time() < deadline:
        size = (await sh(microvm, h, "wc -c < /tmp/up")).strip()
        if size == str(len(payload)):
            break
        await asyncio.sleep(0.1)
    assert size == str(len(payload))
