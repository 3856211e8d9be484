"""Run SandboxFusion's own runner tests, unmodified, against a running ``dsec serve``.

SandboxFusion's tests (``sandbox/tests/runners/test_*.py`` of bytedance/SandboxFusion) do
``from sandbox.server.server import app; client = TestClient(app)`` and post to
``/run_code`` and ``/run_jupyter``. This script copies the chosen test files, byte for byte,
into a scratch directory and puts a stand-in ``sandbox`` package on the path in which:

* ``sandbox.runners`` is SandboxFusion's own ``sandbox/runners/types.py`` (its models and
  ``CommandRunStatus``), executed from the checkout;
* ``sandbox.server.sandbox_api`` is SandboxFusion's own ``sandbox/server/sandbox_api.py``
  (``RunCodeRequest``, ``RunCodeResponse``, ``RunJupyterResponse`` ...), executed from the
  checkout with its runner table left empty: nothing of SandboxFusion runs code;
* ``sandbox.server.server.app`` is an ASGI app that forwards every request to dsec (the
  ``--url``; the API key, if any, as ``Authorization: Bearer``).

So the tests' requests, assertions and models are SandboxFusion's; only the server differs.
Usage (a SandboxFusion checkout at ``$SF``, e.g. from ``git clone`` or a mirror)::

    DSEC_HOME=/tmp/sf-home dsec serve --port 7391 &
    python scripts/sandboxfusion_suite.py --checkout $SF --url http://127.0.0.1:7391 \\
        --key $KEY python cpp bash go java nodejs rust jupyter isolation

It prints pytest's summary per file and a table, and exits non-zero when a test failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SHIM_STRUCTLOG = """
import logging


class stdlib:  # noqa: N801 - the module attribute SandboxFusion uses
    @staticmethod
    def get_logger(*_a, **_k):
        return logging.getLogger("sandboxfusion")
"""

SHIM_RUNNERS = """
import os
_src = os.path.join(os.environ["SF_CHECKOUT"], "sandbox", "runners", "types.py")
exec(compile(open(_src).read(), _src, "exec"))
CODE_RUNNERS = {}


async def run_jupyter(_request):
    raise RuntimeError("SandboxFusion runs nothing here: requests go to dsec")
"""

SHIM_SANDBOX_API = """
import os
_src = os.path.join(os.environ["SF_CHECKOUT"], "sandbox", "server", "sandbox_api.py")
exec(compile(open(_src).read(), _src, "exec"))
"""

SHIM_SERVER = '''
"""An ASGI app relaying every request to dsec (SF_DSEC_URL, SF_DSEC_KEY)."""
import os

import httpx

URL = os.environ["SF_DSEC_URL"].rstrip("/")
KEY = os.environ.get("SF_DSEC_KEY", "")


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = {"content-type": "application/json"}
    if KEY:
        headers["authorization"] = f"Bearer {KEY}"
    async with httpx.AsyncClient(timeout=600) as client:
        resp = await client.request(
            scope["method"], URL + scope["path"], content=body, headers=headers
        )
    await send(
        {
            "type": "http.response.start",
            "status": resp.status_code,
            "headers": [(b"content-type", resp.headers.get("content-type", "").encode())],
        }
    )
    await send({"type": "http.response.body", "body": resp.content})
'''


def build_shim(root: Path) -> None:
    """Write the stand-in ``sandbox`` package (and a ``structlog`` stub) under ``root``."""
    files = {
        "structlog.py": SHIM_STRUCTLOG,
        "sandbox/__init__.py": "",
        "sandbox/runners/__init__.py": SHIM_RUNNERS,
        "sandbox/server/__init__.py": "",
        "sandbox/server/sandbox_api.py": SHIM_SANDBOX_API,
        "sandbox/server/server.py": SHIM_SERVER,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (root / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\nfilterwarnings =\n"
        "    ignore::pytest.PytestUnraisableExceptionWarning\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkout", required=True, help="a SandboxFusion checkout (its root)")
    ap.add_argument("--url", required=True, help="dsec's base URL, e.g. http://127.0.0.1:7391")
    ap.add_argument("--key", default=os.environ.get("DSEC_API_KEY", ""), help="dsec API key")
    ap.add_argument("suites", nargs="+", help="test_<suite>.py names: python java isolation ...")
    args = ap.parse_args()
    checkout = Path(args.checkout).resolve()
    work = Path(tempfile.mkdtemp(prefix="sf-suite-"))
    try:
        build_shim(work)
        env = {
            **os.environ,
            "SF_CHECKOUT": str(checkout),
            "SF_DSEC_URL": args.url,
            "SF_DSEC_KEY": args.key,
            "PYTHONPATH": str(work),
        }
        rows = []
        for suite in args.suites:
            src = checkout / "sandbox" / "tests" / "runners" / f"test_{suite}.py"
            dst = work / "tests" / src.name
            dst.parent.mkdir(exist_ok=True)
            shutil.copyfile(src, dst)  # unmodified
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-rfE",
                    "-o",
                    "addopts=",
                    str(dst),
                ],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            print(f"== test_{suite}.py\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}", flush=True)
            passed = failed = 0
            tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            for part in tail.replace("=", "").split(","):
                words = part.split()
                if len(words) >= 2 and words[0].isdigit():
                    if words[1].startswith("passed"):
                        passed = int(words[0])
                    elif words[1].startswith(("failed", "error")):
                        failed += int(words[0])
            rows.append((suite, passed, failed))
        print(f"\n{'suite':<12} {'passed':>6} {'failed':>6}")
        for suite, p, f in rows:
            print(f"{suite:<12} {p:>6} {f:>6}")
        tp, tf = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"{'total':<12} {tp:>6} {tf:>6}")
        print(f"{tp} passed, {tf} failed")
        return 1 if tf else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
