"""Every engine a worker drives satisfies `seerd.worker.engine.Engine`, checked by the type checker
(mypy) on the engines' own source, the way the worker uses them: the stepped and async vLLM
engines, the simulator's engine, and the tests' scripted one. A class that lacks a member of the
protocol is refused in the same run, so the check is seen to bite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CONFORMANCE = '''
from seerd.worker.async_engine import AsyncEngine
from seerd.worker.engine import Engine
from seerd.worker.sim_engine import SimEngine
from seerd.worker.stepped import SteppedEngine
from tests.unit.helpers import ScriptedEngine


def stepped(engine: SteppedEngine) -> Engine:
    return engine


def async_llm(engine: AsyncEngine) -> Engine:
    return engine


def simulated(engine: SimEngine) -> Engine:
    return engine


def scripted(engine: ScriptedEngine) -> Engine:
    return engine


class WithoutReload:
    max_chunks = kv_capacity_tokens = kv_block_tokens = 1
    dtype = "float32"
    live = counters = None


def refused(engine: WithoutReload) -> Engine:
    return engine  # refused: no open, run, progress, abort, reload_weights, shutdown
'''

# seerd's own modules are read (and must be found: a missing one would be typed Any and pass
# anything); third-party packages are not followed (typed Any), which keeps the check to seconds.
CONFIG = '''[mypy]
follow_imports = silent
[mypy-vllm.*,torch.*,transformers.*,numpy.*,sqlalchemy.*,mooncake.*,pyarrow.*,matplotlib.*,uvicorn.*,starlette.*,aiohttp.*,httpx.*,safetensors.*,sortedcontainers.*,prometheus_client.*,cryptography.*,alembic.*,click.*,rich.*,submitit.*,pydantic.*,psutil.*,pytest.*,scipy.*]
follow_imports = skip
ignore_missing_imports = True
'''


def test_every_engine_satisfies_the_engine_protocol_by_the_type_checker(tmp_path):
    module = tmp_path / "engine_conformance.py"
    module.write_text(CONFORMANCE)
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                           str(tmp_path / "cache"), "--no-error-summary", str(module)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "MYPYPATH": str(REPO)})
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    refused_at = 1 + CONFORMANCE.splitlines().index("    return engine  # refused: no open, run, progress, abort, "
                                                     "reload_weights, shutdown")
    assert len(errors) == 1 and f"{module.name}:{refused_at}:" in errors[0] and '"WithoutReload"' in errors[0], \
        done.stdout + done.stderr
