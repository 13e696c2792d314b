"""The dashboard over several shards: ``create_app(jobs, engines={"eu": ..., "us": ...})``.

One page at ``/`` lists every queue of every shard (a shard that cannot be reached is
shown as such, and the others still are), with the sums; each shard's name links to that
shard's own, complete dashboard, mounted at ``/shards/<name>/``. Jobs, actions, schedules
and workers are per shard there: a job id means something only within its shard, and an
action is a statement on one database.
"""

from __future__ import annotations

import logging
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
from .app import HERE, Authorize, Dashboard, _SecurityHeaders

__all__ = ["sharded_app"]

log = logging.getLogger("sqla_jobs.web")

#: A shard's name is a path segment of its dashboard.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def sharded_app(
    jobs: Jobs | type[Any],
    engines: Mapping[str, sa.Engine | str],
    *,
    authorize: Authorize | None,
    read_only: bool | None,
    title: str,
    refresh: float,
    secret: bytes | None = None,
) -> ASGIApp:
    """See :func:`sqla_jobs.web.create_app` (``engines=``)."""
    from ..db import create_engine

    if not engines:
        raise ValueError("engines= names no shard")
    effective_read_only = read_only if read_only is not None else authorize is None
    if not effective_read_only and authorize is None:
        log.warning(
            "sqla_jobs.web: actions are enabled for anyone who can reach this dashboard "
            "(read_only=False without authorize=); put it behind your authentication"
        )
    dashboards: dict[str, Dashboard] = {}
    for name, engine in engines.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"shard name {name!r}: use letters, digits, '_', '.' or '-'")
        if isinstance(engine, str):
            engine = create_engine(engine)
        if not isinstance(engine, sa.Engine):
            raise TypeError(f"shard {name!r}: expected an Engine or a URL, got {engine!r}")
        dashboards[name] = Dashboard(
            jobs,
            engine,
            authorize=authorize,
            read_only=effective_read_only,
            title=f"{title} · {name}",
            refresh=refresh,
            shard=name,
            secret=secret,
        )
    return _ShardsPage(jobs, dashboards, title).app


class _ShardsPage:
    def __init__(self, jobs: Jobs | type[Any], dashboards: dict[str, Dashboard], title: str):
        self.jobs = jobs
        self.dashboards = dashboards
        self.title = title
        self.env = next(iter(dashboards.values())).env
        routes: list[Any] = [
            Route("/", self.page, name="shards"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        routes += [Mount(f"/shards/{name}", d.app) for name, d in dashboards.items()]
        self.app: ASGIApp = _SecurityHeaders(Starlette(routes=routes))

    async def page(self, request: Request) -> Response:
        return await run_in_threadpool(self._render, request)

    def _render(self, request: Request) -> Response:
        def read(conn: sa.Connection) -> tuple[list[admin.QueueSummary], int]:
            queues = admin.overview(conn, self.jobs)
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
        every: list[admin.QueueSummary] = [q for s in shards for q in s["queues"]]
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
