"""``python3 -m dsec_codeinterp [--host H] [--port 49999] [--cwd DIR]``: run the server.

Stops cleanly (kernels shut down, their process groups killed) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile

from .contexts import ContextRegistry, KernelCatalog, Limits
from .server import serve

DEFAULT_PORT = 49999


def _default_cwd() -> str:
    for candidate in ("/home/user", os.environ.get("HOME") or "", "/"):
        if candidate and os.path.isdir(candidate):
            return candidate
    return "/"


def _private_dirs() -> str:
    """Jupyter's runtime directory (connection files) and, when the home directory is not
    writable, IPython's and matplotlib's: private temporary directories, so that the
    server works as any user and kernels do not rebuild caches in a read-only home."""
    base = tempfile.mkdtemp(prefix="dsec-codeinterp-")
    os.environ.setdefault("JUPYTER_RUNTIME_DIR", os.path.join(base, "runtime"))
    os.makedirs(os.environ["JUPYTER_RUNTIME_DIR"], mode=0o700, exist_ok=True)
    home = os.environ.get("HOME") or ""
    if not (home and os.access(home, os.W_OK)):
        os.environ.setdefault("IPYTHONDIR", os.path.join(base, "ipython"))
        os.environ.setdefault("MPLCONFIGDIR", os.path.join(base, "matplotlib"))
    return base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsec_codeinterp", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (49999)")
    parser.add_argument(
        "--cwd",
        default=None,
        help="default working directory of new contexts (/home/user, else $HOME, else /)",
    )
    parser.add_argument(
        "--max-output-bytes",
        type=int,
        default=Limits.max_output_bytes,
        help="stdout+stderr+result bytes forwarded per execution",
    )
    parser.add_argument("--max-contexts", type=int, default=Limits.max_contexts)
    parser.add_argument(
        "--interrupt-grace",
        type=float,
        default=Limits.interrupt_grace_s,
        help="seconds an interrupted kernel may take before it is restarted",
    )
    parser.add_argument("--log-level", default=os.environ.get("DSEC_CODEINTERP_LOG", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    limits = Limits(
        max_output_bytes=args.max_output_bytes,
        max_contexts=args.max_contexts,
        interrupt_grace_s=args.interrupt_grace,
    )
    cwd = args.cwd or _default_cwd()
    private = _private_dirs()

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        registry = ContextRegistry(KernelCatalog(), limits, cwd)
        await serve(registry, args.host, args.port, stop)

    try:
        asyncio.run(run())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
