"""Images from anywhere (issue 17, "Must show"): prints a table, writes
benchmarks/results/images.json.

One image, two formats, the same content: the ``debian`` image's root filesystem (the
shared test layer cache's layer, extracted) plus a layer holding ``/data/blob.bin``, ~900 MB
of incompressible bytes (``--quick``: 128 MiB). It is stored in Debian's
``docker-registry`` on loopback (its own config in a temp dir, storage cached under
``--work``, default /var/tmp/dsec-bench-images, so reruns skip the preparation) as

* ``bench/plain:<tag>``: a plain OCI image (tar.gz layers, made by this script: ``tar`` and
  ``gzip -1`` of the two trees), what podman reads, and
* ``bench/lazy:<tag>``: the same image as a dsec artifact (``dsec.layers.publish.push_image``
  of that OCI image converted by dsec: EROFS layers with chunk tables).

Every pull goes through a token-bucket throttling TCP proxy (asyncio, in a child process of
this script) in front of the registry: ``--rate`` (100 MB/s) shared by all connections,
server to client; the proxy logs every HTTP request it forwards. Page cache is dropped
before each cold phase. ``dsec serve`` runs as a child process (``ServeProcess``,
``DSEC_SHORT_NAME_REGISTRY=none``), with a fresh ``DSEC_HOME`` and an empty layer store
wherever the phase must be cold.

Phases, in one run (``--repeat`` N: medians over N rounds, the three clients interleaved):

1. first create to first exec (``cat /etc/debian_version; stat -c %s /data/blob.bin``) of
   the uncached image, by reference (``image="127.0.0.1:PORT/bench/...:tag"``):
   * dsec lazy: the dsec artifact, layers attached lazily (range reads on demand);
   * dsec from the plain OCI image: full pull + conversion to EROFS, then the create;
   * podman: ``podman pull`` + ``podman run --rm`` of the plain OCI image (private
     ``--root``/``--runroot``/``--tmpdir``, a registries.conf marking the proxy insecure,
     runc, no network). Target (the full 1 GB image; ``--quick``'s 0.2 GB is for checking
     the script): dsec lazy >= 5x faster than podman.
2. a 3-step build with the SDK builder (``Image.from_image("debian").run(..).env(..)
   .run(..)``, ``build_async`` over HTTP) on a fresh node (build cache empty), then the same
   build fully cached (median of 5). Target: cached rebuild <= 1 s.
3. 32 concurrent creates (+ first exec each) of one new, never pulled reference (a fresh
   tag of the dsec artifact) on a fresh node: wall time, and the requests the proxy saw for
   that tag: exactly one manifest GET (one pull).

Each phase also records benchmarks/hostprobe.py's reading (seconds for a fixed CPU job;
~11 ms at full speed) taken just before it.

Usage (root): .venv/bin/python benchmarks/images.py [--quick] [--repeat N] [--rate 100e6]
    [--data-mib 900] [--concurrent 32] [--work DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402

from dsec import AsyncClient, AsyncSandbox, Image  # noqa: E402
from dsec.builds.wire import BuildDone  # noqa: E402
from dsec.layers.mounts import mountinfo_entries  # noqa: E402
from dsec.server import ServeProcess  # noqa: E402
from hostprobe import host_probe_s  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHARED_CACHE = Path(os.environ.get("DSEC_TEST_LAYER_CACHE", "/var/cache/dsec-test-layers"))
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
FIRST_EXEC = "cat /etc/debian_version; stat -c %s /data/blob.bin"


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def unmount_under(path: Path) -> None:
    """Unmount everything at or below ``path``, deepest first (lazy: busy mounts go too)."""
    for e in sorted(mountinfo_entries(path), key=lambda e: -len(e.mountpoint.parts)):
        subprocess.run(["umount", "-l", str(e.mountpoint)], check=False, capture_output=True)


# --- the throttling proxy ------------------------------------------------------------------


class TokenBucket:
    """``rate`` bytes/s shared by every caller, bursts of at most ``burst`` bytes; a taker
    that overdraws sleeps the debt off (FIFO by the lock), so the long-run rate is exact."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


async def _proxy_serve(upstream: int, rate: float, log_path: str, port_out: Any, down: Any) -> None:
    bucket = TokenBucket(rate, burst=256 * 1024)
    log = open(log_path, "a", buffering=1)

    async def to_client(ur: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        while data := await ur.read(256 * 1024):
            await bucket.take(len(data))
            cw.write(data)
            await cw.drain()
            with down.get_lock():
                down.value += len(data)

    async def to_upstream(cr: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
        buf, body_left = b"", 0
        while data := await cr.read(65536):
            uw.write(data)
            await uw.drain()
            buf += data
            while True:  # log each request head (pulls send GET/HEAD; bodies are skipped)
                if body_left:
                    k = min(body_left, len(buf))
                    buf, body_left = buf[k:], body_left - k
                    if body_left:
                        break
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    break
                lines = buf[:i].decode("latin-1").split("\r\n")
                buf = buf[i + 4 :]
                method, path = [*lines[0].split(" "), "", ""][:2]
                hdr = {
                    k.strip().lower(): v.strip()
                    for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)
                }
                body_left = int(hdr.get("content-length") or 0)
                rec = {"t": time.time(), "m": method, "p": path, "range": hdr.get("range", "")}
                log.write(json.dumps(rec) + "\n")
        with contextlib.suppress(OSError):
            uw.write_eof()

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(to_client(ur, cw), to_upstream(cr, uw))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (cw, uw):
                with contextlib.suppress(Exception):
                    w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20, backlog=512)
    port_out.send(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def _proxy_main(upstream: int, rate: float, log_path: str, port_out: Any, down: Any) -> None:
    asyncio.run(_proxy_serve(upstream, rate, log_path, port_out, down))


class ThrottleProxy:
    """The proxy as a child process (its own GIL): ``port``, ``bytes_down`` (bytes sent to
    clients so far) and ``requests(since)`` (request heads logged after time ``since``)."""

    def __init__(self, upstream: int, rate: float, work: Path) -> None:
        ctx = multiprocessing.get_context("fork")
        self.log = work / "proxy-requests.jsonl"
        self.log.write_text("")
        self._down = ctx.Value("q", 0)
        recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_proxy_main, args=(upstream, rate, str(self.log), send, self._down)
        )
        self.proc.start()
        if not recv.poll(10):
            self.stop()
            raise RuntimeError("the throttling proxy did not start")
        self.port = int(recv.recv())

    @property
    def bytes_down(self) -> int:
        return int(self._down.value)

    def requests(self, since: float) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            rec = json.loads(line)
            if rec["t"] >= since:
                out.append(rec)
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


# --- the registry and the image --------------------------------------------------------------


class Registry:
    """Debian's ``docker-registry`` on a loopback port; config and log in ``tmp``, blobs in
    ``storage`` (kept between runs)."""

    def __init__(self, tmp: Path, storage: Path) -> None:
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = tmp / "registry.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {storage}\n"
            f"http:\n  addr: {self.host}\n"
        )
        self._log = open(tmp / "registry.log", "wb")
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while True:
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start; see {tmp / 'registry.log'}")
            time.sleep(0.05)

    def has_blob(self, repo: str, digest: str) -> bool:
        r = httpx.head(f"http://{self.host}/v2/{repo}/blobs/{digest}", timeout=10)
        return r.status_code == 200

    def put_blob_file(self, repo: str, path: Path, digest: str) -> None:
        if self.has_blob(repo, digest):
            return
        base = f"http://{self.host}/v2/{repo}"
        with httpx.Client(timeout=600) as c:
            r = c.post(f"{base}/blobs/uploads/")
            r.raise_for_status()
            loc = httpx.URL(f"http://{self.host}").join(r.headers["location"])

            def chunks() -> Iterator[bytes]:
                with open(path, "rb") as f:
                    while b := f.read(4 << 20):
                        yield b

            r = c.put(
                loc.copy_add_param("digest", digest),
                content=chunks(),
                headers={"Content-Length": str(path.stat().st_size)},
            )
            if r.status_code != 201:
                raise RuntimeError(f"blob upload failed: {r.status_code} {r.text}")

    def get_manifest(self, repo: str, tag: str) -> tuple[str, bytes] | None:
        accept = f"{MT_MANIFEST}, application/vnd.docker.distribution.manifest.v2+json"
        r = httpx.get(
            f"http://{self.host}/v2/{repo}/manifests/{tag}", headers={"Accept": accept}, timeout=10
        )
        if r.status_code != 200:
            return None
        return r.headers["content-type"], r.content

    def put_manifest(self, repo: str, tag: str, media_type: str, body: bytes) -> None:
        r = httpx.put(
            f"http://{self.host}/v2/{repo}/manifests/{tag}",
            content=body,
            headers={"Content-Type": media_type},
            timeout=30,
        )
        if r.status_code != 201:
            raise RuntimeError(f"manifest upload failed: {r.status_code} {r.text}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class _Random:
    """A file-like of ``n`` random bytes (for tarfile.addfile)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def read(self, k: int = -1) -> bytes:
        k = self.left if k < 0 else min(k, self.left)
        self.left -= k
        return os.urandom(k)


def gzip_file(src: Path, dst: Path) -> None:
    with open(dst, "wb") as out:
        subprocess.run(["gzip", "-1", "-n", "-c", str(src)], stdout=out, check=True)


def debian_layer_tar(work: Path) -> Path:
    """The shared cache's ``debian`` root filesystem as a tar (extracted with fsck.erofs)."""
    tar = work / "debian.tar"
    if tar.exists():
        return tar
    from dsec.layers.store import LayerStore

    store = LayerStore(SHARED_CACHE, SHARED_CACHE.parent / "dsec-test-images")
    try:
        image = store.ensure_image_sync("debian")
        paths = [store.layer_path(d) for d in image.layers]
    finally:
        store.close()
    if len(paths) != 1:
        raise RuntimeError(f"expected a one-layer debian image, got {len(paths)} layers")
    tree = work / "debian-tree"
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(
        ["fsck.erofs", f"--extract={tree}", "--preserve", str(paths[0])],
        check=True,
        capture_output=True,
    )
    tmp = work / "debian.tar.tmp"
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(tree), "-cf", str(tmp), "."], check=True
    )
    shutil.rmtree(tree)
    os.rename(tmp, tar)
    return tar


def data_layer_tar(work: Path, mib: int) -> Path:
    tar = work / f"data-{mib}.tar"
    if tar.exists():
        return tar
    tmp = work / "data.tar.tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        d = tarfile.TarInfo("data")
        d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
        tf.addfile(d)
        f = tarfile.TarInfo("data/blob.bin")
        f.size, f.mode, f.mtime = mib << 20, 0o644, 1_700_000_000
        tf.addfile(f, _Random(f.size))
    os.rename(tmp, tar)
    return tar


def prepare_image(work: Path, reg: Registry, mib: int) -> dict[str, Any]:
    """Make (once; cached in ``work`` and the registry's storage) the plain OCI image
    ``bench/plain:m<mib>`` and the dsec artifact ``bench/lazy:m<mib>`` of the same content."""
    tag = f"m{mib}"
    stamp = work / f"ready-{tag}.json"
    if (
        stamp.exists()
        and reg.get_manifest("bench/lazy", tag)
        and reg.get_manifest("bench/plain", tag)
    ):
        return dict(json.loads(stamp.read_text()))
    print(f"preparing the image ({mib} MiB of data; cached in {work}) ...", flush=True)
    layers: list[dict[str, Any]] = []
    for tar in (debian_layer_tar(work), data_layer_tar(work, mib)):
        gz = tar.with_suffix(".tar.gz")
        if not gz.exists():
            gzip_file(tar, gz.with_suffix(".tmp"))
            os.rename(gz.with_suffix(".tmp"), gz)
        diff_id, digest = sha256_file(tar), sha256_file(gz)
        reg.put_blob_file("bench/plain", gz, digest)
        layers.append({"mediaType": MT_LAYER_GZIP, "digest": digest, "size": gz.stat().st_size})
        layers[-1]["_diff_id"] = diff_id
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Cmd": ["bash"],
        },
        "rootfs": {"type": "layers", "diff_ids": [x.pop("_diff_id") for x in layers]},
    }
    cfg = json.dumps(config, sort_keys=True).encode()
    cfg_path = work / "config.json"
    cfg_path.write_bytes(cfg)
    cfg_digest = "sha256:" + hashlib.sha256(cfg).hexdigest()
    reg.put_blob_file("bench/plain", cfg_path, cfg_digest)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": {"mediaType": MT_CONFIG, "digest": cfg_digest, "size": len(cfg)},
        "layers": layers,
    }
    reg.put_manifest("bench/plain", tag, MT_MANIFEST, json.dumps(manifest).encode())
    # the same image as a dsec artifact: dsec's own conversion of it, pushed with chunk tables
    from dsec.layers.oci import pull_image
    from dsec.layers.publish import push_image
    from dsec.layers.store import LayerStore

    conv = work / "convert-store"
    shutil.rmtree(conv, ignore_errors=True)
    store = LayerStore(conv / "layers", conv / "images")
    try:
        pull_image(store, f"{reg.host}/bench/plain:{tag}", name="benchimg", timeout_s=600)
        push_image(store, "benchimg", f"oci://{reg.host}/bench/lazy:{tag}")
        erofs_bytes = sum(store.get_layer(d).size for d in store.get_image("benchimg").layers)
    finally:
        store.close()
        unmount_under(conv)
        shutil.rmtree(conv, ignore_errors=True)
    sizes = [int(x["size"]) for x in layers]
    info = {
        "tag": tag,
        "data_mib": mib,
        "plain_oci_bytes": sum(sizes) + len(cfg),
        "plain_oci_layers": sizes,
        "dsec_artifact_erofs_bytes": erofs_bytes,
    }
    stamp.write_text(json.dumps(info, indent=2) + "\n")
    for tar in (work / "debian.tar", work / f"data-{mib}.tar"):  # in the registry now
        tar.unlink(missing_ok=True)
        tar.with_suffix(".tar.gz").unlink(missing_ok=True)
    return info


# --- phase 1: first create to first exec ------------------------------------------------------


def serve_env() -> dict[str, str]:
    return {"DSEC_SHORT_NAME_REGISTRY": "none"}


def stop_node(home: Path) -> None:
    from dsec.layers.lazy import LazyServer

    lazy_dir = home / "layers" / "lazy"
    if lazy_dir.is_dir() and not (home / "layers").is_symlink():
        with contextlib.suppress(Exception):
            LazyServer(lazy_dir).shutdown()  # the node's FUSE server outlives `dsec serve`
    unmount_under(home)


@contextlib.contextmanager
def cold_node(homes: Path, name: str, *, shared_layers: bool = False) -> Iterator[ServeProcess]:
    """``dsec serve`` on a fresh DSEC_HOME (empty layer store unless ``shared_layers``)."""
    home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=homes))
    cache = SHARED_CACHE if shared_layers else home / "no-shared-layers"
    try:
        with ServeProcess(home, env=serve_env(), layer_cache=cache) as srv:
            yield srv
    finally:
        stop_node(home)
        shutil.rmtree(home, ignore_errors=True)


async def create_and_exec(srv: ServeProcess, ref: str, n: int = 1) -> tuple[float, list[str]]:
    """Seconds from the first create until every one of ``n`` sandboxes has run FIRST_EXEC;
    their outputs."""
    t0 = time.perf_counter()

    async def one() -> tuple[Any, str]:
        sb = await AsyncSandbox.create(
            image=ref,
            cpu=0.25,
            memory_mb=128,
            url=srv.url,
            api_key=srv.api_key,
            timeout=1800,
        )
        r = await sb.commands.run(["sh", "-c", FIRST_EXEC], timeout=600)
        if r.exit_code != 0:
            raise RuntimeError(f"first exec failed: {r.exit_code} {r.stdout!r} {r.stderr!r}")
        return sb, r.stdout

    made = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    took = time.perf_counter() - t0
    await asyncio.gather(
        *(m[0].kill() for m in made if isinstance(m, tuple)), return_exceptions=True
    )
    errors = [m for m in made if isinstance(m, BaseException)]
    if errors:
        raise errors[0]
    return took, [m[1] for m in made if isinstance(m, tuple)]


def dsec_first_create(homes: Path, proxy: ThrottleProxy, ref: str, label: str) -> dict[str, Any]:
    with cold_node(homes, label) as srv:
        drop_page_cache()
        down0, since = proxy.bytes_down, time.time()
        took, outs = asyncio.run(create_and_exec(srv, ref))
        fetched = proxy.bytes_down - down0
        reqs = len(proxy.requests(since))
    return {"s": took, "bytes_fetched": fetched, "requests": reqs, "stdout": outs[0]}


class Podman:
    """podman with every piece of its state in ``root`` (storage, run root, tmp dir,
    registries/containers/storage confs); the proxy's address marked insecure."""

    def __init__(self, root: Path, registry_host: str) -> None:
        self.root = root
        for d in ("storage", "run", "tmp", "net", "tmpfiles"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "registries.conf").write_text(
            "unqualified-search-registries = []\n\n[[registry]]\n"
            f'location = "{registry_host}"\ninsecure = true\n'
        )
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root / "storage"}"\n'
            f'runroot = "{root / "run"}"\n'
        )
        (root / "containers.conf").write_text(
            '[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "none"\nruntime = "runc"\n'
        )
        self.env = {
            **os.environ,
            "CONTAINERS_REGISTRIES_CONF": str(root / "registries.conf"),
            "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
            "CONTAINERS_CONF": str(root / "containers.conf"),
            "TMPDIR": str(root / "tmpfiles"),
        }
        self.base = [
            "podman",
            "--root",
            str(root / "storage"),
            "--runroot",
            str(root / "run"),
            "--tmpdir",
            str(root / "tmp"),
            "--storage-driver",
            "overlay",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "none",
            "--network-config-dir",
            str(root / "net"),
        ]

    def run(self, *args: str, timeout: float = 1800) -> str:
        r = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if r.returncode != 0:
            raise RuntimeError(f"podman {args[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r.stdout

    def clean(self) -> None:
        with contextlib.suppress(Exception):
            self.run("rm", "-af", timeout=120)
        unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def podman_first_create(homes: Path, proxy: ThrottleProxy, ref: str) -> dict[str, Any]:
    # podman refuses a run root path over 50 characters: a short directory of its own
    pm = Podman(Path(tempfile.mkdtemp(prefix="dsbpm-", dir="/tmp")), f"127.0.0.1:{proxy.port}")
    try:
        drop_page_cache()
        down0, since = proxy.bytes_down, time.time()
        t0 = time.perf_counter()
        pm.run("pull", "--tls-verify=false", "-q", ref)
        t_pull = time.perf_counter() - t0
        out = pm.run(
            "run",
            "--rm",
            "--runtime",
            "runc",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=4096:4096",
            "--network",
            "none",
            "--pull",
            "never",
            ref,
            "sh",
            "-c",
            FIRST_EXEC,
        )
        took = time.perf_counter() - t0
        fetched = proxy.bytes_down - down0
        reqs = len(proxy.requests(since))
    finally:
        pm.clean()
    return {"s": took, "pull_s": t_pull, "bytes_fetched": fetched, "requests": reqs, "stdout": out}


# --- phase 2: a 3-step build ----------------------------------------------------------------


def bench_image(nonce: str) -> Image:
    return (
        Image.from_image("debian")
        .run(f"echo 'bench {nonce}' > /etc/bench-step1")
        .env({"BENCH_MODE": "cached"})
        .run("python3 -c 'import json, os; print(json.dumps(dict(os.environ)))' > /bench.json")
    )


async def build_phase(srv: ServeProcess, cached_rounds: int) -> dict[str, Any]:
    image = bench_image(secrets.token_hex(4))
    done: list[BuildDone] = []

    def on_event(ev: Any) -> None:
        if isinstance(ev, BuildDone):
            done.append(ev)

    async with AsyncClient(srv.url, srv.api_key) as client:
        t0 = time.perf_counter()
        await image.build_async("bench-build:1", client=client, on_event=on_event)
        cold = time.perf_counter() - t0
        if len(done) != 1 or (done[0].built_steps, done[0].cached_steps) != (2, 0):
            raise RuntimeError(f"the cold build was not cold: {done}")
        cached = []
        for _ in range(cached_rounds):
            done.clear()
            t0 = time.perf_counter()
            await image.build_async("bench-build:1", client=client, on_event=on_event)
            cached.append(time.perf_counter() - t0)
            if len(done) != 1 or (done[0].built_steps, done[0].cached_steps) != (0, 2):
                raise RuntimeError(f"the cached build was not fully cached: {done}")
        sb = await AsyncSandbox.create(image="bench-build:1", client=client)
        try:
            r = await sb.commands.run(["sh", "-c", "cat /etc/bench-step1; echo $BENCH_MODE"])
        finally:
            await sb.kill()
    if "cached" not in r.stdout or "bench" not in r.stdout:
        raise RuntimeError(f"the built image is wrong: {r.stdout!r} {r.stderr!r}")
    return {"cold_s": cold, "cached_s": cached}


# --- phase 3: concurrent creates of one new reference ---------------------------------------


def concurrent_phase(
    homes: Path, proxy: ThrottleProxy, reg: Registry, tag: str, n: int
) -> dict[str, Any]:
    fresh = f"c{secrets.token_hex(4)}"
    got = reg.get_manifest("bench/lazy", tag)
    assert got is not None
    reg.put_manifest("bench/lazy", fresh, *got)  # a new tag: a never pulled reference
    ref = f"127.0.0.1:{proxy.port}/bench/lazy:{fresh}"
    with cold_node(homes, "concurrent") as srv:
        drop_page_cache()
        down0, since = proxy.bytes_down, time.time()
        took, outs = asyncio.run(create_and_exec(srv, ref, n))
        fetched = proxy.bytes_down - down0
        reqs = proxy.requests(since)
    return {
        "sandboxes": n,
        "wall_s": took,
        "all_outputs_equal": len(set(outs)) == 1,
        "bytes_fetched": fetched,
        **pull_evidence(reqs, fresh, layer_blobs(got[1])),
    }


def layer_blobs(manifest: bytes) -> set[str]:
    """The dsec layer digests of a dsec artifact manifest (not its chunk tables)."""
    from dsec.layers.publish import LAYER_MEDIA_TYPE

    doc = json.loads(manifest)
    return {str(d["digest"]) for d in doc["layers"] if d.get("mediaType") == LAYER_MEDIA_TYPE}


def pull_evidence(reqs: list[dict[str, Any]], tag: str, layers: set[str]) -> dict[str, Any]:
    """What the proxy's request log says about the pulls of ``tag``: a pull GETs the tag's
    manifest once and the image config once (the other creates wait for that pull), and
    the sandboxes share one copy of the layers: no byte range of a layer is fetched twice.
    The chunk tables are read per pull as the node needs them (attach checks them, the
    on-demand loader loads them) and are counted apart."""
    seen: dict[tuple[str, str, str], int] = {}
    kinds = {
        "manifest_gets_of_the_reference": 0,
        "other_manifest_requests": 0,
        "config_gets": 0,
        "chunk_table_requests": 0,
        "layer_range_gets": 0,
        "other_blob_requests": 0,
    }
    for r in reqs:
        digest = r["p"].rsplit("/", 1)[-1]
        if "/manifests/" in r["p"]:
            if r["m"] == "GET" and r["p"].endswith(f"/manifests/{tag}"):
                kinds["manifest_gets_of_the_reference"] += 1
            else:
                kinds["other_manifest_requests"] += 1
        elif "/blobs/" not in r["p"]:
            kinds["other_blob_requests"] += 1
        elif digest in layers:
            if r["m"] == "GET" and r["range"]:
                kinds["layer_range_gets"] += 1
                key = (r["m"], r["p"], r["range"])
                seen[key] = seen.get(key, 0) + 1
            else:
                kinds["other_blob_requests"] += 1
        elif r["m"] == "GET" and not r["range"]:
            kinds["config_gets"] += 1
        else:
            kinds["chunk_table_requests"] += 1
    repeated = {f"{p} {rg}": c for (_m, p, rg), c in seen.items() if c > 1}
    return {
        **kinds,
        "requests": len(reqs),
        "repeated_layer_ranges": repeated,
        "pulls": kinds["manifest_gets_of_the_reference"],
        "exactly_one_pull": kinds["manifest_gets_of_the_reference"] == 1
        and kinds["config_gets"] == 1,
        "request_log": [f"{r['m']} {r['p']} {r['range']}".strip() for r in reqs[:200]],
    }


# --- main ---------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="128 MiB data layer, 8 creates")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of phases 1 and 2")
    ap.add_argument("--rate", type=float, default=100e6, help="proxy bytes/s")
    ap.add_argument("--data-mib", type=int, default=None, help="default 900 (quick: 128)")
    ap.add_argument("--concurrent", type=int, default=None, help="default 32 (quick: 8)")
    ap.add_argument("--cached-rounds", type=int, default=5)
    ap.add_argument("--work", default="/var/tmp/dsec-bench-images")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (sandboxes need mounts and cgroups; drop_caches)")
    for tool in ("docker-registry", "podman", "fsck.erofs", "gzip", "tar"):
        if shutil.which(tool) is None:
            raise SystemExit(f"needs {tool}")
    mib = args.data_mib or (128 if args.quick else 900)
    n_conc = args.concurrent or (8 if args.quick else 32)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-images-"))
    homes = tmp / "homes"
    homes.mkdir()
    reg: Registry | None = None
    proxy: ThrottleProxy | None = None
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "quick": args.quick,
        "repeat": args.repeat,
        "rate_bytes_per_s": args.rate,
    }
    try:
        reg = Registry(tmp, work / "registry")
        image = prepare_image(work, reg, mib)
        out["image"] = image
        proxy = ThrottleProxy(reg.port, args.rate, tmp)
        host = f"127.0.0.1:{proxy.port}"
        lazy_ref = f"{host}/bench/lazy:{image['tag']}"
        plain_ref = f"{host}/bench/plain:{image['tag']}"
        print(
            f"image: {image['plain_oci_bytes'] / 1e9:.2f} GB plain OCI, "
            f"{image['dsec_artifact_erofs_bytes'] / 1e9:.2f} GB dsec artifact; "
            f"{args.rate / 1e6:.0f} MB/s",
            flush=True,
        )
        rounds: dict[str, list[dict[str, Any]]] = {"lazy": [], "plain": [], "podman": []}
        probes: dict[str, list[float]] = {"first_create": [], "build": [], "concurrent": []}
        for i in range(args.repeat):
            probes["first_create"].append(host_probe_s())
            print(f"round {i + 1}: dsec lazy ...", flush=True)
            rounds["lazy"].append(dsec_first_create(homes, proxy, lazy_ref, "lazy"))
            print(f"  {rounds['lazy'][-1]['s']:.2f} s; dsec plain OCI ...", flush=True)
            rounds["plain"].append(dsec_first_create(homes, proxy, plain_ref, "plain"))
            print(f"  {rounds['plain'][-1]['s']:.2f} s; podman ...", flush=True)
            rounds["podman"].append(podman_first_create(homes, proxy, plain_ref))
            print(f"  {rounds['podman'][-1]['s']:.2f} s", flush=True)
        outputs = {r["stdout"] for rs in rounds.values() for r in rs}
        if len(outputs) != 1:
            raise RuntimeError(f"the three clients saw different images: {outputs}")
        out["first_exec_stdout"] = outputs.pop()
        first: dict[str, Any] = {}
        for k, rs in rounds.items():
            first[k] = {
                "median_s": round(med([r["s"] for r in rs]), 3),
                "all_s": [round(r["s"], 3) for r in rs],
                "median_bytes_fetched": int(med([r["bytes_fetched"] for r in rs])),
                "median_requests": int(med([r["requests"] for r in rs])),
            }
        first["podman"]["median_pull_s"] = round(med([r["pull_s"] for r in rounds["podman"]]), 3)
        for k in ("lazy", "plain"):
            first[k]["podman_over_this"] = round(
                first["podman"]["median_s"] / first[k]["median_s"], 2
            )
        first["target_lazy_speedup"] = 5.0
        first["lazy_meets_target"] = first["lazy"]["podman_over_this"] >= 5.0
        out["first_create"] = first

        builds = []
        for i in range(args.repeat):
            probes["build"].append(host_probe_s())
            print(f"round {i + 1}: 3-step build ...", flush=True)
            with cold_node(homes, "build", shared_layers=True) as srv:
                builds.append(asyncio.run(build_phase(srv, args.cached_rounds)))
        cached_all = [x for b in builds for x in b["cached_s"]]
        out["build"] = {
            "cold_median_s": round(med([b["cold_s"] for b in builds]), 3),
            "cold_all_s": [round(b["cold_s"], 3) for b in builds],
            "cached_median_s": round(med(cached_all), 4),
            "cached_max_s": round(max(cached_all), 4),
            "cached_n": len(cached_all),
            "target_cached_s": 1.0,
        }
        out["build"]["cached_meets_target"] = out["build"]["cached_median_s"] <= 1.0

        probes["concurrent"].append(host_probe_s())
        print(f"{n_conc} concurrent creates of a new reference ...", flush=True)
        conc = concurrent_phase(homes, proxy, reg, image["tag"], n_conc)
        out["concurrent"] = conc
        out["host_probe_s"] = {k: [round(x, 4) for x in v] for k, v in probes.items()}
    finally:
        if proxy is not None:
            proxy.stop()
        if reg is not None:
            reg.stop()
        unmount_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    first = out["first_create"]
    gb = out["image"]["plain_oci_bytes"] / 1e9
    print()
    print(
        f"first create -> first exec, uncached {gb:.2f} GB image at {args.rate / 1e6:.0f} MB/s "
        f"(median of {args.repeat}; host probe {med(out['host_probe_s']['first_create']) * 1e3:.0f} ms)"
    )
    print(f"{'client':<34}{'median s':>10}{'fetched MB':>12}{'requests':>10}{'podman / this':>15}")
    for k, label in (
        ("lazy", "dsec lazy (dsec artifact)"),
        ("plain", "dsec plain OCI (pull + convert)"),
        ("podman", "podman pull + run"),
    ):
        r = first[k]
        ratio = f"{r['podman_over_this']:.1f}x" if "podman_over_this" in r else "1.0x"
        print(
            f"{label:<34}{r['median_s']:>10.2f}{r['median_bytes_fetched'] / 1e6:>12.1f}"
            f"{r['median_requests']:>10}{ratio:>15}"
        )
    print(
        f"  target dsec lazy >= 5x faster than podman: "
        f"{'met' if first['lazy_meets_target'] else 'MISSED'}"
    )
    b = out["build"]
    print()
    print(
        f"3-step build (from_image(debian).run.env.run), host probe "
        f"{med(out['host_probe_s']['build']) * 1e3:.0f} ms"
    )
    print(f"  cold (fresh node): {b['cold_median_s']:.2f} s median of {args.repeat}")
    print(
        f"  fully cached: {b['cached_median_s'] * 1e3:.0f} ms median of {b['cached_n']} "
        f"(max {b['cached_max_s'] * 1e3:.0f} ms); target <= 1 s: "
        f"{'met' if b['cached_meets_target'] else 'MISSED'}"
    )
    c = out["concurrent"]
    print()
    verdict = "exactly one pull" if c["exactly_one_pull"] else "NOT exactly one pull"
    print(
        f"{c['sandboxes']} concurrent creates of a new reference (lazy), host probe "
        f"{med(out['host_probe_s']['concurrent']) * 1e3:.0f} ms: {c['wall_s']:.2f} s to the "
        f"last first exec, {c['bytes_fetched'] / 1e6:.1f} MB fetched"
    )
    print(
        f"  proxy log: {c['manifest_gets_of_the_reference']} manifest GET of the reference, "
        f"{c['config_gets']} config GET: {verdict}; {c['layer_range_gets']} layer range GETs, "
        f"{len(c['repeated_layer_ranges'])} fetched twice; "
        f"{c['chunk_table_requests']} chunk-table requests"
    )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("images_quick.json" if args.quick else "images.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
