"""request failures: chunks of a request the engine failed, and the message it ended with

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 23:00:00.000000
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failed_attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('error', sa.Text(), nullable=True))


def downgrade() -> None:
    # Not in a batch: a batch copy drops the old table, and with foreign keys on that DROP deletes
    # every chunk of the run (chunks.request_id is ON DELETE CASCADE). SQLite >= 3.35 drops in place.
    op.drop_column('requests', 'error')
    op.drop_column('requests', 'failed_attempts')
