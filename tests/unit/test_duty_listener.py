"""The listener duty (worker/_duties/listener.py), without a database: what each
notification wakes. (Whether a LISTEN hears at all: test_pooling.py.)"""

from __future__ import annotations

import time
from typing import Any

from sqla_jobs.worker import _steps as s

from .test_core import make, run_steps


def test_notifications_wake_for_own_queues_and_poke_for_cancellations() -> None:
    core, driver, _ = make(queues=("a",))
    payloads = iter([["b"], ["a"], ["!cancel"]])

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Notifications):
            try:
                return next(payloads)
            except StopIteration:
                core.stopping = True
                return []
        return None

    steps, more = run_steps(core.listener.run_once(), answer)
    assert isinstance(steps[0], s.Listen) and more is False
    assert driver.wakes == 2  # once on LISTEN, once for queue a; none for b
    assert driver.pokes == 1 and not core.listening.is_set()


def test_a_notification_makes_its_queue_wet_and_outlasts_a_claim_that_began_before_it() -> None:
    core, _, _ = make(queues=("a",))
    core.fetcher.dry["a"] = time.monotonic() + 60
    payloads = iter([["a"]])

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Notifications):
            try:
                return next(payloads)
            except StopIteration:
                core.stopping = True
                return []
        return None

    run_steps(core.listener.run_once(), answer)
    assert "a" not in core.fetcher.dry and core.listener.listened
    assert core.fetcher.notified["a"] <= time.monotonic()
