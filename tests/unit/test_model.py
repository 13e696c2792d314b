"""JobMixin's table: what it declares, whatever the model adds."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import STATUSES, JobMixin
from sqla_jobs.model import notify_channel


def test_a_models_own_table_args_keep_the_queues_indexes_and_checks() -> None:
    class Base(DeclarativeBase):
        pass

    class Work(JobMixin, Base):
        __tablename__ = "work_items"
        __table_args__ = {"schema": "work", "comment": "our jobs"}

    table = Work.__table__
    assert table.fullname == "work.work_items"
    assert table.comment == "our jobs"
    assert {i.name for i in table.indexes} == {
        "work_items_claim",
        "work_items_scheduled",
        "work_items_running",
        "work_items_finished",
        "work_items_unique",
        "work_items_dead",
        "work_items_meta",
        "work_items_keys",
        "work_items_key_order",
        "work_items_parents",
    }
    checks = {
        c.name: str(c.sqltext) for c in table.constraints if isinstance(c, sa.CheckConstraint)
    }
    assert set(checks) == {
        "work_items_status",
        "work_items_priority",
        "work_items_max_attempts",
        "work_items_attempts",
        "work_items_args_object",
        "work_items_meta_object",
        "work_items_attempts_left",
        "work_items_waiting",
    }
    assert all(f"'{s}'" in checks["work_items_status"] for s in STATUSES)
    assert {t.name for t in Base.metadata.tables.values()} == {
        "work_items",
        "work_items_queues",
        "work_items_schedules",
        "work_items_workers",
        "work_items_throughput",
        "work_items_unique_keys",
        "work_items_key_starts",
        "work_items_steps",
    }


def test_notify_channels_are_distinct_and_fit_postgres_identifiers() -> None:
    class Base(DeclarativeBase):
        pass

    long = "j" * 60

    class A(JobMixin, Base):
        __tablename__ = long + "a"

    class B(JobMixin, Base):
        __tablename__ = long + "b"

    a, b = notify_channel(A.__table__), notify_channel(B.__table__)
    assert a != b
    assert len(a.encode()) <= 63 and len(b.encode()) <= 63


def test_long_table_names_get_distinct_fitting_derived_names() -> None:
    from sqla_jobs.model import derived_name

    class Base(DeclarativeBase):
        pass

    long = "a_very_long_jobs_table_name_that_goes_on_and_on_for_ages_x"  # 58 bytes

    class A(JobMixin, Base):
        __tablename__ = long + "1"

    class B(JobMixin, Base):
        __tablename__ = long + "2"

    names_a = {i.name for i in A.__table__.indexes} | {derived_name(A.__tablename__, "notify")}
    names_b = {i.name for i in B.__table__.indexes} | {derived_name(B.__tablename__, "notify")}
    assert all(len(str(n).encode()) <= 63 for n in names_a | names_b)
    assert not names_a & names_b
    assert derived_name("jobs", "claim") == "jobs_claim"  # short names stay readable


def test_backoff_grows_is_capped_and_jitters_within_bounds() -> None:
    from sqla_jobs import Backoff

    plain = Backoff(base=2, factor=3, cap=50, jitter=0)
    assert [plain(n) for n in (1, 2, 3, 4, 5)] == [2, 6, 18, 50, 50]
    jittery = Backoff(base=10, jitter=0.1)
    assert all(9 <= jittery(1) <= 11 for _ in range(200))
    # NaN passed every check (a NaN cap retried at once, for ever), a bool was a number.
    nan, inf = float("nan"), float("inf")
    bads: list[dict[str, object]] = [
        {"base": -1},
        {"factor": 0.5},
        {"jitter": 2},
        {"cap": nan},
        {"base": nan},
        {"factor": nan},
        {"jitter": nan},
        {"base": inf},
        {"base": True},
        {"cap": "60"},
    ]
    for bad in bads:
        with pytest.raises(ValueError, match="invalid Backoff"):
            Backoff(**bad)  # type: ignore[arg-type]
    # Past attempt 1,024 the growth is more than a float holds: the cap, not an error.
    assert plain(1025) == 50 and plain(10**6) == 50
    assert Backoff(jitter=0)(2**31 - 1) == 3600.0
    assert Backoff(cap=inf, jitter=0)(3) == 8.0  # no cap


def test_a_task_timeout_is_a_finite_number_of_seconds() -> None:
    """NaN never fired, ``True`` meant one second, ``"5"`` failed on a comparison."""
    from sqla_jobs import Jobs

    from .. import app

    jobs = Jobs(app.Job)
    for bad in (float("nan"), float("inf"), True, "5", 0, -1):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            jobs.task(name=f"t{bad!r}", timeout=bad)(lambda: None)  # type: ignore[call-overload]
    assert jobs.task(name="ok", timeout=0.5)(lambda: None).timeout == 0.5
