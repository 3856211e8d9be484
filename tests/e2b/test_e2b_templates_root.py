"""E2B's template API through the unmodified ``e2b`` SDK against a real ``dsec serve``.

``Template.build`` (from_image, from_template, from_dockerfile, copy, run_cmd, set_envs,
set_workdir, set_user, set_start_cmd) runs through dsec's image builds on the container
tier; sandboxes of the template get its files, environment, user, working directory and
start command. Also: aliases, tags, list, delete, another key's view (not found), and the
bad input of issue 17 (unknown template, unknown step type, a failing step with its output
and nothing stored, files never uploaded, an upload over the size limit).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b.exceptions import BuildException, FileUploadException, TemplateException
from tests.conftest import _seed_layers
from tests.isolation import worker_subnet
from tests.timing import budget

from dsec.models import ImageRef, KeyScope
from e2b import Sandbox, Template, wait_for_timeout

pytestmark = pytest.mark.root

SUBNET = worker_subnet(234)  # not the other tests' subnets
MAX_CONTEXT = 1 << 20  # DSEC_MAX_BUILD_CONTEXT_BYTES of this server: small, to test 413


class Server:
    def __init__(self, bg: Any, other_key: str) -> None:
        self.bg = bg
        self.url = bg.url
        self.api = f"{bg.url}/e2b"
        self.key = bg.api_key
        self.other_key = other_key

    def owner(self, key: str | None = None) -> str:
        return self.bg.keys.verify(key or self.key)

    def image(self, name: str, key: str | None = None) -> Any:
        assert self.bg.edge is not None
        return self.bg.call(self.bg.edge.get_image(ImageRef(name=name), self.owner(key)))

    def images(self, key: str | None = None) -> list[str]:
        assert self.bg.edge is not None
        owner = self.owner(key)
        return [
            i.name
            for i in self.bg.call(self.bg.edge.list_images(KeyScope(), owner)).images
            if i.owner == owner
        ]

    def http(self, method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"X-API-Key": key or self.key, **kw.pop("headers", {})}
        return httpx.request(method, self.api + path, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def server(dsec_home_root: Path, shared_layers: Path) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    from dsec.server import BackgroundServer

    home = dsec_home_root / "e2b-templates"
    _seed_layers(home, shared_layers)
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ["DSEC_MAX_BUILD_CONTEXT_BYTES"] = str(MAX_CONTEXT)
    try:
        with BackgroundServer(home, tiers=["container"], network_options={"subnet": SUBNET}) as bg:
            assert bg.edge is not None
            if "container" not in bg.edge.runtimes:
                pytest.skip("the container tier is not available on this node")
            bg.call(bg.edge.layers.ensure_image("busybox"))
            os.environ.update(
                E2B_API_URL=f"{bg.url}/e2b",
                E2B_SANDBOX_URL=f"{bg.url}/e2b/envd",
                E2B_API_KEY=bg.api_key,
            )
            yield Server(bg, bg.keys.create_key("e2b-templates-other"))
    finally:
        os.environ.pop("DSEC_MAX_BUILD_CONTEXT_BYTES", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def ctx(tmp_path: Path) -> Path:
    d = tmp_path / "ctx"
    (d / "app" / "sub").mkdir(parents=True)
    (d / "app" / "a.txt").write_text("hello\n")
    (d / "app" / "sub" / "b.txt").write_text("deep\n")
    (d / "main.py").write_text("print(6 * 7)\n")
    (d / "x1.cfg").write_text("one\n")
    (d / "x2.cfg").write_text("two\n")
    return d


def name() -> str:
    return "tpl-" + secrets.token_hex(4)


def run(sb: Sandbox, cmd: str, **kw: Any) -> str:
    r = sb.commands.run(cmd, **kw)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def test_build_then_sandbox_has_files_env_user_workdir_and_start(server: Server, ctx: Path) -> None:
    alias = name()
    t = (
        Template(file_context_path=str(ctx))
        .from_image("busybox")
        .copy("app", "/opt/app")
        .copy("main.py", "main.py")
        .copy("*.cfg", "/etc/cfgs", mode=0o755)
        .set_envs({"FOO": "bar", "PATH": "/opt/bin:$PATH"})
        .run_cmd("echo built-as-$(id -un) > /tmp/built")
        .set_user("root")
        .run_cmd("mkdir -p /srv/data && echo root-made > /srv/data/x")
        .set_user("user")
        .set_workdir("/home/user/work")
        .set_start_cmd("echo started > /tmp/started; exec sleep 100000", "test -f /tmp/started")
    )
    logs: list[Any] = []
    info = Template.build(t, alias, cpu_count=1, memory_mb=300, on_build_logs=logs.append)
    assert info.name == alias and info.tags == ["default"]
    assert any("RUN echo built-as" in str(e.message) for e in logs)
    assert Template.exists(alias)

    sb = Sandbox.create(alias)
    try:
        assert run(sb, "id -un").strip() == "user"
        assert run(sb, "pwd").strip() == "/home/user/work"
        assert run(sb, "cat /opt/app/a.txt /opt/app/sub/b.txt") == "hello\ndeep\n"
        assert run(sb, "cat /home/user/main.py") == "print(6 * 7)\n"
        # a glob copies what it matched into the destination, with the mode given
        assert run(sb, "ls /etc/cfgs").split() == ["x1.cfg", "x2.cfg"]
        assert run(sb, "stat -c '%a %U' /etc/cfgs/x1.cfg /opt/app/a.txt").split("\n")[:2] == [
            "755 user",
            "644 user",
        ]
        assert run(sb, "cat /tmp/built").strip() == "built-as-user"
        assert run(sb, "stat -c %U /srv/data/x").strip() == "root"
        env = run(sb, "echo $FOO; echo $PATH").split("\n")
        assert env[0] == "bar" and env[1].startswith("/opt/bin:/") and "/usr/bin" in env[1]
        assert run(sb, "cat /tmp/started").strip() == "started"  # the ready check passed
        assert sb.get_info().memory_mb == 300  # the template's size
    finally:
        sb.kill()

    # the template is the key's image; a rebuild with nothing changed is all cache hits
    assert alias in server.images()
    logs.clear()
    Template.build(t, alias, on_build_logs=logs.append)
    messages = [str(e.message) for e in logs]
    assert any("already cached" in m for m in messages), messages
    assert any("0 steps built" in m for m in messages), messages


def test_dockerfile_template_and_time_only_ready_check(server: Server, ctx: Path) -> None:
    alias = name()
    dockerfile = (
        "FROM busybox\n"
        "ENV GREETING=hi\n"
        "WORKDIR /app\n"
        "COPY app/ ./\n"
        "RUN echo $GREETING > /app/greeting\n"
        'CMD ["sh", "-c", "echo up > /tmp/cmd-ran; exec sleep 100000"]\n'
    )
    t = Template(file_context_path=str(ctx)).from_dockerfile(dockerfile)
    Template.build(t, alias)
    start = server.image(alias).meta["start"]
    # the SDK turns CMD into a start command with `sleep 20` as its ready check: dsec starts
    # the command and does not make every create sleep 20 s (docs/e2b.md)
    assert "ready_cmd" not in start
    assert "sleep 100000" in str(start["cmd"])
    sb = Sandbox.create(alias)
    try:
        # the Dockerfile set no USER: E2B's default user comes last; its WORKDIR stays
        assert run(sb, "id -un").strip() == "user"
        assert run(sb, "pwd").strip() == "/app"
        assert run(sb, "cat /app/greeting /app/a.txt") == "hi\nhello\n"
        deadline = time.monotonic() + budget(10)
        while sb.commands.run("test -f /tmp/cmd-ran").exit_code != 0:
            if time.monotonic() > deadline:
                pytest.fail("the start command (Dockerfile CMD) did not run")
            time.sleep(0.1)
    finally:
        sb.kill()


def test_time_only_ready_check_is_not_a_create_time_sleep(server: Server) -> None:
    alias = name()
    t = (
        Template()
        .from_image("busybox")
        .set_start_cmd("exec sleep 100000", wait_for_timeout(30_000))
    )
    Template.build(t, alias)
    assert "ready_cmd" not in server.image(alias).meta["start"]


def test_from_template_and_tags(server: Server, ctx: Path) -> None:
    parent = name()
    Template.build(Template().from_image("busybox").run_cmd("echo parent > /home/user/p"), parent)
    child = name()
    Template.build(
        Template().from_template(parent).run_cmd("cat /home/user/p > /home/user/c"),
        f"{child}:v1",
    )
    sb = Sandbox.create(f"{child}:v1")
    try:
        assert run(sb, "cat /home/user/c").strip() == "parent"
        assert run(sb, "id -un").strip() == "user"  # the parent's user, kept
    finally:
        sb.kill()
    assert Template.exists(child)
    tags = {t.tag for t in Template.get_tags(child)}
    assert tags == {"v1"}
    got = Template.assign_tags(f"{child}:v1", ["stable", "prod"])
    assert sorted(got.tags) == ["prod", "stable"]
    tags_now = Template.get_tags(child)
    assert {t.tag for t in tags_now} == {"v1", "stable", "prod"}
    assert len({t.build_id for t in tags_now}) == 1  # one build, three tags
    sb = Sandbox.create(f"{child}:stable")
    try:
        assert run(sb, "cat /home/user/c").strip() == "parent"
    finally:
        sb.kill()
    Template.remove_tags(child, "prod")
    assert {t.tag for t in Template.get_tags(child)} == {"v1", "stable"}
    # by id too
    template_id = server.http("GET", f"/templates/aliases/{child}").json()["templateID"]
    sb = Sandbox.create(template_id)  # no default tag: the newest build
    sb.kill()
    listed = {t["aliases"][0]: t for t in server.http("GET", "/templates").json()}
    assert listed[child]["templateID"] == template_id and listed[parent]["buildStatus"] == "ready"
    assert server.http("GET", f"/templates/{template_id}").json()["builds"]
    # delete: every tag's image goes
    assert server.http("DELETE", f"/templates/{template_id}").status_code == 204
    assert not Template.exists(child)
    assert not [n for n in server.images() if n.split(":")[0] == child]


def test_another_key_sees_not_found(server: Server) -> None:
    alias = name()
    Template.build(Template().from_image("busybox").run_cmd("true"), alias)
    template_id = server.http("GET", f"/templates/aliases/{alias}").json()["templateID"]
    other = server.other_key
    assert not Template.exists(alias, api_key=other)
    assert server.http("GET", f"/templates/aliases/{alias}", key=other).status_code == 404
    assert server.http("GET", f"/templates/{template_id}", key=other).status_code == 404
    assert server.http("DELETE", f"/templates/{template_id}", key=other).status_code == 404
    assert server.http("GET", f"/templates/{template_id}/tags", key=other).status_code == 404
    listed = server.http("GET", "/templates", key=other).json()
    assert alias not in [t["aliases"][0] for t in listed]
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(template_id, api_key=other)
    # a build started by one key cannot be driven or read by another
    r = server.http("POST", "/v3/templates", json={"name": name()})
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    body = {"fromImage": "busybox", "steps": []}
    assert (
        server.http("POST", f"/v2/templates/{tid}/builds/{bid}", key=other, json=body).status_code
        == 404
    )
    assert server.http("GET", f"/templates/{tid}/builds/{bid}/status", key=other).status_code == 404
    assert server.http("GET", f"/templates/{tid}/files/{'0' * 64}", key=other).status_code == 404
    assert Template.exists(alias)  # still there for its owner


def test_failing_step_reports_step_and_output_and_stores_nothing(server: Server) -> None:
    alias = name()
    t = (
        Template()
        .from_image("busybox")
        .run_cmd("echo fine")
        .run_cmd("echo about-to-fail; echo details >&2; exit 3")
        .run_cmd("echo never")
    )
    with pytest.raises(BuildException) as exc:
        Template.build(t, alias)
    msg = str(exc.value)
    assert "template step 2" in msg and "exit code 3" in msg, msg
    info = Template.build_in_background(t, alias)
    deadline = time.monotonic() + budget(60)
    while True:
        status = Template.get_build_status(info, logs_offset=0)
        if status.status.value in ("ready", "error") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status.status.value == "error" and status.reason is not None
    assert status.reason.step == "2"
    tail = " ".join(e.message for e in status.reason.log_entries)
    assert "about-to-fail" in tail and "details" in tail
    assert not Template.exists(alias)
    assert alias not in server.images()


def test_bad_input(server: Server, ctx: Path) -> None:
    # an unknown template: a typed not-found, for a base and for a sandbox
    with pytest.raises(BuildException, match="not found"):
        Template.build(Template().from_template("no-such-template-x").run_cmd("true"), name())
    with pytest.raises(Exception, match="not found"):
        Sandbox.create("no-such-template-x")
    # a name dsec cannot take, a public template's name
    assert server.http("POST", "/v3/templates", json={"name": "Bad Name"}).status_code == 400
    assert server.http("POST", "/v3/templates", json={"name": "base"}).status_code == 409
    assert server.http("POST", "/v3/templates", json={"name": "busybox"}).status_code == 409
    r = server.http("POST", "/v3/templates", json={"name": name(), "cpuCount": "two"})
    assert r.status_code == 400
    # a step type dsec does not know: 400 naming the step
    r = server.http("POST", "/v3/templates", json={"name": name()})
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    steps = [{"type": "RUN", "args": ["true"]}, {"type": "HEALTHCHECK", "args": ["x"]}]
    r = server.http(
        "POST", f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": "busybox", "steps": steps}
    )
    assert r.status_code == 400 and "step 2" in r.json()["message"], r.text
    assert "HEALTHCHECK" in r.json()["message"]
    # a COPY whose files were never uploaded
    steps = [{"type": "COPY", "args": ["a", "/a"], "filesHash": "ab" * 32}]
    r = server.http(
        "POST", f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": "busybox", "steps": steps}
    )
    assert r.status_code == 400 and "not uploaded" in r.json()["message"], r.text
    # an unknown base image
    r = server.http(
        "POST",
        f"/v2/templates/{tid}/builds/{bid}",
        json={"fromImage": "no-such-image-x", "steps": []},
    )
    assert r.status_code in (404, 422), r.text
    # registry credentials are refused, not ignored
    r = server.http(
        "POST",
        f"/v2/templates/{tid}/builds/{bid}",
        json={
            "fromImage": "busybox",
            "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"},
        },
    )
    assert r.status_code == 422, r.text
    # malformed JSON, status of a build that does not exist
    r = server.http("POST", "/v3/templates", content=b"{", headers={"content-type": "x"})
    assert r.status_code == 400
    assert server.http("GET", f"/templates/{tid}/builds/{'0' * 8}/status").status_code == 404
    # a context over the size limit: 413 on the upload
    big = ctx / "big.bin"
    big.write_bytes(os.urandom(MAX_CONTEXT + 4096))
    with pytest.raises(FileUploadException, match="413"):
        Template.build(
            Template(file_context_path=str(ctx)).from_image("busybox").copy("big.bin", "/b"),
            name(),
        )
    # an upload URL is signed: a forged or another template's token is refused
    r = server.http("POST", "/v3/templates", json={"name": name()})
    tid2 = r.json()["templateID"]
    link = server.http("GET", f"/templates/{tid2}/files/{'cd' * 32}").json()
    assert link["present"] is False
    forged = link["url"].replace(tid2, tid)
    assert httpx.put(forged, content=b"x").status_code == 403
    assert httpx.put(link["url"] + "0", content=b"x").status_code == 403
    assert httpx.put(link["url"], content=b"not a tar").status_code == 200
    # no 500 for any of it; the template API never answered one
    with pytest.raises(TemplateException):
        Template.assign_tags("no-such-template-x:default", "t")
