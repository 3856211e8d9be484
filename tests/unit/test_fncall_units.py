"""Hermetic tests of the fncall tier's pure parts: seccomp program, framing, validation, router.

The router is driven through FastAPI's test client with a recording service that speaks the
real request/response models (no kernel needed).
"""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from dsec.apiserver.routes_runcode import make_runcode_router, request_api_key
from dsec.config import Paths
from dsec.errors import InvalidRequest, PayloadTooLarge
from dsec.runtimes.fncall import seccomp
from dsec.runtimes.fncall.languages import LANGUAGES, resolve_language
from dsec.runtimes.fncall.pool import _FrameReader, encode_frame
from dsec.runtimes.fncall.runtime import FncallRuntime, result_from_agent
from dsec.runtimes.fncall.service import (
    CodeRunRequest,
    CodeRunResult,
    RunCodeLimits,
    RunCodeRequest,
    RunCodeResponse,
    RunCodeService,
    RunStatus,
    check_env,
    work_relative,
)
from dsec.runtimes.fncall.toolkits import TOOLKITS, toolkit_key


def _decode(prog: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]


def test_seccomp_program_checks_arch_first_and_allows_by_default() -> None:
    insns = _decode(seccomp.build_filter())
    assert insns[0] == (0x20, 0, 0, 4)  # load arch
    assert insns[1][3] == seccomp.AUDIT_ARCH_X86_64
    assert insns[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS)
    assert insns[-1] == (0x06, 0, 0, seccomp.RET_ALLOW)
    compared = {k for code, _jt, _jf, k in insns if code == 0x15}
    for name in (
        "mount",
        "ptrace",
        "bpf",
        "unshare",
        "setns",
        "keyctl",
        "kexec_load",
        "init_module",
        "userfaultfd",
    ):
        assert seccomp.DENIED_SYSCALLS[name] in compared, name
    for name in ("XFS_IOC_SWAPEXT", "FICLONE", "TIOCSTI"):
        assert seccomp.DENIED_IOCTLS[name] in compared, name
    # every conditional jump stays inside the program
    for i, (code, jt, jf, _k) in enumerate(insns):
        if code in (0x15, 0x35, 0x45):
            assert i + 1 + max(jt, jf) < len(insns)


def test_frames_roundtrip_in_pieces() -> None:
    data = encode_frame({"op": "result", "n": 1}, b"\x00blob") + encode_frame({"op": "chunk"}, b"")
    reader = _FrameReader()
    got = []
    for i in range(len(data)):
        got += reader.feed(data[i : i + 1])
    assert got == [({"op": "result", "n": 1}, b"\x00blob"), ({"op": "chunk"}, b"")]


def test_result_from_agent_slices_the_blob() -> None:
    res = {
        "exit_code": 0,
        "signal": None,
        "stdout_len": 3,
        "stderr_len": 2,
        "duration_s": 0.5,
        "timed_out": False,
    }
    r = result_from_agent(res, b"xxoutER", offset=2)
    assert (r.stdout, r.stderr, r.exit_code, r.duration_ms) == ("out", "ER", 0, 500.0)


@pytest.mark.parametrize(
    ("path", "rel"), [("a.txt", "a.txt"), ("/work/d/e.txt", "d/e.txt"), ("./x//y", "x/y")]
)
def test_work_relative_accepts_paths_in_work(path: str, rel: str) -> None:
    assert work_relative(path) == rel


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../x", "a/../../b", "/work/../etc", "", "/work", "a\0b"]
)
def test_work_relative_rejects_paths_outside(path: str) -> None:
    with pytest.raises(InvalidRequest):
        work_relative(path)


def test_languages_and_aliases() -> None:
    assert resolve_language("Python3").name == "python"
    assert resolve_language("c++").name == "cpp"
    assert {"python", "bash", "c", "cpp"} <= set(LANGUAGES)
    for spec in LANGUAGES.values():
        assert all(t in TOOLKITS for t in spec.toolkits)
    with pytest.raises(InvalidRequest, match="unsupported language"):
        resolve_language("cobol")


def test_toolkit_key_is_a_function_of_inputs() -> None:
    a = toolkit_key(["sha256:" + "1" * 64], ("gcc", "g++"))
    assert a == toolkit_key(["sha256:" + "1" * 64], ("g++", "gcc"))
    assert a != toolkit_key(["sha256:" + "2" * 64], ("gcc", "g++"))


def _service(tmp_path: Path, **limits: Any) -> RunCodeService:
    return RunCodeService(FncallRuntime(Paths(tmp_path)), RunCodeLimits(**limits))


def test_job_validation(tmp_path: Path) -> None:
    svc = _service(tmp_path, max_files_bytes=10, max_stdin_bytes=4)
    job = svc.job_from_sandboxfusion(
        RunCodeRequest(
            code="print(1)",
            language="python",
            files={"/work/a": base64.b64encode(b"hi").decode(), "b": None},
            fetch_files=["/work/out.txt"],
        )
    )
    assert (
        job.files == [("a", b"hi")]
        and job.fetch == ["out.txt"]
        and job.fetch_names == {"out.txt": ["/work/out.txt"]}
    )
    with pytest.raises(PayloadTooLarge):
        svc.job_from_sandboxfusion(
            RunCodeRequest(
                code="", language="python", files={"a": base64.b64encode(b"x" * 11).decode()}
            )
        )
    with pytest.raises(PayloadTooLarge):
        svc.job_from_sandboxfusion(RunCodeRequest(code="", language="python", stdin="12345"))
    with pytest.raises(InvalidRequest, match="overwrite"):
        svc.job_from_sandboxfusion(
            RunCodeRequest(code="", language="python", files={"main.py": ""})
        )
    with pytest.raises(InvalidRequest, match="base64"):
        svc.job_from_dsec(CodeRunRequest(code="", language="python", stdin_b64="@@"))
    with pytest.raises(InvalidRequest, match="memory"):
        svc.job_from_dsec(CodeRunRequest(code="", language="python", memory_mb=1 << 20))


def test_job_validation_of_paths_env_and_timeouts(tmp_path: Path) -> None:
    """Input the worker could not carry out is refused up front, naming the field."""
    svc = _service(tmp_path)
    x = base64.b64encode(b"x").decode()

    def sf(**kw: Any) -> Any:
        return svc.job_from_sandboxfusion(RunCodeRequest(code="", language="python", **kw))

    with pytest.raises(InvalidRequest, match=r"files: 'a/b' needs 'a' to be a directory"):
        sf(files={"a": x, "a/b": x})
    with pytest.raises(InvalidRequest, match=r"needs 'main\.py' to be a directory"):
        sf(files={"main.py/x": x})
    with pytest.raises(InvalidRequest, match="same file"):
        sf(files={"a": x, "./a": x})
    with pytest.raises(InvalidRequest, match=r"files: path .* component of 300 bytes"):
        sf(files={"a" * 300: x})
    with pytest.raises(InvalidRequest, match=r"fetch_files\[1\] .* lone surrogate"):
        sf(fetch_files=["ok", "\udc80x"])
    # a name per spelling asked for, one fetch per file
    job = sf(fetch_files=["o", "/work/o", "./o", "d/p"])
    assert job.fetch == ["o", "d/p"]
    assert job.fetch_names == {"o": ["o", "/work/o", "./o"], "d/p": ["d/p"]}
    # compile_timeout is ignored where there is no compile step (SandboxFusion does)
    assert sf(compile_timeout=0).compile_timeout_s == 0
    with pytest.raises(InvalidRequest, match="compile timeout"):
        svc.job_from_sandboxfusion(RunCodeRequest(code="", language="c", compile_timeout=0))
    with pytest.raises(InvalidRequest, match="run timeout"):
        sf(run_timeout=301)
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        svc.job_from_dsec(CodeRunRequest(code="", language="python", stdin="\ud800"))
    with pytest.raises(PayloadTooLarge, match=r"env\['A'\]"):
        svc.job_from_dsec(CodeRunRequest(code="", language="c", env={"A": "x" * (200 << 10)}))


def test_files_must_fit_the_pools_work_tmpfs(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    job = svc.job_from_dsec(
        CodeRunRequest(
            code="", language="python", files={"a": base64.b64encode(b"x" * (3 << 20)).decode()}
        )
    )
    svc._check_fits(job, work_mb=4, fsize_mb=4)
    with pytest.raises(PayloadTooLarge, match="per file"):
        svc._check_fits(job, work_mb=4, fsize_mb=2)
    with pytest.raises(PayloadTooLarge, match="/work holds 2 MiB"):
        svc._check_fits(job, work_mb=2, fsize_mb=4)


def test_check_env_limits() -> None:
    lim = RunCodeLimits(max_env_vars=3, max_env_bytes=100)
    check_env({"A": "1", "PATH": "/opt/x:/usr/bin"}, lim)
    for bad in ({"": "x"}, {"A=B": "x"}, {"A": "x\0y"}, {"A": "\ud800"}, {"\udc80": "x"}):
        with pytest.raises(InvalidRequest):
            check_env(bad, lim)
    with pytest.raises(PayloadTooLarge, match="variables"):
        check_env({f"V{i}": "" for i in range(4)}, lim)
    with pytest.raises(PayloadTooLarge, match="totals"):
        check_env({"A": "x" * 60, "B": "y" * 60}, lim)
    with pytest.raises(PayloadTooLarge, match="kernel"):
        check_env({"A": "x" * (128 << 10)}, RunCodeLimits())


def test_base64_accepts_line_breaks_refuses_garbage(tmp_path: Path) -> None:
    """SandboxFusion decodes with the lenient ``b64decode``: what ``encodebytes`` and MIME
    produce (line breaks, spaces) is accepted; other characters or bad padding are not."""
    svc = _service(tmp_path)
    data = bytes(range(256)) * 3

    def files(value: str) -> list[tuple[str, bytes]]:
        req = RunCodeRequest(code="", language="python", files={"a": value})
        return svc.job_from_sandboxfusion(req).files

    assert files(base64.encodebytes(data).decode()) == [("a", data)]
    assert files(" " + base64.b64encode(data).decode() + "\r\n\t") == [("a", data)]
    for bad in ("!!!notb64", "eHg", "-_8=", "eA==\u00a0", "eA=x"):
        with pytest.raises(InvalidRequest, match=r"files\['a'\] is not valid base64"):
            files(bad)
    job = svc.job_from_dsec(CodeRunRequest(code="", language="python", stdin_b64="aGk=\n"))
    assert job.stdin == b"hi"


class RecordingService:
    """Speaks RunCodeService's two methods; records what the routes passed."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def run_code(self, req: RunCodeRequest) -> RunCodeResponse:
        self.calls.append(req)
        return RunCodeResponse(status=RunStatus.Success, message="")

    async def run(self, req: CodeRunRequest) -> CodeRunResult:
        self.calls.append(req)
        if req.language == "cobol":
            raise InvalidRequest("unsupported language 'cobol'")
        return CodeRunResult(outcome="ok")


def _client(keyless: list[str]) -> tuple[TestClient, RecordingService]:
    rec = RecordingService()

    def authorize(request: Request) -> str | None:
        return "owner" if request_api_key(request) == "good" else None

    app = FastAPI()
    app.include_router(make_runcode_router(lambda: rec, authorize, keyless_networks=keyless))  # type: ignore[arg-type,return-value]
    return TestClient(app, client=("127.0.0.1", 40000)), rec


def test_router_keyless_networks() -> None:
    client, rec = _client(["127.0.0.0/8"])
    r = client.post("/run_code", json={"code": "print(1)", "language": "python"})
    assert r.status_code == 200 and r.json()["status"] == "Success"
    client, rec = _client(["10.0.0.0/8"])
    r = client.post("/run_code", json={"code": "print(1)", "language": "python"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    assert rec.calls == []


def test_router_key_in_path_or_header() -> None:
    client, rec = _client([])
    assert (
        client.post("/k/good/run_code", json={"code": "1", "language": "python"}).status_code == 200
    )
    assert (
        client.post("/k/bad/run_code", json={"code": "1", "language": "python"}).status_code == 401
    )
    r = client.post(
        "/run_code",
        json={"code": "1", "language": "python"},
        headers={"Authorization": "Bearer good"},
    )
    assert r.status_code == 200
    assert len(rec.calls) == 2


def test_router_shapes_of_bad_input() -> None:
    client, _rec = _client(["0.0.0.0/0"])
    r = client.post("/run_code", json={"language": "python"})  # no code: SandboxFusion shape
    assert (
        r.status_code == 200
        and r.json()["status"] == "SandboxError"
        and "code" in r.json()["message"]
    )
    r = client.post("/run_code", content=b"{oops")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = client.post("/v1/run_code", json={"code": "x", "language": "cobol"})
    assert r.status_code == 400 and "cobol" in r.json()["error"]["message"]
    r = client.post("/v1/run_code", json={"code": "x", "language": "python", "bogus": 1})
    assert r.status_code == 400
    r = client.post("/v1/run_code", json={"code": "x", "language": "python"})
    assert r.status_code == 200 and r.json()["outcome"] == "ok"
    # nesting deeper than the parser's recursion limit: a 400, not a RecursionError (500)
    deep = b'{"code":"x","language":"python","env":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/run_code", "/v1/run_code"):
        r = client.post(path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text[:300])
        assert r.json()["error"]["code"] == "invalid_request" and "nested" in r.text
    # validation errors do not echo the (possibly huge) input back
    r = client.post("/v1/run_code", json={"code": "x", "language": "python", "env": ["y" * 9999]})
    assert r.status_code == 400 and "y" * 100 not in r.text


def test_router_is_lean_and_keeps_its_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run_code routes bypass FastAPI's dependency solving (measured per-request cost)
    but still describe their bodies and answers in the OpenAPI document."""
    import fastapi.routing

    solved: list[int] = []
    original = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        solved.append(1)
        return await original(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    client, rec = _client(["127.0.0.0/8"])
    r = client.post("/run_code", json={"code": "print(1)", "language": "python"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert RunCodeResponse.model_validate_json(r.content).status == RunStatus.Success
    assert solved == [] and len(rec.calls) == 1
    schema = client.app.openapi()  # type: ignore[attr-defined]
    for path in ("/run_code", "/k/{api_key}/run_code", "/v1/run_code"):
        post = schema["paths"][path]["post"]
        assert "requestBody" in post and "200" in post["responses"], path


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "missing"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(_thp_mode() in ("never", "missing"), reason="no transparent huge pages")
def test_collapse_heap_backs_anonymous_memory_with_huge_pages() -> None:
    """collapse_heap (run by every zygote after its preloads) turns a 2 MiB-aligned stretch of
    the process's anonymous heap into huge pages: forks then copy one entry per 2 MiB."""
    import mmap
    import os

    from dsec.runtimes.fncall.zygote import collapse_heap

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # in a child: the test process's own memory stays as it was
        try:
            heap = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            heap.write(b"x" * (8 << 20))  # populated, like an imported module heap
            before = _anon_huge_kb()
            done = collapse_heap()
            after = _anon_huge_kb()
            os.write(write_end, f"{before} {done} {after}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    before, done, after = map(int, os.read(read_end, 100).split())
    os.close(read_end)
    os.waitpid(pid, 0)
    assert done >= 4 << 20  # at least two aligned 2 MiB stretches of the 8 MiB mapping
    assert after - before >= 4096  # kB now mapped by huge pages


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


# --- SandboxFusion parity (issue 19) ---------------------------------------------------


@pytest.mark.parametrize(
    ("path", "key"),
    [("/mnt/b", "/mnt/b"), ("/mnt//b/./c", "/mnt/b/c"), ("/work/x", "x"), ("./y", "y")],
)
def test_fetch_files_take_absolute_paths(tmp_path: Path, path: str, key: str) -> None:
    """SandboxFusion fetches absolute paths (``/mnt/b``); ``files`` still go under /work."""
    svc = _service(tmp_path)
    job = svc.job_from_sandboxfusion(RunCodeRequest(code="", language="python", fetch_files=[path]))
    assert job.fetch == [key] and job.fetch_names == {key: [path]}
    assert work_relative(path, absolute_ok=True) == key
    with pytest.raises(InvalidRequest, match=r"'\.\.'"):
        work_relative("/mnt/../etc/passwd", absolute_ok=True)
    with pytest.raises(InvalidRequest, match="names a directory"):
        work_relative("/", absolute_ok=True)
    with pytest.raises(InvalidRequest, match="outside the work directory"):
        svc.job_from_sandboxfusion(
            RunCodeRequest(code="", language="python", files={"/mnt/b": "eA=="})
        )


def test_java_runs_as_sandboxfusion_does(tmp_path: Path) -> None:
    """``-ea``, javatuples and the call's jars on both class paths, and JVM flags on the
    command line (JAVA_TOOL_OPTIONS would make the JVM print "Picked up ..." on stderr)."""
    from dsec.runtimes.fncall.languages import CLASSPATH
    from dsec.runtimes.fncall.service import _argv

    java = LANGUAGES["java"]
    assert "JAVA_TOOL_OPTIONS" not in java.env
    assert java.compile is not None and CLASSPATH in java.compile and CLASSPATH in java.run
    assert java.run.index("-ea") < java.run.index("Main")
    svc = _service(tmp_path)
    x = base64.b64encode(b"x").decode()
    job = svc.job_from_sandboxfusion(
        RunCodeRequest(code="", language="java", files={"deps/a.jar": x, "notes.txt": x})
    )
    cp = ".:/usr/share/java/javatuples.jar:deps/a.jar"
    assert _argv(java.run, job)[_argv(java.run, job).index("-cp") + 1] == cp
    assert _argv(java.compile, job)[_argv(java.compile, job).index("-cp") + 1] == cp
    assert _argv(LANGUAGES["c"].run, job) == list(LANGUAGES["c"].run)


def test_sandboxfusion_languages_and_toolkits() -> None:
    rust = resolve_language("rust")
    assert rust.compile is not None and rust.compile[0] == "/usr/bin/rustc"
    assert resolve_language("rs") is rust
    assert "lodash@4.17.21" in TOOLKITS["nodejs"].npm
    assert LANGUAGES["nodejs"].env["NODE_PATH"].endswith("/node_modules")
    pins = dict(p.split("==") for p in TOOLKITS["python-runtime"].pip)
    assert pins["requests"] == "2.31.0" and pins["numpy"] == "1.26.3"
    assert LANGUAGES["python"].toolkits == ("python-runtime",)


def test_toolkit_key_of_debian_packages_is_unchanged() -> None:
    """Cached toolkits of Debian packages only keep their key (no rebuild on upgrade); PyPI
    and npm packages are part of the key."""
    import hashlib
    import json

    base = ["sha256:" + "1" * 64]
    old = json.dumps({"base": base, "packages": ["g++", "gcc"], "v": 1}, sort_keys=True)
    assert toolkit_key(base, ("gcc", "g++")) == hashlib.sha256(old.encode()).hexdigest()[:16]
    with_pip = toolkit_key(base, ("gcc",), pip=("requests==2.31.0",))
    assert with_pip != toolkit_key(base, ("gcc",))
    assert with_pip != toolkit_key(base, ("gcc",), pip=("requests==2.32.0",))
    assert toolkit_key(base, ("gcc",), npm=("lodash@4.17.21",)) != toolkit_key(base, ("gcc",))


def test_build_only_packages_are_part_of_the_key() -> None:
    base = ["sha256:" + "1" * 64]
    kit = TOOLKITS["nodejs"]
    assert "npm" in kit.build_only and "npm" not in kit.apt  # purged before the layer
    assert toolkit_key(base, kit.apt, npm=kit.npm, build_only=kit.build_only) != toolkit_key(
        base, kit.apt, npm=kit.npm
    )
