"""How long will a group's longest response be? A forecast learned online from this rollout.

The paper's group estimate L_g is the longest finished response of the group. It is a lower
bound, and a poor one early: the first response to finish is often the group's shortest, and
with the within-group spread of chain-of-thought lengths a group's longest response is commonly
2-4x its first finished one. Scheduled on L_g alone, the long responses of such a group start
last and make the tail (docs/simulator.md, "Where seer loses").

`GrowthTable` learns, from the groups of this rollout that have completed, how much a group's
longest response exceeded what was known when k of its n responses had finished: the ratio
(final longest) / (longest of the first k to finish). It keeps the `quantile` (default 0.9) of
those ratios per (n, k), so the forecast errs long, as the paper asks ("update estimates
conservatively"). Nothing here is fitted offline: the ratios come from the run itself, so a
workload with tighter groups gets smaller ratios and a forecast close to L_g.

`group_forecast` combines, for one queued request's group:
- what finished: L_g x ratio(n, k), for k >= 1 finished responses; with none finished, the
  group's starting estimate as the paper has it (its max_tokens: "assume long"), or the earlier
  run's longest response with `--prior`;
- what still runs: the longest unfinished response's tokens so far x ratio(n, 1): an unfinished
  response of g tokens is treated like a finished one of (at least) g tokens, so a group whose
  responses keep running past its estimate is recognised as long without waiting for them;
capped at max_tokens. Until `MIN_COMPLETED_GROUPS` groups completed, every ratio is 1.

The table changes rarely (when the number of completed groups has grown by a quarter), and each
change has a new `version`, so a policy can keep its queue order indexed between changes.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_QUANTILE = 0.9
MIN_COMPLETED_GROUPS = 3  # with so few, the 0.9 quantile is their largest ratio: conservative
REFRESH_GROWTH = 1.25  # refresh the table when completed groups have grown by this factor


@dataclass(frozen=True)
class GrowthRatios:
    """An immutable table (n, k) -> ratio, as policies see it."""

    version: int = 0
    ratios: dict[tuple[int, int], float] = field(default_factory=dict)

    def ratio(self, n: int, k: int) -> float:
        return self.ratios.get((n, k), 1.0)


NO_GROWTH = GrowthRatios()


class GrowthTable:
    """Learns the growth ratios from completed groups (fed by the lease book or the simulator)."""

    def __init__(self, quantile: float = DEFAULT_QUANTILE, min_groups: int = MIN_COMPLETED_GROUPS) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_groups = min_groups
        self._samples: dict[tuple[int, int], list[float]] = {}
        self.completed_groups = 0
        self._refreshed_at = 0
        self.current = NO_GROWTH

    def observe_completed(self, lengths_in_finish_order: Sequence[int]) -> None:
        """A group finished: its response lengths, in the order the responses finished."""
        n = len(lengths_in_finish_order)
        if n < 2:
            return
        final = max(lengths_in_finish_order)
        longest = 0
        for k, length in enumerate(lengths_in_finish_order[:-1], 1):
            longest = max(longest, length)
            insort(self._samples.setdefault((n, k), []), final / max(1, longest))
        self.completed_groups += 1
        if (self.completed_groups >= self.min_groups
                and self.completed_groups >= self._refreshed_at * REFRESH_GROWTH):
            self._refresh()

    def _refresh(self) -> None:
        ratios = {key: values[min(len(values) - 1, int(self.quantile * len(values)))]
                  for key, values in self._samples.items()}
        self.current = GrowthRatios(self.current.version + 1, ratios)
        self._refreshed_at = self.completed_groups


def replay_growth(finishes: Iterable[tuple[int, int]], group_sizes: Mapping[int, int],
                  table: GrowthTable | None = None) -> tuple[GrowthTable, dict[int, list[int]]]:
    """The table as it was learned live, rebuilt from (group id, length) in finish order (into
    `table`, a new default one if None); with each group's finished lengths in that order."""
    table = GrowthTable() if table is None else table
    lengths: dict[int, list[int]] = {}
    completed: list[int] = []
    for group_id, length in finishes:
        done = lengths.setdefault(group_id, [])
        done.append(length)
        if len(done) == group_sizes[group_id]:
            completed.append(group_id)
    for group_id in completed:
        table.observe_completed(lengths[group_id])
    return table, lengths


class GroupProgress(Protocol):
    """What a forecast reads of a group (a queued request's view carries it for its group)."""

    group_size: int
    group_finished: int
    group_estimate: int
    group_longest_unfinished: int
    max_tokens: int


class RequestProgress(GroupProgress, Protocol):
    generated: int


def group_forecast(request: GroupProgress, growth: GrowthRatios) -> int:
    """The expected length of the longest response of `request`'s group (module docstring)."""
    n, k = request.group_size, request.group_finished
    known = request.group_estimate if k == 0 else request.group_estimate * growth.ratio(n, k)
    running = request.group_longest_unfinished * growth.ratio(n, 1)
    return min(request.max_tokens, round(max(known, running)))


def expected_remaining(request: RequestProgress, growth: GrowthRatios) -> int:
    """Tokens the request is expected still to generate: its group's forecast less what it has."""
    return max(group_forecast(request, growth), request.generated) - request.generated
