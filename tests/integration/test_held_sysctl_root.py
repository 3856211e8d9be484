"""A host-wide sysctl held by several nodes at once goes back only when the last one leaves.

``net.ipv4.ip_forward`` is per network namespace, so each test runs in a namespace of its
own and never touches the host's value (other tests' servers route through it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from dsec.privileged.hostsysctl import ORIGINAL, HeldSysctl
from dsec.privileged.netns import create_netns, delete_netns, in_netns, write_sysctl

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)"),
]

T = TypeVar("T")
KEY = "net.ipv4.ip_forward"


class Ns:
    def __init__(self, path: Path) -> None:
        self.path = path

    def run(self, fn: Callable[[], T]) -> T:
        return in_netns(self.path, fn)

    def value(self) -> str:
        return self.run(lambda: Path("/proc/sys/net/ipv4/ip_forward").read_text().strip())

    def set(self, value: str) -> None:
        write_sysctl(KEY, value, self.path)


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Ns]:
    path = tmp_path / "ns"
    create_netns(path)
    yield Ns(path)
    delete_netns(path)


def test_the_last_holder_restores_and_not_before(ns: Ns, tmp_path: Path) -> None:
    root = tmp_path / "holders"
    ns.set("0")
    a, b = HeldSysctl(KEY, "1", "a", root), HeldSysctl(KEY, "1", "b", root)
    ns.run(a.hold)
    assert ns.value() == "1" and (root / KEY / ORIGINAL).read_text() == "0"
    ns.run(b.hold)  # found it on: but the value to restore is still the first one's
    ns.run(a.release)
    assert ns.value() == "1"  # b still routes through this host
    ns.run(a.release)  # a second release is a no-op
    assert ns.value() == "1"
    ns.run(b.release)
    assert ns.value() == "0"
    assert os.listdir(root / KEY) == []


def test_a_value_already_right_is_left_alone(ns: Ns, tmp_path: Path) -> None:
    ns.set("1")
    held = HeldSysctl(KEY, "1", "node", tmp_path)
    ns.run(held.hold)
    ns.run(held.release)
    assert ns.value() == "1"


def test_an_older_nodes_note_is_kept(ns: Ns, tmp_path: Path) -> None:
    ns.set("1")  # set by an older dsec that noted "0"
    held = HeldSysctl(KEY, "1", "node", tmp_path)
    ns.run(lambda: held.hold(found_before="0"))
    ns.run(held.release)
    assert ns.value() == "0"


def test_a_dead_holder_does_not_pin_the_value(ns: Ns, tmp_path: Path) -> None:
    """A holder killed with SIGKILL leaves its file; the next holder drops it."""
    ns.set("0")
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from dsec.privileged.hostsysctl import HeldSysctl\n"
        "from dsec.privileged.netns import in_netns\n"
        f"h = HeldSysctl({KEY!r}, '1', 'child', Path({str(tmp_path)!r}))\n"
        f"in_netns({str(ns.path)!r}, h.hold)\n"
        "print('held', flush=True)\nsys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        mine = HeldSysctl(KEY, "1", "node", tmp_path)
        ns.run(mine.hold)
        ns.run(mine.release)
        assert ns.value() == "1"  # the child is alive: it still holds
        child.kill()
        child.wait()
        again = HeldSysctl(KEY, "1", "node", tmp_path)
        ns.run(again.hold)
        ns.run(again.release)
        assert ns.value() == "0"  # the dead child's hold is gone; the first value is back
    finally:
        child.kill()
        child.wait()


def test_a_node_restarted_in_its_process_takes_over_its_hold(ns: Ns, tmp_path: Path) -> None:
    """A node closed with sandboxes still running keeps its hold (they still route); the
    same node made again in the same process is that holder, so its release restores."""
    ns.set("0")
    first = HeldSysctl(KEY, "1", "/var/lib/dsec/net", tmp_path)
    ns.run(first.hold)  # and never released: its sandboxes outlived it
    again = HeldSysctl(KEY, "1", "/var/lib/dsec/net", tmp_path)
    other = HeldSysctl(KEY, "1", "/srv/other-node/net", tmp_path)
    ns.run(again.hold)
    ns.run(other.hold)
    ns.run(again.release)
    assert ns.value() == "1"  # the other node still holds
    ns.run(other.release)
    assert ns.value() == "0"
