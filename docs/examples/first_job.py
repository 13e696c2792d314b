import os

from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_jobs import JobMixin, Jobs, JobSession, Worker, create_engine


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):  # the jobs table, in your own metadata
    __tablename__ = "jobs"


class Link(Base):
    __tablename__ = "links"
    code: Mapped[str] = mapped_column(primary_key=True)


jobs = Jobs(Job)  # the task registry, bound to that table


@jobs.task(queue="previews")  # 5 attempts, exponential backoff between them
def fetch_preview(code: str) -> None:
    print("fetching the preview of", code)


engine = create_engine(os.environ["DATABASE_URL"])
Base.metadata.create_all(engine)  # in an application: an Alembic migration
Session = sessionmaker(engine, class_=JobSession, jobs=jobs)

with Session.begin() as session:  # the link and its job commit together, or neither
    session.add(Link(code="x7Kp"))
    session.enqueue(fetch_preview, code="x7Kp")  # checked against the handler's signature

Worker(jobs, engine).run_until_empty()  # in production: sqla-jobs worker app:jobs
