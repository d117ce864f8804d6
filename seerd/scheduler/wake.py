"""The order idle workers' waiting lease calls are planned for when work is queued: the daemon's
lease line (`seerd.server.waiting.LeaseLine.serve`) and the simulator's model of it
(`seerd.sim.driver`) both sort by it, so a change of the rule changes both."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, NamedTuple


class WaitingCall(NamedTuple):
    key: Hashable  # the caller's handle for the call
    vain: int  # times it was planned for and given nothing since it began to wait
    room: int | None  # its worker's free KV tokens, or None when it could take nothing now
    since: Any  # when it began to wait, sortable: the earlier, the sooner


def wake_order(calls: Iterable[WaitingCall]) -> list[Hashable]:
    """The calls planned for in vain the fewest times first, then the workers with the most KV room
    (admission leaves a request that does not fit one worker to the roomiest: its plan takes it),
    then the longest waiting; a worker without room last."""
    return [call.key for call in sorted(calls, key=lambda c: (c.vain, 1 if c.room is None else -c.room, c.since))]
