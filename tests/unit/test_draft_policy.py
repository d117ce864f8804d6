"""The adaptive draft depth policy (seerd/drafts/policy.py) on hand-made acceptance curves and step-time models."""

from __future__ import annotations

import json

import pytest

from seerd.drafts.policy import AcceptanceCurve, StepTimeModel, choose_depths, expected_tokens

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def linear_model(fixed_s: float, per_token_s: float, gamma_max: int = 8) -> StepTimeModel:
    """T(B, gamma) = fixed + per_token * B * (1 + gamma): a step pays per token it verifies."""
    return StepTimeModel(BATCHES, tuple(tuple(fixed_s + per_token_s * b * (1 + g) for g in range(gamma_max + 1))
                                        for b in BATCHES))


def cpu_like() -> StepTimeModel:
    """Fixed cost dominates at small batches (the tail), per-token cost at large ones (the body)."""
    return linear_model(fixed_s=0.004, per_token_s=0.0002)


def geometric(p: float, gamma_max: int = 8) -> list[float]:
    return [p ** k for k in range(gamma_max + 1)]


def test_speculation_is_off_at_large_batches_and_on_in_the_tail() -> None:
    beta = geometric(0.7)
    body = choose_depths(4, 60, beta, beta, cpu_like(), 8, 2.0)
    tail = choose_depths(1, 1, beta, beta, cpu_like(), 8, 2.0)
    assert (body.high, body.low) == (0, 0)
    assert tail.high > 0 and tail.low > 0


def test_drafts_get_deeper_as_the_batch_shrinks() -> None:
    beta = geometric(0.8)
    depths = [choose_depths(1, b - 1, beta, beta, cpu_like(), 8, 2.0).gamma_star for b in (2, 4, 8, 16, 32)]
    assert depths == sorted(depths, reverse=True)
    assert depths[0] > depths[-1]


def test_free_verification_drafts_to_the_maximum() -> None:
    flat = StepTimeModel(BATCHES, tuple(tuple(0.01 for _ in range(9)) for _ in BATCHES))
    plan = choose_depths(2, 6, geometric(0.6), geometric(0.6), flat, 8, 2.0)
    assert (plan.high, plan.low, plan.gamma_star) == (8, 8, 8)


def test_probes_are_favoured_when_the_budget_is_short() -> None:
    beta = geometric(0.7)
    plan = choose_depths(2, 14, beta, beta, cpu_like(), 8, 2.0)
    assert plan.gamma_star > 0
    assert plan.high > plan.low
    same_weight = choose_depths(2, 14, beta, beta, cpu_like(), 8, 1.0)
    assert same_weight.high <= plan.high


def test_a_class_with_poor_acceptance_gets_less_depth() -> None:
    plan = choose_depths(4, 4, geometric(0.3), geometric(0.9), cpu_like(), 8, 1.0)
    assert plan.gamma_star > 0
    assert plan.low > plan.high


def test_off_when_the_budget_cannot_give_every_probe_a_token() -> None:
    # gamma* = 1 for the whole batch, but the budget (gamma* * B) is spent in one-token steps per
    # class; with every request a probe the rule is simply: budget >= probes.
    model = linear_model(0.004, 0.0002)
    plan = choose_depths(0, 0, geometric(0.7), geometric(0.7), model, 8, 2.0)
    assert (plan.high, plan.low) == (0, 0)


def test_the_budget_is_never_exceeded() -> None:
    for p in (0.3, 0.6, 0.9):
        for high, low in ((1, 0), (0, 3), (3, 5), (8, 24)):
            plan = choose_depths(high, low, geometric(p), geometric(p), cpu_like(), 8, 2.0)
            assert plan.high * high + plan.low * low <= plan.budget


def test_acceptance_curve_counts_only_positions_that_were_reached() -> None:
    curve = AcceptanceCurve(gamma_max=4, prior_weight=0.0, half_life=1e12)
    curve.record(drafted=4, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 never reached
    curve.record(drafted=2, accepted=2)
    assert curve.reached[1:] == pytest.approx([2, 2, 1, 0])
    assert curve.accepted[1:] == pytest.approx([2, 2, 0, 0])
    assert curve.conditional(3) == 0.0
    beta = curve.beta()
    assert beta[:4] == pytest.approx([1.0, 1.0, 1.0, 0.0])
    assert expected_tokens(beta, 2) == pytest.approx(3.0)


def test_acceptance_curve_starts_from_its_prior_and_forgets() -> None:
    curve = AcceptanceCurve(gamma_max=2, prior=0.5, prior_weight=4.0, half_life=10.0)
    assert curve.beta() == pytest.approx([1.0, 0.5, 0.25])
    for _ in range(200):
        curve.record(drafted=1, accepted=0)
    for _ in range(200):
        curve.record(drafted=1, accepted=1)
    assert curve.conditional(1) > 0.85  # recent evidence dominates


def test_step_time_model_interpolates_and_round_trips(tmp_path) -> None:  # noqa: ANN001
    model = StepTimeModel((1, 4), ((1.0, 2.0), (4.0, 8.0)), draft_s_per_request=0.5)
    assert model.step_time(1, 0) == pytest.approx(1.0)
    assert model.step_time(2, 0) == pytest.approx(2.0)
    assert model.step_time(8, 0) == pytest.approx(8.0)  # extrapolated along the last segment
    assert model.step_time(2, 1) == pytest.approx(4.0 + 2 * 0.5)  # drafting cost only when drafting
    path = tmp_path / "profile.json"
    path.write_text(model.to_json())
    assert StepTimeModel.load(path) == StepTimeModel((1, 4), ((1.0, 2.0), (4.0, 8.0)), 0.5, model.source)


def test_step_time_model_refuses_bad_profiles(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="ascending"):
        StepTimeModel((4, 1), ((1.0,), (2.0,)))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"batch_sizes": [1], "seconds": []}))
    with pytest.raises(ValueError, match="unreadable"):
        StepTimeModel.load(path)


def test_the_shipped_cpu_profile_loads_and_says_off_in_the_body() -> None:
    from seerd.drafts.policy import DEFAULT_CPU_PROFILE

    model = StepTimeModel.load(DEFAULT_CPU_PROFILE)
    assert model.gamma_max >= 8
    body = choose_depths(8, 56, geometric(0.6), geometric(0.6), model, 8, 2.0)
    tail = choose_depths(1, 0, geometric(0.6), geometric(0.6), model, 8, 2.0)
    assert body.gamma_star <= tail.gamma_star
    assert tail.high > 0



# ---- whether drafting pays, measured on the engine's own steps (DraftGate) ------------------------

def steps(gate, rows: int, per_token_s: float, drafted: bool, count: int,  # noqa: ANN001
          tokens_per_row: float = 1.0) -> None:
    for _ in range(count):
        tokens = round(rows * tokens_per_row)
        gate.observe(rows, tokens, tokens * per_token_s, drafted)


def test_the_gate_allows_drafting_until_its_steps_say_otherwise_per_batch_size() -> None:
    from seerd.drafts.policy import DraftGate

    gate = DraftGate(cpu_like())
    assert all(gate.allows(b) for b in (1, 5, 64, 500))
    # At 40-63 sequences: undrafted steps 0.3 ms a token; drafted ones 1.6 tokens a sequence
    # per step but 0.5 ms a token.
    steps(gate, 48, 0.0003, drafted=False, count=20)
    steps(gate, 48, 0.0005, drafted=True, count=20, tokens_per_row=1.6)
    assert not gate.allows(48) and not gate.allows(33)
    assert gate.allows(64) and gate.allows(4)  # other buckets: not measured yet
    # At 2-3 sequences drafting gains more than it costs.
    steps(gate, 2, 0.004, drafted=False, count=20)
    steps(gate, 3, 0.002, drafted=True, count=20, tokens_per_row=2.0)
    assert gate.allows(2)
    assert gate.figures()["32"][1] > gate.figures()["32"][0]


def test_the_gate_compares_batch_sizes_within_a_bucket_through_the_profiles_shape() -> None:
    from seerd.drafts.policy import DraftGate

    profile = cpu_like()  # a step of 33 costs much more per token than one of 63 (the fixed part)
    gate = DraftGate(profile)
    # Undrafted steps at 33 and drafted ones at 63 sequences, each exactly at the profile's cost
    # per token: neither side is cheaper once the batch sizes are accounted for.
    for _ in range(20):
        gate.observe(33, 33, profile.step_time(33, 0), False)
        gate.observe(63, 63, profile.step_time(63, 0) * 1.02, True)
    assert not gate.allows(40)


def test_the_side_not_chosen_is_measured_again_once_its_evidence_fades() -> None:
    from seerd.drafts.policy import DraftGate

    gate = DraftGate(cpu_like(), half_life_steps=32, min_steps=8)
    steps(gate, 16, 0.001, drafted=False, count=20)
    steps(gate, 16, 0.0005, drafted=True, count=20)
    assert gate.allows(16)
    # Drafting goes on; the undrafted figure is older with every step until it no longer counts:
    # the gate asks for undrafted steps again, then compares afresh.
    steps(gate, 16, 0.0005, drafted=True, count=200)
    assert not gate.allows(16)
    steps(gate, 16, 0.0004, drafted=False, count=20)  # conditions changed: undrafted now cheaper
    assert not gate.allows(16)
    steps(gate, 16, 0.0006, drafted=True, count=5)
    assert not gate.allows(16)
