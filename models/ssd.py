"""SSD300-VGG16 (Liu et al. 2016) on Pascal VOC or the synthetic detection set.

The detector is torchvision's `SSD` (default boxes, box coder, SSD matcher,
hard-negative-mining loss, post-processing), never pretrained: nothing is
downloaded. Its backbone generalises torchvision's SSD300 VGG-16 feature
extractor with a width divisor, so `variant=tiny` (VGG-16 with 1/8 of the
channels, 128 px input, one extra layer fewer) runs the same code path as
`variant=ssd300` on a CPU.

Precision split (paper 3.3): the module from `build_model()` returns only the
raw head outputs, which the precision policy casts to FP32; the default boxes,
matching, box encoding/decoding, loss and softmax all run here in FP32.
"""
from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import vgg
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.ssd import SSD
from torchvision.ops import box_iou

from data.common import IMAGENET_MEAN, IMAGENET_STD
from data.synthetic_detection import SyntheticDetection, SyntheticDetectionConfig
from data.voc import VOC_CLASSES, VOCConfig, VOCDetection, check_voc
from models.voc_map import AP_VERSIONS, VOCMeanAP
from runner.errors import UserError
from runner.task import Batch, EvalResult, StepContext, Task



@dataclass(frozen=True)
class Variant:
    """Architecture of one SSD size. Channel counts are VGG-16's, divided by `width_divisor`."""

    image_size: int
    width_divisor: int
    # Extra feature layers after fc7: (1x1 channels, 3x3 channels, 3x3 stride, 3x3 padding).
    extras: tuple[tuple[int, int, int, int], ...]
    aspect_ratios: tuple[tuple[int, ...], ...]  # per feature map, besides 1 (DefaultBoxGenerator)
    scales: tuple[float, ...]                  # one per feature map, plus one for the last s'_k
    steps: tuple[int, ...] | None               # default-box spacing in pixels; None: 1 / grid size


VARIANTS: dict[str, Variant] = {
    # torchvision's ssd300_vgg16 = the SSD paper's SSD300 (feature maps 38, 19, 10, 5, 3, 1).
    "ssd300": Variant(
        image_size=300, width_divisor=1,
        extras=((256, 512, 2, 1), (128, 256, 2, 1), (128, 256, 1, 0), (128, 256, 1, 0)),
        aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2,), (2,)),
        scales=(0.07, 0.15, 0.33, 0.51, 0.69, 0.87, 1.05),
        steps=(8, 16, 32, 64, 100, 300)),
    # CPU-sized: feature maps 16, 8, 4, 2, 1. Unpadded 3x3 extras need >= 3x3 inputs, which a
    # 128 px image no longer has after conv9_2, so all extras here halve the map with stride 2.
    "tiny": Variant(
        image_size=128, width_divisor=8,
        extras=((256, 512, 2, 1), (128, 256, 2, 1), (128, 256, 2, 1)),
        aspect_ratios=((2,), (2, 3), (2, 3), (2,), (2,)),
        scales=(0.1, 0.2, 0.37, 0.54, 0.71, 0.88),
        steps=None),
}


@dataclass
class SSDConfig:
    name: str = "ssd"
    variant: str = "tiny"                   # tiny | ssd300
    backbone_weights: str | None = None     # local torchvision VGG-16 state dict (ImageNet); ssd300 only
    # Input normalisation; must match the backbone weights' training (torchvision VGG-16: ImageNet stats).
    image_mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    ap_version: str = "11point"             # 11point (VOC2007, the paper's number) | all_point (VOC2010+)
    score_thresh: float = 0.01              # post-processing as in the SSD paper's evaluation
    nms_thresh: float = 0.45
    detections_per_img: int = 200


def _vgg16_layers(width_divisor: int) -> nn.Sequential:
    """torchvision's VGG-16 `features` (conv1_1 .. pool5), channels divided by width_divisor."""
    cfg = [v if v == "M" else v // width_divisor for v in vgg.cfgs["D"]]
    layers = vgg.make_layers(cfg)
    for m in layers.modules():  # the initialisation torchvision's VGG applies
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
    return layers


def _load_vgg16_weights(layers: nn.Sequential, path: str) -> None:
    """Load the conv layers of an ImageNet VGG-16 state dict (keys features.N.*; fc layers unused)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        features = {k.removeprefix("features."): v for k, v in state.items() if k.startswith("features.")}
        layers.load_state_dict(features)
    except (OSError, EOFError, pickle.UnpicklingError, RuntimeError, AttributeError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load model.backbone_weights={path}: {first_line}; expected a torchvision "
                        f"VGG-16 state dict (features.N.weight/bias) and model.variant=ssd300") from None


def _xavier(module: nn.Module) -> None:
    """SSD's initialisation of the layers it adds to VGG (as torchvision's SSD300)."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)


class VGGFeatures(nn.Module):
    """SSD's VGG-16 feature pyramid: L2-normalised conv4_3, fc7 (dilated fc6), then the extras.

    Same structure as torchvision's SSDFeatureExtractorVGG, with widths and extras from a Variant.
    """

    def __init__(self, layers: nn.Sequential, variant: Variant) -> None:
        super().__init__()
        pools = [i for i, m in enumerate(layers) if isinstance(m, nn.MaxPool2d)]
        layers[pools[2]].ceil_mode = True  # pool3: 75 -> 38 at 300 px, as in the SSD paper
        d = variant.width_divisor
        conv4_channels, fc_channels = 512 // d, 1024 // d
        self.conv4 = nn.Sequential(*layers[:pools[3]])
        # conv4_3 has a larger feature scale than the later maps: L2-normalise and learn a scale (init 20).
        self.scale_weight = nn.Parameter(torch.full((conv4_channels,), 20.0))
        fc = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1),  # pool5 keeps the resolution
            nn.Conv2d(conv4_channels, fc_channels, kernel_size=3, padding=6, dilation=6),  # fc6, atrous
            nn.ReLU(inplace=True),
            nn.Conv2d(fc_channels, fc_channels, kernel_size=1),  # fc7
            nn.ReLU(inplace=True),
        )
        _xavier(fc)
        blocks = [nn.Sequential(*layers[pools[3]:-1], fc)]  # pool4, conv5_x, fc6, fc7 (pool5 dropped)
        in_channels = fc_channels
        for mid, out, stride, padding in variant.extras:
            block = nn.Sequential(
                nn.Conv2d(in_channels, mid // d, kernel_size=1), nn.ReLU(inplace=True),
                nn.Conv2d(mid // d, out // d, kernel_size=3, stride=stride, padding=padding), nn.ReLU(inplace=True))
            _xavier(block)
            blocks.append(block)
            in_channels = out // d
        self.blocks = nn.ModuleList(blocks)
        self.out_channels = [conv4_channels, fc_channels] + [out // d for _, out, _, _ in variant.extras]

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        x = self.conv4(x)
        # The L2 norm is a large reduction, so it runs in FP32 (paper 3.3); in FP16 F.normalize's
        # eps (1e-12) rounds to 0 and an all-zero feature vector (all ReLUs off) would give 0/0 = NaN.
        maps = [self.scale_weight.view(1, -1, 1, 1) * F.normalize(x.float()).to(x.dtype)]
        for block in self.blocks:
            x = block(x)
            maps.append(x)
        return OrderedDict((str(i), m) for i, m in enumerate(maps))


def build_ssd(cfg: SSDConfig, num_classes: int) -> SSD:
    """torchvision SSD for `num_classes` object classes (+ background), randomly initialised."""
    variant = VARIANTS[cfg.variant]
    layers = _vgg16_layers(variant.width_divisor)
    if cfg.backbone_weights:
        _load_vgg16_weights(layers, cfg.backbone_weights)
    anchors = DefaultBoxGenerator([list(r) for r in variant.aspect_ratios], scales=list(variant.scales),
                                  steps=None if variant.steps is None else list(variant.steps))
    size = (variant.image_size, variant.image_size)
    # SSD's own input transform (resize + normalise) is never called: SSDTask.collate normalises.
    return SSD(VGGFeatures(layers, variant), anchors, size, num_classes + 1, score_thresh=cfg.score_thresh,
               nms_thresh=cfg.nms_thresh, detections_per_img=cfg.detections_per_img)


class SSDNet(nn.Module):
    """The trainable part of an SSD: images -> {"bbox_regression": (N, A, 4), "cls_logits": (N, A, C+1)}."""

    def __init__(self, ssd: SSD) -> None:
        super().__init__()
        self.ssd = ssd

    def forward(self, images: Tensor) -> dict[str, Tensor]:
        return self.ssd.head(list(self.ssd.backbone(images).values()))


def default_boxes(ssd: SSD, image_size: int) -> Tensor:
    """The FP32 default boxes (A, 4) in input pixels: one dry run of the backbone gives the grid sizes."""
    images = torch.zeros(1, 3, image_size, image_size)
    with torch.no_grad():
        features = list(ssd.backbone(images).values())
    return ssd.anchor_generator(ImageList(images, [(image_size, image_size)]), features)[0]


class SSDTask(Task):
    name = "ssd"
    metric_name = "mAP"
    model_schema = SSDConfig
    data_sources = {"voc": VOCConfig, "synthetic_detection": SyntheticDetectionConfig}

    def __init__(self, model_cfg: Any, data_cfg: Any, seed: int) -> None:
        super().__init__(model_cfg, data_cfg, seed)
        cfg: SSDConfig = self.model_cfg
        if cfg.variant not in VARIANTS:
            raise UserError(f"bad config: model.variant={cfg.variant!r}; choose one of: {', '.join(VARIANTS)}")
        if cfg.ap_version not in AP_VERSIONS:
            raise UserError(f"bad config: model.ap_version={cfg.ap_version!r}; choose one of: {', '.join(AP_VERSIONS)}")
        if len(cfg.image_mean) != 3 or len(cfg.image_std) != 3:
            raise UserError("bad config: model.image_mean and model.image_std need 3 values (R, G, B)")
        self.image_size = VARIANTS[cfg.variant].image_size
        self._mean = torch.tensor(cfg.image_mean).view(1, 3, 1, 1)
        self._std = torch.tensor(cfg.image_std).view(1, 3, 1, 1)
        # Set by build_model: the torchvision SSD whose parameter-free parts (matcher, box coder,
        # loss, post-processing) this task uses, and its default boxes, cached per device.
        self._ssd: SSD | None = None
        self._anchors: Tensor | None = None

    # --- data ---------------------------------------------------------------------------
    @property
    def class_names(self) -> tuple[str, ...]:
        if isinstance(self.data_cfg, VOCConfig):
            return VOC_CLASSES
        return SyntheticDetection.class_names(self.data_cfg)

    def check_data(self) -> None:
        if isinstance(self.data_cfg, VOCConfig):
            check_voc(self.data_cfg)

    def _dataset(self, split: str) -> torch.utils.data.Dataset:
        if isinstance(self.data_cfg, VOCConfig):
            return VOCDetection(self.data_cfg, split, self.image_size)
        return SyntheticDetection(self.data_cfg, split, self.image_size, self.seed)

    def build_train_data(self) -> torch.utils.data.Dataset:
        return self._dataset("train")

    def build_eval_data(self) -> torch.utils.data.Dataset:
        return self._dataset("eval")

    def collate(self, items: list[tuple[Tensor, dict[str, Tensor]]]) -> Batch:
        """Images in [0, 1] -> one normalised FP32 batch; targets stay a list (box counts vary)."""
        images, targets = zip(*items)
        return {"input": (torch.stack(images) - self._mean) / self._std, "target": list(targets)}

    # --- model --------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        ssd = build_ssd(self.model_cfg, len(self.class_names))
        self._ssd = ssd
        self._anchors = default_boxes(ssd, self.image_size)
        return SSDNet(ssd)

    def _anchors_on(self, device: torch.device) -> Tensor:
        if self._anchors is None or self._ssd is None:
            raise RuntimeError("SSDTask.build_model() must run before training or evaluation")
        if self._anchors.device != device:
            self._anchors = self._anchors.to(device)
        return self._anchors

    def _match(self, anchors: Tensor, gt_boxes: Tensor) -> Tensor:
        """Index of the ground-truth box each default box is assigned to; -1: background (SSD matching)."""
        if gt_boxes.numel() == 0:
            return torch.full((anchors.shape[0],), -1, dtype=torch.int64, device=anchors.device)
        return self._ssd.proposal_matcher(box_iou(gt_boxes, anchors))

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, Tensor]:
        head = model(batch["input"])
        targets = batch["target"]
        anchors = self._anchors_on(head["cls_logits"].device)
        matched = [self._match(anchors, t["boxes"]) for t in targets]
        losses = self._ssd.compute_loss(targets, head, [anchors] * len(targets), matched)
        bbox_loss, cls_loss = losses["bbox_regression"], losses["classification"]
        loss = bbox_loss + cls_loss
        ctx.optimize(loss)
        return {"loss": loss.detach(), "bbox_loss": bbox_loss.detach(), "cls_loss": cls_loss.detach()}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: Iterable[Batch], ctx: StepContext) -> EvalResult:
        names = self.class_names
        evaluator = VOCMeanAP(len(names))
        sizes = [(self.image_size, self.image_size)]
        for batch in batches:
            head = model(batch["input"])  # FP32 in every precision mode (the policy casts outputs up)
            anchors = self._anchors_on(head["cls_logits"].device)
            n = len(batch["target"])
            detections = self._ssd.postprocess_detections(head, [anchors] * n, sizes * n)
            for det, gt in zip(detections, batch["target"]):
                evaluator.add(det["boxes"], det["scores"], det["labels"], gt["boxes"], gt["labels"], gt["difficult"])
        ap = evaluator.compute(self.model_cfg.ap_version)
        metrics = {"mAP": 100.0 * sum(ap.values()) / len(ap) if ap else float("nan")}
        metrics.update({f"AP_{names[c - 1]}": 100.0 * v for c, v in sorted(ap.items())})
        return EvalResult(metrics)
