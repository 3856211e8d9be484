"""Schemathesis hooks for fuzzing dsec (loaded through ``SCHEMATHESIS_HOOKS``).

* ``application/x-tar`` request bodies (``PUT .../files/tar``): schemathesis has no
  serializer for them. Half the generated bodies are sent as raw bytes (not an archive:
  must be a 400), the other half wrapped as one member of a real tar archive, so the
  unpacking code runs too.
* ``application/x-ndjson`` responses (``exec/stream``, ``trajectory``): parsed line by
  line, so a line that is not JSON is reported.
* ``GET .../audit?follow=true`` streams until the sandbox stops (its documented answer): the
  fuzzer, which reads a whole answer before checking it, asks it without ``follow``.
* A ``name`` (query or JSON body) that is a built-in image's gets a ``fuzz-`` prefix: a key's
  own image of that name (a build, a snapshot, a pull) stands in for the built-in one for
  that key, as documented, and the hand-written fuzz tests after this run create
  ``busybox`` sandboxes with the same key.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

import schemathesis
from schemathesis.transport.serialization import serialize_binary


@schemathesis.serializer("application/x-tar")
def tar_body(ctx: Any, value: Any) -> bytes:
    data = serialize_binary(value)
    if len(data) % 2:
        return data
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(f"fuzz/{hashlib.sha256(data).hexdigest()[:12]}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@schemathesis.deserializer("application/x-ndjson")
def ndjson_body(ctx: Any, response: Any) -> Any:
    lines = [line for line in response.content.splitlines() if line.strip()]
    # the documented schema is that of one line (an ExecEvent) or a string: validate the
    # last line of an exec stream (the exit or error event), the text of anything else
    parsed = [json.loads(line) for line in lines]
    path = str(getattr(ctx.operation, "path", ""))
    if path.endswith("/exec/stream"):
        return parsed[-1] if parsed else {}
    return response.content.decode()


BUILTIN_NAMES = frozenset({"busybox", "debian", "e2b-base", "code-interpreter", "desktop"})


def _rename_builtin(data: Any) -> Any:
    if isinstance(data, dict) and data.get("name") in BUILTIN_NAMES:
        return {**data, "name": f"fuzz-{data['name']}"}
    return data


@schemathesis.hook
def map_query(ctx: Any, query: Any) -> Any:
    path = str(getattr(ctx.operation, "path", ""))
    if isinstance(query, dict) and path.endswith("/audit") and "follow" in query:
        query = {**query, "follow": False}
    return _rename_builtin(query)


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """``follow`` off in every phase, whatever form it was given in: the coverage phase's
    cases do not all pass through ``map_query`` (a ``follow`` of ``1`` or ``["true"]`` for
    a sandbox that exists streamed until the request timed out)."""
    query = case.query
    if (
        str(case.operation.path).endswith("/audit")
        and isinstance(query, dict)
        and "follow" in query
    ):
        case.query = {**query, "follow": "false"}


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    return _rename_builtin(body)
