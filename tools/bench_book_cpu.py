"""CPU per chunk of the coordinator's lease book alone: what the state thread spends on each chunk
(its lease and its report, committed to SQLite with synchronous FULL), without HTTP or workers.

One process, one simulated worker calling `LeaseBook.lease(wanted=B)` and `report_many` for all
it got, `--rounds` times after a warm-up; prints the median over `--repeats` of the process CPU
time per chunk. It measures the checkout it is run from (the repository root goes first on the
import path), so a change is measured by running it in both checkouts, alternated:

    .venv/bin/python tools/bench_book_cpu.py [--batch 8] [--chunk-tokens 256] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seerd.config import RunConfig  # noqa: E402
from seerd.coordinator.book import LeaseBook  # noqa: E402
from seerd.coordinator.create import create_rollout  # noqa: E402
from seerd.db import make_engine, make_sessionmaker  # noqa: E402
from seerd.db.migrate import upgrade  # noqa: E402
from seerd.io.prompts import PromptRow  # noqa: E402
from seerd.protocol import ChunkReport  # noqa: E402
from seerd.scheduler import make_policy  # noqa: E402

VOCAB = 1000


def cpu_ms_per_chunk(batch: int, chunk_tokens: int, prompt_tokens: int, rounds: int, groups: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(Path(tmp) / "state.db", synchronous="FULL")
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        config = RunConfig(input_path="bench", model_path="model", policy="divided", chunk_tokens=chunk_tokens,
                           lease_ttl_s=60)
        rows = [PromptRow(f"p{g}", tuple((g * 7 + i) % VOCAB for i in range(prompt_tokens)), 8, 1_000_000, {}, g + 1)
                for g in range(groups)]
        with sessions.begin() as session:
            rollout_id = create_rollout(session, config, rows, input_sha256="0" * 64, now=time.time())
        book = LeaseBook(sessions, rollout_id, make_policy("divided"), chunk_tokens=chunk_tokens, lease_ttl_s=60,
                         seed=0, vocab_size=VOCAB)
        book.load(time.time())
        worker = book.register(rank=0, address="bench", max_chunks=batch, kv_capacity_tokens=10**12,
                               worker_id="bench", now=time.time()).id

        def cycle() -> int:
            grants = book.lease(worker, batch, time.time())
            book.report_many(worker, [ChunkReport(g.chunk_id, g.epoch, [7] * g.max_tokens, [-1.0] * g.max_tokens,
                                                  "length") for g in grants], time.time())
            return len(grants)

        for _ in range(20):
            cycle()
        started, chunks = time.process_time(), 0
        for _ in range(rounds):
            chunks += cycle()
        spent = time.process_time() - started
        engine.dispose()
        return spent / chunks * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="chunks per lease and report call")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--groups", type=int, default=500, help="prompt groups of 8 requests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    samples = [cpu_ms_per_chunk(args.batch, args.chunk_tokens, args.prompt_tokens, args.rounds, args.groups)
               for _ in range(args.repeats)]
    if args.json:
        print(json.dumps({"cpu_ms_per_chunk": statistics.median(samples), "samples": samples}))
    else:
        print(f"B={args.batch} chunk {args.chunk_tokens} prompt {args.prompt_tokens}: "
              f"{statistics.median(samples):.3f} ms CPU per chunk (median of {', '.join(f'{s:.3f}' for s in samples)})")


if __name__ == "__main__":
    main()
