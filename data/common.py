"""What every data source's config has: how to batch it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.errors import UserError


@dataclass
class LoaderConfig:
    name: str = ""
    batch_size: int = 32
    eval_batch_size: int | None = None  # None: same as batch_size
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or (self.eval_batch_size is not None and self.eval_batch_size <= 0):
            raise UserError(f"bad config: data.batch_size={self.batch_size} and data.eval_batch_size="
                            f"{self.eval_batch_size} must be positive")
        if self.num_workers < 0:
            raise UserError(f"bad config: data.num_workers={self.num_workers} must be 0 or more")


def item_generator(seed: int, split: str, index: int) -> torch.Generator:
    """A generator that makes item `index` of `split` the same on every run and worker."""
    split_id = {"train": 0, "eval": 1}[split]
    return torch.Generator().manual_seed((seed * 1_000_003 + split_id) * 10_000_019 + index)
