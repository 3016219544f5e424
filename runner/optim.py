"""Optimizer and per-iteration LR schedule from the trainer config."""
from __future__ import annotations

import math

import torch

from runner.config import TrainerConfig


def build_optimizer(cfg: TrainerConfig, params: list[torch.nn.Parameter],
                    overrides: dict | None = None) -> torch.optim.Optimizer:
    """`overrides` lets a task change hyper-parameters of one of its optimizers (e.g. DCGAN's)."""
    o = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, **(overrides or {})}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, momentum=cfg.momentum, nesterov=cfg.nesterov, **o)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, betas=tuple(cfg.betas), eps=cfg.eps, **o)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, betas=tuple(cfg.betas), eps=cfg.eps, **o)
    return torch.optim.Adagrad(params, eps=cfg.eps, **o)


def lr_factor(cfg: TrainerConfig, total_steps: int, steps_per_epoch: int, step: int) -> float:
    """Multiplier of the base LR after `step` optimizer steps (linear warm-up, then the schedule)."""
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


def build_scheduler(cfg: TrainerConfig, optimizer: torch.optim.Optimizer, total_steps: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, total_steps, steps_per_epoch, step))
