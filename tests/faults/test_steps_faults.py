"""Durable steps through faults: worker processes SIGKILLed over and over while they drain
1,000 jobs of three steps each; sleeping and waiting jobs through a PostgreSQL stopped
with ``-m immediate``; and signals whose transaction never commits.

What a step did is read from three places, none of them the library's own records (which
are overwritten in place and pruned once the job is gone):

* ``step_execs``: every execution of a step's function, a row committed at its start and
  its end stamped when it returns (through the recorder's own connection);
* ``step_effects``: the write of the transactional step, in the step's session;
* ``step_checkpoints``: every row version written to ``jobs_steps``, by a trigger (so only
  what committed: a checkpoint rolled back with its transaction leaves nothing).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import figures, live_jobs, poll_until, scalar, status_counts, wait_until
from .pg import CrashablePostgres
from .workers import KillStorm, WorkerGroup

pytestmark = pytest.mark.faults

LEASE = 2.0

# -- reading what happened ---------------------------------------------------------------


def table(engine: sa.Engine, model: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(model.__table__).order_by(model.id)))


def job_ids(engine: sa.Engine, task: Any) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(app.Job.id).where(app.Job.task == task.name).order_by(app.Job.id)
            ).scalars()
        )


def histories(engine: sa.Engine) -> dict[tuple[int, str], list[Any]]:
    """Per (job, step name), the committed versions of its record, oldest first."""
    found: dict[tuple[int, str], list[Any]] = defaultdict(list)
    for row in table(engine, app.StepCheckpoint):
        found[(row.job_id, row.name)].append(row)
    return found


def execs_by_step(engine: sa.Engine) -> dict[tuple[int, str], list[Any]]:
    """Per (job, step), the executions of its function, in the order they started."""
    found: dict[tuple[int, str], list[Any]] = defaultdict(list)
    for row in sorted(table(engine, app.StepExec), key=lambda r: r.started):
        found[(row.job_id, row.step)].append(row)
    return found


SUSPENDED = """
    SELECT count(*) FROM faults.jobs j JOIN faults.jobs_steps s ON s.job_id = j.id
    WHERE j.status = 'scheduled' AND s.state IN ('sleeping', 'waiting')
    AND j.id = ANY(:ids)
"""


def suspended(engine: sa.Engine, ids: list[int]) -> int:
    """How many of the jobs ``ids`` are suspended (scheduled, in a sleep or a wait)."""
    return int(scalar(engine, SUSPENDED, ids=ids))


# -- 1. a kill storm during steps -----------------------------------------------------------

KILL_JOBS = 1_000
KILL_WORKERS = 4
STEP_S = 0.005
THREE = ("prepare", "book", "finish")
#: A kill explains a repeated execution if it came at most this long after the execution
#: was last seen alive (its function's start, or its end when it returned): a 5 ms step
#: and its checkpoint's round trip, on a machine loaded by 32 handler threads.
CUT_WITHIN = 1.0
#: The storm reads its clock just before it sends SIGKILL: the process may read its own
#: a moment later, before the signal lands.
CLOCK_SLACK = 0.05


@dataclass
class StepAnalysis:
    """What the executions, effects and checkpoints of the three-step jobs say."""

    #: Executions per step, and those cut by a kill: inside the function (no end), or
    #: after it returned and before its checkpoint committed (an end, no checkpoint).
    executions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(THREE, 0))
    cut_inside: dict[str, int] = field(default_factory=lambda: dict.fromkeys(THREE, 0))
    cut_before_checkpoint: dict[str, int] = field(default_factory=lambda: dict.fromkeys(THREE, 0))
    #: Each a list of readable findings; all empty if the promises held.
    not_checkpointed_once: list[Any] = field(default_factory=list)
    bad_checkpoint: list[Any] = field(default_factory=list)
    ran_after_checkpoint: list[Any] = field(default_factory=list)
    unexplained: list[Any] = field(default_factory=list)
    same_attempt_twice: list[Any] = field(default_factory=list)
    effects_not_once: list[Any] = field(default_factory=list)
    bad_effect: list[Any] = field(default_factory=list)
    #: For each execution cut by a kill: seconds from the last it was seen alive (its
    #: end, or its start) to its process's SIGKILL.
    kill_gaps: list[float] = field(default_factory=list)
    max_attempt: int = 0


def analyse_steps(
    ids: list[int],
    execs: dict[tuple[int, str], list[Any]],
    done: dict[tuple[int, str], list[Any]],
    effects: dict[int, list[Any]],
    killed_at: dict[int, float],
) -> StepAnalysis:
    """Per job and step: the step's record was checkpointed done exactly once, by an
    execution that returned, and nothing executed it after that. Every other execution
    of it was cut by a SIGKILL of the process that ran it: that process was killed while
    the step was under way (within ``CUT_WITHIN`` of the execution's start, or of its
    end before the checkpoint), before the next execution started, and its attempt went
    no further (nothing of the job ran in that attempt after it). The transactional
    step's write exists exactly once, the one its checkpoint names, made by the attempt
    that checkpointed it, with the result of the step before it as that attempt got it."""
    a = StepAnalysis()
    per_attempt: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for (job_id, _step), rows in execs.items():
        for r in rows:
            per_attempt[(job_id, r.attempt)].append(r)
    last_of_attempt = {
        key: max(rows, key=lambda r: r.started).id for key, rows in per_attempt.items()
    }
    for job_id in ids:
        for step in THREE:
            mine = execs.get((job_id, step), [])
            a.executions[step] += len(mine)
            attempts = [r.attempt for r in mine]
            if len(set(attempts)) != len(attempts):
                a.same_attempt_twice.append((job_id, step, attempts))
            records = done.get((job_id, step), [])
            if len(records) != 1:
                a.not_checkpointed_once.append(
                    (job_id, step, [(r.attempt, r.result) for r in records])
                )
                continue
            record = records[0]
            a.max_attempt = max(a.max_attempt, record.attempt)
            chosen = [r for r in mine if r.id == record.result.get("exec")]
            if not chosen or chosen[0].ended is None or chosen[0].attempt != record.attempt:
                a.bad_checkpoint.append((job_id, step, record.attempt, record.result, chosen))
                continue
            at = mine.index(chosen[0])
            if at != len(mine) - 1:
                a.ran_after_checkpoint.append((job_id, step, [(r.attempt, r.pid) for r in mine]))
            for r, after in itertools.pairwise(mine[: at + 1]):
                kill = killed_at.get(r.pid)
                # The last the execution was seen alive: its end, or else its start.
                seen = r.started if r.ended is None else r.ended
                gap = None if kill is None else kill - seen
                if (
                    gap is None
                    or not -CLOCK_SLACK <= gap <= CUT_WITHIN
                    or kill > after.started
                    or last_of_attempt[(job_id, r.attempt)] != r.id
                ):
                    a.unexplained.append((job_id, step, r.attempt, r.pid, r.ended is not None, gap))
                    continue
                a.kill_gaps.append(gap)
                if r.ended is None:
                    a.cut_inside[step] += 1
                else:
                    a.cut_before_checkpoint[step] += 1
        mine_effects = effects.get(job_id, [])
        if len(mine_effects) != 1:
            a.effects_not_once.append((job_id, [(e.attempt, e.pid) for e in mine_effects]))
            continue
        effect = mine_effects[0]
        book = done.get((job_id, "book"), [])
        prepare = done.get((job_id, "prepare"), [])
        if (len(book), len(prepare)) != (1, 1):
            continue  # told above
        if (
            effect.id != book[0].result.get("effect")
            or effect.attempt != book[0].attempt
            or effect.prepared != prepare[0].result.get("exec")
        ):
            a.bad_effect.append((job_id, effect, book[0].result, prepare[0].result))
    return a


def test_kill_storm_during_steps(
    faults_db: sa.Engine, FaultsSession: Any, workers: Callable[..., WorkerGroup]
) -> None:
    """1,000 jobs of three steps of about 5 ms each (ordinary, transactional, ordinary),
    drained by four workers of which one is SIGKILLed and replaced every 0.5-1 s: every
    job finishes; every step is checkpointed once, and an ordinary step runs again only
    where a kill cut its earlier execution (inside its function, or between its return
    and its checkpoint); every transactional step's write exists exactly once."""
    with FaultsSession.begin() as session:
        session.enqueue_many(
            app.steps_three, [{"i": i, "seconds": STEP_S} for i in range(KILL_JOBS)]
        )
    ids = job_ids(faults_db, app.steps_three)
    assert len(ids) == KILL_JOBS

    group = workers(queues=["steps"], concurrency=8, lease=LEASE, poll_interval=0.2)
    started = time.monotonic()
    group.start(KILL_WORKERS)
    with KillStorm(group, every=(0.5, 1.0)) as storm:
        wait_until(
            lambda: live_jobs(faults_db) == 0,
            timeout=120,
            interval=0.1,
            what="the three-step jobs drain through the kill storm",
        )
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()

    left = status_counts(faults_db)
    execs = execs_by_step(faults_db)
    done: dict[tuple[int, str], list[Any]] = {
        key: [r for r in rows if r.kind == "run" and r.state == "done"]
        for key, rows in histories(faults_db).items()
    }
    effects: dict[int, list[Any]] = defaultdict(list)
    for e in table(faults_db, app.StepEffect):
        effects[e.job_id].append(e)
    killed_at = {
        p.pid: p.killed_at for p in group.all if p.pid in group.killed and p.killed_at is not None
    }
    a = analyse_steps(ids, execs, done, effects, killed_at)
    cut = sum(a.cut_inside.values()) + sum(a.cut_before_checkpoint.values())
    figures(
        "steps_kill_storm",
        jobs=KILL_JOBS,
        steps_per_job=len(THREE),
        workers=KILL_WORKERS,
        lease_s=LEASE,
        kills=len(storm.kills),
        processes_started=len(group.all),
        executions=a.executions,
        cut_inside=a.cut_inside,
        cut_before_checkpoint=a.cut_before_checkpoint,
        effects=sum(len(v) for v in effects.values()),
        max_attempt=a.max_attempt,
        kill_gap_max_s=max(a.kill_gaps, default=None),
        rows_left=sum(left.values()),
        drain_s=drain,
        jobs_per_s=KILL_JOBS / drain,
    )

    assert not left, f"job rows left after the drain (none may be live, or dead): {left}"
    assert not a.not_checkpointed_once, (
        f"steps not checkpointed done exactly once, (job, step, [(attempt, result)]): "
        f"{a.not_checkpointed_once[:5]}"
    )
    assert not a.bad_checkpoint, (
        f"checkpoints that name no finished execution of that attempt: {a.bad_checkpoint[:5]}"
    )
    assert not a.ran_after_checkpoint, (
        f"steps executed again after their checkpoint, (job, step, [(attempt, pid)]): "
        f"{a.ran_after_checkpoint[:5]}"
    )
    assert not a.same_attempt_twice, f"one claim ran a step twice: {a.same_attempt_twice[:5]}"
    assert not a.unexplained, (
        f"{len(a.unexplained)} step executions were repeated with no kill cutting them, "
        f"(job, step, attempt, pid, had ended, seconds from last seen to its kill): "
        f"{a.unexplained[:5]}; "
        f"kills (monotonic, old pid, new pid): {storm.kills[:10]}"
    )
    # So, per step: one execution per job, and one more for each execution a kill cut.
    for step in THREE:
        expected = KILL_JOBS + a.cut_inside[step] + a.cut_before_checkpoint[step]
        assert a.executions[step] == expected, (step, a.executions[step], expected)
    assert not a.effects_not_once, (
        f"transactional steps whose write is not there exactly once, (job, [(attempt, pid)]): "
        f"{a.effects_not_once[:5]}"
    )
    assert not a.bad_effect, f"effects that are not the checkpointed step's: {a.bad_effect[:3]}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3, "the storm must have hit the drain"
    assert cut > 0, "no kill landed inside a step"


# -- 2. sleeps and waits through a PostgreSQL restart ---------------------------------------

SLEEPERS = 50
WAITERS = 50
NAP_S = 4.0


def test_sleeps_and_waits_survive_a_postgres_restart(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """50 jobs asleep (4 s) and 50 waiting for a signal when PostgreSQL is stopped with
    ``-m immediate`` and started again, two workers running through it: the sleepers wake
    at their time, not before, and finish; the waiters stay suspended until their signal
    (sent after the restart, committed) and then finish with its payload; every step of
    every job ran once, and each sleep and wait was resolved once."""
    group = workers(queues=["suspend"], concurrency=8, lease=LEASE, poll_interval=0.2)
    group.start(2)
    group.wait_started()
    with FaultsSession.begin() as session:
        session.enqueue_many(
            app.steps_sleeper, [{"i": i, "seconds": NAP_S} for i in range(SLEEPERS)]
        )
        session.enqueue_many(app.steps_waiter, [{"i": i} for i in range(WAITERS)])
    sleepers = job_ids(faults_db, app.steps_sleeper)
    waiters = job_ids(faults_db, app.steps_waiter)
    everyone = sleepers + waiters
    wait_until(
        lambda: suspended(faults_db, everyone) == len(everyone),
        timeout=30,
        what="every job suspended in its sleep or its wait",
    )
    with faults_db.connect() as conn:
        now = conn.execute(sa.select(sa.func.now())).scalar_one()
        wake: dict[int, datetime] = dict(
            conn.execute(
                sa.text(
                    "SELECT job_id, until FROM faults.jobs_steps "
                    "WHERE name = 'nap' AND state = 'sleeping'"
                )
            ).all()
        )
    assert set(wake) == set(sleepers) and min(wake.values()) > now, (
        "every sleeper must still be asleep when the server goes down"
    )

    stopped, ready = pg.restart_after(1.0)

    # Through the restart, the waits are kept, unresolved.
    assert suspended(faults_db, waiters) == WAITERS, "a wait was lost or woken by the restart"
    # The sleepers wake at their time, and the workers run them to the end.
    wait_until(
        lambda: not job_ids(faults_db, app.steps_sleeper),
        timeout=60,
        what="the sleepers wake and finish after the restart",
    )
    # The workers were claiming from the queue all that while: the waiters stayed put.
    assert suspended(faults_db, waiters) == WAITERS, "a waiter woke without its signal"
    assert not [
        r for r in table(faults_db, app.StepExec) if r.job_id in waiters and r.step == "after"
    ], "a waiter went past its wait without a signal"

    with FaultsSession.begin() as session:
        answers = [app.jobs.signal(session, j, "go", {"job": j}) for j in waiters]
    assert answers == ["woken"] * WAITERS
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=60, what="the signalled waiters finish")
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()

    left = status_counts(faults_db)
    execs = execs_by_step(faults_db)
    history = {key: [(r.kind, r.state) for r in rows] for key, rows in histories(faults_db).items()}
    ran = {key: len(rows) for key, rows in execs.items()}
    not_once = [
        (j, step, ran.get((j, step), 0))
        for j in everyone
        for step in ("before", "after")
        if ran.get((j, step), 0) != 1
    ]
    early = [
        (j, execs[(j, "after")][0].at, wake[j].timestamp())
        for j in sleepers
        if (j, "after") in execs and execs[(j, "after")][0].at < wake[j].timestamp() - 0.001
    ]
    payloads = {j: execs[(j, "after")][0].payload for j in waiters if (j, "after") in execs}
    wrong_payload = {j: p for j, p in payloads.items() if p != {"job": j}}
    naps = [(j, history.get((j, "nap"))) for j in sleepers]
    bad_naps = [(j, h) for j, h in naps if h != [("sleep", "sleeping"), ("sleep", "done")]]
    gos = [(j, history.get((j, "go"))) for j in waiters]
    bad_gos = [
        (j, h)
        for j, h in gos
        if h != [("wait", "waiting"), ("wait", "signalled"), ("wait", "done")]
    ]
    figures(
        "steps_pg_restart",
        sleepers=SLEEPERS,
        waiters=WAITERS,
        nap_s=NAP_S,
        down_s=ready - stopped,
        step_runs=sum(ran.values()),
        not_once=len(not_once),
        woke_early=len(early),
        rows_left=sum(left.values()),
    )
    assert not exited, f"worker processes exited: {exited}"
    assert not left, f"job rows left (none may be live, or dead): {left}"
    assert not not_once, f"steps that did not run exactly once, (job, step, runs): {not_once[:10]}"
    assert not early, f"sleepers that woke before their time, (job, ran at, due at): {early[:5]}"
    assert not wrong_payload, f"waiters that got another payload: {wrong_payload}"
    assert not bad_naps, f"sleeps not recorded then resolved once: {bad_naps[:5]}"
    assert not bad_gos, f"waits not resolved once by their signal: {bad_gos[:5]}"


# -- 3. a signal whose transaction never commits --------------------------------------------


def test_a_rolled_back_signal_never_wakes_the_job(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """A job waits for ``go``, a worker process claiming from its queue. Signals sent in
    a transaction rolled back, in a savepoint rolled back (its transaction committed), and
    in a transaction whose connection was terminated before COMMIT, each answered
    ``woken`` at the time: none wakes the job, nor leaves anything in its records; after
    each, the worker demonstrably claims from the queue (a probe job runs) and the job
    stays suspended, its wait unresolved. Then a committed signal wakes it, and the wait
    returns that signal's payload."""
    group = workers(queues=["suspend"], concurrency=2, lease=LEASE, poll_interval=0.2)
    group.start(1)
    group.wait_started()
    with FaultsSession.begin() as session:
        session.enqueue(app.steps_waiter, i=0)
    (job_id,) = job_ids(faults_db, app.steps_waiter)
    wait_until(lambda: suspended(faults_db, [job_id]) == 1, timeout=30, what="the job waits")

    def state() -> tuple[Any, ...]:
        with faults_db.connect() as conn:
            job = conn.execute(
                sa.select(app.Job.status, app.Job.run_at).where(app.Job.id == job_id)
            ).one_or_none()
            step = conn.execute(
                sa.text(
                    "SELECT state, result FROM faults.jobs_steps WHERE job_id = :j AND name = 'go'"
                ),
                {"j": job_id},
            ).one_or_none()
            afters = conn.execute(
                sa.select(sa.func.count())
                .select_from(app.StepExec)
                .where(app.StepExec.job_id == job_id, app.StepExec.step == "after")
            ).scalar_one()
        return (
            None if job is None else (job.status, job.run_at.year),
            None if step is None else tuple(step),
            afters,
        )

    untouched = (("scheduled", 9999), ("waiting", None), 0)
    assert state() == untouched

    def rolled_back() -> None:
        with FaultsSession() as session:
            assert app.jobs.signal(session, job_id, "go", {"from": "rollback"}) == "woken"
            session.rollback()

    def savepoint_rolled_back() -> None:
        with FaultsSession.begin() as session:
            savepoint = session.begin_nested()
            assert app.jobs.signal(session, job_id, "go", {"from": "savepoint"}) == "woken"
            savepoint.rollback()
        # The outer transaction committed; the signal was in the savepoint only.

    def connection_terminated() -> None:
        conn = faults_db.connect()
        try:
            backend = conn.execute(sa.select(sa.func.pg_backend_pid())).scalar_one()
            assert app.jobs.signal(conn, job_id, "go", {"from": "terminated"}) == "woken"
            # Waits (up to 5 s) until the backend is gone, so COMMIT cannot get there first.
            assert pg.execute("SELECT pg_terminate_backend(%s, 5000)", (backend,)) == [(True,)]
            with pytest.raises(sa.exc.DBAPIError):
                conn.commit()
        finally:
            conn.invalidate()
            conn.close()

    def probe_ran(n: int) -> bool:
        sql = "SELECT count(*) FROM faults.runs WHERE task = :t AND item = :n"
        return bool(scalar(faults_db, sql, t=app.steps_probe.name, n=n))

    cases = [rolled_back, savepoint_rolled_back, connection_terminated]
    for n, case in enumerate(cases, start=1):
        case()
        with FaultsSession.begin() as session:
            session.enqueue(app.steps_probe, i=n)
        # The worker claims from the job's queue after the signal's end ...
        wait_until(
            functools.partial(probe_ran, n),
            timeout=30,
            what=f"the probe job after {case.__name__} runs",
        )
        # ... and for a while more the job stays as it was: nothing to wake it.
        assert not poll_until(lambda: state() != untouched, timeout=1.0), (
            f"after {case.__name__}, the job moved: {state()}"
        )
        assert state() == untouched, f"after {case.__name__}: {state()}"
    assert [(r.kind, r.state) for r in histories(faults_db)[(job_id, "go")]] == [
        ("wait", "waiting")
    ], "a signal that never committed left a version of the wait's record"

    with FaultsSession.begin() as session:
        assert app.jobs.signal(session, job_id, "go", {"from": "committed"}) == "woken"
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=30, what="the signalled job finishes")
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()

    execs = execs_by_step(faults_db)
    go = histories(faults_db)[(job_id, "go")]
    figures(
        "steps_rolled_back_signal",
        signals_not_committed=len(cases),
        probes=len(cases),
        go_versions=len(go),
    )
    assert not exited, f"worker processes exited: {exited}"
    assert status_counts(faults_db) == {}, "the job finished"
    assert [r.payload for r in execs[(job_id, "after")]] == [{"from": "committed"}]
    assert len(execs[(job_id, "before")]) == 1
    assert [(r.state, r.result) for r in go] == [
        ("waiting", None),
        ("signalled", {"from": "committed"}),
        ("done", {"from": "committed"}),
    ]
