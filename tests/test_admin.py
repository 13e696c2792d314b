"""``sqla_jobs.admin``: stats, listing, retry, cancel, purge and pausing, on a real
PostgreSQL, checked against the claim/complete statements the workers use."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, admin
from sqla_jobs._queries import interval

from . import app
from .helpers import count


def add(engine: sa.Engine, n: int = 1, **values: Any) -> list[int]:
    """Insert ``n`` job rows directly (any status), returning their ids."""
    row = {"task": "t", "queue": "q", **values}
    with engine.begin() as conn:
        return list(
            conn.execute(sa.insert(app.Job).values([row] * n).returning(app.Job.id)).scalars()
        )


def claim(engine: sa.Engine, jobs: Jobs, queue: str = "q") -> Any:
    with engine.begin() as conn:
        return conn.execute(
            jobs.queries.claim,
            {"queue_name": queue, "limit": 1, "lease": interval(30), "worker": "w"},
        ).one()


def fail(engine: sa.Engine, jobs: Jobs, job: Any, *, permanent: bool = True) -> None:
    with engine.begin() as conn:
        conn.execute(
            jobs.queries.fail,
            {
                "job_id": job.id,
                "attempt": job.attempts,
                "error": "Traceback ...\nValueError: boom",
                "delay": interval(0),
                "permanent": permanent,
            },
        )


def job(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(app.Job.__table__).where(app.Job.id == job_id)).one()


@pytest.fixture
def listening(database_url: str, jobs: Jobs) -> Callable[[], Any]:
    """Start a connection LISTENing on the table's channel, as an idle worker would.

    Started by the test once its rows are in place, so that the INSERT trigger's own
    notifications are not heard.
    """

    @contextlib.contextmanager
    def listen() -> Iterator[psycopg.Connection[Any]]:
        url = sa.make_url(database_url).set(drivername="postgresql")
        dsn = url.render_as_string(hide_password=False)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'LISTEN "{jobs.queries.channel}"')
            yield conn

    return listen


def payloads(conn: psycopg.Connection[Any], expected: int) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + 5
    while len(got) < expected and time.monotonic() < deadline:
        got.extend(n.payload for n in conn.notifies(timeout=0.2))
    got.extend(n.payload for n in conn.notifies(timeout=0.05))  # and nothing more
    return sorted(got)


def test_stats_per_queue(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="idle")
    def nothing() -> None: ...

    with db.begin() as conn:
        conn.execute(sa.text("SELECT 1"))
    add(db, 3, run_at=sa.func.now() - timedelta(seconds=30))
    add(db, 1)  # ready, due now
    add(db, 2, status="scheduled", run_at=sa.func.now() + timedelta(hours=1))
    add(db, 1, status="running", attempts=1, locked_until=sa.func.now() + timedelta(minutes=1))
    add(db, 1, status="running", attempts=1, locked_until=sa.func.now() - timedelta(minutes=1))
    add(db, 2, status="dead", attempts=5, finished_at=sa.func.now())
    add(db, 1, status="dead", attempts=5, finished_at=sa.func.now() - timedelta(hours=1))
    add(db, 1, status="cancelled", finished_at=sa.func.now())
    add(db, 4, status="done", attempts=1, finished_at=sa.func.now())
    add(db, 1, queue="other", status="dead", finished_at=sa.func.now())
    with db.begin() as conn:
        admin.pause_queue(conn, jobs, "held")

    with db.connect() as conn:
        by_queue = {s.queue: s for s in admin.queue_states(conn, jobs)}
        kept = Jobs(app.Job, keep_done=timedelta(days=1))
        with_done = {s.queue: s for s in admin.queue_states(conn, kept, window=60)}
        from_model = {s.queue: s for s in admin.queue_states(conn, app.Job)}

    assert sorted(by_queue) == ["held", "idle", "other", "q"]
    q = by_queue["q"]
    assert (q.ready, q.scheduled, q.running, q.lease_expired) == (4, 2, 2, 1)
    assert (q.dead, q.cancelled, q.done, q.dead_recent) == (3, 1, 4, 2)
    assert q.lag_seconds is not None and 29 <= q.lag_seconds < 120
    assert not q.paused
    # Finished jobs are deleted by default: no row is left to count, so it is unknown.
    assert q.done_recent is None and from_model["q"].done_recent is None
    assert with_done["q"].done_recent == 4
    assert by_queue["held"].paused and by_queue["held"].ready == 0
    assert by_queue["idle"].lag_seconds is None and by_queue["idle"].ready == 0
    assert by_queue["other"].lag_seconds is None and by_queue["other"].dead == 1
    assert "idle" not in from_model, "only the registry knows its tasks' queues"
    assert q.to_dict()["lease_expired"] == 1


def test_the_0_2_read_names_warn_and_answer_as_their_replacements(
    db: sa.Engine, jobs: Jobs
) -> None:
    """``admin.stats``, ``admin.overview``, ``QueueStats``, ``QueueSummary``,
    ``QueueState.expired`` and ``sharding.stats`` stay for one release: each warns, naming
    its replacement, and gives what the replacement gives."""
    from sqla_jobs import sharding

    add(db, 3)
    add(db, 1, status="running", attempts=1, locked_until=sa.func.now() - timedelta(minutes=1))
    with db.connect() as conn:
        full = admin.queue_states(conn, jobs)
        live = admin.queue_states(conn, jobs, finished=False)
        with pytest.warns(DeprecationWarning, match="use admin.queue_states"):
            assert admin.stats(conn, jobs) == full
        with pytest.warns(DeprecationWarning, match="finished=False"):
            assert admin.overview(conn, jobs) == live
    with pytest.warns(DeprecationWarning, match="QueueState"):
        assert admin.QueueStats is admin.QueueState
    with pytest.warns(DeprecationWarning, match="QueueState"):
        assert admin.QueueSummary is admin.QueueState
    (q,) = (s for s in live if s.queue == "q")
    with pytest.warns(DeprecationWarning, match="lease_expired"):
        assert q.expired == q.lease_expired == 1
    with pytest.warns(DeprecationWarning, match="sharding.queue_states"):
        (old,) = sharding.stats({"one": db}, jobs)
    (new,) = sharding.queue_states({"one": db}, jobs)
    assert old.shard == new.shard == "one" and old.value and new.value

    # Read a moment apart: the lag grew in between, everything else is the same.
    def unlagged(states: list[admin.QueueState]) -> list[admin.QueueState]:
        return [dataclasses.replace(s, lag_seconds=None) for s in states]

    assert unlagged(old.value) == unlagged(new.value)


def test_list_and_get_jobs(db: sa.Engine, jobs: Jobs) -> None:
    ready = add(db, 3)
    dead = add(db, 2, status="dead", task="other", last_error="boom", finished_at=sa.func.now())
    add(db, 1, queue="elsewhere")
    with db.connect() as conn:
        assert [j.id for j in admin.list_jobs(conn, jobs, queue="q")] == [*dead[::-1], *ready[::-1]]
        assert [j.id for j in admin.list_jobs(conn, jobs, status="dead")] == dead[::-1]
        assert [j.id for j in admin.list_jobs(conn, app.Job, task=["other"], limit=1)] == [dead[1]]
        both = admin.list_jobs(conn, jobs, status=["ready", "dead"], queue=["q"], task="t")
        assert [j.id for j in both] == ready[::-1]
        found = admin.get_job(conn, jobs, dead[0])
        assert found is not None and found.last_error == "boom" and found.status == "dead"
        assert found.to_dict()["finished_at"].endswith("+00:00")
        assert admin.get_job(conn, jobs, 999) is None
        with pytest.raises(ValueError, match="unknown status 'deadd'"):
            admin.list_jobs(conn, jobs, status="deadd")


def test_retry_keeps_attempts_grants_one_more_and_wakes_workers(
    db: sa.Engine, jobs: Jobs, listening: Any
) -> None:
    [job_id] = add(db, max_attempts=1)
    first = claim(db, jobs)
    fail(db, jobs, first, permanent=False)
    before = job(db, job_id)
    assert (before.status, before.attempts, before.max_attempts) == ("dead", 1, 1)

    with listening() as listener:
        with db.begin() as conn:
            assert admin.retry_jobs(conn, jobs, [job_id], dry_run=True) == 1
            assert admin.retry_jobs(conn, jobs, [job_id]) == 1
        assert payloads(listener, 1) == ["q"]
    after = job(db, job_id)
    assert (after.status, after.attempts, after.max_attempts) == ("ready", 1, 2)
    assert after.finished_at is None and after.locked_by is None
    assert after.last_error == before.last_error, "the error stays until the next attempt"
    assert after.run_at > before.run_at

    # The old claim's late completion matches nothing; the new claim is attempt 2.
    with db.begin() as conn:
        stale = {"ids": [job_id], "attempt_list": [1]}
        assert conn.execute(jobs.queries.complete, stale).all() == []
    second = claim(db, jobs)
    assert second.attempts == 2
    with db.begin() as conn:
        assert conn.execute(jobs.queries.complete, {"ids": [job_id], "attempt_list": [2]}).all()
    assert count(db) == 0


def test_retry_selects_dead_and_cancelled_only(db: sa.Engine, jobs: Jobs) -> None:
    dead = add(db, 2, status="dead", attempts=5, max_attempts=5, finished_at=sa.func.now())
    cancelled = add(db, 1, status="cancelled", finished_at=sa.func.now())
    other = add(db, 1, status="dead", queue="other", finished_at=sa.func.now())
    add(db, 2)  # ready: never touched
    with db.begin() as conn:
        with pytest.raises(ValueError, match="select the jobs"):
            admin.retry_jobs(conn, jobs)
        with pytest.raises(ValueError, match="retry applies to dead, cancelled jobs"):
            admin.retry_jobs(conn, jobs, status="ready")
        assert admin.retry_jobs(conn, jobs, queue="q", status="cancelled") == 1
        assert admin.retry_jobs(conn, jobs, queue="q") == 2
        assert admin.retry_jobs(conn, jobs, all_jobs=True) == 1
    assert {job(db, i).status for i in dead + cancelled + other} == {"ready"}
    assert job(db, dead[0]).max_attempts == 6
    assert count(db, status="ready") == 6


def test_a_job_cancelled_while_it_ran_is_retried_once_its_lease_has_passed(
    db: sa.Engine, jobs: Jobs
) -> None:
    """A cancel does not stop a running handler (a thread cannot be stopped), so the job
    keeps its lease, no longer renewed, and a retry before it passes would run the job a
    second time beside it: the retry skips it and says why. Found by an audit, which saw
    attempt 2 start while attempt 1 still ran."""
    [job_id] = add(db)
    claimed = claim(db, jobs)
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, [claimed.id]) == 1
    row = job(db, job_id)
    assert row.status == "cancelled" and row.locked_until is not None
    with db.begin() as conn:
        assert admin.retry_jobs(conn, jobs, [job_id]) == 0
        report = admin.act(conn, jobs, "retry", admin.Selection(ids=[job_id]))
    assert report.acted == () and "its handler may still be running" in report.skipped[0][1]
    assert job(db, job_id).status == "cancelled"
    with db.begin() as conn:  # the lease passes
        conn.execute(
            sa.update(app.Job)
            .where(app.Job.id == job_id)
            .values(locked_until=sa.func.now() - sa.text("interval '1 second'"))
        )
        assert admin.retry_jobs(conn, jobs, [job_id]) == 1
    assert job(db, job_id).status == "ready"
    # A job cancelled before it ran has no lease to wait for.
    [waiting] = add(db)
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, [waiting]) == 1
        assert job(db, waiting).locked_until is None
        assert admin.retry_jobs(conn, jobs, [waiting]) == 1


@pytest.mark.parametrize("how", ["dead by its lease", "ready"])
def test_purging_a_parent_that_did_not_succeed_settles_its_children(
    Session: Any, db: sa.Engine, jobs: Jobs, how: str
) -> None:
    """A purged parent will never succeed: what waits on it is cancelled, as a cancel
    does. A parent that died by its lease leaves its children to retention, and a ready one
    never got to settle them; purged first, their children waited forever (an audit)."""

    @jobs.task(queue="flow", max_attempts=1)
    def step() -> None: ...

    with Session.begin() as session:
        a = session.enqueue(step)
        b = session.enqueue(step.with_options(after=[a]))
        session.flush()
        a_id, b_id = a.id, b.id
    if how == "dead by its lease":
        claimed = claim(db, jobs, "flow")
        assert claimed.id == a_id
        with db.begin() as conn:
            conn.execute(
                sa.update(app.Job)
                .where(app.Job.id == a_id)
                .values(locked_until=sa.func.now() - sa.text("interval '1 minute'"))
            )
            conn.execute(jobs.queries.rescue, {"limit": 10}).all()
        assert job(db, a_id).status == "dead"
    with db.begin() as conn:
        status = "dead" if how == "dead by its lease" else "ready"
        assert admin.purge_jobs(conn, jobs, [a_id], status=status) == 1
    child = job(db, b_id)
    assert child.status == "cancelled" and f"job {a_id}" in child.last_error


def test_retry_respects_unique_keys(db: sa.Engine, jobs: Jobs) -> None:
    older, newer = add(db, 2, status="dead", unique_key="k1", finished_at=sa.func.now())
    [blocked] = add(db, status="dead", unique_key="k2", finished_at=sa.func.now())
    add(db, unique_key="k2")  # a live job holds k2
    with db.begin() as conn:
        # (Any iterable of ids will do, a generator included.)
        assert admin.retry_jobs(conn, jobs, (i for i in (older, newer, blocked))) == 1
    assert job(db, newer).status == "ready"
    assert job(db, older).status == job(db, blocked).status == "dead"


def test_cancel_ready_scheduled_and_running(db: sa.Engine, jobs: Jobs, listening: Any) -> None:
    [ready, running] = add(db, 2)
    [scheduled] = add(db, status="scheduled", run_at=sa.func.now() + timedelta(hours=1))
    [dead] = add(db, status="dead", finished_at=sa.func.now())
    claimed = claim(db, jobs)
    assert claimed.id == ready
    with listening() as listener:
        with db.begin() as conn:
            assert admin.cancel_jobs(conn, jobs, [scheduled, dead]) == 1
        assert payloads(listener, 0) == [], "no running job was cancelled: no one to tell"
        with db.begin() as conn:
            with pytest.raises(ValueError, match="cancel applies to"):
                admin.cancel_jobs(conn, jobs, status="dead")
            assert admin.cancel_jobs(conn, jobs, queue="q", dry_run=True) == 2
            assert admin.cancel_jobs(conn, jobs, queue="q") == 2
        # Workers are asked to heartbeat now.
        assert payloads(listener, 1) == ["!cancel"]
    for i in (ready, running, scheduled):
        row = job(db, i)
        assert row.status == "cancelled" and row.finished_at is not None
        # The claimed one keeps its lease, no longer renewed (a retry waits for it).
        assert (row.locked_until is not None) is (i == claimed.id)
    assert job(db, dead).status == "dead"
    # The running worker's heartbeat and completion match nothing.
    params = {"ids": [claimed.id], "attempt_list": [claimed.attempts]}
    with db.begin() as conn:
        assert conn.execute(jobs.queries.heartbeat, {**params, "lease": interval(30)}).all() == []
        assert conn.execute(jobs.queries.complete, params).all() == []
    assert job(db, claimed.id).status == "cancelled"


def test_purge(db: sa.Engine, jobs: Jobs) -> None:
    old_dead = add(db, 2, status="dead", finished_at=sa.func.now() - timedelta(days=10))
    new_dead = add(db, 1, status="dead", finished_at=sa.func.now())
    done = add(db, 1, status="done", finished_at=sa.func.now())
    ready = add(db, 2)
    add(db, 1, status="running", attempts=1, locked_until=sa.func.now())
    with db.begin() as conn:
        with pytest.raises(ValueError, match="refusing to purge running jobs"):
            admin.purge_jobs(conn, jobs, status="running")
        with pytest.raises(ValueError, match="select the jobs"):
            admin.purge_jobs(conn, jobs)
        assert admin.purge_jobs(conn, jobs, older_than=timedelta(days=7), dry_run=True) == 2
        assert admin.purge_jobs(conn, jobs, older_than=timedelta(days=7)) == 2
        # IDs of live jobs are left alone unless their status is named.
        assert admin.purge_jobs(conn, jobs, [*new_dead, *ready]) == 1
        assert admin.purge_jobs(conn, jobs, ready[:1], status="ready") == 1
        assert admin.purge_jobs(conn, jobs, all_jobs=True) == len(done)
    with db.connect() as conn:
        left = admin.list_jobs(conn, jobs)
    assert sorted(r.status for r in left) == ["ready", "running"]
    assert not set(old_dead) & {r.id for r in left}


def test_pause_resume_and_list_queues(
    Session: Any, jobs: Jobs, listening: Any, db: sa.Engine
) -> None:
    @jobs.task(queue="mail")
    def send() -> None: ...

    add(db, 1, queue="q")
    # A Session works as well as a Connection, and nothing commits behind the caller.
    with Session() as session:
        admin.pause_queue(session, jobs, "mail")
        admin.pause_queue(session, jobs, "mail")  # idempotent
        admin.pause_queue(session, jobs, "future")
        assert admin.paused_queues(session, jobs) == {"mail", "future"}
        session.rollback()
    with Session.begin() as session:
        admin.pause_queue(session, jobs, "mail")
    with db.begin() as conn:
        assert admin.paused_queues(conn, app.Job) == {"mail"}
        queues = {q.name: q for q in admin.list_queues(conn, jobs)}
        assert sorted(queues) == ["mail", "q"]
        assert queues["mail"].paused and queues["mail"].updated_at is not None
        assert not queues["q"].paused and queues["q"].updated_at is None
        with pytest.raises(ValueError, match="queue name"):
            admin.pause_queue(conn, jobs, "")
    with listening() as listener:
        with db.begin() as conn:
            admin.resume_queue(conn, jobs, "mail")
        assert payloads(listener, 1) == ["mail"], "resuming wakes the queue's idle workers"
    with db.connect() as conn:
        assert admin.paused_queues(conn, jobs) == set()
        assert [q.to_dict()["paused"] for q in admin.list_queues(conn, jobs)] == [False, False]


def test_actions_skip_jobs_that_moved_on_since_they_were_seen(db: sa.Engine, jobs: Jobs) -> None:
    from sqla_jobs.admin import SeenJob

    table = jobs.table
    with db.begin() as conn:
        ids = [
            conn.execute(
                sa.insert(table)
                .values(task="t", status="dead", attempts=2, unique_key=key)
                .returning(table.c.id)
            ).scalar_one()
            for key in (None, None, "k")
        ]
        # A live twin holds the unique key of the third.
        conn.execute(sa.insert(table).values(task="t", status="ready", unique_key="k"))
    a, b, keyed = ids
    with db.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == b).values(attempts=3))
        seen = [SeenJob(a, 2, "dead"), SeenJob(b, 2, "dead"), SeenJob(keyed, 2, "dead")]
        assert admin.retry_jobs(conn, jobs, seen=seen, dry_run=True) == 1
        # a listed twice (seen at two moments): acted on once, counted once.
        report = admin.act(
            conn, jobs, "retry", [*seen, SeenJob(10**9, 1, "dead"), SeenJob(a, 1, "dead")]
        )
    assert report.acted == (a,) and report.count == 1
    assert dict(report.skipped) == {
        b: "it changed: now dead, attempt 3",
        keyed: "a live job holds its unique key",
        10**9: "it no longer exists",
    }
    with db.begin() as conn, pytest.raises(ValueError, match="give ids or seen"):
        admin.cancel_jobs(conn, jobs, [a], seen=[SeenJob(a, 2, "ready")])
    # up_to_id leaves out what was enqueued after a count.
    with db.begin() as conn:
        newer = conn.execute(
            sa.insert(table).values(task="t", status="dead").returning(table.c.id)
        ).scalar_one()
        assert admin.purge_jobs(conn, jobs, status="dead", up_to_id=newer - 1) == 2
        assert admin.get_job(conn, jobs, newer) is not None


def test_run_schedule_needs_the_registry_and_a_schedule(db: sa.Engine, jobs: Jobs) -> None:
    with db.begin() as conn:
        with pytest.raises(TypeError, match="needs the Jobs registry"):
            admin.run_schedule(conn, jobs.table, "x")  # type: ignore[arg-type]
        with pytest.raises(LookupError, match="no schedule named 'x'"):
            admin.run_schedule(conn, jobs, "x")


def test_a_retry_racing_an_uncommitted_twin_skips_the_job(db: sa.Engine, jobs: Jobs) -> None:
    """A retry leaves a dead unique job alone while a live job holds its key; a twin
    enqueued but not yet committed is invisible to that test, and the UPDATE waited on
    its key and raised ``IntegrityError`` when it committed. It is now left alone."""
    import threading

    from .helpers import wait_for

    table = app.Job.__table__

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None: ...

    with db.begin() as conn:
        dead = conn.execute(
            sa.insert(table)
            .values(
                task=refresh.name,
                queue="q",
                args={"user_id": 1},
                status="dead",
                unique_key="k",
                attempts=1,
                finished_at=sa.func.now(),
            )
            .returning(table.c.id)
        ).scalar_one()
    out: dict[str, Any] = {}

    def retry() -> None:
        try:
            with db.begin() as conn:
                out["pid"] = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
                out["report"] = admin.retry_report(conn, jobs, [dead])
        except BaseException as exc:
            out["error"] = exc

    with db.connect() as producer:
        producer.begin()
        twin = jobs.enqueue(producer, refresh, 1, unique_key="k")
        thread = threading.Thread(target=retry)
        thread.start()
        wait_for(lambda: "pid" in out)

        def waiting() -> bool:  # the retry's UPDATE waits on the twin's key
            with db.connect() as conn:
                event = conn.execute(
                    sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": out["pid"]},
                ).scalar()
            return bool(event == "Lock")

        wait_for(waiting)
        producer.commit()
    thread.join(10)
    assert "error" not in out, out.get("error")
    assert out["report"].acted == ()
    with db.connect() as conn:
        statuses = dict(conn.execute(sa.select(table.c.id, table.c.status)).all())
    assert statuses == {dead: "dead", twin: "ready"}


def test_actions_take_more_ids_than_a_statement_takes_parameters(db: sa.Engine, jobs: Jobs) -> None:
    """An incident's 70,000 dead jobs retried, then purged, by id: each id was a bind
    parameter (twice in a retry), past the 65,535 PostgreSQL takes in one statement. And
    as many jobs as seen (``act`` with their attempts and status) alike."""
    from . import app

    table = f'"{app.SCHEMA}".jobs'
    with db.begin() as conn:
        ids = list(
            conn.execute(
                sa.text(
                    f"INSERT INTO {table} (queue, task, args, status, attempts, finished_at) "
                    "SELECT 'q', 't', '{}', 'dead', 1, now() FROM generate_series(1, 70000) "
                    "RETURNING id"
                )
            ).scalars()
        )
    with db.begin() as conn:
        assert admin.retry_jobs(conn, jobs, ids) == 70_000
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids) == 70_000
    seen = [admin.SeenJob(i, 1, "cancelled") for i in ids]
    with db.begin() as conn:
        report = admin.act(conn, jobs, "purge", admin.Selection(seen=seen))
    assert report.count == 70_000
    with db.connect() as conn:
        assert not conn.execute(sa.select(app.Job.id)).first()


def test_an_action_on_seen_jobs_does_not_follow_stale_statistics(db: sa.Engine, jobs: Jobs) -> None:
    """30,000 ready jobs cancelled since the table was last analysed (its statistics say no job
    is cancelled), then purged as seen: the guard on what was seen was a join whose plan
    followed those statistics, scanning the whole seen list for every row; the purge ran
    for minutes (here: past its statement timeout). Now each row looks itself up."""
    from . import app

    table = f'"{app.SCHEMA}".jobs'
    with db.begin() as conn:
        ids = list(
            conn.execute(
                sa.text(
                    f"INSERT INTO {table} (queue, task, args, status, attempts, finished_at) "
                    "SELECT 'q', 't', '{}', 'ready', 0, NULL FROM generate_series(1, 30000) "
                    "RETURNING id"
                )
            ).scalars()
        )
        conn.execute(sa.text(f"ANALYZE {table}"))
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids) == 30_000
    seen = [admin.SeenJob(i, 0, "cancelled") for i in ids]
    with db.begin() as conn:
        conn.execute(sa.text("SET LOCAL statement_timeout = '10s'"))
        report = admin.act(conn, jobs, "purge", admin.Selection(seen=seen))
    assert report.count == 30_000
