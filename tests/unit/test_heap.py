"""The coordinator's garbage-collector keeper (seerd/coordinator/heap.py): small passes over what
survived since the last one, cycles frozen while alive collected by the periodic full pass, and
the collector as it was afterwards."""

from __future__ import annotations

import gc
import weakref

from seerd.coordinator.heap import FREEZE_S, FULL_PASS_GROWTH, NEVER, HeapKeeper, resident_bytes


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_small_pass_collects_new_cycles_and_the_full_pass_the_frozen_ones():
    before = gc.get_threshold()
    clock = Clock()
    resident = [1000]  # the process's memory as the keeper reads it
    keeper = HeapKeeper(clock, rss=lambda: resident[0])
    try:
        keeper.settle()
        assert gc.get_threshold()[2] == NEVER and gc.get_freeze_count() > 0

        young = Node()
        young_ref = weakref.ref(young)
        del young
        clock.now += FREEZE_S
        keeper.tick()  # a small pass: the cycle made garbage since the last one is collected
        assert young_ref() is None and keeper.passes == 1

        frozen = Node()
        clock.now += FREEZE_S
        keeper.tick()  # frozen while alive
        frozen_ref = weakref.ref(frozen)
        del frozen
        clock.now += FREEZE_S
        keeper.tick()
        assert frozen_ref() is not None  # small passes do not look at frozen objects

        # Memory grew by a quarter since `settle`: the next tick is a full pass, which
        # unfreezes everything and collects it.
        resident[0] = 1000 * (1 + FULL_PASS_GROWTH) + 1
        clock.now += FREEZE_S
        keeper.tick()
        assert frozen_ref() is None and keeper.full_passes == 1
        assert gc.get_freeze_count() > 0  # and freezes again what is alive
        assert keeper.figures()["gc_passes"] == 3
    finally:
        keeper.close()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_ticks_between_passes_do_nothing():
    # Before `settle` the collector is left alone; after it, nothing happens within `FREEZE_S`.
    clock = Clock()
    keeper = HeapKeeper(clock)
    keeper.tick()
    assert keeper.passes == 0
    try:
        keeper.settle()
        clock.now += FREEZE_S / 2
        keeper.tick()
        assert keeper.passes == 0 and keeper.full_passes == 0
    finally:
        keeper.close()


def test_resident_memory_is_read_from_the_process():
    before = resident_bytes()
    ballast = b"\x01" * (64 << 20)  # 64 MiB written, so resident
    assert resident_bytes() >= before + (48 << 20)
    del ballast
