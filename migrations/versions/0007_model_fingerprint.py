"""model fingerprint: the model checkpoint's identity, recorded at creation and checked at resume

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 09:00:00.000000
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('rollouts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model_fingerprint', sa.Text(), nullable=True))


def downgrade() -> None:
    # Not in a batch: batch would copy the table and drop the old one, and with foreign keys on
    # that DROP deletes the whole run (every table refers to rollouts ON DELETE CASCADE).
    # SQLite >= 3.35 drops a column in place.
    op.drop_column('rollouts', 'model_fingerprint')
