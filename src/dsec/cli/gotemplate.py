"""Go ``text/template``, the subset docker's ``--format`` users write (``dsec docker``).

Data is what JSON decodes to (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``,
``None``) plus :class:`GoStruct` for values with methods (``docker ps``'s ``{{.Label "k"}}``).
Supported::

    {{.}}  {{.Field.Sub}}  {{$}}  {{$v.Field}}  {{(index .M "k").Field}}  {{"text"}} {{42}}
    {{json .X}}  {{.X | json}}  {{index .M "k" 0}}  {{len .X}}  {{join .L ","}}
    {{split .S ","}}  {{lower .S}}  {{upper .S}}  {{title .S}}  {{truncate .S 5}}
    {{pad .S 1 1}}  {{print ...}}  {{println ...}}  {{printf "%s=%d" .A .B}}
    {{eq .A "x"}} {{ne}} {{lt}} {{le}} {{gt}} {{ge}}  {{not .X}} {{and .A .B}} {{or .A .B}}
    {{if PIPE}}...{{else if PIPE}}...{{else}}...{{end}}   {{with PIPE}}...{{else}}...{{end}}
    {{range PIPE}}...{{else}}...{{end}}  {{range $i, $e := PIPE}}  {{break}}  {{continue}}
    {{$x := PIPE}}  {{$x = PIPE}}  {{/* comment */}}  {{- trimmed -}}

Values print as Go's ``fmt`` prints them (``[a b]``, ``map[k:v]``, ``true``, ``<no
value>`` for a missing key or nil, ``1e+21``); ``json`` is docker's (compact, no HTML
escaping). ``define``, ``template`` and ``block`` are refused.

Errors are Go's, as docker prints them: ``template: :1: function "foo" not defined``
(parsing) and ``template: :1:2: executing "" at <.Foo>: map has no entry for key "Foo"``
(executing; line and byte column of the node)::

    >>> render("{{.State.Status}} {{json .Config.Env}}",
    ...        {"State": {"Status": "running"}, "Config": {"Env": ["A=1"]}})
    'running ["A=1"]'
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GoStruct", "Template", "TemplateError", "go_json", "go_str", "parse", "render"]


class TemplateError(ValueError):
    """A template that does not parse or fails while executing; ``str()`` is Go's message."""


@dataclass
class GoStruct:
    """A Go struct value: named ``fields`` (shown by ``json`` and ``%v``) and ``methods``
    (called with the action's arguments). ``type_name`` is what errors call it."""

    type_name: str
    fields: dict[str, Any]
    methods: dict[str, Callable[..., Any]] = field(default_factory=dict)


# -- printing ----------------------------------------------------------------------------


def _go_float(f: float) -> str:
    """``fmt``'s ``%v`` of a float64: shortest digits, an exponent below 1e-4 or from 1e21."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "0"
    short = repr(abs(f))  # shortest round-tripping digits
    mantissa, _, e = short.partition("e")
    if e:
        exp = int(e)
        digits = mantissa.replace(".", "")
    else:
        whole, _, frac = short.partition(".")
        frac = frac.rstrip("0") if frac != "0" else ""
        if whole != "0":
            exp = len(whole) - 1
            digits = whole + frac
        else:
            stripped = frac.lstrip("0")
            exp = -(len(frac) - len(stripped)) - 1
            digits = stripped
    digits = digits.rstrip("0") or "0"
    sign = "-" if f < 0 else ""
    if exp < -4 or exp >= 21:
        m = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{m}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    if exp >= len(digits) - 1:
        return sign + digits + "0" * (exp - len(digits) + 1)
    if exp >= 0:
        return f"{sign}{digits[: exp + 1]}.{digits[exp + 1 :]}"
    return f"{sign}0.{'0' * (-exp - 1)}{digits}"


def _fmt_v(value: Any) -> str:
    """``fmt.Sprint`` of one value (a nil inside a container is ``<nil>``)."""
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(_fmt_v(v) for v in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{_fmt_v(value[k])}" for k in sorted(value)) + "]"
    if isinstance(value, GoStruct):
        return "{" + " ".join(_fmt_v(v) for v in value.fields.values()) + "}"
    return str(value)


def go_str(value: Any) -> str:
    """What an action prints for ``value``: ``<no value>`` for nil, else ``fmt.Sprint``."""
    return "<no value>" if value is None else _fmt_v(value)


def _plain(value: Any) -> Any:
    if isinstance(value, GoStruct):
        return {k: _plain(v) for k, v in value.fields.items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def go_json(value: Any) -> str:
    """docker's ``json`` template function: compact JSON, no HTML escaping."""
    return json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":"))


def _type_name(value: Any) -> str:
    if isinstance(value, GoStruct):
        return value.type_name
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "[]interface {}"
    if isinstance(value, dict):
        return "map[string]interface {}"
    return "interface {}"


def _truth(value: Any) -> bool:
    if isinstance(value, GoStruct):
        return True
    return bool(value)


# -- lexing ------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<declare>:=)
  | (?P<punct>[|(),=])
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<number>-?(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?))
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<variable>\$[A-Za-z0-9_]*)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.VERBOSE,
)


@dataclass
class _Tok:
    kind: str
    text: str
    pos: int  # byte offset in the whole template
    spaced: bool  # whitespace came before it


def _lex_action(src: str, base: int, line: int) -> list[_Tok]:
    toks: list[_Tok] = []
    i, spaced = 0, True
    while i < len(src):
        m = _TOKEN.match(src, i)
        if m is None:
            raise TemplateError(f"template: :{line}: unexpected {src[i]!r} in command")
        kind = m.lastgroup or ""
        if kind == "space":
            spaced = True
        else:
            toks.append(_Tok(kind, m.group(), base + i, spaced))
            spaced = False
        i = m.end()
    return toks


# -- the tree ----------------------------------------------------------------------------


@dataclass
class _Term:
    """An operand: a literal, ``.A.B``, ``$x.A``, a function name or ``( pipeline )``,
    then optional ``.Field`` accesses on what it gave."""

    kind: str  # "field" | "var" | "literal" | "ident" | "pipe"
    pos: int
    text: str  # the source, for error context
    value: Any = None  # literal value / variable name / function name / _Pipe
    chain: list[str] = field(default_factory=list)


@dataclass
class _Pipe:
    pos: int
    text: str
    decl: list[str]
    assign: bool
    cmds: list[list[_Term]]


@dataclass
class _Text:
    text: str


@dataclass
class _Action:
    pipe: _Pipe


@dataclass
class _Block:  # if / with / range
    kind: str
    pipe: _Pipe
    body: list[Any]
    orelse: list[Any]


@dataclass
class _Loop:  # break / continue
    kind: str


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.chained: set[int] = set()  # ids of the ifs an {{else if}} opened

    def line_of(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1

    def fail(self, pos: int, message: str) -> TemplateError:
        return TemplateError(f"template: :{self.line_of(pos)}: {message}")

    def items(self) -> Iterator[tuple[str, str, int]]:
        """("text", text, pos) and ("action", inner, pos) in order, trim markers applied."""
        text, i = self.text, 0
        pending_trim = False
        while True:
            start = text.find("{{", i)
            chunk = text[i : start if start >= 0 else len(text)]
            if pending_trim:
                chunk = chunk.lstrip(" \t\r\n")
            if start < 0:
                if chunk:
                    yield "text", chunk, i
                return
            inner_start = start + 2
            trim_left = text.startswith("- ", inner_start) or text.startswith("-\t", inner_start)
            if trim_left:
                chunk = chunk.rstrip(" \t\r\n")
                inner_start += 2
            if chunk:
                yield "text", chunk, i
            if text.startswith("/*", inner_start):  # {{/* comment */}}, {{- /* c */ -}}
                close = text.find("*/", inner_start + 2)
                if close < 0:
                    raise self.fail(start, "unclosed comment")
                if text.startswith(" -}}", close + 2):
                    pending_trim, i = True, close + 6
                elif text.startswith("}}", close + 2):
                    pending_trim, i = False, close + 4
                else:
                    raise self.fail(start, "comment ends before closing delimiter")
                continue
            end = self._action_end(inner_start)
            if end < 0:
                raise self.fail(start, "unclosed action")
            trim_right = end - 2 >= inner_start and text[end - 2 : end] in (" -", "\t-", "\n-")
            inner_end = end - 1 if trim_right else end
            yield "action", text[inner_start:inner_end], inner_start
            pending_trim = trim_right
            i = end + 2

    def _action_end(self, pos: int) -> int:
        """The index of the ``}}`` closing the action at ``pos`` (strings may hold ``}}``)."""
        text, i = self.text, pos
        while i < len(text):
            c = text[i]
            if c == '"':
                i += 1
                while i < len(text) and text[i] != '"':
                    if text[i] == "\n":
                        return -1
                    i += 2 if text[i] == "\\" else 1
            elif c == "`":
                i = text.find("`", i + 1)
                if i < 0:
                    return -1
            elif text.startswith("}}", i):
                return i
            i += 1
        return -1

    def parse(self) -> list[Any]:
        stack: list[tuple[_Block | None, list[Any]]] = [(None, [])]
        for kind, chunk, pos in self.items():
            body = stack[-1][1]
            if kind == "text":
                body.append(_Text(chunk))
                continue
            toks = _lex_action(chunk, pos, self.line_of(pos))
            if not toks:
                raise self.fail(pos, "missing value for command")
            head = toks[0]
            word = head.text if head.kind == "ident" else ""
            if word in ("if", "with", "range"):
                block = _Block(word, self.pipeline(toks[1:], pos, word), [], [])
                body.append(block)
                stack.append((block, block.body))
            elif word == "else":
                current = stack[-1][0]
                if current is None or body is current.orelse:
                    raise self.fail(pos, "unexpected {{else}}")
                block = current
                rest = toks[1:]
                if rest and rest[0].kind == "ident" and rest[0].text in ("if", "with"):
                    # {{else if X}}: an if inside the else branch, closed by the same {{end}}
                    inner = _Block(rest[0].text, self.pipeline(rest[1:], pos, rest[0].text), [], [])
                    block.orelse.append(inner)
                    stack[-1] = (block, block.orelse)
                    stack.append((inner, inner.body))
                    self.chained.add(id(inner))
                elif rest:
                    raise self.fail(pos, f"unexpected {rest[0].text!r} in else")
                else:
                    stack[-1] = (block, block.orelse)
            elif word == "end":
                if len(toks) > 1:
                    raise self.fail(pos, f"unexpected {toks[1].text!r} in end")
                if len(stack) == 1:
                    raise self.fail(pos, "unexpected {{end}}")
                while True:
                    done, _ = stack.pop()
                    if done is None or id(done) not in self.chained:
                        break
            elif word in ("break", "continue"):
                if not any(b is not None and b.kind == "range" for b, _ in stack):
                    raise self.fail(pos, f"{{{{{word}}}}} outside {{{{range}}}}")
                body.append(_Loop(word))
            elif word in ("define", "template", "block"):
                raise self.fail(pos, f"{{{{{word}}}}} is not supported by dsec docker")
            else:
                body.append(_Action(self.pipeline(toks, pos, "command")))
        if len(stack) > 1:
            raise self.fail(len(self.text), "unexpected EOF")
        return stack[0][1]

    def pipeline(self, toks: list[_Tok], pos: int, context: str) -> _Pipe:
        if not toks:
            raise self.fail(pos, f"missing value for {context}")
        start = toks[0].pos
        text = self.text[start : toks[-1].pos + len(toks[-1].text)]
        decl: list[str] = []
        assign = False
        i = 0
        # $x := / $x = / $i, $e :=
        j = 0
        names: list[str] = []
        while j < len(toks) and toks[j].kind == "variable":
            names.append(toks[j].text)
            if j + 1 < len(toks) and toks[j + 1].text == "," and len(names) == 1:
                j += 2
                continue
            j += 1
            break
        if (
            names
            and j < len(toks)
            and toks[j].kind in ("declare", "punct")
            and toks[j].text
            in (
                ":=",
                "=",
            )
        ):
            if len(names) == 2 and context != "range":
                raise self.fail(pos, "too many declarations in command")
            decl, assign, i = names, toks[j].text == "=", j + 1
        cmds: list[list[_Term]] = []
        current: list[_Term] = []
        rest = toks[i:]
        k = 0
        while k < len(rest):
            t = rest[k]
            if t.text == "|" and t.kind == "punct":
                if not current:
                    raise self.fail(t.pos, "missing command")
                cmds.append(current)
                current = []
                k += 1
                continue
            term, k = self.term(rest, k)
            current.append(term)
        if not current:
            raise self.fail(pos, "missing command")
        cmds.append(current)
        return _Pipe(start, text, decl, assign, cmds)

    def term(self, toks: list[_Tok], k: int) -> tuple[_Term, int]:
        t = toks[k]
        if t.kind == "field":
            chain = [] if t.text == "." else t.text[1:].split(".")
            term = _Term("field", t.pos, t.text, chain=chain)
            k += 1
        elif t.kind == "variable":
            name, _, _ = t.text.partition(".")
            term = _Term("var", t.pos, t.text, value=name)
            k = self.chain(term, toks, k + 1)
        elif t.kind in ("string", "raw"):
            value = ast.literal_eval(t.text) if t.kind == "string" else t.text[1:-1]
            term = _Term("literal", t.pos, t.text, value=value)
            k += 1
        elif t.kind == "number":
            num: Any
            if t.text.lower().lstrip("-").startswith("0x"):
                num = int(t.text, 16)
            elif re.fullmatch(r"-?\d+", t.text):
                num = int(t.text)
            else:
                num = float(t.text)
            term = _Term("literal", t.pos, t.text, value=num)
            k += 1
        elif t.kind == "ident":
            if t.text in ("true", "false"):
                term = _Term("literal", t.pos, t.text, value=t.text == "true")
            elif t.text == "nil":
                term = _Term("literal", t.pos, t.text, value=None)
            elif t.text in _FUNCS:
                term = _Term("ident", t.pos, t.text, value=t.text)
            else:
                raise self.fail(t.pos, f'function "{t.text}" not defined')
            k += 1
        elif t.text == "(":
            depth, j = 0, k
            while j < len(toks):
                if toks[j].text == "(" and toks[j].kind == "punct":
                    depth += 1
                elif toks[j].text == ")" and toks[j].kind == "punct":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j >= len(toks):
                raise self.fail(t.pos, "unclosed left paren")
            inner = self.pipeline(toks[k + 1 : j], t.pos, "parenthesized pipeline")
            end_tok = toks[j]
            term = _Term("pipe", t.pos, self.text[t.pos : end_tok.pos + 1], value=inner)
            k = self.chain(term, toks, j + 1)
        else:
            raise self.fail(t.pos, f"unexpected {t.text!r} in operand")
        return term, k

    def chain(self, term: _Term, toks: list[_Tok], k: int) -> int:
        """``.A.B`` right after ``term`` (``$x.A``, ``(pipeline).A``): fields of its value."""
        if k < len(toks) and toks[k].kind == "field" and not toks[k].spaced:
            if toks[k].text == ".":
                raise self.fail(toks[k].pos, "unexpected . after term")
            term.chain = toks[k].text[1:].split(".")
            term.text += toks[k].text
            k += 1
        return k


# -- executing ---------------------------------------------------------------------------


class _Exec:
    def __init__(self, source: str, strict: bool) -> None:
        self.source = source
        self.strict = strict
        self.out: list[str] = []
        self.vars: list[tuple[str, Any]] = []

    def fail(self, node_pos: int, context: str, message: str) -> TemplateError:
        before = self.source[:node_pos]
        line = before.count("\n") + 1
        col = node_pos - (before.rfind("\n") + 1) if "\n" in before else node_pos
        return TemplateError(f'template: :{line}:{col}: executing "" at <{context}>: {message}')

    def lookup(self, name: str, term: _Term) -> Any:
        for n, v in reversed(self.vars):
            if n == name:
                return v
        raise self.fail(term.pos, term.text, f"undefined variable: {name}")

    def field(self, receiver: Any, name: str, term: _Term, args: list[Any] | None) -> Any:
        if isinstance(receiver, GoStruct):
            if name in receiver.fields:
                value = receiver.fields[name]
            elif name in receiver.methods:
                try:
                    return receiver.methods[name](*(args or []))
                except TypeError:
                    raise self.fail(
                        term.pos, term.text, f"wrong number of args for {name}"
                    ) from None
            else:
                raise self.fail(
                    term.pos,
                    term.text,
                    f"can't evaluate field {name} in type {receiver.type_name}",
                )
        elif isinstance(receiver, dict):
            if name in receiver:
                value = receiver[name]
            elif self.strict:
                raise self.fail(term.pos, term.text, f'map has no entry for key "{name}"')
            else:
                value = None
        elif receiver is None:
            raise self.fail(term.pos, term.text, f"nil pointer evaluating interface {{}}.{name}")
        else:
            raise self.fail(
                term.pos, term.text, f"can't evaluate field {name} in type {_type_name(receiver)}"
            )
        if args:
            raise self.fail(
                term.pos, term.text, f"{name} has arguments but cannot be invoked as function"
            )
        return value

    def term(self, term: _Term, dot: Any, args: list[Any] | None = None) -> Any:
        if term.kind == "literal":
            value = term.value
        elif term.kind == "field":
            value = dot
            for i, name in enumerate(term.chain):
                last = i == len(term.chain) - 1
                value = self.field(value, name, term, args if last else None)
            return value
        elif term.kind == "var":
            value = self.lookup(term.value, term)
        elif term.kind == "pipe":
            value = self.pipe(term.value, dot)
        else:  # a bare function name as an operand: called without arguments
            value = self.call(term, [], dot)
        for i, name in enumerate(term.chain):
            last = i == len(term.chain) - 1
            value = self.field(value, name, term, args if last else None)
        if args and not term.chain:
            raise self.fail(term.pos, term.text, f"can't give argument to non-function {term.text}")
        return value

    def call(self, fn: _Term, args: list[Any], dot: Any, context: str = "") -> Any:
        name = fn.value
        try:
            return _FUNCS[name](*args)
        except _FuncError as e:
            raise self.fail(fn.pos, context or fn.text, f"error calling {name}: {e}") from None
        except TypeError:
            raise self.fail(
                fn.pos, context or fn.text, f"wrong number of args for {name}"
            ) from None

    def command(self, cmd: list[_Term], dot: Any, piped: list[Any]) -> Any:
        head = cmd[0]
        if head.kind == "ident":
            args = [self.term(t, dot) for t in cmd[1:]] + piped
            last = cmd[-1]
            return self.call(head, args, dot, self.source[head.pos : last.pos + len(last.text)])
        args = [self.term(t, dot) for t in cmd[1:]] + piped
        if args and head.kind != "literal" and head.chain:
            return self.term(head, dot, args)
        if args:
            raise self.fail(head.pos, head.text, f"can't give argument to non-function {head.text}")
        return self.term(head, dot)

    def pipe(self, pipe: _Pipe, dot: Any) -> Any:
        value: Any = None
        for i, cmd in enumerate(pipe.cmds):
            value = self.command(cmd, dot, [value] if i else [])
        if pipe.decl and pipe.assign:
            name = pipe.decl[0]
            for idx in range(len(self.vars) - 1, -1, -1):
                if self.vars[idx][0] == name:
                    self.vars[idx] = (name, value)
                    break
            else:
                raise self.fail(pipe.pos, pipe.text, f"undefined variable: {name}")
        elif pipe.decl:
            self.vars.append((pipe.decl[-1], value))
        return value

    def run(self, nodes: list[Any], dot: Any) -> None:
        for node in nodes:
            if isinstance(node, _Text):
                self.out.append(node.text)
            elif isinstance(node, _Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    self.out.append(go_str(value))
            elif isinstance(node, _Loop):
                raise _Break() if node.kind == "break" else _Continue()
            else:
                self.block(node, dot)

    def block(self, node: _Block, dot: Any) -> None:
        mark = len(self.vars)
        try:
            if node.kind == "range":
                decl = node.pipe.decl
                pipe = _Pipe(node.pipe.pos, node.pipe.text, [], False, node.pipe.cmds)
                value = self.pipe(pipe, dot)
                if isinstance(value, dict):
                    items: list[tuple[Any, Any]] = [(k, value[k]) for k in sorted(value)]
                elif isinstance(value, (list, tuple)):
                    items = list(enumerate(value))
                elif isinstance(value, int) and not isinstance(value, bool):
                    items = [(i, i) for i in range(value)]
                elif value is None:
                    items = []
                else:
                    raise self.fail(
                        node.pipe.pos, node.pipe.text, f"range can't iterate over {go_str(value)}"
                    )
                if not items:
                    self.run(node.orelse, dot)
                    return
                for key, elem in items:
                    inner = len(self.vars)
                    if len(decl) == 2:
                        self.vars += [(decl[0], key), (decl[1], elem)]
                    elif decl:
                        self.vars.append((decl[0], elem))
                    try:
                        self.run(node.body, elem)
                    except _Continue:
                        pass
                    except _Break:
                        break
                    finally:
                        del self.vars[inner:]
                return
            value = self.pipe(node.pipe, dot)
            if _truth(value):
                self.run(node.body, value if node.kind == "with" else dot)
            else:
                self.run(node.orelse, dot)
        finally:
            del self.vars[mark:]


# -- functions ---------------------------------------------------------------------------


class _FuncError(Exception):
    pass


def _index(item: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(item, dict):
            item = item.get(key)
        elif isinstance(item, GoStruct):
            item = item.fields.get(key)
        elif isinstance(item, (list, tuple, str)):
            if not isinstance(key, int) or isinstance(key, bool):
                raise _FuncError(f"cannot index slice/array with type {_type_name(key)}")
            if not 0 <= key < len(item):
                raise _FuncError(f"index out of range: {key}")
            item = item[key]
        elif item is None:
            raise _FuncError("index of untyped nil")
        else:
            raise _FuncError(f"can't index item of type {_type_name(item)}")
    return item


def _len(item: Any) -> int:
    if isinstance(item, (str, list, tuple, dict)):
        return len(item)
    raise _FuncError(f"len of type {_type_name(item)}")


def _sprint(*args: Any) -> str:
    """``fmt.Sprint``: a space between operands when neither is a string."""
    out = ""
    for i, a in enumerate(args):
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out += " "
        out += _fmt_v(a)
    return out


def _sprintf(fmt: str, *args: Any) -> str:
    queue = list(args)

    def one(m: re.Match[str]) -> str:
        verb = m.group(2)
        if verb == "%":
            return "%"
        if not queue:
            return f"%!{verb}(MISSING)"
        value = queue.pop(0)
        if verb == "q":
            return json.dumps(_fmt_v(value) if not isinstance(value, str) else value)
        if verb == "d" and isinstance(value, int) and not isinstance(value, bool):
            return ("%" + m.group(1) + "d") % value
        if verb in ("s", "v", "d"):
            return ("%" + m.group(1) + "s") % _fmt_v(value)
        return f"%!{verb}({_type_name(value)}={_fmt_v(value)})"

    return re.sub(r"%([-+ 0#]*\d*)([a-zA-Z%])", one, fmt)


def _compare(op: str) -> Callable[..., bool]:
    def cmp(a: Any, *others: Any) -> bool:
        if not others:
            raise _FuncError("missing argument for comparison")
        for b in others if op == "eq" else others[:1]:
            comparable = (isinstance(a, str) and isinstance(b, str)) or (
                isinstance(a, (int, float)) and isinstance(b, (int, float))
            )
            if op == "eq":
                if a == b and (comparable or a is None or type(a) is type(b)):
                    return True
                continue
            if op == "ne":
                return bool(a != b)
            if not comparable or isinstance(a, bool) or isinstance(b, bool):
                raise _FuncError("incompatible types for comparison")
            return bool({"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op])
        return False

    return cmp


def _title(s: str) -> str:
    return re.sub(r"(^|[^\w'])(\w)", lambda m: m.group(1) + m.group(2).upper(), s)


def _and(*args: Any) -> Any:
    value: Any = None
    for value in args:
        if not _truth(value):
            return value
    return value


def _or(*args: Any) -> Any:
    value: Any = None
    for value in args:
        if _truth(value):
            return value
    return value


def _truncate(s: str, n: int) -> str:
    return s[:n]


def _pad(s: str, left: int, right: int) -> str:
    return " " * left + s + " " * right


_FUNCS: dict[str, Callable[..., Any]] = {
    "and": _and,
    "or": _or,
    "not": lambda v: not _truth(v),
    "len": _len,
    "index": _index,
    "print": _sprint,
    "printf": _sprintf,
    "println": lambda *a: " ".join(_fmt_v(x) for x in a) + "\n",
    "eq": _compare("eq"),
    "ne": _compare("ne"),
    "lt": _compare("lt"),
    "le": _compare("le"),
    "gt": _compare("gt"),
    "ge": _compare("ge"),
    "json": go_json,
    "join": lambda items, sep: sep.join(_fmt_v(x) for x in items),
    "split": lambda s, sep: s.split(sep),
    "lower": lambda s: s.lower(),
    "upper": lambda s: s.upper(),
    "title": _title,
    "truncate": _truncate,
    "pad": _pad,
}


# -- the public face ---------------------------------------------------------------------


class Template:
    """A parsed template; :meth:`execute` renders it for one value."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._nodes = _Parser(source).parse()

    def execute(self, data: Any, *, strict: bool = True) -> str:
        """Render for ``data`` (the dot). ``strict``: a missing map key is an error (what
        docker's ``inspect`` does), else it prints ``<no value>``."""
        run = _Exec(self.source, strict)
        run.vars.append(("$", data))
        try:
            run.run(self._nodes, data)
        except (_Break, _Continue):  # pragma: no cover - the parser allows them in range only
            pass
        return "".join(run.out)


def parse(source: str) -> Template:
    """Parse ``source``; raises :class:`TemplateError` (Go's parse message)."""
    return Template(source)


def render(source: str, data: Any, *, strict: bool = True) -> str:
    """Parse ``source`` and render it for ``data``."""
    return Template(source).execute(data, strict=strict)
