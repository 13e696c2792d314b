"""What ``sqla-jobs worker examples.flask_app.worker:jobs`` imports: the app, made by its
factory (its config from ``DATABASE_URL``), so that jobs run in its context."""

from __future__ import annotations

from .app import create_app, jobs

app = create_app()

__all__ = ["app", "jobs"]
