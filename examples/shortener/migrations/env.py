"""Alembic environment of the Snip example: a standard env.py plus one import."""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context

import alembic_ext  # noqa: F401  registers op.create_jobs_table and its autogenerate support
from examples.shortener.app import Base
from sqla_jobs import create_engine

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=os.environ.get("DATABASE_URL", "postgresql+psycopg://"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(os.environ["DATABASE_URL"])
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
