"""A built-in image not built yet is an image like the others through the API: listed, and
fetched by name (``GET /v1/images/<name>``: what ``docker image inspect`` and the docker CLI's
``run`` look up), with its build status and no layers until its first use builds it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root]


def test_unbuilt_builtin_is_found_by_name(short_home: Path) -> None:
    with BackgroundServer(short_home, tiers=["container"], network_options=None) as srv:
        headers = {"authorization": f"Bearer {srv.api_key}"}
        with httpx.Client(base_url=srv.url, headers=headers, timeout=30) as c:
            listed = {im["name"]: im for im in c.get("/v1/images").json()["images"]}
            assert listed["desktop"]["status"] in ("queued", "building"), listed["desktop"]
            r = c.get("/v1/images/desktop")
            assert r.status_code == 200, r.text
            assert r.json()["name"] == "desktop" and r.json()["layers"] == []
            assert r.json()["status"] == listed["desktop"]["status"]
            r = c.get("/v1/images/no-such-image")
            assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"
            other = srv.keys.create_key("other")
            r = c.get("/v1/images/desktop", headers={"authorization": f"Bearer {other}"})
            assert r.status_code == 200  # a system image: every key sees it
