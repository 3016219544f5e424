"""Data-parallel training over torch.distributed, for runs started by `torchrun`.

    torchrun --nproc_per_node=N -m runner <overrides>

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init` reads them
(nccl on CUDA, gloo on CPU) and returns the process's `World`. Without them a run is one
process, `World()`, and every method here returns at once: the single-process path is unchanged.

What data parallelism means here (runner/engine.py and runner/step.py call these):
- data.batch_size is the GLOBAL batch: every rank builds the same epoch plan (seeded by
  (seed, epoch)) and trains on its contiguous share of each batch (`shard`), so a run's result
  does not depend on how many processes share it (up to reduction order and batch norm).
- Gradients are all-reduced (summed) by `reduce_gradients` in the step context, per
  optimizer, after the task's backward calls and before the loss scaler unscales them. Each
  rank's loss is weighted by its share of the batch (n_rank / n_global) before backward, so
  every item's gradient carries the 1/n_global of one process over the global batch: for a
  loss that is a mean over the batch's items the sum is that process's gradient (also when a
  batch does not split evenly; a loss averaged over tokens of unequal shares is close, not
  equal), and the FP16
  gradients have the range they have in one process, so overflows and scales agree with it.
  This is DDP's reduction, done explicitly rather than by nn.parallel.DistributedDataParallel:
  DDP's reducer is armed by the wrapper's forward and expects one backward over all
  parameters, while tasks here call sub-networks directly (a GAN's model.G / model.D),
  back-propagate into one optimizer's parameters at a time (autograd `inputs=`), may call
  backward several times per step, and produce sparse gradients (which nccl cannot
  all-reduce). One explicit reduction per optimizer step serves all of them. Its cost: the
  communication does not overlap the backward pass as DDP's bucketed hooks would.
- Decisions are global: the overflow flag (and the scalers' max|grad|) are MAX-reduced with
  one collective whose result is read once, as the single host sync of a step; interrupts
  and time-based checkpoints are agreed over a gloo group of host flags.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runner.errors import UserError

# Rank 0 evaluates while the others wait: long evaluations must not hit the default timeout.
TIMEOUT = timedelta(minutes=60)
_DENSE, _SPARSE = 1, 2  # what a parameter's gradient is this step, on any rank (0: none)


def env_world_size() -> int:
    """The world size torchrun announced (1 outside torchrun); needs no process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; start runs with torchrun") from None


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank `rank` of `size` (`World()`: a single process)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    host_group: Any = None  # gloo group for host-side flags and objects (never syncs a GPU)

    @property
    def active(self) -> bool:
        return self.host_group is not None

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run's files and holds its lock."""
        return self.rank == 0

    # --- data ------------------------------------------------------------------------
    def shard(self, batch: list[int]) -> list[int]:
        """This rank's contiguous share of a global batch (sizes differ by at most one).

        Contiguous and stable: position i of a rank's batch is the same row of the global
        batch at every step, so state carried per row (truncated BPTT) stays with its rank."""
        n = len(batch)
        return batch[n * self.rank // self.size: n * (self.rank + 1) // self.size]

    # --- model and gradients -----------------------------------------------------------
    def broadcast_model(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers everywhere: identical initial weights whatever the init did."""
        if not self.active:
            return
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Each parameter's gradient := its sum over ranks, on every rank.

        A parameter without a gradient on this rank but with one elsewhere gets zeros (its
        gradient in the global batch is the others' share); one without a gradient anywhere
        keeps None, so the optimizer skips it as a single process would. Dense gradients are
        reduced in their own dtype (FP16 for fp16/mp) in one flat buffer per dtype; sparse
        ones by gathering every rank's rows (works on gloo and nccl alike) and summing."""
        if not self.active:
            return
        kinds = torch.tensor([0 if p.grad is None else _SPARSE if p.grad.is_sparse else _DENSE for p in params],
                             dtype=torch.int32)
        dist.all_reduce(kinds, op=dist.ReduceOp.MAX, group=self.host_group)
        dense: dict[torch.dtype, list[torch.Tensor]] = {}
        sparse: list[nn.Parameter] = []
        for p, kind in zip(params, kinds.tolist()):
            if kind == _DENSE:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dense.setdefault(p.grad.dtype, []).append(p.grad)
            elif kind == _SPARSE:
                if p.grad is None:
                    p.grad = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long, device=p.device),
                                                     torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device),
                                                     p.shape, check_invariants=False)
                sparse.append(p)
        for grads in dense.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))
        if sparse:
            self._reduce_sparse(sparse)

    def _reduce_sparse(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad.coalesce() for p in params]
        device = grads[0].device
        counts = torch.tensor([g._nnz() for g in grads], dtype=torch.long, device=device)
        gathered = [torch.empty_like(counts) for _ in range(self.size)]
        dist.all_gather(gathered, counts)
        per_rank = torch.stack(gathered).tolist()  # [rank][param]: one host read for all sparse grads
        for j, (p, g) in enumerate(zip(params, grads)):
            nnz = [row[j] for row in per_rank]
            width = max(nnz)
            indices, values = _pad(g._indices(), width, 1), _pad(g._values(), width, 0)
            all_indices = [torch.empty_like(indices) for _ in range(self.size)]
            all_values = [torch.empty_like(values) for _ in range(self.size)]
            dist.all_gather(all_indices, indices)
            dist.all_gather(all_values, values)
            p.grad = torch.sparse_coo_tensor(torch.cat([i[:, :n] for i, n in zip(all_indices, nnz)], 1),
                                             torch.cat([v[:n] for v, n in zip(all_values, nnz)], 0),
                                             g.shape, check_invariants=False).coalesce()  # rows of valid grads

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks (a device collective: no host sync by itself)."""
        if self.active:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise mean over ranks (device collective)."""
        if self.active:
            t = t.clone()
            dist.all_reduce(t)
            t /= self.size
        return t

    # --- host side ---------------------------------------------------------------------
    def any(self, *flags: bool) -> list[bool]:
        """Each flag true on some rank? Over the gloo host group: no GPU sync."""
        if not self.active:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return [bool(v) for v in t.tolist()]

    def sum(self, *values: float) -> list[float]:
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.host_group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.host_group)


def _pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim)


_WORLD: World | None = None


def init(device: torch.device) -> World:
    """The process's World; under torchrun the process group is created on the first call
    (nccl for CUDA, else gloo) and kept for the process's life (a test may train several runs)."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    _export_submitit_env()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        _WORLD = World()
        return _WORLD
    rank, size = int(os.environ["RANK"]), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=TIMEOUT, **({"device_id": torch.device("cuda", local_rank)}
                                                         if device.type == "cuda" else {}))
    host_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend != "gloo" else dist.group.WORLD
    atexit.register(_shutdown)
    _WORLD = World(rank, size, local_rank, host_group)
    return _WORLD


def _export_submitit_env() -> None:
    """A SLURM job of several tasks started by the submitit launcher (configs/hydra/launcher/
    slurm_gpus.yaml) runs one process per GPU, as torchrun would: give torch.distributed the
    variables torchrun would set, from SLURM's. A process started by torchrun has them already."""
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit  # present whenever SUBMITIT_EXECUTOR is set

    if submitit.JobEnvironment().num_tasks > 1:
        # CUDA_VISIBLE_DEVICES stays whole: the device is cuda:<LOCAL_RANK> (local_device)
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: torch.device, world: World) -> torch.device:
    """cuda -> cuda:<local rank> under torchrun (one GPU per process); anything else unchanged."""
    if world.active and device.type == "cuda":
        return torch.device("cuda", world.local_rank)
    return device

