"""A DSec-sized cell on one machine: the cluster control plane's cost per creation (issue 37).

Starts a real Ray cluster (``--raylets`` raylets on this host, ``ray.cluster_utils``) and
PostgreSQL (Debian's package, a private data dir on loopback, ``pg_stat_statements``
loaded), N edge actors whose runtime is the in-memory one (``dsec.testing:memory_node_edge``:
the real ``EdgeAgent`` with its SQLite registry and trajectory log, sandboxes that cost
nothing), ``--replicas`` apiserver replicas (``dsec serve --cluster`` child processes), and
drives creates, execs and kills through the real SDK over HTTP from ``--clients`` client
processes.

N edges = ``--raylets`` Ray nodes x ``N / raylets`` edge actors each
(``DSEC_CLUSTER_EDGES_PER_NODE``): a Ray node here costs a raylet and its agent processes
(several hundred MB and a steady trickle of CPU), so 64 raylets do not fit this 2-core,
24 GiB host beside other work; edge actors are one worker process each. What this leaves
out of the measurement is Ray's per-node cost (raylet, GCS health checks), not the
per-call path, which is the same for every actor.

For each N (``--nodes``) and each live count L (``--live``, grown with batch creations,
``create_many``, job ``fill``), in order:

1. *fill* to L live sandboxes (creations/s of the batch path and its CPU per sandbox);
2. *idle*: ``--idle-s`` seconds with no client: CPU/s each component spends at L live
   (reports, registry sync);
3. *create*: ``--window`` single creations (``AsyncSandbox.create``) from the clients,
   ``--concurrency`` in flight each: creations/s, p50/p99 latency, CPU per creation of each
   component, PostgreSQL statements and rows written per creation;
4. *exec*: one ``echo`` in each of them: p50/p99, CPU per exec;
5. *kill*: each of them: p50/p99, CPU per kill (back to L live).

Then, with ``--job K``, a training job of K sandboxes (``create_many`` batches from every
client: time to all created, creations/s, CPU each), paused, resumed and killed as a job
(one call each: time, failed outcomes). Last, the ``fill`` job is killed the same way.

With ``--burst``, the last raylet's edges are the burst pool (``dsec.io/burst=true``, of
the default size), the job's sandboxes are burstable (``dsec.io/burstable=true``) and the
regular nodes are sized (``DSEC_MEMORY_NODE_MEMORY_MB``) so that the regular pool reaches
the placer's burst threshold (0.8) about halfway through the job: the job's overflow past it goes to the
burst pool (counted in the job's ``placed``), and the node a fault run kills is a regular one.

*Marginal* CPU per operation = the window's CPU minus what the idle cell spends in as
long, per operation: what one more creation costs. Projected cores for 5,000
creations/s = the idle cell's cores + 5,000 x marginal (single creations, and batched).

CPU of a component = utime+stime of its processes (/proc/<pid>/stat) over the window:
``apiserver`` (the replicas), ``edges`` (the ``ray::EdgeActor`` workers), ``ray`` (raylets,
GCS, Ray's agents and idle workers), ``postgres`` (the postmaster and its backends);
clients are shown apart and are not in the total. The host's busy-ness
(``hostprobe.host_probe_s``: ~11 ms idle) is recorded with every window: compare ratios
and medians, not single numbers.

Prints a table, writes benchmarks/results/cell.json (``--out``).

Usage:
    python benchmarks/cell.py [--nodes 16,32,64] [--live 1000,10000,100000] [--window 2000]
        [--raylets 4] [--replicas 2] [--clients 4] [--concurrency 16] [--profile DIR]
    python benchmarks/cell.py --quick       # a functional smoke run (~1 min)

Target (issue 37): <= 1.6 ms of CPU per creation over every component together (5,000
creations/s on <= 8 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_parts import Postgres, serve_replica
from hostprobe import host_probe_s, mem_available_kib

RESULTS = Path(__file__).resolve().parent / "results"
COMPONENTS = ("apiserver", "edges", "ray", "postgres")
SANDBOX = {"cpu": 0.01, "memory_mb": 16, "disk_mb": 1, "ttl_s": None}
CLK_TCK = os.sysconf("SC_CLK_TCK")
RUN_START = time.monotonic()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def pg_counters(pg: Postgres) -> dict[str, float]:
    """Cumulative statements and rows written, by pg_stat_statements and the tables."""
    with pg.connect() as c:
        writes = c.execute(
            "SELECT COALESCE(sum(calls), 0), COALESCE(sum(rows), 0) FROM pg_stat_statements "
            "WHERE query ~* '^\\s*(insert|update|delete)'"
        ).fetchone()
        every = c.execute("SELECT COALESCE(sum(calls), 0) FROM pg_stat_statements").fetchone()
        tup = c.execute(
            "SELECT COALESCE(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables"
        ).fetchone()
        xact = c.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return {
        "statements": float(every[0]),
        "write_statements": float(writes[0]),
        "rows_written": float(tup[0]),
        "commits": float(xact[0]),
    }


# --- CPU of each component -------------------------------------------------------------------
def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, utime+stime ticks, cmdline) of every process."""
    out: dict[int, tuple[int, int, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]), cmd)
    return out


@dataclass
class Accounting:
    """Which processes belong to which component of the cell."""

    me: int
    replicas: set[int] = field(default_factory=set)
    clients: set[int] = field(default_factory=set)
    postmaster: int = 0
    marker: str = ""  # a path in every Ray process's command line

    def sample(self) -> dict[int, tuple[str, int, str]]:
        procs = _procs()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)

        def tree(root: int) -> set[int]:
            seen, todo = set(), [root]
            while todo:
                p = todo.pop()
                if p in seen or p not in procs:
                    continue
                seen.add(p)
                todo += children.get(p, [])
            return seen

        pg = tree(self.postmaster) if self.postmaster else set()
        api: set[int] = set().union(*(tree(p) for p in self.replicas)) if self.replicas else set()
        cl: set[int] = set().union(*(tree(p) for p in self.clients)) if self.clients else set()
        mine = tree(self.me) - {self.me}
        out: dict[int, tuple[str, int, str]] = {}
        for pid, (_, ticks, cmd) in procs.items():
            if "py-spy" in cmd:
                continue  # the profiler of --profile is no part of the cell
            if pid in pg:
                comp = "postgres"
            elif pid in api:
                comp = "apiserver"
            elif pid in cl:
                comp = "clients"
            elif cmd.startswith("ray::EdgeActor"):
                comp = "edges"
            elif pid in mine or (self.marker and self.marker in cmd) or cmd.startswith("ray::"):
                comp = "ray"
            else:
                continue
            out[pid] = (comp, ticks, cmd[:60])
        return out


def cpu_delta(
    before: dict[int, tuple[str, int, str]], after: dict[int, tuple[str, int, str]]
) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """CPU seconds per component between two samples (new processes count from 0), and the
    busiest processes (component, command line, seconds)."""
    out = dict.fromkeys((*COMPONENTS, "clients"), 0.0)
    each: list[tuple[str, str, float]] = []
    for pid, (comp, ticks, cmd) in after.items():
        prev = before.get(pid)
        used = (ticks - (prev[1] if prev and prev[0] == comp else 0)) / CLK_TCK
        out[comp] += used
        each.append((comp, f"{pid} {cmd}", used))
    each.sort(key=lambda x: -x[2])
    return out, each[:8]


# --- client processes ------------------------------------------------------------------------
def client_main(conn: Any, url: str, api_key: str) -> None:
    """A client process: runs the commands it is sent over ``conn`` through the SDK."""
    from dsec import AsyncClient, AsyncSandbox
    from dsec.errors import DsecError

    made: list[Any] = []

    async def timed(fn: Any, n: int, conc: int) -> dict[str, Any]:
        lat: list[float] = []
        errors: dict[str, int] = {}
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                t0 = time.perf_counter()
                try:
                    await fn(i)
                    lat.append((time.perf_counter() - t0) * 1000)
                except DsecError as e:
                    errors[e.code] = errors.get(e.code, 0) + 1
                except Exception as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

        await asyncio.gather(*(worker() for _ in range(conc)))
        return {"latencies_ms": lat, "errors": errors}

    async def run(cmd: tuple[Any, ...]) -> Any:
        async with AsyncClient(url, api_key, timeout=600) as client:
            op = cmd[0]
            if op == "create":
                _, n, conc, job = cmd

                async def create(_: int) -> None:
                    made.append(await AsyncSandbox.create(client=client, job=job, **SANDBOX))

                return await timed(create, n, conc)
            if op == "exec":
                _, conc = cmd
                sbs = list(made)

                async def execute(i: int) -> None:
                    r = await sbs[i].commands.run("echo hi")
                    if r.stdout != "hi\n":
                        raise RuntimeError(f"exec answered {r.stdout!r}")

                return await timed(execute, len(sbs), conc)
            if op == "kill":
                _, conc = cmd
                sbs = list(made)
                made.clear()

                async def kill(i: int) -> None:
                    await sbs[i].kill()

                return await timed(kill, len(sbs), conc)
            if op == "fill":
                _, n, conc, batch, job, *more = cmd
                labels = more[0] if more else {}
                count = 0
                errors: dict[str, int] = {}
                todo = [min(batch, n - i) for i in range(0, n, batch)]

                async def worker() -> None:
                    nonlocal count
                    while todo:
                        k = todo.pop()
                        try:
                            res = await AsyncSandbox.create_many(
                                k, client=client, job=job, labels=labels, **SANDBOX
                            )
                        except Exception as e:  # a fault run kills what answers
                            code = e.code if isinstance(e, DsecError) else type(e).__name__
                            errors[code] = errors.get(code, 0) + k
                            continue
                        count += len(res.sandboxes)
                        for err in res.errors:
                            errors[err.code] = errors.get(err.code, 0) + 1

                await asyncio.gather(*(worker() for _ in range(conc)))
                return {"created": count, "errors": errors}
            if op == "job":
                _, job, action = cmd
                t0 = time.perf_counter()
                res = await getattr(client.jobs, action)(job, timeout=600)
                codes: dict[str, int] = {}
                samples: dict[str, str] = {}  # one message per code: what failed, and why
                for o in res.outcomes.values():
                    if not o.ok:
                        code = str((o.error or {}).get("code", "?"))
                        codes[code] = codes.get(code, 0) + 1
                        samples.setdefault(code, str((o.error or {}).get("message", ""))[:300])
                return {
                    "s": time.perf_counter() - t0,
                    "outcomes": len(res.outcomes),
                    "failed": sum(codes.values()),
                    "failed_by_code": codes,
                    "failed_samples": samples,
                }
            if op == "jobnodes":
                _, job, prefix = cmd
                where = {"burst": 0, "regular": 0}
                for info in await client.jobs.list(job):
                    where["burst" if (info.node or "").startswith(prefix) else "regular"] += 1
                return where
            if op == "joblist":
                _, job = cmd
                states: dict[str, int] = {}
                for info in await client.jobs.list(job, include_stopped=True):
                    lost = (info.stopped_reason or "").startswith("node lost")
                    key = "lost" if lost else info.state
                    states[key] = states.get(key, 0) + 1
                return states
            raise ValueError(op)

    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            return
        try:
            conn.send(("ok", asyncio.run(run(cmd))))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Clients:
    def __init__(self, urls: list[str], api_key: str, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(child, urls[i % len(urls)], api_key))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    @property
    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.pid}

    def all(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        for conn, cmd in zip(self.conns, cmds, strict=True):
            conn.send(cmd)
        out = []
        for conn in self.conns:
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"client failed: {value}")
            out.append(value)
        return out

    def send(self, idxs: list[int], cmds: list[tuple[Any, ...]]) -> None:
        for i, cmd in zip(idxs, cmds, strict=True):
            self.conns[i].send(cmd)

    def recv(self, idxs: list[int]) -> list[Any]:
        out = []
        for i in idxs:
            status, value = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"client failed: {value}")
            out.append(value)
        return out

    def all_of(self, idxs: list[int], cmd: tuple[Any, ...]) -> list[Any]:
        self.send(idxs, [cmd] * len(idxs))
        return self.recv(idxs)

    def one(self, cmd: tuple[Any, ...]) -> Any:
        self.conns[0].send(cmd)
        status, value = self.conns[0].recv()
        if status != "ok":
            raise RuntimeError(f"client failed: {value}")
        return value

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("quit",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --- the cell --------------------------------------------------------------------------------
class Cell:
    """Ray (``raylets`` nodes), ``edges`` in-memory edge actors spread over them, and
    ``replicas`` apiserver replicas, against ``pg``."""

    def __init__(
        self,
        base: Path,
        pg: Postgres,
        *,
        raylets: int,
        edges: int,
        replicas: int,
        burst_at: int = 0,
    ):
        """``burst_at``: with a burst pool (the last raylet's edges), the live sandboxes
        (16 MiB each) at which the regular pool reaches the burst threshold (0.8)."""
        self.base = base
        self.burst_at = burst_at
        self.pg = pg
        self.raylets = raylets
        self.edges = edges
        self.per_node = max(1, edges // raylets)
        self.n_replicas = replicas
        self.cluster: Any = None
        self.workers: dict[str, Any] = {}  # Ray worker nodes by label
        self.replicas: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.api_key = ""
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="dsec-cell-ray-"))

    def start(self) -> None:
        from ray._common.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
        node_env = {"DSEC_MAX_SANDBOXES": "1000000", "DSEC_CREATE_QUEUE": "100000"}
        if self.burst_at:  # requested memory over 1.5x the node's memory reaches 0.8 there
            regular = (self.raylets - 1) * self.per_node
            mib = math.ceil(self.burst_at * SANDBOX["memory_mb"] / 0.8 / 1.5 / regular)
            node_env["DSEC_MEMORY_NODE_MEMORY_MB"] = str(mib)
        self.cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": 1,
                "labels": {"dsec.io/node": "r0"},
                "include_dashboard": False,
                "temp_dir": str(self.ray_tmp),
                "env_vars": node_env,
                "_system_config": {
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 5,
                },
            },
        )
        for i in range(1, self.raylets):
            labels, env = {"dsec.io/node": f"r{i}"}, dict(node_env)
            if self.burst_at and i == self.raylets - 1:  # large: it takes all the overflow
                labels["dsec.io/burst"] = "true"
                env.pop("DSEC_MEMORY_NODE_MEMORY_MB", None)
            self.workers[f"r{i}"] = self.cluster.add_node(num_cpus=1, labels=labels, env_vars=env)
        self.cluster.wait_for_nodes()
        for i in range(self.n_replicas):
            self._start_replica(i)

    def _start_replica(self, i: int) -> None:
        env = {
            "PYTHONPATH": os.environ.get("PYTHONPATH")
            or str(Path(__file__).resolve().parents[1] / "src"),
            "DSEC_TIERS": "container",
            "DSEC_NETWORK": "off",
            "DSEC_CLUSTER_EDGE_FACTORY": "dsec.testing:memory_node_edge",
            "DSEC_CLUSTER_EDGES_PER_NODE": str(self.per_node),
            "DSEC_CLUSTER_PROBE_TIMEOUT_S": "10",
            "DSEC_CLUSTER_LOST_AFTER_S": "30",
        }
        home = self.base / f"api{i}"
        proc, url = serve_replica(
            home, self.base / "nodes", self.cluster.address, self.pg.dsn, free_port(), env,
            timeout_s=600,
        )  # fmt: skip
        if i == 0:
            self.api_key = (home / "api_key").read_text().strip()
        self.replicas.append(proc)
        self.urls.append(url)
        self._wait_edges(url)

    def _wait_edges(self, url: str) -> None:
        import httpx

        want = self.raylets * self.per_node
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                r = httpx.get(f"{url}/metrics", timeout=5)
                for line in r.text.splitlines():
                    if line.startswith('dsec_cluster_nodes{state="alive"}'):
                        if int(float(line.split()[-1])) >= want:
                            return
            time.sleep(1)
        raise RuntimeError(f"{url}: fewer than {want} edges alive after 600 s")

    def notes(self) -> list[str]:
        """What the cell's logs say went wrong: edge actors killed or restarted (Ray's
        memory monitor, a dead worker), nodes declared lost by a replica (at most 40
        lines)."""
        pattern = re.compile(
            r"memory monitor|low on memory|OutOfMemory|Killing worker|restarting actor|"
            r"worker.*(died|exited)|node lost|did not answer",
            re.I,
        )
        files = sorted(self.ray_tmp.glob("session_*/logs/raylet*.out"))
        files += sorted(self.ray_tmp.glob("session_*/logs/gcs_server.out"))
        files += sorted(self.base.glob("api*/serve.log"))
        out: list[str] = []
        for f in files:
            with contextlib.suppress(OSError):
                for line in f.read_text(errors="replace").splitlines():
                    if pattern.search(line) and len(out) < 40:
                        out.append(f"{f.name}: {line[:300]}")
        return out

    def close(self) -> None:
        for p in self.replicas:
            p.terminate()
        for p in self.replicas:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self._kill_edges()
            self.cluster.shutdown()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def _kill_edges(self) -> None:
        import ray
        from ray.util import list_named_actors

        ray.init(address=self.cluster.address, namespace="dsec", log_to_driver=False)
        try:
            for entry in list_named_actors(all_namespaces=True):
                if entry["namespace"] == "dsec" and entry["name"].startswith("dsec-edge-"):
                    with contextlib.suppress(Exception):
                        ray.kill(ray.get_actor(entry["name"], namespace="dsec"), no_restart=True)
        finally:
            ray.shutdown()


# --- measurement -----------------------------------------------------------------------------
class Meter:
    def __init__(self, acct: Accounting, pg: Postgres) -> None:
        self.acct = acct
        self.pg = pg

    def __enter__(self) -> Meter:
        self.probe = host_probe_s()
        self.pg0 = pg_counters(self.pg)
        self.cpu0 = self.acct.sample()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.monotonic() - self.t0
        self.cpu, self.top = cpu_delta(self.cpu0, self.acct.sample())
        pg1 = pg_counters(self.pg)
        self.pgd = {k: pg1[k] - self.pg0[k] for k in pg1}

    def per(self, n: int, prefix: str) -> dict[str, Any]:
        """CPU ms and PostgreSQL work per operation (``n`` of them) over the window."""
        n = max(1, n)
        out: dict[str, Any] = {
            f"{prefix}_cpu_ms_{c}": self.cpu[c] * 1000 / n for c in (*COMPONENTS, "clients")
        }
        out[f"{prefix}_cpu_ms_total"] = sum(self.cpu[c] for c in COMPONENTS) * 1000 / n
        out[f"{prefix}_pg_statements"] = self.pgd["statements"] / n
        out[f"{prefix}_pg_write_statements"] = self.pgd["write_statements"] / n
        out[f"{prefix}_pg_rows_written"] = self.pgd["rows_written"] / n
        out[f"{prefix}_pg_commits"] = self.pgd["commits"] / n
        out[f"{prefix}_wall_s"] = self.wall
        out[f"{prefix}_host_probe_s"] = self.probe
        out[f"{prefix}_top_processes"] = [(c, cmd, round(t, 2)) for c, cmd, t in self.top]
        return out


def split(n: int, k: int) -> list[int]:
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def latencies(results: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    lat = [x for r in results for x in r["latencies_ms"]]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        f"{prefix}_ok": len(lat),
        f"{prefix}_p50_ms": pct(lat, 50),
        f"{prefix}_p99_ms": pct(lat, 99),
        f"{prefix}_errors": errors,
    }


def run_size(args: argparse.Namespace, pg: Postgres, edges: int, base: Path) -> dict[str, Any]:
    raylets = min(args.raylets, edges)
    burst_at = max(args.live) + args.job // 2 if args.burst else 0
    cell = Cell(base, pg, raylets=raylets, edges=edges, replicas=args.replicas, burst_at=burst_at)
    acct = Accounting(me=os.getpid(), postmaster=pg.postmaster_pid(), marker=str(cell.ray_tmp))
    size: dict[str, Any] = {"nodes": raylets * cell.per_node, "raylets": raylets, "steps": []}
    clients: Clients | None = None
    t_start = time.monotonic()
    try:
        mem0 = mem_available_kib()
        cell.start()
        size["start_s"] = time.monotonic() - t_start
        acct.replicas = {p.pid for p in cell.replicas}
        clients = Clients(cell.urls, cell.api_key, args.clients)
        acct.clients = clients.pids
        clients.all([("kill", 1)] * args.clients)  # warm: imports done, connections made
        live = 0
        for target in args.live:
            if time.monotonic() - t_start > args.budget_s:
                size["stopped"] = f"time budget of {args.budget_s:.0f} s spent"
                break
            if time.monotonic() - RUN_START > args.total_budget_s:
                size["stopped"] = f"the run's time budget of {args.total_budget_s:.0f} s spent"
                break
            if mem_available_kib() < args.min_free_mib * 1024:
                size["stopped"] = f"less than {args.min_free_mib} MiB of memory available"
                break
            step: dict[str, Any] = {"live": target}
            grow = max(0, target - live)
            with Meter(acct, pg) as m:
                res = clients.all(
                    [("fill", k, 2, args.batch, "fill") for k in split(grow, args.clients)]
                )
            made = sum(r["created"] for r in res)
            live += made
            step["fill_created"] = made
            step["fill_errors"] = _errors(res)
            step["fill_per_s"] = made / m.wall if m.wall else None
            step.update(m.per(made, "fill"))
            time.sleep(args.settle_s)  # the reports and the registry sync catch up
            with Meter(acct, pg) as m:
                time.sleep(args.idle_s)
            step.update(
                {f"idle_cpu_per_s_{c}": m.cpu[c] / m.wall for c in (*COMPONENTS, "clients")}
            )
            step["idle_pg_statements_per_s"] = m.pgd["statements"] / m.wall
            step["idle_pg_rows_per_s"] = m.pgd["rows_written"] / m.wall
            per_client = split(args.window, args.clients)
            profiler = start_profile(args, cell, f"n{edges}-l{target}")
            calls0 = coalesced(cell.urls)
            with Meter(acct, pg) as m:
                res = clients.all([("create", k, args.concurrency, "w") for k in per_client])
            stop_profile(profiler)
            calls1 = coalesced(cell.urls)
            if calls1[0] > calls0[0]:  # creations per edge call (the replicas coalesce them)
                step["create_per_edge_call"] = (calls1[1] - calls0[1]) / (calls1[0] - calls0[0])
            step.update(latencies(res, "create"))
            step["create_per_s"] = step["create_ok"] / m.wall
            step.update(m.per(step["create_ok"], "create"))
            with Meter(acct, pg) as m:
                res = clients.all([("exec", args.concurrency)] * args.clients)
            step.update(latencies(res, "exec"))
            step.update(m.per(step["exec_ok"], "exec"))
            with Meter(acct, pg) as m:
                res = clients.all([("kill", args.concurrency)] * args.clients)
            step.update(latencies(res, "kill"))
            step.update(m.per(step["kill_ok"], "kill"))
            step["mem_used_mib"] = (mem0 - mem_available_kib()) / 1024
            idle = sum(step[f"idle_cpu_per_s_{c}"] for c in COMPONENTS)
            step["idle_cores"] = idle
            for op in ("fill", "create", "exec", "kill"):  # minus what the idle cell spends
                n = max(1, step[f"{op}_ok"] if op != "fill" else step["fill_created"])
                used = step[f"{op}_cpu_ms_total"] * n - idle * step[f"{op}_wall_s"] * 1000
                step[f"{op}_cpu_ms_marginal"] = max(0.0, used / n)
            step["projected_cores_for_5000_per_s"] = idle + 5 * step["create_cpu_ms_marginal"]
            step["projected_cores_for_5000_per_s_batched"] = idle + 5 * step["fill_cpu_ms_marginal"]
            size["steps"].append(step)
            print_step(edges, step, flush=True)
        if args.job and "stopped" not in size:
            size["job"] = run_job(args, clients, acct, pg)
        if args.faults and "stopped" not in size:
            size["faults"] = run_faults(args, cell, clients, pg)
        if live:
            with Meter(acct, pg) as m:
                out = clients.one(("job", "fill", "kill"))
            size["job_kill"] = {**out, "live": live, **m.per(max(1, live), "job_kill")}
    finally:
        if clients is not None:
            clients.close()
        size["notes"] = cell.notes()
        cell.close()
        shutil.rmtree(base / "nodes", ignore_errors=True)
    size["wall_s"] = time.monotonic() - t_start
    return size


def run_job(args: argparse.Namespace, clients: Clients, acct: Accounting, pg: Postgres) -> dict:
    """A training job of ``--job`` sandboxes: created with ``create_many`` batches from
    every client, then paused, resumed and killed as a job (one call each)."""
    out: dict[str, Any] = {"n": args.job}
    labels = {"dsec.io/burstable": "true"} if args.burst else {}
    with Meter(acct, pg) as m:
        res = clients.all(
            [("fill", k, 2, args.batch, "job", labels) for k in split(args.job, args.clients)]
        )
    made = sum(r["created"] for r in res)
    out.update(created=made, create_s=m.wall, create_per_s=made / m.wall)
    if args.burst:  # the burst raylet's edges are named r<last>e<i>
        out["placed"] = clients.one(("jobnodes", "job", f"r{args.raylets - 1}e"))
    out["create_errors"] = _errors(res)
    out.update(m.per(made, "create"))
    for action in ("pause", "resume", "kill"):
        with Meter(acct, pg) as m:
            done = clients.one(("job", "job", action))
        out[action] = {**done, **m.per(max(1, done["outcomes"]), action)}
    print(
        f"job of {args.job:,d}: created {made:,d} in {out['create_s']:.1f} s "
        + (f"(burst pool {out['placed']['burst']:,d}) " if args.burst else "")
        + f"({out['create_per_s']:.0f}/s, {out['create_cpu_ms_total']:.2f} ms CPU each); "
        + "; ".join(
            f"{a} {out[a]['s']:.1f} s ({out[a]['failed']} failed)"
            for a in ("pause", "resume", "kill")
        ),
        flush=True,
    )
    return out


def _metric(url: str, prefix: str) -> float:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError):
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
    return float("nan")


def coalesced(urls: list[str]) -> tuple[float, float]:
    """(calls, single creations they carried) of the replicas' coalescing so far."""
    calls = sum(_metric(u, "dsec_cluster_coalesced_calls_total") for u in urls)
    items = sum(_metric(u, "dsec_cluster_coalesced_creations_total") for u in urls)
    return (calls, items) if calls == calls else (0.0, 0.0)  # NaN: not coalescing


def _edges_live(url: str, api_key: str) -> int:
    """Live sandboxes of the live edges, as their last reports say."""
    import httpx

    r = httpx.get(f"{url}/v1/node", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    return int(r.json()["sandboxes"])


def _registry_live(pg: Postgres) -> int:
    with pg.connect() as c:
        row = c.execute(
            "SELECT count(*) FROM dsec_sandboxes WHERE state IN ('creating','running','paused')"
        ).fetchone()
    return int(row[0])


def _errors(results: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            out[k] = out.get(k, 0) + v
    return out


def run_faults(args: argparse.Namespace, cell: Cell, clients: Clients, pg: Postgres) -> dict:
    """Faults while clients work: a Ray node (and its edges) killed during a job's
    creation; an apiserver replica killed while the other one's clients create; PostgreSQL
    restarted (immediate) during creations. Counts what the clients saw and what was lost
    or duplicated."""
    out: dict[str, Any] = {}
    idxs = list(range(len(clients.conns)))
    url0 = cell.urls[0]
    # 1. a node lost during a job
    name, victim = sorted(cell.workers.items())[0 if args.burst else -1]  # not the burst pool
    n = args.fault_job
    clients.send(idxs, [("fill", k, 2, 256, "faults") for k in split(n, len(idxs))])
    time.sleep(args.fault_after_s)
    t_kill = time.monotonic()
    cell.cluster.remove_node(victim, allow_graceful=False)
    del cell.workers[name]
    res = clients.recv(idxs)
    lost_s = float("nan")
    while time.monotonic() - t_kill < 60:
        if _metric(url0, 'dsec_cluster_nodes{state="lost"}') >= cell.per_node:
            lost_s = time.monotonic() - t_kill
            break
        time.sleep(0.1)
    time.sleep(args.settle_s + 2)
    after = clients.all([("create", k, 4, "faults-after") for k in split(200, len(idxs))])
    kills = clients.all([("kill", 4)] * len(idxs))
    states = clients.one(("joblist", "faults"))
    pause = clients.one(("job", "faults", "pause"))
    out["node_loss"] = {
        "ray_node": name,
        "edges_on_it": cell.per_node,
        "job_n": n,
        "job_created": sum(r["created"] for r in res),
        "job_errors": _errors(res),
        "reported_lost_after_s": lost_s,
        "job_states_after": states,
        "job_pause_after": pause,
        "creates_after_ok": sum(len(r["latencies_ms"]) for r in after),
        "creates_after_errors": _errors(after),
        "kills_after_errors": _errors(kills),
    }
    print(f"fault: node {name} lost: {out['node_loss']}", flush=True)
    # 2. a replica killed: the clients of the other one see nothing
    if len(cell.replicas) > 1:
        mine = [i for i in idxs if i % len(cell.urls) == 0]
        clients.send(mine, [("create", 300, 4, "faults-replica")] * len(mine))
        time.sleep(1.0)
        cell.replicas[1].kill()
        res = clients.recv(mine)
        kills = clients.all_of(mine, ("kill", 4))
        out["replica_kill"] = {
            "creates_ok": sum(len(r["latencies_ms"]) for r in res),
            "create_errors_seen_by_the_other_replicas_clients": _errors(res),
            "kill_errors": _errors(kills),
        }
        print(f"fault: replica killed: {out['replica_kill']}", flush=True)
    # 3. PostgreSQL restarted during creations
    mine = [i for i in idxs if i % len(cell.urls) == 0]
    time.sleep(args.settle_s + 2)
    live0, reg0 = _edges_live(url0, cell.api_key), _registry_live(pg)
    clients.send(mine, [("create", 300, 4, "faults-pg")] * len(mine))
    time.sleep(1.0)
    t0 = time.monotonic()
    pg.pg_ctl("restart")
    restart_s = time.monotonic() - t0
    res = clients.recv(mine)
    made = sum(len(r["latencies_ms"]) for r in res)
    time.sleep(3 * 2.0 + args.settle_s)  # reports catch the registry up
    live1, reg1 = _edges_live(url0, cell.api_key), _registry_live(pg)
    out["postgres_restart"] = {
        "restart_s": restart_s,
        "creates_ok": made,
        "create_errors": _errors(res),
        "edges_live_before": live0,
        "edges_live_after": live1,
        "registry_live_before": reg0,
        "registry_live_after": reg1,
        "lost_or_duplicated_on_edges": live1 - live0 - made,
        "registry_minus_edges_after": reg1 - live1,
    }
    print(f"fault: PostgreSQL restarted: {out['postgres_restart']}", flush=True)
    clients.all_of(mine, ("kill", 4))
    return out


def start_profile(args: argparse.Namespace, cell: Cell, name: str) -> list[Any]:
    if not args.profile:
        return []
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    targets = [(f"api{i}", p.pid) for i, p in enumerate(cell.replicas)]
    edges = sorted(pid for pid, (_, _, c) in _procs().items() if c.startswith("ray::EdgeActor"))
    targets += [("edge0", edges[0])] if edges else []
    for what, pid in targets:
        cmd = [args.py_spy, "record", "-p", str(pid), "-o", str(out / f"{name}-{what}.txt")]
        cmd += ["-f", "raw", "-r", "200", "--nonblocking"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def stop_profile(procs: list[Any]) -> None:
    import signal

    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(30)


def print_step(edges: int, s: dict[str, Any], flush: bool = False) -> None:
    cpu = " ".join(f"{c[:3]}={s[f'create_cpu_ms_{c}']:.2f}" for c in COMPONENTS)
    print(
        f"N={edges:3d} live={s['live']:>7,d} fill {s['fill_per_s'] or 0:7.0f}/s "
        f"({s['fill_cpu_ms_total']:.2f} ms) | create {s['create_per_s']:6.0f}/s "
        f"p50 {s['create_p50_ms']:6.1f} p99 {s['create_p99_ms']:7.1f} ms, CPU "
        f"{s['create_cpu_ms_total']:.2f} ms [{cpu}] pg {s['create_pg_statements']:.1f} st "
        f"{s['create_pg_rows_written']:.1f} rows | exec p50 {s['exec_p50_ms']:.1f} "
        f"{s['exec_cpu_ms_total']:.2f} ms | kill p50 {s['kill_p50_ms']:.1f} "
        f"{s['kill_cpu_ms_total']:.2f} ms | marginal create {s['create_cpu_ms_marginal']:.2f} "
        f"fill {s['fill_cpu_ms_marginal']:.2f} ms | idle "
        f"{sum(s[f'idle_cpu_per_s_{c}'] for c in COMPONENTS):.2f} cores | probe "
        f"{s['create_host_probe_s'] * 1000:.0f} ms | "
        f"{s.get('create_per_edge_call', 1.0):.1f} creations per edge call",
        flush=flush,
    )


def write_result(args: argparse.Namespace, sizes: list[dict[str, Any]]) -> None:
    result = {
        "label": args.label,
        "args": {k: v for k, v in vars(args).items() if k not in ("py_spy",)},
        "sizes": sizes,
        "target_cpu_ms_per_creation": 1.6,
        "median_create_cpu_ms_total": statistics.median(
            [s["create_cpu_ms_total"] for z in sizes for s in z["steps"]] or [float("nan")]
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="16,32,64", help="edge counts, comma-separated")
    ap.add_argument("--live", default="1000,10000,100000", help="live counts, comma-separated")
    ap.add_argument("--window", type=int, default=2000, help="single creations per window")
    ap.add_argument("--raylets", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight per client")
    ap.add_argument("--batch", type=int, default=1024, help="create_many batch while filling")
    ap.add_argument("--job", type=int, default=0, help="a job of this many after the steps")
    ap.add_argument("--faults", action="store_true", help="fault runs after the steps")
    ap.add_argument(
        "--burst", action="store_true", help="the last raylet a burst pool the job overflows to"
    )
    ap.add_argument("--fault-job", type=int, default=4000, help="the job a node loss hits")
    ap.add_argument("--fault-after-s", type=float, default=1.0)
    ap.add_argument("--idle-s", type=float, default=6.0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--budget-s", type=float, default=780.0, help="wall time per size")
    ap.add_argument(
        "--total-budget-s",
        type=float,
        default=720.0,
        help="no new step after this long (the run then tears down and writes its results)",
    )
    ap.add_argument("--min-free-mib", type=int, default=4096)
    ap.add_argument("--profile", help="py-spy raw profiles of the replicas per create window")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "/tmp/spy/bin/py-spy")
    ap.add_argument("--label", default="", help="a name for this run in the JSON")
    ap.add_argument("--out", default=str(RESULTS / "cell.json"))
    ap.add_argument("--quick", action="store_true", help="a functional smoke run")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.live, args.window, args.raylets = "4", "200", 100, 2
        args.replicas, args.clients, args.concurrency = 1, 2, 4
        args.idle_s, args.settle_s, args.job = 1.0, 0.5, 300
        if args.out == str(RESULTS / "cell.json"):
            args.out = str(RESULTS / "cell_quick.json")
    args.live = [int(x) for x in args.live.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("cell.py starts PostgreSQL as the postgres user: run it as root")
    base = Path(tempfile.mkdtemp(prefix="dsec-cell-"))
    os.chmod(base, 0o755)  # the postgres user reaches its data dir under it
    pg = Postgres.start(base / "pg", port=free_port(), stat_statements=True)
    sizes = []
    try:
        for n in (int(x) for x in args.nodes.split(",")):
            if time.monotonic() - RUN_START > args.total_budget_s:
                print(f"N={n} not run: the run's time budget is spent", flush=True)
                break
            with pg.connect() as c:  # each size starts from an empty registry
                c.execute(
                    "DO $$ BEGIN IF to_regclass('dsec_sandboxes') IS NOT NULL THEN "
                    "TRUNCATE dsec_sandboxes, dsec_nodes, dsec_jobs, dsec_api_keys; "
                    "END IF; END $$"
                )
            sizes.append(run_size(args, pg, n, base / f"n{n}"))
            write_result(args, sizes)  # what is measured is kept if a later size fails
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)
    write_result(args, sizes)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
