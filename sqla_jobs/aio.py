"""asyncio: ``AsyncJobSession`` (needs ``pip install 'sqla-jobs[asyncio]'``, i.e. greenlet).

``enqueue`` on an ``AsyncSession`` is a plain method, not a coroutine: it only adds to
the unit of work, and the INSERT happens at the (awaited) flush or commit.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from .session import EnqueueMixin

__all__ = ["AsyncJobSession"]


class AsyncJobSession(EnqueueMixin, AsyncSession):
    """An ``AsyncSession`` with ``enqueue``; ``async_sessionmaker(..., class_=AsyncJobSession,
    jobs=jobs)``."""
