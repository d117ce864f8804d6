"""Grouped speculative decoding: a server of per-group token logs, local suffix indexes per worker."""

from seerd.drafts.index import Draft, SuffixIndex
from seerd.drafts.server import (
    AppendResult, DraftError, DraftServer, UnknownGroup, UnknownRequest,
)

__all__ = [
    "AppendResult", "Draft", "DraftError", "DraftServer", "SuffixIndex", "UnknownGroup",
    "UnknownRequest",
]
