"""Sharding: jobs follow their rows into the shard, and workers serve several shards.

Two real PostgreSQL servers: the test session's own (shard "a") and a second embedded one
started here (shard "b"). Links whose code starts with "a" live in shard a, the others in
shard b.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from sqla_jobs import EnqueueError, Jobs, admin, create_engine, current_job, sharding
from sqla_jobs.db import embedded_url, normalize_url
from sqla_jobs.model import companion_tables
from sqla_jobs.sharding import ShardedJobSession, ShardedWorker

from . import app

#: Nothing listens here: a shard that is down.
DEAD_URL = "postgresql+psycopg://postgres@127.0.0.1:9/nothing?connect_timeout=2"


@pytest.fixture(scope="module")
def engine_b(worker_database: Any) -> Iterator[sa.Engine]:
    given = os.environ.get("SQLA_JOBS_SECOND_DATABASE_URL")
    # Each xdist worker has a database of its own there (an embedded server is its own).
    url = worker_database(given) if given else embedded_url()
    eng = create_engine(normalize_url(url))
    with eng.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.SCHEMA}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{app.SCHEMA}"'))
        app.Base.metadata.create_all(conn)
    yield eng
    eng.dispose()


@pytest.fixture
def shards(db: sa.Engine, engine_b: sa.Engine) -> dict[str, sa.Engine]:
    tables = ", ".join(f'"{app.SCHEMA}"."{t.name}"' for t in app.Base.metadata.sorted_tables)
    with engine_b.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY"))
    return {"a": db, "b": engine_b}


def _chooser(mapper: Any, instance: Any, clause: Any = None) -> str:
    if isinstance(instance, app.Link):
        return "a" if instance.code.startswith("a") else "b"
    raise ValueError(f"no shard for {instance!r}")


@pytest.fixture
def Sharded(shards: dict[str, sa.Engine], jobs: Jobs) -> sessionmaker[ShardedJobSession]:
    return sessionmaker(
        class_=ShardedJobSession,
        shards=shards,
        shard_chooser=_chooser,
        identity_chooser=lambda *a, **kw: list(shards),
        execute_chooser=lambda context: list(shards),
        jobs=jobs,
    )


def _count(engine: sa.Engine, table: Any, *where: Any) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).select_from(table).where(*where)
        ).scalar_one()


def _task(jobs: Jobs, seen: list[tuple[str, str]] | None = None) -> Any:
    @jobs.task(queue="links")
    def fetch(code: str) -> None:
        if seen is not None:
            seen.append((code, threading.current_thread().name))

    return fetch


JOB = app.Job.__table__


def test_enqueue_lands_in_the_shard_of_its_rows(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.add(app.Link(code="a1", url="u"))
        session.enqueue(fetch, code="a1")
    with Sharded.begin() as session:
        session.add(app.Link(code="b1", url="u"))
        session.enqueue(fetch, code="b1")
    for name, code in (("a", "a1"), ("b", "b1")):
        engine = shards[name]
        assert _count(engine, app.Link.__table__) == 1
        with engine.connect() as conn:
            assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [{"code": code}]


def test_enqueue_rolls_back_with_its_rows(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with pytest.raises(RuntimeError), Sharded.begin() as session:
        session.add(app.Link(code="b2", url="u"))
        session.enqueue(fetch, code="b2")
        session.flush()
        assert _count(shards["b"], JOB) == 0  # not visible before the commit
        raise RuntimeError("the request failed")
    for engine in shards.values():
        assert _count(engine, JOB) == 0
        assert _count(engine, app.Link.__table__) == 0


def test_in_a_savepoint_a_job_shares_the_fate_of_its_rows(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    # A rolled-back begin_nested() takes back what it flushed, the row and its job (the
    # session flushes through the savepoint's connection: see connection_callable).
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.add(app.Link(code="a3", url="u"))
        session.enqueue(fetch, code="a3")
        with pytest.raises(RuntimeError), session.begin_nested():
            session.add(app.Link(code="a3-nested", url="u"))
            session.enqueue(fetch, code="a3-nested")
            session.flush()
            raise RuntimeError
    with shards["a"].connect() as conn:
        codes = set(conn.execute(sa.select(app.Link.code)).scalars())
        args = {a["code"] for a in conn.execute(sa.select(JOB.c.args)).scalars()}
    assert codes == args == {"a3"}
    assert _count(shards["b"], JOB) == 0


def test_shard_with_and_explicit_shard(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.add(app.Link(code="a4", url="u"))
        session.add(b := app.Link(code="b4", url="u"))
        session.enqueue(fetch, code="b4", shard_with=b)  # pending: where it will go
        session.enqueue(fetch, code="to-a", shard="a")
    with Sharded.begin() as session:
        # Loaded: where it came from. The session's transaction writes nothing else.
        loaded = session.get(app.Link, "a4")
        assert loaded is not None
        session.enqueue(fetch, code="a4-again", shard_with=loaded)
    with shards["a"].connect() as conn:
        args = conn.execute(sa.select(JOB.c.args).order_by(JOB.c.id)).scalars().all()
    assert args == [{"code": "to-a"}, {"code": "a4-again"}]
    with shards["b"].connect() as conn:
        assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [{"code": "b4"}]


def test_shard_with_a_pending_job_follows_the_shard_enqueue_chose_for_it(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:
        first = session.enqueue(fetch, code="first", shard="b")
        # Not the application's chooser's answer (it has none for a job): where the
        # flush will send it.
        assert session.shard_of_job(shard_with=first) == "b"
        session.enqueue(fetch, code="second", shard_with=first)
    assert _count(shards["b"], JOB) == 2
    assert _count(shards["a"], JOB) == 0


def test_a_workflow_is_linked_on_its_own_shard(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    """``after=`` and ``jobs.group`` on a sharded session: the link runs on the child's
    shard (it asked the chooser with no instance, and failed), and a group's callback
    follows its members. Job ids repeat across shards (each has its own sequence), so a
    link made on the wrong shard would wait for another shard's job."""
    ran: list[str] = []
    got: list[Any] = []

    @jobs.task(queue="flow")
    def step(name: str) -> None:
        ran.append(name)

    @jobs.task(queue="flow")
    def member(n: int) -> int:
        return n

    @jobs.task(queue="flow")
    def total(results: list[int]) -> None:
        got.append(results)

    with Sharded.begin() as session:
        session.add(app.Link(code="a1", url="u"))
        session.enqueue(step, name="a-first")  # job 1 of shard a
    with Sharded.begin() as session:
        session.add(app.Link(code="b1", url="u"))
        parent = session.enqueue(step, name="parent")  # job 1 of shard b
        session.enqueue(step.with_options(after=[parent]), name="child")
        jobs.group(
            session, [(member, member.args(n=1)), (member, member.args(n=2))], (total, total.args())
        )
    with shards["b"].connect() as conn:
        statuses = conn.execute(sa.select(JOB.c.status).order_by(JOB.c.id)).scalars().all()
    assert statuses == ["ready", "scheduled", "ready", "ready", "scheduled"]
    ShardedWorker(jobs, shards, concurrency=2, listen=False, poll_interval=0.05).run_until_empty(
        timeout=30
    )
    assert sorted(ran) == ["a-first", "child", "parent"]
    assert ran.index("parent") < ran.index("child")
    assert got == [[1, 2]]


def test_a_job_cannot_wait_for_a_job_of_another_shard(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    # Refused at the flush that would link it: the commit fails, and nothing is written.
    refused = pytest.raises(EnqueueError, match=r"on shard 'a' .* on shard 'b'")
    with refused, Sharded.begin() as session:
        parent = session.enqueue(fetch, code="p", shard="a")
        session.enqueue(fetch.with_options(after=[parent]), code="c", shard="b")
    for engine in shards.values():
        assert _count(engine, JOB) == 0


def test_the_shard_of_rows_flushed_earlier_in_the_transaction(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.add(app.Link(code="b5", url="u"))
        session.flush()
        assert not session.new
        session.enqueue(fetch, code="b5")
    assert _count(shards["b"], JOB) == 1
    # A new transaction starts with no shard of its own.
    with Sharded.begin() as session, pytest.raises(EnqueueError, match="writes no rows"):
        session.enqueue(fetch, code="b5")


def test_a_job_whose_shard_cannot_be_told_is_refused(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded() as session:
        with pytest.raises(EnqueueError, match="writes no rows"):
            session.enqueue(fetch, code="x")
        session.add(app.Link(code="a6", url="u"))
        session.add(app.Link(code="b6", url="u"))
        with pytest.raises(EnqueueError, match=r"shards \['a', 'b'\]"):
            session.enqueue(fetch, code="x")
        with pytest.raises(EnqueueError, match="not one of this session's shards"):
            session.enqueue(fetch, code="x", shard="c")
        with pytest.raises(EnqueueError, match="not both"):
            session.enqueue(fetch, code="x", shard="a", shard_with=app.Link(code="a", url=""))
        with pytest.raises(EnqueueError, match="ORM object"):
            session.enqueue(fetch, code="x", shard_with="a6")
        assert not [o for o in session.new if isinstance(o, app.Job)]
        session.rollback()
    for engine in shards.values():
        assert _count(engine, JOB) == 0


def test_a_signal_goes_to_the_shard_whose_connection_it_is_sent_on(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    """Each shard numbers its own jobs: the first job of shard a and the first of shard b
    have the same id. A signal through the sharded session is refused (it cannot tell
    which of the two is meant); through a shard's connection it reaches that shard's job
    and no other."""
    fetch = _task(jobs)
    for code in ("a1", "b1"):
        with Sharded.begin() as session:
            session.add(app.Link(code=code, url="u"))
            session.enqueue(fetch, code=code)
    ids = set()
    for engine in shards.values():
        with engine.connect() as conn:
            ids.add(conn.execute(sa.select(JOB.c.id)).scalar_one())
    [job_id] = ids
    with Sharded() as session, pytest.raises(TypeError, match="pass that shard's connection"):
        jobs.signal(session, job_id, "go")
    with Sharded.begin() as session:
        on_b = session.connection(bind_arguments={"shard_id": "b"})
        assert jobs.signal(on_b, job_id, "go", {"n": 1}) == "kept"
    steps = companion_tables(JOB).steps
    assert _count(shards["a"], steps) == 0
    assert _count(shards["b"], steps, steps.c.name == "go") == 1


def test_the_admin_functions_refuse_a_sharded_session(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    """The same id on both shards: given the sharded session, cancelling job 1 would act
    wherever the choosers send a statement that names no object (here: both shards, two
    jobs cancelled for one). Every admin function refuses it before its first statement;
    the shard's connection acts on that shard's job alone."""
    fetch = _task(jobs)
    for code in ("a1", "b1"):
        with Sharded.begin() as session:
            session.add(app.Link(code=code, url="u"))
            session.enqueue(fetch, code=code)
    [job_id] = {_first_id(engine) for engine in shards.values()}
    with Sharded() as session:
        for call in (
            lambda: admin.cancel_jobs(session, jobs, ids=[job_id]),
            lambda: admin.retry_jobs(session, jobs, ids=[job_id]),
            lambda: admin.purge_jobs(session, jobs, ids=[job_id], status="ready"),
            lambda: admin.get_job(session, jobs, job_id),
            lambda: admin.queue_states(session, jobs),
            lambda: admin.pause_queue(session, jobs, "default"),
        ):
            with pytest.raises(TypeError, match="pass that shard's connection"):
                call()
    with Sharded.begin() as session:
        on_b = session.connection(bind_arguments={"shard_id": "b"})
        assert admin.cancel_jobs(on_b, jobs, ids=[job_id]) == 1
    assert _count(shards["a"], JOB, JOB.c.status == "cancelled") == 0
    assert _count(shards["b"], JOB, JOB.c.status == "cancelled") == 1


def _first_id(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(JOB.c.id)).scalar_one())


def test_a_unique_job_is_unique_within_its_shard(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:  # job 1 of shard a, so that ids collide across shards
        session.enqueue(fetch, code="plain", shard="a")
    unique = fetch.with_options(unique=True)
    with Sharded.begin() as session:
        session.add(app.Link(code="b8", url="u"))
        first = session.enqueue(unique, code="b8")
        again = session.enqueue(unique, code="b8")
        assert again is first
        assert first.args == {"code": "b8"}  # shard b's job 1, not shard a's
        other = session.enqueue(unique, code="b8", shard="a")  # another shard, another key
        assert other is not first and other.args == {"code": "b8"}
    with shards["b"].connect() as conn:
        assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [{"code": "b8"}]
    with shards["a"].connect() as conn:
        args = conn.execute(sa.select(JOB.c.args).order_by(JOB.c.id)).scalars().all()
    assert args == [{"code": "plain"}, {"code": "b8"}]
    with pytest.raises(RuntimeError), Sharded.begin() as session:
        session.enqueue(unique, code="gone", shard="b")
        raise RuntimeError
    assert _count(shards["b"], JOB) == 1
    with Sharded.begin() as session:
        many = [{"code": "b8"}, {"code": "b9"}]
        assert session.enqueue_many(fetch, many, shard="b", unique=True) == 1  # inserted
    with shards["b"].connect() as conn:
        args = conn.execute(sa.select(JOB.c.args).order_by(JOB.c.id)).scalars().all()
    assert args == [{"code": "b8"}, {"code": "b9"}]  # b8's key is held: skipped


def test_enqueue_many_lands_in_its_shard_and_rolls_back_with_it(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.add(app.Link(code="b7", url="u"))
        assert session.enqueue_many(fetch, [{"code": f"b7-{i}"} for i in range(3)]) == 3
    assert _count(shards["b"], JOB) == 3
    assert _count(shards["a"], JOB) == 0
    with pytest.raises(RuntimeError), Sharded.begin() as session:
        session.enqueue_many(fetch, [{"code": "gone"}], shard="a")
        raise RuntimeError
    assert _count(shards["a"], JOB) == 0


def _fill(shards: dict[str, sa.Engine], jobs: Jobs, task: Any, per_shard: int) -> None:
    for name, engine in shards.items():
        with engine.begin() as conn:
            jobs.enqueue_many(conn, task, [{"code": f"{name}-{i}"} for i in range(per_shard)])


def test_a_worker_serving_two_shards_drains_both_exactly_once(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    seen: list[tuple[str, str]] = []
    fetch = _task(jobs, seen)
    _fill(shards, jobs, fetch, 200)
    worker = ShardedWorker(jobs, shards, concurrency=8, name="w")
    assert worker.run_until_empty(timeout=60) == {"a": 200, "b": 200}
    codes = [code for code, _ in seen]
    assert len(codes) == len(set(codes)) == 400
    assert {c.split("-")[0] for c in codes} == {"a", "b"}
    for engine in shards.values():
        assert _count(engine, JOB) == 0  # finished jobs are deleted
    assert {w.name for w in worker.workers.values()} == {"w@a", "w@b"}


def test_stop_now_reaches_the_worker_of_every_shard(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    """``ShardedWorker.stop(now=True)`` (a second signal) ends each shard's grace period:
    the handler running on each is cut off and its job handed back."""
    started = threading.Semaphore(0)

    @jobs.task(queue="links")
    def fetch(code: str) -> None:
        started.release()
        current_job().cancelled.wait(60)

    _fill(shards, jobs, fetch, 1)
    worker = ShardedWorker(jobs, shards, concurrency=1, grace_period=60, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        assert started.acquire(timeout=20) and started.acquire(timeout=20)
        worker.stop()
        thread.join(0.5)
        assert thread.is_alive()
        worker.stop(now=True)
        thread.join(15)
        assert not thread.is_alive(), "stop(now=True) did not end the shards' grace periods"
    finally:
        worker.stop(now=True)
        thread.join(15)
    for engine in shards.values():
        with engine.connect() as conn:
            assert conn.execute(sa.select(JOB.c.status)).scalars().all() == ["ready"]


def _wait(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_shard_that_is_down_does_not_stop_the_others(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    seen: list[tuple[str, str]] = []
    fetch = _task(jobs, seen)
    live = shards["a"]
    worker = ShardedWorker(jobs, {"down": DEAD_URL, "a": live}, concurrency=4)
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    runner.start()
    try:
        # Enqueued while the worker runs: the live shard's worker is claiming and
        # listening though the other cannot even connect.
        _fill({"a": live}, jobs, fetch, 50)
        _wait(lambda: len(seen) == 50 and _count(live, JOB) == 0)
        assert worker.workers["down"].processed == 0
        assert worker.workers["a"].processed == 50
        _wait(lambda: worker.health()["unreachable"] == ["down"])
        assert worker.health()["shards"]["down"]["state"] == "restarting"
        assert worker.health()["healthy"]
    finally:
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()


def test_a_shard_not_migrated_yet_is_started_again_and_a_stop_ends_only_its_run(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    """Shard b's tables are not all there (a rolling migration has not reached it): its
    worker cannot start, and is started again until they are, while shard a drains (the
    error stopped every shard); its health names it as not ready (it said "unreachable").
    The worker stopped while b waited to be started again serves b in its next run (the
    stop stood for ever: b's next run ended at once)."""
    fetch = _task(jobs)
    schedules = f'"{app.SCHEMA}".jobs_schedules'
    with shards["b"].begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {schedules} RENAME TO jobs_schedules_later"))
    worker = ShardedWorker(jobs, shards, concurrency=2, poll_interval=0.1)
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    runner.start()
    try:
        _fill({"a": shards["a"]}, jobs, fetch, 5)
        _wait(lambda: _count(shards["a"], JOB) == 0)
        # Named as not ready (a migration or a grant is wanted), not as unreachable.
        _wait(lambda: worker.health()["not_ready"] == ["b"])
        health = worker.health()
        assert health["unreachable"] == [] and health["healthy"]
        assert health["shards"]["b"]["database"].startswith("not ready for ")
    finally:
        worker.stop()
        runner.join(30)
        with shards["b"].begin() as conn:
            conn.execute(
                sa.text(f'ALTER TABLE "{app.SCHEMA}".jobs_schedules_later RENAME TO jobs_schedules')
            )
    assert not runner.is_alive()
    _fill(shards, jobs, fetch, 3)
    assert worker.run_until_empty(timeout=20) == {"a": 3, "b": 3}


@pytest.mark.parametrize("how", ["after", "enqueue_many", "unique", "query"])
def test_in_a_savepoint_a_row_and_its_jobs_share_their_fate(
    Sharded: sessionmaker[ShardedJobSession], shards: dict[str, sa.Engine], jobs: Jobs, how: str
) -> None:
    """A row and its jobs written in a savepoint that rolls back, however the statements
    interleave: none of them stays. The flush wrote through the outermost transaction,
    whose connection to the shard had not begun the savepoint, which began only at the
    first statement asking for it (the link of an ``after=`` child, an ``enqueue_many``,
    a unique job, a query): a child was kept held for ever without its link, or a row
    without its job."""
    fetch = _task(jobs)
    with Sharded.begin() as session:
        with pytest.raises(RuntimeError), session.begin_nested():
            session.add(app.Link(code="b1", url="u"))
            if how == "after":
                parent = session.enqueue(fetch, code="parent")
                session.enqueue(fetch.with_options(after=[parent]), code="child")
            elif how == "enqueue_many":
                session.flush()
                session.enqueue_many(fetch, [{"code": "b1"}], shard="b")
            elif how == "unique":
                session.flush()
                session.enqueue(fetch.with_options(unique=True), code="b1")
            else:
                session.flush()
                session.execute(sa.select(app.Link)).all()
                session.enqueue(fetch, code="b1")
            session.flush()
            raise RuntimeError
        session.add(app.Link(code="b2", url="u"))  # the transaction itself goes on
    assert _count(shards["b"], JOB) == 0
    assert _count(shards["b"], app.Link.__table__) == 1


def test_a_job_only_write_is_no_shard_for_the_next_enqueue(
    Sharded: sessionmaker[ShardedJobSession], jobs: Jobs
) -> None:
    """``enqueue_many`` on shard b writes no object: a later enqueue without a shard, with
    no object written either, is refused as after a plain ``enqueue`` (it went to b)."""
    fetch = _task(jobs)
    with Sharded.begin() as session:
        session.enqueue_many(fetch, [{"code": "x"}], shard="b")
        with pytest.raises(EnqueueError, match="writes no rows"):
            session.enqueue(fetch, code="y")


def test_stats_and_jobs_across_shards(shards: dict[str, sa.Engine], jobs: Jobs) -> None:
    fetch = _task(jobs)
    _fill({"a": shards["a"]}, jobs, fetch, 2)
    _fill({"b": shards["b"]}, jobs, fetch, 3)
    engines = {**shards, "down": create_engine(DEAD_URL)}
    results = sharding.queue_states(engines, jobs)
    assert [r.shard for r in results] == ["a", "b", "down"]
    assert [(q.queue, q.ready) for q in results[0].value or ()] == [("links", 2)]
    assert results[2].value is None and results[2].error
    [links] = sharding.total(results)
    assert (links.queue, links.ready) == ("links", 5)
    assert links.lag_seconds is not None
    found, failed = sharding.list_jobs(engines, jobs, limit=4)
    assert len(found) == 4
    assert {shard for shard, _ in found} == {"a", "b"}
    assert [r.shard for r in failed] == ["down"]
    stamps = [job.created_at for _, job in found]
    assert stamps == sorted(stamps, reverse=True)


def test_health_over_http_names_the_shard_that_is_stuck(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    import json

    from sqla_jobs.health import serve_health

    from .test_cli_observability import get

    _task(jobs)
    worker = ShardedWorker(jobs, shards, concurrency=2, poll_interval=0.1, stuck_after=1)
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    server = serve_health(worker, 0, "127.0.0.1")
    runner.start()
    try:
        _wait(lambda: get(server.port, "/healthz")[0] == 200)
        # A lock on shard b's table stops every statement of b's fetch loop, not a's.
        with shards["b"].connect() as conn, conn.begin():
            conn.execute(sa.text(f'LOCK TABLE "{app.SCHEMA}".jobs IN ACCESS EXCLUSIVE MODE'))
            _wait(lambda: get(server.port, "/healthz")[0] == 503)
            report = json.loads(get(server.port, "/healthz")[1])
        assert report["unhealthy"] == ["b"] and not report["healthy"]
        assert report["shards"]["a"]["healthy"]
        problems = report["problems"]
        assert all(p.startswith("shard b: ") for p in problems), problems
        assert any(p.startswith("shard b: fetch loop stuck: waiting on Io ") for p in problems)
        _wait(lambda: get(server.port, "/healthz")[0] == 200)
    finally:
        worker.stop()
        runner.join(30)
        server.close()
    assert not runner.is_alive()


# -- reserved names -----------------------------------------------------------------------


def test_shard_keywords_for_a_handler_that_takes_them_are_refused(
    Sharded: sessionmaker[ShardedJobSession],
    shards: dict[str, sa.Engine],
    jobs: Jobs,
    Session: sessionmaker[Any],
) -> None:
    @jobs.task(queue="links")
    def place(shard: str, shard_with: str = "-") -> None: ...

    with Sharded.begin() as session:
        session.add(app.Link(code="a9", url="u"))
        for given in ({"shard": "a"}, {"shard_with": app.Link(code="a", url="")}):
            with pytest.raises(EnqueueError, match=r"both an option .* and a parameter"):
                session.enqueue(place, "x", **given)
        with pytest.raises(EnqueueError, match=r"shard= is both"):
            session.enqueue(place.name, shard="a")  # by name, too
        with pytest.raises(EnqueueError, match=r"shard= is both"):
            session.enqueue(place.with_options(queue="q"), shard=None)  # None is a value
        assert not [o for o in session.new if isinstance(o, app.Job)]
        session.enqueue(place, "eu", "w")  # positionally: the unit of work's shard
        # enqueue_many's items are the handler's arguments, its keywords the options.
        session.enqueue_many(place, [{"shard": "us", "shard_with": "v"}], shard="b")
    with shards["a"].connect() as conn:
        assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [
            {"shard": "eu", "shard_with": "w"}
        ]
    with shards["b"].connect() as conn:
        assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [
            {"shard": "us", "shard_with": "v"}
        ]
    # Not reserved for the plain session: an application that does not shard keeps them.
    with Session.begin() as session:
        assert session.enqueue(place, shard="eu").args == {"shard": "eu"}


# -- asyncio ------------------------------------------------------------------------------


def _async_engines(shards: dict[str, sa.Engine]) -> dict[str, Any]:
    from sqla_jobs.db import create_async_engine

    return {name: create_async_engine(_url(engine)) for name, engine in shards.items()}


def test_async_session_lands_jobs_with_their_rows_and_rolls_back_with_them(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs.sharding import AsyncShardedJobSession

    fetch = _task(jobs)
    unique = fetch.with_options(unique=True)

    async def main() -> None:
        engines = _async_engines(shards)
        make = async_sessionmaker(
            class_=AsyncShardedJobSession,
            shards={name: e.sync_engine for name, e in engines.items()},
            shard_chooser=_chooser,
            identity_chooser=lambda *a, **kw: list(engines),
            execute_chooser=lambda context: list(engines),
            jobs=jobs,
            expire_on_commit=False,
        )
        try:
            async with make.begin() as session:
                session.add(app.Link(code="b1", url="u"))
                job = session.enqueue(fetch, code="b1")  # no await: no I/O
                assert session.unit_of_work_shards() == {"b"}
                assert await session.enqueue_many(fetch, [{"code": "b1-many"}]) == 1
                first = await session.enqueue_unique(unique, code="b1-u")
                assert await session.enqueue_unique(unique, code="b1-u") is first
                with pytest.raises(EnqueueError, match="enqueue_unique"):
                    session.enqueue(unique, code="b1-u")
                session.enqueue(fetch, code="to-a", shard="a")
                with pytest.raises(TypeError, match="pass that shard's connection"):
                    await jobs.signal_async(session, 1, "go")  # which shard's job 1?
            assert job.id is not None and sa.inspect(job).identity_token == "b"
            async with make() as session:
                with pytest.raises(EnqueueError, match="writes no rows"):
                    session.enqueue(fetch, code="x")
                session.add(a2 := app.Link(code="a2", url="u"))
                session.add(app.Link(code="b2", url="u"))
                with pytest.raises(EnqueueError, match=r"shards \['a', 'b'\]"):
                    session.enqueue(fetch, code="x")
                with pytest.raises(EnqueueError, match="not one of this session's shards"):
                    await session.enqueue_many(fetch, [{"code": "x"}], shard="c")
                session.enqueue(fetch, code="a2", shard_with=a2)
                await session.enqueue_many(fetch, [{"code": "b2-many"}], shard="b")
                await session.flush()
                await session.rollback()  # the rows and their jobs, on both shards
        finally:
            for engine in engines.values():
                await engine.dispose()

    asyncio.run(main())
    with shards["b"].connect() as conn:
        args = conn.execute(sa.select(JOB.c.args).order_by(JOB.c.id)).scalars().all()
    assert args == [{"code": "b1-many"}, {"code": "b1-u"}, {"code": "b1"}]
    with shards["a"].connect() as conn:
        assert conn.execute(sa.select(JOB.c.args)).scalars().all() == [{"code": "to-a"}]
    assert _count(shards["a"], app.Link.__table__) == 0
    assert _count(shards["b"], app.Link.__table__) == 1


def test_async_session_links_a_workflow_on_its_own_shard(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs.sharding import AsyncShardedJobSession

    fetch = _task(jobs)

    async def main() -> None:
        engines = _async_engines(shards)
        make = async_sessionmaker(
            class_=AsyncShardedJobSession,
            shards={name: e.sync_engine for name, e in engines.items()},
            shard_chooser=_chooser,
            identity_chooser=lambda *a, **kw: list(engines),
            execute_chooser=lambda context: list(engines),
            jobs=jobs,
        )
        try:
            async with make.begin() as session:
                session.add(app.Link(code="b1", url="u"))
                parent = session.enqueue(fetch, code="parent")
                session.enqueue(fetch.with_options(after=[parent]), code="child")
        finally:
            for engine in engines.values():
                await engine.dispose()

    asyncio.run(main())
    with shards["b"].connect() as conn:
        found = conn.execute(sa.select(JOB.c.status, JOB.c.waiting).order_by(JOB.c.id)).all()
    assert [tuple(row) for row in found] == [("ready", None), ("scheduled", 1)]
    assert _count(shards["a"], JOB) == 0


def _async_task(jobs: Jobs, seen: list[str]) -> Any:
    @jobs.task(queue="links")
    async def fetch(code: str) -> None:
        seen.append(code)

    return fetch


def test_async_worker_drains_two_shards_exactly_once(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    import asyncio

    from sqla_jobs.sharding import AsyncShardedWorker

    seen: list[str] = []
    fetch = _async_task(jobs, seen)
    _fill(shards, jobs, fetch, 150)
    urls = {name: _url(engine) for name, engine in shards.items()}
    worker = AsyncShardedWorker(jobs, urls, concurrency=16, name="w")
    assert asyncio.run(worker.run_until_empty(timeout=60)) == {"a": 150, "b": 150}
    assert len(seen) == len(set(seen)) == 300
    assert {c.split("-")[0] for c in seen} == {"a", "b"}
    for engine in shards.values():
        assert _count(engine, JOB) == 0
    assert {w.name for w in worker.workers.values()} == {"w@a", "w@b"}
    # Its engines were made on that loop and disposed of: it runs again on another.
    _fill({"b": shards["b"]}, jobs, fetch, 3)
    assert asyncio.run(worker.run_until_empty(timeout=60)) == {"a": 0, "b": 3}


def _unreachable_for(worker: Any, shard: str) -> float:
    """Seconds the shard's database has been unreachable, as its health says."""
    said = worker.health()["shards"][shard]["database"]
    return float(said.split()[2].rstrip("s:")) if said.startswith("unreachable for ") else 0.0


def test_async_worker_a_shard_that_is_down_does_not_stop_the_others(
    shards: dict[str, sa.Engine], jobs: Jobs
) -> None:
    import asyncio

    from sqla_jobs.sharding import AsyncShardedWorker

    seen: list[str] = []
    fetch = _async_task(jobs, seen)
    live = shards["a"]
    worker = AsyncShardedWorker(jobs, {"down": DEAD_URL, "a": _url(live)}, concurrency=4)
    runner = threading.Thread(target=asyncio.run, args=(worker.run(install_signal_handlers=False),))
    runner.start()
    try:
        _fill({"a": live}, jobs, fetch, 50)
        _wait(lambda: len(seen) == 50 and _count(live, JOB) == 0)
        assert worker.workers["down"].processed == 0
        assert worker.workers["a"].processed == 50
        _wait(lambda: worker.health()["unreachable"] == ["down"])
        health = worker.health()
        assert health["healthy"] and health["unhealthy"] == []
        assert health["shards"]["down"]["state"] == "restarting"
        assert health["shards"]["down"]["database"].startswith("unreachable for ")
        assert health["shards"]["a"]["state"] == "running"
        # Past several restarts of the down shard's worker: on Python 3.10 the pause
        # between them (asyncio.wait_for) raised asyncio.TimeoutError, which is not the
        # builtin there, and ended the whole worker half a second after a shard was found
        # down (a loaded run's live shard had not finished by then).
        _wait(lambda: runner.is_alive() and _unreachable_for(worker, "down") > 2.0)
        _fill({"a": live}, jobs, fetch, 10)
        _wait(lambda: len(seen) == 60)
        assert runner.is_alive()
    finally:
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()
    after = worker.health()
    assert not after["healthy"] and after["unhealthy"] == ["down", "a"]
    assert "shard a: the worker is not running" in after["problems"]


# -- the command --------------------------------------------------------------------------


def _url(engine: sa.Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _runs_by_worker(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        stmt = sa.select(app.Run.worker, sa.func.count()).group_by(app.Run.worker)
        return {w: n for w, n in conn.execute(stmt).all()}


def _add(engine: sa.Engine, n: int) -> None:
    row = {"task": "tests.app.record_run", "queue": "records"}
    with engine.begin() as conn:
        conn.execute(sa.insert(app.Job).values([row] * n))


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_cli_worker_until_empty_drains_every_shard(
    shards: dict[str, sa.Engine], flavour: str
) -> None:
    from .test_cli import cli

    _add(shards["a"], 5)
    _add(shards["b"], 7)
    flags = [f"--shard=a={_url(shards['a'])}", f"--shard=b={_url(shards['b'])}"]
    if flavour == "asyncio":
        flags.append("--asyncio")
    done = cli("worker", "tests.app:jobs", *flags, "--until-empty", "--name", "w")
    assert done.returncode == 0, done.stderr
    # tests.app's handler records each run in DATABASE_URL's database, shard a.
    assert _runs_by_worker(shards["a"]) == {"w@a": 5, "w@b": 7}
    for engine in shards.values():
        assert _count(engine, JOB) == 0


def test_cli_worker_supervises_a_process_per_shard(shards: dict[str, sa.Engine]) -> None:
    import signal
    import subprocess

    from .test_cli import ROOT, command, environment

    flags = [f"--shard=a={_url(shards['a'])}", f"--shard=b={_url(shards['b'])}"]
    proc = subprocess.Popen(
        command("worker", "tests.app:jobs", *flags, "--name", "p"),
        cwd=ROOT,
        env=environment(),
        stdin=subprocess.DEVNULL,
    )
    try:
        _add(shards["a"], 3)
        _add(shards["b"], 4)
        _wait(lambda: _runs_by_worker(shards["a"]) == {"p@a": 3, "p@b": 4}, timeout=60)
        with shards["a"].connect() as conn:
            pids = set(conn.execute(sa.select(app.Run.pid).distinct()).scalars())
        assert len(pids) == 2  # one process per shard
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def _health(port: int) -> tuple[int, dict[str, Any]]:
    import json

    from .test_cli_observability import get

    status, body = get(port, "/healthz")
    return status, json.loads(body) if status else {}


def test_cli_worker_per_shard_processes_serve_metrics_and_health_by_shard(
    shards: dict[str, sa.Engine],
) -> None:
    import signal
    import subprocess

    from .test_cli import ROOT, command, environment
    from .test_cli_observability import free_ports, get, sample

    metrics_port, health_port = free_ports(3), free_ports(3)
    flags = [
        f"--shard=a={_url(shards['a'])}",
        f"--shard=b={_url(shards['b'])}",
        f"--shard=down={DEAD_URL}",
        "--metrics-port",
        f"127.0.0.1:{metrics_port}",
        "--health-port",
        f"127.0.0.1:{health_port}",
        "--asyncio",
    ]
    proc = subprocess.Popen(
        command("worker", "tests.app:jobs", *flags, "--name", "p"),
        cwd=ROOT,
        env=environment(),
        stdin=subprocess.DEVNULL,
    )
    try:
        _add(shards["a"], 3)
        _add(shards["b"], 4)
        _wait(lambda: _runs_by_worker(shards["a"]) == {"p@a": 3, "p@b": 4}, timeout=60)
        # Child i serves the i-th shard, on each port + i; the body names it.
        for offset, name in enumerate(["a", "b"]):
            status, report = _health(health_port + offset)
            assert status == 200, report
            assert list(report["shards"]) == [name]
            assert report["shards"][name]["worker"] == f"p@{name}"
        # The down shard's process stays up, and says that its shard cannot be reached.
        _wait(lambda: _health(health_port + 2)[1].get("unreachable") == ["down"])
        status, report = _health(health_port + 2)
        assert status == 200 and report["shards"]["down"]["state"] == "restarting"
        # Every series of a child carries its shard.
        labels = {"queue": "records", "task": "tests.app.record_run"}
        for offset, name, ran in ((0, "a", 3), (1, "b", 4)):
            # The event fires a moment after the handler wrote its row: poll.
            _wait(
                lambda offset=offset, name=name, ran=ran: (
                    sample(
                        get(metrics_port + offset, "/metrics")[1],
                        "sqla_jobs_jobs_succeeded_total",
                        shard=name,
                        **labels,
                    )
                    == ran
                )
            )
            text = get(metrics_port + offset, "/metrics")[1]
            assert sample(text, "sqla_jobs_queue_stats_up", shard=name) == 1
        _wait(lambda: get(metrics_port + 2, "/metrics")[0] == 200)
        down = get(metrics_port + 2, "/metrics")[1]
        assert sample(down, "sqla_jobs_queue_stats_up", shard="down") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_cli_worker_one_process_serves_every_shard_on_one_port(
    shards: dict[str, sa.Engine],
) -> None:
    import signal
    import subprocess

    from .test_cli import ROOT, command, environment
    from .test_cli_observability import free_ports, get, sample

    metrics_port, health_port = free_ports(), free_ports()
    flags = [
        f"--shard=a={_url(shards['a'])}",
        f"--shard=down={DEAD_URL}",
        "--one-process",
        "--metrics-port",
        f"127.0.0.1:{metrics_port}",
        "--health-port",
        f"127.0.0.1:{health_port}",
    ]
    proc = subprocess.Popen(
        command("worker", "tests.app:jobs", *flags, "--name", "one"),
        cwd=ROOT,
        env=environment(),
        stdin=subprocess.DEVNULL,
    )
    try:
        _add(shards["a"], 5)
        _wait(lambda: _runs_by_worker(shards["a"]) == {"one@a": 5}, timeout=60)
        with shards["a"].connect() as conn:
            assert len(set(conn.execute(sa.select(app.Run.pid).distinct()).scalars())) == 1
        _wait(lambda: _health(health_port)[1].get("unreachable") == ["down"])
        status, report = _health(health_port)
        assert status == 200 and report["healthy"] and report["unhealthy"] == []
        assert list(report["shards"]) == ["a", "down"]
        assert report["shards"]["a"]["state"] == "running"
        labels = {"queue": "records", "task": "tests.app.record_run"}
        _wait(
            lambda: (
                sample(get(metrics_port, "/metrics")[1], "sqla_jobs_jobs_succeeded_total", **labels)
                == 5
            )
        )
        status, text = get(metrics_port, "/metrics")
        assert status == 200
        assert sample(text, "sqla_jobs_queue_stats_up", shard="a") == 1
        assert sample(text, "sqla_jobs_queue_stats_up", shard="down") == 0
        assert sample(text, "sqla_jobs_worker_slots_busy", worker="one@down") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_cli_worker_shard_flags_that_do_not_mix(shards: dict[str, sa.Engine]) -> None:
    from .test_cli import in_parallel

    flag = f"--shard=a={_url(shards['a'])}"
    both, alone = in_parallel(
        ("worker", "tests.app:jobs", flag, "--one-process", "--processes", "2"),
        ("worker", "tests.app:jobs", "--one-process", "--database-url", _url(shards["a"])),
    )
    assert both.returncode == 2 and "do not mix" in both.stderr
    assert alone.returncode == 2 and "--one-process is for --shard" in alone.stderr


def test_cli_stats_and_jobs_list_across_shards(shards: dict[str, sa.Engine]) -> None:
    import json

    from .test_cli import in_parallel

    _add(shards["a"], 2)
    _add(shards["b"], 3)
    flags = (f"--shard=a={_url(shards['a'])}", f"--shard=b={_url(shards['b'])}")
    down = f"--shard=down={DEAD_URL}"
    stats, table, listing, failing, both = in_parallel(
        ("stats", "tests.app:jobs", *flags, "--json"),
        ("stats", "tests.app:jobs", *flags),
        ("jobs", "list", "tests.app:jobs", *flags, "--json", "--limit", "4"),
        ("stats", "tests.app:jobs", *flags, down, "--json"),
        ("stats", "tests.app:jobs", *flags, "--database-url", _url(shards["a"])),
    )
    assert stats.returncode == 0, stats.stderr
    out = json.loads(stats.stdout)
    assert [(s["shard"], [q["ready"] for q in s["queues"]]) for s in out["shards"]] == [
        ("a", [2]),
        ("b", [3]),
    ]
    assert [(q["queue"], q["ready"]) for q in out["queues"]] == [("records", 5)]
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split()[:2] == ["SHARD", "QUEUE"]
    assert [line.split()[:3] for line in lines[2:]] == [
        ["a", "records", "active"],
        ["b", "records", "active"],
        ["*", "records", "active"],
    ]
    assert listing.returncode == 0, listing.stderr
    found = json.loads(listing.stdout)
    assert len(found) == 4 and {j["shard"] for j in found} == {"a", "b"}
    assert failing.returncode == 1
    assert "shard down: " in failing.stderr
    assert [q["ready"] for q in json.loads(failing.stdout)["queues"]] == [5]
    assert both.returncode == 2 and "not both" in both.stderr


# -- the dashboard ------------------------------------------------------------------------


def test_dashboard_over_shards(shards: dict[str, sa.Engine], jobs: Jobs) -> None:
    import re

    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    @jobs.task(queue="mail")
    def send(to: str) -> None: ...

    with shards["a"].begin() as conn:
        jobs.enqueue_many(conn, send, [{"to": "x"}] * 2)
    with shards["b"].begin() as conn:
        jobs.enqueue_many(conn, send, [{"to": "only-in-b"}] * 3)
    dashboard = create_app(jobs, engines={**shards, "down": DEAD_URL})
    outer = Starlette(routes=[Mount("/ops", dashboard)])
    with TestClient(outer, base_url="http://localhost") as client:
        page = client.get("/ops/")
        assert page.status_code == 200
        text = page.text
        cells = re.findall(r'<td class="num ?">(\d+)</td>', text)
        assert cells.count("2") >= 1 and cells.count("3") >= 1
        assert 'href="/ops/shards/a/"' in text and 'href="/ops/shards/b/"' in text
        assert "cannot be reached" in text
        assert '<th class="num">5</th>' in text  # ready, summed
        b_jobs = client.get("/ops/shards/b/jobs")
        assert b_jobs.status_code == 200
        assert "only-in-b" in b_jobs.text
        assert 'href="/ops/">All shards' in b_jobs.text
        assert "only-in-b" not in client.get("/ops/shards/a/jobs").text
        assert client.get("/ops/shards/down/").status_code == 503
    with pytest.raises(ValueError, match="not both"):
        create_app(jobs, shards["a"], engines=shards)
    with pytest.raises(ValueError, match="shard name"):
        create_app(jobs, engines={"a/b": shards["a"]})


def test_cli_web_over_shards(shards: dict[str, sa.Engine]) -> None:
    import socket
    import subprocess

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from .test_cli import ROOT, command, environment

    _add(shards["b"], 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--shard=a={_url(shards['a'])}", f"--shard=b={_url(shards['b'])}"]
    proc = subprocess.Popen(
        command("web", "tests.app:jobs", *flags, "--port", str(port)),
        cwd=ROOT,
        env=environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stderr.read() if proc.stderr else "") from None
                time.sleep(0.1)
        assert page.status_code == 200
        assert 'href="/shards/a/"' in page.text and 'href="/shards/b/"' in page.text
        b_jobs = httpx.get(f"http://127.0.0.1:{port}/shards/b/jobs", timeout=5)
        assert b_jobs.status_code == 200 and "tests.app.record_run" in b_jobs.text
    finally:
        proc.terminate()
        proc.wait(10)


def test_order_per_key_holds_in_each_shard(shards: dict[str, sa.Engine]) -> None:
    """``key_order="fifo"`` on a sharded application: a key's jobs follow their rows into
    one shard, and there they start in id order, one at a time, with one ShardedWorker of
    16 slots serving both shards; the same key name in two shards is two keys, which run
    side by side (each shard's claim sees its own table only)."""
    jobs = Jobs(app.Job)
    jobs.queue("ledger", key_order="fifo")
    lock = threading.Lock()
    runs: list[tuple[str, str, int, float, float]] = []

    @jobs.task(queue="ledger", concurrency_key=lambda account, **_: account)
    def post(shard: str, account: str, seq: int) -> None:
        start = time.monotonic()
        time.sleep(0.002)  # the handler's work: long enough for two runs of a key to overlap
        with lock:
            runs.append((shard, account, seq, start, time.monotonic()))

    for name, engine in shards.items():
        with engine.begin() as conn:
            # Five keys interleaved; a key's jobs in its sequence's order (ids follow).
            rows = [{"shard": name, "account": f"k{i % 5}", "seq": i // 5} for i in range(100)]
            jobs.enqueue_many(conn, post, rows)
    worker = ShardedWorker(jobs, shards, concurrency=16, name="w")
    assert worker.run_until_empty(timeout=60) == {"a": 100, "b": 100}
    by_key: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for shard, account, seq, start, end in runs:
        by_key.setdefault((shard, account), []).append((start, end, seq))
    assert len(by_key) == 10
    for key, spans in by_key.items():
        spans.sort()
        assert [seq for *_, seq in spans] == list(range(20)), key
        assert all(end <= nxt for (_, end, _), (nxt, _, _) in itertools.pairwise(spans)), key
