"""Grouped speculative decoding: a server of per-group token logs, local suffix indexes per worker."""

from seerd.drafts.index import Draft, SuffixIndex

__all__ = ["Draft", "SuffixIndex"]
