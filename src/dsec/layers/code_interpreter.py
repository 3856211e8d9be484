"""The ``code-interpreter`` image: Debian bookworm, Jupyter kernels and dsec's
code-interpreter server (:mod:`dsec.guest.codeinterp`) listening on port 49999.

One definition, two consumers:

* today, the built-in recipe ``BUILTIN_IMAGES["code-interpreter"]``
  (:func:`dsec.layers.builtin.build_code_interpreter_rootfs`): ``debootstrap --variant=minbase
  --include=<APT_PACKAGES>`` and then :func:`apply_steps` on the tree; one layer;
* later, the image builder: :func:`dockerfile` renders the same packages and steps as a
  Dockerfile (``FROM debian:bookworm-slim``, one ``RUN apt-get install``, one ``COPY`` of
  the server, ``WORKDIR``, ``EXPOSE``, ``CMD``), whose build context is made by
  :func:`write_build_context`.

Everything comes from Debian (no PyPI, no npm at build time): the Python kernel is
Debian's ipykernel; Debian has no bash or JavaScript kernel, so the server ships its own
small ones (``bashkernel.py``, ``jskernel.py``) driving ``bash`` and Debian's ``nodejs``.

The server is the image's start command (:data:`START_CMD`, ``meta["start"]`` with the
readiness check :data:`READY_CMD`): every sandbox of the image runs it from its creation,
which returns once ``/health`` answers; whatever routes ``E2b-Sandbox-Port: 49999`` traffic
sends it to :data:`PORT` inside the sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dsec.guest import codeinterp

__all__ = [
    "APT_PACKAGES",
    "ENV",
    "IMAGE_NAME",
    "PORT",
    "READY_CMD",
    "SITE_DIR",
    "START_CMD",
    "STEPS",
    "WORKDIR",
    "apply_steps",
    "dockerfile",
    "image_meta",
    "write_build_context",
]

IMAGE_NAME = "code-interpreter"
PORT = 49999
"""The TCP port e2b-code-interpreter asks for (``JUPYTER_PORT``)."""

APT_PACKAGES: tuple[str, ...] = (
    "python3",
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-tornado",
    "python3-matplotlib",
    "python3-numpy",
    "python3-pandas",
    "python3-pil",
    "python3-pexpect",
    "nodejs",
    "bash",
    "ca-certificates",
)
"""Debian bookworm packages of the image (their dependencies come along)."""

SITE_DIR = "/usr/lib/python3/dist-packages"
"""Where the server package goes: on the ``sys.path`` of every Debian ``python3`` version
(``/usr/local/lib/python3.X/dist-packages`` names the version; there is no
``/usr/local/lib/python3/dist-packages`` on the path)."""

WORKDIR = "/home/user"
"""E2B's default working directory of a context (its client documents ``/home/user``)."""

START_CMD: tuple[str, ...] = (
    "/usr/bin/python3",
    "-m",
    codeinterp.PACKAGE_NAME,
    "--port",
    str(PORT),
    "--cwd",
    WORKDIR,
)
"""The image's start command: the code-interpreter server on :data:`PORT`."""

READY_CMD = (
    'exec python3 -c "import urllib.request as u; '
    f"u.urlopen('http://127.0.0.1:{PORT}/health', timeout=2).read()\""
)
"""The readiness check: the server answers ``/health`` (a shell command)."""

ENV: dict[str, str] = {"MPLBACKEND": "module://matplotlib_inline.backend_inline"}
"""Environment of the image (the inline backend: figures come back as PNG display data)."""


@dataclass(frozen=True)
class CopyServer:
    """Copy the server package into ``site_dir`` (a ``COPY`` step)."""

    site_dir: str = SITE_DIR


@dataclass(frozen=True)
class MakeDir:
    """Create ``path`` owned by ``uid:gid`` with ``mode`` (a ``RUN mkdir && chown`` step)."""

    path: str
    uid: int
    gid: int
    mode: int = 0o755


Step = CopyServer | MakeDir

STEPS: tuple[Step, ...] = (
    CopyServer(),
    MakeDir(WORKDIR, 1000, 1000),
)
"""What the image adds on top of the packages, in order."""


def _inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def apply_steps(root: Path, steps: tuple[Step, ...] = STEPS) -> None:
    """Apply :data:`STEPS` to the root filesystem at ``root`` (as root: ``chown``)."""
    for step in steps:
        if isinstance(step, CopyServer):
            codeinterp.install_into(_inside(root, step.site_dir))
        else:
            target = _inside(root, step.path)
            target.mkdir(parents=True, exist_ok=True)
            os.chmod(target, step.mode)
            if os.geteuid() == 0:
                os.chown(target, step.uid, step.gid)


def dockerfile(base: str = "debian:bookworm-slim") -> str:
    """:data:`APT_PACKAGES` and :data:`STEPS` as a Dockerfile (build context:
    :func:`write_build_context`)."""
    lines = [
        f"FROM {base}",
        "RUN apt-get update \\",
        " && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\",
        "    " + " ".join(APT_PACKAGES) + " \\",
        " && rm -rf /var/lib/apt/lists/*",
    ]
    for step in STEPS:
        if isinstance(step, CopyServer):
            dest = f"{step.site_dir.rstrip('/')}/{codeinterp.PACKAGE_NAME}/"
            lines.append(f"COPY {codeinterp.PACKAGE_NAME}/ {dest}")
        else:
            lines.append(
                f"RUN mkdir -p {step.path} && chown {step.uid}:{step.gid} {step.path}"
                f" && chmod {step.mode:o} {step.path}"
            )
    lines += [f"ENV {k}={json.dumps(v)}" for k, v in ENV.items()]
    lines += [f"WORKDIR {WORKDIR}", f"EXPOSE {PORT}", f"CMD {json.dumps(list(START_CMD))}"]
    return "\n".join(lines) + "\n"


def write_build_context(dest: Path) -> Path:
    """Write ``Dockerfile`` and the server package (``dsec_codeinterp/``) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    package = dest / codeinterp.PACKAGE_NAME
    if package.exists():
        shutil.rmtree(package)
    codeinterp.install_into(dest)
    (dest / "Dockerfile").write_text(dockerfile())
    return dest


def image_meta() -> dict[str, object]:
    """Metadata recorded on the image: its config (env, working directory, port), its start
    command with the readiness check, and a recipe fingerprint (the packages, the steps and
    the server's code: an image built from another is rebuilt)."""
    import hashlib

    from dsec.images.config import ImageConfig, StartCommand

    recipe = json.dumps(
        [list(APT_PACKAGES), [repr(s) for s in STEPS], list(START_CMD), ENV, WORKDIR],
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(recipe.encode()).hexdigest()[:16] + "-" + codeinterp.fingerprint()
    config = ImageConfig(
        Env=[f"{k}={v}" for k, v in ENV.items()],
        WorkingDir=WORKDIR,
        ExposedPorts={f"{PORT}/tcp": {}},
    )
    start = StartCommand(cmd=list(START_CMD), ready_cmd=READY_CMD, ready_timeout_s=90)
    return {
        "suite": "bookworm",
        "variant": "minbase",
        "include": list(APT_PACKAGES),
        "config": config.to_meta(),
        "start": start.to_meta(),
        "recipe": fingerprint,
    }
