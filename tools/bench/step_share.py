#!/usr/bin/env python
"""Does an event loop beside the stepping thread make an engine's steps wait (the GIL)?

One in-process vLLM engine (seerd's engine settings, 64 sequences decoding) stepped 300 times,
three ways, each in its own process, the list run twice alternated: in the main thread alone
(`main`, as `direct` in tools/bench/e2e.py), in a thread beside an idle asyncio loop (`thread`,
seerd's worker layout with nothing to do), and beside a loop that wakes every millisecond and
does a little Python work (`thread-busy`, far busier than a worker's loop). Prints ms per step
and the step CPU share (the stepping thread's CPU time over its steps' wall time: below 100%,
the step waited for the GIL or a core).

    python tools/bench/step_share.py [--model DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS, SKIP = 300, 5


def measure(model: str, mode: str) -> tuple[float, float]:
    """(ms per step, step CPU share) of one engine stepped the way `mode` says."""
    sys.path.insert(0, str(REPO))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from seerd.settings import EngineConfig, Sampling
    from seerd.worker.vllm_args import engine_args, engine_env_defaults, sampling_params

    engine_env_defaults()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    llm = LLMEngine.from_engine_args(EngineArgs(**engine_args(
        model, EngineConfig(max_num_seqs=64, dtype="float32", kv_cache_gib=0.5), seed=0)))
    rng = random.Random(0)

    def run() -> tuple[float, float]:
        for i in range(64):
            llm.add_request(f"r{i}", TokensPrompt(prompt_token_ids=[rng.randrange(4, 400) for _ in range(32)]),
                            sampling_params(100_000, Sampling(temperature=1.0, ignore_eos=True)))
        wall = cpu = 0.0
        for step in range(STEPS):
            started, cpu_started = time.monotonic(), time.thread_time()
            llm.step()
            if step >= SKIP:
                wall += time.monotonic() - started
                cpu += time.thread_time() - cpu_started
        return wall, cpu

    if mode == "main":
        wall, cpu = run()
    else:
        out: dict = {}
        stepper = threading.Thread(target=lambda: out.update(result=run()))

        async def loop() -> None:
            stepper.start()
            while stepper.is_alive():
                if mode == "thread-busy":
                    sum(range(200))
                    await asyncio.sleep(0.001)
                else:
                    await asyncio.sleep(0.5)

        asyncio.run(loop())
        wall, cpu = out["result"]
    return 1e3 * wall / (STEPS - SKIP), cpu / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the tiny random model, made in a temporary directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=("main", "thread", "thread-busy"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        ms, share = measure(args.model, args.one)
        print(f"{ms} {share}")
        os._exit(0)  # vLLM's in-process engine core may linger at interpreter exit
    model = args.model
    if model is None:
        import tempfile

        sys.path.insert(0, str(REPO))
        from tests.fixtures.make_tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="seerd-step-share-")) / "model"))
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=str(REPO))
    print(f"{'mode':<12} {'ms/step':>8} {'step CPU share':>15}")
    for _ in range(args.rounds):
        for mode in ("main", "thread", "thread-busy"):
            done = subprocess.run([sys.executable, __file__, "--one", mode, "--model", model], env=env,
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"{mode} failed: {done.stderr[-2000:]}")
            ms, share = (float(x) for x in done.stdout.split()[-2:])
            print(f"{mode:<12} {ms:>8.2f} {share:>15.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
