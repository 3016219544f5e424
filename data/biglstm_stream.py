"""Truncated-BPTT batching over token streams, shared by the bigLSTM data sources.

A corpus is a list of *segments* (a 1B Word shard, the whole synthetic corpus), each one
contiguous token stream that is loaded only when it is read. A segment of n tokens is laid
out as `rows` parallel streams of L = chunks * unroll tokens each (row r holds tokens
[r*L, (r+1)*L], one more for the last target), and batch t of that segment is window t of
every row, so consecutive batches continue each row exactly where the last one stopped and
the LSTM state can be carried from one to the next (as in f-lm and the PyTorch
word_language_model example's `batchify`).

Item index = offset(segment) + chunk * rows + row: a batch is the contiguous index range of
one (segment, chunk), so an epoch plan is a list of `range`s (no index lists of the size of
the corpus) and skipping the first k batches of a plan costs nothing but loading the one
segment the resumed batch lies in.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.common import LoaderConfig
from runner.errors import UserError


@dataclass
class TextStreamConfig(LoaderConfig):
    """What every bigLSTM data source has: batch rows and the unrolled length."""

    unroll: int = 20  # tokens per row per batch (truncated BPTT length)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.unroll <= 0:
            raise UserError(f"bad config: data.unroll={self.unroll} must be positive")


class TokenWindows(Dataset):
    """Items: LongTensor [unroll + 1] (inputs are the first unroll, targets the last unroll).

    `lengths[i]` is segment i's token count; `load(i)` returns its tokens (1-D integer
    tensor). The segment being read is cached, so a batch loads at most one segment.
    """

    def __init__(self, lengths: Sequence[int], load: Callable[[int], Tensor], rows: int, unroll: int) -> None:
        self.rows, self.unroll, self.load = rows, unroll, load
        # chunks of segment i; a segment too short for one batch contributes none
        self.chunks = [max(0, (n - 1) // (rows * unroll)) for n in lengths]
        self.offsets = [0]
        for c in self.chunks:
            self.offsets.append(self.offsets[-1] + c * rows)
        self._cached: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return self.offsets[-1]

    def num_batches(self) -> int:
        return sum(self.chunks)

    def _tokens(self, segment: int) -> Tensor:
        if self._cached is None or self._cached[0] != segment:
            self._cached = (segment, self.load(segment))
        return self._cached[1]

    def __getitem__(self, index: int) -> Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        segment = bisect.bisect_right(self.offsets, index) - 1
        chunk, row = divmod(index - self.offsets[segment], self.rows)
        start = row * self.chunks[segment] * self.unroll + chunk * self.unroll
        return self._tokens(segment)[start:start + self.unroll + 1].long()

    def plan(self, order: Sequence[int]) -> list[range]:
        """The batches of the segments in `order`, each segment's chunks in sequence."""
        return [range(self.offsets[s] + c * self.rows, self.offsets[s] + (c + 1) * self.rows)
                for s in order for c in range(self.chunks[s])]


def collate_windows(items: list[Tensor]) -> dict[str, Tensor]:
    """Windows [rows, unroll + 1] -> inputs and next-token targets, both [rows, unroll]."""
    block = torch.stack(items)
    return {"input": block[:, :-1], "target": block[:, 1:]}
