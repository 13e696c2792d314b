"""Reading what happened: runs per job, duplicate runs and their explanation, the figures
line, and waiting on conditions with deadlines (never a fixed sleep)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa

from . import faults_app as app

T = TypeVar("T")

#: Every figures line printed in this run, for the terminal summary (see conftest.py).
FIGURES: list[str] = []


def figures(scenario: str, **values: Any) -> str:
    """Print one ``FAULTS: scenario=... key=value ...`` line (and keep it for the summary)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(fmt(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{fmt(x)}" for k, x in v.items()) + "}"
        if v is None:
            return "-"
        return str(v)

    line = (
        "FAULTS: scenario=" + scenario + " " + " ".join(f"{k}={fmt(v)}" for k, v in values.items())
    )
    # On a line of its own, after pytest's progress dots (with -s).
    print("\n" + line, flush=True)
    FIGURES.append(line)
    return line


def wait_until(
    check: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout}s (last: {value!r})")
        time.sleep(interval)


def poll_until(check: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Like :func:`wait_until`, but say whether it happened instead of failing."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def status_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM faults.jobs GROUP BY status"))
        return {r[0]: int(r[1]) for r in rows}


def live_jobs(engine: sa.Engine) -> int:
    """Jobs not finished yet: scheduled, ready or running."""
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM faults.jobs WHERE status IN ('scheduled', 'ready', 'running')",
        )
    )


def job_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(
                    app.Job.id,
                    app.Job.task,
                    app.Job.queue,
                    app.Job.status,
                    app.Job.attempts,
                    app.Job.max_attempts,
                    app.Job.last_error,
                    app.Job.args["i"].astext.label("i"),
                ).order_by(app.Job.id)
            )
        )


def runs(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(app.Run.__table__).order_by(app.Run.id)))


@dataclass
class RunAnalysis:
    """Runs grouped by job, and which repeated runs a SIGKILL (or a death) explains."""

    by_job: dict[int, list[Any]]
    #: Jobs that ran more than once, and the number of extra runs.
    repeated_jobs: int = 0
    extra_runs: int = 0
    #: Extra runs explained: an earlier attempt ran in a process that was killed or died.
    explained: int = 0
    #: (job id, [(attempt, pid), ...]) for repeats that nothing explains.
    unexplained: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    #: (job id, attempt) recorded twice: one claim ran twice.
    same_attempt_twice: list[tuple[int, int]] = field(default_factory=list)
    max_runs: int = 0
    max_attempt: int = 0


def analyse_runs(all_runs: Iterable[Any], dead_pids: set[int]) -> RunAnalysis:
    """A job may run again only after its earlier run's process was SIGKILLed (or died):
    every run of a job but its last must come from a pid in ``dead_pids``."""
    by_job: dict[int, list[Any]] = defaultdict(list)
    for r in all_runs:
        by_job[r.job_id].append(r)
    result = RunAnalysis(by_job=dict(by_job))
    for job_id, job_runs in by_job.items():
        job_runs.sort(key=lambda r: (r.attempt, r.mono))
        result.max_runs = max(result.max_runs, len(job_runs))
        result.max_attempt = max(result.max_attempt, job_runs[-1].attempt)
        attempts = Counter(r.attempt for r in job_runs)
        result.same_attempt_twice += [(job_id, a) for a, n in attempts.items() if n > 1]
        if len(job_runs) == 1:
            continue
        result.repeated_jobs += 1
        result.extra_runs += len(job_runs) - 1
        earlier = job_runs[:-1]
        if all(r.pid in dead_pids for r in earlier):
            result.explained += len(earlier)
        else:
            result.unexplained.append((job_id, [(r.attempt, r.pid) for r in job_runs]))
    return result
