"""The step context: what a Task's train_step calls to back-propagate and update.

One OptimizerSlot per optimizer name the task declared: its parameters (with FP32
master copies where the precision has them), optimizer, LR schedule and its own
loss scaler. Per slot, per iteration:

    backward(loss, name)   scaled backward, gradients only into this slot's parameters
                           (autograd `inputs=`), may be called several times (they add up)
    step(name)             data-parallel: all-reduce the slot's gradients (runner/distributed.py);
                           grads -> master (FP32), unscale + overflow check (no sync),
                           one host read of the overflow flag (MAX over ranks, so a skip is
                           global): skip, or clip, optimizer
                           step, LR step, round the master back into the model; then the
                           slot's model gradients are cleared
    finish_iteration()     each slot that stepped updates its scaler once (on the device)

A skipped step of one slot never skips another: each reads only its own flag.
Whatever a scaler reads (the flag, max|grad|) is MAX-reduced over ranks, so every rank
holds the same scale at every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from runner.config import OptimizerConfig
from runner.distributed import World
from runner.gradstats import GradStats
from runner.measure import tensor_bytes
from runner.optim import clip_grad_norm_
from runner.precision import BoundParams, PrecisionPolicy
from runner.scaling import LossScaler, dense_values, grad_abs_max


@dataclass
class OptimizerSlot:
    """One named optimizer with everything that updates its parameters."""

    name: str
    cfg: OptimizerConfig
    params: BoundParams
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    skipped_steps: int = 0        # over the whole run
    consecutive_skips: int = 0    # iterations in a row whose step was skipped
    lr: float = 0.0               # the LR of the last optimizer step taken
    grad_bytes: int | None = None # gradient bytes held at the last measured step (model + master)
    # this iteration
    stepped: bool = False
    skipped: bool = False
    found_inf: torch.Tensor | None = None
    grad_max: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.lr = self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "lr": self.lr,
                "master": None if self.params.master_params is None
                else [m.detach() for m in self.params.master_params]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps, self.consecutive_skips, self.lr = (
            state["skipped_steps"], state["consecutive_skips"], state["lr"])
        masters = self.params.master_params
        if masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(masters, [m.to(masters[0].device) for m in state["master"]])


class TrainStep:
    """The StepContext of runner.task, bound to one run's slots. `begin`/`finish_iteration`
    bracket every training iteration; evaluation uses cast/fp32 only."""

    def __init__(self, policy: PrecisionPolicy, slots: dict[str, OptimizerSlot], stats: GradStats,
                 inject_nonfinite_at: list[int], world: World = World()) -> None:
        self.policy = policy
        self.world = world
        self.grad_weight = 1.0  # this rank's share of the global batch (n_rank / n_global): its loss's weight
        self.device = policy.device
        self.slots = slots
        self.stats = stats
        self.inject_nonfinite_at = set(inject_nonfinite_at)
        self.step_number = 0  # 1-based number of the iteration in progress
        self.measure_grad_bytes = False  # set by the engine on the step it measures memory on

    # --- dtypes --------------------------------------------------------------------------
    def cast(self, x: Any) -> Any:
        return self.policy.cast(x)

    def fp32(self, *tensors: Any) -> ContextManager[Any]:
        return self.policy.fp32(*tensors)

    # --- backward and update ---------------------------------------------------------------
    def _slot(self, name: str) -> OptimizerSlot:
        try:
            return self.slots[name]
        except KeyError:
            raise KeyError(f"no optimizer {name!r}; the task's optimizer_params() declared: "
                           f"{', '.join(self.slots)}") from None

    def backward(self, loss: torch.Tensor, name: str = "main") -> None:
        slot = self._slot(name)
        if self.stats.sampling:  # a second optimizer's scale, relative to the one statistics record at
            reference = next(iter(self.slots.values()))
            self.stats.backward_scale(None if slot is reference else slot.scaler.scale / reference.scaler.scale)
        scaled = slot.scaler.scale_loss(loss)
        if self.grad_weight != 1.0:
            # Data-parallel: each item's gradient gets the 1/N of the global batch, as in one process,
            # so FP16 gradients have the single-process range and the all-reduce simply sums them.
            scaled = scaled * self.grad_weight
        with torch.autocast(self.device.type, enabled=False):  # backward never autocasts
            torch.autograd.backward(scaled, inputs=slot.params.model_params)

    def step(self, name: str = "main") -> None:
        slot = self._slot(name)
        bound = slot.params
        with torch.autocast(self.device.type, enabled=False):
            self.world.reduce_gradients(bound.model_params)
            grads = bound.grads_for_update()
            if self.step_number in self.inject_nonfinite_at and grads:
                dense_values(grads)[0].fill_(float("inf"))  # debug hook: an overflow exactly here
            found_inf = slot.scaler.unscale_(grads)
            self.stats.weight_grads(bound)
            if slot.scaler.needs_grad_max:
                grad_max = grad_abs_max(grads).to(found_inf.device)  # an optimizer without grads: a CPU 0
                if self.world.active:
                    # One collective for the flag and max|grad|: a rank-local inf still skips every
                    # rank, and the lognormal scaler reads the same value everywhere.
                    found_inf, grad_max = self.world.all_max(torch.stack([found_inf, grad_max]))
                slot.grad_max = _running_max(slot.grad_max, grad_max)
            else:
                found_inf = self.world.all_max(found_inf)
            slot.found_inf = _running_max(slot.found_inf, found_inf)
            slot.stepped = True
            if self.measure_grad_bytes:
                slot.grad_bytes = tensor_bytes(bound.grad_tensors())
            if found_inf.item():  # the one host sync per optimizer step: skipping needs the host
                slot.skipped = True
                slot.skipped_steps += 1
                bound.clear_grads()
                return
            if slot.cfg.grad_clip is not None:
                clip_grad_norm_(grads, slot.cfg.grad_clip)
            slot.lr = slot.optimizer.param_groups[0]["lr"]
            with self.stats.measure_update(bound, slot.optimizer):
                slot.optimizer.step()
            slot.scheduler.step()
            bound.publish()
            bound.clear_grads()

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        self.backward(loss, name)
        self.step(name)

    # --- iteration bracket -------------------------------------------------------------------
    def begin(self, step_number: int) -> None:
        self.step_number = step_number
        for slot in self.slots.values():
            slot.stepped, slot.skipped, slot.found_inf, slot.grad_max = False, False, None, None

    def finish_iteration(self, stats_max: torch.Tensor | None) -> bool:
        """Update the scalers of the slots that stepped; returns whether any step was skipped.

        stats_max: the gradient statistics' unscaled max|grad| over the whole model on the
        auto scaler's sampling steps (else None); every auto scaler uses it.
        """
        any_skipped = False
        if stats_max is not None:  # auto: activation gradients are rank-local, never all-reduced
            stats_max = self.world.all_max(stats_max)
        for slot in self.slots.values():
            if not slot.stepped:
                continue
            slot.consecutive_skips = slot.consecutive_skips + 1 if slot.skipped else 0
            any_skipped |= slot.skipped
            slot.scaler.update(slot.found_inf, slot.grad_max if stats_max is None else stats_max, self.step_number)
        return any_skipped


def _running_max(current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if current is None else torch.maximum(current, new)
