"""E2B's code-interpreter wire format: request bodies in, NDJSON output lines out.

Pure functions (stdlib only), so they are tested without a kernel.

``POST /execute`` answers ``200`` with ``Content-Type: application/x-ndjson`` and one JSON
object per line, in the order the kernel produced them:

=========================  =================================================================
line ``type``              fields
=========================  =================================================================
``number_of_executions``   ``execution_count`` (the cell's ``In[n]``), first
``stdout`` / ``stderr``    ``text``, ``timestamp`` (ISO 8601, the kernel's message date)
``result``                 ``is_main_result`` (``True`` for the cell's value, ``False`` for
                           ``display()`` calls such as matplotlib figures), ``text``, ``html``,
                           ``markdown``, ``svg``, ``png`` / ``jpeg`` / ``pdf`` (base64),
                           ``latex``, ``json``, ``javascript``, ``data`` (``e2b/data``),
                           ``chart`` (``e2b/chart``), ``extra`` (any other MIME types)
``error``                  ``name``, ``value``, ``traceback`` (one string)
``keepalive``              nothing; sent every few seconds of silence so that a client that
                           went away is noticed (the client ignores it)
``end_of_execution``       nothing; always the last line
=========================  =================================================================

This is what e2b-code-interpreter's ``parse_output`` reads (unknown types are ignored by it).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "DEFAULT_LANGUAGE",
    "ExecuteRequest",
    "RequestError",
    "env_restore_code",
    "env_set_code",
    "normalize_language",
    "output_line",
    "parse_create_context",
    "parse_execute",
    "result_fields",
    "timestamp_of",
]

DEFAULT_LANGUAGE = "python"
_ALIASES = {
    "py": "python",
    "python3": "python",
    "js": "javascript",
    "ts": "typescript",
    "sh": "bash",
    "shell": "bash",
}
_BASH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_ENV_VARS = 1024

# Jupyter MIME type -> field of E2B's Result (e2b_code_interpreter.models.Result).
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status (400, 404, 422)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ExecuteRequest:
    """A parsed ``POST /execute`` body (``code``, ``context_id``, ``language``, ``env_vars``)."""

    code: str
    context_id: str | None
    language: str | None
    env_vars: dict[str, str]


def normalize_language(language: str | None) -> str:
    """E2B's language names: none -> ``python``; ``js`` -> ``javascript``, ``ts`` ->
    ``typescript``; case and surrounding spaces ignored."""
    if not language:
        return DEFAULT_LANGUAGE
    name = language.strip().lower()
    return _ALIASES.get(name, name)


def _json_body(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(422, f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(422, "the body must be a JSON object")
    return data


def _opt_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(422, f"{key!r} must be a string or null")
    return value


def parse_execute(body: bytes) -> ExecuteRequest:
    """Parse and check an ``/execute`` body.

    Raises:
        RequestError: 422 for a body that is not a JSON object or has wrong types (what
            E2B's FastAPI server answers), 400 for ``context_id`` together with
            ``language`` (as E2B does) or for unusable environment variables.
    """
    data = _json_body(body)
    code = data.get("code")
    if not isinstance(code, str):
        raise RequestError(422, "'code' must be a string")
    context_id = _opt_str(data, "context_id")
    language = _opt_str(data, "language")
    if context_id and language:
        raise RequestError(400, "Only one of context_id or language can be provided")
    raw_env = data.get("env_vars")
    env: dict[str, str] = {}
    if raw_env is not None:
        if not isinstance(raw_env, dict):
            raise RequestError(422, "'env_vars' must be an object of strings")
        if len(raw_env) > _MAX_ENV_VARS:
            raise RequestError(400, f"at most {_MAX_ENV_VARS} environment variables per call")
        for key, value in raw_env.items():
            if not isinstance(value, str):
                raise RequestError(422, f"env_vars[{key!r}] must be a string")
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise RequestError(400, f"invalid environment variable name or value: {key!r}")
            env[key] = value
    return ExecuteRequest(code=code, context_id=context_id or None, language=language, env_vars=env)


def parse_create_context(body: bytes) -> tuple[str, str | None]:
    """Parse a ``POST /contexts`` body: ``(language, cwd)``; ``cwd`` None means the default.

    Raises:
        RequestError: 422 for wrong types.
    """
    data = _json_body(body)
    language = normalize_language(_opt_str(data, "language"))
    cwd = _opt_str(data, "cwd")
    return language, cwd or None


def check_env_names(language: str, env: dict[str, str]) -> None:
    """Bash can only set identifier-like names. Raises RequestError(400) otherwise."""
    if language == "bash":
        for key in env:
            if not _BASH_NAME.match(key):
                raise RequestError(400, f"{key!r} is not a valid bash variable name")


def env_set_code(language: str, env: dict[str, str]) -> str:
    """Code that saves the current values of ``env``'s names in the kernel and sets them.

    Run as a silent cell before the user's code; :func:`env_restore_code` undoes it. Values
    are quoted for the language (JSON string literals are valid Python and JavaScript), so
    no value can inject code.
    """
    payload = json.dumps(env)
    if language == "python":
        return (
            "import os as __dsec_os\n"
            f"__dsec_os._dsec_saved_env = {{k: __dsec_os.environ.get(k) for k in {payload}}}\n"
            f"__dsec_os.environ.update({payload})\n"
            "del __dsec_os\n"
        )
    if language == "javascript":
        return (
            f"(() => {{ const e = {payload}; const s = {{}};"
            " for (const k of Object.keys(e)) { s[k] = process.env[k]; process.env[k] = e[k]; }"
            " globalThis[Symbol.for('dsec.savedEnv')] = s; })();"
        )
    if language == "bash":
        lines = []
        for key, value in env.items():
            lines.append(
                f'if [ -n "${{{key}+x}}" ]; then __dsec_had_{key}=1; __dsec_old_{key}="${key}";'
                f" else __dsec_had_{key}=0; fi; export {key}={shlex.quote(value)}"
            )
        return "\n".join(lines)
    return ""


def env_restore_code(language: str, env: dict[str, str]) -> str:
    """Code that puts back what :func:`env_set_code` saved (unset names are unset again)."""
    if language == "python":
        return (
            "import os as __dsec_os\n"
            "for __dsec_k, __dsec_v in getattr(__dsec_os, '_dsec_saved_env', {}).items():\n"
            "    if __dsec_v is None:\n"
            "        __dsec_os.environ.pop(__dsec_k, None)\n"
            "    else:\n"
            "        __dsec_os.environ[__dsec_k] = __dsec_v\n"
            "__dsec_os._dsec_saved_env = {}\n"
            "del __dsec_os\n"
            "try:\n    del __dsec_k, __dsec_v\nexcept NameError:\n    pass\n"
        )
    if language == "javascript":
        return (
            "(() => { const s = globalThis[Symbol.for('dsec.savedEnv')] || {};"
            " for (const k of Object.keys(s)) {"
            " if (s[k] === undefined) { delete process.env[k]; } else { process.env[k] = s[k]; } }"
            " delete globalThis[Symbol.for('dsec.savedEnv')]; })();"
        )
    if language == "bash":
        lines = []
        for key in env:
            lines.append(
                f'if [ "$__dsec_had_{key}" = 1 ]; then export {key}="$__dsec_old_{key}";'
                f" else unset {key}; fi; unset __dsec_had_{key} __dsec_old_{key}"
            )
        return "\n".join(lines)
    return ""


def timestamp_of(msg: dict[str, Any]) -> str:
    """The ISO 8601 date of a Jupyter message (jupyter_client gives a datetime or a string)."""
    date = msg.get("header", {}).get("date")
    if isinstance(date, datetime):
        if date.tzinfo is None:
            date = date.replace(tzinfo=UTC)
        return date.isoformat()
    if isinstance(date, str) and date:
        return date
    return datetime.now(UTC).isoformat()


def result_fields(data: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """A Jupyter MIME bundle as the fields of E2B's ``result`` line.

    ``text/plain`` that is a quoted string (``'abc'``) loses its quotes, as E2B's server
    does, so ``execution.text == "abc"`` for a cell ending in ``"abc"``.
    """
    out: dict[str, Any] = {"type": "result"}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = _MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    out["is_main_result"] = is_main_result
    return out


def output_line(obj: dict[str, Any]) -> bytes:
    """One NDJSON line (UTF-8, ``\\n``-terminated; non-ASCII kept as is)."""
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=str) + "\n").encode()
