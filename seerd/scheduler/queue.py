"""The request buffer as the scheduler sees it: queued requests kept in order as they change.

The lease book updates it incrementally (a request enters when it waits for its next chunk and
leaves when leased), so a lease call costs O(log n + k) rather than a rebuild and sort of every
queued request.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator

from seerd.scheduler.base import QueuedRequest


class RequestQueue:
    def __init__(self) -> None:
        self._items: dict[int, QueuedRequest] = {}
        self._fcfs: list[tuple[float, int]] = []  # (queued_at, request_id), ascending

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

    def remove(self, request_id: int) -> QueuedRequest:
        request = self._items.pop(request_id)
        index = bisect_left(self._fcfs, (request.queued_at, request_id))
        del self._fcfs[index]
        return request

    def fcfs(self) -> Iterator[QueuedRequest]:
        """Oldest first; ties by request id."""
        for _, request_id in self._fcfs:
            yield self._items[request_id]

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items
