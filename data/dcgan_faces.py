"""A built-in, learnable image distribution for GAN runs: procedurally drawn cartoon faces.

Every image is a soft-edged face (an ellipse with two eyes and a smiling or frowning
mouth) on a vertical colour gradient. Seven continuous factors of variation, drawn
uniformly per image: face centre x and y, face size, skin tone, background hue, eye
spacing and mouth curvature. Small pixel noise keeps the density smooth. A generator
has to learn the joint layout (eyes inside the face, mouth below them) and the colour
ranges, so the sliced Wasserstein distance falls over training instead of being zero
or unreachable. Deterministic by (seed, split, index); no download.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from data.common import DrawnImages, LoaderConfig, check_image_size, check_item_counts, require

EDGE = 0.04  # softness of every drawn edge, in units of the half image side
# Drawn items are kept in memory when the whole split fits in this many bytes (32 px: 12 KiB an
# item, so 8192 items). Drawing one is ~40 small tensor ops (~1 ms on a CPU core), which at
# 32 px costs more than a small DCGAN's step needs per image, and a GAN revisits every item
# many times. The cache changes nothing about the values (an item is a function of its index).
CACHE_BYTES = 128 * 2 ** 20


@dataclass
class SyntheticFacesConfig(LoaderConfig):
    name: str = "synthetic_faces"
    image_size: int = 128           # must equal model.image_size
    num_train: int = 8192
    num_eval: int = 512
    noise: float = 0.02         # std of per-pixel Gaussian noise, in the [-1, 1] image range
    batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        check_image_size(self.image_size, "the side of the generated square images; the DCGAN takes 32, 64 or 128")
        check_item_counts(self.num_train, self.num_eval)
        require(0 <= self.noise < math.inf, "noise", self.noise, "a finite number, 0 or more",
                "std of the pixel noise; 0 gives clean drawings")


def _inside(distance: torch.Tensor) -> torch.Tensor:
    """Soft indicator of `distance < 0` (a signed distance to a shape's edge)."""
    return torch.sigmoid(-distance / EDGE)


def _hue_to_rgb(hue: float) -> torch.Tensor:
    """A saturated colour of the given hue in [0, 1), as an RGB vector in [0, 1]."""
    phases = torch.tensor([0.0, 2.0, 4.0]) * math.pi / 3
    return 0.5 + 0.5 * torch.cos(2 * math.pi * hue - phases)


class SyntheticFaces(DrawnImages):
    """Items are (image [3, S, S] in [-1, 1], 0): the DCGAN's tanh range, a dummy label."""

    def __init__(self, cfg: SyntheticFacesConfig, split: str, seed: int) -> None:
        super().__init__(cfg, split, seed)
        fits = self.length * 3 * cfg.image_size ** 2 * 4 <= CACHE_BYTES
        self.cache: dict[int, torch.Tensor] | None = {} if fits else None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.cache is None:
            return self.draw(index), 0
        if index not in self.cache:
            self.cache[index] = self.draw(index)
        return self.cache[index], 0

    def draw(self, index: int) -> torch.Tensor:
        g = self.generator(index)
        cx, cy, size, skin, hue, eyes, smile = torch.rand(7, generator=g).tolist()
        cx, cy = 0.3 * (cx - 0.5), 0.3 * (cy - 0.5)
        rx, ry = 0.45 + 0.25 * size, 0.55 + 0.3 * size
        x, y = (self.xx - cx) / rx, (self.yy - cy) / ry     # face coordinates: the face is the unit disc
        face = _inside(torch.sqrt(x ** 2 + y ** 2) - 1.0)
        spacing = 0.25 + 0.2 * eyes
        eye = _inside(torch.sqrt((x.abs() - spacing) ** 2 + (y + 0.25) ** 2) * rx - 0.08)
        curve = (smile - 0.5) * 0.8                          # > 0 smiles, < 0 frowns
        mouth_line = y - (0.4 + curve * (1 - (x / 0.45) ** 2))
        mouth = _inside(mouth_line.abs() * ry - 0.03) * _inside(x.abs() - 0.45)

        top, bottom = _hue_to_rgb(hue), _hue_to_rgb((hue + 0.15) % 1.0) * 0.6
        t = (self.yy + 1) / 2
        background = top.view(3, 1, 1) * (1 - t) + bottom.view(3, 1, 1) * t
        skin_rgb = torch.tensor([1.0, 0.8, 0.65]) * (0.45 + 0.55 * skin)
        image = background * (1 - face) + skin_rgb.view(3, 1, 1) * face
        image = image * (1 - 0.9 * (eye + mouth).clamp(max=1) * face)  # dark features, only on the face
        image = image * 2 - 1 + self.cfg.noise * torch.randn(image.shape, generator=g)
        return image.clamp(-1, 1)
