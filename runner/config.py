"""Typed schemas for the composed config, and the one function that validates it.

Hydra composes YAML; these dataclasses decide what is allowed. Merging the
composed config into the structured schema turns unknown keys and wrong types
into errors with the offending key named, before anything runs. Model and data
keys are validated by the selected Task's own schema (models/<name>.py).
"""
from __future__ import annotations

import difflib
import functools
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from runner.errors import UserError
from runner.gradstats import StatsConfig
from runner.scaling import ScalerConfig


@dataclass
class OptimizerConfig:
    """One optimizer and its LR schedule. trainer.* holds the defaults for every optimizer;
    trainer.optimizers.<name>.* overrides them for the task's optimizer <name>."""

    optimizer: str = "sgd"             # sgd | adam | adamw | adagrad
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0  # adagrad
    schedule: str = "cosine"           # constant | cosine | step
    milestones: list[int] = field(default_factory=list)  # step schedule: multiply lr by gamma at these points
    schedule_unit: str = "steps"       # steps | epochs: the unit of milestones and warmup_steps
    gamma: float = 0.1
    warmup_steps: int = 0              # linear warm-up from 0 to lr
    grad_clip: float | None = None     # max global L2 norm of (unscaled) gradients


@dataclass
class TrainerConfig(OptimizerConfig):
    max_steps: int = 200
    epochs: int | None = None          # if set, overrides max_steps with epochs * batches per epoch
    optimizers: dict[str, Any] = field(default_factory=dict)  # per-optimizer overrides of the keys above
    log_every: int = 10
    eval_every: int = 0                # 0: evaluate only at the end
    eval_batches: int | None = None    # limit evaluation to this many batches
    timing_warmup_steps: int = 5       # steps excluded from throughput / step-time statistics
    abort_after_skips: int = 50        # end the run as diverged after this many consecutive skipped steps; 0: never
    deterministic: bool = False        # torch.use_deterministic_algorithms + cudnn deterministic
    checkpoint_every: int = 0          # 0: checkpoint only at the end
    checkpoint_minutes: float | None = None  # also checkpoint when this much wall time passed since the last
    resume: str = "auto"               # auto: continue a matching run | never: refuse an existing one | force: may change its length

    def for_optimizer(self, name: str) -> OptimizerConfig:
        """The settings of optimizer `name`: trainer.* with trainer.optimizers.<name>.* on top."""
        base = OptimizerConfig(**{f.name: getattr(self, f.name) for f in fields(OptimizerConfig)})
        overrides = self.optimizers.get(name)
        if not overrides:
            return base
        try:
            merged = OmegaConf.merge(OmegaConf.structured(base), overrides)
            chosen: OptimizerConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise UserError(explain(exc, f"trainer.optimizers.{name}")) from None
        check_optimizer(chosen, f"trainer.optimizers.{name}")
        return chosen


@dataclass
class PrecisionConfig:
    name: str = "fp32"


@dataclass
class DebugConfig:
    nonfinite_steps: list[int] = field(default_factory=list)  # make these steps' gradients inf (scaler demos)
    nonfinite_ranks: list[int] = field(default_factory=list)  # torchrun: inject only on these ranks ([]: all)


@dataclass
class RootConfig:
    model: Any = None
    data: Any = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    scale: Any = "none"
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    seed: int = 0
    # CPU threads of torch's intra-op pool (torch.set_num_threads); null keeps torch's default
    # (one per core). The thread count changes the order of floating-point reductions, so it is
    # part of a run's result: the quick presets pin it to make reruns bit-identical anywhere.
    threads: int | None = None
    device: str = "auto"
    out_root: str = "outputs"
    out_dir: str = ""                  # configs/config.yaml derives it from the run (runner/rundir.py)
    stats: StatsConfig = field(default_factory=StatsConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def _positive(v: Any) -> bool:
    return math.isfinite(v) and v > 0


def _non_negative(v: Any) -> bool:
    return math.isfinite(v) and v >= 0


def _positive_or_null(v: Any) -> bool:
    return v is None or _positive(v)


def _fraction(v: Any) -> bool:
    return 0 <= v < 1


Check = tuple[Callable[[Any], bool], str]  # (test, what the value must be)

# Keys of one optimizer (trainer.* and each trainer.optimizers.<name>.*).
_OPTIMIZER_CHOICES: dict[str, tuple[str, ...]] = {
    "optimizer": ("sgd", "adam", "adamw", "adagrad"),
    "schedule": ("constant", "cosine", "step"),
    "schedule_unit": ("steps", "epochs"),
}
_OPTIMIZER_RANGES: dict[str, Check] = {
    **{k: (_positive, "positive") for k in ("lr", "eps", "gamma")},
    **{k: (_non_negative, "zero or more") for k in (
        "momentum", "weight_decay", "warmup_steps", "initial_accumulator_value")},
    "grad_clip": (_positive_or_null, "positive or null"),
    "betas": (lambda v: len(v) == 2 and all(map(_fraction, v)), "two numbers in [0, 1)"),
    "milestones": (lambda v: all(m > 0 for m in v), "positive numbers"),
}

# Every other numeric key, by its dotted path: the ranges the types cannot express.
_CHOICES: dict[str, tuple[str, ...]] = {"trainer.resume": ("auto", "never", "force")}
_RANGES: dict[str, Check] = {
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2^32)"),  # what every RNG the data sets use accepts
    "threads": (_positive_or_null, "positive or null"),
    **{f"trainer.{k}": (_positive, "positive") for k in ("max_steps", "log_every")},
    **{f"trainer.{k}": (_non_negative, "zero or more") for k in (
        "eval_every", "timing_warmup_steps", "abort_after_skips", "checkpoint_every")},
    **{f"trainer.{k}": (_positive_or_null, "positive or null") for k in (
        "epochs", "eval_batches", "checkpoint_minutes")},
    **{f"scaler.{k}": (_positive, "positive") for k in ("init_scale", "growth_interval", "auto_every")},
    **{f"scaler.{k}": (_positive_or_null, "positive or null") for k in ("min_scale", "max_scale")},
    "scaler.growth_factor": (lambda v: math.isfinite(v) and v > 1, "greater than 1"),
    "scaler.backoff_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "scaler.hysteresis": (lambda v: v >= 1, "1 or more"),
    "scaler.overflow_prob": (lambda v: 0 < v < 1, "in (0, 1)"),
    "scaler.beta1": (_fraction, "in [0, 1)"),
    "scaler.beta2": (_fraction, "in [0, 1)"),
    "scaler.auto_margin": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "stats.every": (_positive, "positive"),
    # steps are numbered from 1, as in the logs: step N is the N-th optimizer step
    "debug.nonfinite_steps": (lambda v: all(s >= 1 for s in v), "step numbers of 1 or more"),
    "debug.nonfinite_ranks": (lambda v: all(r >= 0 for r in v), "rank numbers of 0 or more"),
}

_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def explain(exc: OmegaConfBaseException, where: str = "") -> str:
    """One line for an OmegaConf error, in the user's words: the key, the value and the fix.

    `where` prefixes the key when the error came from a section validated on its own (model, data)."""
    key = ".".join(part for part in (where, str(exc.full_key or "")) if part)
    message = str(exc.msg if exc.msg is not None else exc).splitlines()[0].strip()
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and " not in " in message:
        return _unknown_key(key, exc.parent_node)
    converted = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message)
    if converted:
        value, wanted = converted.groups()
        return f"bad config: {key}={value} must be {_TYPE_WORDS.get(wanted, wanted.lower())}"
    not_bool = re.match(r"Value '(.*)' is not a valid bool", message)
    if not_bool:
        return f"bad config: {key}={not_bool.group(1)} must be true or false"
    if "is not a ListConfig" in message:
        return f"bad config: {key} must be a list, e.g. {key}=[1,2]"
    if "is not a DictConfig" in message or "is not a subclass of" in message:
        return f"bad config: {key} must be a group of keys, e.g. {key}.<name>=<value>"
    return f"bad config: {key}: {message}" if key else f"bad config: {message}"


def _unknown_key(key: str, parent: Any) -> str:
    """A typo gets the closest known key of its section; a section with no keys yet takes new ones with +."""
    known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    section_name, _, name = key.rpartition(".")
    prefix = f"{section_name}." if section_name else ""
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"bad config: unknown key {key}; did you mean {prefix}{close[0]}?"
    if known:
        return f"bad config: unknown key {key}; {section_name or 'the config'} has: {', '.join(known)}"
    return f"bad config: {section_name} has no key {name} yet; new keys need a leading + (+{key}...)"


def _check(value: Any, key: str, choices: tuple[str, ...] | None, check: Check | None) -> None:
    if choices is not None and value not in choices:
        raise UserError(f"bad config: {key}={value!r}; choose one of: {', '.join(choices)}")
    if check is not None and not check[0](value):
        raise UserError(f"bad config: {key}={value} must be {check[1]}")


def check_optimizer(cfg: OptimizerConfig, prefix: str) -> None:
    """Choices and ranges of one optimizer's settings; `prefix` names where they came from."""
    for name in {**_OPTIMIZER_CHOICES, **_OPTIMIZER_RANGES}:
        _check(getattr(cfg, name), f"{prefix}.{name}", _OPTIMIZER_CHOICES.get(name), _OPTIMIZER_RANGES.get(name))
    if cfg.nesterov and cfg.momentum <= 0:
        raise UserError(f"bad config: {prefix}.nesterov=true needs {prefix}.momentum > 0")


def check_device(name: str) -> None:
    """auto, or a device string torch parses (cpu, cuda, cuda:N); whether it exists is checked at run time."""
    try:
        kind = "auto" if name == "auto" else torch.device(name).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("auto", "cpu", "cuda"):
        raise UserError(f"bad config: device={name!r}; use auto, cpu, cuda or cuda:N")


def validate(cfg: DictConfig) -> RootConfig:
    """Composed config -> typed RootConfig, or UserError naming the bad key."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), plain)
        root: RootConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise UserError(explain(exc)) from None
    for key in {**_CHOICES, **_RANGES}:
        _check(functools.reduce(getattr, key.split("."), root), key, _CHOICES.get(key), _RANGES.get(key))
    if root.scaler.min_scale and root.scaler.max_scale and root.scaler.min_scale > root.scaler.max_scale:
        raise UserError(f"bad config: scaler.min_scale={root.scaler.min_scale} is above "
                        f"scaler.max_scale={root.scaler.max_scale}")
    check_optimizer(root.trainer, "trainer")
    for name in root.trainer.optimizers:
        root.trainer.for_optimizer(name)  # checks the overrides of every named optimizer
    check_device(root.device)
    return root


def section(schema: type, cfg: Any, where: str) -> Any:
    """Validate one free-form section (model.*, data.*) against a Task's dataclass schema."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise UserError(explain(exc, where)) from None
