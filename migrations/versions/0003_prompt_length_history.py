"""prompt length history: lengths of earlier rollouts' responses by prompt hash (--prior)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 05:00:00.000000
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('prompt_length_history',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('prompt_hash', sa.String(length=64), nullable=False),
    sa.Column('age', sa.Integer(), nullable=False),
    sa.Column('length', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_prompt_length_history_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_prompt_length_history'))
    )
    with op.batch_alter_table('prompt_length_history', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_prompt_length_history_prompt_hash'), ['prompt_hash'], unique=False)
        batch_op.create_index(batch_op.f('ix_prompt_length_history_rollout_id'), ['rollout_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('prompt_length_history', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_prompt_length_history_rollout_id'))
        batch_op.drop_index(batch_op.f('ix_prompt_length_history_prompt_hash'))

    op.drop_table('prompt_length_history')
