"""The ``code-interpreter`` image: Debian bookworm, Jupyter kernels and dsec's
code-interpreter server (:mod:`dsec.guest.codeinterp`) listening on port 49999.

One definition, two consumers:

* today, the built-in recipe ``BUILTIN_IMAGES["code-interpreter"]``
  (:func:`dsec.layers.builtin.build_code_interpreter_rootfs`): ``debootstrap --variant=minbase
  --include=<APT_PACKAGES>`` and then :func:`apply_steps` on the tree; one layer;
* later, the image builder: :func:`dockerfile` renders the same packages and steps as a
  Dockerfile (``FROM debian:bookworm-slim``, one ``RUN apt-get install``, one ``COPY`` of
  the server, the user, ``USER``, ``WORKDIR``, ``EXPOSE``, ``CMD``), whose build context is made by
  :func:`write_build_context`.

Everything comes from Debian (no PyPI, no npm at build time): the Python kernel is
Debian's ipykernel; Debian has no bash or JavaScript kernel, so the server ships its own
small ones (``bashkernel.py``, ``jskernel.py``) driving ``bash`` and Debian's ``nodejs``.

As in E2B's code-interpreter template, the image's user is E2B's ``user`` (uid 1000, home
``/home/user``, passwordless ``sudo``) and ``pip`` installs into the system Python for
everyone (:class:`OpenPip`), from the index it is configured with, at run time.

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
from dsec.layers.users import PasswordlessSudo, RenameUser, passwordless_sudo, rename_user

__all__ = [
    "APT_PACKAGES",
    "ENV",
    "IMAGE_NAME",
    "PORT",
    "READY_CMD",
    "SITE_DIR",
    "START_CMD",
    "STEPS",
    "USER",
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
    "python3-pip",
    "sudo",
)
"""Debian bookworm packages of the image (their dependencies come along). ``python3-pip``:
``pip`` for code that installs what it imports (smolagents runs ``!pip install`` for its
``additional_authorized_imports``); ``sudo``: E2B's user has it."""

USER = "user"
"""E2B's default user (uid 1000): the image's user, as in E2B's code-interpreter template
(``set_user("user")``): commands without ``user=`` and the server run as it."""

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
class OpenPip:
    """Let every user ``pip install`` into the system Python, as in E2B's templates (whose
    Python is not Debian's): ``/usr/local`` writable by everyone (pip's target for
    ``python3``), its ``dist-packages`` made so that it is on ``sys.path`` of a kernel
    started before the first install, and Debian's ``EXTERNALLY-MANAGED`` marker (PEP 668,
    which makes pip refuse) removed. pip installs from whatever index it is configured with
    (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ``/etc/pip.conf``; PyPI by default)."""


Step = CopyServer | RenameUser | PasswordlessSudo | OpenPip

STEPS: tuple[Step, ...] = (
    CopyServer(),
    RenameUser("sandbox", USER, WORKDIR),
    PasswordlessSudo(USER),
    OpenPip(),
)
"""What the image adds on top of the packages, in order."""


def _inside(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _open_pip(root: Path) -> None:
    for marker in root.glob("usr/lib/python3.*/EXTERNALLY-MANAGED"):
        marker.unlink()
    local = _inside(root, "/usr/local")
    for lib in root.glob("usr/lib/python3.*"):
        if lib.is_dir() and (lib / "os.py").exists():  # a Python of the image
            (local / "lib" / lib.name / "dist-packages").mkdir(parents=True, exist_ok=True)
    if not local.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(local):
        for entry in [*dirnames, *filenames]:
            path = os.path.join(dirpath, entry)
            if not os.path.islink(path):
                os.chmod(path, 0o777 if entry in dirnames else os.stat(path).st_mode | 0o666)
    os.chmod(local, 0o777)


def apply_steps(root: Path, steps: tuple[Step, ...] = STEPS) -> None:
    """Apply :data:`STEPS` to the root filesystem at ``root`` (as root: ``chown``)."""
    for step in steps:
        if isinstance(step, CopyServer):
            codeinterp.install_into(_inside(root, step.site_dir))
        elif isinstance(step, RenameUser):
            rename_user(root, step)
        elif isinstance(step, PasswordlessSudo):
            passwordless_sudo(root, step)
        else:
            _open_pip(root)


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
        elif isinstance(step, RenameUser):  # debian:bookworm-slim has no user to rename
            lines.append(
                f"RUN useradd --create-home --uid 1000 --shell /bin/bash --home-dir {step.home} {step.new}"
            )
        elif isinstance(step, PasswordlessSudo):
            lines.append(
                f"RUN echo '{step.user} ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/e2b-user"
                " && chmod 440 /etc/sudoers.d/e2b-user"
            )
        else:
            lines.append(
                "RUN rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED && mkdir -p"
                ' "$(python3 -c \'import sysconfig; print(sysconfig.get_path("purelib"))\')"'
                " && chmod -R a+rwX /usr/local"
            )
    lines += [f"ENV {k}={json.dumps(v)}" for k, v in ENV.items()]
    lines += [
        f"USER {USER}",
        f"WORKDIR {WORKDIR}",
        f"EXPOSE {PORT}",
        f"CMD {json.dumps(list(START_CMD))}",
    ]
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
        [list(APT_PACKAGES), [repr(s) for s in STEPS], list(START_CMD), ENV, WORKDIR, USER],
        sort_keys=True,
    )
    fingerprint = hashlib.sha256(recipe.encode()).hexdigest()[:16] + "-" + codeinterp.fingerprint()
    config = ImageConfig(
        Env=[f"{k}={v}" for k, v in ENV.items()],
        User=USER,
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
