"""`tools/bench/plan_walk.py` on a small queue: it runs, and its tight-KV state reproduces what
it is for (plans that walk far past the requests they can take)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench" / "plan_walk.py"


def test_the_plan_walk_bench_walks_further_when_the_workers_kv_is_tight():
    command = [sys.executable, str(TOOL), "--queued", "20000", "--workers", "512", "--plans", "200"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines() if " | " in line and
            line.split(" | ")[0] in ("loose", "mixed", "tight")}
    assert set(rows) == {"loose", "mixed", "tight"}, out
    walked = {name: float(row[5]) for name, row in rows.items()}
    assert walked["tight"] > 10 * walked["loose"], out
    assert "decisions digest" in out
