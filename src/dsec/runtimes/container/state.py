"""What the container tier keeps of one sandbox (:class:`ContainerState`): the JSON of its
:class:`~dsec.contract.runtime.Handle` (stored by the edge's registry) and of its
``state.json`` (what an orphan scan destroys a sandbox from), read as one typed model.

Every field has a default: a record an older dsec wrote, without the fields added since,
still parses (and says what that dsec's sandboxes had: no layer scope, no frozen layers,
no network). Unset fields (None) are left out of the JSON."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dsec.contract.runtime import TierState

__all__ = ["ContainerLimits", "ContainerState"]


class ContainerLimits(BaseModel):
    """The limits written into the container's cgroup (None: not known)."""

    model_config = ConfigDict(extra="allow")

    cpu: float | None = None
    memory_mb: int | None = None
    pids: int | None = None


class ContainerState(TierState):
    """One container sandbox as the tier made it.

    Attributes:
        oci_runtime: the OCI runtime binary that runs it (crun or runsc).
        state_root: that runtime's ``--root``.
        cgroup: its cgroup, relative to the hierarchies' roots ("" : the default path of its
            id); a claimed warm container's keeps the warm id.
        cgroup_warm: cgroup2's path of a container an older dsec claimed (it renamed v1's).
        cpu_group: the CPU share group's directory ("" : none).
        layers, layer_paths: its layers' digests and files, bottom first.
        layer_scope: whose layer mounts it stands on ("" : the node's, or an older dsec's).
        hostname, env, user, workdir: what its commands get by default.
        uid, gid: its default user's ids.
        limits: the limits in its cgroup.
        allow_setuid: its exec server runs commands without no_new_privs.
        disk_mb: its writable layer's size, MiB.
        frozen: the frozen layers it holds (released at destroy).
        frozen_lowers: those stacked under its writable layer, bottom first.
        upper_frozen: its own writable layer, frozen by a shared fork (then it is restarted,
            never thawed).
        auid: the loginuid its commands carry (audit).
        network: it has a network (a namespace with a veth and a policy).
        init_pid, init_start: its init's pid and start time (a reused pid is not it).
        warm_id: the warm container it was claimed from.
        create_ms: how long its creation's steps took, ms.
        reroot_ms: how long the move of a warm container onto a fork's root took, ms (until
            the claim adds it to ``create_ms``).
    """

    oci_runtime: str | None = None
    state_root: str | None = None
    cgroup: str = ""
    cgroup_warm: str | None = None
    cpu_group: str = ""
    layers: list[str] = []
    layer_paths: list[str] = []
    layer_scope: str = ""
    hostname: str = "sandbox"
    env: dict[str, str] = {}
    user: str | None = None
    workdir: str = "/"
    uid: int = 0
    gid: int = 0
    limits: ContainerLimits = ContainerLimits()
    allow_setuid: bool = False
    disk_mb: int = 0
    frozen: list[str] = []
    frozen_lowers: list[str] = []
    upper_frozen: str | None = None
    auid: int | None = None
    network: bool = False
    init_pid: int | None = None
    init_start: int | None = None
    warm_id: str | None = None
    create_ms: dict[str, float] = {}
    reroot_ms: dict[str, float] | None = None
