"""The fast path of big ``enqueue_many`` calls (``Task.bind_many``, ``sqla_jobs._bulk``):
rows of keywords with one key set are checked once against the signature, encoded in one
loop and written to COPY a block at a time with one escaping pass per block. What is
stored must be exactly what was given, whatever the characters, and what PostgreSQL
cannot store must still be refused before anything is sent, through the session and the
connection, sync and async.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus

from sqla_jobs import EnqueueError, Jobs
from sqla_jobs._bulk import COPY_BLOCK_ROWS, COPY_MIN_ROWS, GC_PAUSE_MIN_ROWS, gc_paused
from sqla_jobs.session import CHECK_AS_WRITTEN_MIN_ROWS, pending_jobs

from . import app, test_bulk_copy
from .helpers import count, rows

# That module's fixtures: a task taking (to, subject="hi", extra=None), and the log of the
# statements (INSERT or COPY) that wrote into the jobs table.
send = test_bulk_copy.send
statements = test_bulk_copy.statements
TRICKY = test_bulk_copy.TRICKY

#: Past both thresholds: a COPY, with the collector paused.
N = max(COPY_MIN_ROWS, GC_PAUSE_MIN_ROWS) + 37

#: What COPY's text format escapes (backslash, tab, newline, carriage return), what
#: looks like its markers (``\N`` for NULL, ``\.`` for the end), what looks like the
#: checks' own signals (the text ``\u0000``, a ``{`` in a string), and text that is not
#: ASCII; each one alone and at the ends of a string.
STRINGS = [
    *TRICKY,
    "\\N",
    "\\\\N",
    "N\\",
    "\\",
    "\\\n",
    "\r",
    "\t\t\t",
    "\\u0000 is six characters here, not a NUL",
    "\\ud800 too",
    '{"nested": {}}',
    "line\u2028separator\u2029and\x85next line",
    "\x01\x1f\x7f control characters",
    "😀" * 20,
]


def keyword_rows(n: int, *, nested: bool) -> list[dict[str, Any]]:
    """Rows of keywords, all with the key set of the first (``to``, ``subject``,
    ``extra``): ``extra`` is a list, or (``nested``) a dict, which makes the check walk
    the rows whose text holds a second '{'."""
    out = []
    for i in range(n):
        s = STRINGS[i % len(STRINGS)]
        extra: Any = [s, i, 1.5, None, True, [s[::-1]]]
        if nested:
            extra = {s: extra, "k\t\\": {"n": i}}
        out.append({"to": f"{i}@example.com", "subject": s, "extra": extra})
    return out


def stored_args(db: sa.Engine) -> list[Any]:
    return [r.args for r in rows(db)]


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("shape", ["dicts", "task.args"])
def test_keyword_rows_are_stored_as_given_through_a_connection(
    db: sa.Engine,
    jobs: Jobs,
    send: Any,
    statements: Callable[[], list[str]],
    nested: bool,
    shape: str,
) -> None:
    sent = keyword_rows(N, nested=nested)
    given = sent if shape == "dicts" else [send.args(**kw) for kw in sent]
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, given) == N
    assert statements() == ["COPY"]
    assert stored_args(db) == sent


def test_a_small_call_of_keyword_rows_stays_one_insert(
    db: sa.Engine,
    jobs: Jobs,
    send: Any,
    statements: Callable[[], list[str]],
) -> None:
    """Below COPY's threshold the connection's rows, JSON text only, go to the INSERT."""
    sent = keyword_rows(COPY_MIN_ROWS - 1, nested=True)
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send.with_options(priority=3), sent, meta={"m": 1}) == (
            COPY_MIN_ROWS - 1
        )
    assert statements() == ["INSERT"]
    stored = rows(db)
    assert [r.args for r in stored] == sent
    assert {(r.priority, r.queue, r.status) for r in stored} == {(3, "mail", "ready")}
    assert all(r.meta == {"m": 1} for r in stored)


def test_keyword_rows_are_stored_as_given_through_a_session(
    Session: Any,
    db: sa.Engine,
    send: Any,
    statements: Callable[[], list[str]],
) -> None:
    flat, nested = keyword_rows(N, nested=False), keyword_rows(N + 1, nested=True)
    small = keyword_rows(COPY_MIN_ROWS, nested=True)
    with Session.begin() as session:
        session.enqueue_many(send, small)  # every call is written at the call
        session.enqueue_many(send, flat)  # a big list: checked as it is written
        log = sa.text(f"SELECT count(*) FROM {test_bulk_copy.LOG}")
        assert session.execute(log).scalar_one() == 2  # seen inside the transaction
        session.enqueue_many(send, (send.args(**kw) for kw in nested))  # an iterator
        session.enqueue_many(send, small)
    assert statements() == ["COPY", "COPY", "COPY", "COPY"]
    assert stored_args(db) == small + flat + nested + small


def test_keyword_rows_are_stored_as_given_async(
    db: sa.Engine,
    database_url: str,
    jobs: Jobs,
    send: Any,
    statements: Callable[[], list[str]],
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    flat, nested = keyword_rows(N, nested=False), keyword_rows(N, nested=True)

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            assert await session.enqueue_many(send, flat) == N
            await session.commit()
        async with engine.begin() as conn:
            assert await jobs.enqueue_many(conn, send, nested) == N
        await engine.dispose()

    asyncio.run(main())
    assert statements() == ["COPY", "COPY"]
    assert stored_args(db) == flat + nested


def test_very_large_arguments_are_stored_as_given(
    db: sa.Engine, jobs: Jobs, send: Any, Session: Any
) -> None:
    """Arguments of megabytes, full of what COPY escapes, in rows that span blocks."""
    big = "".join(STRINGS) * 2_000  # about 1 MB, backslashes, tabs and newlines throughout
    sent = [
        {"to": f"{i}@example.com", "subject": big if i % 97 == 0 else STRINGS[i % 7], "extra": i}
        for i in range(COPY_MIN_ROWS + 5)
    ]
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, sent) == len(sent)
    with Session.begin() as session:
        session.enqueue_many(send, sent)
    assert stored_args(db) == sent + sent


def _circular() -> Any:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


#: A value PostgreSQL or JSON cannot take, and the message that says so.
UNSTORABLE = [
    ("a\x00b", "NUL character"),
    ({"key\x00": 1}, "NUL character"),
    (["ok", "\ud800"], "surrogate code point U\\+D800"),
    ({"\udfff": 1}, "surrogate code point U\\+DFFF"),
    ({"n": {1: "x"}}, "dict key 1, which is not a string"),
    (float("nan"), "not JSON-serialisable"),
    (object(), "not JSON-serialisable"),
    (_circular(), "Circular reference detected"),
]


@pytest.mark.parametrize("bad, message", UNSTORABLE, ids=[m for _, m in UNSTORABLE])
def test_an_unstorable_value_in_a_late_row_is_refused_and_nothing_of_the_call_is_kept(
    db: sa.Engine,
    jobs: Jobs,
    send: Any,
    Session: Any,
    statements: Callable[[], list[str]],
    bad: Any,
    message: str,
) -> None:
    sent = keyword_rows(N, nested=False)
    sent[-2] = dict(sent[-2], extra=bad)
    with db.begin() as conn:
        with pytest.raises(EnqueueError, match=f"argument 'extra'.*{message}"):
            jobs.enqueue_many(conn, send, sent)
        # Nothing of the call is kept (its COPY's savepoint was rolled back, the log row
        # of the trigger with it), and the caller's transaction goes on.
        assert jobs.enqueue_many(conn, send, sent[:3]) == 3
    with Session.begin() as session:
        with pytest.raises(EnqueueError, match=message):
            session.enqueue_many(send, [send.args(**kw) for kw in sent])
        assert session.enqueue_many(send, sent[:2]) == 2
    assert statements() == ["INSERT", "INSERT"]
    assert count(db) == 5
    assert gc.isenabled()


#: Rows that give the check no reason to look closer (ASCII, no '{', no backslash-u):
#: only the bad value can make it walk them.
CLEAN = [t for t in STRINGS if t.isascii() and "{" not in t and "\\u" not in t]


@pytest.mark.parametrize("bad, message", UNSTORABLE[:5], ids=[m for _, m in UNSTORABLE[:5]])
@pytest.mark.parametrize("where", ["subject", "extra"])
def test_an_unstorable_value_among_clean_rows_is_refused(
    db: sa.Engine, jobs: Jobs, send: Any, bad: Any, message: str, where: str
) -> None:
    sent = [
        {"to": f"{i}@example.com", "subject": CLEAN[i % len(CLEAN)], "extra": [i, CLEAN[i % 3]]}
        for i in range(N)
    ]
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, sent) == N  # they pass as they are
        sent[N // 2] = dict(sent[N // 2], **{where: bad})
        with pytest.raises(EnqueueError, match=f"argument '{where}'.*{message}"):
            jobs.enqueue_many(conn, send, sent)
    assert count(db) == N


def test_unstorable_values_are_refused_async(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    sent = keyword_rows(N, nested=False)
    sent[-1] = dict(sent[-1], subject="\ud83d")  # half of an emoji

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            with pytest.raises(EnqueueError, match="surrogate code point U\\+D83D"):
                session.enqueue_many(send, sent)
            await session.commit()
        async with engine.begin() as conn:
            with pytest.raises(EnqueueError, match="NUL"):
                await jobs.enqueue_many(conn, send, [*sent[:-1], dict(sent[0], to="\x00")])
            assert await jobs.enqueue_many(conn, send, sent[:-1]) == N - 1
        await engine.dispose()

    asyncio.run(main())
    assert stored_args(db) == sent[:-1]


def test_rows_with_other_key_sets_or_mappings_are_checked_one_by_one(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """A row whose keys differ from the first's, a mapping that is not a dict, or
    positional arguments leave the fast path: each row is then bound to the signature
    as before, a good one stored as given and the first bad one refused."""
    sent: list[Any] = keyword_rows(N, nested=False)
    sent[5] = {"to": "no-subject@example.com"}  # a default left out: fine
    sent[6] = MappingProxyType({"to": "proxy@example.com", "subject": "\\N\t"})
    sent[7] = send.args("positional@example.com", "\\")
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, sent) == N
    expected = [dict(kw) for kw in sent[:7]]
    expected += [{"to": "positional@example.com", "subject": "\\"}, *sent[8:]]
    assert stored_args(db) == expected

    for bad, message in [
        ({"subject": "no to"}, "missing a required argument: 'to'"),
        ({"to": "x", "cc": "y"}, "unexpected keyword argument 'cc'"),
    ]:
        late = [*keyword_rows(N, nested=False), bad]
        with pytest.raises(EnqueueError, match=message), db.begin() as conn:
            jobs.enqueue_many(conn, send, late)
    assert count(db) == N


def test_the_collector_is_left_as_it_was(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    sent = keyword_rows(N, nested=False)
    assert gc.isenabled()
    with db.begin() as conn:
        jobs.enqueue_many(conn, send, sent)
        with pytest.raises(EnqueueError):
            jobs.enqueue_many(conn, send, [*sent, {"to": "\x00"}])
    assert gc.isenabled()
    gc.disable()
    try:
        with db.begin() as conn:
            jobs.enqueue_many(conn, send, sent)
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
    assert count(db) == 2 * N


def test_threads_share_one_pause_of_the_collector() -> None:
    """The collector comes back when the last thread leaves, not the first."""
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    big = range(GC_PAUSE_MIN_ROWS)

    def other() -> None:
        with gc_paused(big):
            entered.set()
            release.wait(timeout=30)
        left.set()

    thread = threading.Thread(target=other)
    assert gc.isenabled()
    thread.start()
    try:
        assert entered.wait(timeout=30)
        assert not gc.isenabled()
        with gc_paused(big):
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread is still inside
        with gc_paused(range(GC_PAUSE_MIN_ROWS - 1)):  # too small to pause
            assert not gc.isenabled()
    finally:
        release.set()
        thread.join(timeout=30)
    assert left.is_set()
    assert gc.isenabled()
    with gc_paused(range(GC_PAUSE_MIN_ROWS - 1)):
        assert gc.isenabled()
    with gc_paused(iter(big)):  # an iterator's length is unknown: paused
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_copy_rows_on_a_connection_share_their_savepoints_fate(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]], depth: int
) -> None:
    """COPY runs in the caller's transaction, on its connection: rows written inside a
    savepoint go with it when it rolls back, at any depth, and those of the savepoints
    around it stay."""
    batches = [[{"to": f"{level}-{i}"} for i in range(N)] for level in range(depth + 1)]
    with db.begin() as conn:
        jobs.enqueue_many(conn, send, batches[0])
        savepoints = []
        for level in range(1, depth + 1):  # each savepoint inside the one before
            savepoints.append(conn.begin_nested())
            jobs.enqueue_many(conn, send, batches[level])
        savepoints[-1].rollback()  # the innermost, with what it wrote
        for savepoint in reversed(savepoints[:-1]):
            savepoint.commit()
    # The log is written by a trigger in the same transaction: the rolled-back COPY's
    # entry went with it.
    assert statements() == ["COPY"] * depth
    kept = [row for batch in batches[:-1] for row in batch]
    assert sorted(a["to"] for a in stored_args(db)) == sorted(r["to"] for r in kept)


def test_a_bad_late_row_inside_a_savepoint_leaves_it_usable(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """An unstorable value in a late row of a COPY-sized call inside a savepoint is refused
    before anything is sent: the savepoint and the transaction go on, and commit."""
    bad = [{"to": f"a{i}"} for i in range(N)]
    bad[-1] = {"to": "nul\x00"}
    with db.begin() as conn, conn.begin_nested():
        with pytest.raises(EnqueueError):
            jobs.enqueue_many(conn, send, bad)
        jobs.enqueue_many(conn, send, [{"to": f"b{i}"} for i in range(N)])
    assert sorted(a["to"] for a in stored_args(db)) == sorted(f"b{i}" for i in range(N))


def test_a_copy_on_a_killed_backend_raises_and_the_engine_recovers(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """The server ends the connection under a COPY-sized call: the caller gets a
    ``DBAPIError``, nothing of the transaction is committed, and the engine's next
    connection works."""
    with pytest.raises(sa.exc.DBAPIError) as raised, db.begin() as conn:
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with db.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        jobs.enqueue_many(conn, send, [{"to": f"k{i}"} for i in range(N)])
    # The COPY's own error, the connection invalidated as SQLAlchemy does for its own
    # statements: the rollback on leaving the block let it go instead of failing again.
    assert str(raised.value.statement).startswith("COPY")
    assert raised.value.connection_invalidated
    assert count(db) == 0
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, [{"to": f"n{i}"} for i in range(N)]) == N
    assert count(db) == N


def test_copy_rows_on_an_async_connection_share_their_savepoints_fate(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    """The asyncio COPY (run through ``run_sync``) writes into the caller's savepoint too:
    a rolled-back one takes its rows, a released one keeps them."""
    from sqla_jobs import create_async_engine

    kept = [{"to": f"kept-{i}"} for i in range(N)]
    dropped = [{"to": f"dropped-{i}"} for i in range(N)]

    async def main() -> None:
        engine = create_async_engine(database_url)
        async with engine.begin() as conn:
            async with conn.begin_nested():
                await jobs.enqueue_many(conn, send, kept)
            savepoint = await conn.begin_nested()
            await jobs.enqueue_many(conn, send, dropped)
            await savepoint.rollback()
        await engine.dispose()

    asyncio.run(main())
    assert sorted(a["to"] for a in stored_args(db)) == sorted(r["to"] for r in kept)


# -- a bad row found while the COPY runs --------------------------------------------------
#
# On a connection, the rows after the first block are checked as the COPY sends them
# (sqla_jobs._bulk.CheckedLater). A bad one ends the COPY: the savepoint the COPY runs in
# must take back every block written before it, and leave the caller's transaction (or
# savepoint, or autocommit connection) exactly as a bad row found before the COPY would.

BLOCKS = 4
#: The first row of each block, the last of the first block (checked before the COPY
#: begins), and the very last row.
POSITIONS = [
    COPY_BLOCK_ROWS - 1,
    COPY_BLOCK_ROWS,
    2 * COPY_BLOCK_ROWS + 1,
    BLOCKS * COPY_BLOCK_ROWS - 1,
]
BAD_ROWS = [
    ({"to": "nul\x00"}, "NUL"),
    ({"to": object()}, "not JSON-serialisable"),
    ({"subject": "no to"}, "missing a required argument: 'to'"),
    ({"to": "x", "cc": "y"}, "unexpected keyword argument 'cc'"),
]


def good_rows(tag: str, n: int = BLOCKS * COPY_BLOCK_ROWS) -> list[dict[str, Any]]:
    return [{"to": f"{tag}{i}"} for i in range(n)]


def assert_no_copy_savepoint(conn: sa.Connection) -> None:
    """The COPY's own savepoint was released, not left behind inside the caller's."""
    probe = conn.begin_nested()
    with pytest.raises(sa.exc.DBAPIError, match=r"savepoint .* does not exist"):
        conn.exec_driver_sql("RELEASE SAVEPOINT sqla_jobs_copy")
    probe.rollback()


def in_transaction(conn: sa.Connection) -> bool:
    """The driver's own view: inside a transaction, and not a failed one."""
    status = conn.connection.driver_connection.info.transaction_status  # type: ignore[union-attr]
    return bool(status == TransactionStatus.INTRANS)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("bad, message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_a_bad_row_in_any_block_is_refused_and_the_transaction_goes_on(
    db: sa.Engine,
    jobs: Jobs,
    send: Any,
    statements: Callable[[], list[str]],
    position: int,
    bad: Any,
    message: str,
) -> None:
    sent = good_rows("bad-call-")
    sent[position] = bad
    with db.begin() as conn:
        before = jobs.enqueue_many(conn, send, good_rows("before-"))
        with pytest.raises(EnqueueError, match=message):
            jobs.enqueue_many(conn, send, sent)
        assert in_transaction(conn)
        assert_no_copy_savepoint(conn)
        after = jobs.enqueue_many(conn, send, good_rows("after-"))
    stored = [a["to"] for a in stored_args(db)]
    assert len(stored) == before + after
    assert not any(to.startswith("bad-call-") for to in stored)
    # One COPY for each good call; the failed one's log row went with its savepoint.
    assert statements() == ["COPY", "COPY"]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_bad_late_row_at_any_savepoint_depth_keeps_the_savepoints_intact(
    db: sa.Engine, jobs: Jobs, send: Any, depth: int
) -> None:
    """Inside savepoints nested ``depth`` deep: the refused call leaves no savepoint of
    its own behind, so the caller's innermost one still rolls back exactly what it
    wrote, and the others keep theirs."""
    sent = good_rows("bad-")
    sent[-1] = {"to": "nul\x00"}
    with db.begin() as conn:
        savepoints = []
        for level in range(depth):
            savepoints.append(conn.begin_nested())
            jobs.enqueue_many(conn, send, good_rows(f"level{level}-", COPY_BLOCK_ROWS + 1))
        with pytest.raises(EnqueueError, match="NUL"):
            jobs.enqueue_many(conn, send, sent)
        assert in_transaction(conn)
        jobs.enqueue_many(conn, send, good_rows("dropped-", 2 * COPY_BLOCK_ROWS + 1))
        savepoints[-1].rollback()  # takes level{depth-1}- and dropped-, nothing more
        for savepoint in reversed(savepoints[:-1]):
            savepoint.commit()
    kept = sorted(a["to"] for a in stored_args(db))
    expected = sorted(
        r["to"]
        for level in range(depth - 1)
        for r in good_rows(f"level{level}-", COPY_BLOCK_ROWS + 1)
    )
    assert kept == expected


def test_a_bad_late_row_on_an_autocommit_connection_keeps_nothing(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """Without a transaction the COPY is one: ended by the bad row, it leaves nothing."""
    sent = good_rows("bad-")
    sent[3 * COPY_BLOCK_ROWS] = {"to": object()}
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        with pytest.raises(EnqueueError, match="not JSON-serialisable"):
            jobs.enqueue_many(conn, send, sent)
        assert jobs.enqueue_many(conn, send, good_rows("good-")) == BLOCKS * COPY_BLOCK_ROWS
    assert sorted(a["to"] for a in stored_args(db)) == sorted(r["to"] for r in good_rows("good-"))


def test_a_bad_late_row_on_an_async_connection_is_refused_and_the_transaction_goes_on(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    from sqla_jobs import create_async_engine

    sent = good_rows("bad-")
    sent[-1] = {"subject": "no to"}

    async def main() -> None:
        engine = create_async_engine(database_url)
        async with engine.begin() as conn, conn.begin_nested():
            await jobs.enqueue_many(conn, send, good_rows("kept-"))
            with pytest.raises(EnqueueError, match="missing a required argument"):
                await jobs.enqueue_many(conn, send, sent)
            await jobs.enqueue_many(conn, send, good_rows("after-"))
        await engine.dispose()

    asyncio.run(main())
    assert sorted(a["to"] for a in stored_args(db)) == sorted(
        r["to"] for r in good_rows("kept-") + good_rows("after-")
    )


def test_a_server_error_in_a_late_block_fails_the_transaction_as_an_insert_would(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """Only a row refused by its check is taken back by the COPY's savepoint: an error of
    the server (here a CHECK constraint on the last block) is raised as SQLAlchemy's
    error and leaves the transaction failed, as the INSERT of a small call does."""
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"ALTER TABLE {test_bulk_copy.JOBS} "
                "ADD CONSTRAINT no_boom CHECK (args->>'to' <> 'boom')"
            )
        )
    try:
        sent = good_rows("r")
        sent[-1] = {"to": "boom"}
        with db.begin() as conn:
            with pytest.raises(sa.exc.IntegrityError, match="no_boom"):
                jobs.enqueue_many(conn, send, sent)
            assert not in_transaction(conn)
            with pytest.raises(sa.exc.InternalError, match="current transaction is aborted"):
                conn.execute(sa.text("SELECT 1"))
            conn.rollback()
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {test_bulk_copy.JOBS} DROP CONSTRAINT no_boom"))
    assert count(db) == 0


def test_a_sessions_calls_are_written_in_order_each_at_its_call(
    db: sa.Engine, jobs: Jobs, send: Any, Session: Any, statements: Callable[[], list[str]]
) -> None:
    """Each call is its own statement, written at the call, in the order of the calls: a
    COPY for a COPY-sized run of rows that share every column but the arguments, the
    bulk INSERT for rows of another kind (unique keys). (Until 0.2 the calls waited for
    the flush, where consecutive alike calls shared one COPY.)"""
    m = COPY_MIN_ROWS + 100  # COPY-sized
    with Session.begin() as session:
        session.enqueue_many(send, good_rows("a", m))
        session.enqueue_many(send, good_rows("b", m))
        session.enqueue_many(send, good_rows("u", 3), unique=True)
        session.enqueue_many(send, good_rows("p", m), priority=5)
        session.enqueue_many(send, good_rows("q", m), priority=5)
    assert statements() == ["COPY", "COPY", "INSERT", "COPY", "COPY"]
    stored = rows(db)
    assert [r.args["to"][0] for r in stored] == list("a" * m + "b" * m + "uuu" + "p" * m + "q" * m)
    assert {r.args["to"][0] for r in stored if r.priority == 5} == {"p", "q"}
    assert {r.args["to"][0] for r in stored if r.unique_key is not None} == {"u"}


# -- a session's big call is written at the call -----------------------------------------


def test_a_sessions_big_call_is_written_at_the_call_after_its_objects(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    """From CHECK_AS_WRITTEN_MIN_ROWS rows, a sync session writes the call's rows at once,
    after flushing its own objects; they share the transaction's fate."""
    with Session() as session:
        session.add(app.Link(code="first", url="u"))
        assert session.enqueue_many(send, good_rows("a", CHECK_AS_WRITTEN_MIN_ROWS)) == 1_000
        assert not session.new  # the object was flushed first
        assert pending_jobs(session) == {}
        jobs_table = app.Job.__table__
        assert session.execute(sa.select(sa.func.count()).select_from(jobs_table)).scalar() == (
            CHECK_AS_WRITTEN_MIN_ROWS
        )
        session.rollback()
    assert count(db) == 0
    assert count(db, app.Link) == 0


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_a_bad_late_row_in_a_sessions_big_call_leaves_the_session_usable(
    Session: Any, db: sa.Engine, send: Any, depth: int
) -> None:
    """The error comes from the call, nothing of the call is kept, and the session's
    transaction and savepoints (``depth`` of them) go on: the innermost still rolls back
    exactly what it wrote."""
    bad = good_rows("bad-")
    bad[-1] = {"to": "nul\x00"}
    with Session() as session:
        session.enqueue_many(send, good_rows("outer-"))
        savepoints = [session.begin_nested() for _ in range(depth)]
        session.add(app.Link(code="inner", url="u"))
        with pytest.raises(EnqueueError, match="NUL"):
            session.enqueue_many(send, bad)
        session.enqueue_many(send, good_rows("inner-"))
        if savepoints:
            savepoints[-1].rollback()
        session.commit()
    kept = {a["to"].split("-")[0] for a in stored_args(db)}
    assert kept == ({"outer"} if depth else {"outer", "inner"})
    assert count(db, app.Link) == (0 if depth else 1)
    assert count(db) == len(good_rows("")) * len(kept)


def test_a_session_without_autoflush_writes_at_the_call_and_leaves_its_objects(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    """No autoflush: the session's objects are not flushed behind its back, and the rows
    are still written at the call (as a query would run without flushing them)."""
    with Session(autoflush=False) as session:
        link = app.Link(code="later", url="u")
        session.add(link)
        session.enqueue_many(send, good_rows("a"))
        assert pending_jobs(session) == {} and link in session.new
        with pytest.raises(EnqueueError, match="NUL"):
            session.enqueue_many(send, [*good_rows("b"), {"to": "\x00"}])
        session.commit()
    assert count(db) == len(good_rows(""))
    assert count(db, app.Link) == 1


def test_a_sessions_big_call_on_a_killed_backend_raises_and_the_session_recovers(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    """The server ends the session's connection before its big call is written: the call
    raises SQLAlchemy's error, nothing is committed, and after a rollback the session
    works on a new connection."""
    with Session() as session:
        pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with db.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(sa.exc.DBAPIError):
            session.enqueue_many(send, good_rows("lost-"))
        session.rollback()
        assert session.enqueue_many(send, good_rows("kept-")) == len(good_rows(""))
        session.commit()
    assert {a["to"].split("-")[0] for a in stored_args(db)} == {"kept"}


def test_an_async_copy_on_a_killed_backend_raises_and_the_engine_recovers(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    from sqla_jobs import create_async_engine

    async def main() -> None:
        engine = create_async_engine(database_url)
        with pytest.raises(sa.exc.DBAPIError) as raised:
            async with engine.begin() as conn:
                pid = (await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
                with db.connect() as other:
                    other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                await jobs.enqueue_many(conn, send, good_rows("lost-"))
        assert str(raised.value.statement).startswith("COPY")
        assert raised.value.connection_invalidated
        async with engine.begin() as conn:
            await jobs.enqueue_many(conn, send, good_rows("kept-"))
        await engine.dispose()

    asyncio.run(main())
    assert {a["to"].split("-")[0] for a in stored_args(db)} == {"kept"}


@pytest.mark.parametrize("size", ["small", "big"])
def test_an_awaited_async_session_call_refuses_a_bad_row_and_survives_a_killed_backend(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any, size: str
) -> None:
    """``await AsyncJobSession.enqueue_many(...)`` as its sync session does: a bad row
    anywhere is an EnqueueError that keeps nothing of the call and leaves the session
    usable, with its other work; a connection the server ended raises SQLAlchemy's error,
    nothing is committed, and after a rollback the session works on a new connection."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    n = 3 if size == "small" else len(good_rows(""))

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            session.add(app.Link(code="kept", url="u"))
            with pytest.raises(EnqueueError, match="NUL"):
                await session.enqueue_many(send, [*good_rows("bad-", n - 1), {"to": "\x00"}])
            assert await session.enqueue_many(send, good_rows("kept-", n)) == n
            await session.commit()

            pid = (await session.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
            with db.connect() as other:
                other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            with pytest.raises(sa.exc.DBAPIError):
                await session.enqueue_many(send, good_rows("lost-", n))
            await session.rollback()
            assert await session.enqueue_many(send, good_rows("after-", n)) == n
            await session.commit()
        await engine.dispose()

    asyncio.run(main())
    assert sorted({a["to"].split("-")[0] for a in stored_args(db)}) == ["after", "kept"]
    assert count(db) == 2 * n
    assert [r.code for r in rows(db, app.Link)] == ["kept"]


@pytest.mark.parametrize("bad", [5, None, "to", [("to", "x")]], ids=repr)
@pytest.mark.parametrize("where", ["first", "late"])
def test_an_item_that_is_not_arguments_is_refused_by_name_on_every_path(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any, bad: Any, where: str
) -> None:
    """An ``enqueue_many`` item must be ``task.args(...)`` or a mapping: anything else is
    an EnqueueError that says so (it was an AttributeError), first or late, small or big,
    through a session or a connection, and nothing of the call is kept."""
    message = r"must be task\.args\(\.\.\.\) or a mapping of keyword arguments, not"
    for size in (3, len(good_rows(""))):
        sent: list[Any] = good_rows("r", size)
        sent[0 if where == "first" else -1] = bad
        with Session() as session:
            with pytest.raises(EnqueueError, match=message):
                session.enqueue_many(send, sent)
            session.commit()
        with db.begin() as conn:
            with pytest.raises(EnqueueError, match=message):
                jobs.enqueue_many(conn, send, sent)
            # Not failed: inside the transaction, or not yet in one (nothing was sent).
            status = conn.connection.driver_connection.info.transaction_status  # type: ignore[union-attr]
            assert status in (TransactionStatus.INTRANS, TransactionStatus.IDLE)
            conn.execute(sa.text("SELECT 1"))
    assert count(db) == 0


@pytest.mark.parametrize("arguments", [{"to": "x"}, "to", 5, None], ids=repr)
def test_arguments_that_are_not_many_jobs_are_refused_by_name(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any, arguments: Any
) -> None:
    message = "enqueue_many takes an iterable of jobs' arguments"
    with Session() as session, pytest.raises(EnqueueError, match=message):
        session.enqueue_many(send, arguments)
    with db.begin() as conn, pytest.raises(EnqueueError, match=message):
        jobs.enqueue_many(conn, send, arguments)
    assert count(db) == 0


def test_an_async_sessions_big_call_is_written_when_awaited(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    """``await AsyncJobSession.enqueue_many(...)`` writes a big call at the call, through
    the greenlet; the session inside it, called outside ``run_sync`` (where I/O would
    fail), keeps its rows for the flush, as does a call that is not awaited (0.1's way,
    deprecated)."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            n = await session.enqueue_many(send, good_rows("a", CHECK_AS_WRITTEN_MIN_ROWS))
            assert n == CHECK_AS_WRITTEN_MIN_ROWS
            assert pending_jobs(session.sync_session) == {}
            session.sync_session.enqueue_many(send, good_rows("b", CHECK_AS_WRITTEN_MIN_ROWS))
            session.enqueue_many(send, good_rows("c", CHECK_AS_WRITTEN_MIN_ROWS))
            assert [len(r) for r in pending_jobs(session.sync_session).values()] == [2_000]
            with pytest.warns(DeprecationWarning, match="awaited"):
                await session.commit()
        await engine.dispose()

    asyncio.run(main())
    assert count(db) == 3 * CHECK_AS_WRITTEN_MIN_ROWS
