"""What PostgreSQL can store, checked before anything is sent to it.

Some values are refused only when they reach the database: a NUL character in text or
JSON, a string that is not valid Unicode, an index entry over about 2.7 kB, a NOTIFY
payload over 8,000 bytes. A job is INSERTed at the caller's flush or commit, so such a
value would fail the caller's whole transaction there, far from the enqueue that caused
it. These checks run inside ``enqueue`` and at declaration instead; the table's own
CHECK constraints stay the last line.
"""

from __future__ import annotations

__all__ = [
    "DURATION_MAX_SECONDS",
    "INT_MAX_DIGITS",
    "META_MAX_BYTES",
    "META_RESERVED_PREFIX",
    "PROGRESS_MAX_BYTES",
    "QUEUE_MAX_BYTES",
    "SCHEDULE_NAME_MAX_BYTES",
    "UNIQUE_KEY_MAX_BYTES",
    "check_name",
    "text_problem",
]

#: A queue name is in the claim index and is the payload of every NOTIFY that wakes its
#: workers (at most 8,000 bytes); 128 bytes of UTF-8 is far more than a name needs.
QUEUE_MAX_BYTES = 128
#: A ``unique_key`` given by the caller is an entry of the unique index, whose rows hold
#: about 2.7 kB at most.
UNIQUE_KEY_MAX_BYTES = 1024
#: A schedule's jobs get the unique key ``periodic:<name>:<tick>``; 200 bytes keeps it
#: well inside the unique index.
SCHEDULE_NAME_MAX_BYTES = 200
#: A job's ``meta`` is for tags and correlation ids, not a second set of arguments: every
#: claim returns it and the ``<table>_meta`` GIN index holds an entry per value in it. 8 KiB
#: of JSON is far more than tags need, and keeps a mistake (a document passed as meta)
#: from riding every claim.
META_MAX_BYTES = 8192
#: ``meta`` keys that start with this belong to sqla-jobs (``sqla_jobs.trace``: the trace
#: context of the enqueuing span); ``enqueue`` refuses them from the caller.
META_RESERVED_PREFIX = "sqla_jobs."
#: A progress note rides the heartbeat's statement and is rewritten with the row: a
#: number and a sentence, or a small object, fit in far less than 4 KiB.
PROGRESS_MAX_BYTES = 4096
#: The most digits an int in a job's JSON may have: what a Python with its default limit
#: (``sys.int_info.default_max_str_digits``) reads back. A producer that lifted the limit
#: (``sys.set_int_max_str_digits``) could write more, and no worker could read the row.
INT_MAX_DIGITS = 4300
#: The longest ``keep_result``, retry delay or snooze (100 years): a result's retention
#: end and a job's next ``run_at`` must stay times that PostgreSQL and Python's datetime
#: hold (before the year 10000), or the statement that records the outcome would fail.
DURATION_MAX_SECONDS = 100 * 365.25 * 86400


def text_problem(text: str) -> str | None:
    """Why PostgreSQL could not store this string (as text or in JSON), or ``None``."""
    if "\x00" in text:
        return "contains a NUL character (\\x00), which PostgreSQL cannot store"
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return (
            f"contains the surrogate code point U+{ord(text[exc.start]):04X}, which is not "
            "valid Unicode text (PostgreSQL stores UTF-8)"
        )
    return None


def check_name(
    value: str, what: str, limit: int, error: type[ValueError] = ValueError, hint: str = ""
) -> None:
    """Raise ``error`` unless ``value`` is valid text of at most ``limit`` bytes of UTF-8."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        size = -1
    if 0 <= size <= limit and "\x00" not in value:
        return
    problem = text_problem(value) or f"is {size} bytes in UTF-8; at most {limit} are allowed"
    raise error(f"{what} {shorten(value)} {problem}{hint}")


def shorten(value: str, width: int = 60) -> str:
    """``repr(value)``, cut to about ``width`` characters for a message."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 4]}...{text[-1]}"
