"""``JobMixin`` on every kind of declarative base gives the same, complete jobs table.

Issue 21: on a metaclass-based base (``declarative_base()``, ``registry.generate_base()``,
Flask-SQLAlchemy's ``db.Model``) and with ``@registry.mapped``, the mixin used to build a
bare table (no indexes, CHECK constraints, trigger or companion tables), which
``Jobs(model)`` accepted and autogenerate wrote as a plain ``op.create_table``; on a
``MappedAsDataclass`` base it did not map at all.

Each kind is a small models module, written as an application would write it. The same
source is compared in Python (its PostgreSQL DDL is the DeclarativeBase one's, statement
for statement) and used as the ``models.py`` of a throwaway Alembic project: real
``alembic revision --autogenerate``, ``upgrade``, ``alembic check``, ``sqla-jobs check``'s
comparison, and a job enqueued through the model and run by a worker.
"""

from __future__ import annotations

import sys
import uuid
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, registry
from sqlalchemy.schema import CreateIndex, CreateTable

from alembic_ext.check import schema_differences
from sqla_jobs import JobMixin, Jobs, JobSession, Worker
from sqla_jobs.model import ddl_statements

from .test_alembic import Project, assert_insert_notifies, assert_queue_objects, section
from .test_alembic import make_project as make_project  # the fixture, re-exported

HEADER = """\
import sqlalchemy as sa
from sqla_jobs import JobMixin
"""

#: kind -> models.py source (``{schema}`` and ``{table}`` filled in); each defines
#: ``Base`` (whose ``.metadata`` env.py reads) and the ``Job`` model.
KINDS: dict[str, str] = {
    "DeclarativeBase": """
from sqlalchemy.orm import DeclarativeBase

class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})

class Job(JobMixin, Base):
    __tablename__ = {table!r}
""",
    "DeclarativeBaseNoMeta": """
from sqlalchemy.orm import DeclarativeBaseNoMeta

class Base(DeclarativeBaseNoMeta):
    metadata = sa.MetaData(schema={schema!r})

class Job(JobMixin, Base):
    __tablename__ = {table!r}
""",
    "MappedAsDataclass": """
from sqlalchemy.orm import DeclarativeBase, MappedAsDataclass

class Base(MappedAsDataclass, DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})

class Job(JobMixin, Base):
    __tablename__ = {table!r}
""",
    "declarative_base()": """
from sqlalchemy.orm import declarative_base

Base = declarative_base(metadata=sa.MetaData(schema={schema!r}))

class Job(JobMixin, Base):
    __tablename__ = {table!r}
""",
    "registry.generate_base()": """
from sqlalchemy.orm import registry

Base = registry(metadata=sa.MetaData(schema={schema!r})).generate_base()

class Job(JobMixin, Base):
    __tablename__ = {table!r}
""",
    "registry.mapped": """
from sqlalchemy.orm import registry

Base = registry(metadata=sa.MetaData(schema={schema!r}))

@Base.mapped
class Job(JobMixin):
    __tablename__ = {table!r}
""",
    # Flask-SQLAlchemy 3.x's default db.Model (a metaclass-based declarative base), and
    # its default table name: "job", from the class name.
    "Flask-SQLAlchemy db.Model": """
from flask_sqlalchemy import SQLAlchemy

db = SQLAlchemy(metadata=sa.MetaData(schema={schema!r}))
Base = db.Model

class Job(JobMixin, db.Model):
    pass
""",
}

#: SQLAlchemy 2.1 or later: what a MappedAsDataclass jobs model needs (with 2.0 the
#: mixin refuses it, saying why: ``test_a_dataclass_base_on_sqlalchemy_2_0_is_refused``).
SA_21 = hasattr(sa.orm, "unmapped_dataclass")


def kinds() -> list[Any]:
    """The kinds, as parameters: the dataclass one only where SQLAlchemy maps it."""
    needs_21 = pytest.mark.skipif(not SA_21, reason="MappedAsDataclass needs SQLAlchemy 2.1")
    return [
        pytest.param(kind, marks=needs_21) if kind == "MappedAsDataclass" else kind
        for kind in KINDS
    ]


#: The table each kind's model maps.
TABLES = {kind: "job" if "Flask" in kind else "jobs" for kind in KINDS}


def load(kind: str, schema: str | None = None) -> ModuleType:
    """The kind's models module, imported from its source as an application's would be."""
    source = HEADER + KINDS[kind].format(schema=schema, table=TABLES[kind])
    name = f"declarative_kind_{uuid.uuid4().hex}"
    module = ModuleType(name)
    sys.modules[name] = module  # dataclasses and annotations resolve through it
    try:
        exec(compile(source, f"<{kind}>", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def postgresql_ddl(table: sa.Table) -> list[str]:
    """Every statement ``create_all`` runs on PostgreSQL for a jobs table and its
    companions: CREATE TABLE (columns, CHECK constraints), CREATE INDEX, the trigger DDL
    (only if the table has it attached)."""
    statements = []
    tables = [table, *table.info.get("sqla_jobs_companions", ())]
    for each in tables:
        statements.append(str(CreateTable(each).compile(dialect=_PG)))
        indexes = sorted(each.indexes, key=lambda i: str(i.name))
        statements += [str(CreateIndex(i).compile(dialect=_PG)) for i in indexes]
    if table.info.get("sqla_jobs_ddl"):
        statements += ddl_statements(table)
    return statements


def reference(table_name: str) -> sa.Table:
    class Base(DeclarativeBase):
        pass

    model: Any = type("Job", (JobMixin, Base), {"__tablename__": table_name})
    return model.__table__  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", kinds())
def test_every_declarative_style_declares_the_whole_table(kind: str) -> None:
    models = load(kind)
    table = models.Job.__table__
    assert postgresql_ddl(table) == postgresql_ddl(reference(TABLES[kind]))
    companions = {t.name for t in table.info["sqla_jobs_companions"]}
    assert len(companions) == 7 and companions <= set(table.metadata.tables)
    Jobs(models.Job)  # accepted: nothing is missing


@pytest.mark.skipif(SA_21, reason="SQLAlchemy 2.0 only")
def test_a_dataclass_base_on_sqlalchemy_2_0_is_refused() -> None:
    """With 2.0 a field the caller leaves out would be set to None, and ``args`` stored as
    JSON null instead of its server default: refused at declaration, saying why."""
    with pytest.raises(TypeError, match=r"needs SQLAlchemy 2\.1 or later"):
        load("MappedAsDataclass")


@pytest.mark.skipif(not SA_21, reason="MappedAsDataclass needs SQLAlchemy 2.1")
def test_a_dataclass_job_takes_its_server_defaults() -> None:
    """On a MappedAsDataclass base the columns are keyword-only fields that default to "not
    given": what the caller leaves out is not sent, so the database fills it in."""
    models = load("MappedAsDataclass")
    job = models.Job(task="t", args={"n": 1})
    assert (job.task, job.args) == ("t", {"n": 1})
    # Left out, so not sent in the INSERT (the autogenerate test below runs one).
    assert "queue" not in vars(job) and "status" not in vars(job)
    with pytest.raises(TypeError):
        models.Job("positional")  # keyword-only: no field order to get wrong


def test_the_mapped_as_dataclass_decorator_is_refused_naming_the_mixin() -> None:
    """``@registry.mapped_as_dataclass`` turns the class into a dataclass only after it is
    created, so the mixin cannot give it its own copies of the columns (as it does for a
    MappedAsDataclass base) and SQLAlchemy refuses the inherited ones at mapping time:
    loudly, naming JobMixin, never a half-mapped table. The docs point to the base."""
    from sqlalchemy.orm import registry

    from sqla_jobs import JobMixin

    reg = registry(metadata=sa.MetaData(schema="dataclass_decorator"))
    if not SA_21:  # 2.0 only warns that 2.1 refuses it
        with pytest.warns(sa.exc.SADeprecationWarning, match=r"JobMixin.*not a dataclass"):

            @reg.mapped_as_dataclass
            class Job20(JobMixin):
                __tablename__ = "jobs"

        return
    with pytest.raises(sa.exc.InvalidRequestError, match=r"JobMixin.*not a dataclass"):

        @reg.mapped_as_dataclass
        class Job(JobMixin):
            __tablename__ = "jobs"

    assert not reg.metadata.tables


def test_a_table_the_app_maps_itself_is_refused_with_what_it_lacks() -> None:
    """A Table the application builds and maps is left as it is (changing it could
    duplicate what it declares), and ``Jobs(model)`` says what it lacks at once."""
    metadata = sa.MetaData()

    def columns() -> list[sa.Column[Any]]:  # every column of a jobs table, nothing else
        return [
            sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
            for c in reference("jobs").columns
        ]

    table = sa.Table("jobs", metadata, *columns())

    class Job(JobMixin):
        pass

    registry().map_imperatively(Job, table)
    with pytest.raises(TypeError) as refused:
        Jobs(Job)
    message = str(refused.value)
    assert "maps table 'jobs', which lacks what a jobs table needs" in message
    for part in (
        "CHECK constraints 'jobs_args_object'",
        "'jobs_claim'",
        "companion tables 'jobs_queues', 'jobs_schedules'",
        "the notify trigger",
    ):
        assert part in message, message
    assert "columns" not in message  # it has all of them

    class Base(DeclarativeBase):
        pass

    class Declared(JobMixin, Base):
        __table__ = sa.Table("jobs", Base.metadata, *columns())

    with pytest.raises(TypeError, match="companion tables 'jobs_queues'"):
        Jobs(Declared)


@pytest.mark.parametrize("kind", kinds())
def test_autogenerate_writes_the_whole_queue(kind: str, make_project: Any) -> None:
    """The real ``alembic revision --autogenerate`` writes one ``op.create_jobs_table`` with
    every index and constraint, and the companion tables; after ``upgrade`` the database
    has the whole queue, ``alembic check`` and the schema check find nothing, and a job
    enqueued through the model is run by a worker."""
    project: Project = make_project(explicit_schema=True, table=TABLES[kind])
    project.write_models(HEADER + KINDS[kind])
    script = project.autogenerate("jobs")

    upgrade = section(script, "upgrade")
    table = TABLES[kind]
    jobs_op = next((s for s in upgrade if s.startswith("op.create_jobs_table(")), None)
    assert jobs_op is not None, upgrade
    assert not any(s.startswith(f"op.create_table('{table}',") for s in upgrade)
    for suffix in ("claim", "unique", "meta", "parents", "dead", "keys"):
        assert f"sa.Index('{table}_{suffix}'" in jobs_op
    for suffix in ("status", "args_object", "meta_object", "attempts_left"):
        assert f"name='{table}_{suffix}'" in jobs_op
    for suffix in (
        "queues",
        "schedules",
        "workers",
        "throughput",
        "unique_keys",
        "key_starts",
        "steps",
    ):
        assert any(s.startswith(f"op.create_table('{table}_{suffix}',") for s in upgrade)

    project.upgrade()
    assert_queue_objects(project)
    assert_insert_notifies(project)
    project.check()
    models = project.load_models()
    with project.engine.connect() as conn:
        assert schema_differences(conn, models.Job.__table__) == []

    jobs = Jobs(models.Job)

    @jobs.task(queue="kinds")
    def double(n: int) -> int:
        return 2 * n

    with JobSession(project.engine, jobs=jobs) as session:
        job = session.enqueue(double.with_options(keep_result=True), 21)
        session.commit()
        job_id = job.id
    assert (
        Worker(jobs, project.engine, queues=["kinds"], listen=False).run_until_empty(timeout=10)
        == 1
    )
    assert jobs.result(project.engine, job_id, timeout=5) == 42


def test_a_metadata_naming_convention_names_the_constraints(make_project: Any) -> None:
    """With a ``ck`` naming convention (common in Alembic projects) the CHECK constraints
    take the convention's names; ``Jobs(model)`` compares with a reference named the same
    way, and an existing table that lacks one gets it under that name."""
    convention = {"ck": "ck_%(table_name)s_%(constraint_name)s", "pk": "pk_%(table_name)s"}

    class Base(DeclarativeBase):
        metadata = sa.MetaData(naming_convention=convention)

    class Job(JobMixin, Base):
        __tablename__ = "jobs"

    names = {str(c.name) for c in Job.__table__.constraints}
    assert {"ck_jobs_jobs_status", "ck_jobs_jobs_meta_object", "pk_jobs"} <= names
    Jobs(Job)  # accepted: nothing is missing

    project: Project = make_project(explicit_schema=True)
    project.write_models(
        HEADER
        + """
from sqlalchemy.orm import DeclarativeBase

CONVENTION = {{"ck": "ck_%(table_name)s_%(constraint_name)s", "pk": "pk_%(table_name)s"}}

class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r}, naming_convention=CONVENTION)

class Job(JobMixin, Base):
    __tablename__ = {table!r}
"""
    )
    first = project.autogenerate("jobs")
    project.edit(first, ["name=op.f('ck_jobs_jobs_meta_object')"])
    project.upgrade()
    (upgrade,) = section(project.autogenerate("checks"), "upgrade")
    assert upgrade.startswith("op.create_jobs_checks('jobs', {'ck_jobs_jobs_meta_object': ")
    project.upgrade()
    project.check()
