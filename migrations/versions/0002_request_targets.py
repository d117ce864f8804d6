"""request targets: per-response target lengths (benchmarks), read by workers only

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:44:01.989303
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('request_targets',
    sa.Column('request_id', sa.Integer(), nullable=False),
    sa.Column('target_length', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['request_id'], ['requests.id'], name=op.f('fk_request_targets_request_id_requests'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('request_id', name=op.f('pk_request_targets'))
    )


def downgrade() -> None:
    op.drop_table('request_targets')
