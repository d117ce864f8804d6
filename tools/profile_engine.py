#!/usr/bin/env python
"""Measure a vLLM engine's step times and write the simulator's profile for it.

    .venv/bin/python tools/profile_engine.py [--model DIR] [--out seerd/sim/profiles/cpu-tiny.json]

The engine is the one a seerd worker runs (same `engine_args`, `LLMEngine` stepped in this
process, OMP_NUM_THREADS=1). For batches B and prompt lengths P it adds B requests of P tokens
(ignore_eos, so they decode exactly `--decode` tokens), times the first step (the prefill of
B x P tokens) and every decode step after it, and fits by least squares:
    decode step  T(B, C) = a + b * B + c * C     (C: context tokens in the batch)
    prefill      P(p)    = f + g * p             (p: new tokens prefilled in the step)
Medians of repeated steps go into the fit; the residuals are written beside the constants.
On a GPU, run the same script against the production model to get a profile of that engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model dir (default: the tiny model, made in a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "seerd/sim/profiles/cpu-tiny.json")
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--prompts", default="32,256,768")
    parser.add_argument("--decode", type=int, default=48, help="decode steps per measurement")
    parser.add_argument("--dtype", default="float32",
                        help="the dtype the profiled runs use (`seerd run --dtype`; its auto is float32 for a float32 "
                             "checkpoint on CPU workers)")
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from seerd.settings import EngineConfig, Sampling
    from seerd.worker.vllm_args import engine_args, engine_env_defaults, sampling_params

    engine_env_defaults()
    model = args.model
    if model is None:
        from tests.fixtures.make_tiny_model import make_tiny_model

        model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    batches = [int(x) for x in args.batches.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    engine = engine_args(str(model), EngineConfig(kv_cache_gib=0.25, max_num_seqs=max(batches), max_model_len=1024,
                                                  dtype=args.dtype), seed=0)
    llm = LLMEngine.from_engine_args(EngineArgs(**engine))
    vocab = min(1000, json.loads((Path(model) / "config.json").read_text())["vocab_size"])  # prompt token ids below it
    decode_rows, prefill_rows = [], []
    counter = 0
    for prompt_len in prompts:
        for batch in batches:
            for _ in range(2):  # a warm-up pass, then the measured one
                params = sampling_params(args.decode, Sampling(temperature=1.0, ignore_eos=True, seed=counter))
                for _ in range(batch):
                    counter += 1
                    # distinct prompts: the prefix cache must not serve them
                    tokens = [(counter * 7919 + i) % (vocab - 5) + 4 for i in range(prompt_len)]
                    llm.add_request(f"r{counter}", TokensPrompt(prompt_token_ids=tokens), params)
                times = []
                while llm.has_unfinished_requests():
                    started = time.perf_counter()
                    llm.step()
                    times.append(time.perf_counter() - started)
            # Unchunked prefill admits whole prompts up to max_num_batched_tokens per step.
            per_step = max(1, engine["max_num_batched_tokens"] // prompt_len)
            prefill_steps = -(-batch // per_step)
            prefill_rows.append((batch * prompt_len, sum(times[:prefill_steps])))
            steps = times[prefill_steps:-1]  # decode steps with the whole batch present
            if steps:
                context = batch * (prompt_len + 1 + len(steps) / 2)  # mean context over these steps
                decode_rows.append((batch, context, statistics.median(steps)))
            print(f"P={prompt_len:4d} B={batch:3d}: prefill {1e3 * prefill_rows[-1][1]:7.2f} ms, "
                  f"decode median {1e3 * statistics.median(steps):6.2f} ms over {len(steps)} steps", flush=True)
    x = np.array([[1.0, b, c] for b, c, _ in decode_rows])
    y = np.array([t for _, _, t in decode_rows])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    decode_fit = x @ np.array([a, b, c])
    px = np.array([[1.0, p] for p, _ in prefill_rows])
    py = np.array([t for _, t in prefill_rows])
    (f, g), *_ = np.linalg.lstsq(px, py, rcond=None)
    profile = {
        "name": args.out.stem,
        "engine": "vLLM LLMEngine (stepped), OMP_NUM_THREADS=1, dtype " + engine["dtype"],
        "model": str(model.name if args.model is None else model),
        "measured": time.strftime("%Y-%m-%d"),
        "decode": {"a": float(a), "b": float(b), "c": float(c),
                   "max_abs_residual_ms": float(1e3 * np.max(np.abs(decode_fit - y)))},
        "prefill": {"f": float(f), "g": float(g),
                    "max_abs_residual_ms": float(1e3 * np.max(np.abs(px @ np.array([f, g]) - py)))},
        "points": {"decode": decode_rows, "prefill": prefill_rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"decode T = {1e3 * a:.3f} ms + {1e3 * b:.4f} ms x B + {1e6 * c:.4f} us x C; "
          f"prefill {1e3 * f:.2f} ms + {1e3 * g:.4f} ms/token; wrote {args.out}")


if __name__ == "__main__":
    main()
