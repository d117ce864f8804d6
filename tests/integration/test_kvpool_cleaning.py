"""The coordinator's pool cleaning on a real Mooncake master and holder (no vLLM): a finished
request's blocks go, its siblings' stay; a finished group's prompt blocks go; a finished run
leaves no key; another run's keys are never touched."""

from __future__ import annotations

import time

import pytest

from seerd.kvpool.holder import HolderProcess
from seerd.kvpool.host import PoolHost
from seerd.kvpool.keys import BlockKeys
from seerd.kvpool.service import PoolService
from seerd.kvpool.store import MiB, close_quietly, open_store

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


def keys_of(run: str, group: int, request: int) -> list[str]:
    # 600 tokens with a 300-token prompt: two prompt blocks (the group's), two of the request's own.
    return BlockKeys(b"n" * 16, run, group, request, 300, 128).extend(list(range(600)), 600)


def present(store, keys: list[str]) -> list[bool]:  # noqa: ANN001
    return [code == 1 for code in store.batch_is_exist(keys)]


def test_finished_requests_groups_and_runs_leave_no_blocks(tmp_path):
    service = PoolService(tmp_path, "127.0.0.1", log_dir=tmp_path)
    host = PoolHost(service, "run1", local_host="127.0.0.1")
    address = host.start()
    holder = HolderProcess(tmp_path, 64 * MiB, log_path=tmp_path / "holder.log")
    holder.spawn()
    store = None
    try:
        time.sleep(1.0)
        store = open_store(address, local_host="127.0.0.1", segment_bytes=0, buffer_bytes=16 * MiB)
        mine, sibling, other_group, other_run = (keys_of("run1", 5, 7), keys_of("run1", 5, 8),
                                                 keys_of("run1", 6, 9), keys_of("run10", 5, 7))
        everything = sorted(set(mine + sibling + other_group + other_run))
        for key in everything:
            assert store.put(key, b"x" * 4096) == 0
        assert all(present(store, everything))

        host.request_finished(5, 7)
        host._thread.submit(lambda: None).result()  # the removal ran (one thread, in order)
        assert present(store, mine) == [True, True, False, False]  # the prompt blocks are the group's
        assert all(present(store, sibling + other_group + other_run))

        host.group_finished(5)
        host._thread.submit(lambda: None).result()
        assert not any(present(store, mine + sibling))
        assert all(present(store, other_group + other_run))

        figures = host.close(run_finished=True)
        assert (figures["removed_requests"], figures["removed_groups"], figures["remove_errors"]) == (1, 1, 0)
        # What is left is another run's (run10, whose tag starts like ours): 4 keys.
        assert figures["keys"] == len(set(other_run)), figures
    finally:
        if store is not None:
            close_quietly(store)
        holder.stop()
        service.stop()
