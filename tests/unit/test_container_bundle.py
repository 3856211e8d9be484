"""Unit tests of the container tier's policy rendering, user resolution and file confinement.

No root needed: these check what crun and dsec_execd would be told, and exercise
RootedFiles on a plain directory (openat2 needs no privilege)."""

from __future__ import annotations

import base64
import io
import os
import tarfile
from pathlib import Path

import pytest

from dsec.contract.isolation import CAPABILITIES, DENIED_IOCTLS, MASKED_PATHS, READONLY_PATHS, RULES
from dsec.contract.runtime import SandboxFiles
from dsec.errors import FileNotFound, InvalidRequest, PathOutsideSandbox, PayloadTooLarge
from dsec.runtimes.container.bundle import cgroup_parent, execd_policy_text, oci_config
from dsec.runtimes.container.files import RootedFiles
from dsec.runtimes.container.seccomp import execd_policy_lines, oci_seccomp
from dsec.runtimes.container.users import resolve_user


def _config(tmp_path: Path, **kw: object) -> dict:
    args: dict = dict(
        rootfs=tmp_path / "rootfs",
        init_binary=tmp_path / "init",
        hostname="box",
        cgroups_path="/dsec-x/sb-1",
        cpu=1.5,
        memory_mb=256,
        pids=100,
        env={"A": "b"},
        memsw=True,
    )
    args.update(kw)
    return oci_config(**args)


def test_namespaces_and_cgroup(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    types = {n["type"] for n in cfg["linux"]["namespaces"]}
    assert types == {"pid", "mount", "ipc", "uts", "network", "cgroup"}
    assert "user" not in types
    assert cfg["linux"]["cgroupsPath"] == "/dsec-x/sb-1"
    res = cfg["linux"]["resources"]
    assert res["cpu"] == {"quota": 150_000, "period": 100_000}
    assert res["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert res["pids"] == {"limit": 100}
    assert res["devices"][0] == {"allow": False, "access": "rwm"}
    assert "swap" not in _config(tmp_path, memsw=False)["linux"]["resources"]["memory"]


def test_masked_and_readonly_paths(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    for p in ("/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount", "/proc/kcore", "/proc/keys",
              "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/proc/sysrq-trigger"):  # fmt: skip
        assert p in cfg["linux"]["maskedPaths"]
    for p in ("/proc/sys", "/proc/bus", "/proc/irq"):
        assert p in cfg["linux"]["readonlyPaths"]
    assert list(MASKED_PATHS) == cfg["linux"]["maskedPaths"]
    assert list(READONLY_PATHS) == cfg["linux"]["readonlyPaths"]
    sys_mount = next(m for m in cfg["mounts"] if m["destination"] == "/sys")
    assert "ro" in sys_mount["options"]


def test_process_is_locked_down(tmp_path: Path) -> None:
    proc = _config(tmp_path)["process"]
    assert proc["noNewPrivileges"] is True
    assert proc["user"] == {"uid": 0, "gid": 0}
    caps = set(proc["capabilities"]["bounding"])
    assert caps == set(CAPABILITIES)
    for dangerous in ("CAP_NET_RAW", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_MKNOD", "CAP_NET_ADMIN",
                      "CAP_SYS_MODULE", "CAP_DAC_READ_SEARCH", "CAP_SETFCAP", "CAP_AUDIT_WRITE"):  # fmt: skip
        assert dangerous not in caps
    assert proc["capabilities"]["ambient"] == [] and proc["capabilities"]["inheritable"] == []
    rlimits = {r["type"]: (r["soft"], r["hard"]) for r in proc["rlimits"]}
    assert rlimits["RLIMIT_NOFILE"][0] <= rlimits["RLIMIT_NOFILE"][1]
    assert rlimits["RLIMIT_CORE"] == (0, 0)
    init_mount = next(m for m in _config(tmp_path)["mounts"] if m["destination"] == proc["args"][0])
    assert "ro" in init_mount["options"] and init_mount["source"] == str(tmp_path / "init")


def test_seccomp_denies_what_containers_never_need() -> None:
    sec = oci_seccomp()
    assert sec["defaultAction"] == "SCMP_ACT_ALLOW"
    plain = {e["names"][0] for e in sec["syscalls"] if "args" not in e}
    for name in ("mount", "umount2", "pivot_root", "ptrace", "kexec_load", "kexec_file_load", "bpf",
                 "init_module", "finit_module", "delete_module", "perf_event_open", "userfaultfd",
                 "open_by_handle_at", "keyctl", "add_key", "unshare", "setns", "swapon", "swapoff",
                 "reboot", "acct", "quotactl", "io_uring_setup", "process_vm_readv"):  # fmt: skip
        assert name in plain, name
    assert "read" not in plain and "clone" not in plain and "ioctl" not in plain
    ioctls = {e["args"][0]["valueTwo"] for e in sec["syscalls"] if e["names"] == ["ioctl"]}
    assert {0xC0C0586D, 0x40049409, 0x4020940D, 0xC0189436, 0x5412, 0x541C} <= ioctls
    for e in sec["syscalls"]:
        if e["names"] == ["ioctl"]:
            arg = e["args"][0]
            assert (
                arg["index"] == 1
                and arg["op"] == "SCMP_CMP_MASKED_EQ"
                and arg["value"] == 0xFFFFFFFF
            )
    clone3 = next(e for e in sec["syscalls"] if e["names"] == ["clone3"])
    assert clone3["errnoRet"] == 38  # ENOSYS: libc falls back to clone, whose flags are checked
    assert DENIED_IOCTLS["XFS_IOC_SWAPEXT"] == 0xC0C0586D


def test_oci_and_execd_renderings_are_the_same_policy() -> None:
    """Both enforcers get exactly the same rules, in the same order."""
    oci_rules = []
    for e in oci_seccomp()["syscalls"]:
        if "args" in e:
            a = e["args"][0]
            op = {"SCMP_CMP_EQ": "eq", "SCMP_CMP_MASKED_EQ": "masked_eq"}[a["op"]]
            oci_rules.append(
                f"deny_arg {e['names'][0]} {e['errnoRet']} {a['index']} {op} {a['value']} {a['valueTwo']}"
            )
        else:
            oci_rules.append(f"deny {e['names'][0]} {e['errnoRet']}")
    execd_rules = [line for line in execd_policy_lines() if line.startswith("deny")]
    assert oci_rules == execd_rules
    assert len(execd_rules) == len(RULES)
    text = execd_policy_text()
    assert {int(line.split()[1]) for line in text.splitlines() if line.startswith("cap ")} == set(
        CAPABILITIES.values()
    )
    assert any(line.startswith("rlimit 7 ") for line in text.splitlines())  # RLIMIT_NOFILE


def test_cgroup_parent_depends_on_home(tmp_path: Path) -> None:
    a, b = cgroup_parent(tmp_path / "a"), cgroup_parent(tmp_path / "b")
    assert a != b and a.startswith("dsec-") and a == cgroup_parent(tmp_path / "a")


PASSWD = "root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000::/home/sandbox:/bin/sh\nbroken line\n"
GROUP = "root:x:0:\nsandbox:x:1000:\nstaff:x:50:sandbox,other\nwheel:x:10:root\n"


def test_resolve_user() -> None:
    u = resolve_user("sandbox", PASSWD, GROUP)
    assert (u.uid, u.gid, u.home, u.groups) == (1000, 1000, "/home/sandbox", [50])
    assert resolve_user(None, PASSWD, GROUP).uid == 0
    n = resolve_user("4242", PASSWD, GROUP)
    assert (n.uid, n.gid, n.home, n.groups) == (4242, 0, "/", [])
    assert resolve_user("1000:7", PASSWD, GROUP).gid == 7
    assert resolve_user("root", PASSWD, GROUP).groups == [10]
    with pytest.raises(InvalidRequest):
        resolve_user("nosuchuser", PASSWD, GROUP)
    with pytest.raises(InvalidRequest):
        resolve_user("sandbox", None, None)


# -- RootedFiles on a plain directory ----------------------------------------------


@pytest.fixture
def rooted(tmp_path: Path) -> tuple[RootedFiles, Path, Path]:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_text("sandbox\n")
    outside = tmp_path / "outside-secret"
    outside.write_text("HOST SECRET")
    return RootedFiles(root), root, outside


async def test_files_roundtrip(rooted: tuple[RootedFiles, Path, Path]) -> None:
    files, root, _ = rooted
    assert isinstance(files, SandboxFiles)
    info = await files.write("/a/b/c.txt", b"hello", mode=0o600)
    assert (info.type, info.size, info.mode, info.path) == ("file", 5, 0o600, "/a/b/c.txt")
    assert await files.read("/a/b/c.txt", 100) == b"hello"
    assert [i.name for i in await files.list("/a", depth=2)] == ["b", "c.txt"]
    await files.mkdir("/d/e")
    moved = await files.rename("/a/b/c.txt", "/d/e/f.txt")
    assert moved.path == "/d/e/f.txt"
    with pytest.raises(PayloadTooLarge):
        await files.read("/d/e/f.txt", 4)
    with pytest.raises(FileNotFound):
        await files.stat("/a/b/c.txt")
    with pytest.raises(InvalidRequest):
        await files.remove("/d")  # not empty, not recursive
    await files.remove("/d", recursive=True)
    assert not (root / "d").exists()


def test_replace_now_replaces_a_symlink_and_never_follows_it(
    rooted: tuple[RootedFiles, Path, Path],
) -> None:
    """What a node writes into an image's /etc/resolv.conf: an image's symlink (to the
    host's file, say) is replaced, its target left alone."""
    files, root, outside = rooted
    (root / "etc/resolv.conf").symlink_to(outside)
    files.replace_now("/etc/resolv.conf", b"nameserver 10.0.0.1\n")
    assert not (root / "etc/resolv.conf").is_symlink()
    assert (root / "etc/resolv.conf").read_bytes() == b"nameserver 10.0.0.1\n"
    assert outside.read_text() == "HOST SECRET"
    files.replace_now("/etc/resolv.conf", b"nameserver 10.0.0.2\n")  # a file: rewritten
    assert files.read_now("/etc/resolv.conf", 100) == b"nameserver 10.0.0.2\n"
    (root / "etc/link").symlink_to("../../outside-secret")  # resolved inside the root
    with pytest.raises(FileNotFound):
        files.read_now("/etc/link", 100)
    with pytest.raises(PathOutsideSandbox):
        files.replace_now("/../outside-secret", b"x")
    assert outside.read_text() == "HOST SECRET"


async def test_files_refuse_escapes(rooted: tuple[RootedFiles, Path, Path]) -> None:
    files, root, outside = rooted
    for bad in ("/../outside-secret", "/etc/../../outside-secret", "/../../../../etc/passwd"):
        with pytest.raises(PathOutsideSandbox):
            await files.read(bad, 1000)
    with pytest.raises(InvalidRequest):
        await files.read("relative/path", 1000)
    # symlinks, absolute or relative, resolve inside the root and never reach the host file
    os.symlink(str(outside), root / "abs-link")
    os.symlink("../../../../../../" + str(outside).lstrip("/"), root / "etc/rel-link")
    os.symlink(str(outside.parent), root / "dir-link")
    for link in ("/abs-link", "/etc/rel-link", "/dir-link/outside-secret"):
        with pytest.raises(FileNotFound):
            await files.read(link, 1000)
    with pytest.raises(FileNotFound):  # the link's target does not exist inside the root
        await files.write("/dir-link/outside-secret", b"pwned")
    (root / outside.parent.relative_to("/")).mkdir(parents=True)
    await files.write("/dir-link/outside-secret", b"pwned")  # lands inside the root
    assert outside.read_text() == "HOST SECRET"
    assert (root / outside.parent.relative_to("/") / "outside-secret").read_bytes() == b"pwned"
    st = await files.stat("/abs-link")
    assert st.type == "symlink" and st.target == str(outside)
    with pytest.raises(InvalidRequest):  # a planted link is never written through
        await files.write("/abs-link", b"overwrite")
    assert outside.read_text() == "HOST SECRET"
    os.mkfifo(root / "fifo")
    with pytest.raises(InvalidRequest):
        await files.read("/fifo", 10)  # never blocks on a FIFO
    with pytest.raises(InvalidRequest):
        await files.write("/fifo", b"x")


def _tar(members: list[tuple[str, bytes | None, str | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, link in members:
            ti = tarfile.TarInfo(name)
            if link is not None:
                ti.type, ti.linkname = tarfile.SYMTYPE, link
                tar.addfile(ti)
            elif data is None:
                ti.type = tarfile.DIRTYPE
                tar.addfile(ti)
            else:
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


async def test_tar_upload_download(rooted: tuple[RootedFiles, Path, Path]) -> None:
    files, root, outside = rooted
    n = await files.upload_tar(
        "/up", _tar([("d", None, None), ("d/x.txt", b"x", None), ("d/l", None, "x.txt")])
    )
    assert n == 3
    assert (root / "up/d/x.txt").read_bytes() == b"x"
    data = await files.download_tar("/up", 1 << 20)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = sorted(tar.getnames())
        assert names == ["d", "d/l", "d/x.txt"]  # relative to the directory, like upload_tar
        assert tar.getmember("d/l").issym()
    assert await files.upload_tar("/copy", data) == 3  # round trip
    assert (root / "copy/d/x.txt").read_bytes() == b"x"
    with tarfile.open(fileobj=io.BytesIO(await files.download_tar("/up/d/x.txt", 1 << 16))) as tar:
        assert tar.getnames() == ["x.txt"]
    with pytest.raises(PayloadTooLarge):
        await files.download_tar("/up", 100)
    for bad in ("../evil", "/abs/evil", "a/../../evil"):
        with pytest.raises(PathOutsideSandbox):
            await files.upload_tar("/up", _tar([(bad, b"evil", None)]))
    # a symlink member pointing out, then a file written "through" it: resolved inside
    # the root, where the target does not exist; the host file is never touched
    with pytest.raises(FileNotFound):
        await files.upload_tar(
            "/up2",
            _tar([("esc", None, str(outside.parent)), ("esc/outside-secret", b"pwned", None)]),
        )
    assert outside.read_text() == "HOST SECRET"


def test_oci_state_dir_refuses_planted_directories() -> None:
    """The OCI state root lives in world-writable /dev/shm: only a private dir of ours is used."""
    from dsec.runtimes.container.runtime import _private_tmpfs_dir

    name = f"dsec-test-{os.getpid()}"
    path = Path("/dev/shm") / name
    try:
        got = _private_tmpfs_dir(name, make=False)
        if got is None:
            pytest.skip("/dev/shm is not a tmpfs here")
        assert got == path and not path.exists()  # only asked: nothing made
        assert _private_tmpfs_dir(name, make=True) == path
        assert (path.stat().st_mode & 0o777) == 0o700
        path.chmod(0o777)  # as if someone else had planted it
        assert _private_tmpfs_dir(name, make=False) is None
        assert _private_tmpfs_dir(name, make=True) is None
        path.rmdir()
        path.symlink_to("/tmp")
        assert _private_tmpfs_dir(name, make=True) is None
    finally:
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            path.rmdir()


def test_a_compiled_seccomp_program_replaces_the_rules_for_crun(tmp_path: Path) -> None:
    prog = bytes(range(16))  # two 8-byte instructions
    cfg = _config(tmp_path, seccomp_bpf=prog)
    assert "seccomp" not in cfg["linux"]  # crun would otherwise compile the rules again
    assert base64.b64decode(cfg["annotations"]["run.oci.seccomp_bpf_data"]) == prog
    plain = _config(tmp_path)
    assert plain["linux"]["seccomp"] == oci_seccomp() and "annotations" not in plain
