"""An application's own tests keep working once its metadata holds a jobs table.

Issue 21 §3: adding ``JobMixin`` to an application's metadata made every
``metadata.create_all()`` PostgreSQL-only (``can't render element of type JSONB``), so the
application's SQLite tests broke. The jobs tables now create on SQLite (type variants;
the PostgreSQL-only DDL is left out there), a plain enqueue and ``sqla_jobs.testing``'s
assertions work on it, and what needs PostgreSQL says so in one line. On PostgreSQL the
DDL is what it was (tests/test_alembic.py and tests/test_upgrade.py check that
autogenerate sees no difference on existing installs).

The Flask-SQLAlchemy recipe of the README's testing section (``run_queued_jobs(db.session(),
jobs)`` in an app context) is run here as written, on PostgreSQL, and on SQLite as far as
SQLite goes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_sqlalchemy.session import Session as FlaskSession
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.schema import CreateTable

from sqla_jobs import EnqueueError, EnqueueMixin, JobMixin, Jobs, JobSession
from sqla_jobs.model import reference_table
from sqla_jobs.testing import assert_enqueued, assert_not_enqueued, enqueued_jobs, run_queued_jobs


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class Signup(Base):
    __tablename__ = "signups"
    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    email: Mapped[str] = mapped_column(sa.Text)


jobs = Jobs(Job)


@jobs.task(queue="emails")
def send_welcome(email: str) -> None:
    pass


@pytest.fixture
def sqlite() -> Iterator[sa.Engine]:
    """An application's SQLite test database, its whole metadata created."""
    engine = sa.create_engine("sqlite://")
    Base.metadata.create_all(engine)  # the jobs tables included: this raised before
    yield engine
    Base.metadata.drop_all(engine)
    engine.dispose()


def test_the_jobs_tables_create_and_drop_on_sqlite(sqlite: sa.Engine) -> None:
    names = set(sa.inspect(sqlite).get_table_names())
    assert {"jobs", "signups", "jobs_queues", "jobs_schedules", "jobs_workers"} <= names
    assert len(names) == 9  # the jobs table, seven companions, the app's own


def test_enqueue_and_the_assertions_work_on_sqlite(sqlite: sa.Engine) -> None:
    with JobSession(sqlite, jobs=jobs) as session:
        session.add(Signup(email="a@example.com"))
        job = session.enqueue(send_welcome, "a@example.com")
        session.enqueue(send_welcome.with_options(delay=60, meta={"tag": "later"}), "b@x.org")
        [found] = assert_enqueued(session, send_welcome, email="a@example.com")
        assert found.id == job.id and found.status == "ready"
        assert_not_enqueued(session, send_welcome, email="nobody@example.com")
        later = next(j for j in enqueued_jobs(session, jobs) if j.args == {"email": "b@x.org"})
        assert later.status == "scheduled"
        session.commit()
    with sqlite.connect() as conn:
        stored = conn.execute(sa.select(Job.queue, Job.args, Job.meta).order_by(Job.id)).all()
    assert [tuple(r) for r in stored] == [
        ("emails", {"email": "a@example.com"}, None),
        ("emails", {"email": "b@x.org"}, {"tag": "later"}),
    ]


def test_what_needs_postgresql_says_so_in_one_line(sqlite: sa.Engine) -> None:
    """Refused at the call, before anything is added: the session stays usable and the
    application's rows commit."""
    with JobSession(sqlite, jobs=jobs) as session:
        session.add(Signup(email="a@example.com"))
        for enqueue in (
            lambda: session.enqueue_many(send_welcome, [{"email": "x"}]),
            lambda: session.enqueue(send_welcome.with_options(unique=True), "x"),
            lambda: session.enqueue(send_welcome.with_options(unique_for=60), "x"),
        ):
            with pytest.raises(EnqueueError, match="needs PostgreSQL; this database is sqlite"):
                enqueue()
        with pytest.raises(EnqueueError, match=r"^enqueue_many needs PostgreSQL"):
            jobs.enqueue_many(session.connection(), send_welcome, [{"email": "y"}])
        session.enqueue(send_welcome, "a@example.com")
        with pytest.raises(RuntimeError, match=r"^run_queued_jobs .* needs PostgreSQL"):
            run_queued_jobs(session, jobs)
        session.commit()
    with Session(sqlite) as check:
        assert check.scalar(sa.select(sa.func.count()).select_from(Signup)) == 1
        assert check.scalar(sa.select(sa.func.count()).select_from(Job)) == 1


_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def test_postgresql_ddl_keeps_its_types_and_defaults() -> None:
    """The variants change nothing on PostgreSQL: BIGINT identity, JSONB with ``'{}'::jsonb``,
    arrays (the full comparison with an existing install is tests/test_upgrade.py's)."""
    table = reference_table("jobs")
    ddl = str(CreateTable(table).compile(dialect=_PG))
    for part in (
        "id BIGINT GENERATED BY DEFAULT AS IDENTITY",
        "args JSONB DEFAULT '{}'::jsonb NOT NULL",
        "meta JSONB,",
        "parents BIGINT[],",
    ):
        assert part in ddl, ddl
    companions = {
        t.name: str(CreateTable(t).compile(dialect=_PG)) for t in table.metadata.sorted_tables
    }
    assert "args JSONB DEFAULT '{}'::jsonb NOT NULL" in companions["jobs_schedules"]
    assert "queues TEXT[] NOT NULL" in companions["jobs_workers"]
    assert "rate_log TIMESTAMP WITH TIME ZONE[]" in companions["jobs_queues"]
    assert "log TIMESTAMP WITH TIME ZONE[] NOT NULL" in companions["jobs_key_starts"]


# -- the README's Flask-SQLAlchemy recipe -----------------------------------------------------


class AppSession(EnqueueMixin, FlaskSession):
    """Flask-SQLAlchemy's session with ``enqueue`` (as in examples/flask_app)."""


@dataclass
class FlaskApp:
    app: Flask
    db: Any
    jobs: Jobs
    send_receipt: Any
    Order: Any
    Job: Any

    def checkout(self, item: str) -> Any:
        """The code under test: an order and its receipt job, in db.session's transaction."""
        order = self.Order(item=item)
        self.db.session.add(order)
        self.db.session.flush()
        self.db.session().enqueue(self.send_receipt, order.id)
        return order


def flask_app(uri: str, schema: str | None = None) -> FlaskApp:
    """A Flask-SQLAlchemy app with the default ``db.Model`` (its metaclass-based base)."""
    db = SQLAlchemy(metadata=sa.MetaData(schema=schema), session_options={"class_": AppSession})

    class Job(JobMixin, db.Model):  # type: ignore[name-defined,misc]
        pass  # table "job", named by Flask-SQLAlchemy

    class Order(db.Model):  # type: ignore[name-defined,misc]
        id: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
        item: Mapped[str] = mapped_column(sa.Text)
        receipt_sent: Mapped[bool] = mapped_column(sa.Boolean, default=False)

    registry = Jobs(Job)

    @registry.task(queue="receipts", transactional=True)
    def send_receipt(session: Session, order_id: int) -> None:
        order = session.get(Order, order_id)
        assert order is not None
        order.receipt_sent = True

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = uri
    db.init_app(app)
    return FlaskApp(app, db, registry, send_receipt, Order, Job)


@pytest.fixture
def pg_flask(database_url: str, engine: sa.Engine) -> Iterator[FlaskApp]:
    schema = f"flask_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    made = flask_app(database_url, schema)
    with made.app.app_context():
        made.db.create_all()
    yield made
    with made.app.app_context():
        made.db.engine.dispose()
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


def test_the_flask_sqlalchemy_recipe_runs_jobs_in_the_test_transaction(pg_flask: FlaskApp) -> None:
    web, db = pg_flask, pg_flask.db
    with web.app.app_context():
        order = web.checkout("book")
        assert_enqueued(db.session(), web.send_receipt, order_id=order.id)
        summary = run_queued_jobs(db.session(), web.jobs)
        assert summary.succeeded == 1, summary
        assert db.session.get(web.Order, order.id).receipt_sent
        db.session.rollback()  # the test leaves nothing behind
    with web.app.app_context():
        assert db.session.scalar(sa.select(sa.func.count()).select_from(web.Job)) == 0
        assert db.session.scalar(sa.select(sa.func.count()).select_from(web.Order)) == 0


def test_the_flask_sqlalchemy_recipe_on_sqlite_asserts_and_says_what_needs_postgresql() -> None:
    web = flask_app("sqlite://")
    db = web.db
    with web.app.app_context():
        db.create_all()  # "can't render element of type JSONB" before
        order = web.checkout("book")
        assert_enqueued(db.session(), web.send_receipt, order_id=order.id)
        with pytest.raises(RuntimeError, match="needs PostgreSQL; this database is sqlite"):
            run_queued_jobs(db.session(), web.jobs)
        db.session.rollback()
        db.drop_all()


def test_a_sessionmaker_on_sqlite_too() -> None:
    """The same through a plain ``sessionmaker(class_=JobSession)``, as most apps make it."""
    engine = sa.create_engine("sqlite://")
    Base.metadata.create_all(engine)
    make = sessionmaker(engine, class_=JobSession, jobs=jobs)
    with make.begin() as session:
        session.enqueue("tests.test_app_tests.send_welcome", email="a@example.com")
    with make() as session:
        assert_enqueued(session, "tests.test_app_tests.send_welcome", email="a@example.com")
    engine.dispose()
