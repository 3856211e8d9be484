"""The web dashboard: ``/ui`` on every apiserver (``dsec serve`` and each cluster replica).

Layout (see ``ui/README.md`` for the front end)::

    src/dsec/ui/            the Python side, shipped in the package
        session.py          sign-in, the signed session cookie, CSRF
        series.py           the in-process time series of the charts
        routes.py           /ui, /ui/login, /ui/logout, /ui/api/*
        static/             the built front end (package data, not in git)
    ui/                     the front end's sources: package.json + lock (pinned npm
                            packages: preact, htm, uPlot, Tabulator, esbuild), src/*.js,
                            build.mjs; scripts/bootstrap.sh runs ``npm ci`` and the build

A signed-in page sees exactly what its key owns: it reads and acts through the same ``/v1``
routes as the SDK (authenticated by the session cookie instead of a bearer key, CSRF-checked).
An operator's key (``KeyRecord.role``) also sees the node: its nodes, capacity, every
tenant's counts and the node's own counters over the last hour.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from dsec.ui.routes import STATIC_DIR, make_ui_router
from dsec.ui.series import ActivityRecorder, NodeSampler
from dsec.ui.session import DEFAULT_TTL_S, SessionAuthority, load_secret

__all__ = ["Dashboard", "install_ui"]


class Dashboard:
    """What one app's dashboard holds: its sessions, activity series and node sampler."""

    def __init__(self, edge: Any, keys: Any, secret: bytes | None = None) -> None:
        ttl = float(os.environ.get("DSEC_UI_SESSION_S", DEFAULT_TTL_S))
        self.sessions = SessionAuthority(keys, secret or load_secret(None), ttl_s=ttl)
        self.activity = ActivityRecorder()
        self.sampler = NodeSampler(edge)


def install_ui(app: FastAPI, dashboard: Dashboard) -> None:
    """Add the ``/ui`` routes and static files to ``app``; the sampler starts with the app
    (or at the first page view, where no lifespan runs) and stops with it."""
    app.include_router(make_ui_router(dashboard.sessions, dashboard.activity, dashboard.sampler))
    app.mount(
        "/ui/static",
        StaticFiles(directory=STATIC_DIR, check_dir=False),
        name="ui-static",
    )

    async def start() -> None:
        dashboard.sampler.start()

    async def stop() -> None:
        await dashboard.sampler.stop()

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)
