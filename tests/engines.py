"""Engines as an application makes them, for ``sqla-jobs ... --engine tests.engines:NAME``
(see tests/test_cli_engine.py).

Each is made with SQLAlchemy's own ``create_engine`` (not sqla-jobs'), with
``connect_args={"prepare_threshold": None}`` and a ``connect`` event that names the
connection ``<tag>-pt<prepare_threshold>`` (``application_name``): a test that finds a
worker's connections under that name in ``pg_stat_activity`` knows that the worker used
this engine, its connect arguments and its events.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqla_jobs.db import normalize_url

URL = normalize_url(os.environ["DATABASE_URL"])


def _tag(engine: sa.Engine, tag: str) -> None:
    @event.listens_for(engine, "connect")
    def name(dbapi_connection: Any, record: Any) -> None:
        # An AsyncEngine's DBAPI connection is SQLAlchemy's adapter of psycopg's.
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        threshold = driver.prepare_threshold
        cursor = dbapi_connection.cursor()
        cursor.execute(
            "SELECT set_config('application_name', %s, false)", (f"{tag}-pt{threshold}",)
        )
        cursor.close()
        dbapi_connection.commit()


def make_engine(tag: str = "app-factory") -> sa.Engine:
    """An engine factory, as ``--engine tests.engines:make_engine`` calls it."""
    made = sa.create_engine(URL, connect_args={"prepare_threshold": None}, pool_pre_ping=True)
    _tag(made, tag)
    return made


def make_async_engine(tag: str = "app-async") -> AsyncEngine:
    made = create_async_engine(
        URL.set(drivername="postgresql+psycopg_async"),
        connect_args={"prepare_threshold": None},
        pool_pre_ping=True,
    )
    _tag(made.sync_engine, tag)
    return made


engine = make_engine("app-engine")
async_engine = make_async_engine()
shards = {"eu": make_engine("app-shard-eu"), "us": make_engine("app-shard-us")}
async_shards = {"eu": make_async_engine("app-ashard-eu"), "us": make_async_engine("app-ashard-us")}

#: The mistake the README warns about: the URL's parameter reaches psycopg as a string.
string_threshold = sa.create_engine(URL.update_query_dict({"prepare_threshold": "None"}))

not_an_engine = 42
