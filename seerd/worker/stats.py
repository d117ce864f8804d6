"""A worker's own figures, sent with every heartbeat and shown by `seerd status`.

The coordinator learns of tokens only when a chunk ends; a chunk of 1,000 tokens on a slow
engine can run for minutes. So each heartbeat carries what the worker sees in between: tokens so
far of each running chunk (and when that last changed: a chunk stuck at the same count is the
sign of a hung engine), the engine's KV use, and its recent tokens/s. They are ephemeral: the
coordinator keeps the last payload per worker in the database (`workers.stats_json`), nothing
more.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RECENT_WINDOW_S = 10.0  # "tokens/s now": long enough to span a few heartbeats and chunk ends


@dataclass
class RunningChunk:
    tokens: int = 0
    changed_at: float = field(default_factory=time.time)


class WorkerStats:
    def __init__(self, clock=time.time) -> None:  # noqa: ANN001
        self.clock = clock
        self.started = clock()
        self.chunks_done = 0
        self.tokens_out = 0  # tokens of finished chunks
        self.running: dict[int, RunningChunk] = {}  # chunk id -> live progress
        self._ended: set[int] = set()  # done, counted in tokens_out, not yet reported
        self._totals: deque[tuple[float, int]] = deque()  # (time, tokens incl. in flight)

    def chunk_done(self, chunk_id: int, num_tokens: int) -> None:
        self.chunks_done += 1
        self.tokens_out += num_tokens
        self.running.pop(chunk_id, None)
        self._ended.add(chunk_id)  # until its report is through, the worker still lists it

    def payload(self, running: dict[int, tuple[str, int]], engine_live, spec: dict | None = None,  # noqa: ANN001
                kv_pool: dict | None = None, engine: dict | None = None) -> dict:
        """The heartbeat's `stats`: `running` maps chunk id -> (the lease key c{id}e{epoch} of the
        engine request it runs in, that request's tokens before the chunk: a chunk continued in
        place runs in the request its predecessor started);
        `engine_live` is the engine's latest `EngineLive` or None; `spec` the drafter's totals
        (drafted, accepted, ...) when seerd's drafter runs in this process; `kv_pool` the KV pool
        connector's counters (blocks loaded and saved, bytes, hits) when it runs in this process;
        `engine` the engine scheduler's totals (steps, preemptions, mean running sequences:
        `worker.engine.EngineCounters`) where the engine shows them."""
        now = self.clock()
        progress = engine_live.progress if engine_live is not None else {}
        for chunk_id in list(self.running):
            if chunk_id not in running:
                del self.running[chunk_id]
        self._ended &= running.keys()
        for chunk_id, (engine_key, start) in running.items():
            if chunk_id in self._ended:
                continue
            tokens = progress.get(engine_key)
            tokens = None if tokens is None else max(0, tokens - start)
            entry = self.running.setdefault(chunk_id, RunningChunk(changed_at=now))
            if tokens is not None and tokens != entry.tokens:
                entry.tokens, entry.changed_at = tokens, now
        in_flight = sum(entry.tokens for entry in self.running.values())
        self._totals.append((now, self.tokens_out + in_flight))
        while len(self._totals) > 2 and now - self._totals[1][0] >= RECENT_WINDOW_S:
            self._totals.popleft()
        first_at, first_total = self._totals[0]
        recent = (self._totals[-1][1] - first_total) / (now - first_at) if now > first_at else None
        return {
            "chunks_done": self.chunks_done,
            "tokens_out": self.tokens_out,
            "tokens_per_s": self.tokens_out / max(now - self.started, 1e-9),
            "tokens_per_s_recent": None if recent is None else max(0.0, recent),
            "kv_usage": None if engine_live is None else engine_live.kv_usage,
            "running": {str(cid): {"tokens": e.tokens, "changed_at": e.changed_at}
                        for cid, e in self.running.items()},
            "sampled_at": None if engine_live is None else engine_live.at,
            **({"spec": spec} if spec else {}),
            **({"kv_pool": kv_pool} if kv_pool else {}),
            **({"engine": engine} if engine else {}),
        }
