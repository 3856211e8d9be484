"""What the VM tiers keep of one sandbox (:class:`MicrovmState`): the JSON of its
:class:`~dsec.contract.runtime.Handle` (stored by the edge's registry and, as
``handle.json``, in the sandbox's directory), read as one typed model. The ``vm`` tier keeps
the same.

Every field has a default: a record an older dsec wrote still parses (one without the
machine description, ``vcpus`` and ``layer_paths``, cannot be suspended or memory-forked:
see ``MicrovmRuntime._check_restorable``). Unset fields (None) are left out of the JSON. A
memory snapshot's ``source`` (what a migration ships to another node) is this JSON too."""

from __future__ import annotations

from dsec.contract.runtime import TierState

__all__ = ["MicrovmState"]


class MicrovmState(TierState):
    """One VM sandbox as the tier made it.

    Attributes:
        dir: its directory (sockets, logs, ``handle.json``; None: the default of its id).
        pid: its QEMU's process id (0: none runs, e.g. suspended to a file).
        qemu_name: the name its QEMU runs under (a pooled QEMU keeps its own).
        accel: the accelerator (``kvm`` or ``tcg``): a memory state loads only under the same.
        vcpus, memory_mb, disk_mb: the machine (vCPUs, memory and writable disk in MiB).
        layer_paths: its layer disks' files, bottom first.
        template: the key of the template it was cloned from (None: booted cold).
        hostname, env, user, workdir: what its commands get by default.
        cpu, pids: its CPU (cores) and process limits.
        full_guest: its commands have the whole guest.
        forked_from: the sandbox whose memory it resumed (memory forks).
        last_restore_ms: how long its last restore from a suspend file took, ms.
    """

    dir: str | None = None
    pid: int = 0
    qemu_name: str | None = None
    accel: str | None = None
    vcpus: int | None = None
    memory_mb: int = 0
    disk_mb: int = 0
    layer_paths: list[str] = []
    template: str | None = None
    hostname: str = "sandbox"
    env: dict[str, str] = {}
    user: str | None = None
    workdir: str = "/"
    cpu: float | None = None
    pids: int | None = None
    full_guest: bool = False
    forked_from: str | None = None
    last_restore_ms: float | None = None
