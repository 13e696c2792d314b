"""Flask integration: handlers run inside the app's context, and a transactional handler's
session is Flask-SQLAlchemy's ``db.session``.

.. code-block:: python

    # myapp/__init__.py
    db = SQLAlchemy(session_options={"class_": AppSession})  # AppSession: enqueue too

    class Job(JobMixin, db.Model):
        __tablename__ = "jobs"

    jobs = Jobs(Job)
    flask_jobs = FlaskJobs(jobs, db)

    def create_app() -> Flask:
        app = Flask(__name__)
        app.config.from_prefixed_env()
        db.init_app(app)
        flask_jobs.init_app(app)
        return app

    # myapp/worker.py, what the worker imports: sqla-jobs worker myapp.worker:jobs
    from myapp import create_app, jobs

    app = create_app()

Every run of a handler of ``jobs`` then runs inside an app context of that app, pushed for
the run and popped when it ends (``teardown_appcontext`` functions run then, with the
handler's exception), so handlers use ``current_app``, ``g``, ``url_for(...,
_external=True)`` (with ``SERVER_NAME`` set) and ``db.session`` as a request would. Plain and
``async def`` handlers alike, on either worker.

Given ``db``, a transactional handler's session *is* ``db.session()``: the session
Flask-SQLAlchemy keeps for that app context, of the class ``session_options`` names (with
``enqueue`` if it mixes in :class:`~sqla_jobs.EnqueueMixin`), with its events and ``info``.
Model helpers that write through ``db.session`` write in the job's exactly-once
transaction, committed with the job's guarded completion or rolled back with it. It
writes through Flask-SQLAlchemy's engine (``SQLALCHEMY_DATABASE_URI``), which must be the
worker's database; and, since Flask-SQLAlchemy is synchronous, it serves the threaded
worker (the asyncio worker refuses a sync session, failing the run with a clear error).

.. warning::

    One app per worker process: runs use the app last given to :meth:`FlaskJobs.init_app`.
    A run that starts inside an app context of that same app uses it instead of pushing
    one (a test calling ``sqla_jobs.testing.run_queued_jobs(db.session(), jobs)`` inside
    ``with app.app_context():``, whose ``db.session`` the handlers then share). So do not
    start an asyncio worker inside an app context: its runs, tasks of that context, would
    all share it. The threaded worker's runs start in threads of their own, outside any.

Nothing here is global: the hooks are the registry's (:meth:`sqla_jobs.Jobs.around_run`
and ``Jobs.session_factory``), installed by the first ``init_app``.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .errors import missing_extra
from .worker.job import current_job

try:
    from flask import Flask, current_app, has_app_context
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(missing_extra(__name__, "Flask", "flask")) from exc

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy
    from sqlalchemy.orm import Session

    from .tasks import Jobs
    from .worker.job import ClaimedJob

__all__ = ["FlaskJobs"]


class FlaskJobs:
    """The Flask extension: ``FlaskJobs(jobs, db)``, then ``init_app(app)`` in the app
    factory (or ``FlaskJobs(jobs, db, app)``).

    :param jobs: the registry whose handlers run in the app's context.
    :param db: Flask-SQLAlchemy's extension: transactional handlers then run in its
        ``db.session``. Without it they get the registry's own session (a plain one, or
        ``Jobs(session_factory=...)``'s).
    :param app: an app to initialise at once.
    """

    def __init__(self, jobs: Jobs, db: SQLAlchemy | None = None, app: Flask | None = None) -> None:
        self.jobs = jobs
        self.db = db
        #: The app whose context runs are given (the last one initialised).
        self.app: Flask | None = None
        self._installed = False
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Register with ``app`` (``app.extensions["sqla_jobs"]``) and make it the app
        whose context handlers run in.

        :raises ValueError: ``db`` was given and the registry already has a
            ``session_factory`` of its own.
        """
        if not self._installed:
            if self.db is not None:
                if self.jobs.session_factory is not None:
                    raise ValueError(
                        "this Jobs registry already has a session_factory; FlaskJobs(jobs, "
                        "db) would replace it with db.session (pass no db to keep it)"
                    )
                self.jobs.session_factory = self._session
            self.jobs.around_run(self._context)
            self._installed = True
        app.extensions["sqla_jobs"] = self
        self.app = app

    def _context(self, job: ClaimedJob) -> AbstractContextManager[object]:
        """The app context one run runs in: a new one, or the one it started in."""
        app = self.app
        if app is None:  # pragma: no cover - init_app installs this hook
            raise RuntimeError("FlaskJobs.init_app(app) was never called")
        if has_app_context() and current_app._get_current_object() is app:  # type: ignore[attr-defined]
            return contextlib.nullcontext()
        return app.app_context()

    def _session(self, *, bind: Any) -> Session:
        """``db.session()``, the session of the run's app context, for a transactional run;
        a new session of Flask-SQLAlchemy's for a durable run's step, which commits a
        session of its own (the handler may have left ``db.session`` in a transaction,
        reading through it, which a step's session must not be). ``bind``, the worker's
        engine, is not used: Flask-SQLAlchemy binds its sessions to its own engines."""
        assert self.db is not None
        scoped = self.db.session
        try:
            job = current_job()
        except LookupError:
            job = None
        task = None if job is None else self.jobs.tasks.get(job.task)
        if task is not None and task.durable:
            own: Session = scoped.session_factory()
            return own
        session: Session = scoped()
        return session
