#!/usr/bin/env python
"""Print a run's rollouts: a line per group, then a few responses decoded with the model's tokenizer.

    python tools/show_outputs.py [RUN_DIR] [--decode 3] [--width 100]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq


def model_path(run_dir: Path) -> str | None:
    try:
        with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
            return db.execute("select model_path from rollouts").fetchone()[0]
    except sqlite3.Error:
        return None


def decoder(run_dir: Path):  # noqa: ANN201 - tokens -> text, or None without a tokenizer
    path = model_path(run_dir)
    if path is None:
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a model without a tokenizer: show token ids only
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    half = (width - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", default="runs/demo", type=Path)
    parser.add_argument("--decode", type=int, default=3, help="responses to decode (the longest groups first)")
    parser.add_argument("--width", type=int, default=110)
    args = parser.parse_args(argv)
    path = args.run_dir / "rollouts.parquet"
    table = pq.read_table(path).to_pylist()
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in table:
        groups[row["prompt_id"]].append(row)
    lengths = sorted(r["length"] for r in table)
    print(f"{path}: {len(table)} responses in {len(groups)} groups; lengths median {statistics.median(lengths):.0f}, "
          f"p90 {lengths[int(0.9 * (len(lengths) - 1))]}, max {lengths[-1]}; "
          f"{sum(r['finish_reason'] == 'stop' for r in table)} ended by EOS")
    print(f"{'prompt':<16} {'n':>2} {'lengths':<40} {'chunks':>6} {'mean logprob':>12}")
    for prompt_id, rows in sorted(groups.items(), key=lambda item: -max(r["length"] for r in item[1])):
        rows.sort(key=lambda r: r["response_index"])
        logprobs = [lp for r in rows for lp in r["logprobs"]]
        print(f"{prompt_id:<16} {len(rows):>2} {clip(','.join(str(r['length']) for r in rows), 40):<40} "
              f"{sum(r['num_chunks'] for r in rows):>6} {sum(logprobs) / max(len(logprobs), 1):>12.3f}")
    decode = decoder(args.run_dir)
    if args.decode > 0:
        print()
        longest_groups = sorted(groups.values(), key=lambda rows: -max(r["length"] for r in rows))
        for rows in longest_groups[:args.decode]:
            row = max(rows, key=lambda r: r["length"])
            text = decode(row["token_ids"]) if decode else str(row["token_ids"])
            print(f"{row['prompt_id']} response {row['response_index']} ({row['length']} tokens, "
                  f"{row['finish_reason']}): {clip(text, args.width)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
