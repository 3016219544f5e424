"""CelebA as users have it, for the DCGAN: `<root>/img_align_celeba/*.jpg` and
`<root>/list_eval_partition.txt` (lines `<file> <0|1|2>`: train, validation, test).

Training reads partition 0, evaluation (the real images the SWD compares against)
partition 2. Without the partition file, or for any plain folder of images
(`<root>/*.jpg|png`, e.g. a custom face set), the sorted file list is split: the last
`eval_fraction` is held out. Images are centre-cropped to `crop` pixels (108 on the
178x218 aligned faces, as carpedm20/DCGAN-tensorflow does for CelebA) and resized to
`image_size`, in [-1, 1]. torchvision's CelebA class is not used: it insists on MD5
checks of annotation files a user of the images alone does not have.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from data.common import SCAN_DECODE, LoaderConfig, check_image_size, read_rgb, require, require_range
from runner.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
PARTITION_FILE = "list_eval_partition.txt"
IMAGE_DIR = "img_align_celeba"
PARTITIONS = {"train": 0, "eval": 2}
LAYOUT = (f"expected <root>/{IMAGE_DIR}/*.jpg with <root>/{PARTITION_FILE}, or a folder of .jpg/.png images; "
          f"or use the built-in set with data=synthetic_faces")


@dataclass
class CelebAConfig(LoaderConfig):
    name: str = "celeba"
    root: str = "data/celeba"
    image_size: int = 128
    crop: int | None = 108          # centre crop side before resizing; null: the largest centred square
    eval_fraction: float = 0.1      # plain folders only: the held-out share of the sorted file list
    batch_size: int = 64
    num_workers: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_image_size(self.image_size, "the side of the square images; the DCGAN takes 32, 64 or 128")
        require(self.crop is None or self.crop >= 1, "crop", self.crop, "1 or more, or null",
                "the centre crop side in pixels before resizing; 108 for aligned CelebA")
        require_range("eval_fraction", self.eval_fraction, 0.001, 0.5, "share of a plain folder held out for eval")


def _image_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def _read_partitions(path: Path) -> dict[str, int]:
    """file name -> partition number; UserError naming the line of a malformed file."""
    partitions = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[1] not in ("0", "1", "2"):
            raise UserError(f"{path} line {number} is {line!r}, expected '<file name> <0|1|2>'; "
                            f"restore the file from the CelebA release or delete it to split the folder by order")
        partitions[fields[0]] = int(fields[1])
    return partitions


def list_split(cfg: CelebAConfig, split: str) -> list[Path]:
    """The image files of one split ("train" or "eval"), checked to exist; UserError if none."""
    root = Path(cfg.root).expanduser()
    folder = root / IMAGE_DIR if (root / IMAGE_DIR).is_dir() else root
    if not folder.is_dir():
        raise UserError(f"no CelebA data: {root} does not exist (data.root={cfg.root}); {LAYOUT}")
    names = _image_names(folder)
    partition_path = root / PARTITION_FILE
    if partition_path.is_file():
        partitions = _read_partitions(partition_path)
        wanted = [n for n, part in sorted(partitions.items()) if part == PARTITIONS[split]]
        missing = sorted(set(wanted) - set(names))
        if missing:
            raise UserError(f"{partition_path} lists {len(missing)} images missing from {folder} "
                            f"(first: {missing[0]}); restore them or delete the partition file")
    else:
        held_out = max(1, round(len(names) * cfg.eval_fraction))
        wanted = names[:-held_out] if split == "train" else names[-held_out:]
    if not wanted:
        raise UserError(f"no {split} images in {folder} (data.root={cfg.root}); {LAYOUT}")
    return [folder / n for n in wanted]


def check_celeba(cfg: CelebAConfig) -> None:
    """Pre-flight: both splits list existing files, and their first few decode."""
    for split in PARTITIONS:
        for path in list_split(cfg, split)[:SCAN_DECODE]:
            read_rgb(path)


class CelebAImages(Dataset):
    """Items are (image [3, S, S] in [-1, 1], 0): the DCGAN's tanh range, a dummy label."""

    def __init__(self, cfg: CelebAConfig, split: str) -> None:
        self.cfg = cfg
        self.paths = list_split(cfg, split)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = TF.to_image(read_rgb(self.paths[index]))
        crop = self.cfg.crop or min(image.shape[-2:])
        image = TF.resize(TF.center_crop(image, [crop, crop]), [self.cfg.image_size] * 2, antialias=True)
        return TF.to_dtype(image, torch.float32, scale=True) * 2 - 1, 0
