"""The edge's child reaper (``dsec.privileged.reaper``): orphans are reaped, nobody else's
child is.

Every scenario runs in a fresh Python process that makes itself a child subreaper (a
process-wide, irreversible setting the pytest process must not get), and reports what it
saw as JSON. No root needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from dsec.privileged.reaper import proc_stat

PRELUDE = """
import asyncio, json, os, signal, subprocess, sys, threading, time
from dsec.privileged.reaper import REAPER, become_subreaper, child_pids, proc_stat

def zombie_children():
    out = []
    for pid in child_pids():
        st = proc_stat(pid)
        if st is not None and st.state == "Z":
            out.append(pid)
    return out

def wait_until(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()

def gone(pid):
    st = proc_stat(pid)
    return st is None or st.ppid != os.getpid()
"""


def run_scenario(body: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run ``body`` after the prelude in a new interpreter; it prints one JSON object."""
    code = PRELUDE + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_orphans_in_a_descendants_group_are_reaped() -> None:
    """The crun case: a child daemonizes (its own session), forks, and exits; the grandchild
    comes back to the subreaper and, once it exits, is reaped, while the child's own exit
    status stays with the Popen that waits for it."""
    r = run_scenario(
        """
        become_subreaper()
        orphans, codes = [], []
        # the grandchild outlives the child whatever the scheduler does (a grandchild done
        # before the shell exits is reaped by the shell, never reaching the subreaper)
        orphan = "(while kill -0 $$ 2>/dev/null; do sleep 0.01; done) & echo $!; exit 7"
        for i in range(20):
            p = subprocess.Popen(
                ["sh", "-c", orphan],
                stdout=subprocess.PIPE, start_new_session=True, text=True,
            )
            orphans.append(int(p.stdout.readline()))
            codes.append(p.wait())
            p.stdout.close()
        reaped = wait_until(lambda: all(gone(o) for o in orphans))
        print(json.dumps({"codes": codes, "reaped": reaped, "zombies": zombie_children(),
                          "count": REAPER.reaped}))
        """
    )
    assert r["codes"] == [7] * 20
    assert r["reaped"], "orphaned grandchildren stayed zombies"
    assert r["zombies"] == []
    assert r["count"] >= 20


def test_other_codes_children_keep_their_exit_status() -> None:
    """While the reaper reaps a stream of orphans, subprocess (blocking and polling),
    start_new_session children left unwaited for a while, and asyncio subprocesses all get
    their children's real exit status (a waitpid(-1) reaper would hand them 0 or 255)."""
    r = run_scenario(
        """
        become_subreaper()
        REAPER.interval_s = 0.001
        REAPER.full_scan_interval_s = 0.0
        stop = threading.Event()
        bad = []

        def orphans():
            while not stop.is_set():
                subprocess.run(["sh", "-c", "true & true & exit 0"], start_new_session=True)

        def runs(code):
            for _ in range(60):
                rc = subprocess.run(["sh", "-c", f"exit {code}"]).returncode
                if rc != code:
                    bad.append(("run", code, rc))

        def leaders():
            for _ in range(15):
                p = subprocess.Popen(["sh", "-c", "exit 5"], start_new_session=True)
                time.sleep(0.05)  # exited: a zombie through several reaper passes
                if p.wait() != 5:
                    bad.append(("leader", 5, p.returncode))
                q = subprocess.Popen(["sh", "-c", "exit 6"], process_group=0)
                while q.poll() is None:
                    time.sleep(0.002)
                if q.returncode != 6:
                    bad.append(("group", 6, q.returncode))

        async def aio():
            for _ in range(30):
                p = await asyncio.create_subprocess_exec("sh", "-c", "exit 9")
                if await p.wait() != 9:
                    bad.append(("asyncio", 9, p.returncode))
                p = await asyncio.create_subprocess_exec(
                    "sh", "-c", "exit 8", start_new_session=True
                )
                if await p.wait() != 8:
                    bad.append(("asyncio-session", 8, p.returncode))

        threads = [threading.Thread(target=orphans) for _ in range(2)]
        threads += [threading.Thread(target=runs, args=(c,)) for c in (3, 4)]
        threads.append(threading.Thread(target=leaders))
        for t in threads:
            t.start()
        asyncio.run(aio())
        for t in threads[2:]:
            t.join()
        stop.set()
        for t in threads[:2]:
            t.join()
        settled = wait_until(lambda: not zombie_children())
        print(json.dumps({"bad": bad, "settled": settled, "reaped": REAPER.reaped}))
        """
    )
    assert r["bad"] == []
    assert r["settled"], "zombies left behind"
    assert r["reaped"] > 0, "the orphan stream was not reaped by the reaper"


def test_expected_orphan_group_leader_is_reaped() -> None:
    """A process that leads its own group and comes back as an orphan (a container's
    init does: crun setsid()s it) is left alone unless announced with expect(); then it is
    reaped when it exits."""
    r = run_scenario(
        """
        become_subreaper()
        code = (
            "import os, sys, time\\n"
            "r, w = os.pipe()\\n"
            "pid = os.fork()\\n"
            "if pid == 0:\\n"
            "    os.setsid(); os.close(w); os.read(r, 1); time.sleep(0.3); os._exit(0)\\n"
            "print(pid, flush=True)\\n"
            "time.sleep(0.1)\\n"
            "os._exit(0)\\n"
        )
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        leader = int(p.stdout.readline())
        p.wait(); p.stdout.close()
        wait_until(lambda: proc_stat(leader).state == "Z", 5)
        time.sleep(0.6)  # several passes: not announced, so not taken
        unannounced_left = proc_stat(leader) is not None and proc_stat(leader).state == "Z"
        REAPER.expect(leader, proc_stat(leader).start)
        # the reaper sleeps until a child exits or polls while a zombie waits: make one exit
        subprocess.run(["true"])
        reaped = wait_until(lambda: gone(leader))
        print(json.dumps({"left": unannounced_left, "reaped": reaped,
                          "expected": REAPER.expected_count()}))
        """
    )
    assert r["left"], "an unannounced group leader was reaped (its starter may wait for it)"
    assert r["reaped"]
    assert r["expected"] == 0


def test_reap_pid_is_pinned_to_the_start_time() -> None:
    """reap_pid with another process's start time (a recycled pid) leaves the zombie for
    its real owner; with the right one it reaps it."""
    r = run_scenario(
        """
        from dsec.privileged.reaper import reap_pid
        p = subprocess.Popen(["sh", "-c", "exit 4"])
        wait_until(lambda: proc_stat(p.pid).state == "Z")
        start = proc_stat(p.pid).start
        stale = reap_pid(p.pid, start + 1, timeout_s=0.2)
        still_zombie = proc_stat(p.pid) is not None and proc_stat(p.pid).state == "Z"
        code = p.wait()
        q = subprocess.Popen(["sh", "-c", "exit 0"])
        wait_until(lambda: proc_stat(q.pid).state == "Z")
        reaped = reap_pid(q.pid, proc_stat(q.pid).start, timeout_s=1.0)
        print(json.dumps({"stale": stale, "zombie": still_zombie, "code": code,
                          "reaped": reaped, "q_gone": proc_stat(q.pid) is None}))
        q.returncode = 0  # reaped above
        """
    )
    assert r["stale"] and r["zombie"] and r["code"] == 4
    assert r["reaped"] and r["q_gone"]


def test_reap_pid_with_thousands_of_fds_open() -> None:
    """A busy edge holds more than 1024 fds: reap_pid's wait works past select's limit."""
    r = run_scenario(
        """
        import resource
        from dsec.privileged.reaper import reap_pid
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        p = subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"])
        start = proc_stat(p.pid).start
        reaped = reap_pid(p.pid, start, timeout_s=5.0)
        print(json.dumps({"reaped": reaped, "gone": proc_stat(p.pid) is None,
                          "max_fd": max(held)}))
        p.returncode = 3  # reaped above
        """
    )
    assert r["max_fd"] > 1024 and r["reaped"] and r["gone"]


def test_proc_stat_parses_a_name_with_parentheses_and_spaces(tmp_path: Any) -> None:
    exe = tmp_path / "a) b ("
    exe.write_bytes(open("/bin/sleep", "rb").read())
    exe.chmod(0o755)
    p = subprocess.Popen([str(exe), "5"])
    try:
        st = proc_stat(p.pid)
        assert st is not None
        assert st.ppid == os.getpid() and st.state in "RSD"
        assert st.pgrp == os.getpgrp() and st.start > 0
    finally:
        p.kill()
        p.wait()
    assert proc_stat(p.pid) is None


def test_a_crowded_reaper_gathers_exits_into_one_pass() -> None:
    """With more announced orphans alive than ``crowd``, the exit that wakes the reaper is
    followed by ``crowd_gather_s`` before its pass: a burst of exits costs one visit of
    every child, not one per exit. Every orphan is still reaped."""
    r = run_scenario(
        """
        REAPER.crowd, REAPER.crowd_gather_s = 0, 0.4
        passes = []
        sweep = REAPER.sweep
        REAPER.sweep = lambda: passes.append(1) or sweep()
        kids = [subprocess.Popen(["sleep", "0.3"], process_group=0) for _ in range(8)]
        for kid in kids:
            REAPER.expect(kid.pid, proc_stat(kid.pid).start)
        become_subreaper()
        reaped = wait_until(lambda: all(gone(k.pid) for k in kids), 10)
        print(json.dumps({"reaped": reaped, "passes": len(passes),
                          "expected": REAPER.expected_count()}))
        """
    )
    assert r["reaped"] and r["expected"] == 0
    assert r["passes"] <= 4, r  # the first, then one or two for eight exits at once
