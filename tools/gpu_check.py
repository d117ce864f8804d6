#!/usr/bin/env python
"""What a user with one GPU node runs first (`tools/gpu_check.sh`, docs/gpu.md; issue 19).

Checks, each printed PASS or FAIL with its figures, then a summary (exit 1 if any failed):
1. `pool`: a greedy rollout of the committed motif model with 2 workers, the AsyncLLM engine path
   (`--engine-api async`, the GPU default), divided rollout with chunks re-submitted so that they
   move between the workers: once with `--kv-pool off`, once with `--kv-pool mooncake`. The
   outputs must be equal token for token, chunks must have moved, and the moved chunks must have
   found their response tokens cached (on another worker, only the pool can have them).
2. `profile` (GPU only; `--skip-profile` leaves it out): `tools/profile_spec_steps.py` writes the
   engine's T(B, gamma) step profile for adaptive drafting to OUT/spec-profile.json.

On a GPU node each worker gets its own GPU (`--gpus-per-worker 1`); without one (`--cpu`, or no
CUDA device) the same checks run on CPU workers: what CI runs (tests/integration/test_gpu_check.py).

    tools/gpu_check.sh [--out DIR] [--cpu] [--skip-profile] [--model CKPT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MOTIF = REPO / "examples" / "motif_model" / "weights"
# 32 requests for 2 x 6 slots: with 16 one engine's slow first steps (4.4 s, seen in a full suite)
# let the other run every request beyond the slots alone, no chunk moved, and the check judged nothing.
GROUPS, PROMPT_TOKENS = 16, 200


def write_prompts(path: Path) -> Path:
    """Long random prompts and `ignore_eos`: every chunk continues a context of several blocks."""
    rng = random.Random(7)
    with open(path, "w") as handle:
        for group in range(GROUPS):
            row = {"id": f"g{group}", "prompt_token_ids": [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)],
                   "ignore_eos": True}
            handle.write(json.dumps(row) + "\n")
    return path


def seerd(*args: str, log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "wb") as out:
        return subprocess.run([sys.executable, "-m", "seerd.cli.main", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO).returncode


def outputs(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return {(row["group_index"], row["response_index"]): row["token_ids"] for row in rows}


def check_pool(out: Path, model: Path, gpu: bool) -> dict:
    from seerd.report.cache import continuation_cache_figures
    from seerd.report.source import load_run

    prompts = write_prompts(out / "prompts.jsonl")
    engine = ["--model", str(model), "--workers", "2", "--engine-api", "async", "--policy", "divided",
              "--chunk-tokens", "96", "--n", "2", "--max-tokens", "384", "--temperature", "0",
              "--max-num-seqs", "6", "--wait-for-workers", "--no-in-place", "--no-progress"]
    engine += ["--gpus-per-worker", "1", "--kv-cache-gib", "2"] if gpu else ["--dtype", "float32", "--kv-cache-gib", "0.25"]
    results = {}
    for pool in ("off", "mooncake"):
        run_dir = out / f"run-pool-{pool}"
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.monotonic()
        code = seerd("run", "--input", str(prompts), "--run-dir", str(run_dir), "--kv-pool", pool, *engine,
                     log=out / f"run-pool-{pool}.log")
        results[pool] = {"exit": code, "seconds": round(time.monotonic() - started, 1), "run_dir": str(run_dir)}
        if code != 0:
            return {"passed": False, "why": f"seerd run --kv-pool {pool} exited {code}; see {out}/run-pool-{pool}.log",
                    **results}
    equal = outputs(out / "run-pool-off") == outputs(out / "run-pool-mooncake")
    cache = continuation_cache_figures(load_run(out / "run-pool-mooncake" / "state.db"))
    hit = cache.pool_hit_rate_response
    passed = equal and cache.moved.chunks > 0 and hit is not None and hit >= 0.9
    why = [] if equal else ["outputs differ with the pool"]
    if cache.moved.chunks == 0:
        why.append("no chunk moved between workers")
    elif hit is None or hit < 0.9:
        why.append(f"moved chunks found {hit} of their response tokens cached (the pool's share): expected >= 0.9")
    return {"passed": passed, "why": "; ".join(why), "outputs_equal": equal, "moved_chunks": cache.moved.chunks,
            "moved_response_hit_rate": hit, **results}


def check_profile(out: Path, model: Path) -> dict:
    profile = out / "spec-profile.json"
    code = subprocess.run([sys.executable, str(REPO / "tools" / "profile_spec_steps.py"), "--model", str(model),
                           "--dtype", "auto", "--out", str(profile)], cwd=REPO).returncode  # as the GPU run's engines
    return {"passed": code == 0 and profile.is_file(), "why": "" if code == 0 else f"exited {code}",
            "profile": str(profile)}


def cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/seerd-gpu-check"))
    parser.add_argument("--model", type=Path, default=MOTIF)
    parser.add_argument("--cpu", action="store_true", help="CPU workers even where GPUs are")
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    devices = 0 if args.cpu else cuda_devices()
    gpu = devices >= 2
    if not args.cpu and devices == 1:
        print("one GPU visible: the pool check needs two workers; running them on CPU", flush=True)
    print(f"seerd GPU check: {'2 GPU workers' if gpu else 'CPU workers'} ({devices} CUDA devices), output in {args.out}",
          flush=True)
    checks = {"pool": check_pool(args.out, args.model, gpu)}
    if devices and not args.skip_profile:
        checks["profile"] = check_profile(args.out, args.model)
    for name, result in checks.items():
        verdict = "PASS" if result["passed"] else "FAIL"
        print(f"{verdict} {name}: {json.dumps({k: v for k, v in result.items() if k != 'passed'})}", flush=True)
    (args.out / "report.json").write_text(json.dumps({"devices": devices, "gpu_workers": gpu, **checks}, indent=2))
    failed = [name for name, result in checks.items() if not result["passed"]]
    print(f"{len(checks) - len(failed)} of {len(checks)} passed" + (f"; failed: {', '.join(failed)}" if failed else "")
          + f". Report: {args.out / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
