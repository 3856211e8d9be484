"""Languages of the fncall tier: source file, compile and run commands, warm kind, toolkit.

``warm`` says what waits in a ready worker: ``python`` (the interpreter with common modules
imported runs the file as ``__main__``), ``bash`` (a started bash sources the file) or
``none`` (the agent spawns the compiler and the program per call). ``toolkit`` names the
Debian packages stacked on the base image (:mod:`dsec.runtimes.fncall.toolkits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.errors import InvalidRequest

__all__ = ["ALIASES", "LANGUAGES", "LanguageSpec", "resolve_language"]


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
    toolkit: str | None = None
    env: dict[str, str] = field(default_factory=dict)


LANGUAGES: dict[str, LanguageSpec] = {
    "python": LanguageSpec("python", "main.py", "python", ("/usr/bin/python3", "main.py")),
    "bash": LanguageSpec("bash", "main.sh", "bash", ("/bin/bash", "main.sh")),
    "c": LanguageSpec(
        "c",
        "main.c",
        "none",
        ("./main",),
        compile=("/usr/bin/gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"),
        toolkit="gcc",
    ),
    "cpp": LanguageSpec(
        "cpp",
        "main.cpp",
        "none",
        ("./main",),
        compile=("/usr/bin/g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp", "-lm"),
        toolkit="gcc",
    ),
    "nodejs": LanguageSpec(
        "nodejs", "main.js", "none", ("/usr/bin/node", "main.js"), toolkit="nodejs"
    ),
    "go": LanguageSpec(
        "go",
        "main.go",
        "none",
        ("./main",),
        compile=("/usr/bin/go", "build", "-o", "main", "main.go"),
        toolkit="golang",
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
        ("/usr/bin/java", "-Xss64m", "-cp", ".", "Main"),
        compile=("/usr/bin/javac", "-encoding", "UTF-8", "Main.java"),
        toolkit="java",
        env={"JAVA_TOOL_OPTIONS": "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"},
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
