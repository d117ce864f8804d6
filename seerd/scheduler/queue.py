"""The request buffer as the scheduler sees it: queued requests kept in order as they change.

The lease book (and the simulator) update it incrementally: a request enters when it waits for
its next chunk and leaves when leased. Besides first-come-first-served order, a policy can ask for
its own order by name and key (`ordered`); the index is built once and then kept up to date on
every put and remove, so a lease call costs O(log n + k) rather than a sort of every queued request.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

from seerd.scheduler.views import QueuedRequest


class StaleSnapshot(RuntimeError):
    """A snapshot's queue was read after the scheduler state changed: plan on a fresh snapshot."""


class RequestQueue:
    def __init__(self) -> None:
        self._items: dict[int, QueuedRequest] = {}
        self._fcfs: list[tuple[float, int]] = []  # (queued_at, request_id), ascending
        # name -> (key function, its version, [(key, request_id)] ascending)
        self._indexes: dict[str, tuple[Callable[[QueuedRequest], Any], Any, list]] = {}

    @classmethod
    def of(cls, requests: Iterable[QueuedRequest]) -> RequestQueue:
        queue = cls()
        for request in requests:
            queue.put(request)
        return queue

    def put(self, request: QueuedRequest) -> None:
        if request.request_id in self._items:
            self.remove(request.request_id)
        self._items[request.request_id] = request
        insort(self._fcfs, (request.queued_at, request.request_id))
        for key, _, order in self._indexes.values():
            insort(order, (key(request), request.request_id))

    def remove(self, request_id: int) -> QueuedRequest:
        request = self._items.pop(request_id)
        index = bisect_left(self._fcfs, (request.queued_at, request_id))
        del self._fcfs[index]
        for key, _, order in self._indexes.values():
            del order[bisect_left(order, (key(request), request_id))]
        return request

    def ordered(self, name: str, key: Callable[[QueuedRequest], Any], version: Any = None) -> Iterator[QueuedRequest]:
        """Queued requests ascending by `key`, ties by request id; the index named `name` is
        built on first use and maintained from then on. `key` must depend on the request only
        (not on the clock) and behave the same for as long as `version` does not change; a new
        version (say, of a table the key reads) rebuilds the index with the key given then."""
        index = self._indexes.get(name)
        if index is None or index[1] != version:
            index = (key, version, sorted((key(r), r.request_id) for r in self._items.values()))
            self._indexes[name] = index
        for _, request_id in index[2]:
            yield self._items[request_id]

    def get(self, request_id: int) -> QueuedRequest:
        return self._items[request_id]

    def fcfs(self, after: tuple[float, int] | None = None) -> Iterator[QueuedRequest]:
        """Oldest first; ties by request id. With `after` (a queued_at and request id), only the
        requests queued after it in that order."""
        start = 0 if after is None else bisect_right(self._fcfs, after)
        for _, request_id in islice(self._fcfs, start, None):
            yield self._items[request_id]

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items


class QueueView:
    """A read-only view of a `RequestQueue` as it is at one state version: what a `Snapshot`
    holds. It has no way to change the queue, and a read that starts after the state has moved
    on raises `StaleSnapshot` (`current_version` is the state's mutation counter). Reads are
    checked when they start, not per item: a policy runs start to end between two changes, and
    a per-item check cost a fifth of a simulation's time."""

    __slots__ = ("_queue", "_version", "_current_version")

    def __init__(self, queue: RequestQueue, current_version: Callable[[], int]) -> None:
        self._queue = queue
        self._current_version = current_version
        self._version = current_version()

    def _check(self) -> None:
        if self._current_version() != self._version:
            raise StaleSnapshot("the scheduler state changed after this snapshot was taken")

    def fcfs(self, after: tuple[float, int] | None = None) -> Iterator[QueuedRequest]:
        self._check()
        return self._queue.fcfs(after)

    def ordered(self, name: str, key: Callable[[QueuedRequest], Any], version: Any = None) -> Iterator[QueuedRequest]:
        self._check()
        return self._queue.ordered(name, key, version)

    def get(self, request_id: int) -> QueuedRequest:
        self._check()
        return self._queue.get(request_id)

    def __iter__(self) -> Iterator[QueuedRequest]:
        self._check()
        return iter(self._queue)

    def __len__(self) -> int:
        self._check()
        return len(self._queue)

    def __contains__(self, request_id: object) -> bool:
        self._check()
        return request_id in self._queue
