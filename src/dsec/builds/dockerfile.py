"""Single-stage Dockerfiles, parsed into build steps (:mod:`dsec.builds.steps`).

Two phases, because variable substitution needs the base image's environment:

1. :func:`parse_dockerfile` reads the text into :class:`Instruction` s: parser directives
   at the top (``# escape=`` is honoured; ``# syntax=``, ``# check=`` are ignored), comments,
   line continuations (the escape character at the end of a line; comment lines inside a
   continuation are dropped), heredocs (``RUN <<EOF``, ``COPY <<EOF /path``, ``<<-`` strips
   leading tabs, a quoted delimiter turns off expansion). Syntax it refuses fails here.
2. :meth:`Dockerfile.steps` turns them into steps, substituting ``$VAR`` / ``${VAR}`` /
   ``${VAR:-default}`` / ``${VAR:+alt}`` (and the ``-``/``+`` forms without the colon) in
   ``FROM``, ``COPY``/``ADD``, ``ENV``, ``ARG``, ``WORKDIR``, ``USER``, ``LABEL`` and
   ``EXPOSE``, from the build arguments declared so far, the ``ENV`` values so far and the
   base image's ``Env`` (``ENV`` wins over ``ARG``). ``RUN``, ``CMD`` and ``ENTRYPOINT``
   are not substituted: their shell does it when they run, with the same variables in its
   environment. ``ARG`` before ``FROM`` is usable in ``FROM`` only (redeclare it after).

Supported: ``FROM``, ``RUN`` (shell, exec and heredoc forms; ``--network=default|none``;
``--mount=type=cache`` and ``type=tmpfs`` are accepted and ignored, i.e. the target is an
ordinary directory), ``COPY``/``ADD`` of context files (``--chown``, ``--chmod``;
``--link`` is accepted and changes nothing; ``ADD`` unpacks local tar archives), ``ENV``,
``ARG``, ``WORKDIR``, ``USER``, ``CMD``, ``ENTRYPOINT``, ``SHELL`` (the shell of later
shell-form commands), ``LABEL``, ``MAINTAINER`` (a ``maintainer`` label), ``EXPOSE``
(recorded). Everything else is refused with :class:`~dsec.errors.InvalidRequest` naming the
line and the instruction (``details``: ``line``, ``instruction``): a second ``FROM`` or
``FROM ... AS`` (multi-stage), ``COPY --from``, ``ADD`` of URLs or git repositories, ``RUN
--mount`` of other types, ``HEALTHCHECK``, ``ONBUILD``, ``VOLUME``, ``STOPSIGNAL``, ``FROM
scratch`` and unknown instructions.

Example::

    df = parse_dockerfile(text)
    base = df.base_step(build_args)                 # FromImage / FromRegistry
    steps = df.steps(build_args, base_env={"PATH": "/usr/local/bin:/usr/bin"})
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from dsec.builds.steps import (
    IMAGE_REF,
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    Expose,
    FromImage,
    FromRegistry,
    InlineFile,
    Label,
    Run,
    Step,
    User,
    Workdir,
)
from dsec.errors import InvalidRequest

__all__ = ["Dockerfile", "Heredoc", "Instruction", "parse_dockerfile"]

DEFAULT_SHELL = ("/bin/sh", "-c")

_SUPPORTED = {
    "FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "CMD", "ENTRYPOINT",
    "SHELL", "LABEL", "MAINTAINER", "EXPOSE",
}  # fmt: skip
_REFUSED = {
    "HEALTHCHECK": "health checks are not supported (dsec sandboxes have no health probes)",
    "ONBUILD": "ONBUILD triggers are not supported",
    "VOLUME": "volumes are not supported (a sandbox's files are its layers and its writable layer)",
    "STOPSIGNAL": "STOPSIGNAL is not supported (sandboxes are killed, not stopped)",
}
_HEREDOC = re.compile(r"<<(-?)(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_DIRECTIVE = re.compile(r"^#\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(.*?)\s*$")
_FLAG = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(.*))?$")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _error(line: int, instruction: str, message: str) -> InvalidRequest:
    return InvalidRequest(
        f"Dockerfile line {line}: {instruction}: {message}", line=line, instruction=instruction
    )


@dataclass(frozen=True)
class Heredoc:
    """A here-document of an instruction: ``content`` (lines with their newlines, tabs
    stripped for ``<<-``), whether variables in it are expanded (unquoted delimiter), and
    ``raw``: the body and the terminator line exactly as written (what a shell reads)."""

    name: str
    content: str
    expand: bool
    raw: str


@dataclass(frozen=True)
class Instruction:
    """One instruction: ``keyword`` (upper case), ``flags`` (``--name[=value]`` in front of
    the arguments, for the instructions that take them), ``args`` (the rest, continuations
    joined), its first ``line`` (1-based) and ``source`` (keyword, flags and arguments as
    written, one line)."""

    keyword: str
    flags: tuple[str, ...]
    args: str
    line: int
    source: str
    heredocs: tuple[Heredoc, ...] = ()


@dataclass
class _Vars:
    """Variables visible to substitution: build arguments in scope, then ENV (wins)."""

    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def lookup(self) -> dict[str, str]:
        return {**self.args, **self.env}


# --- phase 1: text -> instructions -----------------------------------------------------------


@dataclass(frozen=True)
class Dockerfile:
    """A parsed Dockerfile (see the module docstring)."""

    instructions: tuple[Instruction, ...]
    escape: str = "\\"

    # --- the base ----------------------------------------------------------------------------

    def _from(self) -> Instruction:
        for ins in self.instructions:
            if ins.keyword == "FROM":
                return ins
        raise InvalidRequest("the Dockerfile has no FROM instruction", line=None)

    def _pre_from_args(self, build_args: dict[str, str]) -> dict[str, str]:
        values: dict[str, str] = {}
        for ins in self.instructions:
            if ins.keyword == "FROM":
                break
            for name, default in _arg_pairs(ins, values, self.escape):
                if name in build_args:
                    values[name] = build_args[name]
                elif default is not None:
                    values[name] = default
        return values

    def base_step(self, build_args: dict[str, str] | None = None) -> FromImage | FromRegistry:
        """The ``FROM`` as a step: a dsec image name (``name[:tag]``, ``<owner id>/name``)
        is ``from_image``; anything else (a registry host, ``@sha256:`` digest,
        ``library/...`` paths) is ``from_registry``."""
        ins = self._from()
        pre = self._pre_from_args(build_args or {})
        platform = None
        for flag in ins.flags:
            name, value = _flag(ins, flag)
            if name != "platform":
                raise _error(ins.line, "FROM", f"unknown flag --{name}")
            platform = _expand(value or "", pre, self.escape, ins)
        if platform not in (None, "", "linux/amd64", "linux/x86_64"):
            raise _error(
                ins.line, "FROM", f"platform {platform!r} is not supported: linux/amd64 only"
            )
        words = _split_words(ins.args, self.escape)
        if not words:
            raise _error(ins.line, "FROM", "needs an image")
        if len(words) > 1:
            if len(words) == 3 and words[1].lower() == "as":
                raise _error(
                    ins.line, "FROM", "multi-stage builds (FROM ... AS name) are not supported"
                )
            raise _error(
                ins.line, "FROM", f"unexpected arguments after the image: {' '.join(words[1:])}"
            )
        ref = _expand(words[0], pre, self.escape, ins)
        if ref == "scratch":
            raise _error(
                ins.line,
                "FROM",
                "FROM scratch is not supported: build from an image, or make a base layer "
                "from a directory with `dsec image build PATH --kind base`",
            )
        if not ref:
            raise _error(ins.line, "FROM", f"{words[0]!r} expands to nothing")
        if IMAGE_REF.match(ref):
            return FromImage(image=ref, source=ins.source, line=ins.line)
        return FromRegistry(ref=ref, source=ins.source, line=ins.line)

    # --- phase 2: instructions -> steps ----------------------------------------------------

    def steps(
        self, build_args: dict[str, str] | None = None, base_env: dict[str, str] | None = None
    ) -> list[Step]:
        """The build's steps (the ``FROM`` first). ``base_env``: the base image's ``Env``
        (substitution sees it, as in Docker). Raises ``InvalidRequest`` with the line."""
        build_args = build_args or {}
        out: list[Step] = [self.base_step(build_args)]
        pre = self._pre_from_args(build_args)
        v = _Vars(env=dict(base_env or {}))
        shell: tuple[str, ...] = DEFAULT_SHELL
        seen_from = False
        for ins in self.instructions:
            if not seen_from:
                if ins.keyword == "FROM":
                    seen_from = True
                continue
            lowered, shell = self._lower(ins, v, pre, build_args, shell)
            out.extend(lowered)
        return out

    def used_args(self) -> set[str]:
        """Names of every ``ARG`` declared (before and after ``FROM``)."""
        names: set[str] = set()
        for ins in self.instructions:
            if ins.keyword == "ARG":
                for word in _split_words(ins.args, self.escape):
                    names.add(word.split("=", 1)[0])
        return names

    def _lower(
        self,
        ins: Instruction,
        v: _Vars,
        pre: dict[str, str],
        build_args: dict[str, str],
        shell: tuple[str, ...],
    ) -> tuple[list[Step], tuple[str, ...]]:
        kw, esc = ins.keyword, self.escape
        src = {"source": ins.source, "line": ins.line}
        try:
            if kw == "FROM":
                raise _error(
                    ins.line, "FROM", "multi-stage builds (a second FROM) are not supported"
                )
            if kw == "RUN":
                return [self._run(ins, shell)], shell
            if kw in ("CMD", "ENTRYPOINT"):
                _no_flags(ins)
                exec_form = _json_form(ins.args)
                cmd = exec_form if exec_form is not None else [*shell, ins.args.strip()]
                if exec_form is None and not ins.args.strip():
                    raise _error(ins.line, kw, "needs a command")
                if kw == "CMD":
                    return [Cmd(cmd=cmd, **src)], shell
                return [Entrypoint(entrypoint=cmd, **src)], shell
            if kw == "SHELL":
                _no_flags(ins)
                form = _json_form(ins.args)
                if not form:
                    raise _error(
                        ins.line, "SHELL", 'needs the JSON form: SHELL ["/bin/bash", "-c"]'
                    )
                return [], tuple(form)
            if kw in ("COPY", "ADD"):
                return [self._copy(ins, v)], shell
            if kw == "ENV":
                _no_flags(ins)
                pairs = _name_values(ins, v.lookup(), esc, legacy=True)
                if not pairs:
                    raise _error(ins.line, "ENV", "needs NAME=value")
                v.env.update(pairs)
                return [Env(vars=pairs, **src)], shell
            if kw == "ARG":
                _no_flags(ins)
                steps: list[Step] = []
                for name, default in _arg_pairs(ins, v.lookup(), esc):
                    if default is None and name in pre:
                        default = pre[name]  # redeclared after FROM: keeps its value
                    value = build_args.get(name, default)
                    if value is not None:
                        v.args[name] = value
                    steps.append(Arg(name=name, default=default, **src))
                return steps, shell
            if kw == "WORKDIR":
                _no_flags(ins)
                path = _expand(ins.args.strip(), v.lookup(), esc, ins)
                if not path:
                    raise _error(ins.line, "WORKDIR", "needs a path")
                return [Workdir(path=path, **src)], shell
            if kw == "USER":
                _no_flags(ins)
                words = _split_words(ins.args, esc)
                if len(words) != 1:
                    raise _error(ins.line, "USER", "needs exactly one user[:group]")
                return [User(user=_expand(words[0], v.lookup(), esc, ins), **src)], shell
            if kw == "LABEL":
                _no_flags(ins)
                pairs = _name_values(ins, v.lookup(), esc, legacy=True)
                if not pairs:
                    raise _error(ins.line, "LABEL", "needs key=value")
                return [Label(labels=pairs, **src)], shell
            if kw == "MAINTAINER":
                _no_flags(ins)
                return [Label(labels={"maintainer": ins.args.strip()}, **src)], shell
            if kw == "EXPOSE":
                _no_flags(ins)
                ports = [_expand(w, v.lookup(), esc, ins) for w in _split_words(ins.args, esc)]
                if not ports:
                    raise _error(ins.line, "EXPOSE", "needs a port")
                return [Expose(ports=[p if "/" in p else p + "/tcp" for p in ports], **src)], shell
        except ValueError as e:  # a step model refused a value (pydantic ValidationError)
            if isinstance(e, InvalidRequest):
                raise
            raise _error(ins.line, kw, _validation_message(e)) from None
        raise _error(ins.line, kw, "unknown instruction")  # pragma: no cover - parse refuses

    def _run(self, ins: Instruction, shell: tuple[str, ...]) -> Run:
        network: str = "default"
        for flag in ins.flags:
            name, value = _flag(ins, flag)
            if name == "network":
                if value not in ("default", "none"):
                    raise _error(
                        ins.line, "RUN", f"--network={value} is not supported: default or none"
                    )
                network = value
            elif name == "mount":
                options = dict(p.partition("=")[::2] for p in (value or "").split(","))
                kind = options.get("type", "bind")
                if kind not in ("cache", "tmpfs"):
                    raise _error(
                        ins.line,
                        "RUN",
                        f"--mount=type={kind} is not supported (only cache and tmpfs mounts, "
                        "which are ignored)",
                    )
            else:
                raise _error(ins.line, "RUN", f"--{name} is not supported")
        text = ins.args
        src = {"source": ins.source, "line": ins.line}
        if ins.heredocs:
            first = ins.heredocs[0]
            if _HEREDOC.fullmatch(text.strip()) and len(ins.heredocs) == 1:
                return Run(cmd=_script(first.content, shell), network=network, **src)
            script = text + "\n" + "".join(h.raw for h in ins.heredocs)
            return Run(cmd=[*shell, script], network=network, **src)
        exec_form = _json_form(text)
        if exec_form is not None:
            return Run(cmd=exec_form, network=network, **src)
        if not text.strip():
            raise _error(ins.line, "RUN", "needs a command")
        cmd: str | list[str] = text.strip() if shell == DEFAULT_SHELL else [*shell, text.strip()]
        return Run(cmd=cmd, network=network, **src)

    def _copy(self, ins: Instruction, v: _Vars) -> Copy:
        kw = ins.keyword
        chown = chmod = None
        for flag in ins.flags:
            name, value = _flag(ins, flag)
            if name == "from":
                raise _error(
                    ins.line, kw, "COPY --from (multi-stage builds, other images) is not supported"
                )
            if name == "chown":
                chown = _expand(value or "", v.lookup(), self.escape, ins)
            elif name == "chmod":
                chmod = _expand(value or "", v.lookup(), self.escape, ins)
            elif name == "link":
                continue  # a layer of its own either way
            else:
                raise _error(ins.line, kw, f"--{name} is not supported")
        form = _json_form(ins.args)
        words = form if form is not None else _split_words(ins.args, self.escape)
        words = [_expand(w, v.lookup(), self.escape, ins) for w in words]
        heredoc_names = {h.name for h in ins.heredocs}
        inline: list[InlineFile] = []
        srcs: list[str] = []
        if len(words) < 2:
            raise _error(ins.line, kw, "needs at least one source and a destination")
        for w in words[:-1]:
            m = _HEREDOC.fullmatch(w) if ins.heredocs else None
            if m is not None and m.group(3) in heredoc_names:
                h = next(h for h in ins.heredocs if h.name == m.group(3))
                content = (
                    _expand_text(h.content, v.lookup(), self.escape, ins) if h.expand else h.content
                )
                inline.append(InlineFile(name=h.name, content=content))
                continue
            if re.match(r"^[a-z][a-z0-9+.-]*://", w) or w.startswith("git@"):
                raise _error(
                    ins.line, kw, f"remote sources ({w}) are not supported: local files only"
                )
            srcs.append(w)
        return Copy(
            src=srcs,
            dest=words[-1],
            chown=chown or None,
            chmod=chmod or None,
            add=kw == "ADD",
            inline=inline,
            source=ins.source,
            line=ins.line,
        )


def _script(content: str, shell: tuple[str, ...]) -> list[str]:
    """``RUN <<EOF`` alone: the heredoc is the script. A ``#!`` line picks its interpreter
    (it is written to a temporary file and run); otherwise the shell runs it."""
    if content.startswith("#!"):
        runner = (
            "f=$(mktemp) || exit 1\n"
            "cat > \"$f\" <<'DSEC_HEREDOC_EOF'\n"
            f"{content}" + ("" if content.endswith("\n") else "\n") + "DSEC_HEREDOC_EOF\n"
            'chmod +x "$f" && "$f"; rc=$?; rm -f "$f"; exit $rc\n'
        )
        return [*DEFAULT_SHELL, runner]
    return [*shell, content]


def _validation_message(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(
                str(x.get("msg", "invalid")).removeprefix("Value error, ") for x in errors()
            )
        except Exception:  # pragma: no cover - defensive: fall back to the text
            pass
    return str(e)


def _no_flags(ins: Instruction) -> None:
    if ins.flags:
        raise _error(ins.line, ins.keyword, f"unknown flag {ins.flags[0]}")


def _flag(ins: Instruction, flag: str) -> tuple[str, str | None]:
    m = _FLAG.match(flag)
    if m is None:
        raise _error(ins.line, ins.keyword, f"malformed flag {flag!r}")
    return m.group(1), m.group(2)


def _json_form(args: str) -> list[str] | None:
    """The exec (JSON array of strings) form, or None for the shell form (also for text
    that starts with ``[`` but is not a JSON string array, as Docker does)."""
    text = args.strip()
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return value
    return None


def _arg_pairs(ins: Instruction, lookup: dict[str, str], esc: str) -> list[tuple[str, str | None]]:
    words = _split_words(ins.args, esc)
    if not words:
        raise _error(ins.line, "ARG", "needs a name")
    out: list[tuple[str, str | None]] = []
    for w in words:
        name, eq, default = w.partition("=")
        if not _VAR_NAME.fullmatch(name):
            raise _error(ins.line, "ARG", f"invalid argument name {name!r}")
        out.append((name, _expand(default, lookup, esc, ins) if eq else None))
    return out


def _name_values(
    ins: Instruction, lookup: dict[str, str], esc: str, *, legacy: bool
) -> dict[str, str]:
    """``NAME=value ...`` pairs (every value substituted from ``lookup`` as it was before the
    instruction), or the legacy ``NAME value with spaces`` form."""
    words = _split_words(ins.args, esc)
    if not words:
        return {}
    if legacy and "=" not in words[0]:
        rest = ins.args.strip()[len(words[0]) :].strip()
        if not rest:
            raise _error(ins.line, ins.keyword, f"{words[0]} has no value (use NAME=value)")
        return {_expand(words[0], lookup, esc, ins): _expand(rest, lookup, esc, ins)}
    out: dict[str, str] = {}
    for w in words:
        name, eq, value = w.partition("=")
        if not eq:
            raise _error(ins.line, ins.keyword, f"{w!r} is not NAME=value")
        key = _expand(name, lookup, esc, ins)
        if not key:
            raise _error(ins.line, ins.keyword, f"{w!r} has an empty name")
        out[key] = _expand(value, lookup, esc, ins)
    return out


# --- words, quotes and substitution (Docker's shell lexer, the parts Dockerfiles use) -------


def _split_words(text: str, esc: str) -> list[str]:
    """Split at unquoted whitespace, keeping quotes and escapes in the words."""
    words: list[str] = []
    cur: list[str] = []
    in_word = False
    quote: str | None = None
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote is not None:
            cur.append(c)
            if c == esc and quote == '"' and i + 1 < n:
                cur.append(text[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
        elif c.isspace():
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
        else:
            in_word = True
            cur.append(c)
            if c == esc and i + 1 < n:
                cur.append(text[i + 1])
                i += 2
                continue
            if c in "\"'":
                quote = c
        i += 1
    if quote is not None:
        words.append("".join(cur))  # an unterminated quote: _expand reports it
    elif in_word:
        words.append("".join(cur))
    return words


def _expand(word: str, lookup: dict[str, str], esc: str, ins: Instruction) -> str:
    """One word with quotes removed, escapes applied and ``$`` variables substituted."""
    out: list[str] = []
    i, n = 0, len(word)
    quote: str | None = None
    while i < n:
        c = word[i]
        if quote == "'":
            if c == "'":
                quote = None
            else:
                out.append(c)
            i += 1
            continue
        if c == esc and i + 1 < n:
            nxt = word[i + 1]
            if quote == '"' and nxt not in ('"', "$", esc):
                out.append(c)
            out.append(nxt)
            i += 2
            continue
        if c == "'" and quote is None:
            quote = "'"
        elif c == '"':
            quote = None if quote == '"' else '"'
        elif c == "$":
            value, i = _variable(word, i, lookup, esc, ins)
            out.append(value)
            continue
        else:
            out.append(c)
        i += 1
    if quote is not None:
        raise _error(ins.line, ins.keyword, f"unterminated {quote} quote in {word!r}")
    return "".join(out)


def _expand_text(text: str, lookup: dict[str, str], esc: str, ins: Instruction) -> str:
    """Substitute ``$`` variables in free text (a heredoc body); quotes stay as they are."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == esc and i + 1 < n and text[i + 1] == "$":
            out.append("$")
            i += 2
        elif c == "$":
            value, i = _variable(text, i, lookup, esc, ins)
            out.append(value)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _variable(
    word: str, i: int, lookup: dict[str, str], esc: str, ins: Instruction
) -> tuple[str, int]:
    """Substitute the variable at ``word[i] == '$'``; returns (value, index after it)."""
    n = len(word)
    if i + 1 < n and word[i + 1] == "{":
        end = _closing_brace(word, i + 2)
        if end < 0:
            raise _error(ins.line, ins.keyword, f"missing '}}' in {word!r}")
        body = word[i + 2 : end]
        m = _VAR_NAME.match(body)
        if m is None:
            raise _error(ins.line, ins.keyword, f"bad substitution ${{{body}}}")
        name, rest = m.group(0), body[m.end() :]
        value = lookup.get(name)
        if not rest:
            return value or "", end + 1
        for op in (":-", ":+", ":?", "-", "+", "?"):
            if rest.startswith(op):
                alt = _expand(rest[len(op) :], lookup, esc, ins)
                unset_or_empty = not value if op.startswith(":") else value is None
                if op.endswith("-"):
                    return (alt if unset_or_empty else value or ""), end + 1
                if op.endswith("+"):
                    return ("" if unset_or_empty else alt), end + 1
                if unset_or_empty:
                    raise _error(ins.line, ins.keyword, f"{name}: {alt or 'is not set'}")
                return value or "", end + 1
        raise _error(ins.line, ins.keyword, f"unsupported substitution ${{{body}}}")
    m = _VAR_NAME.match(word, i + 1)
    if m is None:
        return "$", i + 1
    return lookup.get(m.group(0), ""), m.end()


def _closing_brace(word: str, start: int) -> int:
    depth = 1
    for j in range(start, len(word)):
        if word[j] == "{":
            depth += 1
        elif word[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


# --- the parser ----------------------------------------------------------------------------


_TAKES_FLAGS = {"FROM", "RUN", "COPY", "ADD"}
_TAKES_HEREDOCS = {"RUN", "COPY", "ADD"}


def parse_dockerfile(text: str) -> Dockerfile:
    """Parse Dockerfile text (see the module docstring). Raises ``InvalidRequest`` naming
    the line and the instruction for syntax this builder refuses."""
    if "\0" in text:
        raise InvalidRequest("the Dockerfile contains a NUL byte")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    escape = "\\"
    i = 0
    # parser directives: only at the very top, before any blank line, comment or instruction
    seen: set[str] = set()
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i].strip()) if lines[i].strip().startswith("#") else None
        if m is None:
            break
        key, value = m.group(1).lower(), m.group(2)
        if key in seen:
            break
        seen.add(key)
        if key == "escape":
            if value not in ("\\", "`"):
                raise InvalidRequest(
                    f"Dockerfile line {i + 1}: the escape directive must be \\ or `", line=i + 1
                )
            escape = value
        i += 1
    instructions: list[Instruction] = []
    n = len(lines)
    while i < n:
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i
        parts: list[str] = []
        line = lines[i].lstrip()
        while True:
            body = line.rstrip()
            if body.endswith(escape):
                parts.append(body[: -len(escape)])
                i += 1
                # the continuation: skip comment lines; stop at the end of the file
                while i < n and lines[i].strip().startswith("#"):
                    i += 1
                if i >= n:
                    break
                line = lines[i]
                continue
            parts.append(line.rstrip("\n"))
            i += 1
            break
        joined = "".join(parts).strip()
        m = re.match(r"^(\S+)\s*(.*)$", joined, re.S)
        if m is None:  # pragma: no cover - a non-blank line always has a word
            continue
        keyword, rest = m.group(1).upper(), m.group(2)
        line_no = start + 1
        if keyword in _REFUSED:
            raise _error(line_no, keyword, _REFUSED[keyword])
        if keyword not in _SUPPORTED:
            raise _error(line_no, m.group(1), "unknown or unsupported instruction")
        flags: list[str] = []
        if keyword in _TAKES_FLAGS:
            while True:
                fm = re.match(r"^(--[a-z][a-z0-9-]*(?:=\S*)?)(?:\s+(.*))?$", rest, re.S)
                if fm is None:
                    break
                flags.append(fm.group(1))
                rest = fm.group(2) or ""
        heredocs: list[Heredoc] = []
        if keyword in _TAKES_HEREDOCS and "<<" in rest and _json_form(rest) is None:
            for hm in _HEREDOC.finditer(rest):
                strip_tabs, quoted, name = hm.group(1) == "-", bool(hm.group(2)), hm.group(3)
                body_lines: list[str] = []
                raw_lines: list[str] = []
                while True:
                    if i >= n:
                        raise _error(line_no, keyword, f"heredoc {name} is not terminated")
                    raw = lines[i]
                    i += 1
                    raw_lines.append(raw + "\n")
                    candidate = raw.lstrip("\t") if strip_tabs else raw
                    if candidate == name:
                        break
                    body_lines.append(candidate + "\n")
                heredocs.append(
                    Heredoc(name, "".join(body_lines), expand=not quoted, raw="".join(raw_lines))
                )
        source = " ".join([m.group(1), *flags, rest.strip()]).strip()
        instructions.append(
            Instruction(keyword, tuple(flags), rest, line_no, source, tuple(heredocs))
        )
    return Dockerfile(tuple(instructions), escape)
