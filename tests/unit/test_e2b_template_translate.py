"""E2B template steps -> dsec build steps (``dsec.e2b.templates.translate_template``): pure,
no server. The build itself is tested through the SDK in tests/e2b/test_e2b_templates_root.py."""

from __future__ import annotations

import pytest

from dsec.builds.steps import Copy, Env, FromImage, Label, Run, StartCmd, User, Workdir
from dsec.e2b.errors import E2BError
from dsec.e2b.templates import _copy_source, _expand, template_id_of, translate_template

BASE = FromImage(image="busybox")
H = "ab" * 32


def tr(body: dict, *, from_template: bool = False, env: dict | None = None):
    return translate_template(
        body, base=BASE, base_env=env or {}, from_template=from_template, labels={"l": "1"}
    )


def test_image_base_is_provisioned_with_e2b_default_user_and_home() -> None:
    out = tr({"fromImage": "busybox", "steps": []})
    kinds = [type(s).__name__ for s in out.steps]
    assert kinds == ["FromImage", "User", "Run", "User", "Workdir", "Label"]
    assert out.steps[1] == User(user="root")
    assert "user" in out.steps[2].cmd and out.steps[2].network == "none"
    assert out.steps[3] == User(user="user") and out.steps[4] == Workdir(path="/home/user")
    assert set(out.origins[:5]) == {"base"} and out.origins[-1] == "finalize"


def test_template_base_keeps_its_user_and_is_not_provisioned() -> None:
    out = tr(
        {"fromTemplate": "t", "steps": [{"type": "RUN", "args": ["make"]}]}, from_template=True
    )
    assert [type(s) for s in out.steps] == [FromImage, Run, Label]


def test_steps_map_with_origins_and_e2b_semantics() -> None:
    steps = [
        {"type": "ENV", "args": ["A", "1", "P", "/x:$PATH:${A}:${B:-dflt}"]},
        {"type": "COPY", "args": ["src/*.py", "app/", "", "0755"], "filesHash": H},
        {"type": "RUN", "args": ["whoami", "root"]},
        {"type": "WORKDIR", "args": ["/w"]},
        {"type": "USER", "args": ["bob", "true"]},
        {"type": "COPY", "args": ["f", "/f", "alice:staff"], "filesHash": H},
    ]
    out = tr({"fromImage": "busybox", "steps": steps, "startCmd": "srv", "readyCmd": "ok"})
    mine = list(zip(out.origins, out.steps, strict=True))[5:]
    env = mine[0][1]
    assert isinstance(env, Env) and env.vars["P"].startswith("/x:/usr/local/sbin:")
    assert env.vars["P"].endswith(":1:dflt") and mine[0][0] == "1"
    copy = mine[1][1]
    # a glob copies its directory part of the upload (which holds only what matched)
    assert isinstance(copy, Copy) and copy.src == [f".e2b-files/{H}/src"]
    assert copy.chown == "user" and copy.chmod == "0755"  # E2B: owned by the current user
    # RUN as another user for one step, then back
    assert [type(s) for _, s in mine[2:5]] == [User, Run, User]
    assert mine[2][1].user == "root" and mine[4][1].user == "user"
    # WORKDIR as a non-root user is made by that user first
    assert isinstance(mine[5][1], Run) and mine[5][1].cmd == ["mkdir", "-p", "/w"]
    assert isinstance(mine[6][1], Workdir) and mine[6][1].path == "/w" and mine[6][0] == "4"
    # USER creates the user (with sudo) as root
    assert [type(s) for _, s in mine[7:10]] == [User, Run, User]
    assert mine[8][1].cmd[-2:] == ["bob", "true"] and mine[9][1].user == "bob"
    assert isinstance(mine[10][1], Copy) and mine[10][1].chown == "alice:staff"
    start = mine[11][1]
    assert isinstance(start, StartCmd) and start.ready_cmd == "ok"
    assert start.ready_timeout_s == 300
    assert out.hashes == [H]


@pytest.mark.parametrize("ready", [None, "sleep 20", " sleep 1.5 "])
def test_time_only_ready_checks_are_not_create_time_waits(ready: str | None) -> None:
    body = {"fromImage": "x", "steps": [], "startCmd": "srv"}
    if ready is not None:
        body["readyCmd"] = ready
    start = next(s for s in tr(body).steps if isinstance(s, StartCmd))
    assert start.ready_cmd is None


def test_force_anywhere_disables_the_cache() -> None:
    assert tr({"steps": [{"type": "RUN", "args": ["x"], "force": True}]}).no_cache
    assert tr({"steps": [], "force": True}).no_cache
    assert not tr({"steps": [{"type": "RUN", "args": ["x"]}]}).no_cache


@pytest.mark.parametrize(
    ("step", "words"),
    [
        ({"type": "HEALTHCHECK", "args": ["x"]}, "unknown step type"),
        ({"type": "RUN", "args": []}, "needs a command"),
        ({"type": "COPY", "args": ["a", "/a"]}, "filesHash"),
        ({"type": "COPY", "args": ["a", "/a", "", "rwx"], "filesHash": H}, "chmod"),
        ({"type": "ENV", "args": ["A"]}, "pairs"),
        ({"type": "ENV", "args": ["1A", "x"]}, "variable name"),
        ({"type": "USER", "args": ["bad user!"]}, "invalid user"),
        ({"type": "RUN", "args": [1]}, "list of strings"),
    ],
)
def test_bad_steps_are_400_naming_the_step(step: dict, words: str) -> None:
    with pytest.raises(E2BError) as exc:
        tr({"steps": [{"type": "RUN", "args": ["ok"]}, step]})
    assert exc.value.status == 400 and "step 2" in exc.value.message
    assert words in exc.value.message


def test_expand_and_ids() -> None:
    assert _expand(r"a\$b $X ${Y} ${Z-d} ${E:-e} $", {"X": "x", "Y": "y", "E": ""}) == (
        "a$b x y d e $"
    )
    assert _copy_source("./a/b.txt", H) == f".e2b-files/{H}/a/b.txt"
    assert _copy_source("*.cfg", H) == f".e2b-files/{H}"
    tid = template_id_of("k1", "web")
    assert tid == template_id_of("k1", "web") != template_id_of("k2", "web")
    assert len(tid) == 20 and tid.isalnum() and tid.islower()
    assert isinstance(tr({"steps": []}).steps[-1], Label)


def test_build_records_are_bounded() -> None:
    from dsec.e2b import templates as t

    api = t.TemplateAPI(None, None, None)  # type: ignore[arg-type]
    from datetime import timedelta

    old = t._now() - timedelta(seconds=t.UPLOAD_URL_TTL_S + 60)
    for i in range(t.MAX_BUILDS + 50):  # finished, and requested but never started
        status = "ready" if i % 2 else "waiting"
        b = t._Build(f"b{i}", "k", "tid", "a", ["default"], None, None, status=status)
        b.created_at = old
        api._remember(b)
    running = t._Build("run", "k", "tid", "a", ["default"], None, None, status="building")
    api._remember(running)
    assert len(api._builds) <= t.MAX_BUILDS and "run" in api._builds
    b = t._Build("logs", "k", "tid", "a", ["default"], None, None)
    for i in range(t.MAX_LOG_ENTRIES + 10):
        b.log(str(i))
    assert len(b.entries) == t.MAX_LOG_ENTRIES and b.dropped == 10
