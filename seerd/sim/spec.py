"""Speculative decoding in the simulator (the `+sd` policies): how many tokens a drafted step
yields, and the depth policy the workers run.

- `AcceptanceTable`: a request's expected tokens per step when drafted to the table's depth, by
  n, the number of its group's responses finished at that moment: the paper's Table 2
  (Qwen2-VL-72B, linear drafts, depth 8: n=0 1.70, n=1 2.04, n=5 2.32, n=15 2.53) or a measured
  table (`tools/bench/draft_acceptance.py` on the motif model). Linear in n between rows, the
  last row's value past it. `request` mode (no group context) always reads the n=0 row.
- Per-position acceptance from tokens per step: a constant conditional acceptance alpha(n) per
  draft position, the i.i.d. model behind the paper's T_SD formula, solved so that
      1 + alpha + alpha^2 + ... + alpha^depth = tokens per step at the table's depth;
  beta(k) = alpha^k is the chance the first k draft tokens are all accepted. At the table's depth
  the expected tokens per step equal the table by construction; shallower drafts yield less
  (paper, n=0: alpha 0.412, 1.41 tokens at depth 1; n=15: alpha 0.609, 1.61 at depth 1).
- `DepthPlanner`: at each scheduling point of an instance, the workers' own planner
  (`seerd.drafts.policy.choose_depths`, Algorithm 1) over the running batch: B_h probes and B_l
  other sequences, each class's beta the mean of its sequences' beta (what the worker's online
  curve per class converges to), and a `StepTimeModel` of this instance's step at its current
  batch and context (`costs.py`: a step verifies B + D tokens), so the planner sees exactly the
  step cost the simulator charges: a perfect profile.

The simulator advances a sequence by its expected tokens per step, 1 + beta(1) + ... + beta(d),
rather than drawing accepted tokens step by step: the engine jumps from event to event, and over
a chunk of hundreds of steps the drawn total would differ from the expectation by a few percent
at most; with no draws, a run stays deterministic per seed and a speculative run consumes the
seeded generator exactly as the plain one does.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from seerd.drafts.policy import DepthPlan, StepTimeModel, choose_depths, expected_tokens

if TYPE_CHECKING:
    from seerd.sim.costs import InstanceCosts, ProfiledCosts

PROFILE_DIR = Path(__file__).with_name("profiles")
TABLE_DEPTH = 8  # the paper's gamma_max, and tools/bench/draft_acceptance.py's DEPTH


@dataclass(frozen=True)
class AcceptanceTable:
    """Expected tokens per step (the bonus token included) at `depth`, by finished siblings n."""

    name: str
    rows: tuple[tuple[int, float], ...]  # (n, tokens per step), n ascending
    depth: int = TABLE_DEPTH
    source: str = ""

    def __post_init__(self) -> None:
        ns = [n for n, _ in self.rows]
        if not ns or ns != sorted(set(ns)) or ns[0] < 0:
            raise ValueError(f"acceptance table {self.name}: rows need distinct n >= 0 in ascending order")
        if self.depth < 1:
            raise ValueError(f"acceptance table {self.name}: depth must be at least 1")
        for n, tokens in self.rows:
            if not 1.0 <= tokens <= self.depth + 1:
                raise ValueError(f"acceptance table {self.name}: n={n} gives {tokens} tokens per step, "
                                 f"outside 1..{self.depth + 1} (depth {self.depth} plus the bonus token)")

    def tokens_per_step(self, n: int) -> float:
        """At the table's depth: linear in n between rows, the nearest row outside them."""
        rows = self.rows
        if n <= rows[0][0]:
            return rows[0][1]
        for (n0, t0), (n1, t1) in zip(rows, rows[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return rows[-1][1]

    def conditional(self, n: int) -> float:
        """alpha(n): the acceptance of each draft position given the ones before were accepted."""
        target = self.tokens_per_step(n)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # 1 + a + ... + a^depth rises with a: bisection
            mid = (lo + hi) / 2
            if sum(mid ** k for k in range(self.depth + 1)) < target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def beta(self, n: int, gamma_max: int) -> list[float]:
        """beta[k] = alpha(n)^k, k = 0..gamma_max: the chance the first k drafts are all accepted."""
        alpha = self.conditional(n)
        return [alpha ** k for k in range(gamma_max + 1)]

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "depth": self.depth,
                "rows": [{"n": n, "tokens_per_step": tokens, "alpha": round(self.conditional(n), 4)}
                         for n, tokens in self.rows]}

    @classmethod
    def load(cls, path: str | Path) -> AcceptanceTable:
        """A table in a JSON file, either
        {"source": ..., "depth": 8, "tokens_per_step": {"0": 1.69, "1": 1.87, ...}} or what
        `tools/bench/draft_acceptance.py --json` prints (its `grouped` drafter's accepted draft
        tokens per step, plus the bonus token, at its depth 8)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
            if "table" in raw:
                cells = raw["table"]["grouped"]
                rows = [(int(n), 1.0 + float(cell["accepted_per_step"])) for n, cell in cells.items()]
                source, depth = f"tools/bench/draft_acceptance.py: {raw.get('run_dir', path)}", TABLE_DEPTH
            else:
                rows = [(int(n), float(tokens)) for n, tokens in raw["tokens_per_step"].items()]
                source, depth = str(raw.get("source", path)), int(raw.get("depth", TABLE_DEPTH))
            return cls(str(raw.get("name", path.stem)), tuple(sorted(rows)), depth, source)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"acceptance table {path} is unreadable: {exc}") from exc


PAPER_TABLE_2 = AcceptanceTable(
    "paper-qwen2-vl-72b", ((0, 1.70), (1, 2.04), (5, 2.32), (15, 2.53)), TABLE_DEPTH,
    "Seer paper, Table 2: acceptance length on Qwen2-VL-72B, 20 groups, linear drafts, gamma_max 8")

# Named tables for `--spec-acceptance` (anything else is read as a file).
TABLES: dict[str, Callable[[], AcceptanceTable]] = {
    PAPER_TABLE_2.name: lambda: PAPER_TABLE_2,
    "cpu-motif": lambda: AcceptanceTable.load(PROFILE_DIR / "acceptance-cpu-motif.json"),
}


def acceptance_table(name_or_path: str) -> AcceptanceTable:
    if name_or_path in TABLES:
        return TABLES[name_or_path]()
    if not Path(name_or_path).is_file():
        raise ValueError(f"acceptance table {name_or_path!r}: neither one of {', '.join(TABLES)} nor a file")
    return AcceptanceTable.load(name_or_path)


@dataclass(frozen=True)
class Speculation:
    """What a `+sd` policy turns on, as `seerd run --spec grouped|request` configures a worker."""

    acceptance: AcceptanceTable
    grouped: bool = True  # False: `request` mode, drafts without group context (the n=0 row)
    gamma_max: int = 8  # --spec-depth
    probe_weight: float = 2.0  # --spec-probe-weight (the paper's lambda)

    def __post_init__(self) -> None:
        if self.gamma_max < 1 or self.probe_weight <= 0:
            raise ValueError("speculation needs a depth of at least 1 and a positive probe weight")

    def describe(self) -> dict:
        return {"mode": "grouped" if self.grouped else "request", "gamma_max": self.gamma_max,
                "probe_weight": self.probe_weight, "acceptance": self.acceptance.describe()}


class DraftedSequence(Protocol):
    """What the planner reads of a running sequence (the engine's `SimSeq`)."""

    group_index: int
    is_probe: bool


@dataclass(frozen=True)
class StepShape:
    """One instance's steps until its next scheduling point."""

    plan: DepthPlan
    rates: tuple[float, ...]  # expected tokens per step of each sequence, in the order given
    drafts: int  # draft tokens verified per step, over the batch

    @property
    def growth(self) -> float:
        return sum(self.rates)


class DepthPlanner:
    """The workers' depth policy for one simulated instance (see the module docstring)."""

    def __init__(self, speculation: Speculation, costs: InstanceCosts | ProfiledCosts,
                 finished_in_group: Callable[[int], int]) -> None:
        self.speculation = speculation
        self.costs = costs
        self.finished_in_group = finished_in_group
        self._beta: dict[int, list[float]] = {}
        self._expected: dict[tuple[int, int], float] = {}

    def siblings(self, group_index: int) -> int:
        """n for a request of this group: its finished responses (0 without group context)."""
        return self.finished_in_group(group_index) if self.speculation.grouped else 0

    def beta(self, n: int) -> list[float]:
        if n not in self._beta:
            self._beta[n] = self.speculation.acceptance.beta(n, self.speculation.gamma_max)
        return self._beta[n]

    def expected(self, n: int, depth: int) -> float:
        key = (n, depth)
        if key not in self._expected:
            self._expected[key] = expected_tokens(self.beta(n), depth)
        return self._expected[key]

    def _class_beta(self, counts: dict[int, int]) -> list[float]:
        total = sum(counts.values())
        betas = [(count, self.beta(n)) for n, count in counts.items()]
        return [sum(count * beta[k] for count, beta in betas) / total for k in range(self.speculation.gamma_max + 1)]

    def plan(self, seqs: Sequence[DraftedSequence], context: float) -> StepShape:
        """Depths for the batch `seqs` holding `context` KV tokens, and what they yield."""
        spec = self.speculation
        keys = [(seq.is_probe, self.siblings(seq.group_index)) for seq in seqs]
        probes: dict[int, int] = {}
        others: dict[int, int] = {}
        for (is_probe, n), count in Counter(keys).items():
            (probes if is_probe else others)[n] = count
        beta_high = self._class_beta(probes or others)  # an empty class's beta is never used
        beta_low = self._class_beta(others or probes)
        batch = len(seqs)
        model = StepTimeModel((batch,), (tuple(self.costs.step_time(batch, context, gamma * batch)
                                               for gamma in range(spec.gamma_max + 1)),),
                              source="this simulated instance at its current batch and context")
        plan = choose_depths(sum(probes.values()), sum(others.values()), beta_high, beta_low, model,
                             spec.gamma_max, spec.probe_weight)
        rate = {(is_probe, n): self.expected(n, plan.high if is_probe else plan.low) for is_probe, n in set(keys)}
        drafts = plan.high * sum(probes.values()) + plan.low * sum(others.values())
        return StepShape(plan, tuple(rate[key] for key in keys), drafts)
