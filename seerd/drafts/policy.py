"""Adaptive draft depth: the paper's Marginal-Benefit-Aware policy (Algorithm 1), per engine step.

Drafting pays when verifying gamma extra tokens per sequence costs less than the tokens it gains.
On a GPU a decode step is memory-bound and extra tokens are nearly free until the batch fills the
compute; on this CPU the step time grows with every token, so speculation pays only with few
sequences in flight (the tail). The policy therefore needs two measured things:

- `StepTimeModel`: T(B, gamma), the engine's step time with B sequences each carrying gamma
  draft tokens, profiled offline (`tools/profile_spec_steps.py`), plus the drafter's own CPU
  time per request; `DraftGate` checks it against the steps the engine really takes (a
  profile of one engine on a quiet machine is not the step of an engine sharing its cores with
  another engine, a coordinator and its own drafter);
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
    return 1 << (max(1, rows).bit_length() - 1)


class DraftGate:
    """Whether drafting pays at a batch size, measured on the engine's own steps.

    The depth policy trusts its step-time profile, measured on one engine on an idle machine. A
    rollout's engine steps beside another engine, a coordinator and its own drafter, and there
    drafts cost more: on this CPU, rollouts of the motif model drafted at 64 sequences, where the
    profile said a draft token costs a fifth of a sequence's step, and the engine ran a third
    slower per token than with drafting off. So the drafter times every step (the time between
    two of vLLM's calls to it) with the tokens it produced, and per power-of-two batch-size
    bucket keeps two exponentially forgotten averages of time per token, normalised by the
    profile's undrafted step at that batch size (so sizes within a bucket compare): one over steps
    that verified drafts, one over steps that did not. Drafting is allowed in a bucket while its
    drafted steps take no more time per token than its undrafted ones. Each side is tried again
    when its weight there fades below `min_steps` (a plan's few steps every few hundred), so a
    bucket follows the run (the tail's conditions are not the body's). Before any measurement,
    it allows drafting: the profile decides."""

    def __init__(self, prior: StepTimeModel, half_life_steps: float = 256.0, min_steps: float = 8.0) -> None:
        self.prior = prior
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.min_steps = min_steps
        self.buckets: dict[int, list[float]] = {}  # bucket -> [weight, time per token] x (undrafted, drafted)
        self.observed = 0

    def observe(self, rows: int, tokens: int, seconds: float, drafted: bool) -> None:
        """One step: `rows` sequences produced `tokens` tokens in `seconds`, verifying drafts or not."""
        if rows < 1 or tokens < 1 or seconds <= 0:
            return
        cell = self.buckets.setdefault(batch_bucket(rows), [0.0, 0.0, 0.0, 0.0])
        undrafted_step = self.prior.step_time(rows, 0)
        relative = (seconds / tokens) / (undrafted_step / rows)
        for side in (0, 2):
            cell[side] *= self.decay
        side = 2 if drafted else 0
        cell[side] += 1.0
        cell[side + 1] += (relative - cell[side + 1]) / cell[side]
        self.observed += 1

    def allows(self, batch: int) -> bool:
        cell = self.buckets.get(batch_bucket(batch))
        if cell is None:
            return True
        undrafted_weight, undrafted, drafted_weight, drafted = cell
        if drafted_weight < self.min_steps:
            return True  # (again) see what drafting costs here
        if undrafted_weight < self.min_steps:
            return False  # (again) see what a step costs here without drafts
        return drafted <= undrafted

    def figures(self) -> dict[str, list[float]]:
        """Per bucket: time per token (relative to the profile's undrafted step) without and with drafts."""
        return {str(b): [round(c[1], 3), round(c[3], 3)] for b, c in sorted(self.buckets.items())}


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
                  model: StepTimeModel, gamma_max: int, probe_weight: float) -> DepthPlan:
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
