"""The line of long-polling lease calls and the state thread serving it (seerd/server/waiting.py).

The lease here is a callback standing in for the book's (`LeaseBook.lease`), which the HTTP tests
in test_api.py drive for real; these pin the order of service, the bound on plans, and the hand-over
between the event loop and the state thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from seerd.server.waiting import EXTRA_PLANS, LeaseLine, Waited


async def parked(line: LeaseLine, workers: list[str], timeout_s: float = 60.0) -> list[tuple[str, asyncio.Task]]:
    """Calls of `workers` waiting in line, in that order."""
    calls = []
    for worker in workers:
        calls.append((worker, asyncio.create_task(line.wait(timeout_s, worker, 4))))
        while len(line) < len(calls):
            await asyncio.sleep(0)
    return calls


async def serve(line: LeaseLine, requests: int, lease, context: int = 0, leasing=None) -> int:  # noqa: ANN001
    """`LeaseLine.serve` on a thread of its own, as the state thread runs it; `lease` stands in for
    the lease of the book's transaction (`leasing`: the transaction itself, by default none)."""
    leasing = leasing or (lambda: contextlib.nullcontext(lease))
    return await asyncio.get_running_loop().run_in_executor(None, line.serve, requests, context, 1.0, leasing)


async def answered(calls: list[tuple[str, asyncio.Task]]) -> dict[str, Waited]:
    for _ in range(5):  # answers reach the loop through call_soon_threadsafe
        await asyncio.sleep(0)
    return {worker: task.result() for worker, task in calls if task.done()}


def test_work_goes_to_the_most_kv_room_first_and_of_equals_the_longest_waiting():
    rooms = {"small": 100, "big": 900, "mid": 500, "big2": 900, "none": None}

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        line = LeaseLine(lambda worker, _context: rooms[worker])
        calls = await parked(line, list(rooms))
        asked: list[str] = []
        await serve(line, 2, lambda worker, wanted: asked.append(worker) or [f"chunk for {worker}"])
        first = list(await answered(calls))
        await serve(line, 5, lambda worker, wanted: asked.append(worker) or [f"chunk for {worker}"])
        second = [w for w in await answered(calls) if w not in first]
        for _, task in calls:
            task.cancel()
        return first, second, asked

    first, second, asked = asyncio.run(scenario())
    assert first == ["big", "big2"]  # (in line order) one plan per request
    assert second == ["small", "mid"] and asked == ["big", "big2", "mid", "small"]  # "none" has no room


def test_calls_planned_for_in_vain_wait_on_and_come_after_the_others():
    async def scenario() -> tuple[list[str], dict[str, Waited]]:
        line = LeaseLine(lambda worker, _context: {"roomy": 900, "a": 100, "b": 100}[worker])
        calls = await parked(line, ["roomy", "a", "b"])
        asked: list[str] = []
        # The roomy worker's plan gives it nothing (the work is another's): it waits on.
        await serve(line, 1, lambda worker, wanted: asked.append(worker) or ([] if worker == "roomy" else ["c"]))
        after_first = await answered(calls)
        await serve(line, 1, lambda worker, wanted: asked.append(worker) or ["c"])
        done = await answered(calls)
        for _, task in calls:
            task.cancel()
        return asked, after_first, done

    asked, after_first, done = asyncio.run(scenario())
    assert asked == ["roomy", "a", "b"]  # then "b" first: "roomy" was planned for in vain
    assert list(after_first) == ["a"] and after_first["a"].grants == ["c"] and after_first["a"].plans == 1
    assert sorted(done) == ["a", "b"]


def test_one_batch_of_work_costs_at_most_four_plans_in_vain_beyond_one_per_request():
    async def scenario() -> list[str]:
        line = LeaseLine()
        calls = await parked(line, [f"w{i}" for i in range(10)])
        asked: list[str] = []
        await serve(line, 2, lambda worker, wanted: asked.append(worker) or [])
        assert not await answered(calls) and len(line) == 10  # all still waiting
        for _, task in calls:
            task.cancel()
        return asked

    assert asyncio.run(scenario()) == [f"w{i}" for i in range(2 + EXTRA_PLANS)]


def test_a_call_whose_wait_runs_out_while_planned_for_gets_the_plans_chunks():
    # The state thread is planning for the call when its deadline passes: the chunks it is given
    # reach it (a timed-out answer would leave them leased to a worker that never hears of them).
    async def scenario() -> Waited:
        line = LeaseLine()
        (_, task), = await parked(line, ["w"], timeout_s=0.05)
        planning = threading.Event()

        def slow_lease(worker: str, wanted: int) -> list[str]:
            planning.set()
            for _ in range(1000):  # until the call's wait has run out under this plan
                if line._calls[0].expired:
                    return ["chunk"]
                time.sleep(0.01)
            return []

        serving = asyncio.ensure_future(serve(line, 1, slow_lease))
        outcome = await task
        await serving
        assert planning.is_set() and len(line) == 0
        return outcome

    assert asyncio.run(scenario()).grants == ["chunk"]


def test_a_wait_that_runs_out_unplanned_for_answers_empty_and_leaves_the_line():
    async def scenario() -> tuple[Waited, int]:
        line = LeaseLine()
        (_, task), = await parked(line, ["w"], timeout_s=0.01)
        return await task, len(line)

    outcome, left = asyncio.run(scenario())
    assert outcome.grants is None and not outcome.woken and left == 0


def test_wake_all_answers_every_waiting_call_as_woken():
    async def scenario() -> dict[str, Waited]:
        line = LeaseLine()
        calls = await parked(line, ["a", "b"])
        line.wake_all()
        return await answered(calls)

    outcomes = asyncio.run(scenario())
    assert sorted(outcomes) == ["a", "b"] and all(o.woken and o.grants is None for o in outcomes.values())


def test_a_lease_refused_for_one_worker_fails_that_waiting_call_alone():
    async def scenario() -> tuple[object, dict[str, Waited]]:
        line = LeaseLine(lambda worker, _context: {"gone": 900, "ok": 100}[worker])
        calls = await parked(line, ["gone", "ok"])

        def lease(worker: str, wanted: int) -> list[str] | KeyError:
            if worker == "gone":
                return KeyError(worker)  # as the book's lease answers for a worker it no longer knows
            return ["chunk"]

        await serve(line, 1, lease)
        for _ in range(5):
            await asyncio.sleep(0)
        failed = calls[0][1]
        with pytest.raises(KeyError):
            failed.result()
        return failed.exception(), {"ok": calls[1][1].result()}

    error, served = asyncio.run(scenario())
    assert isinstance(error, KeyError) and served["ok"].grants == ["chunk"]


def test_a_failed_lease_transaction_answers_every_call_it_planned_for_with_the_error_and_no_grants():
    # Grants are answered only after their transaction commits: one that fails leaves every call
    # planned for in it without the chunks it rolled back, and the calls not reached waiting on.
    class DiskFull(OSError):
        pass

    @contextlib.contextmanager
    def failing_commit():
        yield lambda worker, wanted: [f"chunk for {worker}"]
        raise DiskFull("the commit failed")

    async def scenario() -> tuple[dict[str, object], int, BaseException | None]:
        line = LeaseLine(lambda worker, _context: {"a": 900, "b": 500, "c": 100}[worker])
        calls = await parked(line, ["a", "b", "c"])
        raised = None
        try:
            await serve(line, 2, None, leasing=failing_commit)
        except DiskFull as exc:
            raised = exc
        for _ in range(5):
            await asyncio.sleep(0)
        outcomes = {worker: (task.exception() if task.done() else "waiting") for worker, task in calls}
        for _, task in calls:
            task.cancel()
        return outcomes, len(line), raised

    outcomes, left, raised = asyncio.run(scenario())
    assert isinstance(raised, DiskFull)
    assert isinstance(outcomes["a"], DiskFull) and isinstance(outcomes["b"], DiskFull), outcomes
    assert outcomes["c"] == "waiting" and left == 1
