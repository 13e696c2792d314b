"""Alembic support for sqla-jobs: ``op.create_jobs_table``, ``op.drop_jobs_table`` and autogenerate.

Importing this package is all the setup there is. In ``env.py``:

.. code-block:: python

    import alembic_ext  # noqa: F401  (registers the operations and the autogenerate hook)

    from myapp.models import Base

    target_metadata = Base.metadata

    def run_migrations_online() -> None:
        ...
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # only if the jobs table lives in a schema other than the default one:
            include_schemas=True,
            # (None is the default schema: keep it, with your own tables there)
            include_name=lambda name, type_, parent: type_ != "schema" or name in {None, "work"},
        )

``alembic revision --autogenerate`` then writes, for a model ``class Job(JobMixin, Base)``:

.. code-block:: python

    def upgrade() -> None:
        op.create_jobs_table(
            "jobs",
            sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
            ...,
            sa.Index("jobs_claim", "queue", sa.text("priority DESC"), "run_at", "id",
                     postgresql_where=sa.text("status = 'ready'")),
            ...,
            schema="work",
        )

    def downgrade() -> None:
        op.drop_jobs_table("jobs", schema="work")

``op.create_jobs_table`` creates the table, its partial indexes, the storage parameters
tuned for a queue's churn, and the notify trigger and function; ``op.drop_jobs_table``
removes all of it. The columns are written out so that the migration never depends on the
models or on the installed sqla-jobs version (see :mod:`alembic_ext.ops` for why). When a
later sqla-jobs adds a column or an index, the next autogenerate writes a plain
``op.add_column`` / ``op.create_index`` for it. ``alembic upgrade head --sql`` prints all
of it, trigger function included, as SQL a DBA can review and run.

What Alembic does not compare is compared too: the notify function, trigger and storage
parameters (``op.replace_jobs_ddl``), and the named CHECK constraints of the jobs table and
its companions (``op.create_jobs_checks``, whose reverse is ``op.drop_jobs_checks``).
:mod:`alembic_ext.check` runs the same comparison against a live database, for
``sqla-jobs check`` and the worker's start.

Autogenerate compares only the schemas Alembic is told to look at: a jobs table outside
the default schema needs ``include_schemas=True`` (and an ``include_name`` filter to keep
the comparison to your own schemas), or Alembic will propose to create it on every run.
"""

from __future__ import annotations

from . import autogenerate, ops
from .ops import (
    CreateJobsChecksOp,
    CreateJobsTableOp,
    DropJobsChecksOp,
    DropJobsTableOp,
    installed_jobs_table,
)

__all__ = [
    "CreateJobsChecksOp",
    "CreateJobsTableOp",
    "DropJobsChecksOp",
    "DropJobsTableOp",
    "autogenerate",
    "installed_jobs_table",
    "ops",
]
