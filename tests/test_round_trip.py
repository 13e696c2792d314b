"""Property: a job's arguments come back exactly as they were given, or enqueue refuses them.

Over JSON-able values (and the near misses: NaN, infinities, negative zero, floats past
1e16, tuples, NUL and surrogates, deep nesting), through every entry point (a session's
``enqueue``, its ``enqueue_many`` small and COPY-sized, and ``jobs.enqueue`` on a Core
connection): either the call raises :class:`EnqueueError`, and the caller's own row in the
same transaction still commits, or the job commits and a real worker runs its handler with
arguments equal to the ones given, type for type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sqla_jobs import EnqueueError, Jobs, Worker  # noqa: E402

from . import app  # noqa: E402
from .helpers import count, rows  # noqa: E402

#: Strings: any code point (NUL and lone surrogates included, which must be refused).
TEXT = st.text(st.characters(codec=None), max_size=12)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()  # NaN, infinities, -0.0, 1e308 and subnormals included
    | TEXT
)
#: JSON-able values, and the near misses Python's json also writes: tuples.
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(TEXT, inner, max_size=4)
    ),
    max_leaves=12,
)
#: A nesting depth around where Python's recursion would run out.
DEEP = st.integers(min_value=490, max_value=520)

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


def same(given: Any, got: Any) -> bool:
    """Equal, type for type at every level (``1 == 1.0 == True`` is not enough), and
    floats bit for bit (``-0.0`` is not ``0.0``). Walked with a stack, not recursion: the
    values here nest up to the encoder's limit, and on Python 3.12 hypothesis's line
    tracer adds frames of its own to every level of a recursive walk."""
    pending = [(given, got)]
    while pending:
        a, b = pending.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            if not (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)):
                return False
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return False
            pending.extend(zip(a, b, strict=True))
        elif isinstance(a, dict):
            if a.keys() != b.keys():
                return False
            pending.extend((v, b[k]) for k, v in a.items())
        elif a != b:
            return False
    return True


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth - 1):  # the arguments object is the first level
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.fixture
def harness(db: sa.Engine, jobs: Jobs, Session: Any) -> Callable[..., None]:
    """``check(enqueue, values)``: calls ``enqueue(session_or_connection, values)`` in a
    transaction holding a business row of its own, then checks the outcome."""
    received: list[Any] = []

    @jobs.task(queue="echo", name="echo")
    def echo(value: Any = None, n: int = -1) -> None:
        received.append((n, value))

    # One worker for every example: each run_until_empty claims through the real claim
    # and decodes the rows as a worker process would.
    worker = Worker(jobs, db, queues=["echo"], concurrency=4)

    def reset() -> None:
        received.clear()
        with db.begin() as conn:
            conn.execute(sa.delete(app.Job.__table__))
            conn.execute(sa.delete(app.Link.__table__))

    def check(
        enqueue: Callable[[Any, Any], None], values: list[Any], *, core: bool = False
    ) -> None:
        reset()
        refused = None
        if core:
            with db.connect() as conn:
                conn.execute(sa.insert(app.Link.__table__).values(code="kept", url="u"))
                try:
                    enqueue(conn, values)
                except EnqueueError as exc:
                    refused = exc
                conn.commit()
        else:
            with Session() as session:
                session.add(app.Link(code="kept", url="u"))
                try:
                    enqueue(session, values)
                except EnqueueError as exc:
                    refused = exc
                session.commit()
        assert [r.code for r in rows(db, app.Link)] == ["kept"]
        if refused is not None:
            assert count(db) == 0, f"refused ({refused}) yet a job was written"
            return
        assert worker.run_until_empty(timeout=60) == len(values)
        got = dict(received)
        assert sorted(got) == list(range(len(values)))
        for n, value in enumerate(values):
            assert same(value, got[n]), (value, got[n])
        assert count(db) == 0  # done, and deleted

    return check


def _session_enqueue(session: Any, values: list[Any]) -> None:
    for n, value in enumerate(values):
        session.enqueue("echo", value, n=n)


def _session_many(session: Any, values: list[Any]) -> None:
    session.enqueue_many("echo", [{"value": v, "n": n} for n, v in enumerate(values)])


@SETTINGS
@given(value=VALUES)
def test_a_session_enqueue_round_trips_or_refuses(harness: Any, value: Any) -> None:
    harness(_session_enqueue, [value])


@SETTINGS
@given(values=st.lists(VALUES, min_size=1, max_size=5))
def test_a_small_enqueue_many_round_trips_or_refuses(harness: Any, values: list[Any]) -> None:
    harness(_session_many, values)


@settings(SETTINGS, max_examples=6)
@given(value=VALUES, at=st.integers(min_value=0, max_value=1_199))
def test_a_copy_sized_enqueue_many_round_trips_or_refuses(
    harness: Any, value: Any, at: int
) -> None:
    """1,200 rows: written at the call through COPY, the rows after the first block
    checked as they are sent; the hostile value is anywhere among them."""
    values: list[Any] = list(range(1_200))
    values[at] = value
    harness(_session_many, values)


@SETTINGS
@given(value=VALUES)
def test_a_core_connection_enqueue_round_trips_or_refuses(
    harness: Any, jobs: Jobs, value: Any
) -> None:
    def enqueue(conn: sa.Connection, values: list[Any]) -> None:
        for n, v in enumerate(values):
            jobs.enqueue(conn, "echo", v, n=n)

    harness(enqueue, [value], core=True)


@settings(SETTINGS, max_examples=8)
@given(depth=DEEP, where=st.sampled_from(["enqueue", "many", "core"]))
def test_nesting_near_the_limit_round_trips_or_refuses(
    harness: Any, jobs: Jobs, depth: int, where: str
) -> None:
    value = nested(depth)

    def core(conn: sa.Connection, values: list[Any]) -> None:
        jobs.enqueue(conn, "echo", values[0], n=0)

    enqueue = {"enqueue": _session_enqueue, "many": _session_many, "core": core}[where]
    harness(enqueue, [value], core=where == "core")
