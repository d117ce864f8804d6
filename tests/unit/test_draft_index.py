"""The local suffix index against a brute-force reference on random small-vocabulary sequences.

The reference keeps every sequence as a list and the moment each position was indexed (its
recency), and answers `propose` by the definition: the longest suffix of the context (between
min_match and max_match tokens) that occurs followed by a token, its newest `max_candidates`
occurrences, and a token-by-token majority vote over their continuations.
"""

from __future__ import annotations

import random

import pytest

from seerd.drafts.index import Draft, SuffixIndex


class Reference:
    def __init__(self, min_match=3, max_match=16, max_candidates=32):
        self.min_match, self.max_match, self.max_candidates = min_match, max_match, max_candidates
        self.seqs: dict = {}
        self.indexed_at: dict = {}  # key -> [clock at which each position end (index = end) was indexed]
        self.clock = 0

    def extend(self, key, tokens):
        seq = self.seqs.setdefault(key, [])
        stamps = self.indexed_at.setdefault(key, [None])
        for token in tokens:
            seq.append(token)
            self.clock += 1
            stamps.append(self.clock)

    def replace(self, key, tokens):
        self.drop(key)
        self.extend(key, tokens)

    def drop(self, key):
        self.seqs.pop(key, None)
        self.indexed_at.pop(key, None)

    def occurrences(self, pattern):
        """(recency, key, end) of every occurrence of `pattern` followed by a token, newest first."""
        n = len(pattern)
        found = [(self.indexed_at[key][end], key, end)
                 for key, seq in self.seqs.items()
                 for end in range(n, len(seq))
                 if seq[end - n:end] == pattern]
        return sorted(found, reverse=True)

    def longest(self, context):
        cap = min(self.max_match, len(context))
        for length in range(cap, self.min_match - 1, -1):
            if self.occurrences(list(context[-length:])):
                return length
        return 0

    def propose(self, context, max_tokens, min_prob=0.0):
        best = self.longest(context)
        if best == 0 or max_tokens <= 0:
            return Draft()
        chosen = self.occurrences(list(context[-best:]))[:self.max_candidates]
        alive = [self.seqs[key][end:end + max_tokens] for _, key, end in chosen]  # newest first
        draft, prob, support = [], 1.0, 0
        for pos in range(max_tokens):
            voters = [c for c in alive if len(c) > pos]
            if not voters:
                break
            counts: dict[int, int] = {}
            for c in voters:
                counts[c[pos]] = counts.get(c[pos], 0) + 1
            top = max(counts.values())
            token = next(c[pos] for c in voters if counts[c[pos]] == top)  # the newest of the tied
            prob *= top / len(voters)
            if prob < min_prob:
                break
            draft.append(token)
            support = support or top
            alive = [c for c in voters if c[pos] == token]
        return Draft(draft, best, support)


def continues_an_occurrence(ref: Reference, context, draft: Draft) -> bool:
    """The draft follows, in some sequence, an occurrence of the matched suffix."""
    pattern = list(context[-draft.match_len:]) + draft.tokens
    n = len(pattern)
    return any(seq[end - n:end] == pattern for seq in ref.seqs.values() for end in range(n, len(seq) + 1))


def positions_of(ref: Reference, key) -> int:
    """Every indexed position whose last tokens are `key` (followed by a token or not)."""
    n = len(key)
    return sum(seq[end - n:end] == list(key) for seq in ref.seqs.values() for end in range(n, len(seq) + 1))


def random_run(rng: random.Random, index: SuffixIndex, ref: Reference, vocab: int, steps: int,
               rewrites: bool = True):
    """Interleave random extends (and a few replaces and drops); yield after each step."""
    keys = list(range(rng.randint(1, 5)))
    for _ in range(steps):
        key = rng.choice(keys)
        action = rng.random() if rewrites else 1.0
        if action < 0.04 and ref.seqs.get(key):
            index.drop(key)
            ref.drop(key)
        elif action < 0.08:
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
            index.replace(key, tokens)
            ref.replace(key, tokens)
        else:
            tokens = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5, 17, 40]))]
            index.extend(key, tokens)
            ref.extend(key, tokens)
        yield key


@pytest.mark.parametrize("seed", range(40))
def test_propose_equals_the_reference_when_no_walk_is_cut(seed):
    rng = random.Random(seed)
    min_match = rng.choice([1, 2, 3, 3, 4])
    max_match = rng.choice([min_match, min_match + 2, 8, 16])
    max_candidates = rng.choice([1, 3, 32])
    vocab = rng.randint(3, 6)
    index = SuffixIndex(min_match, max_match, max_candidates, max_scan=1 << 30)
    ref = Reference(min_match, max_match, max_candidates)
    for key in random_run(rng, index, ref, vocab, 50):
        for _ in range(3):
            if ref.seqs.get(key) and rng.random() < 0.7:  # the usual query: a request's own tokens
                context = ref.seqs[key][:len(ref.seqs[key]) - rng.choice([0, 0, 1, 5])]
            else:
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
            k = rng.choice([1, 4, 8, 12])
            min_prob = rng.choice([0.0, 0.0, 0.3, 0.6])
            got = index.propose(context, k, min_prob)
            assert got == ref.propose(context, k, min_prob), (context, k, min_prob)
            if got.tokens:
                assert continues_an_occurrence(ref, context, got)
        assert index.length(key) == len(ref.seqs.get(key, []))
    assert index.num_tokens == sum(map(len, ref.seqs.values()))


@pytest.mark.parametrize("seed", range(20))
def test_cut_walks_still_give_valid_drafts_and_never_overstate_the_match(seed):
    rng = random.Random(1000 + seed)
    vocab = rng.randint(2, 4)  # few keys, long chains: walks of 4 links are cut often
    index = SuffixIndex(3, 12, max_candidates=2, max_scan=4)
    ref = Reference(3, 12, 2)
    for key in random_run(rng, index, ref, vocab, 60):
        context = ref.seqs.get(key) or [rng.randrange(vocab) for _ in range(8)]
        got = index.propose(context, 6)
        assert got.match_len <= ref.longest(context)
        assert bool(got.tokens) == (got.match_len > 0)
        if got.tokens:
            assert continues_an_occurrence(ref, context, got)
            assert 1 <= got.support <= 2
    assert index.num_tokens == sum(map(len, ref.seqs.values()))


@pytest.mark.parametrize("seed", range(20))
def test_exact_whenever_the_last_key_occurs_at_most_max_scan_times(seed):
    """The documented guarantee, with a small max_scan: some walks are cut, and whenever the
    context's last min_match tokens occur (anywhere, continued or not) at most max_scan times,
    the result is the reference's."""
    rng = random.Random(2000 + seed)
    vocab = rng.randint(3, 4)
    index = SuffixIndex(3, 10, max_candidates=3, max_scan=6)
    ref = Reference(3, 10, 3)
    exact = inexact = 0
    # No drops: dropped positions would count toward max_scan until a rebuild.
    for key in random_run(rng, index, ref, vocab, 60, rewrites=False):
        context = ref.seqs.get(key) or [rng.randrange(vocab) for _ in range(8)]
        got = index.propose(context, 5)
        if positions_of(ref, context[-3:]) <= 6:
            assert got == ref.propose(context, 5)
            exact += 1
        else:
            assert got.match_len <= ref.longest(context)
            inexact += 1
    assert exact >= 5 and inexact >= 5  # both cases happened


def test_match_is_found_however_old_when_the_newest_occurrences_match_less():
    # 300 recent occurrences of the last key match only 3 tokens; the old one matches 10.
    index = SuffixIndex(3, 16, max_candidates=4, max_scan=8)
    index.extend("old", [9, 8, 7, 6, 5, 4, 3, 1, 2, 3, 42])
    for i in range(300):
        index.extend(i, [100 + i % 50, 1, 2, 3, 7])
    draft = index.propose([0, 9, 8, 7, 6, 5, 4, 3, 1, 2, 3], 4)
    assert draft == Draft([42], 10, 1)


def test_first_token_is_the_majority_and_ties_go_to_the_newest():
    index = SuffixIndex(2, 4)
    index.extend("a", [1, 2, 7, 1, 2, 8])
    index.extend("b", [1, 2, 8, 5])
    assert index.propose([1, 2], 3) == Draft([8, 5], 2, 2)  # 8 twice against 7 once
    index.extend("c", [1, 2, 7])
    index.extend("d", [1, 2, 7, 6])
    # 7 now leads 3 to 2; then 6 (from "d", the newest) ties with 1 (from "a") and wins.
    assert index.propose([1, 2], 3) == Draft([7, 6], 2, 3)


def test_a_continuation_with_half_of_the_votes_does_not_decide_alone():
    index = SuffixIndex(2, 4)
    for key, tail in (("t1", [5, 7, 3]), ("t2", [5, 7, 3]), ("x2", [5, 8, 2]), ("x1", [5, 8, 1])):
        index.extend(key, [1, 2, *tail])
    # 5,7,3 is the most common continuation (2 of 4), but at the second token 8 ties with 7 and
    # its newest occurrence is newer.
    assert index.propose([1, 2], 3) == Draft([5, 8, 1], 2, 4)


def test_min_prob_cuts_the_draft_where_the_path_gets_unlikely():
    index = SuffixIndex(2, 4)
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 9], [5, 6, 7]):
        index.extend(len(index), [1, 2, *tail])
    assert index.propose([1, 2], 3).tokens == [5, 6, 7]  # probs 1, 3/4, 2/3: path 0.5
    assert index.propose([1, 2], 3, min_prob=0.5).tokens == [5, 6, 7]
    assert index.propose([1, 2], 3, min_prob=0.6).tokens == [5, 6]
    assert index.propose([1, 2], 3, min_prob=0.8).tokens == [5]
    assert index.propose([1, 2], 3, min_prob=1.0) == Draft([5], 2, 4)


def test_own_end_never_matches_but_own_repetition_does():
    index = SuffixIndex(3, 16)
    index.extend("me", [1, 2, 3, 4])
    assert index.propose([1, 2, 3, 4], 4) == Draft()  # the only occurrence is the context's own end
    index.extend("me", [9, 1, 2, 3, 4])
    assert index.propose([1, 2, 3, 4, 9, 1, 2, 3, 4], 4) == Draft([9, 1, 2, 3], 4, 1)


def test_replace_and_drop_forget_the_old_tokens():
    index = SuffixIndex(2, 8)
    index.extend("a", [1, 2, 3, 4])
    index.extend("b", [7, 7])
    assert index.propose([1, 2], 2).tokens == [3, 4]
    index.replace("a", [1, 2, 5, 6])
    assert index.propose([1, 2], 2).tokens == [5, 6]
    assert index.length("a") == 4 and index.num_tokens == 6
    index.drop("a")
    assert index.propose([1, 2], 2) == Draft()
    assert "a" not in index and index.length("a") == 0 and index.num_tokens == 2
    index.drop("never there")  # no error
    index.extend("a", [1, 2, 9])
    assert index.propose([1, 2], 2).tokens == [9]


def test_dropping_most_tokens_rebuilds_the_chains():
    index = SuffixIndex(3, 8)
    rng = random.Random(3)
    for key in range(10):
        index.extend(key, [rng.randrange(4) for _ in range(1000)])
    index.extend("keep", [11, 12, 13, 10, 10, 19])
    for key in range(9):
        index.drop(key)
        assert index._dead_tokens <= max(4096, index.num_tokens)
    assert len(index._tokens) < 11  # renumbered: the rebuild ran
    assert index.propose([11, 12, 13, 10, 10], 1) == Draft([19], 5, 1)
    assert index.num_tokens == 1006 and index.length(9) == 1000 and index.length(0) == 0


def test_no_context_no_budget_no_draft():
    index = SuffixIndex(3, 8)
    index.extend(0, [1, 2, 3, 4, 1, 2, 3, 4])
    assert index.propose([2, 3], 4) == Draft()  # shorter than min_match
    assert index.propose([1, 2, 3], 0) == Draft()
    assert index.propose([], 4) == Draft()
    assert index.propose([5, 6, 7], 4) == Draft()  # never seen
    assert index.propose((1, 2, 3), 2) == Draft([4, 1], 3, 2)  # any sequence type


def test_rejects_impossible_settings():
    with pytest.raises(ValueError, match="min_match"):
        SuffixIndex(min_match=4, max_match=3)
    with pytest.raises(ValueError, match="max_candidates"):
        SuffixIndex(max_candidates=64, max_scan=32)


def test_nbytes_grows_with_the_tokens():
    index = SuffixIndex()
    empty = index.nbytes()
    rng = random.Random(0)
    index.extend(0, [rng.randrange(50_000) for _ in range(10_000)])
    grown = index.nbytes()
    # at least the list slots and token ints; at most a few hundred bytes a token
    assert 10_000 * 36 < grown - empty < 10_000 * 400
