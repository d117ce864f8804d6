#!/usr/bin/env python
"""What the lease book's transactions write to the WAL: bytes and 4 KiB pages per transaction,
by what ran it (a report call's commit, its leases), for report calls of B chunks.

Every transaction writes each page it touched in full (a chunk row, the request row, the index
pages of their status, the event row and its indexes), so the disk's load is pages per
transaction times transactions, not rows: `tools/bench/load.py` reports what the coordinator wrote
towards the disk in all. This runs `tools/bench/book_cpu.py`'s in-place cycle (one worker, report
calls of B chunks continued in place) with the WAL checkpoints off and measures the WAL's growth
around each of the book's transactions.

    .venv/bin/python tools/bench/wal_pages.py [--batch 1,8] [--policy seer] [--rounds 200]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench import book_cpu  # noqa: E402
from seerd.db import base  # noqa: E402

FRAME_BYTES = 4096 + 24  # a WAL frame: the page and its header


def wal_growth_by_caller(batch: int, policy: str, rounds: int) -> dict[str, list[int]]:
    """WAL bytes of each transaction of the book, keyed by the function that opened it."""
    grown: dict[str, list[int]] = collections.defaultdict(list)
    begin = base.Writer.begin

    @contextlib.contextmanager
    def measured(self, *, durable: bool = True):  # noqa: ANN001, ANN202
        before = self._wal.stat().st_size if self._wal.exists() else 0
        with begin(self, durable=durable) as conn:
            yield conn
        opened_by = traceback.extract_stack(limit=4)[0].name  # (through contextlib's frames)
        grown[opened_by].append(self._wal.stat().st_size - before)

    saved = base.Writer.begin, base.Writer.CHECKPOINT_WAL_BYTES, base.Writer.INLINE_CHECKPOINT_WAL_BYTES
    base.Writer.begin = measured
    base.Writer.CHECKPOINT_WAL_BYTES = base.Writer.INLINE_CHECKPOINT_WAL_BYTES = 1 << 62  # the WAL only grows
    try:
        book_cpu.cpu_ms_per_chunk(batch, 64, 200, rounds, 2000, in_place=True, policy=policy)
    finally:
        base.Writer.begin, base.Writer.CHECKPOINT_WAL_BYTES, base.Writer.INLINE_CHECKPOINT_WAL_BYTES = saved
    return grown


# The functions that open the book's transactions in this cycle, by what they write.
KINDS = {"report_calls": "reports (one call's)", "close": "leases (the call's continuations)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,8", help="chunks per report call, comma-separated")
    parser.add_argument("--policy", default="seer")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print("| chunks a call | transaction | count | WAL KB each | pages each | pages per chunk |\n|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        for opened_by, sizes in wal_growth_by_caller(batch, args.policy, args.rounds).items():
            if opened_by not in KINDS:
                continue  # the set-up's
            mean = sum(sizes) / len(sizes)
            print(f"| {batch} | {KINDS[opened_by]} | {len(sizes)} | {mean / 1024:.1f} | {mean / FRAME_BYTES:.1f} "
                  f"| {mean / FRAME_BYTES / batch:.1f} |")


if __name__ == "__main__":
    main()
