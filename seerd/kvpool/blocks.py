"""Whole KV blocks between an engine's KV cache and host memory, for every layout vLLM uses.

vLLM 0.32 views every attention layer's cache as a logical `[B, H, N, C]` tensor (blocks, head
slots, tokens of a block, content), whatever the backend and its physical order
(`vllm/v1/kv_cache_interface.py`, `create_kv_cache_views`; the order is a `KVCacheLayout`):
- the CPU backend: `[B, kv_heads, N, 2*head]` (K then V in the content), contiguous;
- FlashAttention, FlashInfer and the Triton backends: the same logical view, K and V in the
  content, physically in the layout's order (`LBHNC`, `LBNHC`, ... or block-outermost `BLHNC`
  for transfers), so a block may be strided;
- MLA (DeepSeek, Kimi, Moonlight): one latent vector per token, `H` = 1, `C` = latent + rope;
- kernel blocks: a manager block split into `r` kernel blocks shows as `B * r` rows
  (`group_kernel_blocks` views them back as `[B, r, ...]`);
- and the per-layer layouts of earlier vLLM versions: FlashAttention's K and V apart,
  `[2, B, N, H, D]` (the block axis second), FlashInfer's `[B, 2, N, H, D]`, MLA's `[B, N, C]`.

A block's bytes here are its logical content in that order (`index_select` on the block axis,
then contiguous), so the same code serves every layout, on CPU and GPU tensors alike: the
physical order never reaches the pool, and two engines whose logical shapes agree exchange blocks
whatever their physical layouts. What must agree (head slots, tokens, content bytes, dtype, kernel
split) is `signature`, which goes into every block's header and is checked on load.

The copies are batched: one gather and one copy into a contiguous host buffer per layer per batch
of blocks (one copy and one scatter back). On a GPU the buffers are pinned and the copies run on a
side stream that first waits for the compute stream (and the compute stream waits for loads); on
the CPU the same code runs with those steps as no-ops, so the tests on CPU tensors cover every line
but the CUDA calls.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


class UnsupportedLayout(ValueError):
    """A KV cache this code cannot copy by whole blocks (the engine then runs without the pool)."""


@dataclass(frozen=True)
class LayerBlocks:
    name: str
    blocks: torch.Tensor  # uint8, block axis first: [num_blocks, ...] (a view of the KV cache)
    block_bytes: int


def layer_blocks(name: str, cache: torch.Tensor, num_blocks: int) -> LayerBlocks:
    """The byte view of one layer's cache with the manager block axis first."""
    if cache.dim() < 2:
        raise UnsupportedLayout(f"layer {name}: a KV cache of shape {tuple(cache.shape)} has no block axis")
    if cache.stride(-1) != 1:  # the content axis is innermost in every vLLM layout: bytes need it so
        raise UnsupportedLayout(f"layer {name}: content axis not innermost (strides {cache.stride()})")
    raw = cache.view(torch.uint8)
    if raw.shape[0] != num_blocks and raw.dim() > 2 and raw.shape[0] == 2 and raw.shape[1] == num_blocks:
        raw = raw.movedim(1, 0)  # K and V apart, blocks second (FlashAttention before vLLM's unified views)
    if raw.shape[0] != num_blocks:
        if raw.shape[0] % num_blocks:
            raise UnsupportedLayout(f"layer {name}: {raw.shape[0]} rows for {num_blocks} blocks")
        raw = raw.unflatten(0, (num_blocks, raw.shape[0] // num_blocks))  # kernel blocks
    return LayerBlocks(name, raw, int(np.prod(raw.shape[1:])))


class BlockCopier:
    """Copies whole blocks of every layer between the KV cache and host rows of `payload_bytes`
    (the layers' blocks one after another, in the order the engine registered them)."""

    def __init__(self, caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not caches:
            raise UnsupportedLayout("no KV cache layers")
        self.layers = [layer_blocks(name, cache, num_blocks) for name, cache in caches.items()]
        devices = {layer.blocks.device for layer in self.layers}
        if len(devices) != 1:
            raise UnsupportedLayout(f"KV cache layers on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.payload_bytes = sum(layer.block_bytes for layer in self.layers)
        self.signature = layout_signature(caches, self.layers)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._buffers: list[torch.Tensor] = []

    # One path for every device: on the CPU the stream steps are no-ops and the host buffers are not
    # pinned, so the tests on CPU tensors run every line but the CUDA calls themselves.
    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        """Blocks `block_ids` into `out[:len(block_ids)]` (host, `[rows, payload_bytes]` uint8)."""
        count = len(block_ids)
        buffers = self._host_buffers(count)
        with self._side_stream():
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device)
            for layer, buffer in zip(self.layers, buffers):
                buffer.copy_(layer.blocks.index_select(0, ids).reshape(count, -1), non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()  # the host reads the buffers next
        host = torch.from_numpy(out[:count])
        for buffer, (start, stop) in zip(buffers, self._spans()):
            host[:, start:stop] = buffer

    def scatter(self, block_ids: list[int], rows: np.ndarray) -> None:
        """`rows[:len(block_ids)]` (host) into blocks `block_ids` of every layer."""
        count = len(block_ids)
        buffers = self._host_buffers(count)
        host = torch.from_numpy(rows[:count])
        for buffer, (start, stop) in zip(buffers, self._spans()):
            buffer.copy_(host[:, start:stop])
        with self._side_stream():
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device)
            for layer, buffer in zip(self.layers, buffers):
                part = buffer.to(self.device, non_blocking=True).reshape(count, *layer.blocks.shape[1:])
                layer.blocks.index_copy_(0, ids, part)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)  # the forward reads them after
            self._stream.synchronize()  # the buffers are reused by the next batch

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """On a GPU: the copies on a stream of their own, after the compute stream's work so far
        (the step's writes to the blocks, its reads of blocks about to be overwritten)."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def _spans(self) -> list[tuple[int, int]]:
        """Each layer's bytes within a host row."""
        spans, offset = [], 0
        for layer in self.layers:
            spans.append((offset, offset + layer.block_bytes))
            offset += layer.block_bytes
        return spans

    def _host_buffers(self, count: int) -> list[torch.Tensor]:
        """Per layer, `count` contiguous host rows, pinned on a GPU (copies with the device are
        asynchronous only to and from pinned, contiguous memory)."""
        if not self._buffers or self._buffers[0].shape[0] < count:
            pinned = self._stream is not None
            self._buffers = [torch.empty((count, layer.block_bytes), dtype=torch.uint8, pin_memory=pinned)
                             for layer in self.layers]
        return [buffer[:count] for buffer in self._buffers]


def layout_signature(caches: dict[str, torch.Tensor], layers: list[LayerBlocks]) -> int:
    """32 bits naming what a block's bytes mean: per layer, its dtype and logical block shape (head
    slots, kernel split, tokens, content). Blocks are exchanged only between equal signatures."""
    text = ";".join(f"{layer.name}:{cache.dtype}:{tuple(layer.blocks.shape[1:])}"
                    for layer, cache in zip(layers, caches.values()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
