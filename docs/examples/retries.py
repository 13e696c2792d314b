"""The default retry policy, spelled out: what Jobs(), @jobs.task() and Backoff() use."""

from datetime import timedelta

from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import Backoff, JobMixin, Jobs


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)  # max_attempts=5, retry=Backoff(): the registry's defaults
assert jobs.max_attempts == 5
assert jobs.retry == Backoff(base=2.0, factor=2.0, cap=3600.0, jitter=0.1)


@jobs.task()  # no max_attempts, no retry: the registry's
def call_webhook(url: str) -> None: ...


@jobs.task(max_attempts=10, retry=Backoff(base=30, cap=timedelta(hours=6).total_seconds()))
def sync_account(account_id: int) -> None: ...


@jobs.task(retry=lambda attempt: 60 * attempt)  # any callable: attempt number -> seconds
def rebuild_index() -> None: ...


assert call_webhook.max_attempts == 5 and call_webhook.retry is jobs.retry
assert sync_account.max_attempts == 10

# The wait after failed attempt n is min(cap, base * factor ** (n - 1)), then +-10%.
exact = Backoff(jitter=0)
assert [exact(n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
assert exact(12) == 3600.0  # capped from the twelfth failure on (2 * 2**11 = 4096)
for n in range(1, 20):
    assert 0.9 * exact(n) <= Backoff()(n) <= min(3600.0, 1.1 * exact(n))

# A task with the defaults runs five times: at once, then about 2, 4, 8 and 16 s after
# each failure (30 s in all); the fifth failure makes the job dead.
print("waits after each failure:", [exact(n) for n in range(1, 5)])
