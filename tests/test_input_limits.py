"""Input that PostgreSQL would refuse only at flush or COMMIT is refused inside enqueue.

Each refusal is an ``EnqueueError`` (or a ``ValueError`` at declaration) that names the
argument or option, raised before anything reaches the database: the caller's own rows in
the same transaction still commit, and no job does.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, JobSession, admin
from sqla_jobs.periodic import add_schedule, enqueue_due, periodic_key
from sqla_jobs.tasks import derive_unique_key

from . import app
from .helpers import count, rows

UTC = timezone.utc


@pytest.fixture
def store(jobs: Jobs) -> Any:
    @jobs.task(queue="store", name="store")
    def store(payload: Any = None, **extra: Any) -> None:
        pass

    return store


# (id, call(session, task), message): every call must raise EnqueueError matching message.
REFUSED: list[tuple[str, Any, str]] = [
    # NUL characters, as values and as keys, at any depth
    ("nul-value", lambda s, t: s.enqueue(t, "a\x00b"), r"argument 'payload'.*NUL"),
    ("nul-in-list", lambda s, t: s.enqueue(t, ["ok", "\x00"]), r"'payload'.*payload\[1\].*NUL"),
    (
        "nul-nested",
        lambda s, t: s.enqueue(t, {"a": [{"b": "x\x00"}]}),
        r"argument 'payload' \(at payload\['a'\]\[0\]\['b'\]\).*NUL",
    ),
    ("nul-key", lambda s, t: s.enqueue(t, {"k\x00": 1}), r"argument 'payload'.*key.*NUL"),
    ("nul-kwargs-key", lambda s, t: s.enqueue(t, **{"x\x00": 1}), r"argument 'extra'.*NUL"),
    (
        "nul-many",
        lambda s, t: s.enqueue_many(t, [{"payload": "ok"}, {"payload": {"x": ["\x00"]}}]),
        r"argument 'payload'.*NUL",
    ),
    # lone surrogates: not valid Unicode text (and not storable as UTF-8)
    ("surrogate", lambda s, t: s.enqueue(t, "\ud800"), r"argument 'payload'.*U\+D800"),
    (
        "surrogate-pair-as-two",
        lambda s, t: s.enqueue(t, ["\ud83d\ude00"]),
        r"argument 'payload'.*U\+D83D",
    ),
    ("surrogate-key", lambda s, t: s.enqueue(t, {"\udc00": 1}), r"'payload'.*key.*U\+DC00"),
    (
        "surrogate-many",
        lambda s, t: s.enqueue_many(t, [{"payload": {"k": "\udfff"}}]),
        r"argument 'payload'.*U\+DFFF",
    ),
    # dict keys JSON would silently turn into strings
    (
        "int-key",
        lambda s, t: s.enqueue(t, {1: "a"}),
        r"argument 'payload' has the dict key 1, which is not a string: .* '1'",
    ),
    (
        "nested-none-key",
        lambda s, t: s.enqueue(t, {"a": [{None: 1}]}),
        r"argument 'payload' \(at payload\['a'\]\[0\]\).*key None",
    ),
    ("bool-key", lambda s, t: s.enqueue(t, extra={True: 1}), r"argument 'extra'.*key True"),
    (
        "float-key-many",
        lambda s, t: s.enqueue_many(t, [{"payload": {1.5: "x"}}]),
        r"argument 'payload'.*key 1.5",
    ),
    # queue names: 128 bytes of UTF-8 at most, no NUL
    ("queue-long", lambda s, t: s.enqueue(t, queue="q" * 129), r"queue .*129 bytes.*at most 128"),
    ("queue-long-utf8", lambda s, t: s.enqueue(t, queue="é" * 65), r"queue .*130 bytes"),
    ("queue-nul", lambda s, t: s.enqueue(t, queue="a\x00b"), r"queue .*NUL"),
    ("queue-surrogate", lambda s, t: s.enqueue(t, queue="a\ud800"), r"queue .*U\+D800"),
    (
        "queue-long-many",
        lambda s, t: s.enqueue_many(t, [{"payload": 1}], queue="q" * 200),
        r"queue .*200 bytes",
    ),
    ("queue-nul-many", lambda s, t: s.enqueue_many(t, [{}], queue="\x00"), r"queue .*NUL"),
    # unique keys given by the caller: 1,024 bytes of UTF-8 at most, no NUL
    (
        "unique-key-long",
        lambda s, t: s.enqueue(t, unique_key="k" * 1025),
        r"unique_key .*1025 bytes.*at most 1024",
    ),
    ("unique-key-long-utf8", lambda s, t: s.enqueue(t, unique_key="é" * 513), r"unique_key"),
    ("unique-key-nul", lambda s, t: s.enqueue(t, unique_key="k\x00"), r"unique_key .*NUL"),
    # times PostgreSQL or datetime cannot hold
    ("delay-huge", lambda s, t: s.enqueue(t, delay=1e12), r"delay"),
    ("delay-inf", lambda s, t: s.enqueue(t, delay=float("inf")), r"delay"),
    ("delay-timedelta-max", lambda s, t: s.enqueue(t, delay=timedelta.max), r"delay"),
    ("delay-huge-many", lambda s, t: s.enqueue_many(t, [{}], delay=1e15), r"delay"),
    ("delay-inf-many", lambda s, t: s.enqueue_many(t, [{}], delay=float("inf")), r"delay"),
    ("run-at-max", lambda s, t: s.enqueue(t, run_at=datetime.max.replace(tzinfo=UTC)), "run_at"),
    (
        "run-at-past-year-9999-in-utc",
        lambda s, t: s.enqueue(
            t, run_at=datetime(9999, 12, 31, 20, tzinfo=timezone(timedelta(hours=-8)))
        ),
        "run_at",
    ),
    ("run-at-min", lambda s, t: s.enqueue(t, run_at=datetime.min.replace(tzinfo=UTC)), "run_at"),
    (
        "run-at-max-many",
        lambda s, t: s.enqueue_many(t, [{}], run_at=datetime.max.replace(tzinfo=UTC)),
        "run_at",
    ),
]


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_inside_enqueue_and_the_session_stays_usable(
    Session: Any, db: sa.Engine, store: Any, call: Any, message: str
) -> None:
    with Session() as session:
        session.add(app.Link(code="kept", url="u"))
        with pytest.raises(EnqueueError, match=message):
            call(session, store)
        session.commit()
    assert [r.code for r in rows(db, app.Link)] == ["kept"]
    assert count(db) == 0


def test_async_session_refuses_the_same(
    database_url: str, db: sa.Engine, jobs: Jobs, store: Any
) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> None:
        engine = create_async_engine(database_url)
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make() as session:
                session.add(app.Link(code="kept", url="u"))
                with pytest.raises(EnqueueError, match="NUL"):
                    session.enqueue(store, {"a": "\x00"})
                with pytest.raises(EnqueueError, match="NUL"):
                    session.enqueue_many(store, [{"payload": ["\x00"]}])
                with pytest.raises(EnqueueError, match="unique_key"):
                    await session.enqueue_unique(store, unique_key="k" * 2000)
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert [r.code for r in rows(db, app.Link)] == ["kept"]
    assert count(db) == 0


def test_what_looks_suspicious_but_is_fine_is_stored_as_given(
    Session: Any, db: sa.Engine, store: Any
) -> None:
    """Only a real problem is refused: the quick checks' false alarms are confirmed away."""
    payloads: list[Any] = [
        "\\u0000",  # a backslash and 'u0000', not a NUL
        {"nested": {"keys": ["fine"]}},
        "{not a dict}",
        "é ü 😀 \u2028",  # non-ASCII, no surrogate
        ["\x01\x1f tab\t newline\n"],  # control characters other than NUL are stored fine
        {"a\\u0000": "\\u0000"},
    ]
    with Session.begin() as session:
        for payload in payloads:
            session.enqueue(store, payload)
        session.enqueue_many(store, [{"payload": p} for p in payloads])
    stored = [r.args["payload"] for r in rows(db)]
    assert stored == payloads + payloads


def test_limits_are_inclusive(Session: Any, db: sa.Engine, store: Any) -> None:
    far = datetime(9999, 12, 1, tzinfo=UTC)
    with Session.begin() as session:
        session.enqueue(store, 1, queue="q" * 128)
        session.enqueue(store, 2, queue="é" * 64)
        session.enqueue(store, 3, unique_key="k" * 1024)
        session.enqueue(store, 4, run_at=far)
        session.enqueue(store, 5, delay=timedelta(days=365 * 1000))
    r = {x.args["payload"]: x for x in rows(db)}  # the unique job was inserted first
    assert [len(r[n].queue.encode()) for n in (1, 2)] == [128, 128]
    assert len(r[3].unique_key) == 1024
    assert r[4].run_at == far and r[4].status == "scheduled"
    assert r[5].run_at.year > 3000


def test_unique_true_works_for_arguments_of_any_size(
    Session: Any, db: sa.Engine, store: Any
) -> None:
    big = {"text": "x" * 100_000, "items": list(range(5_000))}
    with Session.begin() as session:
        first = session.enqueue(store, big, unique=True)
        again = session.enqueue(store, payload=big, unique=True)
        other = session.enqueue(store, {**big, "text": "y"}, unique=True)
        assert first is again and other is not first
        added = session.enqueue_many(store, [{"payload": big}, {"payload": [1]}], unique=True)
        assert added == 2
    keys = sorted(r.unique_key for r in rows(db))
    assert len(keys) == 3  # the enqueue_many copy of big was a live duplicate
    assert all(k.startswith("store:") and len(k) == len("store:") + 64 for k in keys)


def test_the_derived_unique_key_is_a_digest_of_task_and_canonical_arguments() -> None:
    a = derive_unique_key("t", {"x": 1, "y": [1, 2]})
    assert a == derive_unique_key("t", {"y": [1, 2], "x": 1})  # keyword order is irrelevant
    assert a != derive_unique_key("u", {"x": 1, "y": [1, 2]})
    assert a != derive_unique_key("t", {"x": 1, "y": [2, 1]})
    canonical = json.dumps(["t", {"x": 1, "y": [1, 2]}], sort_keys=True, separators=(",", ":"))
    assert a == "t:" + hashlib.sha256(canonical.encode()).hexdigest()
    # A task name of any length still makes a key the index can hold.
    long = derive_unique_key("n" * 5000, {})
    assert len(long.encode()) <= 300 and long != derive_unique_key("n" * 5001, {})


# -- declarations -----------------------------------------------------------------------


def test_task_and_registry_declarations_are_checked(jobs: Jobs) -> None:
    with pytest.raises(ValueError, match=r"task name .*NUL"):
        jobs.task(name="a\x00b")(lambda: None)
    with pytest.raises(ValueError, match=r"task name .*U\+D800"):
        jobs.task(name="a\ud800")(lambda: None)
    with pytest.raises(ValueError, match=r"queue .*129 bytes"):
        jobs.task(name="long_queue", queue="q" * 129)(lambda: None)
    with pytest.raises(ValueError, match=r"queue .*NUL"):
        jobs.task(name="nul_queue", queue="\x00")(lambda: None)
    with pytest.raises(ValueError, match=r"queue .*129 bytes"):
        Jobs(app.Job, default_queue="q" * 129)
    with pytest.raises(ValueError, match=r"queue .*NUL"):
        Jobs(app.Job, default_queue="a\x00")
    assert not jobs.tasks


def test_periodic_declarations_are_checked(jobs: Jobs) -> None:
    @jobs.task(queue="q", name="report")
    def report(payload: Any = None) -> None:
        pass

    with pytest.raises(EnqueueError, match=r"argument 'payload'.*NUL"):
        jobs.periodic("* * * * *", name="a", args={"payload": {"x": "\x00"}})(report)
    with pytest.raises(EnqueueError, match=r"argument 'payload'.*key 1"):
        jobs.periodic("* * * * *", name="b", args={"payload": {1: "x"}})(report)
    with pytest.raises(EnqueueError, match=r"queue .*NUL"):
        jobs.periodic("* * * * *", name="c", queue="q\x00")(report)
    with pytest.raises(ValueError, match=r"schedule name .*201 bytes.*at most 200"):
        jobs.periodic("* * * * *", name="s" * 201)(report)
    with pytest.raises(ValueError, match=r"schedule name .*NUL"):
        jobs.periodic("* * * * *", name="s\x00")(report)

    @jobs.task(queue="q", name="t" * 201)
    def long_named() -> None:
        pass

    with pytest.raises(ValueError, match=r"schedule name .*pass name="):
        jobs.periodic("* * * * *")(long_named)
    assert not jobs.schedules
    jobs.periodic("* * * * *", name="s" * 200)(report)
    assert list(jobs.schedules) == ["s" * 200]


@pytest.mark.parametrize(
    ("name", "options", "error", "message"),
    [
        ("a" * 201, {}, ValueError, r"schedule name .*201 bytes"),
        ("é" * 101, {}, ValueError, r"schedule name .*202 bytes"),
        ("a\x00", {}, ValueError, r"schedule name .*NUL"),
        ("r", {"args": {"payload": "\x00"}}, EnqueueError, r"argument 'payload'.*NUL"),
        ("r", {"args": {"payload": ["\ud800"]}}, EnqueueError, r"argument 'payload'.*U\+D800"),
        ("r", {"args": {"payload": {2: 1}}}, EnqueueError, r"argument 'payload'.*key 2"),
        ("r", {"queue": "q" * 129}, EnqueueError, r"queue .*129 bytes"),
    ],
)
def test_add_schedule_refuses_before_writing(
    db: sa.Engine, jobs: Jobs, store: Any, name: str, options: Any, error: Any, message: str
) -> None:
    with JobSession(db, jobs=jobs) as session:
        session.add(app.Link(code="kept", url="u"))
        with pytest.raises(error, match=message):
            add_schedule(session, jobs, name, store, "0 8 * * *", **options)
        session.commit()
    assert [r.code for r in rows(db, app.Link)] == ["kept"]
    assert rows(db, jobs.queries.schedules_table) == []


def test_the_longest_schedule_name_makes_jobs(db: sa.Engine, jobs: Jobs, store: Any) -> None:
    name = "é" * 100  # 200 bytes
    with db.begin() as conn:
        add_schedule(conn, jobs, name, store, "* * * * *", args={"payload": 1})
        table = jobs.queries.schedules_table
        conn.execute(sa.update(table).values(next_run_at=sa.func.now() - timedelta(minutes=1)))
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    (job,) = rows(db)
    assert job.unique_key.startswith(f"periodic:{name}:")
    assert len(periodic_key(name, datetime.now(UTC)).encode()) < 300


def test_a_schedule_row_whose_key_would_not_fit_is_skipped(
    db: sa.Engine, jobs: Jobs, store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A row written around the API: logged and left, the other schedules still run.

    2,680 incompressible bytes fit the schedules table's primary key, but the periodic
    job's unique key (the name and the tick) would not fit the jobs table's unique index,
    which would fail the whole pass, every schedule's job with it.
    """
    table = jobs.queries.schedules_table
    due = datetime.now(UTC) - timedelta(minutes=1)
    long = secrets.token_hex(1340)
    with db.begin() as conn:
        conn.execute(
            sa.insert(table),
            [
                {"name": n, "task": store.name, "args": {}, "cron": "* * * * *", "next_run_at": due}
                for n in (long, "ok")
            ],
        )
    with caplog.at_level("ERROR", logger="sqla_jobs.periodic"), db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    assert [r.unique_key.split(":")[1] for r in rows(db)] == ["ok"]
    assert any("2680 bytes" in r.getMessage() for r in caplog.records)
    skipped = {r.name: r for r in rows(db, table)}[long]
    assert "2680 bytes" in skipped.last_error


def test_admin_queue_names_are_checked(db: sa.Engine, jobs: Jobs) -> None:
    with db.begin() as conn:
        for action in (admin.pause_queue, admin.resume_queue):
            with pytest.raises(ValueError, match=r"queue .*129 bytes"):
                action(conn, jobs, "q" * 129)
            with pytest.raises(ValueError, match=r"queue .*NUL"):
                action(conn, jobs, "a\x00")
        admin.pause_queue(conn, jobs, "q" * 128)
    with db.connect() as conn:
        assert admin.paused_queues(conn, jobs) == {"q" * 128}
