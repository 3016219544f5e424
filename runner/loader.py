"""Deterministic, resumable batching: epoch e's order depends only on (seed, e).

Resuming at step k rebuilds the same order and starts at the right batch, so an
interrupted run sees exactly the batches the uninterrupted run would have.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from runner.errors import UserError


class EpochSampler(Sampler[int]):
    def __init__(self, size: int, seed: int, epoch: int, start: int, shuffle: bool) -> None:
        self.size, self.seed, self.epoch, self.start, self.shuffle = size, seed, epoch, start, shuffle

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
        else:
            order = torch.arange(self.size)
        return iter(order[self.start:].tolist())

    def __len__(self) -> int:
        return self.size - self.start


def batches_per_epoch(dataset: Dataset, batch_size: int) -> int:
    return len(dataset) // batch_size  # drop_last: every step sees a full batch


def train_batches(dataset: Dataset, batch_size: int, num_workers: int, collate: Callable[[list], Any],
                  seed: int, start_step: int) -> Iterator[Any]:
    """Endless stream of training batches, starting at global step `start_step`."""
    per_epoch = batches_per_epoch(dataset, batch_size)
    if per_epoch == 0:
        raise UserError(f"the training set has {len(dataset)} items, fewer than one batch of {batch_size}; "
                        f"lower data.batch_size")
    epoch, offset = divmod(start_step, per_epoch)
    while True:
        sampler = EpochSampler(len(dataset), seed, epoch, offset * batch_size, shuffle=True)
        # Own generator: worker seeds come from (seed, epoch), and the global RNG (which the
        # checkpoint restores for augmentation in the main process) is not drawn from.
        yield from DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                              collate_fn=collate, drop_last=True,
                              generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        epoch, offset = epoch + 1, 0


def eval_batches(dataset: Dataset, batch_size: int, num_workers: int, collate: Callable[[list], Any],
                 limit: int | None) -> Iterator[Any]:
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0))  # evaluation draws nothing from the global RNG
    for i, batch in enumerate(loader):
        if limit is not None and i >= limit:
            return
        yield batch
