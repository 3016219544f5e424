"""The plug-in interface between the shared engine and one paper model.

A Task owns everything model-specific: the network, the data, the loss and the
metric. It never touches dtypes, loss scalers or master weights: the engine hands
`train_step` a StepContext and an already-cast model. Adding a model means writing
one Task subclass in models/ and one entry in models.TASKS; the loop does not change.

The simple case is one line:

    def train_step(self, model, batch, ctx):
        loss = F.cross_entropy(model(batch["input"]), batch["target"])
        ctx.optimize(loss)                      # backward + step of optimizer "main"
        return {"loss": loss.detach()}

Several networks and optimizers (a GAN), calling submodules directly:

    fake = model.G(ctx.cast(noise))             # FP32 noise -> the model's compute dtype
    with ctx.fp32(model.D(real), model.D(fake.detach())) as (d_real, d_fake):
        d_loss = bce(d_real, ones) + bce(d_fake, zeros)   # losses in FP32, autocast off
    ctx.optimize(d_loss, "disc")                # grads only into the "disc" parameters
    with ctx.fp32(model.D(fake)) as d_fake:
        g_loss = bce(d_fake, ones)
    ctx.optimize(g_loss, "gen")

`backward` may be called several times before `step` (gradients accumulate in the
parameters of that optimizer only); each optimizer has its own loss scaler, so a
skipped step of one never skips another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable, Mapping, Protocol, Sequence, TypeVar, Union

import torch
from torch import nn

from runner.config import section
from runner.errors import UserError

# A batch is a dict. The engine moves every tensor in it to the device (PackedSequence and
# other objects with `.to()` are moved whole), except the top-level keys in `Task.host_keys`;
# the precision policy casts the floating tensors of batch["input"] to the compute dtype.
Batch = dict[str, Any]

# What `optimizer_params` may return per optimizer: parameters, or torch-style parameter
# groups ({"params": [...], "weight_decay": 0.0, ...}); group options override the config.
ParamSpec = Union[Iterable[nn.Parameter], Sequence[dict[str, Any]]]

T = TypeVar("T")


class StepContext(Protocol):
    """What the engine gives `train_step` (and `evaluate`, where backward/step raise)."""

    device: torch.device

    def cast(self, x: T) -> T:
        """Floating tensors in x (nested dicts/lists/tuples, PackedSequence) to the compute dtype."""

    def fp32(self, *tensors: Any) -> ContextManager[Any]:
        """A region with autocast off; yields `tensors` cast to FP32 (one -> it, several -> a tuple)."""

    def backward(self, loss: torch.Tensor, name: str = "main") -> None:
        """Scaled backward of loss into the gradients of optimizer `name`'s parameters only."""

    def step(self, name: str = "main") -> None:
        """Unscale, overflow check (skip on inf/NaN), clip, optimizer and LR step, publish to the
        model, then clear that optimizer's gradients."""

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        """backward(loss, name) then step(name)."""


@dataclass(frozen=True)
class EvalResult:
    """All evaluation values; `metrics[metric_name]` is the headline number.

    `images`: pictures to keep (e.g. a GAN's fixed-latent sample grid), name -> float
    tensor [3, H, W] in [0, 1]; the engine writes each to TensorBoard as `eval/<model>/<name>`
    and as `<run_dir>/<name>_step<step>.png`.
    """

    metrics: dict[str, float]
    images: dict[str, torch.Tensor] = field(default_factory=dict)


def decay_groups(model: nn.Module, weight_decay: float | None = None) -> list[dict[str, Any]]:
    """Two parameter groups: weights, and biases / norm / embedding parameters without weight decay.

    `weight_decay=None` leaves the first group at the optimizer config's value.
    """
    no_decay_types = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.Embedding, nn.EmbeddingBag)
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_bias = name.startswith("bias") or name.endswith("bias")  # bias, bias_ih_l0 (RNNs), ...
            (no_decay if isinstance(module, no_decay_types) or is_bias else decay).append(p)
    first: dict[str, Any] = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = weight_decay
    return [first, {"params": no_decay, "weight_decay": 0.0}]


class Task:
    """Base class; subclasses set the class attributes and implement the methods."""

    name: str = ""
    metric_name: str = ""          # headline metric key, e.g. "top1" or "mAP"
    higher_is_better: bool = True
    optimizer_names: tuple[str, ...] = ("main",)  # the keys optimizer_params() returns
    count_unit: str = "samples"    # what count(batch) counts: samples, tokens, audio_s ...
    host_keys: frozenset[str] = frozenset()  # batch keys the engine leaves on the host (e.g. lengths)
    model_schema: type = object    # dataclass validating the `model.*` keys
    data_sources: dict[str, type] = {}  # data name -> dataclass validating the `data.*` keys

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        """Validates both config sections against the task's schemas (UserError on bad keys)."""
        self.model_cfg = section(self.model_schema, model_cfg, "model")
        if data_cfg.name not in self.data_sources:
            raise UserError(f"model {self.name} cannot use data={data_cfg.name}; "
                            f"choose one of: {', '.join(self.data_sources)}")
        self.data_cfg = section(self.data_sources[data_cfg.name], data_cfg, "data")
        self.seed = seed

    # --- building -----------------------------------------------------------------
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def build_train_data(self) -> torch.utils.data.Dataset:
        raise NotImplementedError

    def build_eval_data(self) -> torch.utils.data.Dataset:
        raise NotImplementedError

    def collate(self, items: list[Any]) -> Batch:
        """Turn dataset items into one Batch (default: items are (input, target))."""
        inputs, targets = zip(*items)
        return {"input": torch.stack(inputs), "target": torch.as_tensor(targets)}

    def epoch_batches(self, dataset: torch.utils.data.Dataset, batch_size: int,
                      generator: torch.Generator) -> list[list[int]]:
        """One training epoch as lists of dataset indices, drawn from `generator` only.

        Default: a random permutation cut into full batches (the last partial batch is
        dropped). Override for bucketing by length, variable batch sizes, or a fixed
        order (truncated BPTT over a token stream). The engine seeds `generator` from
        (seed, epoch), so the order is deterministic and a resumed run skips exactly
        the batches it already trained on.
        """
        order = torch.randperm(len(dataset), generator=generator).tolist()
        return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]

    def optimizer_params(self, model: nn.Module) -> Mapping[str, ParamSpec]:
        """Parameters (or parameter groups) per optimizer name. Most tasks have one, "main";
        a GAN has two. Each name gets its own optimizer, LR schedule and loss scaler, with
        settings from trainer.* overridden by trainer.optimizers.<name>.*."""
        return {"main": model.parameters()}

    # --- running ------------------------------------------------------------------
    def count(self, batch: Batch) -> float:
        """How much this batch counts for throughput, in `count_unit` (read on the host)."""
        x = batch["input"]
        return int(x.shape[0]) if isinstance(x, torch.Tensor) else len(x)

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Forward, loss, and backward/step through ctx for each optimizer.

        Returns detached scalar tensors to log (at least "loss"); the engine reads
        them to the host only on logging steps.
        """
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        raise NotImplementedError

    def check_data(self) -> None:
        """Raise runner.errors.UserError if the configured data cannot be found or read."""

    # --- state carried across batches (e.g. recurrent state for truncated BPTT) ----------
    def reset_state(self) -> None:
        """Called by the engine before the first batch of every training epoch."""

    def state_dict(self) -> dict[str, Any]:
        """Task-held training state to checkpoint (tensors, numbers, strings)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned, when a run resumes."""
