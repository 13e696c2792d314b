"""alembic_ext: real Alembic commands on a throwaway project, against a real PostgreSQL.

Each test writes an Alembic project into a temporary directory (``alembic.ini``, an
``env.py`` that does ``import alembic_ext`` and a ``models.py``) and runs the commands the
way a user would: through ``alembic.command`` in this process, and through
``python -m alembic`` for the offline ``--sql`` output. Every test owns a schema named
``alembic_t_<random>`` that holds its jobs table *and* Alembic's version table, and drops
it at the end, so tests neither see each other nor the schema of the other test modules.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import alembic
import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from psycopg import sql

from alembic_ext import installed_jobs_table
from sqla_jobs.model import STORAGE_PARAMETERS, notify_channel

ENV_PY = '''\
"""env.py of a throwaway project, written as an application would write it."""
import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import context

import alembic_ext  # noqa: F401

config = context.config
here = Path(config.config_file_name).parent
spec = importlib.util.spec_from_file_location("alembic_test_models", here / "models.py")
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)

schema = config.get_main_option("test_schema")
exclude = set((config.get_main_option("exclude") or "").split())


def include_name(name, type_, parent_names):
    return type_ != "schema" or name == schema


def include_object(obj, name, type_, reflected, compare_to):
    return name not in exclude


options = dict(target_metadata=models.Base.metadata, include_object=include_object)
if config.get_main_option("explicit_schema") == "1":
    options.update(include_schemas=True, include_name=include_name, version_table_schema=schema)

if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **options,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()
'''

MODELS_PY = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import JobMixin


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})


class Job(JobMixin, Base):
    __tablename__ = {table!r}


class Link(Base):
    __tablename__ = "links"
    code: Mapped[str] = mapped_column(sa.Text, primary_key=True)
"""

EMPTY_MODELS_PY = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})
"""


class Project:
    """A temporary Alembic project whose jobs table lives in the test's own schema.

    ``explicit_schema``: the model names the schema (``MetaData(schema=...)``) and env.py
    uses ``include_schemas`` + ``version_table_schema``; otherwise the model has no schema
    and the connection's ``search_path`` makes the test schema the default one.
    """

    def __init__(self, root: Path, url: sa.URL, *, explicit_schema: bool, table: str) -> None:
        self.root = root
        self.schema = f"alembic_t_{uuid.uuid4().hex[:10]}"
        self.explicit_schema = explicit_schema
        self.table = table
        self.model_schema = self.schema if explicit_schema else None
        if not explicit_schema:
            url = url.update_query_dict({"options": f"-csearch_path={self.schema}"})
        self.url = url
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.exclude = ""
        (root / "migrations" / "versions").mkdir(parents=True)
        template = Path(alembic.__file__).parent / "templates" / "generic" / "script.py.mako"
        shutil.copy(template, root / "migrations" / "script.py.mako")
        (root / "migrations" / "env.py").write_text(ENV_PY)
        self.write_ini()
        self.write_models()

    # -- files ---------------------------------------------------------------------------

    @property
    def ini(self) -> Path:
        return self.root / "alembic.ini"

    def write_ini(self) -> None:
        url = self.url.render_as_string(hide_password=False).replace("%", "%%")
        self.ini.write_text(
            "[alembic]\n"
            "script_location = %(here)s/migrations\n"
            f"sqlalchemy.url = {url}\n"
            f"test_schema = {self.schema}\n"
            f"explicit_schema = {int(self.explicit_schema)}\n"
            f"exclude = {self.exclude}\n"
        )

    def write_models(self, template: str = MODELS_PY) -> None:
        source = template.format(schema=self.model_schema, table=self.table)
        (self.root / "models.py").write_text(source)

    def load_models(self) -> ModuleType:
        spec = importlib.util.spec_from_file_location(
            f"alembic_test_models_{uuid.uuid4().hex}", self.root / "models.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def edit(self, path: Path, drop_lines_with: list[str]) -> None:
        """Delete the lines of the migration's ``op.create_jobs_table(...)`` call that
        mention any of the given strings (one line each)."""
        kept, inside, dropped = [], False, 0
        for line in path.read_text().splitlines(keepends=True):
            inside = inside or "op.create_jobs_table(" in line
            if inside and any(s in line for s in drop_lines_with):
                dropped += 1
                continue
            inside = inside and line.rstrip() != ")".rjust(5)
            kept.append(line)
        assert dropped == len(drop_lines_with)
        path.write_text("".join(kept))
        shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)

    # -- commands ------------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return Config(str(self.ini))

    def autogenerate(self, message: str = "auto") -> Path:
        script = command.revision(self.config, message=message, autogenerate=True)
        assert script is not None and not isinstance(script, list)
        return Path(script.path)

    def upgrade(self, target: str = "head") -> None:
        command.upgrade(self.config, target)

    def downgrade(self, target: str = "base") -> None:
        command.downgrade(self.config, target)

    def check(self) -> None:
        """``alembic check``: raises if autogenerate would write anything."""
        command.check(self.config)

    def offline_sql(self, *args: str) -> str:
        """``python -m alembic ... --sql`` in a subprocess, as a DBA would run it."""
        result = subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(self.ini), *args, "--sql"],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def compare(self) -> list[Any]:
        """``alembic.autogenerate.compare_metadata`` with the options env.py uses."""
        models = self.load_models()
        opts: dict[str, Any] = {}
        if self.explicit_schema:
            opts = {
                "include_schemas": True,
                "include_name": lambda name, type_, parents: (
                    type_ != "schema" or name == self.schema
                ),
                "version_table_schema": self.schema,
            }
        with self.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts=opts)
            return list(compare_metadata(context, models.Base.metadata))

    # -- the database --------------------------------------------------------------------

    def qualified(self, name: str | None = None) -> str:
        return f'"{self.schema}"."{name or self.table}"'

    def objects(self) -> dict[str, set[str]]:
        """Relations (tables, indexes, sequences), functions and triggers in the schema."""
        params = {"schema": self.schema}
        with self.engine.connect() as conn:
            relations = conn.execute(
                sa.text(
                    "SELECT relname FROM pg_class WHERE relnamespace = "
                    "(SELECT oid FROM pg_namespace WHERE nspname = :schema)"
                ),
                params,
            ).scalars()
            functions = conn.execute(
                sa.text(
                    "SELECT proname FROM pg_proc WHERE pronamespace = "
                    "(SELECT oid FROM pg_namespace WHERE nspname = :schema)"
                ),
                params,
            ).scalars()
            triggers = conn.execute(
                sa.text(
                    "SELECT tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = :schema AND NOT t.tgisinternal"
                ),
                params,
            ).scalars()
            return {
                "relations": set(relations) - {"alembic_version", "alembic_version_pkc"},
                "functions": set(functions),
                "triggers": set(triggers),
            }

    def reloptions(self) -> dict[str, str]:
        with self.engine.connect() as conn:
            options = conn.execute(
                sa.text("SELECT reloptions FROM pg_class WHERE oid = CAST(:t AS regclass)"),
                {"t": self.qualified()},
            ).scalar_one()
        return dict(option.split("=", 1) for option in options or [])

    def libpq_url(self) -> str:
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def make_project(tmp_path: Path, database_url: str) -> Iterator[Any]:
    projects: list[Project] = []

    def make(*, explicit_schema: bool = True, table: str = "jobs") -> Project:
        root = tmp_path / f"project{len(projects)}"
        url = sa.make_url(database_url)
        project = Project(root, url, explicit_schema=explicit_schema, table=table)
        with project.engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{project.schema}"'))
        projects.append(project)
        return project

    yield make
    for project in projects:
        with project.engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{project.schema}" CASCADE'))
        project.engine.dispose()


def section(script: Path, name: str) -> list[str]:
    """The statements of ``upgrade()`` or ``downgrade()`` in a migration, each on one line
    (``pass`` and the docstring left out)."""
    source = script.read_text()
    function = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == name
    )
    statements = []
    for node in function.body:
        if isinstance(node, ast.Pass) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            continue
        segment = ast.get_source_segment(source, node) or ""
        statements.append(" ".join(line.strip() for line in segment.splitlines()))
    return statements


def diff_tables(diffs: list[Any]) -> set[str]:
    """The names of the tables that compare_metadata's differences are about."""
    names: set[str] = set()
    for diff in diffs:
        for item in diff if isinstance(diff, list) else [diff]:
            if item[0] in ("add_table", "remove_table"):
                names.add(item[1].name)
            elif item[0] in ("add_index", "remove_index"):
                names.add(item[1].table.name)
            else:
                names.add(item[2])
    return names


def index_names(table: str) -> set[str]:
    """The indexes the installed JobMixin declares (``<table>_claim`` and the others)."""
    return {str(index.name) for index in installed_jobs_table(table).indexes}


def expected_objects(table: str) -> dict[str, set[str]]:
    return {
        "relations": {table, f"{table}_pkey", f"{table}_id_seq", *index_names(table)},
        "functions": {f"{table}_notify"},
        "triggers": {f"{table}_notify"},
    }


def assert_queue_objects(project: Project) -> None:
    """The table, its indexes, trigger, function and storage parameters are there."""
    objects = project.objects()
    for kind, names in expected_objects(project.table).items():
        assert names <= objects[kind], (kind, objects[kind])
    assert project.reloptions() == STORAGE_PARAMETERS
    with project.engine.connect() as conn:
        claim = conn.execute(
            sa.text("SELECT indexdef FROM pg_indexes WHERE schemaname = :s AND indexname = :i"),
            {"s": project.schema, "i": f"{project.table}_claim"},
        ).scalar_one()
    assert "(queue, priority DESC, run_at, id) WHERE (status = 'ready'::text)" in claim


def assert_nothing_left(project: Project) -> None:
    assert project.objects() == {"relations": set(), "functions": set(), "triggers": set()}


def assert_insert_notifies(project: Project) -> None:
    """A committed INSERT wakes a listener on the table's channel, with the queue name."""
    channel = notify_channel(sa.Table(project.table, sa.MetaData(), schema=project.model_schema))
    with (
        psycopg.connect(project.libpq_url(), autocommit=True) as listener,
        psycopg.connect(project.libpq_url()) as writer,
    ):
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        with writer.transaction():
            writer.execute(
                sql.SQL("INSERT INTO {} (task, queue) VALUES ('send', 'emails')").format(
                    sql.Identifier(project.schema, project.table)
                )
            )
        notes = list(listener.notifies(timeout=10, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [(channel, "emails")]


# --- tests -------------------------------------------------------------------------------


def test_autogenerate_upgrade_check_downgrade(make_project: Any) -> None:
    """The whole life of a jobs table in the default schema, under its usual name."""
    project = make_project(explicit_schema=False)
    script = project.autogenerate("jobs")

    upgrade = section(script, "upgrade")
    assert [s.split("(")[0] for s in upgrade].count("op.create_jobs_table") == 1
    jobs_op = next(s for s in upgrade if s.startswith("op.create_jobs_table("))
    assert jobs_op.startswith("op.create_jobs_table('jobs',")
    assert {"jobs_claim", "jobs_scheduled", "jobs_running", "jobs_unique"} <= index_names("jobs")
    for index in index_names("jobs"):
        assert f"sa.Index('{index}'" in jobs_op
        assert not any(s.startswith(f"op.create_index('{index}'") for s in upgrade)
    assert "schema=" not in jobs_op
    assert not any(s.startswith("op.create_table('jobs',") for s in upgrade)
    assert "op.drop_jobs_table('jobs')" in section(script, "downgrade")
    source = script.read_text()
    assert "import alembic_ext" in source
    assert "models" not in source, "a migration must not import the application's models"

    project.upgrade()
    assert_queue_objects(project)
    project.check()  # a second autogenerate finds nothing
    assert project.compare() == []
    assert_insert_notifies(project)

    project.downgrade("base")
    assert_nothing_left(project)


def test_schema_and_custom_table_name(make_project: Any) -> None:
    """A schema-qualified table with a name of its own: every object follows the name."""
    project = make_project(explicit_schema=True, table="work_items")
    script = project.autogenerate("work items")

    upgrade = section(script, "upgrade")
    jobs_op = next(s for s in upgrade if s.startswith("op.create_jobs_table("))
    assert jobs_op.startswith("op.create_jobs_table('work_items',")
    assert f"schema='{project.schema}'" in jobs_op
    assert "sa.Index('work_items_claim'" in jobs_op
    assert f"op.drop_jobs_table('work_items', schema='{project.schema}')" in section(
        script, "downgrade"
    )

    project.upgrade()
    assert_queue_objects(project)
    project.check()
    assert project.compare() == []
    assert_insert_notifies(project)

    project.downgrade("base")
    assert_nothing_left(project)


def test_offline_sql(make_project: Any) -> None:
    """``upgrade --sql`` prints the whole queue as SQL that psql (or a DBA) can run as is."""
    project = make_project(explicit_schema=True)
    project.autogenerate()
    with project.engine.begin() as conn:  # left by autogenerate; the script creates it
        conn.execute(sa.text(f"DROP TABLE {project.qualified('alembic_version')}"))
    script = project.offline_sql("upgrade", "head")

    schema = project.schema
    assert f"CREATE TABLE {schema}.jobs (" in script
    claim = f"CREATE INDEX jobs_claim ON {schema}.jobs (queue, priority DESC, run_at, id) "
    assert claim + "WHERE status = 'ready';" in script
    assert f"CREATE UNIQUE INDEX jobs_unique ON {schema}.jobs (unique_key) WHERE " in script
    assert f"ALTER TABLE {schema}.jobs SET (fillfactor = 80" in script
    assert f"CREATE OR REPLACE FUNCTION {schema}.jobs_notify() RETURNS trigger" in script
    assert "LANGUAGE plpgsql AS $$\n" in script and "\n$$;\n" in script
    assert f"CREATE TRIGGER jobs_notify AFTER INSERT ON {schema}.jobs" in script
    assert "COMMIT;" in script

    # Applied by hand, it builds the same database as an online upgrade.
    with psycopg.connect(project.libpq_url(), autocommit=True) as conn:
        conn.execute(script.encode())
    assert_queue_objects(project)
    project.check()
    assert_insert_notifies(project)

    downgrade = project.offline_sql("downgrade", "head:base")
    assert f"DROP TABLE {schema}.jobs;" in downgrade
    assert f"DROP FUNCTION IF EXISTS {schema}.jobs_notify() CASCADE;" in downgrade
    with psycopg.connect(project.libpq_url(), autocommit=True) as conn:
        conn.execute(downgrade.encode())
    assert_nothing_left(project)


def test_include_object_is_respected(make_project: Any) -> None:
    """What env.py's include_object leaves out stays out of the jobs operation too."""
    project = make_project(explicit_schema=True)
    project.exclude = "jobs_running links"
    project.write_ini()
    script = project.autogenerate()
    upgrade = section(script, "upgrade")
    jobs_op = next(s for s in upgrade if s.startswith("op.create_jobs_table("))
    assert "jobs_claim" in jobs_op
    assert "jobs_running" not in jobs_op
    assert not any("'links'" in s for s in upgrade)

    script.unlink()
    project.exclude = "jobs"
    project.write_ini()
    script = project.autogenerate()
    upgrade = section(script, "upgrade")
    assert not any("jobs_table" in s or "'jobs'" in s for s in upgrade)
    assert any(s.startswith("op.create_table('links',") for s in upgrade)


def test_later_release_adds_a_column_and_an_index(make_project: Any) -> None:
    """A table made by an older sqla-jobs gets exactly what the newer one added, and the
    migration history still replays from scratch."""
    project = make_project(explicit_schema=True)
    first = project.autogenerate("jobs")
    # What an older release would have written: no last_error column, no running index.
    project.edit(first, ["sa.Column('last_error'", "sa.Index('jobs_running'"])
    project.upgrade()

    second = project.autogenerate("sqla-jobs upgrade")
    upgrade = section(second, "upgrade")
    assert len(upgrade) == 2, upgrade
    add_column = next(s for s in upgrade if s.startswith("op.add_column("))
    assert add_column.startswith("op.add_column('jobs', sa.Column('last_error', sa.Text()")
    create_index = next(s for s in upgrade if s.startswith("op.create_index("))
    assert create_index.startswith("op.create_index('jobs_running', 'jobs', ['locked_until']")
    assert "postgresql_where=sa.text(\"status = 'running'\")" in create_index

    project.upgrade()
    project.check()
    assert project.compare() == []

    # Replaying every migration on an empty database gives the same schema.
    project.downgrade("base")
    assert_nothing_left(project)
    project.upgrade()
    assert_queue_objects(project)
    project.check()


def test_meta_and_progress_reach_an_existing_table_through_autogenerate(
    make_project: Any,
) -> None:
    """A table made before ``meta``, ``progress``, the ``<table>_meta`` index and the
    ``<table>_meta_object`` CHECK constraint existed: the next autogenerate writes exactly
    those four, with nothing to edit by hand, and the upgraded table takes jobs with meta
    (and refuses a meta that is not an object)."""
    project = make_project(explicit_schema=True)
    first = project.autogenerate("jobs")
    project.edit(
        first,
        [
            "sa.Column('meta'",
            "sa.Column('progress'",
            "sa.Index('jobs_meta'",
            "name='jobs_meta_object'",
        ],
    )
    project.upgrade()

    second = project.autogenerate("sqla-jobs 0.2")
    upgrade = section(second, "upgrade")
    assert len(upgrade) == 4, upgrade
    schema = project.schema
    jsonb = "postgresql.JSONB(astext_type=sa.Text()).with_variant(sa.JSON(), 'sqlite')"
    assert upgrade[0] == (
        f"op.add_column('jobs', sa.Column('meta', {jsonb}, nullable=True), schema='{schema}')"
    )
    assert upgrade[1] == (
        f"op.add_column('jobs', sa.Column('progress', {jsonb}, nullable=True), schema='{schema}')"
    )
    assert upgrade[3] == (
        "op.create_jobs_checks('jobs', {'jobs_meta_object': "
        f"\"meta IS NULL OR jsonb_typeof(meta) = 'object'\"}}, schema='{schema}')"
    )
    create_index = upgrade[2]
    assert create_index.startswith("op.create_index('jobs_meta', 'jobs', ['meta']")
    for part in (
        "postgresql_using='gin'",
        "postgresql_ops={'meta': 'jsonb_path_ops'}",
        "postgresql_where=sa.text('meta IS NOT NULL')",
    ):
        assert part in create_index, create_index

    project.upgrade()
    project.check()
    assert project.compare() == []
    with project.engine.connect() as conn:
        indexdef = conn.execute(
            sa.text("SELECT indexdef FROM pg_indexes WHERE schemaname = :s AND indexname = :i"),
            {"s": schema, "i": "jobs_meta"},
        ).scalar_one()
    assert "USING gin (meta jsonb_path_ops) WHERE (meta IS NOT NULL)" in indexdef
    with project.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {project.qualified()} (task, meta) "
                """VALUES ('send', '{"tenant": 7}')"""
            )
        )
    with (
        pytest.raises(sa.exc.IntegrityError, match="jobs_meta_object"),
        project.engine.begin() as conn,
    ):
        conn.execute(sa.text(f"INSERT INTO {project.qualified()} (task, meta) VALUES ('t', '[1]')"))

    project.downgrade("-1")  # the downgrade removes exactly them
    project.upgrade()
    project.check()


def test_limits_columns_reach_an_existing_table_through_autogenerate(
    make_project: Any,
) -> None:
    """A table made before limits existed: autogenerate writes the ``concurrency_key``
    column, the ``<table>_keys`` index and ``<table>_queues.rate_log`` and ``rate_counts``,
    nothing by hand."""
    project = make_project(explicit_schema=True)
    first = project.autogenerate("jobs")
    project.edit(
        first, ["sa.Column('concurrency_key'", "sa.Index('jobs_keys'", "sa.Index('jobs_key_order'"]
    )
    # <table>_queues is an op.create_table of its own, outside create_jobs_table.
    lines = first.read_text().splitlines(keepends=True)
    kept = [
        line
        for line in lines
        if "sa.Column('rate_log'" not in line and "sa.Column('rate_counts'" not in line
    ]
    assert len(kept) == len(lines) - 2
    first.write_text("".join(kept))
    shutil.rmtree(first.parent / "__pycache__", ignore_errors=True)
    project.upgrade()

    second = project.autogenerate("limits")
    upgrade = section(second, "upgrade")
    assert len(upgrade) == 5, upgrade
    schema = project.schema
    assert (
        "op.add_column('jobs', sa.Column('concurrency_key', sa.Text(), nullable=True), "
        f"schema='{schema}')"
    ) in upgrade
    create_index = next(s for s in upgrade if s.startswith("op.create_index('jobs_keys'"))
    assert create_index.startswith(
        "op.create_index('jobs_keys', 'jobs', ['queue', 'concurrency_key']"
    )
    assert "status = 'running' AND concurrency_key IS NOT NULL" in create_index
    key_order = next(s for s in upgrade if s.startswith("op.create_index('jobs_key_order'"))
    assert "['queue', 'concurrency_key', 'id']" in key_order
    add_log = next(s for s in upgrade if "rate_log" in s)
    assert add_log.startswith("op.add_column('jobs_queues', sa.Column('rate_log', ")
    add_counts = next(s for s in upgrade if "rate_counts" in s)
    assert add_counts.startswith("op.add_column('jobs_queues', sa.Column('rate_counts', ")

    project.upgrade()
    project.check()
    assert project.compare() == []
    project.downgrade("-1")
    project.upgrade()
    project.check()


def _drop_statements(script: Path, mentioning: str) -> int:
    """Delete the statements of a migration's functions that mention a string (as if it
    had been written before that object existed); how many."""
    source = script.read_text()
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            for statement in node.body:
                segment = ast.get_source_segment(source, statement) or ""
                if mentioning in segment:
                    assert statement.end_lineno is not None
                    drop.update(range(statement.lineno - 1, statement.end_lineno))
    script.write_text("".join(line for i, line in enumerate(lines) if i not in drop))
    shutil.rmtree(script.parent / "__pycache__", ignore_errors=True)
    return len(drop)


def test_key_starts_table_reaches_an_existing_install_through_autogenerate(
    make_project: Any,
) -> None:
    """An install made before per-key rates: autogenerate writes ``<table>_key_starts``
    and its index as plain operations, and ``alembic check`` is clean after them."""
    project = make_project(explicit_schema=True)
    first = project.autogenerate("jobs")
    assert _drop_statements(first, "jobs_key_starts") > 0
    project.upgrade()

    second = project.autogenerate("key rates")
    upgrade = section(second, "upgrade")
    assert len(upgrade) == 2, upgrade
    create = next(s for s in upgrade if s.startswith("op.create_table("))
    assert create.startswith("op.create_table('jobs_key_starts',")
    for part in ("sa.Column('log', postgresql.ARRAY(", "sa.PrimaryKeyConstraint('queue', 'key'"):
        assert part in create, create
    index = next(s for s in upgrade if s.startswith("op.create_index("))
    assert index.startswith("op.create_index('jobs_key_starts_full', 'jobs_key_starts', ")
    assert "full_until IS NOT NULL" in index

    project.upgrade()
    project.check()
    assert project.compare() == []
    project.downgrade("-1")
    project.upgrade()
    project.check()


def test_removed_jobs_table_is_dropped_with_its_trigger(make_project: Any) -> None:
    """A jobs model removed from the app: the drop takes the function along, and the
    downgrade re-creates the table as the database had it."""
    project = make_project(explicit_schema=True)
    project.autogenerate("jobs")
    project.upgrade()

    project.write_models(EMPTY_MODELS_PY)
    script = project.autogenerate("no more jobs")
    upgrade = section(script, "upgrade")
    assert f"op.drop_jobs_table('jobs', schema='{project.schema}')" in upgrade
    for index in index_names("jobs"):  # dropped with the table, not one by one
        assert not any(s.startswith("op.drop_index(") and f"'{index}'" in s for s in upgrade)
    downgrade = section(script, "downgrade")
    assert any(s.startswith("op.create_jobs_table('jobs',") for s in downgrade)

    project.upgrade()
    assert project.objects()["functions"] == set()
    assert not any(name.startswith("jobs") for name in project.objects()["relations"])

    project.downgrade("-1")
    assert_queue_objects(project)
    script.unlink()
    project.write_models()
    project.check()


def test_hand_written_migration(make_project: Any) -> None:
    """``op.create_jobs_table("jobs", schema=...)`` without columns uses the installed
    JobMixin, and matches the model."""
    project = make_project(explicit_schema=True)
    project.exclude = "links"
    project.write_ini()
    (project.root / "migrations" / "versions" / "0001_jobs.py").write_text(
        f"""\
from alembic import op

import alembic_ext  # noqa: F401

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_jobs_table("jobs", schema={project.schema!r})


def downgrade() -> None:
    op.drop_jobs_table("jobs", schema={project.schema!r})
"""
    )
    project.upgrade()
    assert_queue_objects(project)
    # Only the jobs table was written (not the app's other tables): it matches the model.
    assert "jobs" not in diff_tables(project.compare())

    project.downgrade("base")
    assert_nothing_left(project)


OLD_BODY = """
BEGIN
  PERFORM pg_notify('somewhere-else', 'everything');
  RETURN NULL;
END
"""


def function_body(project: Project) -> str:
    with project.engine.connect() as conn:
        return str(
            conn.execute(
                sa.text(
                    "SELECT prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                    "WHERE n.nspname = :s AND p.proname = :f"
                ),
                {"s": project.schema, "f": f"{project.table}_notify"},
            ).scalar_one()
        )


def test_a_changed_trigger_function_or_storage_reaches_existing_installs(
    make_project: Any,
) -> None:
    """What Alembic cannot see (the notify function, the storage parameters, the trigger)
    is compared too: an install made by an older sqla-jobs gets one ``replace_jobs_ddl``,
    whose downgrade puts the old definition back."""
    project = make_project(explicit_schema=True)
    project.autogenerate("jobs")
    project.upgrade()
    # What an older release would have installed: another function body, one storage
    # parameter missing and one with another value, and (worse) no trigger at all.
    qualified = project.qualified()
    function = f'"{project.schema}"."{project.table}_notify"'
    with project.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger "
                f"LANGUAGE plpgsql AS $${OLD_BODY}$$"
            )
        )
        conn.execute(sa.text(f"ALTER TABLE {qualified} RESET (fillfactor)"))
        conn.execute(sa.text(f"ALTER TABLE {qualified} SET (autovacuum_vacuum_scale_factor = 0.2)"))
        conn.execute(sa.text(f'DROP TRIGGER "{project.table}_notify" ON {qualified}'))
    old_options = project.reloptions()

    script = project.autogenerate("sqla-jobs upgrade")
    (upgrade,) = section(script, "upgrade")
    assert upgrade.startswith(f"op.replace_jobs_ddl('jobs', schema='{project.schema}'")
    assert "pg_notify" in upgrade and "storage_parameters=" in upgrade
    (downgrade,) = section(script, "downgrade")
    assert "somewhere-else" in downgrade and "'autovacuum_vacuum_scale_factor': '0.2'" in downgrade

    project.upgrade()
    assert_queue_objects(project)
    assert_insert_notifies(project)
    project.check()

    project.downgrade("-1")
    assert "somewhere-else" in function_body(project)
    assert project.reloptions() == old_options


def test_a_hand_written_one_liner_can_create_the_whole_queue(make_project: Any) -> None:
    """``companions=True`` creates (and drops) the companion tables too: nothing is left for
    autogenerate to add."""
    project = make_project(explicit_schema=True)
    project.exclude = "links"
    project.write_ini()
    (project.root / "migrations" / "versions" / "0001_jobs.py").write_text(
        f"""\
from alembic import op

import alembic_ext  # noqa: F401

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_jobs_table("jobs", schema={project.schema!r}, companions=True)


def downgrade() -> None:
    op.drop_jobs_table("jobs", schema={project.schema!r}, companions=True)
"""
    )
    project.upgrade()
    assert_queue_objects(project)
    assert diff_tables(project.compare()) == {"links"}  # only the app's own table is missing
    project.check()
    project.downgrade("base")
    assert_nothing_left(project)


def test_new_check_constraints_reach_an_existing_install_and_a_bad_row_stops_them(
    make_project: Any,
) -> None:
    """A table made before ``<table>_attempts_left`` existed (issue 20): autogenerate writes
    one ``op.create_jobs_checks`` (Alembic before 1.19 neither compares nor renders CHECK
    constraints). A live row that breaks it (a ready job with no attempt left, written
    around the library) makes the upgrade fail, naming the constraint, and change
    nothing; once the row is fixed it goes through, and the downgrade drops it again."""
    project = make_project(explicit_schema=True)
    first = project.autogenerate("jobs")
    project.edit(first, ["name='jobs_attempts_left'"])
    project.upgrade()
    with project.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {project.qualified()} (task, attempts, max_attempts) "
                "VALUES ('old', 3, 3)"
            )
        )

    second = project.autogenerate("checks")
    (upgrade,) = section(second, "upgrade")
    assert upgrade.startswith("op.create_jobs_checks('jobs', {'jobs_attempts_left': \"status IN")
    assert upgrade.endswith(f"}}, schema='{project.schema}')")
    (downgrade,) = section(second, "downgrade")
    assert downgrade == (
        f"op.drop_jobs_checks('jobs', ['jobs_attempts_left'], schema='{project.schema}')"
    )
    offline = project.offline_sql("upgrade", f"{_revision(first)}:head")
    assert (
        f"ALTER TABLE {project.schema}.jobs ADD CONSTRAINT jobs_attempts_left CHECK (status IN"
        in offline
    )

    with pytest.raises(sa.exc.IntegrityError, match=r'"jobs_attempts_left" .* violated'):
        project.upgrade()
    with project.engine.connect() as conn:
        version = conn.execute(
            sa.text(f"SELECT version_num FROM {project.qualified('alembic_version')}")
        ).scalar_one()
    assert version == _revision(first)  # rolled back as a whole
    with project.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {project.qualified()} SET max_attempts = 4"))
    project.upgrade()
    project.check()
    assert project.compare() == []
    with (
        pytest.raises(sa.exc.IntegrityError, match="jobs_attempts_left"),
        project.engine.begin() as c,
    ):
        c.execute(sa.text(f"UPDATE {project.qualified()} SET attempts = 4"))

    project.downgrade("-1")
    with project.engine.begin() as conn:  # the constraint is gone with the downgrade
        conn.execute(sa.text(f"UPDATE {project.qualified()} SET attempts = 4"))


def _revision(script: Path) -> str:
    """The revision id a migration declares."""
    found = re.search(r"^revision: str = '(\w+)'", script.read_text(), re.MULTILINE)
    assert found is not None
    return found.group(1)


def test_a_hand_written_drop_jobs_checks_reverses_to_the_installed_definitions() -> None:
    from alembic_ext.ops import DropJobsChecksOp

    reverse = DropJobsChecksOp("jobs", ["jobs_meta_object"], schema="s").reverse()
    assert reverse.checks == {"jobs_meta_object": "meta IS NULL OR jsonb_typeof(meta) = 'object'"}
    companion = DropJobsChecksOp("jobs_schedules", ["jobs_schedules_args_object"]).reverse()
    assert companion.checks == {"jobs_schedules_args_object": "jsonb_typeof(args) = 'object'"}
    with pytest.raises(ValueError, match="no CHECK constraint of this sqla-jobs is named"):
        DropJobsChecksOp("jobs", ["nope"]).reverse()


# -- a naming convention that makes a CHECK's name longer than PostgreSQL keeps --------------

_LONG_NAMES_MODELS_PY = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin

NC = {{
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}}


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r}, naming_convention=NC)


class Job(JobMixin, Base):
    __tablename__ = {table!r}
"""


def test_a_convention_s_long_check_names_are_found_under_their_shortened_names(
    make_project: Any,
) -> None:
    """``ck_%(table_name)s_%(constraint_name)s`` on a 23-character table name gives names
    over 63 bytes, which SQLAlchemy shortens (with a hash) as it creates them. Compared
    under the full name, ``alembic check`` failed right after ``upgrade head``, and each
    autogenerate added the constraint once more (PostgreSQL then truncated that name to
    yet another one); ``sqla-jobs check`` said the table lacked it."""
    from alembic_ext.check import schema_differences

    project: Project = make_project(table="notification_deliveries")
    project.write_models(_LONG_NAMES_MODELS_PY)
    project.autogenerate("init")
    project.upgrade()
    project.check()  # nothing to add
    models = project.load_models()
    with project.engine.connect() as conn:
        assert [d.message for d in schema_differences(conn, models.Job.__table__)] == []
        names = (
            conn.execute(
                sa.text(
                    "SELECT conname FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid"
                    " JOIN pg_namespace n ON n.oid = t.relnamespace WHERE contype = 'c'"
                    " AND t.relname = 'notification_deliveries' AND n.nspname = :schema"
                ),
                {"schema": project.schema},
            )
            .scalars()
            .all()
        )
    assert len(names) == len(set(names)) == 8
    assert any(name.endswith("_atte_26c4") for name in names)  # shortened, once
