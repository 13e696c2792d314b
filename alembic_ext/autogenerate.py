"""Autogenerate: write ``op.create_jobs_table`` / ``op.drop_jobs_table`` for jobs tables.

Alembic's own comparators decide *what* changed; this module only decides *how it is
written*. A schema-level comparator that runs after the built-in ones rewrites the
operations they produced:

* a ``CreateTableOp`` for a table whose ``info`` says it is a jobs table (set by
  :class:`sqla_jobs.JobMixin`), together with the ``CreateIndexOp``\\ s that follow it for
  the same table, becomes one :class:`~alembic_ext.ops.CreateJobsTableOp`;
* a ``DropTableOp`` for a table that, in the database, carries the ``<table>_notify``
  trigger of sqla-jobs, together with the ``DropIndexOp``\\ s before it, becomes one
  :class:`~alembic_ext.ops.DropJobsTableOp`, whose reverse re-creates the table as it was.

What Alembic does not compare is compared here, read-only: the notify function, trigger
and storage parameters (:class:`~alembic_ext.ops.ReplaceJobsDDLOp`), and the named CHECK
constraints of the jobs table and its companions
(:class:`~alembic_ext.ops.CreateJobsChecksOp`).

Because nothing is compared here, whatever Alembic filtered out (``include_object``,
``include_name``, ``include_schemas``) stays out: an index the filter skips is not in the
rewritten operation either. Changes to an existing jobs table (a column or an index added
by a newer sqla-jobs) are left as Alembic writes them: plain ``op.add_column`` and
``op.create_index``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from alembic.autogenerate import comparators
from alembic.autogenerate.api import AutogenContext
from alembic.operations import ops

from sqla_jobs.model import STORAGE_PARAMETERS, derived_name, notify_function_body

from .ops import CreateJobsChecksOp, CreateJobsTableOp, DropJobsTableOp, ReplaceJobsDDLOp

if TYPE_CHECKING:
    from alembic.runtime.environment import NameFilterParentNames

__all__ = ["rewrite_jobs_tables"]

_Key = tuple[str | None, str]

#: ``Table.info`` key of a copy made in another schema than its table's (a translate
#: map's): the schema of the table it copies, whose notify channel its function uses.
CHANNEL_SCHEMA = "sqla_jobs_channel_schema"


def _after_builtin_comparators() -> dict[str, Any]:
    """Keyword arguments that make a comparator run after Alembic's table comparison.

    Since Alembic 1.18 the built-in comparators come from plugins that are merged *after*
    the global registry into each run's dispatcher, so a plain registration would run
    first, before there is anything to rewrite; ``priority=LAST`` puts it after them.
    Before 1.18 comparators ran in registration order and the built-ins, registered when
    ``alembic.autogenerate`` is imported, always came first.
    """
    try:
        from alembic.util import DispatchPriority
    except ImportError:  # pragma: no cover - Alembic < 1.18
        return {}
    return {"priority": DispatchPriority.LAST}


@comparators.dispatch_for("schema", **_after_builtin_comparators())
def rewrite_jobs_tables(
    autogen_context: AutogenContext, upgrade_ops: ops.UpgradeOps, schemas: set[str | None]
) -> None:
    """Swap the create/drop table and index operations of jobs tables for the jobs ops,
    replace the DDL of existing jobs tables that a newer sqla-jobs changed, and add the
    CHECK constraints it declares that they lack."""
    _rewrite_creates(autogen_context, upgrade_ops)
    _rewrite_drops(autogen_context, upgrade_ops)
    _replace_changed_ddl(autogen_context, upgrade_ops, schemas)
    _add_missing_checks(autogen_context, upgrade_ops, schemas)


def _compared_schema(connection: sa.Connection | None, schema: str | None) -> str | None:
    """The schema as Alembic's autogenerate files a table of ``schema``: None for the
    connection's default schema, even named explicitly (``MetaData(schema="public")``).

    Alembic lists the default schema as None among the schemas it compares, and writes
    the operations on such a table under None. Compared under its own name, a jobs table
    declared there was never in the schemas compared: a lost trigger or CHECK constraint
    went unnoticed, and its indexes were not folded into ``op.create_jobs_table``.
    """
    if connection is None or schema is None:
        return schema
    return None if schema == connection.dialect.default_schema_name else schema


def _table_key(connection: sa.Connection | None, schema: str | None, table_name: str) -> _Key:
    return (_compared_schema(connection, schema), table_name)


def _take_index_ops(
    connection: sa.Connection | None,
    upgrade_ops: ops.UpgradeOps,
    tables: set[_Key],
    kind: type[ops.MigrateOperation],
) -> dict[_Key, list[Any]]:
    """Remove the index operations of ``kind`` on ``tables`` (keys of :func:`_table_key`)
    from their ModifyTableOps (and the containers left empty); return them by table."""
    taken: dict[_Key, list[Any]] = {key: [] for key in tables}
    kept: list[ops.MigrateOperation] = []
    for op in upgrade_ops.ops:
        if (
            isinstance(op, ops.ModifyTableOps)
            and (key := _table_key(connection, op.schema, op.table_name)) in tables
        ):
            taken[key] += [sub for sub in op.ops if isinstance(sub, kind)]
            op.ops = [sub for sub in op.ops if not isinstance(sub, kind)]
            if op.is_empty():
                continue
        kept.append(op)
    upgrade_ops.ops = kept
    return taken


def _rewrite_creates(autogen_context: AutogenContext, upgrade_ops: ops.UpgradeOps) -> None:
    # Alembic's CreateTableOp keeps the table's own schema, the ModifyTableOps of its
    # indexes the schema it compared (None for the default schema named explicitly).
    connection = autogen_context.connection
    creates = {
        _table_key(connection, op.schema, op.table_name): op
        for op in upgrade_ops.ops
        if isinstance(op, ops.CreateTableOp) and op.info.get("sqla_jobs")
    }
    if not creates:
        return
    index_ops = _take_index_ops(connection, upgrade_ops, set(creates), ops.CreateIndexOp)
    for i, op in enumerate(upgrade_ops.ops):
        if isinstance(op, ops.CreateTableOp) and op.info.get("sqla_jobs"):
            key = _table_key(connection, op.schema, op.table_name)
            op.info = {}  # sqla-jobs' bookkeeping, meaningless in a migration
            indexes = [index_op.to_index() for index_op in index_ops[key]]
            upgrade_ops.ops[i] = CreateJobsTableOp(op, indexes)


def _is_jobs_table(connection: sa.Connection, schema: str | None, table_name: str) -> bool:
    """Whether the table carries the notify trigger that ``ddl_statements`` creates.

    A dropped table exists only in the database, so its trigger is the one mark left of
    its having been a jobs table; a table that merely has the same columns is dropped as
    any other.
    """
    query = sa.text(
        """
        SELECT EXISTS (
            SELECT 1 FROM pg_trigger t
              JOIN pg_class c ON c.oid = t.tgrelid
              JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = coalesce(:schema, current_schema())
               AND c.relname = :table AND t.tgname = :trigger AND NOT t.tgisinternal
        )
        """
    )
    params = {"schema": schema, "table": table_name, "trigger": derived_name(table_name, "notify")}
    return bool(connection.execute(query, params).scalar())


def _rewrite_drops(autogen_context: AutogenContext, upgrade_ops: ops.UpgradeOps) -> None:
    connection = autogen_context.connection
    if connection is None or connection.dialect.name != "postgresql":
        return
    drops = {
        _table_key(connection, op.schema, op.table_name): op
        for op in upgrade_ops.ops
        if isinstance(op, ops.DropTableOp) and _is_jobs_table(connection, op.schema, op.table_name)
    }
    if not drops:
        return
    index_ops = _take_index_ops(connection, upgrade_ops, set(drops), ops.DropIndexOp)
    for i, op in enumerate(upgrade_ops.ops):
        if isinstance(op, ops.DropTableOp):
            key = _table_key(connection, op.schema, op.table_name)
            if key not in drops:
                continue
            indexes = [index_op.to_index() for index_op in index_ops[key]]
            table_op = op.reverse()
            # Reflection reports the storage parameters as postgresql_with; the operation
            # sets sqla-jobs' own anyway, so they would only be noise in the downgrade.
            with_ = table_op.kw.get("postgresql_with")
            if isinstance(with_, dict) and with_.items() <= STORAGE_PARAMETERS.items():
                del table_op.kw["postgresql_with"]
            recreate = CreateJobsTableOp(table_op, indexes)
            upgrade_ops.ops[i] = DropJobsTableOp(op.table_name, schema=op.schema, reverse=recreate)


# --- what Alembic cannot see: the trigger function and the storage parameters --------------


def _replace_changed_ddl(
    autogen_context: AutogenContext, upgrade_ops: ops.UpgradeOps, schemas: set[str | None]
) -> None:
    """A :class:`~alembic_ext.ops.ReplaceJobsDDLOp` for each jobs table of the metadata that
    exists in the database with another notify function, storage parameters or no trigger.

    Alembic compares tables, columns and indexes, not functions, triggers or
    ``reloptions``: those are compared here, the way alembic_utils compares its
    replaceable entities, by reading the database's definition (read-only catalog
    queries) and writing the database's one into the reverse, so the downgrade restores
    it. The filters apply as for any table.
    """
    connection = autogen_context.connection
    if connection is None or connection.dialect.name != "postgresql":
        return
    creating = {
        _table_key(connection, op.schema, op.table_name)
        for op in upgrade_ops.ops
        if isinstance(op, CreateJobsTableOp)
    }
    inspector = sa.inspect(connection)
    for table in autogen_context.sorted_tables:
        schema, _ = key = _table_key(connection, table.schema, table.name)
        if not table.info.get("sqla_jobs") or key in creating or schema not in schemas:
            continue
        if not autogen_context.run_name_filters(
            table.name, "table", {"schema_name": schema}
        ) or not autogen_context.run_object_filters(table, table.name, "table", False, None):
            continue
        if not inspector.has_table(table.name, schema=table.schema):
            continue
        wanted = ReplaceJobsDDLOp.installed(table.name, table.schema)
        channel_schema = table.info.get(CHANNEL_SCHEMA, table.schema)
        if channel_schema != table.schema:
            # A copy placed in the schema a translate map gives it (check.schema_differences):
            # its function notifies the channel of the table it was declared as.
            named = sa.Table(table.name, sa.MetaData(), schema=channel_schema)
            wanted.function_body = notify_function_body(named)
        found = _found_ddl(connection, table, wanted)
        if found is not None:
            wanted._reverse = found
            upgrade_ops.ops.append(wanted)


def _found_ddl(
    connection: sa.Connection, table: sa.Table, wanted: ReplaceJobsDDLOp
) -> ReplaceJobsDDLOp | None:
    """The table's definition as the database has it, or None if it is ``wanted``'s."""
    body = connection.execute(
        sa.text(
            "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = coalesce(:schema, current_schema()) AND p.proname = :name "
            "AND p.pronargs = 0"
        ),
        {"schema": table.schema, "name": derived_name(table.name, "notify")},
    ).scalar()
    options = connection.execute(
        sa.text(
            "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = coalesce(:schema, current_schema()) AND c.relname = :name"
        ),
        {"schema": table.schema, "name": table.name},
    ).scalar()
    storage = dict(option.split("=", 1) for option in options or [])
    managed = {k: storage[k] for k in STORAGE_PARAMETERS if k in storage}
    has_trigger = _is_jobs_table(connection, table.schema, table.name)
    same = (
        has_trigger
        and _squeezed(body or "") == _squeezed(wanted.function_body)
        and managed == wanted.storage_parameters
    )
    if same:
        return None
    return ReplaceJobsDDLOp(
        table.name,
        schema=table.schema,
        function_body=body or "",
        storage_parameters=managed,
        reverse=wanted,
    )


def _squeezed(text: str) -> str:
    """A function body with its white space folded: indentation is not a change."""
    return " ".join(text.split())


def _jobs_family(autogen_context: AutogenContext) -> list[tuple[sa.Table, list[sa.Table]]]:
    """Each jobs table of the metadata, with itself and its companion tables."""
    family = []
    for table in autogen_context.sorted_tables:
        companions = table.info.get("sqla_jobs_companions")
        if table.info.get("sqla_jobs") and companions is not None:
            family.append((table, [table, *companions]))
    return family


def _final_name(constraint: sa.Constraint, dialect: sa.Dialect) -> str:
    """The name a constraint has in the database: a name over the dialect's limit (63
    bytes on PostgreSQL; a naming convention that repeats a long table name makes one)
    is shortened by SQLAlchemy when it creates it, with a hash of the whole name. Compared
    under its full name, such a constraint was never found, and each autogenerate added
    it again (PostgreSQL then truncated that name to another)."""
    rendered = dialect.identifier_preparer.format_constraint(constraint)
    if rendered is None:
        return str(constraint.name)
    if rendered.startswith('"'):
        return rendered[1:-1].replace('""', '"')
    return rendered


def _add_missing_checks(
    autogen_context: AutogenContext, upgrade_ops: ops.UpgradeOps, schemas: set[str | None]
) -> None:
    """A :class:`~alembic_ext.ops.CreateJobsChecksOp` for each table of a jobs table's
    family (itself and its companions) that exists in the database without some of the
    named CHECK constraints its model declares (compared by name, as Alembic compares
    them: PostgreSQL rewrites a condition's text, so a changed condition gets a new name).

    A constraint that another comparator already adds (Alembic's opt-in
    ``checkconstraint_byname`` plugin) is left to it.
    """
    connection = autogen_context.connection
    if connection is None or connection.dialect.name != "postgresql":
        return
    created = {
        _table_key(connection, op.schema, op.table_name)
        for op in upgrade_ops.ops
        if isinstance(op, (ops.CreateTableOp, CreateJobsTableOp))
    }
    added = {
        sub.constraint_name
        for op in upgrade_ops.ops
        if isinstance(op, ops.ModifyTableOps)
        for sub in op.ops
        if isinstance(sub, ops.CreateCheckConstraintOp)
    }
    inspector = sa.inspect(connection)
    for _, family in _jobs_family(autogen_context):
        for table in family:
            schema, _ = key = _table_key(connection, table.schema, table.name)
            if key in created or schema not in schemas:
                continue
            if not autogen_context.run_name_filters(
                table.name, "table", {"schema_name": schema}
            ) or not autogen_context.run_object_filters(table, table.name, "table", False, None):
                continue
            if not inspector.has_table(table.name, schema=table.schema):
                continue
            have = {c["name"] for c in inspector.get_check_constraints(table.name, table.schema)}
            parents: NameFilterParentNames = {"table_name": table.name, "schema_name": schema}
            missing = {
                final: str(c.sqltext)
                for c in sorted(table.constraints, key=lambda c: str(c.name))
                if isinstance(c, sa.CheckConstraint)
                and c.name is not None
                and (final := _final_name(c, connection.dialect)) not in have
                and c.name not in added
                and final not in added
                # The filters decide for each constraint too, as for Alembic's own
                # comparators (the name filter sees the name the database has, the object
                # filter the model's): one the application leaves out (dropped on
                # purpose, say) was added again at every autogenerate.
                and autogen_context.run_name_filters(final, "check_constraint", parents)
                and autogen_context.run_object_filters(c, c.name, "check_constraint", False, None)
            }
            if missing:
                upgrade_ops.ops.append(CreateJobsChecksOp(table.name, missing, schema=table.schema))
