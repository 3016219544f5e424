"""A built-in, learnable detection set (no download, deterministic by seed).

Each image is a textured background (a tinted, noisy sine grating) with 1 to
`max_objects` filled shapes of random size, aspect ratio and position. The class
is the shape (disc, square, triangle, diamond, ring); each class also has its own
colour family, jittered so that shape and colour together identify it. Objects may
overlap (at most `max_overlap` of the smaller one's box is covered) and later ones
are drawn on top. Boxes are the exact extent of each shape's pixels, in the same
continuous pixel coordinates as data/voc.py. Item i of a split is generated from a
generator seeded with (seed, split, i), so it is the same on every run and worker.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.common import LoaderConfig, check_item_counts, item_generator, require, require_range

# (name, base RGB colour) per class; the name is also the shape drawn.
CLASSES = (
    ("disc", (0.9, 0.2, 0.15)),
    ("square", (0.15, 0.75, 0.2)),
    ("triangle", (0.2, 0.35, 0.95)),
    ("diamond", (0.95, 0.85, 0.15)),
    ("ring", (0.85, 0.25, 0.85)),
)
PLACEMENT_TRIES = 20
MAX_OBJECTS = 100  # a typo guard (the default is 4): a crowded image fails to place most objects anyway


@dataclass
class SyntheticDetectionConfig(LoaderConfig):
    name: str = "synthetic_detection"
    num_classes: int = 3             # 1 .. 5: the first classes of disc, square, triangle, diamond, ring
    num_train: int = 4096
    num_eval: int = 256
    max_objects: int = 4             # objects per image: uniform in 1 .. max_objects
    min_size: float = 0.15           # object box side, as a fraction of the image side
    max_size: float = 0.5
    max_overlap: float = 0.35        # max intersection / smaller box area between two objects
    colour_jitter: float = 0.2       # per-channel uniform jitter of the class colour
    batch_size: int = 16
    num_workers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_range("num_classes", self.num_classes, 1, len(CLASSES), ", ".join(name for name, _ in CLASSES))
        check_item_counts(self.num_train, self.num_eval)
        require_range("max_objects", self.max_objects, 1, MAX_OBJECTS, "each image holds 1 to max_objects shapes")
        # >= 0.05: every shape covers some pixels.
        require_range("min_size", self.min_size, 0.05, 1, "smallest box side as a fraction of the image side")
        require_range("max_size", self.max_size, 0.05, 1, "largest box side as a fraction of the image side")
        require(self.min_size <= self.max_size, "min_size", self.min_size, f"at most data.max_size={self.max_size}",
                "sizes are drawn between the two")
        require_range("max_overlap", self.max_overlap, 0, 1, "fraction of the smaller box two objects may share")
        require_range("colour_jitter", self.colour_jitter, 0, 1, "per-channel change of a class colour")


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=g))


def _shape_mask(shape: str, x: Tensor, y: Tensor) -> Tensor:
    """Pixels inside `shape`, given pixel centres in the object's frame scaled to [-1, 1]^2."""
    if shape == "disc":
        return x**2 + y**2 <= 1
    if shape == "square":
        return (x.abs() <= 1) & (y.abs() <= 1)
    if shape == "triangle":  # apex at the top, base at the bottom
        return (y.abs() <= 1) & (x.abs() <= (y + 1) / 2)
    if shape == "diamond":
        return x.abs() + y.abs() <= 1
    r2 = x**2 + y**2  # ring
    return (r2 <= 1) & (r2 >= 0.3)


def _background(g: torch.Generator, size: int, grid: Tensor) -> Tensor:
    """A dull tinted sine grating with pixel noise: texture the detector must learn to ignore."""
    theta, freq, phase = _uniform(g, 0, math.pi), _uniform(g, 2, 8), _uniform(g, 0, 2 * math.pi)
    xx, yy = grid[0] / size, grid[1] / size
    wave = torch.sin(2 * math.pi * freq * (xx * math.cos(theta) + yy * math.sin(theta)) + phase)
    base = 0.3 + 0.3 * torch.rand(3, 1, 1, generator=g)
    amplitude = 0.15 * torch.rand(3, 1, 1, generator=g)
    return base + amplitude * wave + 0.05 * torch.randn(3, size, size, generator=g)


Box = tuple[float, float, float, float]


def _overlaps_too_much(box: Box, others: list[Box], limit: float) -> bool:
    """Whether `box` and any of `others` share more than `limit` of the smaller box's area."""
    def area(b: Box) -> float:
        return (b[2] - b[0]) * (b[3] - b[1])

    for other in others:
        w = min(box[2], other[2]) - max(box[0], other[0])
        h = min(box[3], other[3]) - max(box[1], other[1])
        if w > 0 and h > 0 and w * h > limit * min(area(box), area(other)):
            return True
    return False


class SyntheticDetection(Dataset):
    """Items: (image (3, S, S) float in [0, 1], {"boxes", "labels" in 1..C, "difficult" (all False)})."""

    def __init__(self, cfg: SyntheticDetectionConfig, split: str, image_size: int, seed: int) -> None:
        self.cfg, self.split, self.size, self.seed = cfg, split, image_size, seed
        self.length = cfg.num_train if split == "train" else cfg.num_eval
        centres = torch.arange(image_size, dtype=torch.float32) + 0.5
        self.grid = torch.stack(torch.meshgrid(centres, centres, indexing="xy"))  # (2, S, S): x, y

    @staticmethod
    def class_names(cfg: SyntheticDetectionConfig) -> tuple[str, ...]:
        return tuple(name for name, _ in CLASSES[:cfg.num_classes])

    def __len__(self) -> int:
        return self.length

    def _sample_box(self, g: torch.Generator) -> Box:
        """A random nominal box (x1, y1, x2, y2) that lies inside the image."""
        cfg, s = self.cfg, self.size
        w = s * _uniform(g, cfg.min_size, cfg.max_size)
        h = min(s * cfg.max_size, max(s * cfg.min_size, w * _uniform(g, 0.7, 1.4)))
        cx, cy = _uniform(g, w / 2, s - w / 2), _uniform(g, h / 2, s - h / 2)
        return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2

    def _draw(self, image: Tensor, shape: str, box: Box, colour: Tensor) -> Tensor:
        """Paint `shape` inscribed in `box` onto image (in place); returns the exact box of its pixels."""
        x0, y0 = int(box[0]), int(box[1])
        x1, y1 = min(self.size, int(box[2]) + 1), min(self.size, int(box[3]) + 1)
        cx, cy, hw, hh = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, (box[2] - box[0]) / 2, (box[3] - box[1]) / 2
        grid = self.grid[:, y0:y1, x0:x1]  # only the pixels the box touches
        mask = _shape_mask(shape, (grid[0] - cx) / hw, (grid[1] - cy) / hh)
        window = image[:, y0:y1, x0:x1]
        window.copy_(torch.where(mask, colour.view(3, 1, 1), window))
        cols, rows = mask.any(dim=0).nonzero().flatten(), mask.any(dim=1).nonzero().flatten()
        return torch.tensor([x0 + int(cols[0]), y0 + int(rows[0]), x0 + int(cols[-1]) + 1, y0 + int(rows[-1]) + 1],
                            dtype=torch.float32)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        g = item_generator(self.seed, self.split, index)
        cfg = self.cfg
        image = _background(g, self.size, self.grid)
        placed: list[Box] = []
        boxes: list[Tensor] = []
        labels: list[int] = []
        for _ in range(int(torch.randint(1, cfg.max_objects + 1, (), generator=g))):
            label = int(torch.randint(1, cfg.num_classes + 1, (), generator=g))
            for _ in range(PLACEMENT_TRIES):
                box = self._sample_box(g)
                if not _overlaps_too_much(box, placed, cfg.max_overlap):
                    break
            else:
                continue  # no free spot for this object: the image gets one object fewer
            name, base_colour = CLASSES[label - 1]
            colour = torch.tensor(base_colour) + cfg.colour_jitter * (2 * torch.rand(3, generator=g) - 1)
            boxes.append(self._draw(image, name, box, colour))
            placed.append(box)
            labels.append(label)
        target = {"boxes": torch.stack(boxes), "labels": torch.tensor(labels, dtype=torch.int64),
                  "difficult": torch.zeros(len(labels), dtype=torch.bool)}
        return image.clamp(0, 1), target
