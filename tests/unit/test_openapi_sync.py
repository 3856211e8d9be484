"""The checked-in OpenAPI document matches the app, and describes the API we promise."""

from __future__ import annotations

import json
from pathlib import Path

import dsec.apiserver
from dsec.apiserver.app import openapi_document, render_openapi
from dsec.contract.edge import VERBS

CHECKED_IN = Path(dsec.apiserver.__file__).parent / "openapi.json"
REGEN = ".venv/bin/python scripts/gen_openapi.py"


def test_checked_in_openapi_is_current() -> None:
    assert CHECKED_IN.exists(), f"{CHECKED_IN} is missing; run: {REGEN}"
    assert CHECKED_IN.read_text() == render_openapi(), (
        f"{CHECKED_IN} is stale (the API changed); regenerate it with: {REGEN}"
    )


def test_openapi_describes_routes_security_and_errors() -> None:
    doc = openapi_document()
    json.dumps(doc)  # serialisable
    paths = doc["paths"]
    # the verbs of the table (dsec.contract.edge.VERBS), each routed from its row
    table: dict[str, set[str]] = {}
    for verb in VERBS:
        table.setdefault("/v1" + verb.template, set()).add(verb.method.lower())
    # and the routes written by hand
    expected = {
        **table,
        "/v1/sandboxes": {"get", "post"},
        "/v1/sandboxes/batch": {"post"},
        "/v1/sandboxes/{sandbox_id}": {"get", "delete"},
        "/v1/sandboxes/{sandbox_id}/exec": {"post"},
        "/v1/sandboxes/{sandbox_id}/exec/stream": {"post"},
        "/v1/sandboxes/{sandbox_id}/files": {"get", "put", "delete"},
        "/v1/sandboxes/{sandbox_id}/files/list": {"get"},
        "/v1/sandboxes/{sandbox_id}/files/stat": {"get"},
        "/v1/sandboxes/{sandbox_id}/files/mkdir": {"post"},
        "/v1/sandboxes/{sandbox_id}/files/rename": {"post"},
        "/v1/sandboxes/{sandbox_id}/files/tar": {"get", "put"},
        "/v1/sandboxes/{sandbox_id}/trajectory": {"get"},
        "/v1/sandboxes/{sandbox_id}/logs": {"get"},
        "/v1/sandboxes/{sandbox_id}/audit": {"get"},
        "/v1/jobs/{job}": {"get"},
        "/v1/jobs/{job}/audit": {"get"},
        "/v1/images/build": {"post"},
        "/v1/builds": {"get", "post"},  # GET from the table, POST (a stream) by hand
        "/v1/sandboxes/{sandbox_id}/display": {"get"},
        "/v1/sandboxes/{sandbox_id}/display/screenshot": {"get"},
        "/v1/sandboxes/{sandbox_id}/display/windows": {"get"},
        "/v1/sandboxes/{sandbox_id}/display/restart": {"post"},
        **{
            f"/v1/sandboxes/{{sandbox_id}}/display/{a}": {"post"}
            for a in ("move", "click", "drag", "scroll", "button", "type", "key", "open", "launch")
        },
        "/v1/sandboxes/{sandbox_id}/ports": {"get"},
        "/v1/node": {"get"},
        "/v1/key": {"get"},
        "/v1/capabilities": {"get"},
        "/healthz": {"get"},
        "/metrics": {"get"},
        "/run_code": {"post"},
        "/k/{api_key}/run_code": {"post"},
        "/v1/run_code": {"post"},
        "/run_jupyter": {"post"},
        "/k/{api_key}/run_jupyter": {"post"},
    }
    assert {p: set(ops) for p, ops in paths.items()} == expected
    for path, ops in paths.items():
        for op in ops.values():
            if path.startswith("/v1") and path != "/v1/run_code":
                assert op.get("security") == [{"ApiKey": []}], path
                statuses = ("400", "401", "404", "408", "409", "413", "422", "429", "500", "503")
                for status in statuses:
                    body = op["responses"][status]["content"]["application/json"]["schema"]
                    assert body == {"$ref": "#/components/schemas/ErrorBody"}, (path, status)
                # 422 is dsec's `unsupported`, never FastAPI's validation error
                assert "unsupported" in op["responses"]["422"]["description"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    stream = paths["/v1/sandboxes/{sandbox_id}/exec/stream"]["post"]["responses"]["200"]["content"]
    assert "application/x-ndjson" in stream
    trajectory = paths["/v1/sandboxes/{sandbox_id}/trajectory"]["get"]["responses"]["200"]
    assert "application/x-ndjson" in trajectory["content"]
    # every state-changing route documents the trajectory headers
    for path, method in [
        ("/v1/sandboxes/{sandbox_id}/exec", "post"),
        ("/v1/sandboxes/{sandbox_id}/exec/stream", "post"),
        ("/v1/sandboxes/{sandbox_id}/files", "put"),
        ("/v1/sandboxes/{sandbox_id}/files", "delete"),
        ("/v1/sandboxes/{sandbox_id}/files/mkdir", "post"),
        ("/v1/sandboxes/{sandbox_id}/files/rename", "post"),
        ("/v1/sandboxes/{sandbox_id}/files/tar", "put"),
        ("/v1/sandboxes/{sandbox_id}/snapshot", "post"),
    ]:
        headers = {
            p["name"].lower() for p in paths[path][method]["parameters"] if p["in"] == "header"
        }
        assert headers == {"x-dsec-seq", "idempotency-key"}, (path, method, headers)
    for ref in json.dumps(doc).split('"$ref": "')[1:]:
        name = ref.split('"')[0].removeprefix("#/components/schemas/")
        assert name in doc["components"]["schemas"], f"dangling $ref {name}"
