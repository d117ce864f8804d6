#!/usr/bin/env python
"""Print a short table of a run's rollouts.parquet: one line per group."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq


def main(run_dir: str) -> int:
    path = Path(run_dir) / "rollouts.parquet"
    table = pq.read_table(path).to_pylist()
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in table:
        groups[row["prompt_id"]].append(row)
    print(f"{path}: {len(table)} responses in {len(groups)} groups")
    print(f"{'prompt':<8} {'n':>2} {'lengths':<24} {'chunks':<14} {'mean logprob':>12}  first tokens")
    for prompt_id, rows in sorted(groups.items()):
        rows.sort(key=lambda r: r["response_index"])
        lengths = ",".join(str(r["length"]) for r in rows)
        chunks = ",".join(str(r["num_chunks"]) for r in rows)
        logprobs = [lp for r in rows for lp in r["logprobs"]]
        mean_lp = sum(logprobs) / max(len(logprobs), 1)
        print(f"{prompt_id:<8} {len(rows):>2} {lengths:<24} {chunks:<14} {mean_lp:>12.3f}  {rows[0]['token_ids'][:6]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/demo"))
