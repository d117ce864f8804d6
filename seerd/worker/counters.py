"""What a worker's engine did, from inside its stepping thread: steps, running sequences,
preemptions, where each step's wall time went (CPU, waiting for a core, the GIL), and the
engine's speed per batch size."""

from __future__ import annotations

from seerd.drafts.policy import batch_bucket


class EngineCounters:
    """What the engine's own scheduler did, cumulative: steps, running sequences summed over
    steps (their mean is the batch the engine kept), preemptions (vLLM evicting a running
    sequence when KV runs out, to recompute it later), and the seconds spent inside steps: wall,
    the stepping thread's CPU (`time.thread_time`) and its run-queue wait (`cpu.ThreadClock`);
    what is left of the wall time was spent blocked (on the GIL). Kept by the stepping thread
    from vLLM's in-process scheduler (v1 internals: `attach` returns None if they moved, and the
    figures are simply missing), read by the heartbeat: plain ints, no lock.

    Per batch size (`by_batch`): steps, seconds and generated tokens of the steps that decoded
    that many sequences, in power-of-two buckets ("4" holds 4-7). Tokens per second at a given
    batch size is the engine's speed there whatever responses were sampled, so runs that sample
    different responses (speculative decoding consumes randomness differently) still compare
    like for like. Needs the engine core's outputs (`count_outputs`); without them it stays empty."""

    def __init__(self, scheduler) -> None:  # noqa: ANN001
        self.scheduler = scheduler
        self.by_batch: dict[int, list] = {}  # bucket -> [steps, seconds, tokens]
        self._decoded = self._generated = 0  # the current step's, from the engine core's outputs
        self.steps = 0
        self.running_sum = 0
        self.preemptions = 0
        self.longest_step_s = 0.0
        self.step_s = self.step_cpu_s = self.step_runq_s = 0.0
        preempt = scheduler._preempt_request

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    @classmethod
    def attach(cls, llm) -> EngineCounters | None:  # noqa: ANN001
        try:
            scheduler = llm.engine_core.engine_core.scheduler
            len(scheduler.running)
            if not callable(scheduler._preempt_request):
                return None
        except (AttributeError, TypeError):
            return None
        counters = cls(scheduler)
        counters.count_outputs(llm.engine_core)
        return counters

    def count_outputs(self, core_client) -> None:  # noqa: ANN001
        """Count what each step generated from the in-process engine core client's outputs (one
        per request that got tokens, with `new_token_ids`). Left alone if vLLM moved them."""
        get_output = getattr(core_client, "get_output", None)
        if not callable(get_output):
            return

        def counted():  # noqa: ANN202
            outputs = get_output()
            try:
                new = [len(o.new_token_ids) for o in outputs.outputs]
            except (AttributeError, TypeError):
                return outputs
            self._decoded += sum(1 for n in new if n)
            self._generated += sum(new)
            return outputs

        core_client.get_output = counted

    def reset(self) -> None:
        """Forget what came before (the warm-up step's lazy initialisation, seconds here)."""
        self.steps = self.running_sum = self.preemptions = 0
        self.longest_step_s = self.step_s = self.step_cpu_s = self.step_runq_s = 0.0
        self.by_batch = {}
        self._decoded = self._generated = 0

    def after_step(self, seconds: float, cpu_seconds: float = 0.0, runq_seconds: float = 0.0) -> None:
        self.steps += 1
        self.running_sum += len(self.scheduler.running)
        self.longest_step_s = max(self.longest_step_s, seconds)
        self.step_s += seconds
        self.step_cpu_s += cpu_seconds
        self.step_runq_s += runq_seconds
        if self._decoded:
            cell = self.by_batch.setdefault(batch_bucket(self._decoded), [0, 0.0, 0])
            cell[0] += 1
            cell[1] += seconds
            cell[2] += self._generated
        self._decoded = self._generated = 0

    def figures(self) -> dict:
        return {"steps": self.steps, "preemptions": self.preemptions, "longest_step_s": self.longest_step_s,
                "step_s": self.step_s, "step_cpu_s": self.step_cpu_s, "step_runq_s": self.step_runq_s,
                "mean_running": self.running_sum / self.steps if self.steps else 0.0,
                "by_batch": {str(bucket): list(cell) for bucket, cell in sorted(self.by_batch.items())}}
