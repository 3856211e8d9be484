"""Build the built-in images the root tests use, once per machine, before they need them.

``make test`` starts this in the background (``tests/conftest.py``'s ``pytest_configure``)
while the root-free tests run; a root test waits for it before it starts, outside its own
time-out (``wait_until_built``). What it builds goes to the machine-wide cache of built-in
layers (``DSEC_BUILTIN_CACHE``, :mod:`dsec.layers.builtin_cache`), keyed by each recipe's
digest, so later runs on the machine find every image there and build nothing; a changed
recipe is rebuilt. Every test process's layer store takes the images from that cache.

Run by hand (as root): ``python -m tests.warm_images`` builds and prints what it did;
``DSEC_TEST_WARM=0`` keeps pytest from starting it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CACHE = "/var/cache/dsec-test-images"
CHAINS = (
    ("debian", "toolkits"),
    ("busybox", "e2b-base", "code-interpreter", "desktop"),
    ("host-images",),
)
"""The images, as chains built one after the other; the chains are built in parallel.
``toolkits``: the fncall tier's toolkit layers over ``debian`` (one per language that has
one: gcc, nodejs, golang, java, rust, python-runtime). ``host-images``: the root filesystem
images of the host matrix's guests that tests boot (:data:`HOST_IMAGES`; cached in
``/var/cache/dsec-hosts``, ``hosts/image.py``), and its KVM-or-TCG probe."""

HOST_IMAGES = ("debian12-6.1-v2",)
"""Hosts of the host matrix (``hosts/spec.py``) that tests boot: ``tests/hosts/``."""


def cache_dir() -> Path:
    return Path(os.environ.get("DSEC_BUILTIN_CACHE") or DEFAULT_CACHE)


def _lock_path() -> Path:
    return cache_dir() / "warm.lock"


def status_path() -> Path:
    return cache_dir() / "warm.json"


def start_in_background() -> bool:
    """Start the build in a child process holding ``warm.lock`` until it is done. False when
    it is switched off or another run on this machine is already building."""
    if os.environ.get("DSEC_TEST_WARM", "1") == "0":
        return False
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another run builds them; our root tests wait for it the same way
        root = Path(__file__).resolve().parent.parent
        with open(cache / "warm.log", "ab") as log:
            # the child inherits the locked file description: the lock lives until it exits
            subprocess.Popen(
                [sys.executable, "-m", "tests.warm_images"],
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                start_new_session=True,
            )
        return True
    finally:
        os.close(fd)


_waited = False


def wait_until_built() -> None:
    """Return once no process is building the images (at once when none is)."""
    global _waited
    if _waited:
        return
    path = _lock_path()
    if path.exists():
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)
    _waited = True


def summary() -> str | None:
    """One line on the last build: what was built or found, and how long it took."""
    try:
        status = json.loads(status_path().read_text())
    except (OSError, ValueError):
        return None
    parts = [
        f"{name} {info['outcome']} {info['seconds']:.0f} s"
        for name, info in status["images"].items()
    ]
    return f"images ({status['seconds']:.0f} s in all): " + ", ".join(parts)


def _build_toolkits(store: object) -> None:
    from dsec.runtimes.fncall.languages import LANGUAGES
    from dsec.runtimes.fncall.toolkits import build_toolkit_image

    stacks = {spec.toolkits for spec in LANGUAGES.values() if spec.toolkits}
    for stack in sorted(stacks):
        image = "debian"
        for toolkit in stack:  # each over the image of the ones before it, as the tier does
            image = build_toolkit_image(store, image, toolkit).name


def _build_host_images() -> str:
    """The host matrix's images of :data:`HOST_IMAGES` (built or found): its outcome."""
    from hosts.guest import choose_accel
    from hosts.image import ensure_image
    from hosts.spec import HOSTS

    outcome = "cached"
    for name in HOST_IMAGES:
        image, built = ensure_image(HOSTS[name].image)
        outcome = "built" if built else outcome
        choose_accel(image.kernel)  # probed once per machine boot, cached beside the images
    return outcome


def build_all() -> dict[str, dict[str, object]]:
    """Build (or find) every image of :data:`CHAINS` into the cache; the outcome of each."""
    from dsec.layers.builtin_cache import BuiltinCache
    from dsec.layers.store import LayerStore

    cache = BuiltinCache.from_env() or BuiltinCache(cache_dir())
    os.environ["DSEC_BUILTIN_CACHE"] = str(cache.root)
    work = cache.root / "store"  # a scratch store: what matters is the cache beside it
    shutil.rmtree(work, ignore_errors=True)
    store = LayerStore(work / "layers", work / "images")
    results: dict[str, dict[str, object]] = {}

    def chain(names: tuple[str, ...]) -> None:
        for name in names:
            pattern = "toolkit-*.erofs" if name == "toolkits" else f"{name}-*.erofs"
            before = {p.name for p in cache.root.glob(pattern)}
            t0 = time.monotonic()
            try:
                if name == "host-images":
                    outcome = _build_host_images()
                else:
                    if name == "toolkits":
                        _build_toolkits(store)
                    else:
                        store.ensure_image_sync(name)
                    after = {p.name for p in cache.root.glob(pattern)}
                    outcome = "cached" if after == before else "built"
            except Exception as e:  # a test that needs it builds it (and says why it cannot)
                outcome = f"failed: {e}"[:300]
            results[name] = {"outcome": outcome, "seconds": round(time.monotonic() - t0, 1)}
            print(f"warm_images: {name}: {outcome} in {results[name]['seconds']} s", flush=True)

    try:
        with concurrent.futures.ThreadPoolExecutor(len(CHAINS)) as pool:
            list(pool.map(chain, CHAINS))
    finally:
        store.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    import logging

    if sys.argv[1:] == ["--background"]:
        started = start_in_background()
        print(
            f"warm_images: {'building' if started else 'not started'} in the background"
            f" (log: {cache_dir() / 'warm.log'})"
        )
        return

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.monotonic()
    results = build_all()
    status = {"seconds": round(time.monotonic() - t0, 1), "images": results}
    status_path().write_text(json.dumps(status, indent=1))
    print(summary(), flush=True)


if __name__ == "__main__":
    main()
