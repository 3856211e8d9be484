"""Fuzz a real ``dsec serve`` (container and fncall tiers, no network) through its API.

1. schemathesis (every phase: examples, coverage, fuzzing, stateful with the links it
   infers between operations) against the server's own ``/openapi.json``: no answer may be
   a server error, and every status code, content type, header and body must be the
   documented one. Bounded: ``DSEC_FUZZ_EXAMPLES`` examples per operation (default 25),
   seed ``DSEC_FUZZ_SEED`` (default fixed, so CI is reproducible), 100 stateful scenarios
   (``DSEC_FUZZ_STATEFUL_EXAMPLES``).
2. A hand-written fuzz of what the OpenAPI document does not describe: the E2B control
   plane (``/e2b/...``), envd (``/e2b/envd/...``: Connect-RPC and ``/files``), the
   SandboxFusion bodies of ``/run_code``, and the port proxy's routes (path, host, E2B
   header; random ports, ids, credentials, methods and paths): malformed JSON, wrong types,
   wrong framings and encodings. Nothing may answer a 5xx that the protocol does not define (E2B's 501 "not
   implemented" and envd's 502 "sandbox ... was not found" are protocol answers).
3. After both: the server's log holds no traceback (no bug was hit, even one answered
   politely), every access-log line parses as JSON and names no key.

Left out of the schemathesis run: ``/v1/images/pull`` and ``/v1/images/{name}/push`` (they
contact the registry named in the body, which may be a public one). ``POST /v1/images/build``
is fuzzed: it takes an uploaded context and never reads a path of the server.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from tests.timing import budget

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

EXCLUDED_OPERATIONS = r"^/v1/images/(pull|[^/]+/push)$"
"""Operations the fuzzer must not call (see the module docstring)."""

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "unsupported_method",
        "allow_header_conformance",
    ]
)
"""What every answer must satisfy. Left out: ``positive_data_acceptance`` (the API refuses
schema-valid values on semantic grounds: an empty ``cmd``, an unknown language, a display
call on a container), ``negative_data_rejection`` (SandboxFusion answers 200 with
``status: SandboxError`` for a bad body, as SandboxFusion does) and
``use_after_free``/``ensure_resource_availability`` (a killed sandbox stays readable with
``state: stopped``; E2B-created ones, ...): behaviours, not bugs."""

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    pytest.importorskip("schemathesis")
    from dsec.server import ServeProcess

    home = Path(f"/tmp/dsec-fuzz-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    srv = ServeProcess(
        home,
        env={
            "DSEC_TIERS": "container,fncall",
            "DSEC_NETWORK": "off",
            "DSEC_ACCESS_LOG": "json",
            "DSEC_PORTS_DOMAIN": "ports.fuzz",  # host routes of the port proxy are fuzzed too
        },
    )
    with srv:
        try:
            # built-in images are built on first use (debian: debootstrap, minutes on a
            # fresh machine): before the fuzzers, whose requests time out after 60 s
            with _client(srv, timeout=budget(900)) as c:
                r = c.post("/v1/run_code", json={"code": "print(1)", "language": "python"})
                assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
                # and the Jupyter image (a fresh machine built it inside a fuzzer's request,
                # which timed out after 60 s)
                r = c.post("/run_jupyter", json={"cells": ["print(1)"], "total_timeout": 300})
                assert r.status_code == 200 and r.json()["status"] == "Success", r.text
                r = c.post("/v1/sandboxes", json={"image": "busybox"})
                assert r.status_code == 201, r.text
                assert c.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 200
            yield srv
        finally:
            made = _kill_everything(srv)
    _forget_snapshot_images(srv.layer_cache, made)
    _assert_no_mounts_under(home)
    shutil.rmtree(home, ignore_errors=True)


def _client(srv: Any, **kw: Any) -> httpx.Client:
    return httpx.Client(
        base_url=srv.url,
        headers={"authorization": f"Bearer {srv.api_key}"},
        timeout=kw.pop("timeout", budget(60)),
        **kw,
    )


def _kill_everything(srv: Any) -> set[str]:
    """Kill every sandbox the fuzz made (``dsec serve`` keeps sandboxes across its own
    restarts) and delete the key's own images (a random build or snapshot may be named
    ``busybox`` and would stand in for the built-in one for this key); the ids of all
    sandboxes, stopped ones included."""
    with _client(srv) as c:
        live = c.get("/v1/sandboxes").json()["sandboxes"]
        for sb in live:
            c.delete(f"/v1/sandboxes/{sb['id']}")
        for image in c.get("/v1/images").json()["images"]:
            if image["owner"] != "system":
                c.delete(f"/v1/images/{quote(image['name'], safe='/:')}")
        every = c.get("/v1/sandboxes", params={"include_stopped": "true"}).json()["sandboxes"]
        assert all(sb["state"] == "stopped" for sb in every), every
    return {sb["id"] for sb in every}


def _forget_snapshot_images(layer_cache: Path, sandbox_ids: set[str]) -> None:
    """The home's layer store is the machine's shared test cache: drop the images the
    fuzz tagged there (snapshots with a name), so no other test sees them."""
    if not (layer_cache / "layers.db").exists():
        return
    from dsec.layers.store import LayerStore

    store = LayerStore(layer_cache, layer_cache / "tmp" / f"fuzz-scratch-{os.getpid()}")
    try:
        for image in store.list_images():
            if image.meta.get("snapshot_of") in sandbox_ids:
                with contextlib.suppress(Exception):
                    store.remove_image(image.name)
    finally:
        store.close()
        shutil.rmtree(layer_cache / "tmp" / f"fuzz-scratch-{os.getpid()}", ignore_errors=True)


def _assert_no_mounts_under(home: Path) -> None:
    prefix = str(home.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        leaked = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
    assert not leaked, f"mounts left under {home}: {leaked[:5]}"


# --- 1. schemathesis ------------------------------------------------------------------
STATEFUL_CONFIG = """
[phases.stateful]
max-steps = 12

[phases.stateful.generation]
max-examples = {examples}
"""
"""More scenarios for the stateful phase than ``--max-examples`` gives it (25 scenarios
cover ~15 of the ~280 links schemathesis infers; 100 cover ~60 in ~40 s)."""


def schemathesis_command(url: str, api_key: str, report_dir: Path) -> list[str]:
    """The schemathesis run CI does (printed in the test's output)."""
    config = report_dir / "schemathesis.toml"
    examples = int(os.environ.get("DSEC_FUZZ_STATEFUL_EXAMPLES", "100"))
    config.write_text(STATEFUL_CONFIG.format(examples=examples))
    return [
        sys.executable,
        "-c",
        "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {api_key}",
        "--checks",
        CHECKS,
        "--max-examples",
        os.environ.get("DSEC_FUZZ_EXAMPLES", "25"),
        "--seed",
        os.environ.get("DSEC_FUZZ_SEED", "20261201"),
        "--workers",
        "1",
        "--request-timeout",
        str(round(budget(60))),
        "--exclude-path-regex",
        EXCLUDED_OPERATIONS,
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(report_dir),
    ]


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(
    server: Any, tmp_path: Path
) -> None:
    cmd = schemathesis_command(server.url, server.api_key, tmp_path)
    shown = " ".join(a if "Bearer" not in a else "'Authorization: Bearer <key>'" for a in cmd)
    print(f"running: {shown}")
    proc = subprocess.run(
        cmd,
        env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        capture_output=True,
        text=True,
        timeout=budget(900),
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert proc.returncode == 0, f"schemathesis found problems:\n{out[-20000:]}"
    assert "Stateful" in out  # the stateful phase ran
    assert server.api_key not in out


# --- 2. E2B and run_code: the routes outside the OpenAPI document ------------------------
FIELDS = [
    "templateID", "timeout", "metadata", "envVars", "autoPause", "autoResume", "network",
    "allow_internet_access", "secure", "mcp", "volumeMounts", "path", "name", "code",
    "language", "files", "fetch_files", "stdin", "run_timeout", "compile_timeout",
    "memory_limit_MB", "env", "timeout_s", "process", "cmd", "args", "cwd", "envs", "pid",
    "tag", "depth", "source", "destination", "user", "signal", "input", "stdin_b64",
    "allowOut", "denyOut", "dnsServers", "count", "limit", "state", "nextToken", "selector",
]  # fmt: skip
"""Field names of the bodies these routes read (E2B, envd, SandboxFusion, dsec)."""


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**64), 10**400])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e308, 5e-324])
    if kind == 4:
        return rng.choice(["", "python", "busybox", "base", "/", "/work/../etc", "a" * 5000])
    if kind == 5:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 6:
        return rng.choice(["\udc80", "\x00", "../../" * 20, "%00", "\n\r", "sb-vm-0"])
    if kind == 7:
        return rng.choice(["print(1)", "import os; print(os.getcwd())", "echo hi", "exit 3"])
    if kind in (8, 9):
        return {rng.choice(FIELDS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _body(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """A malformed (or, sometimes, well-formed) body and its headers."""
    kind = rng.randrange(10)
    if kind == 0:
        return b"", {}
    if kind == 1:
        return rng.choice([b"{", b"[", b"nul", b"{'a': 1}", b"\xff\xfe\x00", b"NaN"]), {
            "content-type": "application/json"
        }
    if kind == 2:
        return b"[" * 5000 + b"]" * 5000, {"content-type": "application/json"}
    if kind == 3:
        return gzip.compress(b"x")[:-4] + b"\x00\x00", {
            "content-type": "application/octet-stream",
            "content-encoding": rng.choice(["gzip", "br", "deflate"]),
        }
    if kind == 4:
        return (
            b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nx\r\n--b--',
            {
                "content-type": rng.choice(
                    ["multipart/form-data; boundary=b", "multipart/form-data"]
                )
            },
        )
    if kind == 5:  # a Connect envelope with garbage inside, or a broken envelope
        payload = json.dumps(_value(rng)).encode()
        frame = bytes([0]) + len(payload).to_bytes(4, "big") + payload
        return rng.choice([frame, frame[:3], bytes([1]) + frame[1:]]), {
            "content-type": rng.choice(["application/connect+json", "application/connect+proto"])
        }
    if kind == 6:
        return os.urandom(rng.randrange(1, 64)), {
            "content-type": rng.choice(["application/proto", "application/json"])
        }
    obj = {rng.choice(FIELDS): _value(rng) for _ in range(rng.randrange(1, 6))}
    text = json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")
    return text, {"content-type": rng.choice(["application/json", "text/plain", ""])}


def _is_rpc(path: str) -> bool:
    return path.startswith(("/e2b/envd/process.Process/", "/e2b/envd/filesystem.Filesystem/"))


def _allowed(path: str, status: int) -> bool:
    """Whether ``status`` is an answer the protocol of ``path`` defines (any 4xx is)."""
    if status < 500:
        return True
    if _is_rpc(path):
        # Connect's HTTP statuses of unimplemented (an unknown method), unavailable (E2B's
        # "sandbox ... was not found") and deadline_exceeded; never internal (500)
        return status in (501, 503, 504)
    if path.startswith("/e2b/envd") or path == "/files":
        return status == 502  # envd: "the sandbox ... was not found" (E2B's proxy answer)
    if path.startswith("/e2b"):
        return status == 501  # E2B routes dsec does not implement
    return False


def test_hand_fuzz_of_e2b_envd_and_run_code(server: Any) -> None:
    rng = random.Random(int(os.environ.get("DSEC_FUZZ_SEED", "20261201")))
    key = server.api_key
    _kill_everything(server)  # room on the node, whatever the schemathesis run left
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/e2b/sandboxes", json={"templateID": "busybox"}, headers={"x-api-key": key})
        assert r.status_code == 201, r.text
        sbx = r.json()
        sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
        ids = [sid, "sb-vm-000000000000", "..%2F..", "x" * 300, "%00", sid + "/../x"]
        control = [
            ("POST", "/e2b/sandboxes"), ("POST", "/e2b/v2/sandboxes"), ("GET", "/e2b/sandboxes"),
            ("GET", "/e2b/v2/sandboxes"), ("GET", "/e2b/sandboxes/{id}"),
            ("POST", "/e2b/sandboxes/{id}/timeout"), ("POST", "/e2b/sandboxes/{id}/refreshes"),
            ("POST", "/e2b/sandboxes/{id}/connect"), ("POST", "/e2b/v2/sandboxes/{id}/connect"),
            ("POST", "/e2b/sandboxes/{id}/pause"), ("POST", "/e2b/sandboxes/{id}/resume"),
            ("POST", "/e2b/sandboxes/{id}/snapshots"), ("POST", "/e2b/sandboxes/{id}/fork"),
            ("PUT", "/e2b/sandboxes/{id}/network"), ("GET", "/e2b/snapshots"),
            ("DELETE", "/e2b/templates/{id}"), ("PATCH", "/e2b/sandboxes/{id}"),
        ]  # fmt: skip
        rpcs = [
            f"/e2b/envd/process.Process/{m}"
            for m in ("Start", "List", "Connect", "SendInput", "SendSignal", "Update", "Nope")
        ] + [
            f"/e2b/envd/filesystem.Filesystem/{m}"
            for m in ("Stat", "ListDir", "MakeDir", "Move", "Remove", "WatchDir",
                      "CreateWatcher", "GetWatcherEvents", "RemoveWatcher")
        ]  # fmt: skip
        runcode = ["/run_code", f"/k/{key}/run_code", "/k/not-a-key/run_code", "/v1/run_code"]
        bad: list[str] = []
        sent = 0
        answered: set[str] = set()  # route kinds that gave a 2xx at least once
        for _ in range(int(os.environ.get("DSEC_FUZZ_HAND_REQUESTS", "2000"))):
            body, headers = _body(rng)
            target = rng.randrange(4)
            if target == 0:
                method, template = rng.choice(control)
                path = template.replace("{id}", rng.choice(ids))
                if rng.random() < 0.9:
                    headers["x-api-key"] = key
                query = rng.choice(["", "?limit=0", "?limit=-5&state=paused", "?metadata=%zz"])
                path += query
            elif target == 1:
                method, path = "POST", rng.choice(rpcs)
                headers.setdefault("connect-protocol-version", "1")
                headers["e2b-sandbox-id"] = rng.choice(ids)
                headers["x-access-token"] = rng.choice([token, token[:-1] + "0", "", "a.b"])
            elif target == 2:
                method = rng.choice(["GET", "POST"])
                path = rng.choice(["/e2b/envd/files", "/files", "/e2b/envd/health"])
                path += rng.choice(
                    ["", "?path=/tmp/f", "?path=", "?path=%00", "?path=rel/../../x",
                     "?path=/tmp/f&signature=v1_xx&signature_expiration=abc",
                     "?signature=v1_" + "A" * 43 + "&username=root"]
                )  # fmt: skip
                if rng.random() < 0.8:
                    headers["e2b-sandbox-id"] = rng.choice(ids)
                    headers["x-access-token"] = rng.choice([token, "bad"])
            else:
                method, path = "POST", rng.choice(runcode)
                if rng.random() < 0.5:
                    obj = {"code": _value(rng), "language": rng.choice(["python", "bash", ""])}
                    obj.update({rng.choice(FIELDS): _value(rng) for _ in range(rng.randrange(3))})
                    body = json.dumps(obj).encode("utf-8", "surrogatepass")
                    headers = {"content-type": "application/json"}
                if path in ("/run_code", "/v1/run_code") and rng.random() < 0.9:
                    headers["authorization"] = f"Bearer {key}"
            headers = {k: v for k, v in headers.items() if v}
            try:
                r = c.request(method, path, content=body, headers=headers)
            except httpx.TimeoutException:
                continue  # a stream that waits for more input is not a server error
            sent += 1
            shown = path.replace(key, "<key>")
            if r.status_code < 300:
                answered.add(_kind(path))
            if not _allowed(path.split("?")[0].replace(key, "{key}"), r.status_code):
                bad.append(f"{method} {shown} -> {r.status_code}: {r.text[:300]}")
            elif (
                r.status_code >= 400
                and not _is_json(r)
                and not (
                    # connectrpc: an empty body for an unknown procedure or content type
                    r.status_code in (404, 415) and _is_rpc(path)
                )
            ):
                bad.append(
                    f"{method} {shown} -> {r.status_code} without a JSON body: {r.text[:200]}"
                )
            assert key not in r.text, f"{method} {shown} echoed the API key"
        assert sent > 100
        assert not bad, "\n".join(bad[:30])
        # not only refusals: some of each kind of request got through to real work
        assert answered >= {"control", "rpc", "files", "run_code"}, answered


def test_hand_fuzz_of_the_port_proxy(server: Any) -> None:
    """The port proxy's routes (path, host, E2B header, raw TCP) with random ports, ids,
    credentials, methods, paths and bodies, against a sandbox whose port 8000 serves (busybox
    httpd): dsec's own answers are JSON errors, never a 500 (only 502 nothing listens / bad
    answer, 503 unreachable); the server logs no traceback (checked by the next test)."""
    rng = random.Random(int(os.environ.get("DSEC_FUZZ_SEED", "20261201")) + 22)
    key = server.api_key
    _kill_everything(server)
    with _client(server) as c:
        r = c.post("/v1/sandboxes", json={"image": "busybox", "memory_mb": 64})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = c.post(
            f"/v1/sandboxes/{sid}/exec",
            json={"cmd": "mkdir -p /w && echo ok > /w/x && httpd -p 8000 -h /w"},
        )
        assert r.json()["exit_code"] == 0, r.text
        token = c.get(f"/v1/sandboxes/{sid}/ports").json()["token"]
    ids = [sid, sid, "sb-vm-000000000000", "sb-x", "..", "%2e%2e", "sb-" + "a" * 70]
    ports = ["8000", "8000", "8001", "0", "65536", "-1", "abc", "8000.5", "99999999999", ""]
    creds: list[dict[str, str]] = [
        {"authorization": f"Bearer {key}"},
        {"x-dsec-port-token": token},
        {"e2b-traffic-access-token": token},
        {"cookie": f"dsec_port_token={token}; other=1"},
        {"authorization": "Bearer " + token[:-1] + "0"},
        {"authorization": "Basic Zm9vOmJhcg=="},
        {"cookie": 'dsec_port_token="broken'},
        {},
    ]
    paths = ["/", "/x", "/x?a=1", f"/_dsec_token/{token}/x", "/_dsec_token/junk/x",
             f"/x?dsec_token={token}", "/x?dsec_token=%zz", "/%2e%2e/etc/passwd", "/" + "a" * 3000]  # fmt: skip
    bad: list[str] = []
    sent = 0
    reached = 0
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for _ in range(int(os.environ.get("DSEC_FUZZ_PORT_REQUESTS", "600"))):
            body, headers = _body(rng)
            headers.update(rng.choice(creds))
            method = rng.choice(["GET", "GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])
            kind = rng.randrange(3)
            sub = rng.choice(paths)
            if kind == 0:
                path = f"/v1/sandboxes/{rng.choice(ids)}/ports/{rng.choice(ports)}{sub}"
            elif kind == 1:
                path = sub
                headers["host"] = f"{rng.choice(ports)}-{rng.choice(ids)}.ports.fuzz"
            else:
                path = "/e2b/envd" + sub
                headers["e2b-sandbox-id"] = rng.choice(ids)
                headers["e2b-sandbox-port"] = rng.choice(ports)
            headers = {k: v for k, v in headers.items() if v}
            try:
                r = c.request(
                    method, path, content=body if method != "HEAD" else b"", headers=headers
                )
            except httpx.TimeoutException:
                continue
            except httpx.RemoteProtocolError as e:
                bad.append(f"{method} {path[:80]} -> connection broken: {e}")
                continue
            sent += 1
            try:
                err = r.json().get("error") if r.content else None
            except (ValueError, AttributeError):
                err = None
            dsec_answer = isinstance(err, dict) and "code" in err
            if not dsec_answer:
                reached += 1  # the sandbox's httpd answered (its answers are its business)
            elif r.status_code >= 500 and not (
                r.status_code in (502, 503)
                and err["code"] in ("port_not_listening", "bad_gateway", "unavailable")
            ):
                bad.append(f"{method} {path[:80]} -> {r.status_code}: {r.text[:300]}")
            assert key not in r.text, f"{method} {path[:80]} echoed the API key"
            # a token the client put in its own URL may come back in a "not found" message
            assert token not in r.text or token in path, f"{method} {path[:80]} echoed the token"
    assert sent > 100 and reached > 10, (sent, reached)
    assert not bad, "\n".join(bad[:30])


def _kind(path: str) -> str:
    if _is_rpc(path):
        return "rpc"
    if path.startswith(("/e2b/envd", "/files")):
        return "files"
    if path.startswith("/e2b"):
        return "control"
    return "run_code"


def _is_json(r: httpx.Response) -> bool:
    try:
        r.json()
    except ValueError:
        return False
    return True


# --- 3. what the server logged ------------------------------------------------------------
def test_server_log_has_no_bug_and_a_clean_access_log(server: Any) -> None:
    """Runs after the fuzzing tests (same module, same server)."""
    log = (server.home / "serve.log").read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:8000]
    access = []
    for line in log.splitlines():
        if line.startswith('{"ts"'):
            entry = json.loads(line)
            assert entry["type"] == "access"
            access.append(entry)
    assert len(access) > 500
    assert server.api_key not in log
    routes = {e["route"] for e in access}
    assert {"/v1/sandboxes", "/k/{api_key}/run_code", "/e2b/sandboxes"} <= routes, routes
    assert not any("sb-" in r for r in routes), sorted(r for r in routes if "sb-" in r)
