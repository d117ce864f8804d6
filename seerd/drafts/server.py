"""The grouped draft server: each group's response token logs, held by the coordinator.

Workers push the tokens their requests generate (`append`) and pull what their siblings generated
(`fetch`, as deltas against what they already hold); each worker drafts from its own local index
(`seerd.drafts.index`), never waiting for this server. The server stores token lists, not
suffix structures: lists are compact, cheap to append to and ship, and rebuilding an index from
them is one pass (a C++ suffix tree cannot be pickled; see ../shared/reference/platform.md).

One log per request: an int32 array of its response tokens and a generation number `gen`,
bumped whenever the log is rewritten (its request re-ran elsewhere and produced other tokens: a
chunk re-leased after its worker died). Prompts are not held: every worker that drafts for a
group has leased one of its requests, so it has the prompt already.

Pure and thread-confined: no I/O, no locks, time read from the `clock` passed in. The HTTP
layer calls it from one thread (as the lease book's state thread); a fetch returns the wire's own
`seerd.protocol.DraftChanges`; group and request ids that arrive as JSON object keys (strings) are taken.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from seerd.protocol import DraftChanges

# Out-of-order segments buffered per request until the gap before them fills; beyond this the
# farthest is dropped (the writer learns the held count from the next AppendResult and resends).
MAX_PENDING_SEGMENTS = 8
_TOKEN_MAX = 2**31 - 1


class DraftError(ValueError):
    """A draft server call that cannot be served as asked; the message says what to do."""


class UnknownGroup(DraftError):
    def __init__(self, group: int) -> None:
        super().__init__(f"group {group} is not registered (finished, expired, or never registered); "
                         f"register it before appending to it")
        self.group = group


class UnknownRequest(DraftError):
    def __init__(self, group: int, request: int) -> None:
        super().__init__(f"group {group} holds no tokens of request {request}; a request appears with "
                         f"its first append")
        self.group = group
        self.request = request


@dataclass(frozen=True)
class AppendResult:
    count: int  # tokens the server now holds for the request, contiguous from 0
    gen: int  # the log's generation (bumped by a rewrite)
    appended: int  # tokens added to the log by this call (buffered segments it released included)
    pending: int  # out-of-order segments still waiting for the gap before them
    rewritten: bool  # the call rewrote tokens the log held (a re-run): gen was bumped
    evicted: tuple[int, ...] = ()  # groups evicted to stay within max_tokens


@dataclass(slots=True)
class _RequestLog:
    gen: int
    tokens: array = field(default_factory=lambda: array("i"))
    pending: dict[int, array] = field(default_factory=dict)  # start -> out-of-order segment

    def held(self) -> int:
        return len(self.tokens) + sum(map(len, self.pending.values())) if self.pending else len(self.tokens)


@dataclass(slots=True)
class _Group:
    ttl_s: float
    last_active: float
    requests: dict[int, _RequestLog] = field(default_factory=dict)
    held: int = 0  # tokens in its logs and pending segments


class DraftServer:
    """Per-group token logs with idempotent, order-tolerant appends and delta fetches."""

    def __init__(self, *, max_tokens: int = 64_000_000, clock: Callable[[], float] = time.monotonic,
                 first_gen: int = 0) -> None:
        if max_tokens < 1:
            raise DraftError(f"max_tokens must be >= 1 (got {max_tokens})")
        self.max_tokens = max_tokens
        self._clock = clock
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # least recently active first
        self._held = 0
        self._appends = 0
        self._appended_tokens = 0
        self._duplicates = 0
        self._rewrites = 0
        self._evictions = {"finished": 0, "expired": 0, "memory": 0}
        # Gens are unique over the server's life; a restarted coordinator starts past the old
        # server's (first_gen from the wall clock), so no worker's cursor matches by accident.
        self._last_gen = first_gen

    # ---- lifecycle -----------------------------------------------------------------------

    def register(self, group: int, ttl_s: float) -> None:
        """Start holding `group` (idempotent: again, it refreshes the TTL and activity).
        A finished or evicted group registered again starts empty."""
        group = _id(group, "group")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise DraftError(f"ttl_s must be a number of seconds > 0 (got {ttl_s!r})")
        now = self._clock()
        state = self._groups.get(group)
        if state is None:
            self._groups[group] = _Group(float(ttl_s), now)
        else:
            state.ttl_s = float(ttl_s)
            self._touch(group, state, now)

    def finish(self, group: int) -> None:
        """The group is done: forget it (a no-op for an unknown group)."""
        if self._evict(_id(group, "group")):
            self._evictions["finished"] += 1

    def expire(self) -> list[int]:
        """Forget the groups idle (no register, append or fetch) for longer than their TTL."""
        now = self._clock()
        gone = [g for g, state in self._groups.items() if now - state.last_active > state.ttl_s]
        for group in gone:
            self._evict(group)
        self._evictions["expired"] += len(gone)
        return gone

    # ---- writing -------------------------------------------------------------------------

    def append(self, group: int, request: int, prev_count: int, tokens: Sequence[int]) -> AppendResult:
        """Add `tokens` to the request's log, placed after its first `prev_count` tokens.

        - tokens the log already holds, with the same values: nothing changes (a retry);
        - a segment starting past the log's end: buffered until the gap fills (`pending`);
        - tokens that differ from held ones: the request re-ran elsewhere and this writer is the
          newer one: the log is cut at the first difference, takes the new tokens, its `gen` is
          bumped and buffered segments are dropped (they may come from either writer).
        A request's log is created by its first append, whatever its `prev_count`.
        """
        group = _id(group, "group")
        request = _id(request, "request")
        if isinstance(prev_count, bool) or not isinstance(prev_count, int) or prev_count < 0:
            raise DraftError(f"prev_count must be an int >= 0 (got {prev_count!r})")
        segment = _tokens(tokens)
        state = self._groups.get(group)
        if state is None:
            raise UnknownGroup(group)
        self._touch(group, state, self._clock())
        log = state.requests.get(request)
        if log is None:
            log = state.requests[request] = _RequestLog(self._new_gen())
        before = log.held()
        written, rewritten = self._place(log, prev_count, segment)
        while log.pending and min(log.pending) <= len(log.tokens):
            start = min(log.pending)
            written += self._place(log, start, log.pending.pop(start), buffered=True)[0]
        self._appends += 1
        self._appended_tokens += written
        grown = log.held() - before
        state.held += grown
        self._held += grown
        evicted = self._make_room(group) if self._held > self.max_tokens else ()
        return AppendResult(len(log.tokens), log.gen, written, len(log.pending), rewritten, evicted)

    def _place(self, log: _RequestLog, start: int, segment: array, buffered: bool = False
               ) -> tuple[int, bool]:
        """Apply one segment to a log: (tokens written, whether held ones were rewritten).
        `buffered`: a segment that waited for its gap; it arrived before the tokens now held
        at its positions, so it loses a conflict with them."""
        held = log.tokens
        if not segment:
            return 0, False
        if start > len(held):
            self._buffer(log, start, segment)
            return 0, False
        end = start + len(segment)
        overlap = min(end, len(held)) - start
        if overlap and held[start:start + overlap] != segment[:overlap]:
            if buffered:
                return 0, False  # a newer writer has replaced these positions already
            first = next(i for i in range(overlap) if held[start + i] != segment[i])
            del held[start + first:]
            held.extend(segment[first:])
            log.gen = self._new_gen()
            log.pending.clear()  # from the old writer or the new one: the writer resends
            self._rewrites += 1
            return len(segment) - first, True
        if end > len(held):
            held.extend(segment[overlap:])
            return end - start - overlap, False
        if not buffered:
            self._duplicates += 1
        return 0, False

    def _new_gen(self) -> int:
        # Unique over the server's life, so a request created again (its group finished and
        # registered anew) never matches a cursor a client kept from before.
        self._last_gen += 1
        return self._last_gen

    def _buffer(self, log: _RequestLog, start: int, segment: array) -> None:
        pending = log.pending
        if start in pending and len(pending[start]) >= len(segment):
            return  # this segment (or a longer one from the same place) is buffered already
        pending[start] = segment
        if len(pending) > MAX_PENDING_SEGMENTS:
            del pending[max(pending)]  # the farthest from the gap waits longest: drop it

    # ---- reading -------------------------------------------------------------------------

    def fetch(self, cursors: Mapping[int | str, Mapping[int | str, Sequence[int]]]) -> DraftChanges:
        """What changed past the client's cursors: {group: {request: (gen, count)}} of what it
        holds (a request it has never seen is absent; a group it has never seen maps to {}).
        For each request whose log differs: (gen, start, tokens) with start = the client's count
        when its gen matches, else 0 (a reset). A fetch counts as activity of its groups."""
        now = self._clock()
        changes: dict[int, dict[int, tuple[int, int, list[int]]]] = {}
        dropped: dict[int, list[int]] = {}
        unknown: list[int] = []
        for group_key, held in cursors.items():
            group = _id(group_key, "group")
            state = self._groups.get(group)
            if state is None:
                unknown.append(group)
                continue
            self._touch(group, state, now)
            client = _cursors(group, held)
            delta = {}
            for request, log in state.requests.items():
                gen, count = client.pop(request, (None, 0))
                size = len(log.tokens)
                if gen == log.gen and count <= size:
                    if count < size:
                        delta[request] = (log.gen, count, log.tokens[count:].tolist())
                elif size or gen is not None:  # a new generation (or the client is ahead): reset
                    delta[request] = (log.gen, 0, log.tokens.tolist())
            if delta:
                changes[group] = delta
            if client:
                dropped[group] = sorted(client)
        return DraftChanges(changes, dropped, unknown)

    def tokens(self, group: int, request: int) -> list[int]:
        """A request's log as held (for inspection and tests)."""
        state = self._groups.get(_id(group, "group"))
        if state is None:
            raise UnknownGroup(group)
        log = state.requests.get(_id(request, "request"))
        if log is None:
            raise UnknownRequest(group, request)
        return log.tokens.tolist()

    def __contains__(self, group: int) -> bool:
        return group in self._groups

    # ---- memory --------------------------------------------------------------------------

    def _touch(self, group: int, state: _Group, now: float) -> None:
        state.last_active = now
        self._groups.move_to_end(group)

    def _evict(self, group: int) -> bool:
        state = self._groups.pop(group, None)
        if state is None:
            return False
        self._held -= state.held
        return True

    def _make_room(self, keep: int) -> tuple[int, ...]:
        """Evict expired groups, then the least recently active ones, until the tokens held fit
        `max_tokens`; never `keep` (a group larger than the bound on its own is held whole)."""
        now = self._clock()
        evicted = []
        expired = [g for g, s in self._groups.items() if g != keep and now - s.last_active > s.ttl_s]
        for group in expired:
            if self._held <= self.max_tokens:
                break
            self._evict(group)
            evicted.append(group)
            self._evictions["expired"] += 1
        while self._held > self.max_tokens:
            oldest = next((g for g in self._groups if g != keep), None)
            if oldest is None:
                break
            self._evict(oldest)
            evicted.append(oldest)
            self._evictions["memory"] += 1
        return tuple(evicted)

    def stats(self) -> dict:
        """Counts and memory, JSON-ready. `tokens`: held in logs and pending segments (what
        `max_tokens` bounds); `bytes`: a `sys.getsizeof` estimate over the logs, their records and
        the group tables (O(requests): not for every call)."""
        size = sys.getsizeof
        total = size(self._groups)
        requests = 0
        for state in self._groups.values():
            total += size(state) + size(state.requests)
            requests += len(state.requests)
            for log in state.requests.values():
                total += size(log) + size(log.gen) + size(log.tokens) + size(log.pending)
                total += sum(size(seg) for seg in log.pending.values())
        return {
            "groups": len(self._groups),
            "requests": requests,
            "tokens": self._held,
            "bytes": total,
            "bytes_per_million_tokens": round(total * 1e6 / self._held) if self._held else None,
            "appends": self._appends,
            "appended_tokens": self._appended_tokens,
            "duplicates": self._duplicates,
            "rewrites": self._rewrites,
            "evictions": dict(self._evictions),
        }


def _id(value, what: str) -> int:
    """A group or request id: an int, or its decimal string (a JSON object key)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise DraftError(f"{what} id must be an int or its decimal string (got {value!r})")


def _tokens(tokens: Sequence[int]) -> array:
    if isinstance(tokens, (str, bytes)):
        raise DraftError(f"tokens must be a list of token ids (got {type(tokens).__name__})")
    try:
        segment = array("i", tokens)
    except (TypeError, OverflowError):
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
                    or not 0 <= t <= _TOKEN_MAX), tokens)
        raise DraftError(f"tokens must be token ids, ints in 0..{_TOKEN_MAX} (got {bad!r})") from None
    if segment and min(segment) < 0:
        raise DraftError(f"tokens must be token ids, ints in 0..{_TOKEN_MAX} (got {min(segment)})")
    return segment


def _cursors(group: int, held: Mapping) -> dict[int, tuple[int, int]]:
    """A client's {request: (gen, count)} with int keys, checked."""
    if not isinstance(held, Mapping):
        raise DraftError(f"the cursors of group {group} must map request ids to [gen, count] "
                         f"(got {type(held).__name__})")
    out = {}
    for request, cursor in held.items():
        try:
            gen, count = cursor
        except (TypeError, ValueError):
            raise DraftError(f"cursor of group {group} request {request} must be [gen, count] "
                             f"(got {cursor!r})") from None
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in (gen, count)):
            raise DraftError(f"cursor of group {group} request {request} must be two ints >= 0 "
                             f"(got {cursor!r})")
        out[_id(request, "request")] = (gen, count)
    return out
