"""What every data source shares: batching settings, range checks, image reading, constants."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from runner.errors import UserError

# ImageNet's per-channel mean and std (RGB, images in [0, 1]): the normalisation torchvision's
# ImageNet models and their pretrained weights expect. One copy for every model and data source.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Limits that catch typos (an extra zero) before they turn into an out-of-memory crash or a
# run that never ends; real settings are far inside them.
MIN_IMAGE_SIZE = 8          # a few pixels per side still survive the networks' downsampling
MAX_IMAGE_SIZE = 4096
MAX_SYNTHETIC_ITEMS = 10_000_000

# What PIL raises on a file that is missing, damaged, truncated or not an image at all.
# DecompressionBombError (an absurdly large image) is not an OSError, so it is listed too.
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError)

# How many files per split the pre-flight scan decodes: enough to catch a wrong format or a
# wrong folder, cheap on a million-image set. Later bad files are reported when first read.
SCAN_DECODE = 2


def require(ok: bool, key: str, value: object, requirement: str, hint: str) -> None:
    """Raise the one-line config error `bad config: data.<key>=<value> must be <requirement> (<hint>)`."""
    if not ok:
        raise UserError(f"bad config: data.{key}={value} must be {requirement} ({hint})")


def require_range(key: str, value: float, low: float, high: float, hint: str) -> None:
    """`low <= value <= high` (NaN fails too, as every comparison with it is false)."""
    require(low <= value <= high, key, value, f"between {low} and {high}", hint)


def check_image_size(image_size: int, hint: str) -> None:
    require_range("image_size", image_size, MIN_IMAGE_SIZE, MAX_IMAGE_SIZE, hint)


def check_item_counts(num_train: int, num_eval: int) -> None:
    """Sizes of a built-in set: at least one item each (an empty evaluation set measures nothing)."""
    for key, value in (("num_train", num_train), ("num_eval", num_eval)):
        require_range(key, value, 1, MAX_SYNTHETIC_ITEMS, "the number of generated images in that split")


@dataclass
class LoaderConfig:
    name: str = ""
    batch_size: int = 32
    eval_batch_size: int | None = None  # None: same as batch_size
    num_workers: int = 0

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", self.batch_size, "1 or more", "items per training batch")
        require(self.eval_batch_size is None or self.eval_batch_size >= 1, "eval_batch_size", self.eval_batch_size,
                "1 or more, or null", "items per evaluation batch; null uses data.batch_size")
        require(self.num_workers >= 0, "num_workers", self.num_workers, "0 or more",
                "data loading processes; 0 loads in the main process")


def item_generator(seed: int, split: str, index: int) -> torch.Generator:
    """A generator that makes item `index` of `split` the same on every run and worker."""
    split_id = {"train": 0, "eval": 1}[split]
    return torch.Generator().manual_seed((seed * 1_000_003 + split_id) * 10_000_019 + index)


class DrawnImages(Dataset):
    """Base of the built-in image sets drawn item by item: `num_train` / `num_eval` items, a
    [-1, 1] coordinate grid (`xx`, `yy`) of `image_size` pixels, and a per-item generator."""

    def __init__(self, cfg: Any, split: str, seed: int) -> None:
        self.cfg, self.split, self.seed = cfg, split, seed
        self.length = cfg.num_train if split == "train" else cfg.num_eval
        coords = torch.linspace(-1.0, 1.0, cfg.image_size)
        self.yy, self.xx = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.length

    def generator(self, index: int) -> torch.Generator:
        """Item `index`'s random source (IndexError past the end, as a Dataset must)."""
        if not 0 <= index < self.length:
            raise IndexError(index)
        return item_generator(self.seed, self.split, index)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_rgb(path: str | Path) -> Image.Image:
    """Decode an image file to RGB; a damaged or unreadable file is a UserError naming it.

    A module-level function, so DataLoader worker processes can pickle it.
    """
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() decodes all pixels: truncation shows up here
    except IMAGE_ERRORS as exc:
        raise UserError(f"cannot read image {path}: {first_line(exc)}; the file is damaged or not an image, "
                        f"replace or delete it") from None
