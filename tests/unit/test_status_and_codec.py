from __future__ import annotations

import math

import pytest

from seerd.db.status import (
    ALLOWED_TRANSITIONS, ChunkStatus, IllegalTransition, RequestStatus, RolloutStatus, check_transition,
)
from seerd.db.codec import pack_floats, pack_ints, unpack_floats, unpack_ints


def test_every_status_has_a_row_in_its_table():
    for enum_cls, table in ALLOWED_TRANSITIONS.items():
        assert set(table) == set(enum_cls)


@pytest.mark.parametrize("current,new", [
    (ChunkStatus.DONE, ChunkStatus.LEASED),
    (ChunkStatus.DONE, ChunkStatus.QUEUED),
    (ChunkStatus.QUEUED, ChunkStatus.DONE),
    (RequestStatus.FINISHED, RequestStatus.QUEUED),
    (RolloutStatus.FINISHED, RolloutStatus.RUNNING),
])
def test_illegal_transitions_raise(current, new):
    with pytest.raises(IllegalTransition):
        check_transition(current, new)


def test_legal_transitions_pass():
    check_transition(ChunkStatus.LEASED, ChunkStatus.QUEUED)
    check_transition(RolloutStatus.INTERRUPTED, RolloutStatus.RUNNING)


def test_codec_round_trips_compactly():
    ids = [0, 1, 1023, 2**31 - 1]
    assert unpack_ints(pack_ints(ids)) == ids
    assert len(pack_ints(ids)) == 16
    lps = [-0.5, -12.25, 0.0]
    assert unpack_floats(pack_floats(lps)) == lps
    assert math.isclose(unpack_floats(pack_floats([-1.1]))[0], -1.1, rel_tol=1e-6)
    assert unpack_ints(None) == [] and unpack_floats(b"") == []
