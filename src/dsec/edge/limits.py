"""The edge's admission limits and switches, from the environment (``DSEC_*``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from dsec.edge.logs import log_bytes_from_env

if TYPE_CHECKING:
    pass

log = logging.getLogger("dsec.edge")

T = TypeVar("T")


@dataclass
class EdgeLimits:
    """Node admission limits. Overcommit is expected: most sandboxes idle while the model thinks."""

    max_sandboxes: int = 4096
    cpu_overcommit: float = 10.0  # sum of requested cores <= this x physical cores
    memory_overcommit: float = 1.5  # sum of requested memory <= this x physical memory
    max_read_bytes: int = 256 << 20
    max_tar_bytes: int = 1 << 30
    stopped_retention_s: float = 3600.0
    reap_interval_s: float = 1.0
    gap_wait_s: float = 5.0  # how long a seq that skips ahead waits for the missing ones
    job_concurrency: int = 64
    create_concurrency: int = 8  # creations in flight per batch call
    image_wait_s: float = 20.0  # a create waits this long for a built-in image being built
    max_build_context_bytes: int = 256 << 20  # an uploaded build context, bytes
    max_build_bytes: int = 4 << 30  # what a build context may unpack to, bytes
    max_build_entries: int = 500_000  # files, directories and links in a build context
    log_bytes: int = 1 << 20  # start-command output kept per sandbox (its logs), bytes
    max_port_connections: int = 256  # open proxied connections per sandbox (429 beyond)
    create_slots: int = 0  # creations in the runtime at once (0: twice the cores, at least 4)
    create_queue: int = 10_000  # creations waiting for a slot (503 node_busy beyond)
    create_wait_s: float = 900.0  # longest wait for a slot (503 node_busy after it)
    key_cpu_groups: bool = False  # each key's sandboxes share one weighted cgroup (quotas.py)

    @classmethod
    def from_env(cls) -> EdgeLimits:
        """Defaults, overridden by ``DSEC_MAX_SANDBOXES``, ``DSEC_CPU_OVERCOMMIT``,
        ``DSEC_MEMORY_OVERCOMMIT``, ``DSEC_IMAGE_WAIT_S`` (seconds a create waits for a
        built-in image being built), ``DSEC_MAX_BUILD_CONTEXT_BYTES``,
        ``DSEC_MAX_BUILD_BYTES``, ``DSEC_CREATE_SLOTS``/``DSEC_CREATE_QUEUE``/
        ``DSEC_CREATE_WAIT_S`` (:mod:`dsec.edge.admission`), ``DSEC_KEY_CPU_GROUPS``
        (``on``: a key's sandboxes share one cgroup of its ``cpu_weight``,
        :mod:`dsec.edge.quotas`; off by default),
        ``DSEC_MAX_PORT_CONNECTIONS``
        (open proxied connections per sandbox) and ``DSEC_LOG_BYTES`` (start-command output
        kept per sandbox): the operator settings of ``dsec serve``."""
        lim = cls()
        env = os.environ
        try:
            if "DSEC_MAX_SANDBOXES" in env:
                lim.max_sandboxes = int(env["DSEC_MAX_SANDBOXES"])
            if "DSEC_CPU_OVERCOMMIT" in env:
                lim.cpu_overcommit = float(env["DSEC_CPU_OVERCOMMIT"])
            if "DSEC_MEMORY_OVERCOMMIT" in env:
                lim.memory_overcommit = float(env["DSEC_MEMORY_OVERCOMMIT"])
            if "DSEC_IMAGE_WAIT_S" in env:
                lim.image_wait_s = float(env["DSEC_IMAGE_WAIT_S"])
            if "DSEC_MAX_BUILD_CONTEXT_BYTES" in env:
                lim.max_build_context_bytes = int(env["DSEC_MAX_BUILD_CONTEXT_BYTES"])
            if "DSEC_MAX_BUILD_BYTES" in env:
                lim.max_build_bytes = int(env["DSEC_MAX_BUILD_BYTES"])
            lim.log_bytes = log_bytes_from_env()
            if "DSEC_MAX_PORT_CONNECTIONS" in env:
                lim.max_port_connections = int(env["DSEC_MAX_PORT_CONNECTIONS"])
            if "DSEC_CREATE_SLOTS" in env:
                lim.create_slots = int(env["DSEC_CREATE_SLOTS"])
            if "DSEC_CREATE_QUEUE" in env:
                lim.create_queue = int(env["DSEC_CREATE_QUEUE"])
            if "DSEC_CREATE_WAIT_S" in env:
                lim.create_wait_s = float(env["DSEC_CREATE_WAIT_S"])
            raw = env.get("DSEC_KEY_CPU_GROUPS", "off").strip().lower()
            if raw not in ("on", "off", "1", "0"):
                raise ValueError(f"DSEC_KEY_CPU_GROUPS must be on or off, not {raw!r}")
            lim.key_cpu_groups = raw in ("on", "1")
        except ValueError as e:
            raise SystemExit(f"invalid edge limit in the environment: {e}") from e
        return lim
