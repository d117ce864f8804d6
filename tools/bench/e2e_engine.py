#!/usr/bin/env python
"""One vLLM engine process for tools/bench/e2e.py: the `direct` baseline's shard, or a profile.

The engine is built by seerd's own `engine_args` (the settings a seerd worker runs with) and is
the offline engine `vllm.LLM.generate` drives: this script drives it the way `LLM.generate` does
(add every request, step until none is left) so that each response's finish time is seen.

    python tools/bench/e2e_engine.py generate MODEL SETTINGS.json SHARD.jsonl OUT.json GO_FILE
    python tools/bench/e2e_engine.py profile  MODEL SETTINGS.json RANK OUT.json GO_FILE BATCH_GO_FILE

generate: SHARD.jsonl holds one line per request {"prompt_token_ids", "sampling"} (n=1 each: a
group's n requests are consecutive lines, as vLLM fans out n>1 itself). Writes OUT.json.ready
once loaded, waits for GO_FILE, generates, and writes {"start", "finished": [t per request],
"lengths": [tokens per request], "tokens", "preemptions", "mean_running"}.

profile (two processes, ranks 0 and 1): at GO_FILE rank 0 decodes one sequence alone (ignore_eos;
rank 1's engine idles) and writes OUT.json.solo with the median decode step; at BATCH_GO_FILE
both decode max_num_seqs sequences at once, and each writes OUT.json with its tokens/s over the
decode steps: the engines' peak together.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, as LLM runs it

PROFILE_TOKENS = 256  # decode steps per profile measurement
PROFILE_PROMPT = 32


def build(model: str, settings: dict):  # -> LLMEngine
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    import msgspec

    from seerd.settings import EngineConfig
    from seerd.worker.vllm_args import engine_args, engine_env_defaults

    engine_env_defaults()
    engine = msgspec.convert(settings["engine"], EngineConfig)
    return LLMEngine.from_engine_args(EngineArgs(**engine_args(model, engine, settings["seed"])))


def warm_up(llm) -> None:  # noqa: ANN001
    """One tiny request before the clock starts, as a seerd worker sends before registering: the
    engine's first step pays lazy initialisation (seconds here) that a long-lived engine has paid."""
    from vllm.inputs import TokensPrompt

    from seerd.settings import Sampling
    from seerd.worker.vllm_args import sampling_params

    llm.add_request("warm-up", TokensPrompt(prompt_token_ids=[1, 2, 3, 4]), sampling_params(2, Sampling(temperature=0.0)))
    while llm.has_unfinished_requests():
        llm.step()


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def generate(llm, shard: Path, out: Path, go: Path) -> None:  # noqa: ANN001
    from vllm.inputs import TokensPrompt

    from seerd.cpu import ThreadClock
    from seerd.settings import SAMPLING_KEYS, Sampling
    from seerd.worker.counters import EngineCounters
    from seerd.worker.vllm_args import sampling_params

    requests = [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
    counters = EngineCounters.attach(llm)
    Path(f"{out}.ready").touch()
    wait_for(go)
    start = time.time()
    for i, request in enumerate(requests):
        sampling = request["sampling"]
        llm.add_request(str(i), TokensPrompt(prompt_token_ids=request["prompt_token_ids"]),
                        sampling_params(sampling["max_tokens"],
                                        Sampling(**{k: v for k, v in sampling.items() if k in SAMPLING_KEYS})))
    finished: list[float | None] = [None] * len(requests)
    lengths = [0] * len(requests)
    thread_clock = ThreadClock()
    while llm.has_unfinished_requests():
        started, (cpu_started, runq_started) = time.monotonic(), thread_clock.read()
        outputs = llm.step()
        cpu_now, runq_now = thread_clock.read()
        if counters is not None:
            counters.after_step(time.monotonic() - started, cpu_now - cpu_started, runq_now - runq_started)
        now = time.time()
        for output in outputs:
            if output.finished:
                finished[int(output.request_id)] = now
                lengths[int(output.request_id)] = len(output.outputs[0].token_ids)
    figures = counters.figures() if counters is not None else {}
    out.write_text(json.dumps({"start": start, "finished": finished, "tokens": sum(lengths), "lengths": lengths,
                               "preemptions": figures.get("preemptions"),
                               "longest_step_s": figures.get("longest_step_s"),
                               "mean_running": figures.get("mean_running"),
                               "ms_per_step": 1e3 * figures["step_s"] / figures["steps"] if figures.get("steps") else None,
                               "step_cpu_share": figures["step_cpu_s"] / figures["step_s"] if figures.get("step_s") else None,
                               "step_runq_share": figures["step_runq_s"] / figures["step_s"] if figures.get("step_s") else None}))


def decode_alone_then_together(llm, settings: dict, rank: int, out: Path, go: Path, batch_go: Path) -> None:  # noqa: ANN001
    Path(f"{out}.ready").touch()
    wait_for(go)
    if rank == 0:
        Path(f"{out}.solo").write_text(json.dumps(decode(llm, 1, "solo")))
    wait_for(batch_go)
    out.write_text(json.dumps(decode(llm, int(settings["engine"]["max_num_seqs"]), "batch")))


def decode(llm, batch: int, tag: str) -> dict:  # noqa: ANN001
    from vllm.inputs import TokensPrompt

    from seerd.settings import Sampling
    from seerd.worker.vllm_args import sampling_params

    params = sampling_params(PROFILE_TOKENS, Sampling(temperature=1.0, ignore_eos=True))
    for i in range(batch):  # distinct prompts: no prefix cache hits between them
        prompt = [(i * 7919 + j * 31) % 400 + 5 for j in range(PROFILE_PROMPT)]
        llm.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=prompt), params)
    steps: list[float] = []
    while llm.has_unfinished_requests():
        started = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - started)
    timed = steps[1:-1]  # the first step prefilled the batch; the last may be partial
    # Tokens over the whole decode, prefill included: on a KV cache too small for the batch the
    # engine queues and preempts, and a per-step figure would count sequences that did not run.
    return {"batch": batch, "median_step_s": statistics.median(timed), "tokens_per_s": batch * PROFILE_TOKENS / sum(steps)}


def main(argv: list[str]) -> int:
    mode, model, settings_file = argv[:3]
    settings = json.loads(Path(settings_file).read_text())
    llm = build(model, settings)
    warm_up(llm)
    if mode == "generate":
        shard, out, go = Path(argv[3]), Path(argv[4]), Path(argv[5])
        generate(llm, shard, out, go)
    elif mode == "profile":
        rank, out, go, batch_go = int(argv[3]), Path(argv[4]), Path(argv[5]), Path(argv[6])
        decode_alone_then_together(llm, settings, rank, out, go, batch_go)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
