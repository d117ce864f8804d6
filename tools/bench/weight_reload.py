#!/usr/bin/env python
"""New weights into a running vLLM engine in place, against starting an engine on them.

The ground work of `seerd serve` (issue 18): an RL iteration's new checkpoint must reach every
worker's engine without a restart. vLLM's worker has `reload_weights(weights_path=...)`,
reachable with `collective_rpc`; this checks on this machine's vLLM that it really swaps the
weights (greedy outputs change, and equal those of an engine started on the new checkpoint) and
what it costs beside an engine start. The new checkpoint is the model's own with every float
tensor perturbed (seeded), written next to a copy of its config and tokenizer.

    .venv/bin/python tools/bench/weight_reload.py [--model examples/motif_model/weights] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as SteppedEngine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.fixtures.perturb import perturbed_copy  # noqa: E402

PROMPTS = [[5, 17, 33, 48, 60, 7, 9, 11], [6, 20, 31, 44, 3, 8], [12, 13, 14, 90, 91]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "motif_model" / "weights")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def engine(path: Path) -> LLM:
        return LLM(model=str(path), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                   enable_prefix_caching=True, max_model_len=512)

    def greedy(llm: LLM) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    starts, reloads, changed, equal = [], [], [], []
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            new = perturbed_copy(args.model, Path(work) / f"v{round_}", seed=round_)
            began = time.perf_counter()
            llm = engine(args.model)
            starts.append(time.perf_counter() - began)
            before = greedy(llm)
            began = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new)})
            llm.reset_prefix_cache()  # cached KV was computed by the old weights
            reloads.append(time.perf_counter() - began)
            after = greedy(llm)
            del llm
            gc.collect()
            fresh = greedy(engine(new))
            gc.collect()
            changed.append(after != before)
            equal.append(after == fresh)
    start, reload = statistics.median(starts), statistics.median(reloads)
    print(f"{args.model}, {args.rounds} rounds (medians)")
    print("| engine start s | in-place reload s | reload / start | outputs changed | equal to a fresh engine |")
    print("|---|---|---|---|---|")
    print(f"| {start:.2f} | {reload:.3f} | {reload / start:.3f} | {sum(changed)}/{len(changed)} "
          f"| {sum(equal)}/{len(equal)} |")
    return 0 if all(changed) and all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
