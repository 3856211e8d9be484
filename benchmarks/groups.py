"""GRPO groups benchmark (issue 35): prints a table, writes benchmarks/results/groups.json.

Measured end to end on real container sandboxes: a ``dsec serve`` child process (apiserver +
edge + container tier) with its own DSEC_HOME, driven through the public async SDK, so every
number includes HTTP, the apiserver, the edge and the runtime.

* **fork(16) to all 16 first execs** for a parent that wrote 1 MiB, 100 MiB and 1 GiB
  (random bytes, ``head -c`` from /dev/urandom): the time from the fork call until each of
  the 16 new sandboxes has answered a ``true``, p50 over ``--groups`` groups, for the shared
  fork (``method="shared"``: the children stack on the parent's frozen writable layer; a
  new parent per group, so each group freezes a layer of its own) against the packed fork
  (``method="pack"``: ``pack_diff`` of the layer first) in the same run. Next to them, one
  ``AsyncSandbox.create`` to its first exec (the peer: a group of 16 should be about as fast).
  Each fork comes ``--settle`` seconds (default 2) after its parent's set-up: the warm pool,
  whose containers the children are made from, refills the previous group's 16 meanwhile
  (a real group's set-up takes longer than that).
* **VM tier** (``vm_microvm``): ``fork(n, memory=True)`` to all n first execs for n = 1, 4, 8
  (its guests run under QEMU TCG here: small n), 2 groups each, on a ``dsec serve`` of its
  own started after the rest (its template boots must not run beside the container sections).
* **a realistic group**: the set-up uploads a local wheel cache (the dependencies of a small
  project, repacked from the wheels installed in this Python: no network), makes a venv and
  ``pip install --no-index``-es the project into it (image ``e2b-base``). ``create_group(16)``
  against 16 independent set-ups run concurrently: time until all 16 import the project.
* **isolation**: in one group, a write in one child is seen by no sibling nor the parent;
  hostnames, ``/etc/machine-id`` (where the image has one), boot ids and random bytes differ.

Each section's failure is recorded in the JSON (``{"error": ...}``) and the run goes on.
``--quick``: 2 groups per size, 1 MiB and 100 MiB only, 4 sandboxes in the realistic group;
writes benchmarks/results/groups_quick.json instead.

Usage: .venv/bin/python benchmarks/groups.py [--quick] [--groups N] [--settle S] [--home DIR]   (root)
Targets: shared fork(16) to all first execs p50 <= 100 ms, the 1 GiB case within 1.5x of
the 1 MiB case; the realistic group >= 10x faster than 16 independent set-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import csv
import hashlib
import importlib.metadata as metadata
import io
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packaging.requirements import Requirement

from dsec import AsyncClient, AsyncSandbox
from dsec.server import ServeProcess
from hostprobe import host_probe_s

RESULTS = Path(__file__).resolve().parent / "results"
N = 16
VM_NS = (1, 4, 8)
"""fork(n, memory=True) sizes on the VM tier: its guests run under QEMU TCG here (no usable
KVM), ~10x slower than the host, so a group of 16 would measure TCG, not the fork."""
VM_GROUPS = 2
SIZES_MIB = (1, 100, 1024)
PARENT = {"cpu": 0.1, "memory_mb": 1400, "disk_mb": 1300}
"""Limits of the size benchmark's parents (their written layer is tmpfs: it counts as
memory) and so of their children."""
PROJECT_DEPS = ("httpx", "jinja2", "click", "attrs")
"""What the realistic group's project depends on (their own dependencies come along)."""
TARGET_PYTHON = {"python_version": "3.11", "python_full_version": "3.11.2"}
"""The e2b-base image's Python (Debian 12), for the dependencies' markers."""


def ms_since(t0: float) -> float:
    """Milliseconds since the ``time.perf_counter()`` value ``t0``."""
    return (time.perf_counter() - t0) * 1000


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 1) if xs else float("nan")


# --- the wheel cache -----------------------------------------------------------------


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def repack_installed(name: str, dest: Path) -> Path:
    """Rebuild the wheel of installed distribution ``name`` from its installed files (its
    RECORD lists them, paths relative to site-packages; scripts outside it are left out)."""
    dist = metadata.distribution(name)
    wheel_meta = (dist.read_text("WHEEL") or "").splitlines()
    tag = next((ln.split(":", 1)[1].strip() for ln in wheel_meta if ln.startswith("Tag:")), "")
    out = dest / f"{_norm(dist.metadata['Name'])}-{dist.version}-{tag or 'py3-none-any'}.whl"
    base = Path(str(dist.locate_file("")))
    records: list[list[str]] = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        record_name = ""
        for f in dist.files or []:
            rel = str(f)
            if rel.startswith("..") or rel.endswith(".pyc") or "__pycache__" in rel:
                continue
            if rel.endswith(".dist-info/RECORD"):
                record_name = rel
                continue
            if rel.endswith((".dist-info/INSTALLER", ".dist-info/direct_url.json")):
                continue
            data = (base / rel).read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append([rel, f"sha256={digest.decode()}", str(len(data))])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*records, [record_name, "", ""]])
        z.writestr(record_name, buf.getvalue())
    return out


def dependency_closure(names: tuple[str, ...]) -> list[str]:
    """``names`` and what they require (for the target Python, no extras), installed here."""
    seen: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if _norm(name) in seen:
            continue
        dist = metadata.distribution(name)
        seen[_norm(name)] = dist.metadata["Name"]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({**TARGET_PYTHON, "extra": ""}):
                todo.append(req.name)
    return sorted(seen.values())


def build_wheel_cache(dest: Path) -> list[str]:
    """The project's wheel and those of its dependencies in ``dest``; their file names."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in dependency_closure(PROJECT_DEPS):
        repack_installed(name, dest)
    files = {
        "groupapp/__init__.py": "import attrs, click, httpx, jinja2\n\nVERSION = '1.0'\n",
        "groupapp-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: groupapp\n"
        "Version: 1.0\n" + "".join(f"Requires-Dist: {d}\n" for d in PROJECT_DEPS),
        "groupapp-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: groups-bench\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(dest / "groupapp-1.0-py3-none-any.whl", "w") as z:
        rows = []
        for rel, text in files.items():
            z.writestr(rel, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
            rows.append(f"{rel},sha256={digest.rstrip(b'=').decode()},{len(text)}\n")
        z.writestr(
            "groupapp-1.0.dist-info/RECORD", "".join(rows) + "groupapp-1.0.dist-info/RECORD,,\n"
        )
    return sorted(p.name for p in dest.iterdir())


# --- sections --------------------------------------------------------------------------


async def first_execs(sandboxes: list[AsyncSandbox]) -> None:
    rs = await asyncio.gather(*(sb.commands.run("true") for sb in sandboxes))
    assert all(r.exit_code == 0 for r in rs), rs


async def kill_all(sandboxes: list[AsyncSandbox]) -> None:
    await asyncio.gather(*(sb.kill() for sb in sandboxes), return_exceptions=True)


async def write_change(sb: AsyncSandbox, mib: int) -> None:
    r = await sb.commands.run(
        f"mkdir -p /data && dd if=/dev/urandom of=/data/blob bs=1048576 count={mib} 2>/dev/null",
        timeout=600,
    )
    assert r.exit_code == 0, r.stderr


async def bench_single(client: AsyncClient, rounds: int) -> dict[str, Any]:
    """One create to its first exec (the peer of a group of 16)."""
    times: list[float] = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        sb = await AsyncSandbox.create(image="busybox", client=client, **PARENT)
        await first_execs([sb])
        times.append(ms_since(t0))
        await sb.kill()
    return {"rounds": rounds, "create_to_first_exec_p50_ms": p50(times[1:])}


async def bench_size(
    client: AsyncClient, mib: int, groups: int, settle_s: float = 0.0
) -> dict[str, Any]:
    """fork(16) to all first execs, shared (a new parent per group) and packed; each fork
    ``settle_s`` after its parent's set-up (the warm pool refills meanwhile)."""
    out: dict[str, Any] = {"mib": mib, "groups": groups, "n": N, "settle_s": settle_s}
    for method in ("shared", "pack"):
        total: list[float] = []
        call: list[float] = []
        parent: AsyncSandbox | None = None
        for g in range(groups + 1):  # the first group warms up (not counted)
            if parent is None or method == "shared":
                parent = await AsyncSandbox.create(image="busybox", client=client, **PARENT)
                await write_change(parent, mib)
                await asyncio.sleep(settle_s)
            t0 = time.perf_counter()
            children = await parent.fork(
                N, method=method, parent="pause" if method == "shared" else "keep"
            )
            t_call = ms_since(t0)
            await first_execs(children)
            t_all = ms_since(t0)
            await kill_all(children)
            if method == "shared":
                await parent.kill()
                parent = None
            if g > 0:
                total.append(t_all)
                call.append(t_call)
        if parent is not None:
            await parent.kill()
        out[method] = {
            "fork16_to_all_first_execs_p50_ms": p50(total),
            "fork_call_p50_ms": p50(call),
            "all_ms": [round(x, 1) for x in total],
        }
    out["pack_over_shared"] = round(
        out["pack"]["fork16_to_all_first_execs_p50_ms"]
        / out["shared"]["fork16_to_all_first_execs_p50_ms"],
        1,
    )
    return out


async def bench_isolation(client: AsyncClient) -> dict[str, Any]:
    """One group of 16: writes, hostnames, machine ids, boot ids and random bytes."""
    parent = await AsyncSandbox.create(image="e2b-base", client=client, cpu=0.1, memory_mb=256)
    children: list[AsyncSandbox] = []
    try:
        r = await parent.commands.run("echo parent > /tmp/who; cat /etc/machine-id", user="root")
        has_machine_id = r.exit_code == 0 and bool(r.stdout.strip())
        children = await parent.fork(N, parent="pause")

        async def out(sb: AsyncSandbox, cmd: str) -> str:
            r = await sb.commands.run(cmd, user="root")
            return str(r.stdout).strip()

        await out(children[0], "echo child0 > /tmp/who; touch /tmp/only0")
        seen = await asyncio.gather(
            *(out(sb, "cat /tmp/who; ls /tmp/only0 2>/dev/null") for sb in [*children[1:], parent])
        )
        hosts = await asyncio.gather(*(out(sb, "hostname") for sb in children))
        ids = await asyncio.gather(*(out(sb, "cat /etc/machine-id") for sb in children))
        boots = await asyncio.gather(
            *(out(sb, "cat /proc/sys/kernel/random/boot_id") for sb in children)
        )
        rand = await asyncio.gather(
            *(out(sb, "head -c 16 /dev/urandom | od -An -tx1") for sb in children)
        )
        return {
            "n": N,
            "write_seen_by_no_other": all(s == "parent" for s in seen),
            "hostnames_distinct": len(set(hosts)) == N,
            "image_has_machine_id": has_machine_id,
            "machine_ids_distinct": len(set(ids)) == N if has_machine_id else None,
            "boot_ids_distinct": len(set(boots)) == N,
            "random_bytes_distinct": len(set(rand)) == N,
        }
    finally:
        await kill_all([*children, parent])


async def bench_vm(
    client: AsyncClient, tier: str, ns: tuple[int, ...], groups: int
) -> dict[str, Any]:
    """fork(n, memory=True) to all n first execs on a VM tier (QEMU TCG here: small n)."""
    out: dict[str, Any] = {"tier": tier, "groups": groups}
    for n in ns:
        total: list[float] = []
        for _ in range(groups):
            parent = await AsyncSandbox.create(image="busybox", tier=tier, client=client)
            try:
                await write_change(parent, 1)
                t0 = time.perf_counter()
                children = await parent.fork(n, memory=True)
                await first_execs(children)
                total.append(ms_since(t0))
                await kill_all(children)
            finally:
                await parent.kill()
        out[f"fork{n}_to_all_first_execs_p50_ms"] = p50(total)
        out[f"fork{n}_all_ms"] = [round(x, 1) for x in total]
    return out


def _setup(wheels: Path) -> Any:
    async def setup(sb: AsyncSandbox) -> None:
        await sb.files.upload_dir(wheels, "/tmp/wheels")
        for cmd in (
            "python3 -m venv $HOME/venv",
            "$HOME/venv/bin/pip install -q --no-index --find-links /tmp/wheels groupapp",
        ):
            r = await sb.commands.run(cmd, timeout=600)
            assert r.exit_code == 0, (cmd, r.stdout, r.stderr)

    return setup


async def ready(sb: AsyncSandbox) -> None:
    r = await sb.commands.run("$HOME/venv/bin/python -c 'import groupapp'", timeout=600)
    assert r.exit_code == 0, r.stderr


async def bench_realistic(client: AsyncClient, wheels: Path, n: int) -> dict[str, Any]:
    """create_group(n) against n independent set-ups run concurrently."""
    limits = {"cpu": 0.5, "memory_mb": 512}
    setup = _setup(wheels)
    # the image's layers come into the page cache once, before either side is timed
    warm = await AsyncSandbox.create(image="e2b-base", client=client, **limits)
    await setup(warm)
    await warm.kill()
    t0 = time.perf_counter()
    group = await AsyncSandbox.create_group(
        n, image="e2b-base", setup=setup, client=client, **limits
    )
    await asyncio.gather(*(ready(sb) for sb in group))
    group_s = ms_since(t0) / 1000
    method = group.method
    await kill_all(group.sandboxes)

    async def independent() -> AsyncSandbox:
        sb = await AsyncSandbox.create(image="e2b-base", client=client, **limits)
        await setup(sb)
        await ready(sb)
        return sb

    t0 = time.perf_counter()
    made = await asyncio.gather(*(independent() for _ in range(n)))
    independent_s = ms_since(t0) / 1000
    await kill_all(list(made))
    return {
        "n": n,
        "wheels": len(os.listdir(wheels)),
        "group_method": method,
        "create_group_to_all_ready_s": round(group_s, 2),
        "independent_setups_to_all_ready_s": round(independent_s, 2),
        "speedup": round(independent_s / group_s, 1),
    }


async def run(url: str, api_key: str, args: argparse.Namespace, wheels: Path) -> dict[str, Any]:
    sizes = SIZES_MIB[:2] if args.quick else SIZES_MIB
    res: dict[str, Any] = {"quick": args.quick, "host_probe_s": round(host_probe_s(), 4)}
    async with AsyncClient(url, api_key, timeout=900) as client:
        sections: list[tuple[str, Any]] = [("single", lambda: bench_single(client, args.groups))]
        sections += [
            (f"fork_{m}mib", (lambda m=m: bench_size(client, m, args.groups, args.settle)))
            for m in sizes
        ]
        sections += [
            ("isolation", lambda: bench_isolation(client)),
            ("realistic", lambda: bench_realistic(client, wheels, 4 if args.quick else N)),
        ]
        for key, fn in sections:
            t0 = time.perf_counter()
            try:
                res[key] = await fn()
            except Exception as e:  # recorded; the run goes on
                res[key] = {"error": repr(e)[:500]}
            print(f"  {key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    res["host_probe_end_s"] = round(host_probe_s(), 4)
    return res


async def run_vm(url: str, api_key: str) -> dict[str, Any]:
    async with AsyncClient(url, api_key, timeout=900) as client:
        return await bench_vm(client, "microvm", VM_NS, VM_GROUPS)


def verdict(value: Any, ok: bool) -> str:
    return f"{value}  {'OK' if ok else 'MISS'}"


def print_table(res: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    single = res.get("single", {})
    if "create_to_first_exec_p50_ms" in single:
        rows.append(
            (
                "1 create -> first exec, p50 ms (peer)",
                "",
                str(single["create_to_first_exec_p50_ms"]),
            )
        )
    base = None
    for key in [k for k in res if k.startswith("fork_")]:
        s = res[key]
        if "error" in s:
            rows.append((key, "", s["error"][:70]))
            continue
        shared = s["shared"]["fork16_to_all_first_execs_p50_ms"]
        base = shared if s["mib"] == 1 else base
        ok = shared <= 100 and (base is None or shared <= 1.5 * base)
        rows.append((f"fork(16) -> 16 first execs, {s['mib']} MiB, shared, p50 ms",
                     "<= 100 ms", verdict(shared, ok)))  # fmt: skip
        rows.append((f"  same, pack_diff fork, p50 ms (x{s['pack_over_shared']})", "",
                     str(s["pack"]["fork16_to_all_first_execs_p50_ms"])))  # fmt: skip
    if base is not None and "fork_1024mib" in res and "shared" in res["fork_1024mib"]:
        ratio = res["fork_1024mib"]["shared"]["fork16_to_all_first_execs_p50_ms"] / base
        rows.append(("shared: 1 GiB over 1 MiB", "<= 1.5x", verdict(f"{ratio:.2f}x", ratio <= 1.5)))
    vm = res.get("vm_microvm", {})
    if "error" in vm:
        rows.append(("vm_microvm", "", vm["error"][:70]))
    for n in VM_NS:
        if f"fork{n}_to_all_first_execs_p50_ms" in vm:
            rows.append((f"microvm fork({n}, memory=True) -> {n} first execs, p50 ms (TCG)", "",
                         str(vm[f"fork{n}_to_all_first_execs_p50_ms"])))  # fmt: skip
    iso = res.get("isolation", {})
    if "error" in iso:
        rows.append(("isolation", "", iso["error"][:70]))
    elif iso:
        for k in ("write_seen_by_no_other", "hostnames_distinct", "machine_ids_distinct",
                  "boot_ids_distinct", "random_bytes_distinct"):  # fmt: skip
            rows.append((f"isolation: {k}", "True", verdict(iso[k], iso[k] is not False)))
    rl = res.get("realistic", {})
    if "error" in rl:
        rows.append(("realistic group", "", rl["error"][:70]))
    elif rl:
        rows.append((f"create_group({rl['n']}) -> all ready, s", "",
                     str(rl["create_group_to_all_ready_s"])))  # fmt: skip
        rows.append((f"{rl['n']} independent set-ups -> all ready, s", "",
                     str(rl["independent_setups_to_all_ready_s"])))  # fmt: skip
        rows.append(("  speedup", ">= 10x", verdict(f"{rl['speedup']}x", rl["speedup"] >= 10)))
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'target':<9}  measured")
    for what, target, measured in rows:
        print(f"{what:<{width}}  {target:<9}  {measured}")
    print(f"(host probe {res['host_probe_s']} s at start, {res.get('host_probe_end_s')} s at end)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 groups, 1 and 100 MiB, 4 set-ups")
    ap.add_argument("--groups", type=int, default=5, help="groups per size (p50 over them)")
    ap.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds between a parent's set-up and its fork (the warm pool refills the\n"
        "previous group's 16 containers; a real group's set-up takes longer)",
    )
    ap.add_argument("--home", default=None, help="DSEC_HOME of the server (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.groups = min(args.groups, 2)
    if os.geteuid() != 0:
        sys.exit("needs root (dsec serve runs containers)")
    home = Path(args.home or tempfile.mkdtemp(prefix="dsec-bench-groups-")).resolve()
    wheels = Path(tempfile.mkdtemp(prefix="dsec-bench-wheels-"))
    t0 = time.perf_counter()
    try:
        build_wheel_cache(wheels)
        env = {"DSEC_CPU_OVERCOMMIT": "40", "DSEC_MEMORY_OVERCOMMIT": "4"}
        with ServeProcess(home, env=env) as srv:
            results = asyncio.run(run(srv.url, srv.api_key, args, wheels))
        # the VM tier on a server of its own: its template boots and pool would run beside
        # the container sections
        t_vm = time.perf_counter()
        try:
            with ServeProcess(home / "vm", env={**env, "DSEC_TIERS": "microvm"}) as srv:
                results["vm_microvm"] = asyncio.run(run_vm(srv.url, srv.api_key))
        except Exception as e:  # recorded; the results so far stand
            results["vm_microvm"] = {"error": repr(e)[:500]}
        print(f"  vm_microvm: {time.perf_counter() - t_vm:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
        if args.home is None:
            with contextlib.suppress(OSError):
                shutil.rmtree(home, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    name = "groups_quick.json" if args.quick else "groups.json"
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"(total {results['total_s']} s; wrote {RESULTS / name})")


if __name__ == "__main__":
    main()
