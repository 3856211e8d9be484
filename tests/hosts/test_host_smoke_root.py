"""dsec on a cgroup v2 host: Debian 12's own kernel (6.1) booted in a QEMU guest.

The short form of the host matrix (``hosts/``, ``make host-matrix``): the guest boots the
cached ``debian12-6.1-v2`` image (``tests/warm_images.py`` builds it in the background, so
its build is never charged to this test's time-out), installs dsec from this checkout,
starts ``dsec serve`` with the container tier and checks through the SDK: create, exec,
files, a memory limit enforced (the command OOM-killed and the result saying so),
pause/resume, kill, then after the server stopped no cgroup, mount, loop device or process
of dsec's left; then the shared-fork tests (:data:`FORK_TESTS`: frozen layers stacked as
lowers, warm containers moved onto a fork's root by the exec server's REROOT, sandbox
groups), which were written on this cgroup v1 machine and must hold on v2 and kernel 6.1.
The guest's evidence (serial console, ``dsec serve``'s log, the checks' JSON, the fork
tests' output) stays in the test's ``tmp_path``.

Several minutes: TCG guests run ~10x slower than this machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hosts.guest import RunOptions, run_host
from hosts.spec import HOSTS
from tests.timing import budget

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.vm, pytest.mark.timeout(2100)]

HOST = "debian12-6.1-v2"
SMOKE_CHECKS = (
    "images.filed", "serve.start", "container.create", "container.exec", "container.files",
    "container.memory", "container.pause_resume", "container.kill", "serve.stop", "leftovers",
    "tests", "leftovers.after_tests",
)  # fmt: skip
FORK_TESTS = (
    "tests/integration/test_groups_root.py",
    "tests/integration/test_container_pool_root.py",
)


def test_container_tier_on_debian12_cgroup_v2(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    options = RunOptions(
        mode="smoke",
        tiers=("container",),
        images={"container": "busybox"},
        conformance=False,
        tests=FORK_TESTS,
        timeout_s=budget(1800),
        memory_mb=2048,
        cpus=1,  # one emulated CPU at nice 10: the guest runs beside the rest of the suite
        nice=10,  # (its VM tiers' own TCG guests missed their boot time-outs beside it)
    )
    run = run_host(HOSTS[HOST], tmp_path / HOST, options)
    results = run.results
    evidence = f"evidence in {run.run_dir} (console.log, out/)"
    checks = {c["name"]: c for c in results.get("checks", [])}
    assert checks, (
        f"the guest reported no checks: {results.get('error')}\n"
        f"{results.get('console_tail', '')}\n{evidence}"
    )
    assert results.get("facts", {}).get("cgroup", {}).get("layout") == "v2", evidence
    missing = [name for name in SMOKE_CHECKS if name not in checks]
    failed = {  # with the failed tests' names and first lines, for the fork tests
        name: [c.get("error"), *((c.get("detail") or {}).get("failures") or [])]
        for name, c in checks.items()
        if c.get("ok") is not True
    }
    assert not missing and not failed, (
        f"missing checks {missing}; not passed:\n"
        + json.dumps(failed, indent=1)
        + f"\ndsec doctor: {results.get('doctor', {}).get('output', '')[-1500:]}\n{evidence}"
    )
