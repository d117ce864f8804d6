"""Prometheus metrics of a running rollout, served by the coordinator on `/metrics`.

Read from the lease book at scrape time (a collector, not counters kept beside the book: the book
stays the one owner of its state), on the state thread like every other call into the book. The
endpoint takes a signed call like the rest of the API, or the read-only metrics token, which is
what Prometheus sends: `authorization: {credentials_file: RUN_DIR/metrics-token}` (docs/status.md).
`RefusalCollector` counts what the coordinator turned away (docs/security.md): strangers show here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from seerd.book.book import LeaseBook
from seerd.db.status import RequestStatus, WorkerStatus
from seerd.tail import finishes_before_tail


class RolloutCollector:
    def __init__(self, book: LeaseBook, worker_stats: dict[str, dict], accepting: Callable[[], bool],
                 clock: Callable[[], float]) -> None:
        self.book = book
        self.worker_stats = worker_stats
        self.accepting = accepting
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        state, now = self.book.state, self.clock()
        requests = GaugeMetricFamily("seerd_requests", "Requests of the rollout by state.", labels=["state"])
        # A request is queued, running (one chunk leased) or finished: the scheduler state knows which.
        by_state = {RequestStatus.QUEUED: len(state.queue), RequestStatus.RUNNING: len(state.leases),
                    RequestStatus.FINISHED: state.finished_requests}
        for status, count in by_state.items():
            requests.add_metric([status.value], count)
        yield requests
        queue = GaugeMetricFamily("seerd_queue_depth", "Requests waiting for their next chunk.", labels=["kind"])
        probes = sum(1 for r in state.queue if r.is_probe)
        queue.add_metric(["probe"], probes)
        queue.add_metric(["other"], len(state.queue) - probes)
        yield queue
        yield GaugeMetricFamily("seerd_leases_in_flight", "Chunks leased to workers now.", value=len(state.leases))
        groups = GaugeMetricFamily("seerd_groups", "Prompt groups by state.", labels=["state"])
        groups.add_metric(["unfinished"], len(state.unfinished_groups))
        groups.add_metric(["finished"], len(state.groups) - len(state.unfinished_groups))
        yield groups
        yield CounterMetricFamily("seerd_output_tokens", "Output tokens committed (finished chunks).",
                                  value=state.output_tokens)
        total, done = len(state.requests), state.finished_requests
        in_tail = total > 0 and done >= finishes_before_tail(total)
        yield GaugeMetricFamily("seerd_tail_requests",
                                "Unfinished requests once 90% have finished (the tail), else 0.",
                                value=total - done if in_tail else 0)
        yield GaugeMetricFamily("seerd_accepting", "1 while the coordinator hands out leases (0: draining).",
                                value=1 if self.accepting() else 0)
        yield from self._workers(now)

    def _workers(self, now: float) -> Iterator[Metric]:
        labels = ["worker"]
        alive = GaugeMetricFamily("seerd_worker_alive", "1 if the worker is alive.", labels=labels)
        running = GaugeMetricFamily("seerd_worker_running_chunks", "Chunks leased to the worker.", labels=labels)
        reserved = GaugeMetricFamily("seerd_worker_kv_reserved_tokens",
                                     "KV tokens reserved for the worker's chunks (context + budget).", labels=labels)
        capacity = GaugeMetricFamily("seerd_worker_kv_capacity_tokens", "The worker's KV capacity.", labels=labels)
        heartbeat = GaugeMetricFamily("seerd_worker_heartbeat_age_seconds", "Since the last heartbeat.",
                                      labels=labels)
        usage = GaugeMetricFamily("seerd_worker_kv_usage_ratio", "The engine's own KV block use (if shown).",
                                  labels=labels)
        rate = GaugeMetricFamily("seerd_worker_tokens_per_second", "The worker's recent output tokens/s.",
                                 labels=labels)
        total_rate = 0.0
        for worker in self.book.workers.values():
            load = self.book.state.workers[worker.id]
            label = [worker.id]
            is_alive = worker.status == WorkerStatus.ALIVE
            alive.add_metric(label, 1 if is_alive else 0)
            running.add_metric(label, len(load.chunks))
            reserved.add_metric(label, load.kv_reserved)
            capacity.add_metric(label, load.kv_capacity_tokens)
            heartbeat.add_metric(label, max(0.0, now - worker.last_heartbeat))
            stats = self.worker_stats.get(worker.id) or {}
            if stats.get("kv_usage") is not None:
                usage.add_metric(label, float(stats["kv_usage"]))
            if stats.get("tokens_per_s_recent") is not None and is_alive:
                rate.add_metric(label, float(stats["tokens_per_s_recent"]))
                total_rate += float(stats["tokens_per_s_recent"])
        yield from (alive, running, reserved, capacity, heartbeat, usage, rate)
        yield GaugeMetricFamily("seerd_output_tokens_per_second", "Recent output tokens/s over live workers.",
                                value=total_rate)


class RefusalCollector:
    """Calls refused by the signature check, by reason (auth.py), and connections the guard closed
    (guard.py), by reason, with the unproven connections open now."""

    def __init__(self, refused: dict[str, int], guard: Callable[[], object | None]) -> None:
        self.refused = refused
        self.guard = guard  # the daemon's ConnectionGuard, once its server runs

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily("seerd_api_refused", "Calls refused with 401, by reason.",
                                      labels=["reason"])
        for reason, count in sorted(dict(self.refused).items()):
            refused.add_metric([reason], count)
        yield refused
        guard = self.guard()
        if guard is None:
            return
        closed = CounterMetricFamily("seerd_api_connections_closed",
                                     "Connections closed by the API's limits, by reason.", labels=["reason"])
        for reason, count in asdict(guard.counters).items():
            closed.add_metric([reason], count)
        yield closed
        yield GaugeMetricFamily("seerd_api_unproven_connections",
                                "Open connections that have not made a signed call yet.",
                                value=guard.unproven_open)


def metrics_registry(*collectors: object) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry
