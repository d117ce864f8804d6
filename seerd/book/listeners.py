"""Who hears of what the lease book commits: one registry, to which the daemon adds the draft
server's and the KV pool's hosts and `seerd serve` its batch dispatch. Each is called on the
state thread, after the commit of what it hears of, in the order it was added."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class BookListeners:
    def __init__(self) -> None:
        # (group, request, offset of the tokens in the response, tokens) per accepted chunk
        self.committed_tokens: list[Callable[[int, int, int, Sequence[int]], None]] = []
        self.request_ended: list[Callable[[int, int], None]] = []  # (group, request): finished or failed
        self.group_ended: list[Callable[[int], None]] = []  # a group whose every request ended

    def tokens_committed(self, group_id: int, request_id: int, offset: int, tokens: Sequence[int]) -> None:
        for listener in self.committed_tokens:
            listener(group_id, request_id, offset, tokens)

    def request_done(self, group_id: int, request_id: int) -> None:
        for listener in self.request_ended:
            listener(group_id, request_id)

    def group_done(self, group_id: int) -> None:
        for listener in self.group_ended:
            listener(group_id)
