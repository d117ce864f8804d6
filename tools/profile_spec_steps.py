#!/usr/bin/env python
"""Profile T(B, gamma): one engine step's time with B sequences in decode, each carrying gamma draft
tokens, for the adaptive draft depth policy (seerd/drafts/policy.py).

Runs one in-process vLLM engine with seerd's engine settings and a drafter that proposes exactly
gamma tokens for every request (the last token repeated: what is accepted does not change the
cost of verifying). Each (B, gamma) cell is the median of `--steps` timed steps after `--warmup`
steps. Also measures seerd's own drafting time per request (SuffixIndex.propose on a group of
`--siblings` responses), which the policy adds per drafted request.

On this CPU:   python tools/profile_spec_steps.py --model examples/motif_model/weights \
                   --out seerd/drafts/profiles/cpu-motif-llama.json
On a GPU node: the same command with the job's model and `--engine-arg` settings of the rollout
(tensor parallelism, dtype); point `seerd run --spec-profile` at the file it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORCED_DEPTH = {"gamma": 0}


class ForcedDepthDrafter:
    """Drafts exactly FORCED_DEPTH["gamma"] tokens for every request that sampled this step."""

    def __init__(self, vllm_config) -> None:  # noqa: ANN001
        self.vllm_config = vllm_config

    def load_model(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        return None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):  # noqa: ANN001, ANN201
        gamma = FORCED_DEPTH["gamma"]
        return [[int(s[-1])] * gamma if s and gamma else [] for s in sampled_token_ids]


def drafting_seconds_per_request(siblings: int, length: int, repeats: int = 2000) -> float:
    from seerd.drafts.index import SuffixIndex

    rng = random.Random(0)
    motifs = [[rng.randrange(500) for _ in range(rng.randint(4, 12))] for _ in range(5)]
    index = SuffixIndex()
    sequences = []
    for s in range(siblings + 1):
        seq: list[int] = []
        while len(seq) < length:
            for motif in motifs:
                seq.extend(t if rng.random() > 0.05 else rng.randrange(500) for t in motif)
        sequences.append(seq[:length])
        index.extend(s, seq[:length])
    query = sequences[-1]
    times = []
    for r in range(repeats):
        cut = 64 + (r * 37) % (length - 64)
        started = time.perf_counter()
        index.propose(query[:cut], 8)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--gamma-max", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--siblings", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (`seerd run --dtype`)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON")
    args = parser.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from seerd.settings import EngineConfig, Sampling
    from seerd.worker.vllm_args import engine_args, engine_env_defaults, sampling_params

    engine_env_defaults()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    extra = {k: json.loads(v) for k, _, v in (pair.partition("=") for pair in args.engine_arg)}
    settings = EngineConfig(max_num_seqs=max(batches), dtype=args.dtype, kv_cache_gib=2.0, extra_args=extra)
    config = engine_args(args.model, settings, seed=0)
    config["speculative_config"] = {"method": "custom_class", "model": "__main__.ForcedDepthDrafter",
                                    "num_speculative_tokens": args.gamma_max}
    llm = LLMEngine.from_engine_args(EngineArgs(**config))
    rng = random.Random(0)
    vocab = 400
    rows = []
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        FORCED_DEPTH["gamma"] = 0
        for i, rid in enumerate(ids):
            prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_len)]
            # A rollout chunk's own parameters: seeded, the sampled token's logprob returned (both
            # cost per step: per-request generators, logprobs of every verified position).
            llm.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                            sampling_params(100_000, Sampling(temperature=1.0, ignore_eos=True, seed=i)))
        for _ in range(3):  # prefill, then decode steps
            llm.step()
        row = []
        for gamma in range(args.gamma_max + 1):
            FORCED_DEPTH["gamma"] = gamma
            timings = []
            for step in range(args.warmup + args.steps):
                started = time.perf_counter()
                llm.step()
                if step >= args.warmup:
                    timings.append(time.perf_counter() - started)
            row.append(statistics.median(timings))
        llm.abort_request(ids)
        FORCED_DEPTH["gamma"] = 0
        while llm.has_unfinished_requests():
            llm.step()
        rows.append(row)
        print(f"B={batch:3d} " + " ".join(f"{t * 1e3:7.2f}" for t in row) + "  ms (gamma 0..)", flush=True)
    draft_s = drafting_seconds_per_request(args.siblings, 1000)
    print(f"seerd drafting: {draft_s * 1e6:.1f} us per request per step (median)")
    from seerd.drafts.policy import StepTimeModel

    model = StepTimeModel(tuple(batches), tuple(tuple(r) for r in rows), draft_s,
                          source=f"tools/profile_spec_steps.py --model {Path(args.model).name} "
                                 f"on {os.uname().nodename} at {time.strftime('%Y-%m-%d %H:%M')}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(model.to_json() + "\n")
    print(f"wrote {args.out}")
    core = getattr(llm, "engine_core", None)
    if core is not None:
        core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
