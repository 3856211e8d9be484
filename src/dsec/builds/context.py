"""The build context: the uploaded files ``copy`` steps read, indexed without unpacking.

The context arrives as a tar archive (uncompressed, or gzip/bzip2/xz: then it is
decompressed in memory, bounded). :class:`BuildContext` indexes its members by path
(``a/b/c``, relative to the context root; leading ``/`` and ``./`` dropped, ``..`` refused)
and reads file data straight from the archive bytes: nothing is written to disk. Hard links
become copies of their target; devices, FIFOs and sockets are skipped; directories that
members imply but the archive does not list exist with mode 0755. Later members replace
earlier ones, as tar does.

:class:`DockerIgnore` is the ``.dockerignore`` matcher (Docker's semantics: ``*`` and ``?``
within a path component, ``**`` across components, a pattern also excludes everything under
a directory it matches, ``!pattern`` re-includes, the last matching line wins).

Example::

    ctx = BuildContext.from_tar(data).without(DockerIgnore.parse(".git\\n*.pyc\\n"))
    sources = ctx.match("src/*.py")          # ['src/a.py', 'src/b.py']
    digest = ctx.content_digest(["src"])     # what a COPY of src would copy, hashed
"""

from __future__ import annotations

import bz2
import hashlib
import io
import lzma
import posixpath
import re
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from dsec.errors import InvalidRequest, PayloadTooLarge

__all__ = ["BuildContext", "ContextEntry", "DockerIgnore", "normalize_context_path"]

EntryType = Literal["file", "dir", "symlink"]
_MAX_SYMLINK_HOPS = 40


def normalize_context_path(path: str) -> str:
    """``path`` relative to the context root, normalised (``""`` is the root). Leading
    ``/`` and ``./`` are dropped; a path that climbs out with ``..`` is refused."""
    if "\0" in path:
        raise InvalidRequest(f"invalid context path {path!r}")
    out: list[str] = []
    for p in path.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not out:
                raise InvalidRequest(f"context path {path!r} leaves the build context")
            out.pop()
        else:
            out.append(p)
    return "/".join(out)


@dataclass(frozen=True)
class ContextEntry:
    """One path of the context. ``mode``: permission bits (with setuid/setgid/sticky);
    ``mtime``: seconds; ``offset``/``size``: where a file's bytes are in the archive."""

    path: str
    type: EntryType
    mode: int
    mtime: float
    size: int = 0
    offset: int = 0
    linkname: str = ""


@dataclass
class BuildContext:
    """An indexed build context (see the module docstring)."""

    data: bytes | memoryview = b""
    entries: dict[str, ContextEntry] = field(default_factory=dict)
    _children: dict[str, list[str]] | None = None
    _digests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> BuildContext:
        return cls(b"", {"": ContextEntry("", "dir", 0o755, 0.0)})

    @classmethod
    def from_tar(
        cls,
        data: bytes,
        *,
        max_bytes: int | None = None,
        max_entries: int | None = None,
    ) -> BuildContext:
        """Index a context archive. ``max_bytes`` bounds the file data (and a compressed
        archive's decompressed size), ``max_entries`` the members.

        Raises:
            InvalidRequest: not a tar archive, or a member leaves the context.
            PayloadTooLarge: past a bound.
        """
        if not data:
            return cls.empty()
        raw = _decompress(data, max_bytes)
        entries: dict[str, ContextEntry] = {"": ContextEntry("", "dir", 0o755, 0.0)}
        total = 0
        count = 0
        try:
            tf = tarfile.open(fileobj=io.BytesIO(raw), mode="r:")
            for m in tf:
                count += 1
                if max_entries is not None and count > max_entries:
                    raise PayloadTooLarge(
                        f"the build context has more than {max_entries} entries",
                        limit_entries=max_entries,
                    )
                path = normalize_context_path(m.name)
                mode = m.mode & 0o7777
                if m.isdir():
                    entry = ContextEntry(path, "dir", mode, float(m.mtime))
                elif m.isreg():
                    total += m.size
                    if max_bytes is not None and total > max_bytes:
                        raise PayloadTooLarge(
                            f"the build context holds more than {max_bytes} bytes of files",
                            limit_bytes=max_bytes,
                        )
                    entry = ContextEntry(path, "file", mode, float(m.mtime), m.size, m.offset_data)
                elif m.issym():
                    entry = ContextEntry(
                        path, "symlink", 0o777, float(m.mtime), linkname=m.linkname
                    )
                elif m.islnk():
                    target = entries.get(normalize_context_path(m.linkname))
                    if target is None or target.type != "file":
                        raise InvalidRequest(
                            f"context member {m.name!r}: hard link to {m.linkname!r}, which is "
                            "not a file earlier in the archive"
                        )
                    entry = ContextEntry(
                        path, "file", mode, float(m.mtime), target.size, target.offset
                    )
                else:
                    continue  # devices, FIFOs: not copyable
                if not path:
                    if entry.type == "dir":
                        entries[""] = entry
                    continue
                entries[path] = entry
        except (tarfile.TarError, EOFError) as e:
            raise InvalidRequest(f"the build context is not a readable tar archive: {e}") from None
        for path in list(entries):  # directories the members imply
            parent = posixpath.dirname(path)
            while parent and parent not in entries:
                entries[parent] = ContextEntry(parent, "dir", 0o755, 0.0)
                parent = posixpath.dirname(parent)
        return cls(memoryview(raw), entries)

    # --- reading ---------------------------------------------------------------------------

    def read(self, entry: ContextEntry) -> bytes:
        """A file's bytes."""
        return bytes(self.data[entry.offset : entry.offset + entry.size])

    def read_text(self, path: str) -> str:
        """A file of the context as text (a Dockerfile, ``.dockerignore``). Raises
        ``InvalidRequest`` if it is not there."""
        entry = self.lookup(path)
        if entry is None or entry.type != "file":
            raise InvalidRequest(f"the build context has no file {path!r}", path=path)
        return self.read(entry).decode("utf-8", errors="replace")

    def lookup(self, path: str) -> ContextEntry | None:
        """The entry at ``path`` (symlinks not followed), or None."""
        return self.entries.get(normalize_context_path(path))

    def resolve(self, path: str) -> ContextEntry | None:
        """The entry ``path`` names, following symlinks inside the context (chroot
        semantics: an absolute target starts at the context root); None if it leads
        nowhere or out of the context."""
        current = normalize_context_path(path)
        for _ in range(_MAX_SYMLINK_HOPS):
            entry = self.entries.get(current)
            if entry is None or entry.type != "symlink":
                return entry
            target = entry.linkname
            base = "" if target.startswith("/") else posixpath.dirname(current)
            try:
                current = normalize_context_path(posixpath.join(base, target.lstrip("/")))
            except InvalidRequest:
                return None
        return None

    def children(self, path: str) -> list[str]:
        """Direct children of the directory ``path`` (full paths, sorted)."""
        if self._children is None:
            kids: dict[str, list[str]] = {}
            for p in self.entries:
                if p:
                    kids.setdefault(posixpath.dirname(p), []).append(p)
            for v in kids.values():
                v.sort()
            self._children = kids
        return self._children.get(path, [])

    def walk(self, path: str) -> Iterator[ContextEntry]:
        """``path`` and everything below it, parents before children, sorted."""
        entry = self.entries.get(path)
        if entry is None:
            return
        yield entry
        if entry.type == "dir":
            for child in self.children(path):
                yield from self.walk(child)

    # --- selecting -------------------------------------------------------------------------

    def match(self, pattern: str) -> list[str]:
        """The context paths a ``COPY`` source names: the path itself, or for a pattern with
        ``*``, ``?`` or ``[...]`` every path whose components match it (``*`` never crosses
        ``/``), sorted. ``"."`` is the context root (``""``)."""
        norm = normalize_context_path(pattern)
        if not any(c in norm for c in "*?["):
            return [norm] if norm in self.entries else []
        parts = norm.split("/")
        regexes = [_ignore_regex(p) for p in parts]  # one component: no "/" to cross
        out = []
        for path in self.entries:
            comps = path.split("/") if path else []
            if len(comps) == len(parts) and all(
                r.match(c) for r, c in zip(regexes, comps, strict=True)
            ):
                out.append(path)
        return sorted(out)

    def without(self, ignore: DockerIgnore | None) -> BuildContext:
        """This context with the paths ``ignore`` excludes removed (the root stays)."""
        if ignore is None or not ignore.patterns:
            return self
        kept = {p: e for p, e in self.entries.items() if not p or not ignore.excluded(p)}
        return BuildContext(self.data, kept)

    def content_digest(self, roots: Iterable[str]) -> str:
        """sha256 over what copying ``roots`` (context paths) brings: for each root, every
        entry below it with its path relative to the root's parent, type, mode, link target
        and the sha256 of its bytes. Modification times and owners are not part of it (a
        fresh checkout of the same files is a cache hit)."""
        h = hashlib.sha256()
        for root in roots:
            entry = self.resolve(root) if root else self.entries.get("")
            if entry is None:
                h.update(b"missing\0" + root.encode() + b"\0")
                continue
            base = posixpath.dirname(entry.path) if entry.path else ""
            for e in self.walk(entry.path):
                rel = posixpath.relpath(e.path, base) if base else e.path
                h.update(f"{e.type}\0{rel}\0{e.mode:o}\0{e.linkname}\0".encode())
                if e.type == "file":
                    h.update(self._file_digest(e).encode() + b"\0")
        return "sha256:" + h.hexdigest()

    def _file_digest(self, e: ContextEntry) -> str:
        key = f"{e.offset}:{e.size}"
        got = self._digests.get(key)
        if got is None:
            got = hashlib.sha256(self.data[e.offset : e.offset + e.size]).hexdigest()
            self._digests[key] = got
        return got


def _decompress(data: bytes, limit: int | None) -> bytes:
    """``data`` as an uncompressed tar: gzip, bzip2 and xz are inflated in bounded steps,
    at most about ``limit`` bytes of files (twice it, plus room for tar headers)."""
    bound = None if limit is None else 2 * limit + (16 << 20)
    step = 16 << 20
    out = bytearray()

    def check() -> None:
        if bound is not None and len(out) > bound:
            raise PayloadTooLarge(
                f"the build context decompresses to more than {bound} bytes", limit_bytes=limit
            )

    try:
        if data[:2] == b"\x1f\x8b":
            z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            pending = data
            while pending and not z.eof:
                out += z.decompress(pending, step)
                pending = z.unconsumed_tail
                check()
            out += z.flush()
        elif data[:3] == b"BZh" or data[:6] == b"\xfd7zXZ\x00":
            d: bz2.BZ2Decompressor | lzma.LZMADecompressor = (
                bz2.BZ2Decompressor() if data[:3] == b"BZh" else lzma.LZMADecompressor()
            )
            out += d.decompress(data, step)
            check()
            while not d.eof and not d.needs_input:
                out += d.decompress(b"", step)
                check()
        else:
            return data
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise InvalidRequest(f"the build context is corrupt: {e}") from None
    check()
    return bytes(out)


# --- .dockerignore ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _IgnorePattern:
    regex: re.Pattern[str]
    exclusion: bool
    text: str


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's (moby/patternmatcher) pattern syntax as a regex over slash paths."""
    out = ["^"]
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if i < n and pattern[i] == "/":  # '**/' matches zero or more directories
                    out.append("(.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("^") or body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    out.append("$")
    return re.compile("".join(out))


@dataclass(frozen=True)
class DockerIgnore:
    """Parsed ``.dockerignore`` patterns (see the module docstring)."""

    patterns: tuple[_IgnorePattern, ...] = ()

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        pats = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            if exclusion:
                line = line[1:].strip()
            line = posixpath.normpath(line).lstrip("/")
            if line in ("", "."):
                continue
            pats.append(_IgnorePattern(_ignore_regex(line), exclusion, raw.strip()))
        return cls(tuple(pats))

    @property
    def has_exclusions(self) -> bool:
        """Whether any ``!`` line re-includes paths (a directory excluded can then still
        hold included files, so it must be walked)."""
        return any(p.exclusion for p in self.patterns)

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative, slash-separated) is left out of the context."""
        candidates = [path]
        parent = posixpath.dirname(path)
        while parent:
            candidates.append(parent)
            parent = posixpath.dirname(parent)
        matched = False
        for p in self.patterns:
            if any(p.regex.match(c) for c in candidates):
                matched = not p.exclusion
        return matched
