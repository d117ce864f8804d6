"""The simulated engine (`seerd.worker.sim_engine`): the simulator's model of an engine behind the
worker's engine interface. Run at a huge time scale, so nothing here waits on the wall clock;
what is checked is what the worker relies on (lengths, streaming at chunk boundaries, aborts,
KV-bound admission), not timing."""

from __future__ import annotations

import asyncio

import pytest

from seerd.protocol import ChunkIdentity
from seerd.settings import Sampling
from seerd.sim.presets import get_preset
from seerd.worker.sim_engine import SimEngine

FAST = 1e6  # modelled seconds per wall second


def engine_id(chunk: int, request: int, group: int = 0, prompt_len: int = 8) -> str:
    return ChunkIdentity(chunk, 1, group, request, prompt_len, False).engine_id


def make_engine(kv_tokens: int = 100_000, max_num_seqs: int = 32) -> SimEngine:
    return SimEngine(get_preset("cpu-tiny").costs(), index=0, kv_capacity_tokens=kv_tokens,
                     max_num_seqs=max_num_seqs, time_scale=FAST, vocab_size=1000)


def test_each_request_ends_at_its_limit_with_tokens_and_logprobs_below_the_vocabulary():
    async def scenario():
        engine = make_engine()
        results = await asyncio.gather(*(engine.run(engine_id(c, c), list(range(8)), length, Sampling(seed=c))
                                         for c, length in [(1, 5), (2, 40), (3, 300)]))
        engine.shutdown()
        return engine, results

    engine, results = asyncio.run(scenario())
    assert [len(r.token_ids) for r in results] == [5, 40, 300]
    assert all(r.finish_reason == "length" and len(r.logprobs) == len(r.token_ids) for r in results)
    assert all(0 <= t < 1000 for r in results for t in r.token_ids)
    assert engine.instance.stats.decode_steps >= 300  # one token per step per sequence
    assert engine.instance.kv_used == 0 and not engine.instance.running


def test_a_streamed_request_wakes_its_worker_at_each_chunk_boundary_and_runs_on():
    async def scenario():
        engine = make_engine()
        stream = engine.open(engine_id(1, 1), list(range(8)), 100, Sampling(), stream=True)
        await stream.until(30)
        first, runs_on = stream.result(0, 30)
        await stream.until(100)
        rest, runs_on_after = stream.result(30, 70)
        engine.shutdown()
        return first, runs_on, rest, runs_on_after

    first, runs_on, rest, runs_on_after = asyncio.run(scenario())
    assert len(first.token_ids) == 30 and runs_on and first.finish_reason == "length"
    assert len(rest.token_ids) == 70 and not runs_on_after


def test_an_aborted_request_frees_its_kv_and_the_others_complete():
    async def scenario():
        # A modelled second is 10 ms here: the dropped request's 10^7 tokens would take hours,
        # so the abort reaches it running, however slow the machine.
        engine = SimEngine(get_preset("cpu-tiny").costs(), index=0, kv_capacity_tokens=10**8, max_num_seqs=4,
                           time_scale=100.0, vocab_size=1000)
        kept = engine.open(engine_id(1, 1), list(range(8)), 50, Sampling(), stream=True)
        dropped = engine.open(engine_id(2, 2), list(range(8)), 10**7, Sampling())
        await kept.until(1)  # both are running now
        await engine.abort(engine_id(2, 2))
        await asyncio.wait_for(kept.until(50), 60)
        while engine.stats.chunks_aborted == 0:  # the abort is taken at the engine's next scheduling point
            await asyncio.sleep(0.001)
        engine.shutdown()
        return engine, kept, dropped

    engine, kept, dropped = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(kept.token_ids) == 50 and kept.finish_reason == "length"
    assert not dropped.finished and engine.stats.chunks_aborted == 1
    assert engine.instance.kv_used == 0 and not engine.instance.running and not engine.instance.waiting


def test_more_context_than_kv_is_admitted_in_turns_and_every_request_completes():
    async def scenario():
        engine = make_engine(kv_tokens=600, max_num_seqs=32)  # room for about three at a time
        results = await asyncio.gather(*(engine.run(engine_id(c, c, group=c, prompt_len=100), list(range(100)),
                                                    100, Sampling()) for c in range(1, 9)))
        engine.shutdown()
        return engine, results

    engine, results = asyncio.run(scenario())
    assert [len(r.token_ids) for r in results] == [100] * 8
    stats = engine.instance.stats
    assert stats.peak_kv <= 600
    assert stats.sequence_steps / stats.decode_steps < 4  # about three at a time, never all eight


def test_a_bad_time_scale_is_refused():
    async def make() -> SimEngine:
        return SimEngine(get_preset("cpu-tiny").costs(), index=0, kv_capacity_tokens=1000, max_num_seqs=4,
                         time_scale=0.0, vocab_size=100)

    with pytest.raises(ValueError, match="time_scale"):
        asyncio.run(make())
