"""Typed schemas for the composed config, and the one function that validates it.

Hydra composes YAML; these dataclasses decide what is allowed. Merging the
composed config into the structured schema turns unknown keys and wrong types
into errors with the offending key named, before anything runs. Model and data
keys are validated by the selected Task's own schema (models/<name>.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import UserError
from runner.gradstats import StatsConfig
from runner.scaling import ScalerConfig


@dataclass
class TrainerConfig:
    max_steps: int = 200
    epochs: int | None = None          # if set, overrides max_steps with epochs * batches per epoch
    optimizer: str = "sgd"             # sgd | adam | adamw | adagrad
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    schedule: str = "cosine"           # constant | cosine | step
    milestones: list[int] = field(default_factory=list)  # step schedule: multiply lr by gamma at these points
    schedule_unit: str = "steps"       # steps | epochs: the unit of milestones and warmup_steps
    gamma: float = 0.1
    warmup_steps: int = 0              # linear warm-up from 0 to lr
    grad_clip: float | None = None     # max global L2 norm of (unscaled) gradients
    log_every: int = 10
    eval_every: int = 0                # 0: evaluate only at the end
    eval_batches: int | None = None    # limit evaluation to this many batches
    timing_warmup_steps: int = 5       # steps excluded from throughput / step-time statistics
    abort_after_skips: int = 50        # end the run as diverged after this many consecutive skipped steps; 0: never
    deterministic: bool = False        # torch.use_deterministic_algorithms + cudnn deterministic
    checkpoint_every: int = 0          # 0: checkpoint only at the end
    resume: str = "auto"               # auto: continue from out_dir/checkpoint.pt if present | never


@dataclass
class PrecisionConfig:
    name: str = "fp32"


@dataclass
class DebugConfig:
    nonfinite_steps: list[int] = field(default_factory=list)  # make these steps' gradients inf (scaler demos)


@dataclass
class RootConfig:
    model: Any = None
    data: Any = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    scale: Any = "none"
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    seed: int = 0
    device: str = "auto"
    out_root: str = "outputs"
    run_name: str = ""
    out_dir: str = ""
    stats: StatsConfig = field(default_factory=StatsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


_CHOICES = {
    "trainer.optimizer": ("sgd", "adam", "adamw", "adagrad"),
    "trainer.schedule": ("constant", "cosine", "step"),
    "trainer.resume": ("auto", "never"),
    "trainer.schedule_unit": ("steps", "epochs"),
}


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _positive_or_null(v: Any) -> bool:
    return v is None or v > 0


def _fraction(v: Any) -> bool:
    return 0 <= v < 1


# Numeric keys whose range the types cannot express; key -> (test, what it must be).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{f"trainer.{k}": (_positive, "positive") for k in ("max_steps", "log_every", "lr", "eps", "gamma")},
    **{f"trainer.{k}": (_non_negative, "zero or more") for k in (
        "momentum", "weight_decay", "warmup_steps", "eval_every", "timing_warmup_steps", "abort_after_skips",
        "checkpoint_every")},
    **{f"trainer.{k}": (_positive_or_null, "positive or null") for k in ("epochs", "grad_clip", "eval_batches")},
    "trainer.betas": (lambda v: len(v) == 2 and all(map(_fraction, v)), "two numbers in [0, 1)"),
    **{f"scaler.{k}": (_positive, "positive") for k in ("init_scale", "growth_interval", "auto_every")},
    **{f"scaler.{k}": (_positive_or_null, "positive or null") for k in ("min_scale", "max_scale")},
    "scaler.growth_factor": (lambda v: v > 1, "greater than 1"),
    "scaler.backoff_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "scaler.hysteresis": (lambda v: v >= 1, "1 or more"),
    "scaler.overflow_prob": (lambda v: 0 < v < 1, "in (0, 1)"),
    "scaler.beta1": (_fraction, "in [0, 1)"),
    "scaler.beta2": (_fraction, "in [0, 1)"),
    "scaler.auto_margin": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


def one_line(exc: OmegaConfBaseException) -> str:
    """OmegaConf errors are multi-line with a key path; keep the message and the key."""
    msg = str(exc).splitlines()[0].strip()
    key = getattr(exc, "full_key", None)
    return f"{key}: {msg}" if key else msg


def validate(cfg: DictConfig) -> RootConfig:
    """Composed config -> typed RootConfig, or UserError naming the bad key."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), plain)
        root: RootConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {one_line(exc)}") from None
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(root, section), name)
        if value not in allowed:
            raise UserError(f"bad config: {key}={value!r}; choose one of: {', '.join(allowed)}")
    for key, (ok, requirement) in _RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(root, section), name)
        if not ok(value):
            raise UserError(f"bad config: {key}={value} must be {requirement}")
    if root.trainer.nesterov and root.trainer.momentum <= 0:
        raise UserError("bad config: trainer.nesterov=true needs trainer.momentum > 0")
    if root.device not in ("auto", "cpu") and not root.device.startswith("cuda"):
        raise UserError(f"bad config: device={root.device!r}; use auto, cpu, cuda or cuda:N")
    return root


def section(schema: type, cfg: Any, where: str) -> Any:
    """Validate one free-form section (model.*, data.*) against a Task's dataclass schema."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise UserError(f"bad config: {where}.{one_line(exc)}") from None
