"""What streaming costs the AsyncLLM engine: its chunks stream (RequestOutputKind.DELTA, an output
per step) so that the worker sees the engine core step (liveness by progress). Same batch (64
requests x 256 greedy tokens, EOS ignored) through one engine, final-only vs streamed,
alternated; prints the median tokens/s of each and their ratio.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/async_stream.py MODEL_DIR [--repeats 4]
"""
import argparse
import asyncio
import statistics
import time

from seerd.settings import EngineConfig, Sampling
from seerd.worker.async_engine import AsyncEngine
from seerd.worker.vllm_args import sampling_params

async def run_final(engine, rid, prompt, n, sampling):
    from vllm.inputs import TokensPrompt
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), sampling_params(n, sampling), request_id=rid):
        final = out
    return final.outputs[0]  # a CompletionOutput: token_ids, as the streamed ChunkResult has

async def main(model, repeats):
    engine = AsyncEngine.start(model, EngineConfig(kv_cache_gib=0.5, max_num_seqs=64, max_model_len=512, dtype="float32"),
                               seed=0)
    prompts = [[4 + (i * 7 + j) % 900 for j in range(20)] for i in range(64)]
    greedy = Sampling(temperature=0.0, ignore_eos=True)
    times = {"final": [], "delta": []}
    k = 0
    for rep in range(repeats):
        for mode in (("final", "delta") if rep % 2 == 0 else ("delta", "final")):
            t = time.perf_counter()
            if mode == "final":
                res = await asyncio.gather(*(run_final(engine, f"f{k}-{i}", p, 256, greedy) for i, p in enumerate(prompts)))
            else:
                res = await asyncio.gather(*(engine.run(f"d{k}-{i}", p, 256, greedy) for i, p in enumerate(prompts)))
            k += 1
            times[mode].append(sum(len(r.token_ids) for r in res) / (time.perf_counter() - t))
    f, d = statistics.median(times["final"]), statistics.median(times["delta"])
    print(f"{'mode':<12}{'median tok/s':>14}  runs")
    for mode, med in (("final-only", f), ("streamed", d)):
        runs = times["final" if mode == "final-only" else "delta"]
        print(f"{mode:<12}{med:>14.0f}  {', '.join(f'{x:.0f}' for x in runs)}")
    print(f"streamed / final-only: {d / f:.3f}")
    engine.shutdown()

if __name__ == "__main__":  # AsyncLLM spawns its engine core: the guard is required
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.repeats))
