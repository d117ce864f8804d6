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

On a GPU the copies are batched (one gather and one device-to-host copy per layer per batch of
blocks) into pinned host memory on a side stream that first waits for the compute stream, and
synchronize before the host reads them; on the CPU they are plain tensor copies.
"""

from __future__ import annotations

import hashlib
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
        self._pinned: list[torch.Tensor] = []

    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        """Blocks `block_ids` into `out[:len(block_ids)]` (host, `[rows, payload_bytes]` uint8)."""
        count = len(block_ids)
        host = torch.from_numpy(out[:count])
        if self._stream is None:
            ids = torch.tensor(block_ids, dtype=torch.long)
            for layer, (start, stop) in zip(self.layers, self._spans()):
                host[:, start:stop] = layer.blocks.index_select(0, ids).reshape(count, -1)
            return
        pinned = self._pinned_layers(count)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)  # the step's writes to these blocks first
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device)
            for layer, staged in zip(self.layers, pinned):
                staged.copy_(layer.blocks.index_select(0, ids).reshape(count, -1), non_blocking=True)
        self._stream.synchronize()
        for staged, (start, stop) in zip(pinned, self._spans()):
            host[:, start:stop] = staged

    def scatter(self, block_ids: list[int], rows: np.ndarray) -> None:
        """`rows[:len(block_ids)]` (host) into blocks `block_ids` of every layer."""
        count = len(block_ids)
        host = torch.from_numpy(rows[:count])
        if self._stream is None:
            ids = torch.tensor(block_ids, dtype=torch.long)
            for layer, (start, stop) in zip(self.layers, self._spans()):
                layer.blocks.index_copy_(0, ids, host[:, start:stop].reshape(count, *layer.blocks.shape[1:]))
            return
        pinned = self._pinned_layers(count)
        for staged, (start, stop) in zip(pinned, self._spans()):
            staged.copy_(host[:, start:stop])
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)  # nothing of the step still reads these blocks
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device)
            for layer, staged in zip(self.layers, pinned):
                part = staged.to(self.device, non_blocking=True).reshape(count, *layer.blocks.shape[1:])
                layer.blocks.index_copy_(0, ids, part)
        compute.wait_stream(self._stream)  # the forward that reads the blocks waits for the copies
        self._stream.synchronize()  # the pinned buffers are reused by the next batch

    def _spans(self) -> list[tuple[int, int]]:
        """Each layer's bytes within a host row."""
        spans, offset = [], 0
        for layer in self.layers:
            spans.append((offset, offset + layer.block_bytes))
            offset += layer.block_bytes
        return spans

    def _pinned_layers(self, count: int) -> list[torch.Tensor]:
        """Per layer, `count` contiguous rows of pinned host memory (copies with the device are
        asynchronous only to and from pinned, contiguous memory)."""
        if not self._pinned or self._pinned[0].shape[0] < count:
            self._pinned = [torch.empty((count, layer.block_bytes), dtype=torch.uint8, pin_memory=True)
                            for layer in self.layers]
        return [staged[:count] for staged in self._pinned]


def layout_signature(caches: dict[str, torch.Tensor], layers: list[LayerBlocks]) -> int:
    """32 bits naming what a block's bytes mean: per layer, its dtype and logical block shape (head
    slots, kernel split, tokens, content). Blocks are exchanged only between equal signatures."""
    text = ";".join(f"{layer.name}:{cache.dtype}:{tuple(layer.blocks.shape[1:])}"
                    for layer, cache in zip(layers, caches.values()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
