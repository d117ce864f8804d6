"""Adaptive draft depth: the paper's Marginal-Benefit-Aware policy (Algorithm 1), per engine step.

Drafting pays when verifying gamma extra tokens per sequence costs less than the tokens it gains.
On a GPU a decode step is memory-bound and extra tokens are nearly free until the batch fills the
compute; on this CPU the step time grows with every token, so speculation pays only with few
sequences in flight (the tail). The policy therefore needs two measured things:

- `StepTimeModel`: T(B, gamma), the engine's step time with B sequences each carrying gamma
  draft tokens, profiled offline (`tools/profile_spec_steps.py`), plus the drafter's own CPU
  time per request; `MeasuredStepCost` corrects it with the steps the engine really takes (a
  profile of one engine on a quiet machine is not the step of an engine sharing its cores with
  another engine, a coordinator and its own drafter: on this CPU it put drafts' cost at a
  third of what they cost in a rollout);
- `AcceptanceCurve`: per draft position k, the chance that position k is accepted given the
  positions before it were, measured online from what the engine accepted; beta(k) is the
  chance the first k are all accepted, so a request drafted to depth d yields
  1 + beta(1) + ... + beta(d) tokens per step on average.

Each step (Algorithm 1):
1. gamma* = argmin over gamma of the time per token T(B, gamma) / (B * E(gamma)), pooled over
   the batch; the step's draft budget is Gamma = gamma* * B tokens. gamma* = 0: off.
2. If Gamma < B_high (not even one draft token for every probe): off.
3. Hand the budget out one position at a time, to the class (probes, the rest) whose next position
   gains the most per token spent: weight * beta_class(d_class + 1), probes weighted by lambda.
   Greedy per token, not per position, because the budget is counted in tokens and a position for
   the larger class costs more of it.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_CPU_PROFILE = PROFILES_DIR / "cpu-motif-llama.json"


@dataclass(frozen=True)
class StepTimeModel:
    """T(B, gamma) on a grid of batch sizes (ascending) and depths 0..gamma_max; linear in B between
    grid points, linear extrapolation beyond the largest."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # seconds[i][gamma] for batch_sizes[i]
    draft_s_per_request: float = 0.0  # the drafter's own time per request per step
    source: str = ""

    def __post_init__(self) -> None:
        if not self.batch_sizes or len(self.batch_sizes) != len(self.seconds):
            raise ValueError("a step-time model needs one row of seconds per batch size")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError("batch sizes must be ascending, distinct and >= 1")
        if len({len(row) for row in self.seconds}) != 1:
            raise ValueError("every batch size needs the same depths")

    @property
    def gamma_max(self) -> int:
        return len(self.seconds[0]) - 1

    def step_time(self, batch: int, gamma: int) -> float:
        gamma = min(gamma, self.gamma_max)
        sizes = self.batch_sizes
        if batch <= sizes[0] or len(sizes) == 1:
            base = self.seconds[0][gamma] * max(1.0, batch / sizes[0])
        else:  # between grid points, or past the last one along the last segment
            i = min(bisect.bisect_left(sizes, batch), len(sizes) - 1)
            lo, hi = sizes[i - 1], sizes[i]
            t_lo, t_hi = self.seconds[i - 1][gamma], self.seconds[i][gamma]
            base = t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)
        drafting = self.draft_s_per_request * batch if gamma > 0 else 0.0
        return max(base, 1e-9) + drafting

    def to_json(self) -> str:
        return json.dumps({"batch_sizes": list(self.batch_sizes), "seconds": [list(r) for r in self.seconds],
                           "draft_s_per_request": self.draft_s_per_request, "source": self.source}, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(tuple(int(b) for b in raw["batch_sizes"]),
                       tuple(tuple(float(x) for x in row) for row in raw["seconds"]),
                       float(raw.get("draft_s_per_request", 0.0)), str(raw.get("source", path)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"step-time profile {path} is unreadable: {exc}") from exc


def batch_bucket(rows: int) -> int:
    """Power-of-two bucket of a batch size: 1, 2 (2-3), 4 (4-7), ... (as the engine counters')."""
    return 1 << (rows.bit_length() - 1)


class MeasuredStepCost:
    """T(B, gamma) as this engine really steps: the offline profile, scaled per batch-size bucket by
    what the drafter timed itself.

    Per bucket, a weighted least-squares line of a step's seconds per sequence against the draft
    tokens it verified per sequence, fitted to the measured steps (exponentially forgotten, half
    life `half_life_steps` of that bucket) and to the profile's own row as a prior worth
    `prior_steps` steps. `step_time(B, gamma)` is the profile's T(B, 0) scaled by the measured
    line's intercept against the profile's, plus the profile's cost of the gamma drafts scaled by
    the measured slope against the profile's: before any measurement, exactly the profile.
    The steps a drafter sees vary in draft tokens by themselves (rows match or do not), which
    measures the slope; when the plan turns drafting off, the measured drafted steps fade and the
    prior's slope returns, so a bucket is tried again after a few half lives (conditions change:
    the other engine goes idle in the tail)."""

    def __init__(self, prior: StepTimeModel, prior_steps: float = 16.0, half_life_steps: float = 256.0) -> None:
        self.prior = prior
        self.prior_steps = prior_steps
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.measured: dict[int, list[float]] = {}  # bucket -> decayed [w, wx, wxx, wy, wxy]
        self.observed = 0
        self._prior_sums: dict[int, list[float]] = {}

    @property
    def gamma_max(self) -> int:
        return self.prior.gamma_max

    def observe(self, rows: int, drafted: int, seconds: float) -> None:
        """One step: `rows` sequences decoded, `drafted` draft tokens verified, `seconds` of wall time."""
        if rows < 1 or seconds <= 0:
            return
        sums = self.measured.setdefault(batch_bucket(rows), [0.0] * 5)
        x, y = drafted / rows, seconds / rows
        for i, value in enumerate((1.0, x, x * x, y, x * y)):
            sums[i] = sums[i] * self.decay + value
        self.observed += 1

    def step_time(self, batch: int, gamma: int) -> float:
        bucket = batch_bucket(max(1, batch))
        if bucket not in self.measured:
            return self.prior.step_time(batch, gamma)
        (undrafted, per_draft), (prior_undrafted, prior_per_draft) = self._line(bucket, True), self._line(bucket, False)
        base = self.prior.step_time(batch, 0) * undrafted / prior_undrafted
        if gamma <= 0:
            return base
        if prior_per_draft > 1e-12:  # the profile's shape in B and gamma, scaled to what was measured
            drafts = (self.prior.step_time(batch, gamma) - self.prior.step_time(batch, 0)) * per_draft / prior_per_draft
        else:  # a profile where drafts cost nothing (a memory-bound GPU step): the measured slope
            drafts = batch * gamma * per_draft
        return base + max(0.0, drafts)

    def _line(self, bucket: int, with_measured: bool) -> tuple[float, float]:
        """(seconds per sequence with no drafts, seconds per draft token per sequence), the
        slope kept >= 0 (a draft token never makes a step cheaper)."""
        sums = list(self._prior(bucket))
        if with_measured:
            sums = [a + b for a, b in zip(sums, self.measured.get(bucket, (0.0,) * 5))]
        w, wx, wxx, wy, wxy = sums
        spread = w * wxx - wx * wx
        slope = max(0.0, (w * wxy - wx * wy) / spread) if spread > 1e-12 else 0.0
        return max((wy - slope * wx) / w, 1e-9), slope

    def _prior(self, bucket: int) -> list[float]:
        sums = self._prior_sums.get(bucket)
        if sums is None:
            # The profile's row at the bucket's middle batch size, at the depths steps really
            # verify per sequence (0-2: rows often draft nothing), so that the prior's leverage
            # on the slope is no greater than that of the few measured steps it stands for.
            batch = bucket + bucket // 2
            depths = range(min(2, self.gamma_max) + 1)
            weight = self.prior_steps / len(depths)
            sums = [0.0] * 5
            for gamma in depths:
                y = self.prior.step_time(batch, gamma) / batch
                for i, value in enumerate((1.0, gamma, gamma * gamma, y, gamma * y)):
                    sums[i] += weight * value
            self._prior_sums[bucket] = sums
        return sums


@dataclass
class AcceptanceCurve:
    """Per-position acceptance, measured online with exponential forgetting, starting from a prior."""

    gamma_max: int = 8
    prior: float = 0.5  # conditional acceptance assumed before any evidence
    prior_weight: float = 4.0  # ... worth this many observations per position
    half_life: float = 2000.0  # observations per position after which old evidence weighs half
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reached:
            self.reached = [0.0] * (self.gamma_max + 1)
            self.accepted = [0.0] * (self.gamma_max + 1)

    def record(self, drafted: int, accepted: int) -> None:
        """One request's step: `drafted` tokens proposed, the first `accepted` of them taken."""
        decay = 0.5 ** (1.0 / self.half_life)
        for k in range(1, min(drafted, self.gamma_max) + 1):
            if accepted < k - 1:
                break  # position k was never reached
            self.reached[k] = self.reached[k] * decay + 1.0
            self.accepted[k] = self.accepted[k] * decay + (1.0 if accepted >= k else 0.0)

    def conditional(self, k: int) -> float:
        weight = self.reached[k] + self.prior_weight
        return (self.accepted[k] + self.prior * self.prior_weight) / weight if weight > 0 else self.prior

    def beta(self) -> list[float]:
        """beta[k] = chance the first k draft tokens are all accepted (beta[0] = 1)."""
        out = [1.0]
        for k in range(1, self.gamma_max + 1):
            out.append(out[-1] * self.conditional(k))
        return out

    def merged(self, other: AcceptanceCurve) -> AcceptanceCurve:
        return AcceptanceCurve(self.gamma_max, self.prior, self.prior_weight, self.half_life,
                               [a + b for a, b in zip(self.reached, other.reached)],
                               [a + b for a, b in zip(self.accepted, other.accepted)])


def expected_tokens(beta: list[float], depth: int) -> float:
    """Tokens a request gains per step when drafted to `depth` (the bonus token included)."""
    return 1.0 + sum(beta[1:depth + 1])


@dataclass(frozen=True)
class DepthPlan:
    high: int  # draft depth for probes
    low: int  # for the rest
    gamma_star: int
    budget: int


OFF = DepthPlan(0, 0, 0, 0)


def choose_depths(batch_high: int, batch_low: int, beta_high: list[float], beta_low: list[float],
                  model: StepTimeModel | MeasuredStepCost, gamma_max: int, probe_weight: float) -> DepthPlan:
    """Algorithm 1 for one step (see the module docstring)."""
    batch = batch_high + batch_low
    gamma_max = min(gamma_max, model.gamma_max, len(beta_high) - 1, len(beta_low) - 1)
    if batch == 0 or gamma_max < 1:
        return OFF
    pooled = [(batch_high * h + batch_low * lo) / batch for h, lo in zip(beta_high, beta_low)]
    best_gamma, best_cost = 0, model.step_time(batch, 0) / batch
    for gamma in range(1, gamma_max + 1):
        cost = model.step_time(batch, gamma) / (batch * expected_tokens(pooled, gamma))
        if cost < best_cost * (1 - 1e-9):
            best_gamma, best_cost = gamma, cost
    budget = best_gamma * batch
    if best_gamma == 0 or budget < batch_high:
        return DepthPlan(0, 0, best_gamma, budget)
    depth = {"high": 0, "low": 0}
    size = {"high": batch_high, "low": batch_low}
    beta = {"high": beta_high, "low": beta_low}
    weight = {"high": probe_weight, "low": 1.0}
    left = budget
    while True:
        options = [(weight[c] * beta[c][depth[c] + 1], c) for c in ("high", "low")
                   if size[c] and depth[c] < gamma_max and size[c] <= left]
        if not options:
            break
        gain, chosen = max(options)
        if gain <= 0 or math.isnan(gain):
            break
        depth[chosen] += 1
        left -= size[chosen]
    return DepthPlan(depth["high"], depth["low"], best_gamma, budget)
