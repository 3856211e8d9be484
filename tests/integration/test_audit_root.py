"""Evidence of cheating on real sandboxes (root): a ``dsec serve`` with the container tier and
networking on a subnet of its own; each test makes a sandbox attempt one thing the platform
refuses and finds exactly that record in ``sb.audit()`` (and in the kill answer, the job
summary, the metrics and the trajectory export). The red-team probe of the security tests
(``tests/security/test_container_escape.py``) runs too, and every refusal it meets leaves
its evidence. No traffic leaves the node: the only destinations are the sandbox's own
gateway and an address of the never-routed benchmarking range, both dropped by the policy."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.isolation import subnet_host, worker_subnet
from tests.security.test_container_escape import EXPECTED, PROBE_C

import dsec.errors as E
from dsec import NetworkPolicy, Sandbox, jobs
from dsec.models import AuditReport
from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,  # a server start, probes that wait out dropped packets
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, crun, netns, audit)"),
]

SUBNET = worker_subnet(241)  # a subnet of its own (other tests' servers use others)
GATEWAY = subnet_host(SUBNET, 1)
NOWHERE = "198.19.255.77"  # RFC 2544 benchmarking range: never routed

LINGER_C = r"""
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) { syscall(SYS_ptrace, 0, 0, 0, 0); sleep(2); return 0; }
"""
"""Tries ptrace once, then stays: its record can name its pid inside the sandbox."""


@pytest.fixture(scope="module")
def server(shared_layers: Path) -> Iterator[BackgroundServer]:
    home = Path(f"/tmp/dsec-audit-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    old = os.environ.get("DSEC_AUDIT_ENTRIES")
    os.environ["DSEC_AUDIT_ENTRIES"] = "16"  # a small cap, for the flood test
    try:
        with BackgroundServer(home, tiers=["container"], network_options={"subnet": SUBNET}) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("DSEC_AUDIT_ENTRIES", None)
        else:
            os.environ["DSEC_AUDIT_ENTRIES"] = old
        shutil.rmtree(home, ignore_errors=True)


def _create(server: BackgroundServer, **kw: object) -> Sandbox:
    kw.setdefault("image", "busybox")
    kw.setdefault("memory_mb", 128)
    return Sandbox.create(url=server.url, api_key=server.api_key, **kw)  # type: ignore[arg-type]


def _wait_for(sb: Sandbox, key: str, at_least: int = 1, timeout_s: float = 10.0) -> AuditReport:
    """The sandbox's audit once ``counts[key] >= at_least`` (kernel records arrive
    asynchronously, within milliseconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rep = sb.audit()
        if rep.counts.get(key, 0) >= at_least or time.monotonic() > deadline:
            return rep
        time.sleep(0.05)


def test_clean_sandbox_has_no_evidence(server: BackgroundServer) -> None:
    with _create(server) as sb:
        assert sb.commands.run("echo hi; ls / > /dev/null").ok
        rep = sb.audit()
        assert rep.enabled and not rep.evidence and rep.total == 0 and rep.entries == []
        assert rep.sources["syscall"], rep.sources  # this node listens for seccomp records


def test_refused_syscall_is_recorded_with_its_process(server: BackgroundServer) -> None:
    with _create(server) as sb:
        assert sb.commands.run("echo before").ok
        res = sb.commands.run("mount -t tmpfs none /mnt")
        assert res.exit_code != 0
        rep = _wait_for(sb, "syscall.mount")
        assert rep.evidence
        assert {k for k in rep.counts if k.startswith("syscall.")} == {"syscall.mount"}, rep
        entry = next(e for e in rep.entries if e.kind == "mount")
        assert entry.category == "syscall" and "seccomp" in entry.detail
        assert entry.comm == "mount" and entry.exe == "/bin/busybox"
        # pid inside the sandbox and command line: only while the process runs (mount is gone)
        assert entry.seq == 2  # after the second call: the one that tried
        # the other categories stay clean
        assert rep.category("files") == rep.category("network") == 0


def test_red_team_probe_leaves_evidence_of_every_refusal(
    server: BackgroundServer, tmp_path: Path
) -> None:
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(PROBE_C)
    subprocess.run(["cc", "-O1", "-static", "-o", str(exe), str(src)], check=True)
    with _create(server) as sb:
        sb.files.write("/probe", exe.read_bytes(), mode=0o755)
        res = sb.commands.run(["/probe"], env={"DSEC_PROBE_IN_SANDBOX": "1"})
        assert res.exit_code == 0, res.stderr
        # clone3's ENOSYS is a fallback every libc takes (dsec.edge.audit.FALLBACK_SYSCALLS)
        refused = sum(1 for k, v in EXPECTED.items() if v != 0 and k != "clone3")
        deadline = time.monotonic() + 10
        while (rep := sb.audit()).category("syscall") < refused and time.monotonic() < deadline:
            time.sleep(0.05)
        # one record per refused call: every one the probe met is there, none it did not
        assert rep.category("syscall") == refused, rep.counts
        assert "syscall.clone3" not in rep.counts
        for name in ("ioctl", "ptrace", "mount", "umount2", "unshare", "clone"):
            assert rep.counts.get(f"syscall.{name}", 0) >= 1, (name, rep.counts)
        assert rep.counts.get("syscall.socket", 0) == 2 and rep.counts["syscall.ioctl"] == 7
        assert all(e.comm == "probe" for e in rep.entries if e.category == "syscall")

        linger_src, linger = tmp_path / "linger.c", tmp_path / "linger"
        linger_src.write_text(LINGER_C)
        subprocess.run(["cc", "-O1", "-static", "-o", str(linger), str(linger_src)], check=True)
        sb.files.write("/linger", linger.read_bytes(), mode=0o755)
        before = rep.counts["syscall.ptrace"]
        assert sb.commands.run(["/linger", "--marker"]).ok
        last = _wait_for(sb, "syscall.ptrace", before + 1)
        entry = [e for e in last.entries if e.kind == "ptrace"][-1]
        assert entry.comm == "linger" and entry.cmdline == "/linger --marker"
        assert entry.pid is not None and entry.pid > 0  # the pid inside the sandbox


def test_files_api_refusals_are_recorded(server: BackgroundServer) -> None:
    with _create(server) as sb:
        with pytest.raises(E.PathOutsideSandbox):
            sb.files.read("/tmp/../../etc/shadow")
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w") as tf:
            member = tarfile.TarInfo("../../usr/bin/grader")
            member.size = 2
            tf.addfile(member, io.BytesIO(b"hi"))
        r = httpx.put(
            f"{server.url}/v1/sandboxes/{sb.id}/files/tar",
            params={"path": "/tmp"},
            content=evil.getvalue(),
            headers={"authorization": f"Bearer {server.api_key}"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "path_outside_sandbox"
        rep = sb.audit()
        assert rep.counts == {"files.dotdot": 1, "files.tar_member": 1}, rep.counts
        assert rep.evidence and all(e.category == "files" for e in rep.entries)
        assert "/etc/shadow" in rep.entries[0].detail


def test_network_and_dns_refusals_are_recorded(server: BackgroundServer) -> None:
    policy = NetworkPolicy(allow_cidrs=["198.18.0.1/32"])
    with _create(server, network=policy) as sb:
        sb.commands.run(f"timeout 2 wget -q -O - http://{NOWHERE}:8080/ ; true", timeout=30)
        sb.commands.run(f"timeout 2 wget -q -O - http://{GATEWAY}:9/ ; true", timeout=30)
        sb.commands.run("nslookup answers.grader.example ; true", timeout=30)
        rep = sb.audit()
        assert rep.counts.get("network.private", 0) >= 1, rep.counts  # a non-public range
        assert rep.counts.get("network.node", 0) >= 1, rep.counts  # the node's own address
        assert rep.counts.get("dns.refused", 0) >= 1, rep.counts
        dests = " ".join(e.detail for e in rep.entries if e.category == "network")
        assert f"{NOWHERE}:8080/tcp" in dests and f"{GATEWAY}:9/tcp" in dests
        assert any("answers.grader.example" in e.detail for e in rep.entries)
        # sampled: reading again adds nothing new
        again = sb.audit()
        assert again.counts == rep.counts


def test_limits_hit_are_recorded(server: BackgroundServer) -> None:
    with _create(server, memory_mb=32, pids=32) as sb:
        assert sb.commands.run("sleep 5", timeout=1).timed_out
        big = sb.commands.run("yes | head -c 100000", max_output_bytes=1000)
        assert big.truncated
        sb.commands.run("tail /dev/zero", timeout=30)  # grows until the OOM killer ends it
        sb.commands.run("for i in $(seq 60); do sleep 3 & done; wait", timeout=30)
        rep = sb.audit()
        assert rep.counts.get("limits.exec_timeout") == 1, rep.counts
        assert rep.counts.get("limits.output_cap") == 1, rep.counts
        assert rep.counts.get("limits.oom_kill", 0) >= 1, rep.counts
        assert rep.counts.get("limits.pids_max", 0) >= 1, rep.counts
        assert not rep.evidence  # limits are no attempt at a boundary
        metrics = sb.metrics()
        assert metrics.audit is not None and metrics.audit.counts == rep.counts


def test_a_full_writable_layer_is_recorded_each_time_it_fills(server: BackgroundServer) -> None:
    with _create(server, disk_mb=8) as sb:
        fill = "dd if=/dev/zero of=/tmp/fill bs=1M count=64"
        assert sb.commands.run(fill).exit_code != 0  # No space left on device
        assert sb.audit().counts.get("limits.disk_full") == 1
        assert sb.audit().counts.get("limits.disk_full") == 1  # still full: the same time
        sb.commands.run("rm /tmp/fill")
        assert sb.commands.run(fill).exit_code != 0
        rep = sb.audit()
        assert rep.counts.get("limits.disk_full") == 2, rep.counts
        assert any(e.kind == "disk_full" for e in rep.entries)
        assert not rep.evidence  # a limit, no attempt at a boundary


def test_flood_keeps_counts_exact_and_details_capped(server: BackgroundServer) -> None:
    with _create(server) as sb:
        for _ in range(100):
            with pytest.raises(E.PathOutsideSandbox):
                sb.files.read("/../x")
        loop = (
            "i=0; while [ $i -lt 300 ]; do mount -t tmpfs none /mnt 2>/dev/null; i=$((i+1)); done"
        )
        sb.commands.run(loop, timeout=120)
        rep = _wait_for(sb, "syscall.mount", at_least=300)
        assert rep.counts["files.dotdot"] == 100
        assert rep.counts["syscall.mount"] >= 300  # busybox may try more than once
        assert rep.cap == 16 and len(rep.entries) == 16
        assert rep.dropped == rep.entries[-1].id - 16
        assert [e.id for e in rep.entries[:8]] == list(range(1, 9))  # the first ones stay


def test_owner_job_summary_kill_and_trajectory(server: BackgroundServer) -> None:
    job = f"audit-{uuid.uuid4().hex[:8]}"
    clean = _create(server, job=job)
    cheat = _create(server, job=job)
    try:
        assert cheat.commands.run("echo one").ok
        cheat.commands.run("mount -t tmpfs none /mnt")
        assert cheat.commands.run("echo three").ok
        _wait_for(cheat, "syscall.mount")
        other = server.keys.create_key("audit-other")
        with pytest.raises(E.SandboxNotFound):
            Sandbox.connect(cheat.id, url=server.url, api_key=other).audit()
        assert jobs.audit(job, url=server.url, api_key=other).sandboxes == {}
        summary = jobs.audit(job, url=server.url, api_key=server.api_key)
        assert set(summary.sandboxes) == {clean.id, cheat.id}
        assert summary.flagged == [cheat.id]
        lines = cheat.trajectory().splitlines()
        kinds = [
            ("audit" if '"type":"audit"' in ln else "entry" if '"type":"entry"' in ln else "h")
            for ln in lines
        ]
        assert kinds == ["h", "entry", "entry", "audit", "entry"], lines
        info = cheat.kill()
        assert info.audit is not None and info.audit.evidence
        assert info.audit.counts == {"syscall.mount": info.audit.total}
        # after the kill: still there for the job summary
        after = jobs.audit(job, url=server.url, api_key=server.api_key)
        assert after.sandboxes[cheat.id].stopped and after.flagged == [cheat.id]
    finally:
        clean.kill()
        cheat.kill()


def test_reward_example_zeroes_the_cheating_rollout(server: BackgroundServer) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "reward_with_evidence.py"
    env = {**os.environ, "DSEC_URL": server.url, "DSEC_API_KEY": server.api_key}
    res = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cheat=True reward=0.0" in res.stdout and "flagged: ['sb-" in res.stdout


def test_follow_streams_entries_and_bad_input_is_the_callers(server: BackgroundServer) -> None:
    with _create(server) as sb:
        got: list[str] = []

        watcher = Sandbox.connect(sb.id, url=server.url, api_key=server.api_key)

        def follow() -> None:  # its own connection: sb.kill() closes sb's
            for entry in watcher.follow_audit(timeout=60):
                got.append(f"{entry.category}.{entry.kind}")

        reader = threading.Thread(target=follow)
        reader.start()
        time.sleep(0.3)
        with pytest.raises(E.PathOutsideSandbox):
            sb.files.read("/../grader/answers")
        sb.commands.run("mount -t tmpfs none /mnt")
        _wait_for(sb, "syscall.mount")
        time.sleep(0.3)
        sb.kill()  # ends the stream
        reader.join(30)
        assert not reader.is_alive() and got[:1] == ["files.dotdot"] and "syscall.mount" in got
        headers = {"authorization": f"Bearer {server.api_key}"}
        for query in ("after=-1", "after=x", "follow=maybe", f"after={2**60}"):
            r = httpx.get(f"{server.url}/v1/sandboxes/{sb.id}/audit?{query}", headers=headers)
            assert r.status_code in (400, 422), (query, r.status_code, r.text)
        r = httpx.get(f"{server.url}/v1/sandboxes/sb-nope-123/audit", headers=headers)
        assert r.status_code == 404
        r = httpx.get(f"{server.url}/v1/jobs/bad%20job/audit", headers=headers)
        assert r.status_code in (400, 404, 422)
