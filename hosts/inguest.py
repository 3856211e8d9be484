"""The host check, inside a guest of the host matrix (copied to the payload disk; run by the
image's ``dsec-hostcheck`` unit as ``python3 inguest.py /mnt/payload``).

Two stages, so that a broken dsec never loses the facts about the host:

1. under Debian's ``python3`` (standard library only): the host's facts (kernel, cgroup
   layout and controllers, kernel config), dsec installed from ``wheels/`` into the image's
   venv at ``/opt/dsec-venv`` (which has dsec's dependencies: ``hosts/image.py``), then
   stage 2 in that venv, bounded by the run's budget;
2. under the venv (``--checks``): the built-in image layers filed under the keys this dsec
   computes, ``dsec serve`` with ``DSEC_TIERS`` of the config, ``dsec doctor`` (``dsec info``
   when there is no such command), then checks through the SDK on each tier: create, exec,
   files, a memory limit, a pids limit, a CPU quota, a disk limit, pause/resume, kill,
   create-to-first-exec latency; then every sandbox killed, the server stopped, and no
   cgroup, mount, loop device or process of dsec's may be left; then, in full mode, the
   conformance suite of the checkout's tests for the same tiers (within what is left of the
   budget, at most :data:`CONFORMANCE_MAX_S`) and the leftovers again; then the tests the
   matrix was given with ``--tests`` (config ``tests``: pytest paths of the checkout, in any
   mode, within what is left of the budget) and the leftovers again.

Every check is recorded as it finishes (``out/checks.json``), with pass/fail/skip, the error
text and what was measured; a check that does not return within its time-out is recorded
as failed and the run goes on. Stage 1 writes ``out/results.json`` (facts, phases, checks)
and prints it between ``DSEC-HOSTCHECK-RESULTS-BEGIN``/``-END`` lines on the console.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

VENV = Path("/opt/dsec-venv")
HOME = Path("/var/lib/dsec")
IMAGE_CACHE = Path("/var/cache/dsec-images")
PORT = 7070
URL = f"http://127.0.0.1:{PORT}"
OWN_UNIT = "dsec-hostcheck"
"""The image's unit running this check (its cgroup and shell are not dsec's leftovers)."""
T0 = time.monotonic()
KERNEL_OPTIONS = (
    "CONFIG_MEMCG", "CONFIG_MEMCG_V1", "CONFIG_CGROUP_PIDS", "CONFIG_CFS_BANDWIDTH",
    "CONFIG_CGROUP_FREEZER", "CONFIG_EROFS_FS", "CONFIG_EROFS_FS_ZIP", "CONFIG_OVERLAY_FS",
    "CONFIG_FUSE_FS", "CONFIG_BLK_DEV_LOOP", "CONFIG_NET_9P", "CONFIG_9P_FS",
    "CONFIG_SECURITY_LANDLOCK", "CONFIG_USER_NS", "CONFIG_SECCOMP_FILTER", "CONFIG_NF_TABLES",
    "CONFIG_VETH",
)  # fmt: skip

_log_file: Path | None = None
_progress: list[str] = []
"""Where the running check is (a check that times out says where it was)."""


def say(message: str) -> None:
    """One progress line on the console (the serial log) and in ``out/guest.log``."""
    line = f"dsec-hostcheck: [{time.monotonic() - T0:7.1f} s] {message}"
    print(line, flush=True)
    if _log_file is not None:
        with contextlib.suppress(OSError), _log_file.open("a") as f:
            f.write(line + "\n")


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _read_within(path: Path, timeout_s: float = 3.0) -> str | None:
    """``path``'s text, or None when reading it blocks longer than ``timeout_s``: a process's
    ``cmdline`` waits for its mmap lock and its ``stack`` for its exec lock, which a process
    stuck in the kernel may hold for minutes (the reader thread is left behind)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(_read(path)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else None


def _run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv``; its exit code and output (stdout and stderr together), never raising."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            env=env,
            check=False,
        )
        rc: int | None = proc.returncode
        out = proc.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.output or b"").decode(errors="replace") + f"\n[timed out: {timeout_s} s]"
    except OSError as e:
        rc, out = None, f"[cannot run {argv[0]}: {e}]"
    return {"argv": argv, "rc": rc, "output": out, "seconds": round(time.monotonic() - t0, 1)}


# --- stage 1: facts and installation (standard library only) ---------------------------------


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, fs type, source, super options) of every mount."""
    rows = []
    text = _read_within(Path("/proc/self/mountinfo"), 60)
    if text is None:  # the namespace's lock held by a stuck (u)mount, or a huge mount table
        raise CheckFailed("/proc/self/mountinfo not read within 60 s: a (u)mount is stuck")
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) >= 5 and len(rparts) >= 2:
            rows.append((parts[4], rparts[0], rparts[1], rparts[2] if len(rparts) > 2 else ""))
    return rows


def mount_stats(timeout_s: float = 60, pid: int | str = "self") -> dict[str, Any]:
    """How big the mount table of ``pid``'s namespace is, how long it took to read, how many
    mounts propagate (``shared:``) and how many are under dsec's home: a table that grows
    with every sandbox is a propagation leak (systemd makes ``/`` shared; a bare container
    host has it private)."""
    t0 = time.monotonic()
    progress = {"lines": 0}
    chunks: list[str] = []

    def read() -> None:  # in pieces, counting: a huge table still says how far it got
        with open(f"/proc/{pid}/mountinfo", errors="replace") as f:
            while chunk := f.read(1 << 20):
                chunks.append(chunk)
                progress["lines"] += chunk.count("\n")
        progress["done"] = 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not progress.get("done"):
        return {
            "error": f"/proc/self/mountinfo not read within {timeout_s:.0f} s",
            "lines_read_so_far": progress["lines"],
        }
    lines = "".join(chunks).splitlines()
    root = next((ln.split(" - ")[0].split()[6:] for ln in lines if ln.split()[4:5] == ["/"]), [])
    return {
        "mounts": len(lines),
        "shared": sum(" shared:" in ln.split(" - ")[0] for ln in lines),
        "under_dsec_home": sum(ln.split()[4].startswith(str(HOME)) for ln in lines),
        "root_propagation": " ".join(root) or "private",
        "read_s": round(time.monotonic() - t0, 2),
    }


def cgroup_facts() -> dict[str, Any]:
    """The cgroup layout the guest booted with: ``v2`` (unified), ``hybrid`` (v1 controllers
    and systemd's v2 tree) or ``v1``; the controllers each hierarchy has."""
    mounts = _mounts()
    v2 = [m for m in mounts if m[1] == "cgroup2"]
    v1 = [m for m in mounts if m[1] == "cgroup"]
    if any(m[0] == "/sys/fs/cgroup" for m in v2):
        layout = "v2"
    elif v1 and v2:
        layout = "hybrid"
    elif v1:
        layout = "v1"
    else:
        layout = "none"
    v1_controllers = sorted(
        c
        for m in v1
        for c in m[3].split(",")
        if c in {"cpu", "cpuacct", "memory", "pids", "freezer", "cpuset", "blkio", "io", "devices"}
    )
    v2_controllers = ""
    for m in v2:
        v2_controllers = _read(Path(m[0]) / "cgroup.controllers").strip() or v2_controllers
    enabled = [
        line.split()[0]
        for line in _read("/proc/cgroups").splitlines()[1:]
        if len(line.split()) >= 4 and line.split()[3] == "1"
    ]
    return {
        "layout": layout,
        "v1_mounts": [m[0] for m in v1],
        "v1_controllers": v1_controllers,
        "v2_mounts": [m[0] for m in v2],
        "v2_controllers": v2_controllers.split(),
        "proc_cgroups_enabled": enabled,
    }


def facts() -> dict[str, Any]:
    """What the host is: kernel, cgroups, kernel options, user space versions."""
    release = os.uname().release
    config = _read(f"/boot/config-{release}")
    options = {}
    for name in KERNEL_OPTIONS:
        m = re.search(rf"^{name}=(\S+)$", config, re.M)
        options[name] = m.group(1) if m else "n"
    first = {
        cmd[0]: (_run(cmd, 30)["output"].strip().splitlines() or [""])[0]
        for cmd in (["systemctl", "--version"], ["crun", "--version"], ["runc", "--version"])
    }
    os_release = dict(
        line.split("=", 1) for line in _read("/etc/os-release").splitlines() if "=" in line
    )
    meminfo = _read("/proc/meminfo").split()
    return {
        "kernel": release,
        "kernel_version": _read("/proc/version").strip(),
        "cmdline": _read("/proc/cmdline").strip(),
        "os": os_release.get("PRETTY_NAME", "").strip('"'),
        "python": sys.version.split()[0],
        "cgroup": cgroup_facts(),
        "mount_table": mount_stats(),
        "kernel_config": options,
        "systemd": first["systemctl"],
        "crun": first["crun"],
        "runc": first["runc"],
        "cpus": os.cpu_count(),
        "memory_kb": int(meminfo[1]) if len(meminfo) > 1 else None,
    }


def install(payload: Path, out: Path) -> str | None:
    """dsec from the payload's wheel into the image's venv (which has its dependencies);
    None, or why it failed."""
    if not (VENV / "bin/python").exists():
        return f"the image has no venv at {VENV}"
    r = _run(
        [
            str(VENV / "bin/pip"), "install", "-q", "--disable-pip-version-check", "--no-index",
            "--no-deps", "--find-links", str(payload / "wheels"), "dsec",
        ],
        1800,
    )  # fmt: skip
    (out / "pip.log").write_text(r["output"])
    if r["rc"] != 0:
        return f"pip install failed (exit {r['rc']}):\n{_tail(r['output'])}"
    return None


def _kill_group_of(pid_file: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def stage1(payload: Path) -> int:
    global _log_file
    out = payload / "out"
    out.mkdir(exist_ok=True)
    _log_file = out / "guest.log"
    config = json.loads((payload / "config.json").read_text())
    results: dict[str, Any] = {"host": config["host"], "mode": config["mode"], "phases": {}}
    say(f"host {config['host']['name']}: collecting facts")
    try:
        results["facts"] = facts()
    except Exception:
        results["facts"] = {"error": traceback.format_exc()}
    say(f"kernel {os.uname().release}, cgroup {results['facts'].get('cgroup', {})}")
    results["phases"]["boot_s"] = round(float(_read("/proc/uptime").split()[0]), 1)

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))

    save()
    say("installing dsec into a venv from the payload's wheels")
    t0 = time.monotonic()
    error = install(payload, out)
    results["phases"]["install_s"] = round(time.monotonic() - t0, 1)
    if error is not None:
        results["error"] = error
        say(error)
    else:
        budget = float(config.get("budget_s", 3600)) - (time.monotonic() - T0)
        say(f"installed in {results['phases']['install_s']} s; checks (budget {budget:.0f} s)")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [str(VENV / "bin/python"), "-u", __file__, "--checks", str(payload)],
                stdin=subprocess.DEVNULL,
                timeout=max(budget, 60),
                env={**os.environ, "HOSTCHECK_DEADLINE": str(time.time() + max(budget, 60))},
                check=False,
            )
            if proc.returncode != 0:
                results["error"] = f"the checks' process exited with code {proc.returncode}"
        except subprocess.TimeoutExpired:
            results["error"] = f"the checks did not finish within the budget ({budget:.0f} s)"
            _kill_group_of(out / "serve.pid")
        results["phases"]["checks_s"] = round(time.monotonic() - t0, 1)
    try:
        results.update(json.loads((out / "checks.json").read_text()))
    except (OSError, ValueError) as e:
        results.setdefault("error", f"no checks.json from the checks: {e}")
    results["phases"]["guest_total_s"] = round(time.monotonic() - T0, 1)
    (out / "dmesg.log").write_text(_run(["dmesg"], 60)["output"])
    save()
    print("DSEC-HOSTCHECK-RESULTS-BEGIN", flush=True)
    print(json.dumps(results), flush=True)
    print("DSEC-HOSTCHECK-RESULTS-END", flush=True)
    return 0


# --- stage 2: dsec itself (in the venv) ------------------------------------------------------


class CheckFailed(Exception):
    """A check saw dsec misbehave; ``detail`` is what it measured."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}


class Skipped(Exception):
    """A check that does not apply (the tier lacks the ability)."""


class Recorder:
    """The checks' results, saved to ``out/checks.json`` after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"checks": []}
        self.lock = threading.Lock()

    def save(self) -> None:
        with self.lock:
            text = json.dumps(self.data, indent=1, default=str)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def set(self, key: str, value: Any) -> None:
        with self.lock:
            self.data[key] = value
        self.save()

    def check(
        self, name: str, fn: Callable[[], dict[str, Any] | None], timeout_s: float = 300
    ) -> bool:
        """Run ``fn`` (a check) with a time-out and record what came of it; True if it passed.

        ``fn`` returns what it measured, raises :class:`CheckFailed`, :class:`Skipped` or any
        other exception (a failure with its type and message)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["detail"] = fn() or {}
            except BaseException as e:
                box["error"] = e

        t0 = time.monotonic()
        _progress.clear()
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        thread.join(timeout_s)
        entry: dict[str, Any] = {"name": name, "seconds": round(time.monotonic() - t0, 1)}
        err = box.get("error")
        if thread.is_alive():
            where = f", in {_progress[-1]}" if _progress else ""
            entry.update(
                ok=False, error=f"timed out after {timeout_s:.0f} s (the call hung{where})"
            )
        elif err is None:
            entry.update(ok=True, detail=box.get("detail", {}))
        elif isinstance(err, Skipped):
            entry.update(ok=None, error=f"skipped: {err}")
        elif isinstance(err, CheckFailed):
            entry.update(ok=False, error=str(err), detail=err.detail)
        else:
            text = f"{type(err).__name__}: {err}"
            entry.update(
                ok=False, error=text, trace=_tail("".join(traceback.format_exception(err)), 12)
            )
        with self.lock:
            self.data["checks"].append(entry)
        self.save()
        verdict = {True: "ok", False: "FAILED", None: "skipped"}[entry["ok"]]
        say(f"check {name}: {verdict} ({entry['seconds']} s) {entry.get('error', '')}"[:600])
        return entry["ok"] is True


def _file_layers(config: dict[str, Any], rec: Recorder, payload: Path) -> None:
    """Put the payload's layers where this dsec's built-in cache looks for them, under the
    key this dsec computes (the host's key may come from a different source of the recipe)."""
    from dsec.layers import builtin
    from dsec.layers.builtin_cache import BuiltinCache

    def file_them() -> dict[str, Any]:
        IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
        cache = BuiltinCache(IMAGE_CACHE)
        filed = {}
        for name, info in config["layers"].items():
            recipe = builtin.BUILTIN_IMAGES[name]
            key = cache.key(recipe, {**recipe.meta, "builtin": name})
            if key is None:
                raise CheckFailed(f"dsec gives the built-in image {name} no cache key")
            dest = IMAGE_CACHE / f"{name}-{key}-{info['sha256']}.erofs"
            if not dest.exists():
                shutil.copyfile(payload / info["file"], dest)
                dest.chmod(0o444)
            filed[name] = dest.name
        for name, info in config.get("toolkits", {}).items():  # named as the host's cache did
            dest = IMAGE_CACHE / Path(info["file"]).name
            if not dest.exists():
                shutil.copyfile(payload / info["file"], dest)
                dest.chmod(0o444)
            filed[f"toolkit-{name}"] = dest.name
        return filed

    rec.check("images.filed", file_them, 600)


class Serve:
    """``dsec serve`` as a child process (its own session: its helpers die with the group)."""

    def __init__(self, env: dict[str, str], out: Path) -> None:
        self.env = env
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> dict[str, Any]:
        from dsec import Client

        log = (self.out / "serve.log").open("ab")
        self.proc = subprocess.Popen(
            [str(VENV / "bin/dsec"), "serve", "--port", str(PORT)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        (self.out / "serve.pid").write_text(str(self.proc.pid))
        t0 = time.monotonic()
        last = ""
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise CheckFailed(
                    f"dsec serve exited with code {rc}:\n{_tail(_read(self.out / 'serve.log'), 25)}"
                )
            try:
                with Client(URL, timeout=10) as client:
                    info = client.node_info()
                return {"ready_s": round(time.monotonic() - t0, 1), "node": info.node}
            except Exception as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(1)
            if time.monotonic() - t0 > 900:
                raise CheckFailed(f"dsec serve not answering after 900 s (last: {last})")

    def stop(self) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            rc = None if self.proc is None else self.proc.returncode
            raise CheckFailed(f"dsec serve was not running at the end (exit code {rc})")
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            detail = {
                "threads": _threads(self.proc.pid),
                "children": [_describe(p) for p in _processes() if p["ppid"] == self.proc.pid],
                "log_tail": _tail(_read(self.out / "serve.log"), 8),
            }
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            raise CheckFailed(
                "dsec serve did not exit within 120 s of SIGTERM (killed)", detail
            ) from None
        # what its session left running (helpers that should have ended with it)
        time.sleep(2)
        left = _session_processes(self.proc.pid)
        if left:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            raise CheckFailed(
                f"dsec serve exited ({rc}) but processes of its session remain", {"left": left}
            )
        return {"exit_code": rc}


def _processes() -> list[dict[str, Any]]:
    """Every process: pid, ppid, session, state, comm, its command line and, for one in
    uninterruptible sleep (``D``), where it waits in the kernel. What cannot be read within
    a few seconds (the process holds the lock the read needs) is marked so."""
    procs = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        stat = _read_within(proc / "stat") or ""
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 4:
            continue
        p: dict[str, Any] = {
            "pid": int(proc.name),
            "state": fields[0],
            "ppid": int(fields[1]),
            "sid": int(fields[3]),
            "comm": comm,
        }
        cmdline = _read_within(proc / "cmdline")
        if cmdline is None:
            p["cmdline"] = f"[{comm}: cmdline unreadable, its mmap lock held > 3 s]"
        else:
            p["cmdline"] = cmdline.replace("\0", " ").strip() or f"[{comm}]"
        if fields[0] == "D":
            p["wchan"] = _read_within(proc / "wchan") or "?"
            stack = _read_within(proc / "stack")
            p["stack"] = (
                [line.split()[-1] for line in stack.splitlines() if line.split()][:12]
                if stack is not None
                else ["(stack unreadable: its exec lock held > 3 s)"]
            )
        procs.append(p)
    return procs


def _describe(p: dict[str, Any]) -> str:
    text = f"{p['pid']} {p['state']} {p['cmdline']}"[:200]
    if p["state"] == "D":
        text += f" (stuck in {p.get('wchan') or '?'}: {' < '.join(p.get('stack', []))})"
    return text


def _threads(pid: int) -> list[str]:
    """Each thread of ``pid``: name, state, where it waits in the kernel."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        stat = _read_within(task / "stat") or ""
        state = stat.rpartition(")")[2].split()[:1]
        text = _read_within(task / "stack")
        text = "(stack unreadable)" if text is None else text
        stack = [line.split()[-1] for line in text.splitlines() if line.split()][:6]
        name = (_read_within(task / "comm") or "?").strip()
        out.append(f"{task.name} {name} {''.join(state)} {' < '.join(stack)}"[:300])
    return out


def snapshot() -> list[str]:
    """Every user-space process (kernel threads left out): pid, state, command line, and
    where it waits in the kernel (``wchan``) when it is not running: the evidence of a
    hang."""
    lines = []
    for p in _processes():
        if p["ppid"] == 2 or p["pid"] == 2:
            continue
        if p["state"] not in ("R",):
            p.setdefault("wchan", _read_within(Path(f"/proc/{p['pid']}/wchan"), 1) or "?")
        lines.append(f"{_describe(p)} wchan={p.get('wchan', '-')}"[:300])
    # a mount namespace over fs.mount-max makes mount(2) answer ENOSPC: how full is ours
    stats = mount_stats(30)
    mounts = stats.get("mounts", f">= {stats.get('lines_read_so_far', '?')}")
    limit = (_read_within(Path("/proc/sys/fs/mount-max"), 1) or "?").strip()
    return [f"mounts in this namespace: {mounts} (fs.mount-max {limit}): {stats}", *lines[:80]]


def _session_processes(sid: int) -> list[str]:
    return [_describe(p) for p in _processes() if p["sid"] == sid]


def leftovers() -> dict[str, Any]:
    """What of dsec's is still on the host: cgroups named ``dsec*``, mounts under its home or
    naming dsec, loop devices, processes whose command line names dsec, crun or runc, and
    any process stuck in the kernel (``D``: with where it waits)."""
    cgroups: list[str] = []
    mounts: list[str] = []
    _progress.append("leftovers: the mount table")
    t0 = time.monotonic()
    try:
        table = _mounts()
    except CheckFailed as e:  # still look at the processes: the one stuck in a (u)mount
        table, mounts = [], [str(e)]
    read_s = time.monotonic() - t0
    if read_s > 5:
        mounts.append(f"(the mount table took {read_s:.0f} s to read: {len(table)} mounts)")
    _progress.append("leftovers: cgroups")
    for point, fstype, _src, _opts in table:
        if fstype not in ("cgroup", "cgroup2"):
            continue
        for root, dirs, _files in os.walk(point):
            depth = root[len(point) :].count("/")
            for d in dirs:
                if d.startswith("dsec") and not d.startswith(OWN_UNIT):
                    cgroups.append(os.path.join(root, d))
            if depth >= 4:
                dirs[:] = []
            else:
                dirs[:] = [d for d in dirs if not d.startswith("dsec")]
    mounts += [
        f"{point} ({fstype} {src})"
        for point, fstype, src, _opts in table
        if (point.startswith(str(HOME)) or "dsec" in point or "dsec" in src)
        and not point.startswith("/mnt/payload")
    ]
    loops = []
    _progress.append("leftovers: loop devices")
    for dev in sorted(Path("/sys/block").glob("loop*")):
        text = _read_within(dev / "loop/backing_file")
        backing = "(backing_file unreadable: blocked > 3 s)" if text is None else text.strip()
        if backing:
            loops.append(f"/dev/{dev.name} -> {backing}")
    me = {os.getpid(), os.getppid()}
    procs, stuck = [], []
    _progress.append("leftovers: processes")
    for p in _processes():
        if p["pid"] in me:
            continue
        if p["state"] == "D" or "unreadable" in p["cmdline"]:
            stuck.append(_describe(p))
        elif re.search(r"dsec|\bcrun\b|\brunc\b|fncall", p["cmdline"]) and not re.search(
            rf"inguest\.py|/{OWN_UNIT}\b", p["cmdline"]
        ):
            procs.append(_describe(p))
    return {
        "cgroups": cgroups,
        "mounts": mounts,
        "loop_devices": loops,
        "processes": procs,
        "stuck_processes": stuck,
    }


# --- the checks on one tier ---


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 1)


class TierChecks:
    """The checks of one tier, through the public SDK."""

    def __init__(self, tier: str, image: str, caps: Any, rec: Recorder) -> None:
        self.tier = tier
        self.image = image
        self.caps = caps
        self.rec = rec
        self.made: list[Any] = []

    def create(self, timeout: float = 600, **kw: Any) -> Any:
        from dsec import Sandbox

        kw.setdefault("memory_mb", 256)
        sb = Sandbox.create(tier=self.tier, image=self.image, ttl_s=1800, timeout=timeout, **kw)
        self.made.append(sb)
        return sb

    def run(self, sb: Any, cmd: str, timeout: float = 120) -> Any:
        return sb.commands.run(cmd, timeout=timeout)

    @staticmethod
    def _result(r: Any) -> dict[str, Any]:
        return {
            "exit_code": r.exit_code,
            "signal": r.signal,
            "oom_killed": r.oom_killed,
            "timed_out": r.timed_out,
            "stdout": r.stdout[-400:],
            "stderr": r.stderr[-400:],
        }

    def all(self, mode: str) -> None:
        t = self.tier
        box: dict[str, Any] = {}

        def create() -> dict[str, Any]:
            t0 = time.monotonic()
            box["sb"] = self.create()
            info = box["sb"].refresh()
            if info.state != "running":
                raise CheckFailed(f"state {info.state} after create, not running")
            return {"seconds": round(time.monotonic() - t0, 2), "id": box["sb"].id}

        names = ["exec", "files", "memory", "pause_resume", "kill", "mounts"]
        if mode == "full":
            names[3:3] = ["pids", "cpu", "disk"]
            names.append("latency")
        if not self.rec.check(f"{t}.create", create, 900):
            for name in names:  # each would fail as create did: not worth the guest's time
                self.rec.check(f"{t}.{name}", _skip("no sandbox: create failed"))
            return
        sb = box["sb"]
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "exec": lambda: self.exec(sb),
            "files": lambda: self.files(sb),
            "memory": self.memory,
            "pids": self.pids,
            "cpu": self.cpu,
            "disk": self.disk,
            "pause_resume": lambda: self.pause_resume(sb),
            "kill": lambda: self.kill(sb),
            "latency": self.latency,
            "mounts": self.mounts,
        }
        try:
            for name in names:
                self.rec.check(f"{t}.{name}", steps[name], 1800 if name == "latency" else 300)
        finally:
            self.kill_all()

    def exec(self, sb: Any) -> dict[str, Any]:
        r = self.run(sb, "echo hi")
        if r.stdout != "hi\n" or r.exit_code != 0:
            raise CheckFailed(f"echo hi gave {r.stdout!r} (exit {r.exit_code})", self._result(r))
        return {"duration_ms": r.duration_ms}

    def files(self, sb: Any) -> dict[str, Any]:
        text = "dsec host matrix\n" * 64
        sb.files.write("/tmp/dsec-hostcheck.txt", text)
        got = sb.files.read_text("/tmp/dsec-hostcheck.txt")
        if got != text:
            raise CheckFailed(f"read back {len(got)} chars, not the {len(text)} written")
        r = self.run(sb, "wc -c < /tmp/dsec-hostcheck.txt")
        if r.stdout.strip() != str(len(text)):
            raise CheckFailed(f"the sandbox sees {r.stdout.strip()!r} bytes", self._result(r))
        return {}

    def memory(self) -> dict[str, Any]:
        """A command touching 400 MiB in a 128 MiB sandbox is OOM-killed and says so."""
        sb = self.create(memory_mb=128)
        r = self.run(sb, "dd if=/dev/zero of=/dev/null bs=400M count=1", timeout=300)
        detail = self._result(r)
        with contextlib.suppress(Exception):
            sb.kill()
        if r.exit_code == 0:
            raise CheckFailed("dd with a 400 MiB buffer succeeded in a 128 MiB sandbox", detail)
        if not r.oom_killed:
            raise CheckFailed(
                f"dd failed (exit {r.exit_code}, signal {r.signal}) but oom_killed is false",
                detail,
            )
        return detail

    def pids(self) -> dict[str, Any]:
        """A fork loop in a ``pids=32`` sandbox stops at the limit."""
        sb = self.create(pids=32)
        script = (
            "import os, signal, time\n"
            "kids, err = [], ''\n"
            "try:\n"
            "    for _ in range(300):\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            time.sleep(60)\n"
            "            os._exit(0)\n"
            "        kids.append(pid)\n"
            "except OSError as e:\n"
            "    err = str(e)\n"
            "for pid in kids:\n"
            "    os.kill(pid, signal.SIGKILL)\n"
            "print(len(kids), err)\n"
        )
        sb.files.write("/tmp/forks.py", script)
        r = self.run(sb, "python3 /tmp/forks.py", timeout=300)
        detail = self._result(r)
        with contextlib.suppress(Exception):
            sb.kill()
        words = r.stdout.split(maxsplit=1)
        if not words or not words[0].isdigit():
            raise CheckFailed(f"the fork loop printed {r.stdout!r}", detail)
        forked = int(words[0])
        detail["forked"] = forked
        if forked >= 300:
            raise CheckFailed("300 processes forked in a pids=32 sandbox", detail)
        if forked > 32:
            raise CheckFailed(f"{forked} processes forked in a pids=32 sandbox", detail)
        return detail

    def cpu(self) -> dict[str, Any]:
        """A busy loop in a ``cpu=0.5`` sandbox gets about half a core: its CPU time over
        wall time (3 s), against the same loop outside any sandbox."""
        script = (
            "import os, time\n"
            "t = time.monotonic()\n"
            "while time.monotonic() - t < 3:\n"
            "    pass\n"
            "c = os.times()\n"
            "print(c.user + c.system, time.monotonic() - t)\n"
        )
        ref = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
        )
        cpu_s, wall_s = (float(x) for x in ref.stdout.split())
        baseline = cpu_s / wall_s
        sb = self.create(cpu=0.5)
        sb.files.write("/tmp/busy.py", script)
        r = self.run(sb, "python3 /tmp/busy.py", timeout=300)
        detail = self._result(r)
        with contextlib.suppress(Exception):
            sb.kill()
        try:
            cpu_s, wall_s = (float(x) for x in r.stdout.split())
        except ValueError:
            raise CheckFailed(f"the busy loop printed {r.stdout!r}", detail) from None
        share = cpu_s / wall_s
        detail.update(share=round(share, 3), unlimited_share=round(baseline, 3))
        if share > 0.65:
            raise CheckFailed(f"a cpu=0.5 sandbox got {share:.2f} of a core", detail)
        if share < 0.35 * baseline:
            raise CheckFailed(
                f"a cpu=0.5 sandbox got {share:.2f} of a core (unlimited: {baseline:.2f})", detail
            )
        return detail

    def disk(self) -> dict[str, Any]:
        """Writing 64 MiB into a ``disk_mb=32`` sandbox fails."""
        sb = self.create(disk_mb=32, memory_mb=512)
        r = self.run(
            sb,
            "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?; wc -c < /tmp/fill",
            timeout=300,
        )
        detail = self._result(r)
        with contextlib.suppress(Exception):
            sb.kill()
        m = re.search(r"rc=(\d+)\s+(\d+)", r.stdout)
        if not m:
            raise CheckFailed(f"the write printed {r.stdout[-300:]!r}", detail)
        rc, size = int(m.group(1)), int(m.group(2))
        detail["written_bytes"] = size
        if rc == 0 or size > 40 << 20:
            raise CheckFailed(
                f"wrote {size >> 20} MiB into a disk_mb=32 sandbox (dd exit {rc})", detail
            )
        return detail

    def pause_resume(self, sb: Any) -> dict[str, Any]:
        if not self.caps.pause:
            raise Skipped(f"tier {self.tier} has no pause")
        self.run(sb, "echo before > /tmp/state")
        t0 = time.monotonic()
        sb.pause()
        state = sb.refresh().state
        paused_s = time.monotonic() - t0
        if state != "paused":
            raise CheckFailed(f"state {state} after pause")
        t0 = time.monotonic()
        sb.resume()
        state = sb.refresh().state
        if state != "running":
            raise CheckFailed(f"state {state} after resume")
        r = self.run(sb, "cat /tmp/state")
        if r.stdout != "before\n":
            raise CheckFailed(f"after resume the file holds {r.stdout!r}", self._result(r))
        return {"pause_s": round(paused_s, 2), "resume_s": round(time.monotonic() - t0, 2)}

    def kill(self, sb: Any) -> dict[str, Any]:
        from dsec.errors import SandboxNotFound, SandboxStopped

        sb.kill()
        try:
            state = sb.refresh().state
        except (SandboxNotFound, SandboxStopped):
            return {"state": "gone"}
        if state != "stopped":
            raise CheckFailed(f"state {state} after kill")
        return {"state": state}

    def latency(self) -> dict[str, Any]:
        """Create then first exec, ten times: the median (and each) in ms; a failed one is
        counted (the median is over those that worked), and a creation is given 120 s."""
        times: list[float] = []
        errors: list[str] = []
        first_snapshot: list[str] = []
        for _ in range(10):
            t0 = time.monotonic()
            try:
                sb = self.create(timeout=120)
                r = self.run(sb, "true")
                if r.exit_code != 0:
                    raise CheckFailed(f"`true` exited {r.exit_code}: {r.stderr[-200:]}")
                times.append((time.monotonic() - t0) * 1000)
                sb.kill()
            except Exception as e:
                errors.append(f"after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
                if not first_snapshot:  # the node as the first failure left it
                    first_snapshot = snapshot()
        detail = {
            "p50_ms": _p50(times) if times else None,
            "all_ms": [round(t) for t in times],
            "errors": errors,
            "processes_at_first_error": first_snapshot,
        }
        if errors:
            raise CheckFailed(f"{len(errors)} of 10 creations failed: {errors[0]}", detail)
        return detail

    def mounts(self) -> dict[str, Any]:
        """The mount tables (the host's, and that of ``dsec serve``'s own namespace) do not
        grow with the sandboxes created: five created and killed one after another leave
        them as they were, and each live one adds a bounded number of mounts (its root and
        upper; a layer's mount is shared). A table that grows with every creation ends in
        ENOSPC from mount(2) (fs.mount-max) for every new container."""
        out = _log_file.parent if _log_file is not None else Path("/tmp")
        server = int((out / "serve.pid").read_text())
        tables = {"host": "self", "server": str(server)}
        seen: dict[str, list[int]] = {name: [] for name in tables}

        def count(tag: str) -> dict[str, int]:
            now = {}
            for name, pid in tables.items():
                stats = mount_stats(60, pid)
                if "mounts" not in stats:
                    raise CheckFailed(f"{name} {tag}: {stats.get('error')}", {**seen, **stats})
                with contextlib.suppress(OSError):
                    text = Path(f"/proc/{pid}/mountinfo").read_text(errors="replace")
                    (out / f"mountinfo-{self.tier}-{name}-{tag}.txt").write_text(text[: 4 << 20])
                now[name] = int(stats["mounts"])
                seen[name].append(now[name])
            return now

        base = count("before")
        live: dict[str, list[int]] = {name: [] for name in tables}
        for i in range(5):
            sb = self.create()
            self.run(sb, "true")
            for name, n in count(f"live{i}").items():
                live[name].append(n - base[name])
            sb.kill()
            count(f"after{i}")
        deadline = time.monotonic() + 30  # a kill answers before its teardown has finished
        while time.monotonic() < deadline and any(seen[n][-1] > base[n] for n in tables):
            time.sleep(1)
            count("settled")
        detail = {"before": base, "counts": seen, "added_while_live": live}
        for name in tables:
            if seen[name][-1] > base[name] or max(live[name]) > 8:
                raise CheckFailed(
                    f"the {name}'s mount table grew: {seen[name]} (before, then live and "
                    f"after each of 5 sandboxes)",
                    detail,
                )
        return detail

    def kill_all(self) -> None:
        for sb in self.made:
            with contextlib.suppress(Exception):
                sb.kill()


def _skip(why: str) -> Callable[[], dict[str, Any]]:
    def fn() -> dict[str, Any]:
        raise Skipped(why)

    return fn


def _kill_every_sandbox() -> dict[str, Any]:
    from dsec import Sandbox

    killed = []
    for info in Sandbox.list():
        with contextlib.suppress(Exception):
            Sandbox.connect(info.id).kill()
            killed.append(info.id)
    return {"killed": killed}


def _doctor(env: dict[str, str], rec: Recorder) -> None:
    """``dsec doctor`` verbatim, or, when this dsec has no such command, ``dsec info``."""
    dsec = str(VENV / "bin/dsec")
    r = _run([dsec, "doctor"], 600, env)
    missing = r["rc"] == 2 and "No such command" in r["output"]
    rec.set("doctor", {"command": "dsec doctor", "missing": missing, **r})
    info = _run([dsec, "info", "--output", "wide"], 120, env)
    if info["rc"] != 0:
        info = _run([dsec, "info"], 120, env)
    rec.set("info", {"command": "dsec info", **info})
    say("dsec doctor: " + ("no such command" if missing else f"exit {r['rc']}"))
    for line in (r["output"] if not missing else info["output"]).splitlines()[:40]:
        say(f"  | {line}")


CONFORMANCE_MAX_S = 1200
"""The most the conformance suite gets (less when the run's budget has less left)."""
TESTS_SLOWNESS = "8"
"""``DSEC_TEST_SLOWNESS`` for tests chosen with ``--tests``: their waits are written for
this machine at full speed, and guest code under TCG runs ~10x slower (8 is the most
``tests/timing.py`` allows)."""


def _conformance(payload: Path, env: dict[str, str], tiers: list[str], rec: Recorder) -> None:
    """The checkout's conformance suite for ``tiers``, in its own in-process server, its
    output streamed to ``out/conformance.log``; bounded by what is left of the budget."""
    # pytest-timeout's limits (300 s by default) stretched x2 (tests/timing.py)
    selection = ["tests/conformance", "-k", " or ".join(tiers)]
    _pytest(payload, env, "conformance", selection, "2", CONFORMANCE_MAX_S, rec)


def _tests(payload: Path, env: dict[str, str], paths: list[str], rec: Recorder) -> None:
    """The checkout's tests ``paths`` (files, directories or node ids, as the matrix's
    ``--tests`` gave them), output in ``out/tests.log``; bounded by what is left of the
    budget, and failed when any of them failed, errored or was skipped for want of a tier."""
    _pytest(payload, env, "tests", paths, TESTS_SLOWNESS, None, rec)


def _pytest(
    payload: Path,
    env: dict[str, str],
    name: str,
    selection: list[str],
    slowness: str,
    max_s: float | None,
    rec: Recorder,
) -> None:
    """pytest over ``selection`` in the payload's tree, recorded as check ``name`` with
    its counts (junit report ``out/<name>.xml``, output ``out/<name>.log``); at most
    ``max_s`` seconds (None: what is left of the run's budget)."""
    out = payload / "out"
    xml = out / f"{name}.xml"
    deadline = float(os.environ.get("HOSTCHECK_DEADLINE") or time.time() + (max_s or 3600))
    limit_s = deadline - time.time() - 180
    if max_s is not None:
        limit_s = min(max_s, limit_s)
    if limit_s < 120:
        rec.check(name, _skip(f"no time left in the run's budget ({limit_s:.0f} s)"))
        return

    def run() -> dict[str, Any]:
        argv = [
            str(VENV / "bin/python"), "-m", "pytest", *selection, "-q", "-rfs",
            "-p", "no:cacheprovider", f"--junitxml={xml}",
        ]  # fmt: skip
        test_env = {**env, "DSEC_TEST_WARM": "0", "DSEC_TEST_SLOWNESS": slowness, "PYTHONPATH": "."}
        with (out / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=payload / "tree",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=test_env,
                start_new_session=True,
            )
            try:
                rc: int | None = proc.wait(limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)
                rc = None
        output = _read(out / f"{name}.log")
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        failures = []
        skips: dict[str, int] = {}
        try:
            for case in ET.parse(xml).getroot().iter("testcase"):
                bad = case.find("failure")
                if bad is None:
                    bad = case.find("error")
                if bad is not None:
                    counts["failed" if bad.tag == "failure" else "errors"] += 1
                    msg = (bad.get("message") or "").splitlines()[:1]
                    failures.append(f"{case.get('name')}: {msg[0] if msg else ''}"[:300])
                elif (skip := case.find("skipped")) is not None:
                    counts["skipped"] += 1
                    why = (skip.get("message") or "?").splitlines()[0][:400]
                    skips[why] = skips.get(why, 0) + 1
                else:
                    counts["passed"] += 1
        except (OSError, ET.ParseError) as e:
            ran = len(re.findall(r"^tests/\S+ |PASSED|FAILED", output, re.M))
            why = f"killed after {limit_s:.0f} s" if rc is None else f"pytest exit {rc}"
            raise CheckFailed(
                f"no junit report ({why}; {e}):\n{_tail(output)}", {"output_lines": ran}
            ) from None
        detail = {**counts, "exit_code": rc, "failures": failures[:40], "skips": skips}
        unavailable = sum(
            n for why, n in skips.items() if "unavailable" in why or "not enabled" in why
        )
        if counts["failed"] or counts["errors"] or unavailable or rc not in (0, 5):
            raise CheckFailed(
                f"{counts['failed']} failed, {counts['errors']} errors, {unavailable} skipped as "
                f"their tier was unavailable, {counts['passed']} passed (pytest exit {rc})",
                detail,
            )
        return detail

    rec.check(name, run, limit_s + 120)


def stage2(payload: Path) -> int:
    global _log_file
    out = payload / "out"
    _log_file = out / "guest.log"
    config = json.loads((payload / "config.json").read_text())
    rec = Recorder(out / "checks.json")
    tiers: list[str] = config["tiers"]
    env = {
        **os.environ,
        "DSEC_HOME": str(HOME),
        "DSEC_URL": URL,
        "DSEC_TIERS": ",".join(tiers),
        "DSEC_BUILTIN_CACHE": str(IMAGE_CACHE),
        "DSEC_PREBUILD": ",".join(config["layers"]),
        "DSEC_SHORT_NAME_REGISTRY": "none",
        # an emulated (TCG) guest runs ~10x slower: a probe container alone can take >10 s
        "DSEC_OCI_TIMEOUT_S": "120",
        "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    os.environ.update(env)  # the SDK finds the server and its key ($DSEC_HOME/api_key)
    _file_layers(config, rec, payload)
    serve = Serve(env, out)
    up = rec.check("serve.start", serve.start, 960)
    _doctor(env, rec)
    if up:
        from dsec import Client

        with Client(URL, timeout=60) as client:
            caps = {c.tier: c for c in client.node_info().tiers}
        rec.set(
            "tiers",
            {t: {"available": c.available, "reason": c.reason} for t, c in caps.items()},
        )
        for tier in tiers:
            c = caps.get(tier)
            if c is None or not c.available:
                why = "not enabled" if c is None else (c.reason or "unavailable")
                rec.check(f"{tier}.available", _failing(why))
                continue
            image = config.get("images", {}).get(tier, "debian")
            TierChecks(tier, image, c, rec).all(config["mode"])
        rec.check("sandboxes.killed", _kill_every_sandbox, 600)
        rec.check("serve.stop", serve.stop, 300)
    clean = rec.check("leftovers", lambda: _no_leftovers(), 120)
    suites: list[tuple[str, Callable[[], None]]] = []
    if config.get("conformance") and config["mode"] == "full":
        suites.append(("conformance", lambda: _conformance(payload, env, tiers, rec)))
    if config.get("tests"):  # the matrix's --tests
        suites.append(("tests", lambda: _tests(payload, env, list(config["tests"]), rec)))
    for name, run in suites:
        if not clean:  # its tests would hang or skip on what the checks left behind
            rec.check(name, _skip("the checks above left the node unclean (leftovers failed)"))
            continue
        run()
        clean = rec.check(f"leftovers.after_{name}", lambda: _no_leftovers(), 120)
    return 0


def _failing(why: str) -> Callable[[], dict[str, Any]]:
    def fn() -> dict[str, Any]:
        raise CheckFailed(why)

    return fn


def _no_leftovers() -> dict[str, Any]:
    time.sleep(1)
    found = leftovers()
    if any(found.values()):
        summary = ", ".join(f"{len(v)} {k}" for k, v in found.items() if v)
        raise CheckFailed(
            f"left behind: {summary}",
            {**found, "all_processes": snapshot()},
        )
    return found


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--checks":
        return stage2(Path(sys.argv[2]))
    if len(sys.argv) == 2:
        return stage1(Path(sys.argv[1]))
    print("usage: inguest.py PAYLOAD | inguest.py --checks PAYLOAD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
