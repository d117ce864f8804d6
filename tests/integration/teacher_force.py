"""Recompute sampled tokens' log-probabilities by teacher forcing (a helper process of test_spec_decoding).

stdin: JSON [{"prompt": [ids], "response": [ids]}, ...]; stdout (last line): JSON [[logprob per
response token], ...], from one plain engine (no speculation) scoring prompt + response.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    items = json.load(sys.stdin)
    longest = max(len(i["prompt"]) + len(i["response"]) for i in items)
    llm = LLMEngine.from_engine_args(EngineArgs(
        model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=1 << 29,
        enable_chunked_prefill=False, max_model_len=max(longest + 8, 512), max_num_batched_tokens=max(longest + 8, 2048),
        dtype="float32", enable_prefix_caching=False, disable_log_stats=True))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    for k, item in enumerate(items):
        llm.add_request(str(k), TokensPrompt(prompt_token_ids=item["prompt"] + item["response"]), params)
    results: dict[int, list[float]] = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                k = int(output.request_id)
                item = items[k]
                tokens = item["prompt"] + item["response"]
                start = len(item["prompt"])
                results[k] = [float(output.prompt_logprobs[p][tokens[p]].logprob) for p in range(start, len(tokens))]
    print(json.dumps([results[k] for k in range(len(items))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
