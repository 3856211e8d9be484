"""``dsec serve`` keeps its mounts in its own mount namespace (dsec.privileged.mountns).

On systemd hosts ``/`` and ``/dev`` are shared mounts: a container's masks, bound from the
node's ``/dev/null``, joined the host's ``/dev`` peer group, and a rebind on top of one
propagated to the host's ``/dev/null`` and to every other container's masks, doubling the
mount table with each container until ``mount(2)`` answered ENOSPC (Debian 12 guests). Here
the host's ``/`` is private, so each test runs its server in a mount namespace made *shared*
like systemd's (``unshare --propagation shared``) and looks from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.ns_ids import from_each_cpu
from tests.timing import budget

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)"),
]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from dsec import Sandbox
    from dsec.runtimes.container.bundle import cgroup_parent
    from dsec.server import ServeProcess

    home = Path(sys.argv[1])
    env = {"DSEC_MOUNT_NAMESPACE": sys.argv[2]}

    def table(pid="self"):
        rows = []
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                rows.append({"mp": fields[4], "tags": fields[6:], "fs": right.split()[0]})
        return rows

    def under_home(rows):
        return sorted(r["mp"] + " " + r["fs"] for r in rows if r["mp"].startswith(str(home)))

    def measure(srv, boxes, out):
        for sb in boxes:
            assert sb.commands.run("true").exit_code == 0
        mine = cgroup_parent(home)  # this server's containers (other tests run beside)

        def ours(p):
            try:
                return (
                    Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"/dev/.dsec-init")
                    and mine in Path(f"/proc/{p}/cgroup").read_text()
                )
            except OSError:  # gone meanwhile
                return False

        inits = [p for p in os.listdir("/proc") if p.isdigit() and ours(p)]
        out["live"] = len(table())
        out["host_under_home"] = under_home(table())
        out["server_under_home"] = under_home(table(srv.proc.pid))
        # what the server said of its namespace (read when an assertion below fails)
        out["namespace_log"] = [
            ln for ln in (home / "serve.log").read_text(errors="replace").splitlines()
            if "mount namespace" in ln
        ]
        # a container's masks (/proc/kcore, ...) must not be peers of a host mount
        out["shared_masks"] = [
            r["mp"] for p in inits for r in table(p)
            if r["mp"].startswith("/proc/") and any(t.startswith("shared:") for t in r["tags"])
        ]
        out["inits"] = len(inits)
        boxes[0].files.write("/tmp/x", "through the API")
        out["read_back"] = boxes[0].files.read_text("/tmp/x")

    out = {"before": len(table())}
    with ServeProcess(home, env=env) as srv:
        kw = {"image": "busybox", "url": srv.url, "api_key": srv.api_key}
        boxes = []
        try:  # sandboxes outlive a stopped server (a restart recovers them): kill them
            boxes += [Sandbox.create(**kw) for _ in range(4)]
            measure(srv, boxes, out)
        finally:
            for sb in boxes:
                sb.kill()
    out["after"] = len(table())
    out["host_under_home_after"] = under_home(table())
    print(json.dumps(out))
    """
)


def _run_shared(tmp_path: Path, mode: str) -> dict:  # type: ignore[type-arg]
    """The script in a new mount namespace whose mounts are all shared, as systemd's are."""
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run(
        [
            *("unshare", "--mount", "--propagation", "shared", "--", sys.executable, "-c", SCRIPT),
            str(home),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=budget(300),
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_sandbox_mounts_stay_out_of_a_shared_host_table(tmp_path: Path) -> None:
    out = _run_shared(tmp_path, "own")
    assert out["inits"] >= 4  # and the warm pool's
    # the host sees the namespace's pin (on its private directory), no sandbox mount
    assert all("/run/mntns" in m for m in out["host_under_home"]), (
        out["namespace_log"],
        out["host_under_home"],
    )
    # the server's own namespace has them: an overlay and an upper per sandbox
    assert sum(m.endswith(" overlay") for m in out["server_under_home"]) >= 4
    assert out["shared_masks"] == []
    assert out["read_back"] == "through the API"
    # and nothing of the server's is left in the host's table, not even the pin (no sandbox
    # outlived the server)
    assert out["host_under_home_after"] == [], out


def test_host_namespace_when_asked(tmp_path: Path) -> None:
    """``DSEC_MOUNT_NAMESPACE=host``: the mounts are in the host's table, as before (and are
    gone with the sandboxes)."""
    out = _run_shared(tmp_path, "host")
    assert sum(m.endswith(" overlay") for m in out["host_under_home"]) >= 4
    assert out["host_under_home_after"] == []


PIN_REPEATEDLY = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from dsec.privileged import mountns

    unpinned = []
    for i in range(int(sys.argv[2])):
        pid = os.fork()
        if pid == 0:  # a single-threaded process, as dsec serve is at its start
            ns = mountns.enter_node_namespace(Path(sys.argv[1]) / str(i))
            ok = ns.own and ns.pin is not None
            if not ok:
                print(ns.reason, file=sys.stderr)
            ns.release()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        unpinned += [i] if os.waitstatus_to_exitcode(status) else []
    print(len(unpinned))
    """
)


def test_the_node_namespace_is_pinned_however_the_kernel_numbers_namespaces(
    tmp_path: Path,
) -> None:
    """The node's namespace pin, made from a host namespace made on each CPU in turn (a
    namespace numbered below the binder's is refused with EINVAL on Linux 6.18, whose ids
    come from per-CPU batches: about half of ``dsec serve``'s starts here ran unpinned)."""
    for cpu, (out, err) in from_each_cpu(PIN_REPEATEDLY, tmp_path, "shared", "8").items():
        assert out == "0", f"unpinned from CPU {cpu}: {err}"
