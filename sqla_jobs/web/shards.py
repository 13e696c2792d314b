"""The dashboard over several shards: ``create_app(jobs, engines={"eu": ..., "us": ...})``.

One page at ``/`` lists every queue of every shard (a shard that cannot be reached is
shown as such, and the others still are), with the sums; each shard's name links to that
shard's own, complete dashboard, mounted at ``/shards/<name>/``. Jobs, actions, schedules
and workers are per shard there: a job id means something only within its shard, and an
action is a statement on one database.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from .. import admin
from ..sharding import across
from ..tasks import Jobs
from ._base import HERE, Mounted, SecurityHeaders, engine_of, templates

__all__ = ["shard_engines", "shards_page"]

#: A shard's name is a path segment of its dashboard.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def shard_engines(engines: Mapping[str, sa.Engine | str]) -> dict[str, sa.Engine]:
    """The shards of ``create_app(engines=...)``, checked: names that are path segments,
    engines (or URLs, made into engines)."""
    if not engines:
        raise ValueError("engines= names no shard")
    checked: dict[str, sa.Engine] = {}
    for name, engine in engines.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"shard name {name!r}: use letters, digits, '_', '.' or '-'")
        checked[name] = engine_of(f"shard {name!r}", engine)
    return checked


def shards_page(jobs: Jobs | type[Any], dashboards: Mapping[str, Mounted], title: str) -> ASGIApp:
    """The page of every shard at ``/``, and each shard's dashboard at ``/shards/<name>``."""
    return _ShardsPage(jobs, dashboards, title).app


class _ShardsPage:
    def __init__(self, jobs: Jobs | type[Any], dashboards: Mapping[str, Mounted], title: str):
        self.jobs = jobs
        self.dashboards = dashboards
        self.title = title
        self.env = templates()
        routes: list[Any] = [
            Route("/", self.page, name="shards"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        routes += [Mount(f"/shards/{name}", d.app) for name, d in dashboards.items()]
        self.app: ASGIApp = SecurityHeaders(Starlette(routes=routes))

    async def page(self, request: Request) -> Response:
        return await run_in_threadpool(self._render, request)

    def _render(self, request: Request) -> Response:
        def read(conn: sa.Connection) -> tuple[list[admin.QueueState], int]:
            queues = admin.queue_states(conn, self.jobs, finished=False)
            alive = sum(w.alive for w in admin.list_workers(conn, self.jobs))
            return queues, alive

        engines = {name: d.engine for name, d in self.dashboards.items()}
        root = (request.scope.get("root_path") or "").rstrip("/")
        shards: list[dict[str, Any]] = []
        for result in across(engines, read):
            queues, alive = result.value or ([], 0)
            shards.append(
                {
                    "name": result.shard,
                    "href": f"{root}/shards/{result.shard}/",
                    "error": result.error,
                    "queues": queues,
                    "alive": alive,
                }
            )
        every: list[admin.QueueState] = [q for s in shards for q in s["queues"]]
        lags = [q.lag_seconds for q in every if q.lag_seconds is not None]
        totals = {
            key: sum(getattr(q, key) for q in every)
            for key in ("scheduled", "ready", "running", "dead")
        }
        html = self.env.get_template("shards.html").render(
            title=self.title,
            table_name=admin.source_table(self.jobs).fullname,
            home=f"{root}/",
            static_href=f"{root}/static/dashboard.css",
            shards=shards,
            totals=totals
            | {"lag": max(lags) if lags else None, "alive": sum(s["alive"] for s in shards)},
            now=datetime.now(timezone.utc),
        )
        response = HTMLResponse(html, status_code=200)
        response.headers["cache-control"] = "no-store"
        return response
