#!/usr/bin/env python
"""Local rollout throughput: `seerd run --workers 2` against the same two engines driven directly.

Configurations, each repeated and run side by side in one invocation on the same prompt file:
  vllm-direct   veRL-style: the batch split into two contiguous shards of groups, each shard handed
                whole to an offline `vllm.LLM.generate` (n samples per prompt) in its own process;
                both start together after loading. Throughput = output tokens / makespan.
  seerd-group   `seerd run --policy group` (groups bound round-robin, no chunking).
  seerd-divided `seerd run --policy divided --chunk-tokens K` (chunks continue in place, the default).
  seerd-seer    `seerd run --policy seer --chunk-tokens K` (seerd's default policy).
  seerd-divided-resubmit, seerd-seer-resubmit  the same with `--no-in-place`: every chunk boundary
                stops the request and re-submits it (what seerd did before in-place continuation).
  seerd-div-async  (--with-async) the same on AsyncLLM workers instead of in-process LLMEngine.
For seerd, the time counted is the generation phase read from the run's database (first lease to
the rollout's end, export included); engine start-up is excluded for every configuration.
Lengths: the tiny random model almost never emits EOS, so each group's length is its max_tokens,
drawn heavy-tailed (lognormal) so that a few groups form a tail, as in RL rollouts.

    python tools/bench/rollout.py [--groups 32] [--n 4] [--repeats 3] [--chunk-tokens 128] [--configs A,B]
                                  [--before CHECKOUT] [--kv-pool off|mooncake|auto]

`--before CHECKOUT` (a git worktree of an earlier commit): every seerd configuration also runs on
that checkout's code (PYTHONPATH), interleaved with this one's, and the table adds the
coordinator's CPU per chunk before and after (CPU time of the coordinator process in the
generation phase / chunks): the same command measuring both sides of a change.
"""

from __future__ import annotations

import argparse
import functools
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
ENGINE = {"kv_cache_gib": 0.5, "max_num_seqs": 64, "dtype": "float32"}


def make_prompts(path: Path, groups: int, seed: int, mean_tokens: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        length = int(min(max_tokens, max(16, rng.lognormvariate(math.log(mean_tokens) - 0.5, 1.0))))
        rows.append({"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(rng.randrange(16, 64))],
                     "max_tokens": length})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# --------------------------------------------------------------------------- direct vLLM (veRL-like)
SHARD_SCRIPT = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model, shard_file, n, kv_gib, max_seqs, dtype, go_file, out_file, seed = sys.argv[1:]
    rows = [json.loads(l) for l in open(shard_file)]
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
              kv_cache_memory_bytes=int(float(kv_gib) * (1 << 30)), max_num_seqs=int(max_seqs),
              enable_chunked_prefill=False, max_num_batched_tokens=4096, seed=int(seed))
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows]
    params = [SamplingParams(n=int(n), max_tokens=r["max_tokens"], temperature=1.0, logprobs=0,
                             flat_logprobs=True, detokenize=False) for r in rows]
    open(out_file + ".ready", "w").close()
    while not os.path.exists(go_file):
        time.sleep(0.01)
    start = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = time.time()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    json.dump({"start": start, "end": end, "tokens": tokens}, open(out_file, "w"))
"""


def run_direct(model: str, rows: list[dict], n: int, work: Path, seed: int) -> dict:
    script = work / "shard.py"
    script.write_text(SHARD_SCRIPT)
    half = (len(rows) + 1) // 2
    shards = [rows[:half], rows[half:]]  # veRL splits the batch into contiguous DP shards
    go = work / "go"
    go.unlink(missing_ok=True)
    procs, outs = [], []
    for i, shard in enumerate(shards):
        shard_file = work / f"shard{i}.jsonl"
        shard_file.write_text("".join(json.dumps(r) + "\n" for r in shard))
        out = work / f"shard{i}.json"
        out.unlink(missing_ok=True)
        Path(str(out) + ".ready").unlink(missing_ok=True)
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), model, str(shard_file), str(n), str(ENGINE["kv_cache_gib"]),
             str(ENGINE["max_num_seqs"]), ENGINE["dtype"], str(go), str(out), str(seed)],
            env=engine_env(), stdout=subprocess.DEVNULL, stderr=open(work / f"shard{i}.log", "w")))
    deadline = time.time() + 600
    while not all(Path(str(o) + ".ready").exists() for o in outs):
        if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"direct vLLM shard failed to start; see {work}/shard*.log")
        time.sleep(0.1)
    go.touch()
    for p in procs:
        if p.wait(timeout=1200) != 0:
            raise RuntimeError(f"direct vLLM shard failed; see {work}/shard*.log")
    results = [json.loads(o.read_text()) for o in outs]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"tokens": sum(r["tokens"] for r in results), "seconds": span}


# --------------------------------------------------------------------------- seerd
def run_seerd(model: str, prompts: Path, policy: str, chunk_tokens: int, n: int, work: Path, seed: int,
              engine_api: str = "stepped", in_place: bool = True, code: Path = REPO, kv_pool: str | None = None) -> dict:
    run_dir = work / f"run-{policy}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", model,
           "--run-dir", str(run_dir), "--workers", "2", "--policy", policy, "--chunk-tokens", str(chunk_tokens),
           "--n", str(n), "--max-tokens", "100000", "--temperature", "1.0", "--seed", str(seed),
           "--kv-cache-gib", str(ENGINE["kv_cache_gib"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--dtype", ENGINE["dtype"], "--engine-api", engine_api, "--no-progress",
           "--wait-for-workers"]  # like the baseline's barrier: both engines up before the clock starts
    if kv_pool is not None:  # else each checkout's own default
        cmd += ["--kv-pool", kv_pool]
    if code == REPO or not in_place:  # an earlier checkout may predate the option (and re-submit anyway)
        cmd.append("--in-place" if in_place else "--no-in-place")
    # From the checkout's own directory: `python -m` puts the working directory first on the path.
    done = subprocess.run(cmd, env=engine_env(code), cwd=code, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"seerd run failed: {done.stderr[-2000:]}")
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = db.execute("select min(leased_at) from chunks").fetchone()[0]
        end = db.execute("select finished_at from rollouts").fetchone()[0]
        tokens = db.execute("select sum(generated_tokens) from requests").fetchone()[0]
        load = json.loads(db.execute("select data_json from events where kind='coordinator_load'").fetchone()[0])
        chunks = db.execute("select count(*) from chunks").fetchone()[0]
        in_place = db.execute("select count(*) from events where kind = 'chunk_leased' "
                              "and json_extract(data_json, '$.in_place')").fetchone()[0]
    return {"tokens": tokens, "seconds": end - first, "coordinator_cpu_share": load["cpu_share"], "chunks": chunks,
            "in_place": in_place, "cpu_ms_per_chunk": 1e3 * generation_cpu(load) / chunks}


def generation_cpu(load: dict) -> float:
    """The coordinator's CPU seconds while the engines generated. Checkouts before 2026-11-27
    counted the export after the last report in `cpu_s`; it runs alone on the CPU, so its wall
    time stands in for its CPU there."""
    if "generation_cpu_s" in load:
        return load["generation_cpu_s"]
    return load["cpu_s"] - load.get("export_s", 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model dir (default: a tiny model made in a temp dir)")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--mean-tokens", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=1536)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-async", action="store_true",
                        help="also run seerd-divided on AsyncLLM workers (--engine-api async)")
    parser.add_argument("--configs", help="comma-separated configurations to run (default: all but the "
                                          "async one; vllm-direct always runs, it is the base)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--before", help="an earlier checkout: run every seerd configuration on its code too")
    parser.add_argument("--kv-pool", choices=("off", "mooncake", "auto"),
                        help="every seerd configuration's --kv-pool (default: each checkout's own default)")
    args = parser.parse_args()
    seerd = functools.partial(run_seerd, kv_pool=args.kv_pool)
    work = Path(tempfile.mkdtemp(prefix="seerd-bench-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from tests.fixtures.make_tiny_model import make_tiny_model
        model = str(make_tiny_model(work / "model"))
    prompts = work / "prompts.jsonl"
    rows = make_prompts(prompts, args.groups, args.seed, args.mean_tokens, args.max_tokens)
    configs = {
        "vllm-direct": lambda s: run_direct(model, rows, args.n, work, s),
        "seerd-group": lambda s: seerd(model, prompts, "group", 10**6, args.n, work, s),
        "seerd-divided": lambda s: seerd(model, prompts, "divided", args.chunk_tokens, args.n, work, s),
        "seerd-seer": lambda s: seerd(model, prompts, "seer", args.chunk_tokens, args.n, work, s),
        "seerd-divided-resubmit": lambda s: seerd(model, prompts, "divided", args.chunk_tokens, args.n, work, s,
                                                      in_place=False),
        "seerd-seer-resubmit": lambda s: seerd(model, prompts, "seer", args.chunk_tokens, args.n, work, s,
                                                   in_place=False),
    }
    if args.with_async:
        configs["seerd-div-async"] = lambda s: seerd(model, prompts, "divided", args.chunk_tokens, args.n, work,
                                                         s, engine_api="async")
    if args.before:
        before = Path(args.before).resolve()
        for name in [n for n in configs if n.startswith("seerd-") and "async" not in n]:
            policy = name.split("-")[1]  # seerd-divided -> divided
            chunk = 10**6 if policy == "group" else args.chunk_tokens
            resubmit = name.endswith("-resubmit")
            configs[f"{name}@before"] = (lambda p, c, r: lambda s: seerd(
                model, prompts, p, c, args.n, work, s, in_place=not r, code=before))(policy, chunk, resubmit)
    if args.configs:
        wanted = {"vllm-direct", *args.configs.split(",")}
        unknown = wanted - configs.keys()
        if unknown:
            parser.error(f"unknown configurations {sorted(unknown)}; known: {sorted(configs)}")
        configs = {name: fn for name, fn in configs.items() if name.removesuffix("@before") in wanted}
    samples: dict[str, list[dict]] = {name: [] for name in configs}
    for repeat in range(args.repeats):  # interleaved, so drift on a noisy machine hits all alike
        for name, fn in configs.items():
            result = fn(args.seed + repeat)
            result["tok_s"] = result["tokens"] / result["seconds"]
            samples[name].append(result)
            print(f"# repeat {repeat + 1} {name}: {result['tokens']} tokens in {result['seconds']:.2f}s "
                  f"= {result['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(s["tok_s"] for s in samples["vllm-direct"])
    table = []
    for name, runs in samples.items():
        med = statistics.median(r["tok_s"] for r in runs)
        busy = [r["coordinator_cpu_share"] for r in runs if "coordinator_cpu_share" in r]
        table.append({"config": name, "median_tok_s": med, "ratio_to_direct": med / base,
                      "samples_tok_s": [round(r["tok_s"]) for r in runs],
                      "coordinator_cpu_share": statistics.median(busy) if busy else None,
                      "chunks": statistics.median(r["chunks"] for r in runs) if "chunks" in runs[0] else None,
                      "cpu_ms_per_chunk": (statistics.median(r["cpu_ms_per_chunk"] for r in runs)
                                           if "cpu_ms_per_chunk" in runs[0] else None),
                      "in_place": statistics.median(r["in_place"] for r in runs) if "in_place" in runs[0] else None})
    if args.json:
        print_json({"args": vars(args), "table": table}, indent=1)
        return 0
    lengths = sorted(r["max_tokens"] for r in rows)
    print(f"{args.groups} groups x n={args.n}, lengths median {lengths[len(lengths) // 2]} max {lengths[-1]}, "
          f"chunk {args.chunk_tokens}, {args.repeats} repeats, 2 engines (OMP_NUM_THREADS=1)")
    print(f"{'config':<30} {'median tok/s':>12} {'x direct':>9} {'coord CPU':>10} {'ms/chunk':>8} {'chunks':>7} "
          f"{'in place':>8}  samples")
    for row in table:
        busy = f"{row['coordinator_cpu_share']:.2%}" if row["coordinator_cpu_share"] is not None else "-"
        chunks = "-" if row["chunks"] is None else f"{row['chunks']:.0f}"
        in_place = "-" if row["in_place"] is None else f"{row['in_place']:.0f}"
        per_chunk = "-" if row["cpu_ms_per_chunk"] is None else f"{row['cpu_ms_per_chunk']:.2f}"
        print(f"{row['config']:<30} {row['median_tok_s']:>12.0f} {row['ratio_to_direct']:>9.2f} {busy:>10} "
              f"{per_chunk:>8} {chunks:>7} {in_place:>8}  {row['samples_tok_s']}")
        before = next((b for b in table if b["config"] == f"{row['config']}@before"), None)
        if before is not None and row["cpu_ms_per_chunk"] and before["cpu_ms_per_chunk"]:
            print(f"{'':<30} coordinator CPU per chunk after / before: "
                  f"{row['cpu_ms_per_chunk'] / before['cpu_ms_per_chunk']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
