"""The application the fault tests run: its own metadata, a jobs table, business tables,
and tasks that leave a trace of every run.

Worker processes load it as ``faults_app:jobs`` (their working directory is this folder);
the tests import it as ``tests.faults.faults_app``. Every task has an explicit name, so
the two imports agree on what a job's ``task`` column means.

Every task first records its run (job id, attempt, pid, worker, wall and monotonic time,
and its business key) into ``runs``, through a connection of its own, committed before the
handler goes on: a run that was recorded happened, whatever became of the job after.
Transactional tasks then write their business row with the job's session, so that row
commits with the job's completion or not at all.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import Backoff, JobMixin, Jobs, Steps, current_job

SCHEMA = "faults"
#: The URL the handlers record their runs through (set by the tests for worker processes).
RECORD_URL_ENV = "FAULTS_RECORD_URL"

#: Attempts for the ordinary tasks. The scenarios inject infrastructure faults (killed
#: workers, a crashed server, cut connections), each of which may cost a job an attempt;
#: the point is that no job is lost, so ordinary jobs do not run out of attempts. The
#: poison tasks below set small limits of their own.
ATTEMPTS = 50


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class Run(Base):
    """One row per handler run that got as far as recording itself."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    task: Mapped[str] = mapped_column(sa.Text)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)
    worker: Mapped[str] = mapped_column(sa.Text)
    #: time.time() and time.monotonic() when the handler started.
    at: Mapped[float] = mapped_column(sa.Float)
    mono: Mapped[float] = mapped_column(sa.Float)
    #: The producer's time.monotonic() when it enqueued the job (from the job's args).
    enq: Mapped[float | None] = mapped_column(sa.Float)
    #: The business key the job carries (an item number, or an order id) and its slot.
    item: Mapped[int | None] = mapped_column(sa.BigInteger)
    slot: Mapped[int | None] = mapped_column(sa.Integer)
    #: With ``record(check=True)``: when the worker decided to start the run
    #: (``current_job().started``, monotonic), whether the claim was still this run's
    #: when the run was recorded (its row running, at this attempt, locked by this
    #: worker), and when that was read (monotonic).
    started: Mapped[float | None] = mapped_column(sa.Float)
    held: Mapped[bool | None] = mapped_column(sa.Boolean)
    checked: Mapped[float | None] = mapped_column(sa.Float)


class Ledger(Base):
    """The business effect of a transactional task: exactly one row per item, if the
    exactly-once promise holds. Deliberately no unique constraint: a second row must be
    visible, not refused."""

    __tablename__ = "ledger"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    item: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)


class GroupRun(Base):
    """One row per run of a group's callback, with the results it was given."""

    __tablename__ = "group_runs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    group_no: Mapped[int] = mapped_column(sa.Integer, index=True)
    results: Mapped[Any] = mapped_column(JSONB)


class FlowDone(Base):
    """The business effect of a step of a workflow (``flow_step``): committed with the
    job's completion, so exactly one row per job that succeeded, written at its end."""

    __tablename__ = "flow_done"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    #: time.time() as the handler ended, before its commit: a child claimed once that
    #: commit is visible starts later by the same clock.
    ended: Mapped[float] = mapped_column(sa.Float)


class Order(Base):
    """A producer's business row; ``slots`` lists the jobs its transaction kept."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    producer: Mapped[int] = mapped_column(sa.Integer)
    slots: Mapped[list[int]] = mapped_column(JSONB)


class KeyRun(Base):
    """A run of a job of a queue in key order that got to its end (a killed run leaves
    none): its key, its place in the key's order, and when it started and ended."""

    __tablename__ = "key_runs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    key: Mapped[str] = mapped_column(sa.Text, index=True)
    seq: Mapped[int] = mapped_column(sa.Integer)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)
    started: Mapped[float] = mapped_column(sa.Float)
    ended: Mapped[float] = mapped_column(sa.Float)


jobs = Jobs(Job, max_attempts=ATTEMPTS, retry=Backoff(base=0.05, factor=2.0, cap=0.5, jitter=0.2))
jobs.queue("ordered", key_order="fifo")
# The same order, going on past a dead or cancelled head (test_operator_chaos.py).
jobs.queue("ordered_on", key_order="fifo", on_head_failure="continue")

_ENGINE: sa.Engine | None = None


def _engine() -> sa.Engine:
    global _ENGINE
    if _ENGINE is None:
        from sqla_jobs import create_engine

        _ENGINE = create_engine(os.environ[RECORD_URL_ENV], pool_size=4, max_overflow=16)
    return _ENGINE


def record(
    item: int | None = None, slot: int | None = None, enq: float | None = None, check: bool = False
) -> None:
    """Record this run, committed, through the recorder's own connection; with ``check``,
    also whether the job's row still says this run's claim holds (see ``Run.held``)."""
    job = current_job()
    mono, at = time.monotonic(), time.time()
    held = checked = None
    with _engine().begin() as conn:
        if check:
            c = Job.__table__.c
            held = bool(
                conn.execute(
                    sa.select(
                        sa.and_(
                            c.status == "running",
                            c.attempts == job.attempts,
                            c.locked_by == job.worker,
                        )
                    ).where(c.id == job.id)
                ).scalar()
            )
            checked = time.monotonic()
        conn.execute(
            sa.insert(Run).values(
                job_id=job.id,
                task=job.task,
                attempt=job.attempts,
                pid=os.getpid(),
                worker=job.worker,
                at=at,
                mono=mono,
                enq=enq,
                item=item,
                slot=slot,
                started=job.started if check else None,
                held=held,
                checked=checked,
            )
        )


# -- ordinary tasks ------------------------------------------------------------------------


@jobs.task(name="faults.work", queue="work")
def work(i: int, enq: float | None = None, sleep: float = 0.0) -> None:
    """Record the run, then take ``sleep`` seconds."""
    record(item=i, enq=enq)
    if sleep:
        time.sleep(sleep)


@jobs.task(name="faults.book", queue="work", transactional=True)
def book(i: int, session: Session, sleep: float = 0.0) -> None:
    """Record the run, then write one ledger row that commits with the job's completion,
    after ``sleep`` seconds (a run long enough for an operator's cancel to land in it)."""
    record(item=i)
    if sleep:
        time.sleep(sleep)
    job = current_job()
    session.add(Ledger(item=i, job_id=job.id, attempt=job.attempts, pid=os.getpid()))


@jobs.task(name="faults.in_order", queue="ordered", concurrency_key=lambda key, **_: key)
def in_order(key: str, seq: int, sleep: float = 0.0) -> None:
    """Record the start, take ``sleep`` seconds, then record the whole run (start and end)."""
    record(item=seq)
    started = time.time()
    if sleep:
        time.sleep(sleep)
    job = current_job()
    with _engine().begin() as conn:
        conn.execute(
            sa.insert(KeyRun).values(
                job_id=job.id,
                key=key,
                seq=seq,
                attempt=job.attempts,
                pid=os.getpid(),
                started=started,
                ended=time.time(),
            )
        )


@jobs.task(name="faults.order_job", queue="orders")
def order_job(order_id: int, slot: int) -> None:
    record(item=order_id, slot=slot)


# -- workflows -----------------------------------------------------------------------------


@jobs.task(name="faults.member", queue="flow", keep_result=True)
def member(group_no: int, k: int, align: float = 0.0) -> list[int]:
    """A group member: record the run, then return ``[group_no, k]`` at the next multiple
    of ``align`` seconds of the wall clock (at least half of it from now), so that members
    running at the same time on different workers finish at the same moment."""
    record(item=group_no, slot=k)
    if align:
        _until_tick(align)
    return [group_no, k]


@jobs.task(name="faults.collect", queue="flow")
def collect(group_no: int, results: list[Any]) -> None:
    """A group's callback: record the run and the results it got, committed."""
    record(item=group_no)
    job = current_job()
    with _engine().begin() as conn:
        conn.execute(
            sa.insert(GroupRun).values(
                job_id=job.id, attempt=job.attempts, group_no=group_no, results=results
            )
        )


@jobs.task(name="faults.parent", queue="flow")
def parent(i: int, align: float) -> None:
    """A job that gets a child while it runs (the test enqueues it once the run shows);
    returns at a multiple of ``align`` seconds of the wall clock, at least ``align`` from
    now (the test times its kills by the same clock)."""
    record(item=i)
    _until_tick(align, at_least=1.0)


def _until_tick(align: float, at_least: float = 0.5) -> None:
    """Sleep until a multiple of ``align`` seconds of the wall clock, at least
    ``at_least * align`` from now."""
    now = time.time()
    left = align - now % align
    time.sleep(left + (align if left < at_least * align else 0.0))


@jobs.task(name="faults.kid", queue="flow")
def kid(i: int) -> None:
    record(item=i)


@jobs.task(name="faults.answer", queue="answers", keep_result=True)
def answer(i: int, sleep: float = 0.0) -> dict[str, int]:
    """A kept result that names its job's item: a waiter checks it got its own."""
    record(item=i)
    if sleep:
        time.sleep(sleep)
    return {"i": i, "twice": 2 * i}


@jobs.task(name="faults.flow_step", queue="flowchaos", transactional=True)
def flow_step(chain: int, level: int, session: Session, sleep: float = 0.0) -> None:
    """A step of a workflow (``after=``): record the run, take ``sleep`` seconds, then
    write its ``FlowDone`` row, which commits with the completion."""
    record(item=chain, slot=level)
    if sleep:
        time.sleep(sleep)
    job = current_job()
    session.add(FlowDone(job_id=job.id, attempt=job.attempts, ended=time.time()))


# -- paused workers (test_pause.py) ---------------------------------------------------------


@jobs.task(name="faults.pause_work", queue="pause")
def pause_work(i: int) -> None:
    """Record the run and whether its claim still held."""
    record(item=i, check=True)


@jobs.task(name="faults.pause_book", queue="pause", transactional=True)
def pause_book(i: int, session: Session) -> None:
    """As ``book``, checking the claim: one ledger row per item, if exactly-once holds."""
    record(item=i, check=True)
    job = current_job()
    session.add(Ledger(item=i, job_id=job.id, attempt=job.attempts, pid=os.getpid()))


# -- poison --------------------------------------------------------------------------------


@jobs.task(name="faults.poison_raise", queue="steady", max_attempts=3)
def poison_raise(i: int) -> None:
    record(item=i)
    raise ValueError(f"poison #{i} raised on purpose")


@jobs.task(name="faults.poison_sys_exit", queue="steady", max_attempts=2)
def poison_sys_exit(i: int) -> None:
    record(item=i)
    sys.exit(3)


@jobs.task(name="faults.poison_os_exit", queue="poison", max_attempts=2)
def poison_os_exit(i: int) -> None:
    record(item=i)
    os._exit(1)


@jobs.task(name="faults.poison_timeout", queue="steady", max_attempts=2, timeout=0.5)
def poison_timeout(i: int, seconds: float) -> None:
    """Runs past its timeout, and does not look at ``current_job().cancelled``."""
    record(item=i)
    time.sleep(seconds)


@jobs.task(name="faults.long_job", queue="steady")
def long_job(i: int, seconds: float) -> None:
    """Runs for several leases; the worker's heartbeat must keep its claim."""
    record(item=i)
    time.sleep(seconds)


@jobs.task(name="faults.huge", queue="poison")
def huge(i: int, blob: list[Any], size: int) -> None:
    """Huge arguments: check they arrived whole, record their length as the slot."""
    if len(blob) != size:
        raise ValueError(f"blob of {len(blob)} items, expected {size}")
    record(item=i, slot=len(blob))


# -- durable steps (test_steps_faults.py) ---------------------------------------------------


class StepExec(Base):
    """One execution of a step's function, recorded through the recorder's own connection
    (committed at once): a row at its start, ``ended`` set when it returns. A row without
    ``ended`` is an execution that a kill cut (or that failed)."""

    __tablename__ = "step_execs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    step: Mapped[str] = mapped_column(sa.Text)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)
    #: time.monotonic() at the start and at the end of the step's function.
    started: Mapped[float] = mapped_column(sa.Float)
    ended: Mapped[float | None] = mapped_column(sa.Float)
    #: time.time() at the start (comparable with PostgreSQL's clock on this machine).
    at: Mapped[float] = mapped_column(sa.Float)
    #: What the step was given (a wait's payload, for the step after it).
    payload: Mapped[Any] = mapped_column(JSONB(none_as_null=True), nullable=True)


class StepEffect(Base):
    """The database write of a transactional step (its ``session``): exactly one row per
    job if the promise holds. Deliberately no unique constraint: a second row must show."""

    __tablename__ = "step_effects"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    item: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)
    #: The result of the step before it, as the handler got it (that step's execution id).
    prepared: Mapped[int] = mapped_column(sa.BigInteger)


class StepCheckpoint(Base):
    """Every row version written to ``jobs_steps`` (by a trigger, created with the schema,
    see below): the history of each step's record, which the job's own records do not keep
    (they are overwritten in place, and pruned once the job is gone). Rows written in a
    transaction that rolled back are not here."""

    __tablename__ = "step_checkpoints"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    name: Mapped[str] = mapped_column(sa.Text)
    kind: Mapped[str] = mapped_column(sa.Text)
    state: Mapped[str] = mapped_column(sa.Text)
    attempt: Mapped[int | None] = mapped_column(sa.Integer)
    result: Mapped[Any] = mapped_column(JSONB, nullable=True)


_TRIGGER_DDL = (
    f"""
    CREATE OR REPLACE FUNCTION "{SCHEMA}".step_checkpoint() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO "{SCHEMA}".step_checkpoints (job_id, name, kind, state, attempt, result)
        VALUES (NEW.job_id, NEW.name, NEW.kind, NEW.state, NEW.attempt, NEW.result);
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER step_checkpoint AFTER INSERT OR UPDATE ON "{SCHEMA}".jobs_steps
        FOR EACH ROW EXECUTE FUNCTION "{SCHEMA}".step_checkpoint()
    """,
)


@sa.event.listens_for(Base.metadata, "after_create")
def _create_step_trigger(target: Any, connection: sa.Connection, **kw: Any) -> None:
    for ddl in _TRIGGER_DDL:
        connection.exec_driver_sql(ddl)


def _exec_started(step: str, payload: Any = None) -> int:
    job = current_job()
    with _engine().begin() as conn:
        return int(
            conn.execute(
                sa.insert(StepExec)
                .values(
                    job_id=job.id,
                    step=step,
                    attempt=job.attempts,
                    pid=os.getpid(),
                    started=time.monotonic(),
                    at=time.time(),
                    payload=payload,
                )
                .returning(StepExec.id)
            ).scalar_one()
        )


def _exec_ended(exec_id: int) -> None:
    with _engine().begin() as conn:
        conn.execute(
            sa.update(StepExec).where(StepExec.id == exec_id).values(ended=time.monotonic())
        )


def ordinary_step(step: str, seconds: float, payload: Any = None) -> dict[str, int]:
    """An ordinary step's function: record the execution, take ``seconds``, record its
    end; returns ``{"exec": <its execution's id>}`` (what the checkpoint stores)."""
    exec_id = _exec_started(step, payload)
    if seconds:
        time.sleep(seconds)
    _exec_ended(exec_id)
    return {"exec": exec_id}


def transactional_step(
    item: int, prepared: dict[str, int], seconds: float, session: Session
) -> dict[str, int]:
    """A transactional step's function: record the execution (committed at once), write one
    effect row in the step's session (committed with the checkpoint, or not at all), take
    ``seconds`` inside that transaction, record the end."""
    exec_id = _exec_started("book")
    job = current_job()
    effect = StepEffect(
        job_id=job.id, item=item, attempt=job.attempts, pid=os.getpid(), prepared=prepared["exec"]
    )
    session.add(effect)
    session.flush()
    if seconds:
        time.sleep(seconds)
    _exec_ended(exec_id)
    return {"exec": exec_id, "effect": int(effect.id)}


@jobs.task(name="faults.steps_three", queue="steps", durable=True)
def steps_three(steps: Steps, i: int, seconds: float = 0.005) -> None:
    """Three steps: an ordinary one, a transactional one (given the first's result), and an
    ordinary one again."""
    prepared = steps.run("prepare", ordinary_step, "prepare", seconds)
    steps.run("book", transactional_step, i, prepared, seconds)
    steps.run("finish", ordinary_step, "finish", seconds)


@jobs.task(name="faults.steps_sleeper", queue="suspend", durable=True)
def steps_sleeper(steps: Steps, i: int, seconds: float) -> None:
    """A step, a sleep of ``seconds`` (no worker held), a step."""
    steps.run("before", ordinary_step, "before", 0.0)
    steps.sleep("nap", seconds)
    steps.run("after", ordinary_step, "after", 0.0)


@jobs.task(name="faults.steps_waiter", queue="suspend", durable=True)
def steps_waiter(steps: Steps, i: int) -> None:
    """A step, a wait for the signal ``go`` (no timeout), a step that records the payload."""
    steps.run("before", ordinary_step, "before", 0.0)
    payload = steps.wait("go")
    steps.run("after", ordinary_step, "after", 0.0, payload)


@jobs.task(name="faults.steps_probe", queue="suspend")
def steps_probe(i: int) -> None:
    """An ordinary job of the suspended jobs' queue: its run shows the worker claimed from
    that queue after the moment it was enqueued."""
    record(item=i)


# -- concurrency, rate and fair-share limits (test_limit_faults.py) --------------------------

#: The limits the workers enforce (and test_limit_faults.py checks).
CAPPED_CONCURRENCY = 4
RATE_COUNT, RATE_PERIOD = 50, 1.0
#: The queues whose claims and completions ``job_events`` records.
LIMIT_QUEUES = ("capped", "per_key", "rated", "fair_share")

jobs.queue("capped", concurrency=CAPPED_CONCURRENCY)
jobs.queue("per_key", key_concurrency=1)
jobs.queue("rated", rate=f"{RATE_COUNT}/{RATE_PERIOD:g}s")
jobs.queue("fair_share", fair=True)


class LimitRun(Base):
    """One run of a limited task: a row committed before the handler's work begins (its
    start, ``time.monotonic()``), ``ended`` set when the work is done, before the job's
    completion is written (retried through an outage, so that only a killed process leaves
    a run without an end). ``token`` is the run's own, so that the end can be written even
    when the start's commit was cut and its outcome is unknown."""

    __tablename__ = "limit_runs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    token: Mapped[str] = mapped_column(sa.Text, index=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    queue: Mapped[str] = mapped_column(sa.Text)
    key: Mapped[str | None] = mapped_column(sa.Text)
    item: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    pid: Mapped[int] = mapped_column(sa.Integer)
    started: Mapped[float] = mapped_column(sa.Float)
    ended: Mapped[float | None] = mapped_column(sa.Float)
    #: time.time() at the start (comparable with PostgreSQL's clock on this machine).
    at: Mapped[float] = mapped_column(sa.Float)


class JobEvent(Base):
    """Every change of status of a job of the limited queues, written by a trigger on the
    jobs table (created with the schema, see below) in the transaction that made it: a claim
    (``new = 'running'``), a rescue or a retry (``running`` to ``ready`` or ``scheduled``),
    a completion (``new = 'deleted'``: finished jobs are deleted). ``at`` is
    ``clock_timestamp()`` inside that statement. Only what committed is here."""

    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger, index=True)
    queue: Mapped[str] = mapped_column(sa.Text)
    key: Mapped[str | None] = mapped_column(sa.Text)
    old: Mapped[str | None] = mapped_column(sa.Text)
    new: Mapped[str] = mapped_column(sa.Text)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    worker: Mapped[str | None] = mapped_column(sa.Text)
    at: Mapped[Any] = mapped_column(sa.DateTime(timezone=True))
    #: The transaction that made it (``txid_current()``): one claim's jobs share it.
    txid: Mapped[int] = mapped_column(sa.BigInteger)


class RateStamp(Base):
    """Every write of a queue's rate log (``jobs_queues.rate_log``) that added starts, by a
    trigger: the stamp the claim appended and its jobs (the last of ``rate_counts``). The
    log itself is trimmed to its window; this keeps them all."""

    __tablename__ = "rate_stamps"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    queue: Mapped[str] = mapped_column(sa.Text)
    at: Mapped[Any] = mapped_column(sa.DateTime(timezone=True))
    n: Mapped[int] = mapped_column(sa.Integer)


_LIMIT_QUEUES_SQL = ", ".join(f"'{q}'" for q in LIMIT_QUEUES)
_LIMIT_TRIGGER_DDL = (
    f"""
    CREATE OR REPLACE FUNCTION "{SCHEMA}".job_event() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'DELETE' THEN
            INSERT INTO "{SCHEMA}".job_events
                (job_id, queue, key, old, new, attempt, worker, at, txid)
            VALUES (OLD.id, OLD.queue, OLD.concurrency_key, OLD.status, 'deleted',
                    OLD.attempts, OLD.locked_by, clock_timestamp(), txid_current());
        ELSE
            INSERT INTO "{SCHEMA}".job_events
                (job_id, queue, key, old, new, attempt, worker, at, txid)
            VALUES (NEW.id, NEW.queue, NEW.concurrency_key, OLD.status, NEW.status,
                    NEW.attempts, NEW.locked_by, clock_timestamp(), txid_current());
        END IF;
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER job_event_update AFTER UPDATE ON "{SCHEMA}".jobs FOR EACH ROW
        WHEN (NEW.queue IN ({_LIMIT_QUEUES_SQL}) AND OLD.status IS DISTINCT FROM NEW.status)
        EXECUTE FUNCTION "{SCHEMA}".job_event()
    """,
    f"""
    CREATE TRIGGER job_event_delete AFTER DELETE ON "{SCHEMA}".jobs FOR EACH ROW
        WHEN (OLD.queue IN ({_LIMIT_QUEUES_SQL}))
        EXECUTE FUNCTION "{SCHEMA}".job_event()
    """,
    f"""
    CREATE OR REPLACE FUNCTION "{SCHEMA}".rate_stamp() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        newest timestamptz := NEW.rate_log[cardinality(NEW.rate_log)];
    BEGIN
        -- A claim appends its clock_timestamp() once, and how many jobs it claimed to
        -- rate_counts, after the claims still in the window: the newest stamp, unless it
        -- was there before.
        IF newest IS NULL THEN
            RETURN NULL;
        END IF;
        IF TG_OP = 'UPDATE' AND OLD.rate_log IS NOT NULL AND newest = ANY (OLD.rate_log) THEN
            RETURN NULL;
        END IF;
        INSERT INTO "{SCHEMA}".rate_stamps (queue, at, n)
        VALUES (NEW.name, newest, NEW.rate_counts[cardinality(NEW.rate_counts)]);
        RETURN NULL;
    END $$
    """,
    f"""
    CREATE TRIGGER rate_stamp AFTER INSERT OR UPDATE ON "{SCHEMA}".jobs_queues
        FOR EACH ROW EXECUTE FUNCTION "{SCHEMA}".rate_stamp()
    """,
)


@sa.event.listens_for(Base.metadata, "after_create")
def _create_limit_triggers(target: Any, connection: sa.Connection, **kw: Any) -> None:
    for ddl in _LIMIT_TRIGGER_DDL:
        connection.exec_driver_sql(ddl)


def _write(statement: Any, give_up_after: float = 60.0) -> None:
    """Run ``statement`` through the recorder's connection, committed, retrying while the
    server cannot be reached (a crash, a restart), for up to ``give_up_after`` seconds."""
    deadline = time.monotonic() + give_up_after
    while True:
        try:
            with _engine().begin() as conn:
                conn.execute(statement)
            return
        except sa.exc.DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def timed_run(item: int, key: str | None, sleep: float) -> None:
    """Record the run's start (committed), take ``sleep`` seconds, record its end."""
    job = current_job()
    token = os.urandom(16).hex()
    started, at = time.monotonic(), time.time()
    try:
        with _engine().begin() as conn:
            conn.execute(
                sa.insert(LimitRun).values(
                    token=token,
                    job_id=job.id,
                    queue=job.queue,
                    key=key,
                    item=item,
                    attempt=job.attempts,
                    pid=os.getpid(),
                    started=started,
                    at=at,
                )
            )
    except sa.exc.DBAPIError:
        # The start may have committed after all (a commit cut before its answer): end it.
        ended = time.monotonic()
        _write(sa.update(LimitRun).where(LimitRun.token == token).values(ended=ended))
        raise
    if sleep:
        time.sleep(sleep)
    ended = time.monotonic()
    _write(sa.update(LimitRun).where(LimitRun.token == token).values(ended=ended))


@jobs.task(name="faults.capped", queue="capped")
def capped(i: int, sleep: float = 0.0) -> None:
    timed_run(i, None, sleep)


@jobs.task(name="faults.per_key", queue="per_key", concurrency_key=lambda key, **_: key)
def per_key(i: int, key: str, sleep: float = 0.0) -> None:
    timed_run(i, key, sleep)


@jobs.task(name="faults.rated", queue="rated")
def rated(i: int, sleep: float = 0.0) -> None:
    timed_run(i, None, sleep)


@jobs.task(name="faults.fair_share", queue="fair_share", concurrency_key=lambda tenant, **_: tenant)
def fair_share(i: int, tenant: str, sleep: float = 0.0) -> None:
    timed_run(i, tenant, sleep)
