"""seerd's drafter inside vLLM: `speculative_config={"method": "custom_class", "model":
"seerd.drafts.drafter.SeerdDrafter", "num_speculative_tokens": gamma_max}`.

vLLM's model runner calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` after
every step, with one row per request of its input batch, and verifies whatever we return (so any
draft is safe: a wrong one costs verification time, never a wrong token). Request ids are not
passed; the runner that calls us has them (`input_batch.req_ids`, same order), and seerd's engine
request ids say which group, request and probe each row is (`seerd.protocol`).

Per step:
1. each row's newly sampled tokens extend its request's sequence in the local index, and tell the
   acceptance curves how many of last step's drafts were taken;
2. the depth policy splits the batch into probes and the rest and picks a depth per class from
   the step-time profile and the measured acceptance (`drafts.policy`), or `gamma_max` when
   fixed; drafting stays off at batch sizes where this engine's own steps (the time between two
   calls is one step) showed it costs more time per token than it saves (`DraftGate`);
3. each row drafts by longest suffix match against its group's index (grouped) or its own
   prompt and response only (request).

Settings come from the environment (`SEERD_DRAFT_SETTINGS`, JSON), which engine-core processes
inherit: the drafter is built by vLLM, not by us.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from seerd.drafts.index import SuffixIndex
from seerd.drafts.policy import (
    DEFAULT_CPU_PROFILE, OFF, AcceptanceCurve, DepthPlan, DraftGate, StepTimeModel, batch_bucket,
    choose_depths,
)
from seerd.protocol import ChunkIdentity, parse_engine_id

log = logging.getLogger("seerd.drafts")

SETTINGS_ENV = "SEERD_DRAFT_SETTINGS"  # = seerd.worker.vllm_args.DRAFTER_SETTINGS_ENV
REPLAN_EVERY_STEPS = 8  # the batch changes slowly; re-planning every step would cost more than it gains

_stats_lock = threading.Lock()
_live_drafters: list[SeerdDrafter] = []  # in this process (the stepped engine): the worker reads stats


def drafter_stats() -> dict | None:
    """Drafted/accepted totals of the drafters in this process, or None if there are none."""
    with _stats_lock:
        drafters = list(_live_drafters)
    if not drafters:
        return None
    totals = [d.stats() for d in drafters]
    merged = {key: sum(t[key] for t in totals) for key in ("drafted", "accepted", "drafted_rows", "steps",
                                                            "spec_steps", "propose_s", "proposals")}
    merged["sync_cpu_s"] = sum(t.get("sync_cpu_s", 0.0) for t in totals)
    by_batch: dict[str, list] = {}
    for t in totals:
        for bucket, cell in t["by_batch"].items():
            by_batch[bucket] = [a + b for a, b in zip(by_batch.get(bucket, [0] * len(cell)), cell)]
    merged["by_batch"] = by_batch
    merged["measured_steps"] = sum(t.get("measured_steps", 0) for t in totals)
    merged["gate"] = totals[-1]["gate"]
    merged["plan"] = totals[-1]["plan"]
    merged["median_us_per_row"] = totals[-1]["median_us_per_row"]
    merged["mode"] = totals[-1]["mode"]
    return merged


@dataclass
class TrackedRow:
    identity: ChunkIdentity
    response: list[int]  # the request's response tokens so far (what the index holds for it)
    index: SuffixIndex
    last_drafted: int = 0


class SeerdDrafter:
    def __init__(self, vllm_config) -> None:  # noqa: ANN001
        settings = json.loads(os.environ.get(SETTINGS_ENV) or "{}")
        self.mode = settings.get("mode", "grouped")
        if self.mode not in ("grouped", "request"):
            raise ValueError(f"seerd drafter mode must be grouped or request (got {self.mode!r})")
        self.gamma_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.probe_weight = float(settings.get("probe_weight", 2.0))
        self.adaptive = bool(settings.get("adaptive", True))
        self.min_prob = float(settings.get("min_prob", 0.0))
        profile = settings.get("profile_path") or str(DEFAULT_CPU_PROFILE)
        self.model = StepTimeModel.load(profile) if self.adaptive else None
        measured = self.model is not None and settings.get("measure_steps", True)
        self.gate = DraftGate(self.model) if measured else None
        self.clock = time.perf_counter
        self._step_started: float | None = None  # when the previous call began
        self._drafted_last = 0  # draft tokens the previous call returned: this step verified them
        self._planned_last = False  # whether the previous call's plan drafted
        self.curves = {True: AcceptanceCurve(self.gamma_max), False: AcceptanceCurve(self.gamma_max)}
        self.client = None
        if self.mode == "grouped":
            from seerd.drafts.client import DraftClient, HttpTransport

            run_dir = settings.get("run_dir")
            factory = (lambda: HttpTransport.from_run_dir(run_dir)) if run_dir else None
            self.client = DraftClient(factory, sync_interval_s=float(settings.get("sync_interval_s", 0.2)))
        self.rows: dict[str, TrackedRow] = {}
        self.runner = None
        self.plan: DepthPlan = OFF if self.adaptive else DepthPlan(self.gamma_max, self.gamma_max, self.gamma_max, 0)
        self._plan_key: tuple[int, int] | None = None
        self._steps_since_plan = REPLAN_EVERY_STEPS
        self.drafted = self.accepted = self.drafted_rows = self.steps = self.spec_steps = self.proposals = 0
        self.propose_s = 0.0
        self.failures = 0
        self.us_per_row: deque[float] = deque(maxlen=4096)  # recent steps' drafting time per row
        # Per batch-size bucket (as the engine counters' "4" = 4-7 rows): steps, rows, drafted
        # tokens, accepted tokens, the depth planned for the rest summed over steps.
        self.by_batch: dict[int, list[int]] = {}
        with _stats_lock:
            _live_drafters.append(self)

    def load_model(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 (model-free: nothing to load)
        return None

    def stats(self) -> dict:
        return {"mode": self.mode, "drafted": self.drafted, "accepted": self.accepted,
                "drafted_rows": self.drafted_rows, "steps": self.steps,
                "spec_steps": self.spec_steps, "propose_s": self.propose_s, "proposals": self.proposals,
                "sync_cpu_s": self.client.sync_cpu_s if self.client is not None else 0.0,
                "median_us_per_row": statistics.median(self.us_per_row) if self.us_per_row else None,
                "by_batch": {str(b): list(cell) for b, cell in sorted(self.by_batch.items())},
                "measured_steps": self.gate.observed if self.gate is not None else 0,
                "gate": self.gate.figures() if self.gate is not None else {},
                "plan": {"probe_depth": self.plan.high, "depth": self.plan.low, "gamma_star": self.plan.gamma_star}}

    # ------------------------------------------------------------------ the hook
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):  # noqa: ANN001, ANN201
        started = self.clock()
        req_ids = self._input_batch_req_ids()
        self._time_the_step(started, sampled_token_ids, req_ids)
        rows: list[TrackedRow | None] = []
        seen = set()
        accepted_before = self.accepted
        for i, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[i] if i < len(req_ids) else None
            seen.add(req_id)
            rows.append(self._observe(req_id, sampled, int(num_tokens_no_spec[i]), token_ids_cpu, i))
        for req_id in [r for r in self.rows if r not in seen]:
            self._forget(req_id)
        plan = self._plan(rows)
        drafts: list[list[int]] = []
        # The client's sync thread updates group indices: draft while it cannot.
        with self.client.lock if self.client is not None else contextlib.nullcontext():
            for i, row in enumerate(rows):
                depth = 0 if row is None else (plan.high if row.identity.is_probe else plan.low)
                depth = min(depth, self.max_model_len - int(num_tokens_no_spec[i]) - 1)
                draft = self._draft(row, depth) if depth > 0 else []
                if row is not None:
                    row.last_drafted = len(draft)
                self.drafted += len(draft)
                self.drafted_rows += bool(draft)
                drafts.append(draft)
        self._drafted_last = sum(map(len, drafts))
        self._planned_last = plan.high > 0 or plan.low > 0
        self.steps += 1
        self.spec_steps += any(drafts)
        tracked = sum(row is not None for row in rows)
        self.proposals += tracked
        if tracked:
            cell = self.by_batch.setdefault(batch_bucket(tracked), [0, 0, 0, 0, 0])
            cell[0] += 1
            cell[1] += tracked
            cell[2] += self._drafted_last
            cell[3] += self.accepted - accepted_before
            cell[4] += plan.low
        elapsed = self.clock() - started
        self.propose_s += elapsed
        if rows:
            self.us_per_row.append(1e6 * elapsed / len(rows))
        return drafts

    def _time_the_step(self, now: float, sampled_token_ids, req_ids) -> None:  # noqa: ANN001
        """The time since the previous call is one engine step (with this drafter's own share),
        which verified the previous call's drafts and produced the tokens sampled now. Not a
        step's cost: one that also prefilled a new request (its first sampled row: prefills come
        in bursts, and a few of them would decide a side that has few steps), or a much longer
        gap (the engine idle between requests)."""
        previous, self._step_started = self._step_started, now
        rows = sum(1 for sampled in sampled_token_ids if sampled)
        if self.gate is None or previous is None or not rows:
            return
        if any(sampled and (i >= len(req_ids) or req_ids[i] not in self.rows)
               for i, sampled in enumerate(sampled_token_ids)):
            return
        seconds = now - previous
        if seconds <= max(0.25, 8 * self.model.step_time(rows, -(-self._drafted_last // rows))):
            self.gate.observe(rows, sum(map(len, sampled_token_ids)), seconds, self._planned_last)

    def _draft(self, row: TrackedRow, depth: int) -> list[int]:
        try:
            return row.index.propose(row.response, depth, self.min_prob).tokens
        except Exception:  # a drafting bug must cost drafts, never the engine's step
            self.failures += 1
            if self.failures in (1, 100) or self.failures % 10000 == 0:
                log.exception("seerd drafter failed %d times; drafting nothing for those rows", self.failures)
            return []

    def _observe(self, req_id, sampled, num_tokens, token_ids_cpu, i) -> TrackedRow | None:  # noqa: ANN001
        if req_id is None or not sampled:
            return None  # nothing sampled this step (e.g. a prefill in progress): no draft
        row = self.rows.get(req_id)
        if row is None:
            identity = parse_engine_id(req_id)
            if identity is None:
                return None  # not a seerd chunk: leave it undrafted
            tokens = token_ids_cpu[i, :num_tokens].tolist()
            prompt, response = tokens[:identity.prompt_len], tokens[identity.prompt_len:]
            if self.client is not None:
                index = self.client.track(identity.group_id, identity.request_id, prompt, response)
            else:
                index = SuffixIndex()
                index.extend("prompt", prompt)
                index.extend(identity.request_id, response)
            row = self.rows[req_id] = TrackedRow(identity, response, index)
            return row
        if row.last_drafted:
            accepted = max(0, min(len(sampled) - 1, row.last_drafted))
            self.curves[row.identity.is_probe].record(row.last_drafted, accepted)
            self.accepted += accepted
        sampled = list(sampled)
        row.response.extend(sampled)
        if self.client is not None:
            self.client.extend_own(row.identity.group_id, row.identity.request_id, sampled)
        else:
            row.index.extend(row.identity.request_id, sampled)
        return row

    def _forget(self, req_id: str) -> None:
        row = self.rows.pop(req_id)
        if self.client is not None:
            self.client.untrack(row.identity.group_id, row.identity.request_id)

    def _plan(self, rows: list[TrackedRow | None]) -> DepthPlan:
        if not self.adaptive:
            return self.plan
        high = sum(1 for r in rows if r is not None and r.identity.is_probe)
        low = sum(1 for r in rows if r is not None and not r.identity.is_probe)
        self._steps_since_plan += 1
        if (high, low) != self._plan_key or self._steps_since_plan >= REPLAN_EVERY_STEPS:
            pooled = self.curves[True].merged(self.curves[False])
            beta_high = (self.curves[True] if self.curves[True].reached[1] >= 32 else pooled).beta()
            beta_low = (self.curves[False] if self.curves[False].reached[1] >= 32 else pooled).beta()
            plan = choose_depths(high, low, beta_high, beta_low, self.model, self.gamma_max,
                                 self.probe_weight)
            if (plan.high or plan.low) and self.gate is not None and not self.gate.allows(high + low):
                plan = DepthPlan(0, 0, plan.gamma_star, 0)  # measured here: drafting does not pay
            self.plan = plan
            self._plan_key, self._steps_since_plan = (high, low), 0
        return self.plan

    def _input_batch_req_ids(self) -> list[str]:
        """The calling model runner's request ids, in the order of this step's rows."""
        if self.runner is None:
            caller = sys._getframe(2).f_locals.get("self")  # propose <- runner.propose_draft_token_ids
            if caller is None or not hasattr(caller, "input_batch"):
                raise RuntimeError("seerd drafter: cannot find vLLM's model runner (vLLM changed how it "
                                   "calls custom proposers); run with --spec off or ngram")
            self.runner = caller
        return self.runner.input_batch.req_ids
