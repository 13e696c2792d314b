"""What ``sqla-jobs worker tests.flask_worker:jobs`` imports: the Flask app, made by its
factory, and its registry (the Celery-with-Flask habit)."""

from __future__ import annotations

from .flask_app import create_app, jobs

app = create_app()

__all__ = ["app", "jobs"]
