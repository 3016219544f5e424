"""The plug-in interface between the shared engine and one paper model.

A Task owns everything model-specific: the network, the data, the loss and the
metric. It never sees dtypes, loss scalers or master weights: the engine hands
it a `step_fn` that does backward + (scaled, checked, clipped) optimizer step,
and an already-cast model. Adding a model means writing one Task subclass in
models/ and one entry in models.TASKS; the loop does not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from runner.config import section
from runner.errors import UserError

# step_fn(loss, optimizer_name) -> None: backward of the (scaled) loss and the
# optimizer step for the parameters the task listed under that name.
StepFn = Callable[[torch.Tensor, str], None]

# A batch is a dict. The engine moves every tensor in it to the device; the
# precision policy additionally casts batch["input"] (a tensor or a list of
# tensors) to the compute dtype. Targets stay as the data produced them.
Batch = dict[str, Any]


@dataclass(frozen=True)
class EvalResult:
    """All evaluation values; `metrics[metric_name]` is the headline number."""

    metrics: dict[str, float]


class Task:
    """Base class; subclasses set the class attributes and implement the methods."""

    name: str = ""
    metric_name: str = ""          # headline metric key, e.g. "top1" or "mAP"
    higher_is_better: bool = True
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

    def optimizer_params(self, model: nn.Module) -> Mapping[str, Iterable[nn.Parameter]]:
        """Parameters per optimizer. Most tasks have one; DCGAN has two."""
        return {"main": model.parameters()}

    # --- running ------------------------------------------------------------------
    def train_step(self, model: nn.Module, batch: Batch, step_fn: StepFn) -> dict[str, torch.Tensor]:
        """Forward, loss, and one call of step_fn per optimizer.

        Returns detached scalar tensors to log (at least "loss"); the engine reads
        them to the host only on logging steps.
        """
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch]) -> EvalResult:
        raise NotImplementedError

    def check_data(self) -> None:
        """Raise runner.errors.UserError if the configured data cannot be found."""
