"""Pool keys: chained over token ids from a namespace, scoped so cleanup is one regex."""

from __future__ import annotations

import re

from seerd.kvpool.keys import BlockKeys, batch_scope, group_pattern, namespace_digest, request_pattern, run_pattern


def keys_of(tokens, *, namespace=b"n" * 16, group=5, request=7, prompt_len=300, block=128, run="run1"):  # noqa: ANN001, ANN201
    return BlockKeys(namespace, run, group, request, prompt_len, block).extend(tokens, len(tokens))


def test_namespace_digests_differ_by_what_shapes_kv():
    base = {"run": "r", "model": "m", "dtype": "torch.float32", "block_size": 128, "tp": 1, "pp": 1, "layout": "x"}
    digests = {namespace_digest(base)}
    for field, value in (("run", "r2"), ("model", "m2"), ("dtype", "torch.bfloat16"), ("block_size", 64),
                         ("tp", 2), ("pp", 2), ("layout", "y")):
        digests.add(namespace_digest({**base, field: value}))
    assert len(digests) == 8
    assert namespace_digest(dict(reversed(list(base.items())))) == namespace_digest(base)  # order-free


def test_only_full_blocks_get_keys_and_each_is_chained_over_all_before_it():
    tokens = list(range(3, 3 + 300))
    keys = keys_of(tokens)
    assert len(keys) == 2  # 300 tokens: two full blocks of 128
    changed_first = keys_of([9] + tokens[1:])
    assert changed_first[0] != keys[0] and changed_first[1] != keys[1]  # the chain carries the change
    changed_second = keys_of(tokens[:200] + [9] + tokens[201:])
    assert changed_second[0] == keys[0] and changed_second[1] != keys[1]
    assert keys_of(tokens, namespace=b"m" * 16)[0] != keys[0]


def test_extending_hashes_new_blocks_as_a_fresh_computation_would():
    tokens = list(range(1000))
    grower = BlockKeys(b"n" * 16, "run1", 5, 7, 300, 128)
    assert grower.extend(tokens, 130) == keys_of(tokens[:130])
    assert grower.extend(tokens, 700) == keys_of(tokens[:700])
    assert grower.extend(tokens, 300)[:2] == keys_of(tokens[:300])


def test_prompt_blocks_belong_to_the_group_and_the_rest_to_the_request():
    keys = keys_of(list(range(600)), prompt_len=300)
    assert [k.split("/")[3] for k in keys] == ["p", "p", "r7", "r7"]
    assert all(k.startswith("seerd-kv/run1/g5/") for k in keys)
    siblings = keys_of(list(range(600)), request=8, prompt_len=300)
    assert siblings[:2] == keys[:2]  # siblings share the prompt's blocks


def test_cleanup_patterns_cover_exactly_their_scope():
    mine = keys_of(list(range(600)))
    sibling = keys_of(list(range(600)), request=8)
    other_group = keys_of(list(range(600)), group=50)
    other_run = keys_of(list(range(600)), run="run10")
    request = re.compile(request_pattern("run1", 5, 7))
    assert [bool(request.match(k)) for k in mine] == [False, False, True, True]
    assert not any(request.match(k) for k in sibling + other_group + other_run)
    group = re.compile(group_pattern("run1", 5))
    assert all(group.match(k) for k in mine + sibling) and not any(group.match(k) for k in other_group + other_run)
    run = re.compile(run_pattern("run1"))
    assert all(run.match(k) for k in mine + other_group) and not any(run.match(k) for k in other_run)


def test_a_batch_scope_sits_inside_its_run_and_apart_from_every_other_batch():
    """`seerd serve`: one pool across batches. A batch's keys never equal another batch's (each ran
    under its own weights), its pattern takes only its own, the run's takes them all."""
    tokens = list(range(600))
    batch1, batch2 = (keys_of(tokens, run=batch_scope("run1", b)) for b in (1, 2))
    batch12 = keys_of(tokens, run=batch_scope("run1", 12))
    assert all(k.startswith("seerd-kv/run1/b1/g5/") for k in batch1)
    assert not set(batch1) & set(batch2)
    one = re.compile(run_pattern(batch_scope("run1", 1)))
    assert all(one.match(k) for k in batch1) and not any(one.match(k) for k in batch2 + batch12)
    request = re.compile(request_pattern(batch_scope("run1", 1), 5, 7))
    assert [bool(request.match(k)) for k in batch1] == [False, False, True, True]
    assert not any(request.match(k) for k in batch2)
    run = re.compile(run_pattern("run1"))
    assert all(run.match(k) for k in batch1 + batch2 + batch12)
