"""Does the live database hold the jobs tables this version of sqla-jobs declares?

.. code-block:: python

    from alembic_ext.check import schema_differences

    with engine.connect() as conn:
        for difference in schema_differences(conn, jobs.table):
            print(difference.message)

``sqla-jobs check JOBS`` prints the same (and exits 1 when anything differs), and
``sqla-jobs worker`` runs it at start: a missing table or column (the worker's statements
could not run) stops the worker with one line, anything else is a warning in the log and in
``/healthz``.

The comparison is Alembic's autogenerate itself, restricted to the jobs table and its
companion tables, with this package's comparators (:mod:`alembic_ext.autogenerate`): the
notify function, trigger and storage parameters, and the named CHECK constraints. So there
is one description of what the schema should be (the model), and what this reports is
exactly what ``alembic revision --autogenerate`` would write to fix it. It reads the
catalogs only, and changes nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import produce_migrations
from alembic.operations import ops
from alembic.runtime.migration import MigrationContext
from sqlalchemy.dialects import postgresql

from sqla_jobs.db import SCHEMA_FIX
from sqla_jobs.model import derived_name

# importing registers comparators
from .autogenerate import CHANNEL_SCHEMA, _compared_schema, _is_jobs_table
from .ops import CreateJobsChecksOp, CreateJobsTableOp, ReplaceJobsDDLOp

__all__ = ["FIX", "Difference", "schema_differences"]

_POSTGRESQL: sa.Dialect = postgresql.dialect()  # type: ignore[no-untyped-call]

log = logging.getLogger("sqla_jobs.check")

#: What to run when something differs: the migration that adds it may exist already (not
#: applied yet) or not (then autogenerate writes it).
FIX = SCHEMA_FIX


@dataclass(frozen=True)
class Difference:
    """One way the database differs from what this version of sqla-jobs declares."""

    #: The table it is about, schema-qualified when it has a schema.
    table: str
    #: ``"table"``, ``"column"``, ``"index"``, ``"check"``, ``"trigger"``, ``"storage"``,
    #: or the name of the Alembic operation that would fix it.
    kind: str
    #: One line that says what differs.
    message: str
    #: The worker cannot run with it: a statement it runs would fail (a missing table or
    #: column), where the others make it slower or less safe, not wrong.
    fatal: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "kind": self.kind,
            "message": self.message,
            "fatal": self.fatal,
        }


def schema_differences(connection: sa.Connection, table: sa.Table) -> list[Difference]:
    """What differs between the database and the jobs table ``table`` (a complete one: from
    a ``JobMixin`` model) with its companion tables, as Alembic's autogenerate sees it.

    Only those tables are compared (Alembic's ``include_name``/``include_object``), in
    their schema; nothing else of the application's metadata is read. On a connection
    with a ``schema_translate_map``, in the schema it gives them: Alembic reflects the
    schema it is told, so the tables are compared as copies placed there, the map set
    aside meanwhile (``execution_options`` changes a Connection in place)."""
    if connection.schema_for_object(table) == table.schema:
        return _differences(connection, table)
    mapped = connection.get_execution_options().get("schema_translate_map")
    copy = _translated(connection, table)
    connection.execution_options(schema_translate_map=None)
    try:
        return _differences(connection, copy)
    finally:
        connection.execution_options(schema_translate_map=mapped)


def _differences(connection: sa.Connection, table: sa.Table) -> list[Difference]:
    companions = table.info.get("sqla_jobs_companions") or ()
    names = {table.name, *(companion.name for companion in companions)}
    schema = table.schema
    # Alembic compares the connection's default schema as None, even where the model
    # names it (``MetaData(schema="public")``): looking for the tables under that name
    # found none of them, and every one was reported missing.
    compared = _compared_schema(connection, schema)
    schemas = {schema, compared}

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        if type_ == "schema":
            return name == compared
        if type_ == "table":
            return name in names and parent_names.get("schema_name") == compared
        return True

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, other: Any) -> bool:
        if type_ == "table":
            return name in names and obj.schema in schemas
        return True

    opts: dict[str, Any] = {
        "include_name": include_name,
        "include_object": include_object,
        "include_schemas": compared is not None,
    }
    context = MigrationContext.configure(connection, opts=opts)
    script = produce_migrations(context, table.metadata)
    assert script.upgrade_ops is not None
    # Only operations on these tables: a comparator of another plugin the application
    # imported may write operations of its own (a function, an enum type).
    ours = [
        op
        for op in script.upgrade_ops.ops
        if getattr(op, "table_name", None) in names and getattr(op, "schema", None) in schemas
    ]
    found = list(_describe(connection, ours, schema))
    redefined = _definition_differences(connection, table, [table, *companions])
    redefined += _invalid_indexes(connection, table, [table, *companions])
    # Alembic sees a UNIQUE index made plain (or the reverse) as one index missing and
    # another one in its place, under the same name: the one line below says it better.
    said = {d.message.split(" on ", 1)[0] for d in redefined}
    found = [d for d in found if not (d.kind == "index" and d.message.split(" on ", 1)[0] in said)]
    return found + redefined


#: The definitions of the indexes and CHECK constraints of some tables of one schema, as
#: PostgreSQL writes them back (``pg_get_indexdef``, ``pg_get_constraintdef``). Alembic
#: compares indexes by their columns and CHECK constraints by name only: a partial index
#: without its WHERE, or a condition changed by hand, passed the check.
_DEFINITIONS = sa.text(
    "SELECT c.relname, i.relname, 'index', pg_get_indexdef(x.indexrelid) "
    "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
    "JOIN pg_class c ON c.oid = x.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = :schema AND c.relname = ANY(CAST(:names AS text[])) "
    "UNION ALL "
    "SELECT c.relname, k.conname, 'check', pg_get_constraintdef(k.oid) "
    "FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE k.contype = 'c' AND n.nspname = :schema AND c.relname = ANY(CAST(:names AS text[]))"
)
#: Indexes PostgreSQL keeps but does not use: a ``CREATE INDEX CONCURRENTLY`` that failed
#: (a lock timeout, a cancel, a deadlock) leaves one behind, which ``pg_get_indexdef``
#: spells like a good one. An invalid ``<table>_unique`` fails every unique enqueue.
_INVALID = sa.text(
    "SELECT c.relname, i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
    "JOIN pg_class c ON c.oid = x.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = :schema AND c.relname = ANY(CAST(:names AS text[])) "
    "AND NOT (x.indisvalid AND x.indisready) ORDER BY 1, 2"
)
_SCHEMA_NOW = sa.text("SELECT coalesce(CAST(:schema AS text), current_schema())")
_TEMP_SCHEMA = sa.text("SELECT nspname FROM pg_namespace WHERE oid = pg_my_temp_schema()")


def _read_definitions(
    connection: sa.Connection, schema: str, names: list[str]
) -> dict[tuple[str, str, str], str]:
    rows = connection.execute(_DEFINITIONS, {"schema": schema, "names": names}).all()
    # An index's definition names its table, schema-qualified: only what follows USING
    # (method, columns, WHERE) and whether it is UNIQUE are compared.
    return {
        (table, kind, name): (
            re.sub(r"^CREATE (UNIQUE )?INDEX .*? USING ", r"\1USING ", text)
            if kind == "index"
            else text
        )
        for table, name, kind, text in rows
    }


def _definition_differences(
    connection: sa.Connection, table: sa.Table, family: list[sa.Table]
) -> list[Difference]:
    """The indexes and CHECK constraints that exist under their declared names but with
    another definition (another WHERE, not UNIQUE, another condition).

    What they should be is read back from the same tables created as temporary tables in
    a savepoint rolled back at once: PostgreSQL's own spelling of each definition, so
    nothing is compared by text that PostgreSQL rewrites. Skipped where that cannot run
    (a read-only transaction, a standby, a connection in autocommit): the rest of the
    check does not depend on it.

    The copies have no foreign keys: they are not compared here, and one to a table of
    the application (a column a model adds) named a ``pg_temp`` table that is not there
    (``metadata.create_all`` raised NoReferencedTableError, and ``sqla-jobs check`` a
    traceback)."""
    names = [t.name for t in family]
    schema = connection.execute(_SCHEMA_NOW, {"schema": table.schema}).scalar_one()
    found = _read_definitions(connection, schema, names)
    if not found:
        return []
    metadata = sa.MetaData(naming_convention=table.metadata.naming_convention)
    copies = [
        t.to_metadata(
            metadata,
            schema="pg_temp",
            referred_schema_fn=lambda _t, to_schema, _c, _referred: to_schema,
        )
        for t in family
    ]
    try:
        with connection.begin_nested() as savepoint:
            for copy in copies:
                connection.execute(sa.schema.CreateTable(copy, include_foreign_key_constraints=()))
                for index in copy.indexes:
                    connection.execute(sa.schema.CreateIndex(index))
            temp = connection.execute(_TEMP_SCHEMA).scalar_one()
            declared = _read_definitions(connection, temp, names)
            savepoint.rollback()
    except sa.exc.DBAPIError:
        return []
    except sa.exc.SQLAlchemyError as exc:
        # The model itself cannot be created as it is (a type or constraint SQLAlchemy
        # cannot render): say so, rather than fail the whole check with a traceback.
        log.warning(
            "schema: the indexes and CHECK constraints of %r were not compared with their "
            "definitions (the tables could not be copied to compare them: %s: %s)",
            table.fullname,
            type(exc).__name__,
            exc,
        )
        return []
    differences = []
    for key in sorted(found.keys() & declared.keys()):
        if found[key] == declared[key]:
            continue
        table_name, kind, name = key
        where = _name(schema if table.schema is not None else None, table_name)
        what = "index" if kind == "index" else "CHECK constraint"
        message = (
            f"{what} {name!r} on {where!r} differs: the database has {found[key]}; this "
            f"version declares {declared[key]} (drop it and run the migration that creates "
            "it, or re-create it by hand)"
        )
        differences.append(Difference(where, kind, message, False))
    return differences


def _invalid_indexes(
    connection: sa.Connection, table: sa.Table, family: list[sa.Table]
) -> list[Difference]:
    """The indexes of these tables that a failed concurrent build left invalid."""
    schema = connection.execute(_SCHEMA_NOW, {"schema": table.schema}).scalar_one()
    rows = connection.execute(_INVALID, {"schema": schema, "names": [t.name for t in family]})
    differences = []
    for table_name, name in rows:
        where = _name(schema if table.schema is not None else None, table_name)
        message = (
            f"index {name!r} on {where!r} is invalid (a CREATE INDEX CONCURRENTLY that "
            "failed): PostgreSQL keeps it but does not use it; drop it and build it again"
        )
        differences.append(Difference(where, "index", message, False))
    return differences


def _translated(connection: sa.Connection, table: sa.Table) -> sa.Table:
    """Copies of ``table`` and its companion tables, each in the schema ``connection``'s
    ``schema_translate_map`` gives it (the copy of the jobs table names its copied
    companions).

    A foreign key of the application's own to one of its tables (a column a model adds)
    names that table in the schema the map gives it, where a stand-in with its columns
    lets Alembic resolve it: it named a table not among the copies, and the comparison
    failed (NoReferencedTableError). The stand-ins are not compared."""
    companions = table.info.get("sqla_jobs_companions") or ()
    family = (table, *companions)
    metadata = sa.MetaData(naming_convention=table.metadata.naming_convention)

    def schema_of(original: sa.Table) -> str | None:
        return connection.schema_for_object(original)

    def outside(constraint: sa.ForeignKeyConstraint) -> sa.Table | None:
        try:
            referred = constraint.referred_table
        except sa.exc.NoReferenceError:
            return None  # it does not resolve in the model either: copied as it is
        return None if any(referred is t for t in family) else referred

    def referred_schema(
        _t: sa.Table, to_schema: str | None, constraint: sa.ForeignKeyConstraint, _r: str | None
    ) -> str | None:
        referred = outside(constraint)
        return to_schema if referred is None else schema_of(referred)

    copies = [
        t.to_metadata(metadata, schema=schema_of(t), referred_schema_fn=referred_schema)
        for t in family
    ]
    for t in family:
        for constraint in t.foreign_key_constraints:
            referred = outside(constraint)
            if referred is None:
                continue
            schema = schema_of(referred)
            if _name(schema, referred.name) not in metadata.tables:
                columns = [sa.Column(c.name, c.type, primary_key=c.primary_key) for c in referred.c]
                sa.Table(referred.name, metadata, *columns, schema=schema)
    copy: sa.Table = copies[0]
    copy.info[CHANNEL_SCHEMA] = table.schema
    if companions:
        copy.info["sqla_jobs_companions"] = type(companions)(*copies[1:])
    return copy


def _name(schema: str | None, name: str) -> str:
    return f"{schema}.{name}" if schema else name


def _describe(
    connection: sa.Connection, operations: list[Any], schema: str | None
) -> Iterator[Difference]:
    """The operations (all on tables of ``schema``) as differences. Each table is named
    with the model's schema: Alembic writes some operations on a table of the default
    schema under None, others under the name the model gives it."""
    created = {
        op.table_name for op in operations if isinstance(op, (CreateJobsTableOp, ops.CreateTableOp))
    }
    for op in operations:
        if isinstance(op, (CreateJobsTableOp, ops.CreateTableOp)):
            name = _name(schema, op.table_name)
            yield Difference(name, "table", f"table {name!r} is missing", True)
        elif isinstance(op, ops.ModifyTableOps):
            if op.table_name in created:
                continue  # the indexes of a missing table: it is missing
            name = _name(schema, op.table_name)
            for sub in op.ops:
                yield _describe_change(name, sub)
        elif isinstance(op, ReplaceJobsDDLOp):
            yield from _describe_ddl(connection, op)
        elif isinstance(op, CreateJobsChecksOp):
            name = _name(schema, op.table_name)
            checks = ", ".join(map(repr, op.checks))
            plural = "s" if len(op.checks) > 1 else ""
            yield Difference(
                name, "check", f"{name!r} lacks CHECK constraint{plural} {checks}", False
            )
        else:
            table = _name(schema, getattr(op, "table_name", "?"))
            yield Difference(table, type(op).__name__, f"{table!r}: {type(op).__name__}", False)


def _describe_change(table: str, op: Any) -> Difference:
    """One change inside a table: a column, an index, a constraint."""
    if isinstance(op, ops.AddColumnOp):
        return Difference(table, "column", f"column {table}.{op.column.name} is missing", True)
    if isinstance(op, ops.DropColumnOp):
        return Difference(
            table,
            "column",
            f"column {table}.{op.column_name} is in the database but not in this version's model",
            False,
        )
    if isinstance(op, ops.CreateIndexOp):
        return Difference(table, "index", f"index {op.index_name!r} on {table!r} is missing", False)
    if isinstance(op, ops.DropIndexOp):
        return Difference(
            table,
            "index",
            f"index {op.index_name!r} on {table!r} is in the database but not in the model",
            False,
        )
    if isinstance(op, ops.AlterColumnOp):
        column = f"{table}.{op.column_name}"
        if op.modify_type is not None:
            message = (
                f"column {column} is {_type(op.existing_type)} in the database; this version "
                f"declares {_type(op.modify_type)}"
            )
        elif op.modify_nullable is not None:
            wanted = "NULL" if op.modify_nullable else "NOT NULL"
            message = f"column {column} should be {wanted}"
        else:
            message = f"column {column} differs ({op.kw or 'server default or comment'})"
        return Difference(table, "column", message, False)
    if isinstance(op, ops.CreateCheckConstraintOp):
        return Difference(
            table, "check", f"{table!r} lacks CHECK constraint {op.constraint_name!r}", False
        )
    name = getattr(op, "constraint_name", None) or getattr(op, "index_name", None) or ""
    return Difference(
        table, type(op).__name__, f"{table!r}: {type(op).__name__} {name}".rstrip(), False
    )


def _type(type_: Any) -> str:
    return str(type_.compile(dialect=_POSTGRESQL)) if type_ is not None else "another type"


def _describe_ddl(connection: sa.Connection, op: ReplaceJobsDDLOp) -> Iterator[Difference]:
    """The notify function, its trigger and the storage parameters: ``op`` is what this
    version installs, its reverse what the database has."""
    table = _name(op.schema, op.table_name)
    found = op.reverse()
    function = derived_name(op.table_name, "notify")
    if not found.function_body:
        message = f"the notify function {function}() of {table!r} is missing"
        yield Difference(table, "trigger", message, False)
    elif " ".join(found.function_body.split()) != " ".join(op.function_body.split()):
        message = f"the notify function {function}() of {table!r} is not this version's"
        yield Difference(table, "trigger", message, False)
    if not _is_jobs_table(connection, op.schema, op.table_name):
        message = f"the notify trigger {function} on {table!r} is missing"
        yield Difference(table, "trigger", message, False)
    storage = []
    for key, value in op.storage_parameters.items():
        have = found.storage_parameters.get(key)
        if have != value:
            storage.append(f"{key} is {have if have is not None else 'not set'} ({value} expected)")
    for key, have in found.storage_parameters.items():
        if key not in op.storage_parameters:
            storage.append(f"{key} is {have} (this version does not set it)")
    if storage:
        message = f"storage parameters of {table!r}: {'; '.join(storage)}"
        yield Difference(table, "storage", message, False)
