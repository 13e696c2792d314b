"""The statements of durable steps (:mod:`sqla_jobs.steps`), on ``<table>_steps``.

Every write a step makes is fenced by the claim, as every write that settles a claim is:
the job's row must still be ``running`` under this ``(id, attempts)``; where the step's
writes are the application's (a step that takes a session, a cursor's batch) it is also
locked (``FOR SHARE``; ``FOR NO KEY UPDATE`` where the job row itself changes) until the
step's transaction commits. A lease that passed meanwhile cannot be rescued
under the lock: the rescue's UPDATE waits for the COMMIT, and the next attempt then finds
the step done. A claim already lost matches no row, and nothing is written.

A signal and a wait meet on the step's row: each inserts it, or locks it if it exists
(an insert waits for a concurrent insert of the same key to commit, a lock for a
concurrent lock), and decides only then, by the row's latest committed state. Whichever
comes second sees what the first wrote, so a wait and its signal, or a wait's timeout and
a late signal, resolve one way, once. The job's row is not locked by a signal: the
caller's transaction may last, and a running job's heartbeat must not wait for it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert

from ._queries import _SCHEDULED_VIA_PK, _notify_queues, _one_claim
from .model import JobStatus, companion_tables, notify_channel

__all__ = ["StepQueries"]

#: What a wait with no timeout is scheduled for: the year 9999, which the promoter never
#: reaches (as for a job waiting for its parents; not 'infinity', which Python cannot read).
NEVER: sa.ColumnElement[Any] = sa.literal_column("'9999-01-01 00:00:00+00'::timestamptz")


def _json(name: str) -> Any:
    """``CAST(:name AS jsonb)``: the JSON is encoded (and checked) by the caller."""
    return sa.cast(sa.bindparam(name, type_=sa.Text), JSONB)


class StepQueries:
    """The statements of one jobs table's ``<table>_steps``, each built once (on first use
    of durable steps: ``Queries.steps``)."""

    def __init__(self, table: sa.Table) -> None:
        self.table = t = table
        self.steps_table = st = companion_tables(table).steps
        c = st.c

        # Every record of one job, read once per attempt (at its first step).
        self.load = sa.select(c.name, c.kind, c.state, c.result, c.attempt, c.until).where(
            c.job_id == sa.bindparam("job_id")
        )

        # A checkpoint in one statement: the step's row written from the claim's, so
        # nothing is written for a lost claim. Upserted: a cursor moves its row on, and a
        # step whose first checkpoint a lost claim never wrote is written by the next. A
        # row of another kind (a signal of that name, sent from outside) is left alone: no
        # row comes back. The stored result comes back: a step returns it, on its first
        # run as on a replay (jsonb orders an object's keys its own way, and writes 1e16
        # as an int and -0.0 as 0.0).
        #
        # ``checkpoint_locked`` (a step that takes a session, a cursor's batch: writes of
        # the application's commit with it) locks the claim's row FOR SHARE until the
        # COMMIT, so a rescue of the job waits for it and the next attempt finds the step
        # done: exactly once. ``checkpoint`` (an ordinary step: its effect is outside the
        # database, at least once anyway) only reads it: a row lock is a write of the job's
        # page and of the WAL, on every step.
        def checkpoint(locked: bool) -> Any:
            fence = sa.select(
                t.c.id,
                sa.bindparam("name", type_=sa.Text),
                sa.bindparam("kind", type_=sa.Text),
                sa.bindparam("state", type_=sa.Text),
                _json("result"),
                t.c.attempts,
            ).where(_one_claim(t))
            if locked:
                fence = fence.with_for_update(read=True, of=t)
            upsert = insert(st).from_select(
                ["job_id", "name", "kind", "state", "result", "attempt"], fence
            )
            return upsert.on_conflict_do_update(
                index_elements=[c.job_id, c.name],
                set_={
                    "state": upsert.excluded.state,
                    "result": upsert.excluded.result,
                    "attempt": upsert.excluded.attempt,
                    "updated_at": sa.func.now(),
                },
                where=c.kind == upsert.excluded.kind,
            ).returning(c.job_id, c.result)

        self.checkpoint = checkpoint(locked=False)
        self.checkpoint_locked = checkpoint(locked=True)
        # Why a checkpoint wrote nothing, read only then: a row of another kind (a signal
        # of that name) is the application's mistake, no row of it a claim lost.
        self.kind_of = sa.select(c.kind).where(
            c.job_id == sa.bindparam("job_id"), c.name == sa.bindparam("name")
        )

        # A sleep or a wait, in one transaction. The step's row is the meeting point with
        # jobs.signal: taken first (inserted, or locked FOR UPDATE if it exists, which
        # waits for a signal that is committing), then the claim's row locked (the fence),
        # then the step decided and the job suspended or not. ``due``: the database's
        # clock says the step's time has come.
        due = sa.func.coalesce(c.until <= sa.func.now(), False).label("due")
        taken = insert(st).values(
            job_id=sa.bindparam("job_id"),
            name=sa.bindparam("name"),
            kind=sa.bindparam("kind"),
            state=sa.bindparam("state"),
            attempt=sa.bindparam("attempt", type_=sa.Integer),
            # A time given (``until=``), or a delay from the database's now.
            until=sa.func.coalesce(
                sa.bindparam("at", type_=sa.DateTime(True)),
                sa.func.now() + sa.bindparam("after", type_=sa.Interval),
            ),
        )
        # Nothing back: the row exists (a signal came first, or an earlier attempt wrote
        # it). A concurrent insert of the same row (a first signal) is waited for.
        self.take_step = taken.on_conflict_do_nothing(index_elements=[c.job_id, c.name]).returning(
            c.until, due
        )
        self.lock_step = (
            sa.select(c.kind, c.state, c.result, c.until, due)
            .where(c.job_id == sa.bindparam("job_id"), c.name == sa.bindparam("name"))
            .with_for_update(of=st)
        )
        self.lock_claim = (
            sa.select(t.c.id).where(_one_claim(t)).with_for_update(key_share=True, of=t)
        )
        # (An UPDATE's parameters cannot share the names of its table's columns.)
        self.set_state = (
            sa.update(st)
            .where(c.job_id == sa.bindparam("of_job"), c.name == sa.bindparam("of_step"))
            .values(state=sa.bindparam("to_state"), updated_at=sa.func.now())
        )
        # Back to scheduled until the step's time (its row's ``until``; none: the year 9999),
        # the attempt not counted (max_attempts + 1, as for a snooze), the slot freed.
        self.suspend = (
            sa.update(t)
            .where(_one_claim(t))
            .values(
                status=JobStatus.SCHEDULED.value,
                run_at=sa.func.coalesce(sa.bindparam("until", type_=sa.DateTime(True)), NEVER),
                max_attempts=t.c.max_attempts + 1,
                locked_until=None,
            )
            .returning(t.c.id)
        )

        # jobs.signal, in the caller's transaction: the job looked at (no lock: a signal
        # must not hold up the heartbeat of a running job for as long as the caller's
        # transaction lasts), then the step's row inserted as a kept signal, or, if it
        # exists, locked (waiting for a wait that is committing) and written; then a
        # suspended job woken, in a statement whose snapshot sees that wait's COMMIT.
        self.job_status = sa.select(t.c.status).where(t.c.id == sa.bindparam("job_id"))
        self.keep_signal = (
            insert(st)
            .values(
                job_id=sa.bindparam("job_id"),
                name=sa.bindparam("name"),
                kind="wait",
                state="signalled",
                result=_json("result"),
            )
            .on_conflict_do_nothing(index_elements=[c.job_id, c.name])
            .returning(c.job_id)
        )
        self.deliver = (
            sa.update(st)
            .where(c.job_id == sa.bindparam("of_job"), c.name == sa.bindparam("of_step"))
            .values(state="signalled", result=_json("payload"), updated_at=sa.func.now())
        )
        woken = (
            sa.update(t)
            .where(t.c.id == sa.bindparam("job_id"), t.c.status == _SCHEDULED_VIA_PK)
            .values(status=JobStatus.READY.value, run_at=sa.func.now())
            .returning(t.c.queue)
            .cte("woken")
        )
        self.wake = _notify_queues(notify_channel(t), woken)

        # Retention: the records of jobs that are gone (a job's row is deleted when it
        # succeeds, or pruned later). Through the primary keys of both tables.
        orphans = (
            sa.select(c.job_id)
            .where(~sa.exists().where(t.c.id == c.job_id))
            .distinct()
            .limit(sa.bindparam("limit"))
        )
        self.prune = sa.delete(st).where(c.job_id.in_(orphans))

        # What the operator model reads: a job's records in the order they were written.
        self.records = (
            sa.select(
                c.name,
                c.kind,
                c.state,
                c.attempt,
                c.until,
                c.created_at,
                c.updated_at,
                sa.func.octet_length(sa.cast(c.result, sa.Text)).label("size"),
                sa.case((c.kind == "cursor", c.result)).label("position"),
            )
            .where(c.job_id == sa.bindparam("job_id"))
            .order_by(c.created_at, c.name)
        )
