"""asyncio: :class:`AsyncJobSession` and :class:`AsyncWorker`, in one import.

They live in :mod:`sqla_jobs.session` and :mod:`sqla_jobs.worker.aio`; this module keeps
``from sqla_jobs.aio import AsyncJobSession, AsyncWorker`` working, and needs SQLAlchemy's
asyncio support (``pip install 'sqla-jobs[asyncio]'``).
"""

from __future__ import annotations

try:
    from .session import AsyncJobSession
except ImportError as exc:  # defined only where SQLAlchemy's asyncio support imports
    raise ImportError(
        "sqla_jobs.aio needs SQLAlchemy's asyncio support (greenlet): "
        "pip install 'sqla-jobs[asyncio]'"
    ) from exc
from .worker.aio import AsyncWorker

__all__ = ["AsyncJobSession", "AsyncWorker"]
