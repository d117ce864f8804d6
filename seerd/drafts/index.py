"""A group's local suffix index: draft tokens by the longest suffix match over sibling responses.

A worker keeps one `SuffixIndex` per group it serves, fed with the group's token logs (the prompt
and each request's response, as deltas from the draft server), and asks it for a draft before
each verification step. It is pure Python on purpose: a C++ suffix tree cannot be pickled or
shipped between processes, and this structure is rebuilt from token lists in one pass.

Layout (one index per group):
- each sequence's tokens in a Python list; a sequence has a slot number;
- every position `end` of a sequence (its first `end` tokens) with `end >= min_match` has a
  *key*, the `min_match` tokens ending there. `_newest[key]` holds the key's newest occurrence
  in the whole group (a location: slot and end) and how many occurrences it has; `_older[slot]
  [end]` is the location of the occurrence before that one. So every key has a chain of its
  occurrences, newest first, across sequences, and appending tokens costs a few C-level passes
  over them (zip, map, dict) instead of a Python loop per token.

`propose(context)` finds the longest suffix of the context (at most `max_match`) that occurs
followed by a token, then lets its newest `max_candidates` occurrences vote the draft:
- the match grows by questions "does the last `need` tokens occur?", from `need = min_match`
  up. Each is answered on the chain of the *rarest* key inside those tokens (every occurrence of
  the suffix holds that key at a fixed offset), one slice comparison per link; the first hit is
  measured backwards token by token and the next question asks for one token more. A "no" ends
  it: the last match is the longest.
- the voters are collected on the chain of the context's last key, whose order is the order in
  which occurrences were completed: "newest" means the last token indexed most recently.

Each walk visits at most `max_scan` links. The guarantee, tested against a brute force: when no
walk is cut short, `match_len` is the longest match in the whole index and the voters are its
newest `max_candidates` occurrences. No walk is cut when the context's last `min_match` tokens
occur at most `max_scan` times in the index (every suffix contains them, so its rarest key occurs
no more often). Beyond that a walk may stop early: `match_len` is then a match that exists but
perhaps not the longest (rarely: the questions walk rare keys), and the voters those of its
occurrences met in the newest `max_scan` occurrences of the last key, plus the one the match
was measured on. Positions of dropped sequences count toward `max_scan` until the next rebuild.

Why `max_scan = 64` (2 x `max_candidates`): the voters' walk is what a call costs, and on the
motif replay of tools/bench/drafts.py tokens per step stayed within 0.5% from 32 to 256 (2.66 /
2.67 / 2.67 / 2.67 at 32 / 64 / 128 / 256) while the median drafting call went from ~75 to ~120 us.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, and_, rshift

# A location is slot << _SLOT_SHIFT | end; `_newest` values add count << _COUNT_SHIFT.
_SLOT_SHIFT = 32
_END_MASK = (1 << _SLOT_SHIFT) - 1
_MAX_SLOTS = 1 << 20
_COUNT_SHIFT = _SLOT_SHIFT + 20
_LOCATION_MASK = (1 << _COUNT_SHIFT) - 1
_ONE_MORE = 1 << _COUNT_SHIFT
_COUNT_BITS = ~_LOCATION_MASK
_NONE = 0  # no occurrence: no location is 0, since end >= min_match >= 1
# Tokens are keyed in segments this long: a key repeated inside a segment (periodic text) needs
# the slow per-token path, and short segments rarely repeat one.
_SEGMENT = 16
_FEW = 4  # fewer new keys than this: a plain loop costs less than the C passes' setup
# Rebuild the chains once dropped sequences hold more tokens than this and than the live ones.
_REBUILD_MIN_DEAD = 4096


@dataclass(frozen=True)
class Draft:
    """Speculated tokens for one request; no tokens when nothing in the index matches. Each call
    returns a new one, so a caller may extend its tokens."""

    tokens: list[int] = field(default_factory=list)
    match_len: int = 0  # length of the context's suffix found in the index
    support: int = 0  # occurrences of that suffix whose continuation is the first draft token



class SuffixIndex:
    """One group's index: the prompt plus each request's response tokens. Not thread-safe: a
    worker keeps it on the thread that drafts."""

    def __init__(self, min_match: int = 3, max_match: int = 16, max_candidates: int = 32,
                 max_scan: int = 64) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got min_match={min_match}, "
                             f"max_match={max_match}")
        if not 1 <= max_candidates <= max_scan:
            raise ValueError(f"need 1 <= max_candidates <= max_scan, got max_candidates="
                             f"{max_candidates}, max_scan={max_scan}")
        self.min_match = min_match
        self.max_match = max_match
        self.max_candidates = max_candidates
        self.max_scan = max_scan
        self._slot_of: dict[Hashable, int] = {}
        self._tokens: list[list[int]] = []  # by slot; emptied when dropped
        self._older: list[array] = []  # by slot, indexed by end: the previous occurrence's location
        self._newest: dict[tuple[int, ...], int] = {}  # key -> count and newest location
        self.num_tokens = 0  # tokens of the live sequences
        self._dead_tokens = 0  # tokens of dropped sequences, still linked in the chains

    # ---- feeding -------------------------------------------------------------------------

    def extend(self, seq_key: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to the sequence `seq_key` (created if new)."""
        slot = self._slot_of.get(seq_key)
        if slot is None:
            slot = self._new_slot(seq_key)
        self._append(slot, tokens)

    def replace(self, seq_key: Hashable, tokens: Sequence[int]) -> None:
        """The sequence was rewritten (its request re-ran elsewhere): forget it, index `tokens`."""
        self.drop(seq_key)
        self.extend(seq_key, tokens)

    def drop(self, seq_key: Hashable) -> None:
        """Forget a sequence. Its positions stay linked in the chains, skipped by walks, until
        dropped tokens outnumber the live ones and the chains are rebuilt."""
        slot = self._slot_of.pop(seq_key, None)
        if slot is None:
            return
        seq = self._tokens[slot]
        self._tokens[slot] = []  # walks see no continuation there
        self.num_tokens -= len(seq)
        self._dead_tokens += len(seq)
        if self._dead_tokens > max(_REBUILD_MIN_DEAD, self.num_tokens):
            self._rebuild()

    def length(self, seq_key: Hashable) -> int:
        """Tokens held for `seq_key` (0 if unknown)."""
        slot = self._slot_of.get(seq_key)
        return 0 if slot is None else len(self._tokens[slot])

    def __contains__(self, seq_key: Hashable) -> bool:
        return seq_key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def _new_slot(self, seq_key: Hashable) -> int:
        if len(self._tokens) == _MAX_SLOTS:
            self._rebuild()  # renumbers the live sequences from 0
            if len(self._tokens) == _MAX_SLOTS:
                raise OverflowError(f"an index holds at most {_MAX_SLOTS} sequences")
        slot = len(self._tokens)
        self._slot_of[seq_key] = slot
        self._tokens.append([])
        # Ends below min_match have no key; padding lets `_older[slot][end]` index by end.
        self._older.append(array("q", repeat(_NONE, self.min_match)))
        return slot

    def _append(self, slot: int, tokens: Sequence[int]) -> None:
        seq = self._tokens[slot]
        old_len = len(seq)
        seq.extend(tokens)
        new_len = len(seq)
        if new_len > _END_MASK:
            raise OverflowError(f"a sequence holds at most {_END_MASK} tokens")
        self.num_tokens += new_len - old_len
        m = self.min_match
        base = slot << _SLOT_SHIFT
        older = self._older[slot]
        newest = self._newest
        first = max(old_len + 1, m)  # the first new position that has a key
        if first > new_len:
            return
        if new_len - first < _FEW:
            for end in range(first, new_len + 1):
                key = tuple(seq[end - m:end])
                head = newest.get(key, _NONE)
                older.append(head & _LOCATION_MASK)
                newest[key] = base + end + _ONE_MORE + (head & _COUNT_BITS)
            return
        window = seq[first - m:]
        all_keys = list(zip(*[window[i:] for i in range(m)]))  # all_keys[j] ends at first + j
        # A key's new head: its location, and the count one more than before.
        all_counted = range(base + first + _ONE_MORE, base + new_len + 1 + _ONE_MORE)
        for j in range(0, len(all_keys), _SEGMENT):
            keys = all_keys[j:j + _SEGMENT]
            counted = all_counted[j:j + _SEGMENT]
            heads = list(map(newest.get, keys, repeat(_NONE)))
            batch = dict(zip(keys, map(add, counted, map(and_, heads, repeat(_COUNT_BITS)))))
            if len(batch) == len(keys):
                older.extend(map(and_, heads, repeat(_LOCATION_MASK)))
                newest.update(batch)
            else:  # a key repeats inside the segment: chain its occurrences one by one
                for key, location in zip(keys, counted):
                    head = newest.get(key, _NONE)
                    older.append(head & _LOCATION_MASK)
                    newest[key] = location + (head & _COUNT_BITS)

    def _rebuild(self) -> None:
        """Index the live sequences again from scratch, renumbered in creation order (so between
        sequences, "newer" becomes "created later" for the text indexed before the rebuild)."""
        live = sorted(self._slot_of.items(), key=lambda item: item[1])
        tokens = [self._tokens[slot] for _, slot in live]
        self._slot_of.clear()
        self._tokens.clear()
        self._older.clear()
        self._newest.clear()
        self.num_tokens = 0
        self._dead_tokens = 0
        for (key, _), seq in zip(live, tokens):
            self.extend(key, seq)

    # ---- drafting ------------------------------------------------------------------------

    def propose(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.0) -> Draft:
        """Draft up to `max_tokens` tokens to follow `context` (see the module docstring)."""
        m = self.min_match
        if max_tokens <= 0 or len(context) < m:
            return Draft()
        # Where nothing matches (most rows of a batch the model does not repeat itself in), the
        # last m tokens never occurred: one lookup, not one per key of the whole tail.
        if self._newest.get(tuple(context[-m:]), _NONE) == _NONE:
            return Draft()
        tail = list(context[-self.max_match:])
        cap = len(tail)
        keys = list(zip(*[tail[i:] for i in range(m)]))  # keys[i] = tail[i:i + m]
        heads = list(map(self._newest.get, keys, repeat(_NONE)))
        if heads[-1] == _NONE:
            return Draft()
        counts = list(map(rshift, heads, repeat(_COUNT_SHIFT)))
        # Grow the match: find an occurrence of the last `need` tokens (on the chain of the
        # rarest key inside them), measure how far back it matches, ask for one token more.
        best = 0
        found = None
        need = m
        while need <= cap:
            rarest = min(range(cap - need, cap - m + 1), key=counts.__getitem__)
            if counts[rarest] == 0:
                break
            hit = self._occurrences(tail, need, rarest, heads[rarest], 1)
            if not hit:
                break
            found = hit[0]
            seq = self._tokens[found[0]]
            end = found[1]
            best = need
            while best < cap and end > best and seq[end - best - 1] == tail[cap - best - 1]:
                best += 1
            need = best + 1
        if found is None:
            return Draft()
        # The voters: the newest occurrences, found on the chain of the last key, whose order
        # is the order in which occurrences were completed.
        ties = self._occurrences(tail, best, cap - m, heads[-1], self.max_candidates)
        if found not in ties and len(ties) < self.max_candidates:  # the walk was cut before it
            ties.append(found)
        tokens_of = self._tokens
        return _vote([tokens_of[slot][end:end + max_tokens] for slot, end in ties], best, min_prob)

    def _occurrences(self, tail: list[int], length: int, key_at: int, head: int, limit: int
                     ) -> list[tuple[int, int]]:
        """The first `limit` occurrences (slot, end) of `tail[-length:]` with a continuation,
        walking from `head` the chain of the key `tail[key_at:key_at + min_match]`, which lies
        inside that suffix. Visits at most `max_scan` links."""
        cap = len(tail)
        shift = cap - key_at - self.min_match  # the suffix ends this many tokens after the key
        pattern = tail[cap - length:]
        tokens_of, older_of = self._tokens, self._older
        location = head & _LOCATION_MASK
        found: list[tuple[int, int]] = []
        budget = self.max_scan
        while location != _NONE and budget:
            budget -= 1
            slot = location >> _SLOT_SHIFT
            key_end = location & _END_MASK
            location = older_of[slot][key_end]
            seq = tokens_of[slot]
            end = key_end + shift
            # No continuation (yet, or a dropped sequence, emptied), or the suffix differs. When
            # end < length the slice wraps around and comes out shorter: unequal as well.
            if end >= len(seq) or seq[end - length:end] != pattern:
                continue
            found.append((slot, end))
            if len(found) == limit:
                break
        return found

    # ---- accounting ----------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by the index (a `sys.getsizeof` estimate over its structures, counting a
        token object for every token outside CPython's shared small ints; O(tokens): for stats)."""
        size = sys.getsizeof
        total = size(self) + size(self._slot_of) + size(self._tokens) + size(self._older) + size(self._newest)
        total += sum(size(key) for key in self._slot_of)
        for seq in self._tokens:
            total += size(seq) + size(1 << 20) * sum(1 for t in seq if not -5 <= t <= 256)
        total += sum(size(links) for links in self._older)
        some_key = next(iter(self._newest), None)
        if some_key is not None:  # a key's ints are the tokens' own objects; its value is one int
            total += (size(some_key) + size(_ONE_MORE)) * len(self._newest)
        return total


def _vote(continuations: list[list[int]], match_len: int, min_prob: float) -> Draft:
    """Build a draft token by token by majority vote over `continuations` (newest first; a tie
    goes to the newest), keeping only those that agree with the path so far. Stop when none
    continues, or before the path's probability (the product of agreeing / voting at each
    position) would fall below `min_prob`."""
    # Identical continuations are common (repeated text): vote with the distinct ones, weighted.
    # Counter keeps first-seen order, so the newest continuation comes first.
    weighted = Counter(map(tuple, continuations))
    if len(weighted) == 1:
        (only, weight), = weighted.items()
        return Draft(list(only), match_len, weight)
    (top, top_weight), = weighted.most_common(1)  # the first of equals: the newest
    longest = max(map(len, weighted))
    # A continuation holding more than half of the votes wins every position while it stays
    # alive; without a probability floor the rest of the draft is then known.
    top_decides = min_prob <= 0.0 and len(top) == longest
    alive = list(weighted.items())
    alive_weight = len(continuations)  # counts those that end too: an upper bound of the votes
    draft: list[int] = []
    support = 0
    prob = 1.0
    for pos in range(longest):
        if top_decides and pos and 2 * top_weight > alive_weight:
            draft.extend(top[pos:])
            break
        votes: dict[int, int] = {}
        for cont, weight in alive:
            if len(cont) > pos:
                token = cont[pos]
                votes[token] = votes.get(token, 0) + weight
        if not votes:
            break
        token, agree = max(votes.items(), key=_count)  # max() keeps the first (newest) of equals
        prob *= agree / sum(votes.values())
        if prob < min_prob:
            break
        draft.append(token)
        if pos == 0:
            support = agree
        alive = [item for item in alive if len(item[0]) > pos and item[0][pos] == token]
        alive_weight = agree
        if len(alive) == 1:  # one path left: it continues with certainty
            draft.extend(alive[0][0][pos + 1:])
            break
        if top_decides and top[pos] != token:
            top_decides = False
    return Draft(draft, match_len, support)


def _count(item: tuple[int, int]) -> int:
    return item[1]
