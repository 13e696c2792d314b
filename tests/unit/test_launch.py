"""The launch plan of ``sqla-jobs worker`` (worker/_launch.py), without a database: which
flags mix, where the workers run, and what each child of the supervisor is given."""

from __future__ import annotations

import os
from typing import Any

import pytest

from sqla_jobs import Jobs, WorkerSettings
from sqla_jobs.worker._launch import LaunchError, LaunchPlan

from .. import app

URL = "postgresql+psycopg://u@h/db"


def plan(**given: Any) -> LaunchPlan:
    settings = given.pop("settings", WorkerSettings(concurrency=4))
    return LaunchPlan(Jobs(app.Job), "tests.app:jobs", settings, **given)


def test_one_database_runs_here_unless_processes_are_asked_for() -> None:
    assert plan(bind=URL).in_process and plan(bind=URL).children == 0
    assert plan(bind=URL, until_empty=True).in_process
    supervised = plan(bind=URL, processes=3)
    assert not supervised.in_process and supervised.children == 3


def test_shards_run_under_a_supervisor_unless_one_process_or_until_empty() -> None:
    shards = {"a": URL, "b": URL}
    assert plan(shards=shards).children == 2
    assert plan(shards=shards, processes=3).children == 6
    assert plan(shards=shards, one_process=True).in_process
    assert plan(shards=shards, until_empty=True).in_process


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"bind": URL, "processes": 2, "until_empty": True}, "--until-empty and --processes"),
        ({"shards": {"a": URL}, "processes": 2, "one_process": True}, "--one-process and"),
        ({"shards": {"a": URL}, "processes": 2, "until_empty": True}, "--until-empty and"),
    ],
)
def test_flags_that_do_not_mix_make_no_plan(given: dict[str, Any], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        plan(**given)


def test_each_child_of_one_database_gets_the_same_command_and_its_own_ports() -> None:
    settings = WorkerSettings(concurrency=4, name="w")
    launch = plan(
        settings=settings,
        bind=URL,
        processes=2,
        asyncio=True,
        metrics_at=("127.0.0.1", 9100),
        health_at=("0.0.0.0", 0),
        verbose=2,
        database_url=URL,
        log_argv=("--log-level", "INFO"),
        engine_path="app:engine",
    )
    common = ["-v", "-v", "--database-url", URL, "worker", "tests.app:jobs", *settings.to_argv()]
    common += ["--log-level", "INFO", "--engine", "app:engine", "--asyncio"]
    assert launch.child_argv(0) == [
        *common,
        "--metrics-port",
        "127.0.0.1:9100",
        "--health-port",
        "0.0.0.0:0",  # any free port, for each child
    ]
    assert launch.child_argv(1)[len(common) :] == [
        "--metrics-port",
        "127.0.0.1:9101",
        "--health-port",
        "0.0.0.0:0",
    ]


def test_child_i_of_a_sharded_plan_serves_shard_i_mod_the_shards() -> None:
    engine = object()  # the application's own engine (--engine), loaded again by the child
    settings = WorkerSettings(concurrency=4)
    launch = plan(
        settings=settings,
        shards={"a": URL, "b": engine},
        processes=2,
        engine_path="app:engines",
        health_at=("h", 8000),
    )
    common = ["worker", "tests.app:jobs", *settings.to_argv(), "--one-process"]
    assert [launch.child_argv(i)[len(common) :] for i in range(launch.children)] == [
        ["--shard", f"a={URL}", "--health-port", "h:8000"],
        ["--engine", "app:engines", "--engine-shard", "b", "--health-port", "h:8001"],
        ["--shard", f"a={URL}", "--health-port", "h:8002"],
        ["--engine", "app:engines", "--engine-shard", "b", "--health-port", "h:8003"],
    ]
    assert all(launch.child_argv(i)[: len(common)] == common for i in range(4))


class _Stoppable:
    def __init__(self) -> None:
        self.stops: list[bool] = []

    def stop(self, *, now: bool = False) -> None:
        self.stops.append(now)


def test_a_stop_signal_before_the_worker_runs_stops_it_gracefully() -> None:
    """``/healthz`` answers before the worker installs its handlers: a SIGTERM in that
    window must not kill the process (exit -15), it must stop the worker once it exists."""
    import signal as signals

    from sqla_jobs.worker._signals import EarlyStop

    early = EarlyStop()
    before = signals.getsignal(signals.SIGTERM)
    with early.installed():
        os.kill(os.getpid(), signals.SIGTERM)  # would end this process without the guard
        worker = _Stoppable()
        early.attach(worker)
        assert worker.stops == [False]
        os.kill(os.getpid(), signals.SIGINT)  # later ones reach the attached worker
        assert len(worker.stops) == 2
    assert signals.getsignal(signals.SIGTERM) is before


def test_sigquit_before_the_worker_runs_stops_it_now_once_attached() -> None:
    import signal as signals

    from sqla_jobs.worker._signals import EarlyStop

    early = EarlyStop()
    with early.installed():
        os.kill(os.getpid(), signals.SIGQUIT)  # would dump core and end this process
        worker = _Stoppable()
        early.attach(worker)
    assert worker.stops == [True]


def test_a_repeat_stops_now_a_second_after_the_first_and_never_in_a_supervised_child() -> None:
    """One stop delivered twice (the terminal's Ctrl-C and a wrapper passing it on) comes
    within milliseconds: the same stop. A person's second Ctrl-C comes later: now."""
    import signal as signals

    from sqla_jobs.worker import _signals

    clock = [100.0]
    tally = _signals.StopSignals(clock=lambda: clock[0])
    assert tally.take(signals.SIGTERM) == "stop"
    clock[0] += 0.05
    assert tally.take(signals.SIGINT) == "same"
    clock[0] += _signals.SAME_STOP_WITHIN
    assert tally.take(signals.SIGINT) == "now"
    tally.reset()
    assert tally.take(signals.SIGINT) == "stop"
    assert tally.take(signals.SIGQUIT) == "now"

    supervised = _signals.StopSignals(clock=lambda: clock[0])
    supervised.repeats_hurry = False  # what watch_supervisor sets in a supervisor's child
    assert supervised.take(signals.SIGTERM) == "stop"
    clock[0] += 60
    assert supervised.take(signals.SIGTERM) == "same"
    assert supervised.take(signals.SIGQUIT) == "now"
