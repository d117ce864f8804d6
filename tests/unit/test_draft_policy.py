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



# ---- the step cost measured in the engine (MeasuredStepCost) -------------------------------------

def test_a_measured_cost_without_measurements_is_the_profile() -> None:
    from seerd.drafts.policy import MeasuredStepCost

    profile = cpu_like()
    cost = MeasuredStepCost(profile)
    assert all(cost.step_time(b, g) == profile.step_time(b, g) for b in (1, 3, 17, 64, 200) for g in range(9))


def feed(cost, rows: int, per_row_s: float, per_draft_s: float, steps: int) -> None:  # noqa: ANN001
    """Steps of `rows` sequences whose draft tokens vary by step (rows match or do not), timed
    as an engine would: per_row_s per sequence plus per_draft_s per draft token."""
    for step in range(steps):
        drafted = (step % 4) * rows // 2  # 0, 0.5, 1, 1.5 draft tokens per sequence
        cost.observe(rows, drafted, rows * per_row_s + drafted * per_draft_s)


def test_drafts_that_cost_more_than_the_profile_said_turn_drafting_off_at_that_batch_size_only() -> None:
    from seerd.drafts.policy import MeasuredStepCost

    # The profile: a draft token costs a fifth of a sequence, so at acceptance 0.7 drafting pays
    # at every batch size.
    profile = StepTimeModel(BATCHES, tuple(tuple(0.0002 * b * (1 + 0.2 * g) for g in range(9)) for b in BATCHES))
    beta = geometric(0.7)
    assert choose_depths(0, 64, beta, beta, profile, 8, 2.0).low > 0
    assert choose_depths(0, 2, beta, beta, profile, 8, 2.0).low > 0
    cost = MeasuredStepCost(profile)
    # Measured at 64 sequences: a draft token costs as much as a sequence's whole step.
    feed(cost, 64, per_row_s=0.0003, per_draft_s=0.0003, steps=400)
    assert choose_depths(0, 64, beta, beta, cost, 8, 2.0).low == 0
    assert cost.step_time(64, 2) == pytest.approx(64 * 0.0003 * 3, rel=0.15)  # the prior weighs a little
    # Other batch sizes keep the profile until they are measured themselves.
    assert choose_depths(0, 2, beta, beta, cost, 8, 2.0).low > 0
    assert cost.step_time(2, 2) == profile.step_time(2, 2)


def test_drafts_cheaper_than_the_profile_said_turn_drafting_on() -> None:
    from seerd.drafts.policy import MeasuredStepCost

    profile = StepTimeModel(BATCHES, tuple(tuple(0.0002 * b * (1 + 0.9 * g) for g in range(9)) for b in BATCHES))
    beta = geometric(0.6)
    assert choose_depths(0, 16, beta, beta, profile, 8, 2.0).low == 0
    cost = MeasuredStepCost(profile)
    feed(cost, 16, per_row_s=0.0002, per_draft_s=0.00001, steps=400)
    assert choose_depths(0, 16, beta, beta, cost, 8, 2.0).low > 0


def test_a_measured_slope_is_never_negative_and_fades_back_to_the_profile() -> None:
    from seerd.drafts.policy import MeasuredStepCost

    profile = cpu_like()
    cost = MeasuredStepCost(profile, half_life_steps=50)
    for step in range(200):  # noise that would fit drafts making a step cheaper
        drafted = (step % 2) * 64
        cost.observe(64, drafted, 0.02 if drafted else 0.03)
    assert cost.step_time(64, 4) >= cost.step_time(64, 0)
    # Drafting turned off: only undrafted steps arrive, at the profile's own cost, for many half
    # lives; the measured slope is forgotten and the profile's returns.
    for _ in range(2000):
        cost.observe(64, 0, 64 * profile.step_time(96, 0) / 96)
    ratio = cost.step_time(64, 4) / cost.step_time(64, 0)
    assert ratio == pytest.approx(profile.step_time(64, 4) / profile.step_time(64, 0), rel=0.02)
