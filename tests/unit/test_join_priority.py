"""Workers joining wait behind the calls of workers already registered (`CoordinatorControl.join`):
a registration queued first runs after the leases and heartbeats queued behind it, a few
milliseconds of joins a turn, and every join runs in the end. Deterministic: the state thread is
held busy (or a join held) until every call has queued; the order is what the state thread ran."""

from __future__ import annotations

import asyncio
import threading
import time

from seerd.server import control as state_thread
from seerd.server.app import CoordinatorControl


async def _until(condition) -> None:  # noqa: ANN001
    while not condition():
        await asyncio.sleep(0.005)


async def _state_thread_held(control: CoordinatorControl) -> tuple[threading.Event, asyncio.Future]:
    """The state thread held busy by a call until the returned event is set; returns once that
    call runs. (Waiting for the queue to empty instead raced the thread's start: before the call's
    coroutine had queued it the queue was empty too, and calls queued next could join its turn.)"""
    release, running = threading.Event(), threading.Event()

    def hold() -> bool:
        running.set()
        return release.wait(30)

    blocker = asyncio.ensure_future(control.run(hold))
    await _until(running.is_set)
    return release, blocker


def test_calls_of_registered_workers_run_before_registrations_queued_earlier():
    control = CoordinatorControl()
    ran: list[str] = []

    async def scenario() -> list:
        release, blocker = await _state_thread_held(control)
        joins = [asyncio.ensure_future(control.join(ran.append, f"register {i}")) for i in range(3)]
        await _until(lambda: len(control._joins) == 3)
        calls = [asyncio.ensure_future(control.run(ran.append, f"lease {i}")) for i in range(2)]
        await _until(lambda: len(control._calls) == 2)
        release.set()
        return await asyncio.gather(blocker, *joins, *calls)

    answers = asyncio.run(asyncio.wait_for(scenario(), 30))
    control.close()
    assert answers == [True] + [None] * 5
    assert ran == ["lease 0", "lease 1", "register 0", "register 1", "register 2"]


def test_a_call_queued_during_a_long_run_of_joins_goes_before_the_joins_left(monkeypatch):
    monkeypatch.setattr(state_thread, "JOINS_EVERY_S", 60.0)  # the joins' time budget never runs out here
    control = CoordinatorControl()
    ran: list[str] = []
    lease_queued, registering = threading.Event(), threading.Event()

    def first_registration() -> None:
        registering.set()
        lease_queued.wait(30)  # a lease arrives while this registration runs
        ran.append("register 0")

    async def scenario() -> None:
        joins = [asyncio.ensure_future(control.join(first_registration))]
        await _until(registering.is_set)  # the first registration is running
        joins += [asyncio.ensure_future(control.join(ran.append, f"register {i}")) for i in (1, 2)]
        await _until(lambda: len(control._joins) == 2)
        lease = asyncio.ensure_future(control.run(ran.append, "lease"))
        await _until(lambda: len(control._calls) == 1)
        lease_queued.set()
        await asyncio.gather(lease, *joins)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    control.close()
    assert ran == ["register 0", "lease", "register 1", "register 2"]


def test_joins_beyond_a_turns_budget_run_in_turns_of_their_own(monkeypatch):
    monkeypatch.setattr(state_thread, "JOINS_EVERY_S", 0.0)  # one join a turn, past the turn's other calls
    control = CoordinatorControl()
    ran: list[str] = []

    async def scenario() -> None:
        release, blocker = await _state_thread_held(control)
        joins = [asyncio.ensure_future(control.join(ran.append, f"register {i}")) for i in range(3)]
        await _until(lambda: len(control._joins) == 3)
        release.set()
        await asyncio.gather(blocker, *joins)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    control.close()
    assert ran == ["register 0", "register 1", "register 2"]
    assert control.turns.figures()["calls ran"]["calls"] == 3  # [blocker, register 0], [register 1], [register 2]


def test_a_failing_join_fails_its_caller_alone():
    control = CoordinatorControl()

    def refused() -> None:
        raise ValueError("no room")

    async def scenario() -> list:
        return await asyncio.gather(control.join(refused), control.join(int, "7"), return_exceptions=True)

    failed, ok = asyncio.run(asyncio.wait_for(scenario(), 30))
    control.close()
    assert isinstance(failed, ValueError) and ok == 7



def test_a_registration_passed_over_turn_after_turn_runs_after_a_bounded_number_of_them(monkeypatch):
    monkeypatch.setattr(state_thread, "JOINS_MAY_WAIT_TURNS", 4)
    control = CoordinatorControl()
    ran: list[str] = []
    chained: list[asyncio.Future] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()

        def call(n: int) -> None:  # each call queues the next before its turn ends: calls never stop coming
            ran.append(f"call {n}")
            if n < 7:
                loop.call_soon_threadsafe(lambda: chained.append(asyncio.ensure_future(control.run(call, n + 1))))
                while not control._calls:
                    time.sleep(0.001)

        release, blocker = await _state_thread_held(control)
        join = asyncio.ensure_future(control.join(ran.append, "register"))
        chained.append(asyncio.ensure_future(control.run(call, 0)))
        await _until(lambda: len(control._calls) == 1 and len(control._joins) == 1)
        release.set()
        await blocker
        await join
        await _until(lambda: len(chained) == 8)
        await asyncio.gather(*chained)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    control.close()
    # Passed over by the blocker's turn and the turns of calls 0-2; run in the turn of call 3.
    assert ran == ["call 0", "call 1", "call 2", "call 3", "register", "call 4", "call 5", "call 6", "call 7"]


class _TakenJustBefore:
    """The calls lock, with a turn taking the queued calls (swapping in a fresh list, as
    `_run_calls` does) the first time the loop reaches for it: the moment a call has decided
    where to go and not yet gone there."""

    def __init__(self, control: CoordinatorControl) -> None:
        self.control, self.lock, self.taken = control, threading.Lock(), False

    def __enter__(self):  # noqa: ANN204
        if not self.taken and threading.current_thread() is threading.main_thread():
            self.taken = True
            with self.lock:
                self.control._calls = []  # a turn took the list (it was empty: nothing else lost)
        return self.lock.__enter__()

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        return self.lock.__exit__(*exc)


def test_a_call_queued_as_a_turn_takes_the_queue_still_runs():
    control = CoordinatorControl()
    control._calls_lock = _TakenJustBefore(control)

    async def scenario() -> int:
        return await control.run(int, "5")

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == 5  # lost, it would wait for ever
    control.close()
