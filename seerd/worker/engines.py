"""Which engine a worker runs: vLLM stepped in this process, or vLLM's AsyncLLM (the simulator's
model runs in `seerd.worker.sim_host` instead)."""

from __future__ import annotations

import os

from seerd.settings import EngineConfig, PoolSettings, SpecConfig
from seerd.worker.async_engine import AsyncEngine
from seerd.worker.engine import Engine
from seerd.worker.stepped import SteppedEngine
from seerd.worker.vllm_args import DRAFTER_SETTINGS_ENV, cuda_available, drafter_settings, engine_env_defaults, \
    kv_transfer_config


def start_engine(model_path: str, engine: EngineConfig, seed: int, spec: SpecConfig = SpecConfig(),
                 run_dir: str | None = None, kv_pool: PoolSettings | None = None) -> Engine:
    """The engine `engine.api` names ("stepped", "async"; "auto": async with CUDA, else stepped)."""
    engine_env_defaults()
    os.environ[DRAFTER_SETTINGS_ENV] = drafter_settings(spec, run_dir)
    api = engine.api
    if api == "auto":
        api = "async" if cuda_available() else "stepped"
    if api == "sim":
        raise ValueError("--engine-api sim: simulated workers run in `python -m seerd.worker.sim_host`")
    driver = {"stepped": SteppedEngine, "async": AsyncEngine}.get(api)
    if driver is None:
        raise ValueError(f"unknown engine api {api!r}: use auto, stepped or async")
    return driver.start(model_path, engine, seed, spec, kv_transfer_config(kv_pool, run_dir))
