"""Lease calls long-polling for work, and the state thread handing them work as it is queued.

A worker with free slots and nothing to take holds a lease call open (up to `LONG_POLL_MAX_S`).
When work is queued (a report re-queues a request, a lease expires), the state thread plans for
the waiting calls in its own turn (`LeaseLine.serve`) and answers the ones it gives chunks; a call
its plan gives nothing stays in line, at no cost to it. The line is the one piece of state both
threads touch: the event loop adds and times out calls, the state thread takes them; a lock
guards it, and a call the state thread has taken (`claimed`) is answered by it, never timed out
under it.

Why the state thread serves them: woken on the event loop, a call planned for itself, each round
a wait for the state thread's next turn; when the plan gave nothing (another worker's work, a
request left to the worker that ran it, the balance between workers) it waited again, and was
woken again for the next batch. At 512 workers (tools/bench/load.py) lease calls gathered up to 45
rounds like that, 100-300 ms of their answer, most of the lease calls over 100 ms.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import NamedTuple

from seerd.scheduler.wake import WaitingCall, wake_order

# How many plans in vain one batch of work may cost beyond one per request queued (`serve`).
EXTRA_PLANS = 4


class Waited(NamedTuple):
    """How a long poll ended: `grants` the state thread gave it (None: timed out, or woken by
    `wake_all` with `woken`), `ready_at` (monotonic) when the work it got was queued, so that its
    wait for work ends there and the state thread's turn counts as its answer time, and the plans
    made for it while it waited."""

    grants: list | None
    ready_at: float
    plans: int
    woken: bool = False


class _Call:
    __slots__ = ("loop", "future", "worker_id", "wanted", "vain", "plans", "claimed", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, worker_id: str, wanted: int) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.worker_id = worker_id
        self.wanted = wanted
        self.vain = 0  # plans that gave it nothing
        self.plans = 0
        self.claimed = False  # the state thread is planning for it
        self.expired = False  # its wait timed out while claimed: answered by the state thread


class LeaseLine:
    """The waiting lease calls, longest waiting first."""

    def __init__(self, room_for: Callable[[str, int], int | None] = lambda _worker_id, _context: 0) -> None:
        """`room_for(worker_id, context)`: a worker's KV room if it could take a request of that
        context, else None (`SchedulerState.room_for`); read on the state thread."""
        self._calls: collections.deque[_Call] = collections.deque()
        self._lock = threading.Lock()
        self.room_for = room_for

    def __len__(self) -> int:
        return len(self._calls)

    # ------------------------------------------------------------ the event loop's side
    async def wait(self, timeout_s: float, worker_id: str, wanted: int) -> Waited:
        """Wait in line until the state thread gives this call work (`serve`), `wake_all`, or
        `timeout_s`."""
        call = _Call(asyncio.get_running_loop(), worker_id, wanted)
        with self._lock:
            self._calls.append(call)
        try:
            await asyncio.wait({call.future}, timeout=max(0.0, timeout_s))
            if not call.future.done():
                with self._lock:
                    if call.claimed:  # being planned for right now: the plan answers it
                        call.expired = True
                    else:
                        self._calls.remove(call)
                        return Waited(None, time.monotonic(), call.plans)
            return await call.future
        finally:
            if not call.future.done():  # the call went away (its client disconnected)
                with self._lock:
                    if call.claimed:
                        call.expired = True  # out of the line once its plan is done
                    elif call in self._calls:
                        self._calls.remove(call)

    def wake_all(self) -> None:
        """Answer every waiting call the state thread is not planning for as woken: the rollout is
        over or the coordinator stops handing out work."""
        with self._lock:
            taken = [call for call in self._calls if not call.claimed]
            self._calls = collections.deque(call for call in self._calls if call.claimed)
        now = time.monotonic()
        for call in taken:
            _answer(call, Waited(None, now, call.plans, woken=True))

    # ---------------------------------------------------------- the state thread's side
    def serve(self, requests: int, context: int, ready_at: float,
              leasing: Callable[[], ContextManager[Callable[[str, int], object]]]) -> int:
        """Plan for waiting calls, on the state thread, after `requests` were queued (the shortest
        with `context` tokens) at `ready_at`: calls whose worker could take one (`room_for`), those
        planned for in vain the fewest times first, then the workers with the most KV room (admission
        leaves a request that does not fit the asking worker to the one with the most room: its plan
        takes it), then the longest waiting; until the requests are handed out or `requests` +
        `EXTRA_PLANS` plans were made. A call given chunks is answered; the others wait on.
        `leasing()` opens the book's leases of one transaction (`LeaseBook.leasing`): its
        `lease(worker_id, wanted)` gives the grants, or the exception of that call alone (an
        unknown or retired worker). The answers go out once it committed; if it fails, every call
        planned for in it gets the error. Returns the plans made."""
        with self._lock:
            candidates = []
            for place, call in enumerate(self._calls):
                if call.claimed or call.future.done():  # (done: its client went away)
                    continue
                room = self.room_for(call.worker_id, context)
                if room is not None:  # (a worker without room is not planned for at all)
                    candidates.append(WaitingCall(call, call.vain, room, place))
            chosen = wake_order(candidates)[:requests + EXTRA_PLANS]
            for call in chosen:
                call.claimed = True
        left = requests
        outcomes: list[tuple[_Call, object]] = []  # each call planned for, and its grants or error
        try:
            with leasing() as lease:
                for call in chosen:
                    if left <= 0 or len(outcomes) >= requests + EXTRA_PLANS:
                        break
                    call.plans += 1
                    outcome = lease(call.worker_id, call.wanted)
                    outcomes.append((call, outcome))
                    if isinstance(outcome, list):
                        left -= len(outcome)
        except Exception as exc:
            self._release(chosen[len(outcomes):])
            for call, _ in outcomes:
                self._take(call)
                _answer(call, exc)
            raise
        self._release(chosen[len(outcomes):])
        for call, outcome in outcomes:
            if isinstance(outcome, BaseException) or outcome:
                self._take(call)
                _answer(call, outcome if isinstance(outcome, BaseException) else Waited(outcome, ready_at, call.plans))
            else:
                call.vain += 1
                self._release([call])
        return len(outcomes)

    def _take(self, call: _Call) -> None:
        with self._lock:
            self._calls.remove(call)

    def _release(self, chosen: list[_Call]) -> None:
        """Calls planned for (or about to be) that got nothing: back to waiting, or answered as
        timed out if their wait ran out meanwhile."""
        timed_out = []
        with self._lock:
            for call in chosen:
                call.claimed = False
                if call.expired:
                    self._calls.remove(call)
                    timed_out.append(call)
        now = time.monotonic()
        for call in timed_out:
            _answer(call, Waited(None, now, call.plans))


def _answer(call: _Call, outcome: object) -> None:
    call.loop.call_soon_threadsafe(_settle, call.future, outcome)


def _settle(future: asyncio.Future, outcome: object) -> None:
    if future.done():  # its call went away
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
