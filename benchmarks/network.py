"""Network benchmark: prints a table and writes benchmarks/results/network.json.

Measured in one run, on loopback-only infrastructure (dsec.network.testbed: namespaces
in 198.18.0.0/15 that play the internet; nothing leaves this node):
  * namespace setup time: a loopback-only netns (what ``network=None`` costs) vs a full
    NetworkManager.setup (netns + veth + routes + neighbours + filter elements), and teardown
  * resolver latency (p50/p99) from inside a sandbox: static record, cached upstream
    answer, uncached answer forwarded to the upstream in the "internet" namespace
    (each includes admitting the answer into the packet filter before replying)
  * connection setup rate and bulk TCP throughput to an allowed host, through the
    filtered sandbox path vs an unfiltered namespace routed the same way (A/B, same run)
  * filter update cost: one nftables set element (libnftables, in-process) vs one
    cgroup-BPF hash map update (raw bpf(2)), the two admission back-ends considered

Usage: sudo .venv/bin/python benchmarks/network.py [--quick]
Targets (issue 7): networking adds <= 10 ms to sandbox creation; resolver p50 <= 2 ms;
allowed-path throughput within 20% of the unfiltered veth.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsec.network import NetworkManager, NetworkPolicy, ResolverLimits
from dsec.network.dns import TYPE_A, build_query, parse_message
from dsec.network.testbed import DNS_ADDR, Testbed
from dsec.privileged.netns import create_netns, delete_netns, in_netns
from dsec.privileged.nft import Nftables

RESULTS = Path(__file__).resolve().parent / "results"
SUBNET = "10.223.0.0/16"
INTERNET_HOST = "198.18.0.2"
BULK_PORT = 5201


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def ms(x: float) -> float:
    return round(x * 1000, 3)


# ---- namespace setup ---------------------------------------------------------------


async def bench_setup(mgr: NetworkManager, root: Path, n: int) -> dict[str, Any]:
    bare, full, teardown = [], [], []
    for i in range(n):
        path = root / f"bare-{i}"
        t = time.perf_counter()
        create_netns(path)
        bare.append(time.perf_counter() - t)
        delete_netns(path)
    policy = NetworkPolicy(
        allow_domains=["*.bench.test"], allow_cidrs=["198.18.1.0/24"], ports=[80, 443]
    )
    for i in range(n):
        t = time.perf_counter()
        await mgr.setup(f"sb-setup-{i}", policy)
        full.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        await mgr.teardown(f"sb-setup-{i}")
        teardown.append(time.perf_counter() - t)
    return {
        "n": n,
        "loopback_only_netns_ms_p50": ms(pct(bare, 50)),
        "networked_setup_ms_p50": ms(pct(full, 50)),
        "networked_setup_ms_p90": ms(pct(full, 90)),
        "added_by_networking_ms_p50": ms(pct(full, 50) - pct(bare, 50)),
        "teardown_ms_p50": ms(pct(teardown, 50)),
    }


# ---- resolver ----------------------------------------------------------------------


def dns_latencies(netns: Path, server: str, names: list[str]) -> list[float]:
    """Sequential queries from a socket inside the sandbox; seconds per answer."""
    sock = in_netns(netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    sock.settimeout(2)
    sock.connect((server, 53))
    out = []
    try:
        for i, name in enumerate(names):
            t = time.perf_counter()
            sock.send(build_query(i & 0xFFFF, name, TYPE_A))
            data = sock.recv(2048)
            out.append(time.perf_counter() - t)
            if parse_message(data).rcode != 0:
                raise RuntimeError(f"resolver refused {name}")
    finally:
        sock.close()
    return out


async def bench_resolver(mgr: NetworkManager, n: int) -> dict[str, Any]:
    net = await mgr.setup("sb-dns", NetworkPolicy(allow_domains=["*.bench.test"]))
    gw = net.gateway
    static = await asyncio.to_thread(dns_latencies, net.netns_path, gw, ["mirror.bench.test"] * n)
    await asyncio.to_thread(dns_latencies, net.netns_path, gw, ["h0.bench.test"])  # warm cache
    cached = await asyncio.to_thread(dns_latencies, net.netns_path, gw, ["h0.bench.test"] * n)
    fresh_names = [f"h{i}.bench.test" for i in range(1, n + 1)]
    forwarded = await asyncio.to_thread(dns_latencies, net.netns_path, gw, fresh_names)
    await mgr.teardown("sb-dns")
    return {
        "n": n,
        "static_ms_p50": ms(pct(static, 50)),
        "static_ms_p99": ms(pct(static, 99)),
        "cached_ms_p50": ms(pct(cached, 50)),
        "cached_ms_p99": ms(pct(cached, 99)),
        "forwarded_ms_p50": ms(pct(forwarded, 50)),
        "forwarded_ms_p99": ms(pct(forwarded, 99)),
    }


# ---- connections and throughput -----------------------------------------------------


def connect_rate(netns: Path, address: str, port: int, seconds: float) -> float:
    """Connections per second (connect, read the banner, close), sequential."""

    def run() -> float:
        done = 0
        end = time.perf_counter() + seconds
        start = time.perf_counter()
        while time.perf_counter() < end:
            with socket.create_connection((address, port), timeout=2) as s:
                s.recv(64)
            done += 1
        return done / (time.perf_counter() - start)

    return in_netns(netns, run)


class BulkServer:
    """In the internet namespace: each connection gets ``seconds`` of 1 MiB writes."""

    def __init__(self, netns: Path, port: int, seconds: float) -> None:
        self.seconds = seconds

        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(8)
            return s

        self.sock = in_netns(netns, make)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        chunk = b"\0" * (1 << 20)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                end = time.perf_counter() + self.seconds
                try:
                    while time.perf_counter() < end:
                        conn.sendall(chunk)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def download_gbit(netns: Path, address: str, port: int) -> float:
    def run() -> float:
        buf = bytearray(1 << 20)
        total = 0
        with socket.create_connection((address, port), timeout=5) as s:
            start = time.perf_counter()
            while True:
                n = s.recv_into(buf)
                if not n:
                    break
                total += n
            elapsed = time.perf_counter() - start
        return total * 8 / elapsed / 1e9

    return in_netns(netns, run)


async def bench_paths(
    mgr: NetworkManager, tb: Testbed, seconds: float, rounds: int
) -> dict[str, Any]:
    net = await mgr.setup(
        "sb-bulk", NetworkPolicy(allow_cidrs=[f"{INTERNET_HOST}/32"], ports=[80, BULK_PORT])
    )
    plain = tb.ns["plain"]
    server = BulkServer(tb.ns["inet"], BULK_PORT, seconds)
    rates: dict[str, list[float]] = {"filtered": [], "unfiltered": []}
    gbit: dict[str, list[float]] = {"filtered": [], "unfiltered": []}
    try:
        for _ in range(rounds):  # alternate A/B so drift on a shared machine hits both
            for label, ns in (("filtered", net.netns_path), ("unfiltered", plain)):
                rates[label].append(
                    await asyncio.to_thread(connect_rate, ns, INTERNET_HOST, 80, seconds)
                )
                gbit[label].append(
                    await asyncio.to_thread(download_gbit, ns, INTERNET_HOST, BULK_PORT)
                )
    finally:
        server.close()
        await mgr.teardown("sb-bulk")
    med = {k: statistics.median(v) for k, v in gbit.items()}
    return {
        "seconds_per_sample": seconds,
        "rounds": rounds,
        "connections_per_s_filtered": round(statistics.median(rates["filtered"])),
        "connections_per_s_unfiltered": round(statistics.median(rates["unfiltered"])),
        "throughput_gbit_filtered": round(med["filtered"], 2),
        "throughput_gbit_unfiltered": round(med["unfiltered"], 2),
        "throughput_ratio": round(med["filtered"] / med["unfiltered"], 3),
    }


# ---- filter update back-ends ----------------------------------------------------------

_SYS_BPF = 321  # x86_64


def bpf_map_update_us(n: int) -> float | None:
    """Median microseconds of BPF_MAP_UPDATE_ELEM on a hash map keyed (sandbox, dst)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = ctypes.create_string_buffer(struct.pack("=IIIII", 1, 8, 8, 65536, 0) + b"\0" * 100)
    fd = libc.syscall(_SYS_BPF, 0, attr, len(attr))  # BPF_MAP_CREATE, BPF_MAP_TYPE_HASH
    if fd < 0:
        return None
    key = ctypes.create_string_buffer(8)
    value = ctypes.create_string_buffer(struct.pack("=Q", 123))
    times = []
    try:
        for i in range(n):
            struct.pack_into("=II", key, 0, 0x0ADF0002, 0xC6120000 + i)
            upd = ctypes.create_string_buffer(
                struct.pack("=IIQQQ", fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0)
                + b"\0" * 80
            )
            t = time.perf_counter()
            rc = libc.syscall(_SYS_BPF, 2, upd, len(upd))  # BPF_MAP_UPDATE_ELEM
            times.append(time.perf_counter() - t)
            if rc != 0:
                return None
    finally:
        os.close(fd)
    return round(statistics.median(times) * 1e6, 2)


def nft_element_add_us(n: int, sets: int) -> float:
    """Median microseconds of one 'add element' with a timeout, in a table of ``sets`` sets."""
    nft = Nftables()
    table = "dsec_bench_upd"
    try:
        nft.run(f"add table inet {table}\ndelete table inet {table}")
        script = [f"add table inet {table}"]
        script.append(
            f"add set inet {table} dyn {{ type ipv4_addr . ipv4_addr; flags timeout; size 262144; }}"
        )
        for j in range(sets - 1):
            script.append(f"add set inet {table} s{j} {{ type ipv4_addr; flags interval; }}")
        nft.run("\n".join(script))
        times = []
        for i in range(n):
            cmd = f"add element inet {table} dyn {{ 10.223.0.2 . 198.18.{i // 250}.{i % 250} timeout 60s }}"
            t = time.perf_counter()
            nft.run(cmd)
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) * 1e6, 2)
    finally:
        nft.run(f"add table inet {table}\ndelete table inet {table}")
        nft.close()


# ---- main ---------------------------------------------------------------------------


async def main(quick: bool) -> dict[str, Any]:
    n = 15 if quick else 40
    root = Path(tempfile.mkdtemp(prefix="dsec-bench-network-"))
    tb = Testbed(root / "tb", ttl=300)
    for i in range(4 * n + 2):
        tb.zone.records[f"h{i}.bench.test"] = [f"198.18.0.{2 + i % 8}"]
    mgr = NetworkManager(
        root / "net",
        upstream_dns=[DNS_ADDR],
        static_records={"mirror.bench.test": ["198.18.1.2"]},
        subnet=SUBNET,
        # sequential back-to-back queries: lift the per-sandbox rate limits out of the way
        limits=ResolverLimits(queries_per_s=1e6, burst=1_000_000),
        dns_packets_per_s=1_000_000,
    )
    await tb.start()
    await mgr.start()
    try:
        setup = await bench_setup(mgr, root, n)
        resolver = await bench_resolver(mgr, 4 * n)
        paths = await bench_paths(mgr, tb, 0.5, 3 if quick else 9)
    finally:
        for sandbox_id in list(mgr.sandbox_ids()):
            await mgr.teardown(sandbox_id)
        await mgr.close()
        await tb.close()
        shutil.rmtree(root, ignore_errors=True)
    updates = {
        "nft_element_add_us_p50": await asyncio.to_thread(nft_element_add_us, 200, 10),
        "bpf_map_update_us_p50": await asyncio.to_thread(bpf_map_update_us, 200),
    }
    return {
        "setup": setup,
        "resolver": resolver,
        "paths": paths,
        "filter_updates": updates,
        "targets": {
            "added_by_networking_ms_p50<=10": setup["added_by_networking_ms_p50"] <= 10,
            "resolver_p50_ms<=2": max(resolver["static_ms_p50"], resolver["cached_ms_p50"]) <= 2,
            "throughput_within_20pct": paths["throughput_ratio"] >= 0.8,
        },
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "quick": quick,
    }


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("netns, loopback only (network=None)", f"{r['setup']['loopback_only_netns_ms_p50']} ms"),
        (
            "netns + veth + filter (setup p50/p90)",
            f"{r['setup']['networked_setup_ms_p50']} / {r['setup']['networked_setup_ms_p90']} ms",
        ),
        (
            "  added by networking (p50)",
            f"{r['setup']['added_by_networking_ms_p50']} ms  (target <= 10)",
        ),
        ("teardown (p50)", f"{r['setup']['teardown_ms_p50']} ms"),
        (
            "resolver, static record p50/p99",
            f"{r['resolver']['static_ms_p50']} / {r['resolver']['static_ms_p99']} ms  (target p50 <= 2)",
        ),
        (
            "resolver, cached upstream p50/p99",
            f"{r['resolver']['cached_ms_p50']} / {r['resolver']['cached_ms_p99']} ms",
        ),
        (
            "resolver, forwarded upstream p50/p99",
            f"{r['resolver']['forwarded_ms_p50']} / {r['resolver']['forwarded_ms_p99']} ms",
        ),
        (
            "connections/s filtered vs unfiltered",
            f"{r['paths']['connections_per_s_filtered']} vs {r['paths']['connections_per_s_unfiltered']}",
        ),
        (
            "throughput filtered vs unfiltered",
            f"{r['paths']['throughput_gbit_filtered']} vs {r['paths']['throughput_gbit_unfiltered']} Gbit/s (ratio {r['paths']['throughput_ratio']}, target >= 0.8)",
        ),
        (
            "filter update: nft element / bpf map",
            f"{r['filter_updates']['nft_element_add_us_p50']} / {r['filter_updates']['bpf_map_update_us_p50']} us",
        ),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    print("targets:", ", ".join(f"{k}={'ok' if v else 'MISSED'}" for k, v in r["targets"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (CI smoke run)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces, nftables)")
    result = asyncio.run(main(args.quick))
    print_table(result)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "network.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
