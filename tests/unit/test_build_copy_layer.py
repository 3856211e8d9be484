"""Copy layers built straight from context files: destinations resolved inside the image
(its symlinks followed, its directories' metadata kept), ownership and modes, and a tree
that can never be written through a symlink of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.builds.copy_layer import (
    ImageFS,
    LayerTree,
    SourceEntry,
    _Node,
    apply_chmod,
    lookup_ids,
    place_entries,
)
from dsec.errors import InvalidRequest
from dsec.models import FileInfo

T = 1_700_000_000.0


def info(
    path: str, kind: str, mode: int = 0o755, uid: int = 0, target: str | None = None
) -> FileInfo:
    return FileInfo(
        path=path, name=path.rsplit("/", 1)[-1] or "/", type=kind, size=0, mode=mode,  # type: ignore[arg-type]
        mtime=T, uid=uid, gid=uid, target=target,
    )  # fmt: skip


MERGED_USR = {
    "/": info("/", "dir"),
    "/bin": info("/bin", "symlink", 0o777, target="usr/bin"),
    "/usr": info("/usr", "dir"),
    "/usr/bin": info("/usr/bin", "dir"),
    "/tmp": info("/tmp", "dir", 0o1777),
    "/home": info("/home", "dir"),
    "/home/app": info("/home/app", "dir", 0o700, uid=1234),
    "/etc": info("/etc", "dir"),
    "/etc/hosts": info("/etc/hosts", "file", 0o644),
    "/loop": info("/loop", "symlink", 0o777, target="/loop"),
}


def image_fs(tree: dict[str, FileInfo] = MERGED_USR) -> tuple[ImageFS, list[str]]:
    asked: list[str] = []

    async def stat(path: str) -> FileInfo | None:
        asked.append(path)
        return tree.get(path)

    return ImageFS(stat), asked


def f(rel: str, data: bytes = b"x", mode: int = 0o644) -> SourceEntry:
    return SourceEntry(rel, "file", mode, T, data=lambda: data)


def d(rel: str, mode: int = 0o755) -> SourceEntry:
    return SourceEntry(rel, "dir", mode, T)


def link(rel: str, target: str) -> SourceEntry:
    return SourceEntry(rel, "symlink", 0o777, T, linkname=target)


async def test_destinations_follow_the_image_symlinks_and_keep_its_directories() -> None:
    fs, _ = image_fs()
    tree = LayerTree()
    await fs.stat("/")
    await place_entries(
        fs, tree, "/bin/tool", [f("tool", mode=0o755)], into_dir=False, owner=None, chmod=None
    )
    await place_entries(fs, tree, "/tmp", [f("t.txt")], into_dir=True, owner=None, chmod=None)
    await place_entries(
        fs, tree, "/home/app", [f("f")], into_dir=True, owner=(1234, 1234), chmod=None
    )
    assert "/bin" not in tree.nodes  # a /bin directory would hide every binary
    assert tree.nodes["/usr/bin/tool"].mode == 0o755
    assert tree.nodes["/tmp"].mode == 0o1777  # the image's /tmp, not a fresh 0755 one
    assert (tree.nodes["/home/app"].mode, tree.nodes["/home/app"].uid) == (0o700, 1234)
    assert (tree.nodes["/home/app/f"].uid, tree.nodes["/home/app/f"].gid) == (1234, 1234)


async def test_new_directories_belong_to_root_or_the_chown_owner_and_keep_source_modes() -> None:
    fs, asked = image_fs()
    tree = LayerTree()
    entries = [d("", 0o750), d("sub", 0o700), f("sub/a"), link("sub/l", "a")]
    await place_entries(fs, tree, "/opt/app", entries, into_dir=True, owner=None, chmod=None)
    assert tree.nodes["/opt"].mode == 0o755 and tree.nodes["/opt"].uid == 0  # created parent
    assert tree.nodes["/opt/app"].mode == 0o750 and tree.nodes["/opt/app/sub"].mode == 0o700
    assert tree.nodes["/opt/app/sub/l"].linkname == "a"
    assert "/opt/app/sub" not in asked  # below a new directory nothing is asked
    other = LayerTree()
    await place_entries(
        fs, other, "/srv/x", [d(""), f("a")], into_dir=True, owner=(7, 8), chmod="u+x,go-r",
        root_dirs=frozenset({"/srv"}),
    )  # fmt: skip
    assert (other.nodes["/srv"].uid, other.nodes["/srv"].mode) == (0, 0o755)  # as WORKDIR makes it
    assert (other.nodes["/srv/x"].uid, other.nodes["/srv/x"].gid) == (7, 8)
    assert other.nodes["/srv/x/a"].mode == 0o700


async def test_files_on_the_way_and_symlink_loops_are_refused() -> None:
    fs, _ = image_fs()
    with pytest.raises(InvalidRequest, match="not a directory"):
        await place_entries(
            fs, LayerTree(), "/etc/hosts/x", [f("x")], into_dir=False, owner=None, chmod=None
        )
    with pytest.raises(InvalidRequest, match="too many symlinks"):
        await place_entries(
            fs, LayerTree(), "/loop/x", [f("x")], into_dir=False, owner=None, chmod=None
        )


async def test_a_tree_is_never_written_through_its_own_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    fs, _ = image_fs({"/": info("/", "dir")})
    # a directory with children, then a later source putting a symlink in its place ...
    tree = LayerTree()
    await place_entries(
        fs, tree, "/d", [d(""), d("lib"), f("lib/x")], into_dir=True, owner=None, chmod=None
    )
    await place_entries(
        fs, tree, "/d", [d(""), link("lib", str(outside))], into_dir=True, owner=None, chmod=None
    )
    assert "/d/lib/x" not in tree.nodes and tree.nodes["/d/lib"].type == "symlink"
    # ... and the other way round: the later directory wins over the symlink
    again = LayerTree()
    await place_entries(
        fs, again, "/d", [d(""), link("lib", str(outside))], into_dir=True, owner=None, chmod=None
    )
    await place_entries(
        fs, again, "/d", [d(""), d("lib"), f("lib/x")], into_dir=True, owner=None, chmod=None
    )
    assert again.nodes["/d/lib"].type == "dir"
    for t, root in ((tree, tmp_path / "one"), (again, tmp_path / "two")):
        t.write(root)
    assert list(outside.iterdir()) == []
    assert (tmp_path / "two" / "d" / "lib" / "x").read_bytes() == b"x"
    assert os.readlink(tmp_path / "one" / "d" / "lib") == str(outside)
    # a tree broken by hand is refused at write time, before anything goes outside
    bad = LayerTree()
    bad.nodes = {
        "/": _Node("dir", 0o755, 0, 0, T),
        "/l": _Node("symlink", 0o777, 0, 0, T, linkname=str(outside)),
        "/l/evil": _Node("file", 0o644, 0, 0, T, data=lambda: b"!"),
    }
    with pytest.raises(InvalidRequest, match="through a symlink"):
        bad.write(tmp_path / "three")
    assert list(outside.iterdir()) == []


def test_chmod_octal_and_symbolic() -> None:
    assert apply_chmod("0755", 0o600, False) == 0o755
    assert apply_chmod("4755", 0o600, False) == 0o4755
    assert apply_chmod("u+x", 0o644, False) == 0o744
    assert apply_chmod("go-rwx", 0o755, True) == 0o700
    assert apply_chmod("a=r", 0o777, False) == 0o444
    assert apply_chmod("a+X", 0o644, False) == 0o644 and apply_chmod("a+X", 0o644, True) == 0o755
    assert apply_chmod("u+s,o+t", 0o755, True) == 0o5755


def test_chown_lookup() -> None:
    passwd = "root:x:0:0::/root:/bin/sh\napp:x:1234:50::/home/app:/bin/sh\n"
    group = "root:x:0:\nstaff:x:50:\n"
    assert lookup_ids("app", passwd, group) == (1234, 1234)  # Docker: the uid as the gid too
    assert lookup_ids("app:staff", passwd, group) == (1234, 50)
    assert lookup_ids("1000:1000", None, None) == (1000, 1000)
    assert lookup_ids("1000", None, None) == (1000, 1000)
    with pytest.raises(InvalidRequest, match="no user 'ghost'"):
        lookup_ids("ghost", passwd, group)
    with pytest.raises(InvalidRequest, match="no group 'wheel'"):
        lookup_ids("app:wheel", passwd, group)
