"""fewer hot indexes: drop the two that every lease or report transaction wrote and nothing read

`ix_events_ts` (no query filters or orders events by time: they are read by run, in id order)
and `ix_chunks_request_id` (the unique (request_id, seq) index answers every lookup by request,
in order). Each cost a page of WAL in every transaction that inserts an event or a chunk: of the
~11 pages a one-chunk report or lease writes (tools/bench/wal_pages.py), and a 512-worker load run
wrote ~17 GB towards the disk for a 221 MB database (tools/bench/load.py).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 16:30:00.000000
"""
from __future__ import annotations

from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_events_ts', table_name='events')
    op.drop_index('ix_chunks_request_id', table_name='chunks')


def downgrade() -> None:
    op.create_index('ix_chunks_request_id', 'chunks', ['request_id'], unique=False)
    op.create_index('ix_events_ts', 'events', ['ts'], unique=False)
