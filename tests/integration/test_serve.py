"""`seerd serve` on real vLLM engines: batch after batch on engines that start once, new weights
loaded in place and strictly on-policy, groups streamed as they end, a killed serve resumed
(issue 18). Two engines at a time, as everywhere here: the fresh `seerd run` that the second batch
is compared with runs after the serve stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from tests.fixtures.perturb import perturbed_copy

from seerd.coordinator.model_identity import fingerprint_json, model_fingerprint, weight_version
from seerd.serve.client import Client, ServeError
from tests.integration.harness import db_rows, run_seerd, start_seerd, wait_for

pytestmark = pytest.mark.vllm

ENGINE = ["--workers", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--chunk-tokens", "16", "--dtype", "float32"]
SHORT, LONG = 24, 1200  # tokens: the long group keeps a batch running long after the short ones ended


def prompts(groups: int, long_group: bool = False) -> list[dict]:
    rows = [{"id": f"p{g}", "prompt_token_ids": [5 + g, 17, 33 + g, 40, 41 + 2 * g], "max_tokens": SHORT,
             "ignore_eos": True} for g in range(groups)]
    if long_group:
        rows.append({"id": "long", "prompt_token_ids": [7, 8, 9, 10], "max_tokens": LONG, "ignore_eos": True})
    return rows


def version_of(model: Path) -> str:
    model = model.resolve()
    return weight_version(str(model), fingerprint_json(model_fingerprint(model)))


def start_serve(model: Path, run_dir: Path, log: Path) -> subprocess.Popen:
    return start_seerd("serve", "--model", str(model), "--run-dir", str(run_dir), *ENGINE, "--n", "2",
                       "--temperature", "0", "--max-tokens", str(SHORT), log=log)


def worker_processes(run_dir: Path) -> list[int]:
    """The serve's worker processes (each leads its own process group; its reaper shares the name)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if (entry.isdigit() and b"seerd.worker" in (command := Path(f"/proc/{entry}/cmdline").read_bytes())
                    and str(run_dir).encode() in command and os.getpgid(int(entry)) == int(entry)):
                found.append(int(entry))
        except OSError:  # it exited meanwhile
            continue
    return found


def stop(serve: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    serve.send_signal(sig)
    return serve.wait(timeout=120)


def test_batches_under_new_weights_stream_and_match_a_fresh_run(tiny_model_dir, tmp_path):
    new_weights = perturbed_copy(tiny_model_dir, tmp_path / "step-1", seed=1)
    run_dir = tmp_path / "serve"
    serve = start_serve(tiny_model_dir, run_dir, tmp_path / "serve.log")
    try:
        client = Client(run_dir)
        first = client.rollout(prompts(3))
        assert [(r["group_index"], r["response_index"]) for r in first] == [(g, k) for g in range(3) for k in range(2)]
        assert {r["weight_version"] for r in first} == {version_of(tiny_model_dir)}

        # The second batch, under new weights, streamed: each group once, the first ones while the
        # long group still runs (it needs LONG / 16 chunks after them).
        state = client.submit(prompts(3, long_group=True), weights=new_weights)
        assert state.weights_version == version_of(new_weights)
        seen, status_at_first = [], None
        for group in client.groups(state.batch):
            if not seen:
                status_at_first = client.state(state.batch).status
            seen.append(group)
        assert status_at_first == "running"
        assert sorted(g["group_index"] for g in seen) == [0, 1, 2, 3]
        assert {r["weight_version"] for g in seen for r in g["rows"]} == {version_of(new_weights)}
        second = {(r["group_index"], r["response_index"]): r["token_ids"] for g in seen for r in g["rows"]}
        assert len(second[(3, 0)]) == LONG and all(len(second[(g, k)]) == SHORT for g in range(3) for k in range(2))
        # The same key again answers the same batch; a submission with bad prompts creates nothing.
        again = client.submit(tmp_path / "unused.jsonl", key=_key_of(run_dir, state.batch))
        assert again.batch == state.batch
        (tmp_path / "bad.jsonl").write_text('{"id": "x", "prompt_token_ids": [1, 2, 999999]}\n')
        with pytest.raises(ServeError, match="outside|vocab"):
            client.submit(tmp_path / "bad.jsonl")
        assert db_rows(run_dir, "select count(*) from rollouts")[0][0] == 2
        # The client has every group once they ended; the batch's export follows.
        output = wait_for(lambda: client.state(state.batch).output, 60, "batch 2's export")
        assert output == str(run_dir / "batches" / str(state.batch) / "rollouts.jsonl")
        assert len(Path(output).read_text().splitlines()) == 8
    finally:
        code = stop(serve)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]

    # Strictly on-policy, from the database: every chunk of batch 2 was leased to a worker that
    # registered with the new weights (after loading them in place), after that registration.
    registered = {worker: (ts, json.loads(data)) for worker, ts, data in db_rows(
        run_dir, "select worker_id, ts, data_json from events where kind = 'worker_registered' and rollout_id = ?",
        (state.batch,))}
    assert registered and all(data["weights_version"] == version_of(new_weights) and data["weights_loaded_s"] > 0
                              for _, data in registered.values())
    chunks = db_rows(run_dir, "select c.lease_holder, c.leased_at from chunks c join requests r on r.id = c.request_id "
                              "where r.rollout_id = ?", (state.batch,))
    assert chunks and all(holder in registered and leased_at >= registered[holder][0] for holder, leased_at in chunks)

    # Greedy outputs under the new weights equal a fresh run started on them.
    fresh_input = tmp_path / "fresh.jsonl"
    fresh_input.write_text("".join(json.dumps(row) + "\n" for row in prompts(3, long_group=True)))
    fresh = run_seerd("run", "--input", str(fresh_input), "--model", str(new_weights), "--run-dir",
                      str(tmp_path / "fresh"), *ENGINE, "--n", "2", "--temperature", "0", "--no-progress")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    fresh_rows = [json.loads(line) for line in (tmp_path / "fresh" / "rollouts.jsonl").read_text().splitlines()]
    assert {(r["group_index"], r["response_index"]): r["token_ids"] for r in fresh_rows} == second


def _key_of(run_dir: Path, batch: int) -> str:
    (config,) = db_rows(run_dir, "select config_json from rollouts where id = ?", (batch,))[0]
    return json.loads(config)["batch_key"]


def test_a_killed_serve_resumes_its_batch_and_the_client_gets_every_group_once(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "serve"
    serve = start_serve(tiny_model_dir, run_dir, tmp_path / "serve-1.log")
    try:
        client = Client(run_dir, patience_s=300)
        state = client.submit(prompts(4, long_group=True))
        groups = client.groups(state.batch)
        seen = [next(groups)]  # a short group ended: the long one runs on
        wait_for(lambda: db_rows(run_dir, "select count(*) from chunks c join requests r on r.id = c.request_id "
                                          "where r.rollout_id = ? and r.group_id = (select max(id) from prompt_groups) "
                                          "and c.status = 'done'", (state.batch,))[0][0] >= 2,
                 120, "the long group's second chunk")
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=60)
        serve = start_serve(tiny_model_dir, run_dir, tmp_path / "serve-2.log")
        seen.extend(groups)  # the same iterator, across the restart
        wait_for(lambda: client.state(state.batch).status == "finished", 60, "the batch's end")
    finally:
        code = stop(serve)
    assert code == 0, (tmp_path / "serve-2.log").read_text()[-3000:]
    assert sorted(g["group_index"] for g in seen) == [0, 1, 2, 3, 4]
    rows = [r for g in seen for r in g["rows"]]
    assert len(rows) == 10 and len({(r["group_index"], r["response_index"]) for r in rows}) == 10
    assert db_rows(run_dir, "select status from rollouts") == [("finished",)]
    assert db_rows(run_dir, "select count(*) from events where kind = 'rollout_resumed'")[0][0] == 1
    long_rows = [r for r in rows if r["prompt_id"] == "long"]
    assert all(len(r["token_ids"]) == LONG for r in long_rows)


def test_grouped_drafting_under_serve_draws_on_the_previous_batch(tmp_path):
    """`--spec grouped` on the motif model (drafts are accepted there): the second batch of the
    same prompts starts its draft server from the first batch's responses, and drafting changes no
    greedy output."""
    import sys

    from tests.integration.harness import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT))
    from examples.motif_model.corpus import make_prompts

    model = REPO_ROOT / "examples" / "motif_model" / "weights"
    run_dir = tmp_path / "serve"
    serve = start_seerd("serve", "--model", str(model), "--run-dir", str(run_dir), "--workers", "1",
                        "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--dtype", "float32", "--chunk-tokens", "96",
                        "--spec", "grouped", "--n", "2", "--max-tokens", "192", "--temperature", "0",
                        log=tmp_path / "serve.log")
    try:
        client = Client(run_dir)
        prompts = make_prompts(4, seed=5)
        first, second = client.rollout(prompts), client.rollout(prompts)
        wait_for(lambda: client.state(2).status == "finished", 60, "the second batch's end")
        # A worker waiting for the next batch still stops on SIGTERM, at once (it once waited
        # out its patience, a minute, and outlived a cancelled job).
        (worker,) = worker_processes(run_dir)
        os.kill(worker, signal.SIGTERM)
        wait_for(lambda: worker not in worker_processes(run_dir), 30, "the worker to stop on SIGTERM")
    finally:
        code = stop(serve)
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert [r["token_ids"] for r in second] == [r["token_ids"] for r in first]
    (data,) = db_rows(run_dir, "select data_json from events where kind = 'spec_history_seeded' and rollout_id = 2")[0]
    seeded = json.loads(data)
    assert seeded["rollouts"] == [1] and seeded["groups"] == 4 and seeded["responses"] == 8
    assert not db_rows(run_dir, "select id from events where kind = 'spec_history_seeded' and rollout_id = 1")

    def accepted(batch: int) -> int:  # the worker process's drafter totals, as of the batch's end
        return max(json.loads(stats)["spec"]["accepted"] for (stats,) in db_rows(
            run_dir, "select stats_json from workers where rollout_id = ? and stats_json is not null", (batch,)))

    assert accepted(2) > accepted(1) > 0  # drafts were accepted in each batch
