"""Each tier reads its handles' JSON as its own typed model (issue 33 step 3): parsed once
per handle, given back with ``keep``, and a handle an older dsec wrote still parses."""

from __future__ import annotations

from dsec.contract.runtime import Handle
from dsec.models import CreateSandboxRequest
from dsec.runtimes.container.state import ContainerState
from dsec.runtimes.microvm.state import MicrovmState
from dsec.testing import FakeEdge, MemoryState

OLD_CONTAINER_HANDLE = {  # as an older dsec's container tier wrote it (no layer scope)
    "oci_runtime": "/usr/bin/crun",
    "state_root": "/run/dsec/oci",
    "cgroup": "dsec-1234/sb-n-1",
    "cpu_group": "",
    "layers": ["sha256:" + "a" * 64],
    "layer_paths": ["/var/lib/dsec/layers/a.erofs"],
    "hostname": "sandbox",
    "env": {"TASK": "t-1"},
    "user": None,
    "workdir": "/work",
    "limits": {"cpu": 0.5, "memory_mb": 256, "pids": 64},
    "allow_setuid": False,
    "disk_mb": 512,
    "uid": 1000,
    "gid": 1000,
    "init_pid": 4242,
    "init_start": 987654,
    "network": True,
    "create_ms": {"rootfs": 3.5, "total": 9.25},
    "a_later_field": {"kept": True},
}


def test_an_old_container_handle_parses() -> None:
    handle = Handle("sb-n-1", dict(OLD_CONTAINER_HANDLE))
    st = handle.typed(ContainerState)
    assert (st.init_pid, st.init_start, st.uid, st.workdir) == (4242, 987654, 1000, "/work")
    assert (st.limits.cpu, st.limits.memory_mb, st.limits.pids) == (0.5, 256, 64)
    assert st.network and st.env == {"TASK": "t-1"} and st.layer_scope == ""
    assert (st.frozen, st.frozen_lowers, st.upper_frozen, st.auid) == ([], [], None, None)
    assert handle.typed(ContainerState) is st  # parsed once


def test_keep_gives_the_json_back_without_unset_fields() -> None:
    handle = Handle("sb-n-1", dict(OLD_CONTAINER_HANDLE))
    st = handle.typed(ContainerState)
    st.upper_frozen = "fz-1"
    st.frozen = [*st.frozen, "fz-1"]
    handle.keep(st)
    assert handle.state["upper_frozen"] == "fz-1" and handle.state["frozen"] == ["fz-1"]
    assert handle.state["a_later_field"] == {"kept": True}  # a newer dsec's field survives
    assert (
        "warm_id" not in handle.state and "auid" not in handle.state and "user" not in handle.state
    )
    assert handle.typed(ContainerState) is st
    again = Handle("sb-n-1", dict(handle.state)).typed(ContainerState)  # a restarted edge
    assert again == st


def test_a_replaced_state_is_parsed_again() -> None:
    handle = Handle.of("sb-n-1", ContainerState(init_pid=1, init_start=2))
    assert handle.typed(ContainerState).init_pid == 1
    handle.state = {**handle.state, "init_pid": 7}
    assert handle.typed(ContainerState).init_pid == 7
    assert Handle("sb-n-1").typed(ContainerState).init_pid is None  # an empty handle


async def test_the_memory_runtime_keeps_its_typed_state() -> None:
    edge = FakeEdge()
    info = await edge.create_sandbox(CreateSandboxRequest(tier="container"), "k1")
    handle = edge._live[info.id].handle
    assert handle.state == {"fake": True} and handle.typed(MemoryState).fake
    rt = edge.runtimes["container"]
    assert await rt.recover(Handle(info.id, {"fake": True}))  # a handle of an older dsec
    await edge.close()


OLD_MICROVM_HANDLE = {  # as an older dsec's microvm tier wrote it
    "dir": "/var/lib/dsec/microvm/sandboxes/sb-n-2",
    "pid": 5151,
    "accel": "kvm",
    "vcpus": 2,
    "memory_mb": 1024,
    "disk_mb": 2048,
    "workdir": "/root",
    "env": {"A": "1"},
    "user": None,
    "hostname": "sandbox",
    "template": None,
    "cpu": 1.5,
    "pids": 1024,
    "layer_paths": ["/var/lib/dsec/layers/a.erofs"],
    "full_guest": False,
    "qemu_name": "pool-1234",
}


def test_an_old_microvm_handle_parses_and_keeps_its_machine() -> None:
    handle = Handle("sb-n-2", dict(OLD_MICROVM_HANDLE))
    st = handle.typed(MicrovmState)
    assert (st.pid, st.vcpus, st.memory_mb, st.disk_mb, st.cpu) == (5151, 2, 1024, 2048, 1.5)
    assert (st.qemu_name, st.template, st.forked_from, st.workdir) == (
        "pool-1234",
        None,
        None,
        "/root",
    )
    st.pid = 0  # suspended to a file
    handle.keep(st)
    unset = {k for k, v in OLD_MICROVM_HANDLE.items() if v is None}  # left out of the JSON
    assert unset == {"template", "user"}
    assert handle.state == {
        **{k: v for k, v in OLD_MICROVM_HANDLE.items() if k not in unset},
        "pid": 0,
    }
    # a handle from before memory snapshots: no machine description
    assert Handle("sb-n-3", {"pid": 7}).typed(MicrovmState).vcpus is None


def test_a_spec_takes_every_field_it_shares_with_the_request_by_name() -> None:
    from dsec.contract.runtime import SandboxSpec
    from dsec.edge.registry import ResolvedRequest
    from dsec.network import NetworkPolicy

    req = ResolvedRequest(
        tier="container",
        cpu=0.25,
        memory_mb=300,
        disk_mb=700,
        pids=77,
        env={"A": "1"},
        user="1000:1000",
        workdir="/w",
        labels={"task": "t"},
        network=NetworkPolicy(allow_domains=["pypi.org"]),
        allow_setuid=True,
    )
    spec = SandboxSpec.of_request(
        req, id="sb-n-1", layer_paths=["/l.erofs"], layer_digests=["sha256:" + "a" * 64]
    )
    shared = {f for f in SandboxSpec.__dataclass_fields__ if f in ResolvedRequest.model_fields}
    assert shared >= {"cpu", "memory_mb", "disk_mb", "pids", "env", "workdir", "network"}
    assert {f: getattr(spec, f) for f in shared} == {f: getattr(req, f) for f in shared}
    assert (spec.id, spec.hostname, spec.owner) == ("sb-n-1", "sandbox", "")
    spec.env["B"] = "2"  # the runtime's copy: the stored request is not changed through it
    assert req.env == {"A": "1"}
    # what the node decides wins over a field of the same name
    assert SandboxSpec.of_request(req, id="x", layer_paths=[], layer_digests=[], cpu=1.0).cpu == 1.0
