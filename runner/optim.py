"""Optimizers, gradient clipping and the per-iteration LR schedule from one optimizer's config."""
from __future__ import annotations

import math
from typing import Any

import torch

from runner.config import OptimizerConfig
from runner.scaling import dense_values


def build_optimizer(cfg: OptimizerConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """Options set in a parameter group (e.g. weight_decay=0 for biases) win over the config's."""
    o = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=cfg.momentum, nesterov=cfg.nesterov, **o)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, betas=tuple(cfg.betas), eps=cfg.eps, **o)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, betas=tuple(cfg.betas), eps=cfg.eps, **o)
    return torch.optim.Adagrad(groups, eps=cfg.eps, initial_accumulator_value=cfg.initial_accumulator_value, **o)


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale grads in place so their global L2 norm is at most max_norm; returns the norm (no host sync).

    torch.nn.utils.clip_grad_norm_ does the same for dense gradients; sparse ones are
    clipped through their values (the norm of a sparse tensor is the norm of its values).
    """
    values = dense_values(grads)
    total = torch.nn.utils.get_total_norm(values, foreach=True)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(values, coef)
    return total


def lr_factor(cfg: OptimizerConfig, total_steps: int, steps_per_epoch: int, step: int) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warm-up, then the schedule."""
    unit = steps_per_epoch if cfg.schedule_unit == "epochs" else 1
    warmup = cfg.warmup_steps * unit
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "step":
        return cfg.gamma ** sum(step >= m * unit for m in cfg.milestones)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(cfg: OptimizerConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A closed-form factor per step (LambdaLR), not torch's chained schedulers: SequentialLR's
    recursive updates are not exact across a resume, a closed form is."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, total_steps, steps_per_epoch, step))
