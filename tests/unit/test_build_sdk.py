"""The SDK builder (``dsec.Image``), the build wire format and the CLI's ``image build -f``,
against a mocked ``POST /v1/builds`` that records what it received (hermetic)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import dsec
import dsec.cli.main as cli
from dsec import AsyncClient, BuildFailed, Image
from dsec.builds import (
    BuildDone,
    BuildError,
    BuildRequest,
    BuildStarted,
    Copy,
    FromImage,
    Run,
    StepOutput,
    StepStarted,
    decode_build_upload,
    encode_build_upload,
    parse_event,
)
from dsec.errors import InvalidRequest
from dsec.models import ImageInfo

NOW = datetime(2026, 12, 1, tzinfo=UTC)
IMAGE = ImageInfo(name="app:1", layers=["sha256:" + "a" * 64], size=10, created_at=NOW)


def names(data: bytes) -> list[str]:
    return tarfile.open(fileobj=io.BytesIO(data)).getnames()


def member(data: bytes, name: str) -> bytes:
    tf = tarfile.open(fileobj=io.BytesIO(data))
    f = tf.extractfile(name)
    assert f is not None
    return f.read()


# --- the builder ------------------------------------------------------------------------------


def test_image_is_immutable_and_chainable(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("print(1)\n")
    base = Image.from_image("debian")
    a = base.apt_install("git", ["curl"]).pip_install("pytest==8.3.3")
    b = base.run("echo b")
    assert base.steps == [FromImage(image="debian")]
    assert [s.op for s in a.steps] == ["from_image", "apt_install", "pip_install"]
    assert a.steps[1].packages == ["git", "curl"]
    assert [s.op for s in b.steps] == ["from_image", "run"]
    full = (
        a.copy(tmp_path / "app.py", "/app/app.py", chmod="0755")
        .env({"A": "1"}, B="2")
        .workdir("/app")
        .user("sandbox")
        .cmd(["python3", "app.py"])
        .entrypoint("/entry.sh")
        .arg("V", "1")
        .label(team="rl")
        .expose(8080)
        .run("true", network={"presets": ["github"]})
    )
    ops = [s.op for s in full.steps]
    assert ops[3:] == [
        "copy", "env", "workdir", "user", "cmd", "entrypoint", "arg", "label", "expose", "run",
    ]  # fmt: skip
    assert full.steps[3] == Copy(src=["sdk/0/app.py"], dest="/app/app.py", chmod="0755")
    assert full.steps[-1].network.presets == ["github"]


def test_invalid_steps_are_refused_at_once(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="Debian package"):
        Image.from_image("debian").apt_install("curl; rm -rf /")
    with pytest.raises(InvalidRequest, match="pip requirement"):
        Image.from_image("debian").pip_install("--index-url=http://evil")
    with pytest.raises(InvalidRequest, match="no local file"):
        Image.from_image("debian").copy(tmp_path / "nope", "/x")
    with pytest.raises(InvalidRequest, match="invalid image name"):
        Image.from_image("Not A Name")
    with pytest.raises(InvalidRequest, match="name"):
        Image.from_image("debian").env({"1X": "y"})


def test_request_and_context_are_what_goes_over_the_wire(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("x = 1\n")
    (src / "link").symlink_to("pkg/m.py")
    (tmp_path / "req.txt").write_text("numpy\n")
    image = (
        Image.from_image("debian")
        .copy(src, "/work/src")
        .copy(tmp_path / "req.txt", "/tmp/")
        .run("pip install -r /tmp/req.txt")
    )
    req = image.request("app:1", no_cache=True, memory_mb=2048)
    assert req.name == "app:1" and req.no_cache and req.memory_mb == 2048
    assert req.steps is not None and req.steps[1].src == ["sdk/0/src"]
    assert req.steps[2].src == ["sdk/1/req.txt"]
    assert req.effective_run_network() is None  # spec builds: no network unless asked
    ctx = image.context()
    assert names(ctx) == [
        "sdk/0", "sdk/0/src", "sdk/0/src/link", "sdk/0/src/pkg", "sdk/0/src/pkg/m.py",
        "sdk/1", "sdk/1/req.txt",
    ]  # fmt: skip
    tf = tarfile.open(fileobj=io.BytesIO(ctx))
    assert tf.getmember("sdk/0/src/link").issym()
    assert all(m.uid == 0 and m.uname == "" for m in tf.getmembers())
    with pytest.raises(InvalidRequest, match="memory_mb"):
        image.request("app:1", memory_mb=1)
    with pytest.raises(InvalidRequest, match="invalid image name"):
        image.request("UPPER")


def test_from_dockerfile_packs_the_context_minus_dockerignore(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM debian\nARG V\nCOPY . /app/\n")
    (tmp_path / ".dockerignore").write_text("node_modules\n*.log\n!keep.log\n")
    (tmp_path / "node_modules" / "x").mkdir(parents=True)
    (tmp_path / "node_modules" / "x" / "big.js").write_text("...")
    (tmp_path / "a.log").write_text("no")
    (tmp_path / "keep.log").write_text("yes")
    (tmp_path / "main.py").write_text("print()")
    image = Image.from_dockerfile(tmp_path / "Dockerfile", build_args={"V": "1"})
    req = image.request("app:2", build_args={"W": "2"})
    assert req.dockerfile == "FROM debian\nARG V\nCOPY . /app/\n" and req.steps is None
    assert req.build_args == {"V": "1", "W": "2"}
    assert req.effective_run_network() is not None  # Dockerfiles: debian + pypi by default
    assert req.effective_run_network().presets == ["debian", "pypi"]  # type: ignore[union-attr]
    assert sorted(names(image.context())) == [".dockerignore", "Dockerfile", "keep.log", "main.py"]
    assert image.request("x", run_network=None).effective_run_network() is None
    with pytest.raises(InvalidRequest, match="Dockerfile"):
        image.run("echo more")


# --- the wire ---------------------------------------------------------------------------------


def test_upload_framing_round_trips_and_refuses_other_bodies() -> None:
    req = Image.from_image("busybox").run("true").request("x")
    ctx = io.BytesIO()
    with tarfile.open(fileobj=ctx, mode="w") as tf:
        info = tarfile.TarInfo("f.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    body = encode_build_upload(req, ctx.getvalue())
    assert names(body)[0] == ".dsec-build.json"
    got, context = decode_build_upload(body)
    assert got == req and names(context) == ["f.txt"] and member(context, "f.txt") == b"hi"
    assert decode_build_upload(encode_build_upload(req))[1] == b""
    with pytest.raises(InvalidRequest, match="first tar member"):
        decode_build_upload(ctx.getvalue())
    with pytest.raises(InvalidRequest, match="not a tar"):
        decode_build_upload(b"{}")
    with pytest.raises(InvalidRequest, match="exactly one of"):
        BuildRequest.parse({"name": "x"})
    with pytest.raises(InvalidRequest, match="bogus"):
        BuildRequest.parse({"name": "x", "dockerfile": "FROM a", "bogus": 1})


def test_events_are_parsed_leniently() -> None:
    assert parse_event("") is None
    assert parse_event('{"type": "from-the-future", "x": 1}') is None
    ev = parse_event('{"type": "output", "step": 2, "stream": "stdout", "data": "hi", "new": 1}')
    assert isinstance(ev, StepOutput) and ev.data == "hi"
    done = parse_event(
        json.dumps({"type": "done", "image": {**IMAGE.model_dump(mode="json"), "new_field": True}})
    )
    assert isinstance(done, BuildDone) and done.image.name == "app:1"
    with pytest.raises(InvalidRequest):
        parse_event("{not json")


# --- the client against a mocked POST /v1/builds ---------------------------------------------


def _events(*events: Any) -> bytes:
    return b"".join(e.model_dump_json().encode() + b"\n" for e in events)


class FakeBuilds:
    """``POST /v1/builds``: records each request and answers with programmed events."""

    def __init__(self, answer: Callable[[BuildRequest, bytes], httpx.Response]) -> None:
        self.requests: list[tuple[BuildRequest, bytes, httpx.Headers]] = []
        self.answer = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/v1/builds"
        req, context = decode_build_upload(request.read())
        self.requests.append((req, context, request.headers))
        return self.answer(req, context)


def ok_answer(req: BuildRequest, context: bytes) -> httpx.Response:
    body = _events(
        BuildStarted(build_id="b-1", name=req.name, base="busybox", steps=2),
        StepStarted(step=1, total=2, instruction="FROM busybox"),
        StepStarted(step=2, total=2, instruction="RUN echo hi"),
        StepOutput(step=2, stream="stdout", data="hi\n"),
        BuildDone(image=IMAGE, built_steps=1),
    )
    return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})


async def test_build_posts_the_spec_and_context_and_returns_the_image(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("data")
    fake = FakeBuilds(ok_answer)
    seen: list[Any] = []
    async with AsyncClient("http://dsec.test", "k", transport=httpx.MockTransport(fake)) as c:
        image = Image.from_image("busybox").copy(tmp_path / "f", "/f").run("echo hi")
        got = await image.build_async("app:1", client=c, on_event=seen.append, no_cache=True)
    assert got == IMAGE
    req, context, headers = fake.requests[0]
    assert headers["content-type"] == "application/x-tar"
    assert headers["authorization"] == "Bearer k"
    assert req.no_cache and [s.op for s in req.steps or []] == ["from_image", "copy", "run"]
    assert member(context, "sdk/0/f") == b"data"
    assert [e.type for e in seen] == ["start", "step", "step", "output", "done"]


async def test_a_failed_step_raises_build_failed_with_where_and_the_output_tail() -> None:
    def failing(req: BuildRequest, context: bytes) -> httpx.Response:
        body = _events(
            StepStarted(step=2, total=2, instruction="RUN make"),
            BuildError(
                code="build_failed",
                message="step 2/2 (RUN make) failed with exit code 2",
                step=2,
                instruction="RUN make",
                line=3,
                output_tail="make: *** no rule\n",
                details={"exit_code": 2},
            ),
        )
        return httpx.Response(200, content=body)

    transport = httpx.MockTransport(FakeBuilds(failing))
    async with AsyncClient("http://dsec.test", "k", transport=transport) as c:
        with pytest.raises(BuildFailed) as e:
            await c.build(Image.from_image("busybox").run("make"), "app:1")
    assert e.value.details["step"] == 2 and e.value.details["line"] == 3
    assert e.value.details["output_tail"] == "make: *** no rule\n"
    assert e.value.details["exit_code"] == 2 and "exit code 2" in e.value.message


async def test_a_refusal_before_the_stream_is_the_error_it_names() -> None:
    def refuse(req: BuildRequest, context: bytes) -> httpx.Response:
        err = InvalidRequest("Dockerfile line 2: VOLUME: volumes are not supported", line=2)
        return httpx.Response(400, json=err.to_wire())

    transport = httpx.MockTransport(FakeBuilds(refuse))
    async with AsyncClient("http://dsec.test", "k", transport=transport) as c:
        with pytest.raises(InvalidRequest, match="VOLUME") as e:
            await c.build(Image.from_image("busybox").run("x"), "app:1")
    assert e.value.details["line"] == 2


async def test_a_stream_that_stops_early_is_an_error() -> None:
    def cut(req: BuildRequest, context: bytes) -> httpx.Response:
        return httpx.Response(200, content=_events(StepStarted(step=1, total=3, instruction="x")))

    transport = httpx.MockTransport(FakeBuilds(cut))
    async with AsyncClient("http://dsec.test", "k", transport=transport) as c:
        with pytest.raises(dsec.ServiceUnavailable, match="ended before"):
            await c.build(Image.from_image("busybox").run("x"), "app:1")


def test_the_sync_build_uses_the_same_wire(tmp_path: Path) -> None:
    fake = FakeBuilds(ok_answer)
    client = dsec.Client("http://dsec.test", "k", transport=httpx.MockTransport(fake))
    try:
        assert Image.from_image("busybox").run("echo hi").build("app:1", client=client) == IMAGE
        events = list(client.build_events(Image.from_image("busybox").run("echo hi"), "app:1"))
    finally:
        client.close()
    assert [e.type for e in events] == ["start", "step", "step", "output", "done"]
    assert len(fake.requests) == 2


# --- the CLI ---------------------------------------------------------------------------------


@pytest.fixture
def cli_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBuilds]:
    fake = FakeBuilds(ok_answer)
    monkeypatch.setattr(cli, "transport_factory", lambda: httpx.MockTransport(fake))
    yield fake


def test_cli_image_build_with_a_dockerfile(tmp_path: Path, cli_builds: FakeBuilds) -> None:
    (tmp_path / "Dockerfile").write_text("FROM busybox\nARG V\nRUN echo hi\n")
    (tmp_path / "x.txt").write_text("x")
    runner = CliRunner(env={"DSEC_API_KEY": "k", "DSEC_URL": "http://dsec.test"})
    result = runner.invoke(
        cli.app,
        [
            "image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path),
            "--name", "app:1", "--build-arg", "V=2", "--no-cache", "--run-network", "none",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "built app:1" in result.stdout and "1 steps built" in result.stdout
    assert "[2/2] RUN echo hi" in result.stderr and "hi\n" in result.stderr
    req, context, _ = cli_builds.requests[0]
    assert req.dockerfile == "FROM busybox\nARG V\nRUN echo hi\n"
    assert req.build_args == {"V": "2"} and req.no_cache
    assert "run_network" in req.model_fields_set and req.run_network is None
    assert "x.txt" in names(context)
    bad = runner.invoke(cli.app, ["image", "build", str(tmp_path), "--name", "a", "--no-cache"])
    assert bad.exit_code == 1 and "need -f" in bad.stderr


def test_cli_build_failure_is_one_red_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(req: BuildRequest, context: bytes) -> httpx.Response:
        err = BuildError(
            code="build_failed", message="step 2/2 (RUN false) failed with exit code 1"
        )
        return httpx.Response(200, content=_events(err))

    monkeypatch.setattr(cli, "transport_factory", lambda: httpx.MockTransport(FakeBuilds(failing)))
    (tmp_path / "Dockerfile").write_text("FROM busybox\nRUN false\n")
    runner = CliRunner(env={"DSEC_API_KEY": "k", "DSEC_URL": "http://dsec.test"})
    result = runner.invoke(
        cli.app,
        ["image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", "a"],
    )
    assert result.exit_code == 1
    assert "exit code 1" in result.stderr and "build_failed" in result.stderr


def test_steps_models_are_the_public_wire(tmp_path: Path) -> None:
    req = BuildRequest.parse(
        {
            "name": "x",
            "steps": [{"op": "from_image", "image": "busybox"}, {"op": "run", "cmd": ["true"]}],
        }
    )
    assert req.steps == [FromImage(image="busybox"), Run(cmd=["true"])]
