"""The ``sqla-jobs`` command.

.. code-block:: console

    $ sqla-jobs worker myapp.tasks:jobs --queues previews,webhooks --concurrency 16

The database URL comes from ``--database-url`` or ``DATABASE_URL``; the registry (a
:class:`~sqla_jobs.Jobs`) from a ``module:attribute`` path, imported from the current
directory first, as ``python -m`` would. Errors are one line on stderr and a non-zero exit
code: 2 for bad usage (a bad URL, a path that does not import), 1 for a failure at run time.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import sqlalchemy as sa

from .db import create_engine
from .tasks import Jobs

__all__ = ["main"]

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code attached."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def load_registry(path: str) -> Jobs:
    """Import ``module:attribute`` and check that it is a :class:`Jobs` registry."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise CommandError(f"expected module:attribute (e.g. myapp.tasks:jobs), got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CommandError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CommandError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Jobs):
        raise CommandError(f"{path} is a {type(obj).__name__}, not a sqla_jobs.Jobs registry")
    return obj


def engine_from(args: argparse.Namespace) -> sa.Engine:
    url = args.database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise CommandError("no database: pass --database-url or set DATABASE_URL")
    try:
        return create_engine(url)
    except Exception as exc:
        raise CommandError(f"bad database URL: {exc}") from None


def _queues(text: str) -> list[str]:
    names = [q.strip() for q in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty queue name in {text!r}")
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def cmd_worker(args: argparse.Namespace) -> int:
    from .worker import Worker

    jobs = load_registry(args.registry)
    engine = engine_from(args)
    worker = Worker(
        jobs,
        engine,
        queues=args.queues,
        concurrency=args.concurrency,
        lease=args.lease,
        poll_interval=args.poll_interval,
        grace_period=args.grace_period,
        listen=not args.no_listen,
    )
    _check_table(engine, jobs)
    if args.until_empty:
        worker.run_until_empty()
    else:
        worker.run()
    return 0


def _check_table(engine: sa.Engine, jobs: Jobs) -> None:
    try:
        with engine.connect() as conn:
            exists = sa.inspect(conn).has_table(jobs.table.name, schema=jobs.table.schema)
    except sa.exc.DBAPIError as exc:
        raise CommandError(
            f"cannot connect to the database: {exc.orig}".strip(), EXIT_FAILURE
        ) from None
    if not exists:
        raise CommandError(
            f"table {jobs.table.fullname!r} does not exist: run your migrations "
            "(alembic upgrade head)",
            EXIT_FAILURE,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqla-jobs",
        description="A job queue in your own PostgreSQL database.",
    )
    parser.add_argument(
        "--database-url",
        help="PostgreSQL URL (default: $DATABASE_URL)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    worker = sub.add_parser(
        "worker",
        help="run a worker",
        description="Claim and run jobs until SIGINT or SIGTERM, then stop gracefully: "
        "no new claims, running jobs get the grace period, unstarted ones are handed back.",
    )
    worker.add_argument("registry", help="the Jobs registry, as module:attribute")
    worker.add_argument(
        "--queues",
        type=_queues,
        default=None,
        help="comma-separated queues to serve (default: every queue of the registry's tasks)",
    )
    worker.add_argument(
        "--concurrency",
        type=_positive_int,
        default=10,
        help="handlers running at once (default: 10)",
    )
    worker.add_argument(
        "--lease",
        type=_positive_float,
        default=30.0,
        help="seconds a claim is held between heartbeats (default: 30)",
    )
    worker.add_argument(
        "--poll-interval",
        type=_positive_float,
        default=1.0,
        help="longest sleep between claims without a NOTIFY (default: 1)",
    )
    worker.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds running jobs get to finish on stop (default: 30)",
    )
    worker.add_argument(
        "--no-listen", action="store_true", help="poll only (for PgBouncer transaction pooling)"
    )
    worker.add_argument(
        "--until-empty", action="store_true", help="stop once no job is ready (scripts, cron)"
    )
    worker.set_defaults(func=cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
    except CommandError as exc:
        print(f"sqla-jobs: error: {exc}", file=sys.stderr)
        code = exc.code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
