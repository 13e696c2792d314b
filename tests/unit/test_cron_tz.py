"""Cron in a time zone, across both daylight-saving changes of 2026 in Europe/Paris
(29 March: 02:00 CET becomes 03:00 CEST; 25 October: 03:00 CEST becomes 02:00 CET)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from sqla_jobs.cron import check_cron, next_tick

PARIS = "Europe/Paris"


def ticks(expression: str, start: datetime, n: int, tz: str | None = PARIS) -> list[str]:
    out, t = [], start
    for _ in range(n):
        t = next_tick(expression, t, tz)
        assert t.tzinfo is not None and t.utcoffset() == timezone.utc.utcoffset(t)
        out.append(t.strftime("%m-%d %H:%MZ"))
    return out


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)


def test_nine_on_weekdays_is_nine_in_paris_summer_and_winter() -> None:
    assert ticks("0 9 * * 1-5", utc(2026, 3, 26, 12), 3) == [
        "03-27 08:00Z",  # Friday, CET
        "03-30 07:00Z",  # Monday, CEST
        "03-31 07:00Z",
    ]
    assert ticks("0 9 * * 1-5", utc(2026, 10, 23, 12), 2) == ["10-26 08:00Z", "10-27 08:00Z"]


def test_a_tick_in_the_skipped_hour_fires_once() -> None:
    # 02:30 does not exist on 29 March: the job runs once, at 03:00 CEST.
    assert ticks("30 2 * * *", utc(2026, 3, 28, 12), 3) == [
        "03-29 01:00Z",
        "03-30 00:30Z",
        "03-31 00:30Z",
    ]
    # An hourly job misses no run and runs no hour twice.
    assert ticks("0 * * * *", utc(2026, 3, 28, 23, 30), 4) == [
        "03-29 00:00Z",  # 01:00 CET
        "03-29 01:00Z",  # 03:00 CEST (02:00 does not exist)
        "03-29 02:00Z",
        "03-29 03:00Z",
    ]


def test_a_tick_in_the_repeated_hour_fires_once() -> None:
    # 02:30 happens twice on 25 October (CEST, then CET): the job runs the first time only.
    assert ticks("30 2 * * *", utc(2026, 10, 24, 12), 3) == [
        "10-25 00:30Z",
        "10-26 01:30Z",
        "10-27 01:30Z",
    ]
    assert ticks("*/30 * * * *", utc(2026, 10, 24, 23, 15), 6) == [
        "10-24 23:30Z",  # 01:30 CEST
        "10-25 00:00Z",  # 02:00 CEST
        "10-25 00:30Z",  # 02:30 CEST; 02:00 and 02:30 CET are skipped
        "10-25 02:00Z",  # 03:00 CET
        "10-25 02:30Z",
        "10-25 03:00Z",
    ]


def test_utc_is_the_default_and_bad_zones_are_refused() -> None:
    assert ticks("30 2 * * *", utc(2026, 10, 24, 12), 2, tz=None) == [
        "10-25 02:30Z",
        "10-26 02:30Z",
    ]
    with pytest.raises(ValueError, match="unknown time zone 'Europe/Pariss'"):
        check_cron("* * * * *", tz="Europe/Pariss")
    with pytest.raises(ValueError, match="time zone must be an IANA name"):
        check_cron("* * * * *", tz="")


def _walked(expression: str, due: datetime, now: datetime, tz: str | None) -> datetime:
    """The latest tick at or before ``now`` from ``due``, one step at a time."""
    latest = due
    while (after := next_tick(expression, latest, tz)) <= now:
        latest = after
    return latest


@pytest.mark.parametrize("tz", [None, "Europe/Paris", "America/New_York", "Australia/Lord_Howe"])
@pytest.mark.parametrize("expression", ["* * * * *", "15 * * * *", "30 2 * * *", "0 */3 * * 1-5"])
def test_the_latest_tick_is_the_one_stepping_forward_finds(expression: str, tz: str | None) -> None:
    """``latest_tick`` reads it back from the tick after ``now`` (one step, where walking
    forward was a step per missed tick); it must land where walking forward lands,
    through the changes of offset of each zone (spring and autumn, 2026)."""
    from sqla_jobs.cron import latest_tick

    starts = [datetime(2026, 3, 7, tzinfo=timezone.utc), datetime(2026, 10, 1, tzinfo=timezone.utc)]
    for start in starts:
        due = next_tick(expression, start, tz)
        for hours in (0, 1, 5, 26, 24 * 3):
            now = due + timedelta(hours=hours, minutes=7)
            assert latest_tick(expression, due, now, tz) == _walked(expression, due, now, tz)


@pytest.mark.parametrize("expression", ["0 R * * *", "R * * * *", "r(0-30) * * * *"])
def test_a_random_field_is_refused(expression: str) -> None:
    """croniter draws ``R`` anew each time it reads the expression, at every tick: a
    "daily at a random hour" fired several times a day."""
    with pytest.raises(ValueError, match="random field"):
        check_cron(expression)
    assert check_cron("0 0 * MAR FRI")  # names with an R are no random field
