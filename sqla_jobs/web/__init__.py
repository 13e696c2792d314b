"""A web dashboard for the queue: see and steer it in a browser.

.. code-block:: python

    from sqla_jobs.web import create_app            # pip install 'sqla-jobs[web]'

    dashboard = create_app(jobs, engine)              # read-only
    dashboard = create_app(jobs, engine, authorize=lambda request: is_admin(request))

    app.mount("/jobs", dashboard)                     # FastAPI or Starlette

It is an ASGI application (Starlette, Jinja2 templates, htmx for the live parts, with no
JavaScript build step) that mounts under any path of an ASGI app, and under a WSGI app
(Flask, Django) through ``a2wsgi.ASGIMiddleware``; ``sqla-jobs web myapp.tasks:jobs``
serves it on its own (uvicorn). Pages: an overview of the queues (counts, lag, a chart
of outcomes per minute, pause state, refreshed live), the jobs (filters, search, keyset
pages, newest first), one job in full, the schedules, the workers.

Every read goes through :mod:`sqla_jobs.admin` and reads through an index; every action
too, guarded by what the page showed (:class:`~sqla_jobs.admin.SeenJob`): a job that
moved on since is left alone, and the result page says so.

.. warning::

    Mounted with no options, the dashboard is **read-only**. Actions need
    ``authorize=`` (a callable ``request -> bool``), or ``read_only=False``, which lets
    anyone who can reach the page retry, cancel and delete jobs: only behind your own
    authentication. Reading is not guarded by ``authorize``: job arguments and errors may
    hold personal data, so mount the dashboard where only operators can reach it.
    Actions are POSTs with a CSRF token (a double-submit cookie signed with the app's
    ``secret``, plus the browser's ``Origin`` and ``Sec-Fetch-Site``), and pages are
    served with a Content-Security-Policy that allows no inline script. It answers only
    for the ``Host`` names of ``allowed_hosts=`` (the loopback names by default): give
    the names it is reached by when you mount it.
"""

from __future__ import annotations

try:
    from .app import Dashboard, create_app
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"sqla_jobs.web needs the 'web' extra: pip install 'sqla-jobs[web]' ({exc})"
    ) from exc

__all__ = ["Dashboard", "create_app"]
