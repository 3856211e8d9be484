"""Locations and settings, read from the environment.

``DSEC_HOME`` (default ``/var/lib/dsec``) holds everything a node keeps:

    $DSEC_HOME/
      state.db            SQLite registry (sandboxes, keys)
      api_key             the key generated at first start (mode 0600)
      layers/             content-addressed EROFS files + layers.db
      mnt/layers/<hex>    each layer mounted once per key (<scope>-<hex>) or node (<hex>)
      sandboxes/<id>/     per-sandbox upper (tmpfs), overlay rootfs, OCI bundle
      run/                crun state root, sockets
      bin/                native helpers compiled for this node
      images/             scratch space for image builds

``DSEC_URL`` (default ``http://127.0.0.1:7070``) is where the SDK and CLI find the server;
``DSEC_API_KEY`` overrides the key file.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_HOME = "/var/lib/dsec"
DEFAULT_URL = "http://127.0.0.1:7070"


def host_memory_mb() -> int:
    """This node's physical memory (``MemTotal``), MiB; 0 when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable ``name`` as one of ``choices`` (case and surrounding spaces
    ignored); the first choice, the default, when it is unset or anything else (logged once
    per value), e.g. ``env_choice("DSEC_LAYER_SHARING", ("key", "node"))``."""
    value = os.environ.get(name, "").strip().lower()
    if value in choices:
        return value
    if value:
        _warn_choice(name, value, choices)
    return choices[0]


@functools.cache
def _warn_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    log.warning("%s=%r is not one of %s: using %s", name, value, ", ".join(choices), choices[0])


def dsec_home() -> Path:
    return Path(os.environ.get("DSEC_HOME", DEFAULT_HOME))


def dsec_url() -> str:
    return os.environ.get("DSEC_URL", DEFAULT_URL).rstrip("/")


@dataclass(frozen=True)
class Paths:
    home: Path

    @classmethod
    def from_env(cls) -> Paths:
        return cls(dsec_home())

    @property
    def state_db(self) -> Path:
        return self.home / "state.db"

    @property
    def api_key_file(self) -> Path:
        return self.home / "api_key"

    @property
    def layers(self) -> Path:
        return self.home / "layers"

    @property
    def layer_mounts(self) -> Path:
        return self.home / "mnt" / "layers"

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def bin(self) -> Path:
        return self.home / "bin"

    @property
    def scratch(self) -> Path:
        return self.home / "images"

    def ensure(self) -> None:
        for p in (
            self.home,
            self.layers,
            self.layer_mounts,
            self.sandboxes,
            self.run,
            self.bin,
            self.scratch,
        ):
            p.mkdir(parents=True, exist_ok=True)
        os.chmod(self.home, 0o711)
