"""Typed schemas for the composed config, and the one function that validates it.

Hydra composes YAML; these dataclasses decide what is allowed. Merging the
composed config into the structured schema turns unknown keys and wrong types
into errors with the offending key named, before anything runs. Model and data
keys are validated by the selected Task's own schema (models/<name>.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    t = root.trainer
    for key in ("max_steps", "log_every"):
        if getattr(t, key) <= 0:
            raise UserError(f"bad config: trainer.{key} must be positive, got {getattr(t, key)}")
    if t.lr <= 0:
        raise UserError(f"bad config: trainer.lr must be positive, got {t.lr}")
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
