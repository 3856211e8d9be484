"""libnftables waits on its netlink socket with select(): a socket fd past 1024 aborts the
process inside glibc. dsec.privileged.nft keeps low fds in reserve for its contexts, and a
context that would still get a high fd is refused with NftError, never an abort."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.root

SCENARIO = """
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, 8192))
{early}
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1500)]
from dsec.privileged.nft import Nftables, NftError
try:
    for _ in range(6):  # more contexts than the reserve holds: each gives its fds back
        n = Nftables()
        n.json("list tables")
        n.close()
    print("ok")
except NftError as e:
    print("refused:", e)
"""


def _run(early: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (nftables)")
    code = textwrap.dedent(SCENARIO).format(early=early)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_contexts_made_after_thousands_of_fds_use_the_reserve() -> None:
    r = _run("import dsec.privileged.nft")
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout, r.stderr)


def test_without_a_low_fd_the_context_is_refused_not_aborted() -> None:
    r = _run("")
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])  # -6 (SIGABRT) before
    assert r.stdout.startswith("refused:") and "below 1024" in r.stdout, r.stdout
