"""Deterministic, resumable batching: epoch e's batches depend only on (seed, e).

The task draws each epoch's batches (lists of dataset indices, any sizes) from a
generator seeded by (seed, epoch), see Task.epoch_batches. Resuming at step k
rebuilds the same plans and starts at the right batch, so an interrupted run sees
exactly the batches the uninterrupted run would have, whatever the batch sizes.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from runner.errors import UserError

EpochPlan = Callable[[torch.Generator], list[list[int]]]  # generator -> one epoch's batches


RANK_SEED_STRIDE = 1_000_003  # a prime: ranks' worker seeds never meet another seed's at nearby epochs


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + epoch)


def epoch_batches(plan: EpochPlan, seed: int, epoch: int) -> list[list[int]]:
    return plan(epoch_generator(seed, epoch))


def shareable(plan: EpochPlan, world_size: int) -> EpochPlan:
    """The plan of a data-parallel run: batches with fewer items than processes (the short last
    batch of a length bucket) are left out, on every rank alike, so each process gets at least one
    item. Still a function of (seed, epoch) only: resuming finds the same batches."""
    if world_size == 1:
        return plan
    return lambda generator: [b for b in plan(generator) if len(b) >= world_size]


def check_plan(batches: list[list[int]], dataset: Dataset, batch_size: int, world_size: int = 1) -> None:
    if not batches and world_size > 1:
        raise UserError(f"no training batch has {world_size} items to give each process one; data.batch_size "
                        f"is the global batch: raise it or start fewer processes")
    if not batches:
        raise UserError(f"the training set has {len(dataset)} items, fewer than one batch of {batch_size}; "
                        f"lower data.batch_size or use more training data")


def train_batches(dataset: Dataset, plan: EpochPlan, num_workers: int, collate: Callable[[list], Any],
                  seed: int, start_step: int, on_epoch_start: Callable[[], None]) -> Iterator[Any]:
    """Endless stream of training batches from global step `start_step` (0-based count of batches
    already trained). `on_epoch_start` runs before the first batch of every epoch begun from
    its start (a resumed run restores its mid-epoch state from the checkpoint instead)."""
    for batch, _ in shard_batches(dataset, plan, num_workers, collate, seed, start_step, on_epoch_start):
        yield batch


def shard_batches(dataset: Dataset, plan: EpochPlan, num_workers: int, collate: Callable[[list], Any],
                  seed: int, start_step: int, on_epoch_start: Callable[[], None],
                  shard: Callable[[list[int]], list[int]] = lambda b: b,
                  rank: int = 0) -> Iterator[tuple[Any, float]]:
    """train_batches for one process of a data-parallel run: (its share of each global batch,
    that share's fraction of the global batch). Every process walks the same plan; `shard`
    picks its items (runner.distributed.World.shard). Data-loader workers of rank `rank` get
    their own seeds (rank 0: the single-process ones), so augmentation differs between ranks."""
    epoch, offset = 0, start_step
    batches = epoch_batches(plan, seed, epoch)
    while offset >= len(batches):  # epochs may differ in length (bucketing): walk them
        offset -= len(batches)
        epoch += 1
        batches = epoch_batches(plan, seed, epoch)
    while True:
        if offset == 0:
            on_epoch_start()
        local = [shard(b) for b in batches[offset:]]  # never empty: see shareable()
        fractions = [len(mine) / len(b) for mine, b in zip(local, batches[offset:])]
        # Own generator: worker seeds come from (seed, epoch, rank), and the global RNG (which the
        # checkpoint restores for augmentation in the main process) is not drawn from.
        workers = epoch_generator(seed + RANK_SEED_STRIDE * rank, epoch)
        yield from zip(DataLoader(dataset, batch_sampler=local, num_workers=num_workers, collate_fn=collate,
                                  generator=workers), fractions)
        epoch, offset = epoch + 1, 0
        batches = epoch_batches(plan, seed, epoch)


def eval_batches(dataset: Dataset, batch_size: int, num_workers: int, collate: Callable[[list], Any],
                 limit: int | None) -> Iterator[Any]:
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0))  # evaluation draws nothing from the global RNG
    for i, batch in enumerate(loader):
        if limit is not None and i >= limit:
            return
        yield batch
