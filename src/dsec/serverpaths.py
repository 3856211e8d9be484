"""Server paths that must not leave the server (error messages of the API, E2B, run_code).

A server registers its state directories once at start (``dsec serve`` registers
``$DSEC_HOME`` and where its ``layers/`` leads); :func:`scrub_server_paths` then shows each
as its placeholder. :mod:`dsec.errors` applies it to every wire form of an error
(``DsecError.to_wire``, ``DsecError.public_message``), so the exception keeps the real path
for the server's own log while clients see ``$DSEC_HOME/sandboxes/sb-.../rootfs``.

The registry is process-wide (a server process has one home; a test process that runs
several servers registers each), append-only and thread-safe.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

__all__ = ["hide_server_path", "scrub_server_paths"]

_hidden_lock = threading.Lock()
_hidden: dict[str, str] = {}  # absolute server path -> placeholder
_hidden_re: re.Pattern[str] | None = None


def hide_server_path(path: str | os.PathLike[str], placeholder: str) -> None:
    """Show ``path`` (and its resolved form, if a symlink leads elsewhere) as ``placeholder``
    in every error that leaves this process (the JSON bodies of the API, E2B and run_code
    answers). For server state directories (``$DSEC_HOME``), never for ``/``."""
    global _hidden_re
    raw = os.path.abspath(os.fspath(path))
    forms = {raw.rstrip("/"), os.path.realpath(raw).rstrip("/")}
    with _hidden_lock:
        for form in forms:
            if form and form != "/":
                _hidden[form] = placeholder
        # longest first, so a registered subdirectory wins over its parent; a match ends
        # where the path does (``/srv/dsec`` does not match inside ``/srv/dsec2``)
        alts = "|".join(re.escape(p) for p in sorted(_hidden, key=len, reverse=True))
        _hidden_re = re.compile(f"(?:{alts})(?![\\w.-])") if alts else None


def scrub_server_paths(value: Any) -> Any:
    """``value`` with every :func:`hide_server_path` path replaced by its placeholder:
    strings, and the strings inside lists, tuples and dicts (keys too); anything else as is."""
    pattern = _hidden_re
    if pattern is None:
        return value
    return _scrub(value, pattern)


def _scrub(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        if "/" not in value:
            return value
        return pattern.sub(lambda m: _hidden.get(m.group(0), m.group(0)), value)
    if isinstance(value, dict):
        return {_scrub(k, pattern): _scrub(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, pattern) for v in value]
    return value
