"""snip tables

Revision ID: 0001
Revises: 
Created: 2026-11-30 05:26:24.120180
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql
import alembic_ext  # noqa: F401

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_jobs_table('jobs',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('queue', sa.Text(), server_default='default', nullable=False),
    sa.Column('task', sa.Text(), nullable=False),
    sa.Column('args', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('status', sa.Text(), server_default='ready', nullable=False),
    sa.Column('priority', sa.SmallInteger(), server_default='0', nullable=False),
    sa.Column('run_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('max_attempts', sa.Integer(), server_default='5', nullable=False),
    sa.Column('locked_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('locked_by', sa.Text(), nullable=True),
    sa.Column('unique_key', sa.Text(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('scheduled', 'ready', 'running', 'done', 'dead', 'cancelled')", name='jobs_status'),
    sa.CheckConstraint('attempts >= 0', name='jobs_attempts'),
    sa.CheckConstraint('max_attempts >= 1', name='jobs_max_attempts'),
    sa.CheckConstraint('priority >= 0', name='jobs_priority'),
    sa.PrimaryKeyConstraint('id'),
    sa.Index('jobs_claim', 'queue', sa.text('priority DESC'), 'run_at', 'id', postgresql_where=sa.text("status = 'ready'")),
    sa.Index('jobs_finished', 'finished_at', postgresql_where=sa.text("status IN ('done', 'dead', 'cancelled')")),
    sa.Index('jobs_running', 'locked_until', postgresql_where=sa.text("status = 'running'")),
    sa.Index('jobs_scheduled', 'run_at', postgresql_where=sa.text("status = 'scheduled'")),
    sa.Index('jobs_unique', 'unique_key', unique=True, postgresql_where=sa.text("unique_key IS NOT NULL AND status IN ('scheduled', 'ready', 'running')"))
    )
    op.create_table('jobs_queues',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('paused', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('jobs_schedules',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('task', sa.Text(), nullable=False),
    sa.Column('args', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('cron', sa.Text(), nullable=False),
    sa.Column('queue', sa.Text(), nullable=True),
    sa.Column('priority', sa.SmallInteger(), nullable=True),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('next_run_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_run_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('origin', sa.Text(), server_default='runtime', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_index('jobs_schedules_due', 'jobs_schedules', ['next_run_at'], unique=False, postgresql_where=sa.text('enabled'))
    op.create_table('links',
    sa.Column('code', sa.Text(), nullable=False),
    sa.Column('long_url', sa.Text(), nullable=False),
    sa.Column('owner_webhook', sa.Text(), nullable=True),
    sa.Column('title', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('code')
    )


def downgrade() -> None:
    op.drop_table('links')
    op.drop_index('jobs_schedules_due', table_name='jobs_schedules', postgresql_where=sa.text('enabled'))
    op.drop_table('jobs_schedules')
    op.drop_table('jobs_queues')
    op.drop_jobs_table('jobs')
