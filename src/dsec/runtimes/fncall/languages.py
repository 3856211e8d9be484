"""Languages of the fncall tier: source file, compile and run commands, warm kind, toolkit.

``warm`` says what waits in a ready worker: ``python`` (the interpreter with common modules
imported runs the file as ``__main__``), ``bash`` (a started bash sources the file) or
``none`` (the agent spawns the compiler and the program per call). ``toolkits`` name the
toolkit layers stacked on the base image, in order (:mod:`dsec.runtimes.fncall.toolkits`).

Compile and run commands follow SandboxFusion's runners (``sandbox/runners/major.py``):
Java runs with assertions on (``-ea``) and ``javatuples`` plus every ``*.jar`` of the call's
``files`` on its class path (the token :data:`CLASSPATH` in an argv is replaced by it);
Node.js finds SandboxFusion's preinstalled npm packages through ``NODE_PATH``; Rust is
``rustc`` without optimisation, as there, but linked against Debian's shared ``libstd``
(``-C prefer-dynamic -C rpath``): a third of the CPU of a static link (0.13 vs 0.40 s for a
hello world here), which keeps SandboxFusion's 1 s compile limits within reach on a busy
node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.errors import InvalidRequest
from dsec.runtimes.fncall.toolkits import NODE_MODULES_PREFIX

__all__ = ["ALIASES", "CLASSPATH", "LANGUAGES", "LanguageSpec", "resolve_language"]

CLASSPATH = "{classpath}"
"""An argv element replaced by the call's Java class path: ``.``, the spec's ``jars``, then
the ``*.jar`` files of the call (as given, relative to ``/work``), joined with ``:``."""

_JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
"""Start-up flags of ``java`` (and, as ``-J`` flags, of ``javac``): passed on the command
line, not through ``JAVA_TOOL_OPTIONS``, whose "Picked up ..." line would open every
stderr."""


@dataclass(frozen=True)
class LanguageSpec:
    """How to run one language. Commands run in ``/work`` with the source at ``source_file``.

    Each command's ``argv[0]`` is an absolute path, so a call's ``env`` (a ``PATH`` of its
    own) changes what the program finds, never whether the compiler or interpreter starts.
    """

    name: str
    source_file: str
    warm: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    toolkits: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    jars: tuple[str, ...] = ()


LANGUAGES: dict[str, LanguageSpec] = {
    "python": LanguageSpec(
        "python",
        "main.py",
        "python",
        ("/usr/bin/python3", "main.py"),
        toolkits=("python-runtime",),
    ),
    "bash": LanguageSpec("bash", "main.sh", "bash", ("/bin/bash", "main.sh")),
    "c": LanguageSpec(
        "c",
        "main.c",
        "none",
        ("./main",),
        compile=("/usr/bin/gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"),
        toolkits=("gcc",),
    ),
    "cpp": LanguageSpec(
        "cpp",
        "main.cpp",
        "none",
        ("./main",),
        compile=("/usr/bin/g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp", "-lm"),
        toolkits=("gcc",),
    ),
    "nodejs": LanguageSpec(
        "nodejs",
        "main.js",
        "none",
        ("/usr/bin/node", "main.js"),
        toolkits=("nodejs",),
        env={"NODE_PATH": f"{NODE_MODULES_PREFIX}/node_modules"},
    ),
    "go": LanguageSpec(
        "go",
        "main.go",
        "none",
        ("./main",),
        compile=("/usr/bin/go", "build", "-o", "main", "main.go"),
        toolkits=("golang",),
        env={
            "GOCACHE": "/tmp/go-cache",
            "GOPATH": "/tmp/go",
            "GO111MODULE": "off",
            "GOFLAGS": "-buildvcs=false",
        },
    ),
    "java": LanguageSpec(
        "java",
        "Main.java",
        "none",
        ("/usr/bin/java", *_JVM_FLAGS, "-Xss64m", "-cp", CLASSPATH, "-ea", "Main"),
        compile=(
            "/usr/bin/javac",
            *(f"-J{f}" for f in _JVM_FLAGS),
            "-encoding",
            "UTF-8",
            "-cp",
            CLASSPATH,
            "Main.java",
        ),
        toolkits=("java",),
        jars=("/usr/share/java/javatuples.jar",),
    ),
    "rust": LanguageSpec(
        "rust",
        "main.rs",
        "none",
        ("./main",),
        compile=("/usr/bin/rustc", "-C", "prefer-dynamic", "-C", "rpath", "main.rs", "-o", "main"),
        toolkits=("rust",),
    ),
}

ALIASES: dict[str, str] = {
    "python3": "python",
    "py": "python",
    "sh": "bash",
    "c++": "cpp",
    "cxx": "cpp",
    "node": "nodejs",
    "javascript": "nodejs",
    "js": "nodejs",
    "golang": "go",
    "rs": "rust",
}


def resolve_language(name: str) -> LanguageSpec:
    """The spec of ``name`` (case-insensitive, aliases allowed). Raises InvalidRequest."""
    key = ALIASES.get(name.lower(), name.lower())
    spec = LANGUAGES.get(key)
    if spec is None:
        raise InvalidRequest(
            f"unsupported language {name!r}; supported: {', '.join(sorted(LANGUAGES))}",
            language=name,
            supported=sorted(LANGUAGES),
        )
    return spec
