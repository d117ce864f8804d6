"""A vLLM-CPU engine with seerd's KV pool connector, driven over stdin/stdout (the KV pool tests and
tools/bench_kvpool.py).

Each input line is a JSON chunk {"id": engine request id, "prompt": [...], "max_tokens": n}; each
output line the greedy result {"tokens": [...], "cached": num_cached_tokens, "s": seconds in the
engine, "stats": pool counters}. Settings (JSON, third argument): dtype, extra_args, run_tag,
model_revision, no_pool.
A separate process per engine, as on a real job: each has its own prefix cache and pool client.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def main() -> None:
    run_dir, model, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    from seerd.kvpool.pool import pool_stats
    from seerd.worker.engine import start_engine

    engine = {"kv_cache_gib": 0.25, "max_num_seqs": 8, "dtype": settings.get("dtype", "float32"),
              "api": "stepped", "extra_args": settings.get("extra_args", {})}
    kv_pool = None if settings.get("no_pool") else {"mode": "mooncake", "run_tag": settings.get("run_tag", "test"),
               "model_revision": settings.get("model_revision", "m"), "local_host": "127.0.0.1"}

    async def serve() -> None:
        driver = start_engine(model, engine, 0, None, run_dir, kv_pool)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            chunk = json.loads(line)
            if "keys_of" in chunk:  # the pool keys this engine's connector gives a token sequence
                print(json.dumps({"keys": pool_keys(driver, chunk)}), flush=True)
                continue
            if "exposure" in chunk:  # what of this engine its store client lets peers reach
                print(json.dumps(exposure()), flush=True)
                continue
            started = time.perf_counter()
            result = await driver.run(chunk["id"], chunk["prompt"], chunk["max_tokens"],
                                      {"temperature": 0.0, "ignore_eos": True})
            print(json.dumps({"tokens": result.token_ids, "cached": result.cached_tokens,
                              "s": time.perf_counter() - started, "stats": pool_stats()}), flush=True)
        driver.shutdown()

    asyncio.run(serve())


def exposure() -> dict:
    """The worker-side connector's store client's segment name, its staging rows and the KV
    cache's layers, as (address, bytes)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    connector._client.usable()
    return {"segment": connector._client._store.get_hostname(),
            "staging": [connector._io.staging.ctypes.data, connector._io.staging.nbytes],
            "kv_cache": [[layer.blocks.data_ptr(), layer.blocks.numel()] for layer in connector._io.copier.layers]}


def pool_keys(driver, ask: dict) -> list[str]:  # noqa: ANN001
    from seerd.protocol import ChunkIdentity

    connector = driver.llm.engine_core.engine_core.scheduler.connector
    keys = connector.block_keys(ChunkIdentity(0, 0, ask["group"], ask["request"], ask["prompt_len"], False,
                                              ask.get("batch", 0)))
    tokens = ask["keys_of"]
    return list(keys.extend(tokens, len(tokens)))


if __name__ == "__main__":
    main()
