"""The simulator: its cost model, workloads, engine model and the driver around the real policies."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seerd.cli.main import cli
from seerd.scheduler.state import FIRST_CHUNK_SPREAD
from seerd.sim.costs import InstanceCosts
from seerd.sim.driver import SimResult, Simulation
from seerd.sim.presets import PRESETS, get_preset
from seerd.sim.report import SimSettings, run_comparison, summarize
from seerd.sim.workload import SimGroup, TraceError, Workload, generate, load_trace, next_iteration
from tests.unit.helpers import HAND_CHUNKS, hand_built_cache_run

QWEN = get_preset("qwen2-vl-72b")


def small_workload(lengths_per_group: list[list[int]], prompt_len: int = 32, max_tokens: int = 512) -> Workload:
    return Workload(tuple(SimGroup(i, prompt_len, max_tokens, tuple(ls)) for i, ls in enumerate(lengths_per_group)),
                    "hand-made")


def simulate(workload: Workload, policy: str, *, instances: int = 2, kv: int = 4000, chunk: int = 64,
             max_num_seqs: int = 16, seed: int = 0, pool_hit_rate: float = 1.0,
             first_chunk_spread: float = FIRST_CHUNK_SPREAD) -> tuple[Simulation, SimResult]:
    sim = Simulation(workload, policy, QWEN.costs(), instances=instances, chunk_tokens=chunk,
                     max_num_seqs=max_num_seqs, seed=seed, pool_hit_rate=pool_hit_rate, kv_capacity=kv,
                     first_chunk_spread=first_chunk_spread)
    return sim, sim.run()


# ----------------------------------------------------------------- cost model
@pytest.mark.parametrize("preset", list(PRESETS))
def test_segment_time_is_the_exact_sum_of_its_steps(preset: str) -> None:
    costs = get_preset(preset).costs()
    for batch, context, steps in [(1, 100, 7), (64, 200_000, 50), (256, 10, 300), (300, 2_000_000, 40)]:
        summed = sum(costs.step_time(batch, context + i * batch) for i in range(steps))
        assert math.isclose(costs.segment_time(batch, context, steps), summed, rel_tol=1e-9)


def test_segment_time_across_the_memory_to_compute_crossing() -> None:
    costs = QWEN.costs()
    fixed, m0, m1, f0, f1 = costs._linear_terms(4096)
    assert f0 > m0 and m1 > f1  # compute-bound at small context, memory-bound later: one crossing
    crossing = (f0 - m0) / (m1 - f1)
    start = max(0.0, crossing - 4096 * 20)
    summed = sum(costs.step_time(4096, start + i * 4096) for i in range(60))
    assert math.isclose(costs.segment_time(4096, start, 60), summed, rel_tol=1e-9)


def test_steps_within_inverts_segment_time() -> None:
    costs = QWEN.costs()
    for budget in (0.0, 0.05, 1.0, 30.0):
        k = costs.steps_within(32, 100_000, 10_000, budget)
        assert costs.segment_time(32, 100_000, k) <= budget < costs.segment_time(32, 100_000, k + 1)


def test_cost_model_orders_of_magnitude() -> None:
    """Checks of the derivation, not of any target: decode of a 72B model at TP8 is ~10 ms at
    batch 1 (weights / 8 / HBM bandwidth); a full KV read dominates at large batch."""
    costs = QWEN.costs()
    assert 0.008 < costs.step_time(1, 1000) < 0.02
    assert costs.step_time(128, 1_000_000) > 2 * costs.step_time(1, 1000)
    for preset in PRESETS.values():
        assert preset.costs().kv_capacity_tokens() > preset.max_tokens  # one request always fits


# ----------------------------------------------------------------- workloads
def test_generator_matches_preset_statistics_and_correlates_within_groups() -> None:
    workload = generate(QWEN, seed=3)
    lengths = [length for g in workload.groups for length in g.lengths]
    assert len(lengths) == QWEN.requests
    assert abs(statistics.mean(lengths) / QWEN.mean_tokens - 1) < 0.08
    assert max(lengths) == QWEN.max_tokens and min(lengths) >= 16
    # Most of the log-length variance lies between groups (within_share 0.15).
    logs = [[math.log(x) for x in g.lengths] for g in workload.groups]
    within = statistics.mean(statistics.pvariance(g) for g in logs)
    total = statistics.pvariance([x for g in logs for x in g])
    assert within / total < 0.3


def test_generator_is_deterministic_and_iterations_drift() -> None:
    assert generate(QWEN, 5, requests=160) == generate(QWEN, 5, requests=160)
    first = generate(QWEN, 5, requests=1600)
    second = next_iteration(first, QWEN, 9)
    assert [g.prompt_len for g in first.groups] == [g.prompt_len for g in second.groups]
    assert [g.lengths for g in first.groups] != [g.lengths for g in second.groups]
    # The same prompts stay predictive: group maxima correlate across iterations.
    a = [math.log(max(g.lengths)) for g in first.groups]
    b = [math.log(max(g.lengths)) for g in second.groups]
    assert statistics.correlation(a, b) > 0.6


def test_trace_replay_and_its_errors(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"group": "a", "length": 10, "prompt_len": 5}\n{"group": "a", "length": 30, "prompt_len": 5}\n'
                     '\n{"group": 7, "length": 20}\n')
    workload = load_trace(trace, QWEN)
    assert [g.lengths for g in workload.groups] == [(10, 30), (20,)]
    assert [g.prompt_len for g in workload.groups] == [5, QWEN.prompt_tokens]
    assert {g.max_tokens for g in workload.groups} == {QWEN.max_tokens}
    # A real run's lengths past the preset's max_tokens replay: the trace's own maximum, or its rows' caps.
    trace.write_text('{"group": "a", "length": 50000}\n{"group": "b", "length": 7, "max_tokens": 2048}\n')
    assert [g.max_tokens for g in load_trace(trace, QWEN).groups] == [50000, 2048]
    for text, message in [('{"group": 1}', "length"), ("nope", "not JSON"),
                          ('{"group": 1, "length": 0}', "1..max_tokens"),
                          ('{"group": 1, "length": 3000, "max_tokens": 2048}', "1..2048"),
                          ('{"group": 1, "length": 3, "max_tokens": 2.5}', "max_tokens must be"),
                          ('{"group": 1, "length": 3, "max_tokens": 8}\n{"group": 1, "length": 3}', "two max_tokens"),
                          ('{"group": 1, "length": 3, "prompt_len": 2}\n{"group": 1, "length": 3, "prompt_len": 4}',
                           "two prompt lengths"), ("", "no requests")]:
        trace.write_text(text)
        with pytest.raises(TraceError, match=message):
            load_trace(trace, QWEN)


# ----------------------------------------------------------------- the simulation
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=4), min_size=1, max_size=10),
       policy=st.sampled_from(["group", "divided", "seer", "oracle", "streamrl-oracle", "seer-revealed:0.3"]),
       chunk=st.sampled_from([16, 64, 1000]), seed=st.integers(0, 3), gap=st.sampled_from([0.0, 0.05]))
def test_every_request_completes_exactly_once_and_only_group_preempts(groups, policy, chunk, seed, gap) -> None:
    workload = small_workload(groups)
    sim = Simulation(workload, policy, QWEN.costs(), instances=2, chunk_tokens=chunk, max_num_seqs=6, seed=seed,
                     pool_hit_rate=0.5, kv_capacity=1500, chunk_gap_s=gap)
    result = sim.run()
    assert result.requests == sum(len(g) for g in groups)
    assert all(r.finished_at is not None and sim.state.requests[r.request_id].generated == r.true_length for r in sim.requests.values())
    assert len(result.finish_times) == result.requests and not sim.state.leases and not len(sim.state.queue)
    assert result.output_tokens == sum(map(sum, groups))
    assert all(peak <= result.kv_capacity for peak in result.peak_kv)
    oversized = any(sum(32 + length for length in g) > 1500 * 0.99 or len(g) > 6 for g in groups)
    if policy != "group" and not (policy == "streamrl-oracle" and oversized):
        assert result.preemptions == 0  # KV admission by construction


def test_group_policy_preempts_when_kv_runs_out() -> None:
    """veRL's engine admits by prompt and grows; with KV for ~3 full responses it must preempt."""
    workload = small_workload([[400] * 4, [400] * 4])
    _, result = simulate(workload, "group", kv=1400, max_num_seqs=8)
    assert result.preemptions > 0 and result.recomputed_tokens > 0
    _, divided = simulate(workload, "divided", kv=1400, max_num_seqs=8)
    assert divided.preemptions == 0


def test_same_seed_same_report_and_seeds_differ() -> None:
    config = SimSettings(QWEN, chunk_tokens=4096, pool_hit_rate=0.5, requests=320, record_timeline=False)

    def report(seed: int) -> dict:
        summary = summarize(run_comparison(config, ["group", "seer", "oracle"], [seed]))
        return {p: {k: v for k, v in e.items() if k != "sim_wall_s"} for p, e in summary.items()}

    assert report(1) == report(1)
    assert report(1) != report(2)


def test_seer_starts_long_groups_before_short_ones() -> None:
    """Once probes reveal the lengths, the long groups' other requests go first (slots bind)."""
    workload = small_workload([[20] * 4, [300] * 4, [20] * 4, [300] * 4])
    sim, _ = simulate(workload, "seer", instances=1, kv=100_000, max_num_seqs=4, chunk=64)
    start = {(r.group_index, r.response_index): r.first_leased_at for r in sim.requests.values()}
    long_rest = [start[(g, k)] for g in (1, 3) for k in range(1, 4)]
    short_rest = [start[(g, k)] for g in (0, 2) for k in range(1, 4)]
    assert max(long_rest) < min(short_rest)


def test_seer_learns_growth_ratios_from_completed_groups_in_the_simulator() -> None:
    # Every group: one short response and three 4x longer: the table learns it, the forecast uses it.
    workload = small_workload([[25, 100, 100, 100]] * 12)
    sim, _ = simulate(workload, "seer", instances=1, kv=100_000, max_num_seqs=4, chunk=64)
    assert sim.state.growth.completed_groups == 12
    assert sim.state.growth.current.ratio(4, 1) == 4.0


def test_seer_revealed_is_told_each_groups_longest_at_its_first_finish() -> None:
    from seerd.scheduler.oracle import RevealedSeerPolicy

    workload = small_workload([[20, 300, 20, 20], [20] * 4, [20, 20, 20, 300]])
    sim, _ = simulate(workload, "seer-revealed", instances=1, kv=100_000, max_num_seqs=4, chunk=64)
    policy = sim.policy
    assert isinstance(policy, RevealedSeerPolicy) and policy.revealed == {0: 300, 1: 20, 2: 300}
    noisy = RevealedSeerPolicy({0: 10, 1: 10, 2: 50}, {0: 0, 1: 0, 2: 1}, sigma=0.5)
    assert noisy.revealed[0] != 10 and noisy.name == "seer-revealed:0.5"
    with pytest.raises(ValueError, match="sigma"):
        RevealedSeerPolicy({0: 10}, {0: 0}, sigma=-1)


def test_tail_time_is_the_time_spent_on_the_last_tenth() -> None:
    result = SimResult("x", 100.0, 1, 10, [float(t) for t in (1, 2, 3, 4, 5, 6, 7, 8, 40, 100)], [50.0], 0, 0, 0, 0,
                       0, 0, 0.0, [], 1, [0], 0.0)
    assert result.tail_time_s == 60.0  # 9 of 10 were done at t=40
    assert result.idle_fraction == 0.5


def test_pool_hit_rate_trades_recompute_for_loads() -> None:
    workload = small_workload([[300] * 4 for _ in range(6)])
    _, with_pool = simulate(workload, "divided", pool_hit_rate=1.0, chunk=32)
    _, without = simulate(workload, "divided", pool_hit_rate=0.0, chunk=32)
    assert with_pool.recomputed_tokens == 0 and with_pool.pool_loads > 0
    assert without.pool_loads == 0 and without.recomputed_tokens > 0


# ----------------------------------------------------------------- the order of lease calls
# 8 requests of 300 tokens in chunks of 100 (16 continued chunks), 2 instances, KV to spare: at the
# start instance 0 asks first and takes every request, instance 1 finds nothing and waits.
EIGHT_REQUESTS = small_workload([[300] * 2 for _ in range(4)])


def test_an_instance_waiting_longer_takes_the_chunks_requeued_by_one_with_free_slots() -> None:
    """Instance 0 (8 of 16 slots) waits from its second call, after instance 1's first, so the
    first continuations go to instance 1, which then re-asks first and keeps the rest."""
    sim, result = simulate(EIGHT_REQUESTS, "divided", max_num_seqs=16, chunk=100, kv=100_000, first_chunk_spread=0.0)
    first, second = (instance.stats for instance in sim.instances)
    assert first.moved_continuations == first.local_continuations == 0
    assert second.moved_continuations == 8 and second.local_continuations == 8
    assert result.moved_chunks == 8 and result.local_continuations == 8


def test_a_full_reporter_asks_after_the_waiting_instance_so_every_continuation_moves() -> None:
    """With 8 slots the instance holding every request is full: it asks only once its report is
    answered, after the other instance's waiting call has taken the requeued chunks."""
    _, result = simulate(EIGHT_REQUESTS, "divided", max_num_seqs=8, chunk=100, kv=100_000, first_chunk_spread=0.0)
    assert result.moved_chunks == 16 and result.local_continuations == 0


def test_moved_chunks_make_the_pool_hit_rate_count_under_divided() -> None:
    results = {hit: simulate(EIGHT_REQUESTS, "divided", max_num_seqs=16, chunk=100, kv=100_000,
                             pool_hit_rate=hit)[1] for hit in (1.0, 0.0)}
    assert results[1.0].pool_loads == results[0.0].moved_chunks > 0
    assert results[0.0].recomputed_tokens == 8 * 100  # each moved chunk rebuilds its 100 generated tokens
    assert results[1.0].throughput_tok_s > results[0.0].throughput_tok_s  # a load is cheaper than a prefill


def test_waiting_order_follows_long_poll_renewals() -> None:
    """Polls time out after LONG_POLL_S and are renewed: the wait that counts is the current poll's
    (of workers with equal KV room: none runs anything here)."""
    from seerd.sim.driver import LONG_POLL_S

    sim = Simulation(EIGHT_REQUESTS, "divided", QWEN.costs(), instances=3, chunk_tokens=100, max_num_seqs=16,
                     seed=0, kv_capacity=100_000)
    sim.waiting_since = [(0.0, 1), None, (0.5 * LONG_POLL_S, 2)]
    assert sim._waiting_in_wake_order(0.9 * LONG_POLL_S) == [0, 2]
    assert sim._waiting_in_wake_order(1.2 * LONG_POLL_S) == [2, 0]  # instance 0 renewed at LONG_POLL_S
    sim.waiting_since[1] = (0.0, 3)  # began at the same time as instance 0, after it: renews after it
    assert sim._waiting_in_wake_order(2.2 * LONG_POLL_S) == [2, 0, 1]


def test_preset_scale_simulates_every_policy() -> None:
    """A tenth of the qwen preset on 2 instances (so KV binds) through every policy."""
    config = SimSettings(QWEN.with_changes(instances=2), chunk_tokens=4096, requests=960, record_timeline=False)
    summary = summarize(run_comparison(config, ["group", "divided", "seer", "oracle", "streamrl-oracle"], [0]))
    assert summary["group"]["x_group"] == 1.0 and summary["oracle"]["x_oracle"] == 1.0
    assert summary["group"]["preemptions"] > 0
    assert all(summary[p]["preemptions"] == 0 for p in ("divided", "seer", "oracle", "streamrl-oracle"))


# ----------------------------------------------------------------- the command
def test_sim_command_json_schema(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["sim", "--preset", "moonlight", "--requests", "160", "--policies",
                                      "group,seer,oracle", "--json", "--plot", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["preset"] == "moonlight"
    for name in ("group", "seer", "oracle"):
        entry = doc["policies"][name]
        for key in ("throughput_tok_s", "total_time_s", "tail_time_s", "preemptions", "idle_fraction"):
            assert isinstance(entry[key], (int, float))
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert "completion_cdf.png" in pngs and "instances_seer.png" in pngs
    assert all((tmp_path / "plots" / p).stat().st_size > 10_000 for p in pngs)


def test_sim_command_with_a_trace_and_iterations(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"group": g, "length": 100 + 50 * g}) + "\n" for g in range(8) for _ in range(4)))
    result = CliRunner().invoke(cli, ["sim", "--trace", str(trace), "--policies", "group,seer"])
    assert result.exit_code == 0, result.output
    assert "32 requests" in result.output and "seer" in result.output
    result = CliRunner().invoke(cli, ["sim", "--requests", "320", "--iterations", "2", "--policies", "seer,seer+prior",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["policies"]["seer+prior"]["runs"] == 1


@pytest.mark.parametrize("args, message", [
    (["--policies", "fastest"], "unknown policy"),
    (["--policies", "seer-revealed:much"], "unknown policy"),
    (["--policies", "seer+prior"], "--iterations 2"),
    (["--pool-hit-rate", "2"], "pool-hit-rate"),
    (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
    (["--requests", "3"], "at least the group size"),
])
def test_sim_command_bad_input_exits_2(args, message) -> None:
    result = CliRunner().invoke(cli, ["sim", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_costs_reject_a_model_that_does_not_fit() -> None:
    tiny_cluster = QWEN.parallelism.__class__(gpus=1)
    with pytest.raises(ValueError, match="does not fit"):
        InstanceCosts(QWEN.model, tiny_cluster).kv_capacity_tokens()


def test_profiled_costs_sum_exactly_and_the_cpu_preset_runs() -> None:
    cpu = get_preset("cpu-tiny")
    costs = cpu.costs()
    assert costs.kv_capacity_tokens() == cpu.kv_tokens
    summed = sum(costs.step_time(8, 1000 + 8 * i) for i in range(30))
    assert math.isclose(costs.segment_time(8, 1000, 30), summed, rel_tol=1e-9)
    assert costs.steps_within(8, 1000, 100, costs.segment_time(8, 1000, 30)) == 30
    config = SimSettings(cpu, chunk_tokens=cpu.chunk_tokens, record_timeline=False)
    summary = summarize(run_comparison(config, ["group", "seer"], [0]))
    assert summary["seer"]["preemptions"] == 0 and summary["group"]["total_time_s"] > 0


def test_sim_command_overrides_kv_and_sequences() -> None:
    result = CliRunner().invoke(cli, ["sim", "--preset", "cpu-tiny", "--kv-tokens", "900", "--max-num-seqs", "4",
                                      "--policies", "divided", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["cluster"]["kv_capacity_tokens"] == 900 and doc["cluster"]["max_num_seqs"] == 4


def test_a_control_plane_gap_per_chunk_slows_chunked_policies_only() -> None:
    workload = small_workload([[300] * 4 for _ in range(6)])
    results = {}
    for gap in (0.0, 0.5):
        sim = Simulation(workload, "divided", QWEN.costs(), instances=2, chunk_tokens=32, max_num_seqs=16, seed=0,
                         kv_capacity=4000, chunk_gap_s=gap)
        results[gap] = sim.run()
        assert all(sim.state.requests[r.request_id].generated == r.true_length for r in sim.requests.values())
    # 10 chunks per response, each boundary 0.5 s: at least 4.5 s more on the critical path.
    assert results[0.5].total_time_s > results[0.0].total_time_s + 4.5
    group = simulate(workload, "group", chunk=32, kv=4000)[1]
    gapped = Simulation(workload, "group", QWEN.costs(), instances=2, chunk_tokens=32, max_num_seqs=16, seed=0,
                        kv_capacity=4000, chunk_gap_s=0.5).run()
    assert gapped.total_time_s <= group.total_time_s + 0.5 + 1e-9  # unchunked: one report at the very end


# ----------------------------------------------------------------- --pool-hit-rate-from RUN_DIR
FAST_SIM = ["sim", "--preset", "cpu-tiny", "--requests", "64", "--policies", "divided"]


def test_sim_command_takes_the_pool_hit_rate_measured_in_a_run(tmp_path) -> None:
    """tests/unit/helpers.py HAND_CHUNKS: 4 moved continued chunks found 184 of their 424 cacheable
    response tokens (the report's test works them out); the run is unfinished (running)."""
    run_dir = hand_built_cache_run(tmp_path / "run")
    result = CliRunner().invoke(cli, [*FAST_SIM, "--pool-hit-rate-from", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    cluster = json.loads(result.output)["cluster"]
    assert cluster["pool_hit_rate"] == 184 / 424
    assert cluster["pool_hit_rate_source"] == {
        "from": "run", "run_dir": str(run_dir), "measured": 184 / 424, "moved_chunks": 4,
        "response_cached_tokens": 184, "response_cacheable_tokens": 424, "block_size": 128, "run_status": "running"}
    result = CliRunner().invoke(cli, [*FAST_SIM, "--pool-hit-rate-from", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (f"pool hit rate 0.434: measured in {run_dir} (running): 4 continued chunks moved to another worker "
            "found 184 of 424 cacheable response tokens cached") in result.output


def test_sim_command_clamps_a_measured_pool_hit_rate_above_one(tmp_path) -> None:
    """More cached than 128-token blocks allow (an engine with smaller blocks): used as 1."""
    chunks = ((0, 0, 0, "w0", 100, 0, 0.0, 1.0), (0, 0, 1, "w1", 100, 288, 1.0, 2.0))  # 88 of 56 cacheable
    run_dir = hand_built_cache_run(tmp_path / "run", chunks)
    result = CliRunner().invoke(cli, [*FAST_SIM, "--pool-hit-rate-from", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    cluster = json.loads(result.output)["cluster"]
    assert cluster["pool_hit_rate"] == 1.0 and cluster["pool_hit_rate_source"]["measured"] == 88 / 56


def test_sim_command_says_where_the_pool_hit_rate_came_from() -> None:
    for args, source in (([], "default"), (["--pool-hit-rate", "0.25"], "option")):
        result = CliRunner().invoke(cli, [*FAST_SIM, *args, "--json"])
        assert result.exit_code == 0, result.output
        cluster = json.loads(result.output)["cluster"]
        assert cluster["pool_hit_rate_source"] == {"from": source}
        assert cluster["pool_hit_rate"] == (0.25 if args else 1.0)
    result = CliRunner().invoke(cli, [*FAST_SIM, "--pool-hit-rate", "0.25"])
    assert "pool hit rate 0.250: --pool-hit-rate" in result.output


def test_sim_command_pool_hit_rate_from_bad_runs_exit_2(tmp_path) -> None:
    def fails(*args: str) -> str:
        result = CliRunner().invoke(cli, [*FAST_SIM, *args])
        assert result.exit_code == 2, result.output
        return result.output

    run_dir = hand_built_cache_run(tmp_path / "run")
    assert "exclude each other" in fails("--pool-hit-rate", "0.5", "--pool-hit-rate-from", str(run_dir))
    assert "exclude each other" in fails("--pool-hit-rate", "1.0", "--pool-hit-rate-from", str(run_dir))
    assert "no run directory" in fails("--pool-hit-rate-from", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    assert "no run at" in fails("--pool-hit-rate-from", str(tmp_path / "empty"))
    same_worker_only = tuple(c for c in HAND_CHUNKS if (c[0], c[1]) == (0, 0) and c[2] <= 1)
    output = fails("--pool-hit-rate-from", str(hand_built_cache_run(tmp_path / "same", same_worker_only)))
    assert "no continued chunk that moved to another worker" in output and "1 stayed on their worker" in output
    within_prompt = ((1, 0, 0, "w0", 50, 0, 0.0, 1.0), (1, 0, 1, "w1", 50, 0, 1.0, 2.0))  # L 110: nothing cacheable
    output = fails("--pool-hit-rate-from", str(hand_built_cache_run(tmp_path / "short", within_prompt)))
    assert "had no response tokens that could be cached" in output


def test_a_measured_pool_load_replaces_the_recompute_in_a_profile(tmp_path) -> None:
    from seerd.sim.costs import ProfiledCosts

    profile = json.loads((Path(__file__).resolve().parents[2] / "seerd/sim/profiles/cpu-tiny.json").read_text())
    without = ProfiledCosts(profile, 5120)
    assert without.pool_load_time(1000) == without.prefill_time(1000)  # no pool measured: a recompute
    with_pool = ProfiledCosts({**profile, "pool_load": {"h": 0.002, "k": 1e-6}}, 5120)
    assert with_pool.pool_load_time(1000) == pytest.approx(0.003)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**profile, "pool_load": {"h": 0.002, "k": 1e-6}}))
    result = CliRunner().invoke(cli, ["sim", "--preset", "cpu-tiny", "--requests", "64", "--policies", "divided",
                                      "--profile", str(path), "--kv-tokens", "4096", "--json"])
    assert result.exit_code == 0, result.output
    cluster = json.loads(result.output)["cluster"]
    assert cluster["kv_capacity_tokens"] == 4096 and cluster["pool_load_ms_1k"] == pytest.approx(3.02, abs=0.01)
    for args, says in ((["--profile", str(path)], "needs --kv-tokens"),
                       (["--profile", str(tmp_path / "nope.json"), "--kv-tokens", "10"], "no such file")):
        bad = CliRunner().invoke(cli, ["sim", "--preset", "cpu-tiny", *args])
        assert bad.exit_code == 2 and says in bad.output


def test_waiting_workers_are_woken_most_kv_room_first() -> None:
    """As the daemon wakes them (`CoordinatorControl._wake`): a worker running chunks has less room."""
    sim = Simulation(EIGHT_REQUESTS, "divided", QWEN.costs(), instances=3, chunk_tokens=100, max_num_seqs=16,
                     seed=0, kv_capacity=100_000)
    assert sim.lease(0, 0.0)  # instance 0 now holds KV for its chunks
    sim.waiting_since = [(0.0, 1), (0.1, 2), (0.2, 3)]
    assert sim._waiting_in_wake_order(0.3) == [1, 2, 0]
