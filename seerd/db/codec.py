"""Compact binary forms of token ids (int32) and logprobs (float32), little-endian."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_SWAP = sys.byteorder != "little"


def pack_ints(values: Iterable[int]) -> bytes:
    data = array("i", values)
    if _SWAP:
        data.byteswap()
    return data.tobytes()


def unpack_ints(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    data = array("i")
    data.frombytes(blob)
    if _SWAP:
        data.byteswap()
    return data.tolist()


def pack_floats(values: Iterable[float]) -> bytes:
    data = array("f", values)
    if _SWAP:
        data.byteswap()
    return data.tobytes()


def unpack_floats(blob: bytes | None) -> list[float]:
    if not blob:
        return []
    data = array("f")
    data.frombytes(blob)
    if _SWAP:
        data.byteswap()
    return data.tolist()
