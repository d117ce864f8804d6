"""What a worker's chunk report means: is it well-formed, and does it finish its request?

Pure functions of the report and what the lease book knows of the chunk, so the rules live in
one place and are tested without a database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# "length_target": the worker ended the response at its target length (benchmark rows).
FINISH_REASONS = frozenset({"stop", "length", "length_target"})


class BadReport(ValueError):
    """A report that cannot be right whatever the lease state (too many tokens, bad fields)."""


class Report(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    duplicate: bool = False
    reason: str = ""
    request_finished: bool = False


@dataclass(frozen=True)
class Verdict:
    finished: bool  # the request is complete with this chunk
    finish_reason: str  # the request's, if finished (the chunk keeps the worker's own)


def validate(report: Report, budget: int, generated: int, target: int | None) -> None:
    """Raise `BadReport` unless the report can be right for a chunk of `budget` tokens of a
    request with `generated` tokens so far and, for benchmark rows, a `target` length."""
    if report.finish_reason not in FINISH_REASONS:
        raise BadReport(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {report.finish_reason!r}")
    if len(report.logprobs) != len(report.token_ids):
        raise BadReport(f"{len(report.token_ids)} token ids but {len(report.logprobs)} logprobs")
    if len(report.token_ids) > budget:
        raise BadReport(f"{len(report.token_ids)} tokens exceed the chunk budget {budget}")
    if not report.token_ids and report.finish_reason != "stop":
        raise BadReport("an empty chunk must end with finish_reason 'stop'")
    total = generated + len(report.token_ids)
    if target is not None and total > target:
        raise BadReport(f"{total} tokens pass the response's target length {target}")
    if report.finish_reason == "length_target" and target is None:
        raise BadReport("finish_reason 'length_target' for a request without a target length")
    if report.finish_reason == "length_target" and total != target:
        raise BadReport(f"finish_reason 'length_target' at {total} tokens, but the target is {target}")


def judge(report: Report, budget: int, generated: int, max_tokens: int, target: int | None) -> Verdict:
    """Whether a (valid) report finishes its request: EOS, the response's budget reached, a chunk
    shorter than its budget ("length" with room left: the model's context is full), or the
    target length reached (a worker that stopped there but called it "length" must not get a
    0-token chunk next)."""
    n_tokens = len(report.token_ids)
    total = generated + n_tokens
    at_target = total == target
    finished = (report.finish_reason in ("stop", "length_target") or total >= max_tokens
                or n_tokens < budget or at_target)
    reason = "length_target" if at_target and report.finish_reason == "length" else report.finish_reason
    return Verdict(finished, reason)
