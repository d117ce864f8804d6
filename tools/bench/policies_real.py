#!/usr/bin/env python
"""Scheduling policies on real engines: `seerd run --workers 2` with group, divided and seer.

The workload fixes every response's length with `target_lengths` (workers end a response there,
as if the model had emitted EOS), shaped like the simulator's `qwen2-vl-72b` preset and scaled
down to run in minutes on 2 CPU cores:
  - per group a base length drawn lognormal across prompts (heavy tail; sigma --sigma), the
    paper's mean/max ratio kept (7615 / 40960 = 0.19: mean ~0.19 x --max-tokens before clipping);
  - each response = base x lognormal(0, --within-sigma): lengths strongly correlated in a group;
  - clipped to [8, --max-tokens]; group size --n (the paper's 16 is too many here; 8 by default);
  - `ignore_eos`, so that every response ends exactly at its target (finish reason length_target).
The KV cache of each engine is made small (--kv-cache-mib) so that it binds: seer and divided
admit chunks only while their KV fits, group leaves vLLM to queue and preempt.

Per run, from the run's database: the clock runs from the first lease to the last finished
response (engine start-up excluded; --wait-for-workers, so both engines are up at the first
lease); throughput = output tokens / that time; tail time = time from when 90% of requests had
finished to the end. Policies run interleaved (group, divided, seer, group, ...) so that drift on
this noisy machine hits them alike; the table shows medians and each run's figure.

    python tools/bench/policies_real.py [--groups 48] [--n 8] [--repeats 3] [--trace-out trace.jsonl] [--with-sim]

`--trace-out FILE` writes the workload as JSONL, one line per request: {"group", "length",
"prompt_len"}, for `seerd sim --trace FILE`. `--with-sim` also runs `seerd sim` on that trace
(preset --sim-preset, default `cpu-tiny`, the simulator's profile of these CPU engines; 2
instances, the same chunk size, KV tokens and sequences per engine as measured) and prints its
ratios to group beside the measured ones.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import engine_env, print_json  # noqa: E402
POLICIES = ("group", "divided", "seer")
PAPER_MEAN_OVER_MAX = 7615 / 40960  # qwen2-vl-72b: mean / max generation length
MIN_LENGTH = 8


def make_workload(groups: int, n: int, max_tokens: int, sigma: float, within_sigma: float,
                  seed: int) -> list[dict]:
    """One prompt row per group, with its responses' target lengths (see the module docstring)."""
    rng = random.Random(seed)
    mean = PAPER_MEAN_OVER_MAX * max_tokens
    rows = []
    for g in range(groups):
        base = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)  # mean `mean` before clipping
        targets = [int(min(max_tokens, max(MIN_LENGTH, round(base * rng.lognormvariate(0.0, within_sigma)))))
                   for _ in range(n)]
        prompt = [rng.randrange(4, 1000) for _ in range(rng.randrange(16, 64))]
        # ignore_eos: the random model's EOS (~1 in 1000 tokens) would cut the long responses short.
        rows.append({"id": f"g{g}", "prompt_token_ids": prompt, "n": n, "max_tokens": max_tokens,
                     "target_lengths": targets, "ignore_eos": True})
    return rows


def write_trace(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as handle:
        for g, row in enumerate(rows):
            for length in row["target_lengths"]:
                handle.write(json.dumps({"group": g, "length": length,
                                         "prompt_len": len(row["prompt_token_ids"])}) + "\n")


def ratio(value: float, base: float) -> float:
    return value / base if base > 0 else math.nan  # a tiny workload can have no tail at all


def simulate(trace: Path, policies: list[str], *, preset: str, chunk_tokens: int, kv_tokens: int,
             max_num_seqs: int) -> dict[str, dict]:
    """`seerd sim` on the trace: per policy, its throughput and tail time (see the issue's --json)."""
    cmd = [sys.executable, "-m", "seerd.cli.main", "sim", "--preset", preset, "--trace", str(trace),
           "--instances", "2", "--chunk-tokens", str(chunk_tokens), "--kv-tokens", str(kv_tokens),
           "--max-num-seqs", str(max_num_seqs), "--policies", ",".join(policies), "--json"]
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"seerd sim failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["policies"]


def run_policy(model: str, prompts: Path, policy: str, args: argparse.Namespace, work: Path, seed: int) -> dict:
    run_dir = work / f"run-{policy}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", model,
           "--run-dir", str(run_dir), "--workers", "2", "--wait-for-workers", "--policy", policy,
           "--chunk-tokens", str(args.chunk_tokens), "--seed", str(seed), "--temperature", "1.0",
           "--kv-cache-gib", str(args.kv_cache_mib / 1024), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--dtype", "float32", "--no-progress"]
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"seerd run --policy {policy} failed ({run_dir}): {done.stderr[-2000:]}")
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = db.execute("select min(leased_at) from chunks").fetchone()[0]
        finishes = sorted(t for (t,) in db.execute("select finished_at from requests"))
        tokens = db.execute("select sum(generated_tokens) from requests").fetchone()[0]
        reasons = dict(db.execute("select finish_reason, count(*) from requests group by finish_reason").fetchall())
        kv = db.execute("select min(kv_capacity_tokens) from workers").fetchone()[0]
        chunks = db.execute("select count(*) from chunks").fetchone()[0]
    end = finishes[-1]
    p90 = finishes[math.ceil(0.9 * len(finishes)) - 1]  # when 90% of the requests had finished
    return {"tokens": tokens, "seconds": end - first, "tail_s": end - p90, "finish_reasons": reasons,
            "kv_capacity_tokens": kv, "chunks": chunks, "run_dir": str(run_dir)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model dir (default: the tiny model, made in a temp dir)")
    parser.add_argument("--groups", type=int, default=48)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of lengths across prompts")
    parser.add_argument("--within-sigma", type=float, default=0.25,
                        help="lognormal sigma of lengths within a group (small: strongly correlated)")
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-mib", type=float, default=5.0,
                        help="KV cache per engine (tiny model: 1 KiB per token in bf16)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="workload seed; sampling seeds vary per repeat")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--trace-out", type=Path, help="write the workload as a JSONL trace for `seerd sim`")
    parser.add_argument("--with-sim", action="store_true",
                        help="also print the simulator's prediction for the same trace (ratios to group)")
    parser.add_argument("--sim-preset", default="cpu-tiny", help="the simulator's cost model for --with-sim")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if "group" not in policies:
        parser.error("--policies must include group (the ratios are to it)")
    work = Path(tempfile.mkdtemp(prefix="seerd-bench-policies-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from tests.fixtures.make_tiny_model import make_tiny_model
        model = str(make_tiny_model(work / "model"))
    rows = make_workload(args.groups, args.n, args.max_tokens, args.sigma, args.within_sigma, args.seed)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = args.trace_out or work / "trace.jsonl"
    write_trace(trace, rows)
    samples: dict[str, list[dict]] = {p: [] for p in policies}
    for repeat in range(args.repeats):
        for policy in policies:
            result = run_policy(model, prompts, policy, args, work, seed=args.seed + repeat)
            result["tok_s"] = result["tokens"] / result["seconds"]
            samples[policy].append(result)
            print(f"# repeat {repeat + 1} {policy}: {result['tokens']} tokens in {result['seconds']:.1f}s = "
                  f"{result['tok_s']:.0f} tok/s, tail {result['tail_s']:.1f}s, {result['chunks']} chunks",
                  file=sys.stderr, flush=True)
    base_tok_s = statistics.median(r["tok_s"] for r in samples["group"])
    base_tail = statistics.median(r["tail_s"] for r in samples["group"])
    table = []
    for policy, runs in samples.items():
        tok_s = statistics.median(r["tok_s"] for r in runs)
        tail = statistics.median(r["tail_s"] for r in runs)
        table.append({"policy": policy, "median_tok_s": tok_s, "x_group": tok_s / base_tok_s,
                      "median_tail_s": tail, "tail_x_group": ratio(tail, base_tail),
                      "median_total_s": statistics.median(r["seconds"] for r in runs),
                      "samples_tok_s": [round(r["tok_s"]) for r in runs],
                      "samples_tail_s": [round(r["tail_s"], 1) for r in runs]})
    kv = samples["group"][0]["kv_capacity_tokens"]
    if args.with_sim:
        predicted = simulate(trace, policies, preset=args.sim_preset, chunk_tokens=args.chunk_tokens, kv_tokens=kv,
                             max_num_seqs=args.max_num_seqs)
        for row in table:
            sim = predicted[row["policy"]]
            row["sim_x_group"] = ratio(sim["throughput_tok_s"], predicted["group"]["throughput_tok_s"])
            row["sim_tail_x_group"] = ratio(sim["tail_time_s"], predicted["group"]["tail_time_s"])
    lengths = sorted(t for r in rows for t in r["target_lengths"])
    if args.json:
        print_json({"args": {k: str(v) for k, v in vars(args).items()}, "kv_capacity_tokens": kv,
                    "table": table}, indent=1)
        return 0
    print(f"{args.groups} groups x n={args.n}: {len(lengths)} requests, {sum(lengths)} tokens, length mean "
          f"{statistics.mean(lengths):.0f} median {lengths[len(lengths) // 2]} max {lengths[-1]}; chunk "
          f"{args.chunk_tokens}; KV {kv} tokens and {args.max_num_seqs} seqs per engine; 2 engines; "
          f"{args.repeats} repeats")
    sim_head = f" {'sim x group':>11} {'sim tail x':>10}" if args.with_sim else ""
    print(f"{'policy':<8} {'tok/s':>7} {'x group':>8} {'total s':>8} {'tail s':>7} {'tail x group':>13}{sim_head}  "
          f"samples tok/s | tail s")
    for row in table:
        sim_cols = (f" {row['sim_x_group']:>11.2f} {row['sim_tail_x_group']:>10.2f}" if args.with_sim else "")
        print(f"{row['policy']:<8} {row['median_tok_s']:>7.0f} {row['x_group']:>8.2f} {row['median_total_s']:>8.1f} "
              f"{row['median_tail_s']:>7.1f} {row['tail_x_group']:>13.2f}{sim_cols}  {row['samples_tok_s']} | "
              f"{row['samples_tail_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
