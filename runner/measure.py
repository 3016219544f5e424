"""Honest speed and memory numbers.

Step times: CUDA events on GPU (read after one synchronize at flush time, so
timing adds no per-step host sync), perf_counter on CPU. Warm-up steps are
excluded. Memory: the allocator's peaks on GPU, peak RSS on CPU, and byte
counts that do not depend on the device (parameters, gradients, optimizer
state, master weights, activations saved for backward).
"""
from __future__ import annotations

import resource
import sys
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn


class StepTimer:
    """Per-step durations and counts (samples, tokens, ... whatever the task counts)."""

    def __init__(self, device: torch.device, warmup_steps: int) -> None:
        self.cuda = device.type == "cuda"
        self.warmup_steps = warmup_steps
        self.durations_ms: list[float] = []
        self.counts: list[float] = []
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self._seen = 0
        self._t0 = 0.0
        self._start_event: torch.cuda.Event | None = None

    def start(self) -> None:
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, count: float) -> None:
        self._seen += 1
        timed = self._seen > self.warmup_steps
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            if timed:
                self._pending.append((self._start_event, end, count))
        elif timed:
            self.durations_ms.append((time.perf_counter() - self._t0) * 1e3)
            self.counts.append(count)

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {"durations_ms": torch.tensor(self.durations_ms, dtype=torch.float64),
                "counts": torch.tensor(self.counts, dtype=torch.float64), "seen": self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.durations_ms = state["durations_ms"].tolist()
        self.counts = state["counts"].tolist()
        self._seen = state["seen"]

    def flush(self) -> None:
        """Resolve pending CUDA events (one synchronize for all of them)."""
        if not self._pending:
            return
        self._pending[-1][1].synchronize()
        for start, end, n in self._pending:
            self.durations_ms.append(start.elapsed_time(end))
            self.counts.append(n)
        self._pending.clear()

    def recent_samples_per_s(self, last: int) -> float | None:
        """Throughput over the last `last` timed steps (counted units per second)."""
        self.flush()
        if not self.durations_ms:
            return None
        return sum(self.counts[-last:]) / (sum(self.durations_ms[-last:]) / 1e3)

    def summary(self) -> dict[str, float | None]:
        self.flush()
        if not self.durations_ms:
            return {"samples_per_s": None, "step_time_ms_p50": None, "step_time_ms_p90": None}
        t = torch.tensor(self.durations_ms)
        return {
            "samples_per_s": sum(self.counts) / (float(t.sum()) / 1e3),
            "step_time_ms_p50": float(t.quantile(0.5)),
            "step_time_ms_p90": float(t.quantile(0.9)),
        }


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes the tensors hold; a sparse COO tensor holds its values and indices, not its dense size."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            total += t._values().numel() * t.element_size() + t._indices().numel() * t._indices().element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    return sum(tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
               for opt in optimizers for state in opt.state.values())


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class SavedActivations:
    """Peak bytes of tensors autograd holds for backward at once, parameters (and autocast's copies
    of them) excluded.

    Counted per storage, so views of one buffer count once. A storage counts from the moment a
    tensor of it is saved until every saved tensor of it is gone (its graph freed by backward),
    so an iteration with several backward passes (a GAN's D and G steps) reports the largest
    amount alive together, and a storage freed by one pass and reused at the same address by the
    next is not mistaken for the first. This is the device-independent measure of the
    activation memory the paper halves.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = {t.untyped_storage().data_ptr() for t in params}
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, saved tensors alive]
        self.current = 0
        self.peak = 0

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """autocast's low-precision copy of a parameter: weight memory, not an activation."""
        fn = t.grad_fn
        if fn is None or fn.name() != "ToCopyBackward0":
            return False
        source = fn.next_functions[0][0]
        return source is not None and hasattr(source, "variable") and \
            source.variable.untyped_storage().data_ptr() in self.params

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or ptr == 0 or self._is_weight_copy(t):
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)  # runs when autograd (and everyone else) drops it
        return t

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.current -= entry[0]

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


def memory_report(device: torch.device, model: nn.Module, master: list[torch.Tensor],
                  optimizers: Iterable[torch.optim.Optimizer], activation_bytes: int | None,
                  grad_bytes: int | None) -> dict[str, int | None]:
    """grad_bytes: measured at the step where activations were measured: the model's gradients
    plus the FP32 master gradients, sparse ones at their stored size."""
    cuda = device.type == "cuda"
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "param_bytes": tensor_bytes(model.parameters()),
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": optimizer_state_bytes(optimizers),
        "master_weight_bytes": tensor_bytes(master),
        "activation_bytes": activation_bytes,
    }
