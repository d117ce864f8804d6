"""A request vLLM refuses fails alone: the stepped engine (vLLM's LLMEngine in the worker) goes on
serving the others. Before, one refused request (a prompt longer than the engine's max_model_len)
killed the engine, and the same request then killed every other worker's in turn."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.harness import REPO_ROOT, test_env

pytestmark = pytest.mark.vllm

# Run in its own process: the engine sets process-wide vLLM settings (in-process engine core).
SCRIPT = r"""
import asyncio, json, sys
from seerd.settings import EngineConfig, Sampling
from seerd.worker.stepped import SteppedEngine

async def main(model):
    engine = SteppedEngine.start(model, EngineConfig(kv_cache_gib=0.1, max_num_seqs=4, max_model_len=64,
                                                     dtype="float32"), seed=0)
    greedy = Sampling(temperature=0.0)
    too_long, fine = engine.run("c1e1g1r1p100", [5] * 100, 8, greedy), engine.run("c2e1g1r2p4", [5, 6, 7, 8], 8, greedy)
    results = await asyncio.gather(too_long, fine, return_exceptions=True)
    after = await engine.run("c3e1g1r3p4", [5, 6, 7, 8], 8, greedy)
    print(json.dumps({"too_long": repr(results[0]), "fine": len(results[1].token_ids),
                      "after": after.token_ids, "before": results[1].token_ids,
                      "engine_failure": repr(engine.failure)}))
    engine.shutdown()

asyncio.run(main(sys.argv[1]))
"""


def test_a_prompt_the_engine_refuses_fails_alone(tiny_model_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                            timeout=300, env=test_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert "maximum context length is 64" in answer["too_long"]
    assert answer["fine"] == 8 and answer["engine_failure"] == "None"
    assert answer["after"] == answer["before"]  # the engine still serves, greedy and the same


# AsyncLLM chunks stream (an output per step, for liveness): the same result as asking vLLM for
# the final output only, tokens and logprobs, greedy and seeded; and chunks cut from one request
# running on (in-place continuation) add up to the same.
STREAM_SCRIPT = r"""
import asyncio, json, sys
from vllm.inputs import TokensPrompt
from seerd.settings import EngineConfig, Sampling
from seerd.worker.async_engine import AsyncEngine
from seerd.worker.vllm_args import sampling_params

async def final_only(engine, request_id, prompt, max_tokens, sampling):
    final = None
    async for output in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), sampling_params(max_tokens, sampling),
                                            request_id=request_id):
        final = output
    completion = final.outputs[0]
    return list(completion.token_ids), [float(x) for x in completion.logprobs.logprobs], completion.finish_reason

async def cut(engine, request_id, prompt, max_tokens, sampling, sizes):
    stream = engine.open(request_id, prompt, max_tokens, sampling, stream=True)
    token_ids, logprobs, start, runs_on = [], [], 0, []
    for size in sizes:
        await stream.until(start + size)
        chunk, more = stream.result(start, size)
        token_ids += chunk.token_ids
        logprobs += chunk.logprobs
        runs_on.append(more)
        start += size
    return token_ids, logprobs, chunk.finish_reason, runs_on

async def main(model):
    engine = AsyncEngine.start(model, EngineConfig(kv_cache_gib=0.1, max_num_seqs=4, max_model_len=128,
                                                   dtype="float32"), seed=0)
    cases = [([5, 6, 7, 8], Sampling(temperature=0.0)), ([9, 10, 11], Sampling(temperature=1.0, seed=3))]
    streamed = await asyncio.gather(*(engine.run(f"s{i}", p, 40, s) for i, (p, s) in enumerate(cases)))
    final = await asyncio.gather(*(final_only(engine, f"f{i}", p, 40, s) for i, (p, s) in enumerate(cases)))
    chunks = await asyncio.gather(*(cut(engine, f"c{i}", p, 40, s, (16, 16, 8)) for i, (p, s) in enumerate(cases)))
    print(json.dumps({"streamed": [[r.token_ids, r.logprobs, r.finish_reason] for r in streamed],
                      "final": [list(r) for r in final], "cut": [list(r[:3]) for r in chunks],
                      "runs_on": [r[3] for r in chunks], "steps": engine.progress().steps}))
    engine.shutdown()

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
"""


def test_a_streamed_async_chunk_equals_the_final_only_one(tiny_model_dir, tmp_path):
    script = tmp_path / "stream.py"  # a file: AsyncLLM spawns its engine core, which imports __main__
    script.write_text(STREAM_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                            timeout=300, env=test_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert answer["streamed"] == answer["final"] == answer["cut"]
    assert answer["runs_on"] == [[True, True, False]] * 2  # the last chunk ends the request
    assert all(len(tokens) == 40 for tokens, _, _ in answer["streamed"])
    assert answer["steps"] >= 80  # an output per step of each streamed chunk
