"""Speculative decoding in the simulator (`+sd` policies): the acceptance table, the cost of drafted
steps, the workers' depth planner on simulated engines, and what speculation may and may not change."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seerd.cli.main import cli
from seerd.drafts.policy import DEFAULT_CPU_PROFILE, StepTimeModel, expected_tokens
from seerd.sim.costs import ProfiledCosts
from seerd.sim.driver import SimResult, Simulation
from seerd.sim.presets import PRESETS, get_preset
from seerd.sim.report import SimSettings, format_table, is_sim_policy, run_comparison, summarize
from seerd.sim.spec import PAPER_TABLE_2, AcceptanceTable, Speculation, acceptance_table
from seerd.sim.workload import SimGroup, Workload

QWEN = get_preset("qwen2-vl-72b")
CPU = get_preset("cpu-tiny")
GRID = (1, 2, 4, 8, 16, 32, 64)


def workload(lengths_per_group: list[list[int]], prompt_len: int = 32, max_tokens: int = 512) -> Workload:
    return Workload(tuple(SimGroup(i, prompt_len, max_tokens, tuple(ls)) for i, ls in enumerate(lengths_per_group)),
                    "hand-made")


def run(work: Workload, policy: str, speculation: Speculation | None, *, costs=None, instances: int = 2,
        kv: int = 4000, chunk: int = 64, max_num_seqs: int = 16, seed: int = 0,
        gap: float = 0.0) -> tuple[Simulation, SimResult]:
    sim = Simulation(work, policy, costs or QWEN.costs(), instances=instances, chunk_tokens=chunk,
                     max_num_seqs=max_num_seqs, seed=seed, pool_hit_rate=0.5, kv_capacity=kv, chunk_gap_s=gap,
                     speculation=speculation)
    return sim, sim.run()


def table(*rows: tuple[int, float]) -> AcceptanceTable:
    return AcceptanceTable("test", rows)


def flat_cpu_costs() -> ProfiledCosts:
    """cpu-tiny's decode profile with drafts that cost nothing: verification time flat in depth."""
    flat = StepTimeModel(GRID, tuple(tuple(0.01 for _ in range(9)) for _ in GRID))
    return ProfiledCosts(CPU.costs().profile, CPU.kv_tokens, flat)


def comparable(result: SimResult) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k != "wall_s"}


# ----------------------------------------------------------------- the acceptance table
@pytest.mark.parametrize("acceptance", [PAPER_TABLE_2, acceptance_table("cpu-motif")])
def test_per_position_acceptance_gives_the_tables_tokens_per_step_at_its_depth(acceptance) -> None:
    for n, tokens in acceptance.rows:
        beta = acceptance.beta(n, acceptance.depth)
        assert expected_tokens(beta, acceptance.depth) == pytest.approx(tokens, abs=1e-9)
        assert beta[0] == 1.0 and all(a > b for a, b in zip(beta, beta[1:]))  # deeper: less likely
        assert expected_tokens(beta, 1) < tokens  # shallower drafts yield less


def test_the_paper_table_interpolates_in_n_and_holds_past_its_last_row() -> None:
    assert PAPER_TABLE_2.tokens_per_step(0) == 1.70 and PAPER_TABLE_2.tokens_per_step(1) == 2.04
    assert PAPER_TABLE_2.tokens_per_step(3) == pytest.approx((2.04 + 2.32) / 2)
    assert PAPER_TABLE_2.tokens_per_step(10) == pytest.approx((2.32 + 2.53) / 2)
    assert PAPER_TABLE_2.tokens_per_step(40) == 2.53
    assert PAPER_TABLE_2.conditional(0) == pytest.approx(0.412, abs=1e-3)
    assert PAPER_TABLE_2.conditional(15) == pytest.approx(0.609, abs=1e-3)
    assert table((0, 1.0)).conditional(0) == pytest.approx(0.0, abs=1e-12)  # the bonus token only


def test_a_table_loads_from_its_own_json_and_from_the_benchmarks_output(tmp_path) -> None:
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"source": "here", "tokens_per_step": {"5": 2.0, "0": 1.5}}))
    loaded = AcceptanceTable.load(own)
    assert loaded.rows == ((0, 1.5), (5, 2.0)) and loaded.depth == 8 and loaded.source == "here"
    bench = tmp_path / "bench.json"  # what tools/bench/draft_acceptance.py --json prints
    bench.write_text(json.dumps({"run_dir": "r", "groups": 24, "table": {
        "grouped": {"0": {"accepted_per_step": 0.69}, "15": {"accepted_per_step": 1.11}},
        "request": {"0": {"accepted_per_step": 0.69}, "15": {"accepted_per_step": 0.69}}}}))
    for loaded in (AcceptanceTable.load(bench), acceptance_table(str(bench))):
        assert [n for n, _ in loaded.rows] == [0, 15]
        assert [tokens for _, tokens in loaded.rows] == pytest.approx([1.69, 2.11])
    for text, says in (("{}", "unreadable"), ('{"tokens_per_step": {"0": 12}}', "outside 1..9"),
                       ('{"tokens_per_step": {}}', "ascending")):
        own.write_text(text)
        with pytest.raises(ValueError, match=says):
            AcceptanceTable.load(own)
    with pytest.raises(ValueError, match="neither"):
        acceptance_table(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------- the cost of drafted steps
@pytest.mark.parametrize("preset", list(PRESETS))
def test_drafted_segments_are_the_exact_sum_of_their_steps(preset: str) -> None:
    costs = get_preset(preset).costs()
    for batch, context, steps, drafts, growth in [(1, 100, 7, 3, 2.4), (64, 200_000, 50, 128, 101.5),
                                                  (16, 4000, 300, 16 * 8, 37.0)]:
        summed = sum(costs.step_time(batch, context + i * growth, drafts) for i in range(steps))
        assert math.isclose(costs.segment_time(batch, context, steps, drafts, growth), summed, rel_tol=1e-9)
        budget = costs.segment_time(batch, context, steps, drafts, growth)
        assert costs.steps_within(batch, context, 10 * steps, budget, drafts, growth) == steps


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_draft_token_never_makes_a_step_cheaper(preset: str) -> None:
    costs = get_preset(preset).costs()
    for batch in (1, 2, 8, 32, 256):
        times = [costs.step_time(batch, 1000 * batch, depth * batch) for depth in range(9)]
        assert times == sorted(times)  # the CPU profile's noise is removed by a running maximum


def test_verifying_drafts_is_nearly_free_on_a_memory_bound_gpu_step_until_compute_binds() -> None:
    costs = QWEN.costs()
    small = costs.step_time(8, 60_000, 8 * 8) / costs.step_time(8, 60_000)
    large = costs.step_time(256, 1_000_000, 256 * 8) / costs.step_time(256, 1_000_000)
    assert small < 1.15 < 2 < large


def test_a_measured_profile_without_a_spec_profile_cannot_cost_drafts() -> None:
    costs = ProfiledCosts(CPU.costs().profile, 5120)
    assert costs.segment_time(4, 100, 10) > 0
    with pytest.raises(ValueError, match="no spec profile"):
        costs.step_time(4, 100, drafts=8)


# ----------------------------------------------------------------- what speculation changes
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=4), min_size=1, max_size=8),
       policy=st.sampled_from(["group", "divided", "seer", "oracle"]), chunk=st.sampled_from([16, 64, 1000]),
       seed=st.integers(0, 3), gap=st.sampled_from([0.0, 0.05]), mode=st.booleans())
def test_speculation_never_changes_what_a_request_produces(groups, policy, chunk, seed, gap, mode) -> None:
    work = workload(groups)
    spec = Speculation(PAPER_TABLE_2, grouped=mode)
    _, plain = run(work, policy, None, chunk=chunk, seed=seed, gap=gap, kv=1500, max_num_seqs=6)
    sim, drafted = run(work, policy, spec, chunk=chunk, seed=seed, gap=gap, kv=1500, max_num_seqs=6)
    assert all(r.finished_at is not None for r in sim.requests.values())
    assert [sim.state.requests[rid].generated for rid in sim.requests] == [r.true_length for r in
                                                                         sim.requests.values()]
    assert not sim.state.leases and not len(sim.state.queue)
    assert (drafted.requests, drafted.output_tokens) == (plain.requests, plain.output_tokens)
    assert all(peak <= drafted.kv_capacity for peak in drafted.peak_kv)
    if policy != "group":
        assert drafted.preemptions == 0  # the scheduler's KV admission holds with drafts too


def test_with_nothing_accepted_beyond_the_bonus_token_the_planner_turns_speculation_off() -> None:
    work = workload([[300, 120, 40, 200], [30, 30, 400, 60], [250] * 4, [90, 500, 20, 20]])
    nothing = Speculation(table((0, 1.0)))
    for policy in ("group", "divided", "seer"):
        for gap in (0.0, 0.05):
            plain = Simulation(work, policy, QWEN.costs(), instances=2, chunk_tokens=64, max_num_seqs=8, seed=1,
                               pool_hit_rate=0.5, kv_capacity=3000, chunk_gap_s=gap).run()
            drafted = Simulation(work, policy, QWEN.costs(), instances=2, chunk_tokens=64, max_num_seqs=8, seed=1,
                                 pool_hit_rate=0.5, kv_capacity=3000, chunk_gap_s=gap, speculation=nothing).run()
            assert drafted.spec_steps == drafted.drafted_tokens == 0
            assert comparable(drafted) == comparable(plain)


def test_high_acceptance_and_free_drafts_shorten_the_rollout() -> None:
    work = workload([[400, 300, 200, 100]] * 6)
    eager = Speculation(table((0, 8.0)))  # ~7 of 8 drafts accepted per step
    _, plain = run(work, "seer", None, costs=flat_cpu_costs())
    _, drafted = run(work, "seer", eager, costs=flat_cpu_costs())
    assert drafted.output_tokens == plain.output_tokens
    assert drafted.total_time_s < 0.3 * plain.total_time_s
    assert drafted.spec_steps == drafted.decode_steps and drafted.tokens_per_sequence_step > 6


def test_on_the_cpu_drafts_pay_more_in_the_small_batches_of_the_tail_than_overall() -> None:
    """cpu-tiny: each extra token costs step time on this CPU, so drafts pay in small batches."""
    config = SimSettings(CPU, chunk_tokens=CPU.chunk_tokens, record_timeline=False)
    runs = run_comparison(config, ["seer", "seer+sd"], [0, 1])
    for plain, drafted in zip(runs["seer"], runs["seer+sd"]):
        assert drafted.output_tokens == plain.output_tokens
        assert drafted.total_time_s < plain.total_time_s
        assert drafted.tail_time_s / plain.tail_time_s < drafted.total_time_s / plain.total_time_s


def test_speculative_runs_are_deterministic_per_seed() -> None:
    config = SimSettings(QWEN, chunk_tokens=4096, pool_hit_rate=0.5, requests=320, record_timeline=False)

    def report(seed: int) -> dict:
        summary = summarize(run_comparison(config, ["group+sd", "seer+sd"], [seed]))
        return {p: {k: v for k, v in e.items() if k != "sim_wall_s"} for p, e in summary.items()}

    assert report(1) == report(1)
    assert report(1) != report(2)


def test_a_finished_sibling_raises_acceptance_on_another_instance_at_once() -> None:
    """One instance runs the group's short probe, the other its long response: when the probe
    finishes, the other instance re-plans then (not at its chunk's end), and with group context
    the long response goes faster than without."""
    work = workload([[20, 400]])
    times = {}
    for grouped in (True, False):
        sim, _ = run(work, "divided", Speculation(PAPER_TABLE_2, grouped=grouped), chunk=1000, max_num_seqs=1)
        probe_end = sim.requests[0].finished_at
        replans = [t for t, running, _ in sim.instances[1].timeline if running]
        assert len(replans) == (2 if grouped else 1)  # its admission, and with group context the refresh
        if grouped:
            step = QWEN.costs().step_time(1, 2000, 8)
            assert probe_end <= replans[1] <= probe_end + step
        times[grouped] = sim.requests[1].finished_at
    assert times[True] < times[False]


# ----------------------------------------------------------------- the command and the report
def test_sd_policies_are_named_by_a_suffix() -> None:
    assert all(is_sim_policy(name) for name in ("seer+sd", "group+sd", "divided+sd", "oracle+sd",
                                                 "seer+prior+sd", "seer-revealed:0.2+sd"))
    assert not is_sim_policy("seer+sd+sd") and not is_sim_policy("fast+sd")


def test_sim_command_reports_the_papers_sd_row_beside_ours() -> None:
    result = CliRunner().invoke(cli, ["sim", "--preset", "qwen2-vl-72b", "--requests", "160", "--policies",
                                      "group,seer,seer+sd", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["paper"]["seer_sd_x"] == 2.04
    assert doc["speculation"]["mode"] == "grouped" and doc["speculation"]["gamma_max"] == 8
    assert [row["tokens_per_step"] for row in doc["speculation"]["acceptance"]["rows"]] == [1.70, 2.04, 2.32, 2.53]
    entry = doc["policies"]["seer+sd"]
    assert entry["tokens_per_sequence_step"] > 1.2 and 0 < entry["draft_acceptance"] < 1
    assert doc["policies"]["seer"]["tokens_per_sequence_step"] == 1.0
    text = format_table(doc["policies"], QWEN)
    header, _, *rows = text.splitlines()
    assert "tok/step" in header and rows[2].startswith("seer+sd") and rows[2].rstrip().endswith("2.04")


def test_sim_command_spec_options_and_their_errors(tmp_path) -> None:
    fast = ["sim", "--preset", "cpu-tiny", "--requests", "64", "--policies", "seer+sd"]
    result = CliRunner().invoke(cli, [*fast, "--spec-mode", "request", "--spec-depth", "4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["speculation"]["mode"] == "request" and doc["speculation"]["acceptance"]["name"] == "cpu-motif"
    text = CliRunner().invoke(cli, fast)
    assert "acceptance cpu-motif: n=0 1.69" in text.output
    for args, says in ((["--spec-acceptance", str(tmp_path / "none.json")], "neither"),
                       (["--spec-depth", "0"], "depth of at least 1")):
        bad = CliRunner().invoke(cli, [*fast, *args])
        assert bad.exit_code == 2 and says in bad.output
    profile = tmp_path / "profile.json"  # a measured profile alone has no spec profile
    profile.write_text(json.dumps(CPU.costs().profile))
    bad = CliRunner().invoke(cli, ["sim", "--preset", "qwen2-vl-72b", "--requests", "64", "--policies", "seer+sd",
                                   "--profile", str(profile), "--kv-tokens", "200000", "--chunk-tokens", "1024"])
    assert bad.exit_code == 2 and "no spec profile" in bad.output


def test_the_cpu_preset_drafts_with_the_shipped_spec_profile() -> None:
    costs = CPU.costs()
    assert costs.spec_profile == StepTimeModel.load(DEFAULT_CPU_PROFILE)
    assert costs.step_time(1, 100, 8) > costs.step_time(1, 100) + 8e-5 * 0.9  # drafting time charged
