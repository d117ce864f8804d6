"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-22 01:34:26.581502
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('rollouts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('created', 'running', 'interrupted', 'finished', 'failed', name='rolloutstatus', native_enum=False, length=16), nullable=False),
    sa.Column('policy', sa.String(length=32), nullable=False),
    sa.Column('seed', sa.Integer(), nullable=False),
    sa.Column('model_path', sa.Text(), nullable=False),
    sa.Column('input_path', sa.Text(), nullable=False),
    sa.Column('input_sha256', sa.String(length=64), nullable=False),
    sa.Column('config_json', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('status_reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_rollouts'))
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('worker_id', sa.String(length=128), nullable=True),
    sa.Column('request_id', sa.Integer(), nullable=True),
    sa.Column('chunk_id', sa.Integer(), nullable=True),
    sa.Column('data_json', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_events_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_kind'), ['kind'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_rollout_id'), ['rollout_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_ts'), ['ts'], unique=False)

    op.create_table('prompt_groups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('group_index', sa.Integer(), nullable=False),
    sa.Column('prompt_id', sa.Text(), nullable=False),
    sa.Column('prompt_token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('prompt_len', sa.Integer(), nullable=False),
    sa.Column('prompt_hash', sa.String(length=64), nullable=False),
    sa.Column('n', sa.Integer(), nullable=False),
    sa.Column('max_tokens', sa.Integer(), nullable=False),
    sa.Column('sampling_json', sa.Text(), nullable=False),
    sa.Column('length_estimate', sa.Integer(), nullable=False),
    sa.Column('probe_request_id', sa.Integer(), nullable=True),
    sa.Column('bound_worker', sa.String(length=128), nullable=True),
    sa.Column('finished_requests', sa.Integer(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_prompt_groups_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_prompt_groups')),
    sa.UniqueConstraint('rollout_id', 'group_index', name=op.f('uq_prompt_groups_rollout_id'))
    )
    with op.batch_alter_table('prompt_groups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_prompt_groups_prompt_hash'), ['prompt_hash'], unique=False)
        batch_op.create_index(batch_op.f('ix_prompt_groups_rollout_id'), ['rollout_id'], unique=False)

    op.create_table('workers',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('address', sa.Text(), nullable=False),
    sa.Column('max_chunks', sa.Integer(), nullable=False),
    sa.Column('kv_capacity_tokens', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('alive', 'stale', 'gone', name='workerstatus', native_enum=False, length=16), nullable=False),
    sa.Column('registered_at', sa.Float(), nullable=False),
    sa.Column('last_heartbeat', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_workers_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_workers'))
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workers_rollout_id'), ['rollout_id'], unique=False)

    op.create_table('requests',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rollout_id', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.Integer(), nullable=False),
    sa.Column('response_index', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('queued', 'running', 'finished', name='requeststatus', native_enum=False, length=16), nullable=False),
    sa.Column('is_probe', sa.Boolean(), nullable=False),
    sa.Column('generated_tokens', sa.Integer(), nullable=False),
    sa.Column('num_chunks', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('last_worker', sa.String(length=128), nullable=True),
    sa.Column('queued_at', sa.Float(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['group_id'], ['prompt_groups.id'], name=op.f('fk_requests_group_id_prompt_groups'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['rollout_id'], ['rollouts.id'], name=op.f('fk_requests_rollout_id_rollouts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_requests')),
    sa.UniqueConstraint('group_id', 'response_index', name=op.f('uq_requests_group_id'))
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_requests_group_id'), ['group_id'], unique=False)
        batch_op.create_index('ix_requests_rollout_status', ['rollout_id', 'status'], unique=False)

    op.create_table('chunks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('request_id', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('max_tokens', sa.Integer(), nullable=False),
    sa.Column('status', sa.Enum('queued', 'leased', 'done', name='chunkstatus', native_enum=False, length=16), nullable=False),
    sa.Column('lease_holder', sa.String(length=128), nullable=True),
    sa.Column('lease_deadline', sa.Float(), nullable=True),
    sa.Column('lease_epoch', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('leased_at', sa.Float(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('token_ids', sa.LargeBinary(), nullable=True),
    sa.Column('logprobs', sa.LargeBinary(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('cached_tokens', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['request_id'], ['requests.id'], name=op.f('fk_chunks_request_id_requests'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_chunks')),
    sa.UniqueConstraint('request_id', 'seq', name=op.f('uq_chunks_request_id'))
    )
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_chunks_request_id'), ['request_id'], unique=False)
        batch_op.create_index('ix_chunks_status_deadline', ['status', 'lease_deadline'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.drop_index('ix_chunks_status_deadline')
        batch_op.drop_index(batch_op.f('ix_chunks_request_id'))

    op.drop_table('chunks')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index('ix_requests_rollout_status')
        batch_op.drop_index(batch_op.f('ix_requests_group_id'))

    op.drop_table('requests')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workers_rollout_id'))

    op.drop_table('workers')
    with op.batch_alter_table('prompt_groups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_prompt_groups_rollout_id'))
        batch_op.drop_index(batch_op.f('ix_prompt_groups_prompt_hash'))

    op.drop_table('prompt_groups')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_ts'))
        batch_op.drop_index(batch_op.f('ix_events_rollout_id'))
        batch_op.drop_index(batch_op.f('ix_events_kind'))

    op.drop_table('events')
    op.drop_table('rollouts')
