"""The machine-wide cache of the host matrix (``$DSEC_HOSTS_CACHE``, default
``/var/cache/dsec-hosts``): root filesystem images (:mod:`hosts.image`) and wheelhouses
(:mod:`hosts.wheels`), each built under an exclusive ``flock`` so that two runs at once
build it once."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.layers.builtin_cache import flocked  # one cross-process build lock for all caches

__all__ = ["CACHE_ENV", "DEFAULT_CACHE", "cache_dir", "flocked"]

CACHE_ENV = "DSEC_HOSTS_CACHE"
DEFAULT_CACHE = "/var/cache/dsec-hosts"


def cache_dir() -> Path:
    """``$DSEC_HOSTS_CACHE`` or ``/var/cache/dsec-hosts``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
