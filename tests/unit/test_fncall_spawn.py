"""fncall_spawn, the helper every command of a fncall worker execs through, on its own: both
forms (run now; wait for the command on a pipe), the PATH search and the exit statuses of
what cannot run. Landlock and the cgroup move are left out (-1): the fncall tests cover them
in a worker."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from dsec.runtimes.container.native import build_native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_native(tmp_path_factory.mktemp("bin"), "fncall_spawn")


def request(cwd: str, argv: list[str], env: list[str]) -> bytes:
    return struct.pack("<II", len(argv), len(env)) + b"".join(
        s.encode() + b"\0" for s in [cwd, *argv, *env]
    )


def waiting(spawn: Path, data: bytes | None) -> subprocess.CompletedProcess[bytes]:
    """The second form: started first, then handed ``data`` (None: nothing, end of file)."""
    r, w = os.pipe()
    proc = subprocess.Popen(
        [str(spawn), "-1", "-1", str(r)],
        pass_fds=(r,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    os.close(r)
    if data:
        os.write(w, data)
    os.close(w)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_runs_now_with_the_path_of_its_environment(spawn: Path, tmp_path: Path) -> None:
    script = tmp_path / "hello"
    script.write_text('echo "hello $1"\n')  # no #!: run by /bin/sh, as execvp does
    script.chmod(0o755)
    env = {"PATH": f"/nonexistent:{tmp_path}:/usr/bin:/bin"}
    r = subprocess.run([spawn, "-1", "-1", "--", "hello", "you"], env=env, capture_output=True)
    assert (r.returncode, r.stdout) == (0, b"hello you\n"), r
    r = subprocess.run(
        [spawn, "-1", "-1", "--", "cat", "/proc/self/oom_score_adj"], env=env, capture_output=True
    )
    assert r.stdout == b"1000\n", r  # above the agent's


def test_what_cannot_run(spawn: Path, tmp_path: Path) -> None:
    r = subprocess.run([spawn, "-1", "-1", "--", "no-such-program"], capture_output=True)
    assert (r.returncode, r.stderr) == (127, b"no-such-program: No such file or directory\n")
    (tmp_path / "data").write_text("x")
    r = subprocess.run([spawn, "-1", "-1", "--", str(tmp_path / "data")], capture_output=True)
    assert r.returncode == 126 and b"Permission denied" in r.stderr, r
    r = subprocess.run([spawn, "-1"], capture_output=True)
    assert r.returncode == 126 and r.stderr.startswith(b"usage:"), r


def test_waits_for_its_command(spawn: Path, tmp_path: Path) -> None:
    argv = ["sh", "-c", 'pwd; echo "$X" "[$1]" "[$2]"', "sh", "", "two words"]
    r = waiting(spawn, request(str(tmp_path), argv, ["X=y", "PATH=/usr/bin:/bin"]))
    assert (r.returncode, r.stdout) == (0, f"{tmp_path}\ny [] [two words]\n".encode()), r
    r = waiting(spawn, request("/", ["env"], []))
    assert (r.returncode, r.stdout) == (0, b""), r  # the request's environment, nothing else


def test_a_waiting_helper_not_used_or_handed_garbage(spawn: Path) -> None:
    assert waiting(spawn, None).returncode == 0  # end of file: not used after all
    r = waiting(spawn, request("/does/not/exist", ["true"], []))
    assert (r.returncode, r.stderr) == (
        126,
        b"dsec: cwd /does/not/exist: No such file or directory\n",
    )
    for bad in (b"\x01\0\0\0\0\0\0\0/\0", b"\x01\0", request("/", ["true"], [])[:-1]):
        r = waiting(spawn, bad)
        assert r.returncode == 126 and b"Invalid argument" in r.stderr, (bad, r)
