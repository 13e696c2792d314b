"""Create the app's tables: ``python -m examples.fastapi_app.create_tables``.

The users table, and the jobs table with its indexes, trigger and companion tables, from
the app's metadata (``DATABASE_URL``). An app that has migrations runs them instead
(``alembic upgrade head``: see ``examples/shortener``).
"""

from __future__ import annotations

import os

from sqla_jobs import create_engine

from .app import Base


def main() -> None:
    engine = create_engine(os.environ["DATABASE_URL"])
    try:
        with engine.begin() as conn:
            Base.metadata.create_all(conn)
    finally:
        engine.dispose()
    print("created:", ", ".join(sorted(Base.metadata.tables)))


if __name__ == "__main__":
    main()
