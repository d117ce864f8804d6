"""`tools/bench/wal_pages.py`: it measures the book's two transactions of a report call, and a
call of more chunks shares its pages among them (what group commit saves on the disk)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import wal_pages  # noqa: E402


def test_a_report_call_of_more_chunks_writes_fewer_wal_pages_a_chunk():
    per_chunk = {}
    for batch in (1, 8):
        grown = wal_pages.wal_growth_by_caller(batch, "seer", rounds=10)
        assert set(wal_pages.KINDS) <= set(grown)
        assert all(size > 0 for kind in wal_pages.KINDS for size in grown[kind])
        per_chunk[batch] = sum(sum(grown[kind]) / len(grown[kind]) for kind in wal_pages.KINDS) / batch
    assert per_chunk[8] < per_chunk[1] / 2
