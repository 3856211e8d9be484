"""The code-interpreter server's pure parts: request parsing, E2B result mapping, the
env-var helper cells, and the image definition (no kernel, no root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.guest import codeinterp
from dsec.guest.codeinterp import protocol
from dsec.guest.codeinterp.protocol import RequestError
from dsec.layers import builtin
from dsec.layers import code_interpreter as ci


def test_parse_execute_accepts_the_clients_body() -> None:
    body = {"code": "1+1", "context_id": None, "language": None, "env_vars": None}
    req = protocol.parse_execute(json.dumps(body).encode())
    assert req == protocol.ExecuteRequest("1+1", None, None, {})
    req = protocol.parse_execute(b'{"code": "x", "language": "js", "env_vars": {"A": "1"}}')
    assert req.language == "js" and req.env_vars == {"A": "1"}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 422),
        (b"[1]", 422),
        (b'{"code": 5}', 422),
        (b'{"code": "1", "context_id": 3}', 422),
        (b'{"code": "1", "env_vars": {"A": 1}}', 422),
        (b'{"code": "1", "env_vars": []}', 422),
        (b'{"code": "1", "env_vars": {"A=B": "1"}}', 400),
        (b'{"code": "1", "env_vars": {"A": "nul\\u0000"}}', 400),
        (b'{"code": "1", "context_id": "c", "language": "python"}', 400),
    ],
)
def test_parse_execute_refuses_bad_bodies(body: bytes, status: int) -> None:
    with pytest.raises(RequestError) as e:
        protocol.parse_execute(body)
    assert e.value.status == status


def test_languages_normalized_like_e2b() -> None:
    assert protocol.normalize_language(None) == "python"
    assert protocol.normalize_language(" JS ") == "javascript"
    assert protocol.normalize_language("ts") == "typescript"
    assert protocol.parse_create_context(b"") == ("python", None)
    assert protocol.parse_create_context(b'{"language": "Bash", "cwd": "/w"}') == ("bash", "/w")


def test_result_fields_map_mime_types_to_e2b_fields() -> None:
    out = protocol.result_fields(
        {
            "text/plain": "'quoted'",
            "image/png": "iVBOR",
            "text/html": "<b/>",
            "application/json": {"a": 1},
            "e2b/chart": {"type": "line"},
            "application/vnd.custom": "x",
        },
        True,
    )
    assert out == {
        "type": "result",
        "text": "quoted",
        "png": "iVBOR",
        "html": "<b/>",
        "json": {"a": 1},
        "chart": {"type": "line"},
        "extra": {"application/vnd.custom": "x"},
        "is_main_result": True,
    }
    assert protocol.result_fields({"text/plain": "'"}, False)["text"] == "'"


def test_python_env_cells_quote_values_and_restore(tmp_path: Path) -> None:
    env = {"CI_NEW": "a'b\"c\n$(touch pwned)", "CI_OLD": "changed"}
    script = "\n".join(
        [
            "import os",
            "os.environ['CI_OLD'] = 'original'",
            protocol.env_set_code("python", env),
            "print(repr(os.environ['CI_NEW']), os.environ['CI_OLD'])",
            protocol.env_restore_code("python", env),
            "print('CI_NEW' in os.environ, os.environ['CI_OLD'])",
            "print(sorted(n for n in dir() if 'dsec' in n))",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True
    ).stdout.splitlines()
    assert out == [repr(env["CI_NEW"]) + " changed", "False original", "[]"]
    assert not (tmp_path / "pwned").exists()


def test_bash_env_cells_quote_values_and_restore(tmp_path: Path) -> None:
    env = {"CI_NEW": "a'b\"c $(touch pwned) `touch pwned2`", "CI_OLD": "changed"}
    script = "\n".join(
        [
            "CI_OLD=original; export CI_OLD",
            protocol.env_set_code("bash", env),
            'printf "%s|%s\\n" "$CI_NEW" "$CI_OLD"',
            protocol.env_restore_code("bash", env),
            'printf "%s|%s\\n" "${CI_NEW-unset}" "$CI_OLD"',
        ]
    )
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True
    ).stdout.splitlines()
    assert out == [env["CI_NEW"] + "|changed", "unset|original"]
    assert not any(tmp_path.iterdir())
    with pytest.raises(RequestError):
        protocol.check_env_names("bash", {"not-a-name": "x"})
    protocol.check_env_names("python", {"not-a-name": "x"})


def test_install_into_copies_the_server(tmp_path: Path) -> None:
    dest = codeinterp.install_into(tmp_path)
    names = {p.name for p in dest.iterdir()}
    assert {"__main__.py", "server.py", "contexts.py", "pykernel.py", "bashkernel.py"} <= names
    assert {"jskernel.py", "jskernel.js", "charts.py", "protocol.py"} <= names
    codeinterp.install_into(tmp_path)  # again: replaced, not merged
    assert {p.name for p in dest.iterdir()} == names


def test_image_definition_in_one_place(tmp_path: Path) -> None:
    recipe = builtin.BUILTIN_IMAGES[ci.IMAGE_NAME]
    assert recipe.build_rootfs is builtin.build_code_interpreter_rootfs
    assert recipe.meta["start"]["cmd"] == list(ci.START_CMD)
    assert "/health" in recipe.meta["start"]["ready_cmd"]
    assert recipe.meta["config"]["ExposedPorts"] == {"49999/tcp": {}}
    assert recipe.meta["config"]["WorkingDir"] == ci.WORKDIR
    fingerprint = recipe.meta["recipe"]
    assert fingerprint.endswith(codeinterp.fingerprint())  # new server code: a new recipe
    text = ci.dockerfile()
    assert " ".join(ci.APT_PACKAGES) in text
    assert f"COPY dsec_codeinterp/ {ci.SITE_DIR}/dsec_codeinterp/" in text
    assert f"CMD {json.dumps(list(ci.START_CMD))}" in text
    ctx = ci.write_build_context(tmp_path / "ctx")
    assert (ctx / "Dockerfile").read_text() == text
    assert (ctx / "dsec_codeinterp" / "__main__.py").is_file()
    root = tmp_path / "root"
    ci.apply_steps(root)
    assert (root / ci.SITE_DIR.lstrip("/") / "dsec_codeinterp" / "server.py").is_file()
    home = root / ci.WORKDIR.lstrip("/")
    assert home.is_dir()
    if os.geteuid() == 0:
        assert (home.stat().st_uid, home.stat().st_gid) == (1000, 1000)
