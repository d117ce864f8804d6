#!/usr/bin/env python
"""What vLLM's speculative path costs a step when nothing is drafted.

`--spec grouped|request` starts every engine with a `speculative_config` (seerd's drafter as a
custom proposer); when the drafter proposes nothing (no suffix match, or the adaptive depth is 0)
the step still runs vLLM's speculative machinery. This measures that floor: one engine with
seerd's engine settings and no speculative config, against the same engine with a custom
proposer that always returns no drafts, at a few batch sizes, each configuration started in its
own process, alternated (A B A B ...) so drift on a noisy machine hits both alike. Prints the
median step time per configuration and batch and the ratio spec/plain.

    python tools/bench/spec_overhead.py [--model examples/motif_model/weights] [--batches 1,16,64]
                                        [--rounds 2] [--steps 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import MOTIF_MODEL, print_json  # noqa: E402


# The custom proposer: profile_spec_steps' forced-depth drafter, left at depth 0 (it never drafts).
NO_DRAFTS = "tools.profile_spec_steps.ForcedDepthDrafter"


def measure(model: str, spec: bool, batches: list[int], steps: int, warmup: int, dtype: str) -> dict[int, float]:
    """Median step seconds per batch size, in this process (one engine)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from seerd.settings import EngineConfig, Sampling
    from seerd.worker.vllm_args import engine_args, engine_env_defaults, sampling_params

    engine_env_defaults()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    config = engine_args(model, EngineConfig(max_num_seqs=max(batches), dtype=dtype, kv_cache_gib=1.0), seed=0)
    if spec:
        config["speculative_config"] = {"method": "custom_class", "model": NO_DRAFTS,
                                        "num_speculative_tokens": 4}
    llm = LLMEngine.from_engine_args(EngineArgs(**config))
    rng = random.Random(0)
    medians = {}
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            prompt = [rng.randrange(4, 400) for _ in range(64)]
            llm.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                            sampling_params(100_000, Sampling(temperature=1.0, ignore_eos=True)))
        timings = []
        for step in range(3 + warmup + steps):  # the first steps prefill
            started = time.perf_counter()
            llm.step()
            if step >= 3 + warmup:
                timings.append(time.perf_counter() - started)
        medians[batch] = statistics.median(timings)
        llm.abort_request(ids)
        while llm.has_unfinished_requests():
            llm.step()
    core = getattr(llm, "engine_core", None)
    if core is not None:
        core.shutdown()
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MOTIF_MODEL))
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2, help="engine starts per configuration, alternated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", choices=("plain", "spec"), help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(measure(args.model, args.one == "spec", batches, args.steps, args.warmup, args.dtype)))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=str(REPO))
    samples: dict[str, dict[int, list[float]]] = {"plain": {b: [] for b in batches}, "spec": {b: [] for b in batches}}
    for round_ in range(args.rounds):
        for name in ("plain", "spec") if round_ % 2 == 0 else ("spec", "plain"):
            done = subprocess.run([sys.executable, __file__, "--one", name, "--model", args.model, "--batches",
                                   args.batches, "--steps", str(args.steps), "--warmup", str(args.warmup),
                                   "--dtype", args.dtype], env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for batch in batches:
                samples[name][batch].append(result[str(batch)])
            print(f"# round {round_ + 1} {name}: " + ", ".join(f"B={b} {1e3 * result[str(b)]:.2f} ms" for b in batches),
                  file=sys.stderr, flush=True)
    table = {b: {"plain_ms": 1e3 * statistics.median(samples["plain"][b]),
                 "spec_ms": 1e3 * statistics.median(samples["spec"][b]),
                 "ratios": [s / p for s, p in zip(samples["spec"][b], samples["plain"][b])]} for b in batches}
    if args.json:
        print_json({"model": args.model, "rounds": args.rounds, "batches": table}, indent=1)
        return 0
    print(f"{'batch':>5} {'plain ms':>9} {'spec, no drafts ms':>19} {'spec / plain':>12}  per round")
    for b, row in table.items():
        print(f"{b:>5} {row['plain_ms']:>9.2f} {row['spec_ms']:>19.2f} {statistics.median(row['ratios']):>12.2f}  "
              f"{[round(r, 2) for r in row['ratios']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
