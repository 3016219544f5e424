"""Loss scalers (paper section 3.2 and what came after it).

Every scaler keeps its scale as a device tensor and updates it with tensor ops,
so choosing the scale never costs a host sync; the engine's single sync per
optimizer step is reading `found_inf` to decide whether to skip.

    loss_for_backward = scaler.scale_loss(loss)
    found_inf = scaler.unscale_(grads)        # grads /= S in place, 1.0 if any inf/NaN
    ... skip or step ...
    scaler.update(found_inf, grad_max)        # once per iteration

| scale      | how S is chosen                                                                  |
|------------|----------------------------------------------------------------------------------|
| none       | S = 1                                                                            |
| <number>   | S fixed (paper: 8 for SSD, 128 for bigLSTM)                                      |
| dynamic    | backoff, semantics of torch.amp.GradScaler (+ optional min/max, hysteresis)      |
| lognormal  | OpenSeq2Seq's statistical scaler: P(max grad overflows) < overflow_prob          |
| auto       | paper 3.2: largest 2^k with 2^k * max|grad| < format max * margin, every N steps |
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import torch

from runner.errors import UserError


@dataclass
class ScalerConfig:
    """Knobs under the config key `scaler` (the policy itself is the top-level `scale`)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1               # dynamic: shrink only on the k-th overflow (DeepSpeed)
    overflow_prob: float = 0.001      # lognormal: target P(overflow) per step
    beta1: float = 0.99               # lognormal: decay of the running mean of log2 max|g|
    beta2: float = 0.999              # lognormal: decay of the running second moment
    auto_every: int = 100             # auto: re-evaluate S every N steps
    auto_margin: float = 0.125        # auto: keep S * max|g| below format max * margin


def dense_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dense tensors holding the gradient values: a coalesced sparse gradient's values, a dense one itself.

    In-place ops on these (unscale, clip) change the gradients themselves, as in GradScaler.
    """
    return [g._values() if g.is_sparse else g for g in grads]


def grad_abs_max(grads: list[torch.Tensor]) -> torch.Tensor:
    """max |g| over all gradients (sparse: their values) as a float32 device scalar (no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(dense_values(grads), float("inf"))
    return torch.stack([n.float() for n in norms]).max()


class LossScaler:
    """S = 1 and the base of all scalers: unscale, check, and state handling."""

    kind = "none"
    needs_grad_max: bool = False  # lognormal: max|weight grad| every step (auto reads gradstats instead)

    def __init__(self, value: float, cfg: ScalerConfig, format_max: float, device: torch.device) -> None:
        self.cfg = cfg
        self.format_max = format_max
        self.device = device
        self.scale = torch.full((), float(value), dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide grads by S in place; return a device flag (1.0 if any grad is inf/NaN).

        Sparse gradients must be coalesced (BoundParams.grads_for_update does it): their
        values are unscaled and checked, as torch.amp.GradScaler does.
        """
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        inv_scale = self.scale.double().reciprocal().float()
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in dense_values(grads):
            by_dtype[(g.device, g.dtype)].append(g)
        for (dev, _), group in by_dtype.items():
            flag = torch.zeros((1,), dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv_scale.to(dev).reshape(1))
            found_inf = torch.maximum(found_inf, flag.to(self.device).reshape(()))
        return found_inf

    def update(self, found_inf: torch.Tensor, grad_max: torch.Tensor | None, step: int) -> None:
        """Choose the next S. Fixed scalers keep theirs."""

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            getattr(self, k).copy_(v)


class FixedScaler(LossScaler):
    kind = "fixed"


class DynamicScaler(LossScaler):
    """Backoff scaling with torch.amp.GradScaler's semantics.

    On overflow: S *= backoff_factor (at most once per `hysteresis` overflows),
    growth tracker reset. After growth_interval consecutive good steps: S *=
    growth_factor, applied on the N-th good step, skipped if S would be inf.
    min_scale / max_scale clamp; hysteresis > 1 is DeepSpeed's delayed shift,
    whose counter refills on growth.
    """

    kind = "dynamic"

    def __init__(self, value: float, cfg: ScalerConfig, format_max: float, device: torch.device) -> None:
        super().__init__(cfg.init_scale, cfg, format_max, device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_left = torch.full((), cfg.hysteresis, dtype=torch.int32, device=device)

    def update(self, found_inf: torch.Tensor, grad_max: torch.Tensor | None, step: int) -> None:
        cfg = self.cfg
        overflow = found_inf > 0
        shrink = overflow & (self.hysteresis_left <= 1)
        good = self.growth_tracker + 1
        grow = ~overflow & (good >= cfg.growth_interval)
        grown = self.scale * cfg.growth_factor
        if cfg.max_scale is not None:
            grown = torch.clamp(grown, max=cfg.max_scale)
        shrunk = self.scale * cfg.backoff_factor
        if cfg.min_scale is not None:
            shrunk = torch.clamp(shrunk, min=cfg.min_scale)
        new_scale = torch.where(shrink, shrunk, torch.where(grow & torch.isfinite(grown), grown, self.scale))
        self.growth_tracker.copy_(torch.where(overflow | grow, torch.zeros_like(good), good))
        refill = torch.full_like(self.hysteresis_left, cfg.hysteresis)
        self.hysteresis_left.copy_(torch.where(
            overflow, torch.where(shrink, self.hysteresis_left, self.hysteresis_left - 1),
            torch.where(grow, refill, self.hysteresis_left)))
        self.scale.copy_(new_scale)


class LogNormalScaler(LossScaler):
    """OpenSeq2Seq's statistical scaler, with its two published bugs fixed.

    x = log2 max|g| (unscaled) is modelled as normal; running bias-corrected
    estimates of its mean (beta1) and variance (beta2) give a cutoff
    mu + z * sigma with z = Phi^-1(1 - overflow_prob) (3.09 for 0.001), and
    S = 2^floor(log2(format_max) - cutoff). Fixes: on overflow the unscaled max
    is only known to exceed format_max / S, so log2 of that bound (not 2^16) is
    fed into the averages; and log2(format_max) of the actual format is used, not
    a hard-coded 16. S is clamped to [min_scale or 1, max_scale or 2^24], and an
    overflow always shrinks S by at least backoff_factor.
    """

    kind = "lognormal"
    needs_grad_max = True

    def __init__(self, value: float, cfg: ScalerConfig, format_max: float, device: torch.device) -> None:
        super().__init__(cfg.init_scale, cfg, format_max, device)
        zeros = lambda: torch.zeros((), dtype=torch.float32, device=device)  # noqa: E731
        self.mean_hat, self.slow_mean_hat, self.sq_hat = zeros(), zeros(), zeros()
        self.beta1_power = torch.ones((), dtype=torch.float32, device=device)
        self.beta2_power = torch.ones((), dtype=torch.float32, device=device)
        self.z = NormalDist().inv_cdf(1.0 - cfg.overflow_prob)

    def update(self, found_inf: torch.Tensor, grad_max: torch.Tensor | None, step: int) -> None:
        cfg = self.cfg
        assert grad_max is not None, "lognormal scaler needs max|grad| every step"
        overflow = found_inf > 0
        log_fmax = math.log2(self.format_max)
        x = torch.where(overflow, log_fmax - torch.log2(self.scale), torch.log2(grad_max.float()))
        informative = overflow | (grad_max > 0)  # an all-zero gradient says nothing about the max
        x = torch.where(informative, x, torch.zeros_like(x))
        # Python scalars, not torch.tensor(beta, device=...): no host-to-device copy every step
        b1 = torch.where(informative, cfg.beta1, 1.0).to(x.dtype)
        b2 = torch.where(informative, cfg.beta2, 1.0).to(x.dtype)
        self.mean_hat.copy_(b1 * self.mean_hat + (1 - b1) * x)
        self.slow_mean_hat.copy_(b2 * self.slow_mean_hat + (1 - b2) * x)
        self.sq_hat.copy_(b2 * self.sq_hat + (1 - b2) * x * x)
        self.beta1_power.mul_(b1)
        self.beta2_power.mul_(b2)
        seen = self.beta1_power < 1  # at least one informative step
        mu = self.mean_hat / (1 - self.beta1_power).clamp_min(1e-12)
        slow_mu = self.slow_mean_hat / (1 - self.beta2_power).clamp_min(1e-12)
        var = (self.sq_hat / (1 - self.beta2_power).clamp_min(1e-12) - slow_mu * slow_mu).clamp_min(0)
        cutoff = mu + self.z * var.sqrt()
        proposed = torch.exp2(torch.floor(log_fmax - cutoff))
        proposed = proposed.clamp(min=cfg.min_scale or 1.0, max=cfg.max_scale or 2.0**24)
        # After an overflow the statistics alone may propose the very S that overflowed
        # (sigma ~ 0 early on): back off at least as far as the dynamic scaler would.
        backed_off = torch.minimum(proposed, (self.scale * cfg.backoff_factor).clamp_min(cfg.min_scale or 1.0))
        self.scale.copy_(torch.where(overflow, backed_off, torch.where(seen, proposed, self.scale)))


class AutoScaler(LossScaler):
    """The paper's rule from gradient statistics (section 3.2), re-evaluated every N steps.

    S = largest power of two with S * max|g| < format_max * auto_margin, where
    max|g| is the unscaled maximum over the activation and the weight gradients
    of the sampled step. The engine's gradient-statistics collector
    (runner/gradstats.py) samples it every `stats_every` = auto_every steps,
    whether or not stats are enabled, and passes it to update(); on other steps
    grad_max is None. Activation gradients are included because the rule is
    about overflow anywhere in back-propagation: every gradient backward writes
    in the low format, the activation gradients of the paper's Figure 3 as well
    as the weight gradients, must stay below format_max after scaling, and an
    overflow in an activation gradient poisons every gradient below it. Between
    evaluations S stays; an overflow halves it (and the step is skipped).
    """

    kind = "auto"

    def __init__(self, value: float, cfg: ScalerConfig, format_max: float, device: torch.device) -> None:
        super().__init__(cfg.init_scale, cfg, format_max, device)
        self.stats_every = cfg.auto_every

    def update(self, found_inf: torch.Tensor, grad_max: torch.Tensor | None, step: int) -> None:
        cfg = self.cfg
        lo, hi = cfg.min_scale or 1.0, cfg.max_scale or 2.0**24
        halved = (self.scale * 0.5).clamp(min=lo)
        if grad_max is None:
            self.scale.copy_(torch.where(found_inf > 0, halved, self.scale))
            return
        budget = self.format_max * cfg.auto_margin
        exponent = torch.floor(torch.log2(budget / grad_max.float().clamp_min(1e-30)))
        proposed = torch.exp2(exponent).clamp(min=lo, max=hi)
        usable = torch.isfinite(grad_max) & (grad_max > 0) & (found_inf == 0)
        self.scale.copy_(torch.where(found_inf > 0, halved, torch.where(usable, proposed, self.scale)))


SCALERS: dict[str, type[LossScaler]] = {
    "none": LossScaler, "dynamic": DynamicScaler, "lognormal": LogNormalScaler, "auto": AutoScaler,
}


def parse_scale(scale: Any) -> tuple[str, float]:
    """'none' | 'dynamic' | 'lognormal' | 'auto' | positive number -> (kind, value)."""
    if isinstance(scale, bool):
        raise UserError(f"scale={scale} is not a loss scale; use none, dynamic, lognormal, auto or a positive number")
    if isinstance(scale, (int, float)):
        value = float(scale)
    elif isinstance(scale, str) and scale in SCALERS:
        return scale, 1.0
    else:
        try:
            value = float(scale)
        except (TypeError, ValueError):
            raise UserError(f"scale={scale!r} is not a loss scale; use none, dynamic, lognormal, auto "
                            f"or a positive number such as scale=8") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"scale={scale} must be a positive finite number (e.g. scale=8), or none/dynamic/lognormal/auto")
    return "fixed", value


def make_scaler(scale: Any, cfg: ScalerConfig, format_max: float, device: torch.device) -> LossScaler:
    kind, value = parse_scale(scale)
    cls = FixedScaler if kind == "fixed" else SCALERS[kind]
    return cls(value, cfg, format_max, device)
