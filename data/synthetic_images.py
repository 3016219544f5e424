"""A built-in, learnable image-classification set (no download, deterministic by seed).

The class is visible in the image: class c is a sine grating at orientation
pi * c / num_classes, with random phase, frequency jitter, colour, contrast and
pixel noise as nuisances. A network must learn orientation-selective filters to
separate neighbouring classes, so accuracy rises over training instead of
jumping to 100% at once, and FP32-vs-reduced-precision comparisons mean something.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from data.common import DrawnImages, LoaderConfig, check_image_size, check_item_counts, require, require_range

MAX_CLASSES = 1000  # a typo guard: ImageNet's 1000 classes are the most the paper trains on


@dataclass
class SyntheticImagesConfig(LoaderConfig):
    name: str = "synthetic_images"
    num_classes: int = 10
    image_size: int = 64
    num_train: int = 4096
    num_eval: int = 1024
    noise: float = 0.5          # std of per-pixel Gaussian noise relative to the grating amplitude

    def __post_init__(self) -> None:
        super().__post_init__()
        require_range("num_classes", self.num_classes, 2, MAX_CLASSES,
                      "grating orientations to tell apart; one class would make top-1 accuracy 100% by construction")
        check_image_size(self.image_size, "the side of the generated square images")
        check_item_counts(self.num_train, self.num_eval)
        require(0 <= self.noise < math.inf, "noise", self.noise, "a finite number, 0 or more",
                "std of the pixel noise; 0 gives clean gratings")


class SyntheticImages(DrawnImages):
    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = self.generator(index)
        cfg = self.cfg
        label = int(torch.randint(cfg.num_classes, (), generator=g))
        r = torch.rand(6, generator=g)
        theta = math.pi * label / cfg.num_classes
        freq = 3.0 + 2.0 * float(r[0])                 # cycles across the image
        phase = 2 * math.pi * float(r[1])
        contrast = 0.5 + float(r[2])
        wave = torch.sin(math.pi * freq * (self.xx * math.cos(theta) + self.yy * math.sin(theta)) + phase)
        colour = (r[3:6] * 2 - 1).view(3, 1, 1)         # random per-channel sign and strength
        image = contrast * colour * wave + cfg.noise * torch.randn(3, cfg.image_size, cfg.image_size, generator=g)
        return image, label
