"""Helpers for integration tests: run the real `seerd` CLI, read the run's database, check outputs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[2]


def seerd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "seerd.cli.main", *args]


def test_env() -> dict[str, str]:  # not a test: the environment the tests run seerd in
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["NO_COLOR"] = "1"
    return env


test_env.__test__ = False  # modules that import it must not have pytest collect it


def run_seerd(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(seerd_cmd(*args), capture_output=True, text=True, timeout=timeout, env=test_env(),
                          cwd=REPO_ROOT)


def start_seerd(*args: str, log: Path) -> subprocess.Popen:
    handle = open(log, "wb")
    return subprocess.Popen(seerd_cmd(*args), stdout=handle, stderr=subprocess.STDOUT, env=test_env(),
                            cwd=REPO_ROOT)


def write_token_prompts(path: Path, groups: int, *, max_tokens: list[int] | None = None, seed: int = 0) -> Path:
    """Token-id prompts (no tokenizer needed), lengths 6-30, optional per-row max_tokens."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as handle:
        for g in range(groups):
            row = {"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(rng.randrange(6, 30))]}
            if max_tokens:
                row["max_tokens"] = max_tokens[g % len(max_tokens)]
            handle.write(json.dumps(row) + "\n")
    return path


def db_rows(run_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    # Read-only, so a test never takes the coordinator's write lock.
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True, timeout=10) as conn:
        return conn.execute(sql, params).fetchall()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def done_chunks(run_dir: Path) -> int:
    try:
        return db_rows(run_dir, "select count(*) from chunks where status='done'")[0][0]
    except sqlite3.OperationalError:
        return 0


def assert_complete_output(run_dir: Path, expected: dict[tuple[int, int], int] | int) -> list[dict]:
    """Every response exactly once, tokens and logprobs consistent with the database."""
    rows = pq.read_table(run_dir / "rollouts.parquet").to_pylist()
    jsonl = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    keys = [(r["group_index"], r["response_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "a response appears twice"
    if isinstance(expected, int):
        assert len(rows) == expected
    else:
        assert set(keys) == set(expected)
    assert [r["token_ids"] for r in jsonl] == [r["token_ids"] for r in rows]
    for row in rows:
        assert row["length"] == len(row["token_ids"]) == len(row["logprobs"]) > 0
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in row["logprobs"])
        assert row["finish_reason"] in ("stop", "length", "length_target")
    # The database agrees: chunks of each request are 0..k-1, all done, and add up.
    per_request = db_rows(run_dir, """
        select g.group_index, r.response_index, r.generated_tokens, r.num_chunks,
               count(c.id), sum(c.num_tokens), max(c.seq), sum(c.status != 'done')
        from requests r join prompt_groups g on g.id = r.group_id join chunks c on c.request_id = r.id
        group by r.id""")
    by_key = {(g, k): rest for g, k, *rest in per_request}
    for row in rows:
        generated, num_chunks, count, tokens, max_seq, not_done = by_key[(row["group_index"], row["response_index"])]
        assert not_done == 0 and count == num_chunks == row["num_chunks"] == max_seq + 1
        assert tokens == generated == row["length"]
    meta = json.loads((run_dir / "rollouts.meta.json").read_text())
    assert meta["complete"] is True
    return rows


def live_processes() -> dict[int, list[str]]:
    """pid -> the fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...),
    for every process not yet reaped."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            found[int(entry)] = fields
    return found


@contextlib.contextmanager
def kv_pool(run_dir: Path, segment_bytes: int) -> Iterator[object]:
    """A real KV pool for `run_dir`: a fresh secret (engines key their blocks' MACs by it), the
    Mooncake master and metadata server, and one holder giving it `segment_bytes`; yields the
    `PoolService` once the holder's memory is mounted (not after a guessed sleep)."""
    from seerd.kvpool.service import PoolService
    from seerd.rundir import RunDir

    RunDir(run_dir).rotate_secret()
    service = PoolService(run_dir, "127.0.0.1", log_dir=run_dir)
    service.start()
    with open(run_dir / "holder.log", "ab") as log:
        holder = subprocess.Popen([sys.executable, "-m", "seerd.kvpool.holder", "--run-dir", str(run_dir),
                                   "--segment-bytes", str(segment_bytes)], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not service.stats().get("capacity_bytes"):
            assert holder.poll() is None and time.monotonic() < deadline, "the holder gave the pool no memory"
            time.sleep(0.2)
        yield service
    finally:
        holder.terminate()
        holder.wait(timeout=30)
        service.stop()
