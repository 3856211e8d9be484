"""Parts of a cluster on loopback, shared by the cluster tests and ``benchmarks/cell.py``.

* :class:`Postgres`: a private PostgreSQL (Debian's ``postgresql`` package): ``initdb`` +
  ``pg_ctl`` as the ``postgres`` user in a directory of its own, a port on 127.0.0.1, its
  socket in that directory, ``fsync=off``. The system cluster is never touched.
* :func:`serve_replica`: ``dsec serve --cluster`` as a child process, returned once healthy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PG_BIN", "Postgres", "serve_replica"]

PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"))), Path("/usr/bin"))


def _as_postgres(*cmd: str) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=True, capture_output=True)


@dataclass
class Postgres:
    """One running PostgreSQL: its directory (``base``; data in ``base/data``, log in
    ``base/pg.log``) and port. ``stat_statements``: ``pg_stat_statements`` loaded and its
    extension created (statement counts for benchmarks)."""

    base: Path
    port: int
    stat_statements: bool = False

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def data(self) -> Path:
        return self.base / "data"

    @classmethod
    def start(cls, base: Path, *, port: int, stat_statements: bool = False) -> Postgres:
        """``initdb`` in ``base`` (made if missing, owned by ``postgres``) and start."""
        base.mkdir(parents=True, exist_ok=True)
        shutil.chown(base, "postgres", "postgres")
        pg = cls(base, port, stat_statements)
        _as_postgres(str(PG_BIN / "initdb"), "-D", str(pg.data), "-A", "trust", "-U", "postgres")
        pg.pg_ctl("start")
        if stat_statements:
            with pg.connect() as c:
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        return pg

    def pg_ctl(self, action: str) -> None:
        """``pg_ctl start``, ``stop`` or ``restart`` (both ``-m immediate``), waiting."""
        opts = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        if self.stat_statements:
            opts += " -c shared_preload_libraries=pg_stat_statements -c max_connections=200"
        args = [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", opts]
        args += ["-l", str(self.base / "pg.log"), "-w"]
        args += ["-m", "immediate", action] if action in ("stop", "restart") else [action]
        _as_postgres(*args)

    def connect(self) -> Any:
        import psycopg

        return psycopg.connect(self.dsn, autocommit=True)

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.pg_ctl("stop")


def serve_replica(
    home: Path,
    node_root: Path,
    address: str,
    dsn: str,
    port: int,
    env: dict[str, str],
    *,
    timeout_s: float = 180.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """``dsec serve --cluster address --database dsn`` on 127.0.0.1:``port`` as a child
    process (environment: this one's and ``env``; output to ``home/serve.log``); returns
    (process, url) once ``/healthz`` answers, else ``RuntimeError`` with its log."""
    import httpx

    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dsec.cli.main", "serve", "--port", str(port)]
    cmd += ["--home", str(home), "--cluster", address, "--database", dsn]
    cmd += ["--node-root", str(node_root)]
    with open(home / "serve.log", "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "DSEC_HOME": str(home), **env},
            stdout=log_file,
            stderr=log_file,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        if proc.poll() is not None:
            raise RuntimeError(f"dsec serve --cluster exited: {(home / 'serve.log').read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"dsec serve --cluster not healthy: {(home / 'serve.log').read_text()}")
