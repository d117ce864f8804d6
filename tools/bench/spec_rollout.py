#!/usr/bin/env python
"""End to end: rollout throughput with speculative decoding modes against `--spec off`, on real engines.

`seerd run --workers 2 --policy seer` of the trained motif model (examples/motif_model/weights) on
prompts of its own corpus at temperature 1.0, once per mode and repeat, modes interleaved
(off, grouped, ..., off, grouped, ...) so that drift on this noisy machine hits them alike.

Per run, from the run's database: the clock runs from the first lease to the last finished
response (engine start-up excluded; --wait-for-workers); throughput = output tokens / that time;
the body is the time until 90% of the requests had finished and the tail the rest, each with its
own tokens/s (tokens of chunks finished in that phase / its duration); acceptance from the
workers' drafter totals: tokens accepted / drafted, and tokens per step of a request that was
drafted for (1 + accepted / drafted request-steps; the bonus token included).

Sampling is seeded per chunk, but speculative decoding consumes randomness differently, so the
modes sample different (equally distributed) responses: compare tokens/s, not seconds.

    python tools/bench/spec_rollout.py [--groups 24] [--n 8] [--repeats 3] [--modes off,grouped,request,ngram]
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import MOTIF_MODEL, engine_env, print_json  # noqa: E402
MODEL = MOTIF_MODEL


def run_mode(mode: str, prompts: Path, args: argparse.Namespace, work: Path, seed: int) -> dict:
    run_dir = work / f"run-{mode}-{time.time_ns()}"
    spec_mode, _, variant = mode.partition(":")
    cmd = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", args.model,
           "--run-dir", str(run_dir), "--workers", "2", "--wait-for-workers", "--policy", "seer",
           "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--chunk-tokens", str(args.chunk_tokens),
           "--seed", str(seed), "--temperature", "1.0", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-gib", str(args.kv_cache_gib), "--dtype", "float32", "--spec", spec_mode,
           "--no-progress", "--kv-pool", args.kv_pool]
    if variant == "fixed":
        cmd.append("--spec-fixed-depth")
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"seerd run --spec {mode} failed ({run_dir}): {done.stderr[-2000:]}")
    return measure(run_dir)


def measure(run_dir: Path) -> dict:
    from seerd.db import ChunkStatus

    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = db.execute("select min(leased_at) from chunks").fetchone()[0]
        finishes = sorted(t for (t,) in db.execute("select finished_at from requests"))
        tokens = db.execute("select sum(generated_tokens) from requests").fetchone()[0]
        chunk_ends = db.execute("select finished_at, num_tokens from chunks where status = ?",
                                (ChunkStatus.DONE.value,)).fetchall()
        stats = [json.loads(s) for (s,) in db.execute("select stats_json from workers where stats_json is not null")]
        load_json = db.execute("select data_json from events where kind='coordinator_load'").fetchone()[0]
        load = json.loads(load_json)
    end = finishes[-1]
    p90 = finishes[math.ceil(0.9 * len(finishes)) - 1]
    body_tokens = sum(n for t, n in chunk_ends if t <= p90)
    spec = [s["spec"] for s in stats if s.get("spec")]
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    drafted_rows = sum(s["drafted_rows"] for s in spec)
    return {"tokens": tokens, "seconds": end - first, "tok_s": tokens / (end - first),
            "body_s": p90 - first, "tail_s": end - p90,
            "body_tok_s": body_tokens / max(p90 - first, 1e-9),
            "tail_tok_s": (tokens - body_tokens) / max(end - p90, 1e-9),
            "drafted": drafted, "accepted": accepted, "drafted_rows": drafted_rows,
            "draft_us": statistics.median(s["median_us_per_row"] for s in spec) if spec else None,
            # CPU time beside the engines: the drafters' own (on the stepping threads), the draft
            # sync threads', and the coordinator's share of a core while generating.
            "propose_s": sum(s["propose_s"] for s in spec),
            "sync_cpu_s": sum(s.get("sync_cpu_s", 0.0) for s in spec),
            "coordinator_cpu_share": load["cpu_share"],
            "by_batch": by_batch([s["engine"] for s in stats if s.get("engine")]),
            "run_dir": str(run_dir)}


def by_batch(engines: list[dict]) -> dict[int, list]:
    """Both engines' steps, seconds and generated tokens per batch-size bucket (EngineCounters)."""
    total: dict[int, list] = {}
    for engine in engines:
        for bucket, (steps, seconds, tokens) in engine.get("by_batch", {}).items():
            cell = total.setdefault(int(bucket), [0, 0.0, 0])
            cell[0] += steps
            cell[1] += seconds
            cell[2] += tokens
    return total


def print_speed_by_batch(samples: dict[str, list[dict]]) -> None:
    """Tokens per second of engine step time per batch size, all repeats pooled, and each mode's
    ratio to off: the engine's speed with the same batch, whatever responses were sampled."""
    pooled = {mode: by_batch([{"by_batch": r["by_batch"]} for r in runs]) for mode, runs in samples.items()}
    buckets = sorted({b for cells in pooled.values() for b in cells})
    if not buckets:
        return
    print("\nengine speed by batch size: tok/s of step time (x off), share of the mode's step time")
    print(f"{'batch':<8}" + "".join(f"{mode:>26}" for mode in pooled))
    for bucket in buckets:
        row = f"{f'{bucket}-{2 * bucket - 1}' if bucket > 1 else '1':<8}"
        for mode, cells in pooled.items():
            steps, seconds, tokens = cells.get(bucket, (0, 0.0, 0))
            base = pooled["off"].get(bucket)
            if not seconds:
                row += f"{'-':>26}"
                continue
            speed = tokens / seconds
            ratio = f"{speed / (base[2] / base[1]):.2f}" if base and base[1] else "-"
            share = seconds / sum(c[1] for c in cells.values())
            row += f"{f'{speed:.0f} ({ratio}) {share:.0%}':>26}"
        print(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="off,grouped,request,ngram",
                        help="comma-separated --spec modes; MODE:fixed drafts --spec-depth always (no adaptive depth)")
    parser.add_argument("--kv-pool", default="off", choices=("off", "auto", "mooncake"),
                        help="off by default, as in bench_e2e: the pool's synchronous saves cost every "
                             "mode alike")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if "off" not in modes:
        parser.error("--modes must include off (the ratios are to it)")
    sys.path.insert(0, str(REPO))
    from examples.motif_model.corpus import make_prompts

    work = Path(tempfile.mkdtemp(prefix="seerd-bench-spec-"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(args.groups, seed=args.seed)))
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            result = run_mode(mode, prompts, args, work, seed=args.seed + repeat)
            samples[mode].append(result)
            print(f"# repeat {repeat + 1} {mode}: {result['tokens']} tokens in {result['seconds']:.1f}s = "
                  f"{result['tok_s']:.0f} tok/s; body {result['body_tok_s']:.0f} tok/s, tail "
                  f"{result['tail_s']:.1f}s at {result['tail_tok_s']:.0f} tok/s; drafted {result['drafted']} "
                  f"accepted {result['accepted']}", file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(r[k] for r in runs)
               for k in ("tok_s", "body_tok_s", "tail_tok_s", "tail_s", "propose_s", "sync_cpu_s",
                         "coordinator_cpu_share")}
           for m, runs in samples.items()}
    if args.json:
        print_json({"args": vars(args), "median": med, "samples": samples}, indent=1)
        return 0
    base = med["off"]
    print(f"{args.groups} groups x n={args.n}, max_tokens {args.max_tokens}, chunk {args.chunk_tokens}, 2 engines, "
          f"{args.repeats} repeats (medians; ratios to --spec off)")
    print(f"{'mode':<15} {'tok/s':>6} {'x off':>6} {'body x':>7} {'tail x':>7} {'tail s':>7} {'accept':>7} "
          f"{'tok/step':>8} {'draft us':>8} {'propose s':>9} {'sync s':>6} {'coord':>6}  samples tok/s")
    for mode, runs in samples.items():
        drafted = sum(r["drafted"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        drafted_rows = sum(r["drafted_rows"] for r in runs)
        draft_us = [r["draft_us"] for r in runs if r["draft_us"] is not None]
        acceptance = f"{accepted / drafted:.0%}" if drafted else "-"
        per_step = f"{1 + accepted / max(1, drafted_rows):.2f}" if drafted else "-"
        us = f"{statistics.median(draft_us):.0f}" if draft_us else "-"
        row = med[mode]
        print(f"{mode:<15} {row['tok_s']:>6.0f} {row['tok_s'] / base['tok_s']:>6.2f} "
              f"{row['body_tok_s'] / base['body_tok_s']:>7.2f} {row['tail_tok_s'] / base['tail_tok_s']:>7.2f} "
              f"{row['tail_s']:>7.1f} {acceptance:>7} {per_step:>8} {us:>8} {row['propose_s']:>9.2f} "
              f"{row['sync_cpu_s']:>6.2f} "
              f"{row['coordinator_cpu_share']:>6.1%}  {[round(r['tok_s']) for r in runs]}")
    print_speed_by_batch(samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
