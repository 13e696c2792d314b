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
from typing import Any, NamedTuple

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, JobSession, admin
from sqla_jobs._tasks import derive_unique_key
from sqla_jobs.periodic import add_schedule, enqueue_due, periodic_key

from . import app
from .helpers import count, rows

UTC = timezone.utc


class Point(NamedTuple):
    x: int
    y: int


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
    # numbers past their column: max_attempts is an int (the unique job was INSERTed at
    # once, and its DataError aborted the caller's transaction), keep_result an interval
    # added to now()
    (
        "max-attempts-int",
        lambda s, t: s.enqueue(t, max_attempts=2**31),
        r"max_attempts .*<= 2147483647",
    ),
    (
        "max-attempts-unique",
        lambda s, t: s.enqueue(t, 1, max_attempts=2**31, unique=True),
        "max_attempts",
    ),
    ("max-attempts-many", lambda s, t: s.enqueue_many(t, [{}], max_attempts=2**40), "max_attempts"),
    (
        "max-attempts-options",
        lambda s, t: s.enqueue(t.with_options(max_attempts=2**31), 1),
        "max_attempts",
    ),
    (
        "keep-result-huge",
        lambda s, t: s.enqueue(t, keep_result=1e300),
        r"keep_result .*100 years",
    ),
    ("keep-result-max", lambda s, t: s.enqueue(t, keep_result=timedelta.max), "keep_result"),
    ("keep-result-nan", lambda s, t: s.enqueue(t, keep_result=float("nan")), "keep_result"),
    # values that would come back changed: floats as ints, -0.0 as 0.0, tuples as lists
    ("float-1e16", lambda s, t: s.enqueue(t, 1e16), r"'payload' is the float 1e\+16, .* as an int"),
    ("float-1e308", lambda s, t: s.enqueue(t, [1.5, 1e308]), r"\(at payload\[1\]\) is the float"),
    ("float-negative", lambda s, t: s.enqueue(t, {"x": -2.5e20}), r"payload\['x'\]"),
    ("negative-zero", lambda s, t: s.enqueue(t, -0.0), r"is -0.0, .* 0.0"),
    ("negative-zero-many", lambda s, t: s.enqueue_many(t, [{"payload": [-0.0]}]), "-0.0"),
    ("float-many", lambda s, t: s.enqueue_many(t, [{"payload": 1}, {"payload": 3e17}]), "float"),
    ("tuple", lambda s, t: s.enqueue(t, (1, 2)), r"'payload' is a tuple, .* get a list"),
    ("tuple-nested", lambda s, t: s.enqueue(t, {"a": [(1,)]}), r"\(at payload\['a'\]\[0\]\)"),
    ("tuple-kwargs", lambda s, t: s.enqueue(t, extra=("x",)), r"argument 'extra'.*tuple"),
    ("tuple-many", lambda s, t: s.enqueue_many(t, [{"payload": ()}]), "tuple"),
    ("namedtuple", lambda s, t: s.enqueue(t, Point(1, 2)), r"is a Point, which JSON stores"),
    # nesting past what Python's json takes back (from the flush, and in the worker)
    ("nested-501", lambda s, t: s.enqueue(t, _nested(501)), r"nested more than 500 levels"),
    ("nested-970", lambda s, t: s.enqueue(t, _nested(970)), "nested"),
    ("nested-2000", lambda s, t: s.enqueue(t, _nested(2000)), r"nested more than 500 levels"),
    ("nested-unique", lambda s, t: s.enqueue(t, _nested(970), unique=True), "nested"),
    ("nested-many", lambda s, t: s.enqueue_many(t, [{"payload": _nested(700)}]), "nested"),
    ("nested-meta", lambda s, t: s.enqueue(t, meta={"k": _nested(700)}), "meta.*nested"),
]


def _nested(depth: int) -> Any:
    """A value that makes arguments ``depth`` levels deep (lists and dicts in turn)."""
    value: Any = 1
    for i in range(depth - 1):
        value = [value] if i % 2 else {"k": value}
    return value


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
        "[1e+16, -0.0]",  # what a float that changes looks like in JSON, inside a string
        [1e15, 9007199254740993.0, 123.0, -1.5e-300, 5e-324, 0.0, -1.0],  # floats kept as floats
        [[["lists", "of"], "lists"], {"k": [1, 2.5, None, True]}],
        10**4000,  # a long int, within what Python writes and numeric holds
    ]
    with Session.begin() as session:
        for payload in payloads:
            session.enqueue(store, payload)
        session.enqueue_many(store, [{"payload": p} for p in payloads])
    stored = [r.args["payload"] for r in rows(db)]
    assert stored == payloads + payloads
    assert [type(p) for p in stored[7][:3]] == [float, float, float]


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
        # The first row's key is held by ``first``: skipped, and not counted (the rows are
        # written at the call, so the count is of the rows inserted).
        added = session.enqueue_many(store, [{"payload": big}, {"payload": [1]}], unique=True)
        assert added == 1
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


def test_a_star_args_parameter_takes_its_own_tuple(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """The tuple of ``*items`` is the call's, not a value: it is stored as a list and the
    handler gets its positional arguments back. A tuple among them is refused."""

    @jobs.task(name="spread")
    def spread(first: int, *items: Any) -> None: ...

    with Session.begin() as session:
        session.enqueue(spread, 1, 2, [3])
        with pytest.raises(EnqueueError, match=r"argument 'items' \(at items\[0\]\) is a tuple"):
            session.enqueue(spread, 1, (2,))
    [row] = rows(db)
    assert spread.call_args(row.args) == ((1, 2, [3]), {})


def test_the_deepest_arguments_allowed_are_stored_and_read_back_as_given(
    Session: Any, db: sa.Engine, store: Any, jobs: Jobs
) -> None:
    """At the nesting limit, from a caller already deep in its stack: the check encodes
    at the call, the flush (ORM or INSERT) again deeper, and both succeed."""
    from sqla_jobs._storable import JSON_MAX_DEPTH

    value = _nested(JSON_MAX_DEPTH)

    def deep(frames: int) -> None:
        if frames:
            return deep(frames - 1)
        with Session.begin() as session:
            session.enqueue(store, value)
            session.enqueue(store, value, unique=True)
            session.enqueue_many(store, [{"payload": value}] * 3)
        with db.begin() as conn:
            jobs.enqueue(conn, store, value)
        return None

    deep(200)
    assert [r.args["payload"] for r in rows(db)] == [value] * 6


def test_an_int_no_worker_reads_back_is_refused_once_python_writes_it(
    Session: Any, db: sa.Engine, store: Any
) -> None:
    """Python writes no int of more than 4,300 digits; once a program lifts that limit
    (``sys.set_int_max_str_digits(0)``), an int past PostgreSQL's numeric (131,072 digits)
    failed at the flush, and one past 4,300 digits made a row no worker (with the default
    limit) could read back: both are refused at the call, the session usable."""
    import sys

    if not hasattr(sys, "set_int_max_str_digits"):
        pytest.skip("this Python has no int digits limit to lift")
    huge = 10**131_072
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with Session() as session:
            session.add(app.Link(code="kept", url="u"))
            for call in (
                lambda: session.enqueue(store, huge),
                lambda: session.enqueue(store, 10**4300),
                lambda: session.enqueue(store, {"n": [huge]}),
                lambda: session.enqueue_many(store, [{"payload": 1}, {"payload": -huge}]),
            ):
                with pytest.raises(EnqueueError, match=r"more than 4,300 digits"):
                    call()
            session.enqueue(store, 10**4300 - 1)  # 4,300 nines: a worker reads it back
            session.commit()
    finally:
        sys.set_int_max_str_digits(before)
    assert [r.code for r in rows(db, app.Link)] == ["kept"]
    assert count(db) == 1


def test_arguments_past_what_jsonb_holds_are_refused(
    Session: Any, db: sa.Engine, store: Any
) -> None:
    """An array of more than 2**24 elements (PostgreSQL: "invalid memory alloc request
    size"), of more than 256 MB, a string of more than 256 MB: checked only for JSON text
    past 32 MiB, which nothing shorter can reach."""
    from sqla_jobs import _storable as limits

    assert limits.jsonb_problem([0] * limits.JSONB_MAX_ELEMENTS) is None
    assert "elements" in (limits.jsonb_problem([0] * (limits.JSONB_MAX_ELEMENTS + 1)) or "")
    assert "contents" in (limits.jsonb_problem([["x" * 1000] * 100_000] * 3) or "")
    with Session() as session:
        session.add(app.Link(code="kept", url="u"))
        with pytest.raises(EnqueueError, match=r"argument 'payload' holds an array of 16,777,217"):
            session.enqueue(store, [0] * (limits.JSONB_MAX_ELEMENTS + 1))
        session.commit()
    assert [r.code for r in rows(db, app.Link)] == ["kept"]
    assert count(db) == 0


def test_durations_past_a_timestamp_are_refused_at_declaration(jobs: Jobs) -> None:
    with pytest.raises(ValueError, match=r"keep_dead must be a timedelta from 0 to 100 years"):
        Jobs(app.Job, keep_dead=timedelta.max)
    with pytest.raises(ValueError, match="keep_done"):
        Jobs(app.Job, keep_done=timedelta(days=-1))
    with pytest.raises(ValueError, match="keep_result"):
        jobs.task(name="kept_forever", keep_result=timedelta.max)(lambda: None)
    with pytest.raises(EnqueueError, match="max_attempts"):
        jobs.task(name="retried_forever", max_attempts=2**31)(lambda: None)
    with pytest.raises(EnqueueError, match="max_attempts"):
        Jobs(app.Job, max_attempts=2**31)


# -- a database that is not UTF-8 -------------------------------------------------------


@pytest.fixture
def latin1(database_url: str) -> Any:
    """An engine on a LATIN1 database of the test server, with the test app's tables."""
    import os

    from sqla_jobs import create_engine

    name = f"sqla_jobs_latin1_{os.getpid()}"
    server = create_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
            conn.exec_driver_sql(
                f"CREATE DATABASE \"{name}\" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' "
                "TEMPLATE template0"
            )
    except sa.exc.DBAPIError as exc:
        server.dispose()
        pytest.skip(f"cannot create a LATIN1 database here: {exc.orig}")
    url = sa.make_url(database_url).set(database=name)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{app.SCHEMA}"'))
        app.Base.metadata.create_all(conn)
    yield engine
    engine.dispose()
    with server.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
    server.dispose()


def test_a_latin1_database_refuses_at_enqueue_what_it_cannot_store(
    latin1: sa.Engine, jobs: Jobs
) -> None:
    """LATIN1 is a legal encoding; "€" and emoji are not in it, and failed at the flush
    or COMMIT (the caller's transaction lost) through every entry point. Over a
    connection whose client encoding is LATIN1 too (the default), psycopg cannot read
    JSON that holds any non-ASCII text back (it reads JSON as UTF-8): refused as well."""
    from sqla_jobs import create_engine

    @jobs.task(queue="latin", name="latin.store")
    def store(payload: Any = None) -> None: ...

    euro = r"holds '€' \(U\+20AC\), which the database's encoding LATIN1 cannot store"
    client = r"holds 'é' \(U\+00E9\), which JSON cannot carry over a connection whose client "
    client += r"encoding is LATIN1 .*connect with client_encoding=utf8"
    refused: list[tuple[str, Any, str]] = [
        ("enqueue", lambda s: s.enqueue(store, "5 €"), rf"argument 'payload' {euro}"),
        ("nested", lambda s: s.enqueue(store, {"a": ["x", "€"]}), r"\(at payload\['a'\]\[1\]\)"),
        ("key", lambda s: s.enqueue(store, {"€": 1}), r"dict key '€'"),
        ("emoji", lambda s: s.enqueue(store, "😀"), r"U\+1F600"),
        ("unique", lambda s: s.enqueue(store, "€", unique=True), euro),
        ("queue", lambda s: s.enqueue(store, 1, queue="€"), rf"queue '€' {euro}"),
        ("meta", lambda s: s.enqueue(store, 1, meta={"tag": "€"}), r"meta \(at meta\['tag'\]\)"),
        ("many", lambda s: s.enqueue_many(store, [{"payload": "€"}]), euro),
        (
            "many-copy",  # 1,200 rows: written at the call, by COPY; the bad ones in block 5
            lambda s: s.enqueue_many(store, [{"payload": "é"}] * 1_000 + [{"payload": "€"}] * 200),
            euro,
        ),
        ("core", lambda s: jobs.enqueue(s.connection(), store, "€"), euro),
        (
            "core-many",
            lambda s: jobs.enqueue_many(
                s.connection(), store, [{"payload": "é"}] * 599 + [{"payload": "€"}]
            ),
            euro,
        ),
    ]
    utf8 = create_engine(latin1.url, connect_args={"client_encoding": "utf8"})
    Session = sa.orm.sessionmaker(utf8, class_=JobSession, jobs=jobs)
    for label, call, message in refused:
        with Session() as session:
            session.add(app.Link(code=label, url="u"))
            with pytest.raises(EnqueueError, match=message):
                call(session)
            session.commit()
    # What LATIN1 holds is stored as given, by every path.
    with Session.begin() as session:
        session.enqueue(store, "é à ß ÿ")
        session.enqueue(store, {"clé": "é"}, unique=True)
        session.enqueue_many(store, [{"payload": "é"}] * 1_000)
        jobs.enqueue(session.connection(), store, "é", queue="file d'été")
    with utf8.connect() as conn:
        links = conn.execute(sa.select(app.Link.code)).scalars().all()
        payloads = conn.execute(sa.select(app.Job.args["payload"])).scalars().all()
        queues = conn.execute(sa.select(app.Job.queue).distinct()).scalars().all()
    assert sorted(links) == sorted(label for label, _, _ in refused)
    expected = ["é à ß ÿ", {"clé": "é"}, "é", *["é"] * 1_000]
    assert sorted(payloads, key=str) == sorted(expected, key=str)
    assert sorted(queues) == ["file d'été", "latin"]
    utf8.dispose()
    # A LATIN1 connection: text columns take LATIN1, JSON only ASCII.
    Latin = sa.orm.sessionmaker(latin1, class_=JobSession, jobs=jobs)
    with Latin() as session:
        session.add(app.Link(code="latin", url="u"))
        for call in (
            lambda: session.enqueue(store, "é"),
            lambda: session.enqueue_many(store, [{"payload": "é"}] * 300),
            lambda: jobs.enqueue(session.connection(), store, {"k": ["é"]}),
        ):
            with pytest.raises(EnqueueError, match=client):
                call()
        with pytest.raises(EnqueueError, match=rf"queue '€' {euro}"):
            session.enqueue(store, 1, queue="€")
        session.enqueue(store, "plain", queue="été")
        session.commit()
    with latin1.connect() as conn:
        assert (
            conn.execute(
                sa.select(app.Job.queue).where(app.Job.args["payload"].astext == "plain")
            ).scalar_one()
            == "été"
        )


def test_ids_limits_and_filters_past_the_columns_are_refused_before_the_database(
    db: sa.Engine, jobs: Jobs, Session: Any
) -> None:
    """Ids past ``bigint``, limits past it, a meta filter JSON cannot hold, windows past a
    timestamp: each is refused by name, before a statement is sent. (PostgreSQL refused
    them, aborting the transaction the caller passed in with its own work.)"""

    @jobs.task(queue="q")
    def work() -> None:
        pass

    big = 2**63
    with db.connect() as conn:
        for call, name in [
            (lambda: admin.get_job(conn, jobs, big), "job ids"),
            (lambda: admin.list_jobs(conn, jobs, ids=[big]), "job ids"),
            (lambda: admin.retry_jobs(conn, jobs, ids=[big]), "job ids"),
            (lambda: admin.cancel_jobs(conn, jobs, ids=[-1]), "job ids"),
            (lambda: admin.purge_jobs(conn, jobs, ids=[0]), "job ids"),
            (lambda: admin.browse_jobs(conn, jobs, before_id=big), "before_id"),
            (lambda: admin.list_jobs(conn, jobs, limit=big), "limit"),
            (lambda: admin.list_jobs(conn, jobs, meta={"f": float("nan")}), "meta filter"),
            (lambda: admin.throughput(conn, jobs, minutes=10**10), "minutes"),
            (lambda: admin.queue_states(conn, jobs, window=float("nan")), "window"),
            (lambda: admin.queue_states(conn, jobs, window=1e300), "window"),
            (lambda: jobs.result(db, big, timeout=1), "job_id"),
        ]:
            with pytest.raises(ValueError, match=name):
                call()
            assert not conn.in_transaction() or conn.get_transaction().is_active
    with Session() as session:
        with pytest.raises(ValueError, match="limit must be an integer from 1"):
            session.claim("q", limit=big)
        with pytest.raises(EnqueueError, match="after=: job ids are from 1 to"):
            session.enqueue(work.with_options(after=[big]))
        session.rollback()
