"""Build planning and cache keys (which steps hit, which rebuild), the context index and
``.dockerignore``, and the cache index's per-owner, never-stale answers."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from dsec.builds import (
    AptInstall,
    Arg,
    Cmd,
    Copy,
    Entrypoint,
    Env,
    FromImage,
    ImageConfig,
    Label,
    Run,
    User,
    Workdir,
    parse_dockerfile,
)
from dsec.builds.cache import BuildCache, step_key
from dsec.builds.context import BuildContext, DockerIgnore
from dsec.builds.plan import APT_NETWORK, plan_steps
from dsec.errors import InvalidRequest, PayloadTooLarge
from dsec.layers.store import LayerStore
from dsec.network.policy import NetworkPolicy

BASE = ["sha256:" + "1" * 64]


def tar(files: dict[str, bytes | str], mtime: int = 1_700_000_000) -> bytes:
    """A context archive: ``name -> bytes`` files, ``name/ -> ""`` dirs, ``name -> "@target"``
    symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name.rstrip("/"))
            info.mtime = mtime
            if name.endswith("/"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            elif isinstance(data, str) and data.startswith("@"):
                info.type, info.linkname = tarfile.SYMTYPE, data[1:]
                tf.addfile(info)
            else:
                raw = data.encode() if isinstance(data, str) else data
                info.size, info.mode = len(raw), 0o644
                tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def keys(
    steps: list,  # type: ignore[type-arg]
    *,
    files: dict[str, bytes | str] | None = None,
    base: list[str] = BASE,
    build_args: dict[str, str] | None = None,
    config: ImageConfig | None = None,
    mtime: int = 1_700_000_000,
) -> list[str | None]:
    """The key of every step (None: not a filesystem step) in a build where each step's
    layer is derived from its key, as the engine computes them (on the stack so far)."""
    plan = plan_steps(
        steps,
        base_layers=base,
        base_config=config or ImageConfig(),
        build_args=build_args or {},
        context=BuildContext.from_tar(tar(files or {}, mtime)),
        run_network=None,
    )
    stack, out = list(base), []
    for s in plan.steps:
        if s.canonical is None:
            out.append(None)
            continue
        key = step_key(stack, s.canonical)
        out.append(key)
        stack.append("sha256:" + hashlib.sha256(key.encode()).hexdigest())
    return out


THREE = [
    FromImage(image="debian"),
    Run(cmd="echo one > /one"),
    Copy(src=["app.py"], dest="/app/"),
    Run(cmd="python3 /app/app.py"),
]
FILES = {"app.py": b"print('v1')\n"}


def test_an_unchanged_build_has_the_same_keys_and_metadata_steps_have_none() -> None:
    a = keys([*THREE, Cmd(cmd=["python3"])], files=FILES)
    assert a == keys([*THREE, Cmd(cmd=["python3"])], files=FILES)
    assert a[0] is None and a[4] is None
    assert len({k for k in a if k}) == 3


def test_a_changed_middle_step_changes_only_its_key_and_the_ones_after() -> None:
    a = keys(THREE, files=FILES)
    b = keys(THREE, files={"app.py": b"print('v2')\n"})
    assert a[1] == b[1] and a[2] != b[2] and a[3] != b[3]
    c = keys([THREE[0], THREE[1], Copy(src=["app.py"], dest="/srv/"), THREE[3]], files=FILES)
    assert a[1] == c[1] and a[2] != c[2] and a[3] != c[3]
    d = keys([THREE[0], Run(cmd="echo two > /one"), *THREE[2:]], files=FILES)
    assert all(x != y for x, y in zip(a[1:], d[1:], strict=True))


def test_keys_ignore_instruction_text_lines_mtimes_and_config_only_steps() -> None:
    a = keys(THREE, files=FILES)
    annotated = [s.model_copy(update={"source": "RUN  # reformatted", "line": 40}) for s in THREE]
    assert keys(annotated, files=FILES) == a
    assert keys(THREE, files=FILES, mtime=1_800_000_000) == a  # a fresh checkout still hits
    with_config = [THREE[0], Label(labels={"x": "y"}), THREE[1], Cmd(cmd="x"), *THREE[2:]]
    got = keys(with_config, files=FILES)
    assert [k for k in got if k] == [k for k in a if k]


def test_env_and_args_count_only_for_the_steps_that_see_them() -> None:
    a = keys(THREE, files=FILES)
    b = keys([THREE[0], Env(vars={"A": "1"}), *THREE[1:]], files=FILES)
    assert [k for k in b if k] != [k for k in a if k]  # every RUN now sees A
    c = keys([*THREE, Env(vars={"A": "1"}), Entrypoint(entrypoint=["x"])], files=FILES)
    assert [k for k in c if k] == [k for k in a if k]  # set after the last filesystem step
    with_arg = [THREE[0], Arg(name="V", default="1"), *THREE[1:]]
    d1 = keys(with_arg, files=FILES)
    assert d1 == keys(with_arg, files=FILES, build_args={"V": "1"})
    d2 = keys(with_arg, files=FILES, build_args={"V": "2"})
    assert d1[2] != d2[2]


def test_user_workdir_network_and_base_are_part_of_the_keys() -> None:
    a = keys(THREE, files=FILES)
    assert keys([THREE[0], User(user="sandbox"), *THREE[1:]], files=FILES)[2] != a[1]
    assert keys([THREE[0], Workdir(path="/w"), *THREE[1:]], files=FILES)[2] != a[1]
    net = Run(cmd="echo one > /one", network=NetworkPolicy(presets=["pypi"]))
    assert keys([THREE[0], net, *THREE[2:]], files=FILES)[1] != a[1]
    other = keys(THREE, files=FILES, base=["sha256:" + "2" * 64])
    assert all(x != y for x, y in zip(a[1:], other[1:], strict=True))


def test_keys_chain_through_the_layers_actually_below() -> None:
    plan = plan_steps(
        THREE,
        base_layers=BASE,
        base_config=ImageConfig(),
        build_args={},
        context=BuildContext.from_tar(tar(FILES)),
        run_network=None,
    )
    canonical = plan.steps[2].canonical
    assert canonical is not None
    # the same COPY on a rebuilt (different) layer below is another key: no stale reuse
    assert step_key([*BASE, "sha256:" + "a" * 64], canonical) != step_key(
        [*BASE, "sha256:" + "b" * 64], canonical
    )
    # a step that changed nothing added no layer: the next step's key does not move
    assert step_key(BASE, canonical) == step_key(list(BASE), dict(canonical))


def test_dockerfile_comment_and_blank_changes_keep_every_key() -> None:
    def plan_keys(text: str) -> list[str | None]:
        df = parse_dockerfile(text)
        return keys(df.steps({}, {}), files=FILES)

    a = plan_keys("FROM debian\nRUN echo one > /one\nCOPY app.py /app/\nRUN python3 /app/app.py\n")
    b = plan_keys(
        "# comment\nFROM debian\n\nRUN echo one \\\n > /one\n# x\nCOPY app.py /app/\n"
        'RUN python3 /app/app.py\nCMD ["x"]\n'
    )
    assert [k for k in a if k] != [k for k in b if k]  # a continuation is a different command
    c = plan_keys(
        "# comment\nFROM debian\n\nRUN echo one > /one\n# x\nCOPY app.py /app/\nRUN python3 /app/app.py\n"
    )
    assert [k for k in a if k] == [k for k in c if k]


def test_plan_state_network_workdir_and_the_image_config() -> None:
    plan = plan_steps(
        [
            FromImage(image="python"),
            Env(vars={"B": "2"}),
            Arg(name="TOKEN", default="t"),
            Workdir(path="app"),
            AptInstall(packages=["git"]),
            User(user="sandbox"),
            Run(cmd="make"),
            Run(cmd="make", network="none"),
            Cmd(cmd="serve"),
            Workdir(path="/data"),
        ],
        base_layers=BASE,
        base_config=ImageConfig(
            Env=["PATH=/usr/local/bin:/usr/bin", "B=1"],
            WorkingDir="/srv",
            Cmd=["python3"],
            Entrypoint=None,
        ),
        build_args={"UNUSED": "x"},
        context=BuildContext.empty(),
        run_network=NetworkPolicy(presets=["debian", "pypi"]),
    )
    apt, run, run_none, workdir = plan.steps[4], plan.steps[6], plan.steps[7], plan.steps[9]
    assert apt.network == APT_NETWORK and apt.workdir == "/srv/app" and apt.user is None
    assert apt.env == {"PATH": "/usr/local/bin:/usr/bin", "B": "2", "TOKEN": "t"}
    assert run.user == "sandbox" and run.network is not None and run_none.network is None
    assert not plan.steps[3].fs  # WORKDIR app: the next apt_install makes the directory
    assert workdir.fs and workdir.workdir == "/data"  # nothing runs after it: it makes it
    cfg = plan.config
    assert cfg.Env == ["PATH=/usr/local/bin:/usr/bin", "B=2"]  # build args are not kept
    assert (cfg.WorkingDir, cfg.User, cfg.Cmd) == ("/data", "sandbox", ["/bin/sh", "-c", "serve"])
    assert plan.notes == ["build arguments not declared by any ARG: UNUSED"]


def test_entrypoint_clears_an_inherited_cmd_but_not_one_the_build_set() -> None:
    def config(*extra: object) -> ImageConfig:
        return plan_steps(
            [FromImage(image="x"), *extra],  # type: ignore[list-item]
            base_layers=BASE,
            base_config=ImageConfig(Cmd=["bash"]),
            build_args={},
            context=BuildContext.empty(),
            run_network=None,
        ).config

    assert config(Entrypoint(entrypoint=["/e"])).Cmd is None
    assert config(Cmd(cmd=["a"]), Entrypoint(entrypoint=["/e"])).Cmd == ["a"]


def test_copy_sources_must_exist_and_several_need_a_directory() -> None:
    with pytest.raises(InvalidRequest) as e:
        keys([FromImage(image="x"), Copy(src=["missing.txt"], dest="/a", line=7)], files=FILES)
    assert e.value.details["line"] == 7 and "missing.txt" in e.value.message
    with pytest.raises(InvalidRequest, match="directory destination"):
        keys([FromImage(image="x"), Copy(src=["*.py", "app.py"], dest="/a")], files=FILES)
    with pytest.raises(InvalidRequest, match="at most 3 layers"):
        plan_steps(
            [FromImage(image="x"), Run(cmd="a"), Run(cmd="b"), Run(cmd="c")],
            base_layers=BASE,
            base_config=ImageConfig(),
            build_args={},
            context=BuildContext.empty(),
            run_network=None,
            max_layers=3,
        )


# --- the context and .dockerignore -----------------------------------------------------------


def test_context_index_globs_symlinks_and_digests() -> None:
    ctx = BuildContext.from_tar(
        tar(
            {
                "src/a.py": "a",
                "src/b.py": "b",
                "src/c.txt": "c",
                "link": "@src/a.py",
                "out": "@/../x",
            }
        )
    )
    assert ctx.match("src/*.py") == ["src/a.py", "src/b.py"]
    assert ctx.match("./src/") == ["src"] and ctx.match(".") == [""]
    assert ctx.match("*/?.txt") == ["src/c.txt"]
    assert ctx.resolve("link") is not None and ctx.resolve("link").path == "src/a.py"  # type: ignore[union-attr]
    assert ctx.lookup("src").type == "dir"  # type: ignore[union-attr]  # implied by members
    same = BuildContext.from_tar(tar({"src/a.py": "a", "src/b.py": "b", "src/c.txt": "c"}, 1))
    assert ctx.content_digest(["src"]) == same.content_digest(["src"])
    changed = BuildContext.from_tar(tar({"src/a.py": "A", "src/b.py": "b", "src/c.txt": "c"}))
    assert ctx.content_digest(["src"]) != changed.content_digest(["src"])
    with pytest.raises(InvalidRequest, match="leaves the build context"):
        BuildContext.from_tar(tar({"../escape": "x"}))


def test_context_limits() -> None:
    with pytest.raises(PayloadTooLarge):
        BuildContext.from_tar(tar({"a": b"x" * 100}), max_bytes=50)
    with pytest.raises(PayloadTooLarge):
        BuildContext.from_tar(tar({"a": "1", "b": "2", "c": "3"}), max_entries=2)
    import gzip

    bomb = gzip.compress(tar({"big": b"\0" * (4 << 20)}))
    with pytest.raises(PayloadTooLarge):
        BuildContext.from_tar(bomb, max_bytes=1 << 20)
    assert BuildContext.from_tar(gzip.compress(tar({"a": "1"}))).lookup("a") is not None


def test_dockerignore_semantics() -> None:
    ig = DockerIgnore.parse(
        "# comment\n.git\n*.pyc\n**/__pycache__\nbuild/\ndocs/*.md\n!docs/README.md\n/secret.txt\n"
    )
    assert ig.excluded(".git") and ig.excluded(".git/config")
    assert ig.excluded("x.pyc") and not ig.excluded("pkg/x.pyc")  # * stays in one component
    assert ig.excluded("pkg/sub/__pycache__/m.cpython.pyc")
    assert ig.excluded("build/out/bin")
    assert ig.excluded("docs/guide.md") and not ig.excluded("docs/README.md")
    assert ig.excluded("secret.txt") and not ig.excluded("src/main.py")
    ctx = BuildContext.from_tar(tar({"a.pyc": "x", "src/m.py": "y", ".git/HEAD": "z"}))
    kept = ctx.without(ig)
    assert sorted(p for p in kept.entries if p) == ["src", "src/m.py"]


# --- the cache index ---------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    s = LayerStore(tmp_path / "layers", tmp_path / "scratch")
    yield s  # type: ignore[misc]
    s.close()


def _layer(store: LayerStore, tmp_path: Path, content: str) -> str:
    tree = tmp_path / f"tree-{content}"
    tree.mkdir()
    (tree / "f").write_text(content)
    return store.build_layer(tree, "workspace").digest


def test_cache_is_per_owner_and_survives_reopening(store: LayerStore, tmp_path: Path) -> None:
    layer = _layer(store, tmp_path, "a")
    store.grant_layers("kaaaaaaaaaaaaaaaa", [layer])
    cache = BuildCache(tmp_path / "cache.db", store)
    cache.record("kaaaaaaaaaaaaaaaa", "key1", layer, "RUN a")
    cache.record("kaaaaaaaaaaaaaaaa", "key2", None, "RUN true")
    assert cache.lookup("kaaaaaaaaaaaaaaaa", "key1").layer == layer  # type: ignore[union-attr]
    assert cache.lookup("kbbbbbbbbbbbbbbbb", "key1") is None  # another key: no hit
    cache.close()
    again = BuildCache(tmp_path / "cache.db", store)
    assert again.lookup("kaaaaaaaaaaaaaaaa", "key1").layer == layer  # type: ignore[union-attr]
    hit = again.lookup("kaaaaaaaaaaaaaaaa", "key2")
    assert hit is not None and hit.layer is None  # a step that changed nothing
    assert [e["key"] for e in again.entries("kbbbbbbbbbbbbbbbb")] == []
    again.close()


def test_cache_never_hands_out_a_layer_not_granted_or_gone(
    store: LayerStore, tmp_path: Path
) -> None:
    owner = "kaaaaaaaaaaaaaaaa"
    cache = BuildCache(tmp_path / "cache.db", store)
    ungranted = _layer(store, tmp_path, "b")
    cache.record(owner, "k-ungranted", ungranted)
    assert cache.lookup(owner, "k-ungranted") is None
    assert cache.entries(owner) == []  # the stale entry is gone
    cache.record(owner, "k-missing", "sha256:" + "9" * 64)
    assert cache.lookup(owner, "k-missing") is None
    granted = _layer(store, tmp_path, "c")
    store.grant_layers(owner, [granted])
    cache.record(owner, "k-ok", granted)
    assert cache.lookup(owner, "k-ok") is not None
    assert cache.prune(unused_for_s=-1) == 1 and cache.lookup(owner, "k-ok") is None
    cache.close()
