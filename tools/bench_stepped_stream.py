#!/usr/bin/env python
"""What streaming a request costs the stepped engine (a seerd worker's default on the CPU).

A request that runs on past its chunk (in-place continuation) must show its tokens while it
runs, so the worker can cut chunks from it; vLLM then builds an output object per request per
output. One engine, the same batch (64 requests x 384 tokens, EOS ignored, temperature 1) three
ways, alternated: final-only (one output at the end), streamed every step, and streamed every
`seerd.worker.engine.STREAM_EVERY_TOKENS` tokens (what the worker does); prints the median
tokens/s of each and the ratios.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_stepped_stream.py MODEL_DIR [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from seerd.worker import engine as engine_module
from seerd.worker.engine import SteppedEngine

MODES = {"final-only": (False, 1), "every step": (True, 1), "every 16": (True, engine_module.STREAM_EVERY_TOKENS)}


async def batch(engine: SteppedEngine, stream: bool, every: int, tag: str, n: int = 64, tokens: int = 384) -> float:
    engine_module.STREAM_EVERY_TOKENS = every  # read by SteppedEngine.open
    started = time.perf_counter()
    streams = [engine.open(f"{tag}-{i}", [5 + i % 400, 6, 7, 8, 9, 10], tokens,
                           {"temperature": 1.0, "ignore_eos": True, "seed": i}, stream=stream) for i in range(n)]
    for s in streams:
        await s.until(tokens)
    return n * tokens / (time.perf_counter() - started)


async def main(model: str, repeats: int) -> None:
    engine = SteppedEngine.start(model, {"kv_cache_gib": 0.5, "max_num_seqs": 64, "dtype": "float32"}, 0)
    await batch(engine, False, 1, "warm")
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(repeats):
        order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
        for mode in order:
            rates[mode].append(await batch(engine, *MODES[mode], f"{mode}-{rep}"))
    base = statistics.median(rates["final-only"])
    print(f"{'mode':<12}{'median tok/s':>14}{'x final-only':>14}  runs")
    for mode, runs in rates.items():
        med = statistics.median(runs)
        print(f"{mode:<12}{med:>14.0f}{med / base:>14.3f}  {', '.join(f'{x:.0f}' for x in runs)}")
    engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.repeats))
