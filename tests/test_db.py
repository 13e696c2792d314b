"""Database URLs: what ``normalize_url`` turns into psycopg 3, and what it refuses."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

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
