"""A trainer's next checkpoint, made here: the model's own files with every float tensor perturbed
(seeded). Same architecture, other weights: what `seerd serve` loads in place."""

from __future__ import annotations

import shutil
from pathlib import Path


def perturbed_copy(model: Path, dest: Path, seed: int, scale: float = 0.05) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    generator = torch.Generator().manual_seed(seed)
    for shard in Path(dest).glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({name: t + scale * torch.randn(t.shape, generator=generator, dtype=t.dtype)
                   if t.is_floating_point() else t for name, t in tensors.items()}, shard, metadata={"format": "pt"})
    return Path(dest)
