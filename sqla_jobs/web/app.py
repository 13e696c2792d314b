"""The dashboard's ASGI application: routes, pages, guards. See :mod:`sqla_jobs.web`."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from .. import _present, admin, periodic
from .._present import ago, clock
from ..errors import EnqueueError, answered, describe, passing
from ..model import STATUSES, JobStatus, companion_tables
from ..tasks import Jobs
from ._base import (
    DEFAULT_ALLOWED_HOSTS,
    HERE,
    SECURITY_HEADERS,
    Authorize,
    SecurityHeaders,
    TrustedHosts,
    check_allowed_hosts,
    engine_of,
    read_only_of,
    templates,
)
from .shards import shard_engines, shards_page

# DEFAULT_ALLOWED_HOSTS, SECURITY_HEADERS and check_allowed_hosts stay importable from
# here, where they were defined before web/_base.py.
#: Blocked keys the overview lists (``sqla-jobs queues blocked`` lists them all).
BLOCKED_SHOWN = 50

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "SECURITY_HEADERS",
    "Dashboard",
    "check_allowed_hosts",
    "create_app",
]

log = logging.getLogger("sqla_jobs.web")
CSRF_COOKIE = "sqla_jobs_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
#: Jobs listed per page.
PAGE_SIZE = 50
#: Largest request body an action reads (a selection of a few thousand jobs fits).
MAX_FORM_BYTES = 1 << 20
#: Characters of a job's arguments, result or last error its page shows (each may be
#: megabytes); the whole value is a download away.
ARGS_SHOWN = 200_000
#: The columns a job's page offers to download whole, and how each is served.
DOWNLOADS = {
    "args": "application/json",
    "result": "application/json",
    "meta": "application/json",
    "progress": "application/json",
    "last_error": "text/plain; charset=utf-8",
}


class PageError(Exception):
    """A request that gets an error page: the status code and what to tell the person."""

    def __init__(self, status_code: int, heading: str, message: str) -> None:
        super().__init__(message)
        self.status_code, self.heading, self.message = status_code, heading, message


@dataclass(frozen=True)
class Filters:
    """The job list's filters, from the query string, checked."""

    queue: str | None = None
    task: str | None = None
    status: str | None = None
    worker: str | None = None
    q: str | None = None
    #: "1": only durable jobs suspended in a sleep or a wait.
    suspended: str | None = None

    @classmethod
    def of(cls, params: Any) -> Filters:
        values: dict[str, str | None] = {}
        for name in ("queue", "task", "status", "worker", "q", "suspended"):
            raw = params.get(name)
            value = raw.strip() if isinstance(raw, str) else None
            if value and "\x00" in value:
                raise PageError(400, "Bad filter", f"{name}: a NUL character is not allowed")
            values[name] = value or None
        if values["status"] is not None and values["status"] not in STATUSES:
            raise PageError(
                400,
                "Bad filter",
                f"unknown status {values['status']!r}; statuses are {', '.join(STATUSES)}",
            )
        if values["suspended"] not in (None, "1"):
            raise PageError(400, "Bad filter", "suspended: give 1, or leave it out")
        return cls(**values)

    def query(self) -> str:
        return urlencode([(k, v) for k, v in self.items() if v])

    def items(self) -> list[tuple[str, str | None]]:
        return [
            ("queue", self.queue),
            ("task", self.task),
            ("status", self.status),
            ("worker", self.worker),
            ("q", self.q),
            ("suspended", self.suspended),
        ]

    def selection(self, up_to_id: int) -> admin.Selection:
        """Every job these filters match (a bulk action), up to ``up_to_id``."""
        return admin.Selection(
            queue=self.queue, task=self.task, status=self.status, all_jobs=True, up_to_id=up_to_id
        )

    def describe(self) -> str:
        parts = [f"{k} {v}" for k, v in self.items() if v and k not in ("q", "suspended")]
        if self.suspended:
            parts.append("suspended in a step")
        if self.q:
            parts.append(f"matching {self.q!r}")
        return ", ".join(parts)


#: A posted form: each name with its values.
Form = dict[str, list[str]]
_T = TypeVar("_T")


def _reads(
    method: Callable[[Dashboard, Request], Response],
) -> Callable[[Dashboard, Request], Awaitable[Response]]:
    """A page: ``method`` runs in a thread (its statements block), and what goes wrong
    becomes an error page (:meth:`Dashboard._guarded`)."""

    @functools.wraps(method)
    async def handler(self: Dashboard, request: Request) -> Response:
        return await self._page(request, lambda: method(self, request))

    return handler


def _acts(
    method: Callable[[Dashboard, Request, Form], Response],
) -> Callable[[Dashboard, Request], Awaitable[Response]]:
    """An action: the request may act and its form is checked first (:meth:`Dashboard._form`),
    then ``method`` runs as a page, given the form."""

    @functools.wraps(method)
    async def handler(self: Dashboard, request: Request) -> Response:
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        return await self._page(request, lambda: method(self, request, form))

    return handler


class Dashboard:
    """The dashboard for one jobs table: its settings, and the pages and actions.

    Made by :func:`create_app`; ``dashboard.app`` is the ASGI application.
    """

    def __init__(
        self,
        jobs: Jobs | type[Any],
        engine: sa.Engine,
        *,
        authorize: Authorize | None,
        read_only: bool,
        title: str,
        refresh: float,
        shard: str | None = None,
        secret: bytes | None = None,
    ) -> None:
        #: The shard this dashboard shows, when it is one of several (see .shards).
        self.shard = shard
        #: Signs CSRF tokens and notices: random for each dashboard unless given.
        self.signer = Signer(secret if secret is not None else secrets.token_bytes(32))
        self.jobs = jobs
        self.engine = engine
        self.authorize = authorize
        self.read_only = read_only
        self.title = title
        self.refresh = refresh
        #: The database's clock less this host's, as last read (see :meth:`now`).
        self._skew = timedelta(0)
        self.table = admin.source_table(jobs)
        env = templates()
        self.env = env
        routes = [
            Route("/", self.overview, name="overview"),
            Route("/jobs", self.job_list, name="jobs"),
            Route("/jobs/confirm", self.confirm, name="confirm"),
            Route("/jobs/act", self.act, methods=["POST"], name="act"),
            Route("/jobs/act-all", self.act_all, methods=["POST"], name="act_all"),
            Route("/jobs/{job_id}", self.job, name="job"),
            Route("/jobs/{job_id}/value/{field}", self.download, name="download"),
            Route("/jobs/{job_id}/{action}", self.job_action, methods=["POST"], name="job_action"),
            Route("/queues/{action}", self.queue_action, methods=["POST"], name="queue_action"),
            Route("/schedules", self.schedules, name="schedules"),
            Route("/schedules/run", self.run_schedule, methods=["POST"], name="run_schedule"),
            Route("/workers", self.workers, name="workers"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
        self.starlette = Starlette(routes=routes)
        self.starlette.add_exception_handler(404, self._not_found)
        self.starlette.add_exception_handler(405, self._not_allowed)
        self.app: ASGIApp = SecurityHeaders(self.starlette)

    # -- rendering ---------------------------------------------------------------------------

    def can_act(self, request: Request) -> bool:
        """Whether this request may change anything. An ``authorize`` that raises (a
        session middleware missing, a visitor logged out) says no, logged: every page
        asks it (to draw its buttons), and reading is not what it guards."""
        if self.read_only:
            return False
        if self.authorize is None:
            return True
        try:
            return bool(self.authorize(request))
        except Exception:
            log.exception("dashboard: the authorize callable failed")
            return False

    def now(self) -> datetime:
        """Now by the database's clock, as the pages judge times: leases, ages, and what a
        job waits for are the database's times. A dashboard on a host whose clock ran two
        minutes ahead called a live lease expired ("the worker died or hangs") while the
        listing beside it, judged by the database, called it held. Each page's connection
        reads the database's clock in the statement that bounds its waits (no round trip
        more); this host's clock, moved by the difference last seen, stands in between."""
        return datetime.now(timezone.utc) + self._skew

    def _clock_read(self, row: Any) -> None:
        """Keep the difference of the database's clock (read by :func:`_bounded`) from
        this host's."""
        self._skew = row[-1] - datetime.now(timezone.utc)

    def render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        token = self.signer.valid_token(request.cookies.get(CSRF_COOKIE)) or self.signer.token()

        def href(name: str, **params: Any) -> str:
            return self.path(request, name, **params)

        def static(path: str) -> str:
            return self.path(request, "static", path=path)

        base = {
            "request": request,
            "title": self.title,
            "table_name": self.table.fullname,
            "href": href,
            "static": static,
            "csrf_token": token,
            "can_act": self.can_act(request),
            "section": None,
            "page_title": self.title,
            "notice": None,
            "notice_kind": "ok",
            "home": self._home(request),
            "actions": admin.ACTIONS.values(),
            "now": self.now(),
        }
        base.update(context)
        html = self.env.get_template(template).render(base)
        response = HTMLResponse(html, status_code=status_code)
        if request.cookies.get(CSRF_COOKIE) != token:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                path=_cookie_path(request),
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        response.headers["cache-control"] = "no-store"
        return response

    def _home(self, request: Request) -> str | None:
        """The page of every shard, when this dashboard is one shard's (mounted at
        ``/shards/<name>`` under it)."""
        if self.shard is None:
            return None
        root = (request.scope.get("root_path") or "").rstrip("/")
        return root.removesuffix(f"/shards/{self.shard}") + "/"

    def path(self, request: Request, name: str, **params: Any) -> str:
        """The path of one of the dashboard's own routes, under wherever it is mounted.

        ``request.url_for`` would look the name up in the outermost app's router, where a
        mounted dashboard's names are not at the top level.
        """
        root = (request.scope.get("root_path") or "").rstrip("/")
        own = self.starlette.router.url_path_for(name, **{k: str(v) for k, v in params.items()})
        return root + str(own)

    def error_page(self, request: Request, error: PageError) -> HTMLResponse:
        return self.render(
            request,
            "error.html",
            status_code=error.status_code,
            page_title=error.heading,
            code=error.status_code,
            heading=error.heading,
            message=error.message,
        )

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return self.error_page(
            request, PageError(404, "Not found", f"There is no page at {request.url.path}.")
        )

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return self.error_page(
            request,
            PageError(405, "Method not allowed", f"{request.method} is not allowed here."),
        )

    @contextlib.contextmanager
    def _connect(self, *, begin: bool = False) -> Iterator[sa.Connection]:
        """A connection for one page or action, in a transaction whose waits are bounded
        (:data:`LOCK_TIMEOUT`, :data:`STATEMENT_TIMEOUT`, or for an action (``begin``)
        :data:`ACTION_STATEMENT_TIMEOUT`; local to it, so nothing stays on the pooled
        connection): a jobs table locked by a migration, or a query that does not end,
        gives a 503 page rather than a request that never answers, each one holding a
        thread of the pool the host application's own routes run in."""
        with self.engine.connect() as conn:
            if not begin:
                self._clock_read(conn.execute(_BOUNDED).one())
                yield conn
                return
            # An action's own transaction reads each row as it is when it gets the row's
            # lock, whatever the engine's or the database's default isolation level (see
            # admin.ACTION_ISOLATION); reset when the connection goes back to the pool.
            conn.execution_options(isolation_level=admin.ACTION_ISOLATION)
            with conn.begin():
                self._clock_read(conn.execute(_BOUNDED_ACTION).one())
                yield conn

    def _in_transaction(self, work: Callable[[sa.Connection], _T]) -> _T:
        """Run ``work`` in an action's own transaction (:meth:`_connect`), and run that
        again, a few times, when the database undoes it for another's sake: a worker's
        outcome write locked some of the same jobs in another order (a deadlock). That is
        no outage, and the operator was told "the database cannot be reached"; acting
        again on the jobs as they were seen is safe (see :func:`sqla_jobs.admin.act`)."""

        def transaction() -> _T:
            with self._connect(begin=True) as conn:
                return work(conn)

        return admin._again_on_conflict(transaction)

    def _guarded(self, request: Request, page: Callable[[], Response]) -> Response:
        """Run a page; what goes wrong becomes an error page, never a traceback."""
        try:
            return page()
        except PageError as error:
            return self.error_page(request, error)
        except (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError) as exc:
            if _timed_out(exc):
                log.warning("dashboard: the database did not answer in time: %s", describe(exc))
                return self.error_page(
                    request,
                    PageError(
                        503,
                        "Database busy",
                        f"The database did not answer in time ({describe(exc)}): a lock "
                        "held on the jobs table (a migration?) or a slow query. Try again.",
                    ),
                )
            if passing(exc):
                # A deadlock or a serialization failure that outlasted the action's tries
                # (admin.ACTION_TRIES): the database is up, and undid this transaction.
                log.warning("dashboard: the database undid the transaction: %s", describe(exc))
                return self.error_page(
                    request,
                    PageError(
                        503,
                        "Database busy",
                        f"The database undid this transaction to let another go on "
                        f"({describe(exc)}), several times: nothing was changed. Try again.",
                    ),
                )
            if isinstance(exc, sa.exc.DBAPIError) and answered(exc):
                # An error about the statement (OperationalError is also what the driver
                # raises for some of those), on a database that answers.
                return self._database_error(request, exc)
            log.warning("dashboard: database unreachable: %s", describe(exc))
            return self.error_page(
                request,
                PageError(
                    503,
                    "Database unavailable",
                    f"The database cannot be reached: "
                    f"{describe(exc)}. The page works again once it is back.",
                ),
            )
        except sa.exc.DBAPIError as exc:
            return self._database_error(request, exc)
        except Exception:
            log.exception("dashboard: unexpected error on %s", request.url.path)
            return self.error_page(
                request,
                PageError(500, "Something went wrong", "The error was logged by the server."),
            )

    def _database_error(self, request: Request, exc: sa.exc.DBAPIError) -> Response:
        log.warning("dashboard: database error: %s", describe(exc))
        hint = ""
        if "does not exist" in str(exc.orig):
            hint = " Have the migrations been run (alembic upgrade head)?"
        return self.error_page(request, PageError(500, "Database error", f"{describe(exc)}.{hint}"))

    async def _page(self, request: Request, page: Callable[[], Response]) -> Response:
        return await run_in_threadpool(self._guarded, request, page)

    # -- pages -------------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        live = request.headers.get("hx-request") == "true"

        def page() -> Response:
            with self._connect() as conn:
                queues = admin.queue_states(conn, self.jobs, finished=False)
                throughput = admin.throughput(conn, self.jobs)
                workers = admin.list_workers(conn, self.jobs)
                # Keys held behind a failed head (key_order="fifo"); declared in code. The
                # first few, and whether there are more (the CLI lists them all).
                blocked = (
                    admin.blocked_keys(conn, self.jobs, limit=BLOCKED_SHOWN + 1)
                    if isinstance(self.jobs, Jobs)
                    else []
                )
            lags = [q.lag_seconds for q in queues if q.lag_seconds is not None]
            totals = {
                "ready": sum(q.ready for q in queues),
                "scheduled": sum(q.scheduled for q in queues),
                "running": sum(q.running for q in queues),
                "lease_expired": sum(q.lease_expired for q in queues),
                "dead": sum(q.dead for q in queues),
                "lag": max(lags) if lags else None,
            }
            hour = {
                "succeeded": sum(m.succeeded for m in throughput.total),
                "failed": sum(m.failed for m in throughput.total),
                "dead": sum(m.dead for m in throughput.total),
            }
            said = self.signer.verified(request.query_params, ("done", "name"))
            notice = _NOTICES.get(said.get("done", ""))
            return self.render(
                request,
                "_overview_live.html" if live else "overview.html",
                section="overview",
                page_title="Overview",
                queues=queues,
                blocked=blocked[:BLOCKED_SHOWN],
                blocked_more=len(blocked) > BLOCKED_SHOWN,
                totals=totals,
                hour=hour,
                throughput=throughput,
                alive=sum(w.alive for w in workers),
                refresh=self.refresh,
                now=self.now(),
                notice=notice.format(name=said.get("name", "")) if notice else None,
            )

        response = await self._page(request, page)
        response.headers["vary"] = "HX-Request"
        return response

    @_reads
    def job_list(self, request: Request) -> Response:
        f = Filters.of(request.query_params)
        before = _int_param(request.query_params.get("before"), "before")
        try:
            with self._connect() as conn:
                found = admin.browse_jobs(
                    conn,
                    self.jobs,
                    queue=f.queue,
                    task=f.task,
                    status=f.status,
                    worker=f.worker,
                    suspended=True if f.suspended else None,
                    search=f.q,
                    before_id=before,
                    limit=PAGE_SIZE,
                )
        except ValueError as exc:
            raise PageError(400, "Bad filter", str(exc)) from None
        if before is not None and not found.jobs and found.older is None:
            raise PageError(
                404,
                "Past the end",
                f"No job older than #{before} matches: this is past the end of the list.",
            )
        bulk_allowed, bulk_reason = True, ""
        if f.q:
            bulk_allowed, bulk_reason = (
                False,
                "To act on a search, select its jobs (bulk actions take queue, task and "
                "status filters).",
            )
        elif f.worker or f.suspended:
            bulk_allowed, bulk_reason = False, "Select jobs to act on them."
        return self.render(
            request,
            "jobs.html",
            section="jobs",
            page_title="Jobs",
            f=f,
            page=found,
            before=before,
            query=f.query(),
            filters_text=f.describe(),
            statuses=STATUSES,
            queue_names=self._queue_names(),
            task_names=sorted(self.jobs.tasks) if isinstance(self.jobs, Jobs) else [],
            window=admin.SEARCH_WINDOW,
            when=functools.partial(_when, now=self.now()),
            bulk_allowed=bulk_allowed,
            bulk_reason=bulk_reason,
        )

    @_reads
    def job(self, request: Request) -> Response:
        job_id = _job_id(request.path_params["job_id"])
        with self._connect() as conn:
            job = _found(admin.get_job(conn, self.jobs, job_id), job_id)
            paused = job.queue in admin.paused_queues(conn, self.jobs)
        notice, kind = _job_notice(
            self.signer.verified(request.query_params, ("done", "skipped", "rearmed")), job
        )
        args_text = json.dumps(job.args, indent=2, ensure_ascii=False, sort_keys=True)
        error = job.last_error or ""
        return self.render(
            request,
            "job.html",
            section="jobs",
            page_title=f"Job {job.id}",
            job=job,
            next_step=_next_step(job, paused, now := self.now()),
            fields=_fields(job, now),
            step_columns=_present.STEP_COLUMNS,
            steps=[_present.step_cells(step, _page_when(now)) for step in job.steps or ()],
            args_text=args_text[:ARGS_SHOWN],
            args_truncated=len(args_text) > ARGS_SHOWN,
            args_limit=ARGS_SHOWN,
            args_size=len(args_text),
            # The end of a long error: the exception is on its last line.
            error_text=error[-ARGS_SHOWN:],
            error_size=len(error),
            notice=notice,
            notice_kind=kind,
        )

    @_reads
    def download(self, request: Request) -> Response:
        """One column of a job, whole, as a file: what its page cuts short."""
        job_id = _job_id(request.path_params["job_id"])
        field = request.path_params["field"]
        if field not in DOWNLOADS:
            raise PageError(404, "Not found", f"A job has no value {field[:40]!r} to download.")
        with self._connect() as conn:
            job = _found(admin.get_job(conn, self.jobs, job_id), job_id)
        value = getattr(job, field)
        if field == "last_error":
            body, suffix = value or "", "txt"
        else:
            body = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
            suffix = "json"
        filename = f"job-{job_id}-{field}.{suffix}"
        return Response(
            body,
            media_type=DOWNLOADS[field],
            headers={
                "content-disposition": f'attachment; filename="{filename}"',
                "cache-control": "no-store",
            },
        )

    @_reads
    def confirm(self, request: Request) -> Response:
        action = request.query_params.get("action", "")
        if action not in admin.ACTIONS:
            raise PageError(400, "Bad action", f"unknown action {action!r}")
        f = _bulk_filters(request.query_params)
        up_to_id, count = self._count(action, f)
        spec = admin.ACTIONS[action]
        verb = spec.label
        statuses = f.status or " or ".join(spec.statuses)
        hidden = [("action", action), ("up_to_id", up_to_id), ("count", count)]
        hidden += [(k, v) for k, v in f.items() if v]
        return self.render(
            request,
            "confirm.html",
            section="jobs",
            page_title=f"{verb.capitalize()} jobs",
            action=action,
            verb=verb,
            count=count,
            up_to_id=up_to_id,
            statuses=statuses,
            filters_text=_bulk_text(f),
            explanation=spec.explanation,
            destroys=spec.destroys,
            hidden=hidden,
            back=self._jobs_url(request, f),
        )

    def _count(self, action: str, f: Filters) -> tuple[int, int]:
        try:
            with self._connect() as conn:
                up_to_id = admin.max_job_id(conn, self.jobs)
                report = admin.preview(conn, self.jobs, action, f.selection(up_to_id))
        except ValueError as exc:
            raise PageError(400, "Not possible", str(exc)) from None
        return up_to_id, report.count

    @_reads
    def schedules(self, request: Request) -> Response:
        table = admin.source_table(self.jobs)
        s = companion_tables(table).schedules
        with self._connect() as conn:
            if isinstance(self.jobs, Jobs):
                rows = periodic.list_schedules(conn, self.jobs)
            else:
                rows = list(conn.execute(sa.select(s).order_by(s.c.name)))
        notice, kind = None, "ok"
        said = self.signer.verified(request.query_params, ("ran", "name"))
        if said.get("ran"):
            notice = f"Enqueued job #{said['ran']} for schedule {said.get('name', '')}."
        return self.render(
            request,
            "schedules.html",
            section="schedules",
            page_title="Schedules",
            schedules=rows,
            registry=isinstance(self.jobs, Jobs),
            notice=notice,
            notice_kind=kind,
        )

    @_reads
    def workers(self, request: Request) -> Response:
        with self._connect() as conn:
            workers = admin.list_workers(conn, self.jobs)
            running = admin.browse_jobs(conn, self.jobs, status=JobStatus.RUNNING.value, limit=200)
        return self.render(
            request,
            "workers.html",
            section="workers",
            page_title="Workers",
            workers=workers,
            running=running.jobs,
            running_more=running.older is not None,
        )

    # -- actions -----------------------------------------------------------------------------

    async def _form(self, request: Request) -> Form | Response:
        """The posted form, once the request may act and its CSRF token is right; or the
        error page that refuses it."""
        error = await run_in_threadpool(self._refusal, request)
        if error is not None:
            return self.error_page(request, error)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return self.error_page(
                    request, PageError(413, "Too large", "The form is too large.")
                )
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            return self.error_page(request, PageError(400, "Bad form", "not UTF-8"))
        form: dict[str, list[str]] = {}
        for k, v in pairs:
            form.setdefault(k, []).append(v)
        token = request.headers.get(CSRF_HEADER) or (form.get(CSRF_FIELD) or [""])[0]
        cookie = self.signer.valid_token(request.cookies.get(CSRF_COOKIE))
        if not token or not cookie or not hmac.compare_digest(token.encode(), cookie.encode()):
            return self.error_page(
                request,
                PageError(
                    403,
                    "Missing or wrong CSRF token",
                    "This form did not come from this dashboard's own page, or its page is "
                    "too old. Reload the page and try again.",
                ),
            )
        return form

    def _refusal(self, request: Request) -> PageError | None:
        if self.read_only:
            return PageError(403, "Read-only", "This dashboard is read-only: it takes no actions.")
        if not self.can_act(request):
            return PageError(403, "Not allowed", "You are not allowed to act on the queue.")
        if not _same_origin(request):
            return PageError(403, "Cross-site request", "Actions must come from this site.")
        return None

    @_acts
    def job_action(self, request: Request, form: Form) -> Response:
        job_id = _job_id(request.path_params["job_id"])
        action = request.path_params["action"]
        if action not in admin.ACTIONS:
            raise PageError(404, "Not found", f"No action {action!r}.")
        attempts = _required_int(_one(form, "attempts"), "attempts")
        if attempts > _INT_MAX:
            raise PageError(400, "Bad request", f"attempts is out of range: {attempts}")
        seen = admin.SeenJob(job_id, attempts, _one(form, "status") or "")
        report = self._act(action, [seen])
        if admin.ACTIONS[action].destroys and report.acted:
            url = self.path(request, "jobs") + "?" + urlencode({"deleted": job_id})
            return RedirectResponse(url, status_code=303)
        params = {"done": action} if report.acted else {"skipped": report.skipped[0][1]}
        if report.rearmed:
            params["rearmed"] = str(len(report.rearmed))
        url = self.path(request, "job", job_id=job_id) + "?" + self.signer.query(params)
        return RedirectResponse(url, status_code=303)

    def _act(
        self, action: str, selection: admin.Selection | list[admin.SeenJob]
    ) -> admin.ActionReport:
        try:
            return self._in_transaction(lambda conn: admin.act(conn, self.jobs, action, selection))
        except ValueError as exc:
            raise PageError(400, "Not possible", str(exc)) from None

    @_acts
    def act(self, request: Request, form: Form) -> Response:
        action = _one(form, "action") or ""
        if action not in admin.ACTIONS:
            raise PageError(400, "Bad action", f"unknown action {action!r}")
        seen = [_seen(v) for v in form.get("job", [])]
        if not seen:
            raise PageError(400, "Nothing selected", "Select at least one job.")
        report = self._act(action, seen)
        return self._result(request, report, _back(request) or self.path(request, "jobs"))

    @_acts
    def act_all(self, request: Request, form: Form) -> Response:
        action = _one(form, "action") or ""
        if action not in admin.ACTIONS:
            raise PageError(400, "Bad action", f"unknown action {action!r}")
        # The filters its confirm page took, and only those: another one (a worker, a
        # search) would be dropped here, and the action would reach past it.
        f = _bulk_filters({k: v[0] for k, v in form.items()})
        up_to_id = _required_int(_one(form, "up_to_id"), "up_to_id")
        confirmed = _required_int(_one(form, "count"), "count")
        # A retry also says what came back with the retried jobs.
        report = self._act(action, f.selection(up_to_id))
        return self._result(request, report, self._jobs_url(request, f), confirmed=confirmed)

    def _result(
        self,
        request: Request,
        report: admin.ActionReport,
        back: str,
        *,
        confirmed: int | None = None,
    ) -> Response:
        """What an action did: the jobs acted on and those left alone, or, for a bulk
        action (``confirmed``: the count its confirm page showed), how many."""
        spec = admin.ACTIONS[report.action]
        past = spec.label_past
        listed = confirmed is None
        summary = f"{past.capitalize()} {_jobs(report.count)}."
        if report.rearmed:
            summary += _came_back(len(report.rearmed))
        if listed and report.skipped:
            summary += (
                f" {_jobs(len(report.skipped))} left alone: they changed, or {spec.label} does "
                "not apply."
            )
        if confirmed is not None and report.count < confirmed:
            summary += (
                f" You confirmed {confirmed:,}; the others changed meanwhile and were left alone."
            )
        elif confirmed is not None and report.count > confirmed:
            summary += (
                f" You confirmed {confirmed:,}; more matched by then (jobs that came to match "
                "the filters after the count, or whose transaction was still open then)."
            )
        return self.render(
            request,
            "result.html",
            section="jobs",
            page_title="Done",
            heading=f"{past.capitalize()} {_jobs(report.count)}",
            summary=summary,
            action=report.action,
            past=past,
            destroys=spec.destroys,
            acted=list(report.acted) if listed else [],
            skipped=list(report.skipped) if listed else [],
            back=back,
        )

    @_acts
    def queue_action(self, request: Request, form: Form) -> Response:
        action = request.path_params["action"]
        if action not in ("pause", "resume"):
            raise PageError(404, "Not found", f"No queue action {action!r}.")
        name = _one(form, "name") or ""
        change = admin.pause_queue if action == "pause" else admin.resume_queue
        try:
            self._in_transaction(lambda conn: change(conn, self.jobs, name))
        except ValueError as exc:
            raise PageError(400, "Bad queue name", str(exc)) from None
        url = (
            self.path(request, "overview") + "?" + self.signer.query({"done": action, "name": name})
        )
        return RedirectResponse(url, status_code=303)

    @_acts
    def run_schedule(self, request: Request, form: Form) -> Response:
        name = _one(form, "name") or ""
        if "\x00" in name:  # PostgreSQL refuses it in text: no schedule has it
            raise PageError(404, "No such schedule", "a schedule name has no NUL character")
        if not isinstance(self.jobs, Jobs):
            raise PageError(
                400, "Needs the registry", "Running a schedule needs the Jobs registry."
            )
        jobs = self.jobs
        try:
            job_id = self._in_transaction(lambda conn: admin.run_schedule(conn, jobs, name))
        except EnqueueError as exc:
            # First: an unknown task is an EnqueueError and a LookupError too, and was
            # answered "No such schedule" for a schedule that is there.
            raise PageError(400, "Cannot run it", str(exc)) from None
        except admin.NoSuchSchedule as exc:
            raise PageError(404, "No such schedule", str(exc)) from None
        except ValueError as exc:
            raise PageError(400, "Cannot run it", str(exc)) from None
        url = (
            self.path(request, "schedules") + "?" + self.signer.query({"ran": job_id, "name": name})
        )
        return RedirectResponse(url, status_code=303)

    # -- helpers -----------------------------------------------------------------------------

    def _queue_names(self) -> list[str]:
        """Suggestions for the queue filter: the registry's queues (reading the table's
        distinct queues would scan it)."""
        if isinstance(self.jobs, Jobs):
            return sorted({t.queue for t in self.jobs.tasks.values()} | {self.jobs.default_queue})
        return []

    def _jobs_url(self, request: Request, f: Filters) -> str:
        query = urlencode([(k, v) for k, v in f.items() if v and k != "q"])
        return self.path(request, "jobs") + (f"?{query}" if query else "")


# -- small pieces ------------------------------------------------------------------------------

_NOTICES = {
    "pause": "Paused queue {name}: workers stop claiming from it within a poll interval.",
    "resume": "Resumed queue {name}.",
}


def _jobs(n: int) -> str:
    return _present.plural(n, grouped=True)


#: How long a page or an action waits for a lock (a migration's on the jobs table, a
#: worker's on a row) and for any one statement, before it gives a 503 page. An action
#: may take longer than a page: a bulk retry of half a million dead jobs is one UPDATE.
LOCK_TIMEOUT = "5s"
STATEMENT_TIMEOUT = "30s"
ACTION_STATEMENT_TIMEOUT = "300s"


def _bounded(statement_timeout: str) -> sa.Select[Any]:
    return sa.select(
        sa.func.set_config("lock_timeout", LOCK_TIMEOUT, True),
        sa.func.set_config("statement_timeout", statement_timeout, True),
        # The database's clock, for the pages' times (Dashboard.now), at no round trip more.
        sa.func.clock_timestamp(),
    )


_BOUNDED, _BOUNDED_ACTION = _bounded(STATEMENT_TIMEOUT), _bounded(ACTION_STATEMENT_TIMEOUT)
#: SQLSTATEs of those two: lock_not_available, query_canceled.
_TIMED_OUT = frozenset({"55P03", "57014"})


def _timed_out(exc: Exception) -> bool:
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in _TIMED_OUT


def _bulk_filters(params: Mapping[str, str]) -> Filters:
    """The filters of a bulk action (its confirm page, and the action it posts): queue,
    task and status. The others select jobs a bulk action cannot be bounded by, and are
    refused rather than dropped."""
    f = Filters.of(params)
    if f.q or f.worker or f.suspended:
        raise PageError(
            400,
            "Not a bulk filter",
            "Bulk actions take queue, task and status filters; select jobs instead.",
        )
    return f


def _bulk_text(f: Filters) -> str:
    parts = []
    if f.queue:
        parts.append(f"in queue {f.queue}")
    if f.task:
        parts.append(f"of task {f.task}")
    return " ".join(parts)


def _one(form: dict[str, list[str]], name: str) -> str | None:
    values = form.get(name)
    return values[0] if values else None


#: A number the dashboard takes from a URL or a form: ASCII digits, at most a bigint's
#: 19. (``int()`` also reads "¹", "١٢", " 12" and "1_000", and thousands of digits.)
_DIGITS = re.compile(r"[0-9]{1,19}")
_BIGINT_MAX = 2**63 - 1


def _number(value: str) -> int | None:
    """``value`` as a whole number from 0 to a bigint's largest, or None."""
    if _DIGITS.fullmatch(value) is None:
        return None
    number = int(value)
    return number if number <= _BIGINT_MAX else None


def _int_param(value: str | None, name: str, *, required: bool = False) -> int | None:
    if value is None or value == "":
        if required:
            raise PageError(400, "Bad request", f"{name} is missing")
        return None
    number = _number(value)
    if number is None:
        raise PageError(
            400,
            "Bad request",
            f"{name} must be a whole number from 0 to {_BIGINT_MAX}, got {value[:40]!r}",
        )
    return number


def _required_int(value: str | None, name: str) -> int:
    number = _int_param(value, name, required=True)
    assert number is not None
    return number


def _job_id(text: str) -> int:
    value = _number(text)
    if not value:
        raise PageError(404, "Not found", f"{text[:40]!r} is not a job id.")
    return value


def _found(job: admin.JobView | None, job_id: int) -> admin.JobView:
    """The job a page is about, or the page that says there is none."""
    if job is None:
        raise PageError(
            404,
            f"No job {job_id}",
            f"There is no job with id {job_id}. Finished jobs are deleted unless kept "
            "(Jobs(keep_done=...)), and dead ones once pruned.",
        )
    return job


def _seen(value: str) -> admin.SeenJob:
    """One selected job, ``id:attempts:status``, as a job list draws it."""
    parts = value.split(":")
    if len(parts) == 3:
        job_id, attempts = _number(parts[0]), _number(parts[1])
        if job_id and attempts is not None and attempts <= _INT_MAX and parts[2] in STATUSES:
            return admin.SeenJob(job_id, attempts, parts[2])
    raise PageError(
        400, "Bad selection", f"not a job selection (id:attempts:status): {value[:60]!r}"
    )


_INT_MAX = 2**31 - 1


def _cookie_path(request: Request) -> str:
    root = request.scope.get("root_path", "") or ""
    return root.rstrip("/") + "/"


def _same_origin(request: Request) -> bool:
    """Browsers say where a request comes from; one from another site is refused (on top
    of the CSRF token, which such a site cannot read)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin == "null":
        # A sandboxed frame, a data: URL, a redirect across sites: nothing of ours.
        return False
    if origin:
        host = request.headers.get("host", "")
        return urlsplit(origin).netloc == host
    return True


def _back(request: Request) -> str | None:
    """The page the form was on, if it is one of ours."""
    referer = request.headers.get("referer")
    if not referer:
        return None
    parts = urlsplit(referer)
    if parts.netloc and parts.netloc != request.headers.get("host", ""):
        return None
    root = request.scope.get("root_path", "") or ""
    if not parts.path.startswith(root + "/"):
        return None
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _job_notice(
    params: Mapping[str, str], job: admin.JobView | None = None
) -> tuple[str | None, str]:
    """The notice of a job's page after an action: from the signed query string the
    action redirected to (see :meth:`Signer.verified`), never from text in the URL."""
    done = params.get("done")
    if done == "retry":
        if job is not None and job.status == "scheduled" and job.waiting:
            text = "Retried: the job waits again for the jobs it depends on (after=)."
        else:
            text = "Retried: the job is ready again, due now."
        rearmed = params.get("rearmed", "")
        if rearmed.isdigit() and len(rearmed) < 10 and int(rearmed):
            text += _came_back(int(rearmed), one=True)
        return text, "ok"
    if done in admin.ACTIONS:
        return f"{admin.ACTIONS[done].label_past.capitalize()}.", "ok"
    skipped = params.get("skipped")
    if skipped:
        return f"Nothing was done: {skipped[:200]}.", "warn"
    return None, "ok"


def _came_back(n: int, one: bool = False) -> str:
    """A retry's jobs that came back waiting: children cancelled when the retried ended."""
    who, whom = ("it", "it") if one else ("they", "them")
    verb = "waits" if n == 1 else "wait"
    return f" {_jobs(n)} {who} had cancelled by ending {verb} for {whom} again."


def _when(job: admin.JobSummary, now: datetime) -> str:
    status = job.status
    if status == JobStatus.SCHEDULED:
        return f"runs {ago(job.run_at, now)}"
    if status == JobStatus.READY:
        return f"due {ago(job.run_at, now)}"
    if status == JobStatus.RUNNING:
        return f"lease until {clock(job.locked_until, seconds=True)}"
    if job.finished_at is not None:
        return f"finished {ago(job.finished_at, now)}"
    return f"created {ago(job.created_at, now)}"


def _page_when(now: datetime) -> Callable[[datetime | None], str]:
    """How a job's page writes a moment: the UTC time, and how long before or after
    ``now``."""

    def when(value: datetime | None) -> str:
        return f"{clock(value, seconds=True, date=True)} UTC ({ago(value, now)})" if value else "-"

    return when


def _next_step(job: admin.JobView, paused: bool, now: datetime) -> str:
    """One sentence: what happens to this job next, and when."""
    status = job.status
    attempt = f"attempt {job.attempts + 1} of {job.max_attempts}"
    held = job.suspended_in
    if status == JobStatus.SCHEDULED and held is not None:
        done = f"{job.steps_done} of its {len(job.steps or ())} steps done"
        if held.kind == "sleep":
            return (
                f"Asleep in step {held.name!r} ({done}), holding no worker: it runs again "
                f"{ago(job.run_at, now)} and goes on after that step."
            )
        until = "no timeout" if held.until is None else f"times out {ago(held.until, now)}"
        return (
            f"Waits for the signal {held.name!r} ({until}; {done}), holding no worker: "
            "jobs.signal(...) for this job wakes it, in the sender's transaction."
        )
    if status == JobStatus.SCHEDULED:
        kind = "retry" if job.attempts else "first run"
        when = clock(job.run_at, seconds=True, date=True)
        return (
            f"Waits until {when} UTC ({ago(job.run_at, now)}), then becomes ready: {kind}, "
            f"{attempt}."
        )
    if status == JobStatus.READY:
        if paused:
            return (
                f"Ready since {ago(job.run_at, now)}, but its queue {job.queue} is paused: no "
                "worker claims it until the queue is resumed."
            )
        return (
            f"Ready since {ago(job.run_at, now)}: the next free worker of queue {job.queue} "
            f"claims it ({attempt})."
        )
    if status == JobStatus.RUNNING:
        if job.locked_until is not None and job.locked_until < now:
            return (
                f"Running on {job.locked_by}, but its lease expired "
                f"{ago(job.locked_until, now)}: the worker died or hangs, and the job will be "
                "rescued (ready again, or dead if it has no attempt left)."
            )
        return (
            f"Running on {job.locked_by} (attempt {job.attempts} of {job.max_attempts}); "
            f"the lease runs until {clock(job.locked_until, seconds=True)} UTC and is "
            "renewed while the worker lives."
        )
    if status == JobStatus.DEAD:
        tries = f"{job.attempts} attempt{'s' if job.attempts != 1 else ''}"
        return f"Dead after {tries}: nothing happens until it is retried, or pruned by retention."
    if status == JobStatus.CANCELLED:
        return "Cancelled: nothing happens until it is retried, or pruned by retention."
    return "Done: kept for the record until retention prunes it."


def _fields(job: admin.JobView, now: datetime) -> list[tuple[str, str]]:
    # Tags and correlation ids given at enqueue, the handler's last progress note, and
    # workflows and results (only for jobs that have them), each cut to what a page shows.
    return _present.job_fields(
        job,
        when=_page_when(now),
        value=lambda _name, value: _shown(_present.compact_json(value)),
        order=_present.PAGE_JOB_FIELDS,
    )


def _shown(text: str) -> str:
    """A value as a job's page shows it: cut at :data:`ARGS_SHOWN` characters (rows
    written by other producers are bounded by nothing); the page links to all of it."""
    if len(text) <= ARGS_SHOWN:
        return text
    return f"{text[:ARGS_SHOWN]}… ({len(text):,} characters: download it for the rest)"


class Signer:
    """Signs what the dashboard hands the browser and must get back unchanged: the CSRF
    token, and the notice an action's redirect carries.

    An unsigned double-submit token is any text the cookie and the form agree on, so a
    cookie planted by a sibling subdomain (or by a man-in-the-middle on plain http) is a
    bypass; a token is valid here only with the HMAC of this dashboard's secret. A notice
    ("Paused queue emails") is shown only when the server wrote it after acting, never
    because a link says so.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def sign(self, purpose: str, text: str) -> str:
        mac = hmac.new(self._secret, f"{purpose}\x00{text}".encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()[:24]).decode().rstrip("=")

    def verify(self, purpose: str, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(purpose, text), signature)

    def token(self) -> str:
        """A new CSRF token: a random nonce and its signature."""
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self.sign('csrf', nonce)}"

    def valid_token(self, value: str | None) -> str | None:
        """``value`` if it is a token this dashboard signed, else None."""
        if not value or len(value) > 100 or not value.isascii():
            return None
        nonce, dot, signature = value.partition(".")
        if not dot or not nonce or not self.verify("csrf", nonce, signature):
            return None
        return value

    def query(self, params: Mapping[str, object]) -> str:
        """``params`` as a query string, signed (see :meth:`verified`)."""
        text = urlencode(sorted((k, str(v)) for k, v in params.items()))
        return f"{text}&sig={self.sign('notice', text)}"

    def verified(self, query: Any, names: Iterable[str]) -> dict[str, str]:
        """The ``names`` of a query string that :meth:`query` signed; empty unless the
        signature holds."""
        found = {n: query[n] for n in names if n in query}
        signature = query.get("sig")
        if not found or not isinstance(signature, str):
            return {}
        text = urlencode(sorted(found.items()))
        return found if self.verify("notice", text, signature) else {}


def create_app(
    jobs: Jobs | type[Any],
    engine: sa.Engine | str | None = None,
    *,
    engines: Mapping[str, sa.Engine | str] | None = None,
    authorize: Authorize | None = None,
    read_only: bool | None = None,
    title: str = "sqla-jobs",
    refresh: float = 5.0,
    allowed_hosts: Iterable[str] = DEFAULT_ALLOWED_HOSTS,
    secret: str | bytes | None = None,
) -> ASGIApp:
    """The dashboard of one jobs table, as an ASGI application to mount anywhere.

    :param jobs: the :class:`~sqla_jobs.Jobs` registry, or the bare ``JobMixin`` model
        (then "Run now" on schedules is not offered: it needs the tasks).
    :param engine: a SQLAlchemy ``Engine`` (or a database URL to make one from).
    :param engines: instead of ``engine``, the shards, by name (see
        :mod:`sqla_jobs.sharding`): a page of every shard's queues at ``/``, and each
        shard's own dashboard at ``/shards/<name>/``.
    :param authorize: ``request -> bool``: whether a request may act (retry, cancel,
        delete, pause, resume, run a schedule). Giving it turns actions on.
    :param read_only: ``True`` (the default without ``authorize``) refuses every action;
        ``False`` without ``authorize`` lets anyone who can reach the app act, and logs a
        warning saying so.
    :param title: the name in the page header.
    :param refresh: seconds between the overview's live refreshes.
    :param allowed_hosts: the ``Host`` names it answers for (``localhost``,
        ``127.0.0.1`` and ``[::1]`` by default); any other gets a 400. Give the names it
        is reached by (``["jobs.example.com"]``, ``"*.example.com"`` for every subdomain,
        ``["*"]`` for any): a page that rebinds its own name to this server (DNS
        rebinding) is refused instead of reading the jobs.
    :param secret: the key that signs its CSRF tokens and notices; random for each app
        by default. Give every process that serves one dashboard (several workers
        behind one address) the same one, or a form drawn by one is refused by another.
    """
    hosts = check_allowed_hosts(allowed_hosts)
    if isinstance(secret, str):
        secret = secret.encode()
    if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
        raise ValueError("secret must be at least 16 bytes (e.g. secrets.token_hex(32))")
    if read_only and authorize is not None:
        raise ValueError("read_only=True and authorize= contradict each other: give one")
    if authorize is not None and not callable(authorize):
        raise TypeError(f"authorize must be a callable (request -> bool), got {authorize!r}")
    if not refresh > 0:
        raise ValueError(f"refresh must be > 0 seconds, got {refresh!r}")
    admin.source_table(jobs)  # TypeError for anything but a registry or a model
    if engines is not None:
        if engine is not None:
            raise ValueError("give engine= or engines= (shards), not both")
        checked = shard_engines(engines)
        effective = read_only_of(read_only, authorize)
        dashboards = {
            name: Dashboard(
                jobs,
                shard,
                authorize=authorize,
                read_only=effective,
                title=f"{title} · {name}",
                refresh=refresh,
                shard=name,
                secret=secret,
            )
            for name, shard in checked.items()
        }
        return TrustedHosts(shards_page(jobs, dashboards, title), hosts)
    if engine is None:
        raise TypeError("create_app needs an engine (or engines=, one per shard)")
    dashboard = Dashboard(
        jobs,
        engine_of("engine", engine),
        authorize=authorize,
        read_only=read_only_of(read_only, authorize),
        title=title,
        refresh=refresh,
        secret=secret,
    )
    return TrustedHosts(dashboard.app, hosts)
