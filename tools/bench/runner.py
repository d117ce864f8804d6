"""What the benchmarks and harnesses in tools/bench share: the checkout, the environment engines run
in, seerd's command line, a run's database read-only, medians, the test models, and JSON output that
says which CPU it came from. A script imports it as `from tools.bench.runner import ...` after
putting the checkout first on `sys.path` (so that it measures this checkout's seerd, not the
installed one)."""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MOTIF_MODEL = REPO / "examples" / "motif_model" / "weights"  # the trained motif model (float32)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from seerd.machine import machine_facts  # noqa: E402


def engine_env(code: Path = REPO) -> dict[str, str]:
    """This process's environment as engines and seerd should run in it here: one OpenMP thread per
    engine (two engines without it ran 17x slower), no CPU binding, `code` first on the path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "NO_COLOR": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}


def seerd_command(*args: str) -> list[str]:
    """`seerd ARGS` as this interpreter runs it (the checkout's seerd under `engine_env`)."""
    return [sys.executable, "-m", "seerd.cli.main", *args]


def read_rows(run_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """A query on a run's database, read-only (never the coordinator's write lock); [] before the
    database exists."""
    try:
        with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True, timeout=10) as conn:
            return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError:
        return []


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def tiny_model(where: Path, **options: object) -> Path:
    """The tests' tiny random-weight model (tests/fixtures/make_tiny_model.py), built at `where`."""
    from tests.fixtures.make_tiny_model import make_tiny_model

    return make_tiny_model(where, **options)


def print_json(document: dict, indent: int | None = None) -> None:
    """A benchmark's `--json` output: its document, with the CPU it ran on first."""
    print(json.dumps({"machine": machine_facts(), **document}, indent=indent))
