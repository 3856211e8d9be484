"""What keeps test processes that run at once apart: each xdist worker its own subnets.

``make test`` runs the suite in several pytest-xdist workers on one machine. Homes are per
process (``/tmp/dsec-test-<pid>``, ``tmp_path``), ports are picked free, cgroups, nftables
tables and VM template RAM are named after the home; what a test names itself must be per
worker too. A sandbox subnet is the one such name: two servers whose subnets overlap
refuse to start (the second sees the first's route). A module keeps its own second octet
(so two modules never share a subnet) and each worker takes a /20 of it::

    SUBNET = worker_subnet(233)        # 10.233.0.0/20 in worker 0, 10.233.16.0/20 in gw1
    GATEWAY = subnet_host(SUBNET, 1)   # the first host address (the node's side)

``DSEC_NET_SUBNET`` (the default servers' subnet) is set per worker by ``tests/conftest.py``.
"""

from __future__ import annotations

import ipaddress
import os

__all__ = ["WORKER", "subnet_host", "worker_subnet"]


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; unset outside xdist
    try:
        return int(name.removeprefix("gw")) % 16
    except ValueError:
        return 0


WORKER = _worker_index()
"""This process's xdist worker number (0 outside xdist); 16 at most are told apart."""


def worker_subnet(second_octet: int) -> str:
    """``10.<second_octet>.<16 * WORKER>.0/20``: a module's sandbox subnet in this worker."""
    if not 0 <= second_octet <= 255:
        raise ValueError(f"second octet {second_octet} out of range")
    return f"10.{second_octet}.{16 * WORKER}.0/20"


def subnet_host(subnet: str, n: int) -> str:
    """The ``n``-th address of ``subnet`` (1: the first host, the node's gateway)."""
    return str(ipaddress.IPv4Network(subnet).network_address + n)
