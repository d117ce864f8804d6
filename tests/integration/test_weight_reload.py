"""New weights into a running engine, both drivers (`SteppedEngine`, `AsyncEngine`): after
`reload_weights(path)` greedy outputs equal those of an engine started on that checkpoint, and a
reload asked while a request runs is refused (`EngineBusy`) with the engine still serving on its
old weights. The ground work of `seerd serve`'s weight updates (issue 18)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.harness import REPO_ROOT, test_env

pytestmark = pytest.mark.vllm

# In its own process: the engines set process-wide vLLM settings. One engine at a time.
SCRIPT = r"""
import asyncio, json, shutil, sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from seerd.settings import EngineConfig, Sampling
from seerd.worker.async_engine import AsyncEngine
from seerd.worker.engine import EngineBusy
from seerd.worker.stepped import SteppedEngine

SETTINGS = EngineConfig(kv_cache_gib=0.1, max_num_seqs=4, max_model_len=128, dtype="float32")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 40, 41, 42, 43]]
GREEDY = Sampling(temperature=0.0, ignore_eos=True)

def perturbed(model, dest):
    shutil.copytree(model, dest)
    generator = torch.Generator().manual_seed(0)
    for shard in Path(dest).glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=generator, dtype=v.dtype) if v.is_floating_point()
                   else v for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    return dest

async def greedy(engine, tag):
    results = await asyncio.gather(*(engine.run(f"c{i}e1g1r{i}p{len(p)}{tag}", p, 24, GREEDY)
                                     for i, p in enumerate(PROMPTS)))
    return [r.token_ids for r in results]

async def driver(cls, model, new):
    engine = cls.start(model, SETTINGS, seed=0)
    before = await greedy(engine, "a")
    running = engine.open("c9e1g1r9p4", [5, 6, 7, 8], 100, GREEDY, stream=True)
    await running.until(1)
    try:
        await engine.reload_weights(new)
        busy = "no error"
    except EngineBusy as exc:
        busy = str(exc)
    await engine.abort("c9e1g1r9p4")
    still_old = await greedy(engine, "b")
    seconds = await engine.reload_weights(new)
    after = await greedy(engine, "c")
    engine.shutdown()
    return {"before": before, "busy": busy, "still_old": still_old, "after": after, "seconds": seconds}

async def fresh(model):
    engine = SteppedEngine.start(model, SETTINGS, seed=0)
    outputs = await greedy(engine, "d")
    engine.shutdown()
    return outputs

async def main(model, work):
    new = perturbed(model, str(Path(work) / "new"))
    answer = {"stepped": await driver(SteppedEngine, model, new), "fresh": await fresh(new)}
    answer["async"] = await driver(AsyncEngine, model, new)
    print(json.dumps(answer))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_both_engine_drivers_take_new_weights_in_place_and_only_between_batches(tiny_model_dir, tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tmp_path)], capture_output=True,
                            text=True, timeout=600, env=test_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    fresh = answer["fresh"]
    for name in ("stepped", "async"):
        run = answer[name]
        assert "requests still run" in run["busy"], (name, run["busy"])
        assert run["still_old"] == run["before"], name  # the refused reload left the old weights
        assert run["after"] != run["before"], name  # the new weights are in use...
        assert run["after"] == fresh, name  # ...exactly those an engine started on them has
        assert 0 < run["seconds"] < 60, name
