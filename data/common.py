"""What every data source's config has: how to batch it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoaderConfig:
    name: str = ""
    batch_size: int = 32
    eval_batch_size: int | None = None  # None: same as batch_size
    num_workers: int = 0


def item_generator(seed: int, split: str, index: int) -> torch.Generator:
    """A generator that makes item `index` of `split` the same on every run and worker."""
    split_id = {"train": 0, "eval": 1}[split]
    return torch.Generator().manual_seed((seed * 1_000_003 + split_id) * 10_000_019 + index)
