"""The request buffer as the scheduler sees it: queued requests kept in order as they change.

The lease book (and the simulator) update it incrementally: a request enters when it waits for
its next chunk and leaves when leased. Besides first-come-first-served order, a policy can ask for
its own order by name and key (`ordered`); the index is built once and then kept up to date on
every put and remove, so a lease call costs O(log n + k) rather than a sort of every queued request.
Orders are `SortedList`s (sortedcontainers): a put or remove is O(log n) where a plain list's
insort moved every entry after it (~35 us at 80,000 queued; the first chunk boundaries of 512
engines re-queue thousands of requests and their siblings at once: 0.4 s of one state-thread
turn in tools/bench/load.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from seerd.scheduler.views import QueuedRequest


class StaleSnapshot(RuntimeError):
    """A snapshot's queue was read after the scheduler state changed: plan on a fresh snapshot."""


# Runs a function aside (e.g. `ThreadPoolExecutor.submit`): where a re-key is built, off the caller.
Submit = Callable[..., "Future[Any]"]


class RequestQueue:
    def __init__(self, rekey_aside: Submit | None = None) -> None:
        """`rekey_aside`: where a re-key for a new version is built while the index in place
        serves on (`_Index.rekey_aside`); None re-keys in place, at the call that sees the new
        version (the simulator: the same order whatever the timing)."""
        self._rekey_aside = rekey_aside
        self._items: dict[int, QueuedRequest] = {}
        self._fcfs: SortedList = SortedList()  # (queued_at, request_id)
        self._indexes: dict[str, _Index] = {}
        # (context, request id) of every put, a min-heap read lazily: an entry counts while its
        # request is queued with that context (`shortest_context`); the rest are dropped as met.
        self._contexts: list[tuple[int, int]] = []

    @classmethod
    def of(cls, requests: Iterable[QueuedRequest]) -> RequestQueue:
        queue = cls()
        for request in requests:
            queue.put(request)
        return queue

    def put(self, request: QueuedRequest) -> None:
        """Queue `request`, or replace the queued view of the same id with it."""
        old = self._items.get(request.request_id)
        if old is not None:
            self._replace(old, request)
            return
        self._items[request.request_id] = request
        self._fcfs.add((request.queued_at, request.request_id))
        self._note_context(request)
        for index in self._indexes.values():
            index.put(request)

    def _note_context(self, request: QueuedRequest) -> None:
        if len(self._contexts) > 2 * len(self._items) + 64:  # mostly stale: start again from what is queued
            self._contexts = [(_context(r), r.request_id) for r in self._items.values()]
            heapq.heapify(self._contexts)
        else:
            heapq.heappush(self._contexts, (_context(request), request.request_id))

    def _replace(self, old: QueuedRequest, new: QueuedRequest) -> None:
        """A queued request's view changed (its group's progress, say): each order moves it only
        if its key there changed. A report re-puts its queued siblings; each was a remove and an
        add in every order, though its first-come place (and often its context) stays the same
        (in tools/bench/group_leases.py 30% of the puts; the saving was below that bench's noise)."""
        request_id = new.request_id
        self._items[request_id] = new
        if old.queued_at != new.queued_at:
            self._fcfs.remove((old.queued_at, request_id))
            self._fcfs.add((new.queued_at, request_id))
        if _context(old) != _context(new):
            self._note_context(new)
        for index in self._indexes.values():
            index.replace(old, new)

    def remove(self, request_id: int) -> QueuedRequest:
        request = self._items.pop(request_id)
        self._fcfs.remove((request.queued_at, request_id))
        for index in self._indexes.values():
            index.remove(request)
        return request

    def ordered(self, name: str, key: Callable[[QueuedRequest], Any], version: Any = None,
                versioned: Callable[[QueuedRequest], bool] | None = None) -> Iterator[QueuedRequest]:
        """Queued requests ascending by `key`, ties by request id; the index named `name` is
        built on first use and maintained from then on. `key` returns a tuple (keys that agree on
        their first element of one length): the index keeps it with the id appended, flat, which
        sorts twice as fast as a (key, id) pair (70,000 entries: 58 against 129 ms; ints first
        are compared natively). `key` must depend on the request only
        (not on the clock) and behave the same for as long as `version` does not change; a new
        version (say, of a table the key reads) re-keys the index with the key given then: every
        request, or with `versioned` only those it says may have a new key (the rest keep theirs:
        re-keying 80,000 queued requests for seer took ~90 ms of the state thread, at each of the
        growth table's ~20 refreshes in a run's first two minutes). With `rekey_aside`, the
        re-key is built aside and taken up by a later call once built; until then the order of
        the previous version serves (a re-key of 100,000 queued requests held the state thread
        100-220 ms at each of a run's ~37 refreshes, and every call waited behind it)."""
        index = self._indexes.get(name)
        if index is None:
            index = self._indexes[name] = _Index(key, version, versioned, self._items.values())
        elif index.version != version:
            if self._rekey_aside is None:
                index.rekey(key, version, versioned, self._items)
            else:
                index.rekey_aside(key, version, versioned, self._items, self._rekey_aside)
        for entry in index.order:
            request_id = entry[-1]
            yield self._items[request_id]

    def get(self, request_id: int) -> QueuedRequest:
        return self._items[request_id]

    def shortest_context(self) -> int | None:
        """The fewest tokens (prompt and generated) any queued request has; None if none is queued.
        A worker without KV room past it can be given nothing (`base.admit`)."""
        contexts = self._contexts
        while contexts:
            context, request_id = contexts[0]
            request = self._items.get(request_id)
            if request is not None and _context(request) == context:
                return context
            heapq.heappop(contexts)
        return None

    def oldest_queued_at(self) -> float | None:
        """When the request queued longest ago was queued; None if none is."""
        return self._fcfs[0][0] if self._fcfs else None

    def fcfs(self, after: tuple[float, int] | None = None) -> Iterator[QueuedRequest]:
        """Oldest first; ties by request id. With `after` (a queued_at and request id), only the
        requests queued after it in that order."""
        start = 0 if after is None else self._fcfs.bisect_right(after)
        for _, request_id in self._fcfs.islice(start):
            yield self._items[request_id]

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items


def _context(request: QueuedRequest) -> int:
    return request.prompt_len + request.generated


class _Index:
    """One order of the queue: its entries, each a request's key (a tuple) with its id appended,
    ascending, kept as requests come and go, and
    the ids of the requests whose key may change with the next version (`versioned`)."""

    __slots__ = ("key", "version", "versioned", "order", "volatile", "pending")

    def __init__(self, key: Callable[[QueuedRequest], Any], version: Any,
                 versioned: Callable[[QueuedRequest], bool] | None, requests: Iterable[QueuedRequest]) -> None:
        self.key, self.version, self.versioned = key, version, versioned
        self.order = SortedList(key(r) + (r.request_id,) for r in requests)
        self.volatile = set() if versioned is None else {r.request_id for r in requests if versioned(r)}
        self.pending: _Rebuild | None = None

    def put(self, request: QueuedRequest) -> None:
        if self.pending is not None:
            self.pending.touched.add(request.request_id)
        self.order.add(self.key(request) + (request.request_id,))
        if self.versioned is not None and self.versioned(request):
            self.volatile.add(request.request_id)

    def remove(self, request: QueuedRequest) -> None:
        self._remove_entry(request, self.key(request) + (request.request_id,))
        self.volatile.discard(request.request_id)
        if self.pending is not None:
            self.pending.touched.add(request.request_id)

    def replace(self, old: QueuedRequest, new: QueuedRequest) -> None:
        """`remove(old)` then `put(new)`, moving nothing where the key is the same."""
        request_id = new.request_id
        old_entry, new_entry = self.key(old) + (request_id,), self.key(new) + (request_id,)
        if old_entry != new_entry:
            self._remove_entry(old, old_entry)
            self.order.add(new_entry)
        if self.versioned is not None:
            if self.versioned(new):
                self.volatile.add(request_id)
            else:
                self.volatile.discard(request_id)
        if self.pending is not None:
            self.pending.touched.add(request_id)

    def _remove_entry(self, request: QueuedRequest, entry: tuple) -> None:
        try:
            self.order.remove(entry)
        except ValueError:
            raise RuntimeError(f"request {request.request_id} is not where its key puts it: its key changed "
                               "while it was queued (a key that reads the version must be `versioned`)") from None

    def rekey(self, key: Callable[[QueuedRequest], Any], version: Any,
              versioned: Callable[[QueuedRequest], bool] | None, items: dict[int, QueuedRequest]) -> None:
        if versioned is None or self.versioned is None:
            self.__init__(key, version, versioned, items.values())
            return
        volatile = self.volatile
        kept = [entry for entry in self.order if entry[-1] not in volatile]
        kept += sorted(key(items[rid]) + (rid,) for rid in volatile)
        # Two sorted runs: the sort in SortedList's constructor (timsort) merges them in linear time.
        self.key, self.version, self.versioned, self.order = key, version, versioned, SortedList(kept)

    def rekey_aside(self, key: Callable[[QueuedRequest], Any], version: Any,
                    versioned: Callable[[QueuedRequest], bool] | None, items: dict[int, QueuedRequest],
                    submit: Submit) -> None:
        """Build the index of `version` aside, from a copy of the queue as it is now; the requests
        put or removed until it is built are noted, and re-keyed when a later call takes it up.
        The index stays that of its version until then (its puts keyed as its order is)."""
        pending = self.pending
        if pending is not None:
            if not pending.built.done():
                return
            self.pending = None
            self._take_up(pending, items)  # a newer version than the one in place, if not the newest
            if self.version == version:
                return
        self.pending = _Rebuild(key, version, versioned, submit(_build, key, versioned, list(items.values())))

    def _take_up(self, pending: _Rebuild, items: dict[int, QueuedRequest]) -> None:
        order, entries, volatile = pending.built.result()
        for request_id in pending.touched:  # changed since the copy: keyed as they are now
            entry = entries.get(request_id)
            if entry is not None:
                order.remove(entry)
            volatile.discard(request_id)
            request = items.get(request_id)
            if request is not None:
                order.add(pending.key(request) + (request_id,))
                if pending.versioned is not None and pending.versioned(request):
                    volatile.add(request_id)
        self.key, self.version, self.versioned = pending.key, pending.version, pending.versioned
        self.order, self.volatile = order, volatile


@dataclass
class _Rebuild:
    """An index being built aside for `version`, and the requests put or removed meanwhile."""

    key: Callable[[QueuedRequest], Any]
    version: Any
    versioned: Callable[[QueuedRequest], bool] | None
    built: Future
    touched: set[int] = field(default_factory=set)


def _build(key: Callable[[QueuedRequest], Any], versioned: Callable[[QueuedRequest], bool] | None,
           requests: list[QueuedRequest]) -> tuple[SortedList, dict[int, tuple], set[int]]:
    """An index's order, each request's entry in it and its volatile ids (`_Index`), aside."""
    entries = {r.request_id: key(r) + (r.request_id,) for r in requests}
    volatile = set() if versioned is None else {r.request_id for r in requests if versioned(r)}
    return SortedList(entries.values()), entries, volatile


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

    def ordered(self, name: str, key: Callable[[QueuedRequest], Any], version: Any = None,
                versioned: Callable[[QueuedRequest], bool] | None = None) -> Iterator[QueuedRequest]:
        self._check()
        return self._queue.ordered(name, key, version, versioned)

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

    def shortest_context(self) -> int | None:
        self._check()
        return self._queue.shortest_context()

    def oldest_queued_at(self) -> float | None:
        self._check()
        return self._queue.oldest_queued_at()
