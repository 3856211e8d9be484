"""mini-swe-agent backend: a dsec sandbox as a mini-swe-agent environment (2.x).

Config (mini's dotted ``environment_class``; sizes in MiB, times in seconds)::

    environment:
      environment_class: dsec.integrations.minisweagent.DsecEnvironment
      image: debian
      cwd: /work
      timeout: 60
      env: {PAGER: cat}

or in Python::

    from dsec.integrations.minisweagent import DsecEnvironment
    env = DsecEnvironment(image="debian", cwd="/tmp")
    env.execute({"command": "echo hi"})   # {"output": "hi\\n", "returncode": 0, "exception_info": ""}
    env.cleanup()

It behaves as mini's ``DockerEnvironment`` does: every action runs in a fresh
``interpreter`` process (``bash -lc <command>`` by default) in ``cwd``, with ``env`` and
the forwarded host variables, stdout and stderr merged in order; a timeout kills the
command and answers ``returncode: -1`` with the ``TimeoutExpired`` exception text and the
output so far; ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` on the first line ends the run
(``Submitted``). ``get_template_vars`` reports the sandbox's own ``uname`` (what the
commands really run on), ``serialize`` the config and the sandbox id. The sandbox is
killed by :meth:`DsecEnvironment.cleanup`, when the object is collected, or at exit.

The connection comes from ``DSEC_URL`` / ``DSEC_API_KEY`` / ``$DSEC_HOME/api_key`` (or
``url``); credentials are never part of the config, which mini saves in trajectories.
"""

from __future__ import annotations

import logging
import os
import subprocess
import weakref
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import ConfigDict

from dsec.errors import DsecError, SandboxNotFound, SandboxStopped
from dsec.integrations._fields import SandboxFields
from dsec.sdk import Sandbox
from dsec.sdk.sandbox import CREATE_TIMEOUT_S

__all__ = ["DsecEnvironment", "DsecEnvironmentConfig"]

_MAX_OUTPUT_BYTES = 64 << 20
_UNAME_KEYS = ("system", "node", "release", "version", "machine")


class DsecEnvironmentConfig(SandboxFields):
    """mini's ``DockerEnvironmentConfig`` fields (``image``, ``cwd``, ``env``,
    ``forward_env``, ``timeout``, ``interpreter``) plus the sandbox's
    (:class:`~dsec.integrations._fields.SandboxFields`). Sizes in MiB."""

    image: str = "debian"
    """dsec image name (``debian``, or one built with ``dsec image build``)."""
    cwd: str = "/"
    """Working directory of every command (created if missing)."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Host variables passed on when set (``env`` wins on conflict)."""
    timeout: int = 30
    """Default timeout of a command, seconds."""
    interpreter: list[str] = ["bash", "-lc"]
    """The command is appended to this argv."""
    job: str | None = None
    ttl_s: float | None = 3600.0
    """Idle seconds before dsec kills the sandbox (if cleanup never happens)."""
    url: str | None = None
    startup_timeout: float = CREATE_TIMEOUT_S

    model_config = ConfigDict(extra="forbid")


def _kill(sandbox: Any) -> None:
    try:
        sandbox.kill()
    except (SandboxNotFound, SandboxStopped):
        pass
    except Exception as e:  # at exit or in GC: report, never raise
        logging.getLogger(__name__).warning("could not kill sandbox %s: %s", sandbox.id, e)


class DsecEnvironment:
    """Executes mini-swe-agent's actions in a dsec sandbox (see the module docstring)."""

    def __init__(
        self,
        *,
        config_class: type = DsecEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        c = self.config
        self.sandbox = Sandbox.create(
            tier=c.tier,
            image=c.image,
            layers=c.layers,
            cpu=c.cpu,
            memory_mb=c.memory_mb,
            disk_mb=c.disk_mb,
            pids=c.pids,
            env=c.env,
            ttl_s=c.ttl_s,
            labels=c.labels,
            job=c.job,
            network=c.network,
            url=c.url,
            timeout=c.startup_timeout,
        )
        # killed on cleanup(), when collected, or at interpreter exit, whichever is first
        self._finalizer = weakref.finalize(self, _kill, self.sandbox)
        self.logger.info("Started dsec sandbox %s (image %s)", self.sandbox.id, c.image)
        self._uname: dict[str, str] | None = None
        if c.cwd not in ("", "/"):
            self.sandbox.files.make_dir(c.cwd)

    @property
    def sandbox_id(self) -> str:
        return str(self.sandbox.id)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` and return ``{"output", "returncode",
        "exception_info"}`` (plus ``extra`` on an exception), as mini's docker
        environment does."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        env: dict[str, str] = {}
        for key in self.config.forward_env:
            if (value := os.getenv(key)) is not None:
                env[key] = value
        env.update(self.config.env)
        argv = [*self.config.interpreter, command]
        limit = timeout or self.config.timeout
        try:
            # stdout and stderr in one pipe, in order (docker exec ... 2>&1)
            r = self.sandbox.commands.run(
                ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv],
                cwd=cwd,
                env=env,
                timeout=limit,
                max_output_bytes=_MAX_OUTPUT_BYTES,
            )
            if r.timed_out:
                raise subprocess.TimeoutExpired(argv, limit, output=r.stdout)
            returncode = r.exit_code if r.exit_code is not None else 128 + (r.signal or 9)
            output: dict[str, Any] = {
                "output": r.stdout,
                "returncode": returncode,
                "exception_info": "",
            }
        except (DsecError, subprocess.TimeoutExpired) as e:
            raw = getattr(e, "output", None)
            output = {
                "output": raw if isinstance(raw, str) else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        """Raise ``Submitted`` when the first output line asks for it (mini's rule)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if (
            lines
            and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
            and output["returncode"] == 0
        ):
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def _sandbox_uname(self) -> dict[str, str]:
        if self._uname is None:
            r = self.sandbox.commands.run(
                ["/bin/sh", "-c", "uname -s; uname -n; uname -r; uname -v; uname -m"], timeout=30
            )
            values = r.stdout.split("\n")
            self._uname = {
                k: (values[i] if i < len(values) else "") for i, k in enumerate(_UNAME_KEYS)
            }
        return self._uname

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config's fields, the sandbox's ``uname`` (``system``, ``node``,
        ``release``, ``version``, ``machine``) and ``kwargs``."""
        return recursive_merge(self.config.model_dump(), self._sandbox_uname(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "dsec": {"sandbox_id": self.sandbox_id},
            }
        }

    def cleanup(self) -> None:
        """Kill the sandbox (idempotent)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
