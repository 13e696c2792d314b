"""asyncio: :class:`AsyncJobSession` and :class:`AsyncWorker`, in one import.

They live in :mod:`sqla_jobs.session` and :mod:`sqla_jobs.worker.aio`; this module keeps
``from sqla_jobs.aio import AsyncJobSession, AsyncWorker`` working, and needs SQLAlchemy's
asyncio support (``pip install 'sqla-jobs[asyncio]'``).
"""

from __future__ import annotations

from .session import AsyncJobSession
from .worker.aio import AsyncWorker

__all__ = ["AsyncJobSession", "AsyncWorker"]
