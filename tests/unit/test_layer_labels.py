"""Labels read from a root filesystem tree (``detect_provides``), for layers converted
from OCI images, and how they let toolkit layers stack on such images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest
from dsec.layers.workspace import TOOLKIT_REQUIRES, check_stack, detect_provides
from dsec.models import LayerInfo


def _file(tree: Path, rel: str, text: str = "") -> None:
    path = tree / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _debian_like(tree: Path) -> None:
    """Merged /usr as in Debian 12: /lib -> usr/lib, /etc/os-release -> ../usr/lib/..."""
    _file(tree, "usr/lib/x86_64-linux-gnu/libc.so.6")
    _file(tree, "usr/bin/apt-get")
    _file(tree, "usr/bin/python3")
    _file(tree, "usr/lib/os-release", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n'
          'ID=debian\nVERSION_ID="12"\n')  # fmt: skip
    (tree / "etc").mkdir()
    os.symlink("../usr/lib/os-release", tree / "etc" / "os-release")
    os.symlink("usr/lib", tree / "lib")


def _layer(n: str, kind: str, meta: dict[str, object]) -> LayerInfo:
    return LayerInfo(digest="sha256:" + n * 64, kind=kind, size=1, created_at=0.0, meta=meta)


def test_debian_tree(tmp_path: Path) -> None:
    _debian_like(tmp_path)
    assert detect_provides(tmp_path) == ["apt", "debian", "debian-12", "glibc", "python3"]


def test_alpine_and_busybox_trees(tmp_path: Path) -> None:
    alpine, bb = tmp_path / "alpine", tmp_path / "bb"
    _file(alpine, "lib/ld-musl-x86_64.so.1")
    _file(alpine, "sbin/apk")
    _file(alpine, "bin/busybox")
    _file(alpine, "etc/os-release", "ID=alpine\nVERSION_ID=3.20.1\n")
    assert detect_provides(alpine) == ["alpine", "alpine-3.20.1", "apk", "busybox", "musl"]
    _file(bb, "bin/busybox")
    assert detect_provides(bb) == ["busybox"]
    assert detect_provides(tmp_path / "empty-does-not-exist") == []


def test_links_out_of_the_tree_are_not_followed(tmp_path: Path) -> None:
    """An absolute ``lib -> /usr/lib`` or ``etc -> /etc`` would show the host's files."""
    tree = tmp_path / "t"
    tree.mkdir()
    os.symlink("/usr/lib", tree / "usr")
    os.symlink("/lib", tree / "lib")
    os.symlink("/etc", tree / "etc")
    os.symlink("/bin", tree / "bin")
    assert detect_provides(tree) == []
    # a link as the last component is fine (libc.so.6 -> libc-2.36.so is the usual case),
    # but os-release must be a regular file of the tree to be read
    (tree / "etc").unlink()
    (tree / "etc").mkdir()
    os.symlink("/etc/os-release", tree / "etc" / "os-release")
    assert detect_provides(tree) == []


def test_labels_from_os_release_are_checked(tmp_path: Path) -> None:
    _file(tmp_path, "etc/os-release", "ID=Weird Name!\nVERSION_ID=1\n")
    assert detect_provides(tmp_path) == []


def test_toolkit_stacks_on_a_detected_debian_base(tmp_path: Path) -> None:
    _debian_like(tmp_path)
    base = _layer("1", "base", {"source": "oci", "provides": detect_provides(tmp_path)})
    toolkit = _layer("2", "toolkit", {"toolkit": "nodejs"})
    check_stack([base, toolkit])  # glibc + debian-12 found in the files
    bare = _layer("3", "base", {"source": "oci"})
    with pytest.raises(InvalidRequest) as e:
        check_stack([bare, toolkit])
    assert e.value.details["missing"] == sorted(TOOLKIT_REQUIRES)


def test_toolkit_stacks_on_the_code_interpreter_image() -> None:
    """/run_jupyter stacks the python-runtime toolkit on the built-in code-interpreter
    image (Debian bookworm), whose layer says so through its builtin name."""
    ci = _layer("c", "base", {"builtin": "code-interpreter"})
    toolkit = _layer("d", "toolkit", {"toolkit": "python-runtime"})
    check_stack([ci, toolkit])
