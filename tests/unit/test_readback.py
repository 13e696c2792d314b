"""What enqueue writes, a worker must be able to read back: with Python's limit on int
digits lifted (``sys.set_int_max_str_digits``), the encoder writes ints that no worker
with the default limit can decode, and the row would be a poison row. Refused at once."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from sqla_jobs import EnqueueError, Jobs, ResultError
from sqla_jobs._storable import INT_MAX_DIGITS
from sqla_jobs._tasks import check_meta
from sqla_jobs.worker.job import ClaimedJob, result_json

from .. import app


@pytest.fixture
def lifted() -> Iterator[None]:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(before)


@pytest.fixture
def task() -> Any:
    jobs = Jobs(app.Job)

    @jobs.task(name="t")
    def t(v: object, w: int = 0) -> None: ...

    return jobs.tasks["t"]


BIG = 10**INT_MAX_DIGITS  # one digit more than a worker reads


@pytest.mark.usefixtures("lifted")
def test_an_int_no_worker_reads_back_is_refused_at_enqueue_naming_where(task: Any) -> None:
    with pytest.raises(
        EnqueueError, match=r"argument 'v' \(at v\['a'\]\[1\]\) is an int of more than 4,300 digits"
    ):
        task.bind_args((), {"v": {"a": [1, BIG]}})
    with pytest.raises(EnqueueError, match="argument 'v' is an int of more than 4,300 digits"):
        task.bind_args((-BIG,), {})
    # enqueue_many's fast path, on the joined texts: the bad item is found.
    with pytest.raises(EnqueueError, match="argument 'v' is an int of more than 4,300 digits"):
        task.bind_many([{"v": 1}, {"v": 2}, {"v": BIG}])
    with pytest.raises(EnqueueError, match=r"meta key 'n' is an int of more than 4,300 digits"):
        check_meta({"n": BIG})
    with pytest.raises(ResultError, match="the result is an int of more than 4,300 digits"):
        result_json(BIG)
    now = datetime.now(timezone.utc)
    job = ClaimedJob(1, "a", "t", {}, 1, 3, 0, now, now)
    with pytest.raises(ValueError, match="progress is an int of more than 4,300 digits"):
        job.set_progress(BIG)
    # As many digits as a worker reads, and long strings of digits, are fine.
    assert task.bind_args((), {"v": BIG - 1}).json.startswith('{"v":9999')
    assert task.bind_many([{"v": "9" * 5000}])[0]["v"] == "9" * 5000


def test_with_the_default_limit_the_encoder_refuses_it_already(task: Any) -> None:
    with pytest.raises(EnqueueError, match=r"not JSON-serialisable .*Exceeds the limit \(4300"):
        task.bind_args((), {"v": BIG})
