"""Workloads for the simulator: generated from a preset's statistics, or replayed from a trace.

The generator (lengths heavy-tailed across prompts, strongly correlated within a group):
    log L[g, k] = mu + sigma * (sqrt(1 - w) * z[g] + sqrt(w) * e[g, k]),   z, e ~ N(0, 1)
    L[g, k]     = clip(round(exp(log L)), 16, max_tokens)   (clipped ones finish by length)
- sigma = 1.0 (log-scale spread; with Qwen2-VL-72B's mean this spans a few hundred tokens to past
  the 40,960 cap within three sigma, the range the paper reports for chain-of-thought outputs);
- w = within_share (default 0.15): the within-group share of the log-variance, so responses of a
  group have log-length correlation 1 - w = 0.85 ("strongly correlated");
- mu is solved so that the mean of the clipped lognormal equals the preset's mean length
  (closed form: E[min(X, M)] = e^(mu + s^2/2) Phi((ln M - mu - s^2)/s) + M (1 - Phi((ln M - mu)/s))).
Prompt lengths: lognormal with sigma 0.5 around the preset's prompt mean, at least 16.
Iterations (`next_iteration`): the same prompts recur; each group's z drifts as an AR(1) process,
z' = rho z + sqrt(1 - rho^2) n with rho = 0.9, and responses are drawn afresh, so a prompt's
length is predictable from its last iteration but not exactly.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from seerd.sim.presets import Preset

LOG_SIGMA = 1.0
DEFAULT_WITHIN_SHARE = 0.15
PROMPT_LOG_SIGMA = 0.5
DRIFT_RHO = 0.9
MIN_LENGTH = 16


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True)
class SimGroup:
    index: int
    prompt_len: int
    max_tokens: int
    lengths: tuple[int, ...]  # true output length of each response
    latent: float = 0.0  # the generator's z (drifts across iterations)


@dataclass(frozen=True)
class Workload:
    groups: tuple[SimGroup, ...]
    source: str

    @property
    def requests(self) -> int:
        return sum(len(g.lengths) for g in self.groups)

    @property
    def output_tokens(self) -> int:
        return sum(sum(g.lengths) for g in self.groups)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    log_cap = math.log(cap)
    return (math.exp(mu + sigma * sigma / 2) * _phi((log_cap - mu - sigma * sigma) / sigma)
            + cap * (1.0 - _phi((log_cap - mu) / sigma)))


def solve_mu(mean: float, sigma: float, cap: float) -> float:
    if not 0 < mean < cap:
        raise ValueError(f"mean length {mean} must lie between 0 and max_tokens {cap}")
    lo, hi = -10.0, math.log(cap) + 10 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_lognormal_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _draw_lengths(rng: random.Random, mu: float, latent: float, n: int, within_share: float,
                  cap: int) -> tuple[int, ...]:
    across, within = math.sqrt(1.0 - within_share), math.sqrt(within_share)
    out = []
    for _ in range(n):
        log_len = mu + LOG_SIGMA * (across * latent + within * rng.gauss(0.0, 1.0))
        out.append(max(MIN_LENGTH, min(cap, round(math.exp(min(log_len, 50.0))))))
    return tuple(out)


def generate(preset: Preset, seed: int, *, within_share: float = DEFAULT_WITHIN_SHARE,
             requests: int | None = None) -> Workload:
    if not 0.0 <= within_share < 1.0:
        raise ValueError(f"within_share must be in [0, 1), got {within_share}")
    rng = random.Random(seed)
    mu = solve_mu(preset.mean_tokens, LOG_SIGMA, preset.max_tokens)
    n_groups = (requests or preset.requests) // preset.group_size
    if n_groups < 1:
        raise ValueError(f"{requests} requests make no group of {preset.group_size}")
    prompt_mu = math.log(preset.prompt_tokens) - PROMPT_LOG_SIGMA ** 2 / 2
    groups = []
    for index in range(n_groups):
        latent = rng.gauss(0.0, 1.0)
        prompt_len = max(MIN_LENGTH, round(math.exp(prompt_mu + PROMPT_LOG_SIGMA * rng.gauss(0.0, 1.0))))
        lengths = _draw_lengths(rng, mu, latent, preset.group_size, within_share, preset.max_tokens)
        groups.append(SimGroup(index, prompt_len, preset.max_tokens, lengths, latent))
    return Workload(tuple(groups), f"generated:{preset.name}:seed={seed}:w={within_share}")


def next_iteration(workload: Workload, preset: Preset, seed: int, *,
                   within_share: float = DEFAULT_WITHIN_SHARE) -> Workload:
    """The same prompts one RL iteration later: latents drift, responses are drawn afresh."""
    rng = random.Random(seed)
    mu = solve_mu(preset.mean_tokens, LOG_SIGMA, preset.max_tokens)
    groups = []
    for g in workload.groups:
        latent = DRIFT_RHO * g.latent + math.sqrt(1 - DRIFT_RHO ** 2) * rng.gauss(0.0, 1.0)
        lengths = _draw_lengths(rng, mu, latent, len(g.lengths), within_share, g.max_tokens)
        groups.append(SimGroup(g.index, g.prompt_len, g.max_tokens, lengths, latent))
    return Workload(tuple(groups), workload.source + "+1")


def load_trace(path: Path, preset: Preset) -> Workload:
    """JSONL, one line per request: {"group": id, "length": L, "prompt_len": P (optional),
    "max_tokens": M (optional)}.

    Groups are formed by id in order of first appearance. A group's max_tokens is its rows'
    `max_tokens` where given (a real run's cap: a response at it finished by length), else the
    larger of the preset's and the trace's longest response, so that a trace of real lengths
    replays on any preset's engines.
    """
    by_group: dict[object, list[int]] = {}
    prompt_of: dict[object, int] = {}
    cap_of: dict[object, int | None] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or "group" not in row or "length" not in row:
            raise TraceError(f'{where}: expected an object with "group" and "length"')
        cap = row.get("max_tokens")
        if cap is not None and (not _positive_int(cap)):
            raise TraceError(f"{where}: max_tokens must be a positive integer, got {cap!r}")
        length = row["length"]
        if not _positive_int(length) or (cap is not None and length > cap):
            raise TraceError(f"{where}: length must be an integer in 1..{cap if cap is not None else 'max_tokens'}, "
                             f"got {length!r}")
        prompt_len = row.get("prompt_len", preset.prompt_tokens)
        if not _positive_int(prompt_len):
            raise TraceError(f"{where}: prompt_len must be a positive integer, got {prompt_len!r}")
        key = row["group"]
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise TraceError(f"{where}: group must be an integer or a string")
        by_group.setdefault(key, []).append(length)
        if prompt_of.setdefault(key, prompt_len) != prompt_len:
            raise TraceError(f"{where}: group {key!r} has two prompt lengths ({prompt_of[key]} and {prompt_len})")
        if cap_of.setdefault(key, cap) != cap:
            raise TraceError(f"{where}: group {key!r} has two max_tokens ({cap_of[key]} and {cap})")
    if not by_group:
        raise TraceError(f"{path}: the trace holds no requests")
    default_cap = max(preset.max_tokens, max(max(lengths) for lengths in by_group.values()))
    groups = tuple(SimGroup(i, prompt_of[key], cap_of[key] or default_cap, tuple(lengths))
                   for i, (key, lengths) in enumerate(by_group.items()))
    return Workload(groups, f"trace:{Path(path).name}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
