"""asyncio: ``AsyncJobSession`` (needs ``pip install 'sqla-jobs[asyncio]'``, i.e. greenlet).

``enqueue`` on an ``AsyncSession`` is a plain method, not a coroutine: it only adds to
the unit of work, and the INSERT happens at the (awaited) flush or commit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from .errors import EnqueueError
from .session import EnqueueMixin

__all__ = ["AsyncJobSession"]


class AsyncJobSession(EnqueueMixin, AsyncSession):
    """An ``AsyncSession`` with ``enqueue``; ``async_sessionmaker(..., class_=AsyncJobSession,
    jobs=jobs)``.

    A unique job must be inserted at once to know whether it is new, which on asyncio
    means awaiting: use :meth:`enqueue_unique` for those.
    """

    def enqueue(self, task: Any, /, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("unique") or kwargs.get("unique_key") is not None:
            raise EnqueueError(
                "a unique job is inserted at once: use `await session.enqueue_unique(...)` "
                "on an AsyncSession"
            )
        return super().enqueue(task, *args, **kwargs)

    async def enqueue_unique(self, task: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``enqueue(..., unique=True)`` (or with ``unique_key=``), awaited."""
        if kwargs.get("unique_key") is None:
            kwargs["unique"] = True

        def run(sync_session: Any) -> Any:
            return EnqueueMixin.enqueue(sync_session, task, *args, **kwargs)

        return await self.run_sync(run)
