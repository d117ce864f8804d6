"""`seer`: context-aware scheduling, the Seer paper's Algorithm 2, on divided rollout.

Each time a worker asks for work, queued requests are served in this order:
1. the oldest starved request (queued longer than `starvation_s`, default 1800 s), at most
   `starved_per_call` (1) per lease call. This is the anti-starvation rule ("occasionally serve
   underserved groups" in the paper): a request starved at time T is served once the starved
   requests older than it have been, one per lease call that admits anything. In a batch
   rollout nothing waits forever anyway (no new work arrives), so the bound is a safety net set
   above the rollouts it should not disturb (docs/simulator.md, sensitivity).
2. probes (one speculative request per group), shortest generated length first: short probes
   finish and leave, long ones reveal the tail groups early;
3. every other request, started or not, most expected remaining tokens first: its group's
   forecast (`forecast.group_forecast`: the group's longest finished response L_g scaled by how
   much groups of this rollout grew after as many finishes, or the tokens so far of its longest
   unfinished response scaled the same way; max_tokens, or the `--prior`, while nothing has
   finished) less what the request has generated. Ties (groups with nothing finished are all at
   max_tokens): the group whose longest unfinished response has run furthest first, its probe
   has survived the most chunks so far; then oldest first.
   This is Algorithm 2's "longest estimate first" with two changes, each measured in the
   simulator (docs/simulator.md): the estimate is the forecast rather than L_g alone (L_g is
   the shortest-running member's length at first, and ordering on it started the long members
   of such groups last); and the order is by what remains rather than by the total, so that a
   long response a few chunks from its end yields to one that has all of it still to go (LPT).
   A response that runs past its group's forecast raises the forecast itself (the "running"
   term), so it is never left behind at a chunk boundary, which the literal order did to long
   responses of groups whose first finished response was short.
In-place continuation: a non-probe whose engine request runs on at the asking worker past the
chunk it reported (`Snapshot.continuing`) comes before every other non-probe, in the order above
(`base.continuing_first`): the order decides which request starts, not which running one is
stopped at a boundary; only a waiting probe, balance or KV room stops one.
Admission (`base.admit`): chunks only while the worker has free sequence slots and KV room for
the chunk's whole context plus its budget in whole blocks (no preemption by construction); a
request that fits only another worker is left for it; under KV pressure every chunk is lean (a
block or two of growth: `base.lean_budget`); one that fits no worker gets a shorter chunk that
fits, else it stops admission (nothing smaller overtakes a head that waits for room).
Affinity: a request whose previous chunk ran on another live worker with a free slot and KV room
for the chunk is left for that worker (its prefix cache holds the request), unless that worker has
`affinity_spread` more chunks in flight than the asking one (the paper uses 32 in-flight requests).
The home's free slots and KV room are counted down by the requests each plan leaves to it: one
free slot there holds back one request, not all it ran before while the asking worker idles.
Balance: the asking worker takes no more than keeps it within `balance_spread` (32) chunks in flight
of the least loaded worker with room (`balanced_slots`): the paper's "least loaded" routing; it
binds only while the queue cannot fill every worker's free slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

from seerd.scheduler.base import DEFAULT_BALANCE_SPREAD, admit, balanced_slots, continuing_first, whole_chunk_need
from seerd.scheduler.forecast import GrowthRatios, group_forecast
from seerd.scheduler.views import Plan, QueuedRequest, Snapshot

DEFAULT_STARVATION_S = 1800.0
DEFAULT_AFFINITY_SPREAD = DEFAULT_BALANCE_SPREAD
DEFAULT_STARVED_PER_CALL = 1


def seer_key(r: QueuedRequest, growth: GrowthRatios) -> tuple:
    """Probes, shortest generated first; then the rest, most expected remaining tokens first
    (see the module docstring)."""
    if r.is_probe:
        return (0, r.generated, r.queued_at)
    return _rest_key(r, group_forecast(r, growth))


def _rest_key(r: QueuedRequest, forecast: int) -> tuple:
    return (1, -(max(forecast, r.generated) - r.generated), -r.group_longest_unfinished, r.queued_at)


class SeerKey:
    """`seer_key` under one growth table, with each group's forecast worked out once: the
    members of a group share it, and a re-key of the queue when the table changes computed it
    for every queued request (~60% of a 70,000-request re-key's ~200 ms)."""

    __slots__ = ("growth", "_forecasts")
    MEMO_LIMIT = 1 << 16  # forecasts kept, then forgotten at once (they are cheap to redo)

    def __init__(self, growth: GrowthRatios) -> None:
        self.growth = growth
        self._forecasts: dict[tuple, int] = {}

    def __call__(self, r: QueuedRequest) -> tuple:
        if r.is_probe:
            return (0, r.generated, r.queued_at)
        # What `group_forecast` reads of the request (`max_tokens` is its own, not the group's).
        inputs = (r.group_id, r.group_finished, r.group_estimate, r.group_longest_unfinished, r.max_tokens)
        forecast = self._forecasts.get(inputs)
        if forecast is None:
            if len(self._forecasts) >= self.MEMO_LIMIT:
                self._forecasts.clear()
            forecast = self._forecasts[inputs] = group_forecast(r, self.growth)
        return _rest_key(r, forecast)


def reads_growth(r: QueuedRequest) -> bool:
    """Whether `seer_key` of `r` reads the growth table: not for a probe, nor for a request of a
    group with nothing finished and nothing generated (its forecast is its starting estimate).
    Only these are re-keyed when the table changes (`RequestQueue.ordered`)."""
    return not r.is_probe and (r.group_finished > 0 or r.group_longest_unfinished > 0)


class SeerPolicy:
    name = "seer"

    def __init__(self, starvation_s: float = DEFAULT_STARVATION_S,
                 affinity_spread: int = DEFAULT_AFFINITY_SPREAD,
                 starved_per_call: int = DEFAULT_STARVED_PER_CALL,
                 balance_spread: int = DEFAULT_BALANCE_SPREAD) -> None:
        self.starvation_s = starvation_s
        self.starved_per_call = starved_per_call
        self.balance_spread = balance_spread
        self.affinity_spread = affinity_spread

    def order(self, snapshot: Snapshot) -> Iterator[QueuedRequest]:
        """Every queued request in serving order, lazily (the heart of the policy; tested directly)."""
        starved: set[int] = set()
        for request in snapshot.queued.fcfs():  # oldest first: the starved are a prefix
            if (len(starved) >= self.starved_per_call
                    or snapshot.now - request.queued_at <= self.starvation_s):
                break
            starved.add(request.request_id)
            yield request
        growth = snapshot.growth
        ordered = snapshot.queued.ordered("seer", SeerKey(growth), growth.version, reads_growth)
        if starved:  # (a filter only when there are any: it was a layer over every request passed over)
            ordered = (r for r in ordered if r.request_id not in starved)
        held = _held(snapshot, starved)
        for request in ordered:  # probes first (their class), then the rest
            if not request.is_probe:
                # Requests continuing in place on this worker keep their slots before any other
                # non-probe starts (`base.continuing_first`): seer orders who starts, a waiting
                # probe may still take a slot at a boundary.
                rest = itertools.chain([request], ordered)
                yield from continuing_first(replace(snapshot, continuing=held),
                                            (r for r in rest if not r.is_probe), key=lambda r: seer_key(r, growth))
                return
            yield request

    def prepare(self, snapshot: Snapshot) -> None:
        """Build the queue's seer index now, before any worker asks: built by the first lease
        instead, it held the state thread ~70 ms at 100,000 queued requests (bench_lease_cost),
        and every first lease of the start-up fill queued behind it. (The same index the first
        plan would build: nothing can change the queue's keys in between.)"""
        growth = snapshot.growth
        next(snapshot.queued.ordered("seer", SeerKey(growth), growth.version, reads_growth), None)

    def plan(self, snapshot: Snapshot) -> Plan:
        limit = balanced_slots(snapshot, self.balance_spread)
        if limit <= 0:
            return Plan()  # skip ordering the whole queue for nothing
        asking = snapshot.worker(snapshot.worker_id)
        loads = snapshot.loads_by_id
        # What each home worker has left for the requests this plan leaves to it: (free slots, KV
        # room, KV block). One free slot there holds back one request here, not every one it ran
        # before.
        room_left: dict[str, tuple[int, int, int]] = {}
        decided: dict[int, bool] = {}  # admission may look at a request twice (its lean pass)
        asking_id, asking_running = asking.worker_id, asking.running_chunks
        chunk, now = snapshot.chunk_tokens, snapshot.now

        def belongs_elsewhere(request: QueuedRequest) -> bool:
            # Its previous worker holds its prefix: leave it there unless that one is much busier
            # or has no room left for it. (Asked of most requests a plan passes over: in line.)
            home_id = request.last_worker
            if home_id is None or home_id == asking_id:
                return False
            answer = decided.get(request.request_id)
            if answer is None:
                answer = decided[request.request_id] = leave_to_home(request, home_id)
            return answer

        def leave_to_home(request: QueuedRequest, home_id: str) -> bool:
            if home_id in request.failed_on:  # its engine failed it: no home there
                return False
            left = room_left.get(home_id)
            if left is None:  # what the home has: it only shrinks as this plan leaves requests to it
                home = loads.get(home_id)
                if home is None:
                    return False
                slots = home.max_chunks - home.running_chunks
                if home.running_chunks - asking_running > self.affinity_spread:
                    slots = 0  # much busier than the asker: closed to them for this plan
                left = room_left[home_id] = (slots, home.kv_capacity_tokens - home.reserved_kv_tokens,
                                             home.kv_block_tokens)
            slots, headroom, block = left
            if slots <= 0 or now - request.queued_at > self.starvation_s:
                return False
            need = whole_chunk_need(request, chunk, block)
            if headroom < need:
                return False
            room_left[home_id] = (slots - 1, headroom - need, block)
            return True

        return admit(snapshot, self._admission_order(snapshot), skip=belongs_elsewhere, limit=limit)

    def _admission_order(self, snapshot: Snapshot) -> Iterator[QueuedRequest]:
        """`order` for admission: with nothing starved (the common case) it is the index's own
        order, the asker's continuing requests first among the non-probes, walked by a
        `PassingOrder`."""
        oldest = snapshot.queued.oldest_queued_at()
        if oldest is not None and snapshot.now - oldest > self.starvation_s and self.starved_per_call > 0:
            return self.order(snapshot)
        growth = snapshot.growth
        queued = snapshot.queued
        held = _held(snapshot, set())
        # As `continuing_first` puts them (the same set, sorted the same way).
        held_first = sorted((queued.get(rid) for rid in held), key=lambda r: seer_key(r, growth))
        return PassingOrder(queued.ordered("seer", SeerKey(growth), growth.version, reads_growth),
                            snapshot.worker_id, held, held_first)


def _held(snapshot: Snapshot, starved: set[int]) -> frozenset[int]:
    """The asker's continuing requests that keep their slots first: queued, not probes, not starved."""
    return frozenset(rid for rid in snapshot.continuing - starved
                     if rid in snapshot.queued and not snapshot.queued.get(rid).is_probe)


class PassingOrder:
    """Seer's `order` when nothing is starved: the queue's seer index, probes first (a probe after
    a non-probe is dropped, as `order` drops it), the asker's continuing requests (`held`, in
    `held_first` order) before the other non-probes, with what admission uses to pass over many
    requests in one call (`base._admit`): `pass_over_unfit` takes the next requests that fit
    another worker and not the asking one and that seer's skip (`belongs_elsewhere`) leaves alone
    with no effect (no home elsewhere, no failure); `restarted` is the order again from the
    requests admission has seen (its lean pass)."""

    __slots__ = ("_front", "_rest", "_asking", "_held", "_held_first", "_past_probes")

    def __init__(self, rest: Iterator[QueuedRequest], asking: str, held: frozenset[int] = frozenset(),
                 held_first: list[QueuedRequest] | None = None) -> None:
        self._front: list[QueuedRequest] = []  # next in order, popped from the end
        self._rest = rest
        self._asking = asking
        self._held = held
        self._held_first = held_first or []
        self._past_probes = False

    def __iter__(self) -> PassingOrder:
        return self

    def __next__(self) -> QueuedRequest:
        request = self._pull()
        if request is None:
            raise StopIteration
        return request

    def _pull(self) -> QueuedRequest | None:
        front = self._front
        if front:
            return front.pop()
        for request in self._rest:
            if request.is_probe:
                if self._past_probes:
                    continue
                return request
            if not self._past_probes:  # the first non-probe: the continuing ones come first
                self._past_probes = True
                if self._held:
                    if request.request_id not in self._held:
                        front.append(request)
                    front.extend(reversed(self._held_first))
                    return front.pop()
            if request.request_id not in self._held:
                return request
        return None

    def restarted(self, seen: list[QueuedRequest]) -> PassingOrder:
        """The requests `seen` (already in order), then those not taken yet."""
        again = PassingOrder(self._rest, self._asking, self._held, self._held_first)
        again._past_probes = self._past_probes
        again._front = [*self._front, *reversed(seen)]
        return again

    def pass_over_unfit(self, need_of: Callable[[QueuedRequest], int], kv_free: int, room_elsewhere: int,
                        most: int, whole_chunks: tuple[int, int] | None = None,
                        skip: Callable[[QueuedRequest], bool] | None = None) -> list[QueuedRequest]:
        """Take and return the next requests, up to `most`, that admission passes over: those
        `skip` leaves to their home on another worker, and those that need more KV than `kv_free`
        and no more than `room_elsewhere` (`need_of`); the first other one, or one with a failure,
        stays next. `skip` is asked, in order, only of requests with a home elsewhere (it says no
        to the rest) and must answer the same when asked again of the one left next (seer's
        `belongs_elsewhere` keeps its answers); without it such a request stops the run.
        `whole_chunks` (chunk tokens, KV block tokens): `need_of` is a whole chunk's `kv_need`,
        worked out here by `whole_chunk_need` (one call where `need_of` makes three)."""
        passed: list[QueuedRequest] = []
        asking = self._asking
        chunk, block = whole_chunks or (0, 0)
        while len(passed) < most:
            request = self._pull()
            if request is None:
                break
            if request.failed_on:
                self._front.append(request)
                break
            home = request.last_worker
            if home is not None and home != asking:
                if skip is None:
                    self._front.append(request)
                    break
                if skip(request):
                    passed.append(request)
                    continue
            need = need_of(request) if whole_chunks is None else whole_chunk_need(request, chunk, block)
            if need <= kv_free or need > room_elsewhere:
                self._front.append(request)
                break
            passed.append(request)
        return passed
