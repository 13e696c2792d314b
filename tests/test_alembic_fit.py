"""alembic_ext and the admin retry where a model meets the application's own setup: the
default schema named explicitly, a foreign key of the app's own on the jobs table, an
index naming convention, the documented ``include_name`` and filters that leave out a
CHECK constraint.

Alembic projects are written into temporary directories and run through
``alembic.command``, as in tests/test_alembic.py; each test owns its schemas and drops
them at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import alembic
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.orm import Session

from alembic_ext.check import schema_differences
from sqla_jobs import Jobs, admin, create_engine

from .helpers import wait_for
from .test_alembic import section

DOCS = Path(__file__).parent.parent / "docs" / "migrations"

ENV_PY = """\
import importlib.util
import json
from pathlib import Path

import sqlalchemy as sa
from alembic import context

import alembic_ext  # noqa: F401

config = context.config
here = Path(config.config_file_name).parent
spec = importlib.util.spec_from_file_location("fit_models", here / "models.py")
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)

extra = json.loads((here / "env_options.json").read_text())
exclude = set(extra.pop("exclude", []))
include_name = extra.pop("include_name", None)


def include_object(obj, name, type_, reflected, compare_to):
    return name not in exclude


options = dict(target_metadata=models.Base.metadata, include_object=include_object, **extra)
if include_name is not None:
    options["include_name"] = eval(include_name)

engine = sa.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=sa.pool.NullPool)
with engine.connect() as connection:
    context.configure(connection=connection, **options)
    with context.begin_transaction():
        context.run_migrations()
"""

HEADER = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import JobMixin
"""

#: A jobs model and an app table, in the schema that ``MetaData`` names.
MODELS = (
    HEADER
    + """
class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})


class Job(JobMixin, Base):
    __tablename__ = {table!r}


class Link(Base):
    __tablename__ = "links"
    code: Mapped[str] = mapped_column(sa.Text, primary_key=True)
"""
)

#: A jobs model with a column of the app's own that references an app table.
FK_MODELS = (
    HEADER
    + """
class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)


class Job(JobMixin, Base):
    __tablename__ = "jobs"
    user_id: Mapped[int | None] = mapped_column(sa.ForeignKey(User.id))
"""
)


def load_source(source: str) -> ModuleType:
    name = f"fit_models_{uuid.uuid4().hex}"
    module = ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def quoted(*names: str) -> str:
    return ".".join('"' + n.replace('"', '""') + '"' for n in names)


class Project:
    """A throwaway Alembic project; ``search_path`` makes a schema the default one."""

    def __init__(
        self, root: Path, url: sa.URL, *, search_path: str | None, options: dict[str, Any]
    ) -> None:
        self.root = root
        if search_path is not None:
            url = url.update_query_dict({"options": f"-csearch_path={search_path}"})
        self.url = url
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        (root / "migrations" / "versions").mkdir(parents=True)
        template = Path(alembic.__file__).parent / "templates" / "generic" / "script.py.mako"
        shutil.copy(template, root / "migrations" / "script.py.mako")
        (root / "migrations" / "env.py").write_text(ENV_PY)
        self.options = options
        self.write_options()
        u = url.render_as_string(hide_password=False).replace("%", "%%")
        (root / "alembic.ini").write_text(
            f"[alembic]\nscript_location = %(here)s/migrations\nsqlalchemy.url = {u}\n"
        )

    def write_options(self) -> None:
        (self.root / "env_options.json").write_text(json.dumps(self.options))

    def write_models(self, source: str) -> None:
        (self.root / "models.py").write_text(source)

    @property
    def config(self) -> Config:
        return Config(str(self.root / "alembic.ini"))

    def autogenerate(self, message: str) -> list[str]:
        script = command.revision(self.config, message=message, autogenerate=True)
        assert script is not None and not isinstance(script, list)
        return section(Path(script.path), "upgrade")

    def upgrade(self) -> None:
        command.upgrade(self.config, "head")

    def check(self) -> None:
        command.check(self.config)


@pytest.fixture
def schemas(database_url: str) -> Iterator[Any]:
    """``schemas()``: a new schema of the test's own, dropped at the end."""
    made: list[str] = []
    admin_engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)

    def make() -> str:
        name = f"fit_{uuid.uuid4().hex[:10]}"
        with admin_engine.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {quoted(name)}"))
        made.append(name)
        return name

    yield make
    with admin_engine.begin() as conn:
        for name in made:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {quoted(name)} CASCADE"))
    admin_engine.dispose()


@pytest.fixture
def project(tmp_path: Path, database_url: str) -> Iterator[Any]:
    made: list[Project] = []

    def make(*, search_path: str | None = None, **options: Any) -> Project:
        root = tmp_path / f"p{len(made)}"
        p = Project(root, sa.make_url(database_url), search_path=search_path, options=options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.engine.dispose()


def drop(engine: sa.Engine, schema: str, *statements: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement.format(jobs=quoted(schema, "jobs"))))


# --- B1: the connection's default schema, named explicitly by the model -------------------


def test_a_jobs_table_named_in_the_default_schema_gets_its_indexes_inside_create_jobs_table(
    schemas: Any, project: Any
) -> None:
    """``MetaData(schema=S)`` with S the connection's default schema: Alembic writes the
    table's index operations under schema None, and they were not folded into
    ``op.create_jobs_table`` (which keeps S): they came out as loose ``op.create_index``."""
    schema = schemas()
    p = project(search_path=schema)
    p.write_models(MODELS.format(schema=schema, table="jobs"))
    upgrade = p.autogenerate("jobs")
    jobs_op = next(s for s in upgrade if s.startswith("op.create_jobs_table("))
    assert "sa.Index('jobs_claim'" in jobs_op and "sa.Index('jobs_unique'" in jobs_op
    # The companion tables' indexes are Alembic's plain op.create_index, as always.
    assert not [s for s in upgrade if re.match(r"op\.create_index\('[^']*', 'jobs',", s)]
    p.upgrade()
    p.check()


def test_a_jobs_table_named_in_the_default_schema_gets_a_lost_trigger_and_check_back(
    schemas: Any, project: Any
) -> None:
    """Same model: the comparators compared ``table.schema`` (S) with Alembic's schemas,
    where the default schema is None: a dropped notify trigger or CHECK constraint gave an
    empty migration."""
    schema = schemas()
    p = project(search_path=schema)
    p.write_models(MODELS.format(schema=schema, table="jobs"))
    p.autogenerate("jobs")
    p.upgrade()
    drop(
        p.engine,
        schema,
        'DROP TRIGGER "jobs_notify" ON {jobs}',
        'ALTER TABLE {jobs} DROP CONSTRAINT "jobs_meta_object"',
    )
    upgrade = p.autogenerate("drift")
    assert any(s.startswith("op.replace_jobs_ddl('jobs'") for s in upgrade), upgrade
    assert any(
        s.startswith("op.create_jobs_checks('jobs'") and "jobs_meta_object" in s for s in upgrade
    ), upgrade
    p.upgrade()
    p.check()


def test_check_of_a_table_named_in_the_default_schema_finds_it_and_what_it_lacks(
    schemas: Any, database_url: str
) -> None:
    """``schema_differences`` (``sqla-jobs check``, the worker's check, /healthz) looked for
    the tables under S where Alembic compares the default schema as None: all 8 tables
    were reported missing."""
    schema = schemas()
    url = sa.make_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        models = load_source(MODELS.format(schema=schema, table="jobs"))
        with engine.begin() as conn:
            models.Base.metadata.create_all(conn)
        with engine.connect() as conn:
            assert [d.message for d in schema_differences(conn, models.Job.__table__)] == []
        drop(engine, schema, 'ALTER TABLE {jobs} DROP CONSTRAINT "jobs_meta_object"')
        with engine.connect() as conn:
            found = [(d.table, d.kind) for d in schema_differences(conn, models.Job.__table__)]
        assert found == [(f"{schema}.jobs", "check")]
    finally:
        engine.dispose()


def run_check(tmp_path: Path, url: sa.URL, source: str) -> subprocess.CompletedProcess[str]:
    """``sqla-jobs check`` on the model ``Job`` of ``source``, in a process of its own."""
    pkg = tmp_path / f"app_{uuid.uuid4().hex[:6]}"
    pkg.mkdir()
    module = f"fit_models_{uuid.uuid4().hex[:8]}"
    (pkg / f"{module}.py").write_text(source)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")]),
    }
    env["DATABASE_URL"] = url.render_as_string(hide_password=False)
    exe = Path(sys.executable).parent / "sqla-jobs"
    return subprocess.run(
        [str(exe), "check", f"{module}:Job"], capture_output=True, text=True, env=env, timeout=60
    )


def test_cli_check_of_a_model_in_metadata_schema_public_passes(
    tmp_path: Path, database_url: str
) -> None:
    """``MetaData(schema="public")``, tables made by ``create_all``: ``sqla-jobs check``
    said every table was missing and exited 1."""
    table = f"fitjobs_{uuid.uuid4().hex[:6]}"
    source = MODELS.format(schema="public", table=table).replace(
        '__tablename__ = "links"', f'__tablename__ = "{table}_links"'
    )
    models = load_source(source)
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        models.Base.metadata.create_all(conn)
    try:
        result = run_check(tmp_path, sa.make_url(database_url), source)
        assert result.returncode == 0, (result.stdout, result.stderr[-2000:])
        assert "the schema is this version's" in result.stdout
    finally:
        with engine.begin() as conn:
            models.Base.metadata.drop_all(conn)
        engine.dispose()


# --- B2: a foreign key of the app's own on the jobs table ---------------------------------


def test_check_of_a_jobs_model_with_a_foreign_key_compares_the_definitions(
    schemas: Any, database_url: str
) -> None:
    """The definitions of indexes and CHECK constraints are read back from copies made in
    ``pg_temp``; the copied foreign key named ``pg_temp.users``, not among the copies:
    ``create_all`` raised NoReferencedTableError (only DBAPIError was caught)."""
    schema = schemas()
    models = load_source(FK_MODELS.format(schema=schema))
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            models.Base.metadata.create_all(conn)
        with engine.connect() as conn:
            assert [d.message for d in schema_differences(conn, models.Job.__table__)] == []
        # The comparison of definitions still runs: a partial index made whole is found.
        drop(
            engine,
            schema,
            f"DROP INDEX {quoted(schema, 'jobs_claim')}",
            'CREATE INDEX "jobs_claim" ON {jobs} (queue, priority DESC, run_at, id)',
        )
        with engine.connect() as conn:
            found = [d.message for d in schema_differences(conn, models.Job.__table__)]
        assert len(found) == 1 and "'jobs_claim'" in found[0] and "differs" in found[0], found
    finally:
        engine.dispose()


def test_check_through_a_schema_translate_map_of_a_jobs_model_with_a_foreign_key(
    schemas: Any, database_url: str
) -> None:
    """The copies placed in the schema a ``schema_translate_map`` gives them kept a foreign
    key to a table that was not copied: Alembic could not resolve it."""
    tenant = schemas()
    models = load_source(FK_MODELS.format(schema=None))
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            translated = conn.execution_options(schema_translate_map={None: tenant})
            models.Base.metadata.create_all(translated)
            translated.commit()
            found = [d.message for d in schema_differences(translated, models.Job.__table__)]
        assert found == []
    finally:
        engine.dispose()


def test_cli_check_of_a_jobs_model_with_a_foreign_key_passes(
    schemas: Any, tmp_path: Path, database_url: str
) -> None:
    """``sqla-jobs check`` ended in a traceback for such a model."""
    schema = schemas()
    source = FK_MODELS.format(schema=schema)
    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            load_source(source).Base.metadata.create_all(conn)
    finally:
        engine.dispose()
    result = run_check(tmp_path, sa.make_url(database_url), source)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 0, (result.stdout, result.stderr[-2000:])


# --- B3: an index naming convention renames <table>_unique --------------------------------


@pytest.mark.parametrize("through", ["connection", "session"])
@pytest.mark.parametrize("table_name", ["jobs", "background_jobs_of_the_application"])
def test_retry_racing_an_uncommitted_twin_leaves_the_job_under_an_ix_naming_convention(
    schemas: Any, database_url: str, table_name: str, through: str
) -> None:
    """With ``naming_convention={"ix": "ix_%(table_name)s_%(constraint_name)s"}`` the
    unique index is ``ix_jobs_jobs_unique`` (or, over 63 bytes, SQLAlchemy's shortened
    name); the retry's twin race recognised the unique violation by the name
    ``jobs_unique`` only, and raised IntegrityError instead of leaving the dead job alone."""
    schema = schemas()
    models = load_source(
        HEADER
        + f"""
class Base(DeclarativeBase):
    metadata = sa.MetaData(
        schema={schema!r}, naming_convention={{"ix": "ix_%(table_name)s_%(constraint_name)s"}}
    )


class Job(JobMixin, Base):
    __tablename__ = {table_name!r}
"""
    )
    table = models.Job.__table__
    db = create_engine(database_url)
    try:
        with db.begin() as conn:
            models.Base.metadata.create_all(conn)
            indexes = {i["name"] for i in sa.inspect(conn).get_indexes(table_name, schema=schema)}
        assert f"{table_name}_unique" not in indexes
        assert any(name.startswith(f"ix_{table_name}_") for name in indexes), indexes
        jobs = Jobs(models.Job)

        @jobs.task(queue="q")
        def refresh(user_id: int) -> None: ...

        with db.begin() as conn:
            dead = conn.execute(
                sa.insert(table)
                .values(
                    task=refresh.name,
                    queue="q",
                    args={"user_id": 1},
                    status="dead",
                    unique_key="k",
                    attempts=1,
                    finished_at=sa.func.now(),
                )
                .returning(table.c.id)
            ).scalar_one()
        out: dict[str, Any] = {}

        def retry() -> None:
            try:
                if through == "session":
                    with Session(db) as session, session.begin():
                        pid = session.connection().exec_driver_sql("SELECT pg_backend_pid()")
                        out["pid"] = pid.scalar()
                        out["report"] = admin.retry_report(session, jobs, [dead])
                    return
                with db.begin() as conn:
                    out["pid"] = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
                    out["report"] = admin.retry_report(conn, jobs, [dead])
            except BaseException as exc:
                out["error"] = exc

        def waiting_on_a_lock() -> bool:
            with db.connect() as conn:
                event = conn.execute(
                    sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                    {"pid": out["pid"]},
                ).scalar()
            return bool(event == "Lock")

        with db.connect() as producer:
            producer.begin()
            jobs.enqueue(producer, refresh.with_options(unique_key="k"), 1)
            thread = threading.Thread(target=retry)
            thread.start()
            wait_for(lambda: "pid" in out or "error" in out)
            wait_for(lambda: "error" in out or waiting_on_a_lock())
            producer.commit()
        thread.join(10)
        assert not thread.is_alive()
        assert "error" not in out, out.get("error")
        assert out["report"].acted == ()
        with db.connect() as conn:
            status = conn.execute(sa.select(table.c.status).where(table.c.id == dead)).scalar()
        assert status == "dead"
    finally:
        db.dispose()


# --- B4: the include_name of docs/migrations/setup.md ---------------------------------------


def documented_include_name(schema: str) -> str:
    """The ``include_name=`` lambda of docs/migrations/setup.md, for ``schema`` as "work"."""
    text = (DOCS / "setup.md").read_text()
    match = re.search(r"include_name=(lambda .*?),\n", text)
    assert match is not None, "setup.md has no include_name=lambda ..."
    assert '"work"' in match.group(1)
    return match.group(1).replace('"work"', repr(schema))


def test_documented_include_name_keeps_the_app_tables_of_the_default_schema(
    schemas: Any, project: Any
) -> None:
    """The documented filter (``type_ != "schema" or name in {"work"}``) left out Alembic's
    None, the default schema: the app's tables there were never reflected, and every
    autogenerate proposed to create them again."""
    default, work = schemas(), schemas()
    p = project(
        search_path=default,
        include_schemas=True,
        include_name=documented_include_name(work),
    )
    p.write_models(
        HEADER
        + f"""
class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"
    __table_args__ = {{"schema": {work!r}}}


class Link(Base):
    __tablename__ = "links"
    code: Mapped[str] = mapped_column(sa.Text, primary_key=True)
"""
    )
    p.autogenerate("jobs")
    p.upgrade()
    p.check()  # nothing to create again: neither links nor the jobs tables


# --- B5: a CHECK constraint the filters leave out --------------------------------------------


@pytest.mark.parametrize(
    ("by", "plugin"),
    [("include_object", False), ("include_object", True), ("include_name", False)],
    # Alembic's checkconstraint_byname runs include_name on reflected names only, and
    # adds a constraint that filter leaves out: not a case for this package's comparator.
    ids=["include_object", "include_object-checkconstraint_plugin", "include_name"],
)
def test_a_check_constraint_the_filters_leave_out_is_not_added(
    schemas: Any, project: Any, by: str, plugin: bool
) -> None:
    """docs/migrations/autogenerate.md: what the filters leave out is left out. The
    missing CHECK constraints were added by ``op.create_jobs_checks`` after the table's
    filters only, never the constraint's: one left out on purpose came back at every
    autogenerate."""
    schema = schemas()
    options: dict[str, Any] = {"include_schemas": True, "version_table_schema": schema}
    keep = f"lambda name, type_, parent: type_ != 'schema' or name == {schema!r}"
    options["include_name"] = keep
    if plugin:
        options["autogenerate_plugins"] = [
            "alembic.autogenerate.*",
            "alembic.ext.checkconstraint_byname",
        ]
    p = project(**options)
    p.write_models(MODELS.format(schema=schema, table="jobs"))
    p.autogenerate("jobs")
    p.upgrade()
    drop(
        p.engine,
        schema,
        'ALTER TABLE {jobs} DROP CONSTRAINT "jobs_meta_object"',
        'ALTER TABLE {jobs} DROP CONSTRAINT "jobs_args_object"',
    )
    if by == "include_object":
        p.options["exclude"] = ["jobs_meta_object"]
    else:
        p.options["include_name"] = (
            f"lambda name, type_, parent: ({keep})(name, type_, parent) "
            "and not (type_ == 'check_constraint' and name == 'jobs_meta_object')"
        )
    p.write_options()
    upgrade = p.autogenerate("filtered")
    assert not any("jobs_meta_object" in s for s in upgrade), upgrade
    # The constraint the filters keep is added still.
    assert any("jobs_args_object" in s for s in upgrade), upgrade
