"""The JSON log lines of ``sqla-jobs worker --log-format json``."""

from __future__ import annotations

import json
import logging

import pytest

from sqla_jobs.logs import JsonFormatter, configure


def record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("sqla_jobs.worker")
    rec = logger.makeRecord(
        "sqla_jobs.worker", logging.WARNING, __file__, 1, "job %s: %s", (7, "ünïcode"), None
    )
    rec.__dict__.update(extra)
    return rec


def test_one_object_per_line_with_the_extra_fields() -> None:
    line = JsonFormatter().format(record(job_id=7, outcome="dead", duration=0.5, obj=object()))
    assert "\n" not in line
    data = json.loads(line)
    assert data["message"] == "job 7: ünïcode"
    assert (data["level"], data["logger"]) == ("WARNING", "sqla_jobs.worker")
    assert data["time"].endswith("+00:00")
    assert (data["job_id"], data["outcome"], data["duration"]) == (7, "dead", 0.5)
    assert data["obj"].startswith("<object object")  # anything else becomes its str()
    assert "args" not in data and "msg" not in data  # the record's own attributes stay out


def test_a_traceback_stays_on_the_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = record()
        rec.exc_info = sys.exc_info()
    data = json.loads(JsonFormatter().format(rec))
    assert data["exc_info"].startswith("Traceback") and "ValueError: boom" in data["exc_info"]


def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure("INFO", "yaml")


def test_a_line_logged_in_a_run_gets_its_job_and_keeps_its_own_extra() -> None:
    from datetime import datetime, timezone

    from sqla_jobs.logs import TEXT_FORMAT, JobContext
    from sqla_jobs.worker.job import ClaimedJob, reset_current, set_current

    now = datetime.now(timezone.utc)
    job = ClaimedJob(7, "mail", "myapp.send", {}, 2, 5, 0, now, now, worker="w1")
    outside = logging.LogRecord("myapp", logging.WARNING, __file__, 1, "no job", (), None)
    assert JobContext().filter(outside) and "job_id" not in outside.__dict__
    token = set_current(job)
    try:
        inside = logging.LogRecord("myapp", logging.WARNING, __file__, 1, "bounced", (), None)
        inside.task = "the line's own"
        assert JobContext().filter(inside)
    finally:
        reset_current(token)
    text = logging.Formatter(TEXT_FORMAT, defaults={"job_prefix": ""}).format(inside)
    assert text.endswith("myapp: job 7 (myapp.send, queue mail, attempt 2/5): bounced")
    data = json.loads(JsonFormatter().format(inside))
    assert (data["job_id"], data["queue"], data["attempt"], data["worker"]) == (7, "mail", 2, "w1")
    assert data["task"] == "the line's own" and "job_prefix" not in data


def test_an_error_of_the_logging_itself_is_printed_to_stderr_as_logging_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log line or a listener that raised is printed to stderr, named, with its
    traceback (the logging that would say so is what failed); not at all when the
    application turned ``logging.raiseExceptions`` off, as logging does for its own."""
    from sqla_jobs.errors import print_unlogged

    try:
        raise ConnectionError("log shipper unreachable")
    except ConnectionError:
        print_unlogged("the line about a job failed")
    err = capsys.readouterr().err
    assert err.startswith("--- sqla_jobs: the line about a job failed\n")
    assert "ConnectionError: log shipper unreachable" in err
    monkeypatch.setattr(logging, "raiseExceptions", False)
    try:
        raise ConnectionError("again")
    except ConnectionError:
        print_unlogged("the line about a job failed")
    assert capsys.readouterr().err == ""
