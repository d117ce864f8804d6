"""Local GPU workers each see their own GPUs (`seerd run --gpus-per-worker`); no GPU is needed to
check which devices each worker's environment names."""

from __future__ import annotations

import pytest

from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.launch.local import WorkerPool
from seerd.rundir import RunDir


def test_each_local_worker_gets_its_own_gpus_of_those_visible(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = WorkerPool(RunDir(tmp_path), 4, gpus_per_worker=2)
    assert [pool._devices(rank) for rank in range(4)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"},
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")  # a job that was given some GPUs only
    assert pool._devices(1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ValueError, match="worker 2 needs GPUs 4-5; this node shows 4"):
        pool._devices(2)
    assert WorkerPool(RunDir(tmp_path), 2)._devices(1) == {}  # CPU workers: devices left alone


def test_gpus_per_worker_is_the_tensor_parallel_size_and_turns_the_pool_on(tmp_path):
    options = {**ROLLOUT_DEFAULTS, "input_path": tmp_path / "p.jsonl", "model_path": tmp_path, "policy": "seer"}
    config = build_config(workers=4, gpus_per_worker=2, **options)
    assert config.engine.gpus_per_worker == 2 and config.engine.extra_args["tensor_parallel_size"] == 2
    assert config.kv_pool.mode == "mooncake"  # auto, GPU workers that move requests
    cpu = build_config(workers=4, **options)
    assert cpu.engine.gpus_per_worker == 0 and "tensor_parallel_size" not in cpu.engine.extra_args
    assert cpu.kv_pool.mode == "off"  # auto, CPU workers on one node
