"""Snip, a link shortener: creating a link queues its preview and webhook jobs in the
same transaction, so there is never a link without its jobs, nor a job for a
link that was rolled back.

Everything here is ordinary SQLAlchemy. The only sqla-jobs pieces are the ``Job`` model,
the ``jobs`` registry with its two tasks, and ``session.enqueue``.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_jobs import Backoff, JobMixin, Jobs, JobSession, PermanentError, create_engine


class Base(DeclarativeBase):
    pass


class Link(Base):
    __tablename__ = "links"

    code: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    long_url: Mapped[str] = mapped_column(sa.Text)
    owner_webhook: Mapped[str | None] = mapped_column(sa.Text)
    title: Mapped[str | None] = mapped_column(sa.Text)


class Job(JobMixin, Base):
    """The app's jobs table, in the app's own metadata and migrations."""

    __tablename__ = "jobs"


jobs = Jobs(Job, retry=Backoff(base=0.2, cap=5))


def engine() -> sa.Engine:
    return create_engine(os.environ["DATABASE_URL"])


@jobs.task(queue="previews", max_attempts=5, transactional=True)
def fetch_preview(session: Session, code: str) -> None:
    """Fetch the page and store its <title>. Transactional: the title is written in the
    same transaction that completes the job, so it is written exactly once."""
    link = session.get(Link, code)
    if link is None:
        raise PermanentError(f"no link {code!r}")  # nothing to retry for
    with urllib.request.urlopen(link.long_url, timeout=5) as response:
        page = response.read(65536).decode("utf-8", "replace")
    match = re.search(r"<title>(.*?)</title>", page, re.IGNORECASE | re.DOTALL)
    link.title = match.group(1).strip() if match else None


@jobs.task(queue="webhooks", max_attempts=8)
def call_webhook(code: str, event: str, url: str) -> None:
    """POST the event to the owner's webhook. A failure (their server is down) raises, and
    the job is retried with backoff; the receiver must accept repeats (at least once)."""
    body = json.dumps({"event": event, "code": code}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()


def create_link(session: JobSession, code: str, long_url: str, webhook: str | None) -> None:
    """What the web request does: one transaction for the link and its jobs."""
    session.add(Link(code=code, long_url=long_url, owner_webhook=webhook))
    session.enqueue(fetch_preview, code=code)
    if webhook:
        session.enqueue(call_webhook, code=code, event="link.created", url=webhook)


def sessions(bind: sa.Engine) -> sessionmaker[JobSession]:
    return sessionmaker(bind, class_=JobSession, jobs=jobs)
