"""Traversal of the nested containers batches and model outputs are made of.

`torch.utils._pytree` walks dicts, lists, tuples and namedtuples. A PackedSequence
is a namedtuple whose fields must stay together (batch_sizes stays on the host,
the indices belong to the data), so it is a leaf here, handled whole: moved with
its own `.to()`, and a tensor function applied to its `.data` only.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, PackedSequence)


def map_tensors(obj: Any, fn: TensorFn) -> Any:
    """Apply fn to every tensor in obj (PackedSequence: to its data); other leaves unchanged."""
    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if isinstance(x, PackedSequence):
            return PackedSequence(fn(x.data), x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        return x
    return pytree.tree_map(leaf, obj, is_leaf=_is_leaf)


def map_floats(obj: Any, fn: TensorFn) -> Any:
    """map_tensors restricted to floating-point tensors (integer targets, lengths, masks pass)."""
    return map_tensors(obj, lambda t: fn(t) if t.is_floating_point() else t)


def to_dtype(obj: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in obj cast to dtype."""
    return map_floats(obj, lambda t: t.to(dtype))


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor and every object with `.to()` (PackedSequence, ...) to device."""
    def leaf(x: Any) -> Any:
        if isinstance(x, (torch.Tensor, PackedSequence)) or callable(getattr(x, "to", None)):
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x.to(device)
        return x
    return pytree.tree_map(leaf, obj, is_leaf=_is_leaf)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in obj (a PackedSequence contributes its data)."""
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found
