"""ResNet-50 (torchvision's, never pretrained) on ImageFolder or the synthetic image set.

`width` and `depth` shrink the same torchvision Bottleneck network for tests and
CPU runs: width=1.0, depth=[3,4,6,3] is exactly torchvision.models.resnet50.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet

from data.imagefolder import ImageFolderConfig, build_imagefolder, check_imagefolder
from data.synthetic_images import SyntheticImages, SyntheticImagesConfig
from runner.errors import UserError
from runner.task import Batch, EvalResult, StepContext, Task


@dataclass
class ResNet50Config:
    name: str = "resnet50"
    width: float = 1.0                  # multiplies the stage widths 64/128/256/512 (stem stays 64)
    depth: list[int] = field(default_factory=lambda: [3, 4, 6, 3])  # Bottleneck blocks per stage
    zero_init_residual: bool = False

    def __post_init__(self) -> None:
        if len(self.depth) != 4 or min(self.depth) < 1 or self.width <= 0:
            raise UserError(f"bad config: model.depth={list(self.depth)} needs 4 stages of 1+ blocks and "
                            f"model.width={self.width} must be positive (ResNet-50: depth=[3,4,6,3], width=1.0)")


class ScaledResNet(ResNet):
    """torchvision's ResNet with every stage's width multiplied by `width`."""

    def __init__(self, width: float, depth: list[int], num_classes: int, zero_init_residual: bool) -> None:
        self.width = width
        super().__init__(Bottleneck, depth, num_classes=num_classes, zero_init_residual=zero_init_residual)
        if width != 1.0:  # the classifier's input width follows the last stage
            self.fc = nn.Linear(self.inplanes, num_classes)

    def _make_layer(self, block: Any, planes: int, blocks: int, stride: int = 1, dilate: bool = False) -> nn.Sequential:
        return super()._make_layer(block, max(1, round(planes * self.width)), blocks, stride, dilate)


class ResNet50Task(Task):
    name = "resnet50"
    metric_name = "top1"
    model_schema = ResNet50Config
    data_sources = {"synthetic_images": SyntheticImagesConfig, "imagefolder": ImageFolderConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        self._num_classes: int | None = None

    def check_data(self) -> None:
        if isinstance(self.data_cfg, ImageFolderConfig):
            check_imagefolder(self.data_cfg)

    def _dataset(self, split: str) -> Any:
        if isinstance(self.data_cfg, ImageFolderConfig):
            ds = build_imagefolder(self.data_cfg, split)
        else:
            ds = SyntheticImages(self.data_cfg, split, self.seed)
        self._num_classes = ds.num_classes
        return ds

    def build_train_data(self) -> Any:
        return self._dataset("train")

    def build_eval_data(self) -> Any:
        return self._dataset("eval")

    def build_model(self) -> nn.Module:
        if self._num_classes is None:
            self._dataset("eval")
        c = self.model_cfg
        return ScaledResNet(c.width, list(c.depth), self._num_classes, c.zero_init_residual)

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        logits = model(batch["input"])
        loss = F.cross_entropy(logits, batch["target"])
        ctx.optimize(loss)
        return {"loss": loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        correct1 = correct5 = total = 0
        loss_sum = torch.zeros(())
        for batch in batches:
            logits = model(batch["input"]).float()
            target = batch["target"]
            loss_sum = loss_sum + F.cross_entropy(logits, target, reduction="sum").cpu()
            top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
            hits = top5 == target[:, None]
            correct1 += int(hits[:, 0].sum())
            correct5 += int(hits.any(dim=1).sum())
            total += target.numel()
        total = max(total, 1)
        return EvalResult({"top1": 100.0 * correct1 / total, "top5": 100.0 * correct5 / total,
                           "loss": float(loss_sum) / total})
