"""group forecast: the coordinator's forecast of each group's longest response, for `seerd status`

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 09:00:00.000000
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('prompt_groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('forecast_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    # Not in a batch: batch would copy the table and drop the old one, and with foreign keys on
    # that DROP deletes every request of the run (requests.group_id is ON DELETE CASCADE).
    # SQLite >= 3.35 drops a column in place.
    op.drop_column('prompt_groups', 'forecast_tokens')
