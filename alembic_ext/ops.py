"""``op.create_jobs_table()`` and ``op.drop_jobs_table()``: operations, implementations, renderers.

A jobs table is more than what ``op.create_table`` can say: it also needs storage parameters
and a NOTIFY trigger with its function (:func:`sqla_jobs.model.ddl_statements`). These two
operations wrap a plain create/drop table with that DDL, so a migration creates or removes
the whole queue in one line that reads like what it does.

Why the columns are written into the migration
----------------------------------------------
Autogenerate renders ``op.create_jobs_table("jobs", sa.Column(...), ..., sa.Index(...))``
with every column, constraint and index spelled out, exactly as ``op.create_table`` would.
A migration is a record of what the schema was at one revision: if it took its columns from
the installed sqla-jobs instead, replaying the migrations on a fresh database after a
package upgrade would create the new columns in the *first* migration, and the later
migration that adds them would fail. Spelled-out columns keep every revision replayable,
and keep working when the application's model changes (the migration imports no model).

Only the trigger function, storage parameters and their names come from the installed
package, through :func:`sqla_jobs.model.ddl_statements`: they depend on nothing but the
table's name and schema.

``op.create_jobs_table("jobs")`` with no columns is accepted too, for a hand-written first
migration: it then uses the columns of the installed :class:`sqla_jobs.JobMixin`, with the
replay caveat above.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import renderers
from alembic.autogenerate.api import AutogenContext
from alembic.operations import MigrateOperation, Operations, ops
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.sql.schema import SchemaItem

from sqla_jobs.model import (
    STORAGE_PARAMETERS,
    Companions,
    JobMixin,
    _qualified,
    _quote,
    companion_tables,
    ddl_statements,
    drop_statements,
    notify_function_body,
    reference_table,
)

__all__ = [
    "CreateJobsChecksOp",
    "CreateJobsTableOp",
    "DropJobsChecksOp",
    "DropJobsTableOp",
    "ReplaceJobsDDLOp",
    "installed_jobs_table",
]

#: What rendered migrations import: the ops exist only once this package is imported, and a
#: migration should not depend on env.py having done it.
IMPORT = "import alembic_ext  # noqa: F401"


def installed_jobs_table(table_name: str, schema: str | None = None) -> sa.Table:
    """The jobs table as the installed sqla-jobs declares it, on a throwaway MetaData.

    Declaring a class on a fresh declarative base is the one way to get exactly what
    :class:`~sqla_jobs.JobMixin` gives an application (columns, CHECK constraints, indexes
    named after the table) without importing the application's models.
    """

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    model: Any = type("Job", (JobMixin, Base), {"__tablename__": table_name})
    table: sa.Table = model.__table__
    return table


def _bare_table(table_name: str, schema: str | None) -> sa.Table:
    """A column-less Table that names the jobs table, for the name-only DDL helpers."""
    return sa.Table(table_name, sa.MetaData(), schema=schema)


_POSTGRESQL: sa.Dialect = postgresql.dialect()  # type: ignore[no-untyped-call]


def _split(items: Sequence[SchemaItem]) -> tuple[list[SchemaItem], list[sa.Index]]:
    indexes = [item for item in items if isinstance(item, sa.Index)]
    return [item for item in items if not isinstance(item, sa.Index)], indexes


def _detached_sql(expr: Any) -> Any:
    """An index expression or predicate that can be attached to any table of the same
    columns: a column becomes its name, SQL becomes text."""
    if isinstance(expr, sa.Column):
        return expr.name
    if isinstance(expr, (str, sa.TextClause)):
        return expr
    compiled = expr.compile(
        dialect=_POSTGRESQL, compile_kwargs={"literal_binds": True, "include_table": False}
    )
    return sa.text(str(compiled))


def detached_index(index: sa.Index) -> sa.Index:
    """A new, table-less copy of ``index``.

    An Index belongs to one Table for life, and every use of an operation (running it,
    comparing it, reversing it) builds a Table of its own; so the operation keeps its
    indexes in this form, which is also exactly what its rendered source builds.
    """
    options: dict[str, Any] = {}
    for key, value in index.dialect_kwargs.items():
        if key.endswith("_where") and isinstance(value, str):
            value = sa.text(value)  # a reflected predicate comes back as a string
        options[key] = _detached_sql(value) if isinstance(value, sa.ClauseElement) else value
    expressions = [_detached_sql(expr) for expr in index.expressions]
    return sa.Index(index.name, *expressions, unique=bool(index.unique), **options)


def _schema_of(operations: Operations, table: sa.Table) -> str | None:
    """The schema ``table`` is in for this migration: the one the connection's
    ``schema_translate_map`` gives it (Alembic's own operations are compiled through it),
    which the text statements of sqla-jobs must name themselves. Offline (``--sql``) there
    is no connection, and the table's own."""
    if operations.migration_context.as_sql:
        return table.schema
    return operations.get_bind().schema_for_object(table)


def _sql(statement: str) -> sa.TextClause:
    """A DDL string as a text() construct, its colons escaped so none reads as a bind
    parameter (a schema or table name may hold one; the function body is quoted with $$)."""
    return sa.text(statement.replace(":", "\\:"))


@Operations.register_operation("create_jobs_table")
class CreateJobsTableOp(MigrateOperation):
    """Create a jobs table, its indexes, storage parameters, notify function and trigger.

    Internally it is an Alembic :class:`~alembic.operations.ops.CreateTableOp` (columns
    and constraints, schema, table options) plus the indexes, so everything Alembic knows
    about creating and rendering a table applies unchanged.
    """

    def __init__(
        self,
        table_op: ops.CreateTableOp,
        indexes: Iterable[sa.Index] = (),
        *,
        companions: bool = False,
    ) -> None:
        self.table_op = table_op
        self.indexes = [detached_index(index) for index in indexes]
        #: Also create the companion tables (``<table>_queues`` and the others) as the
        #: installed sqla-jobs declares them: for a hand-written migration. Autogenerate
        #: writes them as ``op.create_table`` calls of their own instead.
        self.companions = companions

    @property
    def table_name(self) -> str:
        return self.table_op.table_name

    @property
    def schema(self) -> str | None:
        return self.table_op.schema

    @classmethod
    def from_table(
        cls, table: sa.Table, indexes: Iterable[sa.Index] | None = None
    ) -> CreateJobsTableOp:
        """The operation that creates ``table``, with ``indexes`` (default: all of its own)."""
        table_op = ops.CreateTableOp.from_table(table)
        table_op.info = {}  # sqla-jobs' bookkeeping, meaningless in a migration
        return cls(table_op, table.indexes if indexes is None else indexes)

    @classmethod
    def create_jobs_table(
        cls,
        operations: Operations,
        table_name: str,
        *items: SchemaItem,
        schema: str | None = None,
        companions: bool = False,
        **kw: Any,
    ) -> sa.Table:
        """Create a jobs table with its indexes, storage parameters and notify trigger.

        ``items`` are the columns, constraints and indexes, as autogenerate writes them.
        Without any, the columns, constraints and indexes of the installed
        :class:`sqla_jobs.JobMixin` are used. ``kw`` goes to ``op.create_table``
        (``comment=``, ``prefixes=``, dialect options). ``companions=True`` also creates
        the small tables sqla-jobs keeps beside the jobs table (paused queues, schedules,
        ...), as the installed version declares them: the whole queue from one hand-written
        line. (Autogenerate writes those as ``op.create_table`` calls instead.)

        The function and trigger are named after the table (``<table>_notify``) and live
        in its schema, so several jobs tables can share a database.
        """
        if not items:
            installed = installed_jobs_table(table_name, schema)
            items = (*installed.columns, *installed.constraints, *installed.indexes)
        others, indexes = _split(items)
        table_op = ops.CreateTableOp(table_name, others, schema=schema, **kw)
        table: sa.Table = operations.invoke(cls(table_op, indexes, companions=companions))
        return table

    def create_table_op(self) -> ops.CreateTableOp:
        """One CreateTableOp for the table *and* its indexes: Alembic's create_table creates
        every index its Table carries, in the same way as ``op.create_index`` would."""
        op = copy.copy(self.table_op)
        op.columns = [*self.table_op.columns, *(detached_index(index) for index in self.indexes)]
        return op

    def to_table(self) -> sa.Table:
        return self.create_table_op().to_table()

    def reverse(self) -> DropJobsTableOp:
        return DropJobsTableOp(
            self.table_name, schema=self.schema, companions=self.companions, reverse=self
        )

    def to_diff_tuple(self) -> tuple[str, sa.Table]:
        return ("add_table", self.to_table())


@Operations.register_operation("drop_jobs_table")
class DropJobsTableOp(MigrateOperation):
    """Drop a jobs table, its indexes and trigger (with the table) and its notify function.

    ``reverse`` is the operation that would re-create the table; autogenerate fills it
    from the database, so the downgrade of a dropped jobs table re-creates what was there.
    """

    def __init__(
        self,
        table_name: str,
        *,
        schema: str | None = None,
        companions: bool = False,
        reverse: CreateJobsTableOp | None = None,
    ) -> None:
        self.table_name = table_name
        self.schema = schema
        self.companions = companions
        self._reverse = reverse

    @classmethod
    def drop_jobs_table(
        cls,
        operations: Operations,
        table_name: str,
        *,
        schema: str | None = None,
        companions: bool = False,
    ) -> None:
        """Drop a jobs table created by ``op.create_jobs_table``, trigger and function
        included; ``companions=True`` drops its companion tables too (those that exist)."""
        operations.invoke(cls(table_name, schema=schema, companions=companions))

    def reverse(self) -> CreateJobsTableOp:
        if self._reverse is not None:
            return self._reverse
        # Written by hand: the best guess is the table as the installed package declares it.
        op = CreateJobsTableOp.from_table(installed_jobs_table(self.table_name, self.schema))
        op.companions = self.companions
        return op

    def to_diff_tuple(self) -> tuple[str, sa.Table]:
        return ("remove_table", self.reverse().to_table())


@Operations.register_operation("replace_jobs_ddl")
class ReplaceJobsDDLOp(MigrateOperation):
    """Bring an existing jobs table's storage parameters and notify function (and its
    trigger) to a given definition: what a newer sqla-jobs changed in them.

    Autogenerate writes it when the database's definition differs from the installed
    package's, with the database's as the reverse, so the downgrade puts back what was
    there. An empty ``function_body`` means "no notify function": the reverse of adding
    one to a table that had lost it.
    """

    def __init__(
        self,
        table_name: str,
        *,
        schema: str | None = None,
        function_body: str,
        storage_parameters: dict[str, str],
        reverse: ReplaceJobsDDLOp | None = None,
    ) -> None:
        self.table_name = table_name
        self.schema = schema
        self.function_body = function_body
        self.storage_parameters = dict(storage_parameters)
        self._reverse = reverse

    @classmethod
    def installed(
        cls, table_name: str, schema: str | None = None, *, reverse: ReplaceJobsDDLOp | None = None
    ) -> ReplaceJobsDDLOp:
        """The operation that brings the table to the installed sqla-jobs' definition."""
        table = _bare_table(table_name, schema)
        return cls(
            table_name,
            schema=schema,
            function_body=notify_function_body(table),
            storage_parameters=dict(STORAGE_PARAMETERS),
            reverse=reverse,
        )

    @classmethod
    def replace_jobs_ddl(
        cls,
        operations: Operations,
        table_name: str,
        *,
        schema: str | None = None,
        function_body: str | None = None,
        storage_parameters: dict[str, str] | None = None,
    ) -> None:
        """Replace the notify function and storage parameters of the jobs table.

        Without ``function_body`` and ``storage_parameters``, those of the installed
        sqla-jobs (a hand-written upgrade step after a release that changed them)."""
        op = cls.installed(table_name, schema)
        if function_body is not None:
            op.function_body = function_body
        if storage_parameters is not None:
            op.storage_parameters = dict(storage_parameters)
        operations.invoke(op)

    def reverse(self) -> ReplaceJobsDDLOp:
        if self._reverse is None:
            raise ValueError(
                "a hand-written replace_jobs_ddl has no reverse: write the downgrade's "
                "replace_jobs_ddl(...) with the previous definition"
            )
        return self._reverse

    def to_diff_tuple(self) -> tuple[str, str | None, str]:
        return ("replace_jobs_ddl", self.schema, self.table_name)


@Operations.register_operation("create_jobs_checks")
class CreateJobsChecksOp(MigrateOperation):
    """Add CHECK constraints to an existing jobs table or companion table: those a newer
    sqla-jobs declares (``checks``: name to SQL condition, written into the migration).

    Autogenerate writes it for the constraints of the model that the database lacks,
    found by name: Alembic before 1.19 compares no CHECK constraints, and cannot render
    the one it would write. One ``ALTER TABLE`` adds them all, so PostgreSQL reads the
    table once to validate them; a row that breaks one makes the upgrade fail with the
    constraint's name (fix or delete such rows, then upgrade again).
    """

    def __init__(
        self, table_name: str, checks: Mapping[str, str], *, schema: str | None = None
    ) -> None:
        self.table_name = table_name
        self.checks = dict(checks)
        self.schema = schema

    @classmethod
    def create_jobs_checks(
        cls,
        operations: Operations,
        table_name: str,
        checks: Mapping[str, str],
        *,
        schema: str | None = None,
    ) -> None:
        """Add the named CHECK constraints (name to SQL condition) to ``table_name``."""
        operations.invoke(cls(table_name, checks, schema=schema))

    def reverse(self) -> DropJobsChecksOp:
        return DropJobsChecksOp(
            self.table_name, list(self.checks), schema=self.schema, checks=self.checks
        )

    def to_diff_tuple(self) -> tuple[str, str | None, str, list[str]]:
        return ("add_jobs_checks", self.schema, self.table_name, sorted(self.checks))


@Operations.register_operation("drop_jobs_checks")
class DropJobsChecksOp(MigrateOperation):
    """Drop named CHECK constraints of a jobs table or companion table (those that exist):
    the downgrade of :class:`CreateJobsChecksOp`, which keeps their definitions for its
    own reverse."""

    def __init__(
        self,
        table_name: str,
        names: Iterable[str],
        *,
        schema: str | None = None,
        checks: Mapping[str, str] | None = None,
    ) -> None:
        self.table_name = table_name
        self.names = list(names)
        self.schema = schema
        self._checks = dict(checks) if checks is not None else None

    @classmethod
    def drop_jobs_checks(
        cls,
        operations: Operations,
        table_name: str,
        names: Sequence[str],
        *,
        schema: str | None = None,
    ) -> None:
        """Drop the named CHECK constraints of ``table_name``, if they exist."""
        operations.invoke(cls(table_name, names, schema=schema))

    def reverse(self) -> CreateJobsChecksOp:
        if self._checks is not None:
            return CreateJobsChecksOp(self.table_name, self._checks, schema=self.schema)
        # Written by hand: the definitions the installed sqla-jobs gives these names.
        declared = _declared_checks(self.table_name, self.schema)
        unknown = [name for name in self.names if name not in declared]
        if unknown:
            raise ValueError(
                f"drop_jobs_checks: no CHECK constraint of this sqla-jobs is named {unknown!r}; "
                "write the reverse's create_jobs_checks(...) by hand"
            )
        checks = {name: declared[name] for name in self.names}
        return CreateJobsChecksOp(self.table_name, checks, schema=self.schema)

    def to_diff_tuple(self) -> tuple[str, str | None, str, list[str]]:
        return ("remove_jobs_checks", self.schema, self.table_name, sorted(self.names))


def _declared_checks(table_name: str, schema: str | None) -> dict[str, str]:
    """The CHECK constraints (name to SQL) the installed sqla-jobs declares on a table of
    this name, as a jobs table or as the companion of one (``<jobs>_schedules``): a
    hand-written ``drop_jobs_checks`` may name either."""
    bases = [table_name] + [
        table_name[: -len(suffix) - 1]
        for suffix in Companions._fields
        if table_name.endswith(f"_{suffix}")
    ]
    return {
        str(c.name): str(c.sqltext)
        for base in bases
        for table in reference_table(base, schema).metadata.tables.values()
        if table.name == table_name
        for c in table.constraints
        if isinstance(c, sa.CheckConstraint)
    }


@Operations.implementation_for(CreateJobsTableOp)
def create_jobs_table(operations: Operations, operation: CreateJobsTableOp) -> sa.Table:
    """CREATE TABLE and CREATE INDEX through Alembic, then the extra DDL of sqla-jobs.

    Everything goes through ``operations``, never a connection, so ``--sql`` (offline)
    mode prints the same statements a live upgrade runs.
    """
    table = operations.invoke(operation.create_table_op())
    for statement in ddl_statements(table, schema=_schema_of(operations, table)):
        operations.execute(_sql(statement))
    if operation.companions:
        installed = installed_jobs_table(operation.table_name, operation.schema)
        for companion in companion_tables(installed):
            operations.invoke(ops.CreateTableOp.from_table(companion))
            for index in companion.indexes:
                operations.invoke(ops.CreateIndexOp.from_index(index))
    return table


@Operations.implementation_for(DropJobsTableOp)
def drop_jobs_table(operations: Operations, operation: DropJobsTableOp) -> None:
    """DROP TABLE (which takes its indexes and trigger along), then the trigger function."""
    if operation.companions:
        installed = installed_jobs_table(operation.table_name, operation.schema)
        for companion in reversed(companion_tables(installed)):
            schema = _schema_of(operations, companion)
            operations.execute(_sql(f"DROP TABLE IF EXISTS {_qualified(companion, None, schema)}"))
    operations.drop_table(operation.table_name, schema=operation.schema)
    table = _bare_table(operation.table_name, operation.schema)
    for statement in drop_statements(table, _schema_of(operations, table)):
        operations.execute(_sql(statement))


@Operations.implementation_for(ReplaceJobsDDLOp)
def replace_jobs_ddl(operations: Operations, operation: ReplaceJobsDDLOp) -> None:
    """Reset the storage parameters the definition drops, set its own, replace the function
    and re-create the trigger; or drop both when the definition has no function."""
    table = _bare_table(operation.table_name, operation.schema)
    schema = _schema_of(operations, table)
    qualified = _qualified(table, None, schema)
    # Parameters sqla-jobs manages (now, or in the definition being replaced) that the new
    # definition does not set go back to PostgreSQL's defaults.
    previous = operation._reverse.storage_parameters if operation._reverse else {}
    managed = set(STORAGE_PARAMETERS) | set(previous)
    dropped = sorted(managed - set(operation.storage_parameters))
    if dropped:
        operations.execute(_sql(f"ALTER TABLE {qualified} RESET ({', '.join(dropped)})"))
    if not operation.function_body:
        for statement in drop_statements(table, schema):
            operations.execute(_sql(statement))
        if operation.storage_parameters:
            params = ", ".join(f"{k} = {v}" for k, v in operation.storage_parameters.items())
            operations.execute(_sql(f"ALTER TABLE {qualified} SET ({params})"))
        return
    statements = ddl_statements(
        table,
        function_body=operation.function_body,
        storage_parameters=operation.storage_parameters,
        schema=schema,
    )
    for statement in statements:
        operations.execute(_sql(statement))


@Operations.implementation_for(CreateJobsChecksOp)
def create_jobs_checks(operations: Operations, operation: CreateJobsChecksOp) -> None:
    """One ``ALTER TABLE ... ADD CONSTRAINT ... CHECK (...)`` for all of them."""
    if not operation.checks:
        return
    table = _bare_table(operation.table_name, operation.schema)
    adds = ", ".join(
        f"ADD CONSTRAINT {_quote(name)} CHECK ({sql})" for name, sql in operation.checks.items()
    )
    qualified = _qualified(table, None, _schema_of(operations, table))
    operations.execute(_sql(f"ALTER TABLE {qualified} {adds}"))


@Operations.implementation_for(DropJobsChecksOp)
def drop_jobs_checks(operations: Operations, operation: DropJobsChecksOp) -> None:
    """One ``ALTER TABLE ... DROP CONSTRAINT IF EXISTS ...`` for all of them."""
    if not operation.names:
        return
    table = _bare_table(operation.table_name, operation.schema)
    drops = ", ".join(f"DROP CONSTRAINT IF EXISTS {_quote(name)}" for name in operation.names)
    qualified = _qualified(table, None, _schema_of(operations, table))
    operations.execute(_sql(f"ALTER TABLE {qualified} {drops}"))


# --- rendering ------------------------------------------------------------------------


def _expression(autogen_context: AutogenContext, expr: Any, *, is_index: bool = True) -> str:
    """Python source for an index expression or a SQL-valued index option."""
    if isinstance(expr, sa.Column):
        return repr(expr.name)
    if isinstance(expr, str):
        return repr(expr)
    impl = autogen_context.migration_context.impl
    sql = impl.render_ddl_sql_expr(expr, is_index=is_index)
    return f"{autogen_context.opts['sqlalchemy_module_prefix'] or ''}text({sql!r})"


def _option(autogen_context: AutogenContext, key: str, value: Any) -> str:
    if isinstance(value, str) and key.endswith("_where"):
        value = sa.text(value)  # a reflected predicate comes back as a string: it is SQL
    if isinstance(value, sa.ClauseElement):
        return f"{key}={_expression(autogen_context, value, is_index=False)}"
    return f"{key}={value!r}"


def render_index(autogen_context: AutogenContext, index: sa.Index) -> str:
    """``sa.Index("name", "col", sa.text("expr DESC"), unique=True, postgresql_where=...)``.

    Written as an argument of the table (as in a ``Table(...)`` declaration), so the one
    operation owns its indexes and creates them with the table.
    """
    prefix = autogen_context.opts["sqlalchemy_module_prefix"] or ""
    args = [repr(index.name)]
    args += [_expression(autogen_context, expr) for expr in index.expressions]
    if index.unique:
        args.append("unique=True")
    args += [
        _option(autogen_context, key, value)
        for key, value in sorted(index.dialect_kwargs.items())
        if value is not None
    ]
    return f"{prefix}Index({', '.join(args)})"


@renderers.dispatch_for(CreateJobsTableOp)
def render_create_jobs_table(autogen_context: AutogenContext, op: CreateJobsTableOp) -> str:
    """Render ``op.create_jobs_table(name, columns..., indexes..., schema=...)``.

    Columns and constraints are rendered by Alembic's own ``create_table`` renderer (types,
    server defaults, identity, naming conventions and the imports they need all come out as
    in any migration) from a copy of the operation stripped of its keyword options; the
    indexes and options are then added around that argument list.
    """
    autogen_context.imports.add(IMPORT)
    bare = copy.copy(op.table_op)
    bare.schema = None
    bare.comment = None
    bare.info = {}
    bare.prefixes = None
    bare.kw = {}
    bare.if_not_exists = None
    rendered = renderers.dispatch(bare)(autogen_context, bare)
    head, found, rest = rendered.partition("create_table(")
    if not found or not rest.endswith("\n)"):
        raise RuntimeError(f"unexpected create_table rendering: {rendered!r}")
    args = [rest[: -len("\n)")]]
    args += [render_index(autogen_context, index) for index in op.indexes]
    table_op = op.table_op
    if table_op.schema:
        args.append(f"schema={table_op.schema!r}")
    if table_op.comment is not None:
        args.append(f"comment={table_op.comment!r}")
    if table_op.prefixes:
        args.append(f"prefixes={list(table_op.prefixes)!r}")
    if_not_exists = getattr(table_op, "if_not_exists", None)  # Alembic >= 1.13.3
    if if_not_exists is not None:
        args.append(f"if_not_exists={bool(if_not_exists)!r}")
    args += [f"{key}={value!r}" for key, value in sorted(table_op.kw.items())]
    return f"{head}create_jobs_table(" + ",\n".join(args) + "\n)"


@renderers.dispatch_for(DropJobsTableOp)
def render_drop_jobs_table(autogen_context: AutogenContext, op: DropJobsTableOp) -> str:
    """Render ``op.drop_jobs_table(name, schema=...)``."""
    autogen_context.imports.add(IMPORT)
    prefix = autogen_context.opts["alembic_module_prefix"] or ""
    schema = f", schema={op.schema!r}" if op.schema else ""
    return f"{prefix}drop_jobs_table({op.table_name!r}{schema})"


@renderers.dispatch_for(ReplaceJobsDDLOp)
def render_replace_jobs_ddl(autogen_context: AutogenContext, op: ReplaceJobsDDLOp) -> str:
    """Render ``op.replace_jobs_ddl(name, schema=..., function_body=..., storage_parameters=...)``
    with the definition written out, so the migration records what it installs."""
    autogen_context.imports.add(IMPORT)
    prefix = autogen_context.opts["alembic_module_prefix"] or ""
    args = [repr(op.table_name)]
    if op.schema:
        args.append(f"schema={op.schema!r}")
    args.append(f"function_body={op.function_body!r}")
    args.append(f"storage_parameters={op.storage_parameters!r}")
    return f"{prefix}replace_jobs_ddl(" + ", ".join(args) + ")"


@renderers.dispatch_for(CreateJobsChecksOp)
def render_create_jobs_checks(autogen_context: AutogenContext, op: CreateJobsChecksOp) -> str:
    """Render ``op.create_jobs_checks(name, {constraint: condition, ...}, schema=...)``, the
    conditions written out so the migration records what it adds."""
    autogen_context.imports.add(IMPORT)
    prefix = autogen_context.opts["alembic_module_prefix"] or ""
    schema = f", schema={op.schema!r}" if op.schema else ""
    return f"{prefix}create_jobs_checks({op.table_name!r}, {op.checks!r}{schema})"


@renderers.dispatch_for(DropJobsChecksOp)
def render_drop_jobs_checks(autogen_context: AutogenContext, op: DropJobsChecksOp) -> str:
    """Render ``op.drop_jobs_checks(name, [constraint, ...], schema=...)``."""
    autogen_context.imports.add(IMPORT)
    prefix = autogen_context.opts["alembic_module_prefix"] or ""
    schema = f", schema={op.schema!r}" if op.schema else ""
    return f"{prefix}drop_jobs_checks({op.table_name!r}, {op.names!r}{schema})"
