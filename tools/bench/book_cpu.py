"""CPU per chunk of the coordinator's lease book alone: what the state thread spends on each chunk
(its lease and its report, committed to SQLite with synchronous FULL), without HTTP or workers.

One process, one simulated worker calling `LeaseBook.lease(wanted=B)` and `report_many` for all
it got, `--rounds` times after a warm-up; prints the median over `--repeats` of the process CPU
time per chunk. `--in-place`: as a worker with in-place continuation does instead, a worker
holding 64 running requests reports B of them per call as running on (`report_and_continue`),
and the grants that continue them go back into its running set, with new requests for the
slots of those that finished (the report's `wanted`; with `--max-tokens` below the chunk every
report finishes its request, and without them the running set drained after 32 calls). It measures the checkout it is
run from (the repository root goes first on the import path), so a change is measured by running
it in both checkouts, alternated:

    .venv/bin/python tools/bench/book_cpu.py [--batch 8] [--chunk-tokens 256] [--prompt-tokens 512] [--in-place]
                                         [--policy divided|seer|...] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.bench.runner import print_json  # noqa: E402

from seerd.book.book import LeaseBook  # noqa: E402
from seerd.config import RunConfig  # noqa: E402
from seerd.coordinator.create import create_rollout  # noqa: E402
from seerd.db import make_engine, make_sessionmaker  # noqa: E402
from seerd.db.migrate import upgrade  # noqa: E402
from seerd.io.prompts import PromptRow  # noqa: E402
from seerd.protocol import ChunkReport  # noqa: E402
from seerd.scheduler import make_policy  # noqa: E402

VOCAB = 1000


IN_PLACE_RUNNING = 64  # requests the in-place worker keeps running


def cpu_ms_per_chunk(batch: int, chunk_tokens: int, prompt_tokens: int, rounds: int, groups: int,
                     in_place: bool = False, policy: str = "divided", max_tokens: int = 1_000_000) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(Path(tmp) / "state.db", synchronous="FULL")
        upgrade(engine)
        sessions = make_sessionmaker(engine)
        config = RunConfig(input_path="bench", model_path="model", policy=policy, chunk_tokens=chunk_tokens,
                           lease_ttl_s=60)
        rows = [PromptRow(f"p{g}", tuple((g * 7 + i) % VOCAB for i in range(prompt_tokens)), 8, max_tokens, {}, g + 1)
                for g in range(groups)]
        with sessions.begin() as session:
            rollout_id = create_rollout(session, config, rows, input_sha256="0" * 64, now=time.time())
        book = LeaseBook(sessions, rollout_id, make_policy(policy), chunk_tokens=chunk_tokens, lease_ttl_s=60,
                         seed=0, vocab_size=VOCAB, in_place=in_place)
        book.load(time.time())
        worker = book.register(rank=0, address="bench", max_chunks=IN_PLACE_RUNNING if in_place else batch,
                               kv_capacity_tokens=10**12, worker_id="bench", now=time.time()).id
        running = book.lease(worker, IN_PLACE_RUNNING, time.time()) if in_place else []

        def continue_in_place() -> int:
            reported, running[:] = running[:batch], running[batch:]
            _, grants = book.report_and_continue(worker, [
                ChunkReport(g.chunk_id, g.epoch, [7] * g.max_tokens, [-1.0] * g.max_tokens, "length", running_on=True)
                for g in reported], time.time(), wanted=len(reported))  # finished ones' slots refill too
            running.extend(grants)
            return len(reported)

        def lease_then_report() -> int:
            grants = book.lease(worker, batch, time.time())
            book.report_many(worker, [ChunkReport(g.chunk_id, g.epoch, [7] * g.max_tokens, [-1.0] * g.max_tokens,
                                                  "length") for g in grants], time.time())
            return len(grants)

        cycle = continue_in_place if in_place else lease_then_report
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
    parser.add_argument("--in-place", action="store_true", help="reports continued in place (report_and_continue)")
    parser.add_argument("--policy", default="divided", help="the scheduling policy (divided, seer, ...)")
    parser.add_argument("--max-tokens", type=int, default=1_000_000,
                        help="each request's length: at most --chunk-tokens and every chunk finishes its request "
                             "(what a request's first lease and last report cost); the default never finishes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    samples = [cpu_ms_per_chunk(args.batch, args.chunk_tokens, args.prompt_tokens, args.rounds, args.groups,
                                args.in_place, args.policy, args.max_tokens) for _ in range(args.repeats)]
    if args.json:
        print_json({"cpu_ms_per_chunk": statistics.median(samples), "samples": samples})
    else:
        print(f"{args.policy} B={args.batch} chunk {args.chunk_tokens} prompt {args.prompt_tokens}"
              f"{' in place' if args.in_place else ''}: "
              f"{statistics.median(samples):.3f} ms CPU per chunk (median of {', '.join(f'{s:.3f}' for s in samples)})")


if __name__ == "__main__":
    main()
